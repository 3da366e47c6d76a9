"""Framework-neutral forward launch: device pointers + shapes + strides in, kernel launched.

The torch API (interface.py) and the DLPack entry (dlpack_api.py) both end here. Method:
FlashAttention-3 forward (arXiv 2407.08608, §3, Algorithms 1 and 2).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from . import launch
from .dispatch import MissingVariantError, select_variant
from .launch import device_capability
from ._validate import ELEMENT_SIZE, tma_layout_problem
from .manifest import Variant

__all__ = ["TensorArg", "MissingVariantError", "select_variant", "attention_forward", "device_capability"]

LOG2E = 1.4426950408889634


class TensorArg(NamedTuple):
    """Framework-neutral view of a device array: address (bytes), shape, strides (elements), dtype, device."""

    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: int


def _check_tma(name: str, t: TensorArg) -> None:
    problem = tma_layout_problem(t.shape, t.strides, ELEMENT_SIZE[t.dtype], t.ptr)
    if problem is not None:
        raise ValueError(f"flashgen: TMA cannot address {name}: {problem}")


class _Plan(NamedTuple):
    variant: Variant
    kernel: launch.LoadedKernel
    block_m: int
    block_n: int
    sms: int  # persistent variants launch min(tiles, #SMs) CTAs; 0 = one CTA per tile


_plans: dict = {}  # call key -> _Plan; values are immutable, so concurrent calls may share them


def _plan(dtype: str, d: int, dv: int, causal: bool, device: int, variant: Variant | None) -> _Plan:
    """Variant, loaded kernel and launch constants for a call key, resolved once per process.

    A hit never touches the manifest; a miss reloads it (so a variant added with
    `flashgen add-variant` is picked up by the next call that needs it)."""
    key = (variant.name if variant is not None else None, dtype, d, dv, causal, device)
    plan = _plans.get(key)
    if plan is None:
        var = variant if variant is not None else select_variant(
            "fwd", {"dtype": dtype, "head_dim": d, "head_dim_v": dv, "causal": causal})
        p = var.params
        sms = launch.num_sms(device) if p.get("persistent", True) else 0
        plan = _Plan(var, launch.get_kernel(var, "main", device), p["block_m"], p["block_n"], sms)
        _plans[key] = plan
    return plan


def _bshd_map(t: TensorArg, box_rows: int):
    """128B-swizzled 4-D TMA map over a BSHD tensor, tiles of (box_rows x 64) elements:
    dims innermost first (head_dim, seqlen, heads, batch)."""
    b, s, h, d = t.shape
    es = ELEMENT_SIZE[t.dtype]
    return launch.tensor_map(t.ptr, t.dtype, (d, s, h, b), (t.strides[1] * es, t.strides[2] * es, t.strides[0] * es),
                             (64, box_rows, 1, 1), 128, device=t.device)


def attention_forward(q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, lse: TensorArg,
                      softmax_scale: float, causal: bool, stream: int, variant: Variant | None = None) -> Variant:
    """Launch the FA3 forward: out = softmax(scale * q k^T [+ causal mask]) v, lse = logsumexp rows.

    q (batch, seqlen_q, heads, head_dim), k/v (batch, seqlen_k, heads_k, head_dim[_v]),
    out (batch, seqlen_q, heads, head_dim_v) of q's dtype, lse fp32 (batch, heads, seqlen_q) contiguous.
    Causal is bottom-right aligned. Launches on `stream` (CUstream as int); returns the variant used.
    Raises MissingVariantError when no built variant serves the call, ValueError for layouts TMA
    cannot address. User-facing argument checks live in interface.py / dlpack_api.py.
    """
    b, sq, h, d = q.shape
    _, sk, hk, dv = v.shape
    if h % hk:
        raise ValueError(f"flashgen: heads ({h}) must be a multiple of heads_k ({hk})")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_tma(name, t)
    plan = _plan(q.dtype, d, dv, bool(causal), q.device, variant)
    bm, bn = plan.block_m, plan.block_n
    num_m = -(-sq // bm)
    num_tiles = num_m * h * b
    scale = float(softmax_scale)
    if scale == 0.0 or not math.isfinite(scale):
        if not math.isfinite(scale):
            raise ValueError(f"flashgen: softmax_scale must be finite, got {softmax_scale}")
        scale = 1e-30  # exp2(0 * -inf) would be NaN for masked keys; a tiny scale gives the same uniform weights
    params = {"lse": lse.ptr, "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_k": hk, "batch": b,
              "num_m_blocks": num_m, "num_tiles": num_tiles, "scale_log2": scale * LOG2E, "softmax_scale": scale}
    maps = (_bshd_map(q, bm), _bshd_map(k, bn), _bshd_map(v, bn), _bshd_map(out, 64))
    grid = min(num_tiles, plan.sms) if plan.sms else num_tiles
    launch.launch(plan.kernel, (max(grid, 1), 1, 1), maps, params, stream)
    return plan.variant
