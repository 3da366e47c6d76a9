"""FP8 (e4m3) forward throughput on the FA3 protocol (16k tokens, hidden 2048), beside flashgen's
bf16 forward in the same process: kernel-only e4m3 (inputs already quantized, FA3 descales of
shape (batch, heads_k)), and end to end from bf16 (``flashgen.quantize_fp8`` + attention) when
quantize_fp8 exists; and cuDNN's FP8 forward (scripts/cudnn_fp8_peer.py) in the same run when the cuDNN
frontend is installed (no column with --softcap or --no-cudnn). Timed like `flashgen bench` (triton do_bench median, L2 flushed between
repetitions). TFLOP/s = 4 b h s^2 d (halved for causal) / time.
--variants: instead, every built e4m3 variant of each (head_dim, causal) key (default tiles and
configs/fwd_fp8_tune.yaml's candidates), launched through flashgen.core with the variant forced.
--softcap C: both the e4m3 and the bf16 calls with softcap C (FA3's tests use 15).
--match GLOB[,GLOB...]: with --variants, only the variants whose names match one of them (e.g. '*noncausal_m*').
--dtype bf16|fp16: with --variants, that dtype's variants instead of e4m3 (random normal inputs, no descales).
--rounds N: with --variants, every variant timed N times in turn (rounds alternate over the variants).
  With --dtype bf16/fp16, SDPA's cuDNN and FA2 backends are timed in each round too (rows `sdpa-cudnn`,
  `sdpa-fa2`; BSHD tensors as a user calls SDPA), so the variants' ratios to them come from one run.
Usage: python scripts/fp8_bench.py [--seqlens 512,...,16384] [--head-dims 64,128,256] [--causal both] [--variants]
       [--softcap C]"""
from __future__ import annotations

import argparse
import fnmatch

import torch

import flashgen
from flashgen.bench import _flops, _sdpa_fn, _time_ms

import cudnn_fp8_peer  # scripts/: cuDNN's FP8 forward, when nvidia-cudnn-frontend is installed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--match", default="*", help="--variants: only variant names matching this glob")
    ap.add_argument("--dtype", default="e4m3", choices=("e4m3", "bf16", "fp16"), help="--variants: the variants' dtype")
    ap.add_argument("--rounds", type=int, default=1, help="--variants: timing rounds, alternated over the variants")
    ap.add_argument("--no-cudnn", action="store_true", help="no cuDNN e4m3 column (old/new comparisons)")
    a = ap.parse_args()
    if a.variants:
        return tiles(a)
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[a.causal]
    try:
        quant = flashgen.quantize_fp8
    except AttributeError:
        quant = None
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}" + (f"  softcap {a.softcap}" if a.softcap else ""))
    cap = a.softcap
    peer = None if cap or a.no_cudnn else cudnn_fp8_peer  # cuDNN's FP8 graph has no softcap
    if peer is not None and peer.available():
        print(f"# no cuDNN e4m3 column: {peer.available()}")
        peer = None
    if peer is not None:
        import cudnn
        print(f"# cuDNN e4m3: cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version()} (O in e4m3; "
              "|O - flashgen O| max printed per point)")
    print("| head_dim | causal | seqlen | e4m3 kernel | e4m3 from bf16 (quantize + attn) | bf16 | e4m3 / bf16 "
          "| cuDNN e4m3 | e4m3 / cuDNN e4m3 | cuDNN O max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in a.head_dims.split(",")):
        for causal in causals:
            for s in (int(x) for x in a.seqlens.split(",")):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
                ds = [torch.ones(b, h, device="cuda") for _ in range(3)]
                fl = _flops(b, h, s, d, causal) / 1e12
                t8 = _time_ms(lambda: flashgen.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0],
                                                               k_descale=ds[1], v_descale=ds[2], softcap=cap))
                t16 = _time_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal, softcap=cap))
                e2e = "-"
                if quant is not None:
                    def full():
                        q_, k_, v_, qd, kd, vd = quant(q, k, v)
                        return flashgen.flash_attn_func(q_, k_, v_, causal=causal, q_descale=qd, k_descale=kd,
                                                        v_descale=vd, softcap=cap)
                    e2e = f"{fl / _time_ms(full) * 1e3:.0f}"
                cu = ratio = diff = "-"
                if peer is not None:
                    fn, why = peer.cudnn_fp8_fn(q8, k8, v8, causal)
                    if fn is None:
                        print(f"# {d} {causal} {s}: {why}")
                    else:
                        ref = flashgen.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds[0], k_descale=ds[1],
                                                       v_descale=ds[2])
                        diff = f"{peer.check(fn, ref):.3f}"
                        tc = _time_ms(fn)
                        cu, ratio = f"{fl / tc * 1e3:.0f}", f"{tc / t8:.2f}"
                        del fn
                print(f"| {d} | {causal} | {s} | {fl / t8 * 1e3:.0f} | {e2e} | {fl / t16 * 1e3:.0f} | "
                      f"{t16 / t8:.2f} | {cu} | {ratio} | {diff} |", flush=True)


def tiles(a) -> None:
    from flashgen import core, tuning
    from flashgen.manifest import load_manifest
    from flashgen.tune import tile_label
    from torch.nn.attention import SDPBackend

    def arg(t, dtype):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, t.device.index)

    fp8 = a.dtype == "e4m3"
    elem = {"e4m3": "fp8_e4m3", "bf16": "bf16", "fp16": "fp16"}[a.dtype]
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.dtype, torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    variants = [v for v in load_manifest().variants if v.family == "fwd" and v.params["dtype"] == a.dtype
                and any(fnmatch.fnmatch(v.name, m) for m in a.match.split(",")) and not (v.params["local"] or v.params["softcap"] or
                v.params["pack_gqa"] or v.params["head_dim_v"] != v.params["head_dim"])]  # FA3-protocol calls
    seqlens = [int(x) for x in a.seqlens.split(",")]
    print(f"# {torch.cuda.get_device_name()}: {a.dtype} TFLOP/s per variant (flashgen tune's labels; * = default), "
          f"{a.rounds} round(s) alternated over the variants")
    print("| head_dim | causal | tile | variant | " + " | ".join(a.seqlens.split(",")) + " |")
    print("|---|---|---|---|" + "---|" * len(seqlens))
    for d in (int(x) for x in a.head_dims.split(",")):
        for causal in {"both": (False, True), "no": (False,), "yes": (True,)}[a.causal]:
            vs = sorted((v for v in variants if v.params["head_dim"] == d and v.params["causal"] == causal),
                        key=lambda v: v.name)
            cells = {v.name: [[] for _ in seqlens] for v in vs}
            peers = () if fp8 else ("sdpa-cudnn", "sdpa-fa2")
            cells.update({p: [[] for _ in seqlens] for p in peers})
            for _ in range(a.rounds):
                for si, s in enumerate(seqlens):
                    b, h = 16384 // s, 2048 // d
                    q, k, v_ = (torch.randn(b, s, h, d, device="cuda", dtype=tdt) for _ in range(3))
                    if fp8:
                        q, k, v_ = (x.to(torch.float8_e4m3fn) for x in (q, k, v_))
                    ds = arg(torch.ones(b, h, device="cuda"), "fp32") if fp8 else None
                    out = torch.empty(b, s, h, d, device="cuda", dtype=tdt)
                    lse = torch.empty(b, h, s, device="cuda")
                    for var in vs:
                        fn = lambda: core.attention_forward(arg(q, elem), arg(k, elem), arg(v_, elem), arg(out, a.dtype if not fp8 else "bf16"),
                                                            None if fp8 else arg(lse, "fp32"), d ** -0.5, causal, stream, variant=var,
                                                            q_descale=ds, k_descale=ds, v_descale=ds)
                        cells[var.name][si].append(_flops(b, h, s, d, causal) / 1e9 / _time_ms(fn))
                    if peers:
                        for p, backend in zip(peers, (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)):
                            fn = _sdpa_fn(backend, q, k, v_, causal)
                            cells[p][si].append(_flops(b, h, s, d, causal) / 1e9 / _time_ms(fn) if fn else float("nan"))
            def row(name):  # one cell per seqlen: the rounds' figures
                return " | ".join("/".join(f"{x:.0f}" for x in c) for c in cells[name])
            for var in vs:
                tile = tile_label(tuning.tile_of(var.params, var.dispatch)) + (" *" if var.default else "")
                print(f"| {d} | {causal} | {tile} | {var.name.rsplit('_', 1)[0]} | {row(var.name)} |", flush=True)
            for p in peers:
                print(f"| {d} | {causal} | {p} | {p} | {row(p)} |", flush=True)


if __name__ == "__main__":
    main()
