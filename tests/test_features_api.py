"""CPU tests of FA3's sliding window (``window_size``), logit soft-capping (``softcap``) and
learnable attention sinks (``learnable_sink``) in flashgen's user APIs: flash_attn_func (its
ops torch.ops.flashgen.fwd / bwd, their fakes, autograd including the sink's gradient,
torch.compile) and the DLPack entries flash_attn_forward / flash_attn_backward.

No GPU here. The emulated core of tests/test_api_validation.py (`fake_gpu`) and the emulated
backward of tests/test_bwd_api.py (`gpu`) compute attention through the TensorArgs they are
given, with the window, softcap and sink address they receive; the results are compared with
a reference written from the definitions (FA3's bottom-right aligned window, c * tanh(x / c),
the sink in the softmax denominator), so a wrong value handed to the core, or a dropped one,
gives a wrong result here.
"""

from __future__ import annotations

import ctypes
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flashgen.core as core
import flashgen.dlpack_api as dlpack_api
import flashgen.interface as interface
from flashgen import _validate as V
from flashgen.interface import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import torch_allocates_on_cpu  # noqa: E402
from test_api_validation import (  # noqa: E402,F401
    _as_dlpack_message, assert_problems, fake_gpu, fake_gpu_dlpack, mask, qkv, reference,
)
from test_bwd_api import FakeBwd, assert_close, dl, gpu, reference_grads  # noqa: E402,F401


def sink_of(h=4, seed=3, dtype=torch.float32):
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _raises(fake_gpu, exc, fragment, *args, **kwargs):
    with pytest.raises(exc) as info:
        flash_attn_func(*args, **kwargs)
    assert type(info.value) is exc, info.value
    assert fragment in str(info.value), str(info.value)
    assert fake_gpu.calls == [] and fake_gpu.selected == []
    return info.value


# --------------------------------------------------------------------------------------
# The mask the API relies on: core.mask_spec against FA3's rule written out
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 9), (5, 7), (7, 5), (6, 6)])
def test_core_mask_spec_matches_fa3_rule(sq, sk):
    for causal in (False, True):
        for left in (-1, None, 0, 1, 3, sk - 1, sk + 4):
            for right in (-1, None, 0, 2, sq - 1, sq + 3):
                spec = core.mask_spec(causal, (left, right), sq, sk)
                want = mask(sq, sk, causal, (left, right))
                i = torch.arange(sq).view(-1, 1)
                j = torch.arange(sk).view(1, -1)
                got = ((j >= i + sk - sq - spec.left) & (j <= i + sk - sq + spec.right)) if (spec.causal or spec.local) \
                    else torch.ones(sq, sk, dtype=torch.bool)
                assert torch.equal(got, want), (causal, left, right, spec)
                assert spec.left >= 0 and spec.right >= 0


# --------------------------------------------------------------------------------------
# _validate: window_size, softcap, learnable_sink
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [(-1, -1), [-1, -1], (None, None), (0, 0), (5, None), [None, 3],
                                    (np.int64(2), np.int32(0)), (10**9, 0)])
def test_window_size_valid(window):
    assert V.window_size_problems(window) == []
    left, right = V.window_pair(window)
    assert type(left) is int and type(right) is int
    assert (left, right) == tuple(-1 if x is None else int(x) for x in window)


@pytest.mark.parametrize("window,exc,fragment", [
    (5, TypeError, "window_size must be a pair (left, right), each an int >= -1 or None (-1 / None: unbounded), "
                   "got int 5"),
    (None, TypeError, "window_size must be a pair (left, right)"),
    ("ab", TypeError, "window_size must be a pair (left, right)"),
    (range(2), TypeError, "window_size must be a pair (left, right)"),
    ((1, 2, 3), ValueError, "window_size must be a pair (left, right), each an int >= -1 or None (-1 / None: "
                            "unbounded), got 3 entries: (1, 2, 3)"),
    ([4], ValueError, "got 1 entries"),
    ((1.0, 0), TypeError, "window_size[0] (left) must be an int >= -1 or None (-1 / None: unbounded), got float 1.0"),
    ((0, True), TypeError, "window_size[1] (right) must be an int >= -1 or None (-1 / None: unbounded), got bool True"),
    ((0, "3"), TypeError, "window_size[1] (right) must be an int >= -1 or None"),
    ((-2, 0), ValueError, "window_size[0] (left) must be an int >= -1 or None (-1 / None: unbounded), got -2"),
    ((0, -100), ValueError, "window_size[1] (right) must be an int >= -1 or None (-1 / None: unbounded), got -100"),
])
def test_window_size_problems(window, exc, fragment):
    ((kind, message),) = V.window_size_problems(window)
    assert kind is exc and fragment in message and message.startswith("window_size")


def test_window_size_both_sides_reported():
    problems = V.window_size_problems((-3, 2.5))
    assert [k for k, _ in problems] == [ValueError, TypeError]
    assert "window_size[0] (left)" in problems[0][1] and "window_size[1] (right)" in problems[1][1]


@pytest.mark.parametrize("softcap", [0, 0.0, 1, 30.0, np.float32(2.5), 1e30])
def test_softcap_valid(softcap):
    assert V.softcap_problems(softcap) == []


@pytest.mark.parametrize("softcap,exc,fragment", [
    (-1.0, ValueError, "softcap must be a finite number >= 0 (0 = off), got -1.0"),
    (-1e-9, ValueError, "got -1e-09"),
    (float("nan"), ValueError, "softcap must be a finite number >= 0 (0 = off), got nan"),
    (float("inf"), ValueError, "got inf"),
    (True, TypeError, "softcap must be a real number (float) >= 0 (0 = off), got bool"),
    ("1", TypeError, "got str"),
    (None, TypeError, "got NoneType"),
    (torch.tensor(1.0), TypeError, "got Tensor"),
    (1j, TypeError, "got complex"),
])
def test_softcap_problems(softcap, exc, fragment):
    ((kind, message),) = V.softcap_problems(softcap)
    assert kind is exc and fragment in message


def test_feature_problems_window_softcap_no_longer_not_implemented():
    assert V.feature_problems(window_size=(128, 0), softcap=30.0) == []
    assert V.feature_problems(attention_chunk=8) == []  # chunked attention is served (test_chunk_api.py)
    kinds = [k for k, _ in V.feature_problems(window_size=(1, 2, 3), softcap=-1, qv=object(), attention_chunk=-8)]
    assert kinds == [ValueError, ValueError, NotImplementedError, ValueError]
    with pytest.raises(V.InputError):
        V.check_features(window_size=(1, 2, 3), qv=object())


def _sinfo(shape=(4,), dtype="fp32", strides=None, device=0):
    strides = tuple(torch.empty(shape).stride()) if strides is None else strides
    return V.ArrayInfo(tuple(shape), strides, dtype, dtype, device is not None, device,
                       "cpu" if device is None else f"cuda:{device}")


PROB = V.Problem(batch=2, seqlen_q=5, seqlen_k=7, heads=4, heads_k=2, head_dim=64, head_dim_v=64, dtype="fp16",
                 device=0)


@pytest.mark.parametrize("info,kw,exc,fragment", [
    (_sinfo((3,)), {}, ValueError, "learnable_sink must have shape (heads,) = (4,) (one logit per query head), "
                                   "got (3,)"),
    (_sinfo((1, 4)), {}, ValueError, "got (1, 4)"),
    (_sinfo((), strides=()), {}, ValueError, "got ()"),
    (_sinfo(dtype="fp16"), {}, TypeError, "learnable_sink must have dtype float32, got fp16"),
    (_sinfo(dtype="bf16"), {}, TypeError, "got bf16"),
    (_sinfo(device=None), {}, ValueError, "learnable_sink must be on q's CUDA device 0, got cpu"),
    (_sinfo(device=1), {}, ValueError, "learnable_sink must be on q's CUDA device 0, got cuda:1"),
    (_sinfo(strides=(2,)), dict(contiguous=True), ValueError,
     "learnable_sink must be C-contiguous (stride 1), got strides (2,); pass a contiguous copy"),
    (_sinfo(), dict(contiguous=True, ptr=0x1002), ValueError,
     "learnable_sink's base address 0x1002 is not 4-byte aligned"),
])
def test_learnable_sink_problems(info, kw, exc, fragment):
    ((kind, message),) = V.learnable_sink_problems(info, PROB, **kw)
    assert kind is exc and fragment in message


def test_learnable_sink_problems_valid_and_torch_allows_strides():
    assert V.learnable_sink_problems(_sinfo(), PROB) == []
    assert V.learnable_sink_problems(_sinfo(), PROB, 0x1004, contiguous=True) == []
    assert V.learnable_sink_problems(_sinfo(strides=(2,)), PROB) == []  # the torch API copies
    assert V.learnable_sink_problems(_sinfo((1,), strides=(7,)), PROB._replace(heads=1), contiguous=True) == []
    both = V.learnable_sink_problems(_sinfo((3,), "fp16"), PROB)
    assert [k for k, _ in both] == [ValueError, TypeError]


# --------------------------------------------------------------------------------------
# flash_attn_func: validation
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("window,exc", [
    (5, TypeError), ((1, 2, 3), ValueError), ((0.5, 0), TypeError), ((False, 0), TypeError), ((-2, 0), ValueError),
    ((0, -7), ValueError), (None, TypeError),
])
def test_flash_attn_func_window_size_errors(fake_gpu, window, exc):
    err = _raises(fake_gpu, exc, "window_size", *qkv(), window_size=window)
    assert str(err).startswith("flashgen: window_size")


@pytest.mark.parametrize("softcap,exc", [(-0.5, ValueError), (float("nan"), ValueError), (math.inf, ValueError),
                                         (True, TypeError), ("2", TypeError), (None, TypeError)])
def test_flash_attn_func_softcap_errors(fake_gpu, softcap, exc):
    err = _raises(fake_gpu, exc, "softcap", *qkv(), softcap=softcap)
    assert str(err).startswith("flashgen: softcap must be")


@pytest.mark.parametrize("make,exc,fragment", [
    (lambda: [0.0] * 4, TypeError, "learnable_sink must be None or a float32 (heads,) torch.Tensor, got list"),
    (lambda: np.zeros(4, np.float32), TypeError, "got ndarray"),
    (lambda: torch.zeros(4, dtype=torch.float64), TypeError,
     "learnable_sink must have dtype float32, got torch.float64"),
    (lambda: torch.zeros(4, dtype=torch.float16), TypeError, "got torch.float16"),
    (lambda: torch.zeros(2), ValueError, "learnable_sink must have shape (heads,) = (4,) (one logit per query head), "
                                         "got (2,)"),
    (lambda: torch.zeros(2, 4), ValueError, "got (2, 4)"),  # (heads_k, group) is not accepted either
    (lambda: torch.zeros(1), ValueError, "got (1,)"),  # no broadcast
])
def test_flash_attn_func_learnable_sink_errors(fake_gpu, make, exc, fragment):
    _raises(fake_gpu, exc, fragment, *qkv(), learnable_sink=make())


def test_learnable_sink_on_another_device(fake_gpu, monkeypatch):
    sink = sink_of()
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1) if t is sink else (True, 0))
    _raises(fake_gpu, ValueError, "learnable_sink must be on q's CUDA device 0, got cpu", *qkv(), learnable_sink=sink)
    monkeypatch.setattr(interface, "_device_of", lambda t: (False, None) if t is sink else (True, 0))
    _raises(fake_gpu, ValueError, "learnable_sink must be on q's CUDA device 0", *qkv(), learnable_sink=sink)


def test_learnable_sink_shape_and_dtype_in_one_error(fake_gpu):
    with pytest.raises(V.InputError) as info:
        flash_attn_func(*qkv(), learnable_sink=torch.zeros(3, dtype=torch.float64))
    assert_problems(info.value, "learnable_sink must have shape (heads,) = (4,)",
                    "learnable_sink must have dtype float32, got torch.float64")
    assert fake_gpu.calls == []


def test_window_softcap_and_other_problems_in_one_error(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(V.InputError) as info:
        flash_attn_func(q, k[:1], v, window_size=(-4, None), softcap=float("inf"), learnable_sink="sink")
    assert_problems(info.value,
                    "learnable_sink must be None or a float32 (heads,) torch.Tensor, got str",
                    "k has batch 1 but q has batch 2",
                    "window_size[0] (left) must be an int >= -1 or None (-1 / None: unbounded), got -4",
                    "softcap must be a finite number >= 0 (0 = off), got inf")
    assert fake_gpu.calls == [] and fake_gpu.selected == []


def test_ops_validate_new_arguments(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^flashgen: window_size\[0\] \(left\) must be an int >= -1"):
        torch.ops.flashgen.fwd(q, k, v, 0.1, False, False, -5, 0)
    with pytest.raises(ValueError, match=r"^flashgen: softcap must be a finite number >= 0"):
        torch.ops.flashgen.fwd(q, k, v, 0.1, False, False, -1, -1, -2.0)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads,\) = \(4,\)"):
        torch.ops.flashgen.fwd(q, k, v, 0.1, False, False, -1, -1, 0.0, torch.zeros(5))
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.1, False)
    with pytest.raises(ValueError, match=r"^flashgen: window_size\[1\] \(right\)"):
        torch.ops.flashgen.bwd(out, q, k, v, out, lse, 0.1, False, False, -1, -9)
    with pytest.raises(ValueError, match=r"^flashgen: softcap must be"):
        torch.ops.flashgen.bwd(out, q, k, v, out, lse, 0.1, False, False, -1, -1, float("nan"))
    assert len(fake_gpu.calls) == 1


# --------------------------------------------------------------------------------------
# flash_attn_func: what reaches the core, and the results
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window,softcap,with_sink", [
    (False, (2, 1), 0.0, False),
    (True, (3, -1), 0.0, False),  # causal sliding window
    (False, (None, 0), 0.0, False),  # None = unbounded: causal by window
    (False, (-1, -1), 4.0, False),
    (True, (1, 5), 2.5, True),  # causal forces right = 0
    (False, (0, 0), 0.0, True),
    (False, (-1, -1), 0.0, True),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_features_reach_the_core_and_match_reference(fake_gpu, causal, window, softcap, with_sink, dtype):
    q, k, v = qkv(sq=6, sk=9, dtype=dtype)
    sink = sink_of() if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink,
                               return_attn_probs=True)
    (call,) = fake_gpu.calls
    assert call["window_size"] == tuple(-1 if x is None else x for x in window)
    assert call["softcap"] == softcap and call["causal"] is causal
    if with_sink:
        assert call["sink"] == sink.data_ptr()  # contiguous: used in place
        assert torch.equal(call["sink_values"], sink)
    else:
        assert call["sink"] == 0
    ((family, key),) = fake_gpu.selected
    assert key["softcap"] is (softcap > 0)
    m = core.mask_spec(causal, window, 6, 9)
    assert (key["causal"], key["local"]) == (m.causal, m.local) and not (m.causal and m.local)
    ref, ref_lse = reference(q, k, v, 64 ** -0.5, causal, window, softcap, sink)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert (out.float() - ref).abs().max().item() <= tol
    assert torch.allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_reference_sink_changes_the_result():
    """The reference itself: the sink only adds to the denominator (a check on the test's yardstick)."""
    q, k, v = qkv()
    sink = sink_of()
    out0, lse0 = reference(q, k, v, 0.125, False)
    out1, lse1 = reference(q, k, v, 0.125, False, sink=sink)
    want_lse = torch.logaddexp(lse0, sink.view(1, 4, 1))
    assert torch.allclose(lse1, want_lse, atol=1e-6)
    scale = torch.exp(lse0 - lse1).transpose(1, 2).unsqueeze(-1)  # (b, sq, h, 1)
    assert torch.allclose(out1, out0 * scale, atol=1e-6)


def test_strided_sink_is_copied_contiguous(fake_gpu):
    base = torch.randn(8)
    sink = base[::2]
    assert not sink.is_contiguous()
    q, k, v = qkv()
    out = flash_attn_func(q, k, v, learnable_sink=sink)
    (call,) = fake_gpu.calls
    assert call["sink"] != sink.data_ptr() and torch.equal(call["sink_values"], sink)
    ref, _ = reference(q, k, v, 64 ** -0.5, False, sink=sink)
    assert (out.float() - ref).abs().max().item() <= 2e-3


def test_fast_path_passes_the_features(fake_gpu, monkeypatch):
    seen = []
    real = interface._fwd_run
    monkeypatch.setattr(interface, "_fwd_run", lambda *a: seen.append(a[6:]) or real(*a))
    q, k, v = qkv()
    sink = sink_of()
    flash_attn_func(q, k, v, window_size=[None, 2], softcap=3, learnable_sink=sink)
    ((wl, wr, cap, s, descales, want_lse),) = seen
    assert descales == (None, None, None) and want_lse is False  # out alone: no lse allocated or written
    assert (wl, wr, cap) == (-1, 2, 3.0) and type(cap) is float and s is sink
    assert fake_gpu.calls[0]["softcap"] == 3.0 and fake_gpu.calls[0]["window_size"] == (-1, 2)


def test_sink_that_requires_grad_takes_the_op(fake_gpu, monkeypatch):
    new = []  # keys validated anew (_new_fwd_call: q, k, v and the sink checked once per metadata key)
    make = interface._new_fwd_call
    monkeypatch.setattr(interface, "_new_fwd_call", lambda *a: new.append(a[0]) or make(*a))
    interface._fwd_calls.clear()
    q, k, v = qkv()
    sink = sink_of().requires_grad_(True)
    out = flash_attn_func(q, k, v, learnable_sink=sink)
    # the op's code and autograd formula (interface._FwdFn), recorded by autograd
    assert len(new) == 1 and type(out.grad_fn).__name__ == "_FwdFnBackward"
    with torch.no_grad():
        out = flash_attn_func(q, k, v, learnable_sink=sink)
    assert len(new) == 1 and out.grad_fn is None  # no grad mode: the fast path, on the same validated key
    assert len(fake_gpu.calls) == 2


@pytest.mark.parametrize("with_sink", [False, True])
def test_seqlen_k_zero_with_and_without_sink(fake_gpu, with_sink):
    q, k, v = qkv(b=3, sq=5, sk=0)
    sink = sink_of()[::1] if with_sink else None
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(2, 0), learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out)) and lse.shape == (3, 4, 5) and lse.is_contiguous()
    if with_sink:
        assert torch.equal(lse, sink.view(1, 4, 1).expand(3, 4, 5))
    else:
        assert bool((lse == -math.inf).all())
    assert fake_gpu.calls == [] and fake_gpu.selected == []


def test_seqlen_k_zero_strided_sink(fake_gpu):
    sink = torch.arange(8.0)[::2]
    q, k, v = qkv(b=2, sq=3, sk=0)
    _, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(lse, torch.tensor([0.0, 2.0, 4.0, 6.0]).view(1, 4, 1).expand(2, 4, 3))


def test_empty_batch_with_sink(fake_gpu):
    q, k, v = qkv(b=0)
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink_of(), return_attn_probs=True)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5) and fake_gpu.calls == []


def test_head_dim_multiple_of_8_reaches_the_lookup(fake_gpu):
    q, k, v = qkv(d=72, dv=40)  # any multiple of 8: the core rounds up to a built size
    out = flash_attn_func(q, k, v, softcap=1.0)
    assert out.shape == (2, 5, 4, 40)
    ((_, key),) = fake_gpu.selected
    assert (key["head_dim"], key["head_dim_v"], key["softcap"]) == (72, 40, True)


# --------------------------------------------------------------------------------------
# Backward: window and softcap reach the kernels; the sink's gradient
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window,softcap", [
    (False, (2, 1), 0.0), (True, (3, -1), 0.0), (False, (-1, -1), 3.0), (True, (None, None), 1.5), (False, (0, 4), 2.0),
])
def test_backward_features_reach_the_core(gpu, causal, window, softcap):
    q, k, v = (t.requires_grad_(True) for t in qkv(sq=6, sk=9))
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, deterministic=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).half()
    (out.float() * w.float()).sum().backward()
    (call,) = gpu.calls
    want_window = tuple(-1 if x is None else x for x in window)
    assert call["window_size"] == want_window and call["softcap"] == softcap and call["causal"] is causal
    (ws,) = gpu.workspace_calls
    assert ws == dict(batch=2, seqlen_q=6, seqlen_k=9, causal=causal, window_size=want_window, softcap=softcap,
                      head_dim=64, head_dim_v=64)
    bwd_key = [key for family, key in gpu.fwd.selected if family == "bwd"]
    m = core.mask_spec(causal, window, 6, 9)
    assert bwd_key == [{"dtype": "fp16", "head_dim": 64, "causal": m.causal, "local": m.local,
                        "softcap": softcap > 0}]
    for t, ref in zip((q, k, v), reference_grads(q, k, v, w, 64 ** -0.5, causal, window, softcap)):
        assert_close(t.grad, ref)


def test_forward_saves_the_sink(gpu):
    q, k, v = (t.requires_grad_(True) for t in qkv())
    sink = sink_of().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (q, k, v, out, lse, sink)]


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (2, -1), 3.0)])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 1)])
def test_sink_gradient_through_autograd_matches_reference(gpu, causal, window, softcap, h, hk):
    q, k, v = (t.requires_grad_(True) for t in qkv(sq=6, sk=9, h=h, hk=hk))
    sink = sink_of(h).requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).half()
    (out.float() * w.float()).sum().backward()
    # reference: float64 autograd of the definition
    q64, k64, v64, s64 = (t.detach().double().requires_grad_(True) for t in (q, k, v, sink))
    ref_out, _ = reference(q64, k64, v64, 64 ** -0.5, causal, window, softcap, s64)
    (ref_out * w.double()).sum().backward()
    assert sink.grad.dtype == torch.float32 and sink.grad.shape == (h,)
    assert torch.allclose(sink.grad.double(), s64.grad, atol=5e-3 * max(1.0, s64.grad.abs().max().item()))
    assert s64.grad.abs().max() > 1e-2  # a gradient that could be wrong
    for t, ref in ((q, q64.grad), (k, k64.grad), (v, v64.grad)):  # dq, dk, dv with the sink in lse
        assert_close(t.grad, ref.float())
    (call,) = gpu.calls
    assert call["window_size"] == window and call["softcap"] == softcap


def test_only_the_sink_requires_grad(gpu):
    q, k, v = qkv()
    sink = sink_of().requires_grad_(True)
    out = flash_attn_func(q, k, v, learnable_sink=sink)
    (g,) = torch.autograd.grad(out.float().sum(), (sink,))
    s64 = sink.detach().double().requires_grad_(True)
    ref_out, _ = reference(q.double(), k.double(), v.double(), 64 ** -0.5, False, sink=s64)
    (ref,) = torch.autograd.grad(ref_out.sum(), (s64,))
    assert torch.allclose(g.double(), ref, atol=5e-3 * max(1.0, ref.abs().max().item()))


def _sink_grad_case(dtype=torch.float64, causal=True, sq=6, sk=4, h=4, hk=2, seed=0):
    q, k, v = qkv(sq=sq, sk=sk, h=h, hk=hk, seed=seed)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    sink = sink_of(h, seed=seed + 1, dtype=dtype).requires_grad_(True)
    out, lse = reference(q, k, v, 0.3, causal, (1, -1) if causal else (-1, -1), 2.0, sink)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=dtype)
    return sink, out, lse, dout


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_sink_grad_helper_matches_float64_autograd(seed, causal):
    sink, out, lse, dout = _sink_grad_case(causal=causal, seed=seed)
    (want,) = torch.autograd.grad((out * dout).sum(), (sink,))
    got = interface._sink_grad(dout, out.detach(), lse.detach().float(), sink.detach())
    assert got.dtype == sink.dtype and got.shape == sink.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
    # the formula, term by term: d_sink[h] = -sum_{b,i} exp(sink[h] - lse) * sum_d dout * out
    dpsum = (dout * out.detach()).sum(-1).transpose(1, 2)
    manual = -(torch.exp(sink.detach().view(1, -1, 1) - lse.detach()) * dpsum).sum((0, 2))
    assert torch.allclose(got, manual, rtol=1e-5, atol=1e-6)


def test_sink_grad_helper_dtype_shape_and_empty_rows():
    b, sq, h, d = 2, 3, 4, 8
    out = torch.randn(b, sq, h, d).half()
    dout = torch.randn(b, sq, h, d).half()
    lse = torch.randn(b, h, sq)
    sink = torch.tensor([0.5, -math.inf, 1.0, 0.0], dtype=torch.bfloat16)
    lse[:, 1, :] = -math.inf  # head 1: sink -inf and no key seen: lse -inf, contributes 0 (no NaN)
    lse[0, 2, 1] = -math.inf  # cannot happen with a finite sink, but must not give NaN either
    got = interface._sink_grad(dout, out, lse, sink)
    assert got.dtype == torch.bfloat16 and got.shape == (4,)
    assert torch.isfinite(got.float()).all() and got[1].item() == 0.0
    dpsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    want0 = -(torch.exp(0.5 - lse[:, 0]) * dpsum[:, 0]).sum()
    assert math.isclose(got[0].item(), want0.item(), rel_tol=1e-2)


@pytest.mark.parametrize("b", [1, 3])
def test_seqlen_k_zero_sink_gradient_is_zero(gpu, b):
    q, k, v = (t.requires_grad_(True) for t in qkv(b=b, sk=0))
    sink = sink_of().requires_grad_(True)
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert torch.equal(lse, sink.detach().view(1, 4, 1).expand(b, 4, 5))
    out.float().sum().backward()
    assert torch.equal(sink.grad, torch.zeros(4)) and gpu.calls == []


# --------------------------------------------------------------------------------------
# Fakes, opcheck, torch.compile
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [
    ((2, 5, 4, 64), (2, 7, 2, 64), (2, 7, 2, 64)),
    ((1, 33, 8, 192), (1, 19, 1, 192), (1, 19, 1, 128)),
    ((3, 6, 2, 64), (3, 0, 2, 64), (3, 0, 2, 64)),
])
def test_fwd_fake_with_new_arguments(fake_gpu, shapes):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = [torch.randn(s).half() for s in shapes]
    sink = sink_of(shapes[0][2])
    args = (0.125, True, False, 3, -1, 5.0)
    out_r, lse_r = torch.ops.flashgen.fwd(*real, *args, sink)
    with FakeTensorMode() as mode:
        out_f, lse_f = torch.ops.flashgen.fwd(*(mode.from_tensor(t) for t in real), *args, mode.from_tensor(sink))
        with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads,\)"):
            torch.ops.flashgen.fwd(*(mode.from_tensor(t) for t in real), *args, mode.from_tensor(torch.zeros(99)))
        with pytest.raises(ValueError, match=r"window_size\[0\]"):
            torch.ops.flashgen.fwd(*(mode.from_tensor(t) for t in real), 0.125, True, False, -3, -1, 5.0)
    for r, f in ((out_r, out_f), (lse_r, lse_f)):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype and f.stride() == r.stride()


def test_bwd_fake_with_new_arguments(gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = qkv()
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, False, False, 2, 1, 4.0)
    args = (out, q, k, v, out, lse)
    real = torch.ops.flashgen.bwd(*args, 0.125, False, False, 2, 1, 4.0)
    with FakeTensorMode() as mode:
        fake = torch.ops.flashgen.bwd(*(mode.from_tensor(t) for t in args), 0.125, False, False, 2, 1, 4.0)
        with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
            torch.ops.flashgen.bwd(*(mode.from_tensor(t) for t in args), 0.125, False, False, 2, 1, -4.0)
    for r, f in zip(real, fake):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype and f.stride() == r.stride()
    assert gpu.calls[0]["window_size"] == (2, 1) and gpu.calls[0]["softcap"] == 4.0


def test_opcheck_with_new_arguments(gpu):
    q, k, v = (t.requires_grad_(True) for t in qkv())
    sink = sink_of().requires_grad_(True)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, 0.125, True, False, 2, -1, 3.0, sink))
    out, lse = torch.ops.flashgen.fwd(q.detach(), k.detach(), v.detach(), 0.125, False, False, 2, 1, 3.0)
    torch.library.opcheck(torch.ops.flashgen.bwd.default, (out, q.detach(), k.detach(), v.detach(), out, lse,
                                                           0.125, False, True, 2, 1, 3.0))


def test_old_positional_calls_still_work(gpu):
    q, k, v = qkv()
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, True)
    out2, _ = torch.ops.flashgen.fwd(q, k, v, 0.125, True, True)
    assert torch.equal(out, out2)
    dq, dk, dv = torch.ops.flashgen.bwd(out, q, k, v, out, lse, 0.125, True, False)
    assert dq.shape == q.shape
    assert [c["window_size"] for c in gpu.fwd.calls] == [(-1, -1)] * 2 and gpu.calls[0]["window_size"] == (-1, -1)


def test_compile_fullgraph_with_window_softcap_sink(gpu):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()

    def loss_fn(q, k, v, sink):
        out, lse = flash_attn_func(q, k, v, causal=True, window_size=(3, None), softcap=2.0, learnable_sink=sink,
                                   return_attn_probs=True)
        return (out.float() ** 2).sum() + 0 * lse.sum()

    def inputs():
        return [t.requires_grad_(True) for t in qkv(sq=6, sk=9)] + [sink_of().requires_grad_(True)]

    eager_in, compiled_in = inputs(), inputs()
    loss_fn(*eager_in).backward()
    backend = AotEagerAndRecordGraphs()
    torch.compile(loss_fn, fullgraph=True, backend=backend)(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        assert torch.equal(a.grad, b.grad)
    assert eager_in[3].grad.abs().max() > 0
    fwd_calls = gpu.fwd.calls
    assert [c["window_size"] for c in fwd_calls] == [(3, -1)] * 2 and all(c["softcap"] == 2.0 for c in fwd_calls)
    assert all(c["sink"] != 0 for c in fwd_calls)
    assert [c["window_size"] for c in gpu.calls] == [(3, -1)] * 2
    (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs
    assert "flashgen.fwd" in fw.code and "flashgen.bwd" in bw.code


def test_compile_inductor_with_sink(gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, s: flash_attn_func(q, k, v, softcap=1.5, learnable_sink=s).float().sum(),
                      fullgraph=True)
    eager_in = [t.requires_grad_(True) for t in qkv()] + [sink_of().requires_grad_(True)]
    compiled_in = [t.detach().clone().requires_grad_(True) for t in eager_in]
    flash_attn_func(*eager_in[:3], softcap=1.5, learnable_sink=eager_in[3]).float().sum().backward()
    f(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=1e-5, atol=1e-6)


def test_compile_dynamic_window_from_an_int_argument(fake_gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v, w, c: flash_attn_func(q, k, v, window_size=(w, 0), softcap=c), fullgraph=True,
                      dynamic=True, backend="aot_eager")
    q, k, v = qkv()
    for w, c in ((1, 0.5), (3, 2.0)):
        assert torch.equal(f(q, k, v, w, c), flash_attn_func(q, k, v, window_size=(w, 0), softcap=c))
    assert [c["window_size"] for c in fake_gpu.calls] == [(1, 0), (1, 0), (3, 0), (3, 0)]
    assert [c["softcap"] for c in fake_gpu.calls] == [0.5, 0.5, 2.0, 2.0]


# --------------------------------------------------------------------------------------
# DLPack entries
# --------------------------------------------------------------------------------------

def _np(*ts):
    return [t.numpy() for t in ts]


def _outs(b=2, sq=5, h=4, dv=64):
    return np.full((b, sq, h, dv), np.nan, np.float16), np.full((b, h, sq), np.nan, np.float32)


def test_dlpack_forward_features_reach_the_core(fake_gpu_dlpack):
    q, k, v = qkv()
    sink = sink_of()
    qn, kn, vn, sn = _np(q, k, v, sink)
    out, lse = _outs()
    dlpack_api.flash_attn_forward(qn, kn, vn, causal=True, window_size=(2, None), softcap=3.0, learnable_sink=sn,
                                  out=out, lse=lse, stream=9)
    (call,) = fake_gpu_dlpack.calls
    assert call["window_size"] == (2, -1) and call["softcap"] == 3.0 and call["causal"] is True
    assert call["sink"] == sn.ctypes.data and call["stream"] == 9
    ref, ref_lse = reference(q, k, v, 64 ** -0.5, True, (2, None), 3.0, sink)
    assert np.abs(out.astype(np.float32) - ref.numpy()).max() <= 2e-3
    assert np.allclose(lse, ref_lse.numpy(), atol=1e-5)


def test_dlpack_forward_defaults_pass_no_sink(fake_gpu_dlpack):
    out, lse = _outs()
    dlpack_api.flash_attn_forward(*_np(*qkv()), out=out, lse=lse)
    (call,) = fake_gpu_dlpack.calls
    assert call["window_size"] == (-1, -1) and call["softcap"] == 0.0 and call["sink"] == 0


def test_dlpack_torch_sink_with_torch_allocation(fake_gpu_dlpack, monkeypatch):
    torch_allocates_on_cpu(monkeypatch)
    q, k, v = qkv(dtype=torch.bfloat16)
    sink = sink_of()
    out, lse = dlpack_api.flash_attn_forward(q, k, v, softcap=1.0, learnable_sink=sink)
    ref, ref_lse = reference(q, k, v, 64 ** -0.5, False, softcap=1.0, sink=sink)
    assert (out.float() - ref).abs().max() <= 1.6e-2 and torch.allclose(lse, ref_lse, atol=1e-5)
    assert fake_gpu_dlpack.calls[0]["sink"] == sink.data_ptr()


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(learnable_sink=np.zeros(8, np.float32)[::2]), ValueError,
     "learnable_sink must be C-contiguous (stride 1), got strides (2,); pass a contiguous copy"),
    (dict(learnable_sink=np.zeros(4, np.float64)), TypeError, "learnable_sink must have dtype float32, got float64"),
    (dict(learnable_sink=np.zeros(3, np.float32)), ValueError, "learnable_sink must have shape (heads,) = (4,)"),
    (dict(learnable_sink=[0.0] * 4), TypeError, "learnable_sink must be a DLPack array"),
])
def test_dlpack_forward_sink_errors(fake_gpu_dlpack, kw, exc, fragment):
    out, lse = _outs()
    with pytest.raises(exc) as info:
        dlpack_api.flash_attn_forward(*_np(*qkv()), out=out, lse=lse, **kw)
    assert type(info.value) is exc and fragment in str(info.value), str(info.value)
    assert fake_gpu_dlpack.calls == []


@pytest.mark.parametrize("kw", [
    dict(window_size=(-2, 0.5)),
    dict(window_size=7),
    dict(softcap=float("nan")),
    dict(softcap="x", window_size=(1, 2, 3)),
    dict(softmax_scale=math.inf, softcap=-1),
])
def test_dlpack_window_softcap_messages_match_the_torch_api(fake_gpu_dlpack, kw):
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError)) as torch_err:
        flash_attn_func(q, k, v, **kw)
    with pytest.raises((TypeError, ValueError)) as dl_err:
        dlpack_api.flash_attn_forward(*_np(q, k, v), **kw)
    assert type(dl_err.value) is type(torch_err.value)
    assert str(dl_err.value) == _as_dlpack_message(str(torch_err.value))
    assert fake_gpu_dlpack.calls == []


def test_dlpack_window_problems_join_the_q_k_v_list(fake_gpu_dlpack):
    q, k, v = _np(*qkv())
    with pytest.raises(V.InputError) as info:
        dlpack_api.flash_attn_forward(q.astype(np.float32), k, v, window_size=(0, -3), softcap=True)
    assert_problems(info.value, "q must have dtype float16, bfloat16 or float8_e4m3fn, got float32",
                    "window_size[1] (right) must be an int >= -1 or None", "softcap must be a real number")


class _Copies:
    """Host stand-ins for the driver copies (ctypes.memmove), recording each call."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(dlpack_api, "_memcpy2d", self.copy2d)
        monkeypatch.setattr(dlpack_api, "_memcpy", self.copy)

    def copy2d(self, device, dst, dst_pitch, src, src_pitch, width, height, stream):
        assert width <= dst_pitch and width <= src_pitch and height >= 1
        for r in range(height):  # the regions never overlap (as cuMemcpy2DAsync requires)
            s, d = src + r * src_pitch, dst + r * dst_pitch
            assert d >= s + width or s >= d + width
            ctypes.memmove(d, s, width)
        self.calls.append(("2d", width, height, stream))

    def copy(self, device, dst, src, nbytes, stream):
        assert dst >= src + nbytes or src >= dst + nbytes
        ctypes.memmove(dst, src, nbytes)
        self.calls.append(("1d", nbytes, stream))


@pytest.mark.parametrize("b,sq,h", [(1, 1, 1), (2, 5, 4), (3, 8, 4), (5, 13, 2), (1, 1024, 3)])
def test_dlpack_seqlen_k_zero_lse_is_the_sink(fake_gpu_dlpack, monkeypatch, b, sq, h):
    copies = _Copies(monkeypatch)
    q, k, v = _np(*qkv(b=b, sq=sq, sk=0, h=h, hk=1))
    sink = np.random.default_rng(0).standard_normal(h).astype(np.float32)
    out, lse = _outs(b, sq, h)
    dlpack_api.flash_attn_forward(q, k, v, learnable_sink=sink, out=out, lse=lse, stream=11)
    assert (out == 0).all()
    assert np.array_equal(lse, np.broadcast_to(sink.reshape(1, h, 1), (b, h, sq)))
    assert len(copies.calls) == 1 + math.ceil(math.log2(sq)) + math.ceil(math.log2(b))
    assert all(c[-1] == 11 for c in copies.calls) and fake_gpu_dlpack.calls == []
    assert not any(m[0] == "d32" for m in fake_gpu_dlpack.memsets)  # no -inf memset


def test_dlpack_seqlen_k_zero_without_sink_makes_no_copy(fake_gpu_dlpack, monkeypatch):
    copies = _Copies(monkeypatch)
    out, lse = _outs()
    dlpack_api.flash_attn_forward(*_np(*qkv(sk=0)), out=out, lse=lse)
    assert np.isneginf(lse).all() and copies.calls == []


def test_dlpack_backward_features_reach_the_core(dl, monkeypatch):
    monkeypatch.setattr(dlpack_api, "_workspace", dl.numpy_workspace)
    q, k, v = qkv(sq=6, sk=9)
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, True, False, 3, -1, 2.0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).half()
    dq, dk, dv = (np.full(t.shape, np.nan, np.float16) for t in (q, k, v))
    dlpack_api.flash_attn_backward(*_np(dout, q, k, v, out, lse), softmax_scale=0.125, causal=True,
                                   window_size=[3, None], softcap=2.0, dq=dq, dk=dk, dv=dv)
    (call,) = dl.calls
    assert call["window_size"] == (3, -1) and call["softcap"] == 2.0 and call["causal"] is True
    (ws,) = dl.workspace_calls
    assert ws == dict(batch=2, seqlen_q=6, seqlen_k=9, causal=True, window_size=(3, -1), softcap=2.0, head_dim=64,
                      head_dim_v=64)
    for got, want in zip((dq, dk, dv), reference_grads(q, k, v, dout, 0.125, True, (3, -1), 2.0)):
        assert_close(torch.from_numpy(got), want)


def test_dlpack_backward_window_softcap_errors(dl):
    case = _np(*_fwd_case())
    with pytest.raises(ValueError, match=r"^flashgen: window_size\[0\] \(left\) must be an int >= -1"):
        dlpack_api.flash_attn_backward(*case, window_size=(-9, 0))
    with pytest.raises(TypeError, match=r"^flashgen: softcap must be a real number"):
        dlpack_api.flash_attn_backward(*case, softcap=None)
    assert dl.calls == [] and dl.workspace_calls == []


def _fwd_case():
    q, k, v = qkv()
    out, lse = torch.ops.flashgen.fwd(q, k, v, 0.125, False)
    return out, q, k, v, out, lse


def test_dlpack_backward_documents_the_sink_gradient():
    doc = dlpack_api.flash_attn_backward.__doc__
    assert "d_sink[h] = -sum_{b, i} exp(sink[h] - lse[b, h, i]) * dPsum[b, h, i]" in doc
    assert "dPsum[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]" in doc
