"""Split-KV through flash_attn_func (FA3's ``num_splits``; flashgen.split_kv) on decode-like calls:
microseconds per call with num_splits=1 (FA3's default: the non-varlen kernel, unsplit) and num_splits=0 (the
split count core.varlen_num_splits chooses, on the varlen kernel plus the combine; and the count FA3's rule chose
before session 24's cost model, core.SPLIT_MODEL), beside SDPA's cuDNN and flash
backends (``enable_gqa=True``, BSHD strides as a user calls it; K/V expanded where a backend refuses GQA) in the
same process. Not causal (SDPA's causal is top-left aligned, FA3's bottom-right; at seqlen_q 1 they differ).

Timing: flashgen.bench._time_ms (triton do_bench, median, the L2 flushed before each repetition): events around
each call, so host time that outruns the GPU shows. bf16, heads 32, one row per (head_dim, batch, group,
seqlen_q, seqlen_k).

    python scripts/split_bench.py [--head-dims 64,128] [--shapes 16:8:1:8192,...] [--sweep 2,4,8,16,32] [--csv out.csv]

``--sweep``: each row also times those explicit num_splits (each capped as flash_attn_func caps it:
flashgen.split_kv.split_count) and reports the fastest count of 1, 0's choice and the sweep, with its time and
0's time over it: the data a better rule than FA3's (core.varlen_num_splits) would be fitted to.
``--shapes``: batch:group:seqlen_q:seqlen_k rows instead of the default twelve.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flashgen
import flashgen.core as core
from flashgen.bench import _time_ms
from flashgen.split_kv import split_count

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from packgqa_bench import _sdpa, _write_csv  # noqa: E402


def _fa3_rule(b: int, h: int, hk: int, sq: int, sk: int, d: int) -> int:
    """The count num_splits=0 took before session 24's cost model (core.SPLIT_MODEL off: FA3's rule and the decode
    floor), as flash_attn_func caps it."""
    saved, core.SPLIT_MODEL = core.SPLIT_MODEL, False
    try:
        return split_count(0, b, h, hk, sq, sk, 0, False, (-1, -1), 4 * d)
    finally:
        core.SPLIT_MODEL = saved


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--shapes", help="batch:group:seqlen_q:seqlen_k,... (default: the twelve below)")
    ap.add_argument("--sweep", default="", help="explicit num_splits to time too, e.g. 2,4,8,16,32")
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    h, rows = a.heads, []
    sweep = [int(x) for x in a.sweep.split(",") if x]
    shapes = ([tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")] if a.shapes else
              [(16, 8, 1, 8192), (16, 4, 1, 8192), (16, 8, 1, 1024), (16, 8, 4, 8192), (16, 8, 16, 8192),
               (16, 8, 64, 8192), (4, 8, 1, 8192), (4, 8, 1, 32768), (1, 8, 1, 32768), (1, 8, 16, 32768),
               (8, 1, 1, 8192), (2, 1, 1, 32768)])
    print(f"# split-KV in flash_attn_func, {torch.cuda.get_device_name()}, bf16, heads {h}, not causal; us per call")
    print("| head_dim | batch | group | seqlen_q | seqlen_k | splits | num_splits=1 | num_splits=0 | 1 / 0 | cuDNN "
          "| FA2 "
          "| best SDPA / flashgen(0) | FA3's rule n | its us / 0's |" + (" fastest n | its us | 0 / fastest |" if sweep else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if sweep else ""))
    for d in (int(x) for x in a.head_dims.split(",")):
        for b, group, sq, sk in shapes:
            hk = h // group
            g = torch.Generator(device="cuda").manual_seed(sq + sk + b)
            q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            runs = {n: split_count(n, b, h, hk, sq, sk, 0, False, (-1, -1), 4 * d) for n in (0, *sweep)}  # as called
            splits = runs[0]
            fa3 = _fa3_rule(b, h, hk, sq, sk, d)
            extra = sorted(({runs[n] for n in sweep} | {fa3}) - {1, runs[0]})
            t = {n: 1e3 * _time_ms(lambda n=n: flashgen.flash_attn_func(q, k, v, num_splits=n))
                 for n in (1, 0, *extra)}
            counts = {1: t[1], runs[0]: t[0], **{n: t[n] for n in extra}}
            fastest = min(counts, key=counts.get)
            peers = {}
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                fn, _ = _sdpa(backend, q, k, v)
                peers[name] = 1e3 * _time_ms(fn) if fn else float("nan")
            best = min((x for x in peers.values() if x == x), default=float("nan"))
            row = dict(head_dim=d, batch=b, group=group, seqlen_q=sq, seqlen_k=sk, splits=splits, unsplit_us=t[1],
                       split_us=t[0], speedup=t[1] / t[0], cudnn_us=peers["cudnn"], fa2_us=peers["fa2"],
                       vs_best_sdpa=best / t[0], fa3_splits=fa3, fa3_us=counts[fa3], fa3_over_0=counts[fa3] / t[0])
            if sweep:
                row.update(fastest_splits=fastest, fastest_us=counts[fastest],
                           split_over_fastest=t[0] / counts[fastest],
                           sweep_us=";".join(f"{n}:{t[n]:.1f}" for n in extra))
            row["heads"] = h
            rows.append(row)
            print(f"| {d} | {b} | {group} | {sq} | {sk} | {splits} | {t[1]:.1f} | {t[0]:.1f} | {row['speedup']:.2f} | "
                  f"{peers['cudnn']:.1f} | {peers['fa2']:.1f} | {row['vs_best_sdpa']:.2f} | {fa3} | "
                  f"{row['fa3_over_0']:.2f} |"
                  + (f" {fastest} | {counts[fastest]:.1f} | {t[0] / counts[fastest]:.2f} |" if sweep else ""),
                  flush=True)
            del q, k, v
    _write_csv(a.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
