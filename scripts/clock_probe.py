"""The SM clock and board power while one FA3-protocol forward (or backward) point runs back to back, so that a
kernel's cycles per K/V block can be worked out from its TFLOP/s (docs/PERF.md: the FP8 loop's period).

Usage: python scripts/clock_probe.py --dtype e4m3|bf16|fp16 --head-dim 128 [--causal] [--seqlen 16384] [--seconds 4]
                                     [--impl flashgen|cudnn|fa2] [--backward [--deterministic]] [--variant GLOB]
Samples `nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu` every 100 ms while the calls run (the
first second is dropped as ramp-up) and prints the TFLOP/s (CUDA events over all calls) with the median,
minimum and maximum clock (MHz) and power (W). Clocks and power limits are only read, never set."""
import argparse
import statistics
import subprocess
import time

import torch
from profile_fwd import label, make_call, point_args  # scripts/ is the script's folder: on sys.path


def main() -> None:
    ap = argparse.ArgumentParser()
    point_args(ap)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    call, flops = make_call(a)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t_end = time.time() + a.seconds
    calls = 0
    e0.record()
    while time.time() < t_end:
        for _ in range(10):
            call()
        calls += 10
        torch.cuda.synchronize()
    e1.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    rows = rows[10:] or rows  # the first second: ramp-up
    clk = [float(r[0]) for r in rows]
    pw = [float(r[1]) for r in rows]
    ms = e0.elapsed_time(e1) / calls
    print(f"{label(a)}: {flops / ms / 1e9:.0f} TFLOP/s over {calls} calls; "
          f"SM clock MHz median {statistics.median(clk):.0f} (min {min(clk):.0f}, max {max(clk):.0f}); "
          f"power W median {statistics.median(pw):.0f} (max {max(pw):.0f}); {len(rows)} samples")


if __name__ == "__main__":
    main()
