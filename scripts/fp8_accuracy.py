"""FP8 attention accuracy with and without FA3's block quantization and incoherent processing: the
FA3 paper's Table 3 (arXiv 2407.08608, §4.3) on flashgen.

Inputs as in the paper: q, k, v ~ N(0, 1) + N(0, 100) * Bernoulli(0.001) (x = randn + 10 * randn *
bernoulli(0.001)), rounded to bf16. The error of each pipeline is the RMSE of its output O against
``softmax(q kᵀ * scale) v`` computed in float64 on the upcast bf16 inputs. Rows:

* bf16: ``flash_attn_func(q, k, v)`` on the bf16 inputs (flashgen's bf16 forward);
* FP8 with per-tensor scales (``quantize_fp8(..., incoherent=False, block_quant=False)``: one scale
  per (batch, key head), FA3's descale shape), block quantization only, incoherent processing only,
  and both (the defaults).

Two columns per FP8 row:

* ``fp8 kernel``: ``flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)`` (e4m3
  inputs, bf16 output), where an fp8 forward is built; "n/a" otherwise (the reason is printed);
* ``emulated``: the same quantized inputs, dequantized (``x8.float() * descale``; q', k' stay
  transformed, which is valid because q' k'ᵀ = q kᵀ) and attended in float32 by torch: the
  quantization error of each method alone, without the fp8 kernel's own rounding (P in fp8).

Usage: python scripts/fp8_accuracy.py [--batch 2] [--seqlen 4096] [--heads 16] [--head-dims 128,256]
       [--seed 0] [--quantizer kernel|reference] [--device cuda]
``--quantizer reference`` uses the torch reference of the quantization (tests/gpu/_ref.py) instead
of the kernel, so the emulated column can be computed without a GPU (slow on a CPU: use a small
--seqlen). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from _ref import dequantize_fp8, quantize_ref  # noqa: E402

#: (label, incoherent, block_quant); the last is flashgen's default and FA3's method.
METHODS = (
    ("per-tensor", False, False),
    ("block quantization only", False, True),
    ("incoherent processing only", True, False),
    ("block quantization + incoherent", True, True),
)
#: FA3 Table 3 (FP8 rows), for the printed table.
PAPER = {"per-tensor": 2.4e-2, "block quantization only": 2.4e-2, "incoherent processing only": 9.3e-3,
         "block quantization + incoherent": 9.1e-3, "bf16": 1.9e-4}


def outlier_inputs(batch: int, seqlen: int, heads: int, head_dim: int, seed: int = 0, device="cuda"):
    """q, k, v (batch, seqlen, heads, head_dim) bf16: x = randn + 10 * randn * bernoulli(0.001)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def one():
        shape = (batch, seqlen, heads, head_dim)
        x = torch.randn(shape, generator=g, device=device)
        spikes = torch.randn(shape, generator=g, device=device) * (torch.rand(shape, generator=g, device=device) < 1e-3)
        return (x + 10.0 * spikes).to(torch.bfloat16)

    return one(), one(), one()


def attention(q, k, v, dtype, scale: float):
    """softmax(q kᵀ * scale) v in ``dtype`` (float64 or float32, fp32 matmuls without TF32), one
    (batch, head) at a time; q ``(batch, seqlen_q, heads, d)``, k / v with heads or heads_k heads."""
    b, _, h, _ = q.shape
    g = h // k.shape[2]
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for bi in range(b):
            for hi in range(h):
                qh, kh, vh = q[bi, :, hi].to(dtype), k[bi, :, hi // g].to(dtype), v[bi, :, hi // g].to(dtype)
                out[bi, :, hi] = torch.softmax((qh @ kh.T) * scale, dim=-1) @ vh
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def rmse(out, ref) -> float:
    return (out.double() - ref).pow(2).mean().sqrt().item()


class Unavailable(Exception):
    """The fp8 (or bf16) forward cannot run here; the message says why."""


def _flash(*args, **kwargs):
    from flashgen.dispatch import MissingVariantError
    from flashgen.interface import flash_attn_func

    try:
        return flash_attn_func(*args, **kwargs)
    except (NotImplementedError, MissingVariantError) as e:
        raise Unavailable(str(e).splitlines()[0]) from e


def quantize(q, k, v, incoherent: bool, block_quant: bool, seed: int, quantizer: str):
    """(q8, k8, v8, q_descale, k_descale, v_descale) from the kernel or the torch reference."""
    if quantizer == "kernel":
        from flashgen.interface import quantize_fp8

        return quantize_fp8(q, k, v, incoherent=incoherent, block_quant=block_quant, seed=seed)
    from flashgen.interface import incoherent_signs

    return quantize_ref(q, k, v, incoherent, block_quant, incoherent_signs(q.shape[-1], seed))[0]


def measure(batch=2, seqlen=4096, heads=16, head_dim=128, seed=0, device="cuda", quantizer="kernel",
            run_kernels=True) -> dict:
    """RMSE of every row and column for one shape: ``{"bf16": rmse or None, "methods": {label:
    {"emulated": rmse, "kernel": rmse or None}}, "unavailable": {what: reason}}``."""
    q, k, v = outlier_inputs(batch, seqlen, heads, head_dim, seed, device)
    scale = head_dim ** -0.5
    ref = attention(q, k, v, torch.float64, scale)
    res = {"bf16": None, "methods": {}, "unavailable": {}}
    if run_kernels:
        try:
            res["bf16"] = rmse(_flash(q, k, v), ref)
        except Unavailable as e:
            res["unavailable"]["bf16"] = str(e)
    for label, incoherent, block_quant in METHODS:
        q8, k8, v8, qd, kd, vd = quantize(q, k, v, incoherent, block_quant, seed, quantizer)
        row = {"emulated": rmse(attention(dequantize_fp8(q8, qd), dequantize_fp8(k8, kd), dequantize_fp8(v8, vd),
                                          torch.float32, scale), ref), "kernel": None}
        if run_kernels and "fp8" not in res["unavailable"]:
            try:
                row["kernel"] = rmse(_flash(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd), ref)
            except Unavailable as e:
                res["unavailable"]["fp8"] = str(e)
        res["methods"][label] = row
    return res


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def table(results: dict) -> str:
    """Markdown: one row per pipeline, one column group per shape (``results``: {shape label: measure()})."""
    head = "| method | FA3 paper |" + "".join(f" {s}: fp8 kernel | {s}: emulated |" for s in results)
    lines = [head, "|" + "---|" * (2 + 2 * len(results))]
    lines.append("| bf16 flash_attn_func | 1.9e-04 |" + "".join(f" {_fmt(r['bf16'])} | - |" for r in results.values()))
    for label, _, _ in METHODS:
        cells = "".join(f" {_fmt(r['methods'][label]['kernel'])} | {_fmt(r['methods'][label]['emulated'])} |"
                        for r in results.values())
        lines.append(f"| fp8, {label} | {PAPER[label]:.1e} |{cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantizer", choices=("kernel", "reference"), default="kernel")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    run_kernels = a.device.startswith("cuda")
    results, why = {}, {}
    for d in (int(x) for x in a.head_dims.split(",")):
        label = f"b{a.batch} s{a.seqlen} h{a.heads} d{d}"
        results[label] = measure(a.batch, a.seqlen, a.heads, d, a.seed, a.device, a.quantizer, run_kernels)
        why.update(results[label]["unavailable"])
    print(table(results))
    for what, reason in why.items():
        print(f"\n{what} kernel column n/a: {reason}")
    if not run_kernels:
        print("\n(kernel columns n/a: not on a CUDA device)")
    for label, r in results.items():
        m = {k: v["emulated"] for k, v in r["methods"].items()}
        base = m["per-tensor"]
        print(f"\n{label}, emulated: per-tensor / method = "
              + ", ".join(f"{k} {base / v:.2f}x" for k, v in m.items() if k != "per-tensor"))
    sys.stdout.flush()
    if math.isnan(sum(v["emulated"] for r in results.values() for v in r["methods"].values())):
        raise SystemExit("NaN in the emulated errors")


if __name__ == "__main__":
    main()
