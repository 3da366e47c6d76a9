"""Forward benchmark, FA3-paper protocol, against PyTorch SDPA (cuDNN and flash backends) in the same run.

Protocol (FA3 paper §4.1, DESIGN.md §6): 16k total tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / head_dim), seqlen 512..16384, head_dim 64/128/256, causal on and off.
FLOPs = 4 * batch * heads * seqlen^2 * head_dim, halved for causal. Times are medians over
repetitions, each timed with CUDA events after the L2 cache was flushed (as triton's do_bench
does: triton.testing.do_bench when triton is installed, the same method here otherwise); SDPA is
called on BSHD tensors transposed to (batch, heads, seqlen, head_dim) views, as a user would.
Inputs are random normal.

Also: the paper's ablation (bf16, batch 4, seqlen 8448, 16 heads, head_dim 128, non-causal) over
every built variant of that key, and the host time per call on a small problem of flash_attn_func,
core.attention_forward and SDPA (:func:`measure_overhead`).

Backward (``--backward``; ``--backward-only`` for it alone): the same grid, FLOPs = 2.5 x the
forward's (FA3's convention: 5 matmuls to the forward's 2). Only the backward is timed, on a
forward computed once: flashgen's backward op (``torch.ops.flashgen.bwd``, else the DLPack entry
``flashgen.flash_attn_backward`` with preallocated dq/dk/dv, else autograd) with
deterministic=False and True; SDPA's cuDNN and flash backends as
``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``, q/k/v BSHD leaves seen as BHSD.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time


_FLUSH_BYTES = 256 << 20  # larger than the H100/H200 L2 (50 / 60 MB)


def _time_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds per call of ``fn`` with the L2 flushed before each repetition.

    triton.testing.do_bench (median) when triton is importable; otherwise the same method: a
    256 MB buffer is zeroed before every timed call and each call is bracketed by CUDA events."""
    import torch

    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        pass
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        fn()
    b.record()
    torch.cuda.synchronize()
    est = max(a.elapsed_time(b) / 5, 1e-3)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(1, int(rep_ms / est))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for i in range(n_rep):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _sdpa_fn(backend, q, k, v, causal):
    import torch
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # BSHD memory, BHSD view: as a user calls SDPA

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


def _grid(seqlens, head_dims, dtypes, causals):
    """The FA3-protocol points (16k tokens, hidden 2048): yields (q, k, v, forward FLOPs, row) per
    (dtype, head_dim, causal, seqlen), q/k/v random normal BSHD, row the point's identifying columns."""
    import torch

    for dtype_name in dtypes:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        for d in head_dims:
            for causal in causals:
                for s in seqlens:
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
                    yield q, k, v, _flops(b, h, s, d, causal), {
                        "dtype": dtype_name, "head_dim": d, "causal": causal, "seqlen": s, "batch": b, "heads": h}


def run_grid(seqlens, head_dims, dtypes, causals, attn=None, peers=True):
    """The FA3-protocol grid: TFLOP/s of ``attn`` (default flashgen's flash_attn_func; any
    function with its signature) and, with ``peers``, of SDPA's cuDNN and flash backends."""
    from torch.nn.attention import SDPBackend

    if attn is None:
        from .interface import flash_attn_func as attn

    rows = []
    for q, k, v, fl, res in _grid(seqlens, head_dims, dtypes, causals):
        causal = res["causal"]
        try:
            ms = _time_ms(lambda: attn(q, k, v, causal=causal))
            res["flashgen"] = fl / ms / 1e9
        except Exception as e:  # a missing variant is reported, not fatal
            print(f"flashgen failed at {res}: {e}", file=sys.stderr)
            res["flashgen"] = float("nan")
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            fn = _sdpa_fn(backend, q, k, v, causal) if peers else None
            res[name] = fl / _time_ms(fn) / 1e9 if fn else float("nan")
        best = [x for x in (res["cudnn"], res["fa2"]) if x == x]
        res["ratio"] = res["flashgen"] / max(best) if best else float("nan")
        rows.append(res)
        del q, k, v
    return rows


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------

#: Names the backward op's arguments may have, by what they carry (bound from its schema).
_BWD_ARG_NAMES = {
    "dout": ("dout", "grad_out", "do", "dO", "g", "grad"),
    "q": ("q",), "k": ("k",), "v": ("v",), "out": ("out", "o"), "lse": ("lse", "softmax_lse"),
    "softmax_scale": ("softmax_scale", "scale"), "causal": ("causal", "is_causal"),
    "deterministic": ("deterministic",), "dq": ("dq",), "dk": ("dk",), "dv": ("dv",),
}


def _bwd_op_call(values: dict):
    """``() -> result`` calling ``torch.ops.flashgen.bwd`` with ``values`` bound to its schema's
    arguments by name (see _BWD_ARG_NAMES; arguments with defaults may stay unbound), and the
    schema as text; (None, why) when the op is missing or an argument cannot be bound."""
    import torch

    try:
        op = torch.ops.flashgen.bwd
        schema = op.default._schema
    except (AttributeError, RuntimeError) as e:
        return None, f"no torch.ops.flashgen.bwd ({type(e).__name__})"
    kwargs = {}
    for arg in schema.arguments:
        canon = next((c for c, names in _BWD_ARG_NAMES.items() if arg.name in names), None)
        if canon is not None and values.get(canon) is not None:
            kwargs[arg.name] = values[canon]
        elif not arg.has_default_value():
            return None, f"cannot bind argument {arg.name!r} of {schema}"
    return (lambda: op(**kwargs)), str(schema)


def _flashgen_bwd_fn(q, k, v, causal: bool, deterministic: bool):
    """``(fn, path)``: fn runs flashgen's backward alone for (q, k, v) BSHD on a forward made once
    here (out, lse from flash_attn_func; dout random); path names what is called: the op
    ``torch.ops.flashgen.bwd`` bound by argument name, else ``flashgen.flash_attn_backward``
    into preallocated dq/dk/dv on torch's current stream, else autograd.grad with retain_graph."""
    import torch

    from . import interface

    with torch.no_grad():
        out, lse = interface.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    scale = q.shape[-1] ** -0.5
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    values = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, softmax_scale=scale, causal=causal,
                  deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    fn, why = _bwd_op_call(values)
    if fn is not None:
        return fn, "torch.ops.flashgen.bwd"
    import flashgen

    api = getattr(flashgen, "flash_attn_backward", None)
    if api is not None:
        stream = torch.cuda.current_stream()
        return (lambda: api(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, deterministic=deterministic,
                            stream=stream, dq=dq, dk=dk, dv=dv)), f"flashgen.flash_attn_backward ({why})"
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    out = interface.flash_attn_func(*leaves, causal=causal, deterministic=deterministic)
    return (lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), f"autograd.grad ({why})"


def _sdpa_bwd_fn(backend, q, k, v, causal):
    """``fn`` timing SDPA's backward alone with ``backend``: the forward on BHSD views of BSHD
    leaves is made once, fn is ``torch.autograd.grad(out, leaves, dout, retain_graph=True)``;
    None where the backend refuses the shape/dtype."""
    import torch
    from torch.nn.attention import sdpa_kernel

    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2) for x in leaves)
    try:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        dout = torch.randn_like(out)

        def fn():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        fn()
        torch.cuda.synchronize()
    except Exception:  # backend unavailable for this shape/dtype
        return None
    return fn


def run_grid_bwd(seqlens, head_dims, dtypes, causals, peers=True):
    """The FA3-protocol grid for the backward: TFLOP/s (2.5 x the forward's FLOPs per backward)
    of flashgen's backward with deterministic False ("flashgen") and True ("flashgen_det") and,
    with ``peers``, of SDPA's cuDNN and flash backends; ratio = flashgen / the best SDPA,
    det_ratio = flashgen_det / flashgen. Returns (rows, the path flashgen was called through)."""
    from torch.nn.attention import SDPBackend

    rows, paths = [], set()
    for q, k, v, fl, res in _grid(seqlens, head_dims, dtypes, causals):
        causal, fl = res["causal"], 2.5 * fl
        for col, det in (("flashgen", False), ("flashgen_det", True)):
            try:
                fn, path = _flashgen_bwd_fn(q, k, v, causal, det)
                paths.add(path)
                res[col] = fl / _time_ms(fn) / 1e9
            except Exception as e:  # a missing variant is reported, not fatal
                print(f"flashgen backward (deterministic={det}) failed at {res}: {e}", file=sys.stderr)
                res[col] = float("nan")
            fn = None
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            fn = _sdpa_bwd_fn(backend, q, k, v, causal) if peers else None
            res[name] = fl / _time_ms(fn) / 1e9 if fn else float("nan")
            fn = None
        best = [x for x in (res["cudnn"], res["fa2"]) if x == x]
        res["ratio"] = res["flashgen"] / max(best) if best else float("nan")
        res["det_ratio"] = res["flashgen_det"] / res["flashgen"]
        rows.append(res)
        del q, k, v
    return rows, "; ".join(sorted(paths)) or "none (every call failed)"


def _print_bwd(rows, gpu, path):
    print(f"\nbackward TFLOP/s on {gpu} (16k tokens, hidden 2048; FLOPs = 2.5 x forward; backward alone, "
          f"forward precomputed; flashgen through {path})")
    print(f"{'dtype':<5} {'hd':>3} {'causal':>6} {'seqlen':>6} {'flashgen':>9} {'det':>7} {'cuDNN':>7} {'FA2':>7} "
          f"{'ratio':>6} {'det/def':>7}")
    for r in rows:
        print(f"{r['dtype']:<5} {r['head_dim']:>3} {str(r['causal']):>6} {r['seqlen']:>6} {r['flashgen']:9.1f} "
              f"{r['flashgen_det']:7.1f} {r['cudnn']:7.1f} {r['fa2']:7.1f} {r['ratio']:6.2f} {r['det_ratio']:7.2f}")


def _with_suffix(path: str, suffix: str) -> str:
    """'bench.csv', '_bwd' -> 'bench_bwd.csv' (the backward's files sit next to the forward's)."""
    import os

    root, ext = os.path.splitext(path)
    return f"{root}{suffix}{ext}"


def _write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


def tensor_arg(t):
    """flashgen.core.TensorArg of a CUDA torch tensor (fp32, bf16, fp16 or float8_e4m3fn)."""
    import torch

    from . import core

    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.float8_e4m3fn: "fp8_e4m3"}[t.dtype]
    return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, t.device.index or 0)


def run_ablation():
    import torch

    from . import core
    from .manifest import load_manifest

    b, s, h, d = 4, 8448, 16, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    arg = tensor_arg

    rows = []
    for var in load_manifest().variants:
        p = var.params
        if var.dispatch != {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": False}:
            continue
        stream = torch.cuda.current_stream().cuda_stream
        ms = _time_ms(lambda: core.attention_forward(arg(q), arg(k), arg(v), arg(out), arg(lse), d ** -0.5, False,
                                                     stream, variant=var))
        knobs = {k2: p[k2] for k2 in ("block_m", "block_n", "stages", "consumer_wgs", "pingpong", "overlap", "persistent")}
        rows.append({"variant": var.name, **knobs, "tflops": _flops(b, h, s, d, False) / ms / 1e9})
    return rows


def run_combine(shapes=((64, 1, 32, 128, 16), (8, 1024, 16, 128, 4), (8, 1024, 32, 128, 8), (2, 4096, 16, 256, 64))):
    """flash_attn_combine bandwidth (GB/s counting each input read and each output written once)
    against the same merge in PyTorch ops, for (batch, seqlen, heads, head_dim, num_splits)."""
    import torch

    from .interface import flash_attn_combine

    def torch_combine(op, lp):
        lse = torch.logsumexp(lp, dim=0)
        w = torch.exp(lp - lse).nan_to_num(0.0)
        return (w.unsqueeze(-1) * op).sum(0).to(torch.bfloat16), lse

    rows = []
    for b, sq, h, d, ns in shapes:
        op = torch.randn(ns, b, sq, h, d, device="cuda")
        lp = torch.randn(ns, b, h, sq, device="cuda").transpose(-1, -2)
        nbytes = op.numel() * 4 + lp.numel() * 4 + b * sq * h * (d * 2 + 4)
        res = {"batch": b, "seqlen": sq, "heads": h, "head_dim": d, "splits": ns}
        for name, fn in (("flashgen", lambda: flash_attn_combine(op, lp, out_dtype=torch.bfloat16)),
                         ("torch", lambda: torch_combine(op, lp))):
            res[name] = nbytes / _time_ms(fn) / 1e6
        rows.append(res)
        del op, lp
    return rows


def measure_overhead(n: int = 2000, repeats: int = 5):
    """Host microseconds per call on a small problem (q, k, v (1, 128, 1, 128) bf16, BSHD), each
    the best of ``repeats`` runs of ``n`` back-to-back calls timed with time.perf_counter after a
    warmup (the GPU is synchronised before and after each run, not between calls). The entries'
    runs alternate (every entry's first run, then every entry's second, ...), so a slow stretch of
    the host (the same entry read 18 and 26 us in one call on an H100 host) is not all one entry's:

    * ``flash_attn_func``: flashgen's torch API as a user calls it (validation, allocation of out,
      launch; no lse is allocated or written when it is not asked for);
    * ``flash_attn_func return_attn_probs``: the same, returning (out, lse);
    * ``core.attention_forward``: the framework-neutral launch alone, on preallocated out and lse;
    * ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` as a BSHD user calls it, on
      ``.transpose(1, 2)`` views made in the call (default backend choice);
    * ``sdpa (BHSD views made once)``: the same SDPA call on views made before timing;
    * ``flash_attn_func causal`` and ``sdpa causal``: the first and third with causal=True.
    """
    import torch

    from . import core
    from .interface import flash_attn_func

    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda", dtype=torch.float32)
    stream = torch.cuda.current_stream().cuda_stream
    args = [core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, 0)
            for t, dt in ((q, "bf16"), (k, "bf16"), (v, "bf16"), (out, "bf16"), (lse, "fp32"))]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    entries = (("flash_attn_func", lambda: flash_attn_func(q, k, v)),
               ("flash_attn_func return_attn_probs", lambda: flash_attn_func(q, k, v, return_attn_probs=True)),
               ("core.attention_forward", lambda: core.attention_forward(*args, 0.088, False, stream)),
               ("sdpa", lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))),
               ("sdpa (BHSD views made once)", lambda: sdpa(qt, kt, vt)),
               # causal (one tile here, so no tile counter: that is taken only with more tiles than SMs)
               ("flash_attn_func causal", lambda: flash_attn_func(q, k, v, causal=True)),
               ("sdpa causal", lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)))
    return host_us(entries, n, repeats)


def host_us(entries, n: int = 2000, repeats: int = 5) -> dict:
    """``{name: host microseconds per call}`` of ``entries`` ((name, fn) pairs, fn taking no
    arguments): each the best of ``repeats`` runs of ``n`` back-to-back calls (time.perf_counter,
    the GPU synchronised before and after each run, not between calls) after 50 warmup calls; the
    entries' runs alternate, every entry's first run, then every entry's second, and so on."""
    import torch

    for _, fn in entries:
        for _ in range(50):
            fn()
    best = {name: float("inf") for name, _ in entries}
    for _ in range(repeats):
        for name, fn in entries:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best[name] = min(best[name], (t1 - t0) / n)
    return {name: t * 1e6 for name, t in best.items()}


def _plot(rows, path, names=("flashgen", "cudnn", "fa2")):
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
        for name in names:
            ax.plot(xs, [r[name] for r in sel], marker="o", label=name)
        ax.set_title(f"{key[0]} hd{key[1]} {'causal' if key[2] else 'non-causal'}", fontsize=8)
        ax.set_xlabel("seqlen", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    """Entry of `flashgen bench` / `make bench`. Prints the table(s) last; writes CSV and PNG."""
    ap = argparse.ArgumentParser(prog="flashgen bench", description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--csv", default="bench.csv")
    ap.add_argument("--png", default="bench.png")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--no-overhead", action="store_true")
    ap.add_argument("--no-combine", action="store_true", help="skip the flash_attn_combine bandwidth table")
    ap.add_argument("--backward", action="store_true",
                    help="also time the backward alone (flashgen default and deterministic, SDPA cuDNN and flash) "
                         "on the same grid; its table is printed last, CSV/PNG next to --csv/--png with _bwd added")
    ap.add_argument("--backward-only", action="store_true",
                    help="only the backward grid: --backward without the forward grid, ablation, overhead and "
                         "combine tables (quick: --backward-only --seqlens 4096 --head-dims 128 --dtypes bf16)")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("flashgen bench: no CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    grid = ([int(x) for x in a.seqlens.split(",")], [int(x) for x in a.head_dims.split(",")],
            a.dtypes.split(","), [x.strip().lower() == "true" for x in a.causal.split(",")])
    rows = None
    if not a.backward_only:
        rows = run_grid(*grid)
        _write_csv(rows, a.csv)
        _plot(rows, a.png)
        if not a.no_overhead:
            print(f"\nhost time per call on {gpu}, q/k/v (1, 128, 1, 128) bf16 (best of 5 x 2000 calls):")
            for name, us in measure_overhead().items():
                print(f"python overhead per call, {name}: {us:.1f} us")
        if not a.no_ablation:
            print(f"\nablation ({gpu}; bf16, batch 4, seqlen 8448, 16 heads, hdim 128, non-causal):")
            print(f"{'variant':<60} {'TFLOP/s':>8}")
            for r in run_ablation():
                print(f"{r['variant']:<60} {r['tflops']:8.1f}")
        if not a.no_combine:
            print(f"\nflash_attn_combine GB/s on {gpu} (bf16 out; inputs read once, outputs written once)")
            print(f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'hd':>3} {'splits':>6} {'flashgen':>9} {'torch':>7}")
            for r in run_combine():
                print(f"{r['batch']:>5} {r['seqlen']:>6} {r['heads']:>5} {r['head_dim']:>3} {r['splits']:>6} "
                      f"{r['flashgen']:9.0f} {r['torch']:7.0f}")
    bwd_rows = None
    if a.backward or a.backward_only:
        bwd_rows, path = run_grid_bwd(*grid)
        _write_csv(bwd_rows, _with_suffix(a.csv, "_bwd"))
        _plot(bwd_rows, _with_suffix(a.png, "_bwd"), names=("flashgen", "flashgen_det", "cudnn", "fa2"))
    if rows is not None:
        print(f"\nforward TFLOP/s on {gpu} (16k tokens, hidden 2048)")
        print(f"{'dtype':<5} {'hd':>3} {'causal':>6} {'seqlen':>6} {'flashgen':>9} {'cuDNN':>7} {'FA2':>7} {'ratio':>6}")
        for r in rows:
            print(f"{r['dtype']:<5} {r['head_dim']:>3} {str(r['causal']):>6} {r['seqlen']:>6} {r['flashgen']:9.1f} "
                  f"{r['cudnn']:7.1f} {r['fa2']:7.1f} {r['ratio']:6.2f}")
    if bwd_rows is not None:
        _print_bwd(bwd_rows, gpu, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
