"""The ``combine`` family: merge split-KV partial attention outputs (FA3's ``flash_attn_combine``).

Split-KV (flash-decoding, FA3 §3 / the seeds' "split-KV decode") runs the forward over slices of
the keys and writes, per slice s, an fp32 partial output O_s normalised within the slice and its
log-sum-exp L_s. The combine kernel merges them row by row:
``L = log sum_s exp(L_s)``, ``O = sum_s exp(L_s - L) O_s``; a slice with L_s = -inf contributes
nothing and a row whose slices are all empty gives O = 0, L = -inf.

Template: templates/combine.cu.j2. One kernel (role ``main``), no tensor maps; each CTA merges
``block_m`` rows with ``threads`` threads. head_dim (up to 256) and num_splits (up to
``MAX_SPLITS``) are runtime values; the output dtype is the dispatch axis.
"""
from __future__ import annotations

from ..abi import params_struct
from . import Family, Key, KernelSpec

DTYPES = ("fp32", "bf16", "fp16")  # output dtype; partials are always fp32
MAX_SPLITS = 256
MAX_HEAD_DIM = 256
STATIC_SMEM_LIMIT = 48 * 1024  # the per-split scales live in static shared memory

PARAMS = params_struct(
    "CombineParams",
    ("out_partial", "ptr", "const float*"),  # (num_splits, batch, seqlen, heads, head_dim), last dim contiguous
    ("lse_partial", "ptr", "const float*"),  # (num_splits, batch, seqlen, heads)
    ("out", "ptr", "void*"),  # (batch, seqlen, heads, head_dim) of the output dtype, last dim contiguous
    ("lse", "ptr", "float*"),  # (batch, heads, seqlen) contiguous
    ("op_stride_split", "i64"), ("op_stride_batch", "i64"), ("op_stride_seq", "i64"), ("op_stride_head", "i64"),
    ("lp_stride_split", "i64"), ("lp_stride_batch", "i64"), ("lp_stride_seq", "i64"), ("lp_stride_head", "i64"),
    ("o_stride_batch", "i64"), ("o_stride_seq", "i64"), ("o_stride_head", "i64"),
    ("num_splits", "i32"), ("batch", "i32"), ("seqlen", "i32"), ("heads", "i32"), ("head_dim", "i32"),
    ("vec4", "i32"),  # 1: float4 loads of out_partial and 4-element stores of out are legal
    ("one_pass", "i32"),  # 1: CTAs of at most 2 float4 items per thread take 8-16 splits per step (runtime.combine)
)


def _pow2(lo, hi):
    def check(v):
        return None if lo <= v <= hi and v & (v - 1) == 0 else f"a power of 2 in [{lo}, {hi}]"
    return check


class CombineFamily(Family):
    def resources(self, params):
        """threads, max_splits, max_head_dim, static_smem_bytes (scales of the CTA's rows), no dynamic smem."""
        return dict(threads=int(params["threads"]), max_splits=MAX_SPLITS, max_head_dim=MAX_HEAD_DIM,
                    static_smem_bytes=MAX_SPLITS * int(params["block_m"]) * 4, smem={}, smem_bytes=0)

    def problems(self, params):
        r = self.resources(params)
        if r["static_smem_bytes"] > STATIC_SMEM_LIMIT:
            fit = STATIC_SMEM_LIMIT // (MAX_SPLITS * 4)
            return [("block_m", params["block_m"],
                     f"at most {1 << (fit.bit_length() - 1)} ({MAX_SPLITS} splits x block_m fp32 scales "
                     f"must fit {STATIC_SMEM_LIMIT} bytes of static shared memory)")]
        return []

    def kernels(self, params, resources):
        # a programmatic dependent (PDL) of the kernel before it: the split forward (the varlen fwd variants
        # trigger at their start); ACQBULK: its griddepcontrol.wait before the first read of the partials
        return [KernelSpec("main", resources["threads"], resources["smem_bytes"], PARAMS, sass=("ACQBULK",), pdl=True)]

    def name_parts(self, p):
        return [p["dtype"], f"m{p['block_m']}", f"t{p['threads']}"]


FAMILY = CombineFamily(
    name="combine",
    doc="split-KV combine (FA3 flash_attn_combine)",
    keys=(
        Key("dtype", str, "axis", allowed=DTYPES, doc="output dtype (partials are fp32)"),
        Key("block_m", int, "knob", check=_pow2(4, 64), default=8, doc="rows merged per CTA"),
        Key("threads", int, "knob", allowed=(128, 256), default=128, doc="threads per CTA"),
    ),
    tile_match=("dtype",),
    dispatch_keys=("dtype",),
)
