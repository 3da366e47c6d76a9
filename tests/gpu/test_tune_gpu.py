"""`flashgen tune` on a GPU: a tiny sweep writes a valid table, and calls then use its tiles.

Key bf16, head_dim 128, non-causal; needs the default tile and at least one other built variant of
that key (`flashgen build --all` or `flashgen tune --build`): otherwise skipped with a reason
starting MISSING-TUNE-CANDIDATES. The chosen variant is what ``flashgen.core.attention_forward``
returns (it launches and returns the variant its plan picked); the torch API goes through the
same plan, which ``flashgen.core._plans`` shows. Skipped without an sm_90 GPU (conftest.py).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

import flashgen  # noqa: E402
from flashgen import bench, core, interface, tune, tuning  # noqa: E402
from flashgen.cli import main as cli_main  # noqa: E402
from flashgen.manifest import load_manifest  # noqa: E402

pytestmark = pytest.mark.gpu

KEY = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": False, "local": False, "softcap": False,
       "pack_gqa": False, "varlen": False}


@pytest.fixture
def built():
    vs = [v for v in load_manifest().variants if v.family == "fwd" and v.dispatch == KEY]
    if len(vs) < 2 or not any(v.default for v in vs):
        pytest.skip("MISSING-TUNE-CANDIDATES: bf16 hd128 non-causal needs its default and another built tile "
                    "(`flashgen build --all` or `flashgen tune --build`)")
    return vs


def _forget_plans(monkeypatch):
    """Resolved plans and prepared forward calls are per process: start afresh."""
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_prepared_forwards", {})
    monkeypatch.setattr(interface, "_fwd_calls", {})
    tuning.reset()


@pytest.fixture
def fresh(monkeypatch):
    _forget_plans(monkeypatch)
    yield
    tuning.reset()


def _call(seqlen: int):
    """A bf16 hd128 non-causal forward at seqlen_q = seqlen_k = seqlen through core; the variant used."""
    q, k, v = (torch.randn(1, seqlen, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 4, seqlen, device="cuda", dtype=torch.float32)
    used = core.attention_forward(*(bench.tensor_arg(t) for t in (q, k, v, out, lse)), 128 ** -0.5, False,
                                  torch.cuda.current_stream().cuda_stream)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.cuda.synchronize()
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    return used


def test_tune_writes_a_table_the_calls_follow(built, fresh, tmp_path, monkeypatch):
    out = tmp_path / "table.yaml"
    r = CliRunner().invoke(cli_main, ["tune", "--dtypes", "bf16", "--head-dims", "128", "--causal", "false",
                                      "--seqlens", "512,4096", "--warmup-ms", "5", "--rep-ms", "20", "-o", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    table = tuning.load_table(out)
    assert table.gpu == torch.cuda.get_device_name()
    (entry,) = table.entries.values()
    assert entry.key == KEY and [m["seqlen"] for row in entry.rows for m in row.measured] == [512, 4096]
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", str(out))
    default = next(v for v in built if v.default)
    for seqlen in (512, 4096):
        row = entry.row_for(tuning.seqlen_bucket(seqlen))
        want = row.tile or entry.default_tile
        used = _call(seqlen)
        assert tuning.tile_of(used.params, used.dispatch) == want, (seqlen, used.name, want)
        if row.tile is None:
            assert used.name == default.name


def test_a_table_naming_another_tile_is_followed(built, fresh, tmp_path, monkeypatch):
    default = next(v for v in built if v.default)
    other = next(v for v in built if not v.default)
    data = {"schema": 1, "gpu": torch.cuda.get_device_name(), "date": "2026-11-22",
            "flashgen": {"version": flashgen.__version__, "commit": "test"}, "protocol": {"test": True},
            "entries": [{"family": "fwd", "key": KEY, "default_tile": tuning.tile_of(default.params, KEY),
                         "rows": [{"max_seqlen_k": 1024, "tile": tuning.tile_of(other.params, KEY)},
                                  {"max_seqlen_k": None, "tile": "default"}]}]}
    # found the way a shipped table is: <kernel dir>/tune/<gpu-slug>.yaml is not writable here, so
    # through the variable pointing at a folder
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / f"{tuning.gpu_slug(torch.cuda.get_device_name())}.yaml").write_text(tuning.table_text(data))
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", str(folder))
    assert _call(1000).name == other.name
    assert _call(2000).name == default.name
    # the torch API takes the same plan
    q = torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16)
    flashgen.flash_attn_func(q, q, q)
    torch.cuda.synchronize()
    # (core._plan's key: (variant, dtype, d, dv, causal, local, softcap, device, pack_gqa, bucket, varlen, decode, few))
    assert any(p.variant.name == other.name and k[9:11] == (tuning.seqlen_bucket(700), False)
               for k, p in core._plans.items())
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", "off")
    _forget_plans(monkeypatch)
    assert _call(1000).name == default.name


def test_estimate_printed_and_plan_complete(built):
    r = CliRunner().invoke(cli_main, ["tune", "--dry-run"], catch_exceptions=False)
    assert r.exit_code == 0 and "timings, about" in r.output and torch.cuda.get_device_name() in r.output
    assert tune.key_label(KEY) in r.output
