"""Forward benchmark, FA3-paper protocol, against PyTorch SDPA (cuDNN and flash backends) in the same run.

Protocol (FA3 paper §4.1, DESIGN.md §6): 16k total tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / head_dim), seqlen 512..16384, head_dim 64/128/256, causal on and off.
FLOPs = 4 * batch * heads * seqlen^2 * head_dim, halved for causal. Times are medians of
CUDA-event-timed launches after warm-up; inputs are random normal.

Also: the paper's ablation (bf16, batch 4, seqlen 8448, 16 heads, head_dim 128, non-causal) over
every built variant of that key, and the Python overhead per call.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time


def _time_ms(fn, warmup: int = 3, iters: int = 10, reps: int = 3) -> float:
    """Median over `reps` of the mean time of `iters` back-to-back launches (CUDA events, ms).

    Launches are queued without host synchronization in between, as triton's do_bench does, so
    per-call host overhead is hidden whenever the kernel outlasts it (it is reported separately).
    """
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def _sdpa_fn(backend, q, k, v, causal):
    import torch
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def fn():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    try:
        fn()
        torch.cuda.synchronize()
    except Exception:  # backend unavailable for this shape/dtype
        return None
    return fn


def _flops(b, h, s, d, causal):
    f = 4 * b * h * s * s * d
    return f / 2 if causal else f


def run_grid(seqlens, head_dims, dtypes, causals, iters):
    import torch
    from torch.nn.attention import SDPBackend

    from .interface import flash_attn_func

    rows = []
    for dtype_name in dtypes:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        for d in head_dims:
            for causal in causals:
                for s in seqlens:
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
                    fl = _flops(b, h, s, d, causal)
                    res = {"dtype": dtype_name, "head_dim": d, "causal": causal, "seqlen": s, "batch": b, "heads": h}
                    try:
                        ms = _time_ms(lambda: flash_attn_func(q, k, v, causal=causal), iters=iters)
                        res["flashgen"] = fl / ms / 1e9
                    except Exception as e:  # a missing variant is reported, not fatal
                        print(f"flashgen failed at {res}: {e}", file=sys.stderr)
                        res["flashgen"] = float("nan")
                    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                        fn = _sdpa_fn(backend, q, k, v, causal)
                        res[name] = fl / _time_ms(fn, iters=iters) / 1e9 if fn else float("nan")
                    peers = [x for x in (res["cudnn"], res["fa2"]) if x == x]
                    res["ratio"] = res["flashgen"] / max(peers) if peers else float("nan")
                    rows.append(res)
                    del q, k, v
    return rows


def run_ablation(iters):
    import torch

    from . import core
    from .manifest import load_manifest

    b, s, h, d = 4, 8448, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)

    def arg(t):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                              "fp32" if t.dtype == torch.float32 else "bf16", t.device.index or 0)

    rows = []
    for var in load_manifest().variants:
        p = var.params
        if (p["dtype"], p["head_dim"], bool(p["causal"])) != ("bf16", 128, False):
            continue
        stream = torch.cuda.current_stream().cuda_stream
        ms = _time_ms(lambda: core.attention_forward(arg(q), arg(k), arg(v), arg(out), arg(lse), d ** -0.5, False,
                                                     stream, variant=var), iters=iters)
        knobs = {k2: p[k2] for k2 in ("block_m", "block_n", "stages", "consumer_wgs", "pingpong", "overlap", "persistent")}
        rows.append({"variant": var.name, **knobs, "tflops": _flops(b, h, s, d, False) / ms / 1e9})
    return rows


def measure_overhead(n: int = 2000):
    """Host microseconds per call: flash_attn_func (validation + allocation + launch) and core launch only."""
    import torch

    from . import core
    from .interface import flash_attn_func

    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    args = [core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, 0)
            for t, dt in ((q, "bf16"), (k, "bf16"), (v, "bf16"), (out, "bf16"), (lse, "fp32"))]
    res = {}
    for name, fn in (("flash_attn_func", lambda: flash_attn_func(q, k, v)),
                     ("core.attention_forward", lambda: core.attention_forward(*args, 0.088, False, stream))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[name] = (t1 - t0) / n * 1e6
    return res


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    keys = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        sel = [r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == key]
        xs = [str(r["seqlen"]) for r in sel]
        for name in ("flashgen", "cudnn", "fa2"):
            ax.plot(xs, [r[name] for r in sel], marker="o", label=name)
        ax.set_title(f"{key[0]} hd{key[1]} {'causal' if key[2] else 'non-causal'}", fontsize=8)
        ax.set_xlabel("seqlen", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    """Entry of `flashgen bench` / `make bench`. Prints the table last; writes CSV and PNG."""
    ap = argparse.ArgumentParser(prog="flashgen bench", description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--csv", default="bench.csv")
    ap.add_argument("--png", default="bench.png")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--no-overhead", action="store_true")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashgen bench: no CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    rows = run_grid([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.head_dims.split(",")],
                    a.dtypes.split(","), [x.strip().lower() == "true" for x in a.causal.split(",")], a.iters)
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, a.png)
    if not a.no_overhead:
        for name, us in measure_overhead().items():
            print(f"python overhead per call, {name}: {us:.1f} us")
    if not a.no_ablation:
        print(f"\nablation ({gpu}; bf16, batch 4, seqlen 8448, 16 heads, hdim 128, non-causal):")
        print(f"{'variant':<60} {'TFLOP/s':>8}")
        for r in run_ablation(a.iters):
            print(f"{r['variant']:<60} {r['tflops']:8.1f}")
    print(f"\nforward TFLOP/s on {gpu} (16k tokens, hidden 2048)")
    print(f"{'dtype':<5} {'hd':>3} {'causal':>6} {'seqlen':>6} {'flashgen':>9} {'cuDNN':>7} {'FA2':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['dtype']:<5} {r['head_dim']:>3} {str(r['causal']):>6} {r['seqlen']:>6} {r['flashgen']:9.1f} "
              f"{r['cudnn']:7.1f} {r['fa2']:7.1f} {r['ratio']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
