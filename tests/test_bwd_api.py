"""CPU tests of flashgen's backward API: autograd through flash_attn_func (the ops
torch.ops.flashgen.fwd / flashgen.bwd, their fakes, torch.compile), the DLPack entry
flashgen.flash_attn_backward and the backward's checks in flashgen._validate.

No GPU here. The forward runs on test_api_validation's emulated core (`fake_gpu`); the
`gpu` fixture adds an emulated backward: `core.backward_workspace_bytes` and
`core.attention_backward` (patched with raising=False, so these tests do not depend on the
real ones) check what the kernels rely on (TensorArgs of the right shapes, TMA layouts, a
contiguous fp32 lse, a workspace of at least the size asked for), then compute the gradients
in float32 by the kernels' formula (from the given out and lse) through the memory the
TensorArgs describe and write them there; the tests compare them with torch autograd of the
reference attention. A wrong pointer, stride or argument order gives wrong gradients here,
as on the GPU.

The last section runs the real ``core.attention_backward`` (variant choice, params, TMA maps,
grids, workspace) on a manifest of bwd records made by the family module, with
``launch.get_kernel`` / ``launch`` / ``tensor_map`` recording instead of touching a driver.
"""

from __future__ import annotations

import ctypes
import json
import random
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import flashgen.core as core
import flashgen.dlpack_api as dlpack_api
import flashgen.interface as interface
from flashgen import _validate as V
from flashgen import launch
from flashgen.generator.families import bwd as bwd_mod
from flashgen.interface import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import torch_allocates_on_cpu  # noqa: E402
from test_prepared_calls import targ  # noqa: E402
from test_api_validation import (  # noqa: E402,F401
    _view, assert_problems, fake_gpu, fake_gpu_dlpack, mask, qkv, reference,
)

STREAM = 1234  # test_api_validation's fake current stream


# --------------------------------------------------------------------------------------
# Reference and emulated backward
# --------------------------------------------------------------------------------------

def reference_grads(q, k, v, dout, scale, causal, window_size=(-1, -1), softcap=0.0, sink=None):
    """float32 (dq, dk, dv) of the reference attention for the upstream gradient dout."""
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    o, _ = reference(qf, kf, vf, scale, causal, window_size, softcap, sink)
    o.backward(dout.float())
    return qf.grad, kf.grad, vf.grad


def emulated_grads(q, k, v, out, lse, dout, scale, causal, window_size=(-1, -1), softcap=0.0):
    """float32 (dq, dk, dv) by the kernels' method, from the forward's out and lse (v, out, dout may
    have another head dim than q, k): P = exp(S - lse),
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)) (times 1 - (S / c)^2 with softcap c),
    dQ = scale dS K, dK = scale dS^T Q; dk and dv summed over each GQA group. (Not torch
    autograd: the core runs below the autograd dispatch key.)"""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qf, dof, of = (t.float().transpose(1, 2) for t in (q, dout, out))  # (b, h, sq, d)
    kf, vf = (t.float().repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))  # (b, h, sk, d)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask(sq, sk, causal, window_size), -torch.inf)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see no key: lse -inf, P 0
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * of).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - (s / softcap) ** 2).nan_to_num(0.0)  # masked keys: s -inf, p 0
    dq = (ds @ kf) * scale
    dk = ((ds.transpose(-1, -2) @ qf) * scale).view(b, hk, g, sk, d).sum(2)
    dv = (p.transpose(-1, -2) @ dof).view(b, hk, g, sk, vf.shape[-1]).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def assert_close(got, ref):
    """One rounding of got's dtype away from the float32 reference."""
    tol = 2e-3 if got.dtype == torch.float16 else 1.6e-2
    assert got.shape == ref.shape
    assert (got.float() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


class FakeBwd:
    """Stand-ins for core.backward_workspace_bytes / core.attention_backward and the prepared launch
    (core.prepare_backward / launch_backward, routed to the emulated attention_backward; see the module doc)."""

    def __init__(self, fwd):
        self.fwd = fwd  # test_api_validation.FakeCore: forward calls, variant selections
        self.calls = []
        self.workspace_calls = []  # the arguments of each backward_workspace_bytes call
        self.workspaces = []  # (address, bytes) of every workspace the API allocated
        self.prepared = []  # the arrays (addresses 0) of each prepare_backward call
        self.prepared_launches = []  # the nine addresses of each launch_backward call

    @staticmethod
    def nbytes(batch, seqlen_q, heads):
        return 4 * batch * heads * seqlen_q * 67 + 1000  # an odd size: no element count passes for bytes

    def backward_workspace_bytes(self, batch, seqlen_q, heads, heads_k, head_dim, dtype, causal, device,
                                 variant=None, *, seqlen_k=None, window_size=(-1, -1), softcap=0.0, head_dim_v=None,
                                 varlen_total_q=None):
        assert min(batch, seqlen_q, heads, heads_k) >= 1 and type(causal) is bool
        assert type(seqlen_k) is int and seqlen_k >= 1  # the API always passes it (needed with a window)
        assert type(window_size) is tuple and all(type(x) is int for x in window_size) and type(softcap) is float
        assert type(head_dim_v) is int  # the API always passes it (the variant is that of max(head_dim, head_dim_v))
        self.workspace_calls.append(dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
                                         window_size=window_size, softcap=softcap, head_dim=head_dim,
                                         head_dim_v=head_dim_v,
                                         **({} if varlen_total_q is None else {"varlen_total_q": varlen_total_q})))
        m = core.mask_spec(causal, window_size, seqlen_q, seqlen_k)  # as the real core
        key = {"dtype": dtype, "head_dim": max(head_dim, head_dim_v), "causal": m.causal, "local": m.local,
               "softcap": softcap > 0}
        if varlen_total_q is not None:  # (the real core's key has varlen False otherwise: the family's default)
            key["varlen"] = True
        core.select_variant("bwd", key)  # may raise
        return self.nbytes(batch, seqlen_q, heads) if varlen_total_q is None else self.nbytes(1, varlen_total_q, heads)

    def prepare_backward(self, dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, variant=None, *,
                         window_size=(-1, -1), softcap=0.0, softmax_scale=None, varlen=None):
        """As core.prepare_backward: metadata only (addresses 0); the variant selected and the workspace sized as by
        backward_workspace_bytes (recorded there). Returns the arguments and the workspace's bytes (``nbytes``)."""
        arrays = (dout, q, k, v, out, lse, dq, dk, dv)
        assert all(isinstance(a, core.TensorArg) and a.ptr == 0 for a in arrays)
        assert varlen is None and softmax_scale is None  # (the interface's varlen backward calls attention_backward)
        assert type(causal) is bool and type(deterministic) is bool
        b, sq, h, d = q.shape
        nbytes = self.backward_workspace_bytes(b, sq, h, k.shape[2], d, q.dtype, causal, q.device, variant,
                                               seqlen_k=k.shape[1], window_size=window_size, softcap=softcap,
                                               head_dim_v=v.shape[3])
        self.prepared.append(arrays)
        return types.SimpleNamespace(arrays=arrays, causal=causal, deterministic=deterministic, variant=variant,
                                     window_size=window_size, softcap=softcap, nbytes=nbytes)

    def launch_backward(self, prep, dout_ptr, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr,
                        workspace_ptr, softmax_scale, softcap, stream, varlen=()):
        """As core.launch_backward: the prepared metadata at these addresses, emulated by attention_backward (which
        records the call and checks the arrays, the workspace and the scalars)."""
        assert varlen == () and type(softcap) is float and (softcap > 0) == (prep.softcap > 0)
        ptrs = (dout_ptr, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr)
        self.prepared_launches.append(ptrs)
        return self.attention_backward(*(a._replace(ptr=ptr) for a, ptr in zip(prep.arrays, ptrs)), softmax_scale,
                                       prep.causal, prep.deterministic, stream, workspace_ptr, prep.variant,
                                       window_size=prep.window_size, softcap=softcap)

    def record_workspace(self, make, size_of):
        """``make`` wrapped so that the workspaces it makes are recorded (``size_of(result) -> (ptr, bytes)``)."""
        def wrapped(*a, **kw):
            result = make(*a, **kw)
            self.workspaces.append(size_of(result))
            return result
        return wrapped

    def attention_backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic,
                           stream, workspace_ptr, variant=None, *, window_size=(-1, -1), softcap=0.0, varlen=None):
        if varlen is not None:
            return self._varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic,
                                         stream, workspace_ptr, variant, window_size, softcap, varlen)
        b, sq, h, d = q.shape
        arrays = dict(dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
        for name, a in arrays.items():
            assert isinstance(a, core.TensorArg) and a.dtype == q.dtype and a.device == q.device, name
            assert V.tma_layout_problem(a.shape, a.strides, V.ELEMENT_SIZE[a.dtype], a.ptr) is None, name
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and v.shape[:3] == k.shape[:3]
        assert dout.shape == out.shape == (b, sq, h, v.shape[3])  # head_dim_v (may differ from head_dim)
        assert lse.dtype == "fp32" and lse.shape == (b, h, sq) and V.is_c_contiguous(lse.shape, lse.strides)
        assert min(b, sq, k.shape[1]) >= 1
        assert type(softmax_scale) is float and type(causal) is bool and type(deterministic) is bool
        assert type(window_size) is tuple and all(type(x) is int for x in window_size) and type(softcap) is float
        need = self.nbytes(b, sq, h)
        assert any(p == workspace_ptr and n >= need for p, n in self.workspaces), "workspace missing or too small"
        ctypes.memset(workspace_ptr, 0xAB, need)  # the kernels may use all of it
        self.calls.append(dict(arrays, lse=lse, scale=softmax_scale, causal=causal, deterministic=deterministic,
                               stream=stream, workspace_ptr=workspace_ptr, variant=variant, window_size=window_size,
                               softcap=softcap))
        grads = emulated_grads(*(_view(t) for t in (q, k, v, out, lse, dout)), softmax_scale, causal, window_size,
                               softcap)
        for arg, g in zip((dq, dk, dv), grads):
            _view(arg).copy_(g)
        return variant

    def _varlen_backward(self, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, stream,
                         workspace_ptr, variant, window_size, softcap, varlen):
        """The varlen backward (core.BwdVarlen; bwd.cu.j2 kVarlen) emulated: each sequence's rows (at the offsets
        read through varlen's addresses) as one call of emulated_grads, written to the same rows of dq, dk, dv;
        rows of no sequence are left as they were (the kernels write only the sequences' rows), except the rows past
        the last sequence with varlen.zero_tail (the preprocess zeroes them)."""
        arrays = dict(dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
        for name, a in arrays.items():
            assert isinstance(a, core.TensorArg) and a.dtype == q.dtype and len(a.shape) == 3, name
            assert V.tma_layout_problem(a.shape, a.strides, V.ELEMENT_SIZE[a.dtype], a.ptr) is None, name
        total_q, h = q.shape[0], q.shape[1]
        assert lse.dtype == "fp32" and lse.shape == (h, total_q) and V.is_c_contiguous(lse.shape, lse.strides)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dout.shape == out.shape
        assert type(varlen) is core.BwdVarlen and varlen.batch >= 1 and min(varlen.max_seqlen_q, varlen.max_seqlen_k) >= 1
        assert type(softmax_scale) is float and type(causal) is bool and type(deterministic) is bool
        need = self.nbytes(1, total_q, h)
        assert any(p == workspace_ptr and n >= need for p, n in self.workspaces), "workspace missing or too small"
        ctypes.memset(workspace_ptr, 0xAB, need)
        self.calls.append(dict(arrays, lse=lse, scale=softmax_scale, causal=causal, deterministic=deterministic,
                               stream=stream, workspace_ptr=workspace_ptr, variant=variant, window_size=window_size,
                               softcap=softcap, varlen=varlen))
        n = varlen.batch
        cu_q = list((ctypes.c_int32 * (n + 1)).from_address(varlen.cu_seqlens_q))
        cu_k = list((ctypes.c_int32 * (n + 1)).from_address(varlen.cu_seqlens_k))
        views = {name: _view(a) for name, a in arrays.items()}
        lv = _view(lse)
        for b in range(n):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            assert rq.stop - rq.start <= varlen.max_seqlen_q and rk.stop - rk.start <= varlen.max_seqlen_k
            if rq.stop == rq.start:
                continue
            if rk.stop == rk.start:  # no key: out does not depend on q
                views["dq"][rq] = 0
                continue
            grads = emulated_grads(*(views[x][None, r] for x, r in (("q", rq), ("k", rk), ("v", rk), ("out", rq))),
                                   lv[None, :, rq], views["dout"][None, rq], softmax_scale, causal, window_size, softcap)
            for name, g, r in zip(("dq", "dk", "dv"), grads, (rq, rk, rk)):
                views[name][r] = g[0].to(views[name].dtype)
        for name in ("dk", "dv"):  # keys of sequences with no query: their gradients are 0
            for b in range(n):
                if cu_q[b + 1] == cu_q[b]:
                    views[name][cu_k[b]:cu_k[b + 1]] = 0
        assert type(varlen.zero_tail) is bool
        if varlen.zero_tail:
            views["dq"][cu_q[n]:] = 0
            views["dk"][cu_k[n]:] = 0
            views["dv"][cu_k[n]:] = 0
        return variant


@pytest.fixture
def gpu(fake_gpu, monkeypatch):
    bwd = FakeBwd(fake_gpu)
    monkeypatch.setattr(core, "backward_workspace_bytes", bwd.backward_workspace_bytes, raising=False)
    monkeypatch.setattr(core, "attention_backward", bwd.attention_backward, raising=False)
    monkeypatch.setattr(core, "prepare_backward", bwd.prepare_backward, raising=False)
    monkeypatch.setattr(core, "launch_backward", bwd.launch_backward, raising=False)
    monkeypatch.setattr(interface, "_bwd_calls", {})
    monkeypatch.setattr(interface, "_workspace", bwd.record_workspace(
        interface._workspace, lambda t: (t.data_ptr(), t.numel() * t.element_size())))
    monkeypatch.setattr(dlpack_api, "_workspace", bwd.record_workspace(
        dlpack_api._workspace, lambda r: (r[1], r[0].numel() * r[0].element_size())))
    return bwd


def grad_qkv(**kw):
    return [t.requires_grad_(True) for t in qkv(**kw)]


def bwd_selected(fc):
    return [key for family, key in fc.fwd.selected if family == "bwd"]


# --------------------------------------------------------------------------------------
# Autograd through flash_attn_func
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h,hk", [(4, 4), (4, 2), (4, 1)])
def test_gradients_match_reference(gpu, causal, dtype, h, hk):
    q, k, v = grad_qkv(sq=6, sk=9, h=h, hk=hk, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (out.float() * w.float()).sum().backward()
    for t, ref in zip((q, k, v), reference_grads(q, k, v, w, 64 ** -0.5, causal)):
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
        assert_close(t.grad, ref)
    (call,) = gpu.calls
    assert call["scale"] == pytest.approx(64 ** -0.5) and call["causal"] is causal
    assert call["deterministic"] is False and call["stream"] == STREAM
    assert call["q"].ptr == q.data_ptr() and call["k"].ptr == k.data_ptr() and call["v"].ptr == v.data_ptr()
    assert call["q"].shape == (2, 6, h, 64) and call["k"].shape == call["dk"].shape == (2, 9, hk, 64)
    for name in ("dq", "dk", "dv"):  # gradients allocated contiguous
        assert call[name].strides == tuple(torch.empty(call[name].shape).stride())
    assert bwd_selected(gpu) == [{"dtype": "fp16" if dtype == torch.float16 else "bf16", "head_dim": 64,
                                  "causal": causal, "local": False, "softcap": False}]
    assert call["window_size"] == (-1, -1) and call["softcap"] == 0.0


def test_scale_and_deterministic_reach_the_backward(gpu):
    q, k, v = grad_qkv(d=32, h=2, hk=2)
    flash_attn_func(q, k, v, softmax_scale=-0.3, causal=True, deterministic=True).float().sum().backward()
    (call,) = gpu.calls
    assert call["scale"] == -0.3 and call["deterministic"] is True and call["causal"] is True
    dout = torch.ones(q.shape, dtype=q.dtype)
    for t, ref in zip((q, k, v), reference_grads(q, k, v, dout, -0.3, True)):
        assert_close(t.grad, ref)


def test_broadcast_grad_of_sum_is_copied_for_tma(gpu):
    q, k, v = grad_qkv()
    out = flash_attn_func(q, k, v)
    out.sum().backward()  # grad_out is ones expanded: every stride 0, TMA cannot read it
    (call,) = gpu.calls
    assert call["dout"].strides == tuple(torch.empty(q.shape).stride())
    assert call["out"].ptr == out.data_ptr()  # the forward's saved output, used in place
    for t, ref in zip((q, k, v), reference_grads(q, k, v, torch.ones(q.shape), 64 ** -0.5, False)):
        assert_close(t.grad, ref)


def test_packed_qkv_gradient_flows_into_the_packed_tensor(gpu):
    b, s, h, d = 2, 9, 4, 64
    packed = torch.randn(b, s, 3, h, d).half().requires_grad_(True)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    out = flash_attn_func(q, k, v, causal=True)
    w = torch.randn(out.shape).half()
    (out * w).sum().backward()
    (call,) = gpu.calls
    assert [call[n].ptr for n in "qkv"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]  # no copies
    assert packed.grad.shape == packed.shape
    ref = torch.stack(reference_grads(q, k, v, w, d ** -0.5, True), dim=2)
    assert_close(packed.grad, ref)


def test_kv_cache_prefix_gradients(gpu):
    k_cache = torch.randn(2, 32, 2, 64).half().requires_grad_(True)
    v_cache = torch.randn(2, 32, 2, 64).half().requires_grad_(True)
    q = torch.randn(2, 4, 4, 64).half().requires_grad_(True)
    k, v = k_cache[:, :11], v_cache[:, :11]
    flash_attn_func(q, k, v, causal=True).float().sum().backward()
    ref = reference_grads(q, k, v, torch.ones(q.shape), 64 ** -0.5, True)
    assert_close(q.grad, ref[0])
    assert_close(k_cache.grad[:, :11], ref[1]) and assert_close(v_cache.grad[:, :11], ref[2])
    assert not k_cache.grad[:, 11:].any() and not v_cache.grad[:, 11:].any()


def test_grad_lse_is_ignored_as_in_fa3(gpu):
    q, k, v = grad_qkv()
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    g_out = torch.autograd.grad(out.float().sum(), (q, k, v), retain_graph=True)
    g_both = torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v), retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(g_out, g_both))
    g_lse = torch.autograd.grad(lse.sum(), (q, k, v))  # dout materialised as zeros: zero gradients
    assert all(not g.any() for g in g_lse)


def test_forward_saves_q_k_v_out_lse_only(gpu):
    q, k, v = grad_qkv()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    assert len(saved) == 5
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (q, k, v, out, lse)]


def test_only_the_inputs_that_need_grad_get_one(gpu):
    q, k, v = qkv()
    v.requires_grad_(True)
    flash_attn_func(q, k, v).float().sum().backward()
    assert q.grad is None and k.grad is None and v.grad is not None
    assert_close(v.grad, reference_grads(q, k, v, torch.ones(q.shape), 64 ** -0.5, False)[2])


@pytest.mark.parametrize("d,dv", [(128, 64), (64, 128), (192, 128)])
def test_head_dim_v_differs_gradients_match_reference(gpu, d, dv):
    """head_dim_v != head_dim (FA3's backward serves it): dq, dk, dv of q's, k's and v's shapes match
    the reference; the core gets dout, out, v, dv of head_dim_v columns; the bwd variant asked for
    (and the workspace) is that of max(head_dim, head_dim_v)."""
    q, k, v = grad_qkv(d=d, dv=dv)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 5, 4, dv)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).half()
    (out.float() * w.float()).sum().backward()
    for t, ref in zip((q, k, v), reference_grads(q, k, v, w, d ** -0.5, True)):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        assert_close(t.grad, ref)
    (call,) = gpu.calls
    assert call["q"].shape == call["dq"].shape == (2, 5, 4, d) and call["k"].shape == call["dk"].shape == (2, 7, 2, d)
    assert call["v"].shape == call["dv"].shape == (2, 7, 2, dv)
    assert call["dout"].shape == call["out"].shape == (2, 5, 4, dv)
    assert call["scale"] == pytest.approx(d ** -0.5)  # q's head dim, as FA3
    assert bwd_selected(gpu) == [{"dtype": "fp16", "head_dim": max(d, dv), "causal": True, "local": False,
                                  "softcap": False}]
    (ws,) = gpu.workspace_calls
    assert (ws["head_dim"], ws["head_dim_v"]) == (d, dv)


def test_missing_bwd_variant_raises_before_any_allocation(gpu, monkeypatch):
    select = core.select_variant

    def no_bwd(family, key, manifest=None):
        if family == "bwd":
            raise core.MissingVariantError("flashgen: no built bwd variant serves the call: flashgen add-variant bwd")
        return select(family, key)

    monkeypatch.setattr(core, "select_variant", no_bwd)
    q, k, v = grad_qkv()
    out = flash_attn_func(q, k, v)
    with pytest.raises(core.MissingVariantError, match="add-variant bwd"):
        out.float().sum().backward()
    assert gpu.calls == [] and gpu.workspaces == []


# --------------------------------------------------------------------------------------
# Empty problems: no launch, zero or empty gradients
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("b,sq,sk", [(2, 5, 0), (2, 0, 7), (0, 5, 7), (2, 0, 0)])
def test_empty_problems_launch_nothing(gpu, b, sq, sk):
    q, k, v = qkv(b=b, sq=sq, sk=sk)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    dout = torch.randn(out.shape).half()
    dq, dk, dv = torch.ops.flashgen.bwd(dout, q, k, v, out, lse, 0.125, False, False)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous()
        assert not g.any()  # zeros (or empty)
    assert gpu.calls == [] and gpu.workspaces == [] and bwd_selected(gpu) == []


def test_seqlen_k_zero_through_autograd(gpu):
    q, k, v = grad_qkv(sk=0)
    q.grad = torch.full(q.shape, 7.0).half()  # accumulated into: must stay 7 (dq is 0)
    flash_attn_func(q, k, v).float().sum().backward()
    assert torch.equal(q.grad, torch.full(q.shape, 7.0).half())
    assert k.grad.shape == k.shape == (2, 0, 2, 64) and gpu.calls == []


# --------------------------------------------------------------------------------------
# The op's checks
# --------------------------------------------------------------------------------------

def _fwd_outputs(scale=0.125, **kw):
    """(dout, q, k, v, out, lse): random q, k, v and dout (qkv(**kw)), the forward's out and lse."""
    q, k, v = qkv(**kw)
    out, lse = torch.ops.flashgen.fwd(q, k, v, scale, False)
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype), q, k, v, out, lse


def _bwd(dout, q, k, v, out, lse):
    return torch.ops.flashgen.bwd(dout, q, k, v, out, lse, 0.125, False, False)


@pytest.mark.parametrize("which,make,exc,match", [
    ("dout", lambda t: t[:, :4], ValueError,
     r"^flashgen: dout must have shape \(batch, seqlen_q, heads, head_dim_v\) = \(2, 5, 4, 64\), got \(2, 4, 4, 64\)$"),
    ("dout", lambda t: t.float(), TypeError, r"^flashgen: dout must have q's dtype fp16, got torch.float32$"),
    ("out", lambda t: t.bfloat16(), TypeError, r"^flashgen: out must have q's dtype fp16, got torch.bfloat16$"),
    ("out", lambda t: t[..., :32], ValueError, r"out must have shape .* got \(2, 5, 4, 32\)$"),
    ("lse", lambda t: t.half(), TypeError, r"^flashgen: lse must have dtype float32, got torch.float16$"),
    ("lse", lambda t: t.transpose(1, 2), ValueError,
     r"^flashgen: lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 5\), got \(2, 5, 4\)$"),
])
def test_bwd_op_argument_errors(gpu, which, make, exc, match):
    args = dict(zip(("dout", "q", "k", "v", "out", "lse"), _fwd_outputs()))
    args[which] = make(args[which])
    with pytest.raises(exc, match=match) as info:
        _bwd(**args)
    assert type(info.value) is exc
    assert gpu.calls == [] and bwd_selected(gpu) == []


def test_bwd_op_every_problem_in_one_error(gpu):
    dout, q, k, v, out, lse = _fwd_outputs()
    with pytest.raises(V.InputError) as info:
        _bwd(dout[:, :1].float(), q, k, v, out.bfloat16(), lse[:, :1])
    assert_problems(info.value,
                    "dout must have shape (batch, seqlen_q, heads, head_dim_v) = (2, 5, 4, 64), got (2, 1, 4, 64)",
                    "dout must have q's dtype fp16, got torch.float32",
                    "out must have q's dtype fp16, got torch.bfloat16",
                    "lse must have shape (batch, heads, seqlen_q) = (2, 4, 5), got (2, 1, 5)")
    with pytest.raises(ValueError, match=r"heads of q \(4\) must be a multiple of heads_k of k/v \(3\)"):
        _bwd(dout, q, k[:, :, :1].expand(2, 7, 3, 64), v[:, :, :1].expand(2, 7, 3, 64), out, lse)  # q, k, v first
    assert gpu.calls == []


def test_bwd_op_non_contiguous_lse_is_copied(gpu):
    dout, q, k, v, out, lse = _fwd_outputs()
    lse_t = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (b, h, sq) with strides of (b, sq, h)
    assert not lse_t.is_contiguous()
    dq, dk, dv = _bwd(dout, q, k, v, out, lse_t)
    (call,) = gpu.calls
    assert call["lse"].ptr != lse_t.data_ptr() and call["lse"].strides == lse.stride()
    assert_close(dq, reference_grads(q, k, v, dout, 0.125, False)[0])


def test_bwd_op_needs_hopper(gpu, monkeypatch):
    monkeypatch.setattr(core, "device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 9\.x.*8\.0"):
        _bwd(*_fwd_outputs())


# --------------------------------------------------------------------------------------
# _validate.backward_problems: the usual case and each deviation
# --------------------------------------------------------------------------------------

def _info(shape, dtype="fp16", strides=None, device=0):
    strides = tuple(torch.empty(shape).stride()) if strides is None else strides
    return V.ArrayInfo(tuple(shape), strides, dtype, dtype, device is not None, device,
                       "cpu" if device is None else f"cuda:{device}")


P = V.Problem(batch=2, seqlen_q=5, seqlen_k=7, heads=4, heads_k=2, head_dim=64, head_dim_v=64, dtype="fp16", device=0)
GOOD = dict(dout=_info((2, 5, 4, 64)), out=_info((2, 5, 4, 64)), lse=_info((2, 4, 5), "fp32"))


def test_backward_problems_usual_case_is_empty():
    assert V.backward_problems(P, **GOOD) == []
    assert V.backward_problems(P, **GOOD, lse_ptr=0x1000) == []
    odd = dict(GOOD, lse=_info((2, 1, 5), "fp32", strides=(5, 99, 1)))  # extent-1 dim: any stride (slow path)
    assert V.backward_problems(P._replace(heads=1), dout=_info((2, 5, 1, 64)), out=_info((2, 5, 1, 64)),
                               lse=odd["lse"]) == []
    assert P.q_shape == (2, 5, 4, 64) and P.k_shape == (2, 7, 2, 64) and P.v_shape == (2, 7, 2, 64)


@pytest.mark.parametrize("change,exc,fragment", [
    (dict(dout=_info((2, 5, 4, 64), "bf16")), TypeError, "dout must have q's dtype fp16, got bf16"),
    (dict(out=_info((2, 5, 4, 64), device=1)), ValueError, "out must be on q's CUDA device 0, got cuda:1"),
    (dict(dout=_info((2, 5, 4, 64), device=None)), ValueError, "dout must be on q's CUDA device 0, got cpu"),
    (dict(out=_info((2, 5, 4))), ValueError, "out must have shape (batch, seqlen_q, heads, head_dim_v)"),
    (dict(lse=_info((2, 4, 5), "fp16")), TypeError, "lse must have dtype float32, got fp16"),
    (dict(lse=_info((3, 4, 5), "fp32")), ValueError,  # strides (20, 5, 1) as the right shape's
     "lse must have shape (batch, heads, seqlen_q) = (2, 4, 5), got (3, 4, 5)"),
    (dict(lse=_info((2, 4, 5), "fp32", strides=(20, 1, 4))), ValueError, "lse must be C-contiguous"),
    (dict(lse=_info((2, 4, 5), "fp32", device=1)), ValueError, "lse must be on q's CUDA device 0"),
    (dict(lse_ptr=0x1002), ValueError, "lse's base address 0x1002 is not 4-byte aligned"),
])
def test_backward_problems_each_deviation(change, exc, fragment):
    problems = V.backward_problems(P, **{**GOOD, **change})
    assert problems == [(exc, problems[0][1])] and fragment in problems[0][1]


def test_backward_problems_head_dim_v():
    p = P._replace(head_dim=128)  # q's head_dim 128, v's 64: out and dout are (2, 5, 4, 64)
    assert V.backward_problems(p, **GOOD) == []
    V.check_backward(p, **GOOD)
    wide = _info((2, 5, 4, 128))  # q's head dim where v's belongs
    ((exc, msg),) = V.backward_problems(p, **dict(GOOD, dout=wide))
    assert exc is ValueError and msg == ("dout must have shape (batch, seqlen_q, heads, head_dim_v) = (2, 5, 4, 64), "
                                         "got (2, 5, 4, 128)")
    with pytest.raises(ValueError, match=r"^flashgen: out must have shape \(batch, seqlen_q, heads, head_dim_v\) = "
                                         r"\(2, 5, 4, 64\), got \(2, 5, 4, 128\)$"):
        V.check_backward(p, **dict(GOOD, out=wide))


# --------------------------------------------------------------------------------------
# Fakes, opcheck, torch.compile
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(h=4, hk=1, d=128, sq=33, sk=19), dict(sq=0), dict(sk=0)])
def test_bwd_fake_matches_real_metadata(gpu, kw):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real_args = _fwd_outputs(**kw)
    real = _bwd(*real_args)
    with FakeTensorMode() as mode:
        fake = _bwd(*(mode.from_tensor(t) for t in real_args))
    for r, f in zip(real, fake):
        assert tuple(f.shape) == tuple(r.shape) and f.dtype == r.dtype and f.stride() == r.stride()


def test_bwd_fake_validates(gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = list(_fwd_outputs())
    args[5] = args[5].half()  # lse
    with FakeTensorMode() as mode:
        with pytest.raises(TypeError, match="^flashgen: lse must have dtype float32, got torch.float16$"):
            _bwd(*(mode.from_tensor(t) for t in args))


def test_opcheck_bwd_and_fwd_autograd(gpu):
    torch.library.opcheck(torch.ops.flashgen.bwd.default, (*_fwd_outputs(), 0.125, True, True))
    q, k, v = grad_qkv()
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, 0.125, True, True))


def test_compile_fullgraph_forward_and_backward(gpu):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()

    def loss_fn(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out.float() ** 2).sum()

    eager_in, compiled_in = grad_qkv(), grad_qkv()
    loss_fn(*eager_in).backward()
    backend = AotEagerAndRecordGraphs()
    torch.compile(loss_fn, fullgraph=True, backend=backend)(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        assert torch.equal(a.grad, b.grad)
    assert len(gpu.calls) == 2 and gpu.calls[1]["deterministic"] is True and gpu.calls[1]["causal"] is True
    (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs
    assert "flashgen.fwd" in fw.code and "flashgen.bwd" in bw.code
    assert "flashgen.bwd" not in fw.code


def test_compile_inductor_forward_and_backward(gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v).float().sum() * 2, fullgraph=True)
    eager_in, compiled_in = grad_qkv(), grad_qkv()
    (flash_attn_func(*eager_in).float().sum() * 2).backward()
    f(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        assert torch.equal(a.grad, b.grad)


# --------------------------------------------------------------------------------------
# DLPack entry: flashgen.flash_attn_backward
# --------------------------------------------------------------------------------------

@pytest.fixture
def dl(gpu, fake_gpu_dlpack, monkeypatch):
    """The DLPack entry on host arrays; numpy workspaces (CuPy is not here)."""
    def numpy_workspace(like, device, handle, dl_stream, nbytes, caller):
        ws = np.empty(nbytes, np.uint8)
        return ws, ws.ctypes.data

    assert fake_gpu_dlpack is gpu.fwd  # one FakeCore behind both fixtures
    gpu.numpy_workspace = gpu.record_workspace(numpy_workspace, lambda r: (r[1], r[0].nbytes))
    gpu.memsets = fake_gpu_dlpack.memsets
    return gpu


def _np_case(**kw):
    """(dout, q, k, v, out, lse) as numpy arrays: the forward's out and lse."""
    return [t.numpy() for t in _fwd_outputs(**kw)]


def _np_grads(b=2, sq=5, sk=7, h=4, hk=2, d=64):
    return (np.full((b, sq, h, d), np.nan, np.float16), np.full((b, sk, hk, d), np.nan, np.float16),
            np.full((b, sk, hk, d), np.nan, np.float16))


def test_dlpack_backward_given_gradients(dl, monkeypatch):
    monkeypatch.setattr(dlpack_api, "_workspace", dl.numpy_workspace)
    dout, q, k, v, out, lse = _np_case()
    dq, dk, dv = _np_grads()
    r = dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.125, deterministic=True,
                                       stream=77, dq=dq, dk=dk, dv=dv)
    assert r[0] is dq and r[1] is dk and r[2] is dv
    ref = reference_grads(*(torch.from_numpy(t) for t in (q, k, v, dout)), 0.125, False)
    for got, want in zip(r, ref):
        assert_close(torch.from_numpy(got), want)
    (call,) = dl.calls
    assert call["stream"] == 77 and call["deterministic"] is True and call["scale"] == 0.125
    assert call["dq"].ptr == dq.ctypes.data and call["dout"].ptr == dout.ctypes.data
    assert len(dl.workspaces) == 1 and dl.workspaces[0][1] == FakeBwd.nbytes(2, 5, 4)


def test_dlpack_backward_torch_arrays_allocate_with_torch(dl, monkeypatch):
    torch_allocates_on_cpu(monkeypatch)
    dout, q, k, v, out, lse = _fwd_outputs(dtype=torch.bfloat16, h=4, hk=1)
    dq, dk, dv = dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.125, causal=False)
    for got, t, want in zip((dq, dk, dv), (q, k, v), reference_grads(q, k, v, dout, 0.125, False)):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.shape == t.shape
        assert_close(got, want)
    (call,) = dl.calls
    assert call["stream"] == 0  # stream=None: the legacy default stream
    (ws_ptr, ws_bytes), = dl.workspaces  # the real _workspace, through torch
    assert call["workspace_ptr"] == ws_ptr and ws_bytes >= FakeBwd.nbytes(2, 5, 4)


def test_dlpack_backward_default_scale(dl, monkeypatch):
    monkeypatch.setattr(dlpack_api, "_workspace", dl.numpy_workspace)
    dout, q, k, v, out, lse = _np_case(scale=128 ** -0.5, d=128)
    dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, dq=np.empty(q.shape, np.float16),
                                   dk=np.empty(k.shape, np.float16), dv=np.empty(v.shape, np.float16))
    assert dl.calls[0]["scale"] == 128 ** -0.5


def test_dlpack_backward_every_problem_in_one_error(dl):
    dout, q, k, v, out, lse = _np_case()
    dout_t = np.ascontiguousarray(dout.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # last dim not contiguous
    dq = np.zeros((2, 5, 4, 64), np.float16)
    dq.flags.writeable = False
    dk = np.zeros((2, 7, 2, 32), np.float16)
    dv = np.zeros((2, 7, 2, 128), np.float16)[..., ::2]  # right shape, stride 2 on the last dim
    with pytest.raises(V.InputError) as info:
        dlpack_api.flash_attn_backward(dout_t, q, k, v, out.astype(np.float32), lse.astype(np.float16),
                                       dq=dq, dk=dk, dv=dv)
    assert_problems(info.value,
                    "out must have q's dtype fp16, got float32",
                    "lse must have dtype float32, got float16",
                    "dout cannot be read by TMA: its last dim has stride 4, not 1",
                    "dq is read-only",
                    "dk must have shape (batch, seqlen_k, heads_k, head_dim) = (2, 7, 2, 64), got (2, 7, 2, 32)",
                    "dv cannot be written by the kernel's TMA store: its last dim has stride 2")
    assert dl.calls == [] and dl.workspaces == []


def test_dlpack_backward_q_k_v_problems_come_first_with_non_arrays(dl):
    dout, q, k, v, out, lse = _np_case()
    with pytest.raises(TypeError) as info:
        dlpack_api.flash_attn_backward([1.0], q.astype(np.float32), k, v, out, lse, softmax_scale="x")
    assert type(info.value) is TypeError  # three type problems
    assert_problems(info.value,
                    "dout must be a DLPack array",
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got float32",
                    "softmax_scale must be a real number (float) or None, got str")
    assert dl.calls == []


@pytest.mark.parametrize("d,dv", [(128, 64), (192, 128)])
def test_dlpack_backward_head_dim_v_differs(dl, monkeypatch, d, dv):
    monkeypatch.setattr(dlpack_api, "_workspace", dl.numpy_workspace)
    dout, q, k, v, out, lse = _np_case(d=d, dv=dv)
    assert out.shape == dout.shape == (2, 5, 4, dv)
    r = dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.125,
                                       dq=np.empty(q.shape, np.float16), dk=np.empty(k.shape, np.float16),
                                       dv=np.empty(v.shape, np.float16))
    ref = reference_grads(*(torch.from_numpy(t) for t in (q, k, v, dout)), 0.125, False)
    for got, x, want in zip(r, (q, k, v), ref):
        assert got.shape == x.shape
        assert_close(torch.from_numpy(got), want)
    (call,) = dl.calls
    assert call["v"].shape == call["dv"].shape == (2, 7, 2, dv) and call["dk"].shape == (2, 7, 2, d)
    assert bwd_selected(dl)[-1]["head_dim"] == max(d, dv)
    assert (dl.workspace_calls[0]["head_dim"], dl.workspace_calls[0]["head_dim_v"]) == (d, dv)


def test_dlpack_backward_dout_of_head_dim_refused(dl):
    dout, q, k, v, out, lse = _np_case(d=128, dv=64)
    wide = np.zeros((2, 5, 4, 128), np.float16)  # q's head dim, not v's
    with pytest.raises(ValueError, match=r"dout must have shape \(batch, seqlen_q, heads, head_dim_v\) = "
                                         r"\(2, 5, 4, 64\), got \(2, 5, 4, 128\)"):
        dlpack_api.flash_attn_backward(wide, q, k, v, out, lse)
    assert dl.calls == [] and dl.workspaces == []


def test_dlpack_backward_missing_variant_before_allocation(dl, monkeypatch):
    def no_variant(family, key, manifest=None):
        raise core.MissingVariantError(f"flashgen: no {family} variant: flashgen add-variant {family}")

    case = _np_case()  # the forward's out and lse first
    monkeypatch.setattr(core, "select_variant", no_variant)
    monkeypatch.setattr(dlpack_api, "_workspace", dl.numpy_workspace)
    with pytest.raises(core.MissingVariantError, match="add-variant bwd"):
        dlpack_api.flash_attn_backward(*case, dq=_np_grads()[0])
    assert dl.workspaces == [] and dl.calls == []


def test_dlpack_backward_without_an_allocator(dl, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(TypeError, match=r"flash_attn_backward: needs \d+ bytes of scratch device memory and there "
                                        r"is no allocator for ndarray arrays: install CuPy"):
        dlpack_api.flash_attn_backward(*_np_case(), dq=_np_grads()[0], dk=_np_grads()[1], dv=_np_grads()[2])
    assert dl.calls == []


def test_dlpack_backward_empty_problems_zero_with_memsets(dl):
    dout, q, k, v, out, lse = _np_case(sk=0)  # dq = 0, dk and dv empty
    big = np.full((2, 5, 4, 128), 7, np.float16)
    dq = big[..., :64]  # strided: zeroed row block by row block, the rest untouched
    r = dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, dq=dq, dk=np.empty((2, 0, 2, 64), np.float16),
                                       dv=np.empty((2, 0, 2, 64), np.float16), stream=5)
    assert r[0] is dq and (dq == 0).all() and (big[..., 64:] == 7).all()
    dout, q, k, v, out, lse = _np_case(sq=0)  # dq empty, dk = dv = 0
    dk, dv = np.full((2, 7, 2, 64), 3, np.float16), np.full((2, 7, 2, 64), 3, np.float16)
    dlpack_api.flash_attn_backward(dout, q, k, v, out, lse, dq=np.empty((2, 0, 4, 64), np.float16), dk=dk, dv=dv,
                                   stream=5)
    assert (dk == 0).all() and (dv == 0).all()
    assert dl.calls == [] and dl.workspaces == [] and bwd_selected(dl) == []
    assert dl.memsets and all(m[-1] == 5 for m in dl.memsets)


def test_dlpack_backward_is_exported_and_torch_free():
    import flashgen

    assert flashgen.flash_attn_backward is dlpack_api.flash_attn_backward
    code = ("import sys\nsys.modules['torch'] = None\nimport flashgen\n"
            "try:\n    flashgen.flash_attn_backward([1], [2], [3], [4], [5], [6])\n"
            "except TypeError as e:\n    assert 'dout must be a DLPack array' in str(e), e\n"
            "else:\n    raise SystemExit('no error')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compile_dynamic_shapes_forward_and_backward(gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True).float().sum(), fullgraph=True,
                      dynamic=True, backend="aot_eager")
    for sq, sk in ((64, 64), (7, 100), (3, 5)):
        compiled_in, eager_in = grad_qkv(b=1, sq=sq, sk=sk, h=4, hk=2), grad_qkv(b=1, sq=sq, sk=sk, h=4, hk=2)
        f(*compiled_in).backward()
        flash_attn_func(*eager_in, causal=True).float().sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(compiled_in, eager_in))
    assert len(gpu.calls) == 6


# --------------------------------------------------------------------------------------
# The real core.attention_backward: its variant, params, TMA maps and grids (no driver)
# --------------------------------------------------------------------------------------

def _bwd_record(dtype: str, head_dim: int, causal: bool, block_m: int | None = None, *, local: bool = False,
                softcap: bool = False, **knobs) -> dict:
    """The manifest record of configs/bwd.yaml's variant for this key, from the family module
    (tile, resources, kernels, params layout); no fatbin behind it. ``block_m``: another tile's
    (not the dispatch default), e.g. the non-causal hd128 block_m 80 of configs/bwd.yaml's extra;
    ``local`` / ``softcap``: the key's (a window's variant, a softcap variant); ``knobs``: more params
    (e.g. dkv_steps=False: configs/bwd_ablation.yaml's twins, not defaults)."""
    key = {"dtype": dtype, "head_dim": head_dim, "causal": causal, "local": local, "softcap": softcap}
    params = {"family": "bwd", **bwd_mod.FAMILY.suggest(key), **({"block_m": block_m} if block_m else {}), **knobs}
    name = (f"bwd_{dtype}_hd{head_dim}_{'causal' if causal else 'local' if local else 'noncausal'}"
            f"{'_softcap' if softcap else ''}{f'_m{block_m}' if block_m else ''}"
            f"{''.join(f'_{k}{v}' for k, v in knobs.items())}_fake")
    kernels = [{"role": k.role, "symbol": f"flashgen_{name}_{k.role}", "threads": k.threads, "cluster": list(k.cluster),
                "smem_bytes": k.smem_bytes, "registers": 168, "spill_bytes": 0, "stack_bytes": 0,
                "tensor_maps": list(k.tensor_maps), "sass": list(k.sass), "params": k.params.layout()}
               for k in bwd_mod.FAMILY.kernels(params, bwd_mod.FAMILY.resources(params))]
    return {"name": name, "key": "0" * 64, "family": "bwd", "params": params, "dispatch": key, "default": not (block_m or knobs),
            "fatbin": f"fatbin/{name}.fatbin", "sha256": "0" * 64, "kernels": kernels}


class BwdLaunches:
    """launch.get_kernel / launch.launch / launch.launch_prepared / launch.tensor_map / launch.tensor_map_at
    stand-ins: kernels with the manifest's records and params packers; launches recorded with their params
    struct's bytes (``packed``) and its fields read back from them (``params``): launch packs the dict it is
    given (KeyError for a field the params struct has and the caller did not give), launch_prepared writes its
    argument block as the real one does (the per-call values between the prepared fixed bytes) and takes the
    params from it; maps recorded as their arguments (the address and the geometry's)."""

    def __init__(self):
        self.launches = []

    @staticmethod
    def get_kernel(variant, role, device):
        rec = variant.kernel(role)
        return launch.LoadedKernel(variant, rec, None, device, launch.ParamsPacker(rec.params))

    def _record(self, kernel, grid, tensor_maps, packed, stream):
        packer = kernel.packer
        assert len(tensor_maps) == len(kernel.record.tensor_maps) and len(packed) == packer.size
        params = {n: struct.unpack_from("<" + packer._codes[n], packed, packer._slots[n][1])[0] for n in packer.names}
        self.launches.append(dict(role=kernel.record.role, variant=kernel.variant.name, grid=tuple(grid),
                                  maps=dict(zip(kernel.record.tensor_maps, tensor_maps)), params=params,
                                  packed=packed, stream=stream))

    def launch(self, kernel, grid, tensor_maps, params, stream, device=None):
        assert set(params) == set(kernel.packer.names)  # every field of the struct, nothing else
        self._record(kernel, tuple(int(g) for g in grid), tensor_maps, kernel.packer.pack(params), stream)

    def launch_prepared(self, prep, tensor_maps, values, stream):
        kernel = prep.kernel
        assert len(values) == len(prep.per_call) and len(tensor_maps) == len(kernel.record.tensor_maps)
        block = prep.block_type()
        params_at = ctypes.addressof(block) + prep.head
        prep.pack_block(block, 0, *prep.arrange((*[0] * len(tensor_maps), params_at, *values, *prep.chunks)))
        self._record(kernel, prep.grid, tensor_maps, ctypes.string_at(params_at, kernel.packer.size), stream)

    @staticmethod
    def tensor_map(ptr, dtype, dims, strides_bytes, box, swizzle=128, device=None):
        return dict(ptr=ptr, dtype=dtype, dims=tuple(dims), strides=tuple(strides_bytes), box=tuple(box))

    @staticmethod
    def tensor_map_at(geometry, ptr):
        return BwdLaunches.tensor_map(ptr, geometry.dtype, geometry.dims, geometry.strides_bytes, geometry.box)


@pytest.fixture
def bwd_core(tmp_path, monkeypatch):
    """The real core on a manifest of bf16 bwd variants (every head dim, causal or not) and
    BwdLaunches for the launcher."""
    records = [_bwd_record("bf16", d, c) for d in bwd_mod.HEAD_DIMS for c in (False, True)]
    records.append(_bwd_record("bf16", 128, False, block_m=80))  # configs/bwd.yaml extra (dq_swap)
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 2, "arch": "sm_90a", "nvcc": {"version": "13.0"},
                                                        "variants": records}))
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(tmp_path))
    for var in ("FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(core, "_bwd_plans", {})
    monkeypatch.setattr(core, "_prepared_backwards", {})
    fake = BwdLaunches()
    for name in ("get_kernel", "launch", "launch_prepared", "tensor_map", "tensor_map_at"):
        monkeypatch.setattr(launch, name, getattr(fake, name))
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    return fake


def set_knob(monkeypatch, name: str, value) -> None:
    """A core knob changed between calls: the prepared backwards (core._prepared_backwards) read the knobs when a
    key is prepared, so they are emptied, as a script that changes one must (scripts/bwd_tail_ab.py)."""
    monkeypatch.setattr(core, name, value)
    core._prepared_backwards.clear()


def _run_backward(b, sq, sk, h, hk, d, dv, causal, deterministic=False):
    """core.attention_backward on TensorArgs at distinct fake addresses; returns (variant, args by name)."""
    shapes = dict(dout=(b, sq, h, dv), q=(b, sq, h, d), k=(b, sk, hk, d), v=(b, sk, hk, dv), out=(b, sq, h, dv),
                  dq=(b, sq, h, d), dk=(b, sk, hk, d), dv=(b, sk, hk, dv))
    args = {name: targ(shape, ptr=0x10000 * (i + 1)) for i, (name, shape) in enumerate(shapes.items())}
    lse = core.TensorArg(0x900000, (b, h, sq), (h * sq, sq, 1), "fp32", 0)
    variant = core.attention_backward(*(args[n] for n in ("dout", "q", "k", "v", "out")), lse,
                                      *(args[n] for n in ("dq", "dk", "dv")), 0.1, causal, deterministic, 77, 0xA00000)
    return variant, args


@pytest.mark.parametrize("d", [128, 256], ids=lambda d: f"hd{d}")
def test_core_backward_deterministic_mode(bwd_core, d, monkeypatch):
    """BwdParams.deterministic: 0 without determinism; 3 (the rotated non-causal order) while a
    query block's chain of key-block CTAs fits half the GPU (132 SMs here), 1 while it fits the GPU,
    2 (the hand-off signalled one block late) once it is longer. (The persistent grid off: its grid
    is not the key blocks'.)"""
    set_knob(monkeypatch, "PERSISTENT_BWD", 0)
    bn = None
    for det, sk, want in ((False, 100000, 0), (True, 1000, 3), (True, 100000, 2)):
        variant, _ = _run_backward(1, 300, sk, 2, 2, d, d, False, deterministic=det)
        bn = variant.params["block_n"]
        main = bwd_core.launches[-2]
        assert main["role"] == "main" and main["params"]["deterministic"] == want, (det, sk)
        assert (main["grid"][0] > 132) == (sk == 100000)
    assert [core._deterministic_mode(True, n, 132) for n in (1, 66, 67, 132, 133)] == [3, 3, 1, 1, 2]
    assert core._deterministic_mode(False, 1, 132) == 0
    # not deterministic: the ordered path where _ordered_default says (short causal calls)
    assert core._deterministic_mode(False, 4, 132, ordered_default=True) == 1
    assert [core._deterministic_mode(True, x, 132, ordered_default=True) for x in (1, 66, 67, 133)] == [3, 3, 1, 2]
    assert bn in (64, 128)


@pytest.mark.parametrize("sk,want,want_pairs", [(300, 1, 1), (512, 1, 1), (513, 0, 1), (2000, 0, 1), (2048, 0, 1),
                                               (2049, 0, 0), (5000, 0, 0)], ids=str)
def test_core_backward_default_causal_is_ordered_when_short(bwd_core, sk, want, want_pairs):
    """A causal call that is not deterministic runs the ordered path (mode 1) while seqlen_k is at
    most ORDERED_CAUSAL_MAX_SEQLEN_K (the ds_pairs kernels, head_dim 256: 2-CTA clusters,
    ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS) and the variant adds dQ by bulk reductions (every default
    tile), else the unordered one (mode 0); non-causal calls always unordered."""
    assert (core.ORDERED_CAUSAL_MAX_SEQLEN_K, core.ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS) == (512, 2048)
    for d in (64, 96, 128, 192, 256):
        variant, _ = _run_backward(2, sk, sk, 2, 2, d, d, True)
        main = bwd_core.launches[-2]
        assert bwd_mod.FAMILY.resources(variant.params)["bulk_dq"], d
        pairs = bwd_mod.FAMILY.resources(variant.params)["ds_pairs"]
        assert pairs == (d == 256), d
        assert main["role"] == "main" and main["params"]["deterministic"] == (want_pairs if pairs else want), (d, sk)
    _run_backward(2, 300, 300, 2, 2, 128, 128, False)  # non-causal: unordered
    assert bwd_core.launches[-2]["params"]["deterministic"] == 0


def test_core_backward_unordered_tail(bwd_core, monkeypatch):
    """BwdParams.unordered_tail: in an ordered default call (short causal, not deterministic) the main
    grid's last (batch, head_k) groups, UNORDERED_TAIL_WAVES of the GPU's CTAs (132 SMs here) rounded
    up to whole groups and at most all of them, run unordered; in causal calls past the ordered bounds
    (unordered throughout) UNORDERED_CAUSAL_TAIL_WAVES of them are launched longest first; 0 in
    deterministic and non-causal calls, and with the waves 0."""
    assert core.UNORDERED_TAIL_WAVES == 1.0
    for d, sk, b, hk, want in ((128, 512, 8, 8, 33),   # 4 key blocks: ceil(132 / 4) of 64 groups
                               (256, 512, 8, 8, 17),   # 8 (4 pairs)
                               (256, 2000, 8, 8, 5),   # 32 (16 pairs): an even grid
                               (256, 1950, 8, 8, 5),   # 31 key blocks, an idle 32nd CTA
                               (128, 512, 2, 3, 6)):   # fewer groups than a wave: all
        _run_backward(b, sk, sk, 2 * hk, hk, d, d, True)
        main = bwd_core.launches[-2]
        assert main["params"]["deterministic"] == 1 and main["params"]["unordered_tail"] == want, (d, sk, b, hk)
        assert main["grid"][0] * main["params"]["num_slices"] * want >= 132 or want == b * hk
        _run_backward(b, sk, sk, 2 * hk, hk, d, d, True, deterministic=True)
        assert bwd_core.launches[-2]["params"]["unordered_tail"] == 0
    # Causal past the ordered bounds (unordered throughout): UNORDERED_CAUSAL_TAIL_WAVES (2 waves) of
    # the last groups are launched longest first across them; a deterministic call keeps none.
    assert core.UNORDERED_CAUSAL_TAIL_WAVES == 2.0
    for d, sk, b, hk, want in ((256, 4096, 8, 8, 5),    # 64 key blocks: ceil(264 / 64) of 64 groups
                               (256, 4096, 2, 2, 4),    # fewer groups than 2 waves: all
                               (128, 1024, 16, 8, 33),  # 8 key blocks: ceil(264 / 8)
                               (64, 3000, 4, 4, 11)):   # 24 key blocks: ceil(264 / 24)
        _run_backward(b, sk, sk, 2 * hk, hk, d, d, True)
        main = bwd_core.launches[-2]
        assert main["params"]["deterministic"] == 0 and main["params"]["unordered_tail"] == want, (d, sk, b, hk)
        _run_backward(b, sk, sk, 2 * hk, hk, d, d, True, deterministic=True)
        assert bwd_core.launches[-2]["params"]["unordered_tail"] == 0
    set_knob(monkeypatch, "UNORDERED_CAUSAL_TAIL_WAVES", 0.0)
    _run_backward(2, 4096, 4096, 4, 2, 256, 256, True)
    assert bwd_core.launches[-2]["params"]["unordered_tail"] == 0
    _run_backward(8, 512, 512, 16, 8, 128, 128, False)  # non-causal
    assert bwd_core.launches[-2]["params"]["unordered_tail"] == 0
    set_knob(monkeypatch, "UNORDERED_TAIL_WAVES", 0.0)
    _run_backward(8, 512, 512, 16, 8, 128, 128, True)
    assert bwd_core.launches[-2]["params"]["unordered_tail"] == 0


def test_core_backward_split_tail(bwd_core, monkeypatch):
    """BwdParams.split_*: a non-causal call without a window that is not deterministic, at block_n 128,
    runs its main grid's last partial wave (units % 132 SMs here) as split_pieces CTAs per unit, P
    minimising core._split_tail's model; the grid's z grows by the planes the extra pieces need, the
    workspace holds the tickets and the pieces' partial dK / dV (backward_workspace_bytes sizes it,
    with or without seqlen_k), and none of it in deterministic, causal, local, role-tile calls or a
    call whose units fill whole waves. (The persistent grid off: it takes the short units' calls.)"""
    set_knob(monkeypatch, "PERSISTENT_BWD", 0)
    assert (core.SPLIT_TAIL_OVERHEAD_BLOCKS, core.SPLIT_TAIL_MAX_PIECES, core.SPLIT_TAIL_MAX_ROUNDS) == (6.0, 16, 2)
    # (b, seqlen, h, head_dim): units = key blocks x heads x batch; the last units % 132 split in P
    for b, s, h, d, units, want in ((8, 2048, 16, 128, 2048, (68, 3)),   # 26 blocks of 80 rows: 2 rounds of 8.7
                                    (8, 2048, 32, 64, 4096, (4, 16)),    # 16 blocks, 4 units: 16 pieces each
                                    (2, 1000, 3, 128, 48, (48, 2)),      # fewer units than SMs
                                    (2, 300, 2, 128, 12, (12, 5))):      # 5 blocks of 64 rows
        variant, _ = _run_backward(b, s, s, h, h, d, d, False)
        main = bwd_core.launches[-2]
        p = main["params"]
        assert (p["split_units"], p["split_pieces"]) == want, (b, s, h, d)
        assert p["split_whole"] == units - want[0] and p["deterministic"] == 0
        gx, gy, gz = main["grid"]
        assert gx * gy * b == units and gz * gx * gy >= units + want[0] * (want[1] - 1) > (gz - 1) * gx * gy
        assert p["split_tickets"] >= p["sem"] + 4 and p["split_parts"] >= p["split_tickets"] + 4 * want[0]
        slice_cols = variant.params["slice"]
        end = p["split_parts"] + want[0] * want[1] * 4 * 64 * slice_cols * 4
        for sk in (s, None):
            ws = core.backward_workspace_bytes(b, s, h, h, d, "bf16", False, 0, seqlen_k=sk)
            assert end <= 0xA00000 + ws, sk
        assert pre_zeroes_tickets(bwd_core.launches[-3], p)
    for causal, det, d, s in ((False, True, 128, 2048), (True, False, 128, 2048), (False, False, 256, 2048),
                              (False, False, 192, 2048), (False, False, 128, 128 * 33)):
        _run_backward(4, s, s, 16 if s == 2048 else 1, 16 if s == 2048 else 1, d, d, causal, deterministic=det)
        main = bwd_core.launches[-2]
        assert (main["params"]["split_units"], main["params"]["split_pieces"]) == (0, 1), (causal, det, d, s)
        assert main["grid"][2] == 4 and main["params"]["split_whole"] == main["grid"][0] * main["grid"][1] * 4
    set_knob(monkeypatch, "SPLIT_TAIL_MAX_PIECES", 1)
    _run_backward(8, 2048, 2048, 16, 16, 128, 128, False)
    assert bwd_core.launches[-2]["params"]["split_units"] == 0 and bwd_core.launches[-2]["grid"][2] == 8


def test_core_backward_persistent(bwd_core, monkeypatch):
    """BwdParams.persistent_units: a non-causal call without a window that is not deterministic, on a
    variant that can (bwd.py persistent: block_n 128, not block_m 80, no softcap), with more units than
    the SMs (132 here) and at most PERSISTENT_MAX_BLOCKS iterations per unit, launches one CTA per SM
    over all its units, with fast_div's magic numbers of the plain grid's x and y, no split tail and no
    rotation; every other call gets the plain grid and persistent_units 0."""
    assert core.PERSISTENT_BWD == 1 and core.PERSISTENT_MAX_BLOCKS == 8
    for b, s, h, hk, d in ((16, 512, 16, 16, 128), (16, 512, 32, 32, 64), (16, 1024, 32, 32, 64), (40, 100, 8, 2, 96),
                           (1, 100, 2, 1, 128)):
        sk = s if s > 100 else 17000
        variant, _ = _run_backward(b, s, sk, h, hk, d, d, False)
        p, grid = bwd_core.launches[-2]["params"], bwd_core.launches[-2]["grid"]
        nx, ny = -(-sk // 128), hk
        assert variant.params["block_n"] == 128 and grid == (132, 1, 1), (b, s, d)
        assert p["persistent_units"] == nx * ny * b > 132 and (p["split_units"], p["split_pieces"]) == (0, 1)
        assert p["rotate"] == 0 and p["deterministic"] == 0
        assert (p["unit_x_mul"], p["unit_x_shift"]) == core.fast_div(nx) and (p["unit_y_mul"], p["unit_y_shift"]) == core.fast_div(ny)
        assert bwd_core.launches[-3]["params"] == p == bwd_core.launches[-1]["params"]
    # not: deterministic, causal, 9 and 16 blocks, block_m 80 (hd128 from 2k), the role tiles, units <= SMs, the knob off
    for b, s, h, d, causal, det in ((16, 512, 16, 128, False, True), (16, 512, 16, 128, True, False),
                                    (16, 576, 16, 128, False, False), (16, 1024, 16, 128, False, False),
                                    (8, 2048, 16, 128, False, False),
                                    (16, 512, 8, 256, False, False), (1, 512, 33, 128, False, False)):
        variant, _ = _run_backward(b, s, s, h, h, d, d, causal, deterministic=det)
        p, grid = bwd_core.launches[-2]["params"], bwd_core.launches[-2]["grid"]
        assert p["persistent_units"] == 0 and grid[0] == -(-s // variant.params["block_n"]), (b, s, d, causal, det)
        assert (p["unit_x_mul"], p["unit_y_mul"]) == (0, 0)
    set_knob(monkeypatch, "PERSISTENT_BWD", 0)
    _run_backward(16, 512, 512, 16, 16, 128, 128, False)
    assert bwd_core.launches[-2]["params"]["persistent_units"] == 0 and bwd_core.launches[-2]["grid"] == (4, 16, 16)


def test_fast_div_matches_floor_division():
    """core.fast_div's (mul, shift): (x * mul) >> (32 + shift) == x // d for 31-bit x (mul 0: d = 1), at
    the divisors' edges (powers of two and their neighbours) and on random ones; out-of-range divisors
    raise ValueError."""
    import random

    rng = random.Random(7)
    divisors = [1, 2, 3, 5, 7, 127, 128, 129, 132, 1000, 2**30, 2**30 + 1, 2**31 - 1]
    divisors += [rng.randrange(1, 2**31) for _ in range(300)] + [rng.randrange(1, 5000) for _ in range(300)]
    for d in divisors:
        mul, shift = core.fast_div(d)
        assert 0 <= mul < 2**32 and (mul == 0) == (d == 1)
        xs = [0, 1, d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1]
        xs += [rng.randrange(0, 2**31) for _ in range(50)]
        for x in xs:
            if 0 <= x < 2**31:
                assert (x if mul == 0 else (x * mul) >> (32 + shift)) == x // d, (x, d)
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match="fast_div"):
            core.fast_div(bad)


def test_core_backward_rotate(bwd_core, monkeypatch):
    """BwdParams.rotate: unordered non-causal calls at block_n 128 with no more key blocks than query
    blocks and at least ROTATE_UNORDERED_MIN_M_BLOCKS query blocks (core.ROTATE_UNORDERED) visit the
    query blocks rotated; not deterministic calls (mode 3 rotates by itself), causal ones, the role tiles
    (head_dim 256), longer keys, fewer query blocks, or with the knob off."""
    assert core.ROTATE_UNORDERED is True and core.ROTATE_UNORDERED_MIN_M_BLOCKS == 64
    for b, sq, sk, d, causal, det, want in ((2, 8192, 8192, 128, False, False, 1), (2, 8192, 8192, 64, False, False, 1),
                                            (2, 5120, 5120, 128, False, False, 1),  # 64 blocks of 80 rows
                                            (2, 5040, 5040, 128, False, False, 0),  # 63
                                            (2, 2048, 2048, 128, False, False, 0), (2, 300, 300, 64, False, False, 0),
                                            (2, 5120, 9000, 128, False, False, 0), (2, 8192, 8192, 128, False, True, 0),
                                            (2, 8192, 8192, 128, True, False, 0), (2, 8192, 8192, 256, False, False, 0)):
        _run_backward(b, sq, sk, 4, 2, d, d, causal, deterministic=det)
        assert bwd_core.launches[-2]["params"]["rotate"] == want, (b, sq, sk, d, causal, det)
    set_knob(monkeypatch, "ROTATE_UNORDERED", False)
    _run_backward(2, 8192, 8192, 4, 2, 128, 128, False)
    assert bwd_core.launches[-2]["params"]["rotate"] == 0


def pre_zeroes_tickets(pre, main_params) -> bool:
    """The preprocess gets the same split parameters (its CTA (0, 0, 0) zeroes the tickets)."""
    return all(pre["params"][k] == main_params[k] for k in ("split_units", "split_tickets"))


def test_stage_dq_is_every_role_tile():
    """bwd.stage_dq (the template's kStageDq): the role tiles (head_dim 192 and 256), whose
    consumers' fp32 dQ halves (64 x head_dim / 2 floats) are exactly a ring tile's bytes; the
    resources call them bulk-reduced."""
    for d, want in ((64, False), (96, False), (128, False), (192, True), (256, True)):
        params = bwd_mod.FAMILY.suggest({"dtype": "bf16", "head_dim": d, "causal": False, "local": False,
                                         "softcap": False})
        assert bwd_mod.stage_dq(params) == want == bwd_mod.roles(params), d
        r = bwd_mod.FAMILY.resources(params)
        assert r["bulk_dq"] and r["stage_dq"] == want, d
        if want:
            assert 64 * (d // 2) * 4 == r["smem"]["q"]["bytes"] // params["stages"], d


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d,dv,served", [(192, 128, 192), (64, 128, 128), (128, 64, 128), (128, 128, 128),
                                         (64, 192, 192), (96, 256, 256), (40, 72, 96)],
                         ids=lambda x: str(x))
def test_core_backward_head_dim_v(bwd_core, d, dv, served, causal):
    """(head_dim, head_dim_v) runs on the bwd variant of max(head_dim, head_dim_v) rounded up to a
    built size; the params carry both; q, k, dk are mapped at head_dim columns and v, dout, dv at
    head_dim_v (TMA zero-fills past them and drops stores past them); the main grid has the
    variant's column slices; the workspace is the plan's (head_dim padded), as
    backward_workspace_bytes says given head_dim_v."""
    b, sq, sk, h, hk = 2, 113, 239, 4, 2  # GQA 2, odd lengths
    variant, args = _run_backward(b, sq, sk, h, hk, d, dv, causal)
    assert variant.dispatch == {"dtype": "bf16", "head_dim": served, "causal": causal, "local": False,
                                "softcap": False, "varlen": False}
    pre, main, post = bwd_core.launches
    assert [x["role"] for x in bwd_core.launches] == ["pre", "main", "post"]
    assert all(x["variant"] == variant.name and x["stream"] == 77 for x in bwd_core.launches)
    p = main["params"]
    assert pre["params"] == p == post["params"]
    assert (p["head_dim"], p["head_dim_v"]) == (d, dv)
    assert p["o"] == args["out"].ptr and p["dout"] == args["dout"].ptr and p["dq"] == args["dq"].ptr
    vp = variant.params
    pad = -(-served // 64) * 64
    slices = pad // vp["slice"]
    bn = vp["block_n"]
    extra = -(-p["split_units"] * (p["split_pieces"] - 1) // (-(-sk // bn) * slices * hk))  # the split tail's planes
    assert p["num_slices"] == slices and main["grid"] == (-(-sk // bn), slices * hk, b + extra)
    boxes = {"q": vp["block_m"], "dout": vp["block_m"], "k": bn, "v": bn, "dk": 64, "dv": 64}
    for name, m in main["maps"].items():
        width = dv if name in ("v", "dout", "dv") else d
        assert m["ptr"] == args[name].ptr and m["dims"] == (width, args[name].shape[1], args[name].shape[2], b), name
        assert m["box"] == (64, boxes[name], 1, 1) and m["dtype"] == "bf16", name
    assert pre["maps"] == {} and post["maps"] == {}
    num_m = -(-sq // vp["block_m"])
    # the preprocess: 8 / 16 / 32 lanes per row at head_dim padded to 64 / 128 / 192-256 (256 threads),
    # 2 rows per lane group; the postprocess: 2 CTAs per 16 rows
    lanes = {64: 8, 128: 16, 192: 32, 256: 32}[pad]
    assert pre["grid"] == (-(-num_m * vp["block_m"] // (2 * 256 // lanes)), h, b) and post["grid"] == (2 * -(-sq // 16), h, b)
    assert bwd_mod.pre_row_lanes(vp) == lanes and (64 % bwd_mod.pre_rows_per_cta(vp)) == 0
    rows = b * h * num_m * vp["block_m"]
    assert p["sem"] - p["dq_accum"] >= rows * pad * 4  # the dQ accumulator is head_dim-padded wide
    ws = core.backward_workspace_bytes(b, sq, h, hk, d, "bf16", causal, 0, head_dim_v=dv)
    assert ws == core.backward_workspace_bytes(b, sq, h, hk, served, "bf16", causal, 0)  # head_dim_v defaults
    assert p["sem"] + b * h * num_m * slices * 4 <= 0xA00000 + ws


def test_core_backward_workspace_head_dim_v_defaults_to_head_dim(bwd_core):
    """Existing callers (no head_dim_v) get the workspace of head_dim's variant; a larger head_dim_v
    selects (and sizes for) the larger variant. (With seqlen_k: without it the block_n 128 variants
    also reserve room for any split tail, test_core_backward_split_tail.)"""
    def ws(d, **kw):
        return core.backward_workspace_bytes(2, 300, 4, 2, d, "bf16", False, 0, seqlen_k=300, **kw)

    assert ws(64) == ws(64, head_dim_v=64) == ws(64, head_dim_v=None)
    assert ws(64, head_dim_v=256) == ws(256) != ws(64)  # (hd64's holds its split tail: it may be the larger)
    assert ws(192, head_dim_v=64) == ws(192)


def test_core_backward_pairs_grid_is_padded_to_the_cluster(bwd_core):
    """The ds_pairs kernels (head_dim 256) launch as (2, 1, 1) clusters: an odd count of key blocks
    gets one padded CTA (it idles: templates/bwd.cu.j2 kPairs); other head dims launch one CTA per
    key block."""
    for d, sk, want in ((256, 130, 4), (256, 128, 2), (256, 1, 2), (128, 130, 2), (192, 130, 3)):
        _run_backward(1, 300, sk, 2, 2, d, d, False)
        main = bwd_core.launches[-2]
        assert main["role"] == "main" and main["grid"][0] == want, (d, sk, main["grid"])


def test_core_backward_dkv_steps_twins(bwd_core, monkeypatch, tmp_path):
    """core.BWD_DKV_STEPS (True, the shipped path) serves calls with the dispatch default; False with the
    built twin of the chosen variant that has dkv_steps off (configs/bwd_ablation.yaml), the block_m 80
    variant's twin for long rows, and the variant itself where no twin is built (hd64 here)."""
    assert core.BWD_DKV_STEPS is True
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["variants"] += [_bwd_record("bf16", 128, False, dkv_steps=False),
                             _bwd_record("bf16", 128, False, block_m=80, dkv_steps=False)]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for sq, bm in ((1000, 64), (3000, 80)):
        on, _ = _run_backward(1, sq, 1000, 2, 2, 128, 128, False)
        set_knob(monkeypatch, "BWD_DKV_STEPS", False)
        off, _ = _run_backward(1, sq, 1000, 2, 2, 128, 128, False)
        other, _ = _run_backward(1, sq, 1000, 2, 2, 64, 64, False)
        set_knob(monkeypatch, "BWD_DKV_STEPS", True)
        assert on.params.get("dkv_steps", True) and on.params["block_m"] == bm
        assert off.params["dkv_steps"] is False and off.params["block_m"] == bm and not off.default
        assert {k: x for k, x in off.params.items() if k != "dkv_steps"} == on.params
        assert other.params.get("dkv_steps", True) and other.default


def test_core_backward_deterministic_runs_on_the_nosteps_twins(bwd_core, monkeypatch, tmp_path):
    """Deterministic calls whose variant's head_dim is in core.DET_NOSTEPS_HEAD_DIMS (128) run on its built
    dkv_steps-off twin (configs/bwd.yaml's extra), the block_m 80 variant's twin for long rows; the default
    backward keeps the steps; head_dim 64 keeps them in both modes even with a twin built (the ablation
    set's); emptying DET_NOSTEPS_HEAD_DIMS (the A/B) gives deterministic calls the steps again."""
    assert 128 in core.DET_NOSTEPS_HEAD_DIMS and 64 not in core.DET_NOSTEPS_HEAD_DIMS
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["variants"] += [_bwd_record("bf16", 128, c, dkv_steps=False) for c in (False, True)] + [
        _bwd_record("bf16", 128, False, block_m=80, dkv_steps=False), _bwd_record("bf16", 64, False, dkv_steps=False)]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for sq, causal, bm in ((1000, False, 64), (1000, True, 64), (3000, False, 80)):
        default, _ = _run_backward(1, sq, 1000, 2, 2, 128, 128, causal)
        det, _ = _run_backward(1, sq, 1000, 2, 2, 128, 128, causal, deterministic=True)
        assert default.params.get("dkv_steps", True) and default.params["block_m"] == bm and default.params["causal"] == causal
        assert det.params["dkv_steps"] is False and det.params["block_m"] == bm and det.params["causal"] == causal
        assert {k: x for k, x in det.params.items() if k != "dkv_steps"} == default.params
        assert bwd_core.launches[-2]["params"]["deterministic"] > 0
    for det in (False, True):
        hd64, _ = _run_backward(1, 1000, 1000, 2, 2, 64, 64, False, deterministic=det)
        assert hd64.params.get("dkv_steps", True) and hd64.default
    set_knob(monkeypatch, "DET_NOSTEPS_HEAD_DIMS", ())
    det, _ = _run_backward(1, 1000, 1000, 2, 2, 128, 128, False, deterministic=True)
    assert det.params.get("dkv_steps", True) and det.default


def test_bwd_dkv_steps_rule():
    """dkv_steps: the block_n 128 tiles issue dV / dK k-step by k-step unless the knob is off; the role tiles
    never (tried: hd256 0.96-0.99x, docs/results/bwd_dkv_steps/)."""
    for d in bwd_mod.HEAD_DIMS:
        p = bwd_mod.FAMILY.suggest({"dtype": "bf16", "head_dim": d, "causal": False, "local": False, "softcap": False})
        assert bwd_mod.dkv_steps(p) == (p["block_n"] == 128), d
        assert not bwd_mod.dkv_steps({**p, "dkv_steps": False})
        assert bwd_mod.FAMILY.resources(p)["dkv_steps"] == (p["block_n"] == 128)


@pytest.mark.parametrize("sq", [300, 2047, 2048, 5000], ids=str)
def test_core_backward_long_rows_take_block_m_80(bwd_core, sq):
    """Non-causal hd128 calls with seqlen_q >= DQ_SWAP_MIN_SEQLEN_Q run on the key's block_m 80
    variant (configs/bwd.yaml extra, bwd.py dq_swap), shorter ones on the default block_m 64; its
    Q / dO boxes, preprocess grid (the last CTA may reach past the 80-row padding) and workspace
    follow the 80-row blocks, and backward_workspace_bytes sizes the same plan. Causal calls, other
    head dims and an explicit variant are untouched."""
    assert core.DQ_SWAP_MIN_SEQLEN_Q == 2048
    b, h = 1, 2
    variant, _ = _run_backward(b, sq, 1000, h, h, 128, 128, False)
    bm = variant.params["block_m"]
    assert bm == (80 if sq >= 2048 else 64) and variant.default == (bm == 64)
    assert bwd_mod.dq_swap(variant.params) == (bm == 80)
    pre, main, post = bwd_core.launches[-3:]
    num_m = -(-sq // bm)
    assert main["params"]["seqlen_q_pad"] == num_m * bm and main["params"]["num_m_blocks"] == num_m
    assert main["maps"]["q"]["box"] == (64, bm, 1, 1) and main["maps"]["dout"]["box"] == (64, bm, 1, 1)
    assert pre["grid"] == (-(-num_m * bm // 32), h, b) and post["grid"] == (2 * -(-sq // 16), h, b)
    ws = core.backward_workspace_bytes(b, sq, h, h, 128, "bf16", False, 0)
    p = main["params"]
    assert p["sem"] - p["dq_accum"] >= b * h * num_m * bm * 128 * 4 and p["sem"] + b * h * num_m * 4 <= 0xA00000 + ws
    plan = core._bwd_plan("bf16", 128, core.mask_spec(False, (-1, -1), sq, 1000), False, 0, None, sq)
    # without seqlen_k: room for any split tail (SPLIT_TAIL_MAX_ROUNDS x SMs pieces)
    assert ws == core._bwd_workspace(plan, b, sq, h, (core.SPLIT_TAIL_MAX_ROUNDS * plan.sms, 1))[0]
    for d, causal in ((128, True), (64, False), (256, False)):
        other, _ = _run_backward(b, sq, 1000, h, h, d, d, causal)
        assert other.default and other.params["block_m"] != 80, (d, causal)
    default = core._bwd_plan("bf16", 128, core.mask_spec(False, (-1, -1), 300, 1000), False, 0, None).variant
    assert default.params["block_m"] == 64
    assert core.attention_backward(*(targ(s, ptr=0x10000) for s in [(b, sq, h, 128)] * 5),
                                   core.TensorArg(0x900000, (b, h, sq), (h * sq, sq, 1), "fp32", 0),
                                   *(targ(s, ptr=0x10000) for s in [(b, sq, h, 128)] * 3), 0.1, False, False, 77,
                                   0xA00000, variant=default) is default


def _varlen_record(dtype: str, head_dim: int, causal: bool) -> dict:
    """configs/bwd.yaml's varlen variant of this key (bwd.py varlen), as _bwd_record's."""
    rec = _bwd_record(dtype, head_dim, causal, varlen=True)
    rec["dispatch"] = {**rec["dispatch"], "varlen": True}
    rec["default"] = True
    params = rec["params"]
    assert not any(f(params) for f in (bwd_mod.ds_pairs, bwd_mod.split_tail, bwd_mod.persistent, bwd_mod.dq_swap))
    return rec


@pytest.fixture
def bwd_core_varlen(bwd_core, tmp_path):
    """bwd_core's manifest with the varlen variants of every bf16 head dim, causal or not."""
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["variants"] += [_varlen_record("bf16", d, c) for d in bwd_mod.HEAD_DIMS for c in (False, True)]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    return bwd_core


def _run_varlen_backward(lens_q, lens_k, h, hk, d, dv, causal, pad=(3, 2), deterministic=False, **kw):
    """core.attention_backward(varlen=...) on packed TensorArgs at distinct fake addresses; (variant, args, varlen)."""
    tq, tk = sum(lens_q) + pad[0], sum(lens_k) + pad[1]
    shapes = dict(dout=(tq, h, dv), q=(tq, h, d), k=(tk, hk, d), v=(tk, hk, dv), out=(tq, h, dv), dq=(tq, h, d),
                  dk=(tk, hk, d), dv=(tk, hk, dv))
    args = {name: targ(shape, ptr=0x100000 * (i + 1)) for i, (name, shape) in enumerate(shapes.items())}
    lse = kw.pop("lse", core.TensorArg(0x900000, (h, tq), (tq, 1), "fp32", 0))
    vl = core.BwdVarlen(0x800000, 0x810000, len(lens_q), max(lens_q), max(lens_k))
    variant = core.attention_backward(*(args[n] for n in ("dout", "q", "k", "v", "out")), lse,
                                      *(args[n] for n in ("dq", "dk", "dv")), 0.1, causal, deterministic, 77, 0xA00000,
                                      varlen=vl, **kw)
    return variant, args, vl


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)], ids=str)
def test_core_backward_varlen(bwd_core_varlen, d, dv, causal):
    """The varlen backward: the varlen variant of the key; the sequences' offsets, the longest lengths and the packed
    total in the params (batch = the sequences, seqlen_q_pad = block_m (ceil(total_q / block_m) + batch): every
    sequence's blocks padded apart, bwd.cu.j2 BwdSeq); dk, dv stored from registers (their addresses and strides);
    no persistent grid, split tail, unordered tail or rotation; the grids the non-varlen call of the longest lengths
    would have over the sequences; q, k, v, dout mapped as a batch of one; a workspace that holds it all."""
    lens_q, lens_k, h, hk = [5, 130, 0, 77], [9, 130, 40, 0], 4, 2
    variant, args, vl = _run_varlen_backward(lens_q, lens_k, h, hk, d, dv, causal)
    vp = variant.params
    assert vp["varlen"] is True and variant.dispatch["varlen"] is True
    pre, main, post = bwd_core_varlen.launches
    p = main["params"]
    assert pre["params"] == p == post["params"]
    tq, tk = args["q"].shape[0], args["k"].shape[0]
    bm, bn = vp["block_m"], vp["block_n"]
    assert (p["cu_seqlens_q"], p["cu_seqlens_k"], p["batch"], p["seqlen_q"], p["seqlen_k"], p["total_q"]) == \
        (vl.cu_seqlens_q, vl.cu_seqlens_k, 4, 130, 130, tq)
    assert p["seqlen_q_pad"] == bm * (-(-tq // bm) + 4) and p["num_m_blocks"] == -(-130 // bm)
    assert (p["dk"], p["dv"], p["dk_stride_seq"], p["dk_stride_head"], p["dv_stride_seq"], p["dv_stride_head"]) == \
        (args["dk"].ptr, args["dv"].ptr, hk * d, d, hk * dv, dv)
    assert (p["unordered_tail"], p["rotate"], p["split_units"], p["persistent_units"]) == (0, 0, 0, 0)
    assert p["o_stride_seq"] == h * dv and p["do_stride_seq"] == h * dv and p["dq_stride_seq"] == h * d
    slices = p["num_slices"]
    lanes = bwd_mod.pre_row_lanes(vp)
    assert pre["grid"] == (-(-p["num_m_blocks"] * bm // (2 * 256 // lanes)), h, 4)
    assert main["grid"] == (-(-130 // bn), slices * hk, 4) and post["grid"] == (2 * -(-130 // 16), h, 4)
    for name, m in main["maps"].items():  # a batch of one over the packed rows
        rows = tq if name in ("q", "dout") else tk
        assert m["ptr"] == args[name].ptr and m["dims"][1:] == (rows, args[name].shape[1], 1), name
    ws = core.backward_workspace_bytes(4, 130, h, hk, d, "bf16", causal, 0, seqlen_k=130, head_dim_v=dv,
                                       varlen_total_q=tq)
    pad = -(-max(d, dv) // 64) * 64
    assert p["dq_accum"] - p["dpsum"] >= h * p["seqlen_q_pad"] * 4  # one (heads, seqlen_q_pad) plane
    assert p["sem"] - p["dq_accum"] >= h * p["seqlen_q_pad"] * pad * 4
    assert p["sem"] + 4 * h * p["num_m_blocks"] * slices * 4 <= 0xA00000 + ws


def test_varlen_padded_rows_keep_sequences_apart():
    """bwd.cu.j2 BwdSeq's padding: sequence b's workspace rows start at block_m (cu_seqlens_q[b] // block_m + b), a
    multiple of block_m, and its ceil(len / block_m) blocks end at or before sequence b + 1's start and within
    seqlen_q_pad = block_m (ceil(total_q / block_m) + batch) (core._varlen_rows_pad)."""
    rng = random.Random(5)
    for _ in range(2000):
        bm = rng.choice((64, 128))
        lens = [rng.choice((0, 1, 63, 64, 65, 127, 128, 129, rng.randrange(300))) for _ in range(rng.randrange(1, 9))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        total = cu[-1] + rng.randrange(3)
        plan = types.SimpleNamespace(block_m=bm)
        rows_pad = core._varlen_rows_pad(plan, len(lens), total)
        starts = [bm * (cu[b] // bm + b) for b in range(len(lens))]
        for b, n in enumerate(lens):
            end = starts[b] + -(-n // bm) * bm
            assert starts[b] % bm == 0 and end <= (starts[b + 1] if b + 1 < len(lens) else rows_pad), (bm, lens, b)


def test_core_backward_varlen_refuses_what_it_cannot_run(bwd_core_varlen):
    """A varlen call with 4-D arrays, an lse not (heads, total_q) contiguous, no offsets, or a variant without varlen
    named: ValueError naming it, before any launch."""
    with pytest.raises(ValueError, match="lse must be fp32"):
        _run_varlen_backward([5, 7], [5, 7], 2, 2, 64, 64, False,
                             lse=core.TensorArg(0x900000, (1, 2, 15), (30, 15, 1), "fp32", 0))
    tq = 15
    with pytest.raises(ValueError, match="lse must be fp32"):
        _run_varlen_backward([5, 7], [5, 7], 2, 2, 64, 64, False,
                             lse=core.TensorArg(0x900000, (2, tq), (1, 2), "fp32", 0))
    plain = core.select_variant("bwd", {"dtype": "bf16", "head_dim": 64, "causal": False, "local": False,
                                        "softcap": False})
    with pytest.raises(ValueError, match="varlen"):
        _run_varlen_backward([5, 7], [5, 7], 2, 2, 64, 64, False, variant=plain)
    q = targ((1, 12, 2, 64))
    vl = core.BwdVarlen(0x800000, 0x810000, 2, 7, 7)
    with pytest.raises(ValueError, match="must be 3-D"):
        core.attention_backward(q, q, q, q, q, core.TensorArg(0x900000, (2, 12), (12, 1), "fp32", 0), q, q, q, 0.1,
                                False, False, 77, 0xA00000, varlen=vl)
    a = targ((12, 2, 64))
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        core.attention_backward(a, a, a, a, a, core.TensorArg(0x900000, (2, 12), (12, 1), "fp32", 0), a, a, a, 0.1,
                                False, False, 77, 0xA00000, varlen=vl._replace(cu_seqlens_k=0))
    assert not bwd_core_varlen.launches


# --------------------------------------------------------------------------------------
# The prepared backward (core.prepare_backward / launch_backward) against the unprepared construction
# --------------------------------------------------------------------------------------

def _unprepared_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, stream,
                         workspace_ptr, window_size=(-1, -1), softcap=0.0, varlen=None):
    """core.attention_backward as it was before the prepared launch (commit 4a51576), for valid arguments: every
    call resolves the plan, builds the params dict with every field (addresses included) and launches through
    launch.launch and launch.tensor_map. The reference the prepared path must reproduce byte for byte."""
    total_q = 0
    if varlen is not None:
        dout, q, k, v, out, dq, dk, dv = (core._batch_of_one(name, t) for name, t in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk), ("dv", dv)))
        total_q = q.shape[1]
    _, sq, h, d = q.shape
    _, sk, hk, dv_dim = v.shape
    b = q.shape[0]
    if varlen is not None:
        b, sq, sk = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    mask = core.mask_spec(causal, window_size, sq, sk)
    scale = float(softmax_scale)
    scale_log2, softcap_scale = core.softmax_constants(scale, softcap)
    plan = core._bwd_plan(q.dtype, max(d, dv_dim), mask, softcap > 0, q.device, None, sq, deterministic,
                          varlen is not None)
    bm, bn = plan.block_m, plan.block_n
    num_m, num_n = -(-sq // bm), -(-sk // bn)
    grid_n = core._bwd_grid_n(plan, sk)
    units = core._bwd_units(plan, b, hk, sk)
    persistent = core._persistent_units(plan, mask, deterministic, units, num_m * (h // hk)) if varlen is None else 0
    split_units, split_pieces = ((0, 1) if persistent or varlen is not None
                                 else core._call_split(plan, mask, deterministic, units, sq, h, hk))
    _, (o_lse, o_dpsum, o_acc, o_sem, o_tickets, o_parts) = core._bwd_workspace(
        plan, b, sq, h, (split_units, split_pieces), None if varlen is None else total_q)
    w = int(workspace_ptr)
    ordered = core._ordered_default(plan, mask, sk)
    params = {
        "o": out.ptr, "dout": dout.ptr, "lse": lse.ptr,
        "lse_log2": w + o_lse, "dpsum": w + o_dpsum, "dq_accum": w + o_acc, "sem": w + o_sem, "dq": dq.ptr,
        "o_stride_batch": out.strides[0], "o_stride_seq": out.strides[1], "o_stride_head": out.strides[2],
        "do_stride_batch": dout.strides[0], "do_stride_seq": dout.strides[1], "do_stride_head": dout.strides[2],
        "dq_stride_batch": dq.strides[0], "dq_stride_seq": dq.strides[1], "dq_stride_head": dq.strides[2],
        "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_k": hk, "batch": b, "head_dim": d, "head_dim_v": dv_dim,
        "seqlen_q_pad": num_m * bm if varlen is None else core._varlen_rows_pad(plan, b, total_q),
        "num_m_blocks": num_m, "num_slices": plan.num_slices,
        "deterministic": core._deterministic_mode(deterministic, num_n, plan.sms, ordered),
        "scale_log2": scale_log2, "softmax_scale": scale,
        "softcap_scale": softcap_scale, "window_left": mask.left, "window_right": mask.right,
        "unordered_tail": (core._unordered_tail(plan, deterministic, ordered, mask.causal, grid_n, b * hk)
                           if varlen is None else 0),
        "rotate": int(core.ROTATE_UNORDERED and not deterministic and not mask.causal and not mask.local
                      and not persistent and plan.block_n == 128 and num_n <= num_m
                      and num_m >= core.ROTATE_UNORDERED_MIN_M_BLOCKS and varlen is None),
        "split_whole": units - split_units, "split_units": split_units, "split_pieces": split_pieces,
        "split_parts": w + o_parts if split_units else 0, "split_tickets": w + o_tickets if split_units else 0,
        "persistent_units": persistent,
        "cu_seqlens_q": 0 if varlen is None else varlen.cu_seqlens_q,
        "cu_seqlens_k": 0 if varlen is None else varlen.cu_seqlens_k,
        "dk": dk.ptr, "dv": dv.ptr, "dk_stride_seq": dk.strides[1], "dk_stride_head": dk.strides[2],
        "dv_stride_seq": dv.strides[1], "dv_stride_head": dv.strides[2], "total_q": total_q,
        "total_k": dk.shape[1] if varlen is not None else 0,
        "zero_tail": int(varlen is not None and varlen.zero_tail),
    }
    (params["unit_x_mul"], params["unit_x_shift"]), (params["unit_y_mul"], params["unit_y_shift"]) = (
        (core.fast_div(grid_n), core.fast_div(plan.num_slices * hk)) if persistent else ((0, 0), (0, 0)))
    launch.launch(plan.pre, (-(-num_m * bm // plan.pre_rows), h, b), (), params, stream)
    maps = tuple(launch.tensor_map(t.ptr, *core._bshd_map_spec(t, rows))
                 for t, rows in ((q, bm), (k, bn), (v, bn), (dout, bm), (dk, 64), (dv, 64)))
    extra = -(-split_units * (split_pieces - 1) // (grid_n * plan.num_slices * hk))
    grid = (plan.sms, 1, 1) if persistent else (grid_n, plan.num_slices * hk, b + extra)
    launch.launch(plan.main, grid, maps, params, stream)
    launch.launch(plan.post, (2 * -(-sq // 16), h, b), (), params, stream)
    return plan.variant


@pytest.fixture
def bwd_core_all(bwd_core_varlen, tmp_path):
    """bwd_core_varlen's manifest with the window (local) and softcap variants of head dims 64 and 128."""
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["variants"] += [_bwd_record("bf16", d, False, **{f: True}) for d in (64, 128) for f in ("local", "softcap")]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    return bwd_core_varlen


def _bwd_case_args(case: dict, base: int) -> tuple:
    """(args by name, BwdVarlen or None) of a _PREPARED_CASES entry: the nine arrays at distinct addresses from
    ``base`` (contiguous; padded (batch, seqlen, heads, dim), or packed (total, heads, dim) with ``lens``)."""
    h, hk, d, dv = case["h"], case["hk"], case["d"], case["dv"]
    if "lens" in case:
        lens_q, lens_k = case["lens"]
        tq, tk = sum(lens_q) + 3, sum(lens_k) + 2
        rows = dict(q=(tq,), k=(tk,))
        vl = core.BwdVarlen(base + 0x70000, base + 0x71000, len(lens_q),
                            *case.get("max_seqlen", (max(lens_q), max(lens_k))), case.get("zero_tail", False))
        lse = (h, tq)
    else:
        b, sq, sk = case["b"], case["sq"], case["sk"]
        rows, vl, lse = dict(q=(b, sq), k=(b, sk)), None, (b, h, sq)
    shapes = dict(dout=(*rows["q"], h, dv), q=(*rows["q"], h, d), k=(*rows["k"], hk, d), v=(*rows["k"], hk, dv),
                  out=(*rows["q"], h, dv), lse=lse, dq=(*rows["q"], h, d), dk=(*rows["k"], hk, d),
                  dv=(*rows["k"], hk, dv))
    args = {name: targ(shape, "fp32" if name == "lse" else "bf16", base + 0x1000000 * (i + 1))
            for i, (name, shape) in enumerate(shapes.items())}
    return args, vl


_PREPARED_CASES = {  # (b, sq, sk, h, hk, d, dv) or packed lens, mask, determinism: every decision of the plan
    "hd128_split_tail": dict(b=2, sq=300, sk=300, h=2, hk=2, d=128, dv=128, causal=False),
    "hd64_causal_gqa": dict(b=2, sq=200, sk=333, h=8, hk=2, d=64, dv=64, causal=True),
    "hd256_causal_det_pairs": dict(b=1, sq=300, sk=300, h=4, hk=4, d=256, dv=256, causal=True, deterministic=True),
    "hd96_gqa_det": dict(b=2, sq=100, sk=150, h=6, hk=3, d=96, dv=96, causal=False, deterministic=True),
    "hd128_block_m80": dict(b=1, sq=2048, sk=1000, h=2, hk=2, d=128, dv=128, causal=False),
    "hd128_persistent": dict(b=16, sq=512, sk=512, h=16, hk=16, d=128, dv=128, causal=False),
    "hd128_causal_unordered_tail": dict(b=8, sq=512, sk=512, h=16, hk=8, d=128, dv=128, causal=True),
    "hd64_rotate": dict(b=2, sq=8192, sk=8192, h=4, hk=2, d=64, dv=64, causal=False),
    "hd128_window": dict(b=2, sq=300, sk=400, h=4, hk=2, d=128, dv=128, causal=False, window_size=(64, 32)),
    "hd64_softcap": dict(b=2, sq=300, sk=300, h=4, hk=4, d=64, dv=64, causal=False, softcap=30.0),
    "hd192_dv128_causal": dict(b=2, sq=113, sk=239, h=4, hk=2, d=192, dv=128, causal=True),
    "varlen_hd128_causal": dict(lens=([5, 130, 0, 77], [9, 130, 40, 0]), h=4, hk=2, d=128, dv=128, causal=True),
    "varlen_hd64_zero_tail": dict(lens=([64, 1, 100], [64, 30, 100]), h=2, hk=1, d=64, dv=64, causal=False,
                                  zero_tail=True),
}


@pytest.mark.parametrize("name", list(_PREPARED_CASES))
def test_prepared_backward_is_the_unprepared_launch(bwd_core_all, name, monkeypatch):
    """The prepared backward launches what the unprepared construction (_unprepared_backward) launched, byte for
    byte: the three kernels in order, their grids, the main kernel's six TMA maps, the params struct's bytes, the
    stream. For a spread of keys (split tail, GQA, head dims 64 to 256, deterministic, block_m 80, the persistent
    grid, the unordered tail, rotation, a window, softcap, head_dim_v != head_dim, varlen); the first call
    prepares, a second one with other addresses, scale, softcap value, workspace, offsets and stream hits the cache
    (no second prepare) and launches at its own addresses; prepare_backward on addresses 0 then launch_backward
    (the interface's way) launches the same. The workspace regions the params point at end within ``nbytes``, which
    is at most what backward_workspace_bytes asks for."""
    case = dict(_PREPARED_CASES[name])
    causal, det = case["causal"], case.get("deterministic", False)
    window, softcap = case.get("window_size", (-1, -1)), case.get("softcap", 0.0)
    prepares = []
    real_prepare = core._prepare_backward
    monkeypatch.setattr(core, "_prepare_backward", lambda *a: prepares.append(a) or real_prepare(*a))
    order = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    for rnd, (base, scale, stream, w) in enumerate(((0, 0.1, 77, 0xA00000), (0x40000000, -0.3, 78, 0xB00100))):
        args, vl = _bwd_case_args(case, base)
        cap = softcap * (1 + rnd)  # softcap's value is per call (only softcap > 0 is in the key)
        _unprepared_backward(*(args[n] for n in order), scale, causal, det, stream, w, window, cap, vl)
        want = bwd_core_all.launches[-3:]
        variant = core.attention_backward(*(args[n] for n in order), scale, causal, det, stream, w,
                                          window_size=window, softcap=cap, varlen=vl)
        got = bwd_core_all.launches[-3:]
        prep = core.prepare_backward(*(a._replace(ptr=0) for a in (args[n] for n in order)), causal, det,
                                     window_size=window, softcap=cap, varlen=vl)
        core.launch_backward(prep, *(args[n].ptr for n in order), w, scale, cap, stream,
                             () if vl is None else vl.addresses())
        again = bwd_core_all.launches[-3:]
        assert [x["role"] for x in want] == ["pre", "main", "post"]
        for ref, new, new2 in zip(want, got, again):
            for field in ("role", "variant", "grid", "maps", "packed", "stream"):
                assert ref[field] == new[field] == new2[field], (name, rnd, ref["role"], field)
        assert variant.name == want[0]["variant"] and len(prepares) == 1 and len(core._prepared_backwards) == 1
        main = got[1]
        assert {m: main["maps"][m]["ptr"] for m in main["maps"]} == {m: args[m].ptr for m in main["maps"]}
        p = main["params"]
        assert (p["o"], p["dout"], p["lse"], p["dq"], p["dk"], p["dv"]) == tuple(
            args[n].ptr for n in ("out", "dout", "lse", "dq", "dk", "dv"))
        assert p["softmax_scale"] == pytest.approx(scale) and main["stream"] == stream
        if vl is not None:
            assert (p["cu_seqlens_q"], p["cu_seqlens_k"]) == vl.addresses()
        slices = p["num_slices"]  # (batch: the sequences of a varlen call)
        sem_end = p["sem"] + 4 * p["batch"] * p["heads"] * p["num_m_blocks"] * slices
        assert w <= p["lse_log2"] < p["dpsum"] < p["dq_accum"] < p["sem"] and sem_end <= w + prep.nbytes
        assert (p["split_units"] > 0) == prep.split == (p["split_tickets"] != 0) == (p["split_parts"] != 0)
        if prep.split:
            slice_cols = -(-max(case["d"], case["dv"]) // 64) * 64 // slices
            parts_end = p["split_parts"] + p["split_units"] * p["split_pieces"] * 4 * 64 * slice_cols * 4
            assert p["sem"] < p["split_tickets"] < p["split_parts"] and parts_end <= w + prep.nbytes
        if vl is None:
            asked = core.backward_workspace_bytes(case["b"], case["sq"], case["h"], case["hk"], case["d"], "bf16",
                                                  causal, 0, seqlen_k=case["sk"], window_size=window, softcap=cap,
                                                  head_dim_v=case["dv"])
            assert prep.nbytes <= asked


def test_prepared_backward_keys_hold_all_the_metadata(bwd_core_all):
    """Calls differing from one another in one piece of metadata (each array's strides, seqlen_k, the device,
    causal, deterministic, a window, softcap on, head_dim_v, and of a varlen call its sequences, longest lengths,
    zero_tail) get prepared launches of their own, each launching what the unprepared construction launches, in a
    first round that prepares and a second that hits the cache (one entry per call); calls differing only in what
    each call gives (addresses, scale, softcap's value, stream) share an entry."""
    order = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")
    base = dict(b=2, sq=100, sk=150, h=4, hk=2, d=64, dv=64, causal=False)
    vbase = dict(lens=([5, 70, 33], [9, 60, 40]), h=4, hk=2, d=64, dv=64, causal=False)

    def padded(t, width=128):  # the same shape, rows of ``width`` elements (TMA reads it in place)
        b, s, h, _ = t.shape
        return t._replace(strides=(s * h * width, h * width, width, 1))

    calls = [(base, {}, {})] + [(base, {}, {name: padded}) for name in order if name != "lse"] + [
        (dict(base, sk=151), {}, {}), (base, {}, {name: (lambda t: t._replace(device=1)) for name in order}),
        (dict(base, causal=True), {}, {}), (base, {"deterministic": True}, {}),
        (base, {"window_size": (16, 8)}, {}), (base, {"softcap": 5.0}, {}), (dict(base, dv=128), {}, {}),
        (vbase, {}, {}), (dict(vbase, lens=([5, 70, 33, 0], [9, 60, 40, 0])), {}, {}),  # (the same totals)
        (dict(vbase, max_seqlen=(80, 60)), {}, {}), (dict(vbase, max_seqlen=(70, 64)), {}, {}),
        (dict(vbase, zero_tail=True), {}, {})]
    for rnd in range(2):
        for i, (case, kw, change) in enumerate(calls):
            args, vl = _bwd_case_args(case, (rnd * 64 + i) << 32)
            args = {n: change.get(n, lambda t: t)(a) for n, a in args.items()}
            det, window, cap = kw.get("deterministic", False), kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0)
            _unprepared_backward(*(args[n] for n in order), 0.1 + rnd, case["causal"], det, 5 + i, 0xA00000, window,
                                 cap * (1 + rnd), vl)
            want = bwd_core_all.launches[-3:]
            core.attention_backward(*(args[n] for n in order), 0.1 + rnd, case["causal"], det, 5 + i, 0xA00000,
                                    window_size=window, softcap=cap * (1 + rnd), varlen=vl)
            for ref, new in zip(want, bwd_core_all.launches[-3:]):
                assert all(ref[f] == new[f] for f in ("role", "variant", "grid", "maps", "packed", "stream")), i
        assert len(core._prepared_backwards) == len(calls), rnd


def test_prepared_backward_refuses_a_misaligned_address_as_before(bwd_core):
    """On a cached key, launch_backward refuses an address TMA cannot use (not 16-byte aligned) with the message the
    uncached checks give, naming the array, a workspace_ptr not 256-byte aligned and a bad softmax_scale / softcap,
    before any launch; a key whose first call raised is not cached."""
    args, _ = _bwd_case_args(_PREPARED_CASES["hd64_causal_gqa"], 0)
    order = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")

    def call(**change):
        a = {n: args[n]._replace(ptr=args[n].ptr + change.get(n, 0)) for n in order}
        scale = change.get("scale", 0.1)
        return core.attention_backward(*(a[n] for n in order), scale, True, False, 77,
                                       0xA00000 + change.get("workspace", 0), softcap=change.get("softcap", 0.0))

    for name in ("dout", "q", "k", "v", "out", "dq", "dk", "dv"):
        core._prepared_backwards.clear()
        n = len(bwd_core.launches)
        with pytest.raises(ValueError) as fresh:  # a new key: prepare's checks
            call(**{name: 8})
        assert core._prepared_backwards == {} and len(bwd_core.launches) == n
        call()
        n = len(bwd_core.launches)
        with pytest.raises(ValueError) as cached:  # the key is cached: launch_backward's check, the same words
            call(**{name: 8})
        ptr = args[name].ptr + 8
        assert str(cached.value) == str(fresh.value) == \
            f"flashgen: TMA cannot address {name}: its base address 0x{ptr:x} is not 16-byte aligned"
        assert len(bwd_core.launches) == n and len(core._prepared_backwards) == 1
    for off in (16, 128):  # the workspace's regions need 256-byte alignment (core._bwd_workspace)
        with pytest.raises(ValueError, match=f"workspace_ptr must be 256-byte aligned, got {0xA00000 + off:#x}"):
            call(workspace=off)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        call(scale=float("nan"))
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        call(softcap=-1.0)
    assert len(bwd_core.launches) == n


def test_eager_backward_takes_the_prepared_launch_and_copies_what_tma_cannot_read(gpu):
    """flash_attn_func's eager backward (interface._bwd_impl) launches through core.prepare_backward /
    launch_backward when dout, q, k, v, out are read in place: prepared once per key, each step at its own
    addresses. An input TMA cannot read in place (the stride-0 dout of ``out.sum()``: its layout, another key; a q
    view 2 bytes off alignment: its address, on the cached key) takes the copy path (core.attention_backward on
    aligned copies), with the same gradients."""
    q, k, v = (torch.randn(2, 37, 4, 64).half() for _ in range(3))
    k, v = k[:, :, ::2].contiguous(), v[:, :, ::2].contiguous()  # GQA 4 / 2

    def grads(q, loss):
        leaves = [t.clone().requires_grad_(True) for t in (k, v)]
        qq = q.detach().requires_grad_(True)
        out = flash_attn_func(qq, *leaves, causal=True)
        loss(out).backward()
        return qq.grad, leaves[0].grad, leaves[1].grad, qq

    ones = lambda out: (out * torch.ones_like(out)).sum()  # noqa: E731  (a dense dout of ones)
    first = grads(q, ones)
    assert len(gpu.prepared) == 1 and len(gpu.prepared_launches) == 1 and len(gpu.calls) == 1
    second = grads(q, ones)
    assert len(gpu.prepared) == 1 and len(gpu.prepared_launches) == 2  # a cache hit: no second prepare
    assert gpu.prepared_launches[1][1] == second[3].data_ptr() and gpu.calls[-1]["q"].ptr == second[3].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(first[:3], second[:3]))
    for got, ref in zip(second[:3], reference_grads(q, k, v, torch.ones(2, 37, 4, 64), 0.125, True)):
        assert_close(got, ref)
    summed = grads(q, lambda out: out.sum())  # dout = ones expanded (stride 0): copied, another key
    assert len(gpu.prepared_launches) == 2 and len(gpu.calls) == 3
    assert gpu.calls[-1]["dout"].strides == (37 * 4 * 64, 4 * 64, 64, 1)
    assert all(torch.equal(a, b) for a, b in zip(first[:3], summed[:3]))
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_mis = flat[1:].view(q.shape)  # q's shape and strides, base 2 bytes off alignment
    q_mis.copy_(q)
    assert q_mis.stride() == q.stride() and q_mis.data_ptr() % 16
    n = len(interface._bwd_calls)
    mis = grads(q_mis, ones)  # the cached key (same metadata), a misaligned address: copied
    assert len(interface._bwd_calls) == n and len(gpu.prepared) == 1 and len(gpu.prepared_launches) == 2
    assert gpu.calls[-1]["q"].ptr != q_mis.data_ptr() and gpu.calls[-1]["q"].ptr % 16 == 0
    assert all(torch.equal(a, b) for a, b in zip(first[:3], mis[:3]))


def test_eager_gradients_run_the_ops_code_without_the_dispatcher(gpu):
    """Eagerly, flash_attn_func with gradients runs interface._FwdFn (the fwd op's implementation and autograd formula,
    and _bwd_impl, without the custom-op dispatcher's host time); torch.compile runs the ops. Both give the same out
    and gradients, and one launch of each backward kernel set."""
    import flashgen.interface as interface

    q, k, v = (torch.randn(2, 37, 4, 64).half() for _ in range(3))
    k2, v2 = k[:, :, ::2].contiguous(), v[:, :, ::2].contiguous()  # GQA 4 / 2

    def step(q, k, v):
        return interface.flash_attn_func(q, k, v, causal=True, deterministic=True).float().square().sum()

    got = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_(True) for t in (q, k2, v2)]
        loss = fn(*leaves)
        loss.backward()
        got.append((loss.detach(), *(t.grad for t in leaves)))
    eager_out = interface.flash_attn_func(*(t.clone().requires_grad_(True) for t in (q, k2, v2)), causal=True)
    assert type(eager_out.grad_fn).__name__ == "_FwdFnBackward"
    assert len(gpu.calls) == 2
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_backward_checks_are_kept_per_metadata_key(gpu, monkeypatch):
    """The backward op checks its six arrays, window and softcap once per metadata key (interface._bwd_calls): a
    training loop's second step runs no check, other metadata is checked, and a call that fails is checked (and
    fails) every time, since failures are not kept. The fake implementation checks every call."""
    import flashgen.interface as interface

    checks = []
    real = interface._check_backward
    monkeypatch.setattr(interface, "_check_backward", lambda *a: checks.append(a[6:]) or real(*a))
    interface._bwd_calls.clear()
    q, k, v = (torch.randn(2, 37, 4, 64).half().requires_grad_(True) for _ in range(3))

    def step(causal=True):
        interface.flash_attn_func(q, k, v, causal=causal).float().square().sum().backward()

    step()
    step()
    assert len(checks) == 1 and len(gpu.calls) == 2  # two steps' kernels, one check
    q2 = torch.randn(2, 41, 4, 64).half().requires_grad_(True)  # another seqlen_q: checked
    interface.flash_attn_func(q2, k, v, causal=True).float().sum().backward()
    assert len(checks) == 2
    out, lse = interface.flash_attn_func(q, k, v, return_attn_probs=True)
    for _ in range(2):  # a softcap the check refuses: refused (and checked) each time
        with pytest.raises(ValueError, match="softcap"):
            interface._bwd_impl(torch.ones_like(out), q, k, v, out, lse, 0.125, False, False, -1, -1, -1.0)
    assert len(checks) == 4


def test_eager_backward_makes_no_zero_gradient_for_lse(gpu):
    """The eager training path (interface._FwdFn) tells autograd not to materialise the gradients it ignores: no
    zero tensor of lse's shape is made in the backward (a GPU allocation and fill kernel a step), unless the loss
    leaves out out, where out's zeros are made as before (test_grad_lse_is_ignored_as_in_fa3)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("zeros_like", "zeros", "zero_", "fill_", "new_zeros", "full_like"):
                self.made.append((func.__name__, tuple(getattr(result, "shape", ()))))
            return result

    q, k, v = grad_qkv()
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    with Ops() as ops:
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    assert all(g is not None and g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    assert not [m for m in ops.made if m[1] == tuple(lse.shape)], ops.made
    with Ops() as ops:  # the check above can see the engine's zeros: the lse-only loss makes out's
        torch.autograd.grad(lse.sum(), (q, k, v))
    assert (("zeros_like.default", tuple(out.shape)) in ops.made), ops.made
