"""Warp-stall samples of an Nsight Compute source page (`ncu --page source --csv --print-source sass`,
as `device_check.sh prof` writes *.sass.csv) summed over address ranges of the kernel, with the top
stall reasons of each range, then the busiest SASS lines. Offsets are from the kernel's first
instruction, as cuobjdump prints them, so ranges can be read off a local `cuobjdump -sass` of the
same fatbin (docs/PERF.md: the FP8 loop's phases).

A page of several kernels (the backward's pre, main and post under one NVTX range) is split at its
"Kernel Name" rows and one kernel is read: the first whose name contains --kernel, else the one with
the most samples.

Usage: python scripts/stall_regions.py FILE.sass.csv[.gz] [--kernel NAME] [START-END ...]   (hex offsets,
e.g. 5010-58b0)"""
from __future__ import annotations

import csv
import gzip
import sys


def kernel_rows(rows: list, name: str | None) -> list:
    """The rows of one kernel's section ("Kernel Name" row, header, lines) of a source page."""
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] or [0]
    parts = [rows[a:b] for a, b in zip(starts, starts[1:] + [len(rows)])]
    if name is not None:
        for part in parts:
            if name in part[0][1]:
                return part
        raise SystemExit(f"no kernel named like {name!r} in: {', '.join(part[0][1] for part in parts)}")

    def samples(part):
        col = part[1].index("Warp Stall Sampling (All Samples)")
        return sum(int(r[col] or 0) for r in part[2:] if len(r) > col and r[col].isdigit())
    return max(parts, key=samples)


def main() -> None:
    args = sys.argv[1:]
    name = None
    if "--kernel" in args:
        i = args.index("--kernel")
        name = args[i + 1]
        del args[i:i + 2]
    path, ranges = args[0], args[1:]
    rows = kernel_rows(list(csv.reader(gzip.open(path, "rt") if path.endswith(".gz") else open(path))), name)
    print(f"kernel {rows[0][1]}")
    hdr, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][0], 16)
    recs = []
    for r in data:
        try:
            off = int(r[0], 16) - base
        except ValueError:
            continue
        n = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        recs.append((off, r[1].strip(), n, {h[6:]: int(r[col[h]] or 0) for h in reasons}))
    total = sum(x[2] for x in recs)
    print(f"total samples {total}")

    def top(recs_in):
        agg = {}
        for x in recs_in:
            for k, v in x[3].items():
                agg[k] = agg.get(k, 0) + v
        return ", ".join(f"{k} {v}" for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:5])

    for rng in ranges:
        lo, hi = (int(x, 16) for x in rng.split("-"))
        inside = [x for x in recs if lo <= x[0] < hi]
        n = sum(x[2] for x in inside)
        print(f"{lo:#x}-{hi:#x}: {n} ({100 * n / max(total, 1):.1f} %): {top(inside)}")
    print("busiest lines:")
    for x in sorted(recs, key=lambda x: -x[2])[:20]:
        print(f"{x[0]:#06x} {x[2]:6d} {x[1][:60]:60s} {top([x])}")


if __name__ == "__main__":
    main()
