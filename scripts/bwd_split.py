"""Where the backward's time goes: the GPU time of each of its three kernels (pre, main, post) at
FA3-protocol points, from torch.profiler's kernel records.

    python3 scripts/bwd_split.py [--head-dims 64,128,256] [--seqlens 512,2048,16384] [--dtype bf16]
                                 [--deterministic] [--reps 10] [--pdl]

Each point: 16k tokens, hidden 2048 (batch = 16384 / seqlen, heads = 2048 / head_dim), causal off
and on; flashgen's backward alone on a forward made once (bench._flashgen_bwd_fn), the L2 flushed
(a 256 MB write) before every repetition as in triton's do_bench. Prints a markdown table of the
mean microseconds per kernel and the pre + post share of the three. Needs a GPU and a build with
the bwd variants. Kernel names end in _pre, _main, _post (templates/bwd.cu.j2).

main and post launch as programmatic dependents (PDL, generator/families/bwd.py): each may start before
the kernel before it completes and then waits for it, so its profiler time includes that wait. This
script launches them plainly ($FLASHGEN_PDL=0), so each kernel is timed alone; --pdl keeps PDL (the
three times then overlap, and main's and post's overstate their own work).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict


def split(hd: int, seqlen: int, causal: bool, dtype, deterministic: bool, reps: int) -> dict:
    """{role: mean GPU microseconds per call} of the backward's kernels at one point."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flashgen.bench import _flashgen_bwd_fn

    b, h = 16384 // seqlen, 2048 // hd
    q, k, v = (torch.randn(b, seqlen, h, hd, device="cuda", dtype=dtype) for _ in range(3))
    fn, _ = _flashgen_bwd_fn(q, k, v, causal, deterministic)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):  # warm-up: loads the variant, fills caches of the allocator
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        name = e.name
        for role in ("pre", "main", "post"):
            if name.startswith("flashgen_bwd_") and name.endswith("_" + role):
                total[role] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {role: total[role] / reps for role in ("pre", "main", "post")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,2048,16384")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pdl", action="store_true", help="keep the PDL launches (default: each kernel alone)")
    a = ap.parse_args(argv)
    from flashgen import launch

    os.environ[launch.PDL_ENV] = "1" if a.pdl else "0"  # read as each kernel loads (below)
    import torch

    if not torch.cuda.is_available():
        print("bwd_split: needs a GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    print(f"backward kernels on {torch.cuda.get_device_name()} ({a.dtype}, deterministic={a.deterministic}; "
          f"16k tokens, hidden 2048; mean us per call over {a.reps}, L2 flushed; PDL {'on' if a.pdl else 'off'})")
    print("| hd | causal | seqlen | pre | main | post | (pre + post) / all |")
    print("|---|---|---|---|---|---|---|")
    for hd in (int(x) for x in a.head_dims.split(",")):
        for causal in (False, True):
            for s in (int(x) for x in a.seqlens.split(",")):
                t = split(hd, s, causal, dtype, a.deterministic, a.reps)
                all_ = sum(t.values())
                share = (t["pre"] + t["post"]) / all_ if all_ else float("nan")
                print(f"| {hd} | {'yes' if causal else 'no'} | {s} | {t['pre']:.1f} | {t['main']:.1f} | "
                      f"{t['post']:.1f} | {share:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
