"""Where a backward main-kernel CTA's time goes (role tiles: head_dim 192 / 256), from per-CTA clock64 records.

Needs a cta_probe.patch applied to templates/bwd.cu.j2 (not in the shipped kernels): each main CTA writes 16
uint64 into dq (SM id, clocks at entry, marks 2 and 3, each consumer's loop end, each consumer's stores
drained, exit; globaltimer at entry and exit; its iterations, key block, tail flag) and the postprocess of
the role tiles returns at once, so dq keeps them. Marks 2 / 3: K and Q landed / V landed with this folder's
patch (kernels before the chunked first loads); consumer 0's / consumer 1's first GEMM done with
docs/results/bwd_chunked_first/cta_probe.patch (the current kernels, whose first GEMMs start by chunk).
Marks 14 / 15 (docs/results/bwd_4k/cta_probe*.patch only): the CTA's
head_k and batch. With docs/results/bwd_4k/cta_probe_epilogue.patch set PROBE_SLOTS=24: marks 16-19 (each
consumer's epilogue after both consumers met, after its dK / dV store was issued) and 20-21 (the reducer warp's
loop end, its last reductions complete) split the epilogue. PROBE_DUMP=DIR writes each point's raw records to DIR/probe_hd{hd}_{seqlen}_{causal}.csv.
Build the bf16 hd256 variants, then

    FLASHGEN_TUNE_TABLE=off python3 bwd_cta_probe.py 256,512,1 256,2048,0 ...   (head_dim,seqlen,causal)

Per point (FA3 protocol: 16k tokens, hidden 2048): medians, means and sums per SM of each phase in us (the
SM clock from clock64 against globaltimer), and the gap between one CTA's exit and the next CTA's entry on
the same SM. The "backward (events)" figure brackets host launches too; the main span (globaltimer) is the
kernel's. The per-iteration line's sum is not meaningful (a sum of per-CTA averages)."""
import os
import sys
import statistics as st
import torch
import flashgen


def run_backward(hd, seqlen, causal):
    """Four backward calls on FA3-protocol inputs (16k tokens, hidden 2048, bf16), the L2 flushed before each:
    (the event times in us, dq as the probe patch left it)."""
    b, h = 16384 // seqlen, 2048 // hd
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, seqlen, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        out, lse = flashgen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    res = []
    for rep in range(4):
        dq.zero_()
        flush.zero_()
        ev[0].record()
        flashgen.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal,
                                     deterministic=False, stream=torch.cuda.current_stream(), dq=dq, dk=dk, dv=dv)
        ev[1].record()
        torch.cuda.synchronize()
        res.append(ev[0].elapsed_time(ev[1]) * 1000)
    return res, dq


def point(hd, seqlen, causal):
    b, h = 16384 // seqlen, 2048 // hd
    res, dq = run_backward(hd, seqlen, causal)
    num_n = -(-seqlen // 64)
    grid_n = num_n + num_n % 2
    ctas = grid_n * h * b
    slots = int(os.environ.get("PROBE_SLOTS", "16"))
    r = dq.view(torch.int64).flatten()[: slots * ctas].view(ctas, slots).cpu().tolist()
    if os.environ.get("PROBE_DUMP"):  # the raw records, one CSV per point, for offline analysis
        with open(os.path.join(os.environ["PROBE_DUMP"], f"probe_hd{hd}_{seqlen}_{int(causal)}.csv"), "w") as fh:
            fh.write("smid,clk_entry,mark2,mark3,loop_end0,loop_end1,drained0,drained1,gt_entry,iters,n_block,tail,"
                     "clk_exit,gt_exit,head_k,batch" + (",met0,met1,issued0,issued1,red_loop_end,red_done,x22,x23"
                                                        if slots == 24 else "") + "\n")
            fh.writelines(",".join(map(str, x)) + "\n" for x in r)
    # clock rate from globaltimer: whole-kernel span
    g0 = min(x[8] for x in r); g1 = max(x[13] for x in r)
    by_sm = {}
    for x in r:
        by_sm.setdefault(x[0], []).append(x)
    # cycles per ns from CTAs with long spans
    rates = [(x[12] - x[1]) / (x[13] - x[8]) for x in r if x[13] - x[8] > 5000]
    ghz = st.median(rates)
    us = lambda c: c / ghz / 1000
    act = [x for x in r if x[9] > 0]
    ramp0 = [us(x[2] - x[1]) for x in act]
    ramp1 = [us(x[3] - x[1]) for x in act]
    loop = [us(max(x[4], x[5]) - x[2]) / x[9] for x in act]
    drain = [us(abs(x[4] - x[5])) for x in act]
    epi = [us(max(x[6], x[7]) - max(x[4], x[5])) for x in act]
    tail = [us(x[12] - max(x[6], x[7])) for x in act]
    gaps, busy = [], 0
    for sm, xs in by_sm.items():
        xs.sort(key=lambda x: x[1])
        for a, c in zip(xs, xs[1:]):
            gaps.append(us(c[1] - a[12]))
        busy += sum(x[12] - x[1] for x in xs)
    span_ns = g1 - g0
    nsm = len(by_sm)
    print(f"hd{hd} {'causal' if causal else 'noncausal'} {seqlen}: backward {min(res):.1f} us (events), main span {span_ns/1000:.1f} us,"
          f" {ctas} CTAs on {nsm} SMs, clock {ghz:.3f} GHz")
    print(f"  SM busy (entry..exit) {us(busy)/nsm:.1f} us per SM = {us(busy)/nsm/(span_ns/1000):.3f} of the span")
    f = lambda xs: f"med {st.median(xs):.2f} mean {st.mean(xs):.2f} sum/SM {sum(xs)/nsm:.1f}"
    print(f"  entry -> mark 2 (c0): {f(ramp0)}")
    print(f"  entry -> mark 3 (c1): {f(ramp1)}")
    print(f"  per iteration:    {f(loop)} (iters total {sum(x[9] for x in act)})")
    print(f"  consumers' loop-end skew: {f(drain)}")
    print(f"  epilogue (last loop end -> both stores drained): {f(epi)}")
    if slots == 24:  # cta_probe_epilogue.patch: the epilogue's steps
        end = lambda x: max(x[4], x[5])
        print(f"  loop end -> consumers met: {f([us(max(x[16], x[17]) - end(x)) for x in act])}")
        print(f"  met -> dK/dV stores issued: {f([us(max(x[18], x[19]) - max(x[16], x[17])) for x in act])}")
        print(f"  issued -> drained: {f([us(max(x[6], x[7]) - max(x[18], x[19])) for x in act])}")
        print(f"  reducer: loop end - consumers' loop end: {f([us(x[20] - end(x)) for x in act])}")
        print(f"  reducer: last wait (reductions complete): {f([us(x[21] - x[20]) for x in act])}")
        print(f"  reducer done -> exit: {f([us(x[12] - x[21]) for x in act])}")
    print(f"  drained -> exit (cluster_sync): {f(tail)}")
    print(f"  gap exit -> next entry on the SM: {f(gaps)}")
    sys.stdout.flush()


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["256,512,1", "256,512,0", "256,2048,1", "256,2048,0"]:
        hd, s, c = (int(x) for x in arg.split(","))
        point(hd, s, bool(c))
