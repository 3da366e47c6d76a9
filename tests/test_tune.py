"""Tune tables and `flashgen tune` (issue 11), without a GPU.

The table format (load, validation errors naming the file and the row), seqlen_k buckets, the
runtime's choice through ``flashgen.core.attention_forward`` with the driver, loader and launcher
replaced by fakes (the table's tile when built, else the default; FLASHGEN_TUNE_TABLE; a bad table
warns once and never fails a call), the generator's ``candidates:`` section, and the CLI with the
GPU point replaced by a fake whose timer makes a known candidate win.
"""
from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, SMALL_FWD, cli, fake_cuda, make_project  # noqa: E402

from flashgen import core, launch, tune, tuning  # noqa: E402
from flashgen.dispatch import full_key  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.errors import ConfigError, TuneTableWarning  # noqa: E402
from flashgen.generator.project import Project  # noqa: E402

GPU = "NVIDIA Test GPU 80GB HBM3"  # no shipped table has this name
SLUG = "nvidia-test-gpu-80gb-hbm3"
KNOBS = {"q_stages": 1, "pingpong": True, "overlap": True, "persistent": True, "late_pv_wait": True, "exp_turns": False, "rowsum_mma": False, "vt_global": False}
DEFAULT = {"block_m": 128, "block_n": 128, "stages": 2, "consumer_wgs": 2, **KNOBS}
CAND = {"block_m": 128, "block_n": 176, "stages": 2, "consumer_wgs": 2, **KNOBS}
CAND2 = {"block_m": 128, "block_n": 112, "stages": 2, "consumer_wgs": 2, **KNOBS}
KEY = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": False, "local": False, "softcap": False,
       "pack_gqa": False, "varlen": False}


# ------------------------------------------------------------------------------------ helpers
def record(key: dict, tile: dict, default: bool) -> dict:
    """A manifest (schema 2) record of a fwd variant; never launched, so the fatbin is a name only."""
    name = f"fwd_{key['dtype']}_hd{key['head_dim']}_{'c' if key['causal'] else 'nc'}_m{tile['block_m']}n{tile['block_n']}" \
           f"_s{tile['stages']}"
    return {"name": name, "key": "0" * 64, "family": "fwd", "params": {"family": "fwd", **key, **tile},
            "dispatch": dict(key), "default": default, "fatbin": f"fatbin/{name}.fatbin", "sha256": "0" * 64,
            "kernels": [{"role": "main", "symbol": f"flashgen_{name}_main", "threads": 384, "cluster": [1, 1, 1],
                         "smem_bytes": 1024, "registers": 168, "spill_bytes": 0, "stack_bytes": 0,
                         "tensor_maps": ["q", "k", "v", "o"], "sass": [],
                         "params": {"struct": "FwdParams", "size": 0, "fields": []}}]}


def write_manifest(folder: Path, tiles=((KEY, DEFAULT, True), (KEY, CAND, False), (KEY, CAND2, False))) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "manifest.json"
    path.write_text(json.dumps({"schema": 2, "arch": "sm_90a", "nvcc": {"path": "nvcc", "version": "13.0"},
                                "variants": [record(k, t, d) for k, t, d in tiles]}))
    return path


def table_data(rows=None, gpu=GPU, key=KEY) -> dict:
    rows = rows if rows is not None else [
        {"max_seqlen_k": 1024, "tile": CAND, "measured": [{"seqlen": 512, "tflops": 550.0, "default_tflops": 500.0}]},
        {"max_seqlen_k": 4096, "tile": "default", "measured": [{"seqlen": 4096, "tflops": 600.0, "default_tflops": 600.0}]},
        {"max_seqlen_k": None, "tile": CAND2, "measured": [{"seqlen": 16384, "tflops": 640.0, "default_tflops": 610.0}]},
    ]
    return copy.deepcopy({
        "schema": 1, "gpu": gpu, "date": "2026-11-22", "flashgen": {"version": "0.1.0", "commit": "abc1234"},
        "protocol": tune.protocol([512, 4096, 16384], 25, 100, 0.02),
        "entries": [{"family": "fwd", "key": dict(key), "default_tile": dict(DEFAULT), "rows": rows}]})


def write_table(path: Path, data=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tuning.table_text(data or table_data()))
    return path


def arg(shape, dtype="bf16", ptr=1 << 20):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return core.TensorArg(ptr, tuple(shape), tuple(strides), dtype, 0)


def forward(seqlen_k: int, head_dim: int = 128, variant=None, seqlen_q: int = 256):
    """core.attention_forward through the fakes; returns the variant it launched."""
    q = arg((1, seqlen_q, 2, head_dim))
    k = v = arg((1, seqlen_k, 2, head_dim))
    return core.attention_forward(q, k, v, arg((1, seqlen_q, 2, head_dim)), arg((1, 2, seqlen_q), "fp32"),
                                  head_dim ** -0.5, False, 0, variant)


def fake_launch(monkeypatch):
    """The driver, loader and launcher replaced (device name GPU); empty plan cache, tables forgotten."""
    monkeypatch.setattr(launch, "device_name", lambda device: GPU)
    monkeypatch.setattr(launch, "get_kernel", lambda variant, role, device: ("kernel", variant.name))
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(launch, "tensor_map", lambda *a, **k: object())
    monkeypatch.setattr(launch, "tensor_map_at", lambda geometry, ptr: object())
    monkeypatch.setattr(launch, "launch", lambda *a: None)
    monkeypatch.setattr(launch, "prepare_launch", lambda kernel, grid, params, per_call, counter=None: None)
    monkeypatch.setattr(launch, "launch_prepared", lambda *a: None)
    reset_plans(monkeypatch)


def reset_plans(monkeypatch):
    """Forget the forward's resolved plans and prepared launches (core._plans, core._prepared_forwards, core._built)."""
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_prepared_forwards", {})
    monkeypatch.setattr(core, "_built", set())
    tuning.reset()


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake device (name GPU) and a kernel folder with a manifest: DEFAULT, CAND and CAND2 built for KEY."""
    kdir = tmp_path / "kernels"
    write_manifest(kdir)
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(kdir))
    for var in ("FLASHGEN_TUNE_TABLE", "FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    fake_launch(monkeypatch)
    yield kdir
    tuning.reset()


def tile_of(variant) -> dict:
    return tuning.tile_of(variant.params, variant.dispatch)


# ------------------------------------------------------------------------------------ format
def test_table_round_trips_and_validates(tmp_path):
    path = write_table(tmp_path / "t.yaml")
    text = path.read_text()
    assert text.startswith("# flashgen tune table") and "tile: default" in text
    t = tuning.load_table(path)
    assert t.gpu == GPU and t.date == "2026-11-22" and t.flashgen == {"version": "0.1.0", "commit": "abc1234"}
    e = t.entries[("fwd", *sorted(KEY.items()))]
    assert [r.max_seqlen_k for r in e.rows] == [1024, 4096, None]
    assert e.rows[0].tile == CAND and e.rows[1].tile is None and e.rows[2].tile == CAND2
    assert e.rows[0].measured[0]["tflops"] == 550.0


def _bad(mutate):
    data = table_data()
    mutate(data)
    return data


BAD = [
    (lambda d: d["entries"][0]["rows"][0].update(max_seqlen_k=1000), "entries[0].rows[0].max_seqlen_k = 1000",
     "power of two"),
    (lambda d: d["entries"][0]["rows"][1].update(max_seqlen_k=None), "entries[0].rows[1].max_seqlen_k = null",
     "only the last row"),
    (lambda d: d["entries"][0]["rows"][1].update(max_seqlen_k=512), "entries[0].rows[1].max_seqlen_k = 512",
     "ascending"),
    (lambda d: d["entries"][0]["rows"][0].update(tiles=CAND), "entries[0].rows[0].tiles", "unknown key"),
    (lambda d: d["entries"][0]["rows"][0].update(tile="fastest"), "entries[0].rows[0].tile = 'fastest'",
     "'default'"),
    (lambda d: d["entries"][0]["rows"][0]["tile"].update(causal=True), "entries[0].rows[0].tile.causal",
     "a dispatch key"),
    (lambda d: d["entries"][0]["rows"][0]["tile"].update(block_n=[1]), "entries[0].rows[0].tile.block_n",
     "integer, boolean or string"),
    (lambda d: d["entries"][0]["rows"][0]["measured"][0].update(tflops="fast"),
     "entries[0].rows[0].measured[0].tflops", "number"),
    (lambda d: d["entries"][0].update(rows=[]), "entries[0].rows", "non-empty"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), "entries[1]", "one entry per key"),
    (lambda d: d["entries"][0].pop("key"), "entries[0]", "missing required key 'key'"),
    (lambda d: d.pop("gpu"), "missing required key 'gpu'", ""),
    (lambda d: d.update(schema=2), "schema = 2", "schema 1"),
    (lambda d: d.update(date="yesterday"), "date = 'yesterday'", "YYYY-MM-DD"),
    (lambda d: d.update(flashgen={"version": "0.1.0"}), "flashgen", "missing required key 'commit'"),
    (lambda d: d.update(entries={}), "entries", "expected a list"),
]


@pytest.mark.parametrize("mutate,where,why", BAD)
def test_bad_tables_name_file_and_row(tmp_path, mutate, where, why):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_bad(mutate), sort_keys=False))
    with pytest.raises(tuning.TuneTableError) as ei:
        tuning.load_table(path)
    msg = str(ei.value)
    assert str(path) in msg and where in msg and why in msg, msg
    with pytest.raises(tuning.TuneTableError):  # the writer refuses the same data
        tuning.table_text(_bad(mutate))


def test_unreadable_tables(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: 1\nentries: [\n")
    with pytest.raises(tuning.TuneTableError, match=r"bad\.yaml:.*invalid YAML"):
        tuning.load_table(bad)
    with pytest.raises(tuning.TuneTableError, match=r"missing\.yaml: cannot read"):
        tuning.load_table(tmp_path / "missing.yaml")
    bad.write_text("- 1\n")
    with pytest.raises(tuning.TuneTableError, match=r"bad\.yaml: wrong type list, expected a mapping"):
        tuning.load_table(bad)


def test_gpu_slug():
    assert tuning.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuning.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert tuning.gpu_slug(" NVIDIA  H100 PCIe ") == "nvidia-h100-pcie"
    assert tuning.gpu_slug("???") == "unknown-gpu"


# ------------------------------------------------------------------------------------ buckets
@pytest.mark.parametrize("s,b", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (512, 9), (513, 10), (1024, 10),
                                 (1025, 11), (16384, 14), (16385, 15)])
def test_seqlen_bucket(s, b):
    assert tuning.seqlen_bucket(s) == b
    assert (s - 1).bit_length() == b  # what core computes inline


def test_row_for_bucket(tmp_path):
    e = tuning.load_table(write_table(tmp_path / "t.yaml")).entries[("fwd", *sorted(KEY.items()))]

    def tile(s):
        r = e.row_for(tuning.seqlen_bucket(s))
        return r.tile if r else "none"

    assert [tile(s) for s in (1, 512, 1024)] == [CAND] * 3
    assert [tile(s) for s in (1025, 2048, 4096)] == [None] * 3
    assert [tile(s) for s in (4097, 16384, 1 << 20)] == [CAND2] * 3
    bounded = tuning.Entry("fwd", KEY, DEFAULT, (tuning.Row(1024, CAND),))
    assert bounded.row_for(tuning.seqlen_bucket(1024)).tile == CAND and bounded.row_for(tuning.seqlen_bucket(1025)) is None


# ------------------------------------------------------------------------------------ runtime
def test_runtime_uses_the_table_per_bucket(gpu):
    write_table(gpu / "tune" / f"{SLUG}.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tile_of(forward(512)) == CAND
        assert tile_of(forward(1024)) == CAND
        assert tile_of(forward(1025)) == DEFAULT
        assert tile_of(forward(4096)) == DEFAULT
        assert tile_of(forward(10000)) == CAND2
    # seqlen_q does not pick the bucket (the protocol holds the tile count fixed; see tuning.py)
    assert tile_of(forward(512, seqlen_q=8192)) == CAND
    # an explicit variant is never replaced
    v = forward(4096)
    assert forward(512, variant=v) is v


def test_plan_cache_resolves_once_per_bucket(gpu, monkeypatch):
    write_table(gpu / "tune" / f"{SLUG}.yaml")
    calls = []
    real = tuning.tuned_variant
    monkeypatch.setattr(tuning, "tuned_variant", lambda *a: calls.append(a[1]) or real(*a))
    for s in (512, 600, 1000, 1024, 512, 3000, 4000, 2049):
        forward(s)
    assert calls == [9, 10, 12], calls  # buckets 9 (<=512), 10 (513..1024), 12 (2049..4096): one miss each
    assert sum(1 for k in core._plans if k[0] is None) == 3


def test_head_dim_rounds_up_to_the_served_key(gpu):
    write_table(gpu / "tune" / f"{SLUG}.yaml")
    v = forward(512, head_dim=96)  # served by the hd128 variants: the hd128 entry applies
    assert v.dispatch["head_dim"] == 128 and tile_of(v) == CAND


def test_tile_not_built_falls_back_to_default(gpu):
    write_manifest(gpu, tiles=((KEY, DEFAULT, True), (KEY, CAND2, False)))  # CAND not built
    write_table(gpu / "tune" / f"{SLUG}.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silently: the default wheel does not ship candidates
        assert tile_of(forward(512)) == DEFAULT
        assert tile_of(forward(8192)) == CAND2


def test_no_table_for_this_gpu_uses_defaults(gpu, monkeypatch):
    write_table(gpu / "tune" / "nvidia-h999.yaml", table_data(gpu="NVIDIA H999"))
    assert tile_of(forward(512)) == DEFAULT


def test_env_off_and_override(gpu, monkeypatch, tmp_path):
    write_table(gpu / "tune" / f"{SLUG}.yaml")
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", "off")
    assert tile_of(forward(512)) == DEFAULT
    # a file: used whatever GPU it was measured on
    other = write_table(tmp_path / "elsewhere" / "mine.yaml",
                        table_data(gpu="NVIDIA H200", rows=[{"max_seqlen_k": None, "tile": CAND2}]))
    for value in (str(other), str(other.parent / "nothing.yaml")):
        monkeypatch.setenv("FLASHGEN_TUNE_TABLE", value)
        reset_plans(monkeypatch)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = tile_of(forward(512))
        if value == str(other):
            assert got == CAND2 and not w
        else:  # a named file that is missing: warned, defaults
            assert got == DEFAULT and len(w) == 1 and "nothing.yaml" in str(w[0].message)
    # a folder: searched for <gpu-slug>.yaml
    write_table(tmp_path / "dir" / f"{SLUG}.yaml", table_data(rows=[{"max_seqlen_k": None, "tile": CAND}]))
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", str(tmp_path / "dir"))
    reset_plans(monkeypatch)
    assert tile_of(forward(9999)) == CAND


def test_bad_table_warns_once_and_never_fails_a_call(gpu):
    path = gpu / "tune" / f"{SLUG}.yaml"
    path.parent.mkdir()
    data = table_data()
    data["entries"][0]["rows"][0]["max_seqlen_k"] = 1000
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tiles = [tile_of(forward(s)) for s in (512, 4096, 10000, 512)]
    assert tiles == [DEFAULT] * 4
    assert len(w) == 1, [str(x.message) for x in w]
    msg = str(w[0].message)
    assert str(path) in msg and "entries[0].rows[0].max_seqlen_k = 1000" in msg and "default tiles" in msg


def test_table_of_another_gpu_under_this_name_is_ignored(gpu):
    write_table(gpu / "tune" / f"{SLUG}.yaml", table_data(gpu="NVIDIA H200"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tile_of(forward(512)) == DEFAULT
    assert len(w) == 1 and "'NVIDIA H200'" in str(w[0].message)


def test_driver_failure_in_the_lookup_gives_the_default(gpu, monkeypatch):
    def boom(device):
        raise launch.CudaError("flashgen: cuDeviceGetName failed: CUDA_ERROR_UNKNOWN")

    monkeypatch.setattr(launch, "device_name", boom)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tile_of(forward(512)) == DEFAULT
    assert len(w) == 1 and "cuDeviceGetName" in str(w[0].message)


def test_checkout_tables_are_found(gpu, tmp_path, monkeypatch):
    root = tmp_path / "root"
    write_table(root / "configs" / "tune" / f"{SLUG}.yaml", table_data(rows=[{"max_seqlen_k": None, "tile": CAND2}]))
    monkeypatch.setenv("FLASHGEN_ROOT", str(root))
    assert root / "configs" / "tune" in tuning.table_dirs(gpu / "manifest.json")
    assert tile_of(forward(512)) == CAND2


# ------------------------------------------------------------------------------------ choosing
def test_noise_guard():
    assert tune.decide(100.0, {"d": 100.0, "a": 101.9}, "d", 0.02) == "d"
    assert tune.decide(100.0, {"d": 100.0, "a": 102.1, "b": 101.0}, "d", 0.02) == "a"
    assert tune.decide(100.0, {"d": 100.0, "a": 101.0}, "d", 0.0) == "a"
    assert tune.decide(100.0, {"d": 100.0, "a": float("nan")}, "d", 0.0) == "d"
    assert tune.decide(100.0, {"d": 100.0}, "d", 0.02) == "d"


def test_merge_rows():
    assert tune.merge_rows([512, 1024, 2048, 4096], ["a", "a", "d", "a"]) == [
        (1024, "a", [512, 1024]), (2048, "d", [2048]), (None, "a", [4096])]
    assert tune.merge_rows([512, 1024], ["d", "d"]) == [(None, "d", [512, 1024])]


def test_tile_label():
    assert tune.tile_label(CAND) == "128x176 s2 wg2"
    assert tune.tile_label({**CAND, "pingpong": False, "persistent": False}) == "128x176 s2 wg2 no-pingpong no-persistent"


# ------------------------------------------------------------------------------------ CLI
class FakePoint:
    """Stands in for tune._Point: TFLOP/s by tile (``speeds``: {block_n: f(seqlen)}), outputs by tile."""

    speeds: dict = {}
    wrong: set = set()  # block_n values whose output is wrong
    made: list = []

    def __init__(self, key, seqlen):
        import torch

        self.torch, self.seqlen, self.flops = torch, seqlen, 1e12
        FakePoint.made.append((dict(key), seqlen))

    def time_ms(self, variant, warmup_ms, rep_ms):
        tflops = FakePoint.speeds[variant.params["block_n"]](self.seqlen)
        return self.flops / tflops / 1e9

    def output(self, variant):
        out = self.torch.zeros(8)
        return out + 1.0 if variant.params["block_n"] in FakePoint.wrong else out

    mismatch = staticmethod(tune._Point.mismatch)


@pytest.fixture
def fake_tune(gpu, monkeypatch):
    monkeypatch.setattr(tune, "gpu_name", lambda: GPU)
    monkeypatch.setattr(tune, "_Point", FakePoint)
    FakePoint.made = []
    FakePoint.wrong = set()
    # CAND (n176) 10 % faster up to 1024, 1.5 % faster (inside the guard) at 2048, slower above;
    # CAND2 (n112) always 5 % slower
    FakePoint.speeds = {128: lambda s: 500.0,
                        176: lambda s: 550.0 if s <= 1024 else 507.5 if s == 2048 else 480.0,
                        112: lambda s: 475.0}
    return gpu


def run_tune(*args, env=None):
    return cli(["tune", "--dtypes", "bf16", "--head-dims", "128", "--causal", "false", *args], env=env)


def test_cli_writes_a_table_the_runtime_reads(fake_tune, tmp_path):
    out = fake_tune / "tune" / f"{SLUG}.yaml"  # where the runtime looks for this GPU beside the manifest
    r = run_tune("--seqlens", "512,1024,2048,4096", "-o", str(out))
    assert r.exit_code == 0, r.output
    t = tuning.load_table(out)
    assert t.gpu == GPU and t.protocol["min_gain"] == 0.02 and t.protocol["seqlens"] == [512, 1024, 2048, 4096]
    assert t.flashgen["version"] == "0.1.0" and t.flashgen["commit"]
    (e,) = t.entries.values()
    assert e.key == KEY and e.default_tile == DEFAULT
    assert [(r_.max_seqlen_k, r_.tile) for r_ in e.rows] == [(1024, CAND), (None, None)]
    assert [m["seqlen"] for m in e.rows[1].measured] == [2048, 4096]
    assert e.rows[0].measured[0] == {"seqlen": 512, "tflops": 550.0, "default_tflops": 500.0}
    # the markdown evidence
    assert "| key | seqlen | default TFLOP/s | winner | winner TFLOP/s | gain | note |" in r.output
    assert "| bf16 hd128 noncausal | 512 | 500.0 | 128x176 s2 wg2 | 550.0 | +10.0 % |  |" in r.output
    assert ("| bf16 hd128 noncausal | 2048 | 500.0 | 128x128 s2 wg2 (default) | 500.0 | +0.0 % | "
            "128x176 s2 wg2 +1.5 %: within the 2% guard |") in r.output
    assert "16 timings" in r.output and "about" in r.output  # (3 candidates + the default's second timing) x 4
    assert t.protocol["rounds"] == tune.ROUNDS == 1
    # ... and the runtime then serves the winner
    assert tile_of(forward(700)) == CAND
    assert tile_of(forward(3000)) == DEFAULT
    assert tile_of(forward(100000)) == DEFAULT


def test_cli_rounds_take_each_variants_best_pass(fake_tune, tmp_path, monkeypatch):
    """--rounds N times the order (default, candidates, default) N times at each point and keeps
    each variant's best pass: a candidate slowed in one pass (a noisy timing) still wins with 2
    rounds, and loses the point with 1; the table records the rounds."""
    calls = []
    fast = FakePoint.speeds[176]

    def noisy(s):  # 128x176: its first timing at each point 20 % slow, the later ones as usual
        calls.append(s)
        return fast(s) * (0.8 if calls.count(s) == 1 else 1.0)

    FakePoint.speeds = {**FakePoint.speeds, 176: noisy}
    out2, out1 = tmp_path / "r2.yaml", tmp_path / "r1.yaml"
    r = run_tune("--seqlens", "512", "--rounds", "2", "-o", str(out2))
    assert r.exit_code == 0, r.output
    assert "8 timings" in r.output and "2 rounds" in r.output  # (3 candidates + the default again) x 2 rounds
    (e,) = tuning.load_table(out2).entries.values()
    assert [(r_.max_seqlen_k, r_.tile) for r_ in e.rows] == [(None, CAND)]
    assert e.rows[0].measured[0] == {"seqlen": 512, "tflops": 550.0, "default_tflops": 500.0}
    assert tuning.load_table(out2).protocol["rounds"] == 2
    calls.clear()
    r = run_tune("--seqlens", "512", "-o", str(out1))  # the default: 1 round
    assert r.exit_code == 0, r.output
    (e,) = tuning.load_table(out1).entries.values()
    assert [(r_.max_seqlen_k, r_.tile) for r_ in e.rows] == [(None, None)]  # 440 < 500: the default stays
    assert tuning.load_table(out1).protocol["rounds"] == 1
    assert run_tune("--rounds", "0", "--dry-run").exit_code == 2


def test_cli_min_gain_zero_takes_any_gain(fake_tune, tmp_path):
    out = tmp_path / "t.yaml"
    r = run_tune("--seqlens", "2048", "--min-gain", "0", "-o", str(out), "--commit", "deadbee")
    assert r.exit_code == 0, r.output
    assert tuning.load_table(out).flashgen["commit"] == "deadbee"
    (e,) = tuning.load_table(out).entries.values()
    assert [(r_.max_seqlen_k, r_.tile) for r_ in e.rows] == [(None, CAND)]
    assert "not read" in r.output  # written elsewhere than the runtime looks: the note says how to use it


def test_cli_merge_keeps_the_keys_not_timed(fake_tune, tmp_path):
    """--merge: the entries of the existing table for keys this run did not time stay, and the protocol
    records where they come from (their table's date, commit and min_gain); the timed key's entry is replaced."""
    import yaml

    out = tmp_path / "t.yaml"
    assert run_tune("--seqlens", "2048", "-o", str(out), "--commit", "aaaaaaa").exit_code == 0
    data = yaml.safe_load(out.read_text())
    other = {**data["entries"][0], "key": {**data["entries"][0]["key"], "dtype": "fp16"}}
    data["entries"].append(other)
    data["date"] = "2026-01-02"
    out.write_text(tuning.table_text(data))
    r = run_tune("--seqlens", "512", "-o", str(out), "--commit", "bbbbbbb", "--merge")
    assert r.exit_code == 0, r.output
    t = tuning.load_table(out)
    assert t.flashgen["commit"] == "bbbbbbb" and len(t.entries) == 2
    assert t.entry_for("fwd", KEY).rows[0].measured[0]["seqlen"] == 512  # the timed key: this run's
    assert t.entry_for("fwd", other["key"]).rows == tuning.table_from_data(data, "old").entry_for("fwd", other["key"]).rows
    kept = [{"date": "2026-01-02", "commit": "aaaaaaa", "min_gain": 0.02, "keys": [other["key"]]}]
    assert t.protocol["kept"] == kept
    # a second merge, with another guard, keeps the attribution (and the guard) of the entries it carries over
    r = run_tune("--seqlens", "1024", "-o", str(out), "--commit", "ccccccc", "--merge", "--min-gain", "0.01")
    assert r.exit_code == 0, r.output
    t = tuning.load_table(out)
    assert t.protocol["kept"] == kept and t.protocol["min_gain"] == 0.01
    # without --merge the table holds this run's keys alone
    assert run_tune("--seqlens", "512", "-o", str(out)).exit_code == 0
    assert len(tuning.load_table(out).entries) == 1 and "kept" not in tuning.load_table(out).protocol
    # a table of another GPU is refused before anything is timed, and left as it is
    data = yaml.safe_load(out.read_text())
    data["gpu"] = "Other GPU"
    out.write_text(tuning.table_text(data))
    made = len(FakePoint.made)
    r = run_tune("--seqlens", "512", "-o", str(out), "--merge")
    assert r.exit_code != 0 and "--merge" in r.output and "'Other GPU'" in r.output, r.output
    assert len(FakePoint.made) == made and yaml.safe_load(out.read_text())["gpu"] == "Other GPU"


def test_cli_leaves_out_a_wrong_candidate(fake_tune, tmp_path):
    FakePoint.wrong = {176}
    out = tmp_path / "t.yaml"
    r = run_tune("--seqlens", "512,1024", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "left out 128x176 s2 wg2" in r.output and "differs from the default" in r.output
    (e,) = tuning.load_table(out).entries.values()
    assert [r_.tile for r_ in e.rows] == [None]


def test_cli_dry_run_prints_the_plan(fake_tune, tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "gpu_name", lambda: None)  # a dry run needs no GPU
    r = run_tune("--dry-run", "-o", str(tmp_path / "t.yaml"))
    assert r.exit_code == 0, r.output
    assert "no GPU" in r.output and "128x128 s2 wg2 (default), 128x112 s2 wg2, 128x176 s2 wg2" in r.output
    assert "1 keys, 3 variants, 6 seqlens: 24 timings, about" in r.output
    assert FakePoint.made == [] and not (tmp_path / "t.yaml").exists()
    r = cli(["tune", "--dry-run"])
    assert any(ln.split() == ["bf16", "hd64", "noncausal", "no", "built", "variant:", "not", "timed"]
               for ln in r.output.splitlines()), r.output


def test_cli_errors(fake_tune, tmp_path, monkeypatch):
    r = run_tune("--seqlens", "1000")
    assert r.exit_code == 2 and "seqlen 1000" in r.stderr and "power of two" in r.stderr
    r = cli(["tune", "--dtypes", "fp8"])
    assert r.exit_code == 2 and "'fp8'" in r.stderr and "bf16" in r.stderr
    r = cli(["tune", "--causal", "maybe"])
    assert r.exit_code == 2 and "'maybe'" in r.stderr
    write_manifest(fake_tune, tiles=((KEY, DEFAULT, True),))
    r = run_tune("-o", str(tmp_path / "t.yaml"))
    assert r.exit_code == 1 and "only the default is built" in r.output and "--build" in r.stderr
    monkeypatch.setattr(tune, "gpu_name", lambda: None)
    r = run_tune()
    assert r.exit_code == 3 and "needs a CUDA GPU" in r.stderr


def test_estimate_stays_in_budget():
    """The default sweep (12 keys, 6 seqlens) with the ablation points built too stays under 4 minutes."""
    class V:
        def __init__(self, n):
            self.name = n

    plans = [tune.KeyPlan({}, V("d"), [V(str(i)) for i in range(10 if j == 0 else 4)]) for j in range(12)]
    assert tune.estimate_seconds(plans, tune.DEFAULT_SEQLENS, tune.WARMUP_MS, tune.REP_MS) < 240


CANDS_FWD = """\
family: fwd
default_build: false
matrix:
  dtype: [bf16]
  head_dim: [64, 128]
  causal: [false, true]
candidates:
  - {head_dim: 64, block_m: 192, block_n: 112, consumer_wgs: 3}
  - {head_dim: 128, block_m: 128, block_n: 176, consumer_wgs: 2}
  - {head_dim: 128, causal: true, block_m: 128, block_n: 112, consumer_wgs: 2}
exclude:
  - {head_dim: 64, causal: true}
"""


def test_cli_build_then_tune_into_the_checkout(tmp_path, monkeypatch):
    """`flashgen tune --build`: builds the default set and the keys' candidates (fake nvcc), times
    them (fake GPU) and writes configs/tune/<gpu-slug>.yaml, which the runtime then reads."""
    fake_cuda(tmp_path, monkeypatch)
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "fwd_tune.yaml": CANDS_FWD})
    for var in ("FLASHGEN_TUNE_TABLE", "FLASHGEN_KERNEL_DIR", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tune, "gpu_name", lambda: GPU)
    monkeypatch.setattr(tune, "_Point", FakePoint)
    FakePoint.wrong, FakePoint.made = set(), []
    FakePoint.speeds = {128: lambda s: 500.0, 176: lambda s: 520.0, 112: lambda s: 400.0}
    r = cli(["tune", "--build", "-j", "2", "--dtypes", "bf16", "--head-dims", "128", "--seqlens", "512,1024"],
            root=proj.root)
    assert r.exit_code == 0, r.output
    names = [v["name"] for v in json.loads(proj.manifest_path.read_text())["variants"]]
    assert sum("m128n176" in n for n in names) == 2 and sum("m128n112" in n for n in names) == 1
    assert not any("hd64_noncausal_m192n112" in n for n in names)  # another key's candidate: not built
    out = proj.configs_dir / "tune" / f"{SLUG}.yaml"
    t = tuning.load_table(out)
    assert len(t.entries) == 2 and all(e.rows[0].tile["block_n"] == 176 for e in t.entries.values())
    load_variants(proj)  # configs/tune/*.yaml is not read as a config file
    # the runtime (checkout manifest, checkout table) serves the winner
    monkeypatch.setenv("FLASHGEN_ROOT", str(proj.root))
    fake_launch(monkeypatch)
    assert forward(512).params["block_n"] == 176


def test_default_output_in_a_checkout_and_outside(tmp_path, monkeypatch):
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD})
    monkeypatch.setenv("FLASHGEN_ROOT", str(proj.root))
    assert tune.default_output("NVIDIA H200") == proj.root / "configs" / "tune" / "nvidia-h200.yaml"
    monkeypatch.delenv("FLASHGEN_ROOT")
    monkeypatch.chdir(tmp_path)
    import flashgen.generator.project as gp

    monkeypatch.setattr(gp, "find_root", lambda cwd=None: None)
    assert tune.default_output("NVIDIA H200") == tmp_path / "nvidia-h200.yaml"


# ------------------------------------------------------------------------------------ configs
def test_candidates_section_expands_to_non_default_variants(tmp_path):
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "fwd_tune.yaml": CANDS_FWD})
    vs = load_variants(proj)
    cand = [v for v in vs if any("fwd_tune.yaml" in s for s in v.sources)]
    assert sorted((v.params["head_dim"], v.params["causal"], v.params["block_n"]) for v in cand) == [
        (64, False, 112), (128, False, 176), (128, True, 112), (128, True, 176)]
    assert not any(v.default or v.default_build for v in cand)
    assert all("with candidates[" in v.sources[0] for v in cand)
    defaults = [v for v in vs if v.default]
    assert len(defaults) == 8  # SMALL_FWD's matrix, unchanged


def test_candidates_errors(tmp_path):
    bad = CANDS_FWD.replace("block_m: 192, block_n: 112, consumer_wgs: 3", "block_m: 192, block_n: 160, consumer_wgs: 3")
    proj = make_project(tmp_path, {"fwd_tune.yaml": bad})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    assert any("candidates[0].block_n" in p and "block_n = 160" in p for p in ei.value.problems), ei.value.problems
    none = CANDS_FWD.replace("head_dim: [64, 128]", "head_dim: [64, 128, 256]")
    proj = make_project(tmp_path / "b", {"fwd_tune.yaml": none})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    assert any("head_dim=256" in p and "no tiles row matches" in p and "candidates row" in p
               for p in ei.value.problems), ei.value.problems
    typo = CANDS_FWD.replace("candidates:\n", "candidates:\n  - {head_dim: 64, blockn: 3}\n")
    proj = make_project(tmp_path / "c", {"fwd_tune.yaml": typo})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    assert any("candidates[0].blockn" in p and "unknown key" in p for p in ei.value.problems), ei.value.problems


def test_real_tune_candidates_config():
    """configs/fwd_tune.yaml: for bf16/fp16 x hd 64/128/256 x causal on/off, at least 3 non-default
    candidates per key beside the default tile, none in the default build unless a shipped tune
    table names it (then only because of that table) or configs/fwd.yaml builds it too (the few tile)."""
    vs = load_variants(Project(REPO))
    fwd = [v for v in vs if v.family == "fwd"]
    for key in tune.keys(("bf16", "fp16"), (64, 128, 256), (False, True)):
        serving = [v for v in fwd if v.dispatch == key]
        assert sum(v.default for v in serving) == 1, key
        cands = [v for v in serving if any("fwd_tune.yaml" in s for s in v.sources)]
        assert len(cands) >= 3 and not any(v.default for v in cands), key
        # (a candidate that a default config builds too, as configs/fwd.yaml's few tile: in the default build anyway)
        assert all(v.default_build == bool(v.tuned or any(src.startswith("configs/fwd.yaml") for src in v.sources))
                   for v in cands), key


SHIPPED_TABLES = sorted((REPO / "configs" / "tune").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED_TABLES, ids=lambda p: p.name)
def test_shipped_tables(path):
    """Every shipped table validates, is named after its GPU, names only configured tiles, and
    each of them is in the default build set (so `make build`, `flashgen build` and the default
    wheel have them), marked tuned by this table unless the configs already build it."""
    t = tuning.load_table(path)
    assert path.name == f"{tuning.gpu_slug(t.gpu)}.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TuneTableWarning for a shipped table
        vs = load_variants(Project(REPO))
    default_set = {v.name for v in select(vs)}
    for e in t.entries.values():
        for r in e.rows:
            if r.tile is not None:
                pick = _runtime_pick(vs, e.family, e.key, r.tile)  # what the runtime serves when built
                assert pick is not None, (path.name, e.key, r.tile)
                assert pick.name in default_set and pick.default_build, (path.name, e.key, r.tile)
                assert any(s.startswith(f"configs/tune/{path.name}: entries[") for s in pick.sources)


def _runtime_pick(vs, family, key, tile):
    """The variant of ``vs`` the runtime serves for a table row's ``tile`` when everything is built
    (tuning.variant_with_tile, with the key's default variant as ``like``)."""
    from types import SimpleNamespace as NS

    like = next((v for v in vs if v.family == family and v.dispatch == full_key(family, key) and v.default), None)
    return tuning.variant_with_tile(NS(variants=vs), family, key, tile, like=like)


def test_default_set_is_the_configs_plus_the_shipped_winners():
    """The default set of the real configs is exactly: the variants of the default_build files, plus
    the variant each tile of a shipped table names (the runtime's pick); every other candidate of
    the default_build: false files (configs/fwd_tune.yaml, ablation.yaml, ...) stays outside."""
    vs = load_variants(Project(REPO))
    named = set()
    for path in SHIPPED_TABLES:
        for e in tuning.load_table(path).entries.values():
            for r in e.rows:
                if r.tile is not None:
                    named.add(_runtime_pick(vs, e.family, e.key, r.tile).name)
    by_config = {f"configs/{p.name}" for p in REPO.glob("configs/*.yaml")
                 if yaml.safe_load(p.read_text()).get("default_build", True)}
    from_config = {v.name for v in vs if any(s.split(":")[0] in by_config for s in v.sources)}
    assert {v.name for v in select(vs)} == from_config | named
    assert {v.name for v in vs if v.tuned} == named - from_config
    assert len(vs) > len(from_config | named)  # not every candidate: only the winners


def test_package_ships_the_tables_beside_its_kernels(tmp_path, monkeypatch):
    """generator/package.py copies configs/tune/*.yaml to <kernel dir>/tune/, where the runtime of
    an installed package looks (here: FLASHGEN_KERNEL_DIR at the packaged folder)."""
    from flashgen.generator.package import package_kernels

    fake_cuda(tmp_path, monkeypatch)
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "fwd_tune.yaml": CANDS_FWD})
    key = {**KEY, "causal": True}
    write_table(proj.configs_dir / "tune" / f"{SLUG}.yaml",
                table_data(key=key, rows=[{"max_seqlen_k": None, "tile": CAND}]))
    dest = tmp_path / "pkg" / "_kernels"
    logged = []
    package_kernels(proj.root, dest, spec="all", log=logged.append)
    assert (dest / "tune" / f"{SLUG}.yaml").read_text() == (proj.configs_dir / "tune" / f"{SLUG}.yaml").read_text()
    assert any("shipping 1 tune table" in line for line in logged)
    for var in ("FLASHGEN_TUNE_TABLE", "FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(dest))
    fake_launch(monkeypatch)
    q = arg((1, 256, 2, 128))
    used = core.attention_forward(q, q, q, q, arg((1, 2, 256), "fp32"), 0.1, True, 0)
    assert used.params["block_n"] == 176 and not used.default


# ------------------------------------------------------------------- the default set's tuned tiles
def _tuned_project(tmp_path, tables: dict | None = None):
    """SMALL_FWD (default set, 8 variants) + CANDS_FWD (4 candidates, default_build false) and the
    given tables ({file name: table data}) in configs/tune/."""
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "fwd_tune.yaml": CANDS_FWD})
    for name, data in (tables or {}).items():
        write_table(proj.configs_dir / "tune" / name, data)
    return proj


def _load_quiet(proj):
    """load_variants, failing on any TuneTableWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_variants(proj)


def _sig(vs):
    return sorted((v.name, v.default, v.default_build, tuple(v.tuned)) for v in vs)


def test_default_set_gets_a_tables_winners_and_not_the_other_candidates(tmp_path, monkeypatch):
    """A table naming CAND (128x176) for bf16 hd128 non-causal: that variant joins the default set
    (tuned by the table); the other candidates (128x112, 176 for the causal key, hd64 192x112) do
    not; `flashgen list` shows why; `flashgen build` and the default wheel build it."""
    from flashgen.generator.package import package_kernels

    proj = _tuned_project(tmp_path, {f"{SLUG}.yaml": table_data(rows=[
        {"max_seqlen_k": 1024, "tile": CAND}, {"max_seqlen_k": None, "tile": "default"}])})
    vs = _load_quiet(proj)
    default_set = select(vs)
    added = [v for v in default_set if v.tuned]
    assert [(v.dispatch, tile_of(v), v.tuned) for v in added] == [(KEY, CAND, [SLUG])]
    assert not added[0].default and any(f"configs/tune/{SLUG}.yaml: entries[0].rows[0]" == s for s in added[0].sources)
    assert len(default_set) == 8 + 1
    others = [v for v in vs if not v.default_build]
    assert sorted((v.params["head_dim"], v.params["causal"], v.params["block_n"]) for v in others) == [
        (64, False, 112), (128, True, 112), (128, True, 176)]
    # flashgen list: in the default set, with the reason
    r = cli(["list"], proj.root)
    assert r.exit_code == 0 and not r.stderr, r.output
    line = [ln for ln in r.output.splitlines() if ln.startswith(added[0].name)]
    assert line and line[0].endswith(f"(tuned: {SLUG})")
    assert "9 variants" in r.output and f"1 of them in the default set as tuned tiles ({SLUG})" in r.output
    data = json.loads(cli(["list", "--json"], proj.root).output)
    assert [d["name"] for d in data if d["tuned"]] == [added[0].name]
    # flashgen build (fake nvcc) builds it; the default wheel set (FLASHGEN_VARIANTS unset) packages it
    _, log = fake_cuda(tmp_path, monkeypatch)
    r = cli(["build", "-j", "2"], proj.root)
    assert r.exit_code == 0, r.output
    assert f"default set: 9 variants, 1 of them tiles named by tune tables ({SLUG}" in r.output
    built = {v["name"] for v in json.loads(proj.manifest_path.read_text())["variants"]}
    assert added[0].name in built and not any(v.name in built for v in others)
    monkeypatch.delenv("FLASHGEN_VARIANTS", raising=False)
    logged = []
    names = package_kernels(proj.root, tmp_path / "pkg", log=logged.append)
    assert set(names) == {v.name for v in default_set}
    assert any("1 of the packaged variants" in line for line in logged)


def test_a_second_table_is_picked_up_without_changes(tmp_path):
    """Another GPU's table (an H100's, as `flashgen tune` would write it) adds its own winners; a
    tile both tables name is one variant, tuned by both."""
    h100 = table_data(gpu="NVIDIA H100 80GB HBM3", rows=[{"max_seqlen_k": 512, "tile": CAND},
                                                         {"max_seqlen_k": None, "tile": "default"}])
    causal = table_data(key={**KEY, "causal": True}, rows=[{"max_seqlen_k": None, "tile": CAND2}])
    h100["entries"] += causal["entries"]
    proj = _tuned_project(tmp_path, {f"{SLUG}.yaml": table_data(rows=[{"max_seqlen_k": None, "tile": CAND}]),
                                     "nvidia-h100-80gb-hbm3.yaml": h100})
    vs = _load_quiet(proj)
    added = sorted(((v.params["causal"], v.params["block_n"]), v.tuned) for v in select(vs) if v.tuned)
    assert added == [((False, 176), ["nvidia-h100-80gb-hbm3", SLUG]), ((True, 112), ["nvidia-h100-80gb-hbm3"])]
    assert len(select(vs)) == 8 + 2


def test_unknown_tile_warns_and_changes_nothing(tmp_path, monkeypatch):
    """A table naming a tile no config makes: the load (and so build, list, the wheel) does not fail,
    but warns, naming the table file, the entry and row, and the tile; the tiles it can build
    still join. An invalid table warns once and adds nothing (the runtime ignores it as well)."""
    odd = {**CAND, "block_n": 144}
    proj = _tuned_project(tmp_path, {f"{SLUG}.yaml": table_data(rows=[
        {"max_seqlen_k": 1024, "tile": odd}, {"max_seqlen_k": None, "tile": CAND}])})
    with pytest.warns(TuneTableWarning) as rec:
        vs = load_variants(proj)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1 and f"configs/tune/{SLUG}.yaml: entries[0].rows[0].tile = " in msgs[0], msgs
    assert "block_n: 144" in msgs[0] and "no config makes fwd" in msgs[0] and "default tile" in msgs[0], msgs
    assert [tile_of(v) for v in select(vs) if v.tuned] == [CAND]  # the buildable winner is not dropped
    r = cli(["list"], proj.root)
    assert r.exit_code == 0 and f"warning: configs/tune/{SLUG}.yaml: entries[0].rows[0].tile" in r.stderr, r.output
    fake_cuda(tmp_path, monkeypatch)
    r = cli(["build", "-j", "2"], proj.root)
    assert r.exit_code == 0 and r.stderr.count("warning: ") == 1, (r.output, r.stderr)
    # a key no config serves, a tile key the family does not have
    data = table_data(key={**KEY, "head_dim": 256, "head_dim_v": 256}, rows=[{"max_seqlen_k": None, "tile": CAND}])
    data["entries"].append({**copy.deepcopy(data["entries"][0]), "key": dict(KEY),
                            "rows": [{"max_seqlen_k": None, "tile": {**CAND, "blockn": 3}}]})
    write_table(proj.configs_dir / "tune" / f"{SLUG}.yaml", data)
    with pytest.warns(TuneTableWarning) as rec:
        vs = load_variants(proj)
    msgs = sorted(str(w.message) for w in rec)
    assert len(msgs) == 2 and "entries[0].rows[0]" in msgs[0] and "no config makes a variant of fwd" in msgs[0], msgs
    assert "entries[1].rows[0]" in msgs[1] and "'blockn': not a key of fwd" in msgs[1], msgs
    assert not any(v.tuned for v in vs)
    # an invalid table (here: named after another GPU than it was measured on): ignored with a warning
    (proj.configs_dir / "tune" / f"{SLUG}.yaml").unlink()
    write_table(proj.configs_dir / "tune" / "nvidia-h200.yaml", table_data(rows=[{"max_seqlen_k": None, "tile": CAND}]))
    (proj.configs_dir / "tune" / "broken.yaml").write_text("schema: 1\nentries: [\n")
    with pytest.warns(TuneTableWarning) as rec:
        vs = load_variants(proj)
    msgs = sorted(str(w.message) for w in rec)
    assert len(msgs) == 2 and all("invalid tune table: none of its tiles joins the default build" in m for m in msgs)
    assert "configs/tune/broken.yaml: line" in msgs[0] and "invalid YAML" in msgs[0], msgs
    assert "configs/tune/nvidia-h200.yaml: gpu = " in msgs[1] and f"{SLUG}.yaml" in msgs[1], msgs
    assert not any(v.tuned for v in vs) and len(select(vs)) == 8


def test_no_tables_change_nothing(tmp_path):
    """Without configs/tune/, or with it empty, or with a table naming only default tiles, the
    default set is the default_build files' variants, unchanged, and nothing warns."""
    none = _sig(_load_quiet(_tuned_project(tmp_path / "a")))
    proj = _tuned_project(tmp_path / "b")
    (proj.configs_dir / "tune").mkdir()
    assert _sig(_load_quiet(proj)) == none
    write_table(proj.configs_dir / "tune" / f"{SLUG}.yaml", table_data(rows=[
        {"max_seqlen_k": 1024, "tile": "default"}, {"max_seqlen_k": None, "tile": DEFAULT}]))
    assert _sig(_load_quiet(proj)) == none
    vs = _load_quiet(proj)
    assert len(select(vs)) == 8 and not any(v.tuned for v in vs)
    assert sum(any("configs/tune/" in s for s in v.sources) for v in vs) == 1  # the default variant it names


def test_sweep_through_the_real_point_with_a_fake_timer(gpu, monkeypatch):
    """tune._Point as the GPU run uses it (inputs, core.attention_forward with the variant, the
    bench timer), with torch's CUDA calls sent to the CPU, the launcher (launch.prepare_launch /
    launch_prepared) recording which variant ran and bench._time_ms replaced by a timer that makes
    CAND the fastest."""
    import types

    import torch

    from flashgen import bench
    from flashgen.manifest import load_manifest

    real_randn, real_empty = torch.randn, torch.empty
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(tune, "TOTAL_TOKENS", 1024)  # small CPU tensors: batch 1024 / seqlen
    monkeypatch.setattr(tune, "HIDDEN", 256)  # heads 256 / head_dim
    launched = []
    monkeypatch.setattr(launch, "prepare_launch", lambda kernel, grid, params, per_call, counter=None: (kernel, params))
    monkeypatch.setattr(launch, "launch_prepared", lambda prep, maps, values, stream: launched.append(
        (prep[0][1], prep[1]["batch"], prep[1]["heads"], prep[1]["seqlen_k"], stream)))
    ms = {128: 1.0, 176: 0.8, 112: 1.1}  # by block_n
    by_name = {v.name: v for v in load_manifest().variants}

    def fake_time_ms(fn, warmup_ms=25, rep_ms=100):
        assert (warmup_ms, rep_ms) == (5, 20)
        fn()
        return ms[by_name[launched[-1][0]].params["block_n"]]

    monkeypatch.setattr(bench, "_time_ms", fake_time_ms)
    monkeypatch.setattr(tune._Point, "output", lambda self, variant: torch.zeros(4))
    plans, missing = tune.plan(load_manifest().variants, "fwd", tune.keys(["bf16"], [128], [False, True]))
    assert len(plans) == 1 and len(missing) == 1
    res = tune.sweep(plans, [512, 1024], warmup_ms=5, rep_ms=20, log=lambda s: None)
    p = plans[0]
    names = [v.name for v in p.candidates]
    # at each point, ROUNDS passes with the default first and last
    assert [x[0] for x in launched] == (names + [names[0]]) * tune.ROUNDS * 2
    assert [x[1:] for x in launched[:1] + launched[-1:]] == [(2, 2, 512, 7), (1, 2, 1024, 7)]
    flops = 4 * 2 * 2 * 512 * 512 * 128
    assert res[(0, 512)][names[0]] == res[(0, 512)]["__default2__"] == pytest.approx(flops / 1.0 / 1e9)
    cand = next(v.name for v in p.candidates if v.params["block_n"] == 176)
    assert res[(0, 512)][cand] == pytest.approx(flops / 0.8 / 1e9)
    data, md = tune.build_table(GPU, plans, [512, 1024], res, tune.protocol([512, 1024], 5, 20, 0.02), "c", "0.1.0")
    assert [(r["max_seqlen_k"], r["tile"]) for r in data["entries"][0]["rows"]] == [(None, CAND)]
    assert md[0][3] == "128x176 s2 wg2" and md[0][5] == pytest.approx(0.25)


def test_tile_without_a_newer_knob_prefers_the_default_variants_value():
    """A table row written before a knob existed names no value for it: of the built variants with
    that tile, the one agreeing with the key's default variant on the unnamed keys serves (not the
    first by name)."""
    from types import SimpleNamespace as NS

    key = dict(dtype="e4m3", head_dim=256, head_dim_v=256, causal=False)
    disp = tuning.full_key("fwd", key)
    base = dict(block_m=128, block_n=64, consumer_wgs=2, pingpong=True, overlap=True, persistent=True)

    def var(name, default, **kw):
        return NS(family="fwd", dispatch=disp, name=name, default=default, params={**key, **base, **kw})

    default = var("d", True, stages=2, late_pv_wait=False)
    late_s3, early_s3 = var("a_late", False, stages=3, late_pv_wait=True), var("b_early", False, stages=3, late_pv_wait=False)
    m = NS(variants=[default, late_s3, early_s3])
    old_row = {**base, "stages": 3}  # no late_pv_wait: written before it existed
    assert tuning.variant_with_tile(m, "fwd", key, old_row) is late_s3  # by name alone
    assert tuning.variant_with_tile(m, "fwd", key, old_row, like=default) is early_s3
    assert tuning.variant_with_tile(m, "fwd", key, {**old_row, "late_pv_wait": True}, like=default) is late_s3
    assert tuning.variant_with_tile(m, "fwd", key, {**base, "stages": 4}, like=default) is None


def test_default_set_takes_the_runtimes_variant_for_a_tile_without_a_newer_knob(tmp_path):
    """A table row that names no value for a knob (written before the knob existed) matches every
    candidate with that tile; the one that joins the default set is the one the runtime serves
    (tuning.variant_with_tile): the variant agreeing with the key's default variant on the knob, not
    the first by name (here "..._nopp_..." before "..._pp_...")."""
    cands = CANDS_FWD.replace("  - {head_dim: 128, block_m: 128, block_n: 176, consumer_wgs: 2}\n",
                              "  - {head_dim: 128, block_m: 128, block_n: 176, consumer_wgs: 2}\n"
                              "  - {head_dim: 128, block_m: 128, block_n: 176, consumer_wgs: 2, pingpong: false}\n")
    proj = make_project(tmp_path, {"fwd.yaml": SMALL_FWD, "fwd_tune.yaml": cands})
    old_row = {k: v for k, v in CAND.items() if k != "pingpong"}
    write_table(proj.configs_dir / "tune" / f"{SLUG}.yaml", table_data(rows=[{"max_seqlen_k": None, "tile": old_row}]))
    vs = _load_quiet(proj)
    same_tile = sorted((v for v in vs if v.dispatch == KEY and tile_of(v)["block_n"] == 176), key=lambda v: v.name)
    assert [v.params["pingpong"] for v in same_tile] == [False, True]  # by name the knob's variant comes first
    added = [v for v in select(vs) if v.tuned]
    assert [(v.params["pingpong"], v.tuned) for v in added] == [(True, [SLUG])]
