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

Template: templates/varlen_prep.cu.j2, one kernel (role ``main``), no tensor maps, no shared memory but one word.
API: runtime/varlen_prep.py (``varlen_prepare``), called by interface._varlen_kernel.
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


class VarlenPrepFamily(Family):
    def resources(self, params):
        """threads, the asserts' messages (:func:`contract_messages`); no dynamic shared memory."""
        return dict(threads=int(params["threads"]), messages=contract_messages(), smem={}, smem_bytes=0)

    def kernels(self, params, resources):
        # SASS: the stores of the fill (STG) and the asserts' calls of __assertfail (CALL: not compiled out)
        return [KernelSpec("main", resources["threads"], 0, PARAMS, sass=("STG", "CALL"))]

    def name_parts(self, p):
        return [f"t{p['threads']}"]


FAMILY = VarlenPrepFamily(
    name="varlen_prep",
    doc="varlen offsets checked on the GPU and out / lse rows of no sequence filled (before the varlen forward)",
    keys=(
        Key("threads", int, "knob", allowed=(128, 256), default=256, doc="threads per CTA"),
    ),
    dispatch_keys=(),
)
