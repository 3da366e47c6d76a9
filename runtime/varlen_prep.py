"""The varlen forward's preparation where the offsets are not read on the host, framework-neutral: the launch of
the ``varlen_prep`` kernel (generator/families/varlen_prep.py, templates/varlen_prep.cu.j2).

``flash_attn_varlen_func`` with its offsets on the GPU (eagerly by default, under torch.compile, under CUDA-graph
capture) cannot check FA3's varlen contract on the host, nor know which rows of out / lse belong to no sequence.
One launch of this kernel, queued before the varlen forward on the same stream, does both: it asserts on the
device, naming the argument, where the contract is broken (the rules of flashgen._validate.varlen_problems), and it
writes 0 / -inf into out's / lse's rows of no sequence. Without it (``core.VARLEN_PREP_KERNEL`` off:
``FLASHGEN_VARLEN_PREP_KERNEL=0``, or no variant built) the interface does the same with torch ops: about 20 small
kernels and two memsets over the whole of out and lse.

The same variant's ``kvcache`` kernel (:func:`kvcache_prepare`) does the like for a ``flash_attn_with_kvcache`` step
whose lengths are not read on the host (kvcache._step_on_device): it checks the cache arguments on the device,
appends the new k / v and writes the forward's seqused_k, in one launch instead of about 12-20 torch kernels.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import NamedTuple

from . import dispatch
from . import launch
from .generator.families.varlen_prep import KVCACHE_CTAS_PER_SM, KVCACHE_ROTARY_FIELDS, KVCACHE_ROW_BITS
from .manifest import Variant

__all__ = ["FAMILY", "kvcache_prepare", "prepare_kvcache", "kvcache_addresses", "varlen_prepare", "KvcacheRotary",
           "KVCACHE_MAX_ROWS", "KVCACHE_PER_CALL"]

FAMILY = "varlen_prep"
_INT32_MAX = 2**31 - 1
_CTAS_PER_SM = 2  # the fill's grid: at most this many CTAs per SM (a grid-stride loop over the rows)


# the kvcache kernel's distinct-rows bitmap: caches of at most this many rows where an append names cache_batch_idx
KVCACHE_MAX_ROWS = KVCACHE_ROW_BITS


class KvcacheRotary(NamedTuple):
    """The kvcache kernel's rotary arguments (FA3's rotary_cos / rotary_sin; device addresses as ints, strides in
    bytes): q ``(batch, seqlen_q, heads, q_row_bytes / 2)`` in the caches' 16-bit dtype (``bf16`` or fp16) with byte
    strides ``q_strides`` (batch, row, head), rotated into ``q_rot`` (contiguous, q's shape); ``cos`` / ``sin``
    contiguous 16-byte aligned ``(seqlen_ro, rotary_dim / 2)`` of ``cos_dtype`` (0 fp32, 1 fp16, 2 bf16);
    ``rotary_seqlens`` int32 ``(batch,)`` each entry's first position, or 0 (cache_seqlens); ``interleaved`` pairs
    (else halves); ``each``: q's row i at start + i (causal or local), else every row at start."""
    q: int
    q_rot: int
    q_strides: tuple
    q_row_bytes: int
    seqlen_q: int
    heads: int
    cos: int
    sin: int
    cos_dtype: int
    rotary_seqlens: int
    rotary_dim: int
    seqlen_ro: int
    interleaved: bool
    bf16: bool
    each: bool


_NO_ROTARY = dict.fromkeys((f[0] for f in KVCACHE_ROTARY_FIELDS), 0)  # (every rotary field of the kernel's params)


def _rotary_params(r: KvcacheRotary, k_row_bytes: int, n_new: int, problems: list) -> dict:
    """KvcachePrepParams' rotary fields of ``r`` (appending what the kernel cannot take to ``problems``)."""
    for name, n in (("seqlen_q", r.seqlen_q), ("heads", r.heads), ("seqlen_ro", r.seqlen_ro),
                    ("q_row_bytes", r.q_row_bytes)):
        if not 1 <= n <= _INT32_MAX:
            problems.append(f"rotary {name} {n} (want 1 to 2^31 - 1)")
    if r.rotary_dim < 16 or r.rotary_dim % 16 or 2 * r.rotary_dim > min(r.q_row_bytes, k_row_bytes if n_new else
                                                                           r.q_row_bytes):
        problems.append(f"rotary_dim {r.rotary_dim} (want a multiple of 16 up to head_dim)")
    if any(x % 16 for x in (r.q, r.q_rot, r.q_row_bytes, r.cos, r.sin, *r.q_strides)) or not (
            r.q and r.q_rot and r.cos and r.sin):
        problems.append("rotary q / q_rot / cos / sin: addresses and byte strides must be multiples of 16 bytes, cos "
                        "and sin given")
    if r.cos_dtype not in (0, 1, 2):
        problems.append(f"rotary cos_dtype {r.cos_dtype} (want 0 fp32, 1 fp16, 2 bf16)")
    return {"q": r.q, "q_rot": r.q_rot, "rotary_cos": r.cos, "rotary_sin": r.sin, "rotary_seqlens": r.rotary_seqlens,
            **{f"q_stride_{a}": int(x) for a, x in zip("bth", r.q_strides)}, "q_row_bytes": r.q_row_bytes,
            "seqlen_q": r.seqlen_q, "heads": r.heads, "rotary_dim": r.rotary_dim, "seqlen_ro": r.seqlen_ro,
            "rotary_flags": int(r.interleaved) | 2 * int(r.bf16) | 4 * int(r.each), "rotary_cos_dtype": r.cos_dtype}


class _Plan(NamedTuple):
    variant: Variant
    kernel: object  # launch.LoadedKernel: the role "main"
    kvcache: object  # the role "kvcache"
    warps: int  # per CTA
    sms: int


_plans: dict = {}  # device -> _Plan; immutable values, filled once per device


def _plan(device: int) -> _Plan:
    """The variant, its loaded kernel and the device's SM count, resolved once per device (a miss raises
    MissingVariantError and caches nothing)."""
    plan = _plans.get(device)
    if plan is None:
        var = dispatch.select_variant(FAMILY, {})
        plan = _Plan(var, launch.get_kernel(var, "main", device), launch.get_kernel(var, "kvcache", device),
                     int(var.params["threads"]) // 32, launch.num_sms(device))
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


def kvcache_prepare(cache_seqlens: int, seqlen_const: int, cache_batch_idx: int, cache_leftpad: int, page_table: int,
                    page_table_stride: int, seqused_k: int, k_new: int, v_new: int, k_new_strides: tuple,
                    v_new_strides: tuple, n_new: int, k_cache: int, v_cache: int, k_cache_strides: tuple,
                    v_cache_strides: tuple, k_row_bytes: int, v_row_bytes: int, batch: int, heads_k: int,
                    capacity: int, cache_blocks: int, page_size: int, stream: int, device: int,
                    rotary: KvcacheRotary | None = None) -> Variant:
    """Launch the varlen_prep variant's ``kvcache`` kernel on ``stream``: one flash_attn_with_kvcache step's cache
    arguments checked, its new k / v appended, its seqused_k written (FA3's kvcache semantics,
    hopper/flash_api.cpp mha_fwd with k_new / v_new: entry b's new token i goes to position cache_seqlens[b] + i).

    Args (device addresses as ints, 0 for none; strides in bytes):
        cache_seqlens: int32 ``(batch,)`` tokens already in each entry's cache, or 0: every entry at
            ``seqlen_const``.
        cache_batch_idx, cache_leftpad: int32 ``(batch,)`` or 0. page_table: int32 ``(batch, pages)`` or 0, its rows
            ``page_table_stride`` entries apart.
        seqused_k: int32 ``(batch,)`` written: cache_seqlens + n_new.
        k_new, v_new: the new ``(batch, n_new, heads_k, head_dim[_v])`` rows (0 when n_new is 0), with byte strides
            (batch, token, head) ``k_new_strides`` / ``v_new_strides``; the last dim contiguous, in the caches'
            dtype.
        k_cache, v_cache: ``(cache_blocks, positions, heads_k, head_dim[_v])`` (cache rows, or pages of
            ``page_size`` positions), byte strides (block, position, head).
        k_row_bytes, v_row_bytes: bytes of one head's row (head_dim x element size).
        capacity: each entry's positions (the cache's length, or pages x page_size).
        rotary: :class:`KvcacheRotary` or None: the new keys' first rotary_dim dims rotated as they are appended (at
            positions start_b + i, start_b = rotary_seqlens[b] or cache_seqlens[b]) and q rotated into q_rot (FA3's
            apply_rotary_emb: interleaved pairs or halves, in float32, each product and sum rounded as torch's
            separate kernels round them, the result rounded to the dtype once).

    Every address, stride and row size must be a multiple of 16 bytes (the copies are 16-byte vectors).

    What the kernel does: CTA 0 asserts (a device-side assert naming the argument, the texts of
    ``kvcache_messages()``) where a length plus n_new leaves [0, capacity], a cache_batch_idx row is out of range or
    (with an append) named twice, a cache_leftpad is outside [0, the entry's tokens], a used page's number is out
    of range, or (rotary) an entry's positions leave rotary_cos's rows; every CTA copies the new rows (and rotates
    q), each copy checking its own row, page and rotary position first (no write outside the caches and no read
    outside the tables, whatever the arguments). The grid: one thread per 16-byte chunk (with
    rotary over the halves, per chunk pair), at most 4 CTAs per SM.

    Returns the variant used.

    Raises:
        ValueError: arguments the kernel cannot take (sizes outside int32, misaligned addresses / strides / rows,
            more than KVCACHE_MAX_ROWS cache rows with cache_batch_idx and an append, a page_size < 1 with pages;
            with ``rotary``: a rotary_dim that is not a multiple of 16 up to head_dim, misaligned q / q_rot /
            tables, an unknown cos_dtype, sizes outside int32).
        flashgen.dispatch.MissingVariantError: no varlen_prep variant is built.
        flashgen.launch.CudaError: the driver refuses the load or the launch.
    """
    prep = prepare_kvcache(cache_seqlens, seqlen_const, cache_batch_idx, cache_leftpad, page_table, page_table_stride,
                           seqused_k, k_new, v_new, k_new_strides, v_new_strides, n_new, k_cache, v_cache,
                           k_cache_strides, v_cache_strides, k_row_bytes, v_row_bytes, batch, heads_k, capacity,
                           cache_blocks, page_size, device, rotary)
    launch.launch_prepared(prep, (), kvcache_addresses(cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                                       seqused_k, k_new, v_new, n_new, k_cache, v_cache, rotary),
                           stream)
    return _plan(device).variant


#: The kvcache kernel's params that a :func:`prepare_kvcache` launch takes per call (:func:`kvcache_addresses`): the
#: device addresses.
KVCACHE_PER_CALL = ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table", "seqused_k", "k_new", "v_new",
                    "k_cache", "v_cache", "q", "q_rot", "rotary_cos", "rotary_sin", "rotary_seqlens")


def kvcache_addresses(cache_seqlens: int, cache_batch_idx: int, cache_leftpad: int, page_table: int, seqused_k: int,
                      k_new: int, v_new: int, n_new: int, k_cache: int, v_cache: int,
                      rotary: KvcacheRotary | None = None) -> tuple:
    """The KVCACHE_PER_CALL values of a kvcache step (:func:`kvcache_prepare`'s arguments of the same names; the new
    rows' 0 without new tokens, the rotary ones 0 without ``rotary``)."""
    r = rotary
    return (cache_seqlens, cache_batch_idx, cache_leftpad, page_table, seqused_k, k_new if n_new else 0,
            v_new if n_new else 0, k_cache, v_cache, *((0,) * 5 if r is None else (r.q, r.q_rot, r.cos, r.sin,
                                                                                    r.rotary_seqlens)))


def prepare_kvcache(cache_seqlens: int, seqlen_const: int, cache_batch_idx: int, cache_leftpad: int, page_table: int,
                    page_table_stride: int, seqused_k: int, k_new: int, v_new: int, k_new_strides: tuple,
                    v_new_strides: tuple, n_new: int, k_cache: int, v_cache: int, k_cache_strides: tuple,
                    v_cache_strides: tuple, k_row_bytes: int, v_row_bytes: int, batch: int, heads_k: int,
                    capacity: int, cache_blocks: int, page_size: int, device: int,
                    rotary: KvcacheRotary | None = None) -> launch.PreparedLaunch:
    """:func:`kvcache_prepare`'s launch without launching it: its arguments checked (the same ValueError,
    MissingVariantError), its grid and params fixed but for KVCACHE_PER_CALL, which each
    ``launch.launch_prepared(prep, (), kvcache_addresses(...), stream)`` gives. A step whose arguments differ from
    these only in those addresses (with the same zero / non-zero ones, each a multiple of 16 bytes where this one's
    had to be) may launch it: flashgen.kvcache keeps one per step metadata. Immutable."""
    problems = []
    for name, n in (("batch", batch), ("n_new", n_new), ("heads_k", heads_k), ("capacity", capacity),
                    ("cache_blocks", cache_blocks), ("page_size", page_size), ("page_table_stride", page_table_stride),
                    ("seqlen_const", seqlen_const)):
        if not -_INT32_MAX <= n <= _INT32_MAX:
            problems.append(f"{name} {n} not in int32")
    if batch < 1 or heads_k < 1 or n_new < 0 or not seqused_k:
        problems.append(f"batch {batch}, heads_k {heads_k} (want >= 1), n_new {n_new} (want >= 0), seqused_k "
                        f"0x{seqused_k:x} (required)")
    if page_table and page_size < 1:
        problems.append(f"page_size {page_size} with a page table")
    if cache_batch_idx and n_new and cache_blocks > KVCACHE_MAX_ROWS:
        problems.append(f"{cache_blocks} cache rows with cache_batch_idx and an append (at most {KVCACHE_MAX_ROWS})")
    if n_new:
        sixteen = (k_new, v_new, k_cache, v_cache, k_row_bytes, v_row_bytes, *k_new_strides, *v_new_strides,
                   *k_cache_strides, *v_cache_strides)
        if any(x % 16 for x in sixteen) or not (k_new and v_new and k_cache and v_cache) or min(
                k_row_bytes, v_row_bytes) <= 0 or max(k_row_bytes, v_row_bytes) > _INT32_MAX:
            problems.append("k / v / caches: addresses, byte strides and rows must be multiples of 16 bytes")
    rope = _NO_ROTARY if rotary is None else _rotary_params(rotary, k_row_bytes, n_new, problems)
    if problems:
        raise ValueError("flashgen: kvcache_prepare: " + "; ".join(problems))
    plan = _plan(device)
    threads = plan.warps * 32
    # one thread a unit: a 16-byte chunk, or with rotary over the halves a chunk of x1 with its x2 (the kernel's
    # rotary_units)
    pairs = rotary.rotary_dim // 16 if rotary is not None and not rotary.interleaved else 0
    units = batch * n_new * heads_k * ((k_row_bytes + v_row_bytes) // 16 - pairs)
    if rotary is not None:
        units += batch * rotary.seqlen_q * rotary.heads * (rotary.q_row_bytes // 16 - pairs)
    grid = max(1, min(-(-units // threads), KVCACHE_CTAS_PER_SM * plan.sms))
    params = {
        "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx, "cache_leftpad": cache_leftpad,
        "page_table": page_table, "seqused_k": seqused_k, "k_new": k_new if n_new else 0,
        "v_new": v_new if n_new else 0, "k_cache": k_cache, "v_cache": v_cache,
        **{f"k_new_stride_{a}": int(x) for a, x in zip("bth", k_new_strides)},
        **{f"v_new_stride_{a}": int(x) for a, x in zip("bth", v_new_strides)},
        **{f"k_cache_stride_{a}": int(x) for a, x in zip("rth", k_cache_strides)},
        **{f"v_cache_stride_{a}": int(x) for a, x in zip("rth", v_cache_strides)},
        "k_row_bytes": k_row_bytes, "v_row_bytes": v_row_bytes, "batch": batch, "n_new": n_new, "heads_k": heads_k,
        "seqlen_const": seqlen_const, "capacity": capacity, "cache_blocks": cache_blocks,
        "page_size": page_size if page_table else 0, "page_table_stride": page_table_stride if page_table else 0,
        **rope,
    }
    return launch.prepare_launch(plan.kvcache, (grid, 1, 1), params, KVCACHE_PER_CALL)
