"""Old/new table of the e4m3 forward from fp8_bench.py's markdown output, alternated runs.

    python3 scripts/fp8_compare.py OLD1.md NEW1.md OLD2.md NEW2.md

Reads the "e4m3 kernel" column (TFLOP/s) of each run, keyed by (head_dim, causal, seqlen), and prints
old r1/r2, new r1/r2 and new/old (mean of the new runs over the mean of the old ones), then the
geometric mean of new/old. Used by scripts/device_check.sh fwdchange.
"""
from __future__ import annotations

import math
import sys


def read(path: str) -> dict:
    """{(head_dim, causal, seqlen): e4m3 kernel TFLOP/s} from one fp8_bench.py output."""
    out = {}
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        out[(int(cells[0]), cells[1], int(cells[2]))] = float(cells[3])
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__)
        return 2
    old1, new1, old2, new2 = (read(p) for p in argv)
    keys = [k for k in old1 if k in new1 and k in old2 and k in new2]
    if not keys:
        print("no common points (did a run fail? see the .md files)")
        return 1
    print("| head_dim | causal | seqlen | old r1/r2 | new r1/r2 | new/old |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for k in keys:
        r = (new1[k] + new2[k]) / (old1[k] + old2[k])
        ratios.append(r)
        print(f"| {k[0]} | {k[1]} | {k[2]} | {old1[k]:.0f}/{old2[k]:.0f} | {new1[k]:.0f}/{new2[k]:.0f} | {r:.3f} |")
    print(f"\ngeomean new/old over {len(ratios)} points: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
