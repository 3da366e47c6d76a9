"""CPU tests of FA3's ``attention_chunk`` (chunked attention) in flash_attn_func.

A call with attention_chunk C > 0 runs as at most three ordinary calls on slices of q, k, v
(flashgen.core.chunk_pieces; interface._attention_chunks). Checked here without a GPU:
- the pieces against FA3's own mask (test_util.construct_chunk_mask, written out in
  tests/gpu/_ref.visible_mask), with every causal / window combination: the masks the pieces run
  with, put together, are FA3's mask;
- flash_attn_func's out, lse and gradients against the float32 reference with the chunk mask,
  on test_api_validation's emulated core (`fake_gpu`: each piece's launch computes attention
  through the memory its TensorArgs describe) and test_bwd_api's emulated backward (`gpu`);
- FP8 descales per piece, and the argument's errors;
- flash_attn_qkvpacked_func (FA3's packed entry, which passes attention_chunk on as the rest);
- head_dim_v over 256 (two calls on v's column halves) and flash_attn_varlen_func (one call per
  sequence), the other host-side FA3 entries built the same way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flashgen.core as core
from flashgen import _validate as V
from flashgen.interface import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from _ref import attention_ref, dequantize_fp8, visible_mask  # noqa: E402  (torch only: runs on the CPU)
from test_api_validation import fake_gpu, qkv  # noqa: E402,F401
from test_bwd_api import assert_close, gpu  # noqa: E402,F401

WINDOWS = [(False, (-1, -1)), (True, (-1, -1)), (False, (3, -1)), (False, (-1, 2)), (False, (2, 1)),
           (False, (0, 0)), (True, (4, -1))]


def pieces_mask(sq, sk, chunk, causal, window):
    """The (sq, sk) mask the pieces of chunk_pieces run with: each piece (each of its whole chunks)
    with the call's own causal / window mask, bottom-right aligned in the piece; False elsewhere."""
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for pc in core.chunk_pieces(sq, sk, chunk):
        n = pc.chunks
        cq, ck = (pc.q_end - pc.q_begin) // n, (pc.k_end - pc.k_begin) // n
        for t in range(n):
            part = visible_mask(cq, ck, causal, window)
            q0, k0 = pc.q_begin + t * cq, pc.k_begin + t * ck
            m[q0:q0 + cq, k0:k0 + ck] = True if part is None else part
    return m


def test_chunk_pieces_cover_fa3s_chunk_mask():
    for sq in range(0, 26):
        for sk in range(0, 26):
            for chunk in range(1, 30):
                pieces = core.chunk_pieces(sq, sk, chunk)
                assert 1 <= len(pieces) <= 3
                assert pieces[0].q_begin == 0 and pieces[-1].q_end == sq
                keyed = [pc for pc in pieces if pc.k_end > pc.k_begin]
                for a, b in zip(pieces, pieces[1:]):
                    assert a.q_end == b.q_begin and a.q_end > a.q_begin
                for a, b in zip(keyed, keyed[1:]):
                    assert a.k_end == b.k_begin
                if sq and sk:
                    assert keyed and keyed[-1].k_end == sk
                for pc in keyed:
                    lq, lk = pc.q_end - pc.q_begin, pc.k_end - pc.k_begin
                    assert pc.q_begin + sk - sq == pc.k_begin + lk - lq  # bottom-right alignment kept
                    if pc.chunks > 1:
                        assert lq == lk == chunk * pc.chunks
                if sq and sk:
                    assert torch.equal(pieces_mask(sq, sk, chunk, False, (-1, -1)),
                                       visible_mask(sq, sk, attention_chunk=chunk))


def test_chunk_pieces_with_causal_and_windows_give_fa3s_mask():
    lengths = (1, 2, 3, 5, 7, 8, 13, 16, 17, 24, 31)
    for sq in lengths:
        for sk in lengths:
            for chunk in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
                for causal, window in WINDOWS:
                    want = visible_mask(sq, sk, causal, window, attention_chunk=chunk)
                    assert torch.equal(pieces_mask(sq, sk, chunk, causal, window), want), (sq, sk, chunk, causal,
                                                                                          window)


def test_chunk_pieces_count_does_not_grow_with_chunks():
    assert core.chunk_pieces(16384, 16384, 1) == [core.ChunkPiece(0, 16384, 0, 16384, 16384)]
    # decode-like: the rows' first chunk partial, then the last (partial) chunk
    assert core.chunk_pieces(100, 1000, 64) == [core.ChunkPiece(0, 60, 896, 960, 1),
                                                 core.ChunkPiece(60, 100, 960, 1000, 1)]
    # rows past the keys' start see nothing; whole chunks batched; a partial last chunk
    assert core.chunk_pieces(10, 4, 2) == [core.ChunkPiece(0, 6, 0, 0, 1), core.ChunkPiece(6, 10, 0, 4, 2)]
    assert core.chunk_pieces(5, 7, 4) == [core.ChunkPiece(0, 2, 0, 4, 1), core.ChunkPiece(2, 5, 4, 7, 1)]
    assert core.chunk_pieces(0, 7, 4) == [core.ChunkPiece(0, 0, 0, 7, 1)]
    with pytest.raises(ValueError, match="attention_chunk >= 1"):
        core.chunk_pieces(4, 4, 0)


# --------------------------------------------------------------------------------------
# flash_attn_func with attention_chunk, on the emulated core
# --------------------------------------------------------------------------------------

SHAPES = [  # (seqlen_q, seqlen_k, attention_chunk)
    (37, 53, 16),   # partial first chunk, whole chunks, partial last one
    (53, 37, 16),   # rows before the first key position see nothing
    (40, 40, 8),    # whole chunks only: one call of 5 x batch
    (29, 64, 7),
    (1, 100, 30),   # decode
    (100, 1, 3),
    (24, 24, 1),    # every row its own chunk
]


def check_against_reference(out, lse, q, k, v, scale, causal, window, chunk, softcap=0.0, sink=None):
    ref, ref_lse = attention_ref(q, k, v, causal, scale, window_size=window, softcap=softcap, sink=sink,
                                 attention_chunk=chunk)
    assert out.shape == ref.shape and out.dtype == q.dtype and out.is_contiguous()
    tol = 2e-3 if out.dtype == torch.float16 else 1.6e-2  # one rounding of the emulator's fp32 result
    assert (out.float() - ref.float()).abs().max().item() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq,sk,chunk", SHAPES)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (True, (6, -1))])
def test_chunked_forward_matches_reference(fake_gpu, sq, sk, chunk, causal, window):
    q, k, v = qkv(b=2, sq=sq, sk=sk, h=4, hk=2)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=chunk,
                               return_attn_probs=True)
    check_against_reference(out, lse, q, k, v, 64 ** -0.5, causal, window, chunk)
    pieces = core.chunk_pieces(sq, sk, chunk)
    assert len(fake_gpu.calls) == sum(pc.k_end > pc.k_begin for pc in pieces)  # the blind rows launch nothing
    for call, pc in zip(fake_gpu.calls, [pc for pc in pieces if pc.k_end > pc.k_begin]):
        n = pc.chunks
        assert call["q"].shape == (2 * n, (pc.q_end - pc.q_begin) // n, 4, 64)
        assert call["k"].shape == (2 * n, (pc.k_end - pc.k_begin) // n, 2, 64)
        assert call["causal"] is causal and call["scale"] == pytest.approx(64 ** -0.5)
    # without lse: the same out
    out2 = flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=chunk)
    assert torch.equal(out2, out)


def test_whole_chunks_share_one_call_as_a_view(fake_gpu):
    q, k, v = qkv(b=3, sq=48, sk=48, h=2, hk=2)
    out = flash_attn_func(q, k, v, causal=True, attention_chunk=16)
    check_against_reference(out, flash_attn_func(q, k, v, causal=True, attention_chunk=16, return_attn_probs=True)[1],
                            q, k, v, 64 ** -0.5, True, (-1, -1), 16)
    call = fake_gpu.calls[0]
    assert call["q"].shape == (9, 16, 2, 64) and call["q"].ptr == q.data_ptr()  # contiguous: no copy


def test_a_chunk_covering_every_key_is_the_plain_call(fake_gpu):
    q, k, v = qkv(b=2, sq=37, sk=37)
    out = flash_attn_func(q, k, v, causal=True, attention_chunk=64)
    (call,) = fake_gpu.calls
    assert call["q"].shape == q.shape and call["q"].ptr == q.data_ptr()
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


def test_chunked_softcap_sink_gqa(fake_gpu):
    q, k, v = qkv(b=2, sq=45, sk=61, h=6, hk=2, dtype=torch.bfloat16)
    sink = torch.randn(6, generator=torch.Generator().manual_seed(3))
    out, lse = flash_attn_func(q, k, v, softcap=5.0, learnable_sink=sink, attention_chunk=20, softmax_scale=0.3,
                               return_attn_probs=True)
    check_against_reference(out, lse, q, k, v, 0.3, False, (-1, -1), 20, softcap=5.0, sink=sink)


@pytest.mark.parametrize("sq,sk,chunk", [(37, 53, 16), (53, 37, 16), (40, 40, 8), (1, 30, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_gradients_match_reference(gpu, sq, sk, chunk, causal):
    q, k, v = (t.requires_grad_(True) for t in qkv(b=2, sq=sq, sk=sk, h=4, hk=2))
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    out = flash_attn_func(q, k, v, causal=causal, attention_chunk=chunk, learnable_sink=sink)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out.float() * w.float()).sum().backward()
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sink)]
    ref, _ = attention_ref(*leaves[:3], causal, 64 ** -0.5, sink=leaves[3], attention_chunk=chunk)
    ref.backward(w.float())
    for t, r in zip((q, k, v), leaves[:3]):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        assert_close(t.grad, r.grad)
    assert torch.allclose(sink.grad, leaves[3].grad, atol=2e-2, rtol=2e-2)
    keyed = [pc for pc in core.chunk_pieces(sq, sk, chunk) if pc.k_end > pc.k_begin]
    assert len(gpu.calls) == len(keyed)  # one backward per piece with keys


# --------------------------------------------------------------------------------------
# FP8 descales per piece; argument errors
# --------------------------------------------------------------------------------------

def _fp8(shape, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("sq,sk,chunk,block", [(37, 53, 16, False), (40, 40, 8, False), (128, 192, 64, True),
                                               (192, 192, 64, True), (64, 200, 128, True)])
def test_chunked_fp8_descales(fake_gpu, sq, sk, chunk, block):
    b, h, hk = 2, 4, 2
    q, k, v = _fp8((b, sq, h, 64), 0), _fp8((b, sk, hk, 64), 1), _fp8((b, sk, hk, 64), 2)
    g = torch.Generator().manual_seed(7)
    if block:
        qd = torch.rand(b, h, -(-sq // 64), generator=g) + 0.5
        kd = torch.rand(b, hk, -(-sk // 64), generator=g) + 0.5
    else:
        qd, kd = torch.rand(b, hk, generator=g) + 0.5, torch.rand(b, hk, generator=g) + 0.5
    vd = torch.rand(b, hk, generator=g) + 0.5
    out, lse = flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                               attention_chunk=chunk, return_attn_probs=True)
    deq = [dequantize_fp8(x, d) for x, d in zip((q, k, v), (qd, kd, vd))]
    ref, ref_lse = attention_ref(*deq, True, 64 ** -0.5, attention_chunk=chunk)
    assert out.dtype == torch.bfloat16
    assert bool(((out.float() - ref).abs() <= 8e-3 * ref.abs().clamp(min=1.0)).all())  # one bf16 rounding
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)


def test_block_descales_cut_by_a_chunk_raise_before_any_launch(fake_gpu):
    b, h, hk, sq, sk = 1, 2, 2, 100, 100
    q, k, v = _fp8((b, sq, h, 64), 0), _fp8((b, sk, hk, 64), 1), _fp8((b, sk, hk, 64), 2)
    qd = torch.ones(b, h, 2)
    with pytest.raises(NotImplementedError, match="attention_chunk with a block q_descale"):
        flash_attn_func(q, k, v, q_descale=qd, attention_chunk=48)
    assert fake_gpu.calls == []


@pytest.mark.parametrize("chunk,exc,fragment", [
    ("8", TypeError, "attention_chunk must be an int >= 0 (0 = off), got str"),
    (True, TypeError, "got bool"),
    (2.0, TypeError, "got float"),
    (-1, ValueError, "attention_chunk must be >= 0 (0 = off), got -1"),
])
def test_attention_chunk_argument_errors(fake_gpu, chunk, exc, fragment):
    q, k, v = qkv()
    with pytest.raises(exc) as info:
        flash_attn_func(q, k, v, attention_chunk=chunk)
    assert fragment in str(info.value)
    assert fake_gpu.calls == []
    assert V.attention_chunk_problems(chunk)[0][0] is exc


def test_chunked_empty_problems(fake_gpu):
    for b, sq, sk in ((0, 37, 53), (2, 0, 53), (2, 37, 0)):
        q, k, v = qkv(b=b, sq=sq, sk=sk)
        out, lse = flash_attn_func(q, k, v, attention_chunk=16, return_attn_probs=True)
        assert out.shape == (b, sq, 4, 64) and lse.shape == (b, 4, sq)
        assert not out.any() and bool((lse == float("-inf")).all())
    assert fake_gpu.calls == []


@pytest.mark.parametrize("chunk", [0, None])
def test_attention_chunk_off(fake_gpu, chunk):
    q, k, v = qkv()
    out = flash_attn_func(q, k, v, causal=True, attention_chunk=chunk)
    (call,) = fake_gpu.calls
    assert call["q"].shape == q.shape
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


def test_compile_fullgraph_chunked_forward_and_backward(gpu):
    """torch.compile(fullgraph=True) traces a chunked call (its slicing, the pieces' ops, the cat) and
    its backward: the same gradients as eager, one fwd and one bwd op per piece in the graphs."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()

    def loss_fn(q, k, v):
        return (flash_attn_func(q, k, v, causal=True, attention_chunk=16).float() ** 2).sum()

    def leaves():
        return [t.requires_grad_(True) for t in qkv(b=2, sq=37, sk=53, h=4, hk=2)]

    eager_in, compiled_in = leaves(), leaves()
    loss_fn(*eager_in).backward()
    backend = AotEagerAndRecordGraphs()
    torch.compile(loss_fn, fullgraph=True, backend=backend)(*compiled_in).backward()
    for a, b in zip(eager_in, compiled_in):
        assert torch.equal(a.grad, b.grad)
    (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs
    pieces = len(core.chunk_pieces(37, 53, 16))  # whole chunks 1-2 as one call, the partial last chunk
    assert pieces == 2 and fw.code.count("flashgen.fwd") == bw.code.count("flashgen.bwd") == pieces


# --------------------------------------------------------------------------------------
# flash_attn_qkvpacked_func (FA3's packed entry; it passes attention_chunk on like the rest)
# --------------------------------------------------------------------------------------

def test_qkvpacked_5d_is_flash_attn_func_on_its_views(gpu):
    from flashgen import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 37, 3, 4, 64, generator=torch.Generator().manual_seed(0)).half().requires_grad_(True)
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=16, return_attn_probs=True)
    q, k, v = (t.detach() for t in qkv.unbind(dim=2))
    check_against_reference(out, lse, q, k, v, 64 ** -0.5, True, (-1, -1), 16)
    flash_attn_qkvpacked_func(qkv.detach(), causal=True)  # unchunked: q is a view of qkv, not a copy
    assert gpu.fwd.calls[-1]["q"].ptr == qkv.data_ptr() and gpu.fwd.calls[-1]["k"].strides == qkv[:, :, 1].stride()
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    (out.float() * w.float()).sum().backward()
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, True, 64 ** -0.5, attention_chunk=16)
    ref.backward(w.float())
    assert qkv.grad.shape == qkv.shape
    assert_close(qkv.grad, torch.stack([t.grad for t in leaves], dim=2))


def test_qkvpacked_4d_gqa(fake_gpu):
    from flashgen import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 29, 6 + 2 * 2, 64, generator=torch.Generator().manual_seed(0)).half()
    out = flash_attn_qkvpacked_func(qkv, window_size=(5, 3), num_heads_q=6, softmax_scale=0.2)
    q, k, v = qkv[:, :, :6], qkv[:, :, 6:8], qkv[:, :, 8:]
    ref, _ = attention_ref(q, k, v, False, 0.2, window_size=(5, 3))
    assert out.shape == (2, 29, 6, 64) and (out.float() - ref).abs().max().item() <= 2e-3


@pytest.mark.parametrize("qkv,kw,exc,fragment", [
    ("x", {}, TypeError, "qkv must be a torch.Tensor, got str"),
    (torch.zeros(2, 5, 2, 4, 64), {}, ValueError, "a 5-D qkv must be (batch, seqlen, 3, heads, head_dim)"),
    (torch.zeros(2, 5, 10, 64), {}, TypeError, "needs num_heads_q, an int; got NoneType"),
    (torch.zeros(2, 5, 10, 64), dict(num_heads_q=5), ValueError, "does not split into num_heads_q + 2 * heads_k"),
    (torch.zeros(2, 5, 10, 64), dict(num_heads_q=10), ValueError, "with heads_k >= 1"),
    (torch.zeros(5, 10, 64), {}, ValueError, "got 3-D shape (5, 10, 64)"),
])
def test_qkvpacked_errors(fake_gpu, qkv, kw, exc, fragment):
    from flashgen import flash_attn_qkvpacked_func

    with pytest.raises(exc) as info:
        flash_attn_qkvpacked_func(qkv.half() if isinstance(qkv, torch.Tensor) else qkv, **kw)
    assert fragment in str(info.value)
    assert fake_gpu.calls == []


# --------------------------------------------------------------------------------------
# head_dim_v over 256 (FA3: up to 512 in 16 bits) as two calls on v's column halves
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dv,chunk", [(512, 0), (264, 0), (320, 16)])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_over_256_split(gpu, dv, chunk, causal):
    q, k, v = (t.requires_grad_(True) for t in qkv(b=2, sq=37, sk=53, h=4, hk=2, d=64, dv=dv))
    out, lse = flash_attn_func(q, k, v, causal=causal, attention_chunk=chunk, return_attn_probs=True)
    check_against_reference(out, lse, q.detach(), k.detach(), v.detach(), 64 ** -0.5, causal, (-1, -1), chunk)
    half = -(-dv // 16) * 8
    widths = sorted({c["v"].shape[3] for c in gpu.fwd.calls})
    assert widths == sorted({half, dv - half}) and all(c["v"].ptr in (v.data_ptr(), v.data_ptr() + 2 * half)
                                                       for c in gpu.fwd.calls if chunk == 0)  # read in place
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    (out.float() * w.float()).sum().backward()
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal, 64 ** -0.5, attention_chunk=chunk)
    ref.backward(w.float())
    for t, r in zip((q, k, v), leaves):
        assert_close(t.grad, r.grad)
    assert torch.equal(flash_attn_func(q.detach(), k.detach(), v.detach(), causal=causal, attention_chunk=chunk), out)


@pytest.mark.parametrize("dv,dtype,exc,fragment", [
    (520, torch.float16, ValueError, "up to 512 with float16 / bfloat16 inputs, got 520"),
    (300, torch.float16, ValueError, "must be a multiple of 8 up to 256, or up to 512"),
    (512, torch.float8_e4m3fn, NotImplementedError, "head_dim_v (512) over 256 is served for float16"),
])
def test_head_dim_v_over_256_errors(fake_gpu, dv, dtype, exc, fragment):
    q, k, v = (t.to(dtype) for t in qkv(d=64, dv=dv))
    with pytest.raises(exc) as info:
        flash_attn_func(q, k, v)
    assert fragment in str(info.value)
    assert fake_gpu.calls == []


# --------------------------------------------------------------------------------------
# flash_attn_varlen_func: one flash_attn_func call per sequence, on views
# --------------------------------------------------------------------------------------

def varlen_inputs(lens_q, lens_k, h=4, hk=2, d=64, dv=None, pad_q=0, pad_k=0, dtype=torch.float16, seed=0):
    """Packed q, k, v of sequences of these lengths (plus pad_q / pad_k unused rows at the end)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k
    q = torch.randn(tq, h, d, generator=g).to(dtype)
    k = torch.randn(tk, hk, d, generator=g).to(dtype)
    v = torch.randn(tk, hk, dv or d, generator=g).to(dtype)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k)


def varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal, window=(-1, -1), chunk=0, sink=None, scale=None,
                     softcap=0.0):
    """Per-sequence reference attention, assembled as FA3 lays it out: out (total_q, h, dv) with zero
    unused rows, lse (h, total_q) with -inf there."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for b in range(len(cu_q) - 1):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        qb, kb, vb = q[q0:q0 + used_q[b]], k[k0:k0 + used_k[b]], v[k0:k0 + used_k[b]]
        o, l = attention_ref(qb[None], kb[None], vb[None], causal, scale, window_size=window, sink=sink,
                             attention_chunk=chunk, softcap=softcap)
        out[q0:q0 + used_q[b]] = o[0].float()
        lse[:, q0:q0 + used_q[b]] = l[0]
    return out, lse


@pytest.mark.parametrize("lens_q,lens_k,causal,window,chunk", [
    ([5, 17, 1, 33], [7, 17, 40, 2], True, (-1, -1), 0),
    ([5, 17, 1, 33], [7, 17, 40, 2], False, (3, 2), 0),
    ([30, 12], [30, 50], True, (-1, -1), 8),
    ([9, 0, 4], [0, 6, 11], False, (-1, -1), 0),   # an empty query sequence, a sequence with no key
])
def test_varlen_forward_matches_per_sequence_reference(fake_gpu, lens_q, lens_k, causal, window, chunk):
    from flashgen import flash_attn_varlen_func

    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=3, pad_k=2)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      window_size=window, attention_chunk=chunk, return_attn_probs=True)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, lens_q, lens_k, causal, window, chunk)
    assert out.shape == (q.shape[0], 4, 64) and lse.shape == (4, q.shape[0]) and out.dtype == q.dtype
    assert (out.float() - ref).abs().max().item() <= 2e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)
    if not chunk:  # one call per sequence with rows and keys, on views of q
        assert [c["q"].shape[1] for c in fake_gpu.calls] == [n for n, m in zip(lens_q, lens_k) if n and m]
        starts = [int(a) for a, n, m in zip(cu_q[:-1], lens_q, lens_k) if n and m]
        assert [c["q"].ptr for c in fake_gpu.calls] == [q.data_ptr() + 2 * 4 * 64 * s for s in starts]


def test_varlen_seqused_and_gradients(gpu):
    from flashgen import flash_attn_varlen_func

    lens_q, lens_k = [11, 20, 7], [13, 25, 30]
    used_q, used_k = [9, 20, 3], [13, 10, 30]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=2, seed=3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 30, torch.tensor(used_q, dtype=torch.int32),
                                 torch.tensor(used_k, dtype=torch.int32), causal=True, learnable_sink=sink)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    (out.float() * w.float()).sum().backward()
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, _ = varlen_reference(*leaves, cu_q, cu_k, used_q, used_k, True, sink=sink)
    assert (out.float() - ref.detach()).abs().max().item() <= 2e-3
    ref.backward(w.float())
    for t, r in zip((q, k, v), leaves):
        assert t.grad.shape == t.shape
        assert_close(t.grad, r.grad)  # unused rows: zero gradients in both
    assert not q.grad[cu_q[1] - 2:cu_q[1]].any() and not k.grad[int(cu_k[1]) + 10:int(cu_k[2])].any()


def test_varlen_fp8_descales(fake_gpu):
    from flashgen import flash_attn_varlen_func

    lens = [17, 30]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, dtype=torch.float32)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    g = torch.Generator().manual_seed(7)
    qd, kd, vd = (torch.rand(2, 2, generator=g) + 0.5 for _ in range(3))
    out = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 30, 30, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd)
    assert out.dtype == torch.bfloat16
    for b in range(2):
        s = slice(int(cu_q[b]), int(cu_q[b + 1]))
        deq = [dequantize_fp8(x[s][None], d[b:b + 1]) for x, d in zip((q8, k8, v8), (qd, kd, vd))]
        ref, _ = attention_ref(*deq, True, 64 ** -0.5)
        assert bool(((out[s].float() - ref[0]).abs() <= 8e-3 * ref[0].abs().clamp(min=1.0)).all())


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(cu_seqlens_q=torch.tensor([0, 5, 40], dtype=torch.int32)), ValueError, "cu_seqlens_q[-1] (40) is past"),
    (dict(cu_seqlens_k=torch.tensor([1, 5, 9], dtype=torch.int32)), ValueError, "cu_seqlens_k[0] must be 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "cu_seqlens_q must be non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 9])), ValueError, "cu_seqlens_q must be a 1-D int32 tensor"),
    (dict(cu_seqlens_q=[0, 5, 9]), TypeError, "cu_seqlens_q must be a torch.Tensor of int32, got list"),
    (dict(cu_seqlens_k=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "the same length (batch + 1)"),
    (dict(max_seqlen_q=3), ValueError, "max_seqlen_q (3) is less than the longest sequence (5)"),
    (dict(max_seqlen_k=None), TypeError, "max_seqlen_k must be an int, got NoneType"),
    (dict(seqused_k=torch.tensor([5, 9], dtype=torch.int32)), ValueError, "seqused_k[1] = 9 must be between 0"),
    (dict(q=torch.zeros(2, 9, 4, 64)), ValueError, "q must be 3-D (total, heads, head_dim)"),
    (dict(qv=torch.zeros(9, 4, 64)), NotImplementedError, "qv (absorbed MLA)"),
    (dict(q_descale=torch.ones(2, 4)), ValueError, "q_descale must be None or a float32 (batch, heads_k) = (2, 2)"),
])
def test_varlen_errors(fake_gpu, kw, exc, fragment):
    from flashgen import flash_attn_varlen_func

    q, k, v, cu_q, cu_k = varlen_inputs([5, 4], [5, 4])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    args.update({n: (x.half() if n in "qkv" and isinstance(x, torch.Tensor) and x.is_floating_point() else x)
                 for n, x in kw.items()})
    with pytest.raises(exc) as info:
        flash_attn_varlen_func(**args)
    assert fragment in str(info.value)
    assert fake_gpu.calls == []


def test_varlen_equal_neighbours_share_one_call(fake_gpu):
    from flashgen import flash_attn_varlen_func

    lens_q, lens_k = [16, 16, 16, 9, 9, 16], [20, 20, 20, 9, 9, 20]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, seed=4)
    used_q = torch.tensor([16, 16, 16, 9, 8, 16], dtype=torch.int32)  # sequence 4 leaves a row unused
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 20, used_q, causal=True, return_attn_probs=True)
    calls = [(c["q"].shape[0], c["q"].shape[1], c["k"].shape[1]) for c in fake_gpu.calls]
    assert calls == [(3, 16, 20), (1, 9, 9), (1, 8, 9), (1, 16, 20)]  # batch 3 as one call: views, no copy
    assert fake_gpu.calls[0]["q"].ptr == q.data_ptr() and fake_gpu.calls[0]["q"].strides[0] == 16 * 4 * 64
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q.tolist(), lens_k, True)
    assert (out.float() - ref).abs().max().item() <= 2e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


def test_varlen_under_torch_compile_breaks_the_graph_at_the_offsets(fake_gpu):
    """The offsets' read is data-dependent: torch.compile runs the call with a graph break (same result
    as eager) and fullgraph=True refuses it, as the docstring says."""
    from flashgen import flash_attn_varlen_func

    q, k, v, cu_q, cu_k = varlen_inputs([8, 12], [8, 12], seed=5)
    f = lambda q, k, v, cu_q, cu_k: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True)  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="aot_eager")(q, k, v, cu_q, cu_k), f(q, k, v, cu_q, cu_k))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)


def test_varlen_random_configurations_match_the_reference(fake_gpu):
    """80 seeded random varlen calls (lengths incl. 0, equal neighbours, seqused, padding, masks, chunks)."""
    import random

    from flashgen import flash_attn_varlen_func

    rng = random.Random(1)
    for it in range(80):
        batch = rng.randint(1, 5)
        lens_q = [rng.choice([0, 1, 3, 8, 13]) for _ in range(batch)]
        lens_k = [rng.choice([0, 1, 5, 8, 21]) for _ in range(batch)]
        if rng.random() < 0.5:
            lens_q, lens_k = [lens_q[0]] * batch, [lens_k[0]] * batch
        used_q = [rng.randint(0, n) if rng.random() < 0.3 else n for n in lens_q]
        used_k = [rng.randint(0, n) if rng.random() < 0.3 else n for n in lens_k]
        causal = rng.random() < 0.5
        window = (rng.randint(0, 6), rng.randint(0, 6)) if rng.random() < 0.3 else (-1, -1)
        chunk = rng.choice([0, 0, 1, 3, 7])
        q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=rng.randint(1, 3), pad_k=rng.randint(0, 3), seed=it)
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(used_q), max(used_k),
                                          torch.tensor(used_q, dtype=torch.int32), torch.tensor(used_k, dtype=torch.int32),
                                          causal=causal, window_size=window, attention_chunk=chunk, return_attn_probs=True)
        ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal, window, chunk)
        assert (out.float() - ref).abs().max().item() <= 2e-3
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


def test_varlen_groups_pad_less_than_a_call_costs(monkeypatch):
    from flashgen import interface

    monkeypatch.setattr(interface, "VARLEN_CALL_WORK", 1000 ** 2 * 2048)  # a call's cost: padding 0 to 1000 tokens
    lens = [4000, 3900, 1000, 600, 400, 10, 1, 5000]
    groups = interface._varlen_groups(lens, list(range(8)), 16 * 128)
    assert sorted(b for g in groups for b in g) == list(range(8))
    for g in groups:
        longest = lens[g[0]]
        assert all(lens[b] <= longest and (longest ** 2 - lens[b] ** 2) * 2048 <= 1000 ** 2 * 2048 for b in g)
    assert groups == [[7], [0, 1], [2, 3, 4, 5, 6]]
    monkeypatch.setattr(interface, "VARLEN_CALL_WORK", 0)  # no groups (but of equal lengths)
    assert interface._varlen_groups([5, 5, 3], [0, 1, 2], 64) == [[0, 1], [2]]


@pytest.mark.parametrize("causal,window,used", [(True, (-1, -1), False), (False, (6, 0), False), (True, (-1, -1), True)])
def test_varlen_padded_groups_forward_and_backward(gpu, fake_gpu, monkeypatch, causal, window, used):
    """Causal (or a window closed at the diagonal) with as many rows as keys per sequence: sequences of similar lengths
    run as one zero-padded call each (fewer calls than one per run of equal neighbours), FA3's result and gradients
    (unused rows and the rows past the last sequence: 0), GQA, a learnable sink."""
    from flashgen import flash_attn_varlen_func, interface

    monkeypatch.setattr(interface, "VARLEN_CALL_WORK", 900 * 4 * 64)  # groups of up to 900 padded token^2: several

    lens = [40, 37, 3, 5, 24, 22, 7, 1, 48, 13]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, pad_q=3, pad_k=2, seed=8)
    used_l = [n - 2 if used and n > 4 else n for n in lens]
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5))
    kw = dict(seqused_q=torch.tensor(used_l, dtype=torch.int32), seqused_k=torch.tensor(used_l, dtype=torch.int32)) \
        if used else {}
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 48, 48, causal=causal, window_size=window,
                                      learnable_sink=sink, return_attn_probs=True, **kw)
    calls = fake_gpu.calls
    assert 1 < len(calls) < len(lens) and all(c["q"].shape[1] == c["k"].shape[1] for c in calls)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref, ref_lse = varlen_reference(*leaves, cu_q, cu_k, used_l, used_l, causal, window, sink=sink)
    assert (out.float() - ref.detach()).abs().max().item() <= 2e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite].detach(), atol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    (out.float() * w.float()).sum().backward()
    ref.backward(w.float())
    for t, r in zip((q, k, v), leaves):
        assert_close(t.grad, r.grad)
    assert not q.grad[-3:].any() and not k.grad[-2:].any()


def test_varlen_padded_groups_only_where_padding_is_invisible(fake_gpu, monkeypatch):
    """Not causal, a window open past the diagonal, rows != keys, or attention_chunk: no padded group (a padded key
    would be seen); FP8's descales follow their sequences into the groups."""
    from flashgen import flash_attn_varlen_func, interface

    lens = [40, 37, 3, 5, 24, 22, 7, 1]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, seed=9)
    real = interface._varlen_padded
    with monkeypatch.context() as m:
        m.setattr(interface, "_varlen_padded", lambda *a, **kw: pytest.fail("a padded group"))
        for kw in (dict(causal=False), dict(causal=False, window_size=(5, 1)), dict(causal=True, attention_chunk=16)):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, **kw)
        q2, k2, v2, cu_q2, cu_k2 = varlen_inputs(lens, [n + 1 for n in lens], seed=9)  # one key more than rows
        flash_attn_varlen_func(q2, k2, v2, cu_q2, cu_k2, 40, 41, causal=True)
    assert interface._varlen_padded is real
    q8, k8, v8 = (t.float().to(torch.float8_e4m3fn) for t in (q, k, v))
    g = torch.Generator().manual_seed(7)
    qd, kd, vd = (torch.rand(len(lens), 2, generator=g) + 0.5 for _ in range(3))
    fake_gpu.calls.clear()
    out = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 40, 40, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert len(fake_gpu.calls) < len(lens)
    for b in range(len(lens)):
        s = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, _ = attention_ref(*(dequantize_fp8(t[s][None], d[b:b + 1]) for t, d in ((q8, qd), (k8, kd), (v8, vd))),
                               True, 64 ** -0.5)
        assert (out[s].float() - ref[0]).abs().max().item() <= 2e-2


def test_head_dim_v_512_is_not_reported_with_other_errors(fake_gpu):
    """With several argument errors at once, a 16-bit head_dim_v of 512 (served as two calls) is not one of them."""
    q, k, v = qkv(d=64, dv=512)
    with pytest.raises(ValueError) as info:
        flash_attn_func(q, k, v, softcap=-1.0, window_size=(1, 2, 3))
    assert "head_dim_v" not in str(info.value) and "softcap" in str(info.value)
    q, k, v = qkv(d=64, dv=520)
    with pytest.raises(ValueError) as info:
        flash_attn_func(q, k, v, softcap=-1.0)
    assert "head_dim_v (dim 3 of v) must be a multiple of 8 between 8 and 512, got 520" in str(info.value)
