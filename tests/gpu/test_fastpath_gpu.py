"""GPU tests of flash_attn_func's eager fast path (prepared calls, interface._fwd_calls, and the core's
prepared launches): bitwise the results of the op path (torch.ops.flashgen.fwd, which validates
and prepares afresh) on the first call of a key and on cached calls, for contiguous, GQA,
strided-in-place (packed qkv, KV-cache prefix) and copied (misaligned, transposed) inputs, with a
window, softcap, sink and FP8 descales where built; out alone (no lse allocated or written); new data,
scale, softcap value and sink on a cached key; many live outputs (a TMA map per fresh out address).

Skipped without an sm_90 GPU (tests/gpu/conftest.py); a case whose variant is not built is skipped.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen.core as core  # noqa: E402
import flashgen.interface as interface  # noqa: E402
from flashgen.dispatch import MissingVariantError  # noqa: E402
from flashgen.interface import flash_attn_func  # noqa: E402

from test_api_gpu import assert_fa3_rule, inputs, pick, rnd  # noqa: E402

pytestmark = pytest.mark.gpu


def op(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, sink=None, descales=(None, None, None)):
    """(out, lse) of torch.ops.flashgen.fwd: the op path, validated and prepared afresh each call."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.flashgen.fwd(q, k, v, scale, causal, False, window[0], window[1], softcap, sink, *descales)


def fast(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, sink=None, descales=(None, None, None),
         lse=True):
    """(out, lse) of flash_attn_func (``lse`` False: out alone, return_attn_probs False)."""
    return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                           learnable_sink=sink, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                           return_attn_probs=lse)


def same(a, b, what=""):
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), what


def _case(name, dtype, d):
    """(q, k, v, kwargs, in_place) of a named case."""
    if name == "contiguous":
        return (*inputs(2, 200, 300, 8, 8, d, dtype, seed=1), {}, True)
    if name == "gqa causal":
        return (*inputs(1, 77, 99, 8, 2, d, dtype, seed=2), {"causal": True}, True)
    if name == "mqa seqlen_q 1":
        return (*inputs(3, 1, 257, 4, 1, d, dtype, seed=3), {}, True)
    if name == "packed qkv":
        packed = rnd(2, 150, 3, 4, d, dtype=dtype, seed=4)
        return (packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], {"causal": True}, True)
    if name == "kv-cache prefix":
        kc, vc = rnd(2, 512, 2, d, dtype=dtype, seed=5), rnd(2, 512, 2, d, dtype=dtype, seed=6)
        return (rnd(2, 33, 4, d, dtype=dtype, seed=7), kc[:, :201], vc[:, :201], {"causal": True}, True)
    if name == "misaligned k":
        q, k, v = inputs(2, 64, 96, 4, 4, d, dtype, seed=8)
        flat = torch.empty(k.numel() + 1, dtype=dtype, device="cuda")
        k_mis = flat[1:].view(k.shape)
        k_mis.copy_(k)
        return (q, k_mis, v, {}, False)
    if name == "transposed q":
        q, k, v = inputs(2, 64, 96, 4, 4, d, dtype, seed=9)
        return (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, {}, False)
    if name == "window softcap sink":
        q, k, v = inputs(2, 100, 140, 4, 2, d, dtype, seed=10)
        sink = torch.randn(4, device="cuda")
        return (q, k, v, {"window": (32, 8), "softcap": 15.0, "sink": sink}, True)
    raise KeyError(name)


CASES = ["contiguous", "gqa causal", "mqa seqlen_q 1", "packed qkv", "kv-cache prefix", "misaligned k",
         "transposed q", "window softcap sink"]


@pytest.fixture
def routes(monkeypatch):
    """How each launch reached the core: "prepared" (core.launch_forward: q, k, v in place) or
    "generic" (core.attention_forward, with copies); flash_attn_func's cache starts empty."""
    seen = []
    inside = []  # core.attention_forward itself ends in launch_forward: counted as "generic" only
    real_launch, real_generic = core.launch_forward, core.attention_forward

    def launch(*a):
        if not inside:
            seen.append("prepared")
        return real_launch(*a)

    def generic(*a, **kw):
        seen.append("generic")
        inside.append(1)
        try:
            return real_generic(*a, **kw)
        finally:
            inside.pop()

    monkeypatch.setattr(core, "launch_forward", launch)
    monkeypatch.setattr(core, "attention_forward", generic)
    monkeypatch.setattr(interface, "_fwd_calls", {})
    return seen


def _case_and_ref(name):
    """(q, k, v, kwargs, in_place, the op path's (out, lse)) of a named case; skipped when not built."""
    dtype, d = pick(causal=None)
    q, k, v, kw, in_place = _case(name, dtype, d)
    try:
        return q, k, v, kw, in_place, op(q, k, v, **kw)
    except MissingVariantError as e:
        pytest.skip(f"not built: {e}")


@pytest.mark.parametrize("name", CASES)
def test_fast_path_is_bitwise_the_op_path(name, routes):
    q, k, v, kw, in_place, ref = _case_and_ref(name)
    routes.clear()
    first = fast(q, k, v, **kw)  # a new key: validated and prepared
    again = fast(q, k, v, **kw)  # the cached key
    assert len(interface._fwd_calls) == 1
    assert routes == ["prepared" if in_place else "generic"] * 2, "in-place inputs take the prepared launch"
    same(first, ref, "first call")
    same(again, ref, "cached call")
    if name in ("contiguous", "gqa causal", "packed qkv"):
        assert_fa3_rule(first[0], q, k, v, kw.get("causal", False), lse=first[1])


@pytest.mark.parametrize("name", CASES)
def test_out_alone_allocates_and_writes_no_lse(name, routes):
    """Without return_attn_probs (nothing requiring grad) the prepared launch gets a null lse: the kernel
    writes no LSE (a store through the null pointer would fault at the synchronize) and the call allocates
    out alone; out is bitwise the op path's. Copied inputs take the generic launch, which writes lse."""
    q, k, v, kw, in_place, ref = _case_and_ref(name)
    fast(q, k, v, **kw, lse=False)  # a new key
    torch.cuda.synchronize()
    routes.clear()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = fast(q, k, v, **kw, lse=False)
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    torch.cuda.synchronize()
    assert torch.equal(out, ref[0])
    assert routes == ["prepared" if in_place else "generic"]
    assert allocations == 1 if in_place else allocations >= 3  # out; or out, lse and a copy


def test_cached_key_takes_each_calls_data_scale_softcap_and_sink(monkeypatch):
    monkeypatch.setattr(interface, "_fwd_calls", {})
    dtype, d = pick(causal=False)
    for i, (scale, cap) in enumerate(((None, 0.0), (0.05, 0.0), (-0.2, 0.0), (0.1, 5.0), (0.1, 30.0))):
        q, k, v = inputs(2, 96, 160, 4, 2, d, dtype, seed=20 + i)
        sink = torch.randn(4, device="cuda") if i % 2 else None
        try:
            ref = op(q, k, v, scale, softcap=cap, sink=sink)
        except MissingVariantError as e:
            pytest.skip(f"not built: {e}")
        same(fast(q, k, v, scale, softcap=cap, sink=sink), ref, f"call {i}")
    assert len(interface._fwd_calls) == 4  # softcap off / on, each with and without a sink


def test_many_live_outputs_each_get_their_own_maps():
    """Outputs kept alive: every call writes a fresh out (a TMA map per address); each is the op's."""
    dtype, d = pick(causal=True)
    q, k, v = inputs(1, 128, 128, 2, 2, d, dtype, seed=30)
    outs = [fast(q, k, v, causal=True) for _ in range(64)]
    assert len({o[0].data_ptr() for o in outs}) == 64
    ref = op(q, k, v, causal=True)
    for o in outs:
        same(o, ref)


def test_fp8_with_descales_bitwise(monkeypatch):
    monkeypatch.setattr(interface, "_fwd_calls", {})
    q, k, v = (t.to(torch.float8_e4m3fn) for t in inputs(2, 130, 200, 4, 2, 128, torch.bfloat16, seed=40))
    for ds in ((torch.rand(2, 2, device="cuda") + 0.5, None, torch.rand(2, 2, device="cuda") + 0.5),
               (torch.rand(2, 4, 3, device="cuda") + 0.5, torch.rand(2, 2, 4, device="cuda") + 0.5, None)):
        try:
            ref = op(q, k, v, causal=True, descales=ds)
        except MissingVariantError as e:
            pytest.skip(f"not built: {e}")
        same(fast(q, k, v, causal=True, descales=ds), ref)
        same(fast(q, k, v, causal=True, descales=ds), ref)
        out = fast(q, k, v, causal=True, descales=ds, lse=False)  # a null lse
        torch.cuda.synchronize()
        assert torch.equal(out, ref[0])
