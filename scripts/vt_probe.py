"""The e4m3 forward's V^T source on the FA3 protocol (16k tokens, hidden 2048, non-causal): the in-kernel
transpose against vt_global (V^T written by the variant's preprocess kernel and TMA-loaded), each with random V
and with V = 0 (the tensor cores' data-dependent power: a probe whose P V GEMM read stale V^T measured a faster
kernel), and the vt_global call split per kernel (torch.profiler: the preprocess ``_vt`` and ``_main``).
TFLOP/s = 4 b h s^2 d / time (triton do_bench median, L2 flushed between repetitions), variants forced through
flashgen.core as fp8_bench.py --variants.
Usage: python scripts/vt_probe.py [--seqlens 2048,16384] [--head-dims 128,256] [--rounds 2]"""
from __future__ import annotations

import argparse

import torch

from flashgen import core
from flashgen.bench import _flops, _time_ms
from flashgen.manifest import load_manifest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="2048,16384")
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    def arg(t, dtype):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, t.device.index)

    stream = torch.cuda.current_stream().cuda_stream
    variants = [v for v in load_manifest().variants if v.family == "fwd" and v.params["dtype"] == "e4m3"
                and not (v.params["causal"] or v.params["local"] or v.params["softcap"])]
    print(f"# {torch.cuda.get_device_name()}: e4m3 non-causal TFLOP/s, random V / V = 0, {a.rounds} round(s); "
          "vt_global split: us per call of the preprocess and of the main kernel (torch.profiler)")
    print("| head_dim | seqlen | variant | random V | V = 0 | vt us | main us | main-only TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in a.head_dims.split(",")):
        vs = sorted((v for v in variants if v.params["head_dim"] == d), key=lambda v: v.name)
        for s in (int(x) for x in a.seqlens.split(",")):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
            v0 = torch.zeros_like(v)
            ds = arg(torch.ones(b, h, device="cuda"), "fp32")
            out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(b, h, s, device="cuda")
            fl = _flops(b, h, s, d, False) / 1e9

            def call(var, vv):
                return lambda: core.attention_forward(arg(q, "fp8_e4m3"), arg(k, "fp8_e4m3"), arg(vv, "fp8_e4m3"),
                                                      arg(out, "bf16"), arg(lse, "fp32"), d ** -0.5, False, stream,
                                                      variant=var, q_descale=ds, k_descale=ds, v_descale=ds)
            cells = {(var.name, z): [] for var in vs for z in (0, 1)}
            for _ in range(a.rounds):
                for var in vs:
                    for z, vv in ((0, v), (1, v0)):
                        cells[(var.name, z)].append(fl / _time_ms(call(var, vv)))
            for var in vs:
                split = ("-", "-", "-")
                if var.params.get("vt_global"):
                    fn = call(var, v)
                    fn()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            fn()
                        torch.cuda.synchronize()
                    us = {"vt": 0.0, "main": 0.0}
                    for e in prof.key_averages():
                        for role in us:
                            if e.key.endswith("_" + role):
                                us[role] += e.device_time_total / 20
                    split = (f"{us['vt']:.1f}", f"{us['main']:.1f}", f"{fl / (us['main'] / 1e3):.0f}")
                row = lambda z: "/".join(f"{x:.0f}" for x in cells[(var.name, z)])  # noqa: E731
                print(f"| {d} | {s} | {var.name.rsplit('_', 1)[0]} | {row(0)} | {row(1)} | {' | '.join(split)} |",
                      flush=True)


if __name__ == "__main__":
    main()
