#!/usr/bin/env python3
"""The table of `device_check.sh sections`: causal forward TFLOP/s per L2-section setting (mean of
its runs), each setting over the first, and flashgen / best SDPA backend of the same runs.

    python scripts/section_table.py OUTDIR 32 16 8 4      # reads OUTDIR/sec{MB}_{run}.csv
"""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

from regress_fwd import best_sdpa  # the same "best SDPA backend" as the grid's peers table


def main(argv) -> int:
    out, settings = Path(argv[0]), argv[1:]
    runs = {}
    for mb in settings:
        runs[mb] = []
        for p in sorted(out.glob(f"sec{mb}_*.csv")):
            with open(p) as f:
                runs[mb].append({(r["dtype"], int(r["head_dim"]), int(r["seqlen"])): r for r in csv.DictReader(f)})
    ref = settings[0]
    points = list(runs[ref][0])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    head = " | ".join(f"{mb} MiB" for mb in settings)
    print(f"| dtype | hd | seqlen | {head} | " + " | ".join(f"{mb} / {ref}" for mb in settings[1:])
          + " | " + " | ".join(f"{mb} / SDPA" for mb in settings) + " |")
    print("|---" * (3 + 3 * len(settings) - 1) + "|")
    logs = {mb: [] for mb in settings}
    for pt in points:
        tf = {mb: mean([float(r[pt]["flashgen"]) for r in runs[mb]]) for mb in settings}
        vs = {mb: mean([float(r[pt]["flashgen"]) / best_sdpa(r[pt]) for r in runs[mb]]) for mb in settings}
        for mb in settings:
            logs[mb].append(math.log(vs[mb]))
        print(f"| {pt[0]} | {pt[1]} | {pt[2]} | " + " | ".join(f"{tf[mb]:.0f}" for mb in settings) + " | "
              + " | ".join(f"{tf[mb] / tf[ref]:.3f}" for mb in settings[1:]) + " | "
              + " | ".join(f"{vs[mb]:.2f}" for mb in settings) + " |")
    print("geomean vs best SDPA: " + ", ".join(f"{mb} MiB {math.exp(mean(logs[mb])):.3f}" for mb in settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
