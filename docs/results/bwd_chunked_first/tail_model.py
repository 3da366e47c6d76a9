"""List-scheduling model of the hd256 causal backward's unordered grid (the default from seqlen 4k on).

The grid's launch order: per (batch, head) column, pairs longest first; the last columns (one wave) longest first
across them. (Correction, session 2026-12-02 (7): at the time the code gave that tail to ordered-default calls only,
so past 2k it ran with none, tail_waves=0 here: 5.1 % idle at 4k, which a clock64 probe matched; the tail now exists
there too, core.UNORDERED_CAUSAL_TAIL_WAVES; docs/results/bwd_4k/.) The hardware fills whichever of the 66 cluster slots frees first. A pair's work is its query blocks
plus `over` blocks of start-up and end (about 4.5 us against 2.65 us per block: docs/results/bwd_persistent/).
Prints the modelled idle share of the SMs per seqlen. A model, not a measurement: python3 tail_model.py"""
import heapq
def model(seqlen, slots=66, over=1.7, tail_waves=1.0, hd=256):
    b, h = 16384 // seqlen, 2048 // hd
    nb = seqlen // 64; npairs = nb // 2
    cols = b * h
    units = []  # launch order
    work = lambda q: (nb - 2 * q) + over
    # unordered tail: last ceil(tail_waves*slots/npairs) columns, longest first across them
    tail_cols = min(cols, -(-int(tail_waves * slots) // npairs))
    for c in range(cols - tail_cols):
        for q in range(npairs): units.append(work(q))
    tail = [work(q) for c in range(tail_cols) for q in range(npairs)]
    units += sorted(tail, reverse=True)
    free = [0.0] * slots
    heapq.heapify(free)
    end = 0
    for u in units:
        t = heapq.heappop(free); heapq.heappush(free, t + u); end = max(end, t + u)
    total = sum(units)
    return end, total / slots, 1 - (total / slots) / end
for s in (512, 1024, 2048, 4096, 8192, 16384):
    e, ideal, idle = model(s)
    print(s, f"makespan {e:.0f} ideal {ideal:.0f} idle {idle*100:.1f}%")
