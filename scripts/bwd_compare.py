"""Backward old/new table from `flashgen bench --backward-only` CSVs (scripts/device_check.sh bwd).

Usage: python scripts/bwd_compare.py OLD1.csv NEW1.csv [OLD2.csv NEW2.csv ...]
Prints, per (dtype, head_dim, causal, seqlen), flashgen's default and deterministic TFLOP/s of every
run (old/new), new/old of each mean, det/default of the new code, and new / best SDPA backend.
"""
from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict


def main(paths: list[str]) -> None:
    if len(paths) < 2 or len(paths) % 2:
        raise SystemExit("usage: bwd_compare.py OLD1.csv NEW1.csv [OLD2.csv NEW2.csv ...]")
    runs: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: {"old": [], "new": []})
    for i, path in enumerate(paths):
        with open(path) as f:
            for row in csv.DictReader(f):
                key = (row["dtype"], int(row["head_dim"]), row["causal"], int(row["seqlen"]))
                runs[key]["new" if i % 2 else "old"].append({k: float(row[k]) for k in ("flashgen", "flashgen_det", "cudnn", "fa2")})
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    print("| dtype | hd | causal | seqlen | default old | default new | det old | det new | det new/old | default new/old "
          "| det/default (new) | new / best SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    logs = defaultdict(list)
    for key in sorted(runs):
        o, n = runs[key]["old"], runs[key]["new"]
        fmt = lambda rs, k: "/".join(f"{r[k]:.0f}" for r in rs)  # noqa: E731
        det_gain = mean(n, "flashgen_det") / mean(o, "flashgen_det")
        def_gain = mean(n, "flashgen") / mean(o, "flashgen")
        det_ratio = mean(n, "flashgen_det") / mean(n, "flashgen")
        peer = mean(n, "flashgen") / max(mean(n, "cudnn"), mean(n, "fa2"))
        for name, v in (("det new/old", det_gain), ("default new/old", def_gain), ("det/default", det_ratio), ("vs SDPA", peer)):
            logs[name].append(math.log(v))
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {fmt(o, 'flashgen')} | {fmt(n, 'flashgen')} | {fmt(o, 'flashgen_det')} "
              f"| {fmt(n, 'flashgen_det')} | {det_gain:.3f} | {def_gain:.3f} | {det_ratio:.2f} | {peer:.2f} |")
    print()
    print("geometric means: " + ", ".join(f"{k} {math.exp(sum(v) / len(v)):.3f}" for k, v in logs.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
