"""Throughput of flashgen.quantize_fp8 (the ``quant`` kernels), as memory bandwidth.

Timed like `flashgen bench` (L2 flushed before each repetition, median), twice: the eager call (``call
us``: what a user's stream sees, the Python host time included where it exceeds the GPU's, as after
each L2 flush here) and the same call replayed from a CUDA graph (``us``: the two kernels alone).
The figures below are of the graph. Two figures per shape:
* useful GB/s: the bytes a one-pass quantizer must move (read q, k, v in bf16 / fp16, write them
  in e4m3, plus the descales) over the time;
* traffic GB/s: the bytes these kernels move (v, and q / k without block quantization, are read
  twice: the amax pass, then the quant pass).
and the useful figure as a fraction of the GPU's DRAM peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s;
--peak to override). A reference row per shape: torch's own e4m3 cast of the same three tensors
(``x.to(torch.float8_e4m3fn)``, no scales: the same useful bytes, three elementwise kernels), timed
the same way. Usage: python scripts/quant_bench.py [--peak 4.8e12] [--dtype bf16] [--host-only]
"""
from __future__ import annotations

import argparse

import torch

from flashgen import MissingVariantError
from flashgen.bench import _time_ms, host_us
from flashgen.interface import flash_attn_func, quantize_fp8

SHAPES = [  # batch, seqlen, heads, heads_k, head_dim
    (2, 4096, 16, 16, 128),
    (1, 16384, 16, 16, 128),
    (8, 2048, 32, 8, 128),
    (4, 8192, 32, 32, 64),
    (2, 8192, 8, 8, 256),
    (2, 8192, 16, 16, 96),
    (2, 8192, 16, 16, 192),
    (64, 128, 16, 16, 128),
]


def _graph(fn):
    """``fn``'s kernels captured once in a CUDA graph (after a warm-up on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _peak(name: str) -> float:
    return 4.8e12 if "H200" in name else 3.35e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak", type=float, default=None, help="DRAM bytes/s (default: by GPU name)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--host-only", action="store_true", help="the host time per call alone")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    name = torch.cuda.get_device_name()
    peak = a.peak or _peak(name)
    print(f"{name}, peak {peak / 1e12:.2f} TB/s, {a.dtype}")
    # host time per call on a small problem (bench.host_us: best of 5 runs of 2000 back-to-back calls), beside
    # the attention calls of the FP8 path
    q = torch.randn(1, 128, 1, 128, device="cuda", dtype=dtype)
    q8, k8, v8, qd, kd, vd = quantize_fp8(q, q, q, block_quant=False)  # FA3's descale shape
    entries = [("quantize_fp8", lambda: quantize_fp8(q, q, q)), ("flash_attn_func", lambda: flash_attn_func(q, q, q)),
               ("flash_attn_func e4m3 + descales",
                lambda: flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))]
    for label, fn in list(entries):
        try:
            fn()
        except MissingVariantError as e:  # a partial build
            print(f"{label}: not timed ({e})".splitlines()[0])
            entries.remove((label, fn))
    us = host_us(entries)
    print("host us per call, q, k, v (1, 128, 1, 128): " + ", ".join(f"{n} {t:.1f}" for n, t in us.items()))
    if a.host_only:
        return
    print("| b, s, h, hk, d | mode | call us | us | useful GB/s | % of peak | traffic GB/s |")
    print("|---|---|---|---|---|---|---|")
    for b, s, h, hk, d in SHAPES:
        q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
        k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
        n_q, n_kv = q.numel(), k.numel()
        useful = 3 * (n_q + 2 * n_kv)  # 2 bytes in, 1 out per element (descales are negligible)
        e4m3 = torch.float8_e4m3fn
        cast = lambda: (q.to(e4m3), k.to(e4m3), v.to(e4m3))  # noqa: E731
        call, ms = _time_ms(cast), _time_ms(_graph(cast))
        print(f"| {b}, {s}, {h}, {hk}, {d} | torch cast (reference) | {call * 1e3:.1f} | {ms * 1e3:.1f} | "
              f"{useful / ms / 1e6:.0f} | {100 * useful * 1e3 / ms / peak:.0f} | {useful / ms / 1e6:.0f} |")
        for incoherent, block in ((True, True), (False, True), (True, False)):
            fn = lambda: quantize_fp8(q, k, v, incoherent=incoherent, block_quant=block)  # noqa: E731
            call, ms = _time_ms(fn), _time_ms(_graph(fn))
            traffic = useful + 2 * n_kv + (0 if block else 2 * (n_q + n_kv))
            mode = ("incoherent" if incoherent else "plain") + (", block" if block else ", per-head")
            print(f"| {b}, {s}, {h}, {hk}, {d} | {mode} | {call * 1e3:.1f} | {ms * 1e3:.1f} | {useful / ms / 1e6:.0f} | "
                  f"{100 * useful * 1e3 / ms / peak:.0f} | {traffic / ms / 1e6:.0f} |")


if __name__ == "__main__":
    main()
