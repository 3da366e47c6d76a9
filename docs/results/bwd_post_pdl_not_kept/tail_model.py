"""List-scheduling model of the backward's hd256 main grid (ds_pairs: 2-CTA clusters, 66 cluster slots
on 132 SMs) at the FA3 protocol (16k tokens, hidden 2048): each pair of a (batch, head) runs M - 2q query
blocks (+ 1 block of start-up), pairs taken in launch order by the first free slot. Prints makespan /
(total work / slots) for the ordered causal launch (pairs of a head shortest first: "rev"), the unordered
one (longest first within a head: "fwd") and a global longest-first order ("lpt").
    python docs/results/bwd_post_pdl_not_kept/tail_model.py"""
import heapq


def run(seqlen, hd=256, slots=66, order="rev", ovh=1.0):
    b, h = 16384 // seqlen, 2048 // hd
    m = seqlen // 64
    jobs = []
    for _ in range(b):
        for _ in range(h):
            qs = list(range(m // 2))
            if order == "rev":
                qs = qs[::-1]
            jobs += [m - 2 * q + ovh for q in qs]
    if order == "lpt":
        jobs.sort(reverse=True)
    heap, end = [0.0] * slots, 0.0
    for j in jobs:
        t = heapq.heappop(heap)
        heapq.heappush(heap, t + j)
        end = max(end, t + j)
    return end / (sum(jobs) / slots)


for s in (512, 1024, 2048, 4096, 8192, 16384):
    print(s, " ".join(f"{o} {run(s, order=o):.3f}" for o in ("rev", "fwd", "lpt")))
