"""The backward grid's table from two `flashgen bench --backward-only` runs (their CSVs), with issue 9's goals.

Usage: python scripts/bwd_grid_table.py GRID1_bwd.csv GRID2_bwd.csv [--title TEXT] [> table.md]

Prints a markdown table (TFLOP/s of flashgen's default and deterministic backward, SDPA's cuDNN and FA2 backends,
run 1 / run 2; flashgen over cuDNN and over FA2; deterministic over default), the geometric means over both runs,
and every reading below issue 9's goal: ahead of the best SDPA backend at every point, at least 1.25x cuDNN at
head_dim 256 (FA3 protocol: docs/PERF.md).
"""
from __future__ import annotations

import argparse
import csv
import math


def _rows(path: str) -> dict:
    with open(path, newline="") as f:
        return {(r["dtype"], int(r["head_dim"]), r["causal"] == "True", int(r["seqlen"])): r for r in csv.DictReader(f)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csvs", nargs=2)
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    runs = [_rows(p) for p in a.csvs]
    keys = [k for k in runs[0] if k in runs[1]]
    f = lambda r, c: float(r[c])  # noqa: E731
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    if a.title:
        print(a.title + "\n")
    print("| dtype | hd | causal | seqlen | flashgen | det | cuDNN | FA2 | / cuDNN | / FA2 | det / default |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    logs = {"cudnn": [], "fa2": [], "det": []}
    misses = []
    for k in keys:
        rs = [run[k] for run in runs]
        cells = {c: " / ".join(f"{f(r, c):.0f}" for r in rs) for c in ("flashgen", "flashgen_det", "cudnn", "fa2")}
        ratio = {c: [f(r, "flashgen") / f(r, c) for r in rs] for c in ("cudnn", "fa2")}
        det = [f(r, "flashgen_det") / f(r, "flashgen") for r in rs]
        for c in ("cudnn", "fa2"):
            logs[c] += [math.log(x) for x in ratio[c]]
        logs["det"] += [math.log(x) for x in det]
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {cells['flashgen']} | {cells['flashgen_det']} | {cells['cudnn']} | "
              f"{cells['fa2']} | {fmt(ratio['cudnn'])} | {fmt(ratio['fa2'])} | {fmt(det)} |")
        goal = 1.25 if k[1] == 256 else 1.0
        for i, r in enumerate(rs):
            got = f(r, "flashgen") / (f(r, "cudnn") if k[1] == 256 else max(f(r, "cudnn"), f(r, "fa2")))
            if got < goal:
                misses.append(f"- hd{k[1]} {'causal' if k[2] else 'non-causal'} {k[3]} run {i + 1}: {got:.3f} "
                              f"(flashgen {f(r, 'flashgen'):.0f}, cuDNN {f(r, 'cudnn'):.0f})")
    g = {c: math.exp(sum(x) / len(x)) for c, x in logs.items()}
    print(f"\ngeometric means over both runs: / cuDNN {g['cudnn']:.3f}, / FA2 {g['fa2']:.2f}, "
          f"det / default {g['det']:.3f} (min {min(math.exp(x) for x in logs['det']):.2f})")
    print("\nBelow issue 9's goal (1.0x the best SDPA backend; 1.25x cuDNN at head_dim 256):\n")
    print("\n".join(misses) if misses else "- none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
