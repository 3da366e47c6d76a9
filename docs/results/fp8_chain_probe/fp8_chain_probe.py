"""Where a period of the e4m3 hd128 128x256 no-overlap exp_turns tile goes (issue 10), from clock64 stamps.

Needs chain_probe.patch (this folder) applied and the variant rebuilt; not in the shipped kernels
(`device_check.sh probe` applies it, builds PROBE_FILTER, runs this script and reverts it:
PATCH=docs/results/fp8_chain_probe/chain_probe.patch PROBE_SCRIPT=docs/results/fp8_chain_probe/fp8_chain_probe.py
PROBE_FILTER='fwd_e4m3_hd128_noncausal_m128n256*' PROBE_POINTS='16384 2048'). Thread 0 of each consumer warpgroup
stamps the first 32 K/V blocks its CTA runs into the module global flashgen::g_probe, 8 slots per block:
  0 the block's start (s_step), 1 the GEMM turn taken (S GEMM issued next), 2 S ready (its WGMMA wait),
  3 the exponential turn taken (both rows' maxima done and the other warpgroup's pass seen), 4 the turn passed
  (exponentials and row sums done), 5 V^T's stage ready, 6 P V done (its WGMMA wait); with chain_probe_v2.patch
  also 7 P packed (a read predicated on an OR over P's registers), before the V^T wait.
Per seqlen (FA3 protocol: 16k tokens, hidden 2048, non-causal, the variant forced through flashgen.core): medians over
the CTAs of blocks 4-31 per warpgroup, in cycles, of each segment, the period (slot 6 to slot 6), and how often the
exponential turn was the wait (slot 3 within 64 cycles of the other warpgroup's pass that opened it)."""
import statistics as st
import sys

import torch

from flashgen import core, launch
from flashgen.manifest import load_manifest

MATCH = "fwd_e4m3_hd128_noncausal_m128n256_s2_wg2_pp_noov_ps_xt_vtg"
BLOCKS, SLOTS, CTAS = 32, 8, 160


def run(seqlen: int):
    var = next(v for v in load_manifest().variants if v.name.startswith(MATCH))
    b, h, d = 16384 // seqlen, 2048 // 128, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    out = torch.empty(b, seqlen, h, d, dtype=torch.bfloat16, device="cuda")
    ones = torch.ones(b, h, device="cuda", dtype=torch.float32)

    def arg(t, dtype):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, t.device.index)

    def call():
        core.attention_forward(arg(q, "fp8_e4m3"), arg(k, "fp8_e4m3"), arg(v, "fp8_e4m3"), arg(out, "bf16"), None,
                               d ** -0.5, False, torch.cuda.current_stream().cuda_stream, variant=var,
                               q_descale=arg(ones, "fp32"), k_descale=arg(ones, "fp32"), v_descale=arg(ones, "fp32"))

    call()
    torch.cuda.synchronize()
    d_ = launch._driver()
    lib = launch._libraries[var.name]
    err, ptr, size = d_.cuLibraryGetGlobal(lib, b"_ZN8flashgen7g_probeE")
    assert int(err) == 0, err
    assert int(size) == CTAS * 2 * BLOCKS * SLOTS * 8, size
    buf = torch.zeros(CTAS * 2 * BLOCKS * SLOTS, dtype=torch.int64, device="cuda")
    for _ in range(3):  # the last call's stamps
        d_.cuMemsetD8(ptr, 0, size)
        call()
    torch.cuda.synchronize()
    (err,) = d_.cuMemcpyDtoD(buf.data_ptr(), ptr, size)
    assert int(err) == 0, err
    recs = buf.view(CTAS, 2, BLOCKS, SLOTS).cpu().tolist()
    return recs


def summarize(seqlen, recs):
    seg = {"k wait + GEMM turn (1-0)": (0, 1), "S GEMM issue to ready (2-1)": (1, 2),
           "max + exp-turn wait (3-2)": (2, 3), "exponentials (4-3)": (3, 4),
           "pack, rescale, V^T wait (5-4)": (4, 5), "P V issue to done (6-5)": (5, 6)}
    if any(cta[c][i][7] for cta in recs for c in (0, 1) for i in range(BLOCKS)):  # chain_probe_v2.patch
        seg.update({"  of which P's PRMTs, rescale (7-4)": (4, 7), "  of which V^T wait (5-7)": (7, 5)})
    out = {c: {name: [] for name in seg} for c in (0, 1)}
    period = {0: [], 1: []}
    turn_wait = {0: [0, 0], 1: [0, 0]}
    for cta in recs:
        if cta[0][0][6] == 0:
            continue  # this CTA index did not run (or its first tile is shorter than 32 blocks)
        for c in (0, 1):
            blocks = cta[c]
            for i in range(4, BLOCKS):
                r = blocks[i]
                if not all(r[s] for s in range(7)):
                    continue
                for name, (a, z) in seg.items():
                    out[c][name].append(r[z] - r[a])
                period[c].append(r[6] - blocks[i - 1][6])
                opener = cta[0][i][4] if c == 1 else cta[1][i - 1][4]  # the pass that opened this turn
                if opener:
                    turn_wait[c][0] += 1
                    turn_wait[c][1] += int(r[3] - opener < 64)
    print(f"\n## seqlen {seqlen}: medians in cycles over CTAs x blocks 4-31 ({len(period[0])} / {len(period[1])} blocks)")
    print("| segment | warpgroup 0 | warpgroup 1 |\n|---|---|---|")
    for name in seg:
        print(f"| {name} | {st.median(out[0][name]):.0f} | {st.median(out[1][name]):.0f} |")
    print(f"| period (6 to 6) | {st.median(period[0]):.0f} | {st.median(period[1]):.0f} |")
    for c in (0, 1):
        n, w = turn_wait[c]
        print(f"warpgroup {c}: exponential turn taken within 64 cycles of the opening pass in {w} of {n} blocks")


def main(argv):
    for s in (int(x) for x in (argv or ["16384", "2048"])):
        summarize(s, run(s))


if __name__ == "__main__":
    main(sys.argv[1:])
