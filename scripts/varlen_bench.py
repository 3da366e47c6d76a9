"""Time the varlen kernel (flashgen.core.Varlen: one launch that reads cu_seqlens / seqused) against the
composed path it replaces (one flash_attn_func call per run of equal lengths), in one process, on a GPU.

Two workloads, bf16, head_dim 128, forward without gradient:
  packed:  N documents of random lengths packed into TOKENS tokens (training with document masking; causal),
           flash_attn_varlen_func, heads 16 / 16;
  decode:  B caches of random lengths up to CACHE, one new query each (serving; GQA 32 / 8),
           flash_attn_with_kvcache without appending; also as paged caches (pages of 16 and 256 rows, shuffled),
           whose composed path gathers each entry's pages.
PyTorch SDPA in the same process as the peer: nested (jagged) tensors for the packed documents (one SDPA call per
document where SDPA refuses causal nested tensors), the padded caches with a key mask for decode. Each is timed with flashgen.bench._time_ms (triton do_bench style: L2 flushed before every repetition, median),
kernel on then off, ROUNDS times, alternated. Before timing, the two paths' outputs are compared (same inputs),
and the table prints TFLOP/s (causal FLOPs counted per document) and the speedup. A GPU test pass first is
the caller's (scripts/device_check.sh varlen). Usage: python scripts/varlen_bench.py [--rounds 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import random

import torch

import flashgen
import flashgen.core as core
from flashgen.bench import _time_ms


def packed_case(rng, n_docs: int, tokens: int, h: int = 16, d: int = 128):
    cuts = sorted(rng.sample(range(1, tokens), n_docs - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
    cu = torch.tensor([0] + cuts + [tokens], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = sum(2 * 2 * h * d * n * (n + 1) // 2 for n in lens)  # causal: QK^T and PV over the lower triangle

    def run():
        return flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def sdpa_nested():  # PyTorch's own varlen: nested (jagged) tensors through SDPA, whichever backend it picks
        nt = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2) for t in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*nt, is_causal=True)

    def sdpa_loop():  # one SDPA call per document (where SDPA refuses causal nested tensors)
        bounds = cu.tolist()
        return [torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                                                 is_causal=True)
                for a, b in zip(bounds, bounds[1:])]

    def sdpa():
        try:
            return sdpa_nested()
        except RuntimeError:
            return sdpa_loop()
    return run, sdpa, flops, f"packed {n_docs} docs / {tokens} tokens (max {max(lens)})"


def decode_case(rng, batch: int, cache: int, h: int = 32, hk: int = 8, d: int = 128, page: int | None = None):
    lens = [rng.randint(1, cache) for _ in range(batch)]
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    flops = sum(2 * 2 * h * d * n for n in lens)
    table, kp, vp = None, kc, vc
    if page:  # the same caches as pages of `page` rows in a shuffled pool (SDPA below reads the padded ones)
        per = cache // page
        order = torch.randperm(batch * per, generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30)))
        table = order.view(batch, per).to(device="cuda", dtype=torch.int32)
        kp, vp = (torch.empty(batch * per, page, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kp[table.long().flatten()] = kc.view(batch * per, page, hk, d)
        vp[table.long().flatten()] = vc.view(batch * per, page, hk, d)

    def run():
        return flashgen.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, page_table=table, causal=True)

    mask = (torch.arange(cache, device="cuda")[None, :] < seqlens[:, None])[:, None, None, :]

    def sdpa():  # the padded caches with a key mask (SDPA has no per-entry lengths)
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                                                vc.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    paged = f", pages of {page}" if page else ""
    return run, sdpa, flops, f"decode {batch} caches up to {cache} (mean {sum(lens) // batch}){paged}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cases = [packed_case(rng, 16, 8192), packed_case(rng, 64, 16384), packed_case(rng, 4, 4096),
             decode_case(rng, 64, 8192), decode_case(rng, 8, 32768), decode_case(rng, 256, 2048),
             decode_case(rng, 64, 8192, page=16), decode_case(rng, 64, 8192, page=256)]
    rows = []
    with torch.no_grad():
        for run, sdpa, flops, name in cases:
            core.VARLEN_KERNEL = True
            a = run()
            core.VARLEN_KERNEL = False
            b = run()
            err = (a.float() - b.float()).abs().max().item()
            times = {True: [], False: []}
            for _ in range(args.rounds):
                for on in (True, False):
                    core.VARLEN_KERNEL = on
                    times[on].append(_time_ms(run))
            t_on, t_off = min(times[True]), min(times[False])
            try:
                t_sdpa = min(_time_ms(sdpa) for _ in range(args.rounds))
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
                print(f"{name}: SDPA failed: {type(e).__name__}: {str(e)[:200]}")
                t_sdpa = float("nan")
            rows.append((name, err, times[True], times[False], flops / t_on / 1e9, flops / t_off / 1e9, t_off / t_on,
                         t_sdpa))
    print("| workload | max abs(kernel - composed) | kernel ms (rounds) | composed ms (rounds) | SDPA ms | kernel TFLOP/s | "
          "composed TFLOP/s | composed ms / kernel ms | SDPA ms / kernel ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, err, on, off, f_on, f_off, sp, t_sdpa in rows:
        print(f"| {name} | {err:.2e} | {' / '.join(f'{x:.3f}' for x in on)} | {' / '.join(f'{x:.3f}' for x in off)} | "
              f"{t_sdpa:.3f} | {f_on:.0f} | {f_off:.0f} | {sp:.2f}x | {t_sdpa / min(on):.2f}x |")


if __name__ == "__main__":
    main()
