"""CPU tests of flashgen's user-facing forward API (flashgen.interface, flashgen.dlpack_api,
flashgen._validate): argument checks, copy/no-copy decisions, empty problems, the fake
(meta) implementation, torch.compile tracing and when autograd records the op. The backward
(torch autograd and the DLPack entry) is tested in tests/test_bwd_api.py.

No GPU here. The `fake_gpu` fixture makes CPU tensors pass the device checks and replaces
the core's launch with an emulator that reads and writes memory through the TensorArg it
is given (host address + shape + strides; for the eager fast path's prepared launch, the
metadata given to core.prepare_forward at the addresses given to core.launch_forward),
computing the attention on the CPU. So a wrong pointer or stride handed to the core gives a
wrong result here, as it would on the GPU.
"""

from __future__ import annotations

import ctypes
import functools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flashgen.combine as combine
import flashgen.core as core
import flashgen.dispatch as dispatch
import flashgen.dlpack_api as dlpack_api
import flashgen.interface as interface
import flashgen.kvcache as kvcache
from flashgen import _validate as V
from flashgen.interface import flash_attn_func
from flashgen.manifest import Manifest, Variant

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import torch_allocates_on_cpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from _ref import dequantize_fp8  # noqa: E402  (torch only: runs on the CPU)

_TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8_e4m3": torch.float8_e4m3fn}


# --------------------------------------------------------------------------------------
# Reference and emulated core
# --------------------------------------------------------------------------------------

def mask(sq, sk, causal=False, window_size=(-1, -1)):
    """Boolean (sq, sk) mask, True where query row i may see key j: FA3's rule, bottom-right
    aligned, i + sk - sq - left <= j <= i + sk - sq + right (-1 / None unbounded; causal: right 0).
    Written out here, independently of flashgen.core.mask_spec."""
    left, right = (-1 if x is None else x for x in window_size)
    if causal:
        right = 0
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + sk - sq - left
    if right >= 0:
        ok &= j <= i + sk - sq + right
    return ok


def reference(q, k, v, scale, causal, window_size=(-1, -1), softcap=0.0, sink=None, keys=None):
    """float32 attention (float64 for float64 inputs), bottom-right aligned causal / window,
    FA3's softcap, gpt-oss's learnable sink; returns (out, lse (b,h,sq)). Differentiable in
    q, k, v and sink. Rows that see no key: out 0, lse -inf (or the sink). ``keys`` = (k0, k1): the
    attention over those keys alone (the masks still of the whole sequence): a split-KV partial."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    ft = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(ft).transpose(1, 2)  # b h sq d
    kf = k.to(ft).repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.to(ft).repeat_interleave(g, dim=2).transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask(sq, sk, causal, window_size), -math.inf)
    if keys is not None:
        outside = (torch.arange(sk) < keys[0]) | (torch.arange(sk) >= keys[1])
        s = s.masked_fill(outside.to(s.device), -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.to(ft).view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :sk]
    return (p @ vf).transpose(1, 2), lse


def _view(arg) -> torch.Tensor:
    """A CPU tensor over the memory a TensorArg describes (host address, strides)."""
    es = V.ELEMENT_SIZE[arg.dtype]
    span = 1 + sum((n - 1) * s for n, s in zip(arg.shape, arg.strides))
    buf = (ctypes.c_char * (span * es)).from_address(arg.ptr)
    flat = torch.frombuffer(buf, dtype=torch.uint8).view(_TORCH[arg.dtype])
    return flat.as_strided(arg.shape, arg.strides)


class FakeCore:
    """Records calls; computes the forward on the CPU through the TensorArgs' memory."""

    def __init__(self):
        self.calls = []
        self.selected = []
        self.served = []  # pack_gqa_served's arguments (flash_attn_func's pack_gqa=True hint)
        self.preps = []  # interface._varlen_prep_launch's calls: (seqlens, fill or None)
        self.kvcache_preps = []  # kvcache._kvcache_prep_launch's calls: (lens, seqlen_const, rows, pads, page_table, n)
        self.kvcache_ropes = []  # and whether each rotated (a rope given)

    def varlen_prep_launch(self, seqlens, batch, total_q, total_k, max_seqlen_q, max_seqlen_k, fill, device):
        """As interface._varlen_prep_launch: recorded, then the kernel emulated (:func:`fake_varlen_prep`)."""
        self.preps.append((seqlens, fill))
        fake_varlen_prep(seqlens, batch, total_q, total_k, max_seqlen_q, max_seqlen_k, fill)

    def kvcache_prep_launch(self, lens, seqlen_const, rows, pads, page_table, total, k, v, k_cache, v_cache,
                            capacity, device, rope=None):
        """As kvcache._kvcache_prep_launch: recorded, then the kernel emulated (:func:`fake_kvcache_prep`)."""
        self.kvcache_preps.append((lens, seqlen_const, rows, pads, page_table, 0 if k is None else k.shape[1]))
        self.kvcache_ropes.append(rope is not None)
        fake_kvcache_prep(lens, seqlen_const, rows, pads, page_table, total, k, v, k_cache, v_cache, capacity, rope)

    def prepare_combine(self, out_partial, lse_partial, out, lse, out_dtype):
        """As combine.prepare_combine: metadata only (addresses 0)."""
        args = (out_partial, lse_partial, out, lse)
        assert all(isinstance(t, core.TensorArg) and t.ptr == 0 for t in args) and out.dtype == out_dtype
        return args

    def launch_combine(self, prep, out_partial, lse_partial, out, lse, stream):
        """As combine.launch_combine: the prepared metadata at these addresses, merged as :func:`_fake_combine_launch`
        (recorded in ``calls`` as a ``combine`` entry)."""
        op, lp, o, l = (t._replace(ptr=ptr) for t, ptr in zip(prep, (out_partial, lse_partial, out, lse)))
        self.calls.append(dict(combine=(op, lp, o, l), stream=stream))
        _fake_combine_launch(_view(op), _view(lp), _view(o), _view(l), None)

    def pack_gqa_served(self, dtype, head_dim, head_dim_v, causal, window_size, seqlen_q, seqlen_k, softcap, heads,
                        heads_k, device):
        """As core.pack_gqa_served, with PackGQA variants for every 16-bit key without softcap."""
        self.served.append((dtype, heads, heads_k, softcap))
        return heads > heads_k and dtype != "fp8_e4m3" and not softcap > 0

    def select_variant(self, family, key, manifest=None, round_up=()):
        self.selected.append((family, dict(key)))
        return Variant(name=f"fake_{key.get('dtype', family)}_{key.get('head_dim')}", family=family,
                       params={"dtype": key.get("dtype")}, dispatch=dict(key), kernels=())

    def attention_forward(self, q, k, v, out, lse, softmax_scale, causal, stream, variant=None, *,
                          window_size=(-1, -1), softcap=0.0, sink=0, q_descale=None, k_descale=None,
                          v_descale=None, pack_gqa=None, varlen=None):
        if varlen is not None:
            return self._varlen_forward(q, k, v, out, lse, softmax_scale, causal, window_size, softcap, sink, varlen,
                                        pack_gqa)
        if variant is None:  # as the real core: select (MissingVariantError) before any launch
            m = core.mask_spec(causal, window_size, q.shape[1], k.shape[1])
            variant = core.select_variant(
                "fwd", {"dtype": core._VARIANT_DTYPE.get(q.dtype, q.dtype), "head_dim": q.shape[3], "head_dim_v": v.shape[3], "causal": m.causal,
                        "local": m.local,
                        "softcap": softcap > 0})
        for a in (q, k, v, out):
            assert isinstance(a, core.TensorArg)
            assert V.tma_layout_problem(a.shape, a.strides, V.ELEMENT_SIZE[a.dtype], a.ptr) is None
        assert lse is None or lse.dtype == "fp32" and V.is_c_contiguous(lse.shape, lse.strides)
        assert type(window_size) is tuple and all(type(x) is int for x in window_size)
        assert type(softcap) is float and type(sink) is int
        heads = q.shape[2]
        sink_t = None if sink == 0 else _view(core.TensorArg(sink, (heads,), (1,), "fp32", q.device)).clone()
        descales = {n: None if t is None else _view(t).clone()
                    for n, t in (("q", q_descale), ("k", k_descale), ("v", v_descale))}
        self.calls.append(dict(q=q, k=k, v=v, out=out, lse=lse, scale=softmax_scale, causal=causal, stream=stream,
                               variant=variant, window_size=window_size, softcap=softcap, sink=sink,
                               sink_values=sink_t, descales=descales, pack_gqa=pack_gqa))
        qv, kv, vv = _view(q), _view(k), _view(v)
        if q.dtype == "fp8_e4m3":  # emulated: dequantized in float32
            qv, kv, vv = (dequantize_fp8(x, descales[n]) for x, n in ((qv, "q"), (kv, "k"), (vv, "v")))
        o, l = reference(qv, kv, vv, softmax_scale, causal, window_size, softcap, sink_t)
        _view(out).copy_(o)
        if lse is not None:  # (the prepared launch's null lse: none written)
            _view(lse).copy_(l)
        return variant

    def _varlen_forward(self, q, k, v, out, lse, scale, causal, window_size, softcap, sink, varlen, pack_gqa=None):
        """The varlen kernel (core.Varlen, mask.cuh SeqRange) emulated: each sequence's rows of q and
        k / v (at their cu_seqlens offsets, or row b of a padded batch; seqused_* rows of them) attend
        as one call, written to the same rows of out and lse; rows of no sequence are left as they were.
        Split-KV (num_splits > 1; out and lse then split 0's fp32 partials, split s at s x the split strides): split
        s gets the s-th share of ceil(blocks / splits) blocks of 128 keys (the kernel's split_blocks over the whole
        key range; the kernel's range is the mask's, an equally valid partition), the sink in split 0 only."""
        m = core.mask_spec(causal, window_size, varlen.max_seqlen_q, varlen.max_seqlen_k)
        # the core's PackGQA choice (a padded q, by the rule at block_m 128), which changes the variant only
        pack = (pack_gqa is not False and not varlen.cu_seqlens_q
                and (pack_gqa or core.pack_gqa_rule(varlen.max_seqlen_q, q.shape[-2], k.shape[-2], 128)))
        variant = core.select_variant(
            "fwd", {"dtype": q.dtype, "head_dim": q.shape[-1], "head_dim_v": v.shape[-1], "causal": m.causal,
                    "local": m.local, "softcap": softcap > 0, "pack_gqa": pack, "varlen": True})
        assert (len(q.shape) == 3) == bool(varlen.cu_seqlens_q) and (len(k.shape) == 3) == bool(varlen.cu_seqlens_k)
        assert len(out.shape) == len(q.shape) and lse is not None and V.is_c_contiguous(lse.shape, lse.strides)
        core._varlen_operands(q, k, v, out, varlen, (None, None, None), pack_gqa)  # the real core's checks
        self.calls.append(dict(q=q, k=k, v=v, out=out, lse=lse, scale=scale, causal=causal, variant=variant,
                               window_size=window_size, softcap=softcap, sink=sink, varlen=varlen))

        def ints(ptr, n):
            return list((ctypes.c_int32 * n).from_address(ptr)) if ptr else None

        n = varlen.batch
        cu_q, cu_k = ints(varlen.cu_seqlens_q, n + 1), ints(varlen.cu_seqlens_k, n + 1)
        used_q, used_k = ints(varlen.seqused_q, n), ints(varlen.seqused_k, n)
        rows, pads = ints(varlen.kv_batch_idx, n), ints(varlen.leftpad_k, n)  # a KV cache's
        table = ints(varlen.page_table, n * varlen.page_table_stride)
        qv, kv, vv = _view(q), _view(k), _view(v)
        heads = q.shape[-2]
        sink_t = None if sink == 0 else _view(core.TensorArg(sink, (heads,), (1,), "fp32", q.device)).clone()
        for b in range(n):
            oq, ok = (cu_q[b] if cu_q else 0), (cu_k[b] if cu_k else 0)
            lq = used_q[b] if used_q else cu_q[b + 1] - cu_q[b] if cu_q else q.shape[1]
            lk = used_k[b] if used_k else cu_k[b + 1] - cu_k[b] if cu_k else k.shape[1]
            pad = pads[b] if pads else 0  # (seqused_k counts the left padding's rows too)
            assert lq <= varlen.max_seqlen_q and lk - pad <= varlen.max_seqlen_k  # the grid and window bounds
            qb = qv[oq:oq + lq] if cu_q else qv[b, :lq]
            if table:  # entry b's pages, in order, as one padded row
                stride = varlen.page_table_stride
                pages = torch.tensor(table[b * stride:(b + 1) * stride][:-(-lk // varlen.page_size)])
                kb, vb = kv[pages].flatten(0, 1)[:lk], vv[pages].flatten(0, 1)[:lk]
            elif cu_k:
                kb, vb = kv[ok:ok + lk], vv[ok:ok + lk]
            else:
                r = rows[b] if rows else b
                kb, vb = kv[r, pad:lk], vv[r, pad:lk]
            splits = varlen.num_splits
            per = -(-(-(-kb.shape[0] // 128)) // splits) * 128  # keys per split
            for sp in range(splits):
                ovs = _view(out._replace(ptr=out.ptr + sp * varlen.o_stride_split * V.ELEMENT_SIZE[out.dtype]))
                lvs = _view(lse._replace(ptr=lse.ptr + sp * varlen.lse_stride_split * 4))
                o, l = reference(qb[None], kb[None], vb[None], scale, causal, window_size, softcap,
                                 sink_t if sp == 0 else None, keys=None if splits == 1 else (sp * per, (sp + 1) * per))
                if cu_q:
                    ovs[oq:oq + lq] = o[0]
                    lvs[:, oq:oq + lq] = l[0]
                else:
                    ovs[b, :lq] = o[0]
                    lvs[b, :, :lq] = l[0]
        return variant

    def prepare_forward(self, q, k, v, out, causal, variant=None, *, window_size=(-1, -1), softcap=0.0,
                        softmax_scale=None, q_descale=None, k_descale=None, v_descale=None, pack_gqa=None,
                        varlen=None):
        """As core.prepare_forward: metadata only (addresses 0), the variant selected here (a ``varlen`` call's
        when it launches: :meth:`_varlen_forward`)."""
        for a in (q, k, v, out, q_descale, k_descale, v_descale):
            assert a is None or (isinstance(a, core.TensorArg) and a.ptr == 0)
        if varlen is not None:
            assert not any(varlen.addresses())  # (the arrays' addresses come with each launch)
            return dict(q=q, k=k, v=v, out=out, causal=causal, variant=None, window_size=window_size,
                        descales=(q_descale, k_descale, v_descale), pack_gqa=pack_gqa, varlen=varlen)
        if variant is None:
            m = core.mask_spec(causal, window_size, q.shape[1], k.shape[1])
            variant = core.select_variant(
                "fwd", {"dtype": core._VARIANT_DTYPE.get(q.dtype, q.dtype), "head_dim": q.shape[3],
                        "head_dim_v": v.shape[3], "causal": m.causal, "local": m.local, "softcap": softcap > 0})
        return dict(q=q, k=k, v=v, out=out, causal=causal, variant=variant, window_size=window_size,
                    descales=(q_descale, k_descale, v_descale), pack_gqa=pack_gqa)

    def launch_forward(self, prep, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, softmax_scale, softcap, stream, sink=0,
                       q_descale=0, k_descale=0, v_descale=0, varlen=()):
        """As core.launch_forward: the prepared metadata at these addresses, emulated by attention_forward
        (lse: the contiguous (batch, heads, seqlen_q) the kernel writes; lse_ptr 0: none written; a varlen
        prep's: its arrays at the ``varlen`` addresses)."""
        q = prep["q"]
        if prep.get("varlen") is not None:
            vl = prep["varlen"]
            assert len(varlen) == len(core._VARLEN_PER_CALL) and not any(prep["descales"])
            b, sq, h = q.shape[0], q.shape[1], q.shape[2]
            lse = core.TensorArg(lse_ptr, (b, h, sq), (h * sq, sq, 1), "fp32", q.device)
            return self.attention_forward(q._replace(ptr=q_ptr), prep["k"]._replace(ptr=k_ptr),
                                          prep["v"]._replace(ptr=v_ptr), prep["out"]._replace(ptr=out_ptr), lse,
                                          softmax_scale, prep["causal"], stream, window_size=prep["window_size"],
                                          softcap=softcap, sink=sink, pack_gqa=prep["pack_gqa"],
                                          varlen=vl._replace(**dict(zip(core._VARLEN_PER_CALL, varlen))))
        b, sq, h = q.shape[0], q.shape[1], q.shape[2]
        lse = None if lse_ptr == 0 else core.TensorArg(lse_ptr, (b, h, sq), (h * sq, sq, 1), "fp32", q.device)
        descales = [None if t is None else t._replace(ptr=ptr) for t, ptr in zip(prep["descales"],
                                                                               (q_descale, k_descale, v_descale))]
        assert all((t is None) == (ptr == 0) for t, ptr in zip(prep["descales"], (q_descale, k_descale, v_descale)))
        return self.attention_forward(q._replace(ptr=q_ptr), prep["k"]._replace(ptr=k_ptr), prep["v"]._replace(ptr=v_ptr),
                                      prep["out"]._replace(ptr=out_ptr), lse, softmax_scale, prep["causal"], stream,
                                      prep["variant"], window_size=prep["window_size"], softcap=softcap, sink=sink,
                                      q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                                      pack_gqa=prep["pack_gqa"])


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors count as CUDA device 0 of capability 9.0; the core is emulated (its generic entry
    attention_forward and the prepared launch, prepare_forward + launch_forward, of the eager fast
    path), and flash_attn_func's cache of prepared calls starts empty. The varlen kernel is switched off
    (core.VARLEN_KERNEL): varlen and kvcache calls take the composed path unless a test switches it on
    (test_varlen_kernel_api.py's kernel_on), and eager varlen / kvcache calls read their offsets and lengths on the
    host (core.VARLEN_NO_HOST_READ off, whatever the default) unless a test switches that on."""
    fc = FakeCore()
    monkeypatch.setattr(core, "VARLEN_KERNEL", False)
    monkeypatch.setattr(core, "VARLEN_NO_HOST_READ", False)
    monkeypatch.setattr(core, "_built", set())
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 0))
    monkeypatch.setattr(interface, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(interface, "_fwd_calls", {})
    monkeypatch.setattr(interface, "_varlen_problems", {})
    monkeypatch.setattr(interface, "_varlen_calls", {})
    monkeypatch.setattr(kvcache, "_prep_launches", {})
    monkeypatch.setattr(kvcache, "_step_facts", {})
    monkeypatch.setattr(core, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(core, "select_variant", fc.select_variant)
    monkeypatch.setattr(core, "attention_forward", fc.attention_forward)
    monkeypatch.setattr(core, "prepare_forward", fc.prepare_forward)
    monkeypatch.setattr(core, "launch_forward", fc.launch_forward)
    monkeypatch.setattr(core, "pack_gqa_served", fc.pack_gqa_served)
    monkeypatch.setattr(interface, "_combine_launch", _fake_combine_launch)
    monkeypatch.setattr(combine, "prepare_combine", fc.prepare_combine)
    monkeypatch.setattr(combine, "launch_combine", fc.launch_combine)
    monkeypatch.setattr(interface, "_varlen_prep_launch", fc.varlen_prep_launch)
    monkeypatch.setattr(kvcache, "_kvcache_prep_launch", fc.kvcache_prep_launch)
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)  # (an H100 SXM's: split-KV's heuristic)
    monkeypatch.setattr(core.launch, "dram_bandwidth", lambda device: 3.35e6)  # (its HBM3's peak, bytes per us)
    return fc


def fake_varlen_prep(seqlens, batch, total_q, total_k, max_seqlen_q, max_seqlen_k, fill) -> None:
    """The varlen_prep kernel emulated (templates/varlen_prep.cu.j2): FA3's varlen contract checked in the kernel's
    order, a broken rule a RuntimeError with the kernel's assert message (as torch._assert_async raises on the CPU);
    with ``fill`` = (out, lse) the rows of no sequence's used rows set to 0 / -inf (computed as the union of each
    sequence's used rows, not as the kernel searches)."""
    from flashgen.generator.families.varlen_prep import contract_messages

    messages = contract_messages()
    # (through numpy, as the kernel reads device memory: tests that forbid host reads patch Tensor.tolist / item)
    cu_q, cu_k, used_q, used_k = (None if t is None else t.numpy().tolist() for t in seqlens)
    assert len(cu_q) == len(cu_k) == batch + 1
    for side, (cu, used, total, longest) in enumerate(((cu_q, used_q, total_q, max_seqlen_q),
                                                       (cu_k, used_k, total_k, max_seqlen_k))):
        lens = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or min(lens) < 0 or cu[-1] > total:
            raise RuntimeError(messages[3 * side])
        if used is not None:
            if not all(0 <= u <= n for u, n in zip(used, lens)):
                raise RuntimeError(messages[3 * side + 1])
            lens = used
        if max(lens) > longest:
            raise RuntimeError(messages[3 * side + 2])
    if fill is not None:
        out, lse = fill
        unused = torch.ones(total_q, dtype=torch.bool)
        for b in range(batch):
            unused[cu_q[b]:cu_q[b] + (cu_q[b + 1] - cu_q[b] if used_q is None else used_q[b])] = False
        out[unused] = 0
        lse[:, unused] = -math.inf


def fake_kvcache_prep(lens, seqlen_const, rows, pads, page_table, total, k, v, k_cache, v_cache, capacity,
                      rope=None) -> None:
    """The varlen_prep variant's kvcache kernel emulated (templates/varlen_prep.cu.j2): the cache arguments checked in
    the kernel's order (a broken one a RuntimeError with the kernel's assert message, kvcache_messages()), then the
    new rows copied to positions lens[b] + i of entry b's cache row or pages (rotated first with a ``rope``,
    kvcache._Rope, which also gets q rotated into rope.q_rot: kvcache.apply_rotary at the kernel's positions), and
    total = lens + n. Reads device memory through numpy, as the kernel does (tests that forbid host reads patch
    Tensor.tolist / item)."""
    from flashgen.kvcache import apply_rotary

    from flashgen.generator.families.varlen_prep import kvcache_messages

    messages = kvcache_messages()
    batch, n = total.shape[0], 0 if k is None else k.shape[1]
    host = lambda t: None if t is None else t.numpy().tolist()  # noqa: E731
    ls = host(lens) if lens is not None else [seqlen_const] * batch
    rs, ps, table = host(rows), host(pads), host(page_table)
    blocks, size = k_cache.shape[0], k_cache.shape[1]
    if not all(0 <= x <= capacity - n for x in ls):
        raise RuntimeError(messages[0])
    if rs is not None and (not all(0 <= r < blocks for r in rs) or (n and len(set(rs)) < batch)):
        raise RuntimeError(messages[1])
    if ps is not None and not all(0 <= p <= x + n for p, x in zip(ps, ls)):
        raise RuntimeError(messages[2])
    if table is not None and not all(0 <= table[b][g] < blocks for b in range(batch) for g in range(len(table[b]))
                                     if g * size < ls[b] + n):
        raise RuntimeError(messages[3])
    if rope is not None:
        starts = host(rope.starts) if rope.starts is not None else ls
        sq = rope.q.shape[1]
        if not all(0 <= x and x + max(n, sq if rope.each else 1) <= rope.cos.shape[0] for x in starts):
            raise RuntimeError(messages[4])
        start = torch.tensor(starts, dtype=torch.long)[:, None]
        steps = torch.arange(sq) if rope.each else torch.zeros(sq, dtype=torch.long)
        rope.q_rot.copy_(apply_rotary(rope.q, rope.cos, rope.sin, start + steps, rope.interleaved))
        if n:
            k = apply_rotary(k, rope.cos, rope.sin, start + torch.arange(n), rope.interleaved)
    for b in range(batch):
        for i in range(n):
            pos = ls[b] + i
            blk, slot = (table[b][pos // size], pos % size) if table is not None else (
                rs[b] if rs is not None else b, pos)
            k_cache[blk, slot] = k[b, i]
            v_cache[blk, slot] = v[b, i]
    total.copy_(torch.tensor([x + n for x in ls], dtype=torch.int32))


def _fake_combine_launch(out_partial, lse_partial, out, lse, problem) -> None:
    """The combine kernel emulated (flash_attn_combine's launch): the float64 merge of tests/gpu/_ref.py."""
    from _ref import combine_ref

    merged, merged_lse = combine_ref(out_partial, lse_partial)
    out.copy_(merged.to(out.dtype))
    lse.copy_(merged_lse.float())


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64, dv=None, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to(dtype)
    return q, k, v


def assert_close_to_reference(out, q, k, v, scale, causal, lse=None):
    ref, ref_lse = reference(q, k, v, scale, causal)
    # the emulator computes in fp32 and rounds once: one rounding of the output dtype
    tol = 2e-3 if out.dtype == torch.float16 else 1.6e-2
    assert (out.float() - ref).abs().max().item() <= tol
    if lse is not None:
        assert torch.allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# Working calls (emulated core)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_matches_reference(fake_gpu, causal, dtype):
    q, k, v = qkv(dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 5, 4, 64) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_close_to_reference(out, q, k, v, 64 ** -0.5, causal, lse)
    (call,) = fake_gpu.calls
    assert call["causal"] is causal and call["stream"] == 1234
    assert call["scale"] == pytest.approx(64 ** -0.5)
    assert fake_gpu.selected == [("fwd", {"dtype": "fp16" if dtype == torch.float16 else "bf16", "head_dim": 64,
                                          "head_dim_v": 64, "causal": causal, "local": False, "softcap": False})]
    assert call["window_size"] == (-1, -1) and call["softcap"] == 0.0 and call["sink"] == 0
    assert (call["q"].shape[1], call["k"].shape[1], call["v"].shape[1]) == (5, 7, 7)  # seqlen_q, seqlen_k
    assert call["variant"].name.startswith("fake_")


def test_returns_out_only_by_default_and_custom_scale(fake_gpu):
    q, k, v = qkv(h=2, hk=1, d=32)
    out = flash_attn_func(q, k, v, softmax_scale=0.3, deterministic=True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 2, 32)
    assert fake_gpu.calls[0]["scale"] == 0.3
    assert_close_to_reference(out, q, k, v, 0.3, False)


def test_head_dim_v_differs_reaches_the_variant_lookup(fake_gpu):
    q, k, v = qkv(d=128, dv=64)
    out = flash_attn_func(q, k, v)
    assert out.shape == (2, 5, 4, 64)
    family, key = fake_gpu.selected[0]
    assert family == "fwd" and (key["head_dim"], key["head_dim_v"]) == (128, 64)


def test_scheduling_hints_are_accepted(fake_gpu):
    q, k, v = qkv()
    a = flash_attn_func(q, k, v, num_splits=3, pack_gqa=True, sm_margin=4)
    b = flash_attn_func(q, k, v)
    assert torch.equal(a, b)


def test_pack_gqa_hint_reaches_the_core(fake_gpu):
    """FA3's pack_gqa hint: None leaves the choice to the core's rule, False asks for the unpacked
    kernel, True for PackGQA where it can serve the call (GQA with a built PackGQA variant; else
    unpacked); each hint is its own cached call, in place and through copies, and anything but
    None/True/False is a TypeError."""
    q, k, v = qkv(b=2, sq=5, sk=9, h=8, hk=2, d=64)
    outs = []
    for hint, want in ((None, None), (False, False), (True, True)):
        outs.append(flash_attn_func(q, k, v, pack_gqa=hint))
        assert fake_gpu.calls[-1]["pack_gqa"] is want
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    flash_attn_func(q, k, v, pack_gqa=True, softcap=5.0)  # no PackGQA variant with softcap: unpacked
    assert fake_gpu.calls[-1]["pack_gqa"] is False
    flash_attn_func(q, k[:, :, :1].expand(2, 9, 8, 64), v[:, :, :1].expand(2, 9, 8, 64), pack_gqa=True)  # group 1
    assert fake_gpu.calls[-1]["pack_gqa"] is False
    q_odd = torch.zeros(2, 5, 8, 68, dtype=q.dtype)[..., :64]  # rows of 136 bytes: copied for TMA
    q_odd.copy_(q)
    assert torch.equal(flash_attn_func(q_odd, k, v, pack_gqa=True), outs[0])
    assert fake_gpu.calls[-1]["pack_gqa"] is True
    with pytest.raises(TypeError, match="pack_gqa must be None, True or False, got int"):
        flash_attn_func(q, k, v, pack_gqa=1)


def test_ops_entry_point_validates_too(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="heads"):
        torch.ops.flashgen.fwd(q, k[:, :, :1].expand(2, 7, 3, 64), v[:, :, :1].expand(2, 7, 3, 64), 0.1, False)


# --------------------------------------------------------------------------------------
# Real-model layouts: no copies
# --------------------------------------------------------------------------------------

def test_packed_qkv_slices_pass_without_copy(fake_gpu):
    b, s, h, d = 2, 9, 4, 64
    packed = torch.randn(b, s, 3, h, d).half()
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    assert not q.is_contiguous()
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    (call,) = fake_gpu.calls
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert call[name].ptr == t.data_ptr(), f"{name} was copied"
        assert call[name].strides == t.stride() == (s * 3 * h * d, 3 * h * d, d, 1)
    assert_close_to_reference(out, q, k, v, d ** -0.5, True, lse)


def test_kv_cache_prefix_passes_without_copy(fake_gpu):
    b, cap, sk, h, hk, d = 2, 64, 13, 4, 2, 64
    k_cache = torch.randn(b, cap, hk, d).half()
    v_cache = torch.randn(b, cap, hk, d).half()
    k, v = k_cache[:, :sk], v_cache[:, :sk]
    q = torch.randn(b, 3, h, d).half()
    out = flash_attn_func(q, k, v, causal=True)
    (call,) = fake_gpu.calls
    assert call["k"].ptr == k_cache.data_ptr() and call["v"].ptr == v_cache.data_ptr()
    assert call["k"].shape == (b, sk, hk, d) and call["k"].strides == k_cache.stride()
    assert call["q"].ptr == q.data_ptr()
    assert_close_to_reference(out, q, k, v, d ** -0.5, True)


def test_bhsd_transposed_passes_without_copy(fake_gpu):
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv())
    assert not q.is_contiguous() and q.stride(-1) == 1
    out = flash_attn_func(q, k, v)
    call = fake_gpu.calls[0]
    assert [call[n].ptr for n in "qkv"] == [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    assert_close_to_reference(out, q, k, v, 64 ** -0.5, False)


def test_extent_one_dim_with_odd_stride_is_not_copied(fake_gpu):
    b, h, d = 2, 4, 64
    base = torch.randn(b * h * d + 8).half()
    q = base.as_strided((b, 1, h, d), (h * d, 3, d, 1))  # stride 3 on the size-1 seqlen dim
    _, k, v = qkv(b=b, h=h, hk=h, d=d)
    out = flash_attn_func(q, k, v)
    call = fake_gpu.calls[0]
    assert call["q"].ptr == q.data_ptr()
    assert call["q"].strides == (h * d, h * d, d, 1)  # normalised for the size-1 dim only
    assert_close_to_reference(out, q, k, v, d ** -0.5, False)


# --------------------------------------------------------------------------------------
# Layouts TMA cannot address: copied (torch API)
# --------------------------------------------------------------------------------------

def _non_contiguous_last_dim():
    q, k, v = qkv(d=64)
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride of last dim = seqlen*... != 1
    assert q.stride(-1) != 1
    return q, k, v


def _misaligned_base():
    q, k, v = qkv(d=64)
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)
    q2 = flat[1:].view(q.shape)  # contiguous, base 2 bytes past an aligned address
    q2.copy_(q)
    return q2, k, v


def _unaligned_row_stride():
    q, k, v = qkv(d=64)
    wide = torch.zeros(*q.shape[:-1], 68, dtype=q.dtype)  # 68 * 2 bytes = 136, not a 16-multiple
    wide[..., :64] = q
    return wide[..., :64], k, v


def _broadcast_heads():
    q, k, v = qkv(h=4, hk=4)
    k = k[:, :, :1].expand(k.shape)  # stride 0 on heads
    v = v[:, :, :1].expand(v.shape)
    return q, k, v


@pytest.mark.parametrize("make,which", [
    (_non_contiguous_last_dim, "q"),
    (_misaligned_base, "q"),
    (_unaligned_row_stride, "q"),
    (_broadcast_heads, "k"),
])
def test_layouts_tma_cannot_address_are_copied(fake_gpu, make, which):
    q, k, v = make()
    t = {"q": q, "k": k, "v": v}[which]
    if make is _misaligned_base:
        assert t.data_ptr() % 16 != 0 and t.is_contiguous()
    out = flash_attn_func(q, k, v)
    arg = fake_gpu.calls[0][which]
    assert arg.ptr != t.data_ptr() and arg.ptr % 16 == 0
    assert arg.strides == tuple(torch.empty(t.shape).stride())
    assert_close_to_reference(out, q, k, v, q.shape[-1] ** -0.5, False)


# --------------------------------------------------------------------------------------
# Empty problems
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("b,sq", [(0, 5), (2, 0), (0, 0)])
def test_empty_output_launches_nothing(fake_gpu, b, sq):
    q, k, v = qkv(b=b, sq=sq)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (b, sq, 4, 64) and out.dtype == torch.float16
    assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32
    assert fake_gpu.calls == [] and fake_gpu.selected == []


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_k_zero_attends_to_nothing(fake_gpu, causal):
    q, k, v = qkv(sk=0, d=64, dv=32)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 5, 4, 32) and torch.equal(out, torch.zeros_like(out))
    assert lse.shape == (2, 4, 5) and bool((lse == -math.inf).all())
    assert fake_gpu.calls == []


# --------------------------------------------------------------------------------------
# Validation errors (each before any variant lookup or launch)
# --------------------------------------------------------------------------------------

def _raises(fake_gpu, exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        flash_attn_func(*args, **kwargs)
    assert fake_gpu.calls == [] and fake_gpu.selected == []


def test_cpu_tensors_rejected_without_patch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor.*cpu"):
        flash_attn_func(q, k, v)


def test_not_a_tensor(fake_gpu):
    q, k, v = qkv()
    _raises(fake_gpu, TypeError, "k must be a torch.Tensor", q, k.numpy(), v)


def test_one_tensor_not_cuda(fake_gpu, monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(interface, "_device_of", lambda t: (False, None) if t is v else (True, 0))
    _raises(fake_gpu, ValueError, "v must be a CUDA tensor", q, k, v)


def test_devices_differ(fake_gpu, monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1) if t is k else (True, 0))
    _raises(fake_gpu, ValueError, "same CUDA device", q, k, v)


def test_not_hopper(fake_gpu, monkeypatch):
    monkeypatch.setattr(core, "device_capability", lambda device: (8, 0))
    _raises(fake_gpu, RuntimeError, r"compute capability 9\.x.*8\.0", *qkv())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype(fake_gpu, dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    _raises(fake_gpu, TypeError, r"q must have dtype float16, bfloat16 or float8_e4m3fn", q, k, v)


def test_dtypes_differ(fake_gpu):
    q, k, v = qkv()
    _raises(fake_gpu, TypeError, r"same dtype.*k torch.bfloat16", q, k.bfloat16(), v)


@pytest.mark.parametrize("fp8", ["float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_other_fp8_formats_not_implemented(fake_gpu, fp8):
    """Only OCP e4m3fn is served: the fnuz formats have another exponent bias and NaN encoding,
    so reading them as e4m3fn would be silently wrong."""
    if not hasattr(torch, fp8):
        pytest.skip(f"torch has no {fp8}")
    q, k, v = (t.to(getattr(torch, fp8)) for t in qkv())
    _raises(fake_gpu, NotImplementedError, "only float8_e4m3fn is served among the fp8 dtypes", q, k, v)


# --------------------------------------------------------------------------------------
# FP8 (e4m3): descales, output dtype, what is refused
# --------------------------------------------------------------------------------------

def _e4m3(*ts):
    return [t.to(torch.float8_e4m3fn) for t in ts]


@pytest.mark.parametrize("form", ["none", "head", "block"])
def test_fp8_forward_with_descales(fake_gpu, form):
    q, k, v = _e4m3(*qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64))
    ds = {"none": (None, None, None),
          "head": (torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5),
          "block": (torch.rand(2, 4, 2) + 0.5, torch.rand(2, 2, 3) + 0.5, torch.rand(2, 2) + 0.5)}[form]
    out, lse = flash_attn_func(q, k, v, causal=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                               return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 70, 4, 64)
    call = fake_gpu.calls[-1]
    assert call["out"].dtype == "bf16" and call["q"].dtype == "fp8_e4m3"
    assert fake_gpu.selected[-1][1]["dtype"] == "e4m3"
    deq = [dequantize_fp8(x, d) for x, d in zip((q, k, v), ds)]
    o_ref, l_ref = reference(*deq, 64 ** -0.5, True)
    torch.testing.assert_close(out.float(), o_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-4)
    if form == "none":  # a descale of 1 is the same as none
        ones = torch.ones(2, 2)
        out1 = flash_attn_func(q, k, v, causal=True, q_descale=ones, k_descale=ones, v_descale=ones)
        assert torch.equal(out1, out)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(q_descale=torch.ones(2, 4)), ValueError, r"q_descale must have shape \(batch, heads_k\) = \(2, 2\) or "
                                                   r"\(batch, heads, ceil\(seqlen_q / 64\)\) = \(2, 4, 2\), got \(2, 4\)"),
    (dict(k_descale=torch.ones(2, 2, 2)), ValueError, r"k_descale must have shape .* = \(2, 2, 3\), got \(2, 2, 2\)"),
    (dict(v_descale=torch.ones(2, 4, 2)), ValueError, r"v_descale must have shape \(batch, heads_k\) = \(2, 2\)"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError, "v_descale must have dtype float32"),
    (dict(q_descale=[1.0]), TypeError, "q_descale must be None or a float32 torch.Tensor, got list"),
])
def test_fp8_argument_problems(fake_gpu, kwargs, exc, match):
    q, k, v = _e4m3(*qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64))
    _raises(fake_gpu, exc, match, q, k, v, **kwargs)


def test_fp8_window_softcap_and_sink_are_served(fake_gpu):
    """FP8 serves sliding windows, softcap and learnable_sink (fwd_fp8.yaml builds local and softcap
    variants): the call selects the e4m3 key with them instead of raising."""
    q, k, v = _e4m3(*qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64))
    flash_attn_func(q, k, v, window_size=(16, 0), softcap=10.0, learnable_sink=torch.zeros(4, device=q.device))
    family, key = fake_gpu.selected[-1]
    assert family == "fwd" and key["dtype"] == "e4m3" and key["local"] is True and key["softcap"] is True


def test_fp8_causal_spelled_as_a_window_is_served(fake_gpu):
    q, k, v = _e4m3(*qkv(b=1, sq=40, sk=50, h=2, hk=2, d=64))
    flash_attn_func(q, k, v, window_size=(-1, 0))  # = causal: no band
    assert fake_gpu.selected[-1][1]["causal"] is True and fake_gpu.selected[-1][1]["local"] is False


def test_descales_need_e4m3_inputs(fake_gpu):
    _raises(fake_gpu, ValueError, "q_descale scales float8_e4m3fn inputs only", *qkv(), q_descale=torch.ones(2, 2))


def test_fp8_needs_no_grad(fake_gpu):
    q, k, v = qkv()
    q8, k8, v8 = _e4m3(q, k, v)
    q8.requires_grad_(True)
    _raises(fake_gpu, NotImplementedError, "has no backward", q8, k8, v8)


@pytest.mark.parametrize("which,shape,match", [
    ("q", (2, 5, 256), r"q must be 4-D"),
    ("k", (2, 7, 2, 64, 1), r"k must be 4-D"),
    ("k", (3, 7, 2, 64), r"k has batch 3 but q has batch 2"),
    ("v", (1, 7, 2, 64), r"v has batch 1 but q has batch 2"),
    ("v", (2, 8, 2, 64), r"k and v must have the same seqlen_k"),
    ("v", (2, 7, 1, 64), r"k and v must have the same number of heads"),
    ("k", (2, 7, 2, 32), r"k must have q's head_dim 64"),
    ("v", (2, 7, 2, 20), r"head_dim_v .* multiple of 8 .*got 20"),
    ("v", (2, 7, 2, 520), r"head_dim_v .*up to 512 with float16 / bfloat16 inputs, got 520"),  # 264: two calls
])
def test_shape_errors(fake_gpu, which, shape, match):
    q, k, v = qkv()
    t = {"q": q, "k": k, "v": v}
    t[which] = torch.zeros(shape, dtype=torch.float16)
    _raises(fake_gpu, ValueError, match, t["q"], t["k"], t["v"])


@pytest.mark.parametrize("d,match", [(20, "got 20"), (264, "got 264"), (4, "got 4")])
def test_head_dim_errors(fake_gpu, d, match):
    q, k, v = qkv(d=d)
    _raises(fake_gpu, ValueError, r"head_dim \(dim 3 of q\).*" + match, q, k, v)


def test_heads_not_a_multiple_of_heads_k(fake_gpu):
    q, k, v = qkv(h=4, hk=3)
    _raises(fake_gpu, ValueError, r"heads of q \(4\) must be a multiple of heads_k of k/v \(3\)", q, k, v)


def test_zero_heads(fake_gpu):
    q, k, v = qkv(h=0, hk=0)
    _raises(fake_gpu, ValueError, "heads and heads_k must be >= 1", q, k, v)


@pytest.mark.parametrize("scale,exc", [
    (float("nan"), ValueError), (float("inf"), ValueError), (-math.inf, ValueError),
    ("0.125", TypeError), (True, TypeError), (torch.tensor(0.1), TypeError), (1j, TypeError),
])
def test_softmax_scale_errors(fake_gpu, scale, exc):
    _raises(fake_gpu, exc, "softmax_scale", *qkv(), softmax_scale=scale)


def test_softmax_scale_any_finite_real_accepted(fake_gpu):
    q, k, v = qkv()
    for s in (1, np.float32(0.25), 0.0, -0.5):
        out = flash_attn_func(q, k, v, softmax_scale=s)
        assert_close_to_reference(out, q, k, v, float(s), False)
    assert [c["scale"] for c in fake_gpu.calls] == [1.0, 0.25, 0.0, -0.5]
    assert all(type(c["scale"]) is float for c in fake_gpu.calls)


@pytest.mark.parametrize("kwargs,name", [
    (dict(qv=torch.ones(2, 5, 4, 64)), "qv"),
])
def test_unbuilt_features_not_implemented(fake_gpu, kwargs, name):
    _raises(fake_gpu, NotImplementedError, name, *qkv(), **kwargs)


def test_window_size_must_be_a_pair(fake_gpu):
    _raises(fake_gpu, TypeError, "window_size must be a pair", *qkv(), window_size=5)


def test_default_feature_values_accepted(fake_gpu):
    flash_attn_func(*qkv(), window_size=[-1, -1], softcap=0, q_descale=None)
    assert len(fake_gpu.calls) == 1


def test_extra_positional_arguments_rejected(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(TypeError):
        flash_attn_func(q, k, v, None, False, (-1, -1))


def test_missing_variant_error_propagates(fake_gpu, monkeypatch):
    empty = Manifest(path=Path("/nonexistent/manifest.json"), variants=())
    monkeypatch.setattr(core, "select_variant", functools.partial(dispatch.select_variant, manifest=empty))
    q, k, v = qkv(dtype=torch.bfloat16, d=128)
    with pytest.raises(core.MissingVariantError, match=r"flashgen add-variant fwd --dtype bf16 --head-dim 128.*--causal"):
        flash_attn_func(q, k, v, causal=True)
    assert fake_gpu.calls == []


# --------------------------------------------------------------------------------------
# Every problem in one error
# --------------------------------------------------------------------------------------

def assert_problems(err: BaseException, *fragments: str) -> list:
    """``err`` lists exactly len(fragments) problems, one line each after a
    ``"flashgen: N problems with the arguments:"`` head, each fragment in its own line."""
    head, *lines = str(err).split("\n")
    assert head == f"flashgen: {len(fragments)} problems with the arguments:", str(err)
    assert all(line.startswith("  - ") for line in lines), str(err)
    for fragment in fragments:
        assert sum(fragment in line for line in lines) == 1, (fragment, str(err))
    return lines


def _as_dlpack_message(torch_message: str) -> str:
    """A torch-API message with the DLPack entry's spellings of host memory and dtypes."""
    return torch_message.replace("on cpu", "on DLPack device type 1 (kDLCPU)").replace("torch.", "")


def test_every_problem_of_q_k_v_in_one_error_in_both_apis():
    q = torch.zeros(2, 5, 64)  # not CUDA, float32 and 3-D: three problems of q
    _, k, v = qkv()  # host memory too: one problem each (no fake_gpu here)
    with pytest.raises(V.InputError) as info:
        flash_attn_func(q, k, v)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, TypeError)
    assert_problems(err,
                    "q must be a CUDA tensor/array, got one on cpu",
                    "k must be a CUDA tensor/array, got one on cpu",
                    "v must be a CUDA tensor/array, got one on cpu",
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got torch.float32",
                    "q must be 4-D (batch, seqlen_q, heads, head_dim) (layout BSHD), got 3-D shape (2, 5, 64)")
    with pytest.raises(V.InputError) as dl:
        dlpack_api.flash_attn_forward(q.numpy(), k.numpy(), v.numpy())
    assert str(dl.value) == _as_dlpack_message(str(err))  # the same checks, the same message


def test_independent_problems_reported_dependent_checks_skipped(fake_gpu_dlpack):
    q = torch.zeros(2, 5, 4, 64)  # float32
    k = torch.zeros(2, 7, 3, 64, dtype=torch.float16)  # heads 4 not a multiple of heads_k 3
    v = torch.zeros(2, 8, 3, 20, dtype=torch.float16)  # seqlen_k 8 != k's 7; head_dim_v 20
    with pytest.raises(V.InputError) as info:
        flash_attn_func(q, k, v)
    assert_problems(info.value,
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got torch.float32",
                    "k and v must have the same seqlen_k (dim 1)",
                    "heads of q (4) must be a multiple of heads_k of k/v (3)",
                    "head_dim_v (dim 3 of v) must be a multiple of 8 between 8 and 256, got 20")
    assert "same dtype" not in str(info.value)  # needs every dtype supported: skipped
    with pytest.raises(V.InputError) as dl:
        dlpack_api.flash_attn_forward(q.numpy(), k.numpy(), v.numpy())
    assert str(dl.value) == _as_dlpack_message(str(info.value))
    assert fake_gpu_dlpack.calls == [] and fake_gpu_dlpack.selected == []


def test_rank_problem_skips_only_the_comparisons_with_that_array(fake_gpu):
    q = torch.zeros(2, 5, 64, dtype=torch.float16)  # 3-D: its batch/heads/head_dim cannot be compared
    k = torch.zeros(3, 7, 2, 64, dtype=torch.float16)
    v = torch.zeros(3, 7, 1, 20, dtype=torch.float16)  # heads 1 != k's 2; head_dim_v 20
    with pytest.raises(ValueError) as info:
        flash_attn_func(q, k, v)
    assert type(info.value) is ValueError  # several problems of one kind keep that kind
    assert_problems(info.value,
                    "q must be 4-D",
                    "k and v must have the same number of heads (dim 2)",
                    "head_dim_v (dim 3 of v) must be a multiple of 8 between 8 and 256, got 20")
    assert "has batch" not in str(info.value)
    assert fake_gpu.calls == []


def test_not_a_tensor_scale_and_features_join_the_list(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(V.InputError) as info:
        flash_attn_func(q.float(), k.numpy(), v, softmax_scale=float("nan"), softcap=-30.0, window_size=(1.5, 0))
    assert_problems(info.value,
                    "k must be a torch.Tensor, got ndarray",
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got torch.float32",
                    "softmax_scale must be a finite number, got nan",
                    "window_size[0] (left) must be an int >= -1 or None (-1 / None: unbounded), got float 1.5",
                    "softcap must be a finite number >= 0 (0 = off), got -30.0")
    assert fake_gpu.calls == [] and fake_gpu.selected == []


def test_not_implemented_alone_or_mixed(fake_gpu):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError) as info:  # only unsupported features: still NotImplementedError
        flash_attn_func(q, k, v, qv=q)
    assert type(info.value) is NotImplementedError
    assert str(info.value) == "flashgen: qv (absorbed MLA) is not supported yet; pass qv=None"
    fp8 = torch.float8_e5m2
    with pytest.raises(V.InputError) as info:  # unserved fp8 together with real errors: all of them
        flash_attn_func(q.to(fp8), k.to(fp8), torch.zeros(2, 7, 2, 20, dtype=torch.float16))
    assert_problems(info.value,
                    "q has dtype torch.float8_e5m2: only float8_e4m3fn is served among the fp8 dtypes",
                    "k has dtype torch.float8_e5m2: only float8_e4m3fn is served among the fp8 dtypes",
                    "head_dim_v (dim 3 of v) must be a multiple of 8 between 8 and 256, got 20")


def test_input_error_is_exported():
    import flashgen

    assert flashgen.InputError is V.InputError
    assert issubclass(V.InputError, ValueError) and issubclass(V.InputError, TypeError)
    with pytest.raises(TypeError, match="^flashgen: out must have q's dtype fp16, got bf16$") as info:
        V.check_out(V.ArrayInfo((1, 2, 3, 8), (48, 24, 8, 1), "bf16", "bf16", True, 0, "cuda:0"),
                    V.Problem(1, 2, 4, 3, 3, 8, 8, "fp16", 0))
    assert type(info.value) is TypeError  # one problem: its own type and a one-line message


# --------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------

def test_grad_inputs_go_through_the_op_with_deterministic(fake_gpu, monkeypatch):
    seen, op, new = [], [], []  # every launch (_fwd_run), the op's validation (_check_fwd), keys validated anew
    run, check, make = interface._fwd_run, interface._check_fwd, interface._new_fwd_call
    monkeypatch.setattr(interface, "_fwd_run", lambda *a: seen.append(a[6:]) or run(*a))
    monkeypatch.setattr(interface, "_check_fwd", lambda *a: op.append(1) or check(*a))
    monkeypatch.setattr(interface, "_new_fwd_call", lambda *a: new.append(a[0]) or make(*a))
    interface._fwd_calls.clear()
    q, k, v = qkv()
    out = flash_attn_func(q, k, v)  # no grad needed: the eager fast path
    assert seen == [(-1, -1, 0.0, None, (None, None, None), False)] and op == [] and out.grad_fn is None
    assert len(new) == 1
    k.requires_grad_(True)
    out = flash_attn_func(q, k, v, deterministic=True)  # recorded by autograd: the op's code through _FwdFn
    assert len(seen) == 2 and out.requires_grad and type(out.grad_fn).__name__ == "_FwdFnBackward"
    # the grad path's key (_fwd_call_key) is the inline fast path's: the same _FwdCall, validated once, not per call
    assert len(new) == 1 and op == [] and len(interface._fwd_calls) == 1
    out = flash_attn_func(q, k, v, causal=True)  # a new key on the grad path: validated (q, k, v) once
    assert len(new) == 2 and new[1] == interface._fwd_call_key(q, k, v, True, -1, -1, 0.0, None, (None,) * 3, None)
    assert len(fake_gpu.calls) == 3


def test_no_grad_inputs_give_plain_outputs(fake_gpu):
    out, lse = flash_attn_func(*qkv(), return_attn_probs=True)
    assert not out.requires_grad and out.grad_fn is None and lse.grad_fn is None
    q, k, v = qkv()
    q.requires_grad_(True)
    with torch.no_grad():
        out = flash_attn_func(q, k, v)
    assert not out.requires_grad


# --------------------------------------------------------------------------------------
# Fake implementation, opcheck, torch.compile
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [
    ((2, 5, 4, 64), (2, 7, 2, 64), (2, 7, 2, 64)),
    ((1, 33, 8, 128), (1, 19, 1, 128), (1, 19, 1, 64)),
    ((3, 0, 2, 64), (3, 4, 2, 64), (3, 4, 2, 64)),
])
def test_fake_impl_matches_real_metadata(fake_gpu, shapes):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = [torch.randn(s).half() for s in shapes]
    out_r, lse_r = torch.ops.flashgen.fwd(*real, 0.125, True)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        out_f, lse_f = torch.ops.flashgen.fwd(*fake, 0.125, True)
    for r, f in ((out_r, out_f), (lse_r, lse_f)):
        assert tuple(f.shape) == tuple(r.shape)
        assert f.dtype == r.dtype and f.stride() == r.stride() and f.device == r.device


def test_fake_impl_validates(fake_gpu):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = qkv(h=4, hk=3)
    with FakeTensorMode() as mode:
        with pytest.raises(ValueError, match="multiple of heads_k"):
            torch.ops.flashgen.fwd(*(mode.from_tensor(t) for t in (q, k, v)), 0.1, False)


def test_opcheck(fake_gpu):
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, 0.125, True))


def test_compile_fullgraph_matches_eager(fake_gpu):
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, q, k, v):
            o, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
            return self.proj(o.float()), lse * 2

    m = Block().eval()
    q, k, v = qkv()
    with torch.no_grad():
        eager = m(q, k, v)
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert len(fake_gpu.calls) == 2


def test_compile_dynamic_shapes_fullgraph(fake_gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                      dynamic=True, backend="aot_eager")
    for sq, sk in ((64, 64), (100, 333), (7, 1000), (3, 5)):
        q, k, v = qkv(b=1, sq=sq, sk=sk, h=4, hk=4, d=64)
        assert torch.equal(f(q, k, v), flash_attn_func(q, k, v, causal=True))


def test_compile_inductor_default_backend(fake_gpu):
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True).float() * 2, fullgraph=True)
    q, k, v = qkv()
    assert torch.equal(f(q, k, v), flash_attn_func(q, k, v, causal=True).float() * 2)


# --------------------------------------------------------------------------------------
# _validate helpers
# --------------------------------------------------------------------------------------

def test_tma_layout_problem_cases():
    sh = (2, 8, 4, 64)
    assert V.tma_layout_problem(sh, (2048, 256, 64, 1), 2, 0x1000) is None
    assert "last dim" in V.tma_layout_problem(sh, (2048, 256, 64, 2), 2, 0x1000)
    assert "not a multiple of 16" in V.tma_layout_problem(sh, (2048, 260, 65, 1), 2, 0x1000)
    assert "broadcast" in V.tma_layout_problem(sh, (2048, 256, 0, 1), 2, 0x1000)
    assert "aligned" in V.tma_layout_problem(sh, (2048, 256, 64, 1), 2, 0x1002)
    assert V.tma_layout_problem((2, 1, 4, 64), (256, 3, 64, 1), 2, 0x1000) is None


def test_tma_strides_normalises_only_extent_one_dims():
    assert V.tma_strides((2, 1, 4, 64), (256, 3, 64, 1)) == (256, 256, 64, 1)
    assert V.tma_strides((1, 5, 4, 64), (7, 768, 64, 1)) == (5 * 768, 768, 64, 1)
    assert V.tma_strides((2, 9, 4, 64), (6912, 768, 64, 1)) == (6912, 768, 64, 1)


def test_is_c_contiguous():
    assert V.is_c_contiguous((2, 3, 4), (12, 4, 1))
    assert V.is_c_contiguous((2, 1, 4), (4, 99, 1))
    assert not V.is_c_contiguous((2, 3, 4), (24, 8, 1))
    assert V.is_c_contiguous((2, 0, 4), (0, 0, 0))


# --------------------------------------------------------------------------------------
# DLPack entry (numpy / torch CPU arrays standing in for device arrays)
# --------------------------------------------------------------------------------------

@pytest.fixture
def fake_gpu_dlpack(fake_gpu, monkeypatch):
    # cuda-core reads the DLPack capsules (StridedMemoryView); a declared dependency of flashgen
    pytest.importorskip("cuda.core.utils", reason="cuda-core is not installed")
    monkeypatch.setattr(dlpack_api, "_CUDA_DEVICE_TYPES", frozenset({dlpack_api.kDLCPU}))
    memsets = []

    def m8(device, ptr, n, stream):
        memsets.append(("d8", n, stream))
        ctypes.memset(ptr, 0, n)

    def m2d8(device, ptr, pitch, width, height, stream):
        memsets.append(("2d8", width, height, stream))
        for r in range(height):
            ctypes.memset(ptr + r * pitch, 0, width)

    def m32(device, ptr, value, count, stream):
        memsets.append(("d32", count, stream))
        (ctypes.c_uint32 * count).from_address(ptr)[:] = [value] * count

    monkeypatch.setattr(dlpack_api, "_memset8", m8)
    monkeypatch.setattr(dlpack_api, "_memset2d8", m2d8)
    monkeypatch.setattr(dlpack_api, "_memset32", m32)
    fake_gpu.memsets = memsets
    return fake_gpu


def _np_qkv(**kw):
    return [t.numpy() for t in qkv(**kw)]


def _outs(b=2, sq=5, h=4, dv=64, dtype=np.float16):
    return np.full((b, sq, h, dv), np.nan, dtype), np.full((b, h, sq), np.nan, np.float32)


def test_dlpack_numpy_arrays_with_given_outputs(fake_gpu_dlpack):
    q, k, v = _np_qkv()
    out, lse = _outs()
    r = dlpack_api.flash_attn_forward(q, k, v, causal=True, out=out, lse=lse, stream=77)
    assert r[0] is out and r[1] is lse
    ref, ref_lse = reference(*(torch.from_numpy(t) for t in (q, k, v)), 64 ** -0.5, True)
    assert np.abs(out.astype(np.float32) - ref.numpy()).max() <= 2e-3
    assert np.allclose(lse, ref_lse.numpy(), atol=1e-5)
    (call,) = fake_gpu_dlpack.calls
    assert call["stream"] == 77 and call["causal"] is True
    assert call["q"].ptr == q.__array_interface__["data"][0]


def test_dlpack_torch_arrays_allocate_with_torch(fake_gpu_dlpack, monkeypatch):
    torch_allocates_on_cpu(monkeypatch)
    q, k, v = qkv(dtype=torch.bfloat16)
    out, lse = dlpack_api.flash_attn_forward(q, k, v, softmax_scale=0.2)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, 5, 4, 64)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 5)
    assert_close_to_reference(out, q, k, v, 0.2, False, lse)


@pytest.mark.parametrize("form", ["none", "head", "block"])
def test_dlpack_fp8_forward_with_descales(fake_gpu_dlpack, monkeypatch, form):
    """e4m3 inputs through the DLPack entry: the descales reach the core with their own strides,
    out is bf16 (allocated by torch here), and the result is flash_attn_func's."""
    torch_allocates_on_cpu(monkeypatch)
    q, k, v = _e4m3(*qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64))
    ds = {"none": (None, None, None),
          "head": (torch.rand(2, 2) + 0.5, (torch.rand(2, 2) + 0.5).t().contiguous().t(), torch.rand(2, 2) + 0.5),
          "block": (torch.rand(2, 4, 2) + 0.5, torch.rand(2, 2, 3) + 0.5, torch.rand(2, 2) + 0.5)}[form]
    out, lse = dlpack_api.flash_attn_forward(q, k, v, causal=True, q_descale=ds[0], k_descale=ds[1],
                                             v_descale=ds[2])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, 70, 4, 64)
    call = fake_gpu_dlpack.calls[-1]
    assert call["out"].dtype == "bf16" and call["q"].dtype == "fp8_e4m3"
    for name, t in zip("qkv", ds):
        got = call["descales"][name]
        assert (got is None) if t is None else torch.equal(got, t)
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                       return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_dlpack_fp8_read_when_the_torch_bridge_refuses_float8(fake_gpu_dlpack, monkeypatch):
    """cuda-core's fast path for torch tensors refuses float8 ("Unsupported AOTI dtype code: 24",
    seen on the H100 machine): the entry reads the same capsule through the plain DLPack protocol."""
    real = dlpack_api._smv()
    tried = []

    class BridgeRefusesFloat8:
        @staticmethod
        def from_dlpack(obj, stream_ptr):
            tried.append(type(obj).__name__)
            if isinstance(obj, torch.Tensor) and obj.dtype == torch.float8_e4m3fn:
                raise TypeError("Unsupported AOTI dtype code: 24")
            return real.from_dlpack(obj, stream_ptr=stream_ptr)

    monkeypatch.setattr(dlpack_api, "_smv", lambda: BridgeRefusesFloat8)
    q, k, v = _e4m3(*qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64))
    out = torch.full((2, 5, 4, 64), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 4, 5), float("nan"))
    dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    assert tried.count("_CapsuleOnly") == 3  # q, k, v read again; out and lse the first way
    ref_out, ref_lse = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_dlpack_fp8_given_out_must_be_bf16(fake_gpu_dlpack):
    q, k, v = _e4m3(*qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64))
    lse = torch.full((2, 4, 5), float("nan"))
    with pytest.raises(TypeError, match=r"out must have dtype bf16 \(the output's dtype for fp8_e4m3 inputs\), "
                                        r"got torch.float8_e4m3fn"):
        dlpack_api.flash_attn_forward(q, k, v, out=torch.empty(2, 5, 4, 64, dtype=torch.float8_e4m3fn), lse=lse)
    assert fake_gpu_dlpack.calls == []
    out = torch.full((2, 5, 4, 64), float("nan"), dtype=torch.bfloat16)
    r = dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    assert r[0] is out and not torch.isnan(out).any()


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(q_descale=torch.ones(2, 4)), ValueError, r"q_descale must have shape \(batch, heads_k\) = \(2, 2\)"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float16)), TypeError, "v_descale must have dtype float32"),
    (dict(q_descale=[1.0]), TypeError, "q_descale must be a DLPack array"),
])
def test_dlpack_fp8_argument_problems(fake_gpu_dlpack, kwargs, exc, match):
    q, k, v = _e4m3(*qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64))
    out, lse = torch.empty(2, 70, 4, 64, dtype=torch.bfloat16), torch.empty(2, 4, 70)
    with pytest.raises(exc, match=match):
        dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse, **kwargs)
    assert fake_gpu_dlpack.calls == [] and fake_gpu_dlpack.selected == []


def test_dlpack_descales_need_e4m3_inputs(fake_gpu_dlpack):
    q, k, v = _np_qkv()
    with pytest.raises(ValueError, match="q_descale scales float8_e4m3fn inputs only"):
        dlpack_api.flash_attn_forward(q, k, v, q_descale=np.ones((2, 2), np.float32), out=_outs()[0], lse=_outs()[1])
    assert fake_gpu_dlpack.calls == []


def test_dlpack_fp8_attend_nothing_zeroes_bf16_out(fake_gpu_dlpack):
    """seqlen_k = 0: no launch; out (bf16, 2 bytes an element) zeroed, lse -inf."""
    q, _, _ = _e4m3(*qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64))
    k = v = torch.empty(2, 0, 2, 64, dtype=torch.float8_e4m3fn)
    out = torch.full((2, 5, 4, 64), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 4, 5), float("nan"))
    dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    assert fake_gpu_dlpack.calls == []
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())
    assert ("d8", out.numel() * 2, 0) in fake_gpu_dlpack.memsets


def test_dlpack_packed_and_cache_layouts_without_copy(fake_gpu_dlpack):
    packed = np.random.default_rng(0).standard_normal((2, 9, 3, 4, 64)).astype(np.float16)
    q = packed[:, :, 0]
    cache = np.random.default_rng(1).standard_normal((2, 32, 4, 64)).astype(np.float16)
    k, v = cache[:, :9], packed[:, :, 2]
    out, lse = _outs(sq=9)
    dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    call = fake_gpu_dlpack.calls[0]
    assert call["q"].ptr == q.__array_interface__["data"][0] and call["q"].strides == (9 * 3 * 256, 3 * 256, 64, 1)
    assert call["k"].ptr == cache.__array_interface__["data"][0] and call["k"].strides == (32 * 256, 256, 64, 1)


def test_dlpack_layout_tma_cannot_address_raises(fake_gpu_dlpack):
    q, k, v = _np_qkv()
    q = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    with pytest.raises(ValueError, match=r"q cannot be read by TMA: its last dim"):
        dlpack_api.flash_attn_forward(q, k, v, out=_outs()[0], lse=_outs()[1])
    assert fake_gpu_dlpack.calls == []


@pytest.mark.parametrize("bad,exc,match", [
    ("out_shape", ValueError, r"out must have shape"),
    ("out_dtype", TypeError, r"out must have q's dtype"),
    ("out_layout", ValueError, r"out cannot be written by the kernel's TMA store"),
    ("lse_shape", ValueError, r"lse must have shape"),
    ("lse_dtype", TypeError, r"lse must have dtype float32"),
    ("lse_layout", ValueError, r"lse must be C-contiguous"),
    ("out_readonly", ValueError, r"out is read-only"),
])
def test_dlpack_bad_outputs(fake_gpu_dlpack, bad, exc, match):
    q, k, v = _np_qkv()
    out, lse = _outs()
    if bad == "out_shape":
        out = out[:, :4]
    elif bad == "out_dtype":
        out = out.astype(np.float32)
    elif bad == "out_layout":
        out = np.zeros((2, 5, 4, 128), np.float16)[..., ::2]
    elif bad == "lse_shape":
        lse = np.zeros((2, 5, 4), np.float32)
    elif bad == "lse_dtype":
        lse = lse.astype(np.float16)
    elif bad == "lse_layout":
        lse = np.zeros((2, 5, 4), np.float32).transpose(0, 2, 1)
    elif bad == "out_readonly":
        out.flags.writeable = False
    with pytest.raises(exc, match=match):
        dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    assert fake_gpu_dlpack.calls == []


def test_dlpack_shared_validation(fake_gpu_dlpack):
    q, k, v = _np_qkv()
    with pytest.raises(ValueError, match=r"k has batch 1"):
        dlpack_api.flash_attn_forward(q, k[:1], v[:1])
    with pytest.raises(TypeError, match="float16, bfloat16 or float8_e4m3fn"):
        dlpack_api.flash_attn_forward(*(t.astype(np.float32) for t in (q, k, v)))
    with pytest.raises(ValueError, match="softmax_scale"):
        dlpack_api.flash_attn_forward(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="q must be a DLPack array"):
        dlpack_api.flash_attn_forward([1, 2], k, v)
    assert fake_gpu_dlpack.calls == []


def test_dlpack_host_arrays_rejected():
    q, k, v = _np_qkv()
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor/array.*kDLCPU"):
        dlpack_api.flash_attn_forward(q, k, v)


def test_dlpack_every_layout_and_output_problem_in_one_error(fake_gpu_dlpack):
    q, k, v = _np_qkv()
    q = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)  # last dim not contiguous
    out = np.zeros((2, 4, 4, 64), np.float32)  # wrong shape, wrong dtype, read-only
    out.flags.writeable = False
    lse = np.zeros((2, 5, 4), np.float16)  # wrong shape, wrong dtype
    with pytest.raises(V.InputError) as info:
        dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    assert_problems(info.value,
                    "q cannot be read by TMA: its last dim",
                    "out is read-only",
                    "out must have shape (batch, seqlen_q, heads, head_dim_v) = (2, 5, 4, 64), got (2, 4, 4, 64)",
                    "out must have q's dtype fp16, got float32",
                    "lse must have shape (batch, heads, seqlen_q) = (2, 4, 5), got (2, 5, 4)",
                    "lse must have dtype float32, got float16")
    assert fake_gpu_dlpack.calls == []


def test_dlpack_not_an_array_and_other_problems(fake_gpu_dlpack):
    q, k, _ = _np_qkv()
    with pytest.raises(TypeError) as info:
        dlpack_api.flash_attn_forward(q.astype(np.float32), k, [1, 2], softmax_scale="0.1")
    assert type(info.value) is TypeError  # all three are type problems
    assert_problems(info.value,
                    "v must be a DLPack array (with __dlpack__ and __dlpack_device__, e.g. a CuPy, JAX or torch "
                    "array), got list",
                    "q must have dtype float16, bfloat16 or float8_e4m3fn, got float32",
                    "softmax_scale must be a real number (float) or None, got str")
    assert fake_gpu_dlpack.calls == []


def test_dlpack_not_hopper(fake_gpu_dlpack, monkeypatch):
    monkeypatch.setattr(core, "device_capability", lambda device: (10, 0))
    with pytest.raises(RuntimeError, match=r"9\.x.*10\.0"):
        dlpack_api.flash_attn_forward(*_np_qkv(), out=_outs()[0], lse=_outs()[1])


def test_dlpack_missing_outputs_without_allocator(fake_gpu_dlpack, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(TypeError, match="pass out="):
        dlpack_api.flash_attn_forward(*_np_qkv())


def test_dlpack_empty_and_seqlen_k_zero(fake_gpu_dlpack):
    q, k, v = _np_qkv(sq=0)
    out, lse = np.zeros((2, 0, 4, 64), np.float16), np.zeros((2, 4, 0), np.float32)
    dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse)
    q, k, v = _np_qkv(sk=0)
    out, lse = _outs()
    dlpack_api.flash_attn_forward(q, k, v, out=out, lse=lse, stream=5)
    assert (out == 0).all() and np.isneginf(lse).all()
    # strided out: zeroed row block by row block, padding untouched
    big = np.full((2, 5, 4, 128), 7, np.float16)
    out2 = big[..., :64]
    lse2 = np.full((2, 4, 5), np.nan, np.float32)
    dlpack_api.flash_attn_forward(q, k, v, out=out2, lse=lse2, stream=5)
    assert (out2 == 0).all() and (big[..., 64:] == 7).all() and np.isneginf(lse2).all()
    assert fake_gpu_dlpack.calls == []
    assert all(m[-1] == 5 for m in fake_gpu_dlpack.memsets)


@pytest.mark.parametrize("stream,handle", [(None, 0), (0, 0), (42, 42)])
def test_dlpack_stream_handles(stream, handle):
    assert dlpack_api._stream_handle(stream) == handle


def test_dlpack_stream_objects():
    class Proto:
        def __cuda_stream__(self):
            return (0, 99)

    class TorchLike:
        cuda_stream = 7

    class CupyLike:
        ptr = 8

    assert dlpack_api._stream_handle(Proto()) == 99
    assert dlpack_api._stream_handle(TorchLike()) == 7
    assert dlpack_api._stream_handle(CupyLike()) == 8
    assert dlpack_api._dlpack_stream(0) == 1 and dlpack_api._dlpack_stream(99) == 99
    with pytest.raises(TypeError, match="stream"):
        dlpack_api._stream_handle("default")
    with pytest.raises(TypeError, match="stream"):
        dlpack_api._stream_handle(True)


def test_dlpack_module_does_not_import_torch():
    code = (
        "import sys\n"
        "import flashgen._validate, flashgen.dlpack_api\n"
        "assert 'torch' not in sys.modules, 'flashgen.dlpack_api imported torch'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
