"""Run flashgen's backward once per FA3-protocol shape, each in a subprocess with a time limit, and
report which shapes finish (and how fast) and which do not: a liveness check for changes to the
backward's cross-CTA hand-offs. Usage: python scripts/bwd_hang_probe.py [--timeout 30]
[--seqlens 512,2048,16384] [--head-dims 64,128,256] [--deterministic 1] [--reps 3]"""
from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import sys, time, torch
from flashgen.bench import _flashgen_bwd_fn, _flops
hd, causal, s, det, reps = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
b, h = 16384 // s, 2048 // hd
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
fn, path = _flashgen_bwd_fn(q, k, v, causal, det)
fn(); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(reps): fn()
torch.cuda.synchronize()
ms = (time.perf_counter() - t) / reps * 1e3
print(f"{ms:.3f} ms, {2.5 * _flops(b, h, s, hd, causal) / ms / 1e9:.0f} TFLOP/s")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--seqlens", default="512,2048,16384")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--deterministic", default="1")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    for hd in map(int, a.head_dims.split(",")):
        for causal in ("0", "1"):
            for s in map(int, a.seqlens.split(",")):
                for det in a.deterministic.split(","):
                    args = [sys.executable, "-c", CHILD, str(hd), causal, str(s), det, str(a.reps)]
                    try:
                        r = subprocess.run(args, capture_output=True, text=True, timeout=a.timeout)
                        res = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else \
                            f"FAILED rc {r.returncode}: {r.stderr.strip().splitlines()[-1:] }"
                    except subprocess.TimeoutExpired:
                        res = f"HANG (no result in {a.timeout:.0f} s)"
                    print(f"hd {hd} causal {causal} seqlen {s} det {det}: {res}", flush=True)


if __name__ == "__main__":
    main()
