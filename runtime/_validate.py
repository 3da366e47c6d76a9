"""Framework-neutral argument checks for the flashgen forward entry points.

Both public entry points -- :func:`flashgen.interface.flash_attn_func` (torch) and
:func:`flashgen.dlpack_api.flash_attn_forward` (any DLPack array) -- describe their arrays
as :class:`ArrayInfo` records and run the same checks here, so the two raise the same
errors with the same messages, before any device work. Nothing in this module imports
torch or touches the GPU.

Rules (FA3's ``flash_attn_interface`` semantics, see ``shared/research/fa3.md`` §1, and
the kernels' TMA requirements, docs/CONTRACTS.md §2):

* q is ``(batch, seqlen_q, heads, head_dim)``, k is ``(batch, seqlen_k, heads_k, head_dim)``,
  v is ``(batch, seqlen_k, heads_k, head_dim_v)`` (layout BSHD); heads % heads_k == 0
  (GQA/MQA); head_dim and head_dim_v are multiples of 8 and at most 256.
* dtypes fp16 or bf16, the same for q, k and v; fp8 is recognised and refused with
  NotImplementedError (no fp8 variant is built yet).
* a TMA descriptor can address an array when its last dim has stride 1, every other
  stride is a multiple of 16 bytes, no stride is negative or a broadcast 0, and its base
  address is 16-byte aligned (CUDA driver API, ``cuTensorMapEncodeTiled``).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence

__all__ = [
    "ArrayInfo",
    "Problem",
    "ELEMENT_SIZE",
    "SUPPORTED_DTYPES",
    "FP8_DTYPES",
    "TMA_ALIGN_BYTES",
    "MAX_HEAD_DIM",
    "HEAD_DIM_MULTIPLE",
    "check_features",
    "check_softmax_scale",
    "check_inputs",
    "check_capability",
    "tma_layout_problem",
    "tma_strides",
    "check_out",
    "check_lse",
    "is_c_contiguous",
]

#: Bytes per element of the dtypes flashgen knows by name.
ELEMENT_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
#: Input dtypes some built variant may serve (docs/CONTRACTS.md §1).
SUPPORTED_DTYPES = ("fp16", "bf16")
#: Recognised, not served yet: NotImplementedError rather than TypeError.
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")
#: TMA: global address and every global stride but the innermost must be 16-byte multiples.
TMA_ALIGN_BYTES = 16
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8

_NAMES = ("q", "k", "v")


class ArrayInfo(NamedTuple):
    """What the checks need to know about one array, whatever framework it comes from.

    shape / strides: tuples of ints, strides in elements (like ``torch.Tensor.stride()``).
    dtype: flashgen's name ('fp16', 'bf16', 'fp32', 'fp8_e4m3', 'fp8_e5m2') or None when
    flashgen has no name for it. dtype_repr: the framework's spelling, for messages.
    is_cuda: lives in CUDA device memory; device: its CUDA ordinal (None when not CUDA).
    device_repr: the framework's spelling of the device, for messages.
    """

    shape: tuple
    strides: tuple
    dtype: Optional[str]
    dtype_repr: str
    is_cuda: bool
    device: Optional[int]
    device_repr: str


class Problem(NamedTuple):
    """The validated sizes of one forward call (all ints)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    device: int

    @property
    def out_shape(self) -> tuple:
        """``(batch, seqlen_q, heads, head_dim_v)``: the output's shape."""
        return (self.batch, self.seqlen_q, self.heads, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple:
        """``(batch, heads, seqlen_q)``: the log-sum-exp's shape (fp32, natural log)."""
        return (self.batch, self.heads, self.seqlen_q)

    @property
    def nothing_to_compute(self) -> bool:
        """True when the output has no element (batch 0 or seqlen_q 0)."""
        return self.batch == 0 or self.seqlen_q == 0


def _fmt_shape(shape: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


# --------------------------------------------------------------------------------------
# Arguments no built variant serves yet
# --------------------------------------------------------------------------------------

def check_features(
    *,
    window_size=(-1, -1),
    softcap=0.0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    qv=None,
    attention_chunk=0,
) -> None:
    """Refuse FA3 arguments that no flashgen variant implements yet.

    Raises NotImplementedError naming the argument for: ``window_size`` other than
    ``(-1, -1)`` (sliding-window / local attention), ``softcap`` other than 0, any of
    ``q_descale`` / ``k_descale`` / ``v_descale`` (fp8 descaling), ``qv`` (absorbed MLA)
    and ``attention_chunk`` other than 0. TypeError for a window_size that is not a pair.
    """
    if window_size is not None:
        try:
            left, right = window_size
        except (TypeError, ValueError):
            raise TypeError(
                f"flashgen: window_size must be a pair (left, right) of ints, got {window_size!r}"
            ) from None
        if (left, right) != (-1, -1):
            raise NotImplementedError(
                f"flashgen: window_size={tuple(window_size)!r} (sliding-window / local attention) "
                "is not supported yet: no built variant implements it; use window_size=(-1, -1)"
            )
    if softcap is None:
        softcap = 0.0
    if softcap != 0:
        raise NotImplementedError(
            f"flashgen: softcap={softcap!r} is not supported yet: no built variant implements "
            "logit soft-capping; use softcap=0.0"
        )
    for name, val in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if val is not None:
            raise NotImplementedError(
                f"flashgen: {name} is not supported yet: descaling belongs to the fp8 forward, "
                f"and no fp8 variant is built; pass {name}=None"
            )
    if qv is not None:
        raise NotImplementedError("flashgen: qv (absorbed MLA) is not supported yet; pass qv=None")
    if attention_chunk not in (0, None):
        raise NotImplementedError(
            f"flashgen: attention_chunk={attention_chunk!r} is not supported yet; pass attention_chunk=0"
        )


def check_softmax_scale(softmax_scale, head_dim) -> float:
    """Return the softmax scale as a Python float.

    None gives FA3's default ``head_dim ** -0.5``. Otherwise any finite real number (int or
    float, not bool), as in FA3: zero and negative scales are legal (the kernel takes the
    row maximum of the scaled scores, FA3 paper arXiv 2407.08608, Algorithm 1). TypeError
    for a non-number, ValueError for NaN / inf, each naming ``softmax_scale``.
    """
    if softmax_scale is None:
        return float(head_dim) ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            "flashgen: softmax_scale must be a real number (float) or None, "
            f"got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"flashgen: softmax_scale must be a finite number, got {softmax_scale!r}")
    return scale


# --------------------------------------------------------------------------------------
# q, k, v
# --------------------------------------------------------------------------------------

def check_inputs(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo) -> Problem:
    """Check q, k, v (devices, dtypes, shapes) and return the problem's sizes.

    In this order, each a clear error naming the argument:
    1. not CUDA arrays, or not all on one device: ValueError;
    2. dtype: fp8 -> NotImplementedError; anything but fp16/bf16 -> TypeError;
       q, k, v dtypes differ -> TypeError;
    3. not 4-D BSHD -> ValueError; batch of k/v differs from q's; seqlen or heads of k and
       v differ; k's head_dim differs from q's; heads or heads_k < 1; heads not a multiple
       of heads_k; head_dim / head_dim_v not in 8..256 in steps of 8 -> ValueError.
    Sizes of 0 for batch, seqlen_q or seqlen_k are allowed (empty problems).
    """
    infos = (q, k, v)
    # 1. devices
    for name, a in zip(_NAMES, infos):
        if not a.is_cuda:
            raise ValueError(
                f"flashgen: {name} must be a CUDA tensor/array, got one on {a.device_repr}"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(
            "flashgen: q, k and v must be on the same CUDA device, got "
            f"q on {q.device_repr}, k on {k.device_repr}, v on {v.device_repr}"
        )
    # 2. dtypes
    for name, a in zip(_NAMES, infos):
        if a.dtype in FP8_DTYPES:
            raise NotImplementedError(
                f"flashgen: {name} has dtype {a.dtype_repr}: the fp8 forward is not supported yet "
                "(no fp8 variant is built); pass float16 or bfloat16"
            )
        if a.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"flashgen: {name} must have dtype float16 or bfloat16, got {a.dtype_repr}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "flashgen: q, k and v must have the same dtype, got "
            f"q {q.dtype_repr}, k {k.dtype_repr}, v {v.dtype_repr}"
        )
    # 3. shapes
    expected = {
        "q": "(batch, seqlen_q, heads, head_dim)",
        "k": "(batch, seqlen_k, heads_k, head_dim)",
        "v": "(batch, seqlen_k, heads_k, head_dim_v)",
    }
    for name, a in zip(_NAMES, infos):
        if len(a.shape) != 4:
            raise ValueError(
                f"flashgen: {name} must be 4-D {expected[name]} (layout BSHD), "
                f"got {len(a.shape)}-D shape {_fmt_shape(a.shape)}"
            )
    batch, seqlen_q, heads, head_dim = q.shape
    for name, a in (("k", k), ("v", v)):
        if a.shape[0] != batch:
            raise ValueError(
                f"flashgen: {name} has batch {a.shape[0]} but q has batch {batch} "
                f"(q {_fmt_shape(q.shape)}, {name} {_fmt_shape(a.shape)})"
            )
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    if v.shape[1] != seqlen_k:
        raise ValueError(
            f"flashgen: k and v must have the same seqlen_k (dim 1), got k {_fmt_shape(k.shape)}, "
            f"v {_fmt_shape(v.shape)}"
        )
    if v.shape[2] != heads_k:
        raise ValueError(
            f"flashgen: k and v must have the same number of heads (dim 2), got k {_fmt_shape(k.shape)}, "
            f"v {_fmt_shape(v.shape)}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(
            f"flashgen: k must have q's head_dim {head_dim} (dim 3), got k {_fmt_shape(k.shape)}, "
            f"q {_fmt_shape(q.shape)}"
        )
    head_dim_v = v.shape[3]
    if heads < 1 or heads_k < 1:
        raise ValueError(
            f"flashgen: heads and heads_k must be >= 1, got q {_fmt_shape(q.shape)}, k {_fmt_shape(k.shape)}"
        )
    if heads % heads_k != 0:
        raise ValueError(
            f"flashgen: heads of q ({heads}) must be a multiple of heads_k of k/v ({heads_k}) "
            "(GQA/MQA: each k/v head serves heads // heads_k query heads)"
        )
    for name, d, what in (("q", head_dim, "head_dim"), ("v", head_dim_v, "head_dim_v")):
        if d < HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE != 0:
            raise ValueError(
                f"flashgen: {what} (dim 3 of {name}) must be a multiple of {HEAD_DIM_MULTIPLE} "
                f"between {HEAD_DIM_MULTIPLE} and {MAX_HEAD_DIM}, got {d}"
            )
    return Problem(
        batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, head_dim_v, q.dtype, q.device
    )


def check_capability(capability: tuple, device: int) -> None:
    """RuntimeError unless ``capability`` (major, minor) is 9.x (Hopper, sm_90a)."""
    if capability[0] != 9:
        raise RuntimeError(
            f"flashgen: needs an NVIDIA Hopper GPU (compute capability 9.x, sm_90a: H100/H200); "
            f"CUDA device {device} has compute capability {capability[0]}.{capability[1]}"
        )


# --------------------------------------------------------------------------------------
# Layout (TMA)
# --------------------------------------------------------------------------------------

def tma_layout_problem(shape: Sequence[int], strides: Sequence[int], elem_size: int,
                       ptr: Optional[int] = None) -> Optional[str]:
    """Why a TMA descriptor cannot address this array, or None when it can.

    Requirements: the last dim has stride 1; every other dim of extent > 1 has a stride
    >= 1 (no broadcast 0, no negative stride) whose byte size is a multiple of 16; the base
    address ``ptr`` (bytes; skipped when None) is a multiple of 16. A dim of extent 1 is
    never stepped over, so its stride does not matter (see :func:`tma_strides`).
    """
    n = len(shape)
    if n and shape[-1] > 1 and strides[-1] != 1:
        return f"its last dim has stride {strides[-1]}, not 1"
    for i in range(n - 1):
        if shape[i] == 1:
            continue
        s = strides[i]
        if s <= 0:
            return f"dim {i} has stride {s} (broadcast or reversed)"
        if (s * elem_size) % TMA_ALIGN_BYTES:
            return (f"dim {i} has stride {s} elements = {s * elem_size} bytes, "
                    f"not a multiple of {TMA_ALIGN_BYTES}")
    if ptr is not None and ptr % TMA_ALIGN_BYTES:
        return f"its base address 0x{ptr:x} is not {TMA_ALIGN_BYTES}-byte aligned"
    return None


def tma_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple:
    """Strides to hand to the core: the array's own, except for dims of extent 1.

    A dim of extent 1 is only ever indexed at 0, so frameworks leave arbitrary strides
    there (``x[:, None]``, ``expand``); such a dim gets the stride it would have in a
    dense array over the dims inside it (a 16-byte multiple whenever the inner dims pass
    :func:`tma_layout_problem`), so the core's TMA checks see a legal value.
    """
    out = list(strides)
    n = len(shape)
    if n and shape[-1] == 1:
        out[-1] = 1
    for i in range(n - 2, -1, -1):
        if shape[i] == 1:
            out[i] = shape[i + 1] * out[i + 1] if shape[i + 1] > 0 else out[i + 1]
    return tuple(out)


# --------------------------------------------------------------------------------------
# Caller-provided outputs (DLPack entry)
# --------------------------------------------------------------------------------------

def check_out(out: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> None:
    """Check a caller-provided output: shape ``(batch, seqlen_q, heads, head_dim_v)``, q's
    dtype, q's device, and a layout the TMA store can address (see
    :func:`tma_layout_problem`). ValueError / TypeError naming ``out``."""
    _check_same_device("out", out, problem)
    if tuple(out.shape) != problem.out_shape:
        raise ValueError(
            f"flashgen: out must have shape (batch, seqlen_q, heads, head_dim_v) = "
            f"{_fmt_shape(problem.out_shape)}, got {_fmt_shape(out.shape)}"
        )
    if out.dtype != problem.dtype:
        raise TypeError(f"flashgen: out must have q's dtype {problem.dtype}, got {out.dtype_repr}")
    if 0 not in problem.out_shape:
        why = tma_layout_problem(out.shape, out.strides, ELEMENT_SIZE[problem.dtype], ptr)
        if why:
            raise ValueError(
                f"flashgen: out cannot be written by the kernel's TMA store: {why}; "
                "pass an out whose last dim is contiguous and whose other strides and base "
                "address are 16-byte aligned (a contiguous array always is)"
            )


def check_lse(lse: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> None:
    """Check a caller-provided log-sum-exp: shape ``(batch, heads, seqlen_q)``, float32,
    q's device, dense row-major (C-contiguous: the kernel writes it at
    ``ptr + ((b * heads + h) * seqlen_q + i) * 4``), 4-byte aligned. ValueError / TypeError
    naming ``lse``."""
    _check_same_device("lse", lse, problem)
    if tuple(lse.shape) != problem.lse_shape:
        raise ValueError(
            f"flashgen: lse must have shape (batch, heads, seqlen_q) = "
            f"{_fmt_shape(problem.lse_shape)}, got {_fmt_shape(lse.shape)}"
        )
    if lse.dtype != "fp32":
        raise TypeError(f"flashgen: lse must have dtype float32, got {lse.dtype_repr}")
    if 0 in problem.lse_shape:
        return
    if not is_c_contiguous(lse.shape, lse.strides):
        raise ValueError(
            f"flashgen: lse must be C-contiguous, got strides {tuple(lse.strides)} for shape "
            f"{_fmt_shape(lse.shape)}"
        )
    if ptr is not None and ptr % 4:
        raise ValueError(f"flashgen: lse's base address 0x{ptr:x} is not 4-byte aligned")


def is_c_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when (shape, strides in elements) is dense row-major; extent-1 dims are ignored."""
    if 0 in tuple(shape):
        return True
    expect = 1
    for n, s in zip(reversed(tuple(shape)), reversed(tuple(strides))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _check_same_device(name: str, a: ArrayInfo, problem: Problem) -> None:
    if not a.is_cuda or a.device != problem.device:
        raise ValueError(
            f"flashgen: {name} must be on q's CUDA device {problem.device}, got {a.device_repr}"
        )
