"""FP8 quantization of q, k, v, framework-neutral: argument checks and the launches of the ``quant``
kernels (the torch API is ``flashgen.quantize_fp8``, in flashgen.interface).

Method (FlashAttention-3, Shah et al., arXiv 2407.08608, §3.3): FP8 (e4m3) attention loses accuracy
on inputs with outlier features. Two remedies, both optional:

* block quantization: one scale per ``QUANT_BLOCK`` (64) rows of each q / k head instead of one per
  (batch, head);
* incoherent processing: q and k are multiplied by the same random orthogonal matrix
  ``M = diag(s) H_B / sqrt(B)`` (per block of B consecutive head_dim coordinates; B the largest
  power of two dividing head_dim, at most 256; H_B the Walsh-Hadamard matrix in natural order; s a
  ±1 vector), so ``(q M)(k M)ᵀ = q kᵀ`` while an outlier coordinate is spread over B coordinates.
  A fast Walsh-Hadamard transform does it in O(B log B) per row.

Then ``x8 = satfinite_e4m3(x' / descale)``, ``descale = amax(|x'|) / 448`` over the scale's group
(1 when the amax is 0). Nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from . import dispatch
from . import launch
from ._validate import ArrayInfo, Problem, _is_int, input_problems, raise_problems
from .core import _WS_ALIGN, TensorArg, _workspace_address  # (one workspace alignment for all kernels)
from .manifest import Variant

# The family module's constants, not copies.
from .generator.families.quant import (  # noqa: E402
    E4M3_MAX,
    QUANT_BLOCK,
    SIGN_WORDS,
    hadamard_size,
    tile_geometry,
)

__all__ = [
    "QUANT_BLOCK",
    "E4M3_MAX",
    "blocks",
    "descale_shapes",
    "check_quantize",
    "quantize_problems",
    "hadamard_size",
    "pack_sign_bits",
    "reads_in_place",
    "workspace_layout",
    "quantize_fp8_launch",
    "PreparedQuantize",
    "prepare_quantize",
    "launch_quantize",
]

#: What follows ``"flashgen: "`` in every message of the quantize checks.
CONTEXT = "quantize_fp8: "
_INT32_MAX = 2**31 - 1
_SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes as a non-negative int


def blocks(seqlen: int) -> int:
    """``ceil(seqlen / QUANT_BLOCK)``: the 64-row blocks of a sequence (one block scale each)."""
    return -(-int(seqlen) // QUANT_BLOCK)


def descale_shapes(p: Problem, block_quant: bool) -> tuple:
    """The shapes of ``(q_descale, k_descale, v_descale)`` for the call ``p`` (:func:`check_quantize`):
    with ``block_quant`` q ``(batch, heads, blocks(seqlen_q))`` and k ``(batch, heads_k,
    blocks(seqlen_k))``, else both ``(batch, heads_k)`` (FA3's); v always ``(batch, heads_k)``."""
    per_head = (p.batch, p.heads_k)
    if not block_quant:
        return per_head, per_head, per_head
    return (p.batch, p.heads, blocks(p.seqlen_q)), (p.batch, p.heads_k, blocks(p.seqlen_k)), per_head


def flag_problems(incoherent, block_quant, seed) -> list:
    """The problems (``(exception class, message)`` pairs) of the scalar arguments: incoherent and
    block_quant bools, seed an int in [0, 2^64 - 1] (torch.Generator's seed range)."""
    P: list = []
    for name, val in (("incoherent", incoherent), ("block_quant", block_quant)):
        if not isinstance(val, bool):
            P.append((TypeError, f"{name} must be a bool, got {type(val).__name__} {val!r}"))
    if not _is_int(seed):
        P.append((TypeError, f"seed must be an int (the seed of the ±1 signs of incoherent processing), got "
                             f"{type(seed).__name__} {seed!r}"))
    elif not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        P.append((ValueError, f"seed must be between {_SEED_RANGE[0]} and {_SEED_RANGE[1]}, got {seed}"))
    return P


def quantize_problems(q: Optional[ArrayInfo], k: Optional[ArrayInfo], v: Optional[ArrayInfo]) -> list:
    """Everything wrong with q, k, v (see :func:`check_quantize`), as ``(exception class, message)``
    pairs; None stands for an argument that is no array (reported by the caller)."""
    P = input_problems(q, k, v, dtypes=("fp16", "bf16"))  # fp8 inputs are already quantized: a dtype error
    if not P and q is not None and k is not None and v is not None:
        batch, seqlen_q, heads, _ = q.shape
        seqlen_k, heads_k = k.shape[1], k.shape[2]
        for what, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if n > _INT32_MAX:
                P.append((ValueError, f"{what} must be at most {_INT32_MAX}, got {n}"))
        for name, nb, h in (("q", blocks(seqlen_q), heads), ("k", blocks(seqlen_k), heads_k)):
            if batch * nb * h > _INT32_MAX:
                P.append((ValueError, f"{name} has batch x ceil(seqlen / {QUANT_BLOCK}) x heads = {batch * nb * h} "
                                      f"blocks, more than {_INT32_MAX}"))
    return P


def check_quantize(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, also: Sequence[tuple] = ()) -> Problem:
    """Check q, k, v of a quantize call and return its sizes; raises before any device work.

    q ``(batch, seqlen_q, heads, head_dim)``, k ``(batch, seqlen_k, heads_k, head_dim)``, v
    ``(batch, seqlen_k, heads_k, head_dim_v)``: float16 or bfloat16 (all three the same), on one
    CUDA device; heads a multiple of heads_k; head_dim and head_dim_v multiples of 8 in 8..256
    (the forward's rules, :func:`flashgen._validate.input_problems`). batch and seqlens may be 0.
    ``also``: problems found elsewhere in the call (e.g. :func:`flag_problems`), reported in the
    same exception.

    Raises TypeError (dtypes; fp8 inputs included: they are quantized already), ValueError
    (devices, ranks, sizes), :class:`flashgen.InputError` for both; every problem is listed, the
    message starting with ``"flashgen: quantize_fp8: "``.
    """
    raise_problems(quantize_problems(q, k, v) + list(also), CONTEXT)
    batch, seqlen_q, heads, head_dim = (int(n) for n in q.shape)
    seqlen_k, heads_k, head_dim_v = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    return Problem(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v, q.dtype, q.device)


def pack_sign_bits(negative: Sequence[bool]) -> tuple:
    """The kernel's ``sign_bits0..7``: bit i (of word i // 32) set where s_i = -1 (at most 256 signs)."""
    if len(negative) > 32 * SIGN_WORDS:
        raise ValueError(f"flashgen: at most {32 * SIGN_WORDS} signs, got {len(negative)}")
    words = [0] * SIGN_WORDS
    for i, neg in enumerate(negative):
        if neg:
            words[i // 32] |= 1 << (i % 32)
    return tuple(words)


def workspace_layout(p: Problem, block_quant: bool) -> tuple:
    """``(total bytes, (q, k, v) byte offsets or None)`` of the fp32 amax workspace: (batch, heads,
    blocks) for each tensor whose scale spans several blocks (v always; q and k without block
    quantization); each region 256-byte aligned. Its contents need no initialisation."""
    nq, nk = blocks(p.seqlen_q), blocks(p.seqlen_k)
    sizes = (0 if block_quant else p.batch * p.heads * nq, 0 if block_quant else p.batch * p.heads_k * nk,
             p.batch * p.heads_k * nk)
    offs, off = [], 0
    for n in sizes:
        offs.append(off if n else None)
        off += -(-n * 4 // _WS_ALIGN) * _WS_ALIGN
    return off, tuple(offs)


class _Plan(NamedTuple):
    variant: Variant
    amax: object  # launch.LoadedKernel
    quant: object


_plans: dict = {}  # (dtype, device) -> _Plan; immutable values


def _plan(dtype: str, device: int) -> _Plan:
    """The variant serving ``dtype`` and its two loaded kernels, once per key (a miss that raises
    MissingVariantError caches nothing)."""
    key = (dtype, device)
    plan = _plans.get(key)
    if plan is None:
        var = dispatch.select_variant("quant", {"dtype": dtype})
        plan = _Plan(var, launch.get_kernel(var, "amax", device), launch.get_kernel(var, "quant", device))
        _plans[key] = plan
    return plan


def reads_in_place(shape: Sequence[int], strides: Sequence[int], ptr: int = 0) -> bool:
    """The kernels' 16-byte loads can read a 16-bit input of this (batch, seqlen, heads, dim) ``shape``,
    element ``strides`` and address: a contiguous last dim, rows 16-byte aligned (``ptr`` 0 checks the
    layout alone)."""
    return strides[3] == 1 and not ptr % 16 and all(n <= 1 or (s * 2) % 16 == 0 for n, s in zip(shape[:3], strides[:3]))


def _launch_problems(args: dict, p: Problem, block_quant: bool) -> list:
    """What the kernels rely on (the API layers check the rest, with nicer messages)."""
    P = []
    qd, kd, vd = descale_shapes(p, block_quant)
    shapes = {"q": p.q_shape, "k": p.k_shape, "v": p.v_shape, "q8": p.q_shape, "k8": p.k_shape, "v8": p.v_shape,
              "q_descale": qd, "k_descale": kd, "v_descale": vd}
    for name, want in shapes.items():
        t = args[name]
        if tuple(t.shape) != want:
            P.append(f"{name} has shape {tuple(t.shape)}, want {want}")
        if t.device != p.device:
            P.append(f"{name} is on cuda:{t.device}, q on cuda:{p.device}")
    for name in ("q", "k", "v"):
        t = args[name]
        if t.dtype != p.dtype:
            P.append(f"{name} has dtype {t.dtype}, want {p.dtype}")
        elif 0 not in t.shape:
            if not reads_in_place(t.shape, t.strides, t.ptr):
                P.append(f"{name} (strides {t.strides}, address 0x{t.ptr:x}) needs a contiguous last dim and 16-byte "
                         "aligned rows (16-byte loads)")
    for name in ("q8", "k8", "v8"):
        t = args[name]
        if t.dtype != "fp8_e4m3" or (0 not in t.shape and tuple(t.strides) != _contiguous(t.shape)):
            P.append(f"{name} must be a contiguous e4m3 array, got {t.dtype} strides {t.strides}")
    for name in ("q_descale", "k_descale", "v_descale"):
        t = args[name]
        if t.dtype != "fp32" or (0 not in t.shape and tuple(t.strides) != _contiguous(t.shape)) or t.ptr % 4:
            P.append(f"{name} must be a contiguous, 4-byte aligned float32 array, got {t.dtype} strides {t.strides}")
    return P


def _contiguous(shape: Sequence[int]) -> tuple:
    out, acc = [], 1
    for n in reversed(tuple(shape)):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def tile_counts(p: Problem) -> tuple:
    """CTAs of the q, k and v tiles: batch x blocks x ceil(heads / heads_per_cta) each."""
    _, _, g_qk = tile_geometry(p.head_dim)
    _, _, g_v = tile_geometry(p.head_dim_v)
    nq, nk = blocks(p.seqlen_q), blocks(p.seqlen_k)
    return (p.batch * nq * -(-p.heads // g_qk), p.batch * nk * -(-p.heads_k // g_qk), p.batch * nk * -(-p.heads_k // g_v))


_POINTERS = ("q", "k", "v", "q8", "k8", "v8", "q_descale", "k_descale", "v_descale")


def _fixed_params(p: Problem, strides: Sequence[Sequence[int]], incoherent: bool, block_quant: bool,
                  sign_bits: Sequence[int], amax_ptrs: Sequence[Optional[int]] = (None, None, None)) -> dict:
    """Every field of the kernels' params but q's, k's, v's and the outputs' addresses (0 here):
    ``strides``, q's, k's and v's element strides; ``amax_ptrs``, the addresses of the workspace's
    q, k, v amax regions (None, unused: 0)."""
    tq, tk, tv = tile_counts(p)
    rows_qk, log_qk, _ = tile_geometry(p.head_dim)
    rows_v, log_v, _ = tile_geometry(p.head_dim_v)
    b = hadamard_size(p.head_dim)
    params = {name: 0 for name in _POINTERS}
    for name, ptr in zip(("q_amax", "k_amax", "v_amax"), amax_ptrs):
        params[name] = 0 if ptr is None else ptr
    for name, st in zip("qkv", strides):
        params.update({f"{name}_stride_batch": st[0], f"{name}_stride_seq": st[1], f"{name}_stride_head": st[2]})
    params.update({
        "batch": p.batch, "seqlen_q": p.seqlen_q, "seqlen_k": p.seqlen_k, "heads": p.heads, "heads_k": p.heads_k,
        "head_dim": p.head_dim, "head_dim_v": p.head_dim_v, "q_blocks": blocks(p.seqlen_q),
        "k_blocks": blocks(p.seqlen_k),
        "q_tiles": tq, "k_tiles": tk, "v_tiles": tv,
        "qk_rows": rows_qk, "qk_items_log2": log_qk, "v_rows": rows_v, "v_items_log2": log_v,
        "hadamard": b, "incoherent": 1 if incoherent else 0, "block_quant": 1 if block_quant else 0,
        "hadamard_scale": 1.0 / math.sqrt(b),  # packed as fp32: rounded once
        **{f"sign_bits{i}": int(w) for i, w in enumerate(sign_bits)},
    })
    return params


def _grids(p: Problem, block_quant: bool) -> tuple:
    """(amax CTAs, quant CTAs): the amax kernel visits v, and q / k without block quantization."""
    tq, tk, tv = tile_counts(p)
    quant_grid = tq + tk + tv
    if quant_grid > _INT32_MAX:
        raise ValueError(f"flashgen: quantize_fp8: {quant_grid} tiles, more than the grid limit {_INT32_MAX}")
    return (0 if block_quant else tq + tk) + tv, quant_grid


class PreparedQuantize(NamedTuple):
    """The launches of one quantize call shape (:func:`prepare_quantize`), made once and launched any
    number of times by :func:`launch_quantize` with the call's addresses. Immutable: calls on any
    thread may share it."""

    variant: Variant
    amax: Optional[launch.PreparedLaunch]  # None when the grid is empty
    quant: Optional[launch.PreparedLaunch]
    workspace_bytes: int  # :func:`workspace_layout`'s total
    amax_offsets: tuple  # the byte offsets in the workspace of the amax regions the kernels use (per-call fields)


def prepare_quantize(p: Problem, strides: Sequence[Sequence[int]], incoherent: bool, block_quant: bool,
                     sign_bits: Sequence[int]) -> PreparedQuantize:
    """The fixed part of :func:`quantize_fp8_launch` for inputs of ``strides`` (q's, k's, v's element
    strides, last dim contiguous, rows 16-byte aligned: the caller checks) and contiguous outputs:
    the variant and both kernels' params but the addresses. MissingVariantError when no quant
    variant serves the dtype, ValueError for more tiles than the kernels index."""
    plan = _plan(p.dtype, p.device)
    amax_grid, quant_grid = _grids(p, block_quant)
    nbytes, offs = workspace_layout(p, block_quant)
    params = _fixed_params(p, strides, incoherent, block_quant, sign_bits)
    used = [(n, o) for n, o in zip(("q_amax", "k_amax", "v_amax"), offs) if o is not None]
    per_call = _POINTERS + tuple(n for n, _ in used)
    prep = [launch.prepare_launch(kernel, (grid, 1, 1), params, per_call) if grid else None
            for kernel, grid in ((plan.amax, amax_grid), (plan.quant, quant_grid))]
    return PreparedQuantize(plan.variant, prep[0], prep[1], nbytes, tuple(o for _, o in used))


def launch_quantize(prep: PreparedQuantize, pointers: Sequence[int], workspace_ptr: int, stream: int) -> None:
    """Launch ``prep`` on ``stream``: ``pointers``, the addresses of q, k, v, q8, k8, v8, q_descale,
    k_descale, v_descale (the layouts :func:`prepare_quantize` was made for); ``workspace_ptr``,
    ``prep.workspace_bytes`` of device memory, 256-byte aligned (ValueError if not). Never synchronises."""
    ws = _workspace_address(workspace_ptr)
    values = (*pointers, *(ws + o for o in prep.amax_offsets))
    for lp in (prep.amax, prep.quant):
        if lp is not None:
            launch.launch_prepared(lp, (), values, stream)


def quantize_fp8_launch(q: TensorArg, k: TensorArg, v: TensorArg, q8: TensorArg, k8: TensorArg, v8: TensorArg,
                        q_descale: TensorArg, k_descale: TensorArg, v_descale: TensorArg, workspace_ptr: int,
                        p: Problem, incoherent: bool, block_quant: bool, sign_bits: Sequence[int],
                        stream: int) -> Variant:
    """Launch the quant kernels (``amax`` where some scale spans several blocks, then ``quant``).

    q, k, v: the inputs (fp16 / bf16, last dim contiguous, 16-byte aligned rows); q8, k8, v8:
    contiguous e4m3 outputs of their shapes; q/k/v_descale: contiguous fp32 outputs of
    :func:`descale_shapes`; ``workspace_ptr``: :func:`workspace_layout` bytes of device memory,
    256-byte aligned (ValueError if not), any contents, alive until the kernels ran (stream order;
    unused when its size is 0); ``sign_bits``: :func:`pack_sign_bits` of the ±1 vector (ignored unless
    ``incoherent``). Launches on ``stream``; never synchronises.

    Every output element is written, except the descales of a tensor with no rows, which the
    caller sets to 1 (global scales of an empty tensor: amax 0). Returns the variant used;
    MissingVariantError when no quant variant serves the dtype; ValueError for arguments the
    kernels cannot serve.
    """
    args = dict(q=q, k=k, v=v, q8=q8, k8=k8, v8=v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    problems = _launch_problems(args, p, block_quant)
    if problems:
        raise ValueError("flashgen: quantize_fp8_launch: " + "; ".join(problems))
    ws = _workspace_address(workspace_ptr)
    plan = _plan(p.dtype, p.device)
    amax_grid, quant_grid = _grids(p, block_quant)
    _, offs = workspace_layout(p, block_quant)
    params = _fixed_params(p, (q.strides, k.strides, v.strides), incoherent, block_quant, sign_bits,
                           [None if o is None else ws + o for o in offs])
    params.update({name: args[name].ptr for name in _POINTERS})
    if amax_grid:
        launch.launch(plan.amax, (amax_grid, 1, 1), (), params, stream, p.device)
    if quant_grid:
        launch.launch(plan.quant, (quant_grid, 1, 1), (), params, stream, p.device)
    return plan.variant
