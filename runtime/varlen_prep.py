"""The varlen forward's preparation where the offsets are not read on the host, framework-neutral: the launch of
the ``varlen_prep`` kernel (generator/families/varlen_prep.py, templates/varlen_prep.cu.j2).

``flash_attn_varlen_func`` with its offsets on the GPU (eagerly by default, under torch.compile, under CUDA-graph
capture) cannot check FA3's varlen contract on the host, nor know which rows of out / lse belong to no sequence.
One launch of this kernel, queued before the varlen forward on the same stream, does both: it asserts on the
device, naming the argument, where the contract is broken (the rules of flashgen._validate.varlen_problems), and it
writes 0 / -inf into out's / lse's rows of no sequence. Without it (``core.VARLEN_PREP_KERNEL`` off:
``FLASHGEN_VARLEN_PREP_KERNEL=0``, or no variant built) the interface does the same with torch ops: about 20 small
kernels and two memsets over the whole of out and lse. Nothing here imports torch.
"""

from __future__ import annotations

from typing import NamedTuple

from . import dispatch
from . import launch
from .manifest import Variant

__all__ = ["FAMILY", "varlen_prepare"]

FAMILY = "varlen_prep"
_INT32_MAX = 2**31 - 1
_CTAS_PER_SM = 2  # the fill's grid: at most this many CTAs per SM (a grid-stride loop over the rows)


class _Plan(NamedTuple):
    variant: Variant
    kernel: object  # launch.LoadedKernel
    warps: int  # per CTA
    sms: int


_plans: dict = {}  # device -> _Plan; immutable values, filled once per device


def _plan(device: int) -> _Plan:
    """The variant, its loaded kernel and the device's SM count, resolved once per device (a miss raises
    MissingVariantError and caches nothing)."""
    plan = _plans.get(device)
    if plan is None:
        var = dispatch.select_variant(FAMILY, {})
        kern = launch.get_kernel(var, "main", device)
        plan = _Plan(var, kern, int(var.params["threads"]) // 32, launch.num_sms(device))
        _plans[device] = plan
    return plan


def varlen_prepare(cu_seqlens_q: int, cu_seqlens_k: int, seqused_q: int, seqused_k: int, batch: int, total_q: int,
                   total_k: int, max_seqlen_q: int, max_seqlen_k: int, out: int, out_row_bytes: int, lse: int,
                   heads: int, stream: int, device: int) -> Variant:
    """Launch the varlen_prep kernel on ``stream``: check the offsets and fill the rows of no sequence.

    Args (device addresses as ints, 0 for none; sizes as ints):
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` offsets (required).
        seqused_q, seqused_k: int32 ``(batch,)`` used rows per sequence, or 0.
        batch: sequences, at least 1. total_q, total_k: rows of q and of k / v (dim 0).
        max_seqlen_q, max_seqlen_k: FA3's bounds on every (used) sequence's length.
        out: the forward's ``(total_q, heads, head_dim_v)`` contiguous output, 16-byte aligned, or 0: check only.
        out_row_bytes: bytes of one row of out (heads x head_dim_v x element size), a multiple of 16.
        lse: fp32 ``(heads, total_q)`` contiguous (with out). heads: query heads.
        stream: CUstream handle. device: CUDA ordinal.

    What the kernel does: CTA 0 checks FA3's varlen contract (offsets from 0, non-decreasing, the last at most
    total_q / total_k; seqused between 0 and its sequence's rows; max_seqlen at least every used length) and on a
    broken rule asserts with a message naming the argument (a device-side assert: the CUDA context is lost);
    with ``out`` every CTA's warps set the rows of no sequence (past cu_seqlens_q[batch]; with seqused_q, a
    sequence's rows past its used ones) to out 0 and lse -inf, one warp per row.

    Returns the variant used.

    Raises:
        ValueError: arguments the kernel cannot take (batch < 1, sizes outside int32, a null offsets pointer,
            out's row or address not a multiple of 16 bytes, lse missing with out).
        flashgen.dispatch.MissingVariantError: no varlen_prep variant is built.
        flashgen.launch.CudaError: the driver refuses the load or the launch.
    """
    problems = []
    if not 1 <= batch <= _INT32_MAX - 1:
        problems.append(f"batch {batch} not in 1..{_INT32_MAX - 1}")
    for name, n in (("total_q", total_q), ("total_k", total_k), ("max_seqlen_q", max_seqlen_q),
                    ("max_seqlen_k", max_seqlen_k), ("heads", heads)):
        if not 0 <= n <= _INT32_MAX:
            problems.append(f"{name} {n} not in 0..{_INT32_MAX}")
    if not cu_seqlens_q or not cu_seqlens_k:
        problems.append("cu_seqlens_q and cu_seqlens_k are required (null address)")
    if out and (out % 16 or out_row_bytes <= 0 or out_row_bytes % 16 or not lse):
        problems.append(f"out at 0x{out:x} with rows of {out_row_bytes} bytes (want 16-byte aligned rows and an lse)")
    if problems:
        raise ValueError("flashgen: varlen_prepare: " + "; ".join(problems))
    plan = _plan(device)
    grid = 1 if not out else max(1, min(-(-total_q // plan.warps), _CTAS_PER_SM * plan.sms))
    params = {
        "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_q": seqused_q, "seqused_k": seqused_k,
        "out": out, "lse": lse if out else 0, "out_row_bytes": out_row_bytes if out else 0,
        "batch": batch, "total_q": total_q, "total_k": total_k, "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k, "heads": heads,
    }
    launch.launch(plan.kernel, (grid, 1, 1), (), params, stream, device)
    return plan.variant
