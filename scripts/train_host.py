"""Host time of an eager training step's attention (forward + backward) on a GPU machine, flashgen against SDPA.

A small problem (q, k, v (1, 128, 1, 128) bf16, causal), so the GPU work is a few microseconds and the time per
step is the host's: ``out = attn(q, k, v); torch.autograd.grad(out, (q, k, v), dout)``, timed as
``flashgen.bench.host_us`` does (best of 5 alternated runs of N back-to-back steps, the GPU synchronised only
around each run). Imports whichever flashgen is on the path, so the same script times two trees (device_check.sh
``trainhost``: the .base tree's package against this one's, on the same kernels).

    python3 scripts/train_host.py [--n 1000] [--label new]

Prints one markdown row: label, flashgen us / step, SDPA (default backend) us / step, and flashgen's path.
"""
import argparse

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    import flashgen
    from flashgen import bench

    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fg():
        out = flashgen.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    def sd():
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return torch.autograd.grad(out, (q, k, v), dout)

    # (correctness of the step is the GPU tests' job; this checks only that the two agree roughly)
    g1, g2 = fg(), sd()
    worst = max((x.float() - y.float()).abs().max().item() for x, y in zip(g1, g2))
    us = bench.host_us((("flashgen", fg), ("sdpa", sd)), a.n, 5)
    print(f"| {a.label} | {us['flashgen']:.1f} | {us['sdpa']:.1f} | max |dgrad| diff {worst:.2e} | "
          f"{flashgen.__file__} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
