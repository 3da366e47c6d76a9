"""Forward (and forward + backward) throughput of the mask and softcap variants on one shape, in one
process: no mask, causal, FA3 sliding windows and softcap, timed like `flashgen bench` (L2 flushed
between repetitions, median). FLOPs count only the visible (query, key) pairs, as FA3's benchmark
does for local attention: 4 * d * visible pairs forward, 2.5 x that for the backward. PyTorch SDPA
(cuDNN and flash backends) runs in the same process where it can express the case (no mask,
causal; it has no window or softcap argument).
Usage: python scripts/features_bench.py [--seqlen 16384] [--head-dim 128] [--backward]"""
from __future__ import annotations

import argparse

import torch

from flashgen.bench import _sdpa_fn, _time_ms
from flashgen.core import mask_spec
from flashgen.interface import flash_attn_func


def visible_pairs(sq: int, sk: int, causal: bool, window) -> int:
    m = mask_spec(causal, window, sq, sk)
    if not (m.causal or m.local):
        return sq * sk
    i = torch.arange(sq, dtype=torch.int64)
    lo = (i + sk - sq - m.left).clamp(min=0)
    hi = (i + sk - sq + m.right).clamp(max=sk - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backward", action="store_true")
    a = ap.parse_args()
    s, d = a.seqlen, a.head_dim
    h = 2048 // d
    b = max(1, 16384 // s)
    cases = [("none", False, (-1, -1), 0.0), ("causal", True, (-1, -1), 0.0),
             ("causal window 1024", True, (1024, -1), 0.0), ("window (512, 512)", False, (512, 512), 0.0),
             ("window (4096, 0)", False, (4096, 0), 0.0), ("softcap 30", False, (-1, -1), 30.0),
             ("causal softcap 30", True, (-1, -1), 30.0)]
    print(f"{torch.cuda.get_device_name()} bf16 batch {b} seqlen {s} heads {h} head_dim {d}")
    from torch.nn.attention import SDPBackend

    peers = {"cuDNN": SDPBackend.CUDNN_ATTENTION, "FA2": SDPBackend.FLASH_ATTENTION}
    print(f"{'case':22s} {'fwd TFLOP/s':>12s}" + (f" {'fwd+bwd TFLOP/s':>16s}" if a.backward else "")
          + "".join(f" {n + ' fwd':>10s}" + (f" {n + ' f+b':>10s}" if a.backward else "") for n in peers))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    for name, causal, window, cap in cases:
        flops = 4 * b * h * d * visible_pairs(s, s, causal, window)
        ms = _time_ms(lambda: flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=cap))
        line = f"{name:22s} {flops / ms / 1e9:12.1f}"
        if a.backward:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            do = torch.randn_like(q)

            def step():
                out = flash_attn_func(qg, kg, vg, causal=causal, window_size=window, softcap=cap)
                out.backward(do)
            ms2 = _time_ms(step)
            line += f" {3.5 * flops / ms2 / 1e9:16.1f}"
        for backend in peers.values():
            fn = _sdpa_fn(backend, q, k, v, causal) if window == (-1, -1) and not cap else None
            if fn is None:
                line += f" {'-':>10s}" + (f" {'-':>10s}" if a.backward else "")
                continue
            line += f" {flops / _time_ms(fn) / 1e9:10.1f}"
            if a.backward:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                fg = _sdpa_fn(backend, qg, kg, vg, causal)
                line += f" {3.5 * flops / _time_ms(lambda: fg().backward(do.transpose(1, 2))) / 1e9:10.1f}"
        print(line)


if __name__ == "__main__":
    main()
