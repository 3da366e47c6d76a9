"""The varlen kernels against flash_attn_func on the same batch of equal-length sequences, on a GPU.

flash_attn_varlen_func over B sequences of N tokens each (cu_seqlens = 0, N, 2N, ...) computes what
flash_attn_func computes over the (B, N, H, D) tensor, on other kernels: the varlen axis of the fwd and bwd
families (core.Varlen, core.BwdVarlen). The varlen backward has the plain tiles only (no head_dim 256 pairs,
persistent grid, split or longest-first tail, block_m 80 tile: configs/bwd.yaml, docs/STATUS.md), so this
says what a packed-documents training step gives up for its one launch, at FA3's protocol (bf16, 16k tokens,
hidden 2048, heads = 2048 / head_dim).

Per point: the two paths' out and gradients are compared first (FA3's rule is the GPU tests'; here the largest
absolute difference is printed), then the forward (no gradient) and the backward alone (autograd.grad on a forward
made once, retain_graph; the same method for both paths) are timed with flashgen.bench._time_ms (triton do_bench
style: L2 flushed before every repetition, median), the two paths alternated, ROUNDS rounds. Eager calls: the
varlen path reads cu_seqlens on the host once per forward (core.VARLEN_NO_HOST_READ off), which at these sizes is
a few us of a 0.1-5 ms call. Prints TFLOP/s per round and varlen / func (best rounds); a markdown table last.

Usage: python scripts/varlen_equal_bench.py [--rounds 2] [--seqlens 512,2048,8192] [--head-dims 64,128,256]
"""
from __future__ import annotations

import argparse
import math

import torch

import flashgen
import flashgen.core as core
from flashgen.bench import _flops, _time_ms


def point(d: int, n: int, causal: bool, rounds: int) -> dict:
    """One FA3-protocol point: max abs differences (out, dq, dk, dv) and TFLOP/s of each path per round."""
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * n
    dout = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)

    def packed(x):
        return x.reshape(b * n, h, d)

    def fwd_func():
        return flashgen.flash_attn_func(q, k, v, causal=causal)

    def fwd_varlen():
        return flashgen.flash_attn_varlen_func(packed(q), packed(k), packed(v), cu, cu, n, n, causal=causal)

    leaves = {p: tuple(x.detach().requires_grad_() for x in (q, k, v)) for p in ("func", "varlen")}
    out_func = flashgen.flash_attn_func(*leaves["func"], causal=causal)
    lv = leaves["varlen"]
    out_varlen = flashgen.flash_attn_varlen_func(packed(lv[0]), packed(lv[1]), packed(lv[2]), cu, cu, n, n,
                                                 causal=causal)

    def bwd_func():
        return torch.autograd.grad(out_func, leaves["func"], dout, retain_graph=True)

    def bwd_varlen():
        return torch.autograd.grad(out_varlen, leaves["varlen"], packed(dout), retain_graph=True)

    launches = []  # the varlen path must run the varlen backward (not the composed one): checked once
    real = core.attention_backward
    core.attention_backward = lambda *a, **kw: launches.append(kw.get("varlen") is not None) or real(*a, **kw)
    try:
        grads = bwd_varlen()
    finally:
        core.attention_backward = real
    if launches != [True]:
        raise RuntimeError(f"hd{d} seqlen {n}: the varlen path's backward launches {launches}, not the varlen kernels")
    diffs = [(out_varlen.reshape(b, n, h, d).float() - out_func.float()).abs().max().item()]
    diffs += [(x.float() - y.float()).abs().max().item() for x, y in zip(grads, bwd_func())]
    fl = _flops(b, h, n, d, causal)
    fns = {"fwd func": (fwd_func, fl), "fwd varlen": (fwd_varlen, fl),
           "bwd func": (bwd_func, 2.5 * fl), "bwd varlen": (bwd_varlen, 2.5 * fl)}
    tf = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, f) in fns.items():
            with torch.no_grad() if name.startswith("fwd") else torch.enable_grad():
                tf[name].append(f / _time_ms(fn) / 1e9)
    return {"head_dim": d, "seqlen": n, "causal": causal, "diffs": diffs, "tf": tf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seqlens", default="512,2048,8192")
    ap.add_argument("--head-dims", default="64,128,256")
    args = ap.parse_args()
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                r = point(d, n, causal, args.rounds)
                rows.append(r)
                print(r, flush=True)
    print(f"\nvarlen kernels against flash_attn_func, equal lengths, bf16, 16k tokens, {torch.cuda.get_device_name()}, "
          f"TFLOP/s per round; ratio = best varlen round / best func round")
    print("| head_dim | seqlen | causal | max abs diff out; dq; dk; dv | fwd func | fwd varlen | fwd ratio | "
          "bwd func | bwd varlen | bwd ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"fwd": [], "bwd": []}
    for r in rows:
        tf = r["tf"]
        cells = []
        for way in ("fwd", "bwd"):
            ratio = max(tf[f"{way} varlen"]) / max(tf[f"{way} func"])
            ratios[way].append(ratio)
            cells += [" / ".join(f"{x:.0f}" for x in tf[f"{way} func"]),
                      " / ".join(f"{x:.0f}" for x in tf[f"{way} varlen"]), f"{ratio:.3f}"]
        print(f"| {r['head_dim']} | {r['seqlen']} | {'yes' if r['causal'] else 'no'} | "
              f"{'; '.join(f'{x:.1e}' for x in r['diffs'])} | {' | '.join(cells)} |")
    print("geometric means, varlen / func: " + ", ".join(
        f"{way} {math.exp(sum(map(math.log, v)) / len(v)):.3f}" for way, v in ratios.items()))


if __name__ == "__main__":
    main()
