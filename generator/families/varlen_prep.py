"""The ``varlen_prep`` family: one small kernel launched before the varlen forward where no one has read the
offsets on the host (``flash_attn_varlen_func`` with GPU offsets: eagerly by default, under torch.compile, under
CUDA-graph capture; FA3's varlen API, hopper/flash_api.cpp, which reads these offsets on the GPU and checks none of
their values).

It does two things in one launch, replacing about 20 small torch kernels (``torch._assert_async`` over the offsets)
and two memsets (out 0, lse -inf over every row):

- **checks FA3's varlen contract** (flashgen._validate.varlen_problems, the same rules as the host path): CTA 0's
  threads walk the ``batch`` sequences of both sides; cu_seqlens from 0, non-decreasing, the last at most total_q /
  total_k; seqused between 0 and its sequence's rows; max_seqlen at least every (used) sequence's length. A broken
  rule is a device-side assert whose text names the argument (the CUDA context is lost, as with any device assert;
  the assert runs before the forward kernel queued after it on the stream).
- **fills the rows of no sequence** of out (0) and lse (-inf), the rows the forward does not write: past
  cu_seqlens_q[batch], and with seqused_q the rows of each sequence past its used ones. One warp per row (grid-stride);
  with seqused_q a row finds its sequence by binary search over cu_seqlens_q. out's rows are ``out_row_bytes``
  (heads x head_dim_v x element size, a multiple of 16) written as 16-byte zeros, so the dtype is not an axis and
  one variant serves every call.

A second kernel (role ``kvcache``) prepares a ``flash_attn_with_kvcache`` step whose lengths are not read on the host
(kvcache._step_on_device: CUDA-graph capture, and eager calls by default), replacing about 12-20 small torch kernels
(asserts, index arithmetic, two index_put) with one launch:

- **checks** the step's cache arguments (CTA 0; :func:`kvcache_messages`, the same texts as the torch path's):
  cache_seqlens + the new tokens within the cache's positions, cache_batch_idx rows in range and (with an append)
  distinct, cache_leftpad between 0 and each entry's tokens, the used pages' numbers in range;
- **appends** the new k / v rows into the cache (every CTA, 16-byte copies; entry b's token i at position
  cache_seqlens[b] + i of its cache row or page), each copy guarded by its own range checks, so a broken argument is
  an assert, never a write outside the cache;
- **writes seqused_k** = cache_seqlens + the new tokens (the varlen forward's key counts);
- **rotary** (FA3's ``rotary_cos`` / ``rotary_sin``, where the call has them): the appended keys' first rotary_dim
  dims rotated at their positions on the way into the cache, and q rotated into a new tensor (interleaved pairs or
  halves, in float32 rounded once, the arithmetic of kvcache.apply_rotary), replacing about 28 torch kernels.
k / v are copied byte for byte (the caller converts a dtype that differs from the cache's first), so the dtype is
not an axis either (rotary reads a flag: fp16 or bf16).

Template: templates/varlen_prep.cu.j2, two kernels (roles ``main`` and ``kvcache``), no tensor maps, static shared
memory only (one word; the kvcache kernel's bitmap of cache rows, ``KVCACHE_ROW_BITS`` bits).
API: runtime/varlen_prep.py (``varlen_prepare``, ``kvcache_prepare``), called by interface._varlen_kernel and
kvcache._step_on_device.
"""
from __future__ import annotations

from ..abi import params_struct
from . import Family, Key, KernelSpec

PARAMS = params_struct(
    "VarlenPrepParams",
    # int32 (batch + 1,) offsets and (batch,) seqused (nullptr: none) on the launch's device
    ("cu_seqlens_q", "ptr", "const int*"), ("cu_seqlens_k", "ptr", "const int*"),
    ("seqused_q", "ptr", "const int*"), ("seqused_k", "ptr", "const int*"),
    ("out", "ptr", "void*"),  # (total_q, heads, head_dim_v) contiguous, 16-byte aligned; nullptr: check only
    ("lse", "ptr", "float*"),  # (heads, total_q) contiguous fp32 (used with out)
    ("out_row_bytes", "i64"),  # one row of out: heads x head_dim_v x element size, a multiple of 16
    ("batch", "i32"), ("total_q", "i32"), ("total_k", "i32"), ("max_seqlen_q", "i32"), ("max_seqlen_k", "i32"),
    ("heads", "i32"),
)

# The kvcache kernel's rotary arguments, KvcachePrepParams' last fields (a launch without rotary zeroes them all:
# runtime/varlen_prep.py _NO_ROTARY).
KVCACHE_ROTARY_FIELDS = (
    # rotary_dim 0: no rotary. q (batch, seqlen_q, heads, q_row_bytes / 2 16-bit elements), byte strides
    # (batch, row, head), rotated into q_rot (contiguous, q's shape); the new keys rotated as they are appended;
    # rotary_cos / rotary_sin contiguous (seqlen_ro, rotary_dim / 2) of rotary_cos_dtype (0 fp32, 1 fp16, 2 bf16);
    # rotary_seqlens int32 (batch,) each entry's first position, or nullptr: cache_seqlens;
    # rotary_flags: 1 interleaved pairs (else halves), 2 bf16 data (else fp16), 4 q's rows each at its own position
    ("q", "ptr", "const char*"), ("q_rot", "ptr", "char*"),
    ("rotary_cos", "ptr", "const char*"), ("rotary_sin", "ptr", "const char*"),
    ("rotary_seqlens", "ptr", "const int*"),
    ("q_stride_b", "i64"), ("q_stride_t", "i64"), ("q_stride_h", "i64"),
    ("q_row_bytes", "i32"), ("seqlen_q", "i32"), ("heads", "i32"),
    ("rotary_dim", "i32"), ("seqlen_ro", "i32"), ("rotary_flags", "i32"), ("rotary_cos_dtype", "i32"),
)

# The kvcache kernel's arguments. Byte strides of k / v (batch, new token, head) and of the caches (row or page,
# position, head); rows of k_row_bytes / v_row_bytes (multiples of 16, as every stride and base address).
KVCACHE_PARAMS = params_struct(
    "KvcachePrepParams",
    # int32 on the launch's device: cache_seqlens (batch,) or nullptr (every entry at seqlen_const);
    # cache_batch_idx, cache_leftpad (batch,) or nullptr; page_table (batch, pages) rows page_table_stride apart
    ("cache_seqlens", "ptr", "const int*"), ("cache_batch_idx", "ptr", "const int*"),
    ("cache_leftpad", "ptr", "const int*"), ("page_table", "ptr", "const int*"),
    ("seqused_k", "ptr", "int*"),  # (batch,) out: cache_seqlens + n
    ("k_new", "ptr", "const char*"), ("v_new", "ptr", "const char*"),  # nullptr when n = 0
    ("k_cache", "ptr", "char*"), ("v_cache", "ptr", "char*"),
    ("k_new_stride_b", "i64"), ("k_new_stride_t", "i64"), ("k_new_stride_h", "i64"),
    ("v_new_stride_b", "i64"), ("v_new_stride_t", "i64"), ("v_new_stride_h", "i64"),
    ("k_cache_stride_r", "i64"), ("k_cache_stride_t", "i64"), ("k_cache_stride_h", "i64"),
    ("v_cache_stride_r", "i64"), ("v_cache_stride_t", "i64"), ("v_cache_stride_h", "i64"),
    ("k_row_bytes", "i32"), ("v_row_bytes", "i32"),
    ("batch", "i32"), ("n_new", "i32"), ("heads_k", "i32"),
    ("seqlen_const", "i32"),  # every entry's cache_seqlens when the pointer is null
    ("capacity", "i32"),  # each entry's positions: the cache's length, or pages x page_size
    ("cache_blocks", "i32"),  # k_cache's dim 0: cache rows, or pages with a page table
    ("page_size", "i32"), ("page_table_stride", "i32"),
    *KVCACHE_ROTARY_FIELDS,
)
KVCACHE_ROW_BITS = 1 << 16  # the distinct-rows check's shared bitmap (8 KB): caches of at most this many rows
# The kvcache kernel's CTAs per SM: its __launch_bounds__' minimum (registers capped so that they are all resident)
# and the runtime's grid cap (runtime/varlen_prep.py), so that a prefill's copies keep enough loads in flight.
KVCACHE_CTAS_PER_SM = 4


def contract_messages() -> tuple:
    """The messages of FA3's varlen contract broken, one per rule, in the order the kernel checks them (its problem
    bit i is message i): per side q then k, the offsets, seqused, max_seqlen. The kernel's asserts print them; the
    torch path (interface._check_offsets_on_device) raises the same ones, so a message does not depend on the path."""
    out = []
    for side, rows in (("q", "q"), ("k", "k and v")):
        out += [f"flashgen: cu_seqlens_{side} must start at 0, not decrease and end at most at the number of rows of "
                f"{rows} (dim 0)",
                f"flashgen: seqused_{side} must be between 0 and each sequence's length (cu_seqlens_{side})",
                f"flashgen: max_seqlen_{side} is less than the longest sequence"]
    assert not any(c in m for m in out for c in '"\\'), "the messages are C string literals in the template"
    return tuple(out)


def kvcache_messages() -> tuple:
    """The messages of a kvcache step's broken arguments, in the kvcache kernel's bit order (bit i is message i):
    lengths, batch_idx, leftpad, pages, rotary positions. The kernel asserts with them; kvcache._step_on_device's
    torch path raises the same ones."""
    out = ("flashgen: cache_seqlens + the new tokens must lie between 0 and the cache's positions (k_cache's "
           "capacity)",
           "flashgen: cache_batch_idx must name distinct rows of k_cache (each in [0, k_cache.shape[0]))",
           "flashgen: cache_leftpad must lie between 0 and each entry's tokens",
           "flashgen: page_table's used entries must name blocks of k_cache (each in [0, k_cache.shape[0]))",
           "flashgen: rotary positions (rotary_seqlens, else cache_seqlens, up to the last new token or q row) must "
           "lie within rotary_cos's rows")
    assert not any(c in m for m in out for c in '"\\'), "the messages are C string literals in the template"
    return out


class VarlenPrepFamily(Family):
    def resources(self, params):
        """threads, the asserts' messages (:func:`contract_messages`, :func:`kvcache_messages`), the kvcache kernel's
        row bitmap; no dynamic shared memory."""
        return dict(threads=int(params["threads"]), messages=contract_messages(), kvcache_messages=kvcache_messages(),
                    row_bits=KVCACHE_ROW_BITS, kvcache_ctas_per_sm=KVCACHE_CTAS_PER_SM,
                    smem={}, smem_bytes=0)

    def kernels(self, params, resources):
        # SASS: the stores of the fill (STG) and the asserts' calls of __assertfail (CALL: not compiled out)
        return [KernelSpec("main", resources["threads"], 0, PARAMS, sass=("STG", "CALL")),
                KernelSpec("kvcache", resources["threads"], 0, KVCACHE_PARAMS, sass=("LDG", "STG", "CALL", "ATOMS"))]

    def name_parts(self, p):
        return [f"t{p['threads']}"]


FAMILY = VarlenPrepFamily(
    name="varlen_prep",
    doc="varlen offsets checked on the GPU and out / lse rows of no sequence filled (before the varlen forward); "
        "a kvcache step's arguments checked, its new k / v appended and seqused_k written",
    keys=(
        Key("threads", int, "knob", allowed=(128, 256), default=256, doc="threads per CTA"),
    ),
    dispatch_keys=(),
)
