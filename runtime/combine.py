"""Split-KV combine, framework-neutral: argument checks and the launch of the ``combine`` kernel.

Split-KV attention (flash-decoding; FlashAttention-3, Shah et al., arXiv 2407.08608, §3, and
FA3's ``flash_attn_combine`` / ``mha_combine``) runs the forward over ``num_splits`` slices of the
keys. Slice s leaves a partial output O_s, normalised within the slice, and its log-sum-exp L_s
(natural log), both fp32. This module merges them, row by row (a row is one (batch, query, head)):

    M = max_s L_s;  w_s = exp(L_s - M);  L = M + log(sum_s w_s);  O = sum_s (w_s / sum_s w_s) O_s

A slice with L_s = -inf (it saw no key) contributes nothing and its O_s is never read (it may
hold garbage, even NaN); a row whose slices are all -inf gets O = 0 and L = -inf.

The torch API (``flashgen.interface.flash_attn_combine``) and the DLPack entry
(``flashgen.dlpack_api.flash_attn_combine_dlpack``) describe their arrays as
:class:`flashgen._validate.ArrayInfo`, run :func:`check_combine` (same errors, same messages),
allocate outputs, and end in :func:`attention_combine`. Nothing here imports torch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from . import dispatch
from . import launch
from ._validate import ELEMENT_SIZE, ArrayInfo, InputError, raise_problems
from .core import TensorArg, _env_int
from .manifest import Variant

__all__ = [
    "MAX_SPLITS",
    "MAX_HEAD_DIM",
    "OUT_DTYPES",
    "CombineProblem",
    "CombineArgumentError",
    "check_combine",
    "combine_problems",
    "check_combine_lse",
    "combine_lse_problems",
    "use_vec4",
    "attention_combine",
    "PreparedCombine",
    "prepare_combine",
    "launch_combine",
]

# The family module's limits, not copies: MAX_SPLITS (the kernel keeps every split's scale of its
# rows in shared memory; FA3's limit too), MAX_HEAD_DIM (any head_dim from 1 up to it) and the
# output dtypes (flashgen names; the partials and both LSEs are always fp32).
from .generator.families.combine import DTYPES as OUT_DTYPES, MAX_HEAD_DIM, MAX_SPLITS  # noqa: E402
_OUT_DTYPE_SPELLING = "torch.float32, torch.bfloat16 or torch.float16"
_INT32_MAX = 2**31 - 1

#: CTAs whose 16-byte (row, chunk) items are at most 2 per thread (a decode's few rows) walk 8-16 splits per step
#: instead of 4 (templates/combine.cu.j2 one_pass): each step is a round trip to L2 after the split forward, and a
#: 16-split decode's merge ended 4-6.5 us after the forward with 4 steps (session 25, H100; docs/PERF.md).
#: FLASHGEN_COMBINE_ONE_PASS=0: 4 per step everywhere.
ONE_PASS = _env_int("FLASHGEN_COMBINE_ONE_PASS", 1, 0) > 0

_OP_LAYOUT = "(num_splits, batch, seqlen, heads, head_dim)"
_LP_LAYOUT = "(num_splits, batch, seqlen, heads)"
_OUT_LAYOUT = "(batch, seqlen, heads, head_dim)"


#: The exception for several kinds of problems in one call: :class:`flashgen._validate.InputError`
#: (a ValueError and a TypeError), under the name this module has always exported.
CombineArgumentError = InputError

#: What follows ``"flashgen: "`` in every message of the combine checks (both APIs).
CONTEXT = "flash_attn_combine: "


class CombineProblem(NamedTuple):
    """The validated sizes of one combine call (ints) and its output dtype / device."""

    num_splits: int
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    out_dtype: str  # 'fp32', 'bf16' or 'fp16'
    device: int

    @property
    def out_shape(self) -> tuple:
        """``(batch, seqlen, heads, head_dim)``: the merged output's shape."""
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    @property
    def lse_shape(self) -> tuple:
        """``(batch, seqlen, heads)``: the merged LSE's logical shape (FA3's)."""
        return (self.batch, self.seqlen, self.heads)

    @property
    def lse_buffer_shape(self) -> tuple:
        """``(batch, heads, seqlen)``: the contiguous buffer the kernel writes the LSE into; the
        returned LSE is its ``transpose(1, 2)`` view (FA3's ``torch::empty({b, h, s}).transpose(1, 2)``)."""
        return (self.batch, self.heads, self.seqlen)

    @property
    def rows(self) -> int:
        """``batch * heads * seqlen``: rows to merge (one CTA per ``block_m`` of them)."""
        return self.batch * self.heads * self.seqlen

    @property
    def nothing_to_compute(self) -> bool:
        """True when the output has no row (batch, seqlen or heads is 0): no launch."""
        return self.rows == 0


def _fmt_shape(shape: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _may_overlap(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True unless the layout provably gives every element its own address: walking the dims
    of extent > 1 from the smallest |stride| up, each stride must exceed the span of the dims
    inside it (dense, padded, sliced and permuted layouts pass; broadcast 0 strides do not)."""
    span = 0
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda t: t[1]):
        if s <= span:
            return True
        span += (n - 1) * s
    return False


def check_combine(out_partial: ArrayInfo, lse_partial: ArrayInfo, out_dtype: str,
                  out: Optional[ArrayInfo] = None, also: Sequence[tuple] = ()) -> CombineProblem:
    """Check the arguments of a combine call and return its sizes; raises before any device work.

    Args:
        out_partial: float32 ``(num_splits, batch, seqlen, heads, head_dim)`` on a CUDA device,
            last dim contiguous (stride 1; any stride when head_dim is 1), any other strides.
            1 <= num_splits <= :data:`MAX_SPLITS`, 1 <= head_dim <= :data:`MAX_HEAD_DIM`.
        lse_partial: float32 ``(num_splits, batch, seqlen, heads)`` (natural-log LSE of each
            split) on out_partial's device, any strides (FA3's own layout is a transposed view
            of a ``(num_splits, batch, heads, seqlen)`` buffer).
        out_dtype: output dtype, flashgen's name: 'fp32', 'bf16' or 'fp16' (anything else,
            e.g. a framework's spelling of another dtype, is reported as a TypeError).
        out: optional caller-provided output ``(batch, seqlen, heads, head_dim)`` of out_dtype
            on out_partial's device, last dim contiguous, no two elements at one address.
        also: problems found elsewhere in the same call (``(exception class, message)`` pairs,
            see :func:`flashgen._validate.raise_problems`), reported in the same exception.

    Returns:
        :class:`CombineProblem`. batch, seqlen and heads may be 0 (nothing to compute).

    Raises:
        TypeError: a dtype is wrong (out_partial / lse_partial not float32, out_dtype not one
            of fp32 / bf16 / fp16, out's dtype not out_dtype).
        ValueError: not CUDA arrays or not on one device; wrong rank; lse_partial's shape not
            out_partial's first four dims; num_splits or head_dim out of range; a last dim
            not contiguous; out's shape wrong or its elements overlapping; a size above 2^31 - 1.
        CombineArgumentError: both kinds at once (:class:`flashgen._validate.InputError`, a
            subclass of TypeError and ValueError).
        Every problem found is listed in the one message, not only the first (see
        :func:`combine_problems`); the message starts with ``"flashgen: flash_attn_combine: "``.
    """
    raise_problems(combine_problems(out_partial, lse_partial, out_dtype, out) + list(also), CONTEXT)
    num_splits, batch, seqlen, heads, head_dim = (int(n) for n in out_partial.shape)
    return CombineProblem(num_splits, batch, seqlen, heads, head_dim, out_dtype, out_partial.device)


def combine_problems(out_partial: Optional[ArrayInfo], lse_partial: Optional[ArrayInfo], out_dtype: Optional[str],
                     out: Optional[ArrayInfo] = None) -> list:
    """Everything wrong with the arguments of :func:`check_combine`, as ``(exception class,
    message)`` pairs (see :func:`flashgen._validate.raise_problems`); empty when they are valid.

    None for out_partial, lse_partial or out_dtype stands for an argument the caller already
    reported wrong (no array at all, no dtype): the checks that need it are skipped, the
    others still run. So is any check whose inputs failed an earlier one (shape comparisons
    need the ranks right); every independent problem is listed.
    """
    P: list = []
    V, T = ValueError, TypeError
    op, lp = out_partial, lse_partial
    # devices
    if op is not None and not op.is_cuda:
        P.append((V, f"out_partial must be a CUDA tensor/array, got one on {op.device_repr}"))
    if lp is not None and not lp.is_cuda:
        P.append((V, f"lse_partial must be a CUDA tensor/array, got one on {lp.device_repr}"))
    elif lp is not None and op is not None and op.is_cuda and lp.device != op.device:
        P.append((V, f"lse_partial must be on out_partial's device {op.device_repr}, got {lp.device_repr}"))
    # dtypes
    for name, a in (("out_partial", op), ("lse_partial", lp)):
        if a is not None and a.dtype != "fp32":
            P.append((T, f"{name} must have dtype float32 (split-KV partials are fp32), got {a.dtype_repr}"))
    dtype_ok = out_dtype in OUT_DTYPES
    if out_dtype is not None and not dtype_ok:
        P.append((T, f"out_dtype must be {_OUT_DTYPE_SPELLING} (flashgen names fp32, bf16, fp16), "
                     f"got {out_dtype}"))
    # shapes
    op_shape = () if op is None else tuple(op.shape)
    lp_shape = () if lp is None else tuple(lp.shape)
    op_ok = len(op_shape) == 5
    if op is not None and not op_ok:
        P.append((V, f"out_partial must be 5-D {_OP_LAYOUT}, got {len(op_shape)}-D shape {_fmt_shape(op_shape)}"))
    if lp is not None and len(lp_shape) != 4:
        P.append((V, f"lse_partial must be 4-D {_LP_LAYOUT}, got {len(lp_shape)}-D shape {_fmt_shape(lp_shape)}"))
    elif lp is not None and op_ok and lp_shape != op_shape[:4]:
        P.append((V, f"lse_partial must have shape {_LP_LAYOUT} = {_fmt_shape(op_shape[:4])} to match "
                     f"out_partial {_fmt_shape(op_shape)}, got {_fmt_shape(lp_shape)}"))
    if op_ok:
        num_splits, batch, seqlen, heads, head_dim = (int(n) for n in op_shape)
        if not 1 <= num_splits <= MAX_SPLITS:
            P.append((V, f"num_splits (dim 0 of out_partial) must be between 1 and {MAX_SPLITS}, got {num_splits}"))
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            P.append((V, f"head_dim (dim 4 of out_partial) must be between 1 and {MAX_HEAD_DIM}, got {head_dim}"))
        for what, n in (("batch", batch), ("seqlen", seqlen), ("heads", heads)):
            if n > _INT32_MAX:
                P.append((V, f"{what} must be at most {_INT32_MAX}, got {n}"))
        if head_dim > 1 and 0 not in op_shape and op.strides[-1] != 1:
            P.append((V, f"out_partial's last dim (head_dim) must be contiguous (stride 1), got strides "
                         f"{tuple(op.strides)}; pass out_partial.contiguous()"))
    # out
    if out is not None:
        if op is not None and (not out.is_cuda or (op.is_cuda and out.device != op.device)):
            P.append((V, f"out must be on out_partial's CUDA device {op.device_repr}, got {out.device_repr}"))
        if dtype_ok and out.dtype != out_dtype:
            P.append((T, f"out has dtype {out.dtype_repr} but out_dtype is {out_dtype} (the default is float32): "
                         f"pass out_dtype= the dtype of out, or an out of dtype {out_dtype}"))
        o_shape = tuple(out.shape)
        if op_ok and o_shape != (batch, seqlen, heads, head_dim):
            P.append((V, f"out must have shape {_OUT_LAYOUT} = {_fmt_shape((batch, seqlen, heads, head_dim))}, "
                         f"got {_fmt_shape(o_shape)}"))
        elif len(o_shape) != 4:  # out_partial's shape is unusable: out's rank can still be checked
            P.append((V, f"out must be 4-D {_OUT_LAYOUT}, got {len(o_shape)}-D shape {_fmt_shape(o_shape)}"))
        elif 0 not in o_shape:  # an empty array's strides are arbitrary
            if o_shape[-1] > 1 and out.strides[-1] != 1:
                P.append((V, f"out's last dim (head_dim) must be contiguous (stride 1), got strides "
                             f"{tuple(out.strides)}"))
            elif _may_overlap(o_shape, out.strides):
                P.append((V, f"out's elements may share memory (shape {_fmt_shape(o_shape)}, strides "
                             f"{tuple(out.strides)}: a broadcast/expanded view?); every output element needs "
                             "its own address"))
    return P


def _lse_buffer_layout_ok(shape: tuple, strides: tuple, p: CombineProblem) -> bool:
    """True when (shape, strides) addresses element (b, l, h) at ``(b * heads + h) * seqlen + l``:
    either the (batch, seqlen, heads) view with strides (heads * seqlen, 1, seqlen), or the
    (batch, heads, seqlen) buffer itself, C-contiguous. Dims of extent 1 may have any stride."""
    b, s, h = p.batch, p.seqlen, p.heads
    if shape in ((b, s, h), (b, h, s)) and 0 in shape:  # empty: nothing is written, strides are arbitrary
        return True
    if shape == (b, s, h):
        want = (h * s, 1, s)
    elif shape == (b, h, s):
        want = (h * s, s, 1)
    else:
        return False
    return all(n <= 1 or st == w for n, st, w in zip(shape, strides, want))


def check_combine_lse(lse: ArrayInfo, p: CombineProblem, ptr: Optional[int] = None) -> None:
    """Check a caller-provided merged-LSE array (DLPack entry): float32 on the problem's device,
    the ``(batch, seqlen, heads)`` transposed view of a contiguous ``(batch, heads, seqlen)``
    buffer (what flash_attn_combine returns), or that buffer itself; base address (bytes, when
    given) 4-byte aligned. TypeError for the dtype, ValueError otherwise, CombineArgumentError
    for both; every problem is listed (see :func:`combine_lse_problems`)."""
    raise_problems(combine_lse_problems(lse, p, ptr), CONTEXT)


def combine_lse_problems(lse: ArrayInfo, p: CombineProblem, ptr: Optional[int] = None) -> list:
    """The problems (``(exception class, message)`` pairs) of :func:`check_combine_lse`'s ``lse``."""
    P: list = []
    if not lse.is_cuda or lse.device != p.device:
        P.append((ValueError, f"lse must be on out_partial's CUDA device cuda:{p.device}, got {lse.device_repr}"))
    if lse.dtype != "fp32":
        P.append((TypeError, f"lse must have dtype float32, got {lse.dtype_repr}"))
    shape = tuple(lse.shape)
    if shape not in (p.lse_shape, p.lse_buffer_shape):
        P.append((ValueError, f"lse must have shape (batch, seqlen, heads) = {_fmt_shape(p.lse_shape)} (or be the "
                              f"(batch, heads, seqlen) buffer {_fmt_shape(p.lse_buffer_shape)}), got {_fmt_shape(shape)}"))
    elif not _lse_buffer_layout_ok(shape, tuple(lse.strides), p):
        P.append((ValueError, f"lse must be the transpose(1, 2) view of a contiguous (batch, heads, seqlen) buffer "
                              f"(strides {(p.heads * p.seqlen, 1, p.seqlen)}) or that buffer (strides "
                              f"{(p.heads * p.seqlen, p.seqlen, 1)}), got strides {tuple(lse.strides)}"))
    if ptr is not None and ptr % 4:
        P.append((ValueError, f"lse's base address 0x{ptr:x} is not 4-byte aligned"))
    return P


def use_vec4(out_partial: TensorArg, out: TensorArg) -> bool:
    """Whether the kernel may use 16-byte loads of out_partial and 4-element stores of out:
    head_dim % 4 == 0, out_partial's base 16-byte aligned, out's base aligned to 4 elements,
    and every stride the kernel steps by (dims of extent > 1 except the last) a multiple of 4
    elements. Otherwise the kernel's scalar path runs (same result, more instructions)."""
    if out_partial.shape[4] % 4:
        return False
    if out_partial.ptr % 16 or out.ptr % (4 * ELEMENT_SIZE[out.dtype]):
        return False
    for shape, strides in ((out_partial.shape[:4], out_partial.strides[:4]), (out.shape[:3], out.strides[:3])):
        for n, s in zip(shape, strides):
            if n > 1 and s % 4:
                return False
    return True


class _Plan(NamedTuple):
    variant: Variant
    kernel: object  # launch.LoadedKernel
    block_m: int


_plans: dict = {}  # (out_dtype, device) -> _Plan; immutable values, filled once per key


def _plan(out_dtype: str, device: int) -> _Plan:
    """The variant serving out_dtype, its loaded kernel and rows per CTA, resolved once per key
    (a hit touches no manifest; a miss raises MissingVariantError and caches nothing)."""
    key = (out_dtype, device)
    plan = _plans.get(key)
    if plan is None:
        var = dispatch.select_variant("combine", {"dtype": out_dtype})
        plan = _Plan(var, launch.get_kernel(var, "main", device), int(var.params["block_m"]))
        _plans[key] = plan
    return plan


def _launch_problems(op: TensorArg, lp: TensorArg, out: TensorArg, lse: TensorArg, out_dtype: str) -> list:
    """What the kernel itself relies on (the API layers check the rest, with nicer messages)."""
    P = []
    if len(op.shape) != 5 or len(lp.shape) != 4 or len(out.shape) != 4:
        return [f"ranks: out_partial {len(op.shape)}-D (want 5), lse_partial {len(lp.shape)}-D (want 4), "
                f"out {len(out.shape)}-D (want 4)"]
    ns, b, s, h, d = op.shape
    if not 1 <= ns <= MAX_SPLITS or not 1 <= d <= MAX_HEAD_DIM:
        P.append(f"num_splits {ns} not in 1..{MAX_SPLITS} or head_dim {d} not in 1..{MAX_HEAD_DIM}")
    if tuple(lp.shape) != (ns, b, s, h) or tuple(out.shape) != (b, s, h, d):
        P.append(f"shapes disagree: out_partial {op.shape}, lse_partial {lp.shape}, out {out.shape}")
    if op.dtype != "fp32" or lp.dtype != "fp32" or lse.dtype != "fp32" or out.dtype != out_dtype:
        P.append(f"dtypes: out_partial {op.dtype}, lse_partial {lp.dtype}, lse {lse.dtype} (want fp32), "
                 f"out {out.dtype} (want {out_dtype})")
    if d > 1 and b * s * h > 0 and (op.strides[4] != 1 or out.strides[3] != 1):
        P.append("the last dim of out_partial and out must have stride 1")
    p = CombineProblem(ns, b, s, h, d, out_dtype, op.device)
    if not _lse_buffer_layout_ok(tuple(lse.shape), tuple(lse.strides), p):
        P.append(f"lse {lse.shape} strides {lse.strides} is not a contiguous (batch, heads, seqlen) buffer "
                 "or its transpose(1, 2) view")
    for name, t in (("out_partial", op), ("lse_partial", lp), ("out", out), ("lse", lse)):
        es = ELEMENT_SIZE.get(t.dtype, 1)
        if t.ptr % es:
            P.append(f"{name}'s address 0x{t.ptr:x} is not aligned to its {es}-byte elements")
        if t.device != op.device:
            P.append(f"{name} is on cuda:{t.device}, out_partial on cuda:{op.device}")
    return P


def attention_combine(out_partial: TensorArg, lse_partial: TensorArg, out: TensorArg, lse: TensorArg,
                      out_dtype: str, stream: int) -> Variant:
    """Launch the combine kernel: merge split-KV partials into ``out`` and ``lse``.

    Math (per row (b, l, h); FA3 §3 split-KV / flash-decoding, FA3's ``flash_attn_combine``):
    ``M = max_s L_s``, ``w_s = exp(L_s - M)``, ``lse = M + log(sum w)``,
    ``out = sum_s (w_s / sum w) out_partial_s``; splits with L_s = -inf are skipped (never read);
    all -inf gives out 0 and lse -inf. Computed in fp32, rounded once to out_dtype.

    Args:
        out_partial: fp32 ``(num_splits, batch, seqlen, heads, head_dim)``, strides in elements,
            last stride 1 (1 <= num_splits <= 256, 1 <= head_dim <= 256).
        lse_partial: fp32 ``(num_splits, batch, seqlen, heads)``, any strides.
        out: ``(batch, seqlen, heads, head_dim)`` of out_dtype, last stride 1, written.
        lse: fp32, the ``(batch, seqlen, heads)`` transpose view of a contiguous
            ``(batch, heads, seqlen)`` buffer, or that buffer; written (natural log).
        out_dtype: 'fp32', 'bf16' or 'fp16': selects the variant (dispatch key ``dtype``).
        stream: CUstream handle (int) to launch on.

    Returns the variant used. Launches nothing when batch * heads * seqlen == 0 (still selects
    the variant). One CTA per ``block_m`` rows (the variant's knob), rows ordered (b, h, l) with
    l fastest; 16-byte loads when :func:`use_vec4` allows.

    Raises:
        ValueError: arguments the kernel cannot serve (ranks, ranges, shapes, dtypes, unit
            strides, LSE layout, element alignment, devices, more than 2^31 - 1 CTAs); the
            user-facing checks are :func:`check_combine` / :func:`check_combine_lse`.
        flashgen.dispatch.MissingVariantError: no combine variant for out_dtype is built.
        flashgen.launch.CudaError: the driver refuses the load or the launch.
    """
    plan, grid, params = _launch_params(out_partial, lse_partial, out, lse, out_dtype)
    if grid:
        params.update(out_partial=out_partial.ptr, lse_partial=lse_partial.ptr, out=out.ptr, lse=lse.ptr,
                      vec4=1 if use_vec4(out_partial, out) else 0)
        launch.launch(plan.kernel, (grid, 1, 1), (), params, stream, out_partial.device)
    return plan.variant


def _launch_params(out_partial: TensorArg, lse_partial: TensorArg, out: TensorArg, lse: TensorArg,
                   out_dtype: str) -> tuple:
    """``(plan, grid, params)`` of a combine launch: the kernel's checks (ValueError), the variant (loaded), the
    CTAs (0: no rows, nothing to launch) and the params but for the addresses and ``vec4`` (:data:`_PER_CALL`)."""
    problems = _launch_problems(out_partial, lse_partial, out, lse, out_dtype)
    if problems:
        raise ValueError("flashgen: attention_combine: " + "; ".join(problems))
    ns, b, s, h, d = out_partial.shape
    plan = _plan(out_dtype, out_partial.device)
    rows = b * h * s
    grid = -(-rows // plan.block_m)
    if grid > _INT32_MAX:
        raise ValueError(f"flashgen: attention_combine: {rows} rows need {grid} CTAs of {plan.block_m} rows, "
                         f"more than the grid limit {_INT32_MAX}")
    ops, lps, os_ = out_partial.strides, lse_partial.strides, out.strides
    params = {
        "op_stride_split": ops[0], "op_stride_batch": ops[1], "op_stride_seq": ops[2], "op_stride_head": ops[3],
        "lp_stride_split": lps[0], "lp_stride_batch": lps[1], "lp_stride_seq": lps[2], "lp_stride_head": lps[3],
        "o_stride_batch": os_[0], "o_stride_seq": os_[1], "o_stride_head": os_[2],
        "num_splits": ns, "batch": b, "seqlen": s, "heads": h, "head_dim": d, "one_pass": 1 if ONE_PASS else 0,
    }
    return plan, grid, params


#: The params fields each prepared combine launch fills itself, in launch.launch_prepared's order.
_PER_CALL = ("out_partial", "lse_partial", "out", "lse", "vec4")


class PreparedCombine(NamedTuple):
    """A combine launch resolved from its arrays' metadata alone (:func:`prepare_combine`): the variant, the grid
    and the params but for :data:`_PER_CALL`. Immutable, so calls on any thread may share it;
    :func:`launch_combine` launches it."""

    launch: Optional[launch.PreparedLaunch]  # None: no rows (nothing to launch)
    variant: Variant
    vec4: bool  # head_dim and the strides allow the 16-byte path (the addresses are checked per launch)
    out_align: int  # bytes of 4 elements of out: its address's alignment for the 16-byte path


_prepared_combines: dict = {}  # metadata key -> PreparedCombine (immutable: shared by concurrent calls)
_PREPARED_CACHE_MAX = 256  # bounded: emptied when full (a miss only prepares again)


def prepare_combine(out_partial: TensorArg, lse_partial: TensorArg, out: TensorArg, lse: TensorArg,
                    out_dtype: str) -> PreparedCombine:
    """:func:`attention_combine`'s checks and launch for arrays of this metadata (shapes, strides, dtypes,
    device; the ``ptr`` fields are not read: each :func:`launch_combine` gives the addresses), for callers that
    merge the same shapes again and again (the split-KV calls: flashgen.split_kv, the varlen / kvcache kernel path).
    Resolved once per metadata key and cached (bounded), as core.prepare_forward. Raises what
    :func:`attention_combine` raises (a key that raised is not cached)."""
    args = tuple(t._replace(ptr=0) for t in (out_partial, lse_partial, out, lse))
    key = (args, out_dtype)
    prep = _prepared_combines.get(key)
    if prep is None:
        plan, grid, params = _launch_params(*args, out_dtype)
        prepared = launch.prepare_launch(plan.kernel, (grid, 1, 1), params, _PER_CALL) if grid else None
        prep = PreparedCombine(prepared, plan.variant, use_vec4(args[0], args[2]), 4 * ELEMENT_SIZE[out.dtype])
        launch.cache_put(_prepared_combines, key, prep, _PREPARED_CACHE_MAX)
    return prep


def launch_combine(prep: PreparedCombine, out_partial: int, lse_partial: int, out: int, lse: int,
                   stream: int) -> Variant:
    """Launch a :class:`PreparedCombine` on arrays of its metadata at these device addresses on ``stream``
    (the 16-byte path where the addresses allow it, as :func:`use_vec4`); returns the variant. CudaError if the
    launch fails. The caller vouches that the addresses hold arrays of the prepared metadata, aligned to their
    elements (the checks :func:`attention_combine` runs per call ran once, at :func:`prepare_combine`)."""
    if prep.launch is not None:
        vec4 = 1 if prep.vec4 and not (out_partial % 16 or out % prep.out_align) else 0
        launch.launch_prepared(prep.launch, (), (out_partial, lse_partial, out, lse, vec4), stream)
    return prep.variant
