"""The ``quant`` family: FP8 (e4m3) quantization of Q, K, V for the FP8 forward, with FA3's block
quantization and incoherent processing (arXiv 2407.08608, §3.3; ``flashgen.quantize_fp8``).

Per call, for q ``(batch, seqlen_q, heads, head_dim)``, k ``(batch, seqlen_k, heads_k, head_dim)``
and v ``(batch, seqlen_k, heads_k, head_dim_v)`` (fp16 or bf16, the ``dtype`` axis):

- incoherent processing (q and k only, optional): ``x' = (x ⊙ s) H_B / sqrt(B)`` on every block of
  B consecutive head_dim coordinates, B the largest power of two dividing head_dim (at most 256),
  H_B the Walsh-Hadamard matrix in natural order, s a ±1 vector of head_dim signs (the same for q
  and k, so ``q' k'ᵀ = q kᵀ``). Computed by a fast Walsh-Hadamard transform
  (templates/include/flashgen/hadamard.cuh): 3 stages inside a thread's 8 values, log2(B / 8)
  stages by warp shuffles.
- quantization: ``x8 = satfinite_e4m3(x' / descale)``, ``descale = amax / 448`` (1 where amax is 0)
  over the scale's group: with block quantization one scale per ``QUANT_BLOCK`` (64) rows of each
  q / k head; otherwise one per (batch, key head), over all rows (q: over the query heads of the
  GQA group too); v always one per (batch, key head).

Template: templates/quant.cu.j2. Two kernels, launched in order on one stream:

- ``amax``: the amax of x' per (tensor, batch, head, 64-row block), into an fp32 workspace, for
  the tensors whose scale spans more than one block (v always; q and k without block quantization).
- ``quant``: per tile, the transform again (cheaper than a round trip through memory), the scale
  (the tile's own amax for block-quantized q / k; else the max of the workspace entries of its
  group, reduced by every CTA that needs it), e4m3 out, descales out.

A CTA is 256 threads (``THREADS``) holding ``ITEMS`` (8) 16-byte chunks each: 8 consecutive
elements of one row, loaded once (q / k under block quantization are read from memory exactly
once). Thread t takes chunk ``c = t % C`` (C = dim / 8) of row ``t / C`` in each pass of
``R = 256 // C`` rows; ``2^items_log2`` passes cover the 64 rows of a block and a CTA takes
``8 >> items_log2`` heads of the same rows (small head dims: 4 heads of 64, 2 of 128), so every
CTA moves about 32 KB (:func:`tile_geometry`). Chunks of one Hadamard block are then on
consecutive lanes of one warp, which is what the shuffle stages need.

Why head_dim is not an axis: the kernel is memory-bound and its inner loops (8 items x 8 values)
do not depend on head_dim; head_dim only sets the thread -> (row, chunk) map, the pass count and
the number of shuffle stages, all cheap runtime values. One variant per input dtype therefore
serves every head_dim that is a multiple of 8 up to 256, and q / k and v of different head dims in
the same launch; the default build is 2 small variants (a few seconds each).
"""
from __future__ import annotations

from ..abi import params_struct
from . import Family, Key, KernelSpec

DTYPES = ("bf16", "fp16")  # input dtype; outputs are e4m3 and fp32 descales
QUANT_BLOCK = 64  # rows per block scale (the FP8 forward reads its descales per 64 rows too)
THREADS = 256
ITEMS = 8  # 16-byte chunks per thread
CHUNK = 8  # elements per chunk (16 bytes of fp16 / bf16)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
E4M3_MAX = 448.0
MAX_HADAMARD = 256
REGISTER_FILE = 65536
SIGN_WORDS = MAX_HEAD_DIM // 32  # the ±1 vector as bits, 32 per u32 field

PARAMS = params_struct(
    "QuantParams",
    # inputs (batch, seqlen, heads, dim) of the dtype, last dim contiguous, 16-byte aligned rows
    ("q", "ptr", "const void*"), ("k", "ptr", "const void*"), ("v", "ptr", "const void*"),
    # outputs: e4m3, contiguous, the inputs' shapes
    ("q8", "ptr", "void*"), ("k8", "ptr", "void*"), ("v8", "ptr", "void*"),
    # descales, fp32, contiguous: q (batch, heads, q_blocks) or (batch, heads_k); k (batch, heads_k,
    # k_blocks) or (batch, heads_k); v (batch, heads_k)
    ("q_descale", "ptr", "float*"), ("k_descale", "ptr", "float*"), ("v_descale", "ptr", "float*"),
    # workspace: amax of x' per (batch, head, block), fp32 (batch, heads, blocks); only for the tensors
    # the ``amax`` kernel visits (any value elsewhere)
    ("q_amax", "ptr", "float*"), ("k_amax", "ptr", "float*"), ("v_amax", "ptr", "float*"),
    ("q_stride_batch", "i64"), ("q_stride_seq", "i64"), ("q_stride_head", "i64"),  # elements
    ("k_stride_batch", "i64"), ("k_stride_seq", "i64"), ("k_stride_head", "i64"),
    ("v_stride_batch", "i64"), ("v_stride_seq", "i64"), ("v_stride_head", "i64"),
    ("batch", "i32"), ("seqlen_q", "i32"), ("seqlen_k", "i32"), ("heads", "i32"), ("heads_k", "i32"),
    ("head_dim", "i32"), ("head_dim_v", "i32"),
    ("q_blocks", "i32"), ("k_blocks", "i32"),  # ceil(seqlen / QUANT_BLOCK)
    ("q_tiles", "i32"), ("k_tiles", "i32"), ("v_tiles", "i32"),  # CTAs per tensor (tile_geometry)
    ("qk_rows", "i32"), ("qk_items_log2", "i32"),  # tile_geometry(head_dim)
    ("v_rows", "i32"), ("v_items_log2", "i32"),  # tile_geometry(head_dim_v)
    ("hadamard", "i32"),  # B (q and k), with incoherent processing
    ("incoherent", "i32"), ("block_quant", "i32"),  # 0 / 1
    ("hadamard_scale", "f32"),  # 1 / sqrt(B) rounded to fp32
    *((f"sign_bits{i}", "u32") for i in range(SIGN_WORDS)),  # bit i of s: 1 -> s_i = -1
)


def hadamard_size(head_dim: int) -> int:
    """B: the largest power of two dividing head_dim, at most 256 (64 -> 64, 96 -> 32, 192 -> 64)."""
    return min(head_dim & -head_dim, MAX_HADAMARD)


def tile_geometry(dim: int, threads: int = THREADS, items: int = ITEMS) -> tuple:
    """``(rows_per_pass, items_log2, heads_per_cta)`` of a tensor whose rows have ``dim`` elements
    (a multiple of 8 up to 256): a CTA's ``threads`` threads cover ``rows_per_pass`` rows of 8-element
    chunks per pass, ``2^items_log2`` passes reach the 64 rows of a block, and the ``items``
    chunks of a thread then span ``heads_per_cta`` heads."""
    chunks = dim // CHUNK
    rows = threads // chunks
    passes = -(-QUANT_BLOCK // rows)
    items_log2 = (passes - 1).bit_length()
    return rows, items_log2, items >> items_log2


class QuantFamily(Family):
    def resources(self, params):
        """threads, items, quant_block, e4m3_max, min_blocks' register budget; no dynamic smem."""
        return dict(threads=THREADS, items=ITEMS, quant_block=QUANT_BLOCK, e4m3_max=E4M3_MAX,
                    max_hadamard=MAX_HADAMARD, sign_words=SIGN_WORDS,
                    max_registers=REGISTER_FILE // (THREADS * int(params["min_blocks"])), smem={}, smem_bytes=0)

    def problems(self, params):
        # The tile lives in registers: ITEMS x 8 fp32 values per thread plus addresses and scales.
        regs = self.resources(params)["max_registers"]
        need = ITEMS * CHUNK + 32
        if regs < need:
            fit = REGISTER_FILE // (THREADS * need)
            return [("min_blocks", params["min_blocks"],
                     f"at most {fit} ({THREADS} threads x {need} registers per thread: the tile's "
                     f"{ITEMS * CHUNK} fp32 values per thread stay in registers)")]
        return []

    def kernels(self, params, resources):
        # SASS: 16-byte loads (LDG), warp shuffles (SHFL); the quant kernel's hardware e4m3
        # conversion (F2FP.SATFINITE.E4M3.F32.PACK_AB, not a software rounding) and stores.
        return [KernelSpec("amax", THREADS, 0, PARAMS, sass=("LDG", "SHFL")),
                KernelSpec("quant", THREADS, 0, PARAMS, sass=("LDG", "SHFL", "F2FP", "STG"))]

    def name_parts(self, p):
        return [p["dtype"], f"b{p['min_blocks']}"]


FAMILY = QuantFamily(
    name="quant",
    doc="FP8 quantization of Q/K/V: block scales, incoherent processing (FA3 §3.3)",
    keys=(
        Key("dtype", str, "axis", allowed=DTYPES, doc="input dtype (outputs are e4m3 + fp32 descales)"),
        Key("min_blocks", int, "knob", allowed=(1, 2, 3, 4), default=2,
            doc="CTAs per SM the register allocation must allow (__launch_bounds__)"),
    ),
    tile_match=("dtype",),
    dispatch_keys=("dtype",),
)
