"""GPU correctness of ``flashgen.flash_attn_with_kvcache`` (FA3's decoding entry; flashgen.kvcache
runs it on the host side: lengths read on the host, then flash_attn_func calls), in the manner of
FA3's hopper/test_flash_attn.py::test_flash_attn_kvcache: random cache lengths, left padding, paged
caches of page size 1 / 4 / 128, rotary (interleaved or halves) on the appended keys and on q,
causal / local / neither, MHA / GQA / MQA, varlen q. Rule (FA3's kvcache test):
``max|out - ref| <= 2 max|out_pt - ref| + 1e-5`` and ``mean|out - ref| <= 1.5 mean|out_pt - ref|``,
ref the float32 reference on upcast inputs (_ref.kvcache_reference), out_pt the same in the input
dtype; the caches after the call equal the reference's (allclose 1e-3 where rotary rounded keys).
Skipped without an sm_90 GPU (conftest.py) or when a variant is missing.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
import flashgen.core  # noqa: E402,F401  (flashgen imports its submodules lazily: the tests patch flashgen.core)
from flashgen.manifest import load_manifest  # noqa: E402
from _ref import (  # noqa: E402  (tests/gpu on sys.path)
    assert_child_asserts, captured, kvcache_reference, logical_cache, poison_cached_blocks, start_child, variant_missing,
    varlen_launches)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (1, 339), (3, 1024), (64, 800), (128, 128), (256, 512)])
@pytest.mark.parametrize("page_size", [None, 1, 4, 128])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
def test_kvcache_append_and_attend(seqlen_q, seqlen_k, page_size, rotary, causal, local, mha_type, monkeypatch):
    """The composed path (the varlen kernel switched off): what serves the calls the kernel does not take."""
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", False)
    check_kvcache(seqlen_q, seqlen_k, page_size, rotary, causal, local, mha_type)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (1, 339), (3, 1024), (64, 800), (128, 128), (256, 512)])
@pytest.mark.parametrize("rotary", [None, "interleaved"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("mha_type", ["mha", "gqa", "mqa"])
def test_kvcache_varlen_kernel(seqlen_q, seqlen_k, rotary, causal, local, mha_type, monkeypatch):
    """The same with the varlen kernel switched on (flashgen.core.VARLEN_KERNEL): an unpaged cache with left
    padding is one launch whose seqused_k is each entry's length after the append and whose leftpad_k is
    cache_leftpad."""
    launches = count_launches(monkeypatch)
    pads = check_kvcache(seqlen_q, seqlen_k, None, rotary, causal, local, mha_type, varlen=True)
    # leftpad_k is given exactly when some entry has left padding (the drawn paddings may all be 0: seqlen_k 128);
    # without the host read of the lengths (core.VARLEN_NO_HOST_READ) whenever cache_leftpad is (all of them here)
    assert len(launches) == 1 and launches[0] is not None and launches[0].seqused_k
    assert bool(launches[0].leftpad_k) == (any(pads) or flashgen.core.VARLEN_NO_HOST_READ)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 339), (3, 1024), (128, 128)])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_kvcache_varlen_kernel_softcap(seqlen_q, seqlen_k, page_size, causal, local, monkeypatch):
    """softcap (Gemma 2) on the varlen kernel (fwd.py varlen x softcap, session 2026-12-05 (4), written without a GPU;
    core.VARLEN_SOFTCAP switched on here): one launch, against FA3's kvcache reference with softcap, GQA, rotary,
    unpaged with left padding or paged."""
    monkeypatch.setattr(flashgen.core, "VARLEN_SOFTCAP", True)
    launches = count_launches(monkeypatch)
    check_kvcache(seqlen_q, seqlen_k, page_size, "interleaved", causal, local, "gqa", leftpad_on=page_size is None,
                  varlen=True, softcap=30.0)
    assert len(launches) == 1 and launches[0] is not None


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 128), (1, 512), (3, 1024), (64, 768), (128, 128), (256, 512)])
@pytest.mark.parametrize("layout", ["batch_idx", "page16", "page128"])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("prep", [False, True], ids=["torch_append", "prep_kernel"])
def test_kvcache_varlen_kernel_cache_layouts(seqlen_q, seqlen_k, layout, causal, local, prep, monkeypatch):
    """The varlen kernel over cache_batch_idx's rows (a cache of more rows than entries) and over paged caches
    (pages of 16 and 128 rows, read box by box: fwd.cu.j2 load_kv), GQA: one launch each. The step's checks and
    append by torch ops or (``prep``, core.VARLEN_PREP_KERNEL) by the varlen_prep variant's kvcache kernel: the
    caches after the call are the reference's bit for bit (NaN where no entry's tokens are)."""
    if prep and variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    monkeypatch.setattr(flashgen.core, "VARLEN_PREP_KERNEL", prep)
    launches = count_launches(monkeypatch)
    page = {"page16": 16, "page128": 128}.get(layout)
    check_kvcache(seqlen_q, seqlen_k, page, "interleaved", causal, local, "gqa", leftpad_on=page is None,
                  varlen=True, batch_idx=layout == "batch_idx")
    assert len(launches) == 1 and launches[0] is not None
    assert bool(launches[0].page_table) == (page is not None) and bool(launches[0].kv_batch_idx) == (page is None)


@pytest.mark.parametrize("seqlen_q,seqlen_k,num_splits", [(1, 4096, 0), (1, 16384, 0), (4, 3072, 5), (64, 2048, 3),
                                                        (1, 768, 7)])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_varlen_kernel_split_kv(seqlen_q, seqlen_k, num_splits, causal, local, page_size, monkeypatch):
    """Split-KV (flash-decoding): 5 caches x 3 K/V heads leave most SMs idle, so the heuristic splits the keys
    (num_splits 0), or num_splits forces it; each split's fp32 partial, merged by the combine kernel, against the
    reference (padded and paged caches, GQA)."""
    launches = count_launches(monkeypatch)
    monkeypatch.setattr(flashgen.core, "SPLIT_KV_AUTO", True)  # (num_splits 0: the heuristic; the default, whatever the env)
    check_kvcache(seqlen_q, seqlen_k, page_size, None, causal, local, "gqa", leftpad_on=page_size is None, varlen=True,
                  num_splits=num_splits)
    assert len(launches) == 1 and launches[0] is not None and launches[0].num_splits > 1


@pytest.mark.parametrize("seqlen_q,causal,local", [(1, False, False), (3, True, False), (64, False, True)])
def test_kvcache_varlen_kernel_split_kv_mha(seqlen_q, causal, local, monkeypatch):
    """Split-KV with as many K/V heads as query heads (no PackGQA: the unpacked epilogue's fp32 partials)."""
    launches = count_launches(monkeypatch)
    check_kvcache(seqlen_q, 2048, None, None, causal, local, "mha", varlen=True, num_splits=3)
    assert len(launches) == 1 and launches[0] is not None and launches[0].num_splits == 3


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 339), (3, 1024), (1, 4096)])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_kvcache_decode_hd256_one_warpgroup(seqlen_q, seqlen_k, page_size, causal, local, monkeypatch):
    """head_dim 256's decode steps (Gemma's) on the one-warpgroup PackGQA varlen tile (64 x 64, configs/fwd.yaml
    extra; core.DECODE_WG1): GQA, unpaged with left padding or in pages of 16, against FA3's kvcache reference;
    the launch's variant is that tile."""
    launches = count_launches(monkeypatch)
    plans = []
    real = flashgen.core._plan

    def spy(*a, **kw):
        plan = real(*a, **kw)
        plans.append(plan.variant)
        return plan

    monkeypatch.setattr(flashgen.core, "_plan", spy)
    monkeypatch.setattr(flashgen.core, "DECODE_WG1", True)
    check_kvcache(seqlen_q, seqlen_k, page_size, None, causal, local, "gqa", leftpad_on=page_size is None,
                  varlen=True, d=256)
    assert len(launches) == 1 and launches[0] is not None
    if not any(v.params["consumer_wgs"] == 1 for v in plans):
        names = [v.name for v in plans]
        if variant_missing("fwd", {"dtype": "bf16", "head_dim": 256, "head_dim_v": 256, "causal": causal, "local": local,
                                   "softcap": False, "varlen": True, "pack_gqa": True}):
            pytest.skip("MISSING-FWD-VARIANT: head_dim 256's PackGQA varlen variants not built")
        pytest.fail(f"no one-warpgroup variant served the step: {names}")
    assert all(v.params["head_dim"] == 256 for v in plans)


@pytest.mark.parametrize("seqlen_q,seqlen_k,num_splits", [(256, 2048, 1), (200, 4096, 1), (256, 4096, 2), (300, 1536, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_few_tile_varlen(seqlen_q, seqlen_k, num_splits, causal, page_size, monkeypatch):
    """Chunked prefills on head_dim 64's 128 x 128 two-warpgroup varlen tile (core.FEW_TILE_VARLEN switched on here;
    configs/fwd.yaml extra): 5 caches x 6 heads (MHA: GQA at these lengths packs into the PackGQA varlen tile, 128
    rows already) make no more waves of 128-row tiles than of 192-row ones (60 of each, times the splits; 90 against
    60 at 300 queries: one wave each), so the wave rule takes the 128-row tile, except for causal calls over fewer than
    8x seqlen_q keys; unpaged with left padding or in pages of 16, against FA3's kvcache reference."""
    launches = count_launches(monkeypatch)
    monkeypatch.setattr(flashgen.core, "FEW_TILE", True)
    monkeypatch.setattr(flashgen.core, "FEW_TILE_VARLEN", True)
    monkeypatch.setattr(flashgen.core, "_prepared_forwards", {})  # (calls prepared with the rule off: not reused)
    seen = []
    real = flashgen.core.launch_forward

    def spy(prep, *a, **kw):
        seen.append(prep.plan.variant)
        return real(prep, *a, **kw)

    monkeypatch.setattr(flashgen.core, "launch_forward", spy)
    check_kvcache(seqlen_q, seqlen_k, page_size, None, causal, False, "mha", leftpad_on=page_size is None, varlen=True,
                  num_splits=num_splits, d=64)
    assert len(launches) == 1 and launches[0] is not None and launches[0].num_splits == num_splits
    var = seen[-1]
    want = 192 if causal and seqlen_k < flashgen.core.FEW_TILE_CAUSAL_KEYS * seqlen_q else 128
    if want == 128 and not any(
            v.family == "fwd" and v.params["dtype"] == "bf16" and v.params["head_dim"] == 64 and v.params["varlen"]
            and v.params["causal"] == causal and not v.params["local"] and not v.params["softcap"]
            and not v.params.get("pack_gqa") and (v.params["block_m"], v.params["consumer_wgs"]) == (128, 2)
            for v in load_manifest().variants):
        pytest.skip("MISSING-FWD-VARIANT: head_dim 64's unpacked 128 x 128 wg2 varlen tile not built")
    assert var.params["varlen"] and not var.params.get("pack_gqa") and var.params["block_m"] == want, var.name


def count_launches(monkeypatch) -> list:
    """The varlen kernel switched on; the Varlen of each core.attention_forward call (None: not varlen) collected."""
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", True)
    return varlen_launches(monkeypatch, "attention_forward")


def poison_unused(kc, vc, table, ends, starts=None, rows=None) -> None:
    """NaN at every cache position that entry b does not attend to: past ``ends[b]`` (its tokens after the
    append) and before ``starts[b]`` (its left padding), in row ``rows[b]`` (default b) of kc / vc or in the
    pages ``table[b]``; every row of an unpaged cache that no entry names is NaN throughout. Attention over the
    used positions must not see them (P is 0 there, but 0 x NaN is NaN: FA3 lets them through, flash-attention
    issues 1745 and 2374)."""
    rows = list(range(len(ends))) if rows is None else rows
    if table is None:
        for r in set(range(kc.shape[0])) - set(rows):
            kc[r], vc[r] = float("nan"), float("nan")
    for b, end in enumerate(ends):
        lo = 0 if starts is None else starts[b]
        if table is None:
            for c in (kc, vc):
                c[rows[b], end:] = float("nan")
                c[rows[b], :lo] = float("nan")
            continue
        ps = kc.shape[1]
        for j, page in enumerate(table[b].tolist()):  # positions [j * ps, (j + 1) * ps)
            used_to = min(max(end - j * ps, 0), ps)  # the page's rows below end: [0, used_to)
            pad_to = min(max(lo - j * ps, 0), ps)    # its rows below the left padding's end: [0, pad_to)
            for c in (kc, vc):
                c[page, used_to:] = float("nan")
                c[page, :pad_to] = float("nan")


def check_kvcache(seqlen_q, seqlen_k, page_size, rotary, causal, local, mha_type, leftpad_on=True, varlen=False,
                  batch_idx=False, num_splits=0, softcap=0.0, d=128):
    """One call of FA3's kvcache test against the reference (the module docstring's rule; 3x the max error under
    softcap, FA3's forward factor there); ``leftpad_on`` False: no left padding; ``varlen``: the key is the varlen
    kernels' (the skip names them); ``batch_idx``: an unpaged cache of more rows than entries, read through
    cache_batch_idx (FA3's has_batch_idx); ``num_splits``: FA3's (0: chosen); ``softcap``: FA3's; ``d``: the head
    dim. Returns the entries' drawn left paddings."""
    batch, heads = 5, 6
    heads_k = {"mha": 6, "gqa": 3, "mqa": 1}[mha_type]
    if page_size is not None and seqlen_k % page_size:
        pytest.skip("FA3's test: seqlen_k a multiple of the page size")
    key = {"dtype": "bf16", "head_dim": d, "head_dim_v": d, "causal": causal, "local": local, "softcap": softcap > 0}
    # (varlen named both ways: a build of the varlen variants alone has no kernel for the composed path's calls)
    why = variant_missing("fwd", {**key, "varlen": varlen}, round_up=("head_dim", "head_dim_v"))
    if why:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 1000 + seqlen_k)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
    seqlen_new = max(1, seqlen_q // 2)
    q = r(batch, seqlen_q, heads, d)
    k, v = r(batch, seqlen_new, heads_k, d), r(batch, seqlen_new, heads_k, d)
    rows = list(range(batch))
    if page_size is None:
        rows_cache = 2 * batch + 1 if batch_idx else batch
        kc, vc, table = r(rows_cache, seqlen_k, heads_k, d), r(rows_cache, seqlen_k, heads_k, d), None
        if batch_idx:
            rows = torch.randperm(rows_cache, generator=g, device="cuda")[:batch].tolist()
    else:
        pages = seqlen_k // page_size
        blocks = pages * batch * 3
        kc, vc = r(blocks, page_size, heads_k, d), r(blocks, page_size, heads_k, d)
        table = torch.randperm(blocks, generator=g, device="cuda")[:batch * pages].reshape(batch, pages).int()
    # FA3's bound: the appended keys (and, rotated per row, q's positions) stay inside the cache
    high = seqlen_k - (seqlen_q if rotary and (causal or local) else seqlen_new) + 1
    lens = torch.randint(0, high, (batch,), generator=g, device="cuda", dtype=torch.int32)
    leftpad = torch.stack([torch.randint(0, max(int(n), 1), (1,), generator=g, device="cuda")[0] for n in lens]).int()
    if not leftpad_on:
        leftpad.zero_()
    poison_unused(kc, vc, table, (lens + seqlen_new).tolist(), leftpad.tolist(), rows)
    window = tuple(torch.randint(0, seqlen_k, (2,), generator=g, device="cuda").tolist()) if local else (-1, -1)
    rope = None
    if rotary:
        angle = torch.rand(seqlen_k, 32, generator=g, device="cuda") * 2 * math.pi
        rope = (torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16))
    kc0, vc0 = kc.clone(), vc.clone()
    # scratch taken from torch right after (a split call's fp32 partials, up to 32 splits) starts as NaN, not as the
    # zeros of fresh memory: a partial row that no split writes and the merge reads would show in out
    poison_cached_blocks(4 * 32 * batch * seqlen_q * heads * (d + 1))
    out, lse = flashgen.flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=rope and rope[0], rotary_sin=rope and rope[1], cache_seqlens=lens,
        cache_leftpad=leftpad, page_table=table, causal=causal, window_size=window,
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32, device="cuda") if batch_idx else None, num_splits=num_splits,
        rotary_interleaved=rotary == "interleaved", return_softmax_lse=True, softcap=softcap)
    torch.cuda.synchronize()
    args = (q, k, v, kc0, vc0, table, lens.tolist(), leftpad.tolist(), rows, causal, window, rope,
            rotary == "interleaved")
    ref, _, kref, vref = kvcache_reference(*args, softcap=softcap)
    pt, _, _, _ = kvcache_reference(*args, upcast=False, softcap=softcap)
    err, base = (out.float() - ref.float()).abs(), (pt.float() - ref.float()).abs()
    factor = 3 if softcap else 2
    assert err.max().item() <= factor * base.max().item() + 1e-5, \
        f"max error {err.max().item():.3e} vs {base.max().item():.3e}"
    assert err.mean().item() <= 1.5 * base.mean().item(), f"mean error {err.mean().item():.3e} vs {base.mean().item():.3e}"
    assert lse.shape == (batch, heads, seqlen_q) and not torch.isnan(out).any()
    got_k, got_v = logical_cache(kc, table, rows, batch), logical_cache(vc, table, rows, batch)
    assert_same_cache(got_k, got_v, kref, vref, rotary)
    return leftpad.tolist()


def assert_same_cache(got_k, got_v, kref, vref, rotary) -> None:
    """The caches after the call against the reference's: V's bits, K's bits (allclose 1e-3 where rotary rounded
    the new keys), NaN where the reference has NaN (poison_unused's positions, untouched)."""
    assert torch.equal(got_v.isnan(), vref.isnan()) and torch.equal(got_v.nan_to_num(), vref.nan_to_num())
    assert torch.equal(got_k.isnan(), kref.isnan())
    if rotary:
        assert torch.allclose(got_k.float(), kref.float(), rtol=1e-3, atol=1e-3, equal_nan=True)
    else:
        assert torch.equal(got_k.nan_to_num(), kref.nan_to_num())


@pytest.mark.parametrize("rotary", [None, "interleaved"])
@pytest.mark.parametrize("mha_type", ["gqa", "mqa"])
@pytest.mark.parametrize("prep", [False, True], ids=["torch_append", "prep_kernel"])
def test_kvcache_decode_step_in_a_cuda_graph(rotary, mha_type, prep, monkeypatch):
    """A decode step (one query, one new key per entry, causal) captured in a CUDA graph with the varlen kernel
    switched on (kvcache._step_on_device: no length read on the host), then replayed for other cache_seqlens
    written into the same tensor: each replay's out and caches against the reference of those lengths. The append
    by torch ops or (``prep``) by the kvcache kernel, captured too."""
    if prep and variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    monkeypatch.setattr(flashgen.core, "VARLEN_PREP_KERNEL", prep)
    monkeypatch.setattr(flashgen.core, "KVCACHE_ROTARY_KERNEL", prep)
    d, batch, heads, cache = 128, 5, 8, 512
    heads_k = {"gqa": 2, "mqa": 1}[mha_type]
    key = {"dtype": "bf16", "head_dim": d, "head_dim_v": d, "causal": False, "local": False, "softcap": False,
           "varlen": True}
    why = variant_missing("fwd", key) or variant_missing("fwd", {**key, "pack_gqa": True})
    if why:
        pytest.skip(why)
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", True)
    g, (q, k, v, kc, vc) = decode_inputs(batch, heads, heads_k, d, cache, seed=7)
    kc0, vc0 = kc.clone(), vc.clone()
    lens = torch.tensor([3, 100, 0, 511, 257], dtype=torch.int32, device="cuda")
    rope = None
    if rotary:
        angle = torch.rand(cache, 32, generator=g, device="cuda") * 2 * math.pi
        rope = (torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16))
    kw = dict(rotary_cos=rope and rope[0], rotary_sin=rope and rope[1], cache_seqlens=lens, causal=True,
              rotary_interleaved=True, return_softmax_lse=True)
    graph, (out, lse) = captured(lambda: flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, **kw))
    for new_lens in ([3, 100, 0, 511, 257], [0, 1, 2, 300, 17]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        kp, vp = kc0.clone(), vc0.clone()  # NaN past each entry's tokens after the append
        poison_unused(kp, vp, None, [n + 1 for n in new_lens])
        kc.copy_(kp)
        vc.copy_(vp)
        graph.replay()
        torch.cuda.synchronize()
        args = (q, k, v, kp, vp, None, new_lens, [0] * batch, list(range(batch)), True, (-1, -1), rope, True)
        ref, ref_lse, kref, vref = kvcache_reference(*args)
        pt, _, _, _ = kvcache_reference(*args, upcast=False)
        err, base = (out.float() - ref.float()).abs(), (pt.float() - ref.float()).abs()
        assert err.max().item() <= 2 * base.max().item() + 1e-5, (new_lens, err.max().item(), base.max().item())
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert torch.allclose(lse[finite], ref_lse[finite].to(lse.device), atol=2e-3)
        assert not out.isnan().any()
        assert_same_cache(logical_cache(kc, None, list(range(batch)), batch),
                          logical_cache(vc, None, list(range(batch)), batch), kref, vref, rotary)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("cos_dtype", ["fp32", "same"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("layout", ["rows", "pages"])
def test_kvcache_rotary_in_the_kernel_is_the_torch_paths(dtype, cos_dtype, interleaved, layout, monkeypatch):
    """A decode step with rotary (96 of 128 dims rotated, rotary_seqlens apart from cache_seqlens, 3 new keys and 3
    causal q rows per entry) on the kvcache kernel (q and the new keys rotated in it) and on torch ops
    (kvcache.apply_rotary): the same bits in out, lse and both caches. The kernel rounds each product and sum in
    float32 as torch's kernels do, so nothing may differ."""
    if variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    key = {"dtype": dtype, "head_dim": 128, "head_dim_v": 128, "causal": True, "local": False, "softcap": False,
           "varlen": True}
    if variant_missing("fwd", key):
        pytest.skip(variant_missing("fwd", key))
    g = torch.Generator(device="cuda").manual_seed(13)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dt)  # noqa: E731
    batch, heads, heads_k, cache, page = 4, 8, 2, 256, 16
    q, k, v = r(batch, 3, heads, 128), r(batch, 3, heads_k, 128), r(batch, 3, heads_k, 128)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    kw = dict(cache_seqlens=i32([0, 77, 250, 131]), rotary_seqlens=i32([5, 0, 300, 97]), causal=True,
              rotary_interleaved=interleaved, return_softmax_lse=True)
    if layout == "pages":
        kc, vc = r(batch * cache // page, page, heads_k, 128), r(batch * cache // page, page, heads_k, 128)
        kw["page_table"] = torch.randperm(batch * cache // page, generator=g, device="cuda").view(batch, -1).int()
    else:
        kc, vc = r(batch, cache, heads_k, 128), r(batch, cache, heads_k, 128)
    angle = torch.rand(310, 48, generator=g, device="cuda") * 2 * math.pi
    tdt = torch.float32 if cos_dtype == "fp32" else dt
    kw.update(rotary_cos=torch.cos(angle).to(tdt), rotary_sin=torch.sin(angle).to(tdt))
    import flashgen.kvcache as kvm

    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", True)
    monkeypatch.setattr(flashgen.core, "VARLEN_NO_HOST_READ", True)  # (the default: lengths on the GPU stay there)
    monkeypatch.setattr(flashgen.core, "KVCACHE_ROTARY_KERNEL", True)
    launched, real = [], kvm._kvcache_prep_launch  # (whether each kvcache kernel launch rotated)
    monkeypatch.setattr(kvm, "_kvcache_prep_launch", lambda *a: launched.append(a[12] is not None) or real(*a))
    got = {}
    for prep in (False, True):
        monkeypatch.setattr(flashgen.core, "VARLEN_PREP_KERNEL", prep)
        kcp, vcp = kc.clone(), vc.clone()
        out, lse = flashgen.flash_attn_with_kvcache(q, kcp, vcp, k, v, **kw)
        got[prep] = (out, lse, kcp, vcp)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), got[False], got[True]):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    assert launched == [True] and not torch.equal(got[True][2], kc)  # (the kernel rotated; the append happened)


@pytest.mark.parametrize("kernel", [False, True])
def test_kvcache_one_length_in_a_cuda_graph(kernel, monkeypatch):
    """A decode step with cache_seqlens an int (every entry at one length) captured in a CUDA graph, with the varlen
    kernel off or on: a slice append and one flash_attn_func call (kvcache._step_on_device), no varlen kernel needed.
    The replay's out and caches against the reference."""
    d, batch, heads, heads_k, cache, length = 128, 3, 8, 2, 256, 77
    key = {"dtype": "bf16", "head_dim": d, "head_dim_v": d, "causal": True, "local": False, "softcap": False,
           "varlen": False}
    why = variant_missing("fwd", key)
    if why:
        pytest.skip(why)
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", kernel)
    _, (q, k, v, kc, vc) = decode_inputs(batch, heads, heads_k, d, cache, seed=9)
    poison_unused(kc, vc, None, [length + 1] * batch)
    kc0, vc0 = kc.clone(), vc.clone()
    graph, out = captured(lambda: flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=length, causal=True))
    kc.copy_(kc0)
    vc.copy_(vc0)
    graph.replay()
    torch.cuda.synchronize()
    args = (q, k, v, kc0, vc0, None, [length] * batch, [0] * batch, list(range(batch)), True, (-1, -1))
    ref, _, kref, vref = kvcache_reference(*args)
    pt, _, _, _ = kvcache_reference(*args, upcast=False)
    err, base = (out.float() - ref.float()).abs(), (pt.float() - ref.float()).abs()
    assert err.max().item() <= 2 * base.max().item() + 1e-5 and not out.isnan().any()
    assert_same_cache(kc, vc, kref, vref, None)


def decode_inputs(batch, heads, heads_k, d, cache, seed):
    """A decode step's bf16 inputs on the GPU: ``(generator, (q, k, v, k_cache, v_cache))``, one query and one new
    key per entry, caches of ``cache`` positions (random throughout)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return g, (r(batch, 1, heads, d), r(batch, 1, heads_k, d), r(batch, 1, heads_k, d), r(batch, cache, heads_k, d),
               r(batch, cache, heads_k, d))


# A decode step with one broken cache argument, in a child interpreter (a device-side assert loses the CUDA context):
# 3 entries, caches of 64 positions (pages of 16 for "table"), one new token each.
_BAD_STEP_CHILD = """
import torch, flashgen
g = torch.Generator(device="cuda").manual_seed(5)
r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)
i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")
bad = {bad!r}
paged = "table" in bad
kc, vc = (r(12, 16, 2, 128) if paged else r(4, 64, 2, 128) for _ in range(2))
kw = dict(cache_seqlens=i32(bad.get("lens", [3, 10, 40])))
if paged:
    kw["page_table"] = i32(bad["table"])
if "rows" in bad:
    kw["cache_batch_idx"] = i32(bad["rows"])
if "pads" in bad:
    kw["cache_leftpad"] = i32(bad["pads"])
if "ro" in bad:  # rotary over 64 of 128 dims, a table of 50 positions
    t = torch.rand(50, 32, generator=g, device="cuda")
    kw.update(rotary_cos=torch.cos(t).bfloat16(), rotary_sin=torch.sin(t).bfloat16(), rotary_seqlens=i32(bad["ro"]))
try:
    flashgen.flash_attn_with_kvcache(r(3, 1, 4, 128), kc, vc, r(3, 1, 2, 128), r(3, 1, 2, 128), causal=True, **kw)
    torch.cuda.synchronize()
    print("no error")
except Exception as e:  # (torch's RuntimeError at the synchronisation, or a later launch's CUDA error)
    print("raised:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""
BAD_STEPS = [
    ({"lens": [3, -1, 40]}, "cache_seqlens + the new tokens"),
    ({"lens": [3, 64, 40]}, "cache_seqlens + the new tokens"),
    ({"rows": [0, 4, 1]}, "cache_batch_idx must name distinct rows"),
    ({"rows": [2, 0, 2]}, "cache_batch_idx must name distinct rows"),
    ({"pads": [0, 12, 2]}, "cache_leftpad must lie between 0"),
    ({"table": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 12, 10, 11]]}, "page_table's used entries"),
    ({"ro": [3, 50, 2]}, "rotary positions"),
]


BAD_STEP_KEY = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "local": False, "softcap": False,
                "varlen": True}


def _bad_step_env(prep: str) -> dict:
    return {"FLASHGEN_VARLEN_NO_HOST_READ": "1", "FLASHGEN_VARLEN_PREP_KERNEL": prep,
            "FLASHGEN_KVCACHE_ROTARY_KERNEL": prep}


@pytest.fixture(scope="module")
def bad_step_children():
    """Every case's child interpreter started at once (their start-up overlaps: _ref.start_child)."""
    for prep in ("0", "1"):
        if not variant_missing("fwd", BAD_STEP_KEY) and (prep == "0" or not variant_missing("varlen_prep", {})):
            for bad, _ in BAD_STEPS:
                start_child(_BAD_STEP_CHILD.format(bad=bad), _bad_step_env(prep))


@pytest.mark.parametrize("prep", ["0", "1"], ids=["torch_checks", "prep_kernel"])
@pytest.mark.parametrize("bad,fragment", BAD_STEPS)
def test_kvcache_bad_gpu_arguments_are_a_device_assert_naming_the_argument(bad, fragment, prep, bad_step_children):
    """An eager decode step with its lengths on the GPU (kvcache._step_on_device: no host read) checks the cache
    arguments on the GPU: a length past the cache or below 0, a cache_batch_idx row out of range or named twice, a
    left padding past the entry's tokens, a used page out of range, a rotary position past rotary_cos's rows are a
    device-side assert (torch._assert_async, or
    with core.VARLEN_PREP_KERNEL the kvcache kernel's) whose message names the argument, raised at the next
    synchronisation. In a child interpreter (an assert loses the CUDA context)."""
    why = variant_missing("fwd", BAD_STEP_KEY) or (prep == "1" and variant_missing("varlen_prep", {}))
    if why:
        pytest.skip(why)
    assert_child_asserts(_BAD_STEP_CHILD.format(bad=bad), fragment, _bad_step_env(prep), bad)
