#!/usr/bin/env python3
"""A cost model of the forward's causal tile order on the FA3-protocol grid (16k tokens, hidden
2048): max / mean work per CTA over 132 persistent CTAs, a tile costing (K/V blocks + 1), for
the order of templates/include/flashgen/scheduler.cuh with and without L2 sections, dealt
round-robin (static) or claimed by whichever CTA is free first (dynamic, greedy), and with the
last section merged as core.tail_heads does (the order the kernels run since session 17).

    python scripts/schedule_model.py

It is what motivated the tile claims (docs/PERF.md, "Causal tile order"); it models neither L2 nor
the per-tile ramp, so it ranks orders, it does not predict TFLOP/s."""
from __future__ import annotations

import heapq
import math

CTAS = 132


def order(num_m: int, pairs: int, section: int, tail: int = 0) -> list:
    """Tiles (m_block, pair) in scheduler.cuh's causal order: sections of ``section`` pairs, the last
    one of ``tail`` pairs (0: what is left after whole sections)."""
    tail = tail or pairs - (pairs - 1) // section * section
    starts = list(range(0, pairs - tail, section)) + [pairs - tail]
    out = []
    for s0 in starts:
        n = section if s0 < pairs - tail else tail
        out += [(num_m - 1 - r // n, s0 + r % n) for r in range(n * num_m)]
    return out


def cost(m: int, block_m: int, block_n: int) -> float:
    return math.ceil((m + 1) * block_m / block_n) + 1.0


def imbalance(tiles: list, block_m: int, block_n: int, dynamic: bool) -> float:
    loads = [0.0] * CTAS
    if dynamic:
        heap = [(0.0, i) for i in range(CTAS)]
        for m, _ in tiles:
            w, i = heapq.heappop(heap)
            heapq.heappush(heap, (w + cost(m, block_m, block_n), i))
        loads = [w for w, _ in heap]
    else:
        for t, (m, _) in enumerate(tiles):
            loads[t % CTAS] += cost(m, block_m, block_n)
    return max(loads) / (sum(loads) / CTAS)


def main() -> int:
    from flashgen.core import section_heads, tail_heads

    print("| head_dim | tile | seqlen | pairs | section | last section | static, no sections | static, sections "
          "| claims, sections | claims, sections, last merged (core.tail_heads) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    # the default tiles, and those the shipped tune tables name at short causal seqlens (hd64 128x128, hd256 128x48)
    for hd, bm, bn in ((64, 192, 128), (64, 128, 128), (128, 128, 128), (256, 128, 80), (256, 128, 48)):
        heads = 2048 // hd
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            batch, num_m = 16384 // s, -(-s // bm)
            pairs = batch * heads
            section = section_heads(batch, heads, heads, s, hd, hd, 2)
            tail = tail_heads(batch, heads, heads, s, hd, hd, 2)
            plain, cut, merged = order(num_m, pairs, pairs), order(num_m, pairs, section), \
                order(num_m, pairs, section, tail)
            print(f"| {hd} | {bm}x{bn} | {s} | {pairs} | {section} | {tail} | {imbalance(plain, bm, bn, False):.3f} | "
                  f"{imbalance(cut, bm, bn, False):.3f} | {imbalance(cut, bm, bn, True):.3f} | "
                  f"{imbalance(merged, bm, bn, True):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
