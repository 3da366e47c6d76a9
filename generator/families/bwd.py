"""The ``bwd`` family: FlashAttention-3 backward, fp16/bf16 (arXiv 2407.08608, §3 and FA3's
``hopper/`` backward: one CTA per K/V block, five WGMMA GEMMs per query block).

Template: templates/bwd.cu.j2. Three kernels per variant, launched in order on one stream:

- ``pre``: dPsum = rowsum(dO ∘ O) in fp32 (over head_dim_v columns), LSE scaled to log2 (an
  empty row's -inf becomes +inf, so its recomputed P is 0), the fp32 dQ accumulator and the
  deterministic-mode semaphores zeroed. Deterministic runs store each dQ tile's first share in the
  order instead of adding it (a bulk copy from the staging tiles, plain vector stores where the
  consumers add dQ themselves), so there the preprocess zeroes only the query blocks that no key
  block visits (the zeros were
  the accumulator's size in DRAM writes: with the hand-off's lighter fence, the deterministic
  backward ran 1.05-1.26x faster on an H100, docs/PERF.md).
  Rows past seqlen_q up to the padded length get dPsum 0 and LSE +inf. Each row takes
  ``pre_row_lanes`` lanes (several rows per warp below head_dim 192), so every head dim keeps as
  many loads in flight per SM, and each lane group takes ``PRE_GROUP_ROWS`` rows, their loads
  issued together. Causal calls with seqlen_k <= 512 (2048 with ``ds_pairs``) take the ordered path even when
  not deterministic where dQ is bulk-reduced (``bulk_dq``; ``core._ordered_default``: measured
  faster, no zeroing).
- ``main``: CTA (n_block, slice, head_k, batch). A producer warp loads the CTA's K and V block once
  and streams Q, dO (TMA) and LSE, dPsum (bulk copies) per query block through a ``stages``-deep
  mbarrier ring, over every query head of the K/V head's group (GQA/MQA: dK and dV are summed
  over the group in registers, in a fixed order). Two consumer warpgroups own 64 key rows each:
  S^T = K Q^T and dP^T = V dO^T (SS-WGMMA, K-major), P^T = exp2(S^T * scale_log2 - LSE_log2),
  dS^T = P^T ∘ (dP^T - dPsum), dV += P^T dO and dK += dS^T Q (RS-WGMMA; at block_n 128 each 16-row
  k-step issued as soon as its P^T / dS^T columns are packed, ``dkv_steps``, so the tensor cores run
  under the exponentials: H200 +1-6 %), dS^T staged in shared memory, dQ = dS K (SS-WGMMA, both
  operands MN-major). Each consumer's 64 x 64 fp32 dQ tile goes
  to shared memory and a reducer warp of the producer warpgroup adds it to the fp32 accumulator
  with one bulk reduction (``cp.reduce.async.bulk .add.f32``, 16 KB); where shared memory has no
  room for both consumers' staging tiles (the role tiles), dQ is staged in the ring buffers
  instead (``stage_dq``, below). (A single staging tile the consumers take turns on
  measured about 5 % faster at head_dim 256, but its ordering runs through the reducer warp's two
  split arrive/sync barriers, which compute-sanitizer's racecheck does not follow: it reported
  write-write races there. It was dropped.) The accumulator holds 64 x 64 tiles in WGMMA fragment order, so either way each
  addition is contiguous. With ``deterministic``, per-(batch, head, m_block, slice) semaphores
  order the additions across CTAs. dK (times softmax_scale) and dV are TMA-stored through the
  K/V buffers.
- ``post``: dQ = dQ_accum * softmax_scale, cast to the input dtype; the last (batch, head) first, since
  the main grid ended on them and the L2 may still hold their accumulator tiles (measured on an
  H200: deterministic runs 1.001-1.008x at 11 of 12 points, the default within its spread; docs/PERF.md).

``main`` and ``post`` are programmatic dependents (``KernelSpec.pdl``) of the kernel before each:
``pre`` and ``main`` let them launch from their first instruction
(``cudaTriggerProgrammaticLaunchCompletion``), so ``main``'s CTAs take the SMs that ``pre``'s last wave
leaves, init their barriers and load their K and V block with the first query block's Q and dO (on
K's and V's barriers; the consumers' first S^T GEMM waits for K and Q only) while ``pre`` finishes,
and wait (``cudaGridDependencySynchronize``: ``pre`` complete, its writes visible) before anything
that reads what ``pre`` writes (LSE, dPsum, the semaphores, the accumulator); ``post`` waits likewise
before it reads the accumulator. Each kernel's completion therefore still follows the one before it.
Measured on an H200: +0.7-0.9 % at seqlen 512 for head_dim 64 / 128 (3-4 us a call), level elsewhere.
The block_n 128 tiles issue those loads in the prologue, right after K's and V's barriers are
initialised (before the CTA barrier and setmaxnreg); a CTA's start, entry to its first K and Q
landed, is then 1.6-2.1 us at head_dim 128 on an H200, 0.3-0.5 us less than when the producer
issued them (docs/results/bwd_prologue_issue/).

Masks and softcap, as in the forward family: ``causal`` or ``local`` (a band with runtime
bounds: sliding windows; a CTA visits only the query blocks its key block's band reaches),
``softcap`` variants recompute t = tanh(S * softcap_scale), P = exp2(t *
scale_log2 - LSE_log2) and scale dS by the tanh's derivative 1 - t^2 (FA3's softcap backward).
Learnable sinks need nothing here: the forward's LSE includes the sink, and its gradient is
-sum(exp(sink - LSE) * dPsum), computed by the caller.

Slices (block_n 128): the dK/dV/dQ columns a CTA produces (``slice`` of head_dim_padded). The dK
and dV accumulators of 64 key rows x slice columns must fit in a consumer's registers beside S^T
and dP^T; head dims above 128 could split into slices, each CTA recomputing S^T and dP^T over the
full head_dim (7/5 of the GEMM work at 256, 9/5 at 192). The dQ GEMM of a consumer is 64 x 64:
with block_m 64 each consumer takes half the slice's columns (slice 128), with block_m 128 each
takes 64 query rows of a 64-column slice.

block_m 80 (``dq_swap``; FA3's tile for non-causal head_dim 128, configs/bwd.yaml ``extra``, served
from seqlen_q >= ``core.DQ_SWAP_MIN_SEQLEN_Q``): S^T and dP^T are m64n80, dV and dK take 5 k-steps of
16 query rows, and since 80 rows are no m64 WGMMA's M, each consumer computes dQ^T = K^T dS^T over
64 of the slice's columns (M) and the block's 80 rows (N); dS^T is kept in the 32-byte swizzle
(16-column chunks: 20 KB, so two buffers fit). Its fp32 tiles are dQ^T in m64n80 fragment order,
which the postprocess reads transposed. Measured on an H200: the deterministic backward 1.04-1.05x
from seqlen 2k on (a query block's ordered hand-offs are spread over 80 rows), the default level
(docs/PERF.md).

Role tiles (block_n 64, block_m 64, slice = head_dim_padded; the default at head_dim 192 and 256):
both consumers work on the CTA's 64 key rows, split by role rather than rows, so every GEMM is
done once. Consumer 0 computes S^T, P^T and dV += P^T dO, and hands P^T (times 1 - tanh^2 with
softcap: all dS^T needs of it) to consumer 1 through shared memory in the input dtype (the P that
dV's GEMM takes; fp32 until 2026-11-22, half the bytes now), in accumulator
fragment order (``pd``); consumer 1 computes dP^T, dS^T (staged for dQ) and dK += dS^T Q. Each then
computes dQ = dS K over half of its columns (96 or 128, in GEMMs of at most 64 columns that stay
inside K's 64-column swizzle chunks: 64 + 32 and 32 + 64 at head_dim 192). One accumulator
of 64 x head_dim per consumer: 128 registers at 256, where dK and dV together would not fit.
block_n 64 doubles the dQ additions per key of block_n 128 (one per 64 keys): they are staged in
the Q and dO ring buffers themselves, each consumer writing its fp32 half (exactly a ring tile's
bytes: 32 KB at head_dim 256, 24 KB at 192) into the buffer whose last reader it is (consumer 0:
dO's, after dV; consumer 1: Q's, after dK), and the reducer warp adds each half with one bulk
reduction (contiguous in the accumulator: DqTile keeps each 8-column group of a 64-row block
together) and only then releases
the buffer to the loads (the empty barriers count its arrival too). Measured on an H200
(docs/PERF.md): no dQ additions at all 547 TFLOP/s at 16k, the consumers' ``red.v4`` 377, the
staging alone (bulk reductions dropped) 442, staged 418-425; the staging's cost is shared-memory
bandwidth (64 KB written and read per block beside ~256 KB of operand reads). On an H100 (2026-11-23,
docs/PERF.md) half of the bulk reductions dropped made the hd256 default 1.16-1.21x faster: the L2's
additions bound it; 2-CTA clusters summing dQ through distributed shared memory first lost
(0.85-0.94). At head_dim 256 (not local) the role tiles now run as 2-CTA clusters that exchange dS^T
instead (``ds_pairs``, below): each CTA stages and reduces half of dQ, 1.09-1.20x faster unordered
(H100, docs/PERF.md). The block's target reaches the reducer warp through a per-stage slot (the
producer warpgroup's 32 registers).
Deterministic: ``BwdParams.deterministic`` 1 and 3 signal a block's hand-off once its additions
have landed; 2 (``core._deterministic_mode``: the chain of key blocks longer than the SM count) one
block later, after the next block's reductions are issued (at 16k 1.07-1.15x faster; at
512-2k, where all of a chain's CTAs start together, it delays each CTA by a block: 0.76-0.87x).
3 (chains of at most half the SM count, resident together) changes the non-causal order: key
blocks visit the query blocks rotated, each from its own index on, so no CTA waits for the
hand-offs of every CTA before it in the chain (causal runs as 1).
Short causal calls take the ordered path by default (``core._ordered_default``), whose key blocks
run shortest first, so the grid would end on its last groups' longest CTAs: there the last
(batch, head_k) groups, about one wave of CTAs (``BwdParams.unordered_tail``,
``core.UNORDERED_TAIL_WAVES``), run unordered and longest first across them (the template's
``GridCta``; their dQ accumulator zeroed by the preprocess): 1.02-1.04x at hd128-256 causal
512-2k on an H200 (docs/PERF.md).

``varlen`` (FA3's varlen backward; the template's kVarlen; flash_attn_varlen_func's gradients): q, k, v, out, dout
and the gradients packed along their token dim (one batch entry), sequence b in rows [cu_seqlens_q[b],
cu_seqlens_q[b + 1]) of q and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k. The three grids' z is the sequence and
their x covers the longest one (BwdParams.seqlen_q / seqlen_k); a CTA past its sequence's rows or keys returns, and
the masks are each sequence's own (bottom-right aligned on its lengths). The workspace holds one plane of
(heads, seqlen_q_pad) rows, sequence b's from block_m (cu_seqlens_q[b] // block_m + b) on (FA3's padding of each
sequence to the block), so no query block's dQ tiles reach another sequence's rows; the rows past a sequence's end
get LSE +inf and dPsum 0. dK and dV are stored from registers with the sequence's rows as bound (a 64-row TMA store
would write into the next sequence's). The loads read the rows just past a sequence's end from its neighbour, as
FA3's do (P = 0 and dS = 0 there: finite values add nothing). The plain tiles only: no ds_pairs (head_dim 256 runs
its role tiles unpaired), split tail, persistent grid or block_m 80; no unordered tail or rotation (core). The
deterministic modes order each sequence's dQ additions by its own key blocks. Written without a GPU (session
2026-12-05 (3)); core.VARLEN_BWD_KERNEL keeps the interface off it until its GPU tests pass.

head_dim_v != head_dim (e.g. DeepSeek's 192 / 128): no key of its own. As FA3 does, the runtime
serves the call with the variant of max(head_dim, head_dim_v) (``BwdParams.head_dim`` and
``head_dim_v`` carry the real sizes): the TMA maps of Q, K, dK have head_dim columns and those of
V, dO, dV head_dim_v, so the zero-filled columns add nothing to S^T = K Q^T or dP^T = V dO^T, and
the dK / dV stores drop the columns past their maps (a slice wholly past them is not stored).

Feasibility (checked before anything is rendered):

- head_dim in {64, 96, 128, 192, 256} (P = head_dim padded to 64; TMA zero-fills the padding).
- block_n = 128 (2 consumer warpgroups x 64 key rows): (block_m, slice) in {(64, 128), (80, 128),
  (128, 64)}, slice divides P; registers: S^T and dP^T (block_m/2 each) plus dK and dV (slice/2 each)
  <= 240 - 48 per consumer thread (240 - 32 at block_m 80: 208, as FA3's 80 x 128 tile).
- block_n = 64 (role tiles): block_m = 64, slice = P; registers: S^T or dP^T (block_m/2) plus dV or
  dK (P/2) plus one 32-register dQ piece <= 232 - 8.
- Shared memory: K and V (block_n x P each), stages x (Q and dO, block_m x P each, and LSE and
  dPsum, block_m fp32 each), ds_buffers x dS^T (block_n x block_m), dq_buffers x 16 KB (block_m 80:
  20 KB) of dQ staging, the role tiles' 16-bit P^T (64 x block_m), 512 bytes of mbarriers (and slots) and 1024 of
  alignment slack <= 227 KB. dS^T is double-buffered
  when that fits (one fewer barrier per query block); dQ staging is 2 buffers (one per consumer)
  or none (the consumers' own reductions).
"""
from __future__ import annotations

from ..abi import params_struct
from . import Family, Key, KernelSpec

SMEM_LIMIT = 232448  # 227 KB: the sm_90 per-block opt-in maximum of dynamic shared memory
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = ("bf16", "fp16")
ELEM = 2
BLOCK_N = 128
ROLES_BLOCK_N = 64  # block_n 64: the two consumers split the work by role (see the module docstring)
CONSUMER_WGS = 2
TILES = ((64, 128), (128, 64), (80, 128))  # (block_m, slice) with block_n 128
DQ_SWAP_BLOCK_M = 80  # block_m 80: dQ^T = K^T dS^T (dq_swap); FA3's non-causal head_dim 128 tile
STAGES = (1, 2)
BARRIER_BYTES = 512  # mbarriers (15 at most) and the role tiles' dQ slots (2 x 24 bytes)
ALIGN_SLACK_BYTES = 1024
PRODUCER_REGS, CONSUMER_REGS = 24, 240
# The role tiles' producer warpgroup also runs the staged dQ's reducer warp, whose loop (with the
# loads' state live beside it) does not fit 24 registers: 32 / 232 (128 x 32 + 256 x 232 <= 65536).
ROLES_PRODUCER_REGS, ROLES_CONSUMER_REGS = 32, 232
REG_HEADROOM = 48
# block_m 80 (dq_swap): 208 accumulator registers, as FA3's 80 x 128 tile holds in its 240; ptxas's
# spill check (generator/ptxas.py) is the real bound.
DQ_SWAP_REG_HEADROOM = 32
ROLES_REG_HEADROOM = 8  # the role tiles' consumers hold fewer live arrays beside their accumulators
PRE_POST_THREADS = 256  # the preprocess: pre_rows_per_cta rows per CTA; the postprocess: 4 row pairs per CTA

PARAMS = params_struct(
    "BwdParams",
    ("o", "ptr", "const void*"),  # (batch, seqlen_q, heads, head_dim_v), q's dtype
    ("dout", "ptr", "const void*"),  # same shape and dtype
    ("lse", "ptr", "const float*"),  # (batch, heads, seqlen_q) fp32 contiguous, natural log
    ("lse_log2", "ptr", "float*"),  # workspace (batch, heads, seqlen_q_pad)
    ("dpsum", "ptr", "float*"),  # workspace (batch, heads, seqlen_q_pad)
    ("dq_accum", "ptr", "float*"),  # workspace (batch, heads, seqlen_q_pad, head_dim_padded)
    ("sem", "ptr", "int*"),  # workspace (batch, heads, num_m_blocks, num_slices)
    ("dq", "ptr", "void*"),  # (batch, seqlen_q, heads, head_dim), q's dtype
    ("o_stride_batch", "i64"), ("o_stride_seq", "i64"), ("o_stride_head", "i64"),
    ("do_stride_batch", "i64"), ("do_stride_seq", "i64"), ("do_stride_head", "i64"),
    ("dq_stride_batch", "i64"), ("dq_stride_seq", "i64"), ("dq_stride_head", "i64"),
    ("seqlen_q", "i32"),
    ("seqlen_k", "i32"),
    ("heads", "i32"),
    ("heads_k", "i32"),  # divides heads (GQA/MQA)
    ("batch", "i32"),
    ("head_dim", "i32"),  # the real head_dim of q and k (a multiple of 8)
    ("head_dim_v", "i32"),  # the real head_dim_v of v, o and dout (a multiple of 8)
    ("seqlen_q_pad", "i32"),  # num_m_blocks * block_m
    ("num_m_blocks", "i32"),
    ("num_slices", "i32"),  # head_dim_padded / slice
    ("deterministic", "i32"),  # 1, 2, 3: dQ additions in a fixed order (bitwise reproducible); 2: hand-off signalled one block late; 3: the rotated non-causal order (core._deterministic_mode)
    ("scale_log2", "f32"),  # softmax_scale * log2(e), any sign; softcap variants: softcap * log2(e)
    ("softmax_scale", "f32"),
    ("softcap_scale", "f32"),  # softcap variants: softmax_scale / softcap (any sign); else unused
    ("window_left", "i32"),  # local variants: the forward's band (fwd.py); both >= 0
    ("window_right", "i32"),
    ("unordered_tail", "i32"),  # ordered default runs: the last (batch, head_k) groups of the main grid's launch order that run unordered, longest first (core._unordered_tail; bwd.cu.j2 GridCta); else 0
    ("rotate", "i32"),  # unordered non-causal runs: key block n visits the query blocks from block n on, as mode 3 (core.ROTATE_UNORDERED)
    ("split_whole", "i32"),  # split tail (core._split_tail; bwd.cu.j2 kSplitTail): the main grid's units (CTAs of launch order) before the split ones
    ("split_units", "i32"),  # the last units of the launch order, each run as split_pieces CTAs over parts of its query blocks; 0: none
    ("split_pieces", "i32"),  # >= 1
    ("split_parts", "ptr", "float*"),  # workspace (split_units, split_pieces, 2 consumers, 2 (dK, dV), 64 * slice): the pieces' fp32 partial sums
    ("split_tickets", "ptr", "int*"),  # workspace (split_units,): pieces done per unit; zeroed by the preprocess
    ("unit_x_mul", "u32"), ("unit_x_shift", "u32"),  # persistent calls: core.fast_div of the key blocks (bwd.cu.j2 unit_cta)
    ("unit_y_mul", "u32"), ("unit_y_shift", "u32"),  # and of num_slices x heads_k
    ("persistent_units", "i32"),  # persistent variants (bwd.cu.j2 kPersistent): > 0, the units (CTAs of the plain grid) that a grid of one CTA per SM runs in turn; 0: one unit per CTA
    # varlen variants only (bwd.cu.j2 kVarlen; null / 0 otherwise): q, k, v, o, dout, dq, dk, dv packed along their
    # token dim (batch entry 0), sequence b in rows [cu_seqlens[b], cu_seqlens[b + 1]); batch: the sequences;
    # seqlen_q / seqlen_k: the longest; lse (heads, total_q); the workspace's rows padded per sequence
    # (seqlen_q_pad: block_m x (ceil(total_q / block_m) + batch), one (batch 0) plane; bwd.cu.j2 bwd_seq)
    ("cu_seqlens_q", "ptr", "const int*"),  # int32 (batch + 1,)
    ("cu_seqlens_k", "ptr", "const int*"),  # int32 (batch + 1,)
    ("dk", "ptr", "void*"),  # (total_k, heads_k, head_dim), stored from registers (rows bounded per sequence)
    ("dv", "ptr", "void*"),  # (total_k, heads_k, head_dim_v)
    ("dk_stride_seq", "i64"), ("dk_stride_head", "i64"),
    ("dv_stride_seq", "i64"), ("dv_stride_head", "i64"),
    ("total_q", "i32"),  # q's rows: lse's stride between heads
    ("total_k", "i32"),  # k's rows
    ("zero_tail", "i32"),  # 1: the preprocess zeroes dq's, dk's, dv's rows past the last sequence (bwd.cu.j2)
)


def _pad64(x: int) -> int:
    return -(-int(x) // 64) * 64


def dq_swap(params: dict) -> bool:
    """Whether the consumers compute dQ transposed (the template's kDqSwap): block_m 80 (FA3's tile
    for non-causal head_dim 128, 80 x 128). An m64 WGMMA cannot take 80 query rows as M, so each
    consumer computes dQ^T = K^T dS^T over 64 of the slice's columns (M) and the block's 80 query
    rows (N), both operands MN-major as stored (K's column chunk, dS^T in the 32-byte swizzle's
    16-column chunks). Its fp32 tile (64 columns x 80 rows, m64n80 fragment order) is staged and
    bulk-reduced as the 64 x 64 tiles of block_m 64 are; the postprocess reads it transposed.
    Per query block the fixed costs (barriers, LSE / dPsum, the dQ hand-off) are spread over 25 %
    more rows than at block_m 64."""
    return int(params["block_m"]) == DQ_SWAP_BLOCK_M


def dq_tile_bytes(params: dict) -> int:
    """One consumer's fp32 dQ tile: 64 x 64, or (dq_swap) 64 columns x block_m rows."""
    return 64 * (int(params["block_m"]) if dq_swap(params) else 64) * 4


def pre_row_lanes(params: dict) -> int:
    """Lanes per query row in the preprocess: one 16-byte load of O and of dO per lane over the
    row's head_dim padded to 64 (8 at 64, 16 at 128, 32 from 192 on, the lanes of a warp being a
    power of two). Several rows share a warp below 256 columns, so that as many bytes are in flight
    per SM at every head dim: one warp per row left hd64 at half the DRAM bandwidth (130 against
    69-78 us on an H200, docs/PERF.md)."""
    p = _pad64(params["head_dim"])
    return 8 if p == 64 else 16 if p == 128 else 32


PRE_GROUP_ROWS = 2  # query rows per lane group in the preprocess, their loads issued together


def pre_rows_per_cta(params: dict) -> int:
    """Query rows per CTA of the preprocess (its grid is seqlen_q_pad / this, rounded up): PRE_GROUP_ROWS
    per group of pre_row_lanes lanes; divides 64. With block_m 80 the last CTA may reach past
    seqlen_q_pad (its rows there store nothing)."""
    return PRE_GROUP_ROWS * PRE_POST_THREADS // pre_row_lanes(params)


def stage_dq(params: dict) -> bool:
    """Whether the consumers stage their fp32 dQ in the Q/dO ring tiles for the reducer warp's bulk
    reductions (the template's kStageDq): every role tile. Each consumer's half of dQ (64 x
    head_dim padded / 2 floats) is exactly a 64 x head_dim padded 16-bit ring tile, at head_dim 192
    (96 columns each) as at 256 (128). (Earlier dQ went in 64-column chunks, two of which do
    not fit head_dim 192's 24 KB tile, and its consumers added dQ with red.global.add.v4.f32.)"""
    return roles(params)


def ds_pairs(params: dict) -> bool:
    """Whether the main kernel runs as 2-CTA clusters of neighbouring key blocks that exchange
    their dS^T tiles (the template's kPairs): the role tiles at head_dim 256, not local. On a query
    block both visit, CTA r of a pair computes dQ's columns [128 r, 128 r + 128) over both blocks'
    128 keys (its own dS^T and K, the peer's dS^T, copied into this CTA's P^T buffer by a bulk copy
    between the CTAs' shared memories, and the peer's K columns, loaded once) and reduces only
    those: half the L2's fp32 dQ additions and half the dQ staging, at the cost of the peer's K
    half (16 KB, which fills the 227 KB exactly) and one exchange per block. The L2 additions bound
    the hd256 backward (an H100 ran 1.16-1.21x faster with half of them dropped, docs/PERF.md).
    A CTA whose neighbour is past the last key block does not pair. Ordered runs pair too: a column
    half takes one addition per pair, in turns of pairs (H100: the deterministic hd256 backward
    1.13-1.30x faster than unpaired, docs/results/bwd_det_pairs/)."""
    return (roles(params) and _pad64(params["head_dim"]) == 256 and not params.get("local", False)
            and not params.get("varlen", False))


# The role tiles' k-steps of K (consumer 0) and of V (consumer 1) held in registers, by padded head_dim
# (kv_reg_steps); head dims not listed hold none.
KV_REG_STEPS = {192: (12, 12), 256: (5, 5)}


def kv_reg_steps(params: dict) -> tuple:
    """The template's (kKRegSteps, kVRegSteps): how many of the 16-column k-steps of K (consumer 0) and
    of V (consumer 1) the role tiles' consumers hold in registers across blocks (4 registers each per
    thread) and issue as RS-WGMMA in their S^T = K Q^T and dP^T = V dO^T GEMMs. Those GEMMs have
    N = block_m = 64: as SS-WGMMA they read A and B from shared memory at its full bandwidth
    (128 B/clk), which the role tiles share with their other traffic; every k-step held halves that
    k-step's reads (H200: +1 % at head_dim 256, up to +2.5 % at 192; docs/results/bwd_kv_regs/).
    (0, 0): not a role tile, or a head_dim not in KV_REG_STEPS. The bound is the consumers'
    registers: at head_dim 256 dK or dV's 128 beside S^T's or dP^T's 32 leave room for 5 of the 16
    k-steps (6 in either consumer spilled, 8 serialized the WGMMAs); at head_dim 192 (96) all 12 fit."""
    return KV_REG_STEPS.get(_pad64(params["head_dim"]), (0, 0)) if roles(params) else (0, 0)


def split_tail(params: dict) -> bool:
    """Whether the main kernel can run its grid's last partial wave split (the template's kSplitTail;
    the runtime's core._split_tail picks per call): each unit of it as several CTAs over parts of its
    query blocks, whose fp32 dK / dV partial sums the unit's last piece adds. The block_n 128 tiles
    without a mask on whole blocks (not causal, not local: every unit the same length), except head_dim
    64 with softcap, whose consumers spilled a register with the piece's start in the kernel (8 bytes)."""
    causal, local = params.get("causal", False), params.get("local", False)
    hd64_softcap = _pad64(params["head_dim"]) == 64 and params.get("softcap", False)
    return not roles(params) and not causal and not local and not hd64_softcap and not params.get("varlen", False)


def persistent(params: dict) -> bool:
    """Whether the main kernel can run persistent (the template's kPersistent; core._persistent_units picks
    per call): a grid of one CTA per SM, each running units of the plain grid in turn, the next unit's K
    and V loaded under this unit's dK / dV stores, which are staged in the dS^T and dQ buffers. The block_n
    128 tiles without a mask on whole blocks (every unit the same length: a static deal matches the
    hardware's), except block_m 80, whose staging buffers hold a consumer's dV rows across both dQ buffers,
    and softcap, whose consumers spilled 4-20 bytes with the unit loop."""
    causal, local, softcap = params.get("causal", False), params.get("local", False), params.get("softcap", False)
    return (not roles(params) and not causal and not local and not softcap
            and int(params["block_m"]) != DQ_SWAP_BLOCK_M and not params.get("varlen", False))


def dkv_steps(params: dict) -> bool:
    """Whether each consumer issues the dV += P^T dO and dK += dS^T Q GEMMs k-step by k-step (16 query
    rows each) as P^T and dS^T are packed (the template's kDkvSteps), so that the tensor cores run them
    while the next exponentials are computed. Both consumers meet at every block's dS^T, so their
    exponentials (MUFU-bound: 8192 per block at head_dim 128, about 512 cycles at 16 per clock) run
    at the same time, and with both GEMMs issued after them the tensor cores idle meanwhile. The
    block_n 128 tiles with the ``dkv_steps`` knob on (the default). Measured on an H200 against the
    knob-off twins (configs/bwd_ablation.yaml) in one process, interleaved: hd128 non-causal +2-6 %,
    causal 2k / 16k +3-4 %, hd64 +1-2 %, causal 512 level. The role tiles (consumer 0's dV so) lost
    1-4 % at head_dim 256 and were level at 192: they keep the GEMM after P^T (docs/results/bwd_dkv_steps/).
    The deterministic backward at head_dim 128 is 1-3 % faster without the steps, so head_dim 128's twins are
    in the default set (configs/bwd.yaml) and serve it (core.DET_NOSTEPS_HEAD_DIMS; docs/results/bwd_det_nosteps/)."""
    return bool(params.get("dkv_steps", True)) and not roles(params)


def roles(params: dict) -> bool:
    """Whether the tile splits the consumers by role (block_n 64) rather than by key rows."""
    return int(params["block_n"]) == ROLES_BLOCK_N


def smem_layout(params: dict, ds_buffers: int, dq_buffers: int) -> dict:
    """Shared-memory regions ``{name: {"offset", "bytes"}}`` of the main kernel, in address order
    (``kp``: ds_pairs' peer K columns, 64 x head_dim / 2; ``pd``: the role tiles' 16-bit P^T
    hand-off, 64 x block_m, and ds_pairs' received dS^T, 1024-byte aligned there; empty otherwise;
    ``ds``: dS^T, block_n x block_m, in 16-column chunks of the 32-byte swizzle with dq_swap)."""
    p, bm, st = _pad64(params["head_dim"]), int(params["block_m"]), int(params["stages"])
    bn = int(params["block_n"])
    sizes = {"k": bn * p * ELEM, "v": bn * p * ELEM, "q": st * bm * p * ELEM, "do": st * bm * p * ELEM,
             "ds": ds_buffers * bn * bm * ELEM, "dq": dq_buffers * dq_tile_bytes(params),
             "kp": (bn * p // 2 * ELEM if ds_pairs(params) else 0), "lse": st * bm * 4,
             "dpsum": st * bm * 4, "pd": (64 * bm * ELEM if roles(params) else 0), "bars": BARRIER_BYTES}
    out, off = {}, 0
    for name, size in sizes.items():
        out[name] = {"offset": off, "bytes": size}
        off += size
    return out


def _smem_total(layout: dict) -> int:
    return layout["bars"]["offset"] + layout["bars"]["bytes"] + ALIGN_SLACK_BYTES


class BwdFamily(Family):
    def resources(self, params):
        """threads, smem (main kernel layout), smem_bytes, ds_buffers, dq_buffers, producer/consumer
        regs, head_dim_padded, num_slices, pre_row_lanes, pre_rows_per_cta, stage_dq, bulk_dq (the reducer warp adds dQ
        with bulk reductions: staged tiles or stage_dq; else the consumers add with red.v4). The buffer counts are the first of (dS^T, dQ) = (2, 2),
        (1, 2), (1, 0) that fits in shared memory; role tiles take (1, 0) (their P^T hand-off
        orders the one dS^T buffer's reuse; their dQ is staged in the ring buffers: stage_dq)."""
        for ds_buffers, dq_buffers in ((1, 0),) if roles(params) else ((2, 2), (1, 2), (1, 0)):
            smem = smem_layout(params, ds_buffers, dq_buffers)
            if _smem_total(smem) <= SMEM_LIMIT:
                break
        p = _pad64(params["head_dim"])
        staged, pairs = stage_dq(params), ds_pairs(params)
        return dict(threads=128 * (CONSUMER_WGS + 1), smem=smem, smem_bytes=_smem_total(smem), ds_buffers=ds_buffers,
                    ds_pairs=pairs, cluster=(2, 1, 1) if pairs else (1, 1, 1), split_tail=split_tail(params),
                    persistent=persistent(params), dkv_steps=dkv_steps(params),
                    dq_buffers=dq_buffers,
                    producer_regs=ROLES_PRODUCER_REGS if roles(params) else PRODUCER_REGS,
                    consumer_regs=ROLES_CONSUMER_REGS if roles(params) else CONSUMER_REGS, head_dim_padded=p,
                    num_slices=max(1, p // int(params["slice"])), pre_post_threads=PRE_POST_THREADS,
                    pre_row_lanes=pre_row_lanes(params), pre_rows_per_cta=pre_rows_per_cta(params),
                    stage_dq=staged, bulk_dq=dq_buffers > 0 or staged, dq_swap=dq_swap(params),
                    kv_reg_steps=kv_reg_steps(params))

    def problems(self, params):
        out = []
        bm, sl, st = params["block_m"], params["slice"], params["stages"]
        p = _pad64(params["head_dim"])
        if params["causal"] and params.get("local", False):
            out.append(("local", True, "false with causal: true (the local kernel serves causal with a window)"))
        if roles(params):
            if bm != 64:
                out.append(("block_m", bm, "64 with block_n 64 (the role tiles)"))
            if sl != p:
                out.append(("slice", sl, f"head_dim padded to 64 ({p}) with block_n 64: the role tiles do not slice"))
        elif (bm, sl) not in TILES:
            out.append(("slice", sl, "128 with block_m 64 or 80, 64 with block_m 128 (each consumer's dQ GEMM is 64 "
                                     "x 64, or 64 columns x 80 rows)"))
        elif p % sl:
            out.append(("slice", sl, f"a divisor of head_dim padded to 64 ({p})"))
        if dq_swap(params) and params.get("varlen", False):
            out.append(("block_m", bm, "64 or 128 with varlen (block_m 80's dQ^T tiles are not padded per sequence)"))
        elif dq_swap(params) and (params["causal"] or params.get("local", False) or params.get("softcap", False)):
            out.append(("block_m", bm, "64 or 128 with causal, local or softcap (block_m 80, FA3's tile, is built "
                                       "and tested for the plain non-causal mask only)"))
        if out:
            return out
        if roles(params):  # S^T or dP^T, dV or dK, and one dQ piece of at most 64 x 64
            need = bm // 2 + p // 2 + 32
            what = "S^T or dP^T (block_m/2) + dV or dK (head_dim/2) + a dQ piece (32)"
            limit = ROLES_CONSUMER_REGS - ROLES_REG_HEADROOM
        else:
            need = bm // 2 * 2 + sl // 2 * 2
            what = "S^T, dP^T (block_m/2 each) + dK, dV (slice/2 each)"
            limit = CONSUMER_REGS - (DQ_SWAP_REG_HEADROOM if dq_swap(params) else REG_HEADROOM)
        if need > limit:
            out.append(("block_m", bm, f"{what} = {need} registers > {limit}: lower block_m or slice"))
        r = self.resources(params)
        if r["smem_bytes"] > SMEM_LIMIT:
            out.append(("stages", st, f"small enough for 227 KB of shared memory ({r['smem_bytes']} bytes needed: "
                                      f"K, V {params['block_n']}x{p} + {st} x (Q, dO {bm}x{p}) + dS^T, 2 bytes each)"))
        return out

    def kernels(self, params, resources):
        t = resources["pre_post_threads"]
        return [
            # PREEXIT: griddepcontrol.launch_dependents; ACQBULK: griddepcontrol.wait (PDL, the module's docstring)
            KernelSpec("pre", t, 0, PARAMS, sass=("PREEXIT",)),
            KernelSpec("main", resources["threads"], resources["smem_bytes"], PARAMS,
                       tensor_maps=("q", "k", "v", "dout", "dk", "dv"), cluster=resources["cluster"],
                       sass=("HGMMA", "UTMALDG", "USETMAXREG", "PREEXIT", "ACQBULK"), pdl=True),
            KernelSpec("post", t, 0, PARAMS, sass=("ACQBULK",), pdl=True),
        ]

    def name_parts(self, p):
        return [p["dtype"], f"hd{p['head_dim']}", "causal" if p["causal"] else "local" if p["local"] else "noncausal",
                *(["softcap"] if p["softcap"] else []), *(["varlen"] if p.get("varlen") else []),
                f"m{p['block_m']}n{p['block_n']}", f"sl{p['slice']}", f"s{p['stages']}",
                *([] if p.get("dkv_steps", True) else ["nosteps"])]

    def suggest(self, key):
        """The tile of configs/bwd.yaml's table for the key's head_dim (rounded up to a built size)."""
        if isinstance(key.get("head_dim"), int):
            key = {**key, "head_dim": min((h for h in HEAD_DIMS if h >= key["head_dim"]), default=key["head_dim"])}
        p = _pad64(key["head_dim"])
        if p >= 192:  # the role tiles: no recomputed S^T / dP^T
            return {**key, "block_m": 64, "block_n": ROLES_BLOCK_N, "slice": p, "stages": 2}
        bm, sl = (64, 128) if p == 128 else (128, 64)
        return {**key, "block_m": bm, "block_n": BLOCK_N, "slice": sl, "stages": 2}


FAMILY = BwdFamily(
    name="bwd",
    doc="FA3 backward (fp16/bf16): dQ, dK, dV",
    keys=(
        Key("dtype", str, "axis", allowed=DTYPES, doc="Q/K/V/O/dO element type (fp32 accumulation)"),
        Key("head_dim", int, "axis", allowed=HEAD_DIMS,
            doc="head dim of Q, K and V (calls with head_dim_v != head_dim: their max)"),
        Key("causal", bool, "axis", doc="bottom-right aligned causal mask"),
        Key("local", bool, "axis", default=False,
            doc="FA3's local mask: a band with runtime bounds (sliding windows, causal with a window)"),
        Key("softcap", bool, "axis", default=False, doc="logit soft-capping S <- softcap * tanh(S / softcap)"),
        Key("varlen", bool, "axis", default=False,
            doc="FA3's varlen backward: sequences packed along the token dim (cu_seqlens_q / cu_seqlens_k) read by "
                "the kernels (the plain tiles: no ds_pairs, split tail, persistent grid or block_m 80)"),
        Key("block_m", int, "tile", allowed=(64, 80, 128), doc="query rows per step of the main loop"),
        Key("block_n", int, "tile", allowed=(ROLES_BLOCK_N, BLOCK_N),
            doc="key rows per CTA: 128 (2 consumer warpgroups x 64 rows) or 64 (both consumers, split by role)"),
        Key("slice", int, "tile", allowed=(64, 128, 192, 256), doc="dK/dV/dQ columns per CTA"),
        Key("stages", int, "knob", allowed=STAGES, default=2, doc="Q/dO ring depth"),
        Key("dkv_steps", bool, "knob", default=True,
            doc="block_n 128: dV / dK k-steps issued as P^T / dS^T are packed (off: both GEMMs after them)"),
    ),
    tile_match=("head_dim", "dtype", "causal", "local", "softcap", "varlen"),
    tile_required=("head_dim", "block_m", "block_n", "slice"),
    dispatch_keys=("dtype", "head_dim", "causal", "local", "softcap", "varlen"),
)
