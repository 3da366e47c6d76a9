"""CPU tests of the varlen kernel path (core.Varlen; fwd.py ``varlen``, fwd.cu.j2 kVarlen) of
flash_attn_varlen_func and flash_attn_with_kvcache: when a call takes it (the switch core.VARLEN_KERNEL,
no gradient wanted, fp16 / bf16, no descales or attention_chunk, a built variant), that it is one launch
with the right arrays, and that its result is each sequence's attention.

No GPU: test_api_validation's emulated core (``fake_gpu``) runs the varlen launch as the kernel should
(each sequence's rows at its offsets, seqused rows of them, through the addresses it is given), so a wrong
array, offset or layout handed to the core gives a wrong result here. Whether the kernel itself does so is
tests/gpu/test_features_gpu.py's test_varlen_kernel_*.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

import flashgen.core as core
from flashgen import flash_attn_varlen_func, flash_attn_with_kvcache

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ref import BAD_VARLEN_OFFSETS, kvcache_reference, logical_cache  # noqa: E402  (torch only: runs on the CPU)
from test_api_validation import fake_gpu  # noqa: E402,F401  (a fixture)
from test_bwd_api import gpu  # noqa: E402,F401  (a fixture: the emulated backward)
from test_chunk_api import varlen_inputs, varlen_reference  # noqa: E402
from test_kvcache_api import check, make  # noqa: E402


REAL_ATTENTION_FORWARD = core.attention_forward  # (fake_gpu replaces it for the tests' duration)


@pytest.fixture
def kernel_on(fake_gpu, monkeypatch):
    monkeypatch.setattr(core, "VARLEN_KERNEL", True)
    return fake_gpu


def varlen_calls(fc) -> list:
    return [c for c in fc.calls if c.get("varlen") is not None]


def bound_ok(bound: int, longest: int, rows: int | None = None) -> bool:
    """interface._key_bound's contract for a call whose kernel reads each sequence's key count: max_seqlen_k at
    least the longest sequence's keys and below twice it, a power of two unless capped by a padded k's ``rows``."""
    if rows is not None and bound > rows:
        return False
    return longest <= bound < 2 * longest and (bound & (bound - 1) == 0 or bound == rows)


def check_varlen(out, lse, ref, ref_lse):
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert (out.float() - ref).abs().max().item() <= 2e-3
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], ref_lse[finite], atol=1e-5)


@pytest.mark.parametrize("lens_q,lens_k,used,causal,window,pad_q", [
    ([5, 17, 1, 33], [7, 17, 40, 2], False, True, (-1, -1), 3),
    ([5, 17, 1, 33], [7, 17, 40, 2], False, False, (3, 2), 0),
    ([9, 0, 4], [0, 6, 11], False, False, (-1, -1), 2),  # an empty query sequence, a sequence with no key
    ([11, 20, 7], [13, 25, 30], True, True, (-1, -1), 1),  # seqused_q / seqused_k
    ([64, 64, 64], [64, 64, 64], False, True, (-1, -1), 0),  # equal lengths: one launch either way
])
def test_varlen_kernel_is_one_launch_of_each_sequences_attention(kernel_on, lens_q, lens_k, used, causal, window,
                                                                  pad_q):
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=pad_q, pad_k=2, seed=4)
    used_q = [max(0, n - 2) for n in lens_q] if used else list(lens_q)
    used_k = [max(0, n - 3) for n in lens_k] if used else list(lens_k)
    kw = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32), seqused_k=torch.tensor(used_k, dtype=torch.int32)) \
        if used else {}
    sink = torch.randn(4, generator=torch.Generator().manual_seed(2))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + 5, max(lens_k), causal=causal,
                                      window_size=window, learnable_sink=sink, return_attn_probs=True, **kw)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal, window, sink=sink)
    check_varlen(out, lse, ref, ref_lse)
    (call,) = kernel_on.calls
    vl = call["varlen"]
    assert call["variant"].dispatch["varlen"] is True
    # the sequences' longest used lengths size the grid (not the caller's max_seqlen_q)
    assert (vl.batch, vl.max_seqlen_q) == (len(lens_q), max(used_q)) and bound_ok(vl.max_seqlen_k, max(used_k))
    assert bool(vl.seqused_q) == used and bool(vl.seqused_k) == used
    assert call["q"].ptr == q.data_ptr() and call["q"].shape == tuple(q.shape)  # packed q read in place
    assert call["out"].ptr == out.data_ptr() and call["lse"].shape == (4, q.shape[0])
    # the composed path (the switch off) gives the same out and lse
    core.VARLEN_KERNEL = False
    out2, lse2 = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + 5, max(lens_k), causal=causal,
                                        window_size=window, learnable_sink=sink, return_attn_probs=True, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_unused_rows_are_zero_and_minus_inf(kernel_on):
    """Rows no sequence uses (past seqused, past the last offset) are 0 in out and -inf in lse, as in FA3."""
    q, k, v, cu_q, cu_k = varlen_inputs([6, 9], [8, 8], pad_q=4, seed=1)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 8, seqused_q=torch.tensor([2, 9], dtype=torch.int32),
                                      return_attn_probs=True)
    assert len(varlen_calls(kernel_on)) == 1
    for rows in (slice(2, 6), slice(15, 19)):
        assert not out[rows].any() and torch.isneginf(lse[:, rows]).all()
    assert out[:2].abs().sum() > 0 and torch.isfinite(lse[:, 6:15]).all()


def test_calls_the_varlen_kernel_does_not_take(kernel_on, monkeypatch):
    monkeypatch.setattr(core, "VARLEN_BWD_KERNEL", False)  # (the forward kernel alone; with the backward on, a
    # gradient is served too: test_varlen_backward_*)
    q, k, v, cu_q, cu_k = varlen_inputs([5, 17, 3], [7, 17, 40], seed=5)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, [5, 17, 3], [7, 17, 40], True)

    def run(**kw):
        kernel_on.calls.clear()
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True, return_attn_probs=True, **kw)
        check_varlen(out.detach(), lse.detach(), ref, ref_lse)
        return varlen_calls(kernel_on)

    assert len(run()) == 1
    with torch.no_grad():  # no gradient wanted, even from leaves that require one
        q.requires_grad_(True)
        assert len(run()) == 1
    assert run() == [] and len(kernel_on.calls) == 3  # a gradient wanted: per-sequence calls
    q.requires_grad_(False)
    # attention_chunk larger than every sequence (the result is unchanged): still composed
    assert run(attention_chunk=64) == []
    # no varlen variant built for the key: the composed path serves it
    select = kernel_on.select_variant

    def no_varlen(family, key, manifest=None):
        if key.get("varlen"):
            raise core.MissingVariantError("no varlen variant")
        return select(family, key, manifest)

    monkeypatch.setattr(core, "select_variant", no_varlen)
    assert run() == [] and len(kernel_on.calls) == 3


def test_fp8_varlen_is_composed(kernel_on):
    q, k, v, cu_q, cu_k = varlen_inputs([17, 30], [17, 30], dtype=torch.float32)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 30, 30, causal=True)
    assert varlen_calls(kernel_on) == [] and len(kernel_on.calls) == 1  # composed: one padded group (rows == keys)


def test_bad_window_is_refused_before_any_launch(kernel_on):
    q, k, v, cu_q, cu_k = varlen_inputs([5, 7], [5, 7])
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, window_size=(-2, 0))
    assert kernel_on.calls == []


def test_random_varlen_calls_match_the_reference(kernel_on):
    """60 seeded random varlen calls (lengths 0-70, seqused, padding, GQA, masks, sink) on the kernel path."""
    rng = random.Random(11)
    for it in range(60):
        n = rng.randint(1, 5)
        lens_q = [rng.randint(0, 70) for _ in range(n)]
        lens_k = [rng.randint(0, 70) for _ in range(n)]
        used_q = [rng.randint(0, x) for x in lens_q] if rng.random() < 0.3 else list(lens_q)
        used_k = [rng.randint(0, x) for x in lens_k] if rng.random() < 0.3 else list(lens_k)
        h, hk = rng.choice([(4, 2), (4, 4), (6, 1)])
        causal = rng.random() < 0.5
        window = (rng.randint(0, 20), rng.randint(0, 20)) if not causal and rng.random() < 0.4 else (-1, -1)
        q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, h=h, hk=hk, pad_q=rng.randint(0, 3), seed=200 + it)
        sink = torch.randn(h, generator=torch.Generator().manual_seed(it)) if rng.random() < 0.3 else None
        kernel_on.calls.clear()
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          torch.tensor(used_q, dtype=torch.int32),
                                          torch.tensor(used_k, dtype=torch.int32), causal=causal, window_size=window,
                                          learnable_sink=sink, return_attn_probs=True)
        ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal, window, sink=sink)
        check_varlen(out, lse, ref, ref_lse)
        if max(used_q) and max(used_k):  # (else nothing to compute: the composed path, which launches nothing)
            assert len(varlen_calls(kernel_on)) == 1 and len(kernel_on.calls) == 1


# ------------------------------------------------------------------------------------------------ kvcache
@pytest.mark.parametrize("varlen_q", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (7, 3))])
def test_kvcache_is_one_launch_over_each_entrys_length(kernel_on, varlen_q, rotary, causal, window):
    """An unpaged cache without leftpad or batch_idx: after the append, one launch over cache rows 0..batch-1,
    each entry's length (cache_seqlens + its new tokens) as seqused_k."""
    q, k, v, kc, vc, _ = make(batch=4, sq=3, cache_len=40, new=2, seed=3)
    lens = [5, 0, 37, 17]
    rope = None
    kw = {}
    if rotary:
        angle = torch.rand(64, 16, generator=torch.Generator().manual_seed(9)) * 6.283
        rope = (torch.cos(angle).half(), torch.sin(angle).half())
        kw.update(rotary_cos=rope[0], rotary_sin=rope[1], rotary_interleaved=True)
    kc0, vc0 = kc.clone(), vc.clone()
    qin = q
    if varlen_q:
        qin = q.flatten(0, 1)
        kw.update(cu_seqlens_q=torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32), max_seqlen_q=3)
    out, lse = flash_attn_with_kvcache(qin, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       causal=causal, window_size=window, return_softmax_lse=True, **kw)
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0] * 4, list(range(4)), causal,
                                                 window, rope, True)
    if varlen_q:  # FA3's varlen layouts
        ref, ref_lse = ref.flatten(0, 1), ref_lse.transpose(0, 1).flatten(1, 2)
    check(out, lse, ref, ref_lse)
    (call,) = kernel_on.calls
    vl = call["varlen"]
    assert (vl.batch, vl.max_seqlen_q, vl.max_seqlen_k) == (4, 3, 40)  # 39 keys: 64 capped at the cache's 40 rows
    assert vl.cu_seqlens_k == 0 and vl.seqused_q == 0 and bool(vl.cu_seqlens_q) == varlen_q and vl.seqused_k
    assert call["k"].ptr == kc.data_ptr() and call["k"].shape == (4, 40, 2, 64)  # the cache's first 4 rows in place
    assert torch.equal(logical_cache(vc, None, list(range(4)), 4), vref)
    got_k = logical_cache(kc, None, list(range(4)), 4)
    assert torch.allclose(got_k.float(), kref.float(), atol=1e-3) if rotary else torch.equal(got_k, kref)


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("kernel", [False, True])
def test_kvcache_varlen_q_rows_past_the_last_entry(fake_gpu, monkeypatch, kernel, rotary):
    """q's rows past cu_seqlens_q[-1] belong to no entry: out 0 and lse -inf there, out of q's shape, on either
    path (the composed one used to return only the entries' rows)."""
    monkeypatch.setattr(core, "VARLEN_KERNEL", kernel)
    q, k, v, kc, vc, _ = make(batch=2, sq=3, cache_len=20, new=1, seed=8)
    lens = [4, 11]
    qp = torch.cat([q.flatten(0, 1), torch.randn(2, *q.shape[2:]).half()])  # 6 rows of the entries + 2 past them
    kc0, vc0 = kc.clone(), vc.clone()
    rope, kw = None, {}
    if rotary:
        angle = torch.rand(32, 16, generator=torch.Generator().manual_seed(4)) * 6.283
        rope = (torch.cos(angle).half(), torch.sin(angle).half())
        kw = dict(rotary_cos=rope[0], rotary_sin=rope[1])
    out, lse = flash_attn_with_kvcache(qp, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen_q=3,
                                       causal=True, return_softmax_lse=True, **kw)
    ref, ref_lse, _, _ = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0, 0], [0, 1], True, (-1, -1), rope, True)
    assert out.shape == (8, *q.shape[2:]) and lse.shape == (q.shape[2], 8)
    check(out[:6], lse[:, :6], ref.flatten(0, 1), ref_lse.transpose(0, 1).flatten(1, 2))
    assert not out[6:].any() and torch.isneginf(lse[:, 6:]).all()
    assert len(varlen_calls(fake_gpu)) == (1 if kernel else 0)


@pytest.mark.parametrize("kw,kernel", [
    (dict(page=8), True), (dict(page=16), True), (dict(leftpad=True), True), (dict(rows=True), True),
    (dict(leftpad=True, rows=True), True),
    (dict(page=4), False),  # pages of fewer than 8 rows: no TMA box of whole pages
    (dict(page=8, leftpad=True), False),  # a box would cross a page
])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (5, 2))])
def test_kvcache_paged_leftpad_batch_idx(kernel_on, kw, kernel, causal, window):
    """A paged cache (pages of a multiple of 8 rows), cache_leftpad and cache_batch_idx run on the varlen kernel,
    one launch whose Varlen carries them (k / v whole: pages or cache rows); pages of 4 rows, or pages with left
    padding, are composed. FA3's result and caches either way."""
    q, k, v, kc, vc, table = make(batch=3, sq=2, cache_len=24, new=1, page=kw.get("page"), seed=6)
    lens = [3, 10, 20]
    leftpad = [1, 0, 4] if kw.get("leftpad") else [0, 0, 0]
    rows = [4, 0, 2] if kw.get("rows") else [0, 1, 2]
    kc0, vc0 = kc.clone(), vc.clone()
    args = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), page_table=table, causal=causal,
                window_size=window, return_softmax_lse=True, cache_leftpad=torch.tensor(leftpad, dtype=torch.int32))
    if kw.get("rows"):
        args["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, **args)
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, table, lens, leftpad, rows, causal, window, None,
                                                 True)
    check(out, lse, ref, ref_lse)
    assert torch.equal(logical_cache(kc, table, rows, 3), kref) and torch.equal(logical_cache(vc, table, rows, 3), vref)
    calls = varlen_calls(kernel_on)
    if not kernel:
        assert calls == [] and len(kernel_on.calls) == 3
        return
    (call,) = kernel_on.calls
    vl = call["varlen"]
    assert bool(vl.page_table) == ("page" in kw) and bool(vl.leftpad_k) == bool(kw.get("leftpad"))
    assert bool(vl.kv_batch_idx) == bool(kw.get("rows")) and vl.seqused_k and not vl.cu_seqlens_k
    whole = "page" in kw or kw.get("rows")  # the whole cache (its pages or rows), else its entries' rows
    assert call["k"].shape[0] == (kc.shape[0] if whole else 3)
    if "page" in kw:
        assert (vl.page_size, vl.page_table_stride) == (kw["page"], table.shape[1])
    rows = table.shape[1] * kw["page"] if "page" in kw else kc.shape[1]  # the capacity: its pages' positions or rows
    assert bound_ok(vl.max_seqlen_k, max(n + 1 - p for n, p in zip(lens, leftpad)), rows)


# ------------------------------------------------------------------------- kvcache under CUDA-graph capture
@pytest.mark.parametrize("prep", [False, True], ids=["torch_append", "prep_kernel"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (False, (7, 3))])
def test_kvcache_step_on_device_reads_no_length_on_the_host(kernel_on, monkeypatch, rotary, causal, window, prep):
    """kvcache._step_on_device (flash_attn_with_kvcache under CUDA-graph capture): the lengths stay tensors (a
    read of one on the host fails here), q's rotary is tensor ops, the checks, the append and seqused_k =
    cache_seqlens + new are tensor ops or (``prep``) one launch of the kvcache kernel (emulated), then one varlen
    launch with the cache's capacity as max_seqlen_k; the result is FA3's."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", prep)
    monkeypatch.setattr(core, "KVCACHE_ROTARY_KERNEL", True)

    q, k, v, kc, vc, _ = make(batch=4, sq=3, cache_len=40, new=2, seed=11)
    lens = [5, 0, 30, 17]
    rope, kw = None, {}
    if rotary:
        angle = torch.rand(64, 16, generator=torch.Generator().manual_seed(3)) * 6.283
        rope = (torch.cos(angle).half(), torch.sin(angle).half())
        kw = dict(rotary_cos=rope[0], rotary_sin=rope[1])
    kc0, vc0 = kc.clone(), vc.clone()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a length read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a length read on the host"))
    out, lse = kvcache._step_on_device(q, kc, vc, k, v, kw.get("rotary_cos"), kw.get("rotary_sin"), lens_t, None,
                                       (None, None, None), None, causal, window, 0, 0.0, rotary == "interleaved")
    monkeypatch.undo()
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0] * 4, list(range(4)), causal, window,
                                                 rope, rotary == "interleaved")
    check(out, lse, ref, ref_lse)
    (call,) = kernel_on.calls
    vl = call["varlen"]
    assert (vl.batch, vl.max_seqlen_q, vl.max_seqlen_k) == (4, 3, 40) and vl.seqused_k and not vl.cu_seqlens_k
    got_k, got_v = logical_cache(kc, None, list(range(4)), 4), logical_cache(vc, None, list(range(4)), 4)
    assert torch.equal(got_v, vref)
    assert torch.allclose(got_k.float(), kref.float(), atol=1e-3) if rotary else torch.equal(got_k, kref)
    assert torch.equal(kc[4:], kc0[4:])  # rows past the batch untouched
    assert len(kernel_on.kvcache_preps) == int(prep)
    assert kernel_on.kvcache_ropes == ([rotary is not None] if prep else [])  # (the kernel rotates where it runs)


@pytest.mark.parametrize("page", [None, 8])
def test_decode_steps_of_growing_caches_share_one_launch_key(kernel_on, page):
    """A decode loop appends one token per entry a step: the longest cache grows every step, but the launch's
    metadata (Varlen.meta(), core.prepare_forward's key) stays the same within a power of two of it, so the steps
    reuse one prepared launch; each step's result is still FA3's."""
    q, _, _, kc, vc, table = make(batch=3, sq=1, cache_len=200, new=0, page=page, seed=21)
    metas = set()
    for step in range(40):  # longest cache 70..109 keys: one power of two (128)
        lens = [70 + step, 40 + step, 7]
        kernel_on.calls.clear()
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                           page_table=table, causal=True, return_softmax_lse=True)
        if step % 13 == 0:
            ref, ref_lse, _, _ = kvcache_reference(q, None, None, kc, vc, table, lens, [0] * 3, list(range(3)), True,
                                                   (-1, -1))
            check(out, lse, ref, ref_lse)
        (call,) = kernel_on.calls
        assert bound_ok(call["varlen"].max_seqlen_k, max(lens), table.shape[1] * page if page else kc.shape[1])
        metas.add(call["varlen"].meta())
    assert len(metas) == 1


@pytest.mark.parametrize("prep", [False, True], ids=["torch_append", "prep_kernel"])
@pytest.mark.parametrize("cache", ["page8", "rows", "leftpad", "rows+leftpad"])
def test_kvcache_step_on_device_with_a_cache_layout(kernel_on, monkeypatch, cache, prep):
    """Under capture, a paged cache, cache_batch_idx and cache_leftpad (tensors on q's device) are one varlen launch
    with no length read on the host: the append goes to each entry's row or pages (torch ops, or with ``prep`` the
    kvcache kernel, emulated), the result is FA3's."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", prep)

    page = 8 if cache == "page8" else None
    q, k, v, kc, vc, table = make(batch=3, sq=2, cache_len=40, new=2, page=page, seed=13)
    lens = [5, 0, 30]
    rows = [4, 0, 2] if "rows" in cache else [0, 1, 2]
    leftpad = [2, 0, 29] if "leftpad" in cache else [0, 0, 0]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    kc0, vc0 = kc.clone(), vc.clone()
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a length read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a length read on the host"))
    out, lse = kvcache._step_on_device(q, kc, vc, k, v, None, None, i32(lens), None, (None, None, None), None, True,
                                       (-1, -1), 0, 0.0, True, None, i32(rows) if "rows" in cache else None,
                                       i32(leftpad) if "leftpad" in cache else None, table)
    monkeypatch.undo()
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, table, lens, leftpad, rows, True, (-1, -1))
    check(out, lse, ref, ref_lse)
    assert torch.equal(logical_cache(kc, table, rows, 3), kref) and torch.equal(logical_cache(vc, table, rows, 3), vref)
    (call,) = kernel_on.calls
    # the cache's capacity (40 positions: its rows or its pages'), as the bound (64 capped at the capacity)
    assert bool(call["varlen"].page_table) == (page is not None) and call["varlen"].max_seqlen_k == 40
    assert [p[-1] for p in kernel_on.kvcache_preps] == ([2] if prep else [])  # (one launch, 2 new tokens)


def test_kvcache_page_numbers_are_checked_before_any_write(kernel_on):
    """Eager: a used page past the pool (or negative) is a ValueError naming it, before the append; a page past an
    entry's tokens is never read and not checked."""
    q, k, v, kc, vc, table = make(batch=2, sq=1, cache_len=16, new=1, page=8, seed=2)
    kc0 = kc.clone()
    lens = torch.tensor([3, 4], dtype=torch.int32)
    for page in (kc.shape[0], -1):
        bad = table.clone()
        bad[1, 0] = page
        with pytest.raises(ValueError, match=f"page_table\\[1\\] names page {page}"):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=bad, causal=True)
        assert torch.equal(kc, kc0) and kernel_on.calls == []
    bad = table.clone()
    bad[1, 1] = -7
    flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=bad, causal=True)
    assert len(kernel_on.calls) == 1


@pytest.mark.parametrize("prep", [False, True], ids=["torch_checks", "prep_kernel"])
def test_kvcache_step_on_device_refuses_what_the_kernel_does_not_serve_and_checks_on_the_device(kernel_on, monkeypatch,
                                                                                                prep):
    """Pages of 4 rows are refused before the append (NotImplementedError); a cache row named twice by an append and
    a used page out of range are errors of the stream (torch._assert_async, at once on the CPU; ``prep``: the
    kvcache kernel's asserts, emulated), before the attention (the torch path: before any write)."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", prep)

    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    q, k, v, kc, vc, table = make(batch=2, sq=1, cache_len=16, new=1, page=4, seed=2)
    kc0 = kc.clone()
    with pytest.raises(NotImplementedError, match="pages of a multiple of 8 rows"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, i32([3, 4]), None, (None, None, None), None, True,
                                (-1, -1), 0, 0.0, True, None, None, None, table)
    assert torch.equal(kc, kc0) and kernel_on.calls == []
    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    kc0 = kc.clone()
    with pytest.raises(RuntimeError, match="cache_batch_idx must name distinct rows"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, i32([3, 4]), None, (None, None, None), None, True,
                                (-1, -1), 0, 0.0, True, None, i32([1, 1]))
    q, k, v, kc, vc, table = make(batch=2, sq=1, cache_len=16, new=1, page=8, seed=2)
    kc0 = kc.clone()
    bad = table.clone()
    bad[1, 0] = kc.shape[0]  # entry 1's first page, which its 5 tokens use
    with pytest.raises(RuntimeError, match="page_table's used entries"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, i32([3, 4]), None, (None, None, None), None, True,
                                (-1, -1), 0, 0.0, True, None, None, None, bad)
    bad = table.clone()
    bad[1, 1] = -7  # a page past entry 1's tokens: never read, not checked
    kvcache._step_on_device(q, kc, vc, k, v, None, None, i32([3, 4]), None, (None, None, None), None, True,
                            (-1, -1), 0, 0.0, True, None, None, None, bad)
    assert len(kernel_on.calls) == 1
    assert len(kernel_on.kvcache_preps) == (3 if prep else 0)  # (the kernel's launches: the two broken, the good one)


def test_kvcache_step_on_device_needs_the_varlen_kernel(fake_gpu, monkeypatch):
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_KERNEL", False)

    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    kc0 = kc.clone()
    with pytest.raises(NotImplementedError, match="varlen kernel"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, torch.tensor([3, 4], dtype=torch.int32), None,
                                (None, None, None), None, True, (-1, -1), 0, 0.0, True)
    assert torch.equal(kc, kc0) and fake_gpu.calls == []  # refused before the append
    with pytest.raises(ValueError, match="cache_seqlens must be an int32 \\(2,\\) tensor"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, torch.tensor([3, 4]), None, (None, None, None), None,
                                True, (-1, -1), 0, 0.0, True)


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("length", [None, 0, 21])
@pytest.mark.parametrize("rotary", [None, "interleaved"])
def test_kvcache_step_on_device_with_one_length_is_a_flash_attn_func_call(fake_gpu, monkeypatch, kernel, length,
                                                                           rotary):
    """Under capture, cache_seqlens as an int or None (one length for every entry, known on the host): the append is a
    slice and the attention one flash_attn_func call on the cache's first rows, with or without the varlen kernel
    (so a capture that worked before the varlen kernel still does); no length read from a tensor."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_KERNEL", kernel)
    new = 0 if length is None else 2  # (the cache full: nothing to append)
    q, k, v, kc, vc, _ = make(batch=3, sq=2, cache_len=40, new=new, seed=5)
    rope = None
    if rotary:
        angle = torch.rand(64, 16, generator=torch.Generator().manual_seed(3)) * 6.283
        rope = (torch.cos(angle).half(), torch.sin(angle).half())
    kc0, vc0 = kc.clone(), vc.clone()
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a length read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a length read on the host"))
    out, lse = kvcache._step_on_device(q, kc, vc, k, v, rope and rope[0], rope and rope[1], length, None,
                                       (None, None, None), None, True, (-1, -1), 0, 0.0, True)
    monkeypatch.undo()
    lens = [40 if length is None else length] * 3
    ref, ref_lse, kref, vref = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0] * 3, list(range(3)), True, (-1, -1),
                                                 rope, True)
    check(out, lse, ref, ref_lse)
    assert varlen_calls(fake_gpu) == [] and len(fake_gpu.calls) == 1
    got_k, got_v = logical_cache(kc, None, list(range(3)), 3), logical_cache(vc, None, list(range(3)), 3)
    assert torch.equal(got_v, vref)
    assert torch.allclose(got_k.float(), kref.float(), atol=1e-3) if rotary else torch.equal(got_k, kref)
    assert torch.equal(kc[3:], kc0[3:])
    with pytest.raises(ValueError, match="cache_seqlens 39 \\+ 2 new tokens must fit"):
        kvcache._step_on_device(q, kc, vc, *make(batch=3, sq=2, new=2)[1:3], None, None, 39, None, (None, None, None),
                                None, True, (-1, -1), 0, 0.0, True)


def test_kvcache_step_on_device_refuses_before_the_append_without_a_variant(kernel_on, monkeypatch):
    """A tensor of lengths whose call no varlen variant serves (softcap: none is built) is refused before the cache is
    written: a capture cannot fall back to the composed path."""
    from flashgen import kvcache

    real = core.select_variant

    def no_softcap(family, key, *a, **kw):
        if key.get("varlen") and key.get("softcap"):
            raise core.MissingVariantError("no varlen softcap variant")
        return real(family, key, *a, **kw)

    monkeypatch.setattr(core, "select_variant", no_softcap)
    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    kc0 = kc.clone()
    with pytest.raises(NotImplementedError, match="varlen variant built"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, torch.tensor([3, 4], dtype=torch.int32), None,
                                (None, None, None), None, True, (-1, -1), 0, 5.0, True)
    assert torch.equal(kc, kc0) and kernel_on.calls == []


def test_varlen_variant_built_looks_up_a_found_key_once(kernel_on, monkeypatch):
    """varlen_variant_built (asked by every captured decode step) reads the manifest for a key until it is found,
    then not again (it cost about 140 us a call: the manifest's paths and stat); a miss is looked up each time."""
    real, asked = core.select_variant, []

    def counted(family, key, *a, **kw):
        asked.append(key)
        if key.get("softcap"):
            raise core.MissingVariantError("no varlen softcap variant")
        return real(family, key, *a, **kw)

    monkeypatch.setattr(core, "select_variant", counted)
    monkeypatch.setattr(core, "_built", set())
    for _ in range(3):
        assert core.varlen_variant_built("bf16", 128, 128, True, (-1, -1), 64, 512, 0.0)
    assert len(asked) == 1 and asked[0]["varlen"] and asked[0]["causal"]
    for _ in range(2):
        assert not core.varlen_variant_built("bf16", 128, 128, True, (-1, -1), 64, 512, 5.0)
    assert len(asked) == 3
    # another mask is another key
    assert core.varlen_variant_built("bf16", 128, 128, False, (-1, -1), 64, 512, 0.0) and len(asked) == 4


def test_varlen_forward_refuses_a_padded_side_shorter_than_its_max_seqlen(kernel_on):
    """core.attention_forward(varlen=...) with a padded q (or k) of fewer rows than max_seqlen_q (max_seqlen_k): the
    kernel would read and write rows past each entry's: ValueError naming it (the real core, not the emulator)."""
    q, _, _, kc, vc, _ = make(batch=2, sq=8, cache_len=16, new=0, seed=2)
    arg = lambda t: core.TensorArg(0x10000, tuple(t.shape), tuple(t.stride()), "fp16", 0)
    operands = (arg(q), arg(kc[:2]), arg(vc[:2]), arg(q))
    core._varlen_operands(*operands, core.Varlen(0, 0, 0, 0, 2, 8, 16), (None, None, None), None)  # (fits)
    for max_q, max_k, name in ((9, 16, "max_seqlen_q = 9 is past q's 8 rows"), (8, 17, "max_seqlen_k = 17")):
        with pytest.raises(ValueError, match=name):
            core._varlen_operands(*operands, core.Varlen(0, 0, 0, 0, 2, max_q, max_k), (None, None, None), None)


@pytest.mark.parametrize("prep", [False, True], ids=["torch_checks", "prep_kernel"])
@pytest.mark.parametrize("lens", [[3, -1], [3, 16]])
def test_kvcache_step_on_device_checks_the_lengths_on_the_device(kernel_on, monkeypatch, lens, prep):
    """Lengths below 0 or past the cache (with the new token) are an error of the stream (torch._assert_async, raised at
    once on the CPU; ``prep``: the kvcache kernel's assert, emulated), before anything is written: not a write to
    other rows of the cache."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", prep)
    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    kc0 = kc.clone()
    with pytest.raises(RuntimeError, match="cache_seqlens \\+ the new tokens must lie between 0 and the cache's"):
        kvcache._step_on_device(q, kc, vc, k, v, None, None, torch.tensor(lens, dtype=torch.int32), None,
                                (None, None, None), None, True, (-1, -1), 0, 0.0, True)
    assert torch.equal(kc, kc0) and kernel_on.calls == []


@pytest.mark.parametrize("prep", [False, True], ids=["torch_checks", "prep_kernel"])
@pytest.mark.parametrize("starts,causal", [([3, -1], True), ([3, 62], True), ([3, 63], False), ([62, 2], True)])
def test_kvcache_step_on_device_checks_the_rotary_positions_on_the_device(kernel_on, monkeypatch, starts, causal,
                                                                        prep):
    """Rotary positions (rotary_seqlens, here up to its last new key or, causal, q row; 64 rows of rotary_cos) below
    0 or past the table are an error of the stream naming the argument, on both paths (torch._assert_async; the
    kvcache kernel's assert, emulated), before anything is written; the last fitting start passes."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", prep)
    monkeypatch.setattr(core, "KVCACHE_ROTARY_KERNEL", True)
    q, k, v, kc, vc, _ = make(batch=2, sq=3, cache_len=16, new=2, seed=2)
    angle = torch.rand(64, 8, generator=torch.Generator().manual_seed(3))
    cos, sin = torch.cos(angle).half(), torch.sin(angle).half()
    kc0 = kc.clone()
    call = lambda s: kvcache._step_on_device(  # noqa: E731
        q, kc, vc, k, v, cos, sin, torch.tensor([4, 5], dtype=torch.int32), torch.tensor(s, dtype=torch.int32),
        (None, None, None), None, causal, (-1, -1), 0, 0.0, True)
    with pytest.raises(RuntimeError, match="rotary positions .* must lie within rotary_cos's rows"):
        call(starts)
    assert torch.equal(kc, kc0) and kernel_on.calls == []
    call([3, 64 - (3 if causal else 2)])  # (the last rows of the table: fits)
    assert len(kernel_on.calls) == 1 and kernel_on.kvcache_ropes == ([True, True] if prep else [])
    monkeypatch.setattr(core, "KVCACHE_ROTARY_KERNEL", False)  # (the switch off: torch ops rotate, the kernel appends)
    call([3, 5])
    assert len(kernel_on.calls) == 2 and kernel_on.kvcache_ropes == ([True, True, False] if prep else [])


@pytest.mark.parametrize("table", ["aligned", "strided", "misaligned"])
def test_kvcache_kernel_rotates_only_with_16_byte_aligned_tables(kernel_on, monkeypatch, table):
    """The kvcache kernel reads rotary_cos / rotary_sin with 8- and 16-byte loads, so it rotates only where the
    contiguous tables (a strided view's copy) start on 16 bytes; a contiguous view 2 bytes in is rotated by the torch
    ops, to the same result (the emulated core)."""
    from flashgen import kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", True)
    monkeypatch.setattr(core, "KVCACHE_ROTARY_KERNEL", True)
    angle = torch.rand(64, 8, generator=torch.Generator().manual_seed(3))
    cos, sin = torch.cos(angle).half(), torch.sin(angle).half()
    if table == "strided":  # (every other column of a (64, 16) table: copied, aligned)
        cos, sin = (torch.stack((t, t), dim=-1).flatten(-2)[:, ::2] for t in (cos, sin))
        assert not cos.is_contiguous()
    elif table == "misaligned":  # (one element into a bigger buffer: contiguous, 2 bytes past 16)
        cos, sin = (torch.cat((t.flatten()[:1], t.flatten()))[1:].view(64, 8) for t in (cos, sin))
        assert cos.is_contiguous() and cos.data_ptr() % 16 == 2
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(core, "KVCACHE_ROTARY_KERNEL", kernel)
        q, k, v, kc, vc, _ = make(batch=2, sq=3, cache_len=16, new=2, seed=2)
        out = kvcache._step_on_device(q, kc, vc, k, v, cos, sin, torch.tensor([4, 5], dtype=torch.int32), None,
                                      (None, None, None), None, True, (-1, -1), 0, 0.0, True)
        outs.append((out[0] if isinstance(out, tuple) else out, kc))
    assert kernel_on.kvcache_ropes == [table != "misaligned", False]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ------------------------------------------------------------------------- split-KV (flash-decoding)
def test_varlen_num_splits_heuristic(monkeypatch):
    """Splits where the tiles leave SMs idle and the keys are long, none otherwise (132 SMs)."""
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)
    # decode, 8 caches of 32k keys, GQA 32 / 8 (PackGQA: 64 tiles): FA3's rule takes 2 splits (128 of 132 SMs);
    # the decode rule one per 32 key blocks: 8 (measured 9 % faster on an H100, core.DECODE_SPLIT_BLOCKS)
    assert core.varlen_num_splits(8, 32, 8, 1, 32768, 0) == 8
    monkeypatch.setattr(core, "DECODE_SPLIT_BLOCKS", 0)
    assert core.varlen_num_splits(8, 32, 8, 1, 32768, 0) == 2
    monkeypatch.setattr(core, "DECODE_SPLIT_BLOCKS", 32)
    assert core.varlen_num_splits(8, 32, 8, 1, 4096, 0) == 2  # 32 key blocks: FA3's 2 stands
    assert core.varlen_num_splits(16, 32, 8, 1, 32768, 0) == 1  # 128 tiles fill the SMs: no split, whatever the keys
    assert core.varlen_num_splits(1, 32, 32, 64, 32768, 0) == 8  # MHA decode of 64 rows (32 tiles): decode-like
    assert core.varlen_num_splits(1, 32, 32, 256, 32768, 0) == 2  # 2 query blocks a tile: FA3's rule alone
    assert core.varlen_num_splits(1, 32, 8, 1, 32768, 0) > 8  # 8 tiles: many splits
    assert core.varlen_num_splits(64, 32, 8, 1, 32768, 0) == 1  # 512 tiles fill the GPU
    assert core.varlen_num_splits(8, 32, 8, 1, 512, 0) == 1  # 4 key blocks: not worth it
    n = core.varlen_num_splits(1, 8, 8, 1, 300 * 128, 0)
    assert 1 < n <= 128 and (8 * n / 132) / -(-8 * n // 132) >= 0.85 * max(
        (8 * m / 132) / -(-8 * m // 132) for m in range(1, 129))


def test_modelled_splits_of_padded_decodes(monkeypatch):
    """Decode-like calls of a padded batch (kv_bytes_per_key > 0: flash_attn_func, the DLPack entry, a kvcache call
    without lengths) take the cost model's count (core.SPLIT_MODEL): the fastest measured count of
    docs/results/split_sweep_h100/ (bf16, heads 32, H100: 132 SMs, 3.35e6 bytes per us) where FA3's rule was off, FA3's
    where it was right; lengths not known (0) or SPLIT_MODEL off: FA3's rule and the decode floor, as before."""
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(core.launch, "dram_bandwidth", lambda device: 3.35e6)

    def model(batch, group, seqlen_k, head_dim, seqlen_q=1):
        return core.varlen_num_splits(batch, 32, 32 // group, seqlen_q, seqlen_k, 0, None, 4 * head_dim)

    def fa3(batch, group, seqlen_k, seqlen_q=1):
        return core.varlen_num_splits(batch, 32, 32 // group, seqlen_q, seqlen_k, 0)

    # 64 tiles of hd64: 1k keys unsplit (FA3's 2 splits measured 0.88x), from 2k 2 splits (1.06-1.27x)
    assert (model(16, 8, 1024, 64), fa3(16, 8, 1024)) == (1, 2)
    assert [model(16, 8, n, 64) for n in (2048, 4096, 8192)] == [2, 2, 2] and model(16, 8, 8192, 64, 16) == 2
    # 64 tiles of hd128 already read K / V at the DRAM's pace: unsplit (FA3's 2 measured 0.84-0.98x)
    assert [model(16, 8, n, 128) for n in (1024, 2048, 4096, 8192)] == [1, 1, 1, 1] and model(16, 8, 8192, 128, 16) == 1
    assert (model(4, 8, 1024, 64), model(4, 8, 1024, 128)) == (8, 4)  # 16 tiles (FA3: 7)
    assert model(1, 8, 4096, 64) == 16 and fa3(1, 8, 4096) == 28  # 4 tiles: 16 measured fastest, 28 2-3 % slower
    assert (model(1, 8, 32768, 64), model(1, 8, 32768, 128)) == (32, 16)  # FA3: 29 (2 % slower)
    assert model(2, 1, 32768, 64) == 2 and fa3(2, 1, 32768) == 8  # (FA3's decode floor: 4 % slower)
    assert model(8, 1, 8192, 64) == 1  # 256 tiles fill the GPU
    # 32 tiles of hd128 (the second sweep): 4 splits, 2-5 % ahead of 2
    assert [model(8, 8, 4096, 128), model(8, 8, 16384, 128), model(4, 4, 8192, 128), model(1, 1, 65536, 128)] == [4] * 4
    assert model(1, 1, 65536, 64) == 4 and fa3(1, 1, 65536) == 16  # (FA3's 16: 5 % slower)
    # the third sweep: GQA 2 over 20k keys at batch 2 (FA3's 5: 1.21-1.39x of 4's time), 96 tiles of 4k keys (FA3's 4:
    # 1.04-1.08x of unsplit), 20 tiles over 64k keys (several waves of splits: 32 at hd64, 4 at hd128)
    assert (model(2, 2, 20000, 64), model(2, 2, 20000, 128), fa3(2, 2, 20000)) == (4, 4, 5)
    assert (model(24, 8, 4096, 64), model(24, 8, 4096, 128), fa3(24, 8, 4096)) == (1, 1, 4)
    assert (model(5, 8, 65536, 64), model(5, 8, 65536, 128)) == (32, 4)
    assert model(1, 32, 32768, 128, 256) == fa3(1, 32, 32768, 256)  # 2 query blocks a tile: FA3's rule
    # hd256 (session 26's sweep, heads 16; SPLIT_BLOCK_US_WIDE): FA3's 55 / 109 splits of 2 / 1 tiles measured 1.32x /
    # 1.26x the time of 16 / 32; 64-96 tiles unsplit (FA3's 2 / 4: 1.04x)
    def model256(batch, group, seqlen_k):
        return core.varlen_num_splits(batch, 16, 16 // group, 1, seqlen_k, 0, None, 1024)

    def fa3_256(batch, group, seqlen_k):
        return core.varlen_num_splits(batch, 16, 16 // group, 1, seqlen_k, 0)

    assert (model256(1, 8, 8192), fa3_256(1, 8, 8192)) == (16, 55)
    assert (model256(1, 16, 65536), fa3_256(1, 16, 65536)) == (32, 109)
    assert (model256(8, 2, 4096), fa3_256(8, 2, 4096), model256(12, 2, 2048), fa3_256(12, 2, 2048)) == (1, 2, 1, 4)
    # keys wider than hd256's at 16 bits (not measured): FA3's rule
    assert core.varlen_num_splits(1, 16, 2, 1, 8192, 0, None, 2048) == fa3_256(1, 8, 8192) == 55
    monkeypatch.setattr(core.launch, "dram_bandwidth", lambda device: 0.0)  # a driver that reports no memory clock
    assert model(16, 8, 1024, 128) == fa3(16, 8, 1024) == 2  # FA3's rule
    monkeypatch.setattr(core.launch, "dram_bandwidth", lambda device: 3.35e6)
    monkeypatch.setattr(core, "SPLIT_MODEL", False)
    assert model(16, 8, 1024, 128) == fa3(16, 8, 1024) == 2


def test_split_model_reproduces_the_h100_sweeps(monkeypatch):
    """The shipped constants pick, on docs/results/split_sweep_h100's and split_sweep_hd256_h100's rows (H100, each
    count timed), counts within
    1 % of the fastest in geomean per run (scripts/fit_split_model.py, the runtime's own model): a change of the
    constants or the model that loses on the measured rows fails here, before any GPU."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("fit_split_model", repo / "scripts" / "fit_split_model.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(core.launch, "dram_bandwidth", lambda device: 3.352e6)
    monkeypatch.setattr(core, "_split_counts", {})
    files = {str(f): fit.read_rows(str(f)) for f in sorted((repo / "docs/results/split_sweep_h100").glob("call*/split*.csv"))}
    assert len(files) == 10 and sum(map(len, files.values())) == 200  # calls 1-5, two runs each
    # hd256 (session 26: SPLIT_BLOCK_US_WIDE; the CSVs carry their heads, 16)
    wide = {str(f): fit.read_rows(str(f)) for f in sorted((repo / "docs/results/split_sweep_hd256_h100").glob("call*/split*.csv"))}
    assert len(wide) >= 2 and all(len(r) == 20 and r[0][0][1] == 16 for r in wide.values())
    scores = fit.score({**files, **wide})
    assert all(s is not None and s[0] <= 1.01 and s[1] <= 1.15 for s in scores.values()), scores


def test_split_counts_are_kept_per_question(monkeypatch):
    """varlen_num_splits answers a question (shape, device, SMs, settings) once: a decode step asks on every call and
    FA3's rule scans up to MAX_SPLITS counts; another setting or SM count is another question."""
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(core, "_split_counts", {})
    asked = []
    real = core._num_splits
    monkeypatch.setattr(core, "_num_splits", lambda *a: asked.append(a) or real(*a))
    first = core.varlen_num_splits(8, 32, 8, 1, 32768, 0)
    assert core.varlen_num_splits(8, 32, 8, 1, 32768, 0) == first == 8 and len(asked) == 1
    monkeypatch.setattr(core, "DECODE_SPLIT_BLOCKS", 0)
    assert core.varlen_num_splits(8, 32, 8, 1, 32768, 0) == 2 and len(asked) == 2
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 66)
    assert core.varlen_num_splits(8, 32, 8, 1, 32768, 0) == 1 and len(asked) == 3  # 64 tiles fill 80 % of 66 SMs


@pytest.mark.parametrize("splits", [0, 3])
def test_kvcache_split_kv_merges_the_partials(kernel_on, monkeypatch, splits):
    """num_splits (forced 3, or 0 with the heuristic made to choose 4): the kernel launch gets fp32 partial buffers
    of every split (Varlen.num_splits and its strides), flash_attn_combine merges them into out / lse: FA3's result."""
    monkeypatch.setattr(core, "varlen_num_splits", lambda *a: 4)
    monkeypatch.setattr(core, "SPLIT_KV_AUTO", True)
    q, k, v, kc, vc, _ = make(batch=3, sq=2, cache_len=400, new=1, seed=21)
    lens = [5, 300, 399]
    kc0, vc0 = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       causal=True, num_splits=splits, return_softmax_lse=True)
    ref, ref_lse, _, _ = kvcache_reference(q, k, v, kc0, vc0, None, lens, [0] * 3, list(range(3)), True, (-1, -1))
    check(out, lse, ref, ref_lse)
    (call,) = varlen_calls(kernel_on)
    vl, o = call["varlen"], call["out"]
    want = splits or 4
    assert vl.num_splits == want and o.dtype == "fp32" and vl.o_stride_split == 3 * 2 * q.shape[2] * 64
    assert vl.lse_stride_split == 3 * q.shape[2] * 2 and out.dtype == q.dtype and lse.shape == (3, q.shape[2], 2)


def test_varlen_func_split_kv_packed_q(kernel_on):
    """flash_attn_varlen_func with num_splits on a packed q (the partials as combine's batch of one): FA3's out and
    lse, rows past the last sequence 0 / -inf; num_splits must be an int."""
    lens_q, lens_k = [5, 17, 1], [200, 170, 40]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=3, pad_k=2, seed=12)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 200, causal=True, num_splits=2, return_attn_probs=True)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, lens_q, lens_k, True)
    check_varlen(out, lse, ref, ref_lse)
    assert not out[-3:].any() and torch.isneginf(lse[:, -3:]).all()
    assert varlen_calls(kernel_on)[0]["varlen"].num_splits == 2
    with pytest.raises(TypeError, match="num_splits must be an int"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 200, causal=True, num_splits=2.0)


def test_varlen_num_splits_counts_a_windows_keys(monkeypatch):
    """A local window's tiles span left + right + 1 + 128 keys, not the cache (FA3's seqlen_k_loaded)."""
    monkeypatch.setattr(core.launch, "num_sms", lambda device: 132)
    window = core.mask_spec(False, (256, 0), 1, 32768)
    assert core.varlen_num_splits(1, 32, 8, 1, 32768, 0) > 4
    assert core.varlen_num_splits(1, 32, 8, 1, 32768, 0, window) == 1  # 385 keys: 4 blocks


def test_split_kv_contract_is_checked_in_the_core(kernel_on):
    """core.attention_forward(varlen=Varlen(num_splits > 1)) wants an fp32 out, split strides that hold a split, and an
    lse (the merge's weights): ValueError otherwise (the real core's checks, before any launch)."""
    q, _, _, kc, vc, _ = make(batch=2, sq=8, cache_len=16, new=0, seed=2)
    arg = lambda t, dt="fp16": core.TensorArg(0x10000, tuple(t.shape), tuple(t.stride()), dt, 0)  # noqa: E731
    ok = core.Varlen(0, 0, 0, 0, 2, 8, 16, num_splits=2, o_stride_split=q.numel(), lse_stride_split=2 * 4 * 8)
    core._varlen_operands(arg(q), arg(kc[:2]), arg(vc[:2]), arg(q, "fp32"), ok, (None, None, None), None)
    for bad, what in ((ok, "fp32 partial"), (ok._replace(o_stride_split=5), "o_stride_split")):
        with pytest.raises(ValueError, match=what):
            core._varlen_operands(arg(q), arg(kc[:2]), arg(vc[:2]), arg(q, "fp16" if bad is ok else "fp32"), bad,
                                  (None, None, None), None)
    with pytest.raises(ValueError, match="needs lse"):
        REAL_ATTENTION_FORWARD(arg(q), arg(kc[:2]), arg(vc[:2]), arg(q, "fp32"), None, 0.1, False, 0, varlen=ok)


def test_split_kv_without_a_combine_variant_runs_unsplit(kernel_on, monkeypatch):
    """No combine variant built for out's dtype: the call runs with one split instead of failing after the launch."""
    real = core.select_variant

    def no_combine(family, key, *a, **kw):
        if family == "combine":
            raise core.MissingVariantError("no combine variant")
        return real(family, key, *a, **kw)

    monkeypatch.setattr(core, "select_variant", no_combine)
    q, k, v, kc, vc, _ = make(batch=3, sq=2, cache_len=400, new=1, seed=21)
    flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([5, 300, 399], dtype=torch.int32), causal=True,
                            num_splits=3)
    assert varlen_calls(kernel_on)[0]["varlen"].num_splits == 1


def test_split_kv_looks_up_the_combine_variant_once(kernel_on, monkeypatch):
    """A split call's combine variant is looked up (a manifest read) until found, then not again: per decode step it
    cost the host a manifest search."""
    real, asked = core.select_variant, []

    def counted(family, key, *a, **kw):
        if family == "combine":
            asked.append(key)
        return real(family, key, *a, **kw)

    monkeypatch.setattr(core, "select_variant", counted)
    q, k, v, kc, vc, _ = make(batch=3, sq=2, cache_len=400, new=1, seed=22)
    for step in range(3):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([5, 300 + step, 399], dtype=torch.int32),
                                causal=True, num_splits=3)
    assert [c["varlen"].num_splits for c in varlen_calls(kernel_on)] == [3, 3, 3]
    assert len(asked) == 1


def test_num_splits_zero_runs_unsplit_unless_the_heuristic_is_switched_on(kernel_on, monkeypatch):
    """num_splits 0 (flash_attn_with_kvcache's default): the heuristic's choice while core.SPLIT_KV_AUTO is on (the
    default since session 2026-12-05 (5): measured faster on both GPUs, core.py), one split when it is off; num_splits
    n > 1 either way."""
    assert core.SPLIT_KV_AUTO or "FLASHGEN_SPLIT_KV_AUTO" in os.environ  # on unless the environment says otherwise
    monkeypatch.setattr(core, "varlen_num_splits", lambda *a: 4)
    q, k, v, kc, vc, _ = make(batch=3, sq=2, cache_len=400, new=1, seed=23)
    lens = torch.tensor([5, 300, 399], dtype=torch.int32)
    for auto, splits, want in ((False, 0, 1), (True, 0, 4), (False, 3, 3)):
        monkeypatch.setattr(core, "SPLIT_KV_AUTO", auto)
        kernel_on.calls.clear()
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, num_splits=splits)
        assert varlen_calls(kernel_on)[0]["varlen"].num_splits == want


@pytest.mark.parametrize("page", [None, 8])
@pytest.mark.parametrize("causal,window,want", [(True, (45, 0), (True, False)), (False, (100, 0), (True, False)),
                                                (False, (20, 0), (False, True)), (False, (-1, -1), (False, False))])
def test_key_bound_keeps_the_calls_own_mask(kernel_on, page, causal, window, want):
    """max_seqlen_k's rounding up (interface._key_bound) leaves the mask, and so the variant, as the call's own
    lengths give it: a window's left side that reaches every key of the longest cache (40 keys, two query rows) is
    unbounded, as core.mask_spec says for 40, not a local band against the bound (64)."""
    q, _, _, kc, vc, table = make(batch=2, sq=2, cache_len=64, new=0, page=page, seed=24)
    lens = [40, 17]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       page_table=table, causal=causal, window_size=window, return_softmax_lse=True)
    ref, ref_lse, _, _ = kvcache_reference(q, None, None, kc, vc, table, lens, [0, 0], [0, 1], causal, window)
    check(out, lse, ref, ref_lse)
    (call,) = kernel_on.calls
    assert call["varlen"].max_seqlen_k == 64
    m = core.mask_spec(causal, call["window_size"], 2, call["varlen"].max_seqlen_k)
    assert (m.causal, m.local) == want == tuple(call["variant"].dispatch[x] for x in ("causal", "local"))


# --------------------------------------------------------------------------------------
# The varlen backward (core.BwdVarlen; bwd.py ``varlen``, bwd.cu.j2 kVarlen)
# --------------------------------------------------------------------------------------

@pytest.fixture
def bwd_kernel_on(kernel_on, gpu, monkeypatch):
    """The varlen kernels both ways (core.VARLEN_BWD_KERNEL on), with test_bwd_api's emulated backward (``gpu``)."""
    monkeypatch.setattr(core, "VARLEN_BWD_KERNEL", True)
    return gpu


def varlen_grads_reference(q, k, v, cu_q, cu_k, dout, causal, window, scale):
    """float32 (dq, dk, dv): each sequence's reference gradients in its rows, 0 in rows of no sequence."""
    from test_bwd_api import reference_grads

    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    for b in range(len(cu_q) - 1):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        g = reference_grads(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], scale, causal, window)
        for acc, x, r in zip(grads, g, (rq, rk, rk)):
            acc[r] = x[0]
    return grads


@pytest.mark.parametrize("lens_q,lens_k,causal,window,hk,dv", [
    ([5, 17, 1, 33], [7, 17, 40, 2], True, (-1, -1), 2, None),
    ([5, 17, 1, 33], [7, 17, 40, 2], False, (3, 2), 1, None),
    ([9, 0, 4], [0, 6, 11], False, (-1, -1), 4, None),  # an empty query sequence, a sequence with no key
    ([30, 12, 70], [30, 12, 70], True, (-1, -1), 2, 32),  # packed documents; head_dim_v 32
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_is_one_launch_each_way(bwd_kernel_on, lens_q, lens_k, causal, window, hk, dv,
                                                deterministic):
    """A call that wants gradients runs the varlen forward once and the varlen backward once (no composed calls),
    with the arrays, offsets and longest lengths the kernels need; the gradients are each sequence's (0 for keys no
    query sees, and for queries of a sequence without keys)."""
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, h=4, hk=hk, dv=dv, seed=7)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q) + 3, max(lens_k) + 1, causal=causal,
                                 window_size=window, deterministic=deterministic)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    (out.float() * w.float()).sum().backward()
    fwd_calls = varlen_calls(kernel_on := bwd_kernel_on.fwd)
    assert len(fwd_calls) == 1 and len(kernel_on.calls) == 1  # the forward: one varlen launch, nothing composed
    (call,) = bwd_kernel_on.calls
    vl = call["varlen"]
    assert (vl.batch, vl.max_seqlen_q, vl.max_seqlen_k) == (len(lens_q), max(lens_q), max(lens_k))
    assert call["deterministic"] is deterministic and call["causal"] is causal
    assert call["q"].ptr == q.data_ptr() and call["q"].shape == tuple(q.shape)  # packed q read in place
    assert call["lse"].shape == (4, q.shape[0])
    assert bwd_kernel_on.workspace_calls[-1]["varlen_total_q"] == q.shape[0]
    assert [key for fam, key in bwd_kernel_on.fwd.selected if fam == "bwd"][-1]["varlen"] is True
    ref = varlen_grads_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, w, causal, window, 64 ** -0.5)
    for t, r in zip((q, k, v), ref):
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype
        assert (t.grad.float() - r).abs().max().item() <= 2e-3 * max(1.0, r.abs().max().item())


def test_varlen_backward_matches_the_composed_path(bwd_kernel_on):
    """The same call with the switch off (the composed path: flash_attn_func calls per run) gives the same out and
    gradients."""
    lens = [13, 40, 7, 40]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, seed=9)
    got = []
    for on in (True, False):
        core.VARLEN_BWD_KERNEL = on
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, 40, 40, causal=True)
        out.float().square().sum().backward()
        got.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert len(bwd_kernel_on.calls) >= 2 and bwd_kernel_on.calls[0].get("varlen") is not None
    assert all(c.get("varlen") is None for c in bwd_kernel_on.calls[1:])  # the composed calls
    for a, b in zip(*got):
        assert (a.float() - b.float()).abs().max().item() <= 2e-3 * max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("what", ["seqused", "softcap", "chunk", "switch_off", "fwd_switch_off", "no_variant",
                                  "too_many_sequences"])
def test_varlen_backward_calls_it_does_not_take(bwd_kernel_on, monkeypatch, what):
    """seqused (a padded sequence's unused rows, which may hold anything, would be read by the backward's loads),
    softcap, attention_chunk (not built), either switch off, no varlen bwd variant built, or more
    sequences than the grids' z holds: the composed path."""
    lens = [6, 11]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, seed=2)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    kw = {}
    if what == "seqused":
        kw["seqused_q"] = torch.tensor([5, 11], dtype=torch.int32)
    elif what == "softcap":
        kw["softcap"] = 5.0
    elif what == "chunk":
        kw["attention_chunk"] = 4
    elif what == "switch_off":
        core.VARLEN_BWD_KERNEL = False
    elif what == "fwd_switch_off":
        core.VARLEN_KERNEL = False
    elif what == "too_many_sequences":
        monkeypatch.setattr(core, "MAX_VARLEN_BWD_SEQUENCES", 1)
    elif what == "no_variant":
        real = bwd_kernel_on.fwd.select_variant

        def select(family, key, manifest=None, round_up=()):
            if family == "bwd" and key.get("varlen"):
                raise core.MissingVariantError("no varlen bwd variant")
            return real(family, key, manifest, round_up)
        monkeypatch.setattr(core, "select_variant", select)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True, **kw)
    out.float().sum().backward()
    assert bwd_kernel_on.calls and all(c.get("varlen") is None for c in bwd_kernel_on.calls)
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("mode", ["eager", "fullgraph"])
@pytest.mark.parametrize("window", [(-1, -1), (5, 0)])
def test_varlen_backward_with_a_learnable_sink(bwd_kernel_on, mode, window):
    """A learnable_sink (gpt-oss) on the varlen kernels both ways: the backward kernels as without it (the forward's
    lse includes the sink) and d_sink from torch ops over every sequence's rows; out and every gradient, d_sink
    included, are those of the composed path (flash_attn_func per run, whose sink gradient is tested), with rows
    past the last offsets adding nothing (NaN eagerly, where they are cut off; finite under torch.compile, as FA3
    needs)."""
    lens = [13, 30, 1, 22]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, pad_q=3, pad_k=2, seed=14)
    if mode == "eager":
        q[66:] = float("nan")
    sink = torch.randn(4, generator=torch.Generator().manual_seed(5))
    w = torch.randn(q.shape[0], 4, 64, generator=torch.Generator().manual_seed(6))

    def step(q, k, v, sink, cu_q, cu_k):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, window_size=window,
                                     learnable_sink=sink)
        return (out.float() * w).nan_to_num().sum()

    got = []
    for on in (True, False):
        core.VARLEN_BWD_KERNEL = on
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sink)]
        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if mode == "fullgraph" and on else step
        bwd_kernel_on.calls.clear()
        fn(*leaves, cu_q, cu_k).backward()
        launched = [c.get("varlen") is not None for c in bwd_kernel_on.calls]
        assert launched == ([True] if on else [False] * len(launched)) and launched
        got.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv", "d_sink"), *got):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        assert (a.float() - b.float()).abs().max().item() <= 2e-3 * max(1.0, b.float().abs().max().item()), name
    assert got[0][3].abs().sum() > 0


@pytest.mark.parametrize("pad_q,pad_k", [(3, 0), (0, 2), (4, 5)])
def test_varlen_backward_cuts_off_rows_past_the_last_sequence(bwd_kernel_on, pad_q, pad_k):
    """Rows past the last offsets (which may hold anything: NaN here) are cut off before the kernels, which see views
    of the sequences' rows alone: one launch each way, out 0 and lse -inf there, gradients 0 there, the sequences'
    gradients as without the rows."""
    lens = [6, 11, 9]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, pad_q=pad_q, pad_k=pad_k, seed=4)
    for t, n in ((q, 26), (k, 26), (v, 26)):
        t[n:] = float("nan")
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True, return_attn_probs=True)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    (out.float() * w.float()).sum().backward()
    (call,) = bwd_kernel_on.calls
    assert call["varlen"] is not None and call["q"].shape[0] == 26 and call["k"].shape[0] == 26
    assert call["q"].ptr == q.data_ptr() and call["k"].ptr == k.data_ptr()  # views of the leading rows, no copy
    assert out.shape[0] == q.shape[0] and lse.shape == (4, q.shape[0])
    assert not out[26:].any() and bool(torch.isneginf(lse[:, 26:]).all()) and torch.isfinite(out[:26]).all()
    ref = varlen_grads_reference(q.detach()[:26], k.detach()[:26], v.detach()[:26], cu_q, cu_k, w[:26], True,
                                 (-1, -1), 64 ** -0.5)
    for t, r in zip((q, k, v), ref):
        assert not t.grad[26:].any() and t.grad.shape == t.shape
        assert (t.grad[:26].float() - r).abs().max().item() <= 2e-3 * max(1.0, r.abs().max().item())


def test_varlen_backward_without_grad_runs_the_forward_kernel_alone(bwd_kernel_on):
    """No gradient wanted (no_grad, or inputs without requires_grad): the varlen forward alone, as before."""
    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=3)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True)
    with torch.no_grad():
        flash_attn_varlen_func(q.requires_grad_(True), k, v, cu_q, cu_k, 9, 9, causal=True)
    assert len(varlen_calls(bwd_kernel_on.fwd)) == 2 and not bwd_kernel_on.calls


def test_varlen_backward_under_torch_compile(bwd_kernel_on):
    """A training step through torch.compile (not fullgraph: the offsets' read breaks the graph) runs the varlen
    kernels both ways and gives eager's out and gradients."""
    lens = [8, 12, 5]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, seed=6)

    def step(q, k, v):
        out = flash_attn_varlen_func(q * 1.5, k, v, cu_q, cu_k, 12, 12, causal=True)
        return out.float().square().sum()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager")):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves).backward()
        results.append([t.grad for t in leaves])
    assert sum(1 for c in bwd_kernel_on.calls if c.get("varlen") is not None) == 2
    assert not any(c.get("varlen") is None for c in bwd_kernel_on.calls)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------
# Without a host read: torch.compile(fullgraph=True) and CUDA-graph capture (interface._varlen_on_device)
# --------------------------------------------------------------------------------------

def no_host_reads(monkeypatch):
    """A read of a tensor's values on the host (tolist / item) fails the test."""
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a length read on the host"))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a length read on the host"))


@pytest.mark.parametrize("mode", ["fullgraph", "capture", "switch"])
@pytest.mark.parametrize("lens_q,lens_k,used,causal,window,pad_q,splits", [
    ([5, 17, 1, 33], [7, 17, 40, 2], False, True, (-1, -1), 3, 1),
    ([9, 0, 4], [0, 6, 11], False, False, (3, 2), 2, 1),  # an empty query sequence, a sequence with no key
    ([11, 20, 7], [13, 25, 130], True, True, (-1, -1), 1, 2),  # seqused_q / seqused_k; split-KV
])
def test_varlen_forward_without_a_host_read(kernel_on, monkeypatch, mode, lens_q, lens_k, used, causal, window, pad_q,
                                            splits):
    """Under torch.compile(fullgraph=True) (a read of the offsets would break the graph), under CUDA-graph capture
    (where it cannot happen; the seam interface._capturing stands for it here) and eagerly with
    core.VARLEN_NO_HOST_READ, flash_attn_varlen_func runs the
    varlen kernel through torch.ops.flashgen.varlen_fwd with the offsets as tensors: one launch with the caller's
    max_seqlen as the grid's, rows of no sequence 0 / -inf, the result eager's."""
    from flashgen import interface

    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=pad_q, pad_k=2, seed=8)
    used_q = [max(0, n - 2) for n in lens_q] if used else list(lens_q)
    used_k = [max(0, n - 3) for n in lens_k] if used else list(lens_k)
    kw = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32), seqused_k=torch.tensor(used_k, dtype=torch.int32)) \
        if used else {}
    max_q, max_k = max(lens_q) + 4, max(lens_k)

    def call(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                      num_splits=splits, return_attn_probs=True, **kw)

    with pytest.MonkeyPatch.context() as mp:
        if mode == "fullgraph":
            torch._dynamo.reset()
            fn = torch.compile(call, fullgraph=True, backend="aot_eager")
        else:  # capture (the seam), or eager with core.VARLEN_NO_HOST_READ
            mp.setattr(*((interface, "_capturing", lambda q: True) if mode == "capture"
                         else (core, "VARLEN_NO_HOST_READ", True)))
            no_host_reads(mp)
            fn = call
        out, lse = fn(q, k, v, cu_q, cu_k)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q, used_k, causal, window)
    check_varlen(out, lse, ref, ref_lse)
    calls = varlen_calls(kernel_on)
    merges = [c for c in kernel_on.calls if "combine" in c]
    assert len(calls) == 1 and len(merges) == (splits > 1) and len(kernel_on.calls) == 1 + len(merges)
    if merges:  # the prepared merge reads the kernel's partials and writes the returned out / lse
        op, lp, mo, ml = merges[0]["combine"]
        assert (op.ptr, lp.ptr, mo.ptr, ml.ptr) == (calls[0]["out"].ptr, calls[0]["lse"].ptr, out.data_ptr(),
                                                    lse.data_ptr())
    vl = calls[0]["varlen"]
    assert (vl.batch, vl.max_seqlen_q) == (len(lens_q), max_q) and bound_ok(vl.max_seqlen_k, max_k)
    assert vl.num_splits == splits and bool(vl.seqused_q) == used
    assert calls[0]["q"].ptr == q.data_ptr()  # packed q read in place
    assert not out[-pad_q:].any() and torch.isneginf(lse[:, -pad_q:]).all()


@pytest.mark.parametrize("mode", ["fullgraph", "inductor", "capture", "switch"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_training_step_without_a_host_read(bwd_kernel_on, monkeypatch, mode, deterministic):
    """A training step (forward + backward) on the varlen kernels under torch.compile(fullgraph=True) (AOT autograd
    alone, and inductor, whose generated code calls the ops) or capture:
    one launch each way, the gradients each sequence's and 0 in the rows past the last offsets (which the kernels
    are not told of here; finite, as FA3 needs), out / gradients equal to eager's."""
    from flashgen import interface

    lens = [13, 40, 7, 25]
    q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, pad_q=3, pad_k=5, seed=12)
    w = torch.randn(q.shape[0], 4, 64, generator=torch.Generator().manual_seed(1))

    def step(q, k, v, cu_q, cu_k):
        out = flash_attn_varlen_func(q * 1.25, k, v, cu_q, cu_k, 40, 40, causal=True, deterministic=deterministic)
        return (out.float() * w).sum()

    results = []
    for m in ("eager", mode):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with pytest.MonkeyPatch.context() as mp:
            if m in ("fullgraph", "inductor"):
                torch._dynamo.reset()
                fn = torch.compile(step, fullgraph=True, backend="aot_eager" if m == "fullgraph" else "inductor")
            else:
                fn = step
            if m in ("capture", "switch"):
                mp.setattr(*((interface, "_capturing", lambda q: True) if m == "capture"
                             else (core, "VARLEN_NO_HOST_READ", True)))
                no_host_reads(mp)
            loss = fn(*leaves, cu_q, cu_k)
            loss.backward()
        results.append((loss.detach(), *(t.grad for t in leaves)))
    assert [c.get("varlen") is not None for c in bwd_kernel_on.calls] == [True, True]
    assert len(varlen_calls(bwd_kernel_on.fwd)) == len(bwd_kernel_on.fwd.calls) == 2  # the forward: a launch each
    assert bwd_kernel_on.calls[0]["q"].shape[0] == q.shape[0] - 3  # eager: rows past the last offsets cut off
    assert bwd_kernel_on.calls[1]["deterministic"] is deterministic
    assert bwd_kernel_on.calls[1]["q"].shape[0] == q.shape[0]  # the whole q: the offsets' end is not read
    for a, b in zip(*results):
        assert torch.allclose(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    for g, pad in zip(results[1][1:], (3, 5, 5)):  # (q's padding rows, k's and v's)
        assert not g[-pad:].any()


@pytest.fixture(params=[False, True], ids=["torch_checks", "prep_kernel"])
def prep(request, monkeypatch):
    """core.VARLEN_PREP_KERNEL off (the offsets checked by torch ops, out / lse memset) or on (the varlen_prep
    kernel, emulated by the fake core: test_api_validation.fake_varlen_prep)."""
    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("bad,fragment", BAD_VARLEN_OFFSETS)
def test_varlen_offsets_are_checked_on_the_device(kernel_on, prep, bad, fragment):
    """Without a host read the offsets' values are checked on the device (torch._assert_async, which on the CPU
    raises at once, or the varlen_prep kernel's asserts, emulated): FA3's contract broken is an error naming the
    argument, before the kernel launches."""
    q, k, v, cu_q, cu_k = varlen_inputs([5, 5, 10], [5, 5, 10], seed=3)
    cu_q = torch.tensor(bad.get("cu_q", cu_q.tolist()), dtype=torch.int32)
    cu_k = torch.tensor(bad.get("cu_k", cu_k.tolist()), dtype=torch.int32)
    kw = {"seqused_k": torch.tensor(bad["used_k"], dtype=torch.int32)} if "used_k" in bad else {}
    max_q = bad.get("max_q", 12)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, a, b: flash_attn_varlen_func(q, k, v, a, b, max_q, 12, causal=True, **kw),
                       fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fn(q, k, v, cu_q, cu_k)
    assert varlen_calls(kernel_on) == []
    assert len(kernel_on.preps) == int(prep)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("used", [False, True])
def test_varlen_prep_kernel_checks_and_fills_instead_of_torch_ops(kernel_on, monkeypatch, used, num_splits):
    """With core.VARLEN_PREP_KERNEL on, an eager call without a host read is one varlen_prep launch (the offsets
    checked, out / lse's rows of no sequence filled: rows past the last offsets, and past seqused_q) and one
    forward: no torch checks (they would raise here), out and lse allocated empty and returned as the prep kernel
    filled them; split-KV: the prep kernel checks only (flash_attn_combine writes every row)."""
    from flashgen import interface

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", True)
    monkeypatch.setattr(core, "VARLEN_NO_HOST_READ", True)

    def no_torch_checks(*a, **kw):
        raise AssertionError("the torch checks ran although the prep kernel checks the offsets")

    monkeypatch.setattr(interface, "_check_offsets_on_device", no_torch_checks)
    lens_q, lens_k = [5, 17, 1, 33], [7, 17, 200, 2]  # (200 keys: room for 3 splits of 64)
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, pad_q=3, pad_k=2, seed=4)
    used_q = [max(0, n - 2) for n in lens_q] if used else list(lens_q)
    kw = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32)) if used else {}
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      num_splits=num_splits, return_attn_probs=True, **kw)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, used_q, lens_k, True)
    check_varlen(out, lse, ref, ref_lse)
    (launch,) = varlen_calls(kernel_on)
    assert launch["varlen"].num_splits == num_splits
    ((seqlens, fill),) = kernel_on.preps
    assert seqlens[0] is cu_q and seqlens[1] is cu_k and (seqlens[2] is not None) == used and seqlens[3] is None
    if num_splits == 1:
        assert fill[0].data_ptr() == out.data_ptr() and fill[1].data_ptr() == lse.data_ptr()
    else:
        assert fill is None


def test_varlen_prep_kernel_fills_for_the_host_read_path(kernel_on, monkeypatch):
    """Where the offsets are read on the host (core.VARLEN_NO_HOST_READ off) and rows belong to no sequence, the
    prep kernel (on) fills them, instead of memsets; where every row is a sequence's, it does not run."""
    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", True)
    for pad, launched in ((3, 1), (0, 0)):
        kernel_on.preps.clear()
        q, k, v, cu_q, cu_k = varlen_inputs([5, 17], [7, 17], pad_q=pad, seed=5)
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, return_attn_probs=True)
        check_varlen(out, lse, *varlen_reference(q, k, v, cu_q, cu_k, [5, 17], [7, 17], False))
        assert len(kernel_on.preps) == launched


def test_varlen_without_a_host_read_checks_shapes_on_the_host(kernel_on, monkeypatch):
    """Shapes, dtypes and scalars are still checked on the host, naming the argument."""
    from flashgen import interface

    monkeypatch.setattr(interface, "_capturing", lambda q: True)
    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=3)
    with pytest.raises(ValueError, match="cu_seqlens_k must have 3 entries"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k[:2], 9, 9)
    with pytest.raises(ValueError, match="seqused_q must have 2 entries"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, seqused_q=torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 9, 9)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, softmax_scale=float("nan"))
    assert kernel_on.calls == []


@pytest.mark.parametrize("what", ["fp8", "seqused_grad", "switch_off", "no_variant"])
def test_varlen_calls_the_ops_do_not_serve_take_the_host_path(kernel_on, monkeypatch, what):
    """Under capture (the seam) or torch.compile, a call the varlen ops do not serve (FP8, seqused with a gradient
    wanted, the kernel switched off, no varlen variant built) takes the host path: the offsets are read there
    (with GPU offsets under a real capture that is NotImplementedError, next test), and the call is served
    composed."""
    from flashgen import interface

    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=3)
    kw = {}
    if what == "fp8":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    elif what == "seqused_grad":
        kw["seqused_q"] = torch.tensor([5, 9], dtype=torch.int32)
        q.requires_grad_(True)
    elif what == "switch_off":
        core.VARLEN_KERNEL = False
    else:
        select = kernel_on.select_variant

        def no_varlen(family, key, manifest=None, round_up=()):
            if key.get("varlen"):
                raise core.MissingVariantError("no varlen variant")
            return select(family, key, manifest, round_up)
        monkeypatch.setattr(core, "select_variant", no_varlen)
        monkeypatch.setattr(core, "_built", set())
    monkeypatch.setattr(interface, "_capturing", lambda q: True)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, **kw)
    assert reads and varlen_calls(kernel_on) == [] and kernel_on.calls
    assert out.shape == (14, 4, 64) and torch.isfinite(out.float()).all()


def test_host_read_of_gpu_offsets_under_capture_is_refused(monkeypatch):
    """The host path cannot read GPU offsets under CUDA-graph capture: NotImplementedError naming the argument
    (interface._host_ints)."""
    from types import SimpleNamespace

    from flashgen import interface

    class GpuOffsets(torch.Tensor):
        device = SimpleNamespace(type="cuda")

    t = torch.tensor([0, 5], dtype=torch.int32).as_subclass(GpuOffsets)
    monkeypatch.setattr(interface, "_check_index_tensor", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(NotImplementedError, match="reads cu_seqlens_q on the host, which a CUDA graph capture"):
        interface._host_ints("cu_seqlens_q", t, 0)


def test_varlen_compiled_step_follows_new_lengths_without_a_recompile_each(bwd_kernel_on):
    """Packed documents change every step, and so does max_seqlen: under torch.compile(fullgraph=True) the second
    value makes it symbolic (automatic dynamic shapes) and later ones reuse that graph (nothing reads a length's
    value while tracing: no int(), no value in a message, the variant check without lengths), each step still one
    launch each way with its own lengths."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layouts = [[13, 40, 7, 25], [30, 20, 20, 15], [5, 5, 70, 5], [21, 22, 23, 19]]  # 85 tokens each
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()

    def step(q, k, v, cu_q, cu_k, longest):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest, longest, causal=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, lens in enumerate(layouts):
        q, k, v, cu_q, cu_k = varlen_inputs(lens, lens, seed=20 + i)
        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        compiled(*leaves, cu_q, cu_k, max(lens)).backward()
        ref = varlen_grads_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 2 * flash_attn_varlen_func(
            q.detach(), k.detach(), v.detach(), cu_q, cu_k, max(lens), max(lens), causal=True).float(), True,
            (-1, -1), 64 ** -0.5)
        for t, r in zip(leaves, ref):
            assert (t.grad.float() - r).abs().max().item() <= 2e-3 * max(1.0, r.abs().max().item())
        vl = bwd_kernel_on.calls[-1]["varlen"]
        assert (vl.max_seqlen_q, vl.max_seqlen_k) == (max(lens), max(lens))
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles for {len(layouts)} layouts"
    assert len(bwd_kernel_on.calls) == len(layouts) and all(c.get("varlen") for c in bwd_kernel_on.calls)


# --------------------------------------------------------------------------------------
# softcap in the varlen kernel (fwd.py varlen x softcap; core.VARLEN_SOFTCAP, on since its GPU tests passed)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "fullgraph"])
def test_varlen_softcap_runs_on_the_kernel_only_when_switched_on(kernel_on, monkeypatch, mode):
    """flash_attn_varlen_func with softcap (Gemma 2): composed with core.VARLEN_SOFTCAP off, one launch of a varlen
    softcap variant with it on (the default; under torch.compile with fullgraph=True); the same out and lse both
    ways, each sequence's attention with FA3's softcap."""
    q, k, v, cu_q, cu_k = varlen_inputs([5, 17, 1, 33], [7, 17, 40, 2], pad_q=2, seed=21)
    ref, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, [5, 17, 1, 33], [7, 17, 40, 2], True, (20, 0), softcap=3.0)

    def call(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40, causal=True, window_size=(20, 0), softcap=3.0,
                                      return_attn_probs=True)

    got = []
    for on in (False, True):
        monkeypatch.setattr(core, "VARLEN_SOFTCAP", on)
        kernel_on.calls.clear()
        torch._dynamo.reset()  # (switched off, the host path reads the offsets: a graph break, so no fullgraph)
        fn = torch.compile(call, backend="aot_eager", fullgraph=on) if mode == "fullgraph" else call
        got.append(fn(q, k, v, cu_q, cu_k))
        calls = varlen_calls(kernel_on)
        if on:
            assert len(calls) == len(kernel_on.calls) == 1 and calls[0]["variant"].dispatch["softcap"] is True
        else:
            assert calls == [] and kernel_on.calls
    (out, lse), (out2, lse2) = got
    assert (out.float() - out2.float()).abs().max().item() <= 2e-3
    finite = torch.isfinite(lse2)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], lse2[finite], atol=1e-4)
    check_varlen(got[1][0], got[1][1], ref, ref_lse)


def test_varlen_softcap_under_fullgraph_needs_the_switch(kernel_on, monkeypatch):
    """Under torch.compile(fullgraph=True) a softcap call is on the varlen ops only with core.VARLEN_SOFTCAP on;
    off, the offsets would be read on the host, which fullgraph refuses."""
    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=22)

    def call(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, softcap=2.0)

    monkeypatch.setattr(core, "VARLEN_SOFTCAP", True)
    torch._dynamo.reset()
    out = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)
    assert len(varlen_calls(kernel_on)) == 1 and out.shape == (14, 4, 64)
    monkeypatch.setattr(core, "VARLEN_SOFTCAP", False)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # (the host path's reads: a graph break, or a guard
        # on their values)
        torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("on_device", [False, True])
def test_kvcache_softcap_on_the_varlen_kernel(kernel_on, monkeypatch, on_device):
    """flash_attn_with_kvcache with softcap: one varlen launch (a softcap variant) with core.VARLEN_SOFTCAP on, eagerly
    and on the capture path (kvcache._step_on_device); with it off the eager call is composed and the capture path
    refuses (NotImplementedError) before the cache is written."""
    from flashgen import kvcache

    q, k, v, kc, vc, _ = make(batch=4, sq=3, cache_len=40, new=2, seed=23)
    lens = [5, 0, 30, 17]
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def run():
        kernel_on.calls.clear()
        kc1, vc1 = kc.clone(), vc.clone()
        if on_device:
            out, lse = kvcache._step_on_device(q, kc1, vc1, k, v, None, None, lens_t, None, (None, None, None), None,
                                               True, (-1, -1), 0, 4.0, False)
        else:
            out, lse = flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=lens_t, causal=True, softcap=4.0,
                                               return_softmax_lse=True)
        return out, lse, kc1

    ref, ref_lse, kref, _ = kvcache_reference(q, k, v, kc, vc, None, lens, [0] * 4, list(range(4)), True, (-1, -1),
                                              None, False, softcap=4.0)
    monkeypatch.setattr(core, "VARLEN_SOFTCAP", True)
    out, lse, kc1 = run()
    calls = varlen_calls(kernel_on)
    assert len(calls) == len(kernel_on.calls) == 1 and calls[0]["variant"].dispatch["softcap"] is True
    monkeypatch.setattr(core, "VARLEN_SOFTCAP", False)
    if on_device:
        with pytest.raises(NotImplementedError, match="softcap"):
            run()
        assert varlen_calls(kernel_on) == []
    else:
        out2, lse2, _ = run()
        assert varlen_calls(kernel_on) == [] and kernel_on.calls
        assert (out.float() - out2.float()).abs().max().item() <= 2e-3
    check(out, lse, ref, ref_lse)
    assert torch.equal(logical_cache(kc1, None, list(range(4)), 4), kref)  # the append


@pytest.mark.parametrize("what", ["kernel", "paged", "fp8"])
def test_kvcache_no_host_read_switch(kernel_on, monkeypatch, what):
    """flash_attn_with_kvcache eagerly with core.VARLEN_NO_HOST_READ and the lengths on q's device: the capture path
    (kvcache._step_on_device), no length read on the host, the same out, lse and caches as the host path; a call it
    refuses (FP8: the varlen kernel has no e4m3) takes the host path, before anything is written."""
    page = 8 if what == "paged" else None
    q, k, v, kc, vc, table = make(batch=4, sq=3, cache_len=40, new=2, page=page, seed=31,
                                  dtype=torch.float32 if what == "fp8" else torch.float16)
    if what == "fp8":
        q, k, v, kc, vc = (t.to(torch.float8_e4m3fn) for t in (q, k, v, kc, vc))
    lens = torch.tensor([5, 0, 30, 17], dtype=torch.int32)
    got = []
    for on in (False, True):
        kc1, vc1 = kc.clone(), vc.clone()
        kernel_on.calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(core, "VARLEN_NO_HOST_READ", on)
            if on and what != "fp8":
                no_host_reads(mp)
            out, lse = flash_attn_with_kvcache(q, kc1, vc1, k, v, cache_seqlens=lens, page_table=table, causal=True,
                                               return_softmax_lse=True)
        got.append((out, lse, kc1, vc1, [c.get("varlen") for c in kernel_on.calls]))
    (o0, l0, k0, v0, calls0), (o1, l1, k1, v1, calls1) = got
    as_bits = (lambda t: t.view(torch.uint8)) if what == "fp8" else (lambda t: t)
    assert torch.equal(as_bits(k0), as_bits(k1)) and torch.equal(as_bits(v0), as_bits(v1))
    assert (o0.float() - o1.float()).abs().max().item() <= 2e-3
    assert torch.allclose(l0, l1, atol=1e-4)
    if what == "fp8":
        assert all(x is None for x in calls0 + calls1)  # composed both ways
    else:
        assert len(calls1) == 1 and calls1[0] is not None and calls1[0].max_seqlen_k == 40  # the capacity


@pytest.mark.parametrize("window", [(2.5, 0), (True, 0), (3, "0")])
def test_varlen_gradient_call_refuses_a_bad_window(bwd_kernel_on, window):
    """A call that wants gradients checks window_size before the varlen backward's serving rule reads it as ints:
    TypeError naming it, as without gradients (a desk review found (2.5, 0) running as window 2)."""
    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=3)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_varlen_func(q.requires_grad_(True), k, v, cu_q, cu_k, 9, 9, window_size=window)
    assert not bwd_kernel_on.fwd.calls


def test_varlen_compiled_with_dynamic_shapes(bwd_kernel_on):
    """torch.compile(fullgraph=True, dynamic=True): head dims and lengths symbolic from the start; the variant check
    gets constant head dims (interface._constant), so a training step traces, runs the varlen kernels both ways
    and gives eager's gradients; lse is not differentiable (FA3's)."""
    q, k, v, cu_q, cu_k = varlen_inputs([13, 40, 7], [13, 40, 7], seed=41)

    def step(q, k, v, cu_q, cu_k, longest):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, longest, longest, causal=True, return_attn_probs=True)
        assert not lse.requires_grad
        return out.float().square().sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")):
        torch._dynamo.reset()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves, cu_q, cu_k, 40).backward()
        grads.append([t.grad for t in leaves])
    assert [c.get("varlen") is not None for c in bwd_kernel_on.calls] == [True, True]
    for a, b in zip(*grads):
        assert torch.allclose(a.float(), b.float(), atol=1e-3)


@pytest.mark.parametrize("mode", ["eager", "switch"])
def test_varlen_only_the_sinks_gradient(bwd_kernel_on, monkeypatch, mode):
    """Only learnable_sink wants a gradient: the varlen ops (which serve a sink) give d_sink from torch ops and
    launch no backward kernel; d_sink equals the composed path's."""
    q, k, v, cu_q, cu_k = varlen_inputs([13, 30, 22], [13, 30, 22], seed=42)
    got = []
    for on in (True, False):
        monkeypatch.setattr(core, "VARLEN_BWD_KERNEL", on)
        monkeypatch.setattr(core, "VARLEN_NO_HOST_READ", mode == "switch" and on)
        sink = torch.randn(4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        bwd_kernel_on.calls.clear()
        bwd_kernel_on.fwd.calls.clear()
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, learnable_sink=sink)
        out.float().square().sum().backward()
        if on:
            assert len(varlen_calls(bwd_kernel_on.fwd)) == 1 and bwd_kernel_on.calls == []
        got.append(sink.grad)
    assert torch.allclose(got[0], got[1], atol=1e-3, rtol=1e-3) and got[0].abs().sum() > 0


def test_varlen_backward_under_capture_needs_gpu_offsets(bwd_kernel_on, monkeypatch):
    """Under CUDA-graph capture (the seam) the varlen backward serves a call only on the no-host-read path
    (on_device: its offsets are GPU tensors); the host path's call (CPU offsets, which it would copy to the GPU, a
    synchronising copy a capture forbids) is refused and runs composed (a desk review found it admitted)."""
    from flashgen import interface

    q, k, v, cu_q, cu_k = varlen_inputs([5, 9], [5, 9], seed=3)
    q.requires_grad_(True)
    args = (q, k, v, 2, (None, None), None, (None, None, None), 0, 0.0, True, (-1, -1), 9, 9)
    assert interface._varlen_bwd_serves(*args) and interface._varlen_bwd_serves(*args, on_device=True)
    monkeypatch.setattr(interface, "_capturing", lambda q: True)
    assert not interface._varlen_bwd_serves(*args) and interface._varlen_bwd_serves(*args, on_device=True)


def test_varlen_eager_gradients_skip_the_dispatcher_and_check_the_calls_own_mask(bwd_kernel_on, monkeypatch):
    """Eagerly, a call that wants gradients runs interface._VarlenFn (the ops' code without the custom-op dispatcher,
    about 250 us less host time a step on the CPU stub) and the variant check asks for the mask of the call's own
    lengths: with no unmasked varlen variant built, a causal call of several rows still takes the kernels, while
    the check for every mask a call could select (what torch.compile asks) says no."""
    from flashgen import interface

    select = bwd_kernel_on.fwd.select_variant

    def no_unmasked(family, key, manifest=None, round_up=()):
        if key.get("varlen") and not key.get("causal") and not key.get("local"):
            raise core.MissingVariantError("no unmasked varlen variant")
        return select(family, key, manifest, round_up)

    monkeypatch.setattr(core, "select_variant", no_unmasked)
    monkeypatch.setattr(core, "_built", set())
    q, k, v, cu_q, cu_k = varlen_inputs([13, 30], [13, 30], seed=43)
    out = flash_attn_varlen_func(q.requires_grad_(True), k, v, cu_q, cu_k, 30, 30, causal=True)
    assert type(out.grad_fn).__name__ == "_VarlenFnBackward"
    out.float().sum().backward()
    assert [c.get("varlen") is not None for c in bwd_kernel_on.calls] == [True]
    assert interface._varlen_variants_built("fp16", 64, 64, True, (-1, -1), False, True, (30, 30))
    assert not interface._varlen_variants_built("fp16", 64, 64, True, (-1, -1), False, True, None)


def test_varlen_calls_without_gradients_make_no_autograd_node(kernel_on, monkeypatch):
    """interface._varlen_apply: a varlen kernel call that wants no gradient (grad mode off, or no input requiring one)
    runs the op's implementation directly, without interface._VarlenFn's autograd node (13-17 us less host time a
    call on the CPU stub, session 12), with the same out and lse either way. (A call that wants gradients keeps the
    node: test_varlen_eager_gradients_skip_the_dispatcher_and_check_the_calls_own_mask.)"""
    from flashgen import interface

    applied = []
    real = interface._VarlenFn.apply
    monkeypatch.setattr(interface._VarlenFn, "apply", lambda *a: applied.append(1) or real(*a))
    monkeypatch.setattr(core, "VARLEN_NO_HOST_READ", True)  # (the eager path of GPU offsets: interface._varlen_on_device)
    q, k, v, cu_q, cu_k = varlen_inputs([13, 30], [13, 30], seed=47)
    no_host_reads(monkeypatch)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, return_attn_probs=True)
    assert out.grad_fn is None and applied == []
    with torch.no_grad():
        out2, lse2 = flash_attn_varlen_func(q.clone().requires_grad_(True), k, v, cu_q, cu_k, 30, 30, causal=True,
                                            return_attn_probs=True)
    assert out2.grad_fn is None and applied == []
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_varlen_kernel_checks_are_kept_per_metadata(kernel_on, monkeypatch):
    """interface._varlen_checked: a repeated varlen kernel call runs _check_fwd once per metadata key (shapes,
    strides, dtypes, devices, packing, window, softcap, sink), as flash_attn_func's checked calls; another key checks
    again, and a failing check raises on every call (no failure is kept)."""
    from flashgen import interface

    checks = []
    real = interface._check_fwd
    monkeypatch.setattr(interface, "_check_fwd", lambda *a, **kw: checks.append(1) or real(*a, **kw))
    q, k, v, cu_q, cu_k = varlen_inputs([5, 17], [7, 17], seed=6)
    for _ in range(3):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True)
    assert len(checks) == 1
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, window_size=(3, 0))  # another window: checked
    flash_attn_varlen_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu_q, cu_k, 17, 17, causal=True)
    assert len(checks) == 3
    ref, _ = varlen_reference(q, k, v, cu_q, cu_k, [5, 17], [7, 17], True)
    assert (out.float() - ref).abs().max().item() <= 2e-3  # (the kept check's call runs as the first)
    for _ in range(2):  # a bad sink (one logit per query head: 4, not 3) fails in _check_fwd each time
        with pytest.raises(ValueError, match="learnable_sink"):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True, learnable_sink=torch.zeros(3))
    assert len(checks) == 5


def test_kvcache_step_checks_are_kept_per_metadata(kernel_on, monkeypatch):
    """kvcache._step_checked: a decode loop's repeated step runs _check_fwd once per metadata key (kvcache._step_facts:
    shapes, strides, dtypes, devices, window, softcap, descales, ...), another layout or window is another key, and a
    failed check is raised every call (not kept)."""
    from flashgen import kvcache

    real, calls = kvcache._check_fwd, []
    monkeypatch.setattr(kvcache, "_check_fwd", lambda *a: calls.append(a) or real(*a))
    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    step = lambda window, qq=q: kvcache._step_on_device(qq, kc, vc, k, v, None, None, lens, None,  # noqa: E731
                                                        (None, None, None), None, True, window, 0, 0.0, True)
    for _ in range(3):
        lens.sub_(1)  # (the same positions again: the lengths do not matter to the checks)
        step((-1, -1))
        lens.add_(1)
    assert len(calls) == 1
    step((5, 0))
    step(list((5, 0)))  # (a list window: the same key as the tuple)
    assert len(calls) == 2
    for _ in range(3):  # fp32 q: refused, every time
        with pytest.raises(TypeError, match="q must have dtype"):
            step((-1, -1), q.float())
    assert len(calls) == 5 and len(kernel_on.calls) == 5


def test_kvcache_step_choices_are_kept_per_metadata(kernel_on, monkeypatch):
    """kvcache._step_facts: a decode loop's repeated step makes its checks and choices (the varlen kernel serves it,
    the kvcache kernel appends and rotates) once per step metadata (kvcache._step_key), with the same launches and
    results each step; new metadata (another window, a misaligned new row, the kvcache kernel switched off, grad
    mode with a q that wants gradients) decides again, and a refused step is refused every time (not kept)."""
    from flashgen import interface, kvcache

    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", True)
    monkeypatch.setattr(interface, "_varlen_prep_on", lambda: core.VARLEN_PREP_KERNEL)
    asked = []
    for name in ("_kvcache_prep_serves", "_varlen_kernel_serves", "_check_rotary", "_rotary_in_kernel"):
        real = getattr(kvcache, name)
        monkeypatch.setattr(kvcache, name, lambda *a, _r=real, _n=name, **kw: asked.append(_n) or _r(*a, **kw))
    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2, dtype=torch.bfloat16)
    angle = torch.rand(16, 8) * 6.28
    cos, sin = torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16)
    lens = torch.tensor([3, 4], dtype=torch.int32)

    def step(window=(-1, -1), kk=k, qq=q):
        return kvcache._step_on_device(qq, kc, vc, kk, v, cos, sin, lens, None, (None, None, None), None, True, window,
                                       0, 0.0, True)

    outs = []
    for _ in range(3):
        lens.sub_(1)  # (the same positions each step: the caches end as one step leaves them)
        outs.append(step()[0])
        lens.add_(1)
    assert asked.count("_kvcache_prep_serves") == 1 and asked.count("_check_rotary") == 1
    assert asked.count("_rotary_in_kernel") == 1 and asked.count("_varlen_kernel_serves") == 1
    assert kernel_on.kvcache_ropes == [True] * 3 and all(torch.equal(outs[0], o) for o in outs)
    assert len(kvcache._step_facts) == 1
    lens.sub_(1)
    step((5, 0))  # another window
    k8 = torch.zeros(k.numel() + 4, dtype=k.dtype)[4:].view(k.shape)  # a new row 8 bytes off 16
    k8.copy_(k)
    step(kk=k8)  # not 16-byte aligned: the torch ops append and rotate
    assert kernel_on.kvcache_ropes == [True] * 4 and asked.count("_kvcache_prep_serves") == 3  # (k8's: no launch)
    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", False)
    step()
    assert asked.count("_kvcache_prep_serves") == 4 and len(kernel_on.kvcache_ropes) == 4  # (torch ops: no prep call)
    monkeypatch.setattr(core, "VARLEN_PREP_KERNEL", True)
    with torch.enable_grad():
        for _ in range(2):  # q wanting gradients: not the kernel's (no backward here), refused each time
            with pytest.raises(NotImplementedError, match="runs on the varlen kernel alone"):
                step(qq=q.clone().requires_grad_(True))
    assert asked.count("_varlen_kernel_serves") == 6 and len(kvcache._step_facts) == 4


def test_kvcache_step_on_device_refuses_lengths_that_are_not_an_int32_tensor(kernel_on):
    """cache_seqlens as a list (or an int64 tensor) under the no-host-read path: the ValueError naming it, before
    anything is written (an int or None is one length for every entry: the flash_attn_func path)."""
    from flashgen import kvcache

    q, k, v, kc, vc, _ = make(batch=2, sq=1, cache_len=16, new=1, seed=2)
    kc0 = kc.clone()
    rows = torch.tensor([1, 0], dtype=torch.int32)
    for lens in ([3, 4], torch.tensor([3, 4])):
        with pytest.raises(ValueError, match="cache_seqlens must be an int32 \\(2,\\) tensor"):
            kvcache._step_on_device(q, kc, vc, k, v, None, None, lens, None, (None, None, None), None, True,
                                    (-1, -1), 0, 0.0, True, None, rows)
    assert torch.equal(kc, kc0) and kernel_on.calls == [] and kernel_on.kvcache_preps == []


# ---------------------------------------------------------------- flash_attn_func's num_splits (split-KV)
def _splits_since(fc, n: int) -> int:
    """The split count of the one forward the emulated core ran after its first ``n`` calls: 1 for a plain launch
    alone, else the varlen launch's num_splits (followed by exactly one combine launch)."""
    new = fc.calls[n:]
    if new[0].get("varlen") is None:
        assert len(new) == 1
        return 1
    assert len(new) == 2 and "combine" in new[1]
    return new[0]["varlen"].num_splits


def _func_calls(fc) -> tuple:
    """(varlen launches, plain forward launches, combine launches) the emulated core ran."""
    return (varlen_calls(fc), [c for c in fc.calls if c.get("varlen") is None and "combine" not in c],
            [c for c in fc.calls if "combine" in c])


@pytest.mark.parametrize("causal,window,sink", [(False, (-1, -1), False), (True, (-1, -1), True), (False, (90, 3), False)])
def test_flash_attn_func_num_splits_runs_split_kv(kernel_on, causal, window, sink):
    """flash_attn_func(num_splits=n) (FA3's split-KV): one launch of the varlen kernel over the padded batch (no
    length arrays, lengths seqlen_q x seqlen_k) writing each split's fp32 partials, merged by the combine into FA3's
    out and lse; the sink in split 0 only. Poisoned partial buffers would show: the emulated kernel writes only its
    rows, the merge reads every split."""
    from flashgen import flash_attn_func
    from test_api_validation import reference

    torch.manual_seed(3)
    b, sq, sk, h, hk, d = 2, 3, 700, 8, 2, 64
    q, k, v = (torch.randn(b, n, hh, d).to(torch.bfloat16) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
    s = torch.randn(h) if sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, num_splits=3, learnable_sink=s,
                               return_attn_probs=True)
    ref, ref_lse = reference(q, k, v, d ** -0.5, causal, window, 0.0, s)
    assert (out.float() - ref).abs().max().item() <= 1.6e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert out.shape == (b, sq, h, d) and out.dtype == q.dtype and lse.shape == (b, h, sq) and lse.is_contiguous()
    split, plain, merges = _func_calls(kernel_on)
    assert not plain and len(split) == 1 and len(merges) == 1 and kernel_on.calls[-1] is merges[0]
    op, lp, mo, ml = merges[0]["combine"]  # the merge reads the partials the kernel wrote, writes out and lse
    assert (op.ptr, op.shape, lp.ptr, mo.ptr, ml.ptr) == (split[0]["out"].ptr, (3, b, sq, h, d), split[0]["lse"].ptr,
                                                        out.data_ptr(), lse.data_ptr())
    vl, o = split[0]["varlen"], split[0]["out"]
    assert (vl.num_splits, vl.batch, vl.max_seqlen_q, vl.max_seqlen_k) == (3, b, sq, sk)
    assert not any(vl.addresses()) and o.dtype == "fp32" and vl.o_stride_split == b * sq * h * d
    assert vl.lse_stride_split == b * h * sq and split[0]["causal"] is causal


def test_flash_attn_func_num_splits_rules(kernel_on, gpu, monkeypatch):
    """Which flash_attn_func calls split: 1 (FA3's default) never; 0 as core.varlen_num_splits says (a decode-like
    call over 1500 keys: several splits; a call whose tiles fill the GPU: none) while core.SPLIT_KV_AUTO; n at most
    one split per 64 keys; each (key, num_splits) prepared once; calls wanting gradients split too (their gradients
    right); the varlen kernel switched off or a misaligned input (the copy path) run unsplit with the same result;
    num_splits must be an int (TypeError naming it)."""
    from flashgen import flash_attn_func
    import flashgen.interface as interface
    from test_api_validation import reference

    torch.manual_seed(4)
    b, sk, h, hk, d = 2, 1500, 8, 2, 64

    def inputs(sq, bb=b):
        return [torch.randn(bb, n, hh, d).to(torch.float16) for n, hh in ((sq, h), (sk, hk), (sk, hk))]

    def splits_of(*args, **kw):
        n = len(kernel_on.calls)
        out = flash_attn_func(*args, **kw)
        q, k, v = args
        assert (out.float() - reference(q, k, v, d ** -0.5, kw.get("causal", False))[0]).abs().max() <= 2e-3
        return _splits_since(kernel_on, n)

    q, k, v = inputs(1)
    assert splits_of(q, k, v) == 1 and splits_of(q, k, v, num_splits=1) == 1
    chosen = core.varlen_num_splits(b, h, hk, 1, sk, 0, core.mask_spec(False, (-1, -1), 1, sk), 2 * d * 2)  # padded
    assert chosen > 1 and splits_of(q, k, v, num_splits=0) == chosen and splits_of(q, k, v, num_splits=-2) == chosen
    assert splits_of(q, k, v, num_splits=100) == -(-sk // 64)  # one split per 64 keys at most
    entries = len(interface._fwd_calls)
    assert splits_of(q, k, v, num_splits=0) == chosen and len(interface._fwd_calls) == entries  # prepared once
    big = inputs(128 * 16, 16)  # 16 x 8 x 16 tiles: they fill the GPU
    assert splits_of(*big, num_splits=0) == 1
    monkeypatch.setattr(core, "SPLIT_KV_AUTO", False)
    interface._fwd_calls.clear()
    assert splits_of(q, k, v, num_splits=0) == 1 and splits_of(q, k, v, num_splits=4) == 4
    monkeypatch.setattr(core, "VARLEN_KERNEL", False)
    interface._fwd_calls.clear()
    assert splits_of(q, k, v, num_splits=4) == 1
    monkeypatch.setattr(core, "VARLEN_KERNEL", True)
    interface._fwd_calls.clear()
    assert splits_of(q, k, v, num_splits=4) == 4
    # gradients: the forward splits too (its merged out and lse are what the backward reads), both through the
    # eager autograd function and the custom op (torch.ops.flashgen.fwd's num_splits)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qr, kr, vr = (t.clone().float().requires_grad_() for t in (q, k, v))
    reference(qr, kr, vr, d ** -0.5, False)[0].sum().backward()
    for run in (lambda: flash_attn_func(qg, kg, vg, num_splits=4),
                lambda: torch.ops.flashgen.fwd(qg, kg, vg, d ** -0.5, False, False, -1, -1, 0.0, None, None, None,
                                               None, None, 4)[0]):
        n = len(kernel_on.calls)
        out = run()
        assert [c["varlen"].num_splits for c in varlen_calls(kernel_on)[-1:]] == [4] and len(kernel_on.calls) == n + 2
        qg.grad = kg.grad = vg.grad = None
        out.float().sum().backward()
        for g, r in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
            assert (g.float() - r).abs().max().item() <= 2e-2
    storage = torch.empty(q.numel() + 1, dtype=q.dtype)  # a q at an address TMA cannot read: copied, unsplit
    qm = storage[1:].view(q.shape)
    qm.copy_(q)
    assert splits_of(qm, k, v, num_splits=4) == 1
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="num_splits must be an int"):
            flash_attn_func(q, k, v, num_splits=bad)


def test_flash_attn_func_num_splits_under_torch_compile(kernel_on, gpu):
    """torch.compile(fullgraph=True) of a training step with num_splits=3: the graph's torch.ops.flashgen.fwd takes
    num_splits and splits as eager does (varlen + combine launches), gradients equal to eager's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from flashgen import flash_attn_func
    from test_api_validation import qkv

    torch._dynamo.reset()

    def loss_fn(q, k, v):
        return (flash_attn_func(q, k, v, causal=True, num_splits=3).float() ** 2).sum()

    eager_in = [t.requires_grad_(True) for t in qkv(sq=3, sk=400, h=8, hk=2)]
    compiled_in = [t.detach().clone().requires_grad_(True) for t in eager_in]
    loss_fn(*eager_in).backward()
    n = len(varlen_calls(kernel_on))
    backend = AotEagerAndRecordGraphs()
    torch.compile(loss_fn, fullgraph=True, backend=backend)(*compiled_in).backward()
    assert n == 1 and [c["varlen"].num_splits for c in varlen_calls(kernel_on)] == [3, 3]
    for a, b in zip(eager_in, compiled_in):
        assert torch.equal(a.grad, b.grad)
    (fw,) = backend.fw_graphs
    assert "flashgen.fwd" in fw.code


# -------------------------------------------------- the DLPack entry's num_splits (flashgen.split_kv, shared)
@pytest.fixture
def dlpack_kernel_on(kernel_on, monkeypatch):
    """kernel_on with the DLPack entry reading CPU arrays as device 0 (test_api_validation's fake_gpu_dlpack)."""
    pytest.importorskip("cuda.core.utils", reason="cuda-core is not installed")
    import flashgen.dlpack_api as dlpack_api

    monkeypatch.setattr(dlpack_api, "_CUDA_DEVICE_TYPES", frozenset({dlpack_api.kDLCPU}))
    return kernel_on


@pytest.mark.parametrize("causal,window,sink,d", [(False, (-1, -1), False, 64), (True, (-1, -1), True, 64),
                                                   (False, (90, 3), False, 64), (True, (-1, -1), False, 72)])
def test_dlpack_forward_num_splits_runs_split_kv(dlpack_kernel_on, monkeypatch, causal, window, sink, d):
    """flash_attn_forward(num_splits=3) on torch arrays: the varlen launch writes the partials into one workspace of
    the call (partial O at its start, partial LSE at the next 256-byte boundary after it, head_dim 72 making that
    boundary differ from O's end), the combine merges them into out and lse; the same bits as
    flash_attn_func(num_splits=3), and the reference's values."""
    import flashgen.dlpack_api as dlpack_api
    from flashgen import flash_attn_func
    from fgutil import torch_allocates_on_cpu
    from test_api_validation import reference

    torch_allocates_on_cpu(monkeypatch)
    torch.manual_seed(5)
    b, sq, sk, h, hk = (2, 3, 700, 8, 2) if d == 64 else (1, 3, 700, 2, 1)  # d 72: the partial O not 256-byte sized
    q, k, v = (torch.randn(b, n, hh, d).to(torch.bfloat16) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
    s = torch.randn(h) if sink else None
    out, lse = dlpack_api.flash_attn_forward(q, k, v, causal=causal, window_size=window, learnable_sink=s,
                                             num_splits=3)
    split, plain, merges = _func_calls(dlpack_kernel_on)
    assert not plain and len(split) == 1 and len(merges) == 1 and dlpack_kernel_on.calls[-1] is merges[0]
    vl, o, l = split[0]["varlen"], split[0]["out"], split[0]["lse"]
    assert (vl.num_splits, vl.batch, vl.max_seqlen_q, vl.max_seqlen_k) == (3, b, sq, sk) and not any(vl.addresses())
    o_bytes = 4 * 3 * b * sq * h * d
    assert o.dtype == "fp32" and l.ptr - o.ptr == -(-o_bytes // 256) * 256  # one workspace: O, then LSE
    op, lp, mo, ml = merges[0]["combine"]
    assert (op.ptr, lp.ptr, mo.ptr, ml.ptr) == (o.ptr, l.ptr, out.data_ptr(), lse.data_ptr())
    ref, ref_lse = reference(q, k, v, d ** -0.5, causal, window, 0.0, s)
    assert (out.float() - ref).abs().max().item() <= 1.6e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    want, want_lse = flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=s, num_splits=3,
                                     return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_dlpack_forward_num_splits_rules(dlpack_kernel_on, monkeypatch):
    """The DLPack entry splits as flash_attn_func does: 1 (default) never, 0 as core.varlen_num_splits says, FP8
    never; a given out with padded strides is written in place by the merge (its padding untouched); without an
    allocator for the workspace (numpy arrays, no CuPy) a split call raises TypeError naming num_splits and the
    memory it needs, while num_splits=1 runs; num_splits must be an int (TypeError naming it, with q's problems)."""
    import flashgen.dlpack_api as dlpack_api
    from fgutil import torch_allocates_on_cpu
    from test_api_validation import reference

    torch_allocates_on_cpu(monkeypatch)
    torch.manual_seed(6)
    b, sq, sk, h, hk, d = 2, 1, 1500, 8, 2, 64
    q, k, v = (torch.randn(b, n, hh, d).to(torch.float16) for n, hh in ((sq, h), (sk, hk), (sk, hk)))

    def splits_of(*args, **kw):
        n = len(dlpack_kernel_on.calls)
        dlpack_api.flash_attn_forward(*args, **kw)
        return _splits_since(dlpack_kernel_on, n)

    chosen = core.varlen_num_splits(b, h, hk, sq, sk, 0, core.mask_spec(False, (-1, -1), sq, sk), 2 * d * 2)
    assert chosen > 1 and splits_of(q, k, v) == 1 and splits_of(q, k, v, num_splits=0) == chosen
    assert splits_of(q, k, v, num_splits=100) == -(-sk // 64)
    f8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
    assert splits_of(*f8, num_splits=4) == 1
    # a given out with padded rows: the merge writes its 64 columns and leaves the rest
    big = torch.full((b, sq, h, d + 8), 7.0, dtype=q.dtype)
    out, lse = big[..., :d], torch.full((b, h, sq), float("nan"))
    dlpack_api.flash_attn_forward(q, k, v, num_splits=4, out=out, lse=lse)
    assert dlpack_kernel_on.calls[-1]["combine"][2].strides == tuple(out.stride())
    ref, ref_lse = reference(q, k, v, d ** -0.5, False)
    assert (out.float() - ref).abs().max().item() <= 2e-3 and torch.equal(big[..., d:], torch.full_like(big[..., d:], 7))
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # numpy arrays and no CuPy: no allocator for the workspace
    monkeypatch.setitem(sys.modules, "cupy", None)
    qn, kn, vn = (t.numpy() for t in (q, k, v))
    on, ln = out.numpy().copy(), lse.numpy().copy()
    with pytest.raises(TypeError, match=r"num_splits=4 \(4 splits; num_splits=1 needs none\) needs \d+ bytes"):
        dlpack_api.flash_attn_forward(qn, kn, vn, num_splits=4, out=on, lse=ln)
    dlpack_api.flash_attn_forward(qn, kn, vn, num_splits=1, out=on, lse=ln)
    assert abs(on.astype("float32") - ref.numpy()).max() <= 2e-3
    with pytest.raises(TypeError, match="num_splits must be an int"):
        dlpack_api.flash_attn_forward(q, k, v, num_splits=2.0)
    with pytest.raises(TypeError, match="2 problems") as err:  # listed with q's dtype problem, in one error
        dlpack_api.flash_attn_forward(q.float(), k, v, num_splits="2")
    assert "num_splits must be an int" in str(err.value)
