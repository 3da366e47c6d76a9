"""Where a block_n 128 backward main-kernel CTA's time goes (head_dim 64 / 96 / 128), from per-CTA clock64 records.

Needs cta_probe_n128.patch (this folder) applied to templates/bwd.cu.j2 and the variants rebuilt; it is not in
the shipped kernels (`device_check.sh probe` applies it, builds, runs this script and reverts it, with
PATCH=docs/results/bwd_n128_probe/cta_probe_n128.patch PROBE_SCRIPT=docs/results/bwd_n128_probe/bwd_n128_probe.py
PROBE_FILTER='bwd_bf16_hd128_*,bwd_bf16_hd64_*'). Each main CTA writes 16 uint64 into dq at its launch index
(blockIdx.x + gridDim.x (blockIdx.y + gridDim.y blockIdx.z)) and the postprocess returns at once, so dq keeps them:

  0 SM id, 1 clock64 at entry, 2 / 3 consumer 0 / 1 saw K, V and the first Q, dO land, 4 / 5 each consumer's loop
  end, 6 / 7 each consumer's dK / dV stores complete, 8 globaltimer at entry, 9 iterations, 10 key block,
  11 split unit (-1: a whole unit; else a split tail piece), 12 the reducer warp's last reductions complete,
  13 globaltimer at consumer 0's stores complete, 14 K/V head, 15 batch.

cta_probe_n128_v3.patch (PROBE_SLOTS=24) adds, as clock64: 16 the producer's thread 0 past the barriers' init and
its setmaxnreg, 17 K, the first Q, V and the first dO issued, 18 the producer's grid dependency met, 19 consumer 0's
registers granted, 20 consumer 0's grid dependency met, 21 K and the first Q landed (before the LSE wait).

    FLASHGEN_TUNE_TABLE=off python3 bwd_n128_probe.py 128,512,0 128,2048,0 ...   (head_dim,seqlen,causal)

Per point (FA3 protocol: 16k tokens, hidden 2048, bf16): medians, means and sums per SM of each phase in us over
the whole units (split pieces left out; clock64 converted with the rate measured against globaltimer), and the
gap from a CTA's last event (stores or reductions complete) to the next CTA's entry on the same SM. PROBE_DUMP=DIR
writes each point's raw records to DIR/probe_n128_hd{hd}_{seqlen}_{causal}.csv."""
import os
import statistics as st
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bwd_persistent"))
from bwd_cta_probe import run_backward  # noqa: E402  (the same four calls as the role tiles' probe)
import torch  # noqa: E402


SLOTS = int(os.environ.get("PROBE_SLOTS", "16"))  # 24 with cta_probe_n128_v3.patch


def point(hd, seqlen, causal):
    res, dq = run_backward(hd, seqlen, causal)
    recs = dq.view(torch.int64).flatten()
    recs = recs[: recs.numel() // SLOTS * SLOTS].view(-1, SLOTS).cpu().tolist()
    r = [x for x in recs if x[1] != 0]  # CTAs that ran (the rest of dq stays zero)
    if os.environ.get("PROBE_DUMP"):
        with open(os.path.join(os.environ["PROBE_DUMP"], f"probe_n128_hd{hd}_{seqlen}_{int(causal)}.csv"), "w") as fh:
            fh.write("smid,clk_entry,landed0,landed1,loop_end0,loop_end1,drained0,drained1,gt_entry,iters,n_block,"
                     "unit,reduced,gt_drained0,head_k,batch" +
                     (",setup,issued,dep_producer,regs_consumer0,dep_consumer0,k_q_landed" if SLOTS == 24 else "") + "\n")
            fh.writelines(",".join(map(str, x)) + "\n" for x in r)
    whole = [x for x in r if x[9] > 0 and x[11] < 0]
    rates = [(x[6] - x[1]) / (x[13] - x[8]) for x in whole if x[13] - x[8] > 5000]
    ghz = st.median(rates)
    us = lambda c: c / ghz / 1000
    end = lambda x: max(x[6], x[7], x[12]) if x[9] > 0 else x[1]
    by_sm = {}
    for x in r:
        by_sm.setdefault(x[0], []).append(x)
    gaps, busy = [], 0
    for xs in by_sm.values():
        xs.sort(key=lambda x: x[1])
        gaps += [us(c[1] - end(a)) for a, c in zip(xs, xs[1:])]
        busy += sum(end(x) - x[1] for x in xs)
    g0 = min(x[8] for x in r)
    g1 = max(x[13] for x in r if x[9] > 0)
    nsm = len(by_sm)
    f = lambda xs: f"med {st.median(xs):.2f} mean {st.mean(xs):.2f} sum/SM {sum(xs) / nsm:.1f}"
    print(f"hd{hd} {'causal' if causal else 'noncausal'} {seqlen}: backward {min(res):.1f} us (events), main span"
          f" ~{(g1 - g0) / 1000:.1f} us, {len(r)} CTAs ({len(whole)} whole units) on {nsm} SMs, clock {ghz:.3f} GHz")
    print(f"  SM busy (entry..last event) {us(busy) / nsm:.1f} us per SM")
    print(f"  entry -> K, V, first Q / dO landed: {f([us(max(x[2], x[3]) - x[1]) for x in whole])}")
    # (cta_probe_n128_v2.patch: landed0 = K, the first Q and LSE; landed1 = V and the first dO, consumer 1's
    # first-block wait; cta_probe_n128.patch: both = all of them)
    print(f"  entry -> landed0 (v2: K + first Q): {f([us(x[2] - x[1]) for x in whole])}")
    print(f"  entry -> landed1 (v2: V + first dO): {f([us(x[3] - x[1]) for x in whole])}")
    if SLOTS == 24:
        for name, i in (("barriers + setmaxnreg (producer)", 16), ("K, Q, V, dO issued", 17),
                        ("producer's grid dependency met", 18), ("consumer 0's registers granted", 19),
                        ("consumer 0's grid dependency met", 20), ("K + first Q landed (no LSE)", 21)):
            print(f"  entry -> {name}: {f([us(x[i] - x[1]) for x in whole])}")
    print(f"  per iteration (landed -> loop end): {f([us(max(x[4], x[5]) - max(x[2], x[3])) / x[9] for x in whole])}")
    print(f"  consumers' loop-end skew: {f([us(abs(x[4] - x[5])) for x in whole])}")
    print(f"  loop end -> dK / dV stores complete: {f([us(max(x[6], x[7]) - max(x[4], x[5])) for x in whole])}")
    print(f"  reducer's last reductions complete - stores complete: {f([us(x[12] - max(x[6], x[7])) for x in whole])}")
    print(f"  gap last event -> next entry on the SM: {f(gaps)}")
    sys.stdout.flush()


for arg in sys.argv[1:] or ["128,512,0", "128,1024,0", "128,2048,0", "128,16384,0", "64,512,0"]:
    hd, s, c = (int(x) for x in arg.split(","))
    point(hd, s, bool(c))
