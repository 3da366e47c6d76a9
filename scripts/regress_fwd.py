#!/usr/bin/env python3
"""Forward regression check: the FA3-protocol grid for whichever `flashgen` is importable, timed by
THIS checkout's harness (runtime/bench.py, loaded by path), so an old commit's package and the new
one are measured the same way in the same GPU session.

    python scripts/regress_fwd.py run --label new --csv new1.csv [--no-peers]
    PYTHONPATH=/tmp/oldsite FLASHGEN_ROOT=.base FLASHGEN_KERNEL_DIR=.base/build python scripts/regress_fwd.py run --label old --csv old1.csv
    python scripts/regress_fwd.py compare new1.csv old1.csv new2.csv old2.csv     # the table, printed last
    python scripts/regress_fwd.py peers new1.csv new2.csv      # flashgen / best SDPA backend per point (issue 11)
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _bench_module():
    spec = importlib.util.spec_from_file_location("flashgen_bench_harness", HERE / "runtime" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(a) -> int:
    import flashgen
    from flashgen import flash_attn_func

    print(f"[{a.label}] flashgen from {Path(flashgen.__file__).resolve().parent}", flush=True)
    import flashgen.core as core  # experiments on the causal tile order (scheduler.cuh's L2 sections)
    if a.l2_section_mb is not None:
        core.L2_SECTION_BYTES = int(a.l2_section_mb * (1 << 20))
    if a.l2_section_kv_heads is not None:
        core.L2_SECTION_KV_HEADS = a.l2_section_kv_heads
    if a.tail_sections is not None:
        core.CAUSAL_TAIL_SECTIONS = a.tail_sections
    causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
    rows = _bench_module().run_grid([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.head_dims.split(",")],
                                    a.dtypes.split(","), causals, attn=flash_attn_func, peers=not a.no_peers)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["label", *rows[0].keys()])
        w.writeheader()
        for r in rows:
            w.writerow({"label": a.label, **r})
    return 0


def compare(paths) -> int:
    runs = defaultdict(list)  # label -> [ {point: row} ]
    for p in paths:
        with open(p) as f:
            rows = list(csv.DictReader(f))
        runs[rows[0]["label"]].append({(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r for r in rows})
    labels = sorted(runs)  # e.g. new, old
    if labels != ["new", "old"]:
        print(f"compare needs runs labelled new and old, got {labels}", file=sys.stderr)
        return 2
    points = list(runs["new"][0])
    print(f"{'dtype':<5} {'hd':>3} {'causal':>6} {'seqlen':>6} | {'old r1':>7} {'old r2':>7} {'new r1':>7} {'new r2':>7} "
          f"| {'new/old':>7} | {'cuDNN':>6} {'FA2':>6}")
    ratios = []
    for pt in points:
        old = [float(r[pt]["flashgen"]) for r in runs["old"]]
        new = [float(r[pt]["flashgen"]) for r in runs["new"]]
        cud = [float(r[pt]["cudnn"]) for rr in (runs["new"], runs["old"]) for r in rr if r[pt]["cudnn"] not in ("", "nan")]
        fa2 = [float(r[pt]["fa2"]) for rr in (runs["new"], runs["old"]) for r in rr if r[pt]["fa2"] not in ("", "nan")]
        ratio = (sum(new) / len(new)) / (sum(old) / len(old))
        ratios.append(ratio)
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
        cells = " ".join(f"{x:7.1f}" for x in old + new)
        print(f"{pt[0]:<5} {pt[1]:>3} {pt[2]:>6} {pt[3]:>6} | {cells} | {ratio:7.3f} | {med(cud):6.1f} {med(fa2):6.1f}")
    spread = [abs(float(a[pt]["flashgen"]) / float(b[pt]["flashgen"]) - 1) for rr in runs.values()
              for a, b in zip(rr, rr[1:]) for pt in points]
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"new/old geometric mean {gm:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
          f"same-code run-to-run spread: median {sorted(spread)[len(spread) // 2]:.3f}, max {max(spread):.3f}")
    return 0


def best_sdpa(row: dict) -> float:
    """TFLOP/s of the faster SDPA backend (cuDNN or FA2) in one CSV row of `run`."""
    return max(float(row[c]) for c in ("cudnn", "fa2") if row[c] not in ("", "nan"))


def peers(paths) -> int:
    """Issue 11's table: flashgen / the best SDPA backend (cuDNN or FA2) of the same run, per point
    (mean over the runs), its geometric mean over all runs and points, and the points at >= 1.0 in
    every run."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append({(r["dtype"], int(r["head_dim"]), r["causal"], int(r["seqlen"])): r for r in csv.DictReader(f)})
    ratios = {pt: [float(r[pt]["flashgen"]) / best_sdpa(r[pt]) for r in runs] for pt in runs[0]}
    seqlens = sorted({pt[3] for pt in ratios})
    for dt in sorted({pt[0] for pt in ratios}):
        print(f"\n{dt}: flashgen / best SDPA backend, mean of {len(runs)} runs\n"
              f"| head_dim, mask | {' | '.join(str(s) for s in seqlens)} |\n|---|{'---|' * len(seqlens)}")
        for hd in sorted({pt[1] for pt in ratios if pt[0] == dt}):
            for c in ("False", "True"):
                cells = [ratios.get((dt, hd, c, s)) for s in seqlens]
                print(f"| {hd} {'causal' if c == 'True' else 'non-causal'} | "
                      + " | ".join("" if x is None else f"{sum(x) / len(x):.2f}" for x in cells) + " |")
    flat = [x for xs in ratios.values() for x in xs]
    gm = math.exp(sum(math.log(x) for x in flat) / len(flat))
    ahead = sum(1 for xs in ratios.values() if min(xs) >= 1.0)
    print(f"\ngeometric mean {gm:.3f} over {len(ratios)} points x {len(runs)} runs; >= 1.0 in every run: "
          f"{ahead}/{len(ratios)}; min {min(flat):.2f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--label", required=True)
    r.add_argument("--csv", required=True)
    r.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    r.add_argument("--head-dims", default="64,128,256")
    r.add_argument("--dtypes", default="bf16,fp16")
    r.add_argument("--no-peers", action="store_true")
    r.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    r.add_argument("--l2-section-mb", type=float, default=None,
                   help="override core.L2_SECTION_BYTES (MiB) for this run: the causal tile order's L2 sections")
    r.add_argument("--l2-section-kv-heads", type=int, default=None,
                   help="override core.L2_SECTION_KV_HEADS (the cap on K/V heads per L2 section) for this run")
    r.add_argument("--tail-sections", type=int, default=None,
                   help="override core.CAUSAL_TAIL_SECTIONS (sections in the causal order's last one; 1: none merged)")
    c = sub.add_parser("compare")
    c.add_argument("csvs", nargs="+")
    pr = sub.add_parser("peers")
    pr.add_argument("csvs", nargs="+")
    a = ap.parse_args(argv)
    return run(a) if a.cmd == "run" else compare(a.csvs) if a.cmd == "compare" else peers(a.csvs)


if __name__ == "__main__":
    sys.exit(main())
