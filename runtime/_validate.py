"""Framework-neutral argument checks for the flashgen attention entry points.

The public entry points -- :func:`flashgen.interface.flash_attn_func` (torch, forward and
its autograd backward) and :func:`flashgen.dlpack_api.flash_attn_forward` /
:func:`flashgen.dlpack_api.flash_attn_backward` (any DLPack array) -- describe their arrays
as :class:`ArrayInfo` records and run the same checks here, so they raise the same
errors with the same messages, before any device work. Nothing in this module imports
torch or touches the GPU.

Rules (FA3's ``flash_attn_interface`` semantics, see ``shared/research/fa3.md`` §1, and
the kernels' TMA requirements, docs/CONTRACTS.md §2):

* q is ``(batch, seqlen_q, heads, head_dim)``, k is ``(batch, seqlen_k, heads_k, head_dim)``,
  v is ``(batch, seqlen_k, heads_k, head_dim_v)`` (layout BSHD); heads % heads_k == 0
  (GQA/MQA); head_dim and head_dim_v are multiples of 8 and at most 256.
* dtypes fp16, bf16 or fp8_e4m3 (OCP float8_e4m3fn; out bf16), the same for q, k and v; the
  other fp8 formats (fp8_e5m2; fp8_other: e4m3fnuz, e5m2fnuz, e4m3b11fnuz, whose exponent bias
  or NaN encoding differ, so reading them as e4m3fn would be silently wrong) are recognised and
  refused with NotImplementedError. FP8 takes q_descale / k_descale / v_descale
  (:func:`descale_problems`) and has no head_dim_v != head_dim or backward yet
  (:func:`fp8_problems`); windows, softcap and sinks it serves as the 16-bit forward does.
* a TMA descriptor can address an array when its last dim has stride 1, every other
  stride is a multiple of 16 bytes, no stride is negative or a broadcast 0, and its base
  address is 16-byte aligned (CUDA driver API, ``cuTensorMapEncodeTiled``).
* ``window_size`` (FA3's sliding window): a pair (left, right) of ints >= -1 or None;
  ``softcap``: a finite real >= 0 (0 = off); ``learnable_sink``: float32 ``(heads,)`` on q's
  device (:func:`window_size_problems`, :func:`softcap_problems`,
  :func:`learnable_sink_problems`); ``attention_chunk``: None or an int >= 0
  (:func:`attention_chunk_problems`). qv is refused with NotImplementedError
  (:func:`feature_problems`).
* the backward (:func:`backward_problems`) also takes dout and out, both of out's shape
  ``(batch, seqlen_q, heads, head_dim_v)`` and q's dtype and device, and the forward's lse
  (float32 ``(batch, heads, seqlen_q)``, C-contiguous); head_dim_v may differ from head_dim,
  as in the forward. Its gradients dq, dk, dv have q's, k's and v's shapes.

Errors: every check reports every problem it finds, not only the first. Each
``*_problems`` function returns ``(exception class, message)`` pairs and the matching
``check_*`` function raises them together with :func:`raise_problems`: one exception, one
line per problem, the message starting with ``"flashgen: "``. A lone problem (or several of
one kind) raises its own type -- TypeError (a wrong type or dtype), ValueError (a wrong
device, shape, value or layout), NotImplementedError (a valid request no built variant
serves, e.g. fp8) -- and a mix raises :class:`InputError`, a subclass of both ValueError
and TypeError. A check that cannot run because another failed (comparing the head_dim of q
and k when q is not 4-D) is skipped; every independent problem is reported.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence

__all__ = [
    "ArrayInfo",
    "Problem",
    "InputError",
    "raise_problems",
    "ELEMENT_SIZE",
    "SUPPORTED_DTYPES",
    "FP8_DTYPES",
    "TMA_ALIGN_BYTES",
    "MAX_HEAD_DIM",
    "HEAD_DIM_MULTIPLE",
    "check_features",
    "descale_problems",
    "fp8_problems",
    "QUANT_BLOCK",
    "feature_problems",
    "attention_chunk_problems",
    "varlen_problems",
    "offset_problems",
    "window_size_problems",
    "window_pair",
    "softcap_problems",
    "learnable_sink_problems",
    "check_softmax_scale",
    "softmax_scale_problems",
    "check_inputs",
    "input_problems",
    "check_capability",
    "tma_layout_problem",
    "tma_strides",
    "check_out",
    "out_problems",
    "check_lse",
    "lse_problems",
    "array_problems",
    "backward_problems",
    "check_backward",
    "is_c_contiguous",
]

#: Bytes per element of the dtypes flashgen knows by name.
ELEMENT_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_other": 1}
#: Input dtypes some built variant may serve (docs/CONTRACTS.md §1).
SUPPORTED_DTYPES = ("fp16", "bf16", "fp8_e4m3")
#: The fp8 dtypes flashgen knows; those not in SUPPORTED_DTYPES raise NotImplementedError rather than TypeError.
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2", "fp8_other")
#: FP8 block quantization: rows of Q / K per descale (the e4m3 kernels' K descale groups).
QUANT_BLOCK = 64
#: TMA: global address and every global stride but the innermost must be 16-byte multiples.
TMA_ALIGN_BYTES = 16
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8


class ArrayInfo(NamedTuple):
    """What the checks need to know about one array, whatever framework it comes from.

    shape / strides: tuples of ints, strides in elements (like ``torch.Tensor.stride()``).
    dtype: flashgen's name ('fp16', 'bf16', 'fp32', 'fp8_e4m3', 'fp8_e5m2', 'fp8_other') or None when
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
    """The validated sizes of one forward or backward call (all ints), from :func:`check_inputs`."""

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
    def out_dtype(self) -> str:
        """The output's dtype: q's, except bf16 for fp8_e4m3 inputs (as FA3)."""
        return "bf16" if self.dtype == "fp8_e4m3" else self.dtype

    @property
    def out_shape(self) -> tuple:
        """``(batch, seqlen_q, heads, head_dim_v)``: the output's shape."""
        return (self.batch, self.seqlen_q, self.heads, self.head_dim_v)

    @property
    def q_shape(self) -> tuple:
        """``(batch, seqlen_q, heads, head_dim)``: q's shape (and dq's)."""
        return (self.batch, self.seqlen_q, self.heads, self.head_dim)

    @property
    def k_shape(self) -> tuple:
        """``(batch, seqlen_k, heads_k, head_dim)``: k's shape (and dk's)."""
        return (self.batch, self.seqlen_k, self.heads_k, self.head_dim)

    @property
    def v_shape(self) -> tuple:
        """``(batch, seqlen_k, heads_k, head_dim_v)``: v's shape (and dv's)."""
        return (self.batch, self.seqlen_k, self.heads_k, self.head_dim_v)

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
# Reporting: every problem of one call in one exception
# --------------------------------------------------------------------------------------

class InputError(ValueError, TypeError):
    """The arguments of one call have several problems of different kinds, e.g. a wrong dtype
    (a TypeError on its own) and a wrong shape (a ValueError on its own).

    The message lists every problem, one per line. Being both a ValueError and a TypeError,
    it is caught by ``except ValueError`` and by ``except TypeError`` alike. An unsupported
    feature (NotImplementedError alone) that comes with other problems is listed here too.
    """


def raise_problems(problems: Sequence[tuple], context: str = "") -> None:
    """Raise one exception naming every problem in ``problems``; return when it is empty.

    ``problems``: ``(exception class, message)`` pairs, the class being what the problem
    would raise alone (TypeError, ValueError or NotImplementedError) and the message naming
    the argument and what was expected, without the ``"flashgen: "`` prefix.

    The exception is of the problems' class when they all have the same one (so a single
    problem raises what it always did), else :class:`InputError`. Its message starts with
    ``"flashgen: "`` + ``context`` (e.g. ``"flash_attn_combine: "``): the problem itself when
    there is one, else ``"N problems with the arguments:"`` and one ``"  - ..."`` line each.
    """
    if not problems:
        return
    kinds = {kind for kind, _ in problems}
    cls = kinds.pop() if len(kinds) == 1 else InputError
    if len(problems) == 1:
        raise cls(f"flashgen: {context}{problems[0][1]}")
    lines = "\n".join(f"  - {message}" for _, message in problems)
    raise cls(f"flashgen: {context}{len(problems)} problems with the arguments:\n{lines}")


# --------------------------------------------------------------------------------------
# Mask, softcap, learnable sink (FA3's window_size / softcap; gpt-oss / FA4 sinks)
# --------------------------------------------------------------------------------------

_WINDOW_EXPECTED = "a pair (left, right), each an int >= -1 or None (-1 / None: unbounded)"


def _is_int(x) -> bool:
    """An int, not a bool: Python / numpy ints, and torch's symbolic ints (``torch.SymInt``, what a
    traced int argument becomes under ``torch.compile(dynamic=True)``; torch is not imported here)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, numbers.Integral) or (type(x).__name__ == "SymInt" and type(x).__module__.startswith("torch"))


def window_size_problems(window_size) -> list:
    """The problems (see :func:`raise_problems`) of a ``window_size`` (FA3's sliding window).

    Valid: a tuple or list ``(left, right)`` whose entries are each an int >= -1 or None (-1 and
    None mean unbounded on that side; ``(-1, -1)`` is no window). TypeError for anything not a
    tuple/list or an entry that is not an int (bools are refused), ValueError for a tuple/list
    of another length or an entry < -1; each message names ``window_size``."""
    if (type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and window_size[0] >= -1 and window_size[1] >= -1):
        return []  # the common case, fast (host time per call)
    if not isinstance(window_size, (tuple, list)):
        return [(TypeError, f"window_size must be {_WINDOW_EXPECTED}, got {type(window_size).__name__} "
                            f"{window_size!r}")]
    if len(window_size) != 2:
        return [(ValueError, f"window_size must be {_WINDOW_EXPECTED}, got {len(window_size)} entries: "
                             f"{tuple(window_size)!r}")]
    P: list = []
    for i, (side, x) in enumerate(zip(("left", "right"), window_size)):
        if x is None:
            continue
        if not _is_int(x):
            P.append((TypeError, f"window_size[{i}] ({side}) must be an int >= -1 or None (-1 / None: "
                                 f"unbounded), got {type(x).__name__} {x!r}"))
        elif x < -1:
            P.append((ValueError, f"window_size[{i}] ({side}) must be an int >= -1 or None (-1 / None: "
                                  f"unbounded), got {x}"))
    return P


def window_pair(window_size) -> tuple:
    """``(left, right)`` as Python ints, None -> -1, of a window_size that passed
    :func:`window_size_problems` (the form of the ops' ``window_left`` / ``window_right``)."""
    left, right = window_size
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def num_splits_problems(num_splits) -> list:
    """The problems (see :func:`raise_problems`) of FA3's ``num_splits`` (split-KV shares of each tile's keys):
    valid is an int, not a bool (1 = none, 0 or less = chosen by the heuristic, n = n); TypeError naming it."""
    if _is_int(num_splits):
        return []
    return [(TypeError, "num_splits must be an int (FA3's: 1 = none, 0 or less = chosen, n = n splits), got "
                        f"{type(num_splits).__name__}")]


def softcap_problems(softcap) -> list:
    """The problems (see :func:`raise_problems`) of a ``softcap`` (FA3 / Gemma 2 logit soft-capping).

    Valid: a real number (int or float, not bool), finite and >= 0; 0 turns it off. TypeError for
    a non-number, ValueError for NaN / inf / a negative value; each message names ``softcap``."""
    if type(softcap) is float and 0.0 <= softcap < math.inf:  # the common case, fast
        return []
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        return [(TypeError, f"softcap must be a real number (float) >= 0 (0 = off), got {type(softcap).__name__}")]
    if not 0.0 <= float(softcap) < math.inf:  # NaN, inf, negative (comparisons only: traceable by torch.compile)
        return [(ValueError, f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")]
    return []


def learnable_sink_problems(sink: ArrayInfo, problem: "Problem", ptr: Optional[int] = None, *,
                            contiguous: bool = False) -> list:
    """The problems (see :func:`raise_problems`) of a ``learnable_sink`` for valid q, k, v
    (``problem`` from :func:`check_inputs`): float32 (TypeError), shape ``(heads,)`` and on q's
    CUDA device (ValueError). ``contiguous`` (the DLPack entry, which makes no copies): it must
    also be C-contiguous (stride 1) and its address ``ptr`` (bytes; skipped when None) 4-byte
    aligned (ValueError). Each message names ``learnable_sink``."""
    P = _device_problems("learnable_sink", sink, problem)
    shape = (problem.heads,)
    shape_ok = tuple(sink.shape) == shape
    if not shape_ok:
        P.append((ValueError, f"learnable_sink must have shape (heads,) = {_fmt_shape(shape)} (one logit per "
                              f"query head), got {_fmt_shape(sink.shape)}"))
    if sink.dtype != "fp32":
        P.append((TypeError, f"learnable_sink must have dtype float32, got {sink.dtype_repr}"))
    if contiguous and shape_ok and not is_c_contiguous(sink.shape, sink.strides):
        P.append((ValueError, f"learnable_sink must be C-contiguous (stride 1), got strides {tuple(sink.strides)}; "
                              "pass a contiguous copy"))
    if contiguous and ptr is not None and ptr % 4:
        P.append((ValueError, f"learnable_sink's base address 0x{ptr:x} is not 4-byte aligned"))
    return P


# --------------------------------------------------------------------------------------
# Arguments no built variant serves yet
# --------------------------------------------------------------------------------------

def feature_problems(
    *,
    window_size=(-1, -1),
    softcap=0.0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    qv=None,
    attention_chunk=0,
) -> list:
    """The problems (see :func:`raise_problems`) of :func:`check_features`'s arguments: those of
    ``window_size`` (:func:`window_size_problems`) and ``softcap`` (:func:`softcap_problems`),
    then NotImplementedError for each FA3 feature no variant implements yet (qv), then those of
    ``attention_chunk`` (:func:`attention_chunk_problems`)."""
    P: list = window_size_problems(window_size) + softcap_problems(softcap)
    if qv is not None:
        P.append((NotImplementedError, "qv (absorbed MLA) is not supported yet; pass qv=None"))
    return P + attention_chunk_problems(attention_chunk)


def offset_problems(name: str, cu, total: int, rows: str) -> list:
    """The problems (see :func:`raise_problems`) of one list of varlen offsets ``cu`` (cu_seqlens_*):
    batch + 1 >= 1 ints, 0 first, non-decreasing, the last at most ``total``, the rows of ``rows``
    (e.g. "q"). ValueError naming ``name``; at most one problem."""
    if len(cu) < 1:
        return [(ValueError, f"{name} must hold batch + 1 >= 1 offsets, got none")]
    if cu[0] != 0:
        return [(ValueError, f"{name}[0] must be 0, got {cu[0]}")]
    if any(b < a for a, b in zip(cu, cu[1:])):
        return [(ValueError, f"{name} must be non-decreasing, got {list(cu)[:16]}")]
    if cu[-1] > total:
        return [(ValueError, f"{name}[-1] ({cu[-1]}) is past the {total} rows of {rows}")]
    return []


def varlen_problems(total_q: int, total_k: int, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    seqused_q=None, seqused_k=None) -> list:
    """The problems (see :func:`raise_problems`) of FA3's varlen arguments, as host lists of ints
    (``flashgen.flash_attn_varlen_func``): cu_seqlens_q / cu_seqlens_k of batch + 1 offsets each,
    starting at 0, non-decreasing, the last at most total_q / total_k (q's / k's first dim);
    seqused_q / seqused_k None or batch counts with 0 <= seqused[b] <= the sequence's length (the
    rows of sequence b past seqused[b] are unused); max_seqlen_q / max_seqlen_k ints at least every
    (used) sequence's length, as FA3's kernels, which size their grids by them, need. ValueError or
    TypeError naming the argument."""
    P: list = []
    seqs = {}
    for name, cu, total, rows in (("cu_seqlens_q", cu_seqlens_q, total_q, "q"),
                                  ("cu_seqlens_k", cu_seqlens_k, total_k, "k and v")):
        found = offset_problems(name, cu, total, rows)
        P += found
        if not found:
            seqs[name[-1]] = [b - a for a, b in zip(cu, cu[1:])]
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        P.append((ValueError, f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                              f"{len(cu_seqlens_q)} and {len(cu_seqlens_k)}"))
    for which, used in (("q", seqused_q), ("k", seqused_k)):
        lens = seqs.get(which)
        if used is None or lens is None:
            continue
        if len(used) != len(lens):
            P.append((ValueError, f"seqused_{which} must have batch = {len(lens)} entries, got {len(used)}"))
            continue
        bad = [b for b, (u, n) in enumerate(zip(used, lens)) if not 0 <= u <= n]
        if bad:
            b = bad[0]
            P.append((ValueError, f"seqused_{which}[{b}] = {used[b]} must be between 0 and sequence {b}'s length "
                                  f"{lens[b]} (cu_seqlens_{which})"))
        else:
            seqs[which] = list(used)
    for which, mx in (("q", max_seqlen_q), ("k", max_seqlen_k)):
        if not _is_int(mx):
            P.append((TypeError, f"max_seqlen_{which} must be an int, got {type(mx).__name__}"))
        elif which in seqs and seqs[which] and mx < max(seqs[which]):
            P.append((ValueError, f"max_seqlen_{which} ({mx}) is less than the longest sequence "
                                  f"({max(seqs[which])})"))
    return P


def attention_chunk_problems(attention_chunk) -> list:
    """The problems (see :func:`raise_problems`) of FA3's ``attention_chunk`` (chunked attention,
    Llama 4): None or an int >= 0 (not a bool), 0 / None off; C > 0 keeps each query row's keys to
    its chunk of C key positions (flashgen.core.chunk_pieces). TypeError / ValueError naming it."""
    if attention_chunk is None or type(attention_chunk) is int and attention_chunk >= 0:
        return []
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, numbers.Integral):
        return [(TypeError, f"attention_chunk must be an int >= 0 (0 = off), got {type(attention_chunk).__name__}")]
    if attention_chunk < 0:
        return [(ValueError, f"attention_chunk must be >= 0 (0 = off), got {attention_chunk}")]
    return []


def descale_problems(problem: "Problem", descales: dict) -> list:
    """The problems (see :func:`raise_problems`) of the FP8 descales for valid q, k, v
    (``problem`` from :func:`check_inputs`). ``descales``: ``{"q_descale": ArrayInfo or None,
    "k_descale": ..., "v_descale": ...}``.

    With fp8_e4m3 inputs each may be None (a descale of 1) or a float32 array on q's device, any
    strides, of shape: q_descale ``(batch, heads_k)`` (FA3's: one per GQA group) or ``(batch, heads,
    ceil(seqlen_q / 64))`` (block quantization, :data:`QUANT_BLOCK` rows each, as
    ``flashgen.quantize_fp8`` writes); k_descale ``(batch, heads_k)`` or ``(batch, heads_k,
    ceil(seqlen_k / 64))``; v_descale ``(batch, heads_k)``. Values must be positive (not checked:
    that would read the GPU). With 16-bit inputs any descale is a ValueError (they scale e4m3
    inputs only). TypeError for a dtype, ValueError for a shape or device; each names the argument."""
    given = {name: a for name, a in descales.items() if a is not None}
    if not given:
        return []
    if problem.dtype != "fp8_e4m3":
        return [(ValueError, f"{name} scales float8_e4m3fn inputs only; q, k, v have dtype {problem.dtype}: "
                             f"pass {name}=None") for name in given]
    b, h, hk = problem.batch, problem.heads, problem.heads_k
    allowed = {"q_descale": [(b, hk), (b, h, -(-problem.seqlen_q // QUANT_BLOCK))],
               "k_descale": [(b, hk), (b, hk, -(-problem.seqlen_k // QUANT_BLOCK))],
               "v_descale": [(b, hk)]}
    names = {"q_descale": ["(batch, heads_k)", f"(batch, heads, ceil(seqlen_q / {QUANT_BLOCK}))"],
             "k_descale": ["(batch, heads_k)", f"(batch, heads_k, ceil(seqlen_k / {QUANT_BLOCK}))"],
             "v_descale": ["(batch, heads_k)"]}
    P: list = []
    for name, a in given.items():
        P += _device_problems(name, a, problem)
        if a.dtype != "fp32":
            P.append((TypeError, f"{name} must have dtype float32, got {a.dtype_repr}"))
        if tuple(a.shape) not in allowed[name]:
            want = " or ".join(f"{n} = {_fmt_shape(s)}" for n, s in zip(names[name], allowed[name]))
            P.append((ValueError, f"{name} must have shape {want}, got {_fmt_shape(a.shape)}"))
        elif any(st < 0 for st in a.strides) or any(abs(st) >= 2**31 for st in a.strides):
            P.append((ValueError, f"{name} must have strides in [0, 2**31), got {tuple(a.strides)}"))
    return P


def fp8_problems(problem: "Problem") -> list:
    """NotImplementedError (see :func:`raise_problems`) for what the FP8 (fp8_e4m3) forward does not
    implement yet: head_dim_v != head_dim. Empty for 16-bit inputs."""
    if problem.dtype != "fp8_e4m3" or problem.head_dim_v == problem.head_dim:
        return []
    return [(NotImplementedError, f"head_dim_v ({problem.head_dim_v}) != head_dim ({problem.head_dim}) is not "
                                  "supported with float8_e4m3fn inputs yet")]


def check_features(**features) -> None:
    """Check FA3's optional arguments; refuse those no flashgen variant implements yet.

    Keywords: ``window_size``, ``softcap``, ``q_descale``, ``k_descale``, ``v_descale``, ``qv``,
    ``attention_chunk`` (see :func:`feature_problems`). ``window_size`` and ``softcap`` are
    implemented and checked for type and value (TypeError / ValueError naming them, see
    :func:`window_size_problems`, :func:`softcap_problems`), and so is ``attention_chunk``
    (:func:`attention_chunk_problems`); the descales are checked against q, k, v elsewhere
    (:func:`descale_problems`). NotImplementedError naming ``qv`` (absorbed MLA) when given;
    :class:`InputError` for several kinds at once. Every problem is listed (see
    :func:`raise_problems`).
    """
    raise_problems(feature_problems(**features))


def softmax_scale_problems(softmax_scale) -> list:
    """The problems (see :func:`raise_problems`) of a softmax_scale (see :func:`check_softmax_scale`)."""
    if softmax_scale is None:
        return []
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        return [(TypeError, "softmax_scale must be a real number (float) or None, "
                            f"got {type(softmax_scale).__name__}")]
    if not math.isfinite(float(softmax_scale)):
        return [(ValueError, f"softmax_scale must be a finite number, got {softmax_scale!r}")]
    return []


def check_softmax_scale(softmax_scale, head_dim) -> float:
    """Return the softmax scale as a Python float.

    None gives FA3's default ``head_dim ** -0.5``. Otherwise any finite real number (int or
    float, not bool), as in FA3: zero and negative scales are legal (the kernel takes the
    row maximum of the scaled scores, FA3 paper arXiv 2407.08608, Algorithm 1). TypeError
    for a non-number, ValueError for NaN / inf, each naming ``softmax_scale``.
    """
    raise_problems(softmax_scale_problems(softmax_scale))
    if softmax_scale is None:
        return float(head_dim) ** -0.5
    return float(softmax_scale)


# --------------------------------------------------------------------------------------
# q, k, v
# --------------------------------------------------------------------------------------

_LAYOUTS = {
    "q": "(batch, seqlen_q, heads, head_dim)",
    "k": "(batch, seqlen_k, heads_k, head_dim)",
    "v": "(batch, seqlen_k, heads_k, head_dim_v)",
}


def _head_dim_problem(what: str, name: str, d: int, limit: int = MAX_HEAD_DIM) -> list:
    if HEAD_DIM_MULTIPLE <= d <= limit and d % HEAD_DIM_MULTIPLE == 0:
        return []
    return [(ValueError, f"{what} (dim 3 of {name}) must be a multiple of {HEAD_DIM_MULTIPLE} "
                         f"between {HEAD_DIM_MULTIPLE} and {limit}, got {d}")]


_DTYPE_SPELLING = {"fp16": "float16", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}


def _dtypes_text(dtypes) -> str:
    names = [_DTYPE_SPELLING.get(d, d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _device_dtype_rank_problems(arrays: dict, dtypes=SUPPORTED_DTYPES) -> list:
    """Devices, dtypes and ranks of the given q, k, v (``{name: ArrayInfo}``), for :func:`input_problems`."""
    P: list = []
    q, k, v = arrays.get("q"), arrays.get("k"), arrays.get("v")
    # devices
    for name, a in arrays.items():
        if not a.is_cuda:
            P.append((ValueError, f"{name} must be a CUDA tensor/array, got one on {a.device_repr}"))
    if len(arrays) == 3 and q.is_cuda and k.is_cuda and v.is_cuda and not (q.device == k.device == v.device):
        P.append((ValueError, "q, k and v must be on the same CUDA device, got "
                              f"q on {q.device_repr}, k on {k.device_repr}, v on {v.device_repr}"))
    # dtypes
    for name, a in arrays.items():
        if a.dtype in FP8_DTYPES and a.dtype not in dtypes and "fp8_e4m3" in dtypes:
            P.append((NotImplementedError, f"{name} has dtype {a.dtype_repr}: only float8_e4m3fn is served among "
                                           "the fp8 dtypes; pass float8_e4m3fn, float16 or bfloat16"))
        elif a.dtype not in dtypes:
            P.append((TypeError, f"{name} must have dtype {_dtypes_text(dtypes)}, got {a.dtype_repr}"))
    if (len(arrays) == 3 and all(a.dtype in dtypes for a in arrays.values())
            and not (q.dtype == k.dtype == v.dtype)):
        P.append((TypeError, "q, k and v must have the same dtype, got "
                             f"q {q.dtype_repr}, k {k.dtype_repr}, v {v.dtype_repr}"))
    # shapes
    for name, a in arrays.items():
        if len(a.shape) != 4:
            P.append((ValueError, f"{name} must be 4-D {_LAYOUTS[name]} (layout BSHD), "
                                  f"got {len(a.shape)}-D shape {_fmt_shape(a.shape)}"))
    return P


def input_problems(q: Optional[ArrayInfo], k: Optional[ArrayInfo], v: Optional[ArrayInfo],
                   dtypes: tuple = SUPPORTED_DTYPES, max_head_dim_v: int = MAX_HEAD_DIM) -> list:
    """Everything wrong with q, k, v (see :func:`check_inputs`), as ``(exception class,
    message)`` pairs (see :func:`raise_problems`); empty when they are valid. ``max_head_dim_v``:
    the largest head_dim_v the caller serves (flash_attn_func: 512 for 16-bit inputs, as two calls).

    None stands for an argument that is no array at all (the caller reports that): the
    checks of the others still run. A check that needs another to pass first is skipped
    when that one failed, and only then: the same-device check needs all three on CUDA,
    the same-dtype check all three of a supported dtype, and each size comparison needs
    the arrays it compares to be 4-D.
    """
    P: list = []
    arrays = {name: a for name, a in (("q", q), ("k", k), ("v", v)) if a is not None}
    # the usual case (three CUDA arrays, one device, one served dtype, 4-D) skips to the sizes
    usual = (len(arrays) == 3 and q.is_cuda and k.is_cuda and v.is_cuda and q.device == k.device == v.device
             and q.dtype in dtypes and q.dtype == k.dtype == v.dtype
             and len(q.shape) == len(k.shape) == len(v.shape) == 4)
    if not usual:
        P += _device_dtype_rank_problems(arrays, dtypes)
    is_4d = {name: name in arrays and len(arrays[name].shape) == 4 for name in _LAYOUTS}
    if is_4d["q"]:
        for name, a in (("k", k), ("v", v)):
            if is_4d[name] and a.shape[0] != q.shape[0]:
                P.append((ValueError, f"{name} has batch {a.shape[0]} but q has batch {q.shape[0]} "
                                      f"(q {_fmt_shape(q.shape)}, {name} {_fmt_shape(a.shape)})"))
    if is_4d["k"] and is_4d["v"]:
        if v.shape[1] != k.shape[1]:
            P.append((ValueError, "k and v must have the same seqlen_k (dim 1), got "
                                  f"k {_fmt_shape(k.shape)}, v {_fmt_shape(v.shape)}"))
        if v.shape[2] != k.shape[2]:
            P.append((ValueError, "k and v must have the same number of heads (dim 2), got "
                                  f"k {_fmt_shape(k.shape)}, v {_fmt_shape(v.shape)}"))
    if is_4d["q"] and is_4d["k"]:
        if k.shape[3] != q.shape[3]:
            P.append((ValueError, f"k must have q's head_dim {q.shape[3]} (dim 3), got "
                                  f"k {_fmt_shape(k.shape)}, q {_fmt_shape(q.shape)}"))
        heads, heads_k = q.shape[2], k.shape[2]
        if heads < 1 or heads_k < 1:
            P.append((ValueError, f"heads and heads_k must be >= 1, got "
                                  f"q {_fmt_shape(q.shape)}, k {_fmt_shape(k.shape)}"))
        elif heads % heads_k != 0:
            P.append((ValueError, f"heads of q ({heads}) must be a multiple of heads_k of k/v ({heads_k}) "
                                  "(GQA/MQA: each k/v head serves heads // heads_k query heads)"))
    if is_4d["q"]:
        P += _head_dim_problem("head_dim", "q", q.shape[3])
    if is_4d["v"]:
        P += _head_dim_problem("head_dim_v", "v", v.shape[3], max_head_dim_v)
    return P


def check_inputs(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, also: Sequence[tuple] = ()) -> Problem:
    """Check q, k, v (devices, dtypes, shapes) and return the problem's sizes.

    Every problem found is reported, in one exception (see :func:`raise_problems`), each
    naming the argument and what was expected:

    * devices: not CUDA arrays, or not all on one device: ValueError;
    * dtypes: fp8 -> NotImplementedError; anything but fp16/bf16 -> TypeError;
      q, k, v dtypes differ -> TypeError;
    * shapes: not 4-D BSHD; batch of k/v differs from q's; seqlen or heads of k and v
      differ; k's head_dim differs from q's; heads or heads_k < 1; heads not a multiple
      of heads_k; head_dim / head_dim_v not in 8..256 in steps of 8 -> ValueError;
    * several kinds at once: :class:`InputError` (a ValueError and a TypeError).

    ``also``: problems found elsewhere in the same call (e.g. :func:`softmax_scale_problems`),
    reported in the same exception after q, k and v's.
    Sizes of 0 for batch, seqlen_q or seqlen_k are allowed (empty problems).
    """
    raise_problems(input_problems(q, k, v) + list(also))
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
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
# Arrays shaped by q, k, v: caller-provided outputs (DLPack entries), the backward's arrays
# --------------------------------------------------------------------------------------

def array_problems(name: str, a: ArrayInfo, shape: tuple, dims: str, problem: Problem,
                   ptr: Optional[int] = None, *, tma_write: bool = False, dtype: Optional[str] = None) -> list:
    """The problems (see :func:`raise_problems`) of an array that must have ``shape`` (named
    ``dims`` in messages, e.g. ``"(batch, seqlen_q, heads, head_dim)"``), ``dtype`` (None: q's)
    and q's device: ValueError for the shape or device, TypeError for the dtype.

    ``tma_write``: the kernel writes it through TMA, so its layout must pass
    :func:`tma_layout_problem` (checked once the shape is right and non-empty; ``ptr``, its
    address in bytes, is checked too unless None): ValueError otherwise.
    """
    P = _device_problems(name, a, problem)
    shape_ok = tuple(a.shape) == shape
    if not shape_ok:
        P.append((ValueError, f"{name} must have shape {dims} = {_fmt_shape(shape)}, got {_fmt_shape(a.shape)}"))
    want = problem.dtype if dtype is None else dtype
    if a.dtype != want:
        what = (f"q's dtype {want}" if want == problem.dtype
                else f"dtype {want} (the output's dtype for {problem.dtype} inputs)")
        P.append((TypeError, f"{name} must have {what}, got {a.dtype_repr}"))
    if tma_write and shape_ok and 0 not in shape:
        why = tma_layout_problem(a.shape, a.strides, ELEMENT_SIZE[want], ptr)
        if why:
            P.append((ValueError, f"{name} cannot be written by the kernel's TMA store: {why}; pass a {name} whose "
                                  "last dim is contiguous and whose other strides and base address are "
                                  "16-byte aligned (a contiguous array always is)"))
    return P


def out_problems(out: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> list:
    """The problems (see :func:`raise_problems`) of a caller-provided output (see :func:`check_out`)."""
    return array_problems("out", out, problem.out_shape, "(batch, seqlen_q, heads, head_dim_v)", problem, ptr,
                          tma_write=True, dtype=problem.out_dtype)


def check_out(out: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> None:
    """Check a caller-provided output: shape ``(batch, seqlen_q, heads, head_dim_v)``, q's
    dtype (bf16 for fp8_e4m3 inputs: ``problem.out_dtype``), q's device, and a layout the TMA
    store can address (see :func:`tma_layout_problem`; checked once the shape is right). ValueError / TypeError
    naming ``out``, :class:`InputError` for both kinds; every problem is listed."""
    raise_problems(out_problems(out, problem, ptr))


def lse_problems(lse: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> list:
    """The problems (see :func:`raise_problems`) of a caller-provided log-sum-exp (see :func:`check_lse`)."""
    P = _device_problems("lse", lse, problem)
    shape_ok = tuple(lse.shape) == problem.lse_shape
    if not shape_ok:
        P.append((ValueError, f"lse must have shape (batch, heads, seqlen_q) = "
                              f"{_fmt_shape(problem.lse_shape)}, got {_fmt_shape(lse.shape)}"))
    if lse.dtype != "fp32":
        P.append((TypeError, f"lse must have dtype float32, got {lse.dtype_repr}"))
    if 0 in problem.lse_shape:
        return P  # nothing is written: layout and address do not matter
    if shape_ok and not is_c_contiguous(lse.shape, lse.strides):
        P.append((ValueError, f"lse must be C-contiguous, got strides {tuple(lse.strides)} for shape "
                              f"{_fmt_shape(lse.shape)}"))
    if ptr is not None and ptr % 4:
        P.append((ValueError, f"lse's base address 0x{ptr:x} is not 4-byte aligned"))
    return P


def check_lse(lse: ArrayInfo, problem: Problem, ptr: Optional[int] = None) -> None:
    """Check a caller-provided log-sum-exp: shape ``(batch, heads, seqlen_q)``, float32,
    q's device, dense row-major (C-contiguous: the kernel writes it at
    ``ptr + ((b * heads + h) * seqlen_q + i) * 4``), 4-byte aligned. ValueError / TypeError
    naming ``lse``, :class:`InputError` for both kinds; every problem is listed."""
    raise_problems(lse_problems(lse, problem, ptr))


# --------------------------------------------------------------------------------------
# The backward's extra inputs
# --------------------------------------------------------------------------------------

def backward_problems(problem: Problem, dout: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
                      lse_ptr: Optional[int] = None) -> list:
    """The problems (see :func:`raise_problems`) of the backward's inputs besides q, k, v (see
    :func:`check_backward`); ``problem`` comes from :func:`check_inputs` on q, k, v.

    The usual call (everything right) returns at once, with no loop and no message formatted.
    Layouts of dout and out are not checked here: the torch API copies what TMA cannot
    read, the DLPack entry checks them (:func:`tma_layout_problem`) with q's, k's and v's.
    """
    shape = problem.out_shape
    b, sq, h = problem.batch, problem.seqlen_q, problem.heads
    if (dout.shape == shape and out.shape == shape
            and dout.dtype == problem.dtype and out.dtype == problem.dtype and lse.dtype == "fp32"
            and dout.is_cuda and out.is_cuda and lse.is_cuda
            and dout.device == problem.device and out.device == problem.device and lse.device == problem.device
            and lse.shape == (b, h, sq) and lse.strides == (h * sq, sq, 1) and (lse_ptr is None or lse_ptr % 4 == 0)):
        return []
    dims = "(batch, seqlen_q, heads, head_dim_v)"
    P = array_problems("dout", dout, shape, dims, problem)
    P += array_problems("out", out, shape, dims, problem)
    P += lse_problems(lse, problem, lse_ptr)
    return P


def check_backward(problem: Problem, dout: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
                   lse_ptr: Optional[int] = None) -> None:
    """Check the backward's inputs besides q, k, v, for valid q, k, v (``problem`` from
    :func:`check_inputs`):

    * dout (the gradient of out) and out (the forward's output): shape
      ``(batch, seqlen_q, heads, head_dim_v)``, q's dtype, q's device: ValueError / TypeError;
    * lse (the forward's log-sum-exp): float32 ``(batch, heads, seqlen_q)`` on q's device,
      C-contiguous, 4-byte aligned (``lse_ptr``, bytes; skipped when None), as :func:`check_lse`.

    Every problem is listed in one exception (see :func:`raise_problems`).
    """
    raise_problems(backward_problems(problem, dout, out, lse, lse_ptr))


def contiguous_strides(shape: Sequence[int]) -> tuple:
    """The strides (elements) of a fresh C-contiguous array of ``shape``, as torch and CuPy give them (an
    extent 0 counts as 1)."""
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


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


def _device_problems(name: str, a: ArrayInfo, problem: Problem) -> list:
    if a.is_cuda and a.device == problem.device:
        return []
    return [(ValueError, f"{name} must be on q's CUDA device {problem.device}, got {a.device_repr}")]
