"""Fit and score the split-KV cost model (flashgen.core._modelled_splits, the SPLIT_* constants of core.py) against
``scripts/split_bench.py --sweep`` CSVs: for each row, the time of the count the model picks over the fastest count
measured (any count the row timed: 1, the sweep's, num_splits=0's and FA3's rule's), geomean and worst per file.

    python scripts/fit_split_model.py docs/results/split_sweep_h100/call*/split*.csv [--sms 132 --bandwidth 3.352e6]
        [--grid]

The rows' GPU is given by ``--sms`` and ``--bandwidth`` (bytes per us: flashgen.launch.dram_bandwidth on it; an H100
SXM's by default). ``--grid``: also search the constants around the current ones and print the ten best sets by
geomean over all rows (then worst), each with its per-file scores; a row whose chosen count was not timed counts
as unmeasured and disqualifies the set. No GPU needed: the model is evaluated as the runtime evaluates it.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys

import flashgen.core as core

CONSTANTS = ("SPLIT_BLOCK_US", "SPLIT_BLOCK_US_WIDE", "SPLIT_TILE_US", "SPLIT_BANDWIDTH", "SPLIT_NORM",
             "SPLIT_COST_US", "SPLIT_COST_PER_SPLIT_US")
GRID = {"SPLIT_BLOCK_US": (1.0, 1.1, 1.2, 1.3), "SPLIT_BLOCK_US_WIDE": (1.3, 1.4, 1.5, 1.6, 1.7),
        "SPLIT_TILE_US": (0.0, 0.5, 1.0, 1.5), "SPLIT_BANDWIDTH": (0.8, 0.84, 0.9, 0.95), "SPLIT_NORM": (4, 6, 8), "SPLIT_COST_US": (3.0, 4.0, 5.0, 6.0),
        "SPLIT_COST_PER_SPLIT_US": (0.05, 0.1, 0.2)}


def read_rows(path: str, heads: int = 32) -> list[tuple[tuple, dict]]:
    """((batch, heads, heads_k, seqlen_q, seqlen_k, kv_bytes_per_key), {count: us}) per CSV row."""
    rows = []
    for r in csv.DictReader(open(path)):
        t = {1: float(r["unsplit_us"]), int(r["splits"]): float(r["split_us"])}
        for item in filter(None, r.get("sweep_us", "").split(";")):
            n, us = item.split(":")
            t[int(n)] = float(us)
        if r.get("fa3_splits"):
            t[int(r["fa3_splits"])] = float(r["fa3_us"])
        d = int(r["head_dim"])
        h = int(r.get("heads") or heads)  # (CSVs before session 26 have no heads column: split_bench's default 32)
        rows.append(((int(r["batch"]), h, h // int(r["group"]), int(r["seqlen_q"]), int(r["seqlen_k"]), 4 * d), t))
    return rows


def score(files: dict) -> dict:
    """{file: (geomean, worst)} of the current constants' picks; None for a file with a pick it did not time."""
    core._split_counts.clear()
    out = {}
    for f, rows in files.items():
        logs = []
        for (b, h, hk, sq, sk, kvb), t in rows:
            n = core.varlen_num_splits(b, h, hk, sq, sk, 0, None, kvb)
            if n not in t:
                out[f] = None
                break
            logs.append(math.log(t[n] / min(t.values())))
        else:
            out[f] = (math.exp(sum(logs) / len(logs)), math.exp(max(logs)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--bandwidth", type=float, default=3.352e6)
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--heads", type=int, default=32, help="query heads of CSV rows without a heads column")
    a = ap.parse_args(argv)
    core.launch.num_sms = lambda device: a.sms
    core.launch.dram_bandwidth = lambda device: a.bandwidth
    files = {f: read_rows(f, a.heads) for f in a.csv}
    print("current:", {c: getattr(core, c) for c in CONSTANTS})
    for f, s in score(files).items():
        print(f"  {f}: " + ("a pick not timed" if s is None else f"geomean {s[0]:.3f}, worst {s[1]:.3f}"))
    if a.grid:
        results = []
        for values in itertools.product(*(GRID[c] for c in CONSTANTS)):
            for c, v in zip(CONSTANTS, values):
                setattr(core, c, v)
            per = score(files)
            if any(s is None for s in per.values()):
                continue
            logs = [math.log(s[0]) * len(files[f]) for f, s in per.items()]
            total = math.exp(sum(logs) / sum(len(r) for r in files.values()))
            results.append((round(total, 4), round(max(s[1] for s in per.values()), 3), values, per))
        results.sort(key=lambda r: (r[0], r[1]))
        for total, worst, values, per in results[:10]:
            print(f"geomean {total:.4f} worst {worst:.3f}", dict(zip(CONSTANTS, values)),
                  " ".join(f"{s[0]:.3f}" for s in per.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
