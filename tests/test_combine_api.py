"""CPU tests of the split-KV combine API (flashgen.combine, flashgen.interface.flash_attn_combine,
flashgen.dlpack_api.flash_attn_combine_dlpack): argument checks, launch arguments (grid, strides,
vec4, LSE layout), variant/kernel caching, empty problems, fake implementations and torch.compile.

No GPU here. The `fake_gpu` fixture makes CPU tensors count as CUDA device 0 (capability 9.0) and
replaces `flashgen.dispatch.select_variant`, `flashgen.launch.get_kernel` and
`flashgen.launch.launch` with fakes; the fake launch emulates the kernel through the raw params it
receives (host addresses + element strides), so a wrong pointer, stride, grid or LSE layout gives
a wrong result here, as it would on the GPU. The kernel's arithmetic itself is tested on the GPU
(tests/gpu/test_combine_gpu.py).
"""

from __future__ import annotations

import sys
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import flashgen.combine as C
import flashgen.core as core
import flashgen.dispatch as dispatch
import flashgen.dlpack_api as dlpack_api
import flashgen.interface as interface
import flashgen.launch as launch
from flashgen import _validate as V
from flashgen.interface import flash_attn_combine
from flashgen.manifest import Variant

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the shared references (torch only)
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from _ref import combine_ref  # noqa: E402
from fgutil import host_view as _strided, patch_fake_gpu, torch_allocates_on_cpu  # noqa: E402

_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STREAM = 4321


# --------------------------------------------------------------------------------------
# float64 reference and the emulated kernel
# --------------------------------------------------------------------------------------





class FakeKernel:
    def __init__(self, variant, role, device):
        self.variant, self.role, self.device = variant, role, device


class FakeGpu:
    """select_variant / get_kernel / launch stand-ins; `launch` runs the combine on the CPU
    through the params (as the kernel would) and checks what the kernel relies on."""

    def __init__(self, block_m=16, missing=()):
        self.block_m = block_m
        self.missing = set(missing)
        self.selected, self.loaded, self.calls = [], [], []

    def select_variant(self, family, key, manifest=None):
        self.selected.append((family, dict(key)))
        if key.get("dtype") in self.missing:
            raise dispatch.MissingVariantError(f"flashgen: no built {family} variant serves dtype={key['dtype']}")
        return Variant(name=f"combine_{key['dtype']}_fake", family=family,
                       params={"family": family, "dtype": key["dtype"], "block_m": self.block_m, "threads": 128},
                       dispatch=dict(key), kernels=())

    def get_kernel(self, variant, role, device):
        self.loaded.append((variant.name, role, device))
        return FakeKernel(variant, role, device)

    def launch(self, kernel, grid, tensor_maps, params, stream, device=None):
        assert isinstance(kernel, FakeKernel) and kernel.role == "main"
        assert tensor_maps == ()
        self.calls.append(dict(kernel=kernel, grid=tuple(grid), params=dict(params), stream=stream, device=device))
        p = params
        ns, b, s, h, d = (p[k] for k in ("num_splits", "batch", "seqlen", "heads", "head_dim"))
        rows = b * h * s
        bm = kernel.variant.params["block_m"]
        assert rows > 0 and tuple(grid) == (-(-rows // bm), 1, 1)
        for k, v in p.items():
            assert type(v) is int, (k, v)  # the packer takes Python ints for i32/i64/ptr fields
        odt = _TORCH[kernel.variant.params["dtype"]]
        es = torch.empty((), dtype=odt).element_size()
        if p["vec4"]:  # what a float4 load / 4-element store needs, or the GPU faults
            assert d % 4 == 0 and p["out_partial"] % 16 == 0 and p["out"] % (4 * es) == 0
            for n, st in ((ns, p["op_stride_split"]), (b, p["op_stride_batch"]), (s, p["op_stride_seq"]),
                          (h, p["op_stride_head"]), (b, p["o_stride_batch"]), (s, p["o_stride_seq"]),
                          (h, p["o_stride_head"])):
                assert n == 1 or st % 4 == 0
        op = _strided(p["out_partial"], torch.float32, (ns, b, s, h, d),
                      (p["op_stride_split"], p["op_stride_batch"], p["op_stride_seq"], p["op_stride_head"], 1))
        lp = _strided(p["lse_partial"], torch.float32, (ns, b, s, h),
                      (p["lp_stride_split"], p["lp_stride_batch"], p["lp_stride_seq"], p["lp_stride_head"]))
        out = _strided(p["out"], odt, (b, s, h, d), (p["o_stride_batch"], p["o_stride_seq"], p["o_stride_head"], 1))
        lse_rows = _strided(p["lse"], torch.float32, (rows,), (1,))  # the kernel writes lse[r], r = (b*h + h)*s + l
        ref_out, ref_lse = combine_ref(op, lp)
        out.copy_(ref_out.to(odt))
        lse_rows.copy_(ref_lse.permute(0, 2, 1).reshape(-1).float())


@pytest.fixture
def fake_gpu(monkeypatch):
    fg = FakeGpu()
    patch_fake_gpu(monkeypatch, fg, STREAM, C)
    return fg


def partials(ns=3, b=2, s=5, h=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ns, b, s, h, d, generator=g), torch.randn(ns, b, s, h, generator=g) * 3


def assert_matches(out, lse, out_partial, lse_partial):
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.allclose(out.double(), ref_out, atol=1e-2 if out.dtype != torch.float32 else 1e-6, rtol=1e-2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-6, rtol=1e-6)


def assert_fa3_lse_layout(lse, b, s, h):
    """float32 (b, s, h), the transpose(1, 2) view of a contiguous (b, h, s) buffer."""
    assert lse.dtype == torch.float32 and lse.shape == (b, s, h)
    assert lse.stride() == (h * s, 1, s)
    assert lse.transpose(1, 2).is_contiguous()


# --------------------------------------------------------------------------------------
# Working calls: results and launch arguments
# --------------------------------------------------------------------------------------

def test_default_call_launch_arguments(fake_gpu):
    op, lp = partials(ns=3, b=2, s=5, h=4, d=64)
    out, lse = flash_attn_combine(op, lp)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 4, 64) and out.is_contiguous()
    assert_fa3_lse_layout(lse, 2, 5, 4)
    assert_matches(out, lse, op, lp)
    (call,) = fake_gpu.calls
    p = call["params"]
    assert call["grid"] == (3, 1, 1)  # 2 * 4 * 5 = 40 rows, 16 per CTA
    assert call["stream"] == STREAM and call["device"] == 0
    assert p["out_partial"] == op.data_ptr() and p["lse_partial"] == lp.data_ptr()
    assert p["out"] == out.data_ptr() and p["lse"] == lse.data_ptr()
    assert (p["op_stride_split"], p["op_stride_batch"], p["op_stride_seq"], p["op_stride_head"]) == op.stride()[:4]
    assert (p["lp_stride_split"], p["lp_stride_batch"], p["lp_stride_seq"], p["lp_stride_head"]) == lp.stride()
    assert (p["o_stride_batch"], p["o_stride_seq"], p["o_stride_head"]) == out.stride()[:3]
    assert (p["num_splits"], p["batch"], p["seqlen"], p["heads"], p["head_dim"]) == (3, 2, 5, 4, 64)
    assert p["vec4"] == 1
    assert fake_gpu.selected == [("combine", {"dtype": "fp32"})]
    assert fake_gpu.loaded == [("combine_fp32_fake", "main", 0)]


@pytest.mark.parametrize("out_dtype,name", [(torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                            (torch.float32, "fp32")])
def test_out_dtype_selects_the_variant(fake_gpu, out_dtype, name):
    op, lp = partials()
    out, lse = flash_attn_combine(op, lp, out_dtype=out_dtype)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert fake_gpu.selected == [("combine", {"dtype": name})]
    assert_matches(out, lse, op, lp)


@pytest.mark.parametrize("block_m,rows_shape,grid", [
    (4, (1, 1, 1), 1), (4, (1, 7, 3), 6), (32, (3, 113, 2), 22), (16, (2, 16, 1), 2), (16, (2, 17, 1), 3),
])
def test_grid_is_rows_over_block_m(fake_gpu, block_m, rows_shape, grid):
    fake_gpu.block_m = block_m
    b, s, h = rows_shape
    op, lp = partials(ns=2, b=b, s=s, h=h, d=8)
    out, lse = flash_attn_combine(op, lp)
    assert fake_gpu.calls[0]["grid"] == (grid, 1, 1)
    assert_matches(out, lse, op, lp)


def test_fa3_non_contiguous_inputs_are_used_in_place(fake_gpu):
    ns, b, h, s, d = 3, 2, 4, 7, 64
    g = torch.Generator().manual_seed(3)
    op = torch.randn(2 * ns, b, h, s, d, generator=g).transpose(2, 3)[::2]
    lp = torch.randn(ns, b, 2 * h, s, generator=g).transpose(-1, -2)[:, :, :, ::2]
    assert not op.is_contiguous() and not lp.is_contiguous() and op.stride(-1) == 1
    out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    p = fake_gpu.calls[0]["params"]
    assert p["out_partial"] == op.data_ptr() and p["lse_partial"] == lp.data_ptr()
    assert (p["op_stride_split"], p["op_stride_batch"], p["op_stride_seq"], p["op_stride_head"]) == op.stride()[:4]
    assert (p["lp_stride_split"], p["lp_stride_batch"], p["lp_stride_seq"], p["lp_stride_head"]) == lp.stride()
    assert p["lp_stride_seq"] == 1 and p["lp_stride_head"] == 2 * s and p["op_stride_split"] == 2 * b * h * s * d
    assert_matches(out, lse, op, lp)


def test_empty_splits_and_all_empty_rows(fake_gpu):
    ns, b, s, h, d = 5, 3, 4, 2, 16
    op, lp = partials(ns, b, s, h, d)
    lp[ns // 2:, : b // 3 + 1] = -math.inf
    op[ns // 2:, : b // 3 + 1] = math.nan  # partials of empty splits are garbage
    lp[:, 2, 1, 0] = -math.inf  # one row with every split empty
    out, lse = flash_attn_combine(op, lp)
    assert not out.isnan().any()
    assert torch.equal(out[2, 1, 0], torch.zeros(d)) and lse[2, 1, 0] == -math.inf
    assert_matches(out, lse, op, lp)


@pytest.mark.parametrize("case", ["aligned", "head_dim_62", "head_dim_2", "op_base_misaligned",
                                  "out_row_stride_odd", "out_bf16_base_8_bytes_off", "op_split_stride_odd",
                                  "extent_one_odd_stride", "out_fp32_base_8_bytes_off"])
def test_vec4_decision(fake_gpu, case):
    ns, b, s, h, d = 2, 2, 3, 2, 64
    out_dtype = torch.float32
    out = None
    expect = 0
    if case == "aligned":
        op, lp = partials(ns, b, s, h, d)
        expect = 1
    elif case in ("head_dim_62", "head_dim_2"):
        op, lp = partials(ns, b, s, h, 62 if case == "head_dim_62" else 2)
    elif case == "op_base_misaligned":
        src, lp = partials(ns, b, s, h, d)
        flat = torch.empty(src.numel() + 4)
        op = flat[1:1 + src.numel()].view(src.shape)  # 4 bytes past a 16-byte boundary
        op.copy_(src)
        assert op.data_ptr() % 16 == 4
    elif case == "out_row_stride_odd":
        op, lp = partials(ns, b, s, h, d)
        out = torch.empty(b, s, h, d + 2)[..., :d]  # head stride 66: not a multiple of 4 elements
    elif case == "out_bf16_base_8_bytes_off":
        op, lp = partials(ns, b, s, h, d)
        out_dtype = torch.bfloat16
        flat = torch.empty(b * s * h * d + 8, dtype=torch.bfloat16)
        base = (-flat.data_ptr() // 2) % 8  # elements to a 16-byte boundary
        out = flat[base + 2: base + 2 + b * s * h * d].view(b, s, h, d)  # 4 bytes off: not 8-byte aligned
        assert out.data_ptr() % 8 == 4
    elif case == "out_fp32_base_8_bytes_off":
        op, lp = partials(ns, b, s, h, d)
        flat = torch.empty(b * s * h * d + 8)
        base = (-flat.data_ptr() // 4) % 4
        out = flat[base + 2: base + 2 + b * s * h * d].view(b, s, h, d)
        assert out.data_ptr() % 16 == 8
    elif case == "op_split_stride_odd":
        big, lp = partials(ns, b, s, h, d)
        flat = torch.empty(ns * (b * s * h * d + 1))
        op = flat.as_strided((ns, b, s, h, d), (b * s * h * d + 1, s * h * d, h * d, d, 1))
        op.copy_(big)
    elif case == "extent_one_odd_stride":  # seqlen 1 (decode): its stride is never stepped
        src, lp = partials(ns, b, 1, h, d)
        flat = torch.empty(src.numel() * 2)
        op = flat.as_strided(src.shape, (b * h * d, h * d, 3, d, 1))
        op.copy_(src)
        expect = 1
    if out is not None:
        r_out, lse = flash_attn_combine(op, lp, out=out, out_dtype=out_dtype)
        assert r_out is out
    else:
        out, lse = flash_attn_combine(op, lp, out_dtype=out_dtype)
    assert fake_gpu.calls[0]["params"]["vec4"] == expect
    assert_matches(out, lse, op, lp)


def test_use_vec4_direct():
    def arg(ptr, shape, strides, dtype="fp32"):
        return core.TensorArg(ptr, shape, strides, dtype, 0)

    op = arg(0x1000, (2, 1, 1, 1, 128), (128, 128, 128, 128, 1))
    assert C.use_vec4(op, arg(0x2000, (1, 1, 1, 128), (128, 128, 128, 1)))
    assert C.use_vec4(op, arg(0x2008, (1, 1, 1, 128), (128, 128, 128, 1), "bf16"))
    assert not C.use_vec4(op, arg(0x2004, (1, 1, 1, 128), (128, 128, 128, 1), "bf16"))
    assert not C.use_vec4(op, arg(0x2008, (1, 1, 1, 128), (128, 128, 128, 1), "fp32"))
    assert not C.use_vec4(op._replace(ptr=0x1008), arg(0x2000, (1, 1, 1, 128), (128, 128, 128, 1)))
    assert not C.use_vec4(op._replace(strides=(130, 128, 128, 128, 1)), arg(0x2000, (1, 1, 1, 128), (128,) * 3 + (1,)))


def test_given_out_is_written_in_place_with_its_strides(fake_gpu):
    ns, b, s, h, d = 4, 2, 3, 5, 32
    op, lp = partials(ns, b, s, h, d)
    storage = torch.full((b, h, s, d + 8), math.nan, dtype=torch.float16)
    out = storage.transpose(1, 2)[..., :d]  # BHSD storage seen as BSHD, padded rows
    r_out, lse = flash_attn_combine(op, lp, out=out, out_dtype=torch.float16)
    assert r_out is out
    assert_fa3_lse_layout(lse, b, s, h)
    p = fake_gpu.calls[0]["params"]
    assert p["out"] == out.data_ptr()
    assert (p["o_stride_batch"], p["o_stride_seq"], p["o_stride_head"]) == out.stride()[:3]
    assert not out.isnan().any()
    assert torch.isnan(storage[..., d:]).all()  # padding untouched
    assert_matches(out, lse, op, lp)


@pytest.mark.parametrize("shape", [(3, 0, 5, 4, 64), (3, 2, 0, 4, 64), (3, 2, 5, 0, 64), (1, 0, 0, 0, 8)])
@pytest.mark.parametrize("given_out", [False, True])
def test_empty_problems_launch_nothing(fake_gpu, shape, given_out):
    op = torch.randn(shape)
    lp = torch.randn(shape[:4])
    ns, b, s, h, d = shape
    if given_out:
        out = torch.empty(b, s, h, d, dtype=torch.bfloat16)
        r_out, lse = flash_attn_combine(op, lp, out=out, out_dtype=torch.bfloat16)
        assert r_out is out
    else:
        r_out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
        assert r_out.shape == (b, s, h, d) and r_out.dtype == torch.bfloat16
    assert lse.shape == (b, s, h) and lse.dtype == torch.float32
    assert fake_gpu.calls == []


def test_attention_combine_empty_selects_but_does_not_launch(fake_gpu):
    t = lambda shape, dtype="fp32": core.TensorArg(0, shape, tuple(1 for _ in shape), dtype, 0)  # noqa: E731
    var = C.attention_combine(t((2, 0, 3, 4, 8)), t((2, 0, 3, 4)), t((0, 3, 4, 8), "bf16"), t((0, 3, 4)), "bf16", 9)
    assert var.name == "combine_bf16_fake" and fake_gpu.calls == []


def test_plan_is_cached_per_dtype_and_device(fake_gpu):
    op, lp = partials()
    for _ in range(3):
        flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    flash_attn_combine(op, lp)
    assert fake_gpu.selected == [("combine", {"dtype": "bf16"}), ("combine", {"dtype": "fp32"})]
    assert [l[0] for l in fake_gpu.loaded] == ["combine_bf16_fake", "combine_fp32_fake"]
    assert len(fake_gpu.calls) == 4


def test_missing_variant_propagates_and_is_not_cached(fake_gpu):
    fake_gpu.missing = {"fp16"}
    op, lp = partials()
    with pytest.raises(dispatch.MissingVariantError, match="dtype=fp16"):
        flash_attn_combine(op, lp, out_dtype=torch.float16)
    assert fake_gpu.calls == []
    fake_gpu.missing = set()  # e.g. built meanwhile with `flashgen add-variant combine --dtype fp16`
    out, _ = flash_attn_combine(op, lp, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and len(fake_gpu.calls) == 1


def test_not_hopper(fake_gpu, monkeypatch):
    monkeypatch.setattr(core, "device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 9\.x"):
        flash_attn_combine(*partials())
    assert fake_gpu.calls == []


def test_max_splits_matches_the_family_module():
    fam = pytest.importorskip("flashgen.generator.families.combine")
    assert C.MAX_SPLITS == fam.MAX_SPLITS and C.MAX_HEAD_DIM == fam.MAX_HEAD_DIM
    assert set(C.OUT_DTYPES) == set(fam.DTYPES)
    fields = [f.name for f in fam.PARAMS.fields]
    op, lp = partials()
    captured = {}

    class K:
        variant = Variant(name="x", family="combine", params={"block_m": 8, "dtype": "fp32"}, dispatch={}, kernels=())
        role = "main"

    def fake_launch(kernel, grid, maps, params, stream, device=None):
        captured.update(params)

    t = lambda x, dt="fp32": core.TensorArg(x.data_ptr(), tuple(x.shape), x.stride(), dt, 0)  # noqa: E731
    out = torch.empty(2, 5, 4, 64)
    lse = torch.empty(2, 4, 5)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(C, "_plans", {("fp32", 0): C._Plan(K.variant, K(), 8)})
        mp.setattr(launch, "launch", fake_launch)
        C.attention_combine(t(op), t(lp), t(out), t(lse), "fp32", 0)
    finally:
        mp.undo()
    assert sorted(captured) == sorted(fields)  # every struct field given, nothing else


# --------------------------------------------------------------------------------------
# Validation errors (all before any variant lookup or launch)
# --------------------------------------------------------------------------------------

def _raises(fake_gpu, exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        flash_attn_combine(*args, **kwargs)
    assert fake_gpu.calls == [] and fake_gpu.selected == []
    return info.value


def test_cpu_tensors_rejected_without_patch():
    with pytest.raises(ValueError, match=r"out_partial must be a CUDA tensor.*cpu"):
        flash_attn_combine(*partials())


@pytest.mark.parametrize("which", ["out_partial", "lse_partial", "out"])
def test_not_a_tensor(fake_gpu, which):
    args = dict(zip(("out_partial", "lse_partial"), partials()))
    args[which] = np.zeros(3)
    _raises(fake_gpu, TypeError, f"{which} must be a torch.Tensor", **args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_out_partial_dtype(fake_gpu, dtype):
    op, lp = partials()
    _raises(fake_gpu, TypeError, r"out_partial must have dtype float32.*" + str(dtype), op.to(dtype), lp)


def test_lse_partial_dtype(fake_gpu):
    op, lp = partials()
    _raises(fake_gpu, TypeError, r"lse_partial must have dtype float32.*torch.bfloat16", op, lp.bfloat16())


@pytest.mark.parametrize("out_dtype,exc,match", [
    (torch.int8, TypeError, r"out_dtype must be torch.float32, torch.bfloat16 or torch.float16.*torch.int8"),
    (torch.float64, TypeError, r"out_dtype must be .*torch.float64"),
    ("bf16", TypeError, r"out_dtype must be a torch.dtype"),
])
def test_out_dtype_errors(fake_gpu, out_dtype, exc, match):
    _raises(fake_gpu, exc, match, *partials(), out_dtype=out_dtype)


@pytest.mark.parametrize("op_shape,lp_shape,match", [
    ((2, 5, 4, 64), (3, 2, 5, 4), r"out_partial must be 5-D \(num_splits, batch, seqlen, heads, head_dim\), got 4-D"),
    ((3, 2, 5, 4, 64), (3, 2, 5), r"lse_partial must be 4-D .* got 3-D"),
    ((3, 2, 5, 4, 64), (3, 2, 4, 5), r"lse_partial must have shape .*\(3, 2, 5, 4\) to match out_partial"),
    ((3, 2, 5, 4, 64), (2, 2, 5, 4), r"lse_partial must have shape"),
    ((0, 2, 5, 4, 64), (0, 2, 5, 4), r"num_splits \(dim 0 of out_partial\) must be between 1 and 256, got 0"),
    ((257, 1, 1, 1, 8), (257, 1, 1, 1), r"num_splits .* got 257"),
    ((2, 1, 3, 2, 257), (2, 1, 3, 2), r"head_dim \(dim 4 of out_partial\) must be between 1 and 256, got 257"),
    ((2, 1, 3, 2, 0), (2, 1, 3, 2), r"head_dim .* got 0"),
])
def test_shape_errors(fake_gpu, op_shape, lp_shape, match):
    _raises(fake_gpu, ValueError, match, torch.zeros(op_shape), torch.zeros(lp_shape))


def test_limits_are_inclusive(fake_gpu):
    out, lse = flash_attn_combine(torch.randn(256, 1, 1, 1, 1), torch.randn(256, 1, 1, 1))
    assert out.shape == (1, 1, 1, 1) and fake_gpu.calls[0]["params"]["vec4"] == 0
    out, lse = flash_attn_combine(torch.randn(1, 1, 2, 1, 256), torch.randn(1, 1, 2, 1))
    assert out.shape == (1, 2, 1, 256) and fake_gpu.calls[1]["params"]["vec4"] == 1


def test_out_partial_last_dim_not_contiguous(fake_gpu):
    op, lp = partials()
    op = op.transpose(-1, -2).contiguous().transpose(-1, -2)
    _raises(fake_gpu, ValueError, r"out_partial's last dim \(head_dim\) must be contiguous", op, lp)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: torch.empty(2, 5, 4, 32), ValueError, r"out must have shape \(batch, seqlen, heads, head_dim\) = \(2, 5, 4, 64\)"),
    (lambda: torch.empty(2, 5, 4, 64, 1), ValueError, r"out must have shape"),
    (lambda: torch.empty(2, 5, 4, 64, dtype=torch.bfloat16), TypeError, r"out has dtype torch.bfloat16 but out_dtype is fp32"),
    (lambda: torch.empty(2, 5, 64, 4).transpose(-1, -2), ValueError, r"out's last dim \(head_dim\) must be contiguous"),
    (lambda: torch.empty(2, 5, 1, 64).expand(2, 5, 4, 64), ValueError, r"out's elements may share memory"),
])
def test_out_errors(fake_gpu, make, exc, match):
    _raises(fake_gpu, exc, match, *partials(), out=make())


def test_out_on_another_device(fake_gpu, monkeypatch):
    op, lp = partials()
    out = torch.empty(2, 5, 4, 64)
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1) if t is out else (True, 0))
    _raises(fake_gpu, ValueError, r"out must be on out_partial's CUDA device", op, lp, out=out)


def test_out_on_host(fake_gpu, monkeypatch):
    op, lp = partials()
    out = torch.empty(2, 5, 4, 64)
    monkeypatch.setattr(interface, "_device_of", lambda t: (False, None) if t is out else (True, 0))
    _raises(fake_gpu, ValueError, r"out must be on out_partial's CUDA device .*cpu", op, lp, out=out)


def test_lse_partial_on_another_device(fake_gpu, monkeypatch):
    op, lp = partials()
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1) if t is lp else (True, 0))
    _raises(fake_gpu, ValueError, r"lse_partial must be on out_partial's device", op, lp)


def test_every_problem_is_reported(fake_gpu):
    op = torch.zeros(3, 2, 5, 4, 64, dtype=torch.float16)
    lp = torch.zeros(3, 2, 5, 7)
    err = _raises(fake_gpu, C.CombineArgumentError, r"3 problems", op, lp,
                  out=torch.empty(2, 5, 4, 64, dtype=torch.bfloat16), out_dtype=torch.float16)
    assert isinstance(err, TypeError) and isinstance(err, ValueError)
    msg = str(err)
    assert "out_partial must have dtype float32" in msg
    assert "lse_partial must have shape" in msg
    assert "out has dtype torch.bfloat16 but out_dtype is fp16" in msg


def test_only_value_problems_raise_plain_value_error(fake_gpu):
    err = _raises(fake_gpu, ValueError, r"2 problems", torch.zeros(0, 2, 5, 4, 300), torch.zeros(0, 2, 5, 4))
    assert type(err) is ValueError


def assert_problems(err: BaseException, *fragments: str) -> None:
    """``err`` lists exactly len(fragments) problems, one line each after a
    ``"flashgen: flash_attn_combine: N problems with the arguments:"`` head, each fragment in its own line."""
    head, *lines = str(err).split("\n")
    assert head == f"flashgen: flash_attn_combine: {len(fragments)} problems with the arguments:", str(err)
    assert all(line.startswith("  - ") for line in lines), str(err)
    for fragment in fragments:
        assert sum(fragment in line for line in lines) == 1, (fragment, str(err))


def test_combine_argument_error_is_input_error():
    import flashgen

    assert C.CombineArgumentError is V.InputError is flashgen.InputError


def test_not_a_tensor_and_out_dtype_do_not_hide_other_problems(fake_gpu):
    lp = torch.zeros(3, 2, 5, dtype=torch.float16)  # float16 and 3-D
    out = torch.empty(2, 5, 4, 64, 1)  # 5-D
    err = _raises(fake_gpu, V.InputError, "5 problems", np.zeros(3), lp, out=out, out_dtype="bf16")
    assert_problems(err,
                    "out_partial must be a torch.Tensor, got ndarray",
                    "out_dtype must be a torch.dtype (torch.float32, torch.bfloat16 or torch.float16), got 'bf16'",
                    "lse_partial must have dtype float32 (split-KV partials are fp32), got torch.float16",
                    "lse_partial must be 4-D (num_splits, batch, seqlen, heads), got 3-D shape (3, 2, 5)",
                    "out must be 4-D (batch, seqlen, heads, head_dim), got 5-D shape (2, 5, 4, 64, 1)")


def test_empty_4d_out_is_not_called_wrong_rank(fake_gpu):
    # out_partial 4-D: out's expected shape is unknown; a 4-D out (empty here) has no rank problem
    err = _raises(fake_gpu, ValueError, "out_partial must be 5-D", torch.zeros(2, 5, 4, 64), torch.zeros(2, 5, 4, 1),
                  out=torch.empty(0, 5, 4, 64))
    assert str(err) == ("flashgen: flash_attn_combine: out_partial must be 5-D (num_splits, batch, seqlen, heads, "
                        "head_dim), got 4-D shape (2, 5, 4, 64)")


def test_ops_entry_points_validate(fake_gpu):
    op, lp = partials()
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        torch.ops.flashgen.combine(op, lp[:, :1], torch.float32)
    with pytest.raises(TypeError, match="out has dtype"):
        torch.ops.flashgen.combine_out(op, lp, torch.empty(2, 5, 4, 64), torch.float16)
    assert fake_gpu.calls == []


def test_attention_combine_refuses_what_the_kernel_cannot_serve(fake_gpu):
    op, lp = partials()
    out = torch.empty(2, 5, 4, 64)
    t = lambda x, dt="fp32": core.TensorArg(x.data_ptr(), tuple(x.shape), tuple(x.stride()), dt, 0)  # noqa: E731
    bad_lse = torch.empty(2, 5, 4)  # (b, s, h) contiguous: not the (b, h, s) buffer's layout
    with pytest.raises(ValueError, match="contiguous \\(batch, heads, seqlen\\) buffer"):
        C.attention_combine(t(op), t(lp), t(out), t(bad_lse), "fp32", 0)
    with pytest.raises(ValueError, match="dtypes"):
        C.attention_combine(t(op), t(lp), t(out), t(torch.empty(2, 4, 5)), "bf16", 0)
    with pytest.raises(ValueError, match="num_splits"):
        big = core.TensorArg(op.data_ptr(), (300, 2, 5, 4, 64), op.stride(), "fp32", 0)
        C.attention_combine(big, t(lp)._replace(shape=(300, 2, 5, 4)), t(out), t(torch.empty(2, 4, 5)), "fp32", 0)
    assert fake_gpu.calls == []
    # both LSE spellings of the same memory are accepted
    buf = torch.empty(2, 4, 5)
    C.attention_combine(t(op), t(lp), t(out), t(buf), "fp32", 0)
    C.attention_combine(t(op), t(lp), t(out), t(buf.transpose(1, 2)), "fp32", 0)
    assert len(fake_gpu.calls) == 2


# --------------------------------------------------------------------------------------
# Fake implementations, opcheck, torch.compile
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 2, 5, 4, 64), (1, 1, 7, 3, 62), (2, 0, 5, 4, 8)])
@pytest.mark.parametrize("out_dtype", _OUT_DTYPES)
def test_fake_impl_matches_real_metadata(fake_gpu, shape, out_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, lp = torch.randn(shape), torch.randn(shape[:4])
    real = torch.ops.flashgen.combine(op, lp, out_dtype)
    out = torch.empty(shape[1:], dtype=out_dtype)
    real_lse_out = torch.ops.flashgen.combine_out(op, lp, out, out_dtype)
    with FakeTensorMode() as mode:
        fop, flp = mode.from_tensor(op), mode.from_tensor(lp)
        fake = torch.ops.flashgen.combine(fop, flp, out_dtype)
        fake_lse_out = torch.ops.flashgen.combine_out(fop, flp, mode.from_tensor(out), out_dtype)
    for r, f in ((real[0], fake[0]), (real[1], fake[1]), (real_lse_out, fake_lse_out)):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype and f.stride() == r.stride()


def test_fake_impl_validates(fake_gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    op, lp = partials()
    op, lp = op[:0], lp[:0]
    with FakeTensorMode() as mode:
        with pytest.raises(ValueError, match="num_splits"):
            torch.ops.flashgen.combine(mode.from_tensor(op), mode.from_tensor(lp), torch.float32)


def test_opcheck(fake_gpu):
    op, lp = partials()
    torch.library.opcheck(torch.ops.flashgen.combine.default, (op, lp, torch.bfloat16))
    torch.library.opcheck(torch.ops.flashgen.combine_out.default, (op, lp, torch.empty(2, 5, 4, 64), torch.float32))


def test_compile_fullgraph_functional_and_out(fake_gpu):
    torch._dynamo.reset()

    def f(op, lp):
        out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
        return out.float() * 2, lse + 1

    def g(op, lp, out):
        o, lse = flash_attn_combine(op, lp, out=out)
        return o * 3, lse.exp()

    op, lp = partials(ns=4, b=2, s=3, h=2, d=16)
    eager_f = f(op, lp)
    compiled_f = torch.compile(f, fullgraph=True, backend="aot_eager")(op, lp)
    assert all(torch.equal(a, b) for a, b in zip(eager_f, compiled_f))
    out_e, out_c = torch.full((2, 3, 2, 16), math.nan), torch.full((2, 3, 2, 16), math.nan)
    eager_g = g(op, lp, out_e)
    compiled_g = torch.compile(g, fullgraph=True, backend="aot_eager")(op, lp, out_c)
    assert all(torch.equal(a, b) for a, b in zip(eager_g, compiled_g))
    assert torch.equal(out_e, out_c) and not out_c.isnan().any()  # the compiled call wrote `out` too
    assert len(fake_gpu.calls) == 4


def test_compile_inductor_default_backend(fake_gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda op, lp: flash_attn_combine(op, lp)[0] * 2, fullgraph=True)
    op, lp = partials()
    assert torch.equal(f(op, lp), flash_attn_combine(op, lp)[0] * 2)


def test_grad_inputs_go_through_the_op(fake_gpu):
    op, lp = partials()
    op.requires_grad_(True)
    out, lse = flash_attn_combine(op, lp)  # through torch.ops.flashgen.combine: no backward formula
    assert len(fake_gpu.calls) == 1 and out.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        out2, _ = flash_attn_combine(op, lp)
    assert torch.equal(out.detach(), out2) and not out2.requires_grad


# --------------------------------------------------------------------------------------
# DLPack entry (numpy / torch CPU arrays standing in for device arrays)
# --------------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu_dlpack(fake_gpu, monkeypatch):
    pytest.importorskip("cuda.core.utils", reason="cuda-core is not installed")
    monkeypatch.setattr(dlpack_api, "_CUDA_DEVICE_TYPES", frozenset({dlpack_api.kDLCPU}))
    return fake_gpu


def _np_partials(**kw):
    return [t.numpy() for t in partials(**kw)]


def test_dlpack_given_outputs(fake_gpu_dlpack):
    op, lp = _np_partials(ns=3, b=2, s=5, h=4, d=64)
    out = np.full((2, 5, 4, 64), np.nan, np.float16)
    lse = np.full((2, 4, 5), np.nan, np.float32).transpose(0, 2, 1)
    r = dlpack_api.flash_attn_combine_dlpack(op, lp, out=out, lse=lse, out_dtype="float16", stream=77)
    assert r[0] is out and r[1] is lse
    (call,) = fake_gpu_dlpack.calls
    assert call["stream"] == 77 and call["params"]["out"] == out.__array_interface__["data"][0]
    assert fake_gpu_dlpack.selected == [("combine", {"dtype": "fp16"})]
    assert_matches(torch.from_numpy(out), torch.from_numpy(lse), torch.from_numpy(op), torch.from_numpy(lp))


def test_dlpack_lse_may_be_the_buffer_itself(fake_gpu_dlpack):
    op, lp = _np_partials(ns=2, b=2, s=3, h=4, d=8)
    out = np.empty((2, 3, 4, 8), np.float32)
    buf = np.full((2, 4, 3), np.nan, np.float32)
    dlpack_api.flash_attn_combine_dlpack(op, lp, out=out, lse=buf)
    _, ref_lse = combine_ref(torch.from_numpy(op), torch.from_numpy(lp))
    assert np.allclose(buf.transpose(0, 2, 1), ref_lse.numpy(), atol=1e-6)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: np.empty((2, 5, 4), np.float32), ValueError, r"lse must be the transpose\(1, 2\) view"),
    (lambda: np.empty((2, 4, 5), np.float64), TypeError, r"lse must have dtype float32"),
    (lambda: np.empty((2, 5, 5), np.float32), ValueError, r"lse must have shape \(batch, seqlen, heads\) = \(2, 5, 4\)"),
])
def test_dlpack_bad_lse(fake_gpu_dlpack, bad, exc, match):
    op, lp = _np_partials()
    with pytest.raises(exc, match=match):
        dlpack_api.flash_attn_combine_dlpack(op, lp, out=np.empty((2, 5, 4, 64), np.float32), lse=bad())
    assert fake_gpu_dlpack.calls == []


def test_dlpack_shared_validation(fake_gpu_dlpack):
    op, lp = _np_partials()
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        dlpack_api.flash_attn_combine_dlpack(op, lp[:, :1])
    with pytest.raises(TypeError, match="out_partial must have dtype float32"):
        dlpack_api.flash_attn_combine_dlpack(op.astype(np.float16), lp)
    with pytest.raises(TypeError, match="out_dtype must be"):
        dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype="int8")
    with pytest.raises(TypeError, match="out has dtype float32 but out_dtype is bf16"):
        dlpack_api.flash_attn_combine_dlpack(op, lp, out=np.empty((2, 5, 4, 64), np.float32), out_dtype="bf16")
    with pytest.raises(TypeError, match="out_partial must be a DLPack array"):
        dlpack_api.flash_attn_combine_dlpack([1.0], lp)
    assert fake_gpu_dlpack.calls == []


def test_dlpack_every_problem_in_one_error(fake_gpu_dlpack):
    lp = np.zeros((3, 2, 5), np.float16)
    out = np.zeros((2, 5, 4, 64, 1), np.float32)  # 5-D, not bf16, read-only
    out.flags.writeable = False
    with pytest.raises(V.InputError) as info:
        dlpack_api.flash_attn_combine_dlpack([1.0], lp, out=out, out_dtype="bf16")
    assert_problems(info.value,
                    "out_partial must be a DLPack array",
                    "out is read-only",
                    "lse_partial must have dtype float32 (split-KV partials are fp32), got float16",
                    "lse_partial must be 4-D (num_splits, batch, seqlen, heads), got 3-D shape (3, 2, 5)",
                    "out has dtype float32 but out_dtype is bf16",
                    "out must be 4-D (batch, seqlen, heads, head_dim), got 5-D shape (2, 5, 4, 64, 1)")
    assert fake_gpu_dlpack.calls == []


def test_dlpack_every_lse_problem_in_one_error(fake_gpu_dlpack):
    op, lp = _np_partials()
    lse = np.zeros((2, 5, 5), np.float64)  # wrong shape, wrong dtype, read-only
    lse.flags.writeable = False
    with pytest.raises(V.InputError) as info:
        dlpack_api.flash_attn_combine_dlpack(op, lp, out=np.empty((2, 5, 4, 64), np.float32), lse=lse)
    assert_problems(info.value,
                    "lse is read-only",
                    "lse must have dtype float32, got float64",
                    "lse must have shape (batch, seqlen, heads) = (2, 5, 4)")
    assert fake_gpu_dlpack.calls == []


def test_both_apis_give_the_same_message(fake_gpu_dlpack):
    op = torch.zeros(3, 2, 5, 4, 64, dtype=torch.float16)
    lp = torch.zeros(3, 2, 5, 7)
    out = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(V.InputError) as t:
        flash_attn_combine(op, lp, out=out, out_dtype=torch.float16)
    with pytest.raises(V.InputError) as d:
        dlpack_api.flash_attn_combine_dlpack(op.numpy(), lp.numpy(), out=out, out_dtype=torch.float16)
    assert str(d.value) == str(t.value).replace("torch.float16", "float16")  # numpy's spelling of out_partial's dtype


def test_dlpack_host_arrays_rejected():
    pytest.importorskip("cuda.core.utils", reason="cuda-core is not installed")
    with pytest.raises(ValueError, match="out_partial must be a CUDA tensor/array"):
        dlpack_api.flash_attn_combine_dlpack(*_np_partials())


@pytest.mark.parametrize("spelling,name", [
    (None, "fp32"), ("fp16", "fp16"), ("bfloat16", "bf16"), (np.float16, "fp16"), (np.dtype("float32"), "fp32"),
    (torch.bfloat16, "bf16"), (torch.float16, "fp16"), ("int8", "int8"), (np.int32, "int32"),
])
def test_dlpack_out_dtype_spellings(spelling, name):
    assert dlpack_api._combine_out_dtype(spelling) == name


def test_dlpack_torch_arrays_allocate_with_torch(fake_gpu_dlpack, monkeypatch):
    torch_allocates_on_cpu(monkeypatch)
    op, lp = partials(ns=2, b=2, s=5, h=4, d=64)
    out, lse = dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype=torch.bfloat16)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 64)
    assert_fa3_lse_layout(lse, 2, 5, 4)
    assert_matches(out, lse, op, lp)


def test_dlpack_missing_outputs_without_cupy(fake_gpu_dlpack, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *a, **kw):
        if name == "cupy":
            raise ImportError("no cupy")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(TypeError, match=r"no allocator for ndarray arrays: pass out="):
        dlpack_api.flash_attn_combine_dlpack(*_np_partials())
    assert fake_gpu_dlpack.calls == []


def test_dlpack_empty_launches_nothing(fake_gpu_dlpack):
    op = np.zeros((2, 0, 5, 4, 8), np.float32)
    lp = np.zeros((2, 0, 5, 4), np.float32)
    out = np.empty((0, 5, 4, 8), np.float32)
    lse = np.empty((0, 4, 5), np.float32).transpose(0, 2, 1)
    r = dlpack_api.flash_attn_combine_dlpack(op, lp, out=out, lse=lse)
    assert r[0] is out and r[1] is lse and fake_gpu_dlpack.calls == []


def test_dlpack_module_still_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys\nimport flashgen.dlpack_api, flashgen.combine\n"
            "assert 'torch' not in sys.modules, 'imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("case", ["aligned", "op_base_misaligned", "out_base_off", "empty"])
def test_prepared_combine_launches_what_attention_combine_launches(fake_gpu, monkeypatch, case):
    """combine.prepare_combine once (cached per metadata) + launch_combine per call (split-KV calls): the params of each
    launch are attention_combine's for the same arrays (addresses and vec4 per call: the 16-byte path only where
    this call's addresses allow it), the merge is right, and an empty problem prepares no launch."""
    prepared = []

    def prepare_launch(kernel, grid, params, per_call, counter=None):
        assert counter is None and not set(per_call) & set(params)  # (the real one zeroes them)
        prepared.append(per_call)
        return (kernel, grid, params, per_call)

    def launch_prepared(prep, tensor_maps, values, stream):
        kernel, grid, params, per_call = prep
        fake_gpu.launch(kernel, grid, tensor_maps, {**params, **dict(zip(per_call, values))}, stream, kernel.device)

    monkeypatch.setattr(launch, "prepare_launch", prepare_launch)
    monkeypatch.setattr(launch, "launch_prepared", launch_prepared)
    monkeypatch.setattr(C, "_prepared_combines", {})  # (prepared per metadata: the cases share it)
    ns, b, s, h, d = 3, 2, (0 if case == "empty" else 5), 4, 64
    op, lp = partials(ns, b, s, h, d, seed=4)
    if case == "op_base_misaligned":
        flat = torch.empty(op.numel() + 1)
        op = flat[1:].view(op.shape).copy_(op)
    out_full = torch.empty(b * s * h * d + 4, dtype=torch.bfloat16)
    shift = (-out_full.data_ptr() // 2) % 8 + (2 if case == "out_base_off" else 0)
    out = out_full[shift:shift + b * s * h * d].view(b, s, h, d)
    lse = torch.empty(b, h, s).transpose(1, 2)

    def arg(t, dt, ptr=None):
        return core.TensorArg(t.data_ptr() if ptr is None else ptr, tuple(t.shape), tuple(t.stride()), dt, 0)

    prep = C.prepare_combine(arg(op, "fp32", 0), arg(lp, "fp32", 0), arg(out, "bf16", 0), arg(lse, "fp32", 0), "bf16")
    # cached per metadata: the same key (any addresses) gives the same prepared launch, prepared once
    assert C.prepare_combine(arg(op, "fp32"), arg(lp, "fp32"), arg(out, "bf16"), arg(lse, "fp32"), "bf16") is prep
    assert len(prepared) == (0 if case == "empty" else 1)
    if case == "empty":
        assert prep.launch is None and not prepared
        C.launch_combine(prep, op.data_ptr(), lp.data_ptr(), out.data_ptr(), lse.data_ptr(), STREAM)
        assert not fake_gpu.calls
        return
    for _ in range(2):
        var = C.launch_combine(prep, op.data_ptr(), lp.data_ptr(), out.data_ptr(), lse.data_ptr(), STREAM)
    assert var is prep.variant and len(fake_gpu.calls) == 2 and prepared == [C._PER_CALL]
    assert_matches(out.float(), lse, op, lp)
    C.attention_combine(arg(op, "fp32"), arg(lp, "fp32"), arg(out, "bf16"), arg(lse, "fp32"), "bf16", STREAM)
    first, plain = fake_gpu.calls[0], fake_gpu.calls[-1]
    assert first["params"] == plain["params"] and first["grid"] == plain["grid"] and first["stream"] == STREAM
    assert first["params"]["vec4"] == (1 if case == "aligned" else 0)
