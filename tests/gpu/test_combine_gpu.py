"""GPU tests of the split-KV combine (FA3's flash_attn_combine): the ``combine`` kernels through
flashgen.interface.flash_attn_combine (torch) and flashgen.dlpack_api.flash_attn_combine_dlpack
(DLPack, with CuPy and torch arrays).

Covers: results against a float64 reference on the upcast inputs over num_splits 1..256, odd
seqlens, head dims on the 16-byte path and the scalar path (head_dim % 4 != 0, misaligned
layouts), fp32/bf16/fp16 outputs; FA3's non-contiguous inputs; empty splits (-inf LSE) whose
partials are NaN and must not leak; rows with every split empty (out 0, lse -inf); every output
element written (outputs poisoned with NaN first); caller-provided ``out``; empty problems;
large LSE magnitudes; torch.compile(fullgraph=True); CUDA-graph capture; non-default streams;
the DLPack entry.

Tolerances (FA3's tests/test_flash_attn.py test_flash_attn_combine): out passes when
``max|out - ref| <= 2 * max|ref.to(out_dtype) - ref|`` or ``allclose(out, ref.to(out_dtype),
atol=1e-5, rtol=1e-5)``; lse passes ``allclose(lse, ref, atol=1e-5, rtol=1e-5)``. The kernels
are built with --use_fast_math (exp -> ex2.approx, log -> lg2.approx), and FA3's bounds still
hold with margin: each weight is ``ex2.approx((L_s - M) * log2 e)`` with L_s - M <= 0 computed
first, so its relative error is about 2^-22 + |L_s - M| * 2^-24 (< 1e-6 wherever the weight is
not negligible), the sum of weights is >= 1, and ``lse = M + lg2.approx(sum) * ln 2`` adds an
absolute error of about 2^-22: |lse - ref| stays below ~1e-6 for |lse| up to ~30, under
atol + rtol * |lse| >= 1e-5. The out of an fp32 variant carries those weight errors plus fp32
accumulation over at most 256 splits, a few 1e-6 relative on values of magnitude <= ~4, under
the fp32 allclose(1e-5, 1e-5) branch; bf16/fp16 outputs are dominated by their one rounding.

Skipped without an sm_90 GPU (tests/gpu/conftest.py); each dtype is skipped when no combine
variant serving it is built.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import dlpack_api  # noqa: E402
from flashgen.dispatch import MissingVariantError, select_variant  # noqa: E402
from flashgen.interface import flash_attn_combine  # noqa: E402

from _ref import combine_ref  # noqa: E402  (tests/gpu is on sys.path: conftest.py)

pytestmark = pytest.mark.gpu

_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def need(dtype):
    """Skip unless a combine variant serving out dtype `dtype` is built."""
    try:
        select_variant("combine", {"dtype": _NAME[dtype]})
    except MissingVariantError:
        pytest.skip(f"no combine variant for {_NAME[dtype]} is built (flashgen build)")
    except Exception as e:  # no manifest at all
        pytest.skip(f"no kernel manifest: {e}")


# --------------------------------------------------------------------------------------
# Reference and checks
# --------------------------------------------------------------------------------------



def check(out, lse, out_partial, lse_partial, out_dtype):
    """FA3's combine rule for out, allclose(1e-5, 1e-5) for lse (see the module docstring), and
    FA3's output layout: lse is the (b, s, h) transpose view of a contiguous (b, h, s) buffer."""
    torch.cuda.synchronize()
    ns, b, s, h, d = out_partial.shape
    ref, lse_ref = combine_ref(out_partial, lse_partial)
    assert out.shape == (b, s, h, d) and out.dtype == out_dtype
    assert lse.shape == (b, s, h) and lse.dtype == torch.float32
    if lse.numel():
        assert lse.transpose(1, 2).is_contiguous(), lse.stride()
    assert not out.isnan().any(), "NaN in out: a poisoned partial leaked or an element was not written"
    assert not lse.isnan().any(), "NaN in lse: an element was not written"
    pt = ref.to(out_dtype)
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    base = (pt.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * base or torch.allclose(out, pt, atol=1e-5, rtol=1e-5), \
        f"out: max err {err:.3e} > 2 x rounding err of the reference {base:.3e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], atol=1e-5, rtol=1e-5)
    empty_rows = ~finite
    if empty_rows.any():
        assert (out[empty_rows] == 0).all(), "a row with every split empty must give out 0"


def poison_allocator(nbytes):
    """Leave NaN in the caching allocator's free blocks of about this size, so a freshly
    allocated output that the kernel fails to write shows NaN."""
    junk = torch.full((max(nbytes // 4, 1),), math.nan, device="cuda")
    del junk


def fa3_partials(ns, b, s, h, d, seed=0, empty=True):
    """FA3's test inputs: non-contiguous views (out_partial from a (2*ns, b, h, s, d) buffer,
    lse_partial from a (ns, b, 2*h, s) buffer), splits ns//2.. of the first b//3 batches empty
    (-inf) with NaN partials."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    op = torch.randn(2 * ns, b, h, s, d, generator=g, device="cuda").transpose(2, 3)[::2]
    lp = torch.randn(ns, b, 2 * h, s, generator=g, device="cuda").transpose(-1, -2)[:, :, :, ::2]
    if empty:
        lp[ns // 2:, : b // 3] = -math.inf
        op[ns // 2:, : b // 3] = math.nan
    return op, lp


def sizes(ns, s, d, budget=1 << 26):
    """(batch, heads) for a test: 3 x 4 where the doubled out_partial buffer fits `budget`
    floats (256 MiB), fewer for the largest shapes."""
    b, h = 3, 4
    while 2 * ns * b * s * h * d > budget and h > 1:
        h //= 2
    while 2 * ns * b * s * h * d > budget and b > 1:
        b -= 1
    return b, h


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda t: _NAME[t])
@pytest.mark.parametrize("d", [8, 62, 64, 96, 128, 200, 250, 256])
@pytest.mark.parametrize("seqlen", [1, 7, 113, 1023])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 17, 133, 256])
def test_combine_matches_reference(num_splits, seqlen, d, out_dtype):
    need(out_dtype)
    if num_splits * seqlen * d > 256 * 113 * 256 and d not in (62, 128) and out_dtype != torch.bfloat16:
        pytest.skip("largest shapes: covered by bf16 and head dims 62 / 128")
    b, h = sizes(num_splits, seqlen, d)
    op, lp = fa3_partials(num_splits, b, seqlen, h, d, seed=num_splits * 7 + seqlen + d)
    poison_allocator(b * seqlen * h * d * 4)
    out, lse = flash_attn_combine(op, lp, out_dtype=out_dtype)
    check(out, lse, op, lp, out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda t: _NAME[t])
def test_contiguous_inputs_and_default_dtype(out_dtype):
    need(out_dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    op = torch.randn(5, 2, 33, 8, 128, generator=g, device="cuda")
    lp = torch.randn(5, 2, 33, 8, generator=g, device="cuda")
    if out_dtype == torch.float32:
        out, lse = flash_attn_combine(op, lp)  # default: out_partial's dtype
    else:
        out, lse = flash_attn_combine(op, lp, out_dtype=out_dtype)
    check(out, lse, op, lp, out_dtype)
    assert out.is_contiguous()


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda t: _NAME[t])
def test_all_empty_rows_give_zero_and_minus_inf(out_dtype):
    need(out_dtype)
    op, lp = fa3_partials(4, 2, 9, 3, 64, empty=False)
    lp[:, 1, 4, 2] = -math.inf  # one row: every split empty
    op[:, 1, 4, 2] = math.nan
    lp[:, 0] = -math.inf  # a whole batch
    op[:, 0] = math.nan
    out, lse = flash_attn_combine(op, lp, out_dtype=out_dtype)
    check(out, lse, op, lp, out_dtype)
    assert (out[0] == 0).all() and (lse[0] == -math.inf).all()
    assert (out[1, 4, 2] == 0).all() and lse[1, 4, 2] == -math.inf


def test_single_live_split_is_copied():
    """A row whose only finite L_s is split k: weight exp(0) / 1 = 1, so out = out_partial[k]
    and lse = L_k (up to fp32 rounding); k varies per row and is often the last split."""
    need(torch.float32)
    ns, b, s, h, d = 9, 2, 37, 4, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    op = torch.randn(ns, b, s, h, d, generator=g, device="cuda")
    lp = torch.full((ns, b, s, h), -math.inf, device="cuda")
    k = torch.randint(0, ns, (b, s, h), generator=g, device="cuda")
    val = torch.randn(b, s, h, generator=g, device="cuda") * 10
    lp.scatter_(0, k[None], val[None])
    out, lse = flash_attn_combine(op, lp)
    torch.cuda.synchronize()
    want = op.gather(0, k[None, ..., None].expand(1, b, s, h, d))[0]
    torch.testing.assert_close(out, want, atol=0, rtol=1e-6)
    torch.testing.assert_close(lse, val, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scale,offset", [(20.0, 0.0), (1.0, 60.0), (30.0, -80.0)])
def test_large_lse_magnitudes(scale, offset):
    """Widely spread and large LSEs (weights underflowing to 0, lse far from 0)."""
    need(torch.bfloat16)
    op, lp = fa3_partials(33, 3, 50, 4, 128, seed=11)
    lp.mul_(scale).add_(offset)
    out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    check(out, lse, op, lp, torch.bfloat16)


@pytest.mark.parametrize("layout", ["op_base_4_bytes_off", "out_bf16_base_4_bytes_off", "out_padded_rows",
                                    "op_split_stride_odd"])
def test_scalar_path_layouts(layout):
    """Layouts that rule out 16-byte accesses (flashgen.combine.use_vec4) run the scalar path."""
    need(torch.bfloat16)
    ns, b, s, h, d = 6, 2, 19, 3, 128
    src, lp = fa3_partials(ns, b, s, h, d, seed=3)
    op, out = src, None
    if layout == "op_base_4_bytes_off":
        flat = torch.empty(src.numel() + 4, device="cuda")
        op = flat[1:1 + src.numel()].view(src.shape)
        op.copy_(src)
    elif layout == "op_split_stride_odd":
        per = b * s * h * d + 1
        op = torch.empty(ns * per, device="cuda").as_strided(src.shape, (per, s * h * d, h * d, d, 1))
        op.copy_(src)
    elif layout == "out_bf16_base_4_bytes_off":
        flat = torch.full((b * s * h * d + 2,), math.nan, device="cuda", dtype=torch.bfloat16)
        out = flat[2:].view(b, s, h, d)
    elif layout == "out_padded_rows":
        out = torch.full((b, s, h, d + 2), math.nan, device="cuda", dtype=torch.bfloat16)[..., :d]
    if out is None:
        out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    else:
        r, lse = flash_attn_combine(op, lp, out=out, out_dtype=torch.bfloat16)
        assert r is out
    check(out, lse, op, lp, torch.bfloat16)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda t: _NAME[t])
def test_given_out_every_element_written(out_dtype):
    need(out_dtype)
    ns, b, s, h, d = 17, 3, 113, 4, 96
    op, lp = fa3_partials(ns, b, s, h, d, seed=2)
    storage = torch.full((b, h, s, d), math.nan, device="cuda", dtype=out_dtype)
    out = storage.transpose(1, 2)  # BHSD memory as BSHD: non-contiguous, last dim contiguous
    r, lse = flash_attn_combine(op, lp, out=out, out_dtype=out_dtype)
    assert r is out
    check(out, lse, op, lp, out_dtype)


@pytest.mark.parametrize("shape", [(3, 0, 5, 4, 64), (3, 2, 0, 4, 64), (3, 2, 5, 0, 64)])
def test_empty_problems(shape):
    need(torch.bfloat16)
    op = torch.randn(shape, device="cuda")
    lp = torch.randn(shape[:4], device="cuda")
    out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    ns, b, s, h, d = shape
    assert out.shape == (b, s, h, d) and lse.shape == (b, s, h)
    given = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    r, _ = flash_attn_combine(op, lp, out=given, out_dtype=torch.bfloat16)
    assert r is given


def test_top_level_export():
    assert flashgen.flash_attn_combine is flash_attn_combine
    assert flashgen.flash_attn_combine_dlpack is dlpack_api.flash_attn_combine_dlpack


# --------------------------------------------------------------------------------------
# torch.compile, CUDA graphs, streams
# --------------------------------------------------------------------------------------

def test_compile_fullgraph_matches_eager():
    need(torch.bfloat16)
    need(torch.float32)
    torch._dynamo.reset()

    def f(op, lp, out):
        o16, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
        o32, _ = flash_attn_combine(op, lp, out=out)
        return o16.float() * 2 + o32, lse.exp()

    op, lp = fa3_partials(7, 2, 31, 4, 64, seed=4)
    out_e = torch.empty(2, 31, 4, 64, device="cuda")
    out_c = torch.full_like(out_e, math.nan)
    eager = f(op, lp, out_e)
    compiled = torch.compile(f, fullgraph=True)(op, lp, out_c)
    # the elementwise epilogue may be fused differently by inductor: default fp32 tolerances
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)  # same kernel, deterministic: `out` written


def test_cuda_graph_capture_replays_on_new_data():
    need(torch.float16)
    op, lp = fa3_partials(5, 2, 40, 4, 128, seed=6)
    flash_attn_combine(op, lp, out_dtype=torch.float16)  # load the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_combine(op, lp, out_dtype=torch.float16)
    op2, lp2 = fa3_partials(5, 2, 40, 4, 128, seed=7)
    op.copy_(op2)
    lp.copy_(lp2)
    graph.replay()
    check(out, lse, op2, lp2, torch.float16)


def test_runs_on_the_current_stream():
    need(torch.bfloat16)
    op, lp = fa3_partials(17, 3, 257, 4, 128, seed=8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
        snap_out, snap_lse = out.clone(), lse.clone()  # ordered after the kernel on `side` only
    side.synchronize()
    check(snap_out, snap_lse, op, lp, torch.bfloat16)


# --------------------------------------------------------------------------------------
# DLPack entry
# --------------------------------------------------------------------------------------

def _cupy():
    return pytest.importorskip("cupy")


@pytest.mark.parametrize("out_dtype", ["fp32", "fp16"])
def test_dlpack_cupy_allocates_outputs(out_dtype):
    cp = _cupy()
    tdt = {"fp32": torch.float32, "fp16": torch.float16}[out_dtype]
    need(tdt)
    op_t, lp_t = fa3_partials(9, 2, 45, 4, 64, seed=9)
    op, lp = cp.from_dlpack(op_t), cp.from_dlpack(lp_t)
    out, lse = dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype=out_dtype)
    assert isinstance(out, cp.ndarray) and out.shape == (2, 45, 4, 64)
    assert isinstance(lse, cp.ndarray) and lse.shape == (2, 45, 4) and lse.strides == (4 * 4 * 45, 4, 4 * 45)
    cp.cuda.Stream.null.synchronize()
    check(torch.from_dlpack(out), torch.from_dlpack(lse), op_t, lp_t, tdt)


def test_dlpack_cupy_given_outputs_on_a_stream():
    cp = _cupy()
    need(torch.bfloat16)
    op_t, lp_t = fa3_partials(33, 2, 64, 4, 128, seed=10)
    torch.cuda.synchronize()
    out_t = torch.full((2, 64, 4, 128), math.nan, device="cuda", dtype=torch.bfloat16)
    lse_buf = cp.full((2, 4, 64), cp.nan, dtype=cp.float32)
    lse = lse_buf.transpose(0, 2, 1)
    s = cp.cuda.Stream(non_blocking=True)
    r_out, r_lse = dlpack_api.flash_attn_combine_dlpack(cp.from_dlpack(op_t), cp.from_dlpack(lp_t), out=out_t,
                                                        lse=lse, out_dtype="bf16", stream=s)
    assert r_out is out_t and r_lse is lse
    s.synchronize()
    check(out_t, torch.from_dlpack(lse), op_t, lp_t, torch.bfloat16)


def test_dlpack_torch_inputs_allocate_with_torch():
    need(torch.bfloat16)
    op, lp = fa3_partials(3, 2, 7, 4, 250, seed=12)
    out, lse = dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype=torch.bfloat16)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    torch.cuda.synchronize()
    check(out, lse, op, lp, torch.bfloat16)


def test_dlpack_cupy_errors():
    cp = _cupy()
    need(torch.bfloat16)
    op = cp.zeros((2, 1, 3, 4, 64), dtype=cp.float32)
    lp = cp.zeros((2, 1, 3, 4), dtype=cp.float32)
    with pytest.raises(TypeError, match="CuPy cannot allocate bfloat16"):
        dlpack_api.flash_attn_combine_dlpack(op, lp, out_dtype="bf16")
    with pytest.raises(ValueError, match="lse must be the transpose"):
        dlpack_api.flash_attn_combine_dlpack(op, lp, out=cp.empty((1, 3, 4, 64), cp.float32),
                                             lse=cp.empty((1, 3, 4), cp.float32))
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        dlpack_api.flash_attn_combine_dlpack(op, lp[:1])
