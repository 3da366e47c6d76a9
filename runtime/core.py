"""Framework-neutral forward launch: device pointers + shapes + strides in, kernel launched.

The torch API (interface.py) and the DLPack entry (dlpack_api.py) both end here. Method:
FlashAttention-3 forward (arXiv 2407.08608, §3, Algorithms 1 and 2).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

from . import launch, tuning
from .dispatch import MissingVariantError, select_variant
from .launch import device_capability
from ._validate import ELEMENT_SIZE, TMA_ALIGN_BYTES, is_c_contiguous, tma_layout_problem
from .manifest import Variant, load_manifest
# the tile counter, TMA rows, vt_global's V^T scratch and its preprocess's grid
from .generator.families.fwd import (dynamic_schedule, operand_row_bytes, pad_operand, vt_grid,  # noqa: E402
                                     vt_scratch_bytes, vt_seqlen, vt_tile_bytes)
from .generator.families.bwd import (FAMILY as _BWD_FAMILY, DQ_SWAP_BLOCK_M as _BWD_SWAP_BLOCK_M,  # noqa: E402
                                     pre_rows_per_cta)  # pre grid, dQ path, block_m 80

__all__ = ["TensorArg", "Varlen", "BwdVarlen", "MissingVariantError", "select_variant", "attention_forward", "prepare_forward",
           "launch_forward", "PreparedForward", "attention_backward", "prepare_backward", "launch_backward",
           "PreparedBackward", "backward_workspace_bytes", "device_capability", "MaskSpec", "mask_spec",
           "softmax_constants", "ChunkPiece", "chunk_pieces"]

LOG2E = 1.4426950408889634


class TensorArg(NamedTuple):
    """Framework-neutral view of a device array: address (bytes), shape, strides (elements), dtype, device."""

    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: int


def _env_int(name: str, default: int, minimum: int) -> int:
    """The integer setting of environment variable ``name`` (``default`` when unset); ValueError naming the variable
    unless it is an integer of at least ``minimum``."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"flashgen: environment variable {name} must be an integer >= {minimum}, got {text!r}")
    return value


def _raise_misaligned(**ptrs: int) -> None:
    """ValueError naming the first of ``ptrs`` (array name -> device address) TMA cannot address, in
    :func:`_check_tma`'s words; for a prepared launch whose addresses' OR was found misaligned."""
    for name, ptr in ptrs.items():
        if ptr % TMA_ALIGN_BYTES:
            raise ValueError(f"flashgen: TMA cannot address {name}: {tma_layout_problem((), (), 1, ptr)}")


def _workspace_address(workspace_ptr: int) -> int:
    """``workspace_ptr`` as an int; ValueError unless it is :data:`_WS_ALIGN`-byte aligned (every workspace's regions
    are: the backward's, quantize's), which the kernels' vector accesses need (a fault, sticky in the context)."""
    ws = int(workspace_ptr)
    if ws % _WS_ALIGN:
        raise ValueError(f"flashgen: workspace_ptr must be {_WS_ALIGN}-byte aligned, got {ws:#x}")
    return ws


def _check_tma(name: str, t: TensorArg) -> None:
    problem = tma_layout_problem(t.shape, t.strides, ELEMENT_SIZE[t.dtype], t.ptr)
    if problem is not None:
        raise ValueError(f"flashgen: TMA cannot address {name}: {problem}")


class Varlen(NamedTuple):
    """FA3's varlen arguments of a forward call, for the kernels that read them (fwd.py ``varlen``;
    fwd.cu.j2 kVarlen, mask.cuh SeqRange): batch entry b is a sequence of its own lengths.

    The ``cu_seqlens_*`` / ``seqused_*`` fields are device addresses of int32 arrays, 0 where absent:
    ``cu_seqlens_q`` (batch + 1,) token offsets of the sequences packed along q's (and out's) first
    dim, q then ``(total_q, heads, head_dim)``; without it q is a padded batch ``(batch, seqlen, heads,
    head_dim)``; the same for ``cu_seqlens_k`` and k / v. ``seqused_q`` / ``seqused_k`` (batch,): the
    rows used of each sequence (else the offsets' difference, else max_seqlen_q / max_seqlen_k: a padded
    side without seqused is used up to that length, which should then be its padded length).
    ``batch``: the number of sequences; ``max_seqlen_q`` / ``max_seqlen_k``: at least every
    sequence's length (the grid, and the unbounded sides of a window).

    A padded k / v may be a KV cache (flash_attn_with_kvcache's arguments; int32 arrays, 0 where absent):
    ``kv_batch_idx`` (batch,): the cache row of each sequence (cache_batch_idx; k / v then have any number of
    rows); ``leftpad_k`` (batch,): its first key (cache_leftpad: sequence b has ``seqused_k[b] - leftpad_k[b]``
    keys); ``page_table`` (batch, ``page_table_stride``): its pages, k / v being ``(num_pages, page_size,
    heads_k, dim)``, a sequence's key j in row ``j % page_size`` of page ``page_table[b, j // page_size]``. With a
    page table: page_size a multiple of 8, and neither kv_batch_idx nor leftpad_k (a TMA box of gcd(page_size,
    block_n) rows must not cross a page).

    Split-KV (flash-decoding; FA3's num_splits): with ``num_splits`` > 1 each tile's key blocks are split into
    that many shares, run as separate tiles; split s writes its O (fp32, normalised within the split) to the
    call's ``out`` (then fp32) plus ``s x o_stride_split`` elements and its LSE to ``lse`` plus ``s x
    lse_stride_split``; the caller merges them (the combine family: interface._varlen_kernel).

    Nothing here is checked against the arrays' contents: the caller validated them
    (flashgen._validate.varlen_problems, kvcache's checks)."""

    cu_seqlens_q: int
    cu_seqlens_k: int
    seqused_q: int
    seqused_k: int
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    kv_batch_idx: int = 0
    leftpad_k: int = 0
    page_table: int = 0
    page_table_stride: int = 0
    page_size: int = 0
    num_splits: int = 1
    o_stride_split: int = 0
    lse_stride_split: int = 0

    def meta(self) -> tuple:
        """What a prepared launch depends on: which arrays are given, and the sizes."""
        return (bool(self.cu_seqlens_q), bool(self.cu_seqlens_k), bool(self.seqused_q), bool(self.seqused_k),
                self.batch, self.max_seqlen_q, self.max_seqlen_k, bool(self.kv_batch_idx), bool(self.leftpad_k),
                bool(self.page_table), self.page_table_stride, self.page_size, self.num_splits, self.o_stride_split,
                self.lse_stride_split)

    def addresses(self) -> tuple:
        """The per-call params fields (``_VARLEN_PER_CALL``' order)."""
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_q, self.seqused_k, self.kv_batch_idx,
                self.leftpad_k, self.page_table)


class BwdVarlen(NamedTuple):
    """FA3's varlen arguments of a backward call (bwd.py ``varlen``; bwd.cu.j2 kVarlen): the sequences packed along
    the token dim of q, out, dout, dq (``(total_q, heads, dim)``) and of k, v, dk, dv (``(total_k, heads_k, dim)``),
    sequence b in rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])``.
    ``cu_seqlens_q`` / ``cu_seqlens_k``: device addresses of int32 ``(batch + 1,)`` arrays (0 first,
    non-decreasing, the last at most the total); ``batch``: the number of sequences (1 to MAX_VARLEN_BWD_SEQUENCES:
    the grids' z); ``max_seqlen_q`` / ``max_seqlen_k``: at least the longest sequence's lengths (>= 1; the grids'
    sizes: a smaller value leaves rows unwritten; a larger one, FA3's bound where the offsets are not read on the
    host, adds CTAs that return at once). No seqused: every row of a sequence is used. The backward's tiles read the
    rows past a sequence (its neighbour's, or rows of no sequence) and zero them before any GEMM (bwd.cu.j2
    zero_past), so those rows may hold anything. Nothing here is checked against the arrays' contents: the caller
    validated them (flashgen._validate.varlen_problems, or on the GPU: interface._check_offsets_on_device)."""

    cu_seqlens_q: int
    cu_seqlens_k: int
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    zero_tail: bool = False  # the preprocess zeroes dq's, dk's, dv's rows past the last sequence (bwd.cu.j2)

    def meta(self) -> tuple:
        """What a prepared backward depends on: the sizes, zero_tail, and which offsets are given."""
        return (self.batch, self.max_seqlen_q, self.max_seqlen_k, bool(self.zero_tail), bool(self.cu_seqlens_q),
                bool(self.cu_seqlens_k))

    def addresses(self) -> tuple:
        """The per-call params fields (``_BWD_VARLEN_PER_CALL``' order)."""
        return self.cu_seqlens_q, self.cu_seqlens_k


MAX_VARLEN_BWD_SEQUENCES = 65535  # a varlen backward's sequences: its grids' z (CUDA's limit)


# The varlen backward kernels (bwd.cu.j2 kVarlen) in flash_attn_varlen_func's gradients: on since their GPU tests
# passed (H100, session 2026-12-05 (4): tests/gpu/test_features_gpu.py test_varlen_kernel_backward*, the race test,
# the packed-documents training test, compute-sanitizer synccheck / racecheck; written in session 2026-12-05 (3)
# without a GPU). A call that wants gradients and that the varlen forward kernel serves (VARLEN_KERNEL) runs both
# kernels, one launch each way. FLASHGEN_VARLEN_BWD_KERNEL=0 turns them off: such calls then run composed (one
# flash_attn_func call per run of equal lengths, or the padded groups).
VARLEN_BWD_KERNEL = os.environ.get("FLASHGEN_VARLEN_BWD_KERNEL", "1") == "1"


# The varlen kernels in the calls of flash_attn_varlen_func and flash_attn_with_kvcache: on since their GPU tests
# passed (H200, session 2026-12-05 (2): tests/gpu test_varlen_kernel_*, test_kvcache_varlen_kernel*, the CUDA-graph
# decode steps). FLASHGEN_VARLEN_KERNEL=0 turns them off: those entries then run as one flash_attn_func call per run
# of equal lengths (the composed path, which also serves what the kernels do not: gradients, FP8, attention_chunk).
VARLEN_KERNEL = os.environ.get("FLASHGEN_VARLEN_KERNEL", "1") == "1"


# softcap in the varlen kernel (fwd.cu.j2 kVarlen with kSoftcap: 30 default variants since session 2026-12-05 (4)):
# on since their GPU tests passed (H100, the same session: test_varlen_kernel_forward's softcap cases,
# test_kvcache_varlen_kernel_softcap). A varlen or kvcache call with softcap (Gemma 2) that the varlen kernel otherwise
# serves is one launch. FLASHGEN_VARLEN_SOFTCAP=0 turns it off (such calls then run composed).
VARLEN_SOFTCAP = os.environ.get("FLASHGEN_VARLEN_SOFTCAP", "1") == "1"


# flash_attn_varlen_func and flash_attn_with_kvcache without reading their offsets / lengths on the host in eager calls
# too (GPU tensors, calls the varlen kernels serve: interface._varlen_on_device, kvcache._step_on_device, which
# torch.compile (varlen) and CUDA-graph capture always take): no synchronisation a call, as in FA3; the offsets' values
# checked on the GPU (torch._assert_async: a broken contract is a device-side assert naming the argument, as PyTorch's
# own index checks) instead of on the host (a ValueError), FA3's max_seqlen as the grid sizes, out / lse filled first
# and the gradients' rows past the last offsets zeroed by the backward's preprocess (BwdVarlen.zero_tail). Timed on an
# H200 (session 2026-12-05 (5), scripts/varlen_bench.py's "no host read" column): eager training steps over packed
# documents 1.23-1.79x faster, decodes 1.29-2.28x. On by default since session
# 2026-12-05 (6): the varlen backward zeroes the rows its tiles read past a sequence (bwd.cu.j2 zero_past), so the rows
# past the last offsets, which this path does not cut off, no longer reach dq as NaN
# (test_varlen_kernel_backward_rows_past_the_last_sequence). FLASHGEN_VARLEN_NO_HOST_READ=0 turns it off: the offsets
# are then read and checked on the host (a synchronisation when they are on the GPU).
VARLEN_NO_HOST_READ = os.environ.get("FLASHGEN_VARLEN_NO_HOST_READ", "1") == "1"

# Where the varlen forward's offsets are not read on the host (above), one launch of the varlen_prep kernel
# (runtime/varlen_prep.py) checks them on the GPU and fills out / lse's rows of no sequence, instead of about 20 torch
# ops (interface._check_offsets_on_device) and memsets of the whole out and lse (session 2026-12-05 (7); session 5's
# profile put those at 36 of the 148 us of GPU time of a 16-document forward; scripts/overhead_cpu_stub.py, two runs:
# host time of that forward 170-176 -> 84 us, of a training step over it 380-395 -> 272 us). On an H100 (same
# session, scripts/varlen_gpu_time.py twice, docs/results/varlen_prep_h100/): the 16-document forward's GPU time
# 155 -> 107 us and host time 487-494 -> 207-211 us, a training step's GPU time 662 -> 608-609 us; the kernel itself
# 2 us. On by default since its GPU tests passed there (test_features_gpu.py's prep cases, compute-sanitizer clean);
# FLASHGEN_VARLEN_PREP_KERNEL=0 turns it off (the torch checks and memsets). The same switch serves the variant's
# kvcache kernel (session 2026-12-05 (8)): a flash_attn_with_kvcache step without a host read (kvcache._step_on_device)
# checks its cache arguments, appends k / v and writes seqused_k in one launch instead of about 12-20 torch ops
# (H200, varlen_gpu_time.py twice: a decode step of 64 caches 198-202 -> 182 us of GPU time, 262 -> 225 us paged;
# its GPU tests passed there, docs/results/kvcache_prep_h200/); off, kvcache._append_with_torch does the same.
VARLEN_PREP_KERNEL = os.environ.get("FLASHGEN_VARLEN_PREP_KERNEL", "1") == "1"
# Rotary in that kvcache kernel (session 2026-12-06 (9)): with rotary_cos / rotary_sin, q and the new keys rotated in
# the same launch (the torch path's float32 arithmetic, each product and sum rounded alone: the same bits) instead of
# about 28 torch ops (kvcache.apply_rotary twice). H100, varlen_gpu_time.py twice, a decode step of 64 caches of 4096
# with Llama's rotary: 305-306 -> 235.4-235.5 us of GPU time, 761-766 -> 250 us of host time; test_kvcache_gpu.py
# passed with it on (857 tests, the rotations bit for bit against torch ops), memcheck clean
# (docs/results/kvcache_rotary_h100/). On by default; FLASHGEN_KVCACHE_ROTARY_KERNEL=0 turns it off (torch ops rotate,
# the kernel appends).
KVCACHE_ROTARY_KERNEL = os.environ.get("FLASHGEN_KVCACHE_ROTARY_KERNEL", "1") == "1"


# num_splits 0 ("chosen", flash_attn_with_kvcache's default) lets varlen_num_splits (FA3's heuristic) split the keys
# when the tiles do not fill the GPU; FLASHGEN_SPLIT_KV_AUTO=0 runs such calls unsplit. GPU time of an eager decode of 8
# caches up to 32k keys (scripts/varlen_gpu_time.py, profiler): H100 234 us split against 335 us unsplit (session
# 2026-12-05 (4)), H200 201-208 us against 335-340 us (session 2026-12-05 (5), docs/results/varlen_gpu_20261205e/);
# do_bench per call on the H200: 0.40 against 0.48-0.56 ms. (An H200 reading of session 2026-12-05 (2), 1.65-1.71 ms
# split against 0.49-0.63 ms, did not reproduce.) The kvcache GPU tests passed with it on (H200, session 5).
# num_splits > 1 splits as asked either way.
SPLIT_KV_AUTO = os.environ.get("FLASHGEN_SPLIT_KV_AUTO", "1") == "1"


class MaskSpec(NamedTuple):
    """The mask a call runs with, as the variant key names it: ``causal`` (keys up to the
    bottom-right aligned diagonal), ``local`` (a band with runtime bounds: query row i sees keys
    ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``), or neither (only the
    sequence end is masked). ``left``/``right`` >= 0 (an unbounded side is seqlen_k for left,
    seqlen_q for right; causal is (seqlen_k, 0))."""

    causal: bool
    local: bool
    left: int
    right: int


def mask_spec(causal: bool, window_size, seqlen_q: int, seqlen_k: int) -> MaskSpec:
    """FA3's mask semantics (hopper/flash_api.cpp), bottom-right aligned: ``window_size = (left,
    right)`` with -1 (or None) unbounded; ``causal`` sets right = 0; a side that reaches every key
    (left >= seqlen_k - 1, right >= seqlen_q - 1) is unbounded; with both sides unbounded the call
    is unmasked (so causal with seqlen_q == 1 runs the unmasked kernel, as in FA3); an unbounded left
    with right 0 is causal; any other band is local.
    window_size values must be ints >= -1 or None (checked by the callers' validation)."""
    left, right = (-1 if x is None else int(x) for x in window_size)
    if causal:
        right = 0
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if left < 0 and right < 0:
        return MaskSpec(False, False, seqlen_k, seqlen_q)
    if left < 0 and right == 0:
        return MaskSpec(True, False, seqlen_k, 0)
    return MaskSpec(False, True, left if left >= 0 else seqlen_k, right if right >= 0 else seqlen_q)


class ChunkPiece(NamedTuple):
    """One sub-problem of an ``attention_chunk`` call (:func:`chunk_pieces`): query rows
    ``[q_begin, q_end)`` see keys in ``[k_begin, k_end)`` only. ``chunks`` > 1: that many whole
    chunks of ``(q_end - q_begin) // chunks`` rows and as many keys each, one after the other, which
    a caller may run as one call with ``chunks`` times the batch."""

    q_begin: int
    q_end: int
    k_begin: int
    k_end: int
    chunks: int


def chunk_pieces(seqlen_q: int, seqlen_k: int, attention_chunk: int) -> list:
    """FA3's ``attention_chunk`` (Llama 4's chunked attention; FA3's test reference
    ``construct_chunk_mask``) as independent sub-problems: with ``C = attention_chunk`` > 0 and
    ``off = seqlen_k - seqlen_q``, query row i sees only the keys j of its chunk,
    ``floor((i + off) / C) * C <= j < that + C``, on top of its causal / window mask.

    The chunks cut the rows (at their key position i + off) and the keys at the same multiples of C,
    so every row's keys lie in one piece, the pieces' rows and keys do not overlap, and in each
    piece the rows keep their bottom-right alignment: a piece of lq rows and lk keys starts its
    rows at key position k_begin + lk - lq. The call's causal / window_size therefore apply
    unchanged inside each piece, and its out and lse rows are those of the piece's own attention.

    Returns the pieces in row order, together covering rows ``[0, seqlen_q)``: first the rows
    whose position i + off < 0 (they see no key: ``k_begin == k_end == 0``), then the chunk of the
    first row with a key if it is partial, then every whole chunk as one piece (``chunks`` of them),
    then the last chunk if it is partial; at most 3 pieces whatever the number of chunks. Keys
    ``[0, k_begin of the first piece with keys)`` are seen by no row. An empty problem is one piece.
    ValueError unless attention_chunk is an int >= 1 and the lengths ints >= 0."""
    sq, sk, c = int(seqlen_q), int(seqlen_k), int(attention_chunk)
    if c < 1 or sq < 0 or sk < 0:
        raise ValueError(f"flashgen: chunk_pieces needs attention_chunk >= 1 and lengths >= 0, got "
                         f"{attention_chunk}, {seqlen_q}, {seqlen_k}")
    if sq == 0 or sk == 0:
        return [ChunkPiece(0, sq, 0, sk, 1)]
    off = sk - sq
    pieces = []
    blind = min(sq, max(0, -off))  # rows before the first key position
    if blind:
        pieces.append(ChunkPiece(0, blind, 0, 0, 1))
    if blind == sq:
        return pieces
    first = max(off, 0)  # the first row's key position (rows blind..sq-1 sit at positions first..sk-1)
    c0, c_last = first // c, (sk - 1) // c
    if c0 == c_last:  # one chunk holds every row with a key
        pieces.append(ChunkPiece(first - off, sq, c0 * c, sk, 1))
        return pieces
    whole0 = c0 if first % c == 0 else c0 + 1  # the first and last chunks with all their rows and keys
    whole1 = c_last if sk % c == 0 else c_last - 1
    if whole0 > c0:  # the first chunk is partial (its rows start mid-chunk)
        pieces.append(ChunkPiece(first - off, (c0 + 1) * c - off, c0 * c, (c0 + 1) * c, 1))
    if whole0 <= whole1:
        pieces.append(ChunkPiece(whole0 * c - off, (whole1 + 1) * c - off, whole0 * c, (whole1 + 1) * c,
                                 whole1 - whole0 + 1))
    if whole1 < c_last:  # the last chunk is partial (it ends at seqlen_k)
        pieces.append(ChunkPiece(c_last * c - off, sq, c_last * c, sk, 1))
    return pieces


def softmax_constants(softmax_scale: float, softcap: float) -> tuple:
    """``(scale_log2, softcap_scale)`` of the kernels' params: without softcap (0),
    ``(softmax_scale * log2 e, 0)``; with softcap c > 0 (FA3's: logits = c * tanh(scale q.k / c)),
    ``(c * log2 e, softmax_scale / c)``. A zero scale without softcap runs as 1e-30 (masked -inf
    scores times 0 would be NaN; a tiny scale gives the same uniform weights), in the forward and
    the backward alike. ValueError for a non-finite scale or softcap, or softcap < 0."""
    scale, cap = float(softmax_scale), float(softcap)
    if not math.isfinite(scale):
        raise ValueError(f"flashgen: softmax_scale must be finite, got {softmax_scale}")
    if not (math.isfinite(cap) and cap >= 0.0):
        raise ValueError(f"flashgen: softcap must be a finite float >= 0 (0 = off), got {softcap}")
    if cap > 0.0:
        return cap * LOG2E, scale / cap
    return (scale if scale != 0.0 else 1e-30) * LOG2E, 0.0


_ROUND_UP = ("head_dim", "head_dim_v")  # a variant built for a larger head dim serves (TMA zero fill)
_VARIANT_DTYPE = {"fp8_e4m3": "e4m3"}  # the configs' name of an input dtype, where it differs
QUANT_BLOCK = 64  # FP8 block quantization: rows of Q / K per descale (generator/families/fwd.py)
# Causal tile order (scheduler.cuh): the (batch, head) pairs run in sections whose K and V fit in
# this many bytes of L2 together (FA3's LPT scheduler uses 32 MB; the H100 and H200 have 50 MB),
# and of at most L2_SECTION_KV_HEADS K/V heads: with short K/V the bytes alone put up to 128 heads
# in one section at seqlen 512, whose tiles then ran far enough apart that each query block re-read
# its head's K/V from HBM (H100, hd128 causal 512: 241 MB read against 192 MB of unique Q, K and V;
# a 16-head cap gave +16 %, docs/PERF.md "L2 sections of at most 16 K/V heads").
L2_SECTION_BYTES = 32 << 20
L2_SECTION_KV_HEADS = 16
# The causal order's last section is up to this many sections long (tail_heads), where their K and V fit in
# L2_SECTION_BYTES together; 1 (FLASHGEN_CAUSAL_TAIL_SECTIONS=1): every section of section_heads pairs, the last one
# what is left, the order before session 17 (H100, same kernels: hd256 causal 512 1.5-2.0 % slower).
CAUSAL_TAIL_SECTIONS = _env_int("FLASHGEN_CAUSAL_TAIL_SECTIONS", 2, 1)


def section_heads(batch: int, heads: int, heads_k: int, seqlen_k: int, head_dim: int, head_dim_v: int,
                  element_bytes: int) -> int:
    """(batch, head) pairs per L2 section of the causal tile order, in [1, batch * heads]: the query
    heads of as many K/V heads (each seqlen_k x (head_dim + head_dim_v) elements of ``element_bytes``,
    shared by the heads // heads_k query heads of a group) as fit in L2_SECTION_BYTES, and of at
    most L2_SECTION_KV_HEADS K/V heads."""
    kv_bytes = seqlen_k * (head_dim + head_dim_v) * element_bytes
    kv_heads = max(1, min(L2_SECTION_BYTES // max(kv_bytes, 1), L2_SECTION_KV_HEADS))
    return max(1, min(batch * heads, kv_heads * (heads // heads_k)))


def tail_heads(batch: int, heads: int, heads_k: int, seqlen_k: int, head_dim: int, head_dim_v: int,
               element_bytes: int) -> int:
    """(batch, head) pairs in the last L2 section of the causal tile order (scheduler.cuh), in
    [1, batch * heads]: what is left after whole sections of :func:`section_heads` pairs, with the
    sections before it up to CAUSAL_TAIL_SECTIONS sections in all, as many as keep their K/V heads
    within L2_SECTION_BYTES together (no head cap: the launch ends on the shortest tiles of more
    pairs, which balances its last wave: scripts/schedule_model.py, max / mean work per CTA 1.080 ->
    1.031 at FA3's head_dim 256 causal 512). ``batch * heads - tail_heads`` is a multiple of
    section_heads."""
    pairs, sec = batch * heads, section_heads(batch, heads, heads_k, seqlen_k, head_dim, head_dim_v, element_bytes)
    tail = pairs - (pairs - 1) // sec * sec  # the remainder's section (a whole one when sec divides pairs)
    group = max(1, heads // heads_k)
    kv_bytes = seqlen_k * (head_dim + head_dim_v) * element_bytes
    for _ in range(CAUSAL_TAIL_SECTIONS - 1):
        more = min(pairs, tail + sec)
        if more == tail or -(-more // group) * kv_bytes > L2_SECTION_BYTES:
            break
        tail = more
    return tail


def tail_section(batch: int, heads: int, heads_k: int, seqlen_k: int, head_dim: int, head_dim_v: int,
                 element_bytes: int) -> int:
    """The index of the causal tile order's last L2 section (the forward's ``tail_section`` parameter):
    ``(batch * heads - tail_heads) / section_heads``, with :func:`tail_heads` and :func:`section_heads`
    of the same arguments."""
    args = (batch, heads, heads_k, seqlen_k, head_dim, head_dim_v, element_bytes)
    return (batch * heads - tail_heads(*args)) // section_heads(*args)


class _Plan(NamedTuple):
    variant: Variant
    kernel: launch.LoadedKernel
    block_m: int
    block_n: int
    sms: int  # persistent variants launch min(tiles, #SMs) CTAs; 0 = one CTA per tile
    vt: launch.LoadedKernel | None = None  # vt_global variants: the V^T preprocess (fwd.py)


_plans: dict = {}  # call key -> _Plan; values are immutable, so concurrent calls may share them


def _check_named_variant(var: Variant, dtype: str, d: int, dv: int, mask: MaskSpec, softcap: bool,
                         varlen: bool = False) -> None:
    """ValueError unless a forward variant named by the caller computes this call: its dtype, head
    dims at least the call's (zero padded), softcap compiled in exactly when the call has one, and a
    mask kernel that serves the call's mask (a local kernel serves every mask through its runtime
    band; otherwise causal must match and the call must not be local). Without this a softcap
    variant called with softcap 0 would compute tanh(0) scores: silently wrong."""
    p = var.params
    want = {"dtype": _VARIANT_DTYPE.get(dtype, dtype), "softcap": bool(softcap)}
    bad = [f"{k} {p.get(k)!r} (the call: {v!r})" for k, v in want.items() if p.get(k) != v]
    if p.get("head_dim", 0) < d or p.get("head_dim_v", p.get("head_dim", 0)) < dv:
        bad.append(f"head dims {p.get('head_dim')}/{p.get('head_dim_v', p.get('head_dim'))} (the call: {d}/{dv})")
    if var.family != "fwd":
        bad.append(f"family {var.family!r} (the call: 'fwd')")
    if bool(p.get("varlen")) != varlen:
        bad.append(f"varlen {bool(p.get('varlen'))} (the call: {varlen})")
    if not p.get("local") and (bool(p.get("causal")) != mask.causal or mask.local):
        bad.append(f"mask {'causal' if p.get('causal') else 'none'} (the call: "
                   f"{'local' if mask.local else 'causal' if mask.causal else 'none'})")
    if bad:
        raise ValueError(f"flashgen: variant {var.name} does not serve this call: " + "; ".join(bad))


#: PackGQA calls with seqlen_q at most this (decode-like) run on the key's decode tile where one is built
#: (_PACK_GQA_DECODE_TILE; configs/fwd.yaml extra: head_dim 64's non-varlen PackGQA keys), longer ones on the
#: key's tile. H100, bf16, batch 16, heads 32 (scripts/packgqa_bench.py --head-dim 64, 128 x 128 wg2 against
#: 192 x 128 wg3 alternated twice; docs/results/packgqa_hd64_tile_h100/): seqlen_q 1-64 1.03-1.17x, group 4 and
#: 8, causal or not, seqlen_k 1k and 8k; seqlen_q 128 0.91-0.95x (more tiles, each reading all of K / V).
PACK_GQA_DECODE_MAX_SEQLEN_Q = 64
_PACK_GQA_DECODE_TILE = {"block_m": 128, "consumer_wgs": 2}
#: PackGQA calls whose packed rows (group x seqlen_q) fit one warpgroup's 64 run on the key's one-warpgroup tile
#: (_DECODE_WG1_TILE: 64 x 128 with 1 consumer warpgroup and no pingpong at head dims 64 and 128, 64 x 64 at 256;
#: configs/fwd.yaml extra) where one is built, else as above. A one-token decode with GQA group 4 or 8 fills 4 or 8 of a 128-row tile's
#: rows: its second warpgroup runs both GEMMs and an exponential per score of every block on padding, in pingpong
#: turns with the first. H100 (session 25, docs/results/decode_wg1_h100/, bf16, heads 32, the same build with
#: FLASHGEN_DECODE_WG1 0 / 1 alternated in two calls): flash_attn_func's unsplit decode (num_splits=1, FA3's
#: default) 1.10-1.37x where a few tiles walk many key blocks, 1.00-1.05x where the call reads K / V at the DRAM's
#: pace (16 shapes, four runs); kvcache decode
#: steps (64 caches up to 8k, FA3's split rule) 1.03-1.04x at hd128 and 1.10-1.16x at hd64, paged or not; the
#: split path (num_splits=0) 0.96-1.06x per shape, 1.013 geomean (best of each side's runs). hd256 (session 26,
#: docs/results/decode_wg1_hd256_h100/, heads 16, group 2-8): unsplit 1.24-1.37x at 8-32 CTAs, 1.01-1.02x at 64-256,
#: the split path 1.00-1.03x. FLASHGEN_DECODE_WG1=0:
#: the 128-row decode tile for these calls too.
DECODE_WG1 = _env_int("FLASHGEN_DECODE_WG1", 1, 0) > 0
_DECODE_WG1_TILE = {"block_m": 64, "consumer_wgs": 1}


def _decode_tile(group: int, seqlen_q: int) -> int:
    """Which decode tile a PackGQA call of ``group`` query heads per K/V head and ``seqlen_q`` positions asks
    for (_plan): 0 the key's own tile (seqlen_q past PACK_GQA_DECODE_MAX_SEQLEN_Q, or a group that the 128-row
    decode tile cannot hold), 1 the 128-row decode tile (_PACK_GQA_DECODE_TILE), 2 the one-warpgroup tile
    (_DECODE_WG1_TILE, while DECODE_WG1: group x seqlen_q <= 64)."""
    if not 0 < seqlen_q <= PACK_GQA_DECODE_MAX_SEQLEN_Q:
        return 0
    if DECODE_WG1 and group * seqlen_q <= _DECODE_WG1_TILE["block_m"]:
        return 2
    return 1 if group <= _PACK_GQA_DECODE_TILE["block_m"] else 0


def _plan(dtype: str, d: int, dv: int, mask: MaskSpec, softcap: bool, device: int, variant: Variant | None,
          bucket: int = 0, pack_gqa: bool = False, varlen: bool = False, decode: int = 0, few: bool = False) -> _Plan:
    """Variant, loaded kernel and launch constants for a call key, resolved once per process.

    ``bucket``: the call's seqlen_k bucket (``tuning.seqlen_bucket``); the GPU's tune table
    (flashgen/tuning.py) may name another built tile than the default for it. ``pack_gqa``: a
    PackGQA variant (fwd.py's pack_gqa; ignored with ``variant``); ``decode`` (:func:`_decode_tile`) 1 or 2:
    the key's decode tile where one is built (2: the one-warpgroup tile, else the 128-row one). ``few``: without a
    decode tile, the key's few-tile tile (_FEW_TILE, :func:`_few_tile_plan`) where one is built. ``varlen``: a
    varlen variant (fwd.py's varlen; ignored with ``variant``).
    A hit never touches the manifest; a miss reloads it (so a variant added with
    `flashgen add-variant` is picked up by the next call that needs it)."""
    decode = decode if variant is None and pack_gqa else 0
    few = few and variant is None and not decode
    key = (variant.name if variant is not None else None, dtype, d, dv, mask.causal, mask.local, softcap, device,
           pack_gqa, bucket, varlen, decode, few)
    plan = _plans.get(key)
    if plan is None:
        if variant is not None:
            _check_named_variant(variant, dtype, d, dv, mask, softcap, varlen)
        var = variant if variant is not None else select_variant(
            "fwd", {"dtype": _VARIANT_DTYPE.get(dtype, dtype), "head_dim": d, "head_dim_v": dv, "causal": mask.causal, "local": mask.local,
                    "softcap": softcap, "pack_gqa": pack_gqa, "varlen": varlen}, round_up=_ROUND_UP)
        if variant is None:
            var = tuning.tuned_variant(var, bucket, device, load_manifest())
        wg1 = _key_tile(var, **_DECODE_WG1_TILE) if decode == 2 else None
        if few:
            var = _key_tile(var, **_FEW_TILE) or var
        elif wg1 is not None:
            var = wg1
        elif decode:  # (2 without a one-warpgroup tile built: the 128-row one)
            var = _twin_variant(var, **_PACK_GQA_DECODE_TILE)
        p = var.params
        sms = launch.num_sms(device) if p.get("persistent", True) else 0
        vt = launch.get_kernel(var, "vt", device) if p.get("vt_global") else None
        plan = _Plan(var, launch.get_kernel(var, "main", device), p["block_m"], p["block_n"], sms, vt)
        _plans[key] = plan
    return plan


def _bshd_map_spec(t: TensorArg, box_rows: int, row_bytes: int = 128) -> tuple:
    """The arguments of :func:`launch.tensor_map` after the address for a swizzled 4-D TMA map
    over a BSHD tensor, tiles of box_rows x row_bytes bytes (128: 64 16-bit or 128 8-bit elements,
    the 128-byte swizzle; 64: the 64-byte swizzle, the forward's e4m3 head_dim 64, see
    generator.families.fwd.operand_row_bytes): dims innermost first (head_dim, seqlen, heads,
    batch). Depends on the metadata only."""
    b, s, h, d = t.shape
    es = ELEMENT_SIZE[t.dtype]
    return (_VARIANT_DTYPE.get(t.dtype, t.dtype), (d, s, h, b), (t.strides[1] * es, t.strides[2] * es, t.strides[0] * es),
            (row_bytes // es, box_rows, 1, 1), row_bytes, t.device)


def _packed_q_map_spec(q: TensorArg, group: int, positions: int, row_bytes: int = 128) -> tuple:
    """PackGQA's Q map (fwd.cu.j2: kPackGqa), as :func:`_bshd_map_spec`: 5-D (head_dim, head in
    group, seqlen, K/V head, batch) with strides (head, seq, group x head, batch), box (one chunk,
    group, ``positions``, 1, 1), so that a box lands as the tile rows position x group + head in
    group, in the 2-D map's swizzled layout."""
    b, s, h, d = q.shape
    es = ELEMENT_SIZE[q.dtype]
    sb, ss, sh = (x * es for x in q.strides[:3])
    return (_VARIANT_DTYPE.get(q.dtype, q.dtype), (d, group, s, h // group, b), (sh, ss, group * sh, sb),
            (row_bytes // es, group, positions, 1, 1), row_bytes, q.device)


#: FA3's PackGQA threshold (hopper/heuristics.h): pack when the unpacked tiles' share of real rows
#: is below this times the packed tiles' share.
PACK_GQA_EFFICIENCY = 0.9


def pack_gqa_rule(seqlen_q: int, heads: int, heads_k: int, block_m: int) -> bool:
    """Whether a forward call runs PackGQA (the query heads of a K/V head packed into one tile of
    ``block_m`` rows, fwd.cu.j2), by FA3's rule on the share of tile rows that hold a query:
    unpacked seqlen_q / (ceil(seqlen_q / block_m) block_m), packed (group = heads / heads_k, a
    tile holds block_m // group positions) seqlen_q group / (ceil(seqlen_q / (block_m // group))
    block_m); pack when the first is below PACK_GQA_EFFICIENCY times the second. False without GQA
    or with group > block_m. Decode-like calls (seqlen_q 1-64, group >= 4) pack; long prompts do not."""
    group = heads // heads_k
    if group <= 1 or group > block_m or seqlen_q < 1:
        return False
    unpacked = seqlen_q / (-(-seqlen_q // block_m) * block_m)
    per_tile = block_m // group
    packed = seqlen_q * group / (-(-seqlen_q // per_tile) * block_m)
    return unpacked < PACK_GQA_EFFICIENCY * packed


def pack_gqa_served(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window_size, seqlen_q: int,
                    seqlen_k: int, softcap: float, heads: int, heads_k: int, device: int) -> bool:
    """Whether a forward call with this metadata can run PackGQA (``attention_forward(pack_gqa=True)``
    without an error): GQA (heads > heads_k), a built PackGQA variant for its key, and a group that
    fits the variant's tile (heads / heads_k <= block_m). flash_attn_func's ``pack_gqa=True`` hint
    packs exactly then (FA3's hint; the output is the same either way). dtype: the core's name
    (fp16, bf16, fp8_e4m3)."""
    group = heads // heads_k
    if group <= 1 or seqlen_q < 1 or seqlen_k < 1:
        return False
    mask = mask_spec(causal, window_size, seqlen_q, seqlen_k)
    return _packed_plan(dtype, head_dim, head_dim_v, mask, softcap > 0, device, (seqlen_k - 1).bit_length(),
                        group, seqlen_q=seqlen_q) is not None


#: Split-KV: the largest split count the varlen forward uses (within the combine kernel's limit,
#: generator/families/combine.py MAX_SPLITS).
MAX_SPLITS = 128


#: Split-KV of decode-like calls (a tile holds one block of query rows, so its work is its key range alone) that FA3's
#: rule splits (tiles under 80 % of the SMs): at least one split per DECODE_SPLIT_BLOCKS key blocks of 128 (of
#: max_seqlen_k: a KV cache's positions, not the lengths, which the host does not read). FA3's rule fills the SMs once,
#: and an entry's long key range then runs alone at the end. H100, scripts/decode_splits.py (CUDA-graph replay over 8
#: layers), 8 caches of 32k positions, FA3's 2 splits -> 8, three draws of lengths: lengths up to 32k 195-217 -> 179-200
#: us a call (-8 to -9 %), in pages of 64 240-251 -> 170-230 us (-4 to -32 %); lengths up to 4k in the same caches
#: (a cache 8x longer than its sequences) 34.6-48.4 -> 37.7-46.0 us (+9 % to -5 %). Over 24 workloads x lengths the
#: chosen split count's time over the best one's: geomean 1.034 -> 1.026 and 1.045 -> 1.031 (two draws). Where the
#: tiles fill the SMs (16 or more such caches) more splits measured slower (16 caches of 8k: +7 % at 2 splits), and
#: calls with several query blocks per tile keep FA3's rule (not measured). 0: FA3's rule alone
#: (FLASHGEN_DECODE_SPLIT_BLOCKS). docs/results/decode_splits_h100/, docs/PERF.md session 14.
DECODE_SPLIT_BLOCKS = _env_int("FLASHGEN_DECODE_SPLIT_BLOCKS", 32, 0)


#: Split-KV of decode-like calls whose sequences all have max_seqlen_k keys (a padded batch: flash_attn_func and the
#: DLPack entry with num_splits=0, a kvcache call without lengths), chosen by a cost model instead of FA3's wave rule
#: (session 24). Two limits on a call's time: its tiles in waves of one per SM, each tile SPLIT_TILE_US (prologue,
#: epilogue) plus its key blocks one after another, SPLIT_BLOCK_US each (latency-bound: a tile alone on its SM reads a
#: 128-key block of K and V in 1.15 us at hd64 and 1.28 us at hd128 on an H100, whatever the tile count); and the
#: call's K / V bytes at SPLIT_BANDWIDTH of the DRAM's peak (cuDeviceGetAttribute's memory clock and bus width). The
#: time is their smooth maximum (the SPLIT_NORM-norm: near the knee both limits show), plus, for a split call,
#: SPLIT_COST_US (the combine's launch and the partials' round trip, 5-6 us measured) and SPLIT_COST_PER_SPLIT_US per
#: split. The fewest splits (a power of two, the counts measured) within 2 % of the fastest predicted count win.
#: Fitted to three scripts/split_bench.py --sweep runs on an H100 (docs/results/split_sweep_h100/: 60 shapes, bf16,
#: hd64 / hd128, GQA 2 / 4 / 8 and MHA, 1k-128k keys, each timed twice): on 119 of the 120 rows it picks the fastest
#: power of two measured (the other: a row whose two runs disagreed), 1.000-1.005x the fastest count of any kind in
#: geomean per sweep (FA3's rule's 3 or 10 splits were fastest at a few rows), where FA3's rule's own count took 1.032x, 1.015x and 1.050x the fastest in geomean per sweep, worst 1.39x (GQA 2 over 20k keys
#: at batch 2: 5 splits against 4's 1.39x faster; hd64 1k keys over 64 tiles; hd128's 64 tiles that already read K /
#: V at the DRAM's pace). On 20 shapes it was not fitted to (a fourth sweep): 1.003x the fastest count in geomean,
#: worst 1.055x, where FA3's rule took 1.074x, worst 1.39x. FLASHGEN_SPLIT_MODEL=0: FA3's rule for these calls too.
SPLIT_MODEL = _env_int("FLASHGEN_SPLIT_MODEL", 1, 0) > 0
SPLIT_BLOCK_US = 1.2
SPLIT_TILE_US = 1.0
SPLIT_BANDWIDTH = 0.9
SPLIT_NORM = 6
SPLIT_COST_US = 5.0
SPLIT_COST_PER_SPLIT_US = 0.2
#: Key blocks wider than hd128's (512 bytes of K + V per key at 16 bits) take longer: hd256's (1024 bytes) take
#: SPLIT_BLOCK_US_WIDE each, fitted to session 26's sweep (docs/results/split_sweep_hd256_h100/: 20 shapes, bf16,
#: GQA 1-16, 2k-64k keys, twice; H100): the model then picks within 1.002x the fastest count timed in geomean (worst
#: 1.04), where FA3's rule took 1.053-1.056x (worst 1.37: 55 splits of 1 x 2 tiles over 8k keys against 16). Between
#: 512 and 1024 bytes a key (hd192 / 128) the cost is interpolated linearly: not measured.
SPLIT_BLOCK_US_WIDE = 1.5
#: The model's K + V bytes per key at most (hd256's at 16 bits, the widest measured); wider keys keep FA3's rule.
SPLIT_MODEL_MAX_KV_BYTES = 1024


def _forward_tiles(batch: int, heads: int, heads_k: int, max_seqlen_q: int) -> tuple[int, int]:
    """(tiles, query rows per tile) of a forward launch: PackGQA (:func:`pack_gqa_rule`) packs a K/V head's query
    heads into one tile's rows."""
    group = max(heads // max(heads_k, 1), 1)
    m_rows = max_seqlen_q * group if pack_gqa_rule(max_seqlen_q, heads, heads_k, 128) else max_seqlen_q
    return batch * (heads_k if m_rows != max_seqlen_q else heads) * -(-m_rows // 128), m_rows


def varlen_num_splits(batch: int, heads: int, heads_k: int, max_seqlen_q: int, max_seqlen_k: int, device: int,
                      mask: MaskSpec | None = None, kv_bytes_per_key: int = 0) -> int:
    """The split count of a forward's key range (split-KV, flash-decoding; FA3's ``num_splits=0``).

    FA3's heuristic (hopper/heuristics.h) for a call whose tiles do not fill the GPU: the tiles are counted at 128
    rows (packed by :func:`pack_gqa_rule` where it packs) and the key blocks at 128 keys (a local ``mask``
    (:func:`mask_spec`): the keys a tile's window spans, left + right + 1 + 128, as FA3). 1 when the tiles fill 80 %
    of the SMs or there are 4 key blocks or fewer; otherwise the fewest splits whose wave efficiency (tiles x
    splits / SMs, over that rounded up) is within 85 % of the best, and for decode-like calls (one block of
    query rows per tile) at least ceil(key blocks / DECODE_SPLIT_BLOCKS). At most MAX_SPLITS, the SMs and the key
    blocks.

    ``kv_bytes_per_key`` > 0 says that every sequence has ``max_seqlen_k`` keys (a padded batch) and what one key's
    K and V rows of one K/V head take ((head_dim + head_dim_v) x element size): a decode-like call of that kind
    takes :func:`_modelled_splits` instead (while SPLIT_MODEL, up to SPLIT_MODEL_MAX_KV_BYTES). 0: the lengths are
    not known on the host (varlen, a KV cache's positions), where FA3's rule and the decode floor stand
    (docs/results/decode_splits_h100/)."""
    keys = max_seqlen_k if mask is None or not mask.local else min(max_seqlen_k, mask.left + mask.right + 1 + 128)
    tiles, m_rows = _forward_tiles(batch, heads, heads_k, max_seqlen_q)
    sms = launch.num_sms(device)
    # (a decode step asks on every call: FA3's rule scans up to MAX_SPLITS counts, 15-20 us of Python, so the
    # answers are kept per question and settings)
    modelled = SPLIT_MODEL and 0 < kv_bytes_per_key <= SPLIT_MODEL_MAX_KV_BYTES and m_rows <= 128
    bandwidth = launch.dram_bandwidth(device) if modelled else 0.0  # 0: FA3's rule (also where the driver says 0)
    question = (tiles, m_rows, batch, heads_k, keys, kv_bytes_per_key, sms, bandwidth, DECODE_SPLIT_BLOCKS,
                MAX_SPLITS, SPLIT_BLOCK_US, SPLIT_BLOCK_US_WIDE, SPLIT_TILE_US, SPLIT_BANDWIDTH, SPLIT_NORM,
                SPLIT_COST_US, SPLIT_COST_PER_SPLIT_US, SPLIT_MODEL_MAX_KV_BYTES)
    n = _split_counts.get(question)
    if n is None:
        n = launch.cache_put(_split_counts, question,
                             _num_splits(tiles, m_rows, batch, heads_k, keys, kv_bytes_per_key, sms, bandwidth),
                             _SPLIT_COUNTS_MAX)
    return n


_split_counts: dict = {}  # varlen_num_splits's question -> its answer
_SPLIT_COUNTS_MAX = 4096


def _num_splits(tiles: int, m_rows: int, batch: int, heads_k: int, keys: int, kv_bytes_per_key: int, sms: int,
                bandwidth: float) -> int:
    """:func:`varlen_num_splits` of ``tiles`` of ``m_rows`` query rows (:func:`_forward_tiles`) over a tile's
    ``keys`` (the window's span for a local mask) on ``sms`` SMs: the cost model where ``bandwidth`` (the DRAM's
    peak, bytes per us) is given, else FA3's rule."""
    blocks = -(-keys // 128)
    if tiles >= 0.8 * sms or blocks <= 4:
        return 1
    cap = min(MAX_SPLITS, sms, blocks)
    if bandwidth > 0:
        return _modelled_splits(tiles, blocks, batch * max(heads_k, 1) * keys * kv_bytes_per_key, sms, cap, bandwidth,
                                kv_bytes_per_key)
    efficiency = [tiles * n / sms / math.ceil(tiles * n / sms) for n in range(1, cap + 1)]
    n = next(n for n, e in enumerate(efficiency, 1) if e >= 0.85 * max(efficiency))
    if DECODE_SPLIT_BLOCKS > 0 and m_rows <= 128:
        n = max(n, min(-(-blocks // DECODE_SPLIT_BLOCKS), cap))
    return n


def _modelled_splits(tiles: int, blocks: int, kv_bytes: int, sms: int, cap: int, bandwidth: float,
                     kv_bytes_per_key: int) -> int:
    """The split count (a power of two up to ``cap``) of a decode-like call whose ``tiles`` each read ``blocks`` key
    blocks of 128, with ``kv_bytes`` of K and V in all (``kv_bytes_per_key`` a key of one K/V head), on ``sms`` SMs
    whose DRAM peak is ``bandwidth`` bytes per us (the model of SPLIT_MODEL's comment): the fewest splits whose
    predicted time is within 2 % of the fastest count's. Powers of two only: the counts the model was fitted on
    (between them it was not measured)."""
    wide = min(max(kv_bytes_per_key - 512, 0) / 512, 1.0)  # 0 up to hd128's keys, 1 at hd256's (SPLIT_BLOCK_US_WIDE)
    block_us = SPLIT_BLOCK_US + wide * (SPLIT_BLOCK_US_WIDE - SPLIT_BLOCK_US)

    def predicted_us(n: int) -> float:
        serial = (SPLIT_TILE_US + -(-blocks // n) * block_us) * -(-tiles * n // sms)  # waves of one per SM
        merge = SPLIT_COST_US + SPLIT_COST_PER_SPLIT_US * n if n > 1 else 0.0
        memory = kv_bytes / (SPLIT_BANDWIDTH * bandwidth)
        return merge + (serial ** SPLIT_NORM + memory ** SPLIT_NORM) ** (1 / SPLIT_NORM)
    counts = [1 << i for i in range(cap.bit_length())]  # powers of two up to cap: the counts measured
    times = [predicted_us(n) for n in counts]
    return next(n for n, us in zip(counts, times) if us <= 1.02 * min(times))


def varlen_variant_built(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window_size, max_seqlen_q: int,
                         max_seqlen_k: int, softcap: float) -> bool:
    """Whether a varlen forward call with this metadata (``attention_forward(varlen=...)``) has a built variant,
    so that it raises no MissingVariantError: a caller that must not fall back to the composed path (a CUDA-graph
    capture) asks before it writes anything. dtype: the core's name (fp16, bf16). (:func:`variant_built`.)"""
    mask = mask_spec(causal, window_size, max_seqlen_q, max_seqlen_k)
    return variant_built("fwd", {"dtype": dtype, "head_dim": head_dim, "head_dim_v": head_dim_v, "causal": mask.causal,
                                 "local": mask.local, "softcap": softcap > 0, "varlen": True}, _ROUND_UP)


def varlen_bwd_variant_built(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window_size, max_seqlen_q: int,
                             max_seqlen_k: int) -> bool:
    """Whether a varlen backward call (``attention_backward(varlen=...)``) with this metadata has a built variant: the
    bwd variant of max(head_dim, head_dim_v) with varlen (no softcap: bwd.yaml builds none). dtype: the core's name.
    (:func:`variant_built`.)"""
    mask = mask_spec(causal, window_size, max_seqlen_q, max_seqlen_k)
    return variant_built("bwd", {"dtype": dtype, "head_dim": max(head_dim, head_dim_v), "causal": mask.causal,
                                 "local": mask.local, "softcap": False, "varlen": True}, _ROUND_UP)


def variant_built(family: str, key: dict, round_up: tuple = ()) -> bool:
    """Whether :func:`select_variant` finds a built variant of ``family`` for ``key``, for callers that ask on every
    call (a captured decode step, a split-KV call's combine). A key found once is not looked up again, as
    :func:`_plan`'s (a lookup reads the manifest's paths); a miss is looked up each time (a variant added later is
    found)."""
    found = (family, tuple(sorted(key.items())), round_up)
    if found in _built:
        return True
    try:
        select_variant(family, key, round_up=round_up)
    except MissingVariantError:
        return False
    _built.add(found)
    return True


_built: set = set()  # variant_built's keys found built (only added to: safe to share between threads)


#: Few-tile calls (session 27): a 16-bit forward whose key's default tile is taller than _FEW_TILE (head_dim 64:
#: 192 x 128 with 3 consumer warpgroups) runs on the key's _FEW_TILE tile (128 x 128 with 2; configs/fwd.yaml extra,
#: and the causal keys' tune-table tiles) where that takes no more waves of tiles over the SMs (:func:`_few_tile_plan`).
#: A 192-row tile walks a key block in about 1.16x a 128-row tile's time (1.49 against 1.28 us at head_dim 64 on an
#: H100), so with as many waves the 128-row tile ends first: chunked prefills and verify steps (80-1024 queries over
#: 4k-32k keys) and MHA decodes, whose few tiles each walk many key blocks. H100, heads 32, scripts/split_bench.py
#: (docs/results/few_tile_h100/): the key's 128-row tile against its 192-row one on 12 shapes (--twin 128:2, two runs):
#: 1.13-1.17x (non-causal) and 1.18-1.30x (causal, seqlen_k >= 8 seqlen_q) where it takes as many waves, 0.60-1.00x
#: where it takes one more; the rule (FLASHGEN_FEW_TILE 0 / 1 alternated twice, 28 rows, bf16 / fp16): 1.07-1.17x
#: non-causal and 1.16-1.33x causal where it switches, 0.97-1.02x where it does not. Not applied to causal calls whose
#: mask removes more than a little (seqlen_k < FEW_TILE_CAUSAL_KEYS x seqlen_q: their tiles' work differs, not
#: measured), local windows, softcap, e4m3, or varlen-kernel calls unless FEW_TILE_VARLEN (below). Not measured
#: on an H200. FLASHGEN_FEW_TILE=0: the default tiles.
FEW_TILE = _env_int("FLASHGEN_FEW_TILE", 1, 0) > 0
_FEW_TILE = {"block_m": 128, "consumer_wgs": 2}
FEW_TILE_CAUSAL_KEYS = 8
#: The same rule for varlen-kernel calls (session 28, built without a GPU, off until measured): flash_attn_with_kvcache's
#: chunked prefills and verify steps (q padded: its tiles are known; seqlen_k is the cache's positions), varlen calls
#: (q packed: the grid's tiles at max_seqlen_q, an upper bound on the sequences' own), and the split path's partials
#: (tiles x splits). head_dim 64's unpacked varlen tile is 192 x 128 with 3 consumer warpgroups (its PackGQA varlen
#: tile is 128 rows already); configs/fwd.yaml extra builds its 128 x 128 wg2 twin (bf16 / fp16, causal or not). Expected
#: from session 27's non-varlen figures: 1.07-1.17x non-causal, 1.16-1.3x causal where it switches (the same kernel
#: body); measure with `device_check.sh envab` (ENV_VAR=FLASHGEN_FEW_TILE_VARLEN, split_bench.py --kvcache) before
#: turning it on. FLASHGEN_FEW_TILE_VARLEN=1: on (with FEW_TILE).
FEW_TILE_VARLEN = _env_int("FLASHGEN_FEW_TILE_VARLEN", 0, 0) > 0


def _tile_grid(batch: int, seqlen_q: int, heads: int, heads_k: int, block_m: int, packed: bool) -> tuple[int, int, int]:
    """A forward launch's (query positions per tile, query blocks, tiles) for tiles of ``block_m`` rows: a PackGQA
    (``packed``) tile holds block_m // group positions of a K/V head's query heads; tiles = query blocks x (K/V heads
    when packed, else heads) x batch."""
    positions = block_m // (heads // heads_k) if packed else block_m
    num_m = -(-seqlen_q // positions)
    return positions, num_m, num_m * (heads_k if packed else heads) * batch


def _few_tile_plan(plan: _Plan, packed: bool, dtype: str, d: int, dv: int, mask: MaskSpec, softcap: bool, device: int,
                   bucket: int, batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_k: int,
                   may_pack: bool, varlen: bool = False) -> tuple[_Plan, bool]:
    """(plan, packed) of a 16-bit forward call with no variant named: the chosen ``plan`` (``packed``: PackGQA), or
    the key's _FEW_TILE plan (packed by pack_gqa_rule at its block_m where ``may_pack``) where FEW_TILE (and, for a
    ``varlen`` call, FEW_TILE_VARLEN), the call qualifies (FEW_TILE's comment) and its tiles take no more waves of
    launch.num_sms(device) than the chosen plan's. ``batch``: the grid's (a split call's sequences x splits).
    Once per prepared call (PreparedForward), not per launch."""
    if (not FEW_TILE or (varlen and not FEW_TILE_VARLEN) or softcap or mask.local
            or plan.block_m <= _FEW_TILE["block_m"] or (mask.causal and seqlen_k < FEW_TILE_CAUSAL_KEYS * seqlen_q)):
        return plan, packed
    few = _plan(dtype, d, dv, mask, softcap, device, None, bucket=bucket, varlen=varlen, few=True)
    if few.block_m != _FEW_TILE["block_m"]:  # none built for the key
        return plan, packed
    fp = (_packed_plan(dtype, d, dv, mask, softcap, device, bucket, heads // heads_k, varlen=varlen,
                       seqlen_q=seqlen_q, few=True)
          if may_pack and pack_gqa_rule(seqlen_q, heads, heads_k, few.block_m) else None)
    if fp is not None and fp.block_m != few.block_m:
        fp = None  # (a packed key without the tile: the unpacked one)
    few, few_packed = fp or few, fp is not None
    sms = launch.num_sms(device)
    waves = -(-_tile_grid(batch, seqlen_q, heads, heads_k, plan.block_m, packed)[2] // sms)
    few_waves = -(-_tile_grid(batch, seqlen_q, heads, heads_k, few.block_m, few_packed)[2] // sms)
    return (few, few_packed) if few_waves <= waves else (plan, packed)


def _pack_plan(dtype: str, d: int, dv: int, mask: MaskSpec, softcap: bool, device: int, bucket: int,
               group: int, varlen: bool = False, seqlen_q: int = 0, few: bool = False) -> _Plan:
    """The PackGQA plan of a call key (``varlen``: of the varlen variants): with ``seqlen_q`` up to
    PACK_GQA_DECODE_MAX_SEQLEN_Q a decode tile of the key (:func:`_decode_tile`, _plan) unless ``group`` query
    heads overflow it, else the key's own tile (``few``: its few-tile tile, :func:`_few_tile_plan`).
    MissingVariantError where no PackGQA variant serves the key."""
    return _plan(dtype, d, dv, mask, softcap, device, None, bucket=bucket, pack_gqa=True, varlen=varlen,
                 decode=_decode_tile(group, seqlen_q), few=few)


def _packed_plan(dtype: str, d: int, dv: int, mask: MaskSpec, softcap: bool, device: int, bucket: int,
                 group: int, varlen: bool = False, seqlen_q: int = 0, few: bool = False) -> _Plan | None:
    """_pack_plan's plan when a PackGQA variant is built for the key and ``group`` query heads fit its tile
    (group <= block_m); else None (the unpacked kernel serves)."""
    try:
        plan = _pack_plan(dtype, d, dv, mask, softcap, device, bucket, group, varlen, seqlen_q, few)
    except MissingVariantError:
        return None
    return plan if group <= plan.block_m else None


def _descale_params(name: str, t: TensorArg | None, heads: int, heads_k: int, blocks: bool) -> dict:
    """The kernel's Descale fields (fp8.cuh) of one fp32 descale tensor: FA3's (batch, heads_k)
    (query head h reads h // (heads / heads_k)), or with ``blocks`` a (batch, heads or heads_k,
    64-row blocks) tensor; None: no descale (1)."""
    f = {f"{name}_descale": 0, f"{name}_descale_stride_batch": 0, f"{name}_descale_stride_head": 0}
    if name != "v":
        f[f"{name}_descale_stride_block"] = 0
    if name == "q":
        f["q_descale_head_div"] = 1
    if t is None:
        return f
    f[f"{name}_descale"] = t.ptr
    f[f"{name}_descale_stride_batch"], f[f"{name}_descale_stride_head"] = t.strides[0], t.strides[1]
    if len(t.shape) == 3 and blocks:
        f[f"{name}_descale_stride_block"] = t.strides[2]
    elif name == "q":
        f["q_descale_head_div"] = heads // heads_k
    return f


class PreparedForward(NamedTuple):
    """A forward launch resolved from a call's metadata alone (:func:`prepare_forward`): the plan
    (variant, kernel), the TMA maps' geometry, the grid and the params struct but for the fields each
    call gives (:data:`_FWD_PER_CALL`: addresses, softmax constants). Immutable, so calls on any
    thread may share it; :func:`launch_forward` launches it."""

    plan: _Plan
    maps: tuple  # per TMA map (q, k, v, out): its launch.TensorMapGeometry (vt_global: V^T's for v, over the scratch)
    launch: launch.PreparedLaunch  # grid and the params struct, but for the _FWD_PER_CALL fields
    vt_launch: launch.PreparedLaunch | None = None  # vt_global variants: the V^T preprocess (per call: v, vt)
    vt_bytes: int = 0  # vt_global variants: the per-call V^T scratch (fwd.vt_scratch_bytes)


#: The params fields each forward call fills itself, in launch.launch_prepared's order.
_FWD_PER_CALL = ("lse", "o", "sink", "q_descale", "k_descale", "v_descale", "scale_log2", "softmax_scale",
                 "softcap_scale")
#: A varlen launch's per-call fields after _FWD_PER_CALL (:meth:`Varlen.addresses`).
_VARLEN_PER_CALL = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "kv_batch_idx", "leftpad_k",
                    "page_table")
_prepared_forwards: dict = {}  # metadata key (_fwd_key) -> PreparedForward (immutable: shared by concurrent calls)
_PREPARED_CACHE_MAX = 1024  # bounded: cleared when full (dropping entries is safe)


def _fwd_key(q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, causal, window_size, softcap,
             q_descale, k_descale, v_descale, variant, pack_gqa=None, varlen: Varlen | None = None) -> tuple:
    """Everything a PreparedForward depends on: all but the addresses and the softmax scale."""
    return (q[1:], k[1:], v[1:], out[1:], bool(causal),
            window_size if type(window_size) is tuple else tuple(window_size), softcap > 0,
            None if q_descale is None else q_descale[1:], None if k_descale is None else k_descale[1:],
            None if v_descale is None else v_descale[1:], None if variant is None else variant.name, pack_gqa,
            None if varlen is None else varlen.meta())


def prepare_forward(q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, causal: bool,
                    variant: Variant | None = None, *, window_size=(-1, -1), softcap: float = 0.0,
                    softmax_scale: float | None = None, q_descale: TensorArg | None = None,
                    k_descale: TensorArg | None = None, v_descale: TensorArg | None = None,
                    pack_gqa: bool | None = None, varlen: Varlen | None = None) -> PreparedForward:
    """The :class:`PreparedForward` of a forward call (see :func:`attention_forward` for the
    arguments), resolved once per metadata key and cached (bounded).

    Only metadata makes the key: shapes, strides, dtypes and devices of q, k, v, out and the
    descales, ``causal``, ``window_size``, whether ``softcap`` > 0, ``variant``, ``pack_gqa``, ``varlen``'s
    :meth:`Varlen.meta` (its addresses come with each launch). The ``ptr`` fields
    may be 0 (the addresses come with each :func:`launch_forward`, which checks them and the scale
    on every call). On a new key the checks of :func:`attention_forward` run in its order, with
    the non-zero addresses and ``softmax_scale`` when given, and raise what it raises (ValueError
    for heads, layouts, addresses, descale shapes, scale, softcap; MissingVariantError); a key
    that raised is not cached."""
    key = _fwd_key(q, k, v, out, causal, window_size, softcap, q_descale, k_descale, v_descale, variant, pack_gqa,
                   varlen)
    prep = _prepared_forwards.get(key)
    if prep is None:
        prep = _prepare_forward(q, k, v, out, causal, variant, window_size, softcap,
                                1.0 if softmax_scale is None else softmax_scale, q_descale, k_descale, v_descale,
                                pack_gqa, varlen)
        launch.cache_put(_prepared_forwards, key, prep, _PREPARED_CACHE_MAX)
    return prep


def _batch_of_one(name: str, t: TensorArg) -> TensorArg:
    """A varlen side packed along its token dim, ``(total, heads, dim)``, as a batch of one
    ``(1, total, heads, dim)`` (the kernel loads it at its sequences' offsets through a map of batch 1)."""
    if len(t.shape) != 3:
        raise ValueError(f"flashgen: {name} must be 3-D (total, heads, dim) with its cu_seqlens, got shape {t.shape}")
    return t._replace(shape=(1, *t.shape), strides=(t.shape[0] * t.strides[0], *t.strides))


def _span(t: TensorArg) -> int:
    """Elements from a TensorArg's first to its last, plus one."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.strides))


def _varlen_operands(q, k, v, out, varlen: Varlen, descales: tuple, pack_gqa) -> tuple:
    """q, k, v, out of a varlen call as 4-D TensorArgs (a packed side as a batch of one); ValueError for what the
    varlen kernels do not serve (FP8 descales, PackGQA asked for with a packed q), a padded side not of
    ``varlen.batch`` or with fewer rows than its max_seqlen."""
    if any(t is not None for t in descales) or q.dtype == "fp8_e4m3":
        raise ValueError("flashgen: the varlen forward serves fp16 / bf16 without descales")
    if pack_gqa and varlen.cu_seqlens_q:
        raise ValueError("flashgen: the varlen forward has no PackGQA with cu_seqlens_q (a packed q); pass pack_gqa "
                         "None or False")
    if varlen.cu_seqlens_q:
        q, out = _batch_of_one("q", q), _batch_of_one("out", out)
    if varlen.cu_seqlens_k:
        k, v = _batch_of_one("k", k), _batch_of_one("v", v)
    cache = varlen.kv_batch_idx or varlen.leftpad_k or varlen.page_table
    if cache and varlen.cu_seqlens_k:
        raise ValueError("flashgen: kv_batch_idx, leftpad_k and page_table are a padded k's (no cu_seqlens_k)")
    if varlen.page_table and (varlen.kv_batch_idx or varlen.leftpad_k or varlen.page_size % 8
                              or varlen.page_size != k.shape[1] or varlen.page_table_stride < 1):
        raise ValueError(f"flashgen: a page table needs k / v of (num_pages, page_size, heads_k, dim) with page_size "
                         f"(k's dim 1: {k.shape[1]}) = {varlen.page_size} a multiple of 8, page_table_stride >= 1, "
                         "and neither kv_batch_idx nor leftpad_k")
    if varlen.num_splits > 1 and (out.dtype != "fp32" or varlen.o_stride_split < _span(out)):
        raise ValueError(f"flashgen: with num_splits {varlen.num_splits} out must be split 0's fp32 partial, the "
                         f"others o_stride_split elements apart (at least its {_span(out)}); got {out.dtype}, "
                         f"{varlen.o_stride_split}")
    for name, t, packed, most in (("q", q, varlen.cu_seqlens_q, varlen.max_seqlen_q),
                                  ("k", k, varlen.cu_seqlens_k, varlen.max_seqlen_k)):
        rows = name == "k" and (varlen.kv_batch_idx or varlen.page_table)  # k's batch dim: cache rows or pages
        if len(t.shape) != 4 or (not packed and not rows and t.shape[0] != varlen.batch):
            raise ValueError(f"flashgen: {name} must be (batch = {varlen.batch}, seqlen, heads, dim) without its "
                             f"cu_seqlens, got shape {t.shape}")
        # a padded side's rows: the kernel reads (and, for q, writes out's) rows below max_seqlen
        if not packed and most > t.shape[1] and not (name == "k" and varlen.page_table):
            raise ValueError(f"flashgen: max_seqlen_{name} = {most} is past {name}'s {t.shape[1]} rows (padded, "
                             f"(batch, seqlen, heads, dim))")
    return q, k, v, out


def _prepare_forward(q, k, v, out, causal, variant, window_size, softcap, softmax_scale, q_descale, k_descale,
                     v_descale, pack_gqa=None, varlen: Varlen | None = None) -> PreparedForward:
    """Check a forward call (attention_forward's checks, in its order) and resolve its PreparedForward."""
    q_rows = q.shape[-3]  # rows of q's sequence dim: the lse's layout without cu_seqlens_q
    if varlen is not None:
        q, k, v, out = _varlen_operands(q, k, v, out, varlen, (q_descale, k_descale, v_descale), pack_gqa)
    b, sq, h, d = q.shape
    _, sk, hk, dv = v.shape
    if varlen is not None:  # the grid's sequences and lengths (each sequence reads its own in the kernel)
        b, sq, sk = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    if h % hk:
        raise ValueError(f"flashgen: heads ({h}) must be a multiple of heads_k ({hk})")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_tma(name, t)
    fp8 = q.dtype == "fp8_e4m3"
    descales = {"q": (q_descale, (b, h, -(-sq // QUANT_BLOCK))), "k": (k_descale, (b, hk, -(-sk // QUANT_BLOCK))),
                "v": (v_descale, None)}
    for name, (t, block_shape) in descales.items():
        if t is not None and (not fp8 or tuple(t.shape) not in ((b, hk), block_shape)):
            raise ValueError(f"flashgen: {name}_descale of shape {tuple(t.shape)} does not fit this call "
                             f"(fp8_e4m3 inputs: (batch, heads_k) = {(b, hk)}"
                             + (f" or {block_shape}" if block_shape else "") + ")")
    mask = mask_spec(causal, window_size, sq, sk)
    softmax_constants(softmax_scale, softcap)  # the checks only: the constants are per call
    bucket = (sk - 1).bit_length()  # tuning.seqlen_bucket
    group = h // hk
    vl = varlen is not None  # a varlen call: the varlen variants (MissingVariantError where none serves it)
    may_pack = not (vl and varlen.cu_seqlens_q)  # (PackGQA's 5-D Q map needs a padded q)
    if variant is not None or pack_gqa:  # a named variant, or PackGQA asked for (MissingVariantError if none)
        plan = (_plan(q.dtype, d, dv, mask, softcap > 0, q.device, variant, bucket=bucket, varlen=vl)
                if variant is not None else _pack_plan(q.dtype, d, dv, mask, softcap > 0, q.device, bucket, group, vl, sq))
        packed = bool(plan.variant.params.get("pack_gqa"))
    else:
        plan = _plan(q.dtype, d, dv, mask, softcap > 0, q.device, None, bucket=bucket, varlen=vl)
        pp = (_packed_plan(q.dtype, d, dv, mask, softcap > 0, q.device, bucket, group, varlen=vl, seqlen_q=sq)
              if pack_gqa is None and may_pack and pack_gqa_rule(sq, h, hk, plan.block_m) else None)
        packed = pp is not None
        plan = pp or plan
        if not fp8:
            plan, packed = _few_tile_plan(plan, packed, q.dtype, d, dv, mask, softcap > 0, q.device, bucket,
                                          b * (varlen.num_splits if vl else 1), sq, sk, h, hk,
                                          pack_gqa is None and may_pack, vl)
    bm, bn = plan.block_m, plan.block_n
    if packed and group > bm:
        raise ValueError(f"flashgen: pack_gqa needs heads / heads_k ({group}) <= block_m ({bm})")
    positions, num_m, num_tiles = _tile_grid(b, sq, h, hk, bm, packed)
    pairs_heads = hk if packed else h  # the scheduler's (batch, head) pairs: K/V heads when packed
    params = {"seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_k": hk, "batch": b, "num_m_blocks": num_m,
              "num_tiles": num_tiles, "section_heads": section_heads(b, pairs_heads, hk, sk, d, dv, 1 if fp8 else 2),
              "tail_section": tail_section(b, pairs_heads, hk, sk, d, dv, 1 if fp8 else 2),
              "stream_tile_counter": 0, "group": group, "tile_queries": positions,
              "window_left": mask.left, "window_right": mask.right,
              "o_stride_batch": out.strides[0], "o_stride_seq": out.strides[1], "o_stride_head": out.strides[2],
              "head_dim_v": dv, "v": 0, "v_stride_batch": v.strides[0], "v_stride_seq": v.strides[1],
              "v_stride_head": v.strides[2], "vt": 0, "vt_seqlen": vt_seqlen(sk),
              **_descale_params("q", q_descale, h, hk, True),
              **_descale_params("k", k_descale, h, hk, True), **_descale_params("v", v_descale, h, hk, False),
              **dict.fromkeys(_VARLEN_PER_CALL, 0), "lse_stride_batch": 0, "lse_stride_head": 0,
              "page_table_stride": 0, "page_size": 0, "page_box": 0, "num_splits": 1, "o_stride_split": 0,
              "lse_stride_split": 0, "split_mul": 0, "split_shift": 0}
    per_call = _FWD_PER_CALL
    if varlen is not None:  # out's batch stride 0 when packed (its rows at the sequences' offsets); lse likewise
        packed_q = bool(varlen.cu_seqlens_q)
        params.update(o_stride_batch=0 if packed_q else out.strides[0],
                      lse_stride_batch=0 if packed_q else h * q_rows, lse_stride_head=q_rows)
        per_call = _FWD_PER_CALL + _VARLEN_PER_CALL
    kv_box = bn  # K / V rows per TMA box: the block, or (paged) the part of it in one page
    if varlen is not None and varlen.page_table:
        kv_box = math.gcd(varlen.page_size, bn)
        params.update(page_table_stride=varlen.page_table_stride, page_size=varlen.page_size, page_box=kv_box)
    if varlen is not None and varlen.num_splits > 1:  # split-KV: the scheduler's batch is sequences x splits
        splits = varlen.num_splits
        lse_span = h * q_rows * (1 if varlen.cu_seqlens_q else b)
        if varlen.lse_stride_split < lse_span or num_tiles * splits >= 2 ** 31:
            raise ValueError(f"flashgen: num_splits {splits}: lse_stride_split must be at least the lse's {lse_span} "
                             f"elements (got {varlen.lse_stride_split}), and tiles x splits below 2^31")
        num_tiles *= splits
        mul, shift = fast_div(splits)
        params.update(batch=b * splits, num_tiles=num_tiles, num_splits=splits, o_stride_split=varlen.o_stride_split,
                      lse_stride_split=varlen.lse_stride_split, split_mul=mul, split_shift=shift,
                      section_heads=section_heads(b * splits, pairs_heads, hk, sk, d, dv, 1 if fp8 else 2),
                      tail_section=tail_section(b * splits, pairs_heads, hk, sk, d, dv, 1 if fp8 else 2))
    geometry = launch.map_geometry
    vp = plan.variant.params  # the tiles' shared-memory rows (64 or 128 bytes), which the maps' boxes match
    qk_rows = operand_row_bytes(vp["head_dim"], vp["dtype"])
    v_rows = operand_row_bytes(vp.get("head_dim_v", vp["head_dim"]), vp["dtype"])
    q_map = _packed_q_map_spec(q, group, positions, qk_rows) if packed else _bshd_map_spec(q, bm, qk_rows)
    vt_launch, vt_bytes = None, 0
    if plan.vt is not None:  # vt_global: V^T (batch, heads_k, dv, vt_seqlen) in per-call scratch, 128-key boxes
        skp = vt_seqlen(sk)
        vt_bytes = vt_scratch_bytes(b, hk, dv, sk)
        vt_rows = pad_operand(vp.get("head_dim_v", vp["head_dim"]), vp["dtype"])  # the vt ring's rows
        v_map = ("e4m3", (skp, dv, hk, b), (skp, dv * skp, hk * dv * skp), (128, vt_rows, 1, 1), 128, v.device)
        grid_vt = vt_grid(b, hk, dv, sk, vt_tile_bytes(vt_rows))
        if grid_vt[2] > 65535:
            raise ValueError(f"flashgen: batch x heads_k ({grid_vt[2]}) over 65535: the vt preprocess's grid "
                             f"(variant {plan.variant.name}); use a variant without vt_global")
        vt_launch = launch.prepare_launch(plan.vt, grid_vt,
                                          {**params, **dict.fromkeys(_FWD_PER_CALL, 0)}, ("v", "vt"))
    else:
        v_map = _bshd_map_spec(v, kv_box, v_rows)
    # (the o map: unused by varlen variants, which store O from registers; over q there, whose out may be fp32)
    maps = (geometry(*q_map), geometry(*_bshd_map_spec(k, kv_box, qk_rows)), geometry(*v_map),
            geometry(*_bshd_map_spec(q if varlen is not None else out, 64)))
    grid = min(num_tiles, plan.sms) if plan.sms else num_tiles
    # Causal persistent variants claim tiles from an int32 that is 0 at the kernel's start and that the kernel leaves
    # at 0, when there are more tiles than CTAs (else each CTA runs one tile and the kernel needs no counter): the
    # stream's (launch._stream_counter), or under CUDA-graph capture one of the launch's own.
    counter = "stream_tile_counter" if dynamic_schedule(plan.variant.params) and num_tiles > grid else None
    return PreparedForward(plan, maps, launch.prepare_launch(plan.kernel, (max(grid, 1), 1, 1), params, per_call,
                                                             counter), vt_launch, vt_bytes)


def launch_forward(prep: PreparedForward, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: int,
                   softmax_scale: float, softcap: float, stream: int, sink: int = 0, q_descale: int = 0,
                   k_descale: int = 0, v_descale: int = 0, varlen: tuple = ()) -> Variant:
    """Launch a :class:`PreparedForward` on arrays with its metadata at these device addresses
    (q, k, v, out, lse; lse 0: no LSE is written; the sink's and the descales' where
    :func:`prepare_forward` was given them, else 0; ``varlen``: a varlen call's
    :meth:`Varlen.addresses`, as its prepare_forward was given a Varlen) on ``stream``; returns the variant. The
    per-call work of :func:`attention_forward`:
    ValueError for an address TMA cannot use (not 16-byte aligned) or a bad softmax_scale /
    softcap, then the TMA maps (cached by address) and the launch (CudaError if it fails). A
    vt_global variant (fwd.py) launches twice on ``stream`` around V^T scratch of its own
    (``vt_bytes``, from launch.scratch, freed on ``stream`` after the launches): its preprocess, then
    the main kernel reading V^T."""
    if (q_ptr | k_ptr | v_ptr | out_ptr) % TMA_ALIGN_BYTES:
        _raise_misaligned(q=q_ptr, k=k_ptr, v=v_ptr, out=out_ptr)
    scale = float(softmax_scale)
    scale_log2, softcap_scale = softmax_constants(scale, softcap)
    tensor_map_at = launch.tensor_map_at
    mq, mk, mv, mo = prep.maps
    values = (lse_ptr, out_ptr, int(sink), q_descale, k_descale, v_descale, scale_log2, scale, softcap_scale, *varlen)
    if prep.vt_launch is not None:  # vt_global: V^T into this call's scratch, then the main kernel reads it
        with launch.scratch(prep.plan.kernel.device, prep.vt_bytes, stream) as vt_ptr:
            launch.launch_prepared(prep.vt_launch, (), (v_ptr, vt_ptr), stream)
            maps = (tensor_map_at(mq, q_ptr), tensor_map_at(mk, k_ptr), tensor_map_at(mv, vt_ptr),
                    tensor_map_at(mo, out_ptr))
            launch.launch_prepared(prep.launch, maps, values, stream)
        return prep.plan.variant
    maps = (tensor_map_at(mq, q_ptr), tensor_map_at(mk, k_ptr), tensor_map_at(mv, v_ptr), tensor_map_at(mo, out_ptr))
    launch.launch_prepared(prep.launch, maps, values, stream)
    return prep.plan.variant


def attention_forward(q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, lse: TensorArg | None,
                      softmax_scale: float, causal: bool, stream: int, variant: Variant | None = None, *,
                      window_size=(-1, -1), softcap: float = 0.0, sink: int = 0,
                      q_descale: TensorArg | None = None, k_descale: TensorArg | None = None,
                      v_descale: TensorArg | None = None, pack_gqa: bool | None = None,
                      varlen: Varlen | None = None) -> Variant:
    """Launch the FA3 forward: out = softmax(logits [+ mask]) v, lse = logsumexp of each row.

    logits = softmax_scale * q k^T, or with ``softcap`` c > 0 c * tanh(softmax_scale * q k^T / c).
    Mask (:func:`mask_spec`, bottom-right aligned): ``causal`` and/or ``window_size=(left, right)``.
    ``sink``: 0, or the device address of learnable_sink, fp32 (heads,) contiguous: one logit per
    head added to every row's softmax denominator (not to out); lse includes it.
    q (batch, seqlen_q, heads, head_dim), k/v (batch, seqlen_k, heads_k, head_dim[_v]),
    out (batch, seqlen_q, heads, head_dim_v) of q's dtype (bf16 for fp8_e4m3 inputs), lse fp32
    (batch, heads, seqlen_q) contiguous, or None: no lse is written (FP8 rowsum_mma variants then skip
    the exact row sums, fwd.cu.j2 kRowsumMma).
    FP8 (q, k, v fp8_e4m3; FA3 paper §3.3): the logits use q * q_descale and k * k_descale, and out
    is softmax(...) (v * v_descale). Each descale is None (1) or an fp32 tensor: q_descale
    (batch, heads_k) (FA3's shape: one per GQA group) or (batch, heads, ceil(seqlen_q / 64)) (block
    quantization: one per 64 rows of each query head); k_descale (batch, heads_k) or (batch,
    heads_k, ceil(seqlen_k / 64)); v_descale (batch, heads_k); any strides; positive values.
    ``pack_gqa`` (FA3's PackGQA: the query heads of a K/V head in one tile, so K and V are read
    once per group): None = :func:`pack_gqa_rule` decides (falling back to the unpacked kernel
    when no PackGQA variant is built), True = packed (MissingVariantError if no PackGQA variant
    serves the call; ValueError if heads / heads_k > block_m), False = unpacked; the output is the
    same either way (up to fp32 rounding order).
    ``varlen`` (:class:`Varlen`; FA3's varlen): every batch entry is a sequence of its own lengths,
    read by the kernel; with ``cu_seqlens_q`` q and out are ``(total_q, heads, dim)`` and lse
    ``(heads, total_q)`` (FA3's varlen layout), and with ``cu_seqlens_k`` k and v are ``(total_k,
    heads_k, dim)``; a side without them is a padded batch of ``varlen.batch``. Each sequence is one
    attention with the call's mask, bottom-right aligned to its own lengths; out and lse rows no
    sequence uses are not written. fp16 / bf16 only (ValueError for descales); PackGQA as above
    with a padded q only (ValueError for pack_gqa=True with cu_seqlens_q; the rule never packs
    one); MissingVariantError where no varlen variant serves the key. With ``varlen.num_splits`` > 1
    (split-KV) out and lse are split 0's partial buffers, out fp32 (:class:`Varlen`).
    Head dims with no variant of their own run on the smallest built larger one. Launches on
    `stream` (CUstream as int); returns the variant used. Raises MissingVariantError when no built
    variant serves the call, ValueError for layouts TMA cannot address or a bad softmax_scale /
    softcap. User-facing argument checks live in interface.py / dlpack_api.py.

    Host cost: :func:`prepare_forward` (what the metadata decides: checks, mask, variant, grid,
    params, TMA map geometry) runs once per metadata key; each call then does
    :func:`launch_forward` (alignment, softmax constants, TMA maps by address, launch).
    """
    if varlen is not None and varlen.num_splits > 1 and lse is None:
        raise ValueError("flashgen: split-KV (num_splits > 1) needs lse: the partials merge by it")
    prep = prepare_forward(q, k, v, out, causal, variant, window_size=window_size, softcap=softcap,
                           softmax_scale=softmax_scale, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                           pack_gqa=pack_gqa, varlen=varlen)
    return launch_forward(prep, q.ptr, k.ptr, v.ptr, out.ptr, 0 if lse is None else lse.ptr, softmax_scale, softcap,
                          stream, sink,
                          0 if q_descale is None else q_descale.ptr, 0 if k_descale is None else k_descale.ptr,
                          0 if v_descale is None else v_descale.ptr, () if varlen is None else varlen.addresses())


# ------------------------------------------------------------------------------------- backward
class _BwdPlan(NamedTuple):
    variant: Variant
    pre: launch.LoadedKernel
    main: launch.LoadedKernel
    post: launch.LoadedKernel
    block_m: int
    block_n: int
    head_dim_padded: int
    num_slices: int
    sms: int  # the device's SM count (the deterministic hand-off's mode)
    pre_rows: int  # query rows per CTA of the preprocess (generator/families/bwd.py pre_rows_per_cta)
    bulk_dq: bool  # dQ added by the reducer warp's bulk reductions (bwd.py resources; every default tile)
    pairs: bool  # ds_pairs: the main kernel runs as 2-CTA clusters of key blocks (bwd.py resources, bwd.cu.j2 kPairs)
    split_tail: bool  # the main kernel can split its grid's last wave (bwd.py split_tail, bwd.cu.j2 kSplitTail)
    persistent: bool  # the main kernel can run persistent (bwd.py persistent, bwd.cu.j2 kPersistent)


_bwd_plans: dict = {}  # call key -> _BwdPlan (immutable; shared by concurrent calls)


# Calls with at least this many query rows run on the dispatch key's block_m 80 variant where one is
# built (configs/bwd.yaml extra: FA3's non-causal head_dim 128 tile, generator/families/bwd.py
# dq_swap). Measured on an H200 (bf16, FA3 protocol, old/new alternated twice, over block_m 64;
# docs/results/bwd_m80_h200/): deterministic 1.04-1.05x at seqlen 2k / 8k / 16k (0.99 / 1.03 at 512 /
# 1k), default 1.00 (0.999-1.005; 0.94 / 0.97 at 512 / 1k, where 80-row blocks pad 512 rows to 560).
DQ_SWAP_MIN_SEQLEN_Q = 2048


# The A/B switch of the block_n 128 tiles' dV / dK k-steps (generator/families/bwd.py dkv_steps): False serves
# every call with the built variant of its key that has dkv_steps off (its twin: configs/bwd.yaml's extra at
# head_dim 128, configs/bwd_ablation.yaml's, built by `flashgen build --all`, at 64) where there is one. For
# scripts/bwd_tail_ab.py --knob BWD_DKV_STEPS; the shipped path is True.
BWD_DKV_STEPS = True

# Deterministic calls whose variant has one of these head dims take its dkv_steps-off twin where one is built
# (the default set builds them at 128). The steps issue dV / dK under the exponentials, which pays in the
# default backward (+1-6 % at head_dim 128) but made the deterministic one slower, whose ordered dQ hand-off
# waits on each block's dQ: H200, bf16, the same process, twin over steps, two or three runs: head_dim 128
# non-causal 1k 1.010-1.014, 2k 1.017-1.022, 4k 1.019-1.026, 16k 1.004-1.013 (block_m 80), causal 2k 1.008-1.013,
# 16k 1.024-1.030; head_dim 64 non-causal 2k 0.981 (so 64 keeps the steps). This rule on / off (bf16 and fp16,
# two runs): +1.1 % to +4.4 % at head_dim 128. docs/results/bwd_det_nosteps/.
DET_NOSTEPS_HEAD_DIMS = (128,)


def _key_variants(var: Variant) -> tuple[Variant, ...]:
    """The built variants of ``var``'s dispatch key (every tile and knob)."""
    return load_manifest().by_key().get((var.family, *sorted(var.dispatch.items())), ())


def _key_tile(var: Variant, **tile) -> Variant | None:
    """A built variant of ``var``'s dispatch key whose params include ``tile`` (e.g. block_m and consumer_wgs),
    whatever its other knobs; None if none is built."""
    return next((v for v in _key_variants(var) if all(v.params.get(k) == x for k, x in tile.items())), None)


def _twin_variant(var: Variant, **params) -> Variant:
    """The built variant of ``var``'s dispatch key whose params are ``var``'s with ``params`` set, else ``var``
    (block_m=80: the key's block_m 80 tile, bwd.py dq_swap; dkv_steps=False: its A/B twin)."""
    want = {**var.params, **params}
    return next((v for v in _key_variants(var) if v.params == want), var)


def _bwd_plan(dtype: str, d: int, mask: MaskSpec, softcap: bool, device: int, variant: Variant | None,
              seqlen_q: int = 0, deterministic: bool = False, varlen: bool = False) -> _BwdPlan:
    """The bwd variant serving (dtype, head_dim ``d``, mask, softcap) and its three loaded kernels,
    once per process (``d`` rounds up to the smallest built size that covers it; callers pass
    max(head_dim, head_dim_v), as FA3 rounds its backward's head dim). Calls with seqlen_q >=
    DQ_SWAP_MIN_SEQLEN_Q take the key's block_m 80 variant where one is built, and deterministic
    calls at DET_NOSTEPS_HEAD_DIMS the dkv_steps-off twin (_twin_variant). A twin has the same tile, so
    the workspace (_bwd_workspace) does not depend on ``deterministic``. ``varlen``: a varlen variant (bwd.py
    varlen; no twins are built for those)."""
    long_rows = variant is None and seqlen_q >= DQ_SWAP_MIN_SEQLEN_Q
    key = (variant.name if variant is not None else None, dtype, d, mask.causal, mask.local, softcap, device, long_rows,
           BWD_DKV_STEPS, deterministic and DET_NOSTEPS_HEAD_DIMS, varlen)
    plan = _bwd_plans.get(key)
    if plan is None:
        var = variant if variant is not None else select_variant(
            "bwd", {"dtype": dtype, "head_dim": d, "causal": mask.causal, "local": mask.local, "softcap": softcap,
                    "varlen": varlen}, round_up=_ROUND_UP)
        if long_rows:
            var = _twin_variant(var, block_m=_BWD_SWAP_BLOCK_M)
        if variant is None and (not BWD_DKV_STEPS or (deterministic and var.params["head_dim"] in DET_NOSTEPS_HEAD_DIMS)):
            var = _twin_variant(var, dkv_steps=False)
        p = var.params
        if bool(p.get("varlen")) != varlen:
            raise ValueError(f"flashgen: variant {var.name} has varlen {bool(p.get('varlen'))}, the call {varlen}")
        pad = -(-p["head_dim"] // 64) * 64
        res = _BWD_FAMILY.resources(p)
        plan = _BwdPlan(var, *(launch.get_kernel(var, role, device) for role in ("pre", "main", "post")),
                        p["block_m"], p["block_n"], pad, pad // p["slice"], launch.num_sms(device),
                        pre_rows_per_cta(p), res["bulk_dq"], res["ds_pairs"], res["split_tail"],
                        res["persistent"])
        _bwd_plans[key] = plan
    return plan


_WS_ALIGN = 256


# Causal calls with seqlen_k at most this take the ordered path (mode 1) even when not deterministic,
# where the variant's dQ is added by bulk reductions (plan.bulk_dq): it stores each dQ tile's first
# share instead of zeroing the accumulator first, and runs key blocks shortest first. Measured
# (docs/PERF.md, bf16, FA3 protocol, the ordered over the unordered path): seqlen 512: H100 1.06 /
# 1.13 / 1.13 at head_dim 64 / 128 / 256, H200 1.02 / 1.01 / 1.02, hd96 1.00-1.01; seqlen 1024, H100:
# 1.03 / 0.98 / 1.02 (hd128 loses: left unordered from 1024 on). head_dim 192 (H200): 1.01 since
# its dQ is staged and bulk-reduced (08749c1); before, with the consumers' red.v4, 0.84.
ORDERED_CAUSAL_MAX_SEQLEN_K = 512
# The same bound for the ds_pairs kernels (head_dim 256, 2-CTA clusters; their ordered path pairs too,
# by turns of pairs: bwd.cu.j2 kPairs). Measured on an H100 (bf16, FA3 protocol, two runs, the ordered
# over the unordered path, docs/results/bwd_det_pairs/): causal 512 1.09, 2k 1.03, 16k 0.95-0.97.
ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS = 2048


def _ordered_default(plan: _BwdPlan, mask: MaskSpec, seqlen_k: int) -> bool:
    """Whether a call that is not deterministic takes the ordered dQ path (ORDERED_CAUSAL_MAX_SEQLEN_K;
    ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS for the ds_pairs kernels, generator/families/bwd.py)."""
    bound = ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS if plan.pairs else ORDERED_CAUSAL_MAX_SEQLEN_K
    return plan.bulk_dq and mask.causal and seqlen_k <= bound


# The ordered default's unordered tail, in waves of the GPU's SMs (one CTA each). The ordered path runs
# each (batch, head_k) group's key blocks shortest first, so the grid's last wave is made of the last
# groups' longest CTAs, and SMs idle while they finish (H200, hd256 causal 512 / 2k, Nsight Compute:
# 7-8 % of the main kernel's SM time; a list-scheduling model: docs/results/bwd_post_pdl_not_kept/
# tail_model.py). The last groups, about this many waves of CTAs, run unordered and longest first
# across them (bwd.cu.j2 GridCta) instead. 0: none.
UNORDERED_TAIL_WAVES = 1.0
# The same remap in causal calls that are unordered throughout (not deterministic, past the ordered
# bounds): each group runs its key blocks longest first, so the grid ended on the last groups' longest
# CTAs, started as late as a group's shortest. Probed on an H200 (hd256 causal 4k, clock64 per CTA,
# docs/results/bwd_4k/): the SMs idled 5.5 % of the main kernel's span at its end, against 0.6-0.9 % at
# 8k / 16k; there the tail only reorders launches (every column is unordered already). Measured (H200,
# bf16, the same kernels, two waves over none, interleaved calls): hd256 causal 4k 1.04, 8k 1.005, 16k
# 1.02; hd192 4k 1.03; hd128 1k-4k 1.04-1.05; hd64 2k 1.02 (one wave: 1 % less at hd256). 0: none.
UNORDERED_CAUSAL_TAIL_WAVES = 2.0


def _unordered_tail(plan: _BwdPlan, deterministic: bool, ordered_default: bool, causal: bool, grid_n: int,
                    groups: int) -> int:
    """BwdParams.unordered_tail: how many of the main grid's last (batch, head_k) groups run unordered
    and longest first across them (waves of the SMs' CTAs, rounded up to whole groups, at most all
    ``groups``): UNORDERED_TAIL_WAVES where the call takes the ordered path only as its default
    (``ordered_default``: _ordered_default), UNORDERED_CAUSAL_TAIL_WAVES in the other causal calls
    that are not deterministic (unordered throughout: only their launch order changes); else 0, and
    a deterministic call stays ordered throughout. ``grid_n``: the main grid's key-block CTAs per
    group and slice."""
    if deterministic:
        return 0
    waves = UNORDERED_TAIL_WAVES if ordered_default else UNORDERED_CAUSAL_TAIL_WAVES if causal else 0.0
    if waves <= 0:
        return 0
    per_group = grid_n * plan.num_slices
    return min(groups, max(1, math.ceil(waves * plan.sms / per_group)))


# The split tail (bwd.cu.j2 kSplitTail): in calls that are not deterministic and have no mask on whole
# blocks (not causal, no window), at block_n 128, the main grid's last partial wave of units (CTAs, one
# per SM) runs as P pieces per unit over equal parts of its query blocks, their dK / dV partial sums
# added by the unit's last piece. P minimises the modelled time of the tail: ceil(units * P / SMs)
# rounds of (blocks / P + SPLIT_TAIL_OVERHEAD_BLOCKS), the second term a piece's start-up and
# partial-sum hand-off in query-block times; P = 1 (no split) unless it gains. At most
# SPLIT_TAIL_MAX_PIECES pieces per unit and SPLIT_TAIL_MAX_ROUNDS rounds of the SMs (the workspace
# holds units x P partial dK / dV tiles: at most MAX_ROUNDS x SMs of them).
SPLIT_TAIL_OVERHEAD_BLOCKS = 6.0
SPLIT_TAIL_MAX_PIECES = 16
SPLIT_TAIL_MAX_ROUNDS = 2


# Unordered non-causal calls at block_n 128 with no more key blocks than query blocks and at least
# ROTATE_UNORDERED_MIN_M_BLOCKS query blocks visit the query blocks rotated, key block n from query block
# n on (as the deterministic mode 3 does), so that the key blocks of a (batch, head) add into different
# dQ tiles at a time, not all into the same one. Measured on an H200 (bf16, FA3 protocol, the same
# kernels rotated / not, interleaved, two runs; docs/results/bwd_split_tail/): hd128 16k (205 blocks)
# 1.019 / 1.019, 8k (103) 1.007 / 1.003, 2k / 4k (26 / 52) 1.000-1.002; hd64 2k (16) 0.990 / 0.994, hd128
# 1k (16) 0.996 / 0.997 (hd64 past 2k not measured).
ROTATE_UNORDERED = True
ROTATE_UNORDERED_MIN_M_BLOCKS = 64


# The persistent backward grid (bwd.cu.j2 kPersistent; bwd.py persistent: block_n 128, not block_m 80, no
# softcap): a call that is not deterministic, with no mask on whole blocks, more units (CTAs of the plain
# grid) than SMs and at most PERSISTENT_MAX_BLOCKS iterations per unit (query blocks x the GQA group), runs
# one CTA per SM over the units in turn: a unit's K and V load under the last unit's dK / dV stores, and
# the CTA's start-up is paid once, not per unit (H200, hd128 non-causal 512: about 2 us of start and 2.2 us
# of stores per unit of 21.7 us, docs/results/bwd_prologue_issue/). Measured on an H200 (bf16, FA3 protocol,
# the same kernels on / off, interleaved, two runs; docs/results/bwd_persistent_n128/): hd64 512 (4 blocks)
# 1.06, hd64 1k (8) 1.03, hd128 512 (8) 1.02, and 1.002-1.005 at 16 blocks (hd64 2k, hd128 1k), where the
# split tail is given up; so longer units keep the split tail. 0: off.
PERSISTENT_BWD = 1
PERSISTENT_MAX_BLOCKS = 8


def _persistent_units(plan: _BwdPlan, mask: MaskSpec, deterministic: bool, units: int, blocks: int) -> int:
    """BwdParams.persistent_units: ``units`` where the call runs the persistent grid (PERSISTENT_BWD), else 0;
    ``blocks``: a unit's iterations."""
    if not (PERSISTENT_BWD and plan.persistent) or deterministic or mask.causal or mask.local:
        return 0
    return units if units > plan.sms and blocks <= PERSISTENT_MAX_BLOCKS else 0


def fast_div(d: int) -> tuple:
    """(mul, shift) of ``d`` (1 <= d < 2**31) for the kernels' fast_div (templates/include/flashgen/scheduler.cuh):
    x // d == (x * mul) >> (32 + shift) for 0 <= x < 2**31, mul 0 for d = 1 (Granlund and Montgomery, PLDI 1994,
    31-bit dividends). Raises ValueError outside that range."""
    if not 1 <= d < 2**31:
        raise ValueError(f"flashgen: fast_div divisor {d} outside [1, 2**31)")
    if d == 1:
        return 0, 0
    ceil_log2 = (d - 1).bit_length()
    return ((1 << (31 + ceil_log2)) + d - 1) // d, ceil_log2 - 1


def _split_applies(plan: _BwdPlan, mask: MaskSpec, deterministic: bool) -> bool:
    """Whether a call may split its tail: a variant that can (bwd.py split_tail: block_n 128, no causal
    or local mask), a call that is not deterministic (whose dQ additions are ordered by key block)."""
    return plan.split_tail and not (deterministic or mask.causal or mask.local) and SPLIT_TAIL_MAX_PIECES >= 2


def _split_tail(plan: _BwdPlan, mask: MaskSpec, deterministic: bool, units: int, blocks: int) -> tuple:
    """(split_units, split_pieces) of the main grid (BwdParams; bwd.cu.j2 GridCta, kSplitTail):
    ``units`` CTAs in the unsplit grid, each ``blocks`` iterations (query blocks times the GQA group);
    (0, 1) where the split does not apply (deterministic, causal, local, the role tiles) or gains
    nothing under the model above."""
    if not _split_applies(plan, mask, deterministic) or blocks < 2:
        return 0, 1
    tail = units % plan.sms
    if tail == 0:
        return 0, 1
    best, best_p = blocks + SPLIT_TAIL_OVERHEAD_BLOCKS, 1
    for pieces in range(2, min(SPLIT_TAIL_MAX_PIECES, blocks) + 1):
        rounds = -(-tail * pieces // plan.sms)
        t = rounds * (blocks / pieces + SPLIT_TAIL_OVERHEAD_BLOCKS)
        if t < best and rounds <= SPLIT_TAIL_MAX_ROUNDS:
            best, best_p = t, pieces
    return (tail, best_p) if best_p > 1 else (0, 1)


def _deterministic_mode(deterministic: bool, num_n_blocks: int, sms: int, ordered_default: bool = False) -> int:
    """BwdParams.deterministic: the order of the backward's fp32 dQ additions across key-block CTAs.

    0: unordered. Not deterministic: 1 where ``ordered_default`` (_ordered_default: short causal
    calls, measured faster; the default path may be ordered, and is then reproducible as well), else 0.
    Ordered modes, each bitwise reproducible (templates/bwd.cu.j2):

    - 3 (a query block's chain of num_n_blocks key-block CTAs <= sms / 2): the chain's CTAs are
      resident together, so a CTA may wait for one launched after it: non-causal CTAs visit the
      query blocks rotated (key block n from query block n on; dQ[m] adds in the order its visitors
      reach it). Each CTA waits only for a neighbour's previous block, where in key-block order CTA
      n first waited for n hand-offs (the ramp). The half-GPU bound leaves room for other kernels
      that hold SMs (e.g. a collective running beside it). Causal calls run as in 1.
    - 1 (chains up to sms): key-block order (causal: last to first, launched in that order); every
      CTA waited for launched before the waiting one. The hand-off is signalled once a block's
      additions have landed (modes 1 and 3).
    - 2 (chains longer than sms): as 1, signalled one block late, after the next block's additions
      are issued (the CTAs start staggered anyway). Measured on an H200 at head_dim 256: 2 was
      1.07-1.15x faster than 1 at seqlen 16k and 0.76-0.87x at 512-2k (docs/PERF.md). Only the role
      tiles' staged reducer (head_dim 256) signals late; the other paths treat 2 as 1.
    """
    if not deterministic:
        return 1 if ordered_default else 0
    if num_n_blocks > sms:
        return 2
    return 3 if num_n_blocks <= sms // 2 else 1


def _varlen_rows_pad(plan: _BwdPlan, batch: int, total_q: int) -> int:
    """A varlen backward's padded workspace rows per head (BwdParams.seqlen_q_pad; bwd.cu.j2 BwdSeq): sequence b
    from block_m x (cu_seqlens_q[b] // block_m + b) on, its blocks before sequence b + 1's first row."""
    return plan.block_m * (-(-total_q // plan.block_m) + batch)


def _bwd_workspace(plan: _BwdPlan, batch: int, seqlen_q: int, heads: int, split: tuple = (0, 1),
                   varlen_total_q: int | None = None) -> tuple:
    """(total bytes, offsets of lse_log2, dpsum, dq_accum, sem, split_tickets, split_parts) of the
    backward's scratch memory: fp32 (batch, heads, seqlen_q_pad) twice, fp32 (batch, heads, seqlen_q_pad,
    head_dim_padded), int32 (batch, heads, num_m_blocks, num_slices), int32 (split units), fp32 (split
    units, pieces, 2, 2, 64 x slice) (``split``: _split_tail's); each region 256-byte aligned.
    ``varlen_total_q``: a varlen call's q rows (``batch`` sequences, ``seqlen_q`` the longest): the first three
    regions are then one plane of (heads, _varlen_rows_pad) rows."""
    num_m = -(-seqlen_q // plan.block_m)
    rows = (batch * heads * num_m * plan.block_m if varlen_total_q is None
            else heads * _varlen_rows_pad(plan, batch, varlen_total_q))
    units, pieces = split
    slice_cols = plan.head_dim_padded // plan.num_slices
    sizes = (rows * 4, rows * 4, rows * plan.head_dim_padded * 4, batch * heads * num_m * plan.num_slices * 4,
             units * 4, units * pieces * 4 * 64 * slice_cols * 4)
    offs, off = [], 0
    for s in sizes:
        offs.append(off)
        off += -(-s // _WS_ALIGN) * _WS_ALIGN
    return off, tuple(offs)


def backward_workspace_bytes(batch: int, seqlen_q: int, heads: int, heads_k: int, head_dim: int, dtype: str,
                             causal: bool, device: int, variant: Variant | None = None, *, seqlen_k: int | None = None,
                             window_size=(-1, -1), softcap: float = 0.0, head_dim_v: int | None = None,
                             varlen_total_q: int | None = None) -> int:
    """Bytes of device scratch memory :func:`attention_backward` needs for this call (> 0).

    Selects (and loads) the bwd variant the same call of :func:`attention_backward` uses: the one
    serving (dtype, max(head_dim, head_dim_v), mask, softcap); raises MissingVariantError when none
    does. ``head_dim_v``: v's head dim (None: head_dim). ``seqlen_k`` is needed with a window
    (:func:`mask_spec`); heads_k is accepted for symmetry (the workspace does not depend on it).
    ``varlen_total_q``: a varlen call (:class:`BwdVarlen`) with this many q rows: ``batch`` is then its sequence
    count and ``seqlen_q`` / ``seqlen_k`` its max_seqlen_q / max_seqlen_k."""
    if seqlen_k is None:
        if tuple(-1 if x is None else x for x in window_size) != (-1, -1):
            raise ValueError("flashgen: backward_workspace_bytes needs seqlen_k with a window_size")
        seqlen_k = 0  # without a window, mask_spec does not depend on seqlen_k
    mask = mask_spec(causal, window_size, seqlen_q, seqlen_k)
    d = head_dim if head_dim_v is None else max(head_dim, head_dim_v)
    varlen = varlen_total_q is not None
    plan = _bwd_plan(dtype, d, mask, softcap > 0, device, variant, seqlen_q, varlen=varlen)
    if varlen:  # (no split tail: bwd.py split_tail)
        return _bwd_workspace(plan, batch, seqlen_q, heads, (0, 1), int(varlen_total_q))[0]
    # the split tail of a call that is not deterministic (a deterministic call uses less of it); without
    # seqlen_k, room for any: fewer units than SMs, at most SPLIT_TAIL_MAX_ROUNDS x SMs pieces
    if seqlen_k > 0:
        split = _call_split(plan, mask, False, _bwd_units(plan, batch, heads_k, seqlen_k), seqlen_q, heads, heads_k)
    else:
        split = (SPLIT_TAIL_MAX_ROUNDS * plan.sms, 1) if _split_applies(plan, mask, False) else (0, 1)
    return _bwd_workspace(plan, batch, seqlen_q, heads, split)[0]


def _bwd_grid_n(plan: _BwdPlan, seqlen_k: int) -> int:
    """The main grid's x: key blocks (2-CTA clusters, kPairs: an odd count gets an idle CTA)."""
    num_n = -(-seqlen_k // plan.block_n)
    return num_n + num_n % 2 if plan.pairs else num_n


def _bwd_units(plan: _BwdPlan, batch: int, heads_k: int, seqlen_k: int) -> int:
    """The main grid's CTAs (units) without a split tail: its x times slices x heads_k x batch."""
    return _bwd_grid_n(plan, seqlen_k) * plan.num_slices * heads_k * batch


def _call_split(plan: _BwdPlan, mask: MaskSpec, deterministic: bool, units: int, seqlen_q: int, heads: int,
                heads_k: int) -> tuple:
    """_split_tail of one call of ``units`` CTAs (_bwd_units), each (query blocks x the GQA group) iterations."""
    return _split_tail(plan, mask, deterministic, units, -(-seqlen_q // plan.block_m) * (heads // heads_k))


class PreparedBackward(NamedTuple):
    """A backward launch resolved from a call's metadata alone (:func:`prepare_backward`): the plan (variant,
    kernels), the main kernel's TMA maps' geometry, and for each of the three kernels (pre, main, post, one params
    struct: bwd.py BwdParams) its grid and params but for the fields each call gives (:data:`_BWD_PER_CALL`:
    addresses, the workspace's regions, softmax constants); the workspace's layout and size. Immutable, so calls on
    any thread may share it; :func:`launch_backward` launches it."""

    plan: _BwdPlan
    maps: tuple  # per TMA map of the main kernel (q, k, v, dout, dk, dv): its launch.TensorMapGeometry
    pre: launch.PreparedLaunch  # the preprocess (grid and params but for the per-call fields)
    main: launch.PreparedLaunch
    post: launch.PreparedLaunch  # the postprocess
    workspace: tuple  # byte offsets in the workspace of lse_log2, dpsum, dq_accum, sem, split_tickets, split_parts
    split: bool  # the main grid splits its tail (split_tickets / split_parts point into the workspace; else null)
    nbytes: int  # workspace bytes the launches use (at most backward_workspace_bytes's for the call)


#: The params fields each backward call fills itself, in launch.launch_prepared's order (one tuple of values for
#: the three kernels: they share BwdParams).
_BWD_PER_CALL = ("o", "dout", "lse", "dq", "dk", "dv", "lse_log2", "dpsum", "dq_accum", "sem", "split_tickets",
                 "split_parts", "scale_log2", "softmax_scale", "softcap_scale")
#: A varlen backward's per-call fields after _BWD_PER_CALL (:meth:`BwdVarlen.addresses`).
_BWD_VARLEN_PER_CALL = ("cu_seqlens_q", "cu_seqlens_k")
# metadata key (_bwd_key) -> PreparedBackward (immutable: shared by concurrent calls; bounded by _PREPARED_CACHE_MAX).
# The module's knobs above (split tail, persistent grid, tails, rotation, twins) are read when a key is prepared: a
# script that changes one between calls clears this (and interface._bwd_calls), as scripts/bwd_tail_ab.py does.
_prepared_backwards: dict = {}


def _bwd_key(dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, window_size, softcap, variant,
             varlen: BwdVarlen | None) -> tuple:
    """Everything a PreparedBackward depends on: all but the addresses and the softmax scale."""
    return (dout[1:], q[1:], k[1:], v[1:], out[1:], lse[1:], dq[1:], dk[1:], dv[1:], bool(causal), bool(deterministic),
            window_size if type(window_size) is tuple else tuple(window_size), softcap > 0,
            None if variant is None else variant.name, None if varlen is None else varlen.meta())


def prepare_backward(dout: TensorArg, q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, lse: TensorArg,
                     dq: TensorArg, dk: TensorArg, dv: TensorArg, causal: bool, deterministic: bool,
                     variant: Variant | None = None, *, window_size=(-1, -1), softcap: float = 0.0,
                     softmax_scale: float | None = None, varlen: BwdVarlen | None = None) -> PreparedBackward:
    """The :class:`PreparedBackward` of a backward call (see :func:`attention_backward` for the arguments),
    resolved once per metadata key and cached (bounded).

    Only metadata makes the key: shapes, strides, dtypes and devices of the nine arrays, ``causal``,
    ``deterministic``, ``window_size``, whether ``softcap`` > 0, ``variant``, ``varlen``'s :meth:`BwdVarlen.meta`
    (its offsets' addresses come with each launch). The ``ptr`` fields may be 0 (the addresses come with each
    :func:`launch_backward`, which checks them and the scale on every call). On a new key the checks of
    :func:`attention_backward` run in its order, with the non-zero addresses and ``softmax_scale`` when given, and
    raise what it raises (ValueError for varlen shapes, heads, layouts, addresses, scale, softcap;
    MissingVariantError); a key that raised is not cached. ``nbytes`` of the result: the workspace the launches
    use."""
    key = _bwd_key(dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, window_size, softcap, variant, varlen)
    prep = _prepared_backwards.get(key)
    if prep is None:
        prep = _prepare_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, variant, window_size,
                                 softcap, 1.0 if softmax_scale is None else softmax_scale, varlen)
        launch.cache_put(_prepared_backwards, key, prep, _PREPARED_CACHE_MAX)
    return prep


def _prepare_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, variant, window_size, softcap,
                      softmax_scale, varlen: BwdVarlen | None) -> PreparedBackward:
    """Check a backward call (attention_backward's checks, in its order) and resolve its PreparedBackward."""
    total_q = 0
    if varlen is not None:  # (_batch_of_one: ValueError naming an array that is not 3-D)
        dout, q, k, v, out, dq, dk, dv = (_batch_of_one(name, t) for name, t in (
            ("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk), ("dv", dv)))
        total_q = q.shape[1]
        if (tuple(lse.shape) != (q.shape[2], total_q) or lse.dtype != "fp32"
                or tuple(lse.strides) != (total_q, 1)):
            raise ValueError(f"flashgen: with varlen, lse must be fp32 (heads, total_q) = {(q.shape[2], total_q)} "
                             f"contiguous, got {lse.dtype} {lse.shape} strides {lse.strides}")
        if not 1 <= varlen.batch <= MAX_VARLEN_BWD_SEQUENCES or varlen.max_seqlen_q < 1 or varlen.max_seqlen_k < 1 \
                or not (varlen.cu_seqlens_q and varlen.cu_seqlens_k):
            raise ValueError(f"flashgen: varlen needs cu_seqlens_q, cu_seqlens_k, batch in [1, "
                             f"{MAX_VARLEN_BWD_SEQUENCES}] and max_seqlen_q, max_seqlen_k >= 1, got {varlen}")
        if varlen.zero_tail and not all(is_c_contiguous(t.shape, t.strides) for t in (dq, dk, dv)):
            raise ValueError("flashgen: varlen.zero_tail needs contiguous dq, dk, dv (their rows past the last "
                             "sequence are zeroed as one range each)")
    _, sq, h, d = q.shape
    _, sk, hk, dv_dim = v.shape
    b = q.shape[0]
    if varlen is not None:
        b, sq, sk = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    if h % hk:
        raise ValueError(f"flashgen: heads ({h}) must be a multiple of heads_k ({hk})")
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        _check_tma(name, t)
    mask = mask_spec(causal, window_size, sq, sk)
    softmax_constants(softmax_scale, softcap)  # the checks only: the constants are per call
    plan = _bwd_plan(q.dtype, max(d, dv_dim), mask, softcap > 0, q.device, variant, sq, deterministic,
                     varlen is not None)
    bm, bn = plan.block_m, plan.block_n
    num_m, num_n = -(-sq // bm), -(-sk // bn)
    grid_n = _bwd_grid_n(plan, sk)
    units = _bwd_units(plan, b, hk, sk)
    # (varlen variants: no persistent grid or split tail, bwd.py; no unordered tail or rotation: kept simple)
    persistent = _persistent_units(plan, mask, deterministic, units, num_m * (h // hk)) if varlen is None else 0
    split_units, split_pieces = ((0, 1) if persistent or varlen is not None
                                 else _call_split(plan, mask, deterministic, units, sq, h, hk))
    nbytes, offsets = _bwd_workspace(plan, b, sq, h, (split_units, split_pieces), None if varlen is None else total_q)
    ordered = _ordered_default(plan, mask, sk)
    params = {  # all but the per-call fields (_BWD_PER_CALL, and a varlen call's _BWD_VARLEN_PER_CALL)
        "o_stride_batch": out.strides[0], "o_stride_seq": out.strides[1], "o_stride_head": out.strides[2],
        "do_stride_batch": dout.strides[0], "do_stride_seq": dout.strides[1], "do_stride_head": dout.strides[2],
        "dq_stride_batch": dq.strides[0], "dq_stride_seq": dq.strides[1], "dq_stride_head": dq.strides[2],
        "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_k": hk, "batch": b, "head_dim": d, "head_dim_v": dv_dim,
        "seqlen_q_pad": num_m * bm if varlen is None else _varlen_rows_pad(plan, b, total_q),
        "num_m_blocks": num_m, "num_slices": plan.num_slices,
        "deterministic": _deterministic_mode(deterministic, num_n, plan.sms, ordered),
        "window_left": mask.left, "window_right": mask.right,
        "unordered_tail": (_unordered_tail(plan, deterministic, ordered, mask.causal, grid_n, b * hk)
                           if varlen is None else 0),
        "rotate": int(ROTATE_UNORDERED and not deterministic and not mask.causal and not mask.local and not persistent
                      and plan.block_n == 128 and num_n <= num_m and num_m >= ROTATE_UNORDERED_MIN_M_BLOCKS
                      and varlen is None),
        "split_whole": units - split_units, "split_units": split_units, "split_pieces": split_pieces,
        "persistent_units": persistent,
        # varlen (bwd.cu.j2 kVarlen): the sequences (their offsets per call), and dk, dv stored from registers
        # (their rows bounded)
        "cu_seqlens_q": 0, "cu_seqlens_k": 0,
        "dk_stride_seq": dk.strides[1], "dk_stride_head": dk.strides[2],
        "dv_stride_seq": dv.strides[1], "dv_stride_head": dv.strides[2], "total_q": total_q,
        "total_k": dk.shape[1] if varlen is not None else 0,
        "zero_tail": int(varlen is not None and varlen.zero_tail),
    }
    (params["unit_x_mul"], params["unit_x_shift"]), (params["unit_y_mul"], params["unit_y_shift"]) = (
        (fast_div(grid_n), fast_div(plan.num_slices * hk)) if persistent else ((0, 0), (0, 0)))
    per_call = _BWD_PER_CALL if varlen is None else _BWD_PER_CALL + _BWD_VARLEN_PER_CALL
    geometry = launch.map_geometry
    maps = tuple(geometry(*_bshd_map_spec(t, rows)) for t, rows in ((q, bm), (k, bn), (v, bn), (dout, bm), (dk, 64),
                                                                   (dv, 64)))
    # the split tail's extra pieces in planes past the batch's (GridCta: the CTAs past the last piece idle)
    extra = -(-split_units * (split_pieces - 1) // (grid_n * plan.num_slices * hk))
    grid = (plan.sms, 1, 1) if persistent else (grid_n, plan.num_slices * hk, b + extra)
    post_grid = (2 * -(-sq // 16), h, b)  # 2 CTAs per 16 rows (bwd.cu.j2)
    prepare = launch.prepare_launch
    return PreparedBackward(plan, maps, prepare(plan.pre, (-(-num_m * bm // plan.pre_rows), h, b), params, per_call),
                            prepare(plan.main, grid, params, per_call), prepare(plan.post, post_grid, params, per_call),
                            offsets, split_units > 0, nbytes)


def launch_backward(prep: PreparedBackward, dout_ptr: int, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int,
                    lse_ptr: int, dq_ptr: int, dk_ptr: int, dv_ptr: int, workspace_ptr: int, softmax_scale: float,
                    softcap: float, stream: int, varlen: tuple = ()) -> Variant:
    """Launch a :class:`PreparedBackward` on arrays with its metadata at these device addresses (dout, q, k, v,
    out, lse, dq, dk, dv; ``workspace_ptr``: ``prep.nbytes`` of device memory, 256-byte aligned, any contents;
    ``varlen``: a varlen call's :meth:`BwdVarlen.addresses`, as its prepare_backward was given a BwdVarlen) on
    ``stream``; returns the variant. The per-call work of :func:`attention_backward`: ValueError for an array's
    address TMA cannot use (not 16-byte aligned), a workspace_ptr not 256-byte aligned (the kernels' vector
    accesses to its regions would fault, a sticky error of the context) or a bad softmax_scale / softcap, then the
    preprocess, the main kernel's TMA maps (cached by address) and the main kernel, the postprocess (CudaError if a
    launch fails)."""
    if (dout_ptr | q_ptr | k_ptr | v_ptr | out_ptr | dq_ptr | dk_ptr | dv_ptr) % TMA_ALIGN_BYTES:
        _raise_misaligned(dout=dout_ptr, q=q_ptr, k=k_ptr, v=v_ptr, out=out_ptr, dq=dq_ptr, dk=dk_ptr, dv=dv_ptr)
    w = _workspace_address(workspace_ptr)
    scale = float(softmax_scale)
    scale_log2, softcap_scale = softmax_constants(scale, softcap)
    o_lse, o_dpsum, o_acc, o_sem, o_tickets, o_parts = prep.workspace
    split = prep.split
    values = (out_ptr, dout_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, w + o_lse, w + o_dpsum, w + o_acc, w + o_sem,
              w + o_tickets if split else 0, w + o_parts if split else 0, scale_log2, scale, softcap_scale, *varlen)
    launch_prepared = launch.launch_prepared
    launch_prepared(prep.pre, (), values, stream)
    at = launch.tensor_map_at
    mq, mk, mv, mdo, mdk, mdv = prep.maps
    launch_prepared(prep.main, (at(mq, q_ptr), at(mk, k_ptr), at(mv, v_ptr), at(mdo, dout_ptr), at(mdk, dk_ptr),
                                at(mdv, dv_ptr)), values, stream)
    launch_prepared(prep.post, (), values, stream)
    return prep.plan.variant


def attention_backward(dout: TensorArg, q: TensorArg, k: TensorArg, v: TensorArg, out: TensorArg, lse: TensorArg,
                       dq: TensorArg, dk: TensorArg, dv: TensorArg, softmax_scale: float, causal: bool,
                       deterministic: bool, stream: int, workspace_ptr: int, variant: Variant | None = None, *,
                       window_size=(-1, -1), softcap: float = 0.0, varlen: BwdVarlen | None = None) -> Variant:
    """Launch the FA3 backward: dq, dk, dv of ``out = softmax(logits [+ mask]) v``.

    Method: FlashAttention-2/3's backward (arXiv 2307.08691 Algorithm 2; FA3 arXiv 2407.08608 and
    its hopper/ kernels): P is recomputed from the forward's LSE, dS = P ∘ (dP - rowsum(dO ∘ O)),
    dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K; three kernels (templates/bwd.cu.j2).

    q, dq: (batch, seqlen_q, heads, head_dim); dout, out: (batch, seqlen_q, heads, head_dim_v); k,
    dk: (batch, seqlen_k, heads_k, head_dim); v, dv: (batch, seqlen_k, heads_k, head_dim_v); all of
    q's dtype (fp16/bf16) and TMA-addressable (last dim contiguous, other strides and base 16-byte
    aligned); lse fp32 (batch, heads, seqlen_q) contiguous (the forward's). head_dim_v may differ
    from head_dim (e.g. DeepSeek's 192 / 128): the call runs on the bwd variant of max(head_dim,
    head_dim_v) (rounded up to a built size, as FA3), Q, K and their gradients at head_dim
    columns, V, dO and dV at head_dim_v (TMA zero-fills the columns past each tensor's width and
    drops stores past it).
    batch, seqlen_q, seqlen_k >= 1. dk/dv of a GQA group are summed over its query heads.
    ``workspace_ptr``: :func:`backward_workspace_bytes` of device memory, 256-byte aligned, any
    contents, alive until the kernels have run (stream order). ``deterministic``: dQ's fp32
    additions happen in a fixed order, so results are bitwise reproducible. ``causal``,
    ``window_size``, ``softcap``: the forward's (:func:`attention_forward`); with softcap, dS is
    scaled by the tanh's derivative. A learnable sink needs nothing here (lse includes it); its
    gradient is ``-sum_rows exp(sink - lse) * rowsum(dout * out)``, left to the caller.

    ``varlen`` (:class:`BwdVarlen`; FA3's varlen backward, on the varlen variants: bwd.cu.j2 kVarlen): the
    sequences packed along the token dim: q, dq ``(total_q, heads, head_dim)``; dout, out ``(total_q, heads,
    head_dim_v)``; k, dk ``(total_k, heads_k, head_dim)``; v, dv ``(total_k, heads_k, head_dim_v)``; lse fp32
    ``(heads, total_q)`` contiguous (the varlen forward's); the workspace :func:`backward_workspace_bytes` with
    ``varlen_total_q``. Each sequence is one attention with the masks bottom-right aligned on its own lengths. The
    kernels write dq, dk, dv in the sequences' rows only, and with ``varlen.zero_tail`` zero the rows past the last
    sequence (otherwise the caller does; the rows just past a sequence are read and zeroed in shared memory,
    :class:`BwdVarlen`).
    Launches on ``stream``; never synchronises. Raises MissingVariantError (no variant),
    ValueError (layouts, heads, addresses, softmax_scale / softcap, varlen shapes).

    Host cost: :func:`prepare_backward` (what the metadata decides: checks, mask, variant, split / persistent
    grids, workspace layout, the three kernels' params, TMA map geometry) runs once per metadata key; each call
    then does :func:`launch_backward` (alignment, softmax constants, TMA maps by address, three launches).
    """
    prep = prepare_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, deterministic, variant,
                            window_size=window_size, softcap=softcap, softmax_scale=softmax_scale, varlen=varlen)
    return launch_backward(prep, dout.ptr, q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, dq.ptr, dk.ptr, dv.ptr,
                           workspace_ptr, softmax_scale, softcap, stream, () if varlen is None else varlen.addresses())
