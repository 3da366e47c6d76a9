"""Where a decode-like call's GPU time goes: each kernel's device time and the call's span, flashgen against SDPA.

split_bench.py times whole calls (events around each, the L2 flushed): on one-token decodes over 1k-32k keys
flashgen's split call (the varlen kernel writing partials, then the combine as its PDL dependent) read 0.83-1.04 of
SDPA cuDNN on an H100 (session 24, ``docs/results/combine_pdl_h100/``), and nothing said which part is the gap. This
script records the calls under torch.profiler (CUPTI) with the L2 flushed before each one (a 256 MiB fill, left out
of the figures) and prints per call:

* ``span us``: the first kernel's start to the last kernel's end (the launches are queued behind the fill, so
  this is GPU time and the gaps between a call's kernels, without the host);
* each kernel's mean device time (name shortened), in launch order.

Rows: flash_attn_func with num_splits=0 (the cost model's count) and 1 (unsplit), SDPA's cuDNN backend
(``enable_gqa=True``). bf16, heads 32, not causal.

    python scripts/decode_kernel_times.py [--head-dims 64,128] [--shapes 1:8:1:4096,...] [--n 30]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flashgen
from flashgen.split_kv import split_count

_FILL_NAMES = ("fill", "Fill")  # the flush kernel's name contains one of these (torch's fill_)


def _short(name: str) -> str:
    for key in ("fwd_", "combine", "cudnn", "sm90", "flash", "xmma", "cutlass"):
        at = name.find(key)
        if at >= 0:
            return name[at:at + 44]
    return name[:44]


def kernel_times(fn, n: int) -> tuple[float, list]:
    """(mean span in us, [(kernel, mean us)] in launch order) of ``n`` calls of ``fn``, each after a 256 MiB fill."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush.fill_(1)
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in events:
        if any(s in e.name for s in _FILL_NAMES):
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append(e)
    calls = [c for c in calls if c]
    if len(calls) != n:
        raise RuntimeError(f"expected {n} calls between fills, found {len(calls)}")
    spans = [max(e.time_range.end for e in c) - min(e.time_range.start for e in c) for c in calls]
    names = [e.name for e in calls[0]]
    per = [sum(c[i].time_range.elapsed_us() for c in calls if len(c) > i) / n for i in range(len(names))]
    return sum(spans) / n, list(zip((_short(x) for x in names), per))


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--shapes", default="1:8:1:4096,4:8:1:1024,1:8:1:32768,1:1:1:2048,16:8:1:2048")
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args(argv)
    h = a.heads
    print(f"# decode kernels, {torch.cuda.get_device_name()}, bf16, heads {h}, not causal; device us per call "
          f"(L2 flushed before each, {a.n} calls)")
    print("| head_dim | batch | group | seqlen_q | seqlen_k | call | splits | span us | kernels (us each) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in a.head_dims.split(",")):
        for b, group, sq, sk in (tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")):
            hk = h // group
            g = torch.Generator(device="cuda").manual_seed(sq + sk + b)
            q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            rows = [("flashgen 0", split_count(0, b, h, hk, sq, sk, 0, False, (-1, -1), 4 * d),
                     lambda: flashgen.flash_attn_func(q, k, v, num_splits=0)),
                    ("flashgen 1", 1, lambda: flashgen.flash_attn_func(q, k, v, num_splits=1)),
                    ("SDPA cuDNN", "", cudnn)]
            for label, splits, fn in rows:
                try:
                    span, ks = kernel_times(fn, a.n)
                except RuntimeError as e:  # (a backend that refuses the shape)
                    print(f"| {d} | {b} | {group} | {sq} | {sk} | {label} | {splits} | - | {str(e)[:60]} |")
                    continue
                kern = "; ".join(f"{name} {us:.1f}" for name, us in ks)
                print(f"| {d} | {b} | {group} | {sq} | {sk} | {label} | {splits} | {span:.1f} | {kern} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
