"""The varlen_prep family (generator/families/varlen_prep.py, templates/varlen_prep.cu.j2, runtime/varlen_prep.py):
its config, its real compile (0 spills, the asserts kept, every message in the SASS's kernel), and the launch's
argument checks, grid and params. The kernel itself runs in tests/gpu/test_features_gpu.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO  # noqa: E402

from flashgen import varlen_prep  # noqa: E402
from flashgen.generator import sass  # noqa: E402
from flashgen.generator.build import build  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.families.varlen_prep import (KVCACHE_PARAMS, PARAMS, contract_messages,  # noqa: E402
                                                    kvcache_messages)
from flashgen.generator.project import Project  # noqa: E402
from flashgen.generator.toolchain import find_cuobjdump  # noqa: E402


def test_config_is_one_default_variant_of_an_empty_dispatch_key():
    vs = [v for v in load_variants(Project(REPO)) if v.family == "varlen_prep"]
    assert len(vs) == 1 and vs[0].name.startswith("varlen_prep_t256_") and vs[0].params["threads"] == 256


def test_messages_name_each_argument_in_the_torch_paths_order():
    ms = contract_messages()
    assert len(ms) == 6
    for i, arg in enumerate(("cu_seqlens_q", "seqused_q", "max_seqlen_q", "cu_seqlens_k", "seqused_k",
                             "max_seqlen_k")):
        assert ms[i].startswith(f"flashgen: {arg} "), (i, ms[i])
    ms = kvcache_messages()
    assert [m.split()[1] for m in ms] == ["cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table's", "rotary"]


@pytest.mark.slow
def test_real_compile_keeps_the_asserts_without_spills(tmp_path):
    """nvcc with the build's -DNDEBUG: the template undefines it, so the kernel calls __assertfail (the
    manifest's SASS requirement CALL, checked by flashgen.generator.sass) and its source asserts each message;
    0 spill bytes."""
    find_cuobjdump()
    proj = Project(REPO, build_override=tmp_path)
    pick = select(load_variants(proj), "varlen_prep_*")
    res = build(proj, pick, jobs=1, log=lambda line: None)
    assert res.failed == [], res.failed
    manifest = json.loads(proj.manifest_path.read_text())
    (rec,) = [v for v in manifest["variants"] if v["family"] == "varlen_prep"]
    assert [k["role"] for k in rec["kernels"]] == ["main", "kvcache"]
    ops = sass.check_manifest(str(proj.manifest_path))
    for k in rec["kernels"]:  # (the kvcache kernel: its copies' loads and stores, the distinct-rows bitmap's ATOMS)
        assert k["spill_bytes"] == 0 and k["stack_bytes"] == 0 and "CALL" in k["sass"]
        have = set(ops[k["symbol"]])
        assert {"CALL", "STG"} <= have and (k["role"] == "main" or {"LDG", "ATOMS"} <= have)
    src = (proj.src_dir / f"{rec['name']}.cu").read_text()
    for messages in (contract_messages(), kvcache_messages()):  # (each kernel's bits count from 0)
        for i, m in enumerate(messages):
            assert f'assert(!(bad & (1u << {i})) && "{m}");' in src


class _Recorder:
    def __init__(self):
        self.launches = []
        self.kernels = []

    def launch(self, kernel, grid, maps, params, stream, device):
        self.launches.append((grid, params, stream, device))
        self.kernels.append(kernel)

    @staticmethod
    def prepare_launch(kernel, grid, params, per_call, counter=None):
        """As launch.prepare_launch: the fixed fields, every per-call one set to 0."""
        assert set(per_call) <= set(params) and counter is None
        return (kernel, grid, {**params, **dict.fromkeys(per_call, 0)}, per_call)

    def launch_prepared(self, prep, maps, values, stream):
        """As launch.launch_prepared: recorded as a launch of the fixed fields with the per-call ones (no device: the
        prepared kernel was loaded for one)."""
        kernel, grid, params, per_call = prep
        assert len(values) == len(per_call) and maps == ()
        self.launch(kernel, grid, maps, {**params, **dict(zip(per_call, values))}, stream, None)


@pytest.fixture
def fake_launch(monkeypatch):
    """varlen_prep's launch without a GPU: a fake variant of 256 threads, 132 SMs, launches recorded."""
    from flashgen.manifest import Variant

    rec = _Recorder()
    var = Variant(name="varlen_prep_t256_fake", family="varlen_prep", params={"threads": 256}, dispatch={},
                  kernels=())
    monkeypatch.setattr(varlen_prep, "_plans", {})
    monkeypatch.setattr(varlen_prep.dispatch, "select_variant", lambda family, key: var)
    monkeypatch.setattr(varlen_prep.launch, "get_kernel", lambda v, role, device: ("kernel", role))
    monkeypatch.setattr(varlen_prep.launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(varlen_prep.launch, "launch", rec.launch)
    monkeypatch.setattr(varlen_prep.launch, "prepare_launch", rec.prepare_launch)
    monkeypatch.setattr(varlen_prep.launch, "launch_prepared", rec.launch_prepared)
    return rec


def _call(**kw):
    args = dict(cu_seqlens_q=0x1000, cu_seqlens_k=0x2000, seqused_q=0, seqused_k=0x3000, batch=3, total_q=100,
                total_k=90, max_seqlen_q=40, max_seqlen_k=50, out=0x10000, out_row_bytes=432, lse=0x20000, heads=3,
                stream=7, device=0)
    args.update(kw)
    return varlen_prep.varlen_prepare(**args)


def test_launch_packs_every_field_and_sizes_the_grid(fake_launch):
    var = _call()
    assert var.name == "varlen_prep_t256_fake" and fake_launch.kernels == [("kernel", "main")]
    ((grid, params, stream, device),) = fake_launch.launches
    assert grid == (13, 1, 1) and stream == 7 and device == 0  # 100 rows / 8 warps per CTA
    assert set(params) == {f.name for f in PARAMS.fields}
    assert params["seqused_k"] == 0x3000 and params["out_row_bytes"] == 432 and params["heads"] == 3
    _call(total_q=10**6)
    _call(out=0, out_row_bytes=0, lse=0)
    (g_big, _, _, _), (g_check, p_check, _, _) = (x for x in fake_launch.launches[1:])
    assert g_big == (264, 1, 1)  # at most 2 CTAs per SM: the fill is a grid-stride loop
    assert g_check == (1, 1, 1) and p_check["out"] == 0 and p_check["lse"] == 0  # check only: CTA 0


@pytest.mark.parametrize("kw,fragment", [
    (dict(batch=0), "batch 0"),
    (dict(total_q=2**31), "total_q"),
    (dict(heads=-1), "heads"),
    (dict(cu_seqlens_k=0), "cu_seqlens_q and cu_seqlens_k are required"),
    (dict(out_row_bytes=100), "16-byte aligned rows"),
    (dict(out=0x10008), "16-byte aligned rows"),
    (dict(lse=0), "16-byte aligned rows and an lse"),
])
def test_launch_refuses_what_the_kernel_cannot_take(fake_launch, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _call(**kw)
    assert fake_launch.launches == []


def _kv(**kw):
    """kvcache_prepare's arguments for 3 entries, 2 new tokens, 2 K/V heads of 128 bf16 (256-byte rows), unpaged."""
    args = dict(cache_seqlens=0x1000, seqlen_const=0, cache_batch_idx=0, cache_leftpad=0, page_table=0,
                page_table_stride=0, seqused_k=0x2000, k_new=0x10000, v_new=0x20000, k_new_strides=(1024, 512, 256),
                v_new_strides=(1024, 512, 256), n_new=2, k_cache=0x100000, v_cache=0x200000,
                k_cache_strides=(65536, 512, 256), v_cache_strides=(65536, 512, 256), k_row_bytes=256,
                v_row_bytes=256, batch=3, heads_k=2, capacity=128, cache_blocks=4, page_size=0, stream=7, device=0)
    args.update(kw)
    return varlen_prep.kvcache_prepare(**args)


def test_kvcache_launch_packs_every_field_and_sizes_the_grid(fake_launch):
    """One thread per 16-byte chunk of the new rows (3 x 2 x 2 rows of (256 + 256) / 16 chunks = 384 threads: 2 CTAs
    of 256), at most 4 CTAs per SM; the kvcache kernel (role "kvcache"); every KvcachePrepParams field given."""
    _kv()
    ((grid, params, stream, device),) = fake_launch.launches
    assert grid == (2, 1, 1) and stream == 7 and device is None  # (a prepared launch: its kernel loaded for device 0)
    assert set(params) == {f.name for f in KVCACHE_PARAMS.fields}
    assert params["k_cache_stride_r"] == 65536 and params["v_new_stride_h"] == 256 and params["n_new"] == 2
    assert params["page_size"] == 0 and params["page_table_stride"] == 0  # (no page table: not read)
    _kv(batch=4096)
    _kv(n_new=0, k_new=0, v_new=0)
    _kv(page_table=0x3000, page_table_stride=8, page_size=16, cache_blocks=40)
    (g_big, _, _, _), (g_none, p_none, _, _), (_, p_paged, _, _) = fake_launch.launches[1:]
    assert g_big == (528, 1, 1) and g_none == (1, 1, 1) and p_none["k_new"] == 0  # checks + seqused_k only
    assert (p_paged["page_size"], p_paged["page_table_stride"]) == (16, 8)
    assert fake_launch.kernels == [("kernel", "kvcache")] * 4  # (the fake get_kernel's value for the role)


@pytest.mark.parametrize("kw,fragment", [
    (dict(batch=0), "batch 0"),
    (dict(seqused_k=0), "seqused_k"),
    (dict(n_new=-1), "n_new -1"),
    (dict(page_table=0x3000, page_size=0), "page_size 0 with a page table"),
    (dict(cache_batch_idx=0x4000, cache_blocks=(1 << 16) + 1), "cache rows with cache_batch_idx"),
    (dict(k_row_bytes=136), "multiples of 16 bytes"),
    (dict(v_new=0x20008), "multiples of 16 bytes"),
    (dict(k_cache_strides=(65536, 520, 256)), "multiples of 16 bytes"),
    (dict(capacity=2**31), "capacity"),
])
def test_kvcache_launch_refuses_what_the_kernel_cannot_take(fake_launch, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _kv(**kw)
    assert fake_launch.launches == []


def _rope(**kw):
    """A KvcacheRotary for _kv's 3 entries: q of 2 rows x 4 heads of 128 bf16 (256-byte rows), 64 rotary dims, a
    table of 100 fp32 rows, interleaved, each row at its own position."""
    args = dict(q=0x30000, q_rot=0x40000, q_strides=(2048, 1024, 256), q_row_bytes=256, seqlen_q=2, heads=4,
                cos=0x50000, sin=0x60000, cos_dtype=0, rotary_seqlens=0, rotary_dim=64, seqlen_ro=100,
                interleaved=True, bf16=True, each=True)
    args.update(kw)
    return varlen_prep.KvcacheRotary(**args)


def test_kvcache_launch_packs_the_rotary_fields(fake_launch):
    """With rotary: the rotary fields packed (flags: 1 interleaved | 2 bf16 | 4 each), q's chunks added to the grid
    (384 append threads + 3 x 2 x 4 rows of 16 chunks = 768: 3 CTAs); without: every rotary field 0 (rotary_dim 0:
    none)."""
    _kv(rotary=_rope())
    _kv()
    (grid, params, _, _), (_, plain, _, _) = fake_launch.launches
    assert grid == (3, 1, 1) and set(params) == {f.name for f in KVCACHE_PARAMS.fields}
    assert (params["rotary_dim"], params["seqlen_ro"], params["rotary_flags"], params["rotary_cos_dtype"]) == (
        64, 100, 7, 0)
    assert (params["q"], params["q_rot"], params["q_stride_t"], params["heads"], params["seqlen_q"]) == (
        0x30000, 0x40000, 1024, 4, 2)
    _kv(rotary=_rope(interleaved=False, bf16=False, each=False, cos_dtype=2, rotary_seqlens=0x7000))
    assert fake_launch.launches[-1][1]["rotary_flags"] == 0 and fake_launch.launches[-1][1]["rotary_seqlens"] == 0x7000
    assert plain["rotary_dim"] == 0 and plain["q"] == 0 and plain["rotary_flags"] == 0


@pytest.mark.parametrize("kw,fragment", [
    (dict(rotary_dim=8), "rotary_dim 8"),
    (dict(rotary_dim=144), "rotary_dim 144"),  # (past head_dim 128)
    (dict(q=0x30008), "multiples of 16 bytes"),
    (dict(q_strides=(2048, 1000, 256)), "multiples of 16 bytes"),
    (dict(cos=0), "cos and sin given"),
    (dict(sin=0x60008), "multiples of 16 bytes"),  # (the tables' 8- and 16-byte loads)
    (dict(cos_dtype=3), "cos_dtype 3"),
    (dict(seqlen_ro=0), "seqlen_ro 0"),
])
def test_kvcache_launch_refuses_rotary_the_kernel_cannot_take(fake_launch, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _kv(rotary=_rope(**kw))
    assert fake_launch.launches == []


def test_kvcache_step_launch_is_prepared_once_per_metadata(fake_launch, monkeypatch):
    """kvcache._kvcache_prep_launch (a flash_attn_with_kvcache step's launch) prepares the kernel's launch once per
    step metadata (varlen_prep.prepare_kvcache) and gives each call its own addresses: the params launched equal
    kvcache_prepare's for the same arguments, on new tensors of the same metadata too; new metadata (another append
    length, rotary, a page table, a misaligned new row) prepares again."""
    torch = pytest.importorskip("torch")
    from flashgen import kvcache

    monkeypatch.setattr(kvcache, "_prep_launches", {})
    monkeypatch.setattr(kvcache, "_current_stream", lambda device: 7)
    prepared = []
    real_prepare = fake_launch.prepare_launch

    def counting(*a, **kw):
        prepared.append(a[2]["n_new"])
        return real_prepare(*a, **kw)

    monkeypatch.setattr(varlen_prep.launch, "prepare_launch", counting)
    bf = torch.bfloat16
    alive = []  # (each step's tensors kept, so that the next step's are at other addresses)

    def step(n=2, rope=False, paged=False, offset=0, seed=0):
        g = torch.Generator().manual_seed(seed)
        kc, vc = (torch.randn(4, 128, 2, 128, generator=g).to(bf) for _ in range(2))
        k, v = (torch.randn(3, 3, 2, 128, generator=g).to(bf)[:, offset:offset + n] for _ in range(2))  # (strides alike)
        lens, total = torch.tensor([5, 0, 9], dtype=torch.int32), torch.empty(3, dtype=torch.int32)
        table = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32) if paged else None
        r = None
        if rope:
            q = torch.randn(3, 2, 4, 128, generator=g).to(bf)
            cos, sin = (torch.randn(100, 32, generator=g) for _ in range(2))
            r = kvcache._Rope(q, torch.empty_like(q), cos, sin, None, True, True)
        cache = (kc.view(8, 64, 2, 128), vc.view(8, 64, 2, 128)) if paged else (kc, vc)
        alive.append((kc, vc, k, v, lens, total, table, r))
        kvcache._kvcache_prep_launch(lens, 0, None, None, table, total, k, v, *cache, 128, 0, r)
        got = fake_launch.launches[-1]
        es = 2
        strides = lambda t: tuple(s * es for s in t.stride()[:3])  # noqa: E731
        rot = None if r is None else varlen_prep.KvcacheRotary(
            r.q.data_ptr(), r.q_rot.data_ptr(), strides(r.q), 256, 2, 4, cos.data_ptr(), sin.data_ptr(), 0, 0, 64, 100,
            True, True, True)
        varlen_prep.kvcache_prepare(
            lens.data_ptr(), 0, 0, 0, 0 if table is None else table.data_ptr(), 0 if table is None else 2,
            total.data_ptr(), k.data_ptr(), v.data_ptr(), strides(k), strides(v), n, cache[0].data_ptr(),
            cache[1].data_ptr(), strides(cache[0]), strides(cache[1]), 256, 256, 3, 2, 128, cache[0].shape[0],
            64 if paged else 0, 7, 0, rot)
        want = fake_launch.launches[-1]
        assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2] == 7
        return got[1]

    first = step()
    second = step(seed=1)  # new tensors, the same metadata: no new preparation
    # (kvcache_prepare prepares on every call: 2 of the 3; the step's own launch once)
    assert first["k_cache"] != second["k_cache"] and len(prepared) == 3 and len(kvcache._prep_launches) == 1
    step(n=1)
    step(rope=True)
    step(paged=True)
    assert len(prepared) == 3 + 2 * 3 and prepared[-6:-4] == [1, 1]  # three new metadata: one preparation each
    assert len(kvcache._prep_launches) == 4
    with pytest.raises(ValueError, match="multiples of 16 bytes"):  # a new row 8 bytes off: checked again, refused
        k8 = torch.zeros(3 * 2 * 2 * 128 + 4, dtype=bf)[4:].view(3, 2, 2, 128)
        kvcache._kvcache_prep_launch(torch.zeros(3, dtype=torch.int32), 0, None, None, None,
                                     torch.empty(3, dtype=torch.int32), k8, k8, torch.zeros(4, 128, 2, 128, dtype=bf),
                                     torch.zeros(4, 128, 2, 128, dtype=bf), 128, 0)
