"""CPU tests of ``flashgen.flash_attn_with_kvcache`` (FA3's decoding entry, on the host side:
flashgen.kvcache) on test_api_validation's emulated core.

The reference follows FA3's hopper/test_flash_attn.py::test_flash_attn_kvcache, written out here:
the cache rows of each entry (cache_batch_idx, or the pages of page_table), the new keys / values
written at ``[cache_seqlens[b], cache_seqlens[b] + seqlen_new)`` after the rotary embedding (FA3's
``rotate_half`` form, GPT-NeoX halves or interleaved pairs), q rotated at ``cache_seqlens[b] + i``
(causal / local) or ``cache_seqlens[b]``, and attention over the positions
``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)`` with bottom-right aligned masks. The caches
after the call are checked too (FA3's test does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flashgen.core as core
from flashgen import flash_attn_with_kvcache

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from _ref import attention_ref, kvcache_reference, logical_cache  # noqa: E402,F401  (torch only: runs on the CPU)
from test_api_validation import fake_gpu  # noqa: E402,F401

H, HK, D = 6, 2, 64


def make(batch=4, sq=3, cache_len=40, new=2, page=None, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    q = r(batch, sq, H, D)
    k, v = (r(batch, new, HK, D), r(batch, new, HK, D)) if new else (None, None)
    if page is None:
        kc, vc, table = r(batch + 2, cache_len, HK, D), r(batch + 2, cache_len, HK, D), None
    else:
        pages = -(-cache_len // page)
        nblocks = pages * batch * 2
        kc, vc = r(nblocks, page, HK, D), r(nblocks, page, HK, D)
        table = torch.randperm(nblocks, generator=g)[:batch * pages].reshape(batch, pages).to(torch.int32)
    return q, k, v, kc, vc, table


def check(out, lse, ref, ref_lse):
    assert out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max().item() <= 2e-3 * max(1.0, ref.float().abs().max().item())
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


@pytest.mark.parametrize("page", [None, 1, 4, 16])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (7, 3))])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_append_and_attend_matches_fa3_semantics(fake_gpu, page, causal, window, rotary):
    q, k, v, kc, vc, table = make(page=page, seed=1)
    lens = [5, 0, 38, 17]
    leftpad = [2, 0, 30, 0]
    rows = [0, 1, 2, 3]
    rope = None
    if rotary:
        g = torch.Generator().manual_seed(9)
        angle = torch.rand(64, 16, generator=g) * 6.283
        rope = (torch.cos(angle).half(), torch.sin(angle).half())
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=None if rope is None else rope[0], rotary_sin=None if rope is None else rope[1],
        cache_seqlens=torch.tensor(lens, dtype=torch.int32), cache_leftpad=torch.tensor(leftpad, dtype=torch.int32),
        page_table=table, causal=causal, window_size=window, rotary_interleaved=rotary == "interleaved",
        return_softmax_lse=True)
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, table, lens, leftpad, rows, causal, window, rope,
                                                 rotary == "interleaved")
    check(out, lse, ref, ref_lse)
    got_k, got_v = logical_cache(kc, table, rows, 4), logical_cache(vc, table, rows, 4)
    assert torch.equal(got_v, vref)
    if rotary:
        assert torch.allclose(got_k.float(), kref.float(), atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(got_k, kref)
    if table is None:  # rows no entry uses are untouched
        assert torch.equal(kc[4:], kc0[4:]) and torch.equal(vc[4:], vc0[4:])


def test_cache_batch_idx_and_no_new_keys(fake_gpu):
    q, _, _, kc, vc, _ = make(new=0, seed=2)
    rows = [5, 0, 3, 2]
    lens = [40, 1, 9, 33]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       cache_batch_idx=torch.tensor(rows, dtype=torch.int32), causal=True,
                                       return_softmax_lse=True)
    ref, ref_lse, _, _ = kvcache_reference(q, None, None, kc, vc, None, lens, [0] * 4, rows, True, (-1, -1))
    check(out, lse, ref, ref_lse)


def test_equal_neighbours_share_one_call(fake_gpu):
    q, k, v, kc, vc, _ = make(batch=4, new=1, seed=3)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=20, causal=True)
    (call,) = fake_gpu.calls  # the 4 entries: one call on a view of the cache rows 0-3
    assert call["k"].shape == (4, 21, HK, D) and call["k"].ptr == kc.data_ptr()
    assert out.shape == (4, 3, H, D)
    out2 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=21, causal=True)  # the appended cache, read again
    assert torch.equal(out, out2)


def test_varlen_q_and_new_keys(fake_gpu):
    lens_q = [3, 1, 4]
    q_full, k, v, kc, vc, _ = make(batch=3, sq=4, new=2, seed=4)
    q = torch.cat([q_full[b, :n] for b, n in enumerate(lens_q)])
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    lens = [10, 0, 25]
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       cu_seqlens_q=cu, max_seqlen_q=4, causal=True, return_softmax_lse=True)
    assert out.shape == (8, H, D) and lse.shape == (H, 8)
    for b, n in enumerate(lens_q):
        ref, ref_lse, _, _ = kvcache_reference(q_full[b:b + 1, :n], k[b:b + 1], v[b:b + 1], kc0[b:b + 1], vc0[b:b + 1],
                                               None, [lens[b]], [0], [0], True, (-1, -1))
        s = slice(int(cu[b]), int(cu[b + 1]))
        check(out[s][None], lse[:, s][None], ref, ref_lse)


@pytest.mark.parametrize("kw,exc,fragment", [
    (dict(qv=torch.zeros(1)), NotImplementedError, "qv (absorbed MLA)"),
    (dict(k=torch.zeros(4, 2, HK, D)), ValueError, "k and v (the new keys and values) must be given together"),
    (dict(rotary_cos=torch.zeros(8, 16)), ValueError, "rotary_cos / rotary_sin need each other and the new k / v"),
    (dict(cache_seqlens=torch.tensor([41, 0, 0, 0], dtype=torch.int32)), ValueError, "must fit the cache's 40"),
    (dict(cache_seqlens=5, cache_leftpad=torch.tensor([6, 0, 0, 0], dtype=torch.int32)), ValueError,
     "cache_leftpad[0] = 6 must be between 0 and the entry's 5 tokens"),
    (dict(cache_seqlens=5, cache_batch_idx=torch.tensor([0, 1, 2, 9], dtype=torch.int32)), ValueError,
     "cache_batch_idx[3] = 9 is not a row of k_cache"),
    (dict(cache_seqlens=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "cache_seqlens must have batch = 4"),
    (dict(k=torch.zeros(4, 2, HK, D), v=torch.zeros(4, 2, HK, D)), ValueError, "cache_seqlens is needed to append"),
    (dict(k=torch.zeros(4, 2, HK, D), v=torch.zeros(4, 2, HK, D), cache_seqlens=3,
          cache_batch_idx=torch.tensor([0, 1, 1, 2], dtype=torch.int32)), ValueError,
     "cache_batch_idx must name distinct cache rows when k / v are appended"),
])
def test_kvcache_errors(fake_gpu, kw, exc, fragment):
    q, _, _, kc, vc, _ = make(new=0)
    kw = {n: (x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    with pytest.raises(exc) as info:
        flash_attn_with_kvcache(q, kc, vc, **kw)
    assert fragment in str(info.value)
    assert fake_gpu.calls == []


def test_runs_split_where_lengths_differ(fake_gpu):
    q, k, v, kc, vc, _ = make(batch=4, new=1, seed=6)
    lens = [5, 30, 30, 12]
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       causal=True, return_softmax_lse=True)
    assert [(c["k"].shape[0], c["k"].shape[1]) for c in fake_gpu.calls] == [(1, 6), (2, 31), (1, 13)]
    ref, ref_lse, _, _ = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0] * 4, [0, 1, 2, 3], True, (-1, -1))
    check(out, lse, ref, ref_lse)


def test_varlen_new_keys_and_rotary_seqlens(fake_gpu):
    """cu_seqlens_k_new: entries append different numbers of tokens; rotary_seqlens: the rotary
    positions start there instead of at cache_seqlens (the cache positions stay cache_seqlens)."""
    q, _, _, kc, vc, _ = make(batch=3, sq=2, new=0, seed=7)
    g = torch.Generator().manual_seed(8)
    new = [3, 0, 1]
    k = torch.randn(sum(new), HK, D, generator=g).half()
    v = torch.randn(sum(new), HK, D, generator=g).half()
    cu_new = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    lens, rstart = [7, 12, 30], [2, 0, 31]
    angle = torch.rand(64, 16, generator=g) * 6.283
    rope = (torch.cos(angle).half(), torch.sin(angle).half())
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=rope[0], rotary_sin=rope[1],
                                       cache_seqlens=torch.tensor(lens, dtype=torch.int32), cu_seqlens_k_new=cu_new,
                                       rotary_seqlens=torch.tensor(rstart, dtype=torch.int32), causal=True,
                                       return_softmax_lse=True)
    for b in range(3):
        kb, vb = k[int(cu_new[b]):int(cu_new[b + 1])], v[int(cu_new[b]):int(cu_new[b + 1])]
        # the reference rotates at cache_seqlens: shift the table so that position lens[b] reads row rstart[b]
        shift = lens[b] - rstart[b]
        idx = (torch.arange(64 + abs(shift)) - shift).clamp(0, 63)
        rb = (rope[0][idx], rope[1][idx])
        ref, ref_lse, kref, vref = kvcache_reference(q[b:b + 1], kb[None] if new[b] else None, vb[None] if new[b] else None,
                                                     kc0[b:b + 1], vc0[b:b + 1], None, [lens[b]], [0], [0], True,
                                                     (-1, -1), rb, True)
        check(out[b:b + 1], lse[b:b + 1], ref, ref_lse)
        assert torch.allclose(kc[b:b + 1].float(), kref.float(), atol=1e-3, rtol=1e-3) and torch.equal(vc[b:b + 1], vref)


def test_fp8_cache_with_descales(fake_gpu):
    from _ref import dequantize_fp8

    q, k, v, kc, vc, _ = make(batch=3, new=1, seed=9, dtype=torch.float32)
    q8, k8, v8, kc8, vc8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v, kc, vc))
    g = torch.Generator().manual_seed(10)
    qd, kd, vd = (torch.rand(3, HK, generator=g) + 0.5 for _ in range(3))
    lens = [4, 20, 4]
    kc80 = kc8.clone()
    out = flash_attn_with_kvcache(q8, kc8, vc8, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                  q_descale=qd, k_descale=kd, v_descale=vd, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 3, H, D)
    for b in range(3):
        kb = kc80[b, :lens[b] + 1].clone()
        kb[lens[b]] = k8[b, 0]
        assert torch.equal(kc8[b, :lens[b] + 1].view(torch.uint8), kb.view(torch.uint8))  # appended in place
        deq = [dequantize_fp8(x, d[b:b + 1]) for x, d in ((q8[b:b + 1], qd), (kc8[b:b + 1, :lens[b] + 1], kd),
                                                          (vc8[b:b + 1, :lens[b] + 1], vd))]
        ref, _ = attention_ref(*deq, True, D ** -0.5)
        assert bool(((out[b:b + 1].float() - ref).abs() <= 8e-3 * ref.abs().clamp(min=1.0)).all())


def test_errors_leave_the_cache_unwritten(fake_gpu, monkeypatch):
    q, k, v, kc, vc, _ = make(batch=2, new=2, seed=11)
    kc0 = kc.clone()
    lens = torch.tensor([3, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="k must have q's head_dim 32"):  # q against the cache, checked first
        flash_attn_with_kvcache(q[..., :32].contiguous(), kc, vc, k, v, cache_seqlens=lens)
    angle = torch.rand(31, 16)
    with pytest.raises(ValueError, match="entry 1: rotary positions up to 31 are past rotary_cos's 31 rows"):
        flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=angle.cos().half(), rotary_sin=angle.sin().half(),
                                cache_seqlens=lens)
    assert torch.equal(kc, kc0) and fake_gpu.calls == []
    # a softmax_scale that is no finite number: refused naming it, before the append, on the host path and the
    # no-host-read one (the varlen kernel's)
    for no_host_read in (False, True):
        monkeypatch.setattr(core, "VARLEN_KERNEL", no_host_read)
        monkeypatch.setattr(core, "VARLEN_NO_HOST_READ", no_host_read)
        for scale, exc, what in (([0.1], TypeError, "real number"), ("x", TypeError, "real number"),
                                 (float("inf"), ValueError, "finite")):
            with pytest.raises(exc, match=f"softmax_scale must be a {what}"):
                flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, softmax_scale=scale)
    assert torch.equal(kc, kc0) and fake_gpu.calls == []


def test_random_configurations_match_the_reference(fake_gpu):
    """80 seeded random calls (batch, lengths, page sizes, rows, leftpad, masks, rotary) against the reference."""
    import random

    rng = random.Random(0)
    for it in range(80):
        batch, sq, new = rng.randint(1, 4), rng.randint(1, 6), rng.choice([0, 1, 3])
        page = rng.choice([None, 1, 3, 8])
        causal = rng.random() < 0.5
        window = (rng.randint(0, 8), rng.randint(0, 8)) if not causal and rng.random() < 0.3 else (-1, -1)
        rotary = rng.choice([None, "interleaved", "halves"]) if new else None
        room = sq if rotary and (causal or window != (-1, -1)) else 0  # rotary rows of q past the cache
        cache_len = rng.randint(new + room + 1, 30)
        if page:
            cache_len = -(-cache_len // page) * page
        q, k, v, kc, vc, table = make(batch=batch, sq=sq, cache_len=cache_len, new=new, page=page, seed=100 + it)
        rows = list(range(batch)) if page or rng.random() < 0.5 else rng.sample(range(batch + 2), batch)
        lens = [rng.randint(0, cache_len - new - room) for _ in range(batch)]
        leftpad = [rng.randint(0, n + new) if rng.random() < 0.4 else 0 for n in lens]
        rope = None
        if rotary:
            angle = torch.rand(cache_len + sq, 16, generator=torch.Generator().manual_seed(it)) * 6.283
            rope = (angle.cos().half(), angle.sin().half())
        kc0, vc0 = kc.clone(), vc.clone()
        kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), page_table=table, causal=causal,
                  window_size=window, cache_leftpad=torch.tensor(leftpad, dtype=torch.int32), return_softmax_lse=True)
        if not page:
            kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
        if rope is not None:
            kw.update(rotary_cos=rope[0], rotary_sin=rope[1], rotary_interleaved=rotary == "interleaved")
        out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
        ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, table, lens, leftpad, rows, causal, window,
                                                     rope, rotary == "interleaved")
        check(out, lse, ref, ref_lse)
        got_k = logical_cache(kc, table, rows, batch)
        assert torch.equal(logical_cache(vc, table, rows, batch), vref)
        assert torch.allclose(got_k.float(), kref.float(), atol=1e-3, rtol=1e-3) if rotary else torch.equal(got_k, kref)


def test_scheduler_metadata_is_accepted(fake_gpu):
    """FA3's precomputed decode schedule: flashgen has none to compute (None), and the kvcache entry takes it."""
    from flashgen import get_scheduler_metadata

    q, k, v, kc, vc, _ = make(batch=2, new=1, seed=12)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    meta = get_scheduler_metadata(2, 3, 40, H, HK, D, lens, torch.float16, causal=True, max_seqlen_k_new=1)
    assert meta is None
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True, scheduler_metadata=meta)
    assert torch.equal(out, flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens, causal=True))


def test_new_key_offsets_are_checked_as_varlen_offsets(fake_gpu):
    q, _, _, kc, vc, _ = make(batch=2, new=0, seed=13)
    k = torch.zeros(5, HK, D).half()
    for cu, fragment in (([1, 2, 5], "cu_seqlens_k_new[0] must be 0, got 1"),
                         ([0, 3, 2], "cu_seqlens_k_new must be non-decreasing"),
                         ([0, 3, 6], "cu_seqlens_k_new[-1] (6) is past the 5 rows of the new k and v")):
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            flash_attn_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=3,
                                    cu_seqlens_k_new=torch.tensor(cu, dtype=torch.int32))
    assert fake_gpu.calls == []
