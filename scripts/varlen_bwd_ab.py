"""Time the varlen backward alone (torch.autograd.grad of one flash_attn_varlen_func call on the varlen kernels) over
packed causal documents, for an A/B of two trees in one session (scripts/device_check.sh varlenab runs this file of
the new tree under the old tree's package, then under the new one, twice).

Workloads: bf16, causal, 16k tokens cut at random into N documents (N = 16, 64, 256: the shorter the documents, the
more of each CTA's blocks are a sequence's last, partial one), head_dim 64 / 128 / 256 (16 / 16 / 8 heads), GQA 2.
Each point: one forward with gradients, then the backward timed with flashgen.bench._time_ms (triton do_bench style,
L2 flushed before every repetition, median); the launches are checked to be the varlen backward's. Offsets on the
GPU, read on the GPU by both trees (FLASHGEN_VARLEN_NO_HOST_READ=1 set here before flashgen is imported).

  python scripts/varlen_bwd_ab.py --json OUT.json            # one run
  python scripts/varlen_bwd_ab.py --json OUT.json --points 128,16   # one run of one point (head_dim,documents; ';'-separated)
  python scripts/varlen_bwd_ab.py --compare old1 new1 old2 new2   # the old/new table of runs alternated old, new, ...

The table's new/old is the median of the new runs over the median of the old runs (with two runs each, the mean):
with more rounds a one-off stall of one run does not move it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics

os.environ.setdefault("FLASHGEN_VARLEN_NO_HOST_READ", "1")

POINTS = [(d, n) for d in (64, 128, 256) for n in (16, 64, 256)]
TOKENS = 16384


def run(path: str, points=POINTS) -> None:
    import torch

    import flashgen
    import flashgen.core as core
    from flashgen.bench import _time_ms

    res = {"gpu": torch.cuda.get_device_name(), "flashgen": os.path.dirname(flashgen.__file__), "ms": {}}
    for d, n_docs in points:
        h = 8 if d == 256 else 16
        rng = random.Random(1000 * d + n_docs)
        cuts = sorted(rng.sample(range(1, TOKENS), n_docs - 1))
        lens = [b - a for a, b in zip([0] + cuts, cuts + [TOKENS])]
        cu = torch.tensor([0] + cuts + [TOKENS], dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(d + n_docs)
        q = torch.randn(TOKENS, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(TOKENS, h // 2, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        out = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        dout = torch.randn_like(out)
        launches = []
        real = core.attention_backward
        core.attention_backward = lambda *a, **kw: launches.append(kw.get("varlen") is not None) or real(*a, **kw)
        try:
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        finally:
            core.attention_backward = real
        if launches != [True]:
            raise RuntimeError(f"hd{d} {n_docs} docs: backward launches {launches}, not the varlen kernels")
        if not all(bool(torch.isfinite(x).all()) for x in grads):
            raise RuntimeError(f"hd{d} {n_docs} docs: a gradient is not finite")
        ms = _time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        res["ms"][f"{d},{n_docs}"] = ms
        print(f"hd{d} {n_docs} docs (longest {max(lens)}): {ms:.3f} ms", flush=True)
    with open(path, "w") as f:
        json.dump(res, f)


def compare(paths: list[str]) -> None:
    runs = [json.load(open(p)) for p in paths]
    olds, news = runs[0::2], runs[1::2]
    for p, r in zip(paths, runs):
        print(f"{p}: flashgen from {r['flashgen']}")
    print(f"varlen backward, bf16 causal, {TOKENS} tokens of packed documents, GQA 2, {runs[0]['gpu']}: ms per "
          f"backward (old runs / new runs), new/old = median new / median old")
    print("| head_dim | documents | old ms | new ms | new/old |")
    print("|---|---|---|---|---|")
    ratios = []
    for d, n_docs in POINTS:
        key = f"{d},{n_docs}"
        if not all(key in r["ms"] for r in runs):  # (runs of a --points subset)
            continue
        o = [r["ms"][key] for r in olds]
        w = [r["ms"][key] for r in news]
        ratio = statistics.median(w) / statistics.median(o)
        ratios.append(ratio)
        print(f"| {d} | {n_docs} | {' / '.join(f'{x:.3f}' for x in o)} | {' / '.join(f'{x:.3f}' for x in w)} | "
              f"{ratio:.3f} |")
    print(f"geometric mean new/old: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write this run's times here")
    ap.add_argument("--compare", nargs="+", help="old, new, old, new ... JSON files of runs")
    ap.add_argument("--points", help="only these points: 'head_dim,documents' pairs, ';'-separated (default: all 9)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    points = POINTS
    if args.points:
        points = [tuple(int(x) for x in p.split(",")) for p in args.points.split(";") if p]
        unknown = [p for p in points if p not in POINTS]
        if unknown:
            ap.error(f"--points {unknown}: want pairs among {POINTS}")
    run(args.json or "varlen_bwd_ab.json", points)


if __name__ == "__main__":
    main()
