"""The A/B table of two settings of scripts/split_bench.py alternated twice on one build (device_check.sh splitkv's
PDLAB=1, decodeab): CSVs ``DIR/A_1.csv``, ``DIR/B_1.csv``, ``DIR/A_2.csv``, ``DIR/B_2.csv``, the same rows in the same
order. For each of ``--columns`` (split_bench.py's ``unsplit_us``: num_splits=1, ``split_us``: num_splits=0) a
table: us per call of A and B in both runs, A / B per run (> 1: B faster), and SDPA cuDNN's time from A's first run;
then the geomean of A / B per run over the rows.

    python scripts/split_ab.py DIR A B [--columns split_us,unsplit_us] [--labels "PDL off,on"]
"""

from __future__ import annotations

import argparse
import csv
import math


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--columns", default="split_us")
    ap.add_argument("--labels", default="", help="A's and B's names in the header, comma-separated")
    a = ap.parse_args(argv)
    la, lb = (a.labels.split(",") + ["", ""])[:2] if a.labels else (a.a, a.b)
    runs = {k: list(csv.DictReader(open(f"{a.dir}/{k}.csv"))) for k in (f"{a.a}_1", f"{a.b}_1", f"{a.a}_2", f"{a.b}_2")}
    if len({len(r) for r in runs.values()}) != 1:
        raise SystemExit(f"the four CSVs have different row counts: { {k: len(r) for k, r in runs.items()} }")
    for col in a.columns.split(","):
        print(f"\n{col} (us per call)\n")
        tile = {"unsplit_us": "tile_1", "split_us": "tile_0"}.get(col)  # (split_bench.py's tile columns, if written)
        tile = tile if tile in runs[f"{a.a}_1"][0] else None
        print(f"| head_dim | batch | group | seqlen_q | seqlen_k | splits | {la} r1 / r2 | {lb} r1 / r2 | "
              f"{la} / {lb} r1 / r2 | cuDNN |" + (f" tile {la} / {lb} |" if tile else ""))
        print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if tile else ""))
        logs = {1: [], 2: []}
        for i, r in enumerate(runs[f"{a.a}_1"]):
            t = {k: float(v[i][col]) for k, v in runs.items()}
            ab = {n: t[f"{a.a}_{n}"] / t[f"{a.b}_{n}"] for n in (1, 2)}
            for n in (1, 2):
                logs[n].append(math.log(ab[n]))
            print(f"| {r['head_dim']} | {r['batch']} | {r['group']} | {r['seqlen_q']} | {r['seqlen_k']} | "
                  f"{r['splits'] if col == 'split_us' else 1} | {t[f'{a.a}_1']:.1f} / {t[f'{a.a}_2']:.1f} | "
                  f"{t[f'{a.b}_1']:.1f} / {t[f'{a.b}_2']:.1f} | {ab[1]:.3f} / {ab[2]:.3f} | {float(r['cudnn_us']):.1f} |"
                  + (f" {r[tile]} / {runs[f'{a.b}_1'][i][tile]} |" if tile else ""))
        print(f"\ngeomean {la} / {lb}: run 1 {math.exp(sum(logs[1]) / len(logs[1])):.3f}, "
              f"run 2 {math.exp(sum(logs[2]) / len(logs[2])):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
