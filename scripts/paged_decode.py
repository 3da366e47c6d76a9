"""Decode steps on a paged KV cache against the same caches unpaged (a GPU probe; the varlen kernel's paged loads,
fwd.cu.j2 / mask.cuh PageWalk).

flash_attn_with_kvcache with one new query per entry, bf16, GQA 32 / 8 heads, causal, FA3's split-KV heuristic,
no host read (the defaults), over caches of random lengths up to --cache positions: unpaged, and the same caches as
pages of 16, 64 and 256 rows in a shuffled pool (varlen_bench.py's decode case). Each page size's output is compared
with the unpaged call's (max abs difference, which should be 0: the same keys in the same order). Timed as the
grid is (flashgen.bench._time_ms: triton do_bench, L2 flushed, median), rounds alternated; GB/s counts K and V
once per entry's used rows.

Usage: python scripts/paged_decode.py [--batch 64] [--cache 8192] [--head-dims 128,64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache", type=int, default=8192)
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--pages", default="0,16,64,256", help="page sizes (0: unpaged)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    import flashgen
    from flashgen.bench import _time_ms as time_ms
    from varlen_bench import paged_copy  # (scripts/, this script's folder, is on sys.path)

    print(f"# {torch.cuda.get_device_name()}; flashgen from {Path(flashgen.__file__).resolve().parent}")
    print("| head_dim | pages | max abs diff vs unpaged | ms (rounds) | GB/s | ms / unpaged ms |")
    print("|---|---|---|---|---|---|")
    for d in map(int, a.head_dims.split(",")):
        rng = random.Random(d)
        h, hk = 32, 8
        lens = [rng.randint(1, a.cache) for _ in range(a.batch)]
        g = torch.Generator(device="cuda").manual_seed(d)
        q = torch.randn(a.batch, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc, vc = (torch.randn(a.batch, a.cache, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(2))
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        calls = {}
        for page in map(int, a.pages.split(",")):
            table, kp, vp = paged_copy(kc, vc, page, page) if page else (None, kc, vc)
            calls[page] = (lambda kp=kp, vp=vp, table=table: flashgen.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=seqlens, page_table=table, causal=True))
        ref = calls[0]() if 0 in calls else None
        times = {page: [] for page in calls}
        for _ in range(a.rounds):
            for page, fn in calls.items():
                times[page].append(time_ms(fn))
        nbytes = 2 * sum(lens) * hk * d * 2
        base = min(times[0]) if 0 in times else None
        for page, fn in calls.items():
            diff = (fn().float() - ref.float()).abs().max().item() if ref is not None else float("nan")
            best = min(times[page])
            print(f"| {d} | {page or 'none'} | {diff:.2e} | {' / '.join(f'{t:.3f}' for t in times[page])} | "
                  f"{nbytes / best / 1e6:.0f} | {best / base if base else float('nan'):.2f} |")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
