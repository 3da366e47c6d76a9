"""Where the backward main kernel's SMs idle, from bwd_cta_probe.py's raw records (PROBE_DUMP CSVs, gzipped here).

python3 probe_tail.py call1_probe_hd256_*_1.csv.gz: per point the main span (globaltimer, first entry to last
exit), the SMs' busy share of it (entry..exit of their CTAs), the idle before each SM's first CTA and after its
last (mean and max over SMs), CTAs per SM; then the CTAs of the last 150 us of the longest point given, by
(batch, head_k) column: (key block, query blocks, entry us, exit us) of the column's first four."""
import csv
import gzip
import sys


def load(path):
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [x for x in ({k: int(v) for k, v in row.items()} for row in csv.DictReader(f)) if x["gt_entry"] > 0]


def summary(path):
    r = load(path)
    g0, g1 = min(x["gt_entry"] for x in r), max(x["gt_exit"] for x in r)
    sms = {}
    for x in r:
        sms.setdefault(x["smid"], []).append(x)
    first = [min(x["gt_entry"] for x in v) - g0 for v in sms.values()]
    last = [g1 - max(x["gt_exit"] for x in v) for v in sms.values()]
    busy = sum(x["gt_exit"] - x["gt_entry"] for x in r) / len(sms)
    n = [len(v) for v in sms.values()]
    print(f"| {path.split('probe_')[-1].split('.csv')[0]} | {(g1 - g0) / 1e3:.0f} | {busy / (g1 - g0):.3f} | "
          f"{sum(first) / len(first) / 1e3:.1f} / {max(first) / 1e3:.1f} | {sum(last) / len(last) / 1e3:.1f} / "
          f"{max(last) / 1e3:.1f} | {min(n)}-{max(n)} |")
    return r, g0, g1


print("| point | main span us | SM busy / span | idle before first CTA, mean / max us | idle after last CTA, mean / max us | CTAs per SM |")
print("|---|---|---|---|---|---|")
res = [summary(p) for p in sys.argv[1:]]
r, g0, g1 = res[-1]
cols = {}
for x in sorted((x for x in r if x["gt_exit"] > g1 - 150000), key=lambda x: x["n_block"]):
    cols.setdefault((x["batch"], x["head_k"]), []).append(
        (x["n_block"], x["iters"], round((x["gt_entry"] - g0) / 1e3), round((x["gt_exit"] - g0) / 1e3)))
print(f"\nCTAs exiting in the last 150 us of {sys.argv[-1]}, by (batch, head_k): (key block, query blocks, entry, exit)")
for c, v in sorted(cols.items()):
    print(c, len(v), v[:4])
