"""The ``fwd`` family: FlashAttention-3 forward, fp16/bf16 (arXiv 2407.08608, §3, Algorithms 1-2).

Template: templates/fwd.cu.j2. One kernel per variant (role ``main``): a producer warpgroup
issuing TMA loads of Q and of K/V through a ``stages``-deep mbarrier ring, and 2 or 3 consumer
warpgroups (64 query rows each) running S = Q K^T (SS-WGMMA), the online softmax and O += P V
(RS-WGMMA), with pingpong and intra-warpgroup overlap as knobs.

Feasibility (sm_90a, this kernel's layout), checked before anything is rendered:

- head_dim and head_dim_v in {64, 96, 128, 192, 256} (each padded to a multiple of 64; a call with
  a smaller head dim is served by a larger built one, TMA zero-filling the columns past it).
- Masks (mask.cuh): ``causal`` (bottom-right aligned) or ``local`` (FA3's local: a band with
  runtime bounds ``window_left`` / ``window_right``, serving every sliding window, causal with a
  window included), not both; neither masks only the sequence end. Causal is not served by the
  local kernel: the band's per-element test cost the causal kernel 2-7 % (H200).
- ``softcap`` (FA3's, Gemma 2's logit soft-capping) is compiled in: S <- tanh(S * softcap_scale)
  before masking, with softcap_scale = softmax_scale / softcap and scale_log2 = softcap * log2(e).
- ``pack_gqa`` (FA3's PackGQA): a tile holds the query heads of one K/V head (rows = query
  position x group + head in group), so K and V are read once per group; Q comes through a 5-D TMA
  map, O and LSE are stored from registers row by row. 16-bit only. The runtime chooses it per call
  (flashgen.core.pack_gqa_rule); a tile holds block_m // group query positions.
- ``varlen`` (FA3's varlen, fwd.cu.j2 kVarlen): per-sequence lengths read by the kernel from the
  call's ``cu_seqlens_q`` / ``cu_seqlens_k`` (sequences packed along one token dim) and / or
  ``seqused_q`` / ``seqused_k`` (the rows used of each sequence of a padded batch, e.g. a KV cache's
  lengths), mask.cuh SeqRange. Tiles past a sequence's rows are skipped; masks are bottom-right
  aligned per sequence; O and LSE are stored from registers with row bounds (a TMA store of a tile
  would cross into the next sequence). 16-bit. With ``pack_gqa``: a padded q only (PackGQA's 5-D Q map
  has a batch dim; the runtime packs no call with cu_seqlens_q), as in decoding with a KV cache.
- block_n a multiple of 16 in [16, 256]: the N of the S = Q K^T WGMMA (N <= 256) and the PV GEMM
  steps k16 over it. e4m3: a multiple of 32 (k32 steps); S's K-descale groups are 64 columns, or 32
  where block_n is not a multiple of 64 (FA3's 128 x 224), so none straddles two 64-key blocks.
- consumer_wgs in {1, 2, 3} and block_m == 64 * consumer_wgs (each consumer warpgroup owns 64 rows). One
  consumer warpgroup (block_m 64): 16-bit PackGQA decode tiles only (a decode step's group x seqlen_q <= 64
  packed rows fill one warpgroup's 64, where a 128-row tile's second warpgroup runs its GEMMs and
  exponentials on padding, in pingpong turns with the first: core.DECODE_WG1), without pingpong or
  exponential turns (both pass turns between warpgroups).
- stages in 1..4.
- Shared memory (:func:`smem_layout`; P = head_dim rounded up to whole rows: 128 bytes = 64
  16-bit elements, or 128 e4m3 ones, except that an e4m3 head_dim <= 64 takes one 64-byte row
  (:func:`operand_row_bytes`)): Q q_stages*block_m*P (``q_stages`` 2: the next tile's Q loads
  while the current tile runs, into the other buffer; not with PackGQA), K and V
  stages*block_n*P each, O block_m*Pv when
  it still fits (``separate_o``, else O is staged in Q's buffer; e4m3: a bf16 O tile beside the V^T
  ring, else O is stored from registers), 1024 bytes of mbarriers, plus
  1024 bytes of alignment slack: at most 227 KB = 232448 bytes.
- Registers (setmaxnreg, :func:`register_split`): 1 or 2 consumer WGs get 240 regs/thread, 3 get 160
  (producer 24 / 32). e4m3 and PackGQA with 2 consumer WGs: 40 / 232 (the V transpose and the
  5-D Q load need the producer's registers; PackGQA with 1 consumer WG: 40 / 240, its 256 threads launch
  with 256 registers each; hd256 local at 232 spilled 8 bytes), except e4m3 tiles whose accumulators need more than
  200 (head_dim 256 at block_n 128, head_dim 128 at block_n 224): 24 / 240, as FA3.
  With 3 consumer WGs: head_dim_padded <= 128 and block_n <= 128. For both, the fp32 S accumulator
  (block_n/2), O accumulator (head_dim_v_padded/2) and packed P (block_n/4; e4m3 block_n/8)
  registers per thread must leave 32 for addresses and softmax state: block_n/2 +
  head_dim_v_padded/2 + block_n/4 <= consumer_regs - 32 (208 with 2 consumer WGs, 128 with 3:
  hd64 at block_n 128 fits, hd96 does not -- it spilled when tried). Without intra-warpgroup
  overlap (``overlap: false``) S is dead while P is live, so P's registers are not counted: that is
  what fits cuDNN's FP8 tile, 64 x 256 per consumer warpgroup at head_dim 128 (128x256, 0 spill
  bytes), and 128x256 at head_dim 64 (16-bit).
- ``vt_global`` (e4m3 only): V^T comes from global memory instead of the in-kernel transpose. The
  variant has two kernels: ``vt``, a preprocess that writes e4m3 V^T (batch, heads_k, head_dim_v,
  seqlen_k rounded up to 16; keys contiguous, in P's k order within each 16, zeros past seqlen_k)
  into per-call scratch, and ``main``, which TMA-loads V^T tiles into its vt ring. No V ring and no
  transposer warps, so the producer takes FA3's 24 / 240 split with 2 consumer warpgroups.
- ``rowsum_mma`` (e4m3 only): O's softmax row sums l come from the tensor cores, an m64n8 WGMMA of P
  against a 256-byte tile of ones in the barrier area per P V k-step, instead of one FADD per score;
  O / l is then the mean of V's rows weighted by P as the GEMM read it (e4m3). Where the lse is
  written the exact fp32 sums are kept too, for it alone (O is the same with or without the lse).
  Not with ``exp_turns``: the turn's pass then waits on two exponentials only (no row sums), and ptxas
  moved it ahead of 120 of the 130 exponentials of e4m3 hd128 128 x 256 (-11 % on an H200, docs/PERF.md).
"""
from __future__ import annotations

from ..abi import params_struct
from . import Family, Key, KernelSpec

SMEM_LIMIT = 232448  # 227 KB: the sm_90 per-block opt-in maximum of dynamic shared memory
HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = ("bf16", "fp16", "e4m3")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "e4m3": 1}
OUT_DTYPE = {"bf16": "bf16", "fp16": "fp16", "e4m3": "bf16"}  # FP8 attention writes bf16 (FA3)
QUANT_BLOCK = 64  # FP8 block quantization: one descale per 64 rows of Q and of K (runtime quantize_fp8)
CONSUMER_WGS = (1, 2, 3)
STAGES = (1, 2, 3, 4)
BARRIER_BYTES = 1024
ALIGN_SLACK_BYTES = 1024
REG_SPLIT = {1: (24, 240), 2: (24, 240), 3: (32, 160)}  # consumer_wgs -> (producer_regs, consumer_regs)
# e4m3: the producer warpgroup also transposes V (warps 1-3), which spilled at 24 registers.
# pack_gqa: the producer's 5-D Q load and packed tile bounds spilled 8 bytes at 24 (causal, 2 WGs).
# varlen: the producer's per-sequence offsets and bounds spilled 32-48 bytes at 24 (hd192 / hd256 causal).
# A split must fit the registers the CTA is launched with (65536 / threads, rounded down to 8, per
# thread; tests/test_families.py checks every variant): setmaxnreg.inc waits for registers that the
# other warpgroups have released, so 32 / 240 with 2 consumer warpgroups (128 x 32 + 256 x 240 =
# 65536 > 384 x 168 = 64512) hangs every launch (H200, tried).
REG_SPLIT_FP8 = {1: (40, 240), 2: (40, 232), 3: (32, 160)}
# 1 consumer warpgroup (PackGQA's decode tile): 40 / 240 fits its 256 threads' 256 registers each; at 40 / 232
# the hd256 64 x 64 local tile spilled 8 bytes.
# e4m3 with 2 consumer warpgroups whose accumulators do not fit 232 (head_dim 256 at block_n 128):
# FA3's 24 / 240; the transposer's loop over key groups (fp8.cuh: VTransposer) fits 24 registers.
REG_SPLIT_FP8_WIDE = (24, 240)
ACC_REG_HEADROOM = 32


def _acc_regs(block_n, head_dim_v_padded, fp8, overlap=True):
    """Registers per consumer thread for the fp32 S and O accumulators and the packed P (without
    intra-warpgroup overlap, S is dead while P is live, so P takes S's registers)."""
    return block_n // 2 + head_dim_v_padded // 2 + (block_n // (8 if fp8 else 4) if overlap else 0)


def register_split(params):
    """(producer_regs, consumer_regs) per thread (setmaxnreg) for a variant's parameters."""
    wgs = int(params["consumer_wgs"])
    fp8 = params["dtype"] == "e4m3"
    transposer = fp8 and not params.get("vt_global")  # vt_global: the producer issues TMA loads only
    split = (REG_SPLIT_FP8 if transposer or params.get("pack_gqa") or params.get("varlen") else REG_SPLIT).get(wgs, (24, 240))
    if fp8 and wgs == 2 and isinstance(params.get("block_n"), int):
        need = _acc_regs(params["block_n"], pad_operand(params["head_dim_v"], "e4m3"), True,
                         params.get("overlap", True))
        if need > split[1] - ACC_REG_HEADROOM:
            split = REG_SPLIT_FP8_WIDE
    return split

PARAMS = params_struct(
    "FwdParams",
    ("lse", "ptr", "float*"),  # (batch, heads, seqlen_q) fp32, natural log; contiguous; null: not written
    ("seqlen_q", "i32"),
    ("seqlen_k", "i32"),
    ("heads", "i32"),
    ("heads_k", "i32"),  # divides heads (GQA/MQA)
    ("batch", "i32"),
    ("num_m_blocks", "i32"),  # ceil(seqlen_q / tile_queries)
    ("num_tiles", "i32"),  # num_m_blocks * heads * batch (pack_gqa variants: heads_k)
    ("scale_log2", "f32"),  # softmax_scale * log2(e), any sign; softcap variants: softcap * log2(e)
    ("softmax_scale", "f32"),
    ("softcap_scale", "f32"),  # softcap variants: softmax_scale / softcap (any sign); else unused
    ("window_left", "i32"),  # local variants: query i sees keys [i + seqlen_k - seqlen_q - window_left,
    ("window_right", "i32"),  #   i + seqlen_k - seqlen_q + window_right]; both >= 0 (unbounded: seqlen_k, seqlen_q)
    ("sink", "ptr", "const float*"),  # learnable_sink (heads,) fp32 logits, or null
    # e4m3 variants only (fp8.cuh: Descale). Each descale tensor is fp32, indexed
    # [batch * stride_batch + (head / head_div) * stride_head + block64 * stride_block]; null = 1.
    ("q_descale", "ptr", "const float*"),
    ("q_descale_stride_batch", "i32"), ("q_descale_stride_head", "i32"), ("q_descale_stride_block", "i32"),
    ("q_descale_head_div", "i32"),  # heads / heads_k for FA3's (batch, heads_k) shape, else 1
    ("k_descale", "ptr", "const float*"),
    ("k_descale_stride_batch", "i32"), ("k_descale_stride_head", "i32"), ("k_descale_stride_block", "i32"),
    ("v_descale", "ptr", "const float*"),
    ("v_descale_stride_batch", "i32"), ("v_descale_stride_head", "i32"),
    # e4m3 variants store O from registers (no TMA map): out (batch, seqlen_q, heads, head_dim_v) bf16
    ("o", "ptr", "void*"),
    ("o_stride_batch", "i64"), ("o_stride_seq", "i64"), ("o_stride_head", "i64"),
    ("head_dim_v", "i32"),  # the call's (columns of O past it are not stored)
    ("section_heads", "i32"),  # causal: (batch, head) pairs per L2 section of the tile order (scheduler.cuh)
    ("stream_tile_counter", "ptr", "int*"),  # dynamic_schedule variants: one int32, 0 at launch and left at 0 (the stream's)
    ("group", "i32"),  # heads / heads_k
    ("tile_queries", "i32"),  # query positions per tile: block_m, or block_m // group (pack_gqa variants)
    # vt_global variants' preprocess (kernel ``vt``): V (batch, seqlen_k, heads_k, head_dim_v) e4m3 at
    # these strides (elements = bytes) -> V^T (batch, heads_k, head_dim_v, vt_seqlen) e4m3, contiguous
    ("v", "ptr", "const void*"),
    ("v_stride_batch", "i64"), ("v_stride_seq", "i64"), ("v_stride_head", "i64"),
    ("vt", "ptr", "void*"),
    ("vt_seqlen", "i32"),  # seqlen_k rounded up to VT_KEY_ALIGN (the zero keys past seqlen_k are written)
    # varlen variants only (mask.cuh SeqRange; null: that side has the batch's uniform layout and lengths).
    # cu_seqlens_*: int32 (batch + 1,) token offsets of sequences packed along one dim (q / k / v / out
    # then have batch 1 in their maps); seqused_*: int32 (batch,) rows used of each sequence.
    # seqlen_q / seqlen_k above are then the calls' maxima (the grid and the unbounded window sides).
    ("cu_seqlens_q", "ptr", "const int*"), ("cu_seqlens_k", "ptr", "const int*"),
    ("seqused_q", "ptr", "const int*"), ("seqused_k", "ptr", "const int*"),
    # varlen variants: lse of (batch b, head h, row i of its sequence) at b * stride_batch + h * stride_head +
    # offset_q + i (FA3's varlen lse is (heads, total_q): stride_batch 0, stride_head total_q)
    ("lse_stride_batch", "i64"), ("lse_stride_head", "i64"),
    # varlen variants over a K / V cache (flash_attn_with_kvcache; null / 0: unused). kv_batch_idx int32 (batch,):
    # sequence b's batch entry of a padded K / V (cache_batch_idx). leftpad_k int32 (batch,): its first key
    # (cache_leftpad; seqused_k counts from row 0, so it has seqused_k - leftpad_k keys). page_table int32
    # (batch, page_table_stride): its pages, entries of K / V's batch dim of page_size rows each, whose maps then
    # have boxes of page_box = gcd(page_size, block_n) rows (a box never crosses a page).
    ("kv_batch_idx", "ptr", "const int*"), ("leftpad_k", "ptr", "const int*"),
    ("page_table", "ptr", "const int*"), ("page_table_stride", "i32"),
    ("page_size", "i32"), ("page_box", "i32"),
    # varlen variants, split-KV (flash-decoding; > 1: on): the scheduler's batch is batch x num_splits; split s of a
    # tile runs its share of the key blocks and stores fp32 O (normalised within the split) at o + s x
    # o_stride_split and its LSE at lse + s x lse_stride_split (elements), merged by the combine family.
    ("num_splits", "i32"), ("o_stride_split", "i64"), ("lse_stride_split", "i64"),
    ("split_mul", "u32"), ("split_shift", "u32"),  # core.fast_div of num_splits (mul 0: no splits)
    # causal: the index of the tile order's last L2 section (scheduler.cuh), which runs every (batch, head) pair
    # from tail_section * section_heads on (core.tail_section / tail_heads: up to two sections)
    ("tail_section", "i32"),
)

VT_KEY_ALIGN = 16  # V^T rows: whole 16-key groups (P's k order permutes within 16; TMA strides: 16 bytes)
VT_THREADS = 256  # the vt preprocess: threads per CTA (fp8.cuh write_vt_tile)
VT_TILE = 16384  # the vt preprocess: bytes of V per CTA (keys x head_dim bytes)


def vt_tile_bytes(head_dim_v: int) -> int:
    """head_dim bytes per tile of the vt preprocess: 128, or 64 where head_dim_v <= 64."""
    return 64 if int(head_dim_v) <= 64 else 128


def vt_grid(batch: int, heads_k: int, head_dim_v: int, seqlen_k: int, tile_bytes: int) -> tuple:
    """The vt preprocess's grid: (key tiles, head_dim tiles, batch x heads_k)."""
    return (-(-vt_seqlen(seqlen_k) // (VT_TILE // tile_bytes)), -(-int(head_dim_v) // tile_bytes),
            int(batch) * int(heads_k))


def vt_seqlen(seqlen_k: int) -> int:
    """Keys per V^T row in a vt_global variant's scratch (seqlen_k rounded up to VT_KEY_ALIGN)."""
    return -(-int(seqlen_k) // VT_KEY_ALIGN) * VT_KEY_ALIGN


def vt_scratch_bytes(batch: int, heads_k: int, head_dim_v: int, seqlen_k: int) -> int:
    """Bytes of a vt_global call's V^T scratch: (batch, heads_k, head_dim_v, vt_seqlen) e4m3."""
    return int(batch) * int(heads_k) * int(head_dim_v) * vt_seqlen(seqlen_k)


def _block_n(v):
    if not (16 <= v <= 256 and v % 16 == 0):
        return "a multiple of 16 in [16, 256] (WGMMA N <= 256; the PV GEMM steps k16 over block_n)"
    return None


def _pad64(x: int) -> int:
    return -(-int(x) // 64) * 64


def _pad_chunk(x: int, dtype: str) -> int:
    """x rounded up to whole 128-byte swizzle chunks of dtype (64 16-bit or 128 8-bit elements)."""
    c = 128 // DTYPE_BYTES.get(dtype, 2)
    return -(-int(x) // c) * c


def operand_row_bytes(width: int, dtype: str) -> int:
    """Bytes per shared-memory row of a Q, K or V tile whose rows hold ``width`` (head_dim or
    head_dim_v) elements of ``dtype``: 64 (the 64-byte swizzle) for an 8-bit row of at most 64
    elements, so that e4m3 head_dim 64 is not padded to 128 (which doubled both GEMMs), else 128.
    The kernel's tile types (smem.cuh: SmemTileSW) and the runtime's TMA maps (box and swizzle)
    both follow it."""
    return 64 if DTYPE_BYTES.get(dtype, 2) == 1 and int(width) <= 64 else 128


def pad_operand(x: int, dtype: str) -> int:
    """head_dim or head_dim_v rounded up to whole shared-memory rows (:func:`operand_row_bytes`)."""
    c = operand_row_bytes(x, dtype) // DTYPE_BYTES.get(dtype, 2)
    return -(-int(x) // c) * c


def smem_layout(params: dict) -> dict:
    """Shared-memory regions ``{name: {"offset", "bytes"}}`` in address order (what the kernel
    uses and what feasibility checks). O gets its own staging buffer when it fits, so Q is released
    after the tile's last S GEMM and the next tile's Q load overlaps the epilogue; otherwise O is
    staged in Q's buffer (region ``o`` has 0 bytes)."""
    dt = params["dtype"]
    e = DTYPE_BYTES.get(dt, 2)
    p, pv = pad_operand(params["head_dim"], dt), pad_operand(params["head_dim_v"], dt)
    bm, bn, st = int(params["block_m"]), int(params["block_n"]), int(params["stages"])
    sizes = {"q": int(params.get("q_stages", 1)) * bm * p * e, "k": st * bn * p * e, "v": st * bn * pv * e}
    if dt == "e4m3":  # V^T ring (keys padded to whole 128-byte chunks); O (bf16) staged when it fits
        if params.get("vt_global"):  # V^T is TMA-loaded from global memory: no V ring
            sizes["v"] = 0
        sizes["vt"] = st * pv * _pad_chunk(bn, dt)
        sizes["o"] = bm * pv * DTYPE_BYTES[OUT_DTYPE[dt]]
    elif params.get("pack_gqa") or params.get("varlen"):  # O is stored from registers
        sizes["o"] = 0
    else:
        sizes["o"] = bm * pv * DTYPE_BYTES[OUT_DTYPE.get(dt, dt)]
    sizes["bars"] = BARRIER_BYTES
    if sum(sizes.values()) + ALIGN_SLACK_BYTES > SMEM_LIMIT:
        sizes["o"] = 0
    out, off = {}, 0
    for name, size in sizes.items():
        out[name] = {"offset": off, "bytes": size}
        off += size
    return out


def dynamic_schedule(params: dict) -> bool:
    """Whether the variant claims tiles from a tile counter (scheduler.cuh: 0 at launch, left at 0): causal tiles
    differ in length, so persistent causal CTAs balance by claiming; the others run the static
    round-robin (uniform tiles, or one tile per CTA) and need no counter."""
    return bool(params["causal"]) and bool(params.get("persistent", True))


def spec_max(params: dict) -> bool:
    """Whether the softmax takes its exponentials before its row max on a tile's middle K/V blocks
    (softmax.cuh update_speculative; a warpgroup whose P would exceed the bound recomputes S and runs
    the plain update). 16-bit P without softcap (its preparation of S is not repeatable) at head dims
    up to 128. Measured per tile against the same tile without it (H100, FA3 protocol, docs/PERF.md):
    bf16 hd64 / hd128 +1.5-7 % at 2k-16k; hd256 within 1 % (and its causal builds spilled 8-16 bytes);
    e4m3 (P checked against 448 by a max over the exponents) 1-17 % slower, so not there. Not with
    ``rowsum_mma`` (its bound is checked on the row sums in registers, which that knob removes; e4m3 only
    today, so that never meets spec_max)."""
    return (params["dtype"] in ("bf16", "fp16") and not params.get("softcap") and not params.get("rowsum_mma")
            and max(params["head_dim"], params.get("head_dim_v", params["head_dim"])) <= 128)


def half_first(params: dict) -> bool:
    """Whether a warpgroup whose rows see no key of the right half of its tile's first K/V block
    masks and softmaxes that block's left block_n / 2 keys alone (templates/fwd.cu.j2 kHalfFirst,
    mask.cuh sees_right_half; the S GEMM and the P V GEMM stay whole). Under a causal diagonal that
    is the first warpgroup of every tile whose rows end before its first block's middle (block_m =
    block_n: every tile). Measured +2-3 % at bf16 hd64 causal 512-2k (H100, H200; docs/PERF.md).
    The GEMMs at half size too: :func:`half_first_gemm`, on the tiles where ptxas allows it.
    Causal tiles with two consumer warpgroups and block_n >= 64, not local or PackGQA, not FP8
    softcap: the tiles it was measured on; not where :func:`first_block_skip` applies (16-bit block_n 64
    without spec_max: under a causal diagonal with block_m 128 that warpgroup sees none of the block,
    and skipping it whole beats its half). (Earlier versions, with a half-width S GEMM inside the
    branch, spilled 36-148 bytes on the 3-warpgroup hd64 tiles and serialized the WGMMAs of local
    and hd256 128x48 tiles. The register-only branch on the 3-warpgroup hd64 tiles, with a skip of
    the whole block for warpgroups that see none of it: the 16-bit ones spilled 108-112 bytes, the
    e4m3 one measured 0.96-1.01 of the old kernel at 2k-16k, H100; docs/results/
    fwd_first_block_skip_not_kept/. Not tried on local and hd256 128x48 tiles.)"""
    return (bool(params.get("causal")) and not params.get("local") and not params.get("pack_gqa")
            and int(params["consumer_wgs"]) == 2 and int(params["block_n"]) >= 64
            and not (params["dtype"] == "e4m3" and params.get("softcap")) and not first_block_skip(params))


def half_first_gemm(params: dict) -> bool:
    """Whether half_first's warpgroup also runs that block's GEMMs at half size: S = Q K^T at
    N = block_n / 2 (K's first block_n / 2 rows) and P V over the first block_n / 2 keys alone (P's right
    half is 0), in a branch of their own around the first block's S GEMM (templates/fwd.cu.j2
    kHalfFirstGemm, s_step's gemm_s and issue_pv). Under a causal diagonal with block_m = block_n that is
    a quarter of the first block's tensor work per tile. Measured against the same kernels without it
    (FA3 protocol, causal, old/new alternated twice; docs/PERF.md): hd128 causal 512-1k +2.6-3.9 % (H200)
    and +0.9-1.7 % (H100), hd64 and hd256 within the run-to-run spread.
    Where ptxas keeps the WGMMAs asynchronous with the branch in: 16-bit half_first tiles without softcap
    or exponential turns on a 2-stage ring, block_n <= 160, S and O accumulators (block_n / 2 +
    head_dim_v / 2 registers) under 168. Outside it ptxas serialized every WGMMA (C7511/C7515; the build
    refuses those) on some tiles: hd128 128x176, hd256 128x80, hd64 128x128 s2 with exp_turns, the softcap
    and the e4m3 tiles (whose P V takes V^T K-major; not written), and the varlen hd128 causal tile (C7511 with
    the per-tile SeqRange live; so not with varlen)."""
    return (half_first(params) and params["dtype"] in ("bf16", "fp16") and not params.get("softcap")
            and not params.get("varlen")
            and not (params.get("exp_turns") and params.get("stages", 2) == 2)
            and int(params["block_n"]) <= 160
            and (int(params["block_n"]) + int(params.get("head_dim_v", params["head_dim"]))) // 2 < 168)


def first_block_skip(params: dict) -> bool:
    """Whether the first consumer warpgroup skips a tile's first (right-most) K/V block when its rows
    see none of that block's keys (templates/fwd.cu.j2 kFirstBlockSkip, mask.cuh sees_key): no S GEMM,
    softmax or P V for it, the block's K and V stages released and its pingpong turn passed, so both
    warpgroups keep their turns in step. Under a causal diagonal with block_n <= 64 and seqlen_q =
    seqlen_k, every tile's last block starts at or past key 64 of the tile, so rows 0-63 see none of it
    (hd256 128x48: one of a tile's 3-11 blocks at seqlen 512; 128x64: one of 2-8). Causal, two consumer
    warpgroups, the overlapped 16-bit loop without spec_max or exponential turns (the hd256 tiles with
    block_n 48 and 64, softcap included). At block_n 64 it replaces half_first (whose warpgroup ran the
    block's GEMMs at half size, all of it masked): hd256 128x64 bf16 causal 1k 452-458 TFLOP/s on an H100
    against 443 in its tune table's earlier figure; on an H200, A/B at bf16 1k / 4k, 1.010 / 1.017 (within
    the run-to-run spread; docs/PERF.md)."""
    return (bool(params.get("causal")) and not params.get("local") and not params.get("pack_gqa")
            and int(params["consumer_wgs"]) == 2 and int(params["block_n"]) <= 64 and params["dtype"] != "e4m3"
            and params.get("overlap", True) and not params.get("exp_turns") and not spec_max(params))


class FwdFamily(Family):
    def derive(self, params):
        """head_dim_v defaults to head_dim; consumer_wgs to block_m / 64 (one warpgroup per 64 rows)."""
        params.setdefault("head_dim_v", params["head_dim"])
        if isinstance(params.get("block_m"), int):
            params.setdefault("consumer_wgs", params["block_m"] // 64)
        return params

    def resources(self, params):
        """threads, smem (layout), smem_bytes, producer_regs, consumer_regs, head_dim_padded,
        head_dim_v_padded (whole shared-memory rows), qk_row_bytes / v_row_bytes (those rows' bytes:
        :func:`operand_row_bytes`), separate_o, fp8, out_dtype, block_n_vt (e4m3: V^T's key
        columns, block_n padded to 128), dynamic_schedule, spec_max, half_first, first_block_skip (the
        rules above)."""
        wgs = int(params["consumer_wgs"])
        smem = smem_layout(params)
        producer_regs, consumer_regs = register_split(params)
        return dict(
            threads=128 * (wgs + 1),
            smem=smem,
            smem_bytes=smem["bars"]["offset"] + smem["bars"]["bytes"] + ALIGN_SLACK_BYTES,
            producer_regs=producer_regs,
            consumer_regs=consumer_regs,
            head_dim_padded=pad_operand(params["head_dim"], params["dtype"]),
            head_dim_v_padded=pad_operand(params["head_dim_v"], params["dtype"]),
            qk_row_bytes=operand_row_bytes(params["head_dim"], params["dtype"]),
            v_row_bytes=operand_row_bytes(params["head_dim_v"], params["dtype"]),
            separate_o=smem["o"]["bytes"] > 0,
            fp8=params["dtype"] == "e4m3",
            out_dtype=OUT_DTYPE.get(params["dtype"], params["dtype"]),
            block_n_vt=_pad_chunk(params["block_n"], "e4m3"),
            dynamic_schedule=dynamic_schedule(params),
            spec_max=spec_max(params),
            half_first=half_first(params),
            half_first_gemm=half_first_gemm(params),
            first_block_skip=first_block_skip(params),
            vt_global=bool(params.get("vt_global")),
            varlen=bool(params.get("varlen")),
            vt_threads=VT_THREADS,
            vt_tile=VT_TILE,
            vt_tile_bytes=vt_tile_bytes(pad_operand(params["head_dim_v"], params["dtype"])),
        )

    def problems(self, params):
        out = []
        hd, hdv = params["head_dim"], params["head_dim_v"]
        bm, bn, wgs, st = params["block_m"], params["block_n"], params["consumer_wgs"], params["stages"]
        if params["causal"] and params.get("local", False):
            out.append(("local", True, "false with causal: true (the local kernel serves causal with a window)"))
        if wgs in CONSUMER_WGS and bm != 64 * wgs:
            out.append(("block_m", bm, f"64 * consumer_wgs = {64 * wgs} (consumer_wgs is {wgs})"))
        if wgs == 1:  # the decode tile (module docstring): what it was built and measured as
            if params.get("pingpong", True):
                out.append(("pingpong", True, "false with consumer_wgs 1 (the turns pass between warpgroups)"))
            if params.get("exp_turns"):
                out.append(("exp_turns", True, "false with consumer_wgs 1 (the turns pass between warpgroups)"))
            if params["dtype"] == "e4m3" or not params.get("pack_gqa"):
                out.append(("consumer_wgs", 1, "2 or 3 unless dtype is 16-bit and pack_gqa is true (one consumer "
                                               "warpgroup is PackGQA's decode tile)"))
        if params["dtype"] == "e4m3":
            if isinstance(bn, int) and bn % 32:
                out.append(("block_n", bn, "a multiple of 32 with dtype e4m3 (the P V GEMM steps k32 over block_n; "
                                           f"S's descale groups are 32 or {QUANT_BLOCK} keys)"))
            if params.get("pack_gqa"):
                out.append(("pack_gqa", True, "false with dtype e4m3 (the FP8 forward has no PackGQA yet)"))
            if hd != hdv:
                out.append(("head_dim_v", hdv, f"equal to head_dim ({hd}) with dtype e4m3"))
            if params.get("varlen"):
                out.append(("varlen", True, "false with dtype e4m3 (the FP8 forward reads uniform lengths; "
                                            "flash_attn_varlen_func runs FP8 as one call per run of equal lengths)"))
        elif params.get("vt_global"):
            out.append(("vt_global", True, "false unless dtype is e4m3 (16-bit V is read MN-major in place)"))
        if params.get("rowsum_mma") and params["dtype"] != "e4m3":
            out.append(("rowsum_mma", True, "false unless dtype is e4m3 (16-bit tiles ran 1-13 % slower with it, H200: configs/fwd_tune.yaml)"))
        if params.get("rowsum_mma") and params.get("exp_turns"):
            out.append(("rowsum_mma", True, "false with exp_turns (the turn's pass would wait on two exponentials "
                                            "only; ptxas issued it before most of them)"))
        if out:
            return out
        r = self.resources(params)
        if params.get("q_stages", 1) == 2 and params.get("pack_gqa"):
            out.append(("q_stages", 2, "1 with pack_gqa (its 5-D Q load and packed tile slot have one buffer)"))
        if r["smem_bytes"] > SMEM_LIMIT:
            out.append((
                "smem_bytes", r["smem_bytes"],
                f"at most {SMEM_LIMIT} (227 KB); {params.get('q_stages', 1)} x Q {bm}x{r['head_dim_padded']} + {st} "
                f"stages x K/V {bn}x{r['head_dim_padded']} x 2 bytes + 2048: lower block_n, stages or q_stages",
            ))
        n_before = len(out)
        if wgs == 3:
            if r["head_dim_padded"] > 128:
                out.append(("head_dim", hd, "<= 128 with 3 consumer warpgroups (160 registers/thread); use consumer_wgs 2"))
            if bn > 128:
                out.append(("block_n", bn, "<= 128 with 3 consumer warpgroups (160 registers/thread)"))
        if len(out) == n_before:
            need = _acc_regs(bn, r["head_dim_v_padded"], r["fp8"], params.get("overlap", True))  # S, O, packed P
            limit = r["consumer_regs"] - ACC_REG_HEADROOM
            if need > limit:
                out.append((
                    "block_n", bn,
                    f"small enough that the accumulators fit: block_n/2 + head_dim_v_padded/2 + block_n/"
                    f"{8 if r['fp8'] else 4} = {need} "
                    f"registers > {limit} ({r['consumer_regs']} per consumer thread with {wgs} consumer warpgroups, "
                    f"minus {ACC_REG_HEADROOM} headroom); lower block_n"
                    + (" or use consumer_wgs 2" if wgs == 3 else ""),
                ))
        return out

    def kernels(self, params, resources):
        mma = "QGMMA" if resources["fp8"] else "HGMMA"  # e4m3 WGMMA is QGMMA in SASS
        # e4m3 with an O tile: O staged and TMA-stored (the other e4m3 tiles store it from registers)
        tma_o = ("UTMASTG",) if resources["fp8"] and resources["separate_o"] else ()
        # varlen: PREEXIT (griddepcontrol.launch_dependents at the start: a split call's combine, a programmatic
        # dependent, launches while this grid runs and waits for its completion; templates/fwd.cu.j2)
        trigger = ("PREEXIT",) if params.get("varlen") else ()
        main = KernelSpec("main", resources["threads"], resources["smem_bytes"], PARAMS,
                          tensor_maps=("q", "k", "v", "o"), sass=(mma, "UTMALDG", "USETMAXREG") + tma_o + trigger)
        if resources.get("vt_global"):  # the V^T preprocess first; main's map "v" is then V^T's
            return [KernelSpec("vt", resources["vt_threads"], 0, PARAMS), main]
        return [main]

    def name_parts(self, p):
        hd = f"hd{p['head_dim']}" + (f"v{p['head_dim_v']}" if p["head_dim_v"] != p["head_dim"] else "")
        return [p["dtype"], hd, "causal" if p["causal"] else "local" if p["local"] else "noncausal", *(["softcap"] if p["softcap"] else []),
                *(["packgqa"] if p.get("pack_gqa") else []), *(["varlen"] if p.get("varlen") else []),
                f"m{p['block_m']}n{p['block_n']}",
                f"s{p['stages']}", *(["q2"] if p.get("q_stages", 1) == 2 else []), f"wg{p['consumer_wgs']}", "pp" if p["pingpong"] else "nopp",
                "ov" if p["overlap"] else "noov", "ps" if p["persistent"] else "nops",
                *([] if p.get("late_pv_wait", True) else ["ew"]), *(["xt"] if p.get("exp_turns") else []),
                *(["rsm"] if p.get("rowsum_mma") else []),
                *(["vtg"] if p.get("vt_global") else [])]

    def suggest(self, key):
        """FA3's published tiles (DESIGN.md §4) as the starting point for a missing key (head dims
        rounded up to a built size: a call with a smaller one is served by it)."""
        key = {**key, **{k: min((h for h in HEAD_DIMS if h >= key[k]), default=key[k])
                         for k in ("head_dim", "head_dim_v") if isinstance(key.get(k), int)}}
        d = max(key["head_dim"], key.get("head_dim_v", key["head_dim"]))
        if d <= 64:
            bm, bn = 192, 128
        elif d <= 128:
            bm, bn = (128, 128) if key["causal"] or d <= 96 else (128, 176)
        elif d <= 192:
            bm, bn = 128, 112
        else:
            bm, bn = 128, 80
        return {**key, "block_m": bm, "block_n": bn, "consumer_wgs": bm // 64}


FAMILY = FwdFamily(
    name="fwd",
    doc="FA3 forward (fp16/bf16)",
    keys=(
        Key("dtype", str, "axis", allowed=DTYPES, doc="Q/K/V/O element type (fp32 accumulation)"),
        Key("head_dim", int, "axis", allowed=HEAD_DIMS, doc="Q/K head dim"),
        Key("head_dim_v", int, "derived", allowed=HEAD_DIMS, doc="V/O head dim (default: head_dim)"),
        Key("causal", bool, "axis", doc="bottom-right aligned causal mask"),
        Key("local", bool, "axis", default=False,
            doc="FA3's local mask: a band with runtime bounds (sliding windows, causal with a window)"),
        Key("softcap", bool, "axis", default=False, doc="logit soft-capping S <- softcap * tanh(S / softcap)"),
        Key("pack_gqa", bool, "axis", default=False,
            doc="FA3's PackGQA: the query heads of a K/V head packed into one tile (K/V read once per group)"),
        Key("varlen", bool, "axis", default=False,
            doc="FA3's varlen: per-sequence lengths and offsets read by the kernel (cu_seqlens_q / cu_seqlens_k, "
                "seqused_q / seqused_k); O and LSE stored with row bounds"),
        Key("block_m", int, "tile", allowed=(64, 128, 192), doc="query rows per CTA tile (64 x consumer_wgs)"),
        Key("block_n", int, "tile", check=_block_n, doc="key rows per K/V stage"),
        Key("stages", int, "knob", allowed=STAGES, default=2, doc="K/V ring depth"),
        Key("q_stages", int, "knob", allowed=(1, 2), default=1,
            doc="Q buffers: with 2 the producer loads the next tile's Q into the other buffer while the current "
                "tile runs (fwd.cu.j2 kQStages; where O is staged in Q's buffer, the buffer is free once the "
                "tile before's O store has read it); not with PackGQA"),
        Key("consumer_wgs", int, "tile", allowed=CONSUMER_WGS, doc="consumer warpgroups (64 query rows each)"),
        Key("pingpong", bool, "knob", default=True, doc="named-barrier pingpong between consumer warpgroups"),
        Key("overlap", bool, "knob", default=True, doc="intra-warpgroup GEMM/softmax overlap (Algorithm 2)"),
        Key("persistent", bool, "knob", default=True, doc="persistent grid (#SMs CTAs)"),
        Key("late_pv_wait", bool, "knob", default=True,
            doc="with overlap: wait for P V_{j-1} after the softmax of S_j, so that the softmax runs under "
                "that GEMM (false: the wait ptxas hoists above the softmax; measured better for e4m3 "
                "head_dim 256 and head_dim 64 causal)"),
        Key("exp_turns", bool, "knob", default=False,
            doc="the consumer warpgroups take turns for their softmax exponentials (a second named-barrier "
                "ring), so one warpgroup's MUFU.EX2 phase runs at a time (fwd.cu.j2 kExpTurns)"),
        Key("rowsum_mma", bool, "knob", default=False,
            doc="e4m3: O's softmax row sums on the tensor cores: each P V GEMM also issues L += P 1 (an m64n8 WGMMA "
                "per k-step against a tile of ones) instead of one FADD per score; the exact fp32 sums only where "
                "the lse is written (fwd.cu.j2 kRowsumMma)"),
        Key("vt_global", bool, "knob", default=False,
            doc="e4m3: V^T written to per-call scratch by a preprocess kernel and TMA-loaded (no in-kernel "
                "V transpose; fwd.cu.j2 kVtGlobal)"),
    ),
    tile_match=("head_dim", "dtype", "causal", "local", "softcap", "pack_gqa", "varlen"),
    tile_required=("head_dim", "block_m", "block_n", "consumer_wgs"),
    dispatch_keys=("dtype", "head_dim", "head_dim_v", "causal", "local", "softcap", "pack_gqa", "varlen"),
)
