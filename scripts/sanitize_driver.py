"""Driver for scripts/sanitize.sh: small calls of every kernel family in the manifest, checked on the CPU.

Meant to run under NVIDIA compute-sanitizer (memcheck, racecheck, synccheck, initcheck), also alone:

    python3 scripts/sanitize_driver.py

Cases (only those whose variant is built run; a family with no runnable case fails):
  fwd      flash_attn_func, fp16 and bf16 x head_dim 64 and 128 x causal and not, and head_dim 256
           causal (the first warpgroup's first-block skip of the 128x48 tile), batch 2,
           seqlen_q 113, seqlen_k 239, heads 4 over heads_k 2 (GQA); k and v are KV-cache
           prefixes of a longer cache.
  bwd      flash_attn_backward (DLPack entry, torch tensors) into NaN-free gradients: bf16 d64 causal,
           fp16 d128 full (both: dQ staged for the reducer warp), bf16 d256 causal, fp16 d192 full
           (both: the consumers' own dQ reductions), the first two deterministic; head_dim_v !=
           head_dim: bf16 192/128 causal deterministic (hd192: dV's third slice not stored), fp16
           64/128 full (hd128: Q, K half zero-filled); same shapes as fwd; out and lse from the
           float32 reference.
  combine  flash_attn_combine into fp32, bf16 and fp16 (5 splits, seqlen 113, head_dim 64), and
           fp32 with head_dim 62 (the scalar path); FA3's transposed layouts cut from padded
           buffers; splits 2.. of batch 0 saw no key (lse -inf).
  fwd e4m3 flash_attn_func on e4m3 inputs with (batch, heads_k) descales, head_dim 64 causal, 128
           full, 256 full and causal (the V transposer threads and their stop index; hd256: the
           24-register producer), batch 2, seqlen_q 300, seqlen_k 517, heads 4 over heads_k 2;
           FA3's FP8 rule (tests/gpu/test_fp8_gpu.py: _check).
  fwd varlen  the varlen kernel (core.VARLEN_KERNEL switched on for the case), bf16 d128 causal, heads 8 over 2:
           flash_attn_varlen_func on packed sequences (one without queries, lengths past block edges); and
           flash_attn_with_kvcache (no append, q of 3 rows: PackGQA) over a padded cache, a cache of more rows
           read through cache_batch_idx with cache_leftpad, and pages of 16 rows in a shuffled pool (these two
           with 3 splits of the keys, merged by the combine kernel). The cache
           rows past each entry's tokens are never written (whatever is there, NaN included, must not reach
           out: the kernel zeroes V's rows past the keys in shared memory).
  bwd varlen  the varlen backward (core.VARLEN_KERNEL and core.VARLEN_BWD_KERNEL switched on for the case; bwd.cu.j2
           kVarlen): flash_attn_varlen_func's gradients over packed sequences (one without queries, one without
           keys, lengths past block edges), heads 8 over 2: bf16 d128 causal, fp16 d64 full deterministic (block_m
           128: two dQ tiles per consumer), bf16 d256 causal deterministic (the role tiles, unpaired); each
           sequence's dq, dk, dv by FA3's rule (check_bwd), zeros where no query or no key.
  quant    quantize_fp8, bf16 and fp16, head dims 128 / 96 / 192 (head_dim_v 128), all four scale
           modes over the cases, batch 2, seqlen_q 113, seqlen_k 239, heads 4 over heads_k 2; k and
           v are KV-cache prefixes of a longer cache (the rows past seqlen_k are never written).

Inputs are drawn on the CPU from fixed seeds and copied in with plain host-to-device copies,
results are copied out and checked on the CPU against tests/gpu/_ref.py (FA3's rule for the
forward, the float64 merge for combine), so the GPU runs flashgen's kernels and copies only.
Memory the kernels must not read is never written: the KV cache beyond seqlen_k, the padding of
the combine buffers, and the partials of the splits with lse -inf (initcheck flags ordinary
global loads of it, as in combine; TMA loads, as in the forward, are invisible to initcheck).
With PYTORCH_NO_CUDA_MEMORY_CACHING=1 (sanitize.sh sets it for memcheck and initcheck) every
tensor is its own cudaMalloc, so memcheck bounds each exactly.

Every family in the manifest (flashgen.load_manifest().variants[i].family) must have an entry in
CASES: a new family fails here until a case is written for it. SANITIZE_ONLY=TEXT (environment)
runs only the cases whose names contain TEXT (e.g. "e4m3": a sanitizer pass over one change) and,
when TEXT is a family's name (e.g. "varlen_prep"), every case of that family; the families it leaves
without a case are then skipped, not failed, but a TEXT that selects no case at all fails the run
(session 11: SANITIZE_ONLY=varlen_prep matched no case name and memcheck "passed" over 0 cases).

Exit status: 0 when every case ran and matched its reference; 1 otherwise.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from pathlib import Path

import torch

import flashgen
from flashgen import flash_attn_combine, flash_attn_func
from flashgen.interface import incoherent_signs
from flashgen.dispatch import MissingVariantError, select_variant

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from _ref import attention_ref, check_bwd, check_fwd, check_quantized, combine_ref  # noqa: E402

NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def built(family: str, key: dict) -> bool:
    try:
        select_variant(family, key)
        return True
    except MissingVariantError:
        return False


def randn(*shape, seed: int, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def put(view: torch.Tensor, src: torch.Tensor) -> None:
    """Copy CPU ``src`` into the CUDA ``view`` block by contiguous block (host-to-device copies, no
    kernel), leaving the memory between the blocks as it was (never written)."""
    if view.is_contiguous():
        view.copy_(src)
    else:
        for i in range(view.shape[0]):
            put(view[i], src[i])


def fwd_case(dtype, d: int, causal: bool, seed: int, shape=(2, 113, 239, 4, 2)) -> None:
    b, sq, sk, h, hk = shape
    cap = sk + 81
    q, k, v = randn(b, sq, h, d, seed=seed, dtype=dtype), randn(b, sk, hk, d, seed=seed + 1, dtype=dtype), \
        randn(b, sk, hk, d, seed=seed + 2, dtype=dtype)
    q_dev = q.cuda()
    k_cache = torch.empty(b, cap, hk, d, dtype=dtype, device="cuda")  # rows sk.. never written
    v_cache = torch.empty(b, cap, hk, d, dtype=dtype, device="cuda")
    put(k_cache[:, :sk], k)
    put(v_cache[:, :sk], v)
    out, lse = flash_attn_func(q_dev, k_cache[:, :sk], v_cache[:, :sk], causal=causal, return_attn_probs=True)
    out, lse = out.cpu(), lse.cpu()
    check_fwd(q, k, v, causal, out, lse)


def bwd_case(dtype, d: int, dv: int, causal: bool, deterministic: bool, seed: int) -> None:
    b, sq, sk, h, hk = 2, 113, 239, 4, 2
    q, k, v = randn(b, sq, h, d, seed=seed, dtype=dtype), randn(b, sk, hk, d, seed=seed + 1, dtype=dtype), \
        randn(b, sk, hk, dv, seed=seed + 2, dtype=dtype)
    dout = randn(b, sq, h, dv, seed=seed + 3, dtype=dtype)
    out, lse = attention_ref(q, k, v, causal, d ** -0.5)
    dev = [x.cuda() for x in (dout, q, k, v, out, lse)]
    grads = flashgen.flash_attn_backward(*dev, causal=causal, deterministic=deterministic)
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, tuple(g.cpu() for g in grads))


def bwd_varlen_case(dtype, d: int, causal: bool, deterministic: bool, seed: int) -> None:
    import flashgen.core as core

    h, hk = 8, 2
    lens_q, lens_k = [37, 0, 129, 5, 70], [100, 17, 129, 260, 0]
    cu = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q = randn(sum(lens_q), h, d, seed=seed, dtype=dtype)
    k, v = randn(sum(lens_k), hk, d, seed=seed + 1, dtype=dtype), randn(sum(lens_k), hk, d, seed=seed + 2, dtype=dtype)
    dout = randn(sum(lens_q), h, d, seed=seed + 3, dtype=dtype)
    saved = core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, core.attention_backward
    launches = []
    core.VARLEN_KERNEL = core.VARLEN_BWD_KERNEL = True
    core.attention_backward = lambda *a, **kw: launches.append(kw.get("varlen")) or saved[2](*a, **kw)
    try:
        leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
        out = flashgen.flash_attn_varlen_func(*leaves, cu_q.cuda(), cu_k.cuda(), max(lens_q), max(lens_k),
                                              causal=causal, deterministic=deterministic)
        dq, dk, dv = (g.cpu() for g in torch.autograd.grad(out, leaves, dout.cuda()))
    finally:
        core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, core.attention_backward = saved
    assert len(launches) == 1 and launches[0] is not None, "the varlen backward did not run"
    for b in range(len(lens_q)):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lens_q[b] and lens_k[b]:
            check_bwd(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], causal,
                      (dq[rq][None], dk[rk][None], dv[rk][None]))
        elif lens_q[b]:
            assert not dq[rq].any(), f"sequence {b} has no key: dq must be 0"
        elif lens_k[b]:
            assert not dk[rk].any() and not dv[rk].any(), f"sequence {b} has no query: dk, dv must be 0"


def combine_case(out_dtype, d: int, seed: int) -> None:
    ns, b, s, h, pad = 5, 2, 113, 3, 7
    op = randn(ns, b, h, s, d, seed=seed)  # FA3's layouts: (.., heads, seqlen, ..) buffers, transposed
    lp = randn(ns, b, h, s, seed=seed + 1)
    lp[2:, 0] = -math.inf  # splits 2.. of batch 0 saw no key: their partials are never written
    op_buf = torch.empty(ns, b, h, s + pad, d, device="cuda")  # seqlen padded: the pad is never written
    lp_buf = torch.empty(ns, b, h, s + pad, device="cuda")
    for i in range(ns):
        for j in range(b):
            if not (i >= 2 and j == 0):
                put(op_buf[i, j, :, :s], op[i, j])
    put(lp_buf[..., :s], lp)
    out, lse = flash_attn_combine(op_buf[:, :, :, :s].transpose(2, 3), lp_buf[..., :s].transpose(2, 3),
                                  out_dtype=out_dtype)
    out, lse = out.cpu(), lse.transpose(1, 2).cpu().transpose(1, 2)  # lse: a (b, h, s) buffer, copied as is
    ref, lse_ref = combine_ref(op.transpose(2, 3), lp.transpose(2, 3))
    err = (out.double() - ref).abs().max().item()
    rounding = (ref.to(out_dtype).double() - ref).abs().max().item()
    assert err <= 2 * rounding + 1e-5, f"max|out - ref| {err:.3e} > 2 x rounding {rounding:.3e} + 1e-5"
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)


def quant_case(dtype, d: int, dv: int, incoherent: bool, block_quant: bool, seed: int) -> None:
    b, sq, sk, cap, h, hk = 2, 113, 239, 320, 4, 2
    q, k, v = randn(b, sq, h, d, seed=seed, dtype=dtype), randn(b, sk, hk, d, seed=seed + 1, dtype=dtype), \
        randn(b, sk, hk, dv, seed=seed + 2, dtype=dtype)
    k[0, 5, 1, 3] = 40.0  # an outlier
    k_cache = torch.empty(b, cap, hk, d, dtype=dtype, device="cuda")  # rows sk.. never written
    v_cache = torch.empty(b, cap, hk, dv, dtype=dtype, device="cuda")
    put(k_cache[:, :sk], k)
    put(v_cache[:, :sk], v)
    got = flashgen.quantize_fp8(q.cuda(), k_cache[:, :sk], v_cache[:, :sk], incoherent=incoherent,
                                block_quant=block_quant, seed=seed)
    got = tuple(x.cpu() for x in got)
    check_quantized(got, q, k, v, incoherent, block_quant, incoherent_signs(d, seed))


def fwd_cases():
    combos = [(dt, d, c) for dt in (torch.float16, torch.bfloat16) for d in (64, 128) for c in (False, True)]
    # hd256 causal: the tables' 128x48 tile at this seqlen_k, whose first warpgroup skips tile 0's first
    # block (keys 192-238: its rows see keys below 190; fwd.py first_block_skip)
    combos += [(torch.float16, 256, True), (torch.bfloat16, 256, True)]
    for i, (dtype, d, causal) in enumerate(combos):
        key = {"dtype": NAME[dtype], "head_dim": d, "head_dim_v": d, "causal": causal}
        if built("fwd", key):
            yield f"fwd {NAME[dtype]} d{d} {'causal' if causal else 'full'} b2 q113 k239 h4/2", \
                lambda dtype=dtype, d=d, causal=causal, i=i: fwd_case(dtype, d, causal, seed=10 * i)


def fwd_packed_cases():
    """PackGQA (decode-like calls, group 4: core.pack_gqa_rule packs them): 5-D Q loads, per-row stores."""
    for i, (dtype, d, causal) in enumerate(((torch.bfloat16, 128, True), (torch.float16, 64, False),
                                            (torch.bfloat16, 256, False))):
        key = {"dtype": NAME[dtype], "head_dim": d, "head_dim_v": d, "causal": causal, "pack_gqa": True}
        if built("fwd", key):
            yield f"fwd packgqa {NAME[dtype]} d{d} {'causal' if causal else 'full'} b2 q5 k239 h8/2", \
                lambda dtype=dtype, d=d, causal=causal, i=i: fwd_case(dtype, d, causal, seed=100 + i,
                                                                      shape=(2, 5, 239, 8, 2))


def fwd_fp8_cases():
    """e4m3: the transposer threads, their stop at the producer's V block index, the 24-register producer (hd256)."""
    for i, (d, causal) in enumerate(((64, True), (128, False), (256, False), (256, True))):
        if built("fwd", {"dtype": "e4m3", "head_dim": d, "head_dim_v": d, "causal": causal}):
            yield f"fwd e4m3 d{d} {'causal' if causal else 'full'} b2 q300 k517 h4/2", \
                lambda d=d, causal=causal, i=i: fwd_fp8_case(d, causal, seed=200 + i)


def fwd_varlen_case(layout: str, seed: int) -> None:
    import flashgen.core as core

    d, h, hk, dtype = 128, 8, 2, torch.bfloat16
    core.VARLEN_KERNEL = True
    try:
        if layout == "packed":
            lens_q, lens_k = [37, 0, 129, 5], [100, 17, 129, 260]
            cu_q = torch.tensor([0] + [sum(lens_q[:i + 1]) for i in range(4)], dtype=torch.int32)
            cu_k = torch.tensor([0] + [sum(lens_k[:i + 1]) for i in range(4)], dtype=torch.int32)
            q = randn(sum(lens_q), h, d, seed=seed, dtype=dtype)
            k, v = randn(sum(lens_k), hk, d, seed=seed + 1, dtype=dtype), randn(sum(lens_k), hk, d, seed=seed + 2,
                                                                                   dtype=dtype)
            out, lse = flashgen.flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(),
                                                       max(lens_q), max(lens_k), causal=True, return_attn_probs=True)
            out, lse = out.cpu(), lse.cpu()
            for b in range(4):
                if lens_q[b]:
                    a, e, ka, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
                    check_fwd(q[a:e][None], k[ka:ke][None], v[ka:ke][None], True, out[a:e][None], lse[:, a:e][None])
            return
        batch, sq, cap, page = 5, 3, 320, 16
        lens = [1, 77, 129, 320, 200]  # tokens per entry (cache_seqlens; no append)
        pads = [0, 5, 0, 31, 128] if layout == "rows" else [0] * batch
        rows = [6, 0, 3, 7, 1] if layout == "rows" else list(range(batch))
        q = randn(batch, sq, h, d, seed=seed, dtype=dtype)
        kl = [randn(n, hk, d, seed=seed + 10 + b, dtype=dtype) for b, n in enumerate(lens)]
        vl = [randn(n, hk, d, seed=seed + 20 + b, dtype=dtype) for b, n in enumerate(lens)]
        table = None
        if layout == "paged":
            per = cap // page
            order = torch.randperm(batch * per, generator=torch.Generator().manual_seed(seed))
            table = order.view(batch, per).to(torch.int32)
            kc = torch.empty(batch * per, page, hk, d, dtype=dtype, device="cuda")  # the pages' unused rows never written
            vc = torch.empty(batch * per, page, hk, d, dtype=dtype, device="cuda")
            for b, n in enumerate(lens):
                for j in range(-(-n // page)):
                    rows_j = min(page, n - j * page)
                    put(kc[table[b, j], :rows_j], kl[b][j * page:j * page + rows_j])
                    put(vc[table[b, j], :rows_j], vl[b][j * page:j * page + rows_j])
            table = table.cuda()
        else:
            kc = torch.empty(8 if layout == "rows" else batch, cap, hk, d, dtype=dtype, device="cuda")
            vc = torch.empty_like(kc)
            for b, n in enumerate(lens):  # rows [pads[b], n) of entry b's cache row; the others never written
                put(kc[rows[b], pads[b]:n], kl[b][pads[b]:])
                put(vc[rows[b], pads[b]:n], vl[b][pads[b]:])
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")
        out, lse = flashgen.flash_attn_with_kvcache(
            q.cuda(), kc, vc, cache_seqlens=i32(lens), page_table=table, causal=True, return_softmax_lse=True,
            cache_batch_idx=i32(rows) if layout == "rows" else None,
            cache_leftpad=i32(pads) if layout == "rows" else None, num_splits=1 if layout == "cache" else 3)
        out, lse = out.cpu(), lse.cpu()
        for b in range(batch):
            check_fwd(q[b:b + 1], kl[b][pads[b]:][None], vl[b][pads[b]:][None], True, out[b:b + 1], lse[b:b + 1])
    finally:
        core.VARLEN_KERNEL = False


def kvcache_rotary_case(interleaved: bool, seed: int) -> None:
    """A decode step with an append and rotary (pages of 16, 96 of 128 dims, 2 new keys and 2 causal q rows an
    entry) with the rotation in the kvcache kernel and by torch ops: the same out and caches, bit for bit."""
    import flashgen.core as core

    batch, h, hk, d, page, per = 3, 8, 2, 128, 16, 8
    dtype = torch.bfloat16
    q, k, v = (randn(batch, 2, n, d, seed=seed + i, dtype=dtype).cuda() for i, n in enumerate((h, hk, hk)))
    kc, vc = (randn(batch * per, page, hk, d, seed=seed + 5 + i, dtype=dtype).cuda() for i in range(2))
    table = torch.randperm(batch * per, generator=torch.Generator().manual_seed(seed)).view(batch, per)
    angle = torch.rand(200, 48, generator=torch.Generator().manual_seed(seed))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    kw = dict(cache_seqlens=i32([0, 70, 126]), rotary_seqlens=i32([3, 150, 9]), page_table=table.int().cuda(),
              rotary_cos=torch.cos(angle).cuda(), rotary_sin=torch.sin(angle).cuda(), causal=True,
              rotary_interleaved=interleaved)
    saved = (core.VARLEN_KERNEL, core.VARLEN_NO_HOST_READ, core.VARLEN_PREP_KERNEL, core.KVCACHE_ROTARY_KERNEL)
    got = []
    try:
        core.VARLEN_KERNEL = core.VARLEN_NO_HOST_READ = core.VARLEN_PREP_KERNEL = True
        for rot in (False, True):
            core.KVCACHE_ROTARY_KERNEL = rot
            kcr, vcr = kc.clone(), vc.clone()
            got.append((flashgen.flash_attn_with_kvcache(q, kcr, vcr, k, v, **kw), kcr, vcr))
    finally:
        core.VARLEN_KERNEL, core.VARLEN_NO_HOST_READ, core.VARLEN_PREP_KERNEL, core.KVCACHE_ROTARY_KERNEL = saved
    for a, b, name in zip(got[0], got[1], ("out", "k_cache", "v_cache")):
        if not torch.equal(a, b):
            raise AssertionError(f"kvcache rotary: {name} differs between the kernel and torch ops")


def fwd_varlen_cases():
    """The varlen kernel: packed sequences, and KV caches whose unused rows were never written."""
    if built("fwd", {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "varlen": True}):
        for i, layout in enumerate(("packed", "cache", "rows", "paged")):
            yield f"fwd varlen {layout} bf16 d128 causal h8/2", \
                lambda layout=layout, i=i: fwd_varlen_case(layout, seed=400 + 10 * i)


def varlen_prep_cases():
    """The varlen_prep variant's kvcache kernel with an append and rotary (its main kernel runs in the fwd family's
    varlen cases, on by default)."""
    if built("fwd", {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "varlen": True}):
        for interleaved in (True, False):
            yield f"varlen kvcache append rotary {'interleaved' if interleaved else 'halves'} bf16 d128", \
                lambda interleaved=interleaved: kvcache_rotary_case(interleaved, seed=470)


def fwd_fp8_case(d: int, causal: bool, seed: int) -> None:
    import test_fp8_gpu as t  # its inputs, descales and FA3's FP8 rule

    b, sq, sk, h, hk = 2, 300, 517, 4, 2
    q8, k8, v8 = t._inputs(b, sq, sk, h, hk, d, seed)
    ds = t._descales("head", b, sq, sk, h, hk, seed)
    out, lse = flashgen.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0], k_descale=ds[1],
                                        v_descale=ds[2], return_attn_probs=True)
    t._check(q8, k8, v8, ds, causal, out, lse, d ** -0.5)


def bwd_cases():
    for i, (dtype, d, dv, causal, det) in enumerate(((torch.bfloat16, 64, 64, True, True),
                                                     (torch.float16, 128, 128, False, True),
                                                     (torch.bfloat16, 256, 256, True, False),
                                                     (torch.float16, 256, 256, False, True),
                                                     (torch.float16, 192, 192, False, False),
                                                     (torch.bfloat16, 192, 128, True, True),
                                                     (torch.float16, 64, 128, False, False))):
        if built("bwd", {"dtype": NAME[dtype], "head_dim": max(d, dv), "causal": causal}):
            yield f"bwd {NAME[dtype]} d{d}{f' dv{dv}' if dv != d else ''} {'causal' if causal else 'full'}" \
                  f"{' det' if det else ''} b2 q113 k239 h4/2", \
                lambda dtype=dtype, d=d, dv=dv, causal=causal, det=det, i=i: bwd_case(dtype, d, dv, causal, det,
                                                                                       seed=200 + 10 * i)
    for i, (dtype, d, causal, det) in enumerate(((torch.bfloat16, 128, True, False), (torch.float16, 64, False, True),
                                                 (torch.bfloat16, 256, True, True))):
        key = {"dtype": NAME[dtype], "head_dim": d, "causal": causal, "varlen": True}
        if built("bwd", key) and built("fwd", {**key, "head_dim_v": d}):
            yield f"bwd varlen {NAME[dtype]} d{d} {'causal' if causal else 'full'}{' det' if det else ''} 5 seqs h8/2", \
                lambda dtype=dtype, d=d, causal=causal, det=det, i=i: bwd_varlen_case(dtype, d, causal, det,
                                                                                       seed=500 + 10 * i)


def combine_cases():
    for i, (dtype, d) in enumerate(((torch.float32, 64), (torch.bfloat16, 64), (torch.float16, 64),
                                    (torch.float32, 62))):
        if built("combine", {"dtype": NAME[dtype]}):
            yield f"combine {NAME[dtype]} splits5 b2 s113 h3 d{d}", \
                lambda dtype=dtype, d=d, i=i: combine_case(dtype, d, seed=100 + 10 * i)


def quant_cases():
    for i, (dtype, d, dv, inc, blk) in enumerate(((torch.bfloat16, 128, 128, True, True),
                                                   (torch.float16, 96, 96, True, False),
                                                   (torch.bfloat16, 192, 128, False, True),
                                                   (torch.float16, 128, 128, False, False))):
        if built("quant", {"dtype": NAME[dtype]}):
            yield f"quant {NAME[dtype]} d{d} dv{dv} incoherent={inc} block={blk} b2 q113 k239 h4/2", \
                lambda dtype=dtype, d=d, dv=dv, inc=inc, blk=blk, i=i: quant_case(dtype, d, dv, inc, blk, seed=300 + i)


#: family -> generator of (name, case); every family in the manifest needs an entry.
CASES = {"fwd": lambda: (*fwd_cases(), *fwd_packed_cases(), *fwd_fp8_cases(), *fwd_varlen_cases()), "bwd": bwd_cases,
         "combine": combine_cases,
         "quant": quant_cases, "varlen_prep": varlen_prep_cases}


def main() -> int:
    families = sorted({v.family for v in flashgen.load_manifest().variants})
    failed = [f"family {f}: present in the manifest, no case in {Path(__file__).name} (add one to CASES)"
              for f in families if f not in CASES]
    ran = 0
    only = os.environ.get("SANITIZE_ONLY", "")
    for family in families:
        cases = list(CASES.get(family, lambda: ())())
        if family in CASES and not cases:
            failed.append(f"family {family}: none of its cases' variants is built")
        cases = [(name, case) for name, case in cases if only in name or only == family]
        for name, case in cases:
            ran += 1
            try:
                case()
                torch.cuda.synchronize()
                print(f"ok   {name}", flush=True)
            except Exception as e:
                failed.append(f"{name}: {type(e).__name__}: {e}")
                print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    if only and not ran:
        failed.append(f"SANITIZE_ONLY={only!r}: no case's name contains it and no family is named so")
    for f in failed:
        print(f"FAIL {f}", flush=True)
    print(f"sanitize_driver: {ran} cases over families {', '.join(families)}; {len(failed)} failures", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
