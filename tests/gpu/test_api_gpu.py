"""GPU tests of the user-facing API: flashgen.interface.flash_attn_func (torch) and
flashgen.dlpack_api.flash_attn_forward (DLPack, tested with CuPy).

Covers: results against a float32 reference by FA3's rule (max|out-ref| <= 2 max|out_pt-ref|
+ noise), real-model layouts passed without copies (packed qkv, KV-cache prefixes) and
layouts that must be copied, empty problems, torch.compile(fullgraph=True) against eager,
CUDA-graph capture replayed on new data, gradients flowing, MissingVariantError, and the
DLPack entry with CuPy arrays (allocation, caller outputs, non-default streams, the
seqlen_k == 0 driver memsets).

Skipped without an sm_90 GPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import flashgen.core as core  # noqa: E402
import flashgen.interface as interface  # noqa: E402
from flashgen import dlpack_api  # noqa: E402
from flashgen.interface import flash_attn_func  # noqa: E402
from flashgen.manifest import load_manifest  # noqa: E402

from _ref import attention_ref, fa3_rule_ok  # noqa: E402

pytestmark = pytest.mark.gpu

_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _built_keys(family="fwd"):
    try:
        m = load_manifest()
    except Exception:
        return set()
    return {
        (v.params["dtype"], v.params["head_dim"], v.params.get("head_dim_v", v.params["head_dim"]),
         bool(v.params["causal"]))
        for v in m.variants if v.family == family
    }


def pick(causal=None, dtype=None, backward=False):
    """(torch dtype, head_dim) of a built forward variant (and, with ``backward``, a bwd one of the same
    key), preferring head_dim 128 then 64; skips the test when there is none."""
    keys = _built_keys()
    if backward:
        keys &= _built_keys("bwd")
    for d in (128, 64, 256, 96, 192):
        for dt in ((dtype,) if dtype is not None else (torch.bfloat16, torch.float16)):
            cs = (causal,) if causal is not None else (False, True)
            if all((_NAME[dt], d, d, c) in keys for c in cs):
                return dt, d
    pytest.skip("no suitable variant built")


def rnd(*shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    return (rnd(b, sq, h, d, dtype=dtype, seed=seed), rnd(b, sk, hk, d, dtype=dtype, seed=seed + 1),
            rnd(b, sk, hk, d, dtype=dtype, seed=seed + 2))


def assert_fa3_rule(out, q, k, v, causal, scale=None, lse=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    torch.cuda.synchronize()
    ref, lse_ref = attention_ref(q, k, v, causal, scale, upcast=True)
    pt, _ = attention_ref(q, k, v, causal, scale, upcast=False)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    ok, err, base = fa3_rule_ok(out, ref, pt)
    assert ok, f"max err {err:.3e} > 2 x low-precision err {base:.3e}"
    if lse is not None:
        assert lse.shape == lse_ref.shape and lse.dtype == torch.float32
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-4)


@pytest.fixture
def spy(monkeypatch):
    """Record the TensorArgs handed to the core (then launch for real): those of
    core.attention_forward, or for the eager fast path's prepared launch the metadata given to
    core.prepare_forward at the addresses given to core.launch_forward. flash_attn_func's cache
    of prepared calls starts empty, so the prepare is seen."""
    calls = []
    real, real_prepare, real_launch = core.attention_forward, core.prepare_forward, core.launch_forward
    prepared = []  # (PreparedForward, {name: metadata TensorArg})

    inside = []  # attention_forward runs prepare_forward + launch_forward: one call, recorded once

    def wrapped(q, k, v, out, lse, *a, **kw):
        calls.append(dict(q=q, k=k, v=v, out=out, lse=lse))
        inside.append(1)
        try:
            return real(q, k, v, out, lse, *a, **kw)
        finally:
            inside.pop()

    def prepare(q, k, v, out, *a, **kw):
        prep = real_prepare(q, k, v, out, *a, **kw)
        prepared.append((prep, dict(q=q, k=k, v=v, out=out)))
        return prep

    def launch(prep, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, *a):
        if inside:
            return real_launch(prep, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, *a)
        meta = next(m for p, m in reversed(prepared) if p is prep)
        calls.append({**{name: meta[name]._replace(ptr=ptr) for name, ptr in
                         (("q", q_ptr), ("k", k_ptr), ("v", v_ptr), ("out", out_ptr))}, "lse": lse_ptr})
        return real_launch(prep, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, *a)

    monkeypatch.setattr(core, "attention_forward", wrapped)
    monkeypatch.setattr(core, "prepare_forward", prepare)
    monkeypatch.setattr(core, "launch_forward", launch)
    monkeypatch.setattr(interface, "_fwd_calls", {})
    return calls


# --------------------------------------------------------------------------------------
# torch API
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 113, 257, 8, 2), (1, 1, 1, 4, 4), (3, 300, 17, 4, 1)],
                         ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
def test_flash_attn_func_matches_reference(causal, shape):
    dtype, d = pick(causal)
    b, sq, sk, h, hk = shape
    q, k, v = inputs(b, sq, sk, h, hk, d, dtype, seed=sq)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.is_contiguous() and lse.is_contiguous()
    assert_fa3_rule(out, q, k, v, causal, lse=lse)
    out2 = flash_attn_func(q, k, v, causal=causal, deterministic=True)
    assert torch.equal(out, out2)


def test_custom_softmax_scale():
    dtype, d = pick(False)
    q, k, v = inputs(2, 77, 99, 4, 2, d, dtype, seed=5)
    out = flash_attn_func(q, k, v, softmax_scale=0.05)
    assert_fa3_rule(out, q, k, v, False, scale=0.05)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_qkv_no_copy(spy, causal):
    dtype, d = pick(causal)
    b, s, h = 2, 333, 4
    packed = rnd(b, s, 3, h, d, dtype=dtype, seed=1)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    (call,) = spy
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert call[name].ptr == t.data_ptr(), f"{name} was copied"
        assert call[name].strides == t.stride()
    assert_fa3_rule(out, q, k, v, causal, lse=lse)


def test_kv_cache_prefix_no_copy(spy):
    dtype, d = pick(True)
    b, cap, sk, h, hk = 2, 1024, 301, 8, 2
    k_cache = rnd(b, cap, hk, d, dtype=dtype, seed=2)
    v_cache = rnd(b, cap, hk, d, dtype=dtype, seed=3)
    q = rnd(b, 37, h, d, dtype=dtype, seed=4)
    k, v = k_cache[:, :sk], v_cache[:, :sk]
    out = flash_attn_func(q, k, v, causal=True)
    (call,) = spy
    assert call["k"].ptr == k_cache.data_ptr() and call["v"].ptr == v_cache.data_ptr()
    assert call["k"].strides == k_cache.stride()
    assert_fa3_rule(out, q, k, v, True)


def test_layouts_that_need_a_copy_are_copied_and_correct(spy):
    dtype, d = pick(False)
    q, k, v = inputs(2, 129, 200, 4, 4, d, dtype, seed=6)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    flat = torch.empty(k.numel() + 1, dtype=dtype, device="cuda")
    k_mis = flat[1:].view(k.shape)  # contiguous, base 2 bytes off alignment
    k_mis.copy_(k)
    assert q_t.stride(-1) != 1 and k_mis.data_ptr() % 16 != 0
    out = flash_attn_func(q_t, k_mis, v)
    (call,) = spy
    assert call["q"].ptr != q_t.data_ptr() and call["k"].ptr != k_mis.data_ptr()
    assert call["v"].ptr == v.data_ptr()
    assert_fa3_rule(out, q, k, v, False)


@pytest.mark.parametrize("b,sq,sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0)])
def test_empty_problems(spy, b, sq, sk):
    dtype, d = pick(False)
    q, k, v = inputs(b, sq, sk, 4, 2, d, dtype)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    torch.cuda.synchronize()
    assert out.shape == (b, sq, 4, d) and lse.shape == (b, 4, sq)
    assert spy == []
    if sk == 0 and b and sq:
        assert torch.equal(out, torch.zeros_like(out))
        assert bool((lse == -math.inf).all())


def test_missing_variant_error(tmp_path, monkeypatch):
    """A call no built variant serves (here: a kernel folder whose manifest keeps only the
    head_dim 64 forwards, so head_dim 128 cannot round up to anything) raises MissingVariantError
    naming the add-variant command; head_dim 40 rounds up to 64 and runs."""
    import json
    import os

    m = load_manifest()
    data = json.loads(m.path.read_text())
    data["variants"] = [e for e in data["variants"] if e["family"] == "fwd" and e["params"]["head_dim"] == 64
                        and e["params"]["head_dim_v"] == 64]
    if not data["variants"]:
        pytest.skip("no head_dim 64 forward built (a partial build)")
    for e in data["variants"]:  # the fatbins stay where they are
        e["fatbin"] = os.path.join(str(m.path.parent), e["fatbin"])
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(tmp_path))
    # resolved plans and prepared calls are per process: start from the subset
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_prepared_forwards", {})
    monkeypatch.setattr(interface, "_fwd_calls", {})
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[data["variants"][0]["params"]["dtype"]]
    q, k, v = inputs(1, 8, 8, 2, 2, 128, dtype)
    with pytest.raises(core.MissingVariantError, match="flashgen add-variant fwd .*--head-dim 128"):
        flash_attn_func(q, k, v)
    q, k, v = inputs(1, 37, 45, 2, 2, 40, dtype)
    assert_fa3_rule(flash_attn_func(q, k, v), q, k, v, False)


def test_backward_gives_gradients():
    """The forward is differentiable (the backward's own tests: test_bwd_gpu.py): gradients of
    q's dtype and shape, finite, not all zero."""
    dtype, d = pick(False, backward=True)
    q, k, v = inputs(1, 64, 64, 2, 2, d, dtype)
    q.requires_grad_(True)
    out = flash_attn_func(q, k, v)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == dtype and q.grad.shape == q.shape
    assert torch.isfinite(q.grad).all() and q.grad.abs().max() > 0


def test_not_cuda_and_fp8_errors():
    dtype, d = pick(False)
    q, k, v = inputs(1, 8, 8, 2, 2, d, dtype)
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        flash_attn_func(q, k.cpu(), v)
    if hasattr(torch, "float8_e5m2"):  # e4m3 is served (test_fp8_gpu.py); e5m2 is not
        with pytest.raises(NotImplementedError, match="only float8_e4m3fn is served"):
            flash_attn_func(*(t.to(torch.float8_e5m2) for t in (q, k, v)))


# --------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# --------------------------------------------------------------------------------------

class _Attn(torch.nn.Module):
    def __init__(self, d, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(d, d, device="cuda", dtype=dtype)

    def forward(self, q, k, v):
        o, lse = flash_attn_func(q * 1.5, k, v, causal=True, return_attn_probs=True)
        return self.proj(o), lse.exp().sum(-1)


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    dtype, d = pick(True)
    m = _Attn(d, dtype).eval()
    cm = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        for seed, sq in ((0, 128), (1, 77)):
            q, k, v = inputs(2, sq, 200, 4, 2, d, dtype, seed=seed)
            e_out, e_l = m(q, k, v)
            c_out, c_l = cm(q, k, v)
            torch.testing.assert_close(c_out, e_out, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(c_l, e_l, atol=1e-3, rtol=1e-3)
            # the attention itself is the same kernel on the same inputs: bitwise equal
            e_att = flash_attn_func(q * 1.5, k, v, causal=True)
            c_att = torch.compile(lambda q, k, v: flash_attn_func(q * 1.5, k, v, causal=True),
                                  fullgraph=True)(q, k, v)
            assert torch.equal(e_att, c_att)


def test_torch_compile_dynamic_shapes():
    torch._dynamo.reset()
    dtype, d = pick(False)
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v), fullgraph=True, dynamic=True)
    for sq, sk in ((64, 64), (100, 333), (7, 1000)):
        q, k, v = inputs(1, sq, sk, 4, 4, d, dtype, seed=sq)
        out = f(q, k, v)
        assert out.shape == (1, sq, 4, d)
        assert torch.equal(out, flash_attn_func(q, k, v))


@pytest.mark.parametrize("layout", ["contiguous", "packed", "needs_copy"])
def test_cuda_graph_replay_on_new_data(layout):
    dtype, d = pick(True)
    b, s, h = 2, 257, 4

    def make(seed):
        if layout == "packed":
            p = rnd(b, s, 3, h, d, dtype=dtype, seed=seed)
            return p, (p[:, :, 0], p[:, :, 1], p[:, :, 2])
        q, k, v = inputs(b, s, s, h, h, d, dtype, seed=seed)
        if layout == "needs_copy":
            q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
        return None, (q, k, v)

    static_pack, (sq_, sk_, sv_) = make(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            flash_attn_func(sq_, sk_, sv_, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out, static_lse = flash_attn_func(sq_, sk_, sv_, causal=True, return_attn_probs=True)
    for seed in (11, 12):
        new_pack, (nq, nk, nv) = make(seed)
        if static_pack is not None:
            static_pack.copy_(new_pack)
        else:
            sq_.copy_(nq)
            sk_.copy_(nk)
            sv_.copy_(nv)
        g.replay()
        torch.cuda.synchronize()
        exp_out, exp_lse = flash_attn_func(nq, nk, nv, causal=True, return_attn_probs=True)
        assert torch.equal(static_out, exp_out) and torch.equal(static_lse, exp_lse)
        assert_fa3_rule(static_out, nq, nk, nv, True, lse=static_lse)


def _stream_counter_value(stream) -> int:
    """The int32 in ``stream``'s tile counter (launch._stream_counter; made on the stream's first causal call with
    more tiles than SMs), read after a synchronize."""
    import ctypes

    from cuda.bindings import driver as drv

    from flashgen import launch

    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    made = set(launch._stream_counters.values())
    ptr = launch._stream_counter(dev, stream.cuda_stream, launch._stream(stream.cuda_stream))
    assert ptr in made  # (the calls made it: it is not new)
    host = ctypes.c_int32(-7)
    launch.check(drv.cuMemcpyDtoH(ctypes.addressof(host), ptr, 4), "cuMemcpyDtoH")
    return host.value


def test_causal_calls_leave_their_streams_tile_counter_at_zero():
    """A causal call with more tiles than SMs claims its tiles from its stream's counter, which no memset zeroes
    before it (launch._stream_counter): the kernel's last claim, an atomicInc wrapping at num_tiles - 1
    (scheduler.cuh), leaves it at 0. Calls of other tile counts and grids in turn, on the default stream and on
    a side stream: each passes FA3's rule and equals a repeat of itself, and the stream's counter reads 0 after
    each (a count left over would make the next call on the stream skip that many tiles)."""
    dtype, d = pick(True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(4, 1000, 8), (2, 777, 16), (8, 400, 8), (1, 4099, 8), (3, 1000, 8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for b, s, h in shapes:
                assert b * h * -(-s // 192) > sms  # (tiles of at most 192 rows)
                q, k, v = inputs(b, s, s, h, h, d, dtype, seed=b * s)
                out = flash_attn_func(q, k, v, causal=True)
                assert _stream_counter_value(stream) == 0
                again = flash_attn_func(q, k, v, causal=True)
                assert _stream_counter_value(stream) == 0
                assert torch.equal(out, again)
                assert_fa3_rule(out, q, k, v, True)
    torch.cuda.current_stream().wait_stream(side)


def test_cuda_graph_replays_a_call_with_a_tile_counter():
    """A causal call with more tiles than SMs takes, under CUDA-graph capture, a tile counter of its own
    (launch._launch_argv: allocated, zeroed and freed on the stream: the graph's nodes). Each replay zeroes its
    counter again: the replays on new data (outputs poisoned first) equal eager calls; a count left from the
    last replay would skip every tile."""
    dtype, d = pick(True)
    b, s, h = 4, 1000, 8
    tiles = b * h * -(-s // 192)  # (tiles of at most 192 rows)
    assert tiles > torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = inputs(b, s, s, h, h, d, dtype, seed=5)
    assert_fa3_rule(flash_attn_func(q, k, v, causal=True), q, k, v, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = flash_attn_func(q, k, v, causal=True)
    for seed in (21, 22, 23):
        nq, nk, nv = inputs(b, s, s, h, h, d, dtype, seed=seed)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        static_out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, flash_attn_func(nq, nk, nv, causal=True))


def test_compile_reduce_overhead_cudagraphs():
    torch._dynamo.reset()
    dtype, d = pick(False)
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v) * 2, fullgraph=True, mode="reduce-overhead")
    for seed in range(3):
        q, k, v = inputs(2, 128, 256, 4, 2, d, dtype, seed=seed)
        out = f(q, k, v).clone()
        assert torch.equal(out, flash_attn_func(q, k, v) * 2)


# --------------------------------------------------------------------------------------
# DLPack entry with CuPy
# --------------------------------------------------------------------------------------

def _cupy():
    return pytest.importorskip("cupy")


def _cp_inputs(cp, b, sq, sk, h, hk, d, seed=0):
    rs = cp.random.RandomState(seed)
    return [rs.standard_normal(s, dtype=cp.float32).astype(cp.float16)
            for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


@pytest.mark.parametrize("causal", [False, True])
def test_dlpack_cupy_allocates_outputs(causal):
    cp = _cupy()
    d = pick(causal, torch.float16)[1]
    q, k, v = _cp_inputs(cp, 2, 97, 211, 4, 2, d, seed=3)
    out, lse = dlpack_api.flash_attn_forward(q, k, v, causal=causal)
    assert isinstance(out, cp.ndarray) and out.dtype == cp.float16 and out.shape == (2, 97, 4, d)
    assert isinstance(lse, cp.ndarray) and lse.dtype == cp.float32 and lse.shape == (2, 4, 97)
    cp.cuda.runtime.deviceSynchronize()
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    assert_fa3_rule(torch.from_dlpack(out), tq, tk, tv, causal, lse=torch.from_dlpack(lse))


def test_dlpack_cupy_given_outputs_on_a_stream():
    cp = _cupy()
    d = pick(False, torch.float16)[1]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        packed = cp.random.RandomState(4).standard_normal((2, 150, 3, 4, d), dtype=cp.float32).astype(cp.float16)
        q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        out = cp.full((2, 150, 4, d), cp.nan, dtype=cp.float16)
        lse = cp.full((2, 4, 150), cp.nan, dtype=cp.float32)
    r = dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse, stream=s, softmax_scale=0.1)
    assert r[0] is out and r[1] is lse
    s.synchronize()
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    assert_fa3_rule(torch.from_dlpack(out), tq, tk, tv, False, scale=0.1, lse=torch.from_dlpack(lse))


def test_dlpack_cupy_seqlen_k_zero_memsets():
    cp = _cupy()
    d = pick(False, torch.float16)[1]
    q, k, v = _cp_inputs(cp, 2, 9, 0, 4, 2, d)
    out, lse = dlpack_api.flash_attn_forward(q, k, v)
    cp.cuda.runtime.deviceSynchronize()
    assert bool((out == 0).all()) and bool(cp.isneginf(lse).all())
    big = cp.full((2, 9, 4, 2 * d), 7, dtype=cp.float16)
    out2 = big[..., :d]
    lse2 = cp.zeros((2, 4, 9), dtype=cp.float32)
    dlpack_api.flash_attn_forward(q, k, v, out=out2, lse=lse2, stream=cp.cuda.Stream.null)
    cp.cuda.runtime.deviceSynchronize()
    assert bool((out2 == 0).all()) and bool((big[..., d:] == 7).all()) and bool(cp.isneginf(lse2).all())


def test_dlpack_cupy_errors():
    cp = _cupy()
    d = pick(False, torch.float16)[1]
    q, k, v = _cp_inputs(cp, 2, 9, 9, 4, 2, d)
    with pytest.raises(ValueError, match="q cannot be read by TMA"):
        dlpack_api.flash_attn_forward(cp.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2), k, v)
    with pytest.raises(ValueError, match="k and v must have the same seqlen_k"):
        dlpack_api.flash_attn_forward(q, k, v[:, :5])


def test_dlpack_torch_bf16_on_a_stream():
    dtype, d = pick(False, torch.bfloat16)
    q, k, v = inputs(2, 64, 130, 4, 4, d, dtype, seed=9)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    out, lse = dlpack_api.flash_attn_forward(q, k, v, stream=s)
    s.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_fa3_rule(out, q, k, v, False, lse=lse)
