"""CPU tests of the ``quant`` family and ``flashgen.quantize_fp8`` (FA3 §3.3: block quantization and
incoherent processing): the family module (keys, feasibility, tile geometry, params), rendering, a
real nvcc compile (0 spills, the expected SASS), the float64 reference transform (orthogonal:
q' k'ᵀ = q kᵀ), the API's argument errors, and the whole call path with the kernels emulated.

No GPU here. The `fake_gpu` fixture makes CPU tensors count as CUDA device 0 (capability 9.0) and
replaces `flashgen.dispatch.select_variant`, `flashgen.launch.get_kernel` and
`flashgen.launch.launch` with fakes. The fake launch runs :func:`emulate`, a float32 re-enactment
of templates/quant.cu.j2 written from the same description (thread -> chunk map, load of a dead
item's fallback chunk, the sign flips, H_8 in a thread, butterflies across lanes by index
``t ^ m``, per-head amax, workspace reduction, descale and e4m3 rounding), reading and writing the
arrays through the raw params (host addresses + element strides). So a wrong pointer, stride, grid,
tile count or geometry, or a layout that breaks the shuffle stages, shows here against the
reference (tests/gpu/_ref.py: quantize_ref); the GPU tests (tests/gpu/test_quant_gpu.py) hold the
real kernels to the same reference.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashgen
import flashgen.core as core
import flashgen.dispatch as dispatch
import flashgen.interface as interface
import flashgen.launch as launch_mod
import flashgen.quantize as Q
from flashgen import _validate as V
from flashgen.generator import render, sass
from flashgen.generator.abi import render_decls
from flashgen.generator.config import load_variants, select
from flashgen.generator.families import quant as quant_mod
from flashgen.generator.project import Project
from flashgen.interface import incoherent_signs, quantize_fp8
from flashgen.manifest import Variant

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the shared references (torch only)
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from _ref import (  # noqa: E402
    E4M3_MAX, check_quantized, dequantize_fp8, hadamard_block, hadamard_matrix, incoherent_ref,
)
from fgutil import REPO, host_view, patch_fake_gpu, read_manifest  # noqa: E402

STREAM = 777
HEAD_DIMS = (64, 96, 128, 192, 256)
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------
# The family module
# --------------------------------------------------------------------------------------

def test_default_config_builds_one_variant_per_dtype():
    vs = [v for v in load_variants(Project(REPO)) if v.family == "quant"]
    assert sorted(v.params["dtype"] for v in vs) == ["bf16", "fp16"]
    for v in vs:
        assert v.default and v.default_build
        assert [k.role for k in v.kernels] == ["amax", "quant"]
        assert all(k.threads == quant_mod.THREADS and k.smem_bytes == 0 and k.tensor_maps == () for k in v.kernels)
        assert v.dispatch == {"dtype": v.params["dtype"]}
        assert v.name.startswith(f"quant_{v.params['dtype']}_b2_")


def test_min_blocks_feasibility():
    fam = quant_mod.FAMILY
    assert fam.problems({"family": "quant", "dtype": "bf16", "min_blocks": 2}) == []
    ((key, val, allowed),) = fam.problems({"family": "quant", "dtype": "bf16", "min_blocks": 3})
    assert key == "min_blocks" and val == 3 and allowed.startswith("at most 2 ")
    assert fam.key("min_blocks").problem(5) is not None and fam.key("dtype").problem("fp32") is not None


def test_invalid_config_is_reported_before_compiling(tmp_path):
    from fgutil import make_project

    from flashgen.generator.errors import ConfigError

    for text, needle in (("matrix: {dtype: [bf16, e4m3]}", "matrix.dtype[1] = 'e4m3': not allowed; allowed: 'bf16', 'fp16'"),
                         ("defaults: {min_blocks: 4}\nmatrix: {dtype: bf16}", "min_blocks")):
        proj = make_project(tmp_path / str(len(needle)), {"quant.yaml": f"family: quant\n{text}\n"})
        with pytest.raises(ConfigError) as ei:
            load_variants(proj)
        assert any(p.startswith("configs/quant.yaml") and needle in p for p in ei.value.problems), ei.value.problems
    assert "at most 2" in "\n".join(ei.value.problems)


@pytest.mark.parametrize("dim", range(8, 257, 8))
def test_tile_geometry(dim):
    """Every head dim: the passes reach 64 rows, a thread's 8 items cover heads_per_cta heads, the
    threads of a pass fit the CTA, and a Hadamard block's chunks sit on lanes l0 .. l0 + B/8 - 1 of
    one warp with l0 a multiple of B/8 (what the shuffle stages pair by lane ^ m)."""
    rows, items_log2, heads = quant_mod.tile_geometry(dim)
    chunks = dim // 8
    assert rows * chunks <= quant_mod.THREADS and (1 << items_log2) * rows >= quant_mod.QUANT_BLOCK
    assert (1 << items_log2) * heads == quant_mod.ITEMS and heads >= 1
    assert (1 << (items_log2 - 1) if items_log2 else 0) * rows < quant_mod.QUANT_BLOCK  # no pass is wasted
    lanes = hadamard_block(dim) // 8
    assert quant_mod.hadamard_size(dim) == hadamard_block(dim) and lanes <= 32
    for t in range(rows * chunks):
        r, c = divmod(t, chunks)
        for m in (1 << s for s in range(lanes.bit_length() - 1)):
            partner = t ^ m
            assert partner // 32 == t // 32 and divmod(partner, chunks) == (r, c ^ m)


@pytest.mark.parametrize("dim,b", [(64, 64), (96, 32), (128, 128), (192, 64), (256, 256), (8, 8), (40, 8), (80, 16)])
def test_hadamard_size(dim, b):
    assert quant_mod.hadamard_size(dim) == b


def test_params_struct_layout():
    lay = quant_mod.PARAMS.layout()
    names = [f[0] for f in lay["fields"]]
    assert names[:3] == ["q", "k", "v"] and [n for n in names if n.startswith("sign_bits")] == \
        [f"sign_bits{i}" for i in range(quant_mod.SIGN_WORDS)]
    assert lay["size"] % 8 == 0 and quant_mod.SIGN_WORDS * 32 == quant_mod.MAX_HEAD_DIM


def test_render_both_dtypes():
    vs = [v for v in load_variants(Project(REPO)) if v.family == "quant"]
    for v in vs:
        src = render.render(v, REPO / "templates")
        tv = render.template_vars(v)
        assert tv["params_decls"] == render_decls([quant_mod.PARAMS])
        assert f"void __launch_bounds__(kThreads, kMinBlocks) {v.symbol('amax')}(" in src
        assert f"void __launch_bounds__(kThreads, kMinBlocks) {v.symbol('quant')}(" in src
        assert ("using InT = __nv_bfloat16;" in src) == (v.params["dtype"] == "bf16")
        assert "constexpr int kBlockRows = 64;" in src and '#include "flashgen/hadamard.cuh"' in src
        assert "p.sign_bits7" in src


# --------------------------------------------------------------------------------------
# Real nvcc (slow): 0 spills, registers, SASS
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_compile_no_spills_and_sass(tmp_path):
    from flashgen.generator.build import build
    from flashgen.generator.errors import ToolchainError
    from flashgen.generator.toolchain import find_cuobjdump, find_nvcc

    try:
        find_nvcc(), find_cuobjdump()
    except ToolchainError as e:
        pytest.fail(f"real-compile tests need nvcc and cuobjdump: {e}")
    proj = Project(REPO, build_override=tmp_path / "build")
    pick = select(load_variants(proj), "quant_bf16_*")
    assert len(pick) == 1
    res = build(proj, pick, jobs=2, log=lambda s: None)
    assert res.failed == [], res.failed
    (e,) = read_manifest(proj)["variants"]
    report = json.loads((proj.cache_dir / e["key"] / "report.json").read_text())
    assert report["compile_seconds"] < 30 and report["ptxas"]["bad_advisories"] == []
    for k in e["kernels"]:
        assert k["spill_bytes"] == 0 and k["stack_bytes"] == 0, k
        assert 0 < k["registers"] <= 65536 // (k["threads"] * 2)  # min_blocks 2: two CTAs per SM
    text = sass.dump(str(proj.build_dir / e["fatbin"]))
    funcs = sass.functions(text)
    quant, amax = funcs[pick[0].symbol("quant")], funcs[pick[0].symbol("amax")]
    # saturating e4m3 conversion, 16-byte read-once loads, 8-byte stores, warp butterflies
    assert quant.count("F2FP.SATFINITE.E4M3.F32.PACK_AB") == 4 * 8 * 4  # 4 per chunk, 8 chunks, 4 tile shapes
    for body in (quant, amax):
        assert "LDG.E.NA.128.CONSTANT" in body and "SHFL.BFLY" in body
        assert "LDL" not in body and "STL" not in body  # nothing in local memory
    assert "STG.E.64" in quant and "F2FP" not in amax
    assert sass.check(str(proj.build_dir / e["fatbin"]), {k["symbol"]: k["sass"] for k in e["kernels"]})


# --------------------------------------------------------------------------------------
# The reference transform: orthogonal, in float64
# --------------------------------------------------------------------------------------

def test_hadamard_matrix_is_sylvester():
    h = hadamard_matrix(8)
    assert torch.equal(h @ h.T, 8 * torch.eye(8, dtype=torch.float64))
    assert h[1].tolist() == [1, -1, 1, -1, 1, -1, 1, -1] and h[2].tolist() == [1, 1, -1, -1, 1, 1, -1, -1]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_reference_transform_keeps_qk(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 33, 4, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, 47, 4, head_dim, generator=g, dtype=torch.float64)
    k[0, 3, 1, 5] = 300.0  # an outlier
    s = incoherent_signs(head_dim, seed=11)
    qp, kp = incoherent_ref(q, s), incoherent_ref(k, s)
    ref = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert (torch.einsum("bqhd,bkhd->bhqk", qp, kp) - ref).abs().max().item() <= 1e-10 * ref.abs().max().item()
    # norms kept, and the outlier spread over its Hadamard block: B coordinates of 300 / sqrt(B)
    assert torch.allclose(qp.norm(dim=-1), q.norm(dim=-1), rtol=1e-12)
    b = hadamard_block(head_dim)
    assert kp[0, 3, 1].abs().max().item() < 300.0 / math.sqrt(b) + 6


def test_incoherent_signs_reproducible():
    s = incoherent_signs(128, seed=5)
    assert s.dtype == torch.float32 and s.shape == (128,) and set(s.tolist()) == {-1.0, 1.0}
    assert torch.equal(s, incoherent_signs(128, seed=5)) and not torch.equal(s, incoherent_signs(128, seed=6))
    bits = torch.randint(0, 2, (128,), generator=torch.Generator().manual_seed(5))
    assert torch.equal(s, 1.0 - 2.0 * bits.float())


def test_pack_sign_bits():
    assert Q.pack_sign_bits([True] + [False] * 31 + [False, True]) == (1, 2, 0, 0, 0, 0, 0, 0)
    assert Q.pack_sign_bits([True] * 256) == (0xFFFFFFFF,) * 8
    with pytest.raises(ValueError):
        Q.pack_sign_bits([False] * 257)


# --------------------------------------------------------------------------------------
# The emulated kernels
# --------------------------------------------------------------------------------------

def _f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _job(p: dict, which: int, dtype) -> dict:
    """The kernel's Job for tensor `which` (0 q, 1 k, 2 v) with host views of its arrays."""
    n = "qkv"[which]
    b = p["batch"]
    seqlen = p["seqlen_q"] if which == 0 else p["seqlen_k"]
    heads = p["heads"] if which == 0 else p["heads_k"]
    dim = p["head_dim_v"] if which == 2 else p["head_dim"]
    blocks = p["q_blocks"] if which == 0 else p["k_blocks"]
    block = bool(p["block_quant"]) and which != 2
    group = p["heads"] // p["heads_k"] if which == 0 and not block else 1
    strides = (p[f"{n}_stride_batch"], p[f"{n}_stride_seq"], p[f"{n}_stride_head"], 1)
    dshape = (b, heads, blocks) if block else (b, heads // group)
    return dict(
        x=host_view(p[n], dtype, (b, seqlen, heads, dim), strides),
        out=host_view(p[f"{n}8"], torch.uint8, (b * seqlen * heads * dim,), (1,)),
        descale=host_view(p[f"{n}_descale"], torch.float32, (math.prod(dshape),), (1,)),
        amax=host_view(p[f"{n}_amax"], torch.float32, (b * heads * blocks,), (1,)) if p[f"{n}_amax"] else None,
        seqlen=seqlen, heads=heads, dim=dim, blocks=blocks, group=group,
        rows=p["v_rows"] if which == 2 else p["qk_rows"],
        items_log2=p["v_items_log2"] if which == 2 else p["qk_items_log2"],
        transform=which != 2 and bool(p["incoherent"]), per_block=block)


def _fwht8(x: torch.Tensor) -> torch.Tensor:
    """flashgen/hadamard.cuh fwht8 on the last dim (8), stage by stage in float32."""
    x = x.clone()
    for h in (1, 2, 4):
        for i in range(8):
            if i & h == 0:
                a, b = x[..., i].clone(), x[..., i + h].clone()
                x[..., i], x[..., i + h] = a + b, a - b
    return x


def _tile(p: dict, J: dict, tile: int, quant: bool) -> None:
    """One CTA of templates/quant.cu.j2 (run_tile), vectorised over its 256 threads."""
    threads, items = quant_mod.THREADS, quant_mod.ITEMS
    C, R, kper = J["dim"] >> 3, J["rows"], 1 << J["items_log2"]
    kheads = items // kper
    t = torch.arange(threads)
    active, r0, c = t < R * C, t // C, t % C
    head_groups = -(-J["heads"] // kheads)
    hg, rest = tile % head_groups, tile // head_groups
    blk, b = rest % J["blocks"], rest // J["blocks"]
    h0, row0 = hg * kheads, blk * quant_mod.QUANT_BLOCK
    live = torch.zeros(items, threads, dtype=torch.bool)
    x = torch.empty(items, threads, 8, dtype=torch.float32)
    for i in range(items):
        j, ps = divmod(i, kper)
        row = r0 + ps * R
        lv = active & (row < quant_mod.QUANT_BLOCK) & (row0 + row < J["seqlen"]) & (h0 + j < J["heads"])
        live[i] = lv
        z = torch.zeros_like(t)
        rows = J["x"][torch.where(lv, b + z, z), torch.where(lv, row0 + row, z), torch.where(lv, h0 + j + z, z)]
        x[i] = rows.view(threads, C, 8)[t, torch.where(lv, c, z)].float()  # dead: the tensor's first chunk
    if J["transform"]:
        words = torch.tensor([p[f"sign_bits{w}"] for w in range(quant_mod.SIGN_WORDS)], dtype=torch.int64)
        byte = (words[c >> 2] >> ((c & 3) * 8)) & 0xFF
        neg = ((byte.view(-1, 1) >> torch.arange(8)) & 1).bool()  # (threads, 8)
        x = _fwht8(torch.where(neg, -x, x))
        m = 1
        while m < p["hadamard"] >> 3:
            other = x[:, t ^ m]
            x = torch.where(((c & m) != 0).view(1, -1, 1), other - x, x + other)
            m <<= 1
    hscale = _f32(p["hadamard_scale"]) if J["transform"] else _f32(1.0)
    own = quant and J["per_block"]
    heads_here = [h0 + j for j in range(kheads)]
    if not quant or own:
        amax = [torch.where(live[j * kper:(j + 1) * kper], x[j * kper:(j + 1) * kper].abs().amax(-1), _f32(0.0)).max()
                * hscale for j in range(kheads)]
    if not quant:
        for j, h in enumerate(heads_here):
            if h < J["heads"]:
                J["amax"][(b * J["heads"] + h) * J["blocks"] + blk] = amax[j]
        return
    if not own:
        amax = []
        for h in heads_here:
            h = min(h, J["heads"] - 1)
            first = (b * J["heads"] + h - h % J["group"]) * J["blocks"]
            amax.append(J["amax"][first:first + J["group"] * J["blocks"]].max())
    for j, h in enumerate(heads_here):
        descale = amax[j] / E4M3_MAX if amax[j] > 0 else _f32(1.0)
        dv = descale / hscale
        rcp = 1.0 / dv
        if h < J["heads"]:
            if own:
                J["descale"][(b * J["heads"] + h) * J["blocks"] + blk] = descale
            elif blk == 0 and h % J["group"] == 0:
                J["descale"][b * (J["heads"] // J["group"]) + h // J["group"]] = descale
        for ps in range(kper):
            i = j * kper + ps
            y = x[i] * rcp  # div_rn_by: two fmas, each rounded once (float64 holds them exactly enough)
            y = ((x[i].double() - y.double() * dv.double()).float().double() * rcp.double() + y.double()).float()
            q8 = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            for th in torch.nonzero(live[i]).flatten().tolist():
                row = row0 + int(r0[th]) + ps * R
                off = ((b * J["seqlen"] + row) * J["heads"] + h) * J["dim"] + int(c[th]) * 8
                J["out"][off:off + 8] = q8[th]


def emulate(role: str, grid: int, p: dict, dtype) -> None:
    """The ``role`` kernel of templates/quant.cu.j2 over ``grid`` CTAs (run: q tiles, k, v)."""
    quant = role == "quant"
    qk = quant or not p["block_quant"]
    nq, nk = (p["q_tiles"], p["k_tiles"]) if qk else (0, 0)
    jobs = {}
    for cta in range(grid):
        tile, which = cta, 2
        if tile < nq:
            which = 0
        elif tile - nq < nk:
            which, tile = 1, tile - nq
        else:
            tile -= nq + nk
        if which not in jobs:
            jobs[which] = _job(p, which, dtype)
        _tile(p, jobs[which], tile, quant)


class FakeKernel:
    def __init__(self, variant, role, device):
        self.variant, self.role, self.device = variant, role, device


class FakeGpu:
    """select_variant / get_kernel / launch stand-ins; `launch` runs :func:`emulate`."""

    def __init__(self, missing=()):
        self.missing = set(missing)
        self.selected, self.loaded, self.calls = [], [], []
        self.prepared_launches = 0  # launches through the prepared path (interface._quant_calls)

    def select_variant(self, family, key, manifest=None):
        self.selected.append((family, dict(key)))
        if key["dtype"] in self.missing:
            raise dispatch.MissingVariantError(f"flashgen: no built {family} variant serves dtype={key['dtype']}")
        return Variant(name=f"quant_{key['dtype']}_fake", family=family,
                       params={"family": family, "dtype": key["dtype"], "min_blocks": 2}, dispatch=dict(key),
                       kernels=())

    def get_kernel(self, variant, role, device):
        self.loaded.append((variant.name, role, device))
        return FakeKernel(variant, role, device)

    def prepare_launch(self, kernel, grid, params, per_call, counter=None):
        """launch.prepare_launch's stand-in: the fixed params with the per-call fields 0 (as packed)."""
        assert counter is None and set(per_call) <= set(params)
        return SimpleNamespace(kernel=kernel, grid=tuple(grid), params={**params, **{n: 0 for n in per_call}},
                               per_call=tuple(per_call))

    def launch_prepared(self, prep, tensor_maps, values, stream):
        """launch.launch_prepared's stand-in: the per-call values into the params, then :meth:`launch`."""
        assert len(values) == len(prep.per_call)
        self.prepared_launches += 1
        self.launch(prep.kernel, prep.grid, tensor_maps, {**prep.params, **dict(zip(prep.per_call, values))}, stream)

    def launch(self, kernel, grid, tensor_maps, params, stream, device=None):
        assert isinstance(kernel, FakeKernel) and tensor_maps == () and stream == STREAM
        assert set(params) == {f[0] for f in quant_mod.PARAMS.layout()["fields"]}  # every field, nothing else
        for k, v in params.items():
            assert type(v) is (float if k == "hadamard_scale" else int), (k, v)
        assert grid[1:] == (1, 1) and grid[0] > 0
        self.calls.append(dict(role=kernel.role, grid=tuple(grid), params=dict(params)))
        emulate(kernel.role, grid[0], params, _TORCH[kernel.variant.params["dtype"]])


@pytest.fixture
def fake_gpu(monkeypatch):
    fg = FakeGpu()
    patch_fake_gpu(monkeypatch, fg, STREAM, Q)
    monkeypatch.setattr(launch_mod, "prepare_launch", fg.prepare_launch)
    monkeypatch.setattr(launch_mod, "launch_prepared", fg.launch_prepared)
    monkeypatch.setattr(interface, "_quant_calls", {})
    return fg


def _inputs(b, sq, sk, h, hk, d, dv=None, dtype=torch.bfloat16, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        x = torch.randn(*shape, generator=g)
        if outliers:
            x = x + 10 * torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.01)
        return x.to(dtype)

    return r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, dv or d)


def assert_matches_reference(got, q, k, v, incoherent, block_quant, seed):
    """_ref.check_quantized: the bounds the GPU tests hold the real kernels to."""
    check_quantized(got, q, k, v, incoherent, block_quant, incoherent_signs(q.shape[-1], seed))


CASES = [  # b, sq, sk, h, hk, d, dv
    (2, 70, 130, 4, 2, 128, None),
    (1, 17, 64, 8, 1, 64, None),
    (2, 5, 113, 2, 2, 96, None),
    (1, 65, 33, 6, 3, 192, 128),
    (1, 64, 1, 2, 1, 256, 64),
    (3, 1, 9, 8, 8, 40, 8),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(str(x) for x in c if x is not None))
@pytest.mark.parametrize("incoherent,block_quant", [(True, True), (False, False), (True, False), (False, True)])
def test_emulated_kernels_match_reference(fake_gpu, case, incoherent, block_quant):
    b, sq, sk, h, hk, d, dv = case
    q, k, v = _inputs(b, sq, sk, h, hk, d, dv, seed=sum(case[:6]))
    got = quantize_fp8(q, k, v, incoherent=incoherent, block_quant=block_quant, seed=3)
    assert_matches_reference(got, q, k, v, incoherent, block_quant, 3)
    roles = [c["role"] for c in fake_gpu.calls]
    assert roles == ["amax", "quant"]  # v always needs the amax pass
    tq, tk, tv = Q.tile_counts(V.Problem(b, sq, sk, h, hk, d, dv or d, "bf16", 0))
    assert fake_gpu.calls[0]["grid"][0] == (0 if block_quant else tq + tk) + tv
    assert fake_gpu.calls[1]["grid"][0] == tq + tk + tv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_dtypes_and_dequantized_scores(fake_gpu, dtype):
    q, k, v = _inputs(2, 100, 90, 4, 2, 128, dtype=dtype, seed=9)
    q8, k8, v8, qd, kd, vd = got = quantize_fp8(q, k, v)
    assert fake_gpu.selected[0] == ("quant", {"dtype": {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]})
    assert_matches_reference(got, q, k, v, True, True, 0)
    # dequantized q' k'^T approximates q k^T (e4m3: 3 mantissa bits, ~3 % per element)
    s = torch.einsum("bqhd,bkhd->bhqk", dequantize_fp8(q8, qd), dequantize_fp8(k8, kd).repeat_interleave(2, 2))
    ref = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(2, 2))
    assert (s - ref).norm() / ref.norm() < 0.05
    assert ((dequantize_fp8(v8, vd) - v.float()).norm() / v.float().norm()).item() < 0.05


def test_strided_inputs_are_read_in_place(fake_gpu):
    """Slices of a packed qkv: last dim contiguous, 16-byte aligned rows: no copy, own strides."""
    b, s, h, d = 2, 70, 4, 64
    qkv = torch.randn(b, s, 3, h, d).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)
    got = quantize_fp8(q, k, v, seed=1)
    assert_matches_reference(got, q, k, v, True, True, 1)
    p = fake_gpu.calls[-1]["params"]
    assert (p["q"], p["k"], p["v"]) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert (p["q_stride_batch"], p["q_stride_seq"], p["q_stride_head"]) == q.stride()[:3] == (s * 3 * h * d, 3 * h * d, d)


def test_unaligned_inputs_are_copied(fake_gpu):
    """A last dim that is not contiguous, or rows not 16-byte aligned: a contiguous copy is read."""
    base = torch.randn(1, 20, 2, 66).to(torch.float16)
    q = base[..., 1:65]  # rows start 2 bytes in: not 16-byte aligned
    k = torch.randn(1, 20, 2, 64).to(torch.float16).transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) != 1
    v = torch.randn(1, 20, 2, 64).to(torch.float16)
    got = quantize_fp8(q, k, v, incoherent=False)
    assert_matches_reference(got, q, k, v, False, True, 0)
    p = fake_gpu.calls[-1]["params"]
    assert p["q"] != q.data_ptr() and p["k"] != k.data_ptr() and p["v"] == v.data_ptr()


def test_prepared_calls_match_the_direct_launch(fake_gpu):
    """A repeated call (same shapes, strides, dtypes, flags, seed) launches through its prepared launches
    (interface._quant_calls: validated once); their params are the direct launch's but for the addresses;
    a call of the same key whose inputs are not 16-byte aligned takes the direct path, on a copy."""
    q, k, v = _inputs(2, 70, 130, 4, 2, 128)
    first = quantize_fp8(q, k, v, seed=5)
    assert fake_gpu.prepared_launches == 2 and len(interface._quant_calls) == 1
    prepared = [c["params"] for c in fake_gpu.calls]
    buf = torch.empty(q.numel() + 4, dtype=q.dtype)
    q_odd = buf[4:].view(q.shape).copy_(q)  # 8 bytes past a 16-byte boundary: same key, address not aligned
    assert q_odd.stride() == q.stride() and q_odd.data_ptr() % 16
    second = quantize_fp8(q_odd, k, v, seed=5)
    assert fake_gpu.prepared_launches == 2 and len(interface._quant_calls) == 1  # the direct path, same entry
    direct = [c["params"] for c in fake_gpu.calls[2:]]
    assert [c["role"] for c in fake_gpu.calls] == ["amax", "quant"] * 2
    addresses = {"q", "k", "v", "q8", "k8", "v8", "q_descale", "k_descale", "v_descale", "q_amax", "k_amax", "v_amax"}
    for a, b in zip(prepared, direct):
        assert set(a) == set(b) and {n: a[n] for n in a if n not in addresses} == {n: b[n] for n in b if n not in addresses}
        assert b["q"] != q_odd.data_ptr()  # the copy
        assert (a["q_amax"] == 0) == (b["q_amax"] == 0) and (a["v_amax"] == 0) == (b["v_amax"] == 0)
    for x, y in zip(first, second):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)
    assert_matches_reference(second, q, k, v, True, True, 5)


def test_zero_input_gives_descale_one(fake_gpu):
    q = torch.zeros(1, 10, 2, 64, dtype=torch.bfloat16)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, q, q)
    assert torch.equal(qd, torch.ones(1, 2, 1)) and torch.equal(vd, torch.ones(1, 2))
    assert not q8.view(torch.uint8).any() and not v8.view(torch.uint8).any()


def test_saturation_and_exact_max(fake_gpu):
    """The amax element maps to 448 exactly (descale = amax / 448), nothing exceeds it."""
    q, k, v = _inputs(1, 64, 64, 1, 1, 64, seed=2)
    v[0, 7, 0, 3] = 1000.0
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, incoherent=False)
    assert v8[0, 7, 0, 3].float().item() == E4M3_MAX and vd.item() == pytest.approx(1000.0 / 448, rel=1e-6)
    assert v8.float().abs().max().item() == E4M3_MAX and not v8.float().isnan().any()


@pytest.mark.parametrize("shape_q,shape_k,launches", [
    ((0, 5, 4, 64), (0, 7, 2, 64), 0),
    ((2, 0, 4, 64), (2, 0, 2, 64), 0),
    ((2, 0, 4, 64), (2, 7, 2, 64), 2),  # q empty, k / v still quantized
    ((2, 5, 4, 64), (2, 0, 2, 64), 1),  # k / v empty: only q's quant pass (block scales)
])
@pytest.mark.parametrize("block_quant", [True, False])
def test_empty_problems(fake_gpu, shape_q, shape_k, launches, block_quant):
    q = torch.randn(shape_q).to(torch.bfloat16)
    k = torch.randn(shape_k).to(torch.bfloat16)
    got = quantize_fp8(q, k, k, block_quant=block_quant)
    assert_matches_reference(got, q, k, k, True, block_quant, 0)
    expect = launches if block_quant or launches == 0 else 2
    assert len(fake_gpu.calls) == expect


def test_plan_cached_and_missing_variant(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 1, 1, 64)
    quantize_fp8(q, k, v)
    quantize_fp8(q, k, v)
    assert fake_gpu.selected == [("quant", {"dtype": "bf16"})]
    assert fake_gpu.loaded == [("quant_bf16_fake", "amax", 0), ("quant_bf16_fake", "quant", 0)]
    fake_gpu.missing.add("fp16")
    with pytest.raises(dispatch.MissingVariantError, match="dtype=fp16"):
        quantize_fp8(*(x.half() for x in (q, k, v)))
    assert ("fp16", 0) not in Q._plans


def test_not_hopper(fake_gpu, monkeypatch):
    monkeypatch.setattr(core, "device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match="Hopper"):
        quantize_fp8(*_inputs(1, 8, 8, 1, 1, 64))
    assert fake_gpu.calls == []


def test_exports():
    assert flashgen.QUANT_BLOCK == 64 == quant_mod.QUANT_BLOCK
    assert flashgen.quantize_fp8 is quantize_fp8
    for word in ("flash_attn_func(q8, k8, v8, q_descale=q_descale", "arXiv 2407.08608", "Walsh-Hadamard",
                 "(batch, heads, ceil(seqlen_q / 64))", "Raises:"):
        assert word in quantize_fp8.__doc__, word


# --------------------------------------------------------------------------------------
# Argument errors (before any variant lookup or launch)
# --------------------------------------------------------------------------------------

def _raises(fake_gpu, exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        quantize_fp8(*args, **kwargs)
    assert fake_gpu.calls == [] and fake_gpu.selected == []
    assert str(info.value).startswith("flashgen: quantize_fp8: ")
    return info.value


def test_cpu_tensors_rejected_without_patch():
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor.*cpu"):
        quantize_fp8(*_inputs(1, 8, 8, 1, 1, 64))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(fake_gpu, which):
    args = dict(zip("qkv", _inputs(1, 8, 8, 1, 1, 64)))
    args[which] = [1.0]
    _raises(fake_gpu, TypeError, f"{which} must be a torch.Tensor, got list", args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_input_dtype(fake_gpu, dtype):
    q, k, v = _inputs(1, 8, 8, 1, 1, 64)
    _raises(fake_gpu, TypeError, rf"k must have dtype float16 or bfloat16, got {dtype}", q, k.to(dtype), v)


def test_dtypes_differ(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 1, 1, 64)
    _raises(fake_gpu, TypeError, "q, k and v must have the same dtype", q, k.half(), v)


@pytest.mark.parametrize("make,match", [
    (lambda q, k, v: (q[0], k, v), r"q must be 4-D \(batch, seqlen_q, heads, head_dim\)"),
    (lambda q, k, v: (q[..., :60], k[..., :60], v), "head_dim .* must be a multiple of 8"),
    (lambda q, k, v: (q, k, v[..., :12]), "head_dim_v .* must be a multiple of 8"),
    (lambda q, k, v: (q, k[:, :, :1], v), r"k and v must have the same number of heads"),
    (lambda q, k, v: (q[:, :, :3], k, v), r"heads of q \(3\) must be a multiple of heads_k of k/v \(2\)"),
    (lambda q, k, v: (q, k[:, :4], v), "k and v must have the same seqlen_k"),
])
def test_shape_errors(fake_gpu, make, match):
    q, k, v = _inputs(1, 8, 8, 4, 2, 64)
    _raises(fake_gpu, ValueError, match, *make(q, k, v))


def test_head_dim_above_256(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 1, 1, 264)
    _raises(fake_gpu, ValueError, "must be a multiple of 8 between 8 and 256, got 264", q, k, v)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(incoherent=1), TypeError, "incoherent must be a bool, got int 1"),
    (dict(block_quant="yes"), TypeError, "block_quant must be a bool, got str 'yes'"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(seed=True), TypeError, "seed must be an int"),
    (dict(seed=-1), ValueError, r"seed must be between 0 and 18446744073709551615, got -1"),
    (dict(seed=2**64), ValueError, "seed must be between"),
])
def test_flag_errors(fake_gpu, kw, exc, match):
    _raises(fake_gpu, exc, match, *_inputs(1, 8, 8, 1, 1, 64), **kw)


def test_every_problem_is_reported(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 4, 2, 64)
    e = _raises(fake_gpu, flashgen.InputError, "4 problems with the arguments", q.float(), k[..., :60], v, seed=-2,
                block_quant=None)
    msg = str(e)
    for part in ("q must have dtype float16 or bfloat16", "k must have q's head_dim", "block_quant must be a bool",
                 "seed must be between"):
        assert part in msg, part


def test_ops_entry_point_validates(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 4, 2, 64)
    with pytest.raises(ValueError, match="heads of q"):
        torch.ops.flashgen.quantize_fp8(q[:, :, :3], k, v, True, True, 0)
    assert fake_gpu.calls == []


def test_launch_refuses_what_the_kernels_cannot_serve(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 1, 1, 64)
    p = Q.check_quantize(interface._array_info(q), interface._array_info(k), interface._array_info(v))
    outs = interface._quant_outputs(q, interface._quant_shapes(p, True))
    arg = interface._tensor_arg
    good = [arg(x, "bf16", 0) for x in (q, k, v)] + [arg(x, "fp8_e4m3", 0) for x in outs[:3]] + \
        [arg(x, "fp32", 0) for x in outs[3:]]
    bad = list(good)
    bad[0] = good[0]._replace(strides=(512, 64, 64, 2))
    bad[4] = good[4]._replace(dtype="bf16")
    bad[7] = good[7]._replace(shape=(1, 1, 2))
    with pytest.raises(ValueError) as ei:
        Q.quantize_fp8_launch(*bad, 0, p, True, True, (0,) * 8, STREAM)
    msg = str(ei.value)
    assert "q (strides" in msg and "k8 must be a contiguous e4m3" in msg and "k_descale has shape" in msg
    assert fake_gpu.calls == []
    workspace = interface._workspace(q, Q.workspace_layout(p, True)[0])
    assert workspace.data_ptr() % 256 == 0  # (interface._workspace aligns what the CPU allocator gives)
    with pytest.raises(ValueError, match="workspace_ptr must be 256-byte aligned"):
        Q.quantize_fp8_launch(*good, workspace.data_ptr() + 64, p, False, True, (0,) * 8, STREAM)
    assert fake_gpu.calls == []
    Q.quantize_fp8_launch(*good, workspace.data_ptr(), p, False, True, (0,) * 8, STREAM)
    assert [c["role"] for c in fake_gpu.calls] == ["amax", "quant"]


# --------------------------------------------------------------------------------------
# Fake implementation, opcheck, torch.compile
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_quant", [True, False])
def test_fake_impl_matches_real_metadata(fake_gpu, block_quant):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _inputs(2, 70, 33, 4, 2, 64, 128)
    real = torch.ops.flashgen.quantize_fp8(q, k, v, True, block_quant, 0)
    with FakeTensorMode() as mode:
        fake = torch.ops.flashgen.quantize_fp8(*(mode.from_tensor(x) for x in (q, k, v)), True, block_quant, 0)
    for r, f in zip(real, fake):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype and f.stride() == r.stride()


def test_opcheck(fake_gpu):
    q, k, v = _inputs(1, 20, 20, 2, 1, 64)
    torch.library.opcheck(torch.ops.flashgen.quantize_fp8.default, (q, k, v, True, True, 0))
    torch.library.opcheck(torch.ops.flashgen.quantize_fp8.default, (q, k, v, False, False, 7))


def test_compile_fullgraph(fake_gpu):
    torch._dynamo.reset()

    def f(q, k, v):
        q8, k8, v8, qd, kd, vd = quantize_fp8(q, k, v, seed=4)
        return q8.float().sum() * qd.sum(), k8.view(torch.uint8), vd + 1

    q, k, v = _inputs(1, 70, 40, 2, 1, 64)
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_grad_inputs_go_through_the_op(fake_gpu):
    q, k, v = _inputs(1, 8, 8, 1, 1, 64)
    q.requires_grad_(True)
    q8, *_ = quantize_fp8(q, k, v)
    assert len(fake_gpu.calls) == 2 and q8.dtype == torch.float8_e4m3fn
