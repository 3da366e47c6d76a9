#!/usr/bin/env python3
"""A cost model of the forward's causal tile order on the FA3-protocol grid (16k tokens, hidden
2048): max / mean work per CTA over 132 persistent CTAs, a tile costing (K/V blocks + 1), for
the order of templates/include/flashgen/scheduler.cuh with and without L2 sections, dealt
round-robin (static) or claimed by whichever CTA is free first (dynamic, greedy).

    python scripts/schedule_model.py

It is what motivated the tile claims (docs/PERF.md, "Causal tile order"); it models neither L2 nor
the per-tile ramp, so it ranks orders, it does not predict TFLOP/s."""
from __future__ import annotations

import heapq
import math

CTAS = 132
L2_SECTION_BYTES = 32 << 20  # core.L2_SECTION_BYTES
L2_SECTION_KV_HEADS = 16  # core.L2_SECTION_KV_HEADS


def order(num_m: int, pairs: int, section: int) -> list:
    """Tiles (m_block, pair) in scheduler.cuh's causal order."""
    out = []
    for s0 in range(0, pairs, section):
        n = min(section, pairs - s0)
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
    print("| head_dim | seqlen | pairs | section | static, no sections | static, sections | claims, sections |")
    print("|---|---|---|---|---|---|---|")
    for hd, bm, bn in ((64, 192, 128), (128, 128, 128), (256, 128, 80)):
        heads = 2048 // hd
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            pairs, num_m = (16384 // s) * heads, -(-s // bm)
            section = max(1, min(pairs, L2_SECTION_BYTES // (s * 2 * hd * 2), L2_SECTION_KV_HEADS))
            plain, cut = order(num_m, pairs, pairs), order(num_m, pairs, section)
            print(f"| {hd} | {s} | {pairs} | {section} | {imbalance(plain, bm, bn, False):.3f} | "
                  f"{imbalance(cut, bm, bn, False):.3f} | {imbalance(cut, bm, bn, True):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
