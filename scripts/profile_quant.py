"""One quantize_fp8 call (or torch's e4m3 cast of the same tensors) inside an NVTX range "prof", for
Nsight Compute (`ncu --nvtx --nvtx-include "prof/"`). Warm-up calls run first, outside the range.
Usage: python scripts/profile_quant.py [--shape b,s,h,hk,d] [--plain] [--per-head] [--torch-cast]"""
from __future__ import annotations

import argparse

import torch

from flashgen.interface import quantize_fp8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,16384,16,16,128")
    ap.add_argument("--plain", action="store_true", help="no incoherent processing")
    ap.add_argument("--per-head", action="store_true", help="no block quantization")
    ap.add_argument("--torch-cast", action="store_true", help="x.to(float8_e4m3fn) of q, k, v instead")
    a = ap.parse_args()
    b, s, h, hk, d = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if a.torch_cast:
        def fn():
            return [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    else:
        def fn():
            return quantize_fp8(q, k, v, incoherent=not a.plain, block_quant=not a.per_head)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
