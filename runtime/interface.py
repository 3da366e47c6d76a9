"""torch API of flashgen: FlashAttention-3's ``flash_attn_func``, on flashgen's AOT kernels.

Drop-in for FA3's ``flash_attn_interface.flash_attn_func`` (same names, same semantics,
see ``shared/research/fa3.md`` §1): change the import, keep the call. The computation is
the FlashAttention-3 forward (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao,
arXiv 2407.08608, §3, Algorithms 1 and 2) and, for gradients, the FlashAttention-2/3
backward (recompute P from the forward's LSE, ``dS = P ∘ (dP − rowsum(dO ∘ O))``).

Two ops, registered with ``torch.library.custom_op``, each with a fake (meta)
implementation:

* ``torch.ops.flashgen.fwd(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1,
  window_right=-1, softcap=0.0, learnable_sink=None, q_descale=None, k_descale=None,
  v_descale=None, pack_gqa=None, num_splits=1) -> (out, lse)``, whose autograd formula
  saves q, k, v, out and lse (and learnable_sink when given; no more) and calls
* ``torch.ops.flashgen.bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
  window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)``; the sink's gradient is
  computed with torch ops (:func:`_sink_grad`).

Two more for :func:`flash_attn_varlen_func` on the varlen kernels, used where its offsets are not read on the host
(torch.compile, CUDA-graph capture) and for its gradients: ``torch.ops.flashgen.varlen_fwd`` (FA3's varlen
forward over packed q, k, v and int32 offsets on the GPU), whose autograd formula calls
``torch.ops.flashgen.varlen_bwd`` (FA3's varlen backward). Eager calls run their code through
:class:`_VarlenFn`, without the dispatcher (:func:`_varlen_apply`).

Eager calls that want gradients on plain tensors run the fwd op's code and autograd formula through
:class:`_FwdFn`, without the dispatcher (its autograd wrapper cost about 90 us of host time per training step on the
CPU stub: 265 against 174 us), with the forward's checks and prepared launch kept per metadata key as the no-grad
path keeps them (:func:`_fwd_grad_impl`); torch.compile, tracing and tensor subclasses take the ops.

So that

* ``torch.compile(fullgraph=True)`` traces through :func:`flash_attn_func`, forward and
  backward, without graph breaks (the ops are opaque; their fake implementations give
  shapes, dtypes and strides);
* CUDA graphs capture both: the kernels are launched on ``torch.cuda.current_stream()``,
  outputs, gradients, workspace and any layout copy come from torch's caching allocator,
  and neither call makes a host synchronisation.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

#: Message of the ImportError raised when this module (the torch API) is imported without torch.
NO_TORCH = (
    "flashgen: the torch API (flashgen.flash_attn_func, flashgen.flash_attn_combine, "
    "flashgen.quantize_fp8, flashgen.interface) needs PyTorch, which is not installed: pip install flashgen[torch] "
    "(or install torch yourself). Without torch, use the DLPack API, which takes any DLPack "
    "array (CuPy, JAX, ...): flashgen.flash_attn_forward and flashgen.flash_attn_combine_dlpack."
)

try:
    import torch
except ModuleNotFoundError as e:
    if e.name != "torch":  # torch is there but broken: its own error says more
        raise
    raise ImportError(NO_TORCH, name="torch") from e

from . import _validate as _v
from . import core as _core
from . import launch as _launch
from . import split_kv as _split_kv
from . import varlen_prep as _varlen_prep
from .generator.families import varlen_prep as _prep_family

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "NO_TORCH", "quantize_fp8",
           "incoherent_signs", "QUANT_BLOCK"]

_Tensor = torch.Tensor
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FP8_TORCH_DTYPES = tuple(getattr(torch, a) for a in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, a))
for _attr, _name in (  # only e4m3fn is served; the fnuz formats have another bias and NaN: refused
    ("float8_e4m3fn", "fp8_e4m3"),
    ("float8_e4m3fnuz", "fp8_other"),
    ("float8_e5m2", "fp8_e5m2"),
    ("float8_e5m2fnuz", "fp8_other"),
):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name


# --------------------------------------------------------------------------------------
# Seams (module-level so CPU tests can monkeypatch them)
# --------------------------------------------------------------------------------------

def _device_of(t: torch.Tensor) -> tuple:
    """(is a CUDA tensor, CUDA ordinal or None).

    ``is_cuda`` and ``get_device()`` rather than ``t.device``: ``torch.device.type`` builds a new
    string on every read, and flash_attn_func's cache key asks this of q, k and v on every call
    (measured on an H200 host, torch 2.11: 0.33 us a tensor this way, 0.73 us through ``t.device``)."""
    if t.is_cuda:
        return True, t.get_device()
    return False, None


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds of torch; int, no Stream object


def _current_stream(device: int) -> int:
    """The CUstream handle (int) of torch's current stream on ``device``."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def _check_device_capability(device: int) -> None:
    """RuntimeError unless ``device`` is a Hopper GPU (compute capability 9.x)."""
    _v.check_capability(_core.device_capability(device), device)


def _workspace(like: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised uint8 scratch memory on ``like``'s device for the backward.

    From torch's caching allocator on the current stream, so it is CUDA-graph capturable, and
    freeing it once the kernels are enqueued is stream-ordered: the memory is reused only by later
    work. Its address is 256-byte aligned, as the launches require (ValueError otherwise): CUDA
    blocks are 512-byte aligned; an allocator that gives less (the CPU tests' emulated device)
    gets a view at the next aligned byte of a block 255 bytes longer.
    """
    ws = like.new_empty(size=(nbytes,), dtype=torch.uint8)  # (size= as a keyword: see _fwd_run)
    align = _core._WS_ALIGN
    if ws.data_ptr() % align:
        ws = like.new_empty(size=(nbytes + align - 1,), dtype=torch.uint8)
        skip = -ws.data_ptr() % align
        ws = ws[skip:skip + nbytes]
    return ws


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def _array_info(t: torch.Tensor) -> _v.ArrayInfo:
    is_cuda, index = _device_of(t)
    return _v.ArrayInfo(
        tuple(t.shape),
        tuple(t.stride()),
        _DTYPE_NAMES.get(t.dtype),
        str(t.dtype),
        is_cuda,
        index,
        str(t.device),
    )


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _v.Problem:
    return _v.check_inputs(_array_info(q), _array_info(k), _array_info(v))


def _lse_arg(lse: torch.Tensor, p: _v.Problem) -> "_core.TensorArg":
    """The core's view of a contiguous float32 ``(batch, heads, seqlen_q)`` lse."""
    return _core.TensorArg(lse.data_ptr(), p.lse_shape, tuple(lse.stride()), "fp32", p.device)


def _tma_arg(t: torch.Tensor, dtype: str, device: int) -> tuple:
    """``(tensor, TensorArg)`` for an input: ``t`` itself when a TMA descriptor can address
    it, else a contiguous copy of it.

    ``.contiguous()`` is not enough for the copy: an already-contiguous view at a misaligned
    storage offset comes back unchanged, so the copy is an explicit clone into fresh memory
    (torch's caching allocator hands out 512-byte-aligned blocks). The tensor is returned so
    the caller keeps a copy alive until the launch is enqueued.
    """
    shape = tuple(t.shape)
    strides = t.stride()
    ptr = t.data_ptr()
    if _v.tma_layout_problem(shape, strides, _v.ELEMENT_SIZE[dtype], ptr) is not None:
        t = t.clone(memory_format=torch.contiguous_format)
        strides = t.stride()
        ptr = t.data_ptr()
    if 1 in shape:
        strides = _v.tma_strides(shape, strides)
    return t, _core.TensorArg(ptr, shape, tuple(strides), dtype, device)


# --------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------

class _FwdCall(NamedTuple):
    """Everything of a forward call that its validated metadata decides, made by :func:`_fwd_call`:
    the Problem, the outputs' shapes, dtype and strides, how q, k, v reach the kernel and, when they
    are read in place, the core's prepared launch (:func:`flashgen.core.prepare_forward`).
    flash_attn_func's eager path keeps one per key (``_fwd_calls``: everything the validation and
    this record depend on), so a repeated call skips both; immutable, so calls on any thread may
    share it. What depends on the data itself (addresses: alignment, copies) is done per call by
    :func:`_fwd_run`."""

    problem: _v.Problem
    out_shape: tuple
    lse_shape: tuple
    out_dtype: torch.dtype
    inputs: tuple  # per q, k, v: (shape, strides for the core) when TMA can read its layout in place, else None (copied)
    out_strides: tuple  # strides of the fresh contiguous out as the core takes them (tma_strides)
    lse_strides: tuple  # of the fresh contiguous lse
    empty: bool  # nothing to launch: batch, seqlen_q or seqlen_k is 0
    launch: Optional[_core.PreparedForward]  # when q, k, v are all read in place (and not empty); else None
    pack_gqa: Optional[bool] = None  # the core's pack_gqa for this call (:func:`_pack_gqa_arg`)
    split: Optional[_split_kv.SplitForward] = None  # FA3's num_splits: the call runs split-KV (split_kv module)


_fwd_calls: dict = {}  # key (see flash_attn_func) -> _FwdCall; immutable values
_FWD_CALL_CACHE_MAX = 1024  # bounded: cleared when full (dropping entries is safe)


def _input_layout(t: torch.Tensor, elem_size: int):
    """(shape, strides for the core) of an input whose strides TMA can read in place (its address
    is checked per call), else None: the input is copied (:func:`_tma_arg`)."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    if _v.tma_layout_problem(shape, strides, elem_size) is not None:
        return None
    return shape, (_v.tma_strides(shape, strides) if 1 in shape else strides)


def _pack_gqa_arg(p: _v.Problem, causal: bool, window_left: int, window_right: int, softcap: float,
                  pack_gqa: Optional[bool]) -> Optional[bool]:
    """The core's ``pack_gqa`` for flash_attn_func's hint (FA3's ``pack_gqa``): None = the
    measured rule decides (core.pack_gqa_rule); False = unpacked; True = packed where PackGQA can
    serve the call (GQA, a built PackGQA variant, the group fits its tile:
    core.pack_gqa_served), else unpacked. A hint never changes the result, only the kernel."""
    if not pack_gqa:
        return pack_gqa  # None or False, as given
    return _core.pack_gqa_served(p.dtype, p.head_dim, p.head_dim_v, causal, (window_left, window_right), p.seqlen_q,
                                 p.seqlen_k, softcap, p.heads, p.heads_k, p.device)


def _fwd_call(p: _v.Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_left: int,
              window_right: int, softcap: float, descales=(None, None, None), pack_gqa: Optional[bool] = None,
              num_splits: int = 1) -> _FwdCall:
    """The :class:`_FwdCall` of valid arguments (``p``: q, k, v's Problem; ``pack_gqa``: the
    caller's hint; ``num_splits``: FA3's, see :func:`flashgen.split_kv.prepare_split_forward`). When
    q, k, v can be read in place this prepares the core's launch (and the split-KV one where the call splits):
    RuntimeError on a GPU that is not Hopper, then MissingVariantError when no built variant
    serves the call (before any allocation)."""
    es = _v.ELEMENT_SIZE[p.dtype]
    inputs = tuple(_input_layout(t, es) for t in (q, k, v))
    out_strides = _v.tma_strides(p.out_shape, _v.contiguous_strides(p.out_shape))
    empty = p.nothing_to_compute or p.seqlen_k == 0
    prepared = None
    core_pack = None
    if not empty and pack_gqa is not None:
        if pack_gqa:
            _check_device_capability(p.device)  # before the core looks up (and loads) a PackGQA kernel
        core_pack = _pack_gqa_arg(p, causal, window_left, window_right, softcap, pack_gqa)
    if not empty and None not in inputs:
        dev = p.device
        _check_device_capability(dev)  # before the core selects and loads a kernel
        (qs, qst), (ks, kst), (vs, vst) = inputs
        prepared = _core.prepare_forward(
            _core.TensorArg(0, qs, qst, p.dtype, dev), _core.TensorArg(0, ks, kst, p.dtype, dev),
            _core.TensorArg(0, vs, vst, p.dtype, dev), _core.TensorArg(0, p.out_shape, out_strides, p.out_dtype, dev),
            causal, window_size=(window_left, window_right), softcap=softcap,
            q_descale=_descale_arg(descales[0], dev, 0), k_descale=_descale_arg(descales[1], dev, 0),
            v_descale=_descale_arg(descales[2], dev, 0), pack_gqa=core_pack)
    split = None if prepared is None else _split_kv.prepare_split_forward(
        p, inputs, causal, (window_left, window_right), softcap, not _no_descales(descales), core_pack, num_splits)
    return _FwdCall(p, p.out_shape, p.lse_shape, _TORCH_DTYPES[p.out_dtype], inputs, out_strides,
                    _v.contiguous_strides(p.lse_shape), empty, prepared, core_pack, split)


def _new_fwd_call(key: tuple, q, k, v, causal: bool, window_left: int, window_right: int, softcap: float, sink,
                  descales: tuple, pack_gqa: Optional[bool] = None, num_splits: int = 1) -> _FwdCall:
    """flash_attn_func's eager path on a key not in ``_fwd_calls``: validate q, k, v (and the sink,
    the descales and what FP8 lacks), make the key's :class:`_FwdCall` and cache it (bounded)."""
    p = _v.check_inputs(_array_info(q), _array_info(k), _array_info(v))
    if sink is not None or p.dtype == "fp8_e4m3" or not _no_descales(descales):
        _check_extras(p, sink, *descales)
    call = _fwd_call(p, q, k, v, causal, window_left, window_right, softcap, descales, pack_gqa, num_splits)
    return _launch.cache_put(_fwd_calls, key, call, _FWD_CALL_CACHE_MAX)


def _fwd_call_key(q, k, v, causal: bool, window_left: int, window_right: int, softcap: float, sink, descales: tuple,
                  pack_gqa, num_splits: int = 1) -> tuple:
    """``_fwd_calls``' key of a call: q, k, v's shapes, strides, dtypes and devices, the mask, whether softcap is on,
    the sink's and descales' metadata (:func:`_extras_key`), the PackGQA hint, FA3's num_splits. (flash_attn_func's
    inline fast path builds the same tuple itself, one function call less: test_api_validation.py checks that both
    find one entry.)"""
    return (q.shape, q.stride(), q.dtype, _device_of(q), k.shape, k.stride(), k.dtype, _device_of(k),
            v.shape, v.stride(), v.dtype, _device_of(v), causal, window_left, window_right, softcap != 0.0,
            _extras_key(sink, descales), pack_gqa, num_splits)


def _fwd_grad_impl(q, k, v, softmax_scale: float, causal: bool, deterministic: bool = False, window_left: int = -1,
                   window_right: int = -1, softcap: float = 0.0, learnable_sink=None, q_descale=None, k_descale=None,
                   v_descale=None, pack_gqa=None, num_splits: int = 1) -> tuple:
    """:func:`_fwd_impl` for flash_attn_func's eager calls that want gradients (:class:`_FwdFn`), whose
    softmax_scale, window and softcap flash_attn_func has checked: q, k, v, the sink and the descales are validated
    and the launch prepared once per metadata key (``_fwd_calls``, shared with the no-grad path), not per call.
    Returns ``(out, lse)`` as :func:`_fwd_impl`; raises what it raises (on a key's first call)."""
    descales = (q_descale, k_descale, v_descale)
    key = _fwd_call_key(q, k, v, causal, window_left, window_right, softcap, learnable_sink, descales, pack_gqa,
                        num_splits)
    call = _fwd_calls.get(key) or _new_fwd_call(key, q, k, v, causal, window_left, window_right, softcap,
                                                learnable_sink, descales, pack_gqa, num_splits)
    return _fwd_run(call, q, k, v, softmax_scale, causal, window_left, window_right, softcap, learnable_sink, descales)


def _check_fwd(q, k, v, window_left, window_right, softcap, learnable_sink, q_descale=None, k_descale=None,
               v_descale=None) -> _v.Problem:
    """q, k, v, the window and softcap checked together (every problem in one error), then
    learnable_sink and the FP8 descales (whose expected shapes and device come from q); returns
    the Problem."""
    p = _v.check_inputs(_array_info(q), _array_info(k), _array_info(v),
                        also=_v.window_size_problems((window_left, window_right)) + _v.softcap_problems(softcap))
    _check_extras(p, learnable_sink, q_descale, k_descale, v_descale)
    return p


def _no_descales(descales: tuple) -> bool:
    """No descale tensor given. (Not ``descales == (None, None, None)``: a tuple compares its items with
    ``==``, and ``Tensor == None`` goes through torch's dispatch: about 11 us of host time per call.)"""
    return descales[0] is None and descales[1] is None and descales[2] is None


def _extras_key(sink, descales: tuple):
    """The sink's and the descales' part of a forward call's cache key (``_fwd_calls``): None without
    them, else the sink's (shape, dtype, device) and each descale's (shape, strides, dtype, device)."""
    if sink is None and _no_descales(descales):
        return None
    return (None if sink is None else (sink.shape, sink.dtype, _device_of(sink)),
            *(None if t is None else (t.shape, t.stride(), t.dtype, _device_of(t)) for t in descales))


def _check_extras(p: _v.Problem, learnable_sink, q_descale, k_descale, v_descale) -> None:
    """learnable_sink, the FP8 descales and what the FP8 forward lacks, for valid q, k, v (``p``)."""
    P = [] if learnable_sink is None else _v.learnable_sink_problems(_array_info(learnable_sink), p)
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if p.dtype == "fp8_e4m3" or any(t is not None for t in descales.values()):
        P += _v.descale_problems(p, {n: None if t is None else _array_info(t) for n, t in descales.items()})
        P += _v.fp8_problems(p)
    _v.raise_problems(P)


def _fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
    deterministic: bool = False, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    learnable_sink: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
    pack_gqa: Optional[bool] = None, num_splits: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.fwd(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1,
    window_right=-1, softcap=0.0, learnable_sink=None, q_descale=None, k_descale=None,
    v_descale=None, pack_gqa=None, num_splits=1) -> (out, lse)``.

    The registered op behind :func:`flash_attn_func`; same arguments (softmax_scale already
    resolved to a float; ``window_size`` as two ints, -1 unbounded), always returns
    ``(out, lse)``: out contiguous ``(batch, seqlen_q, heads, head_dim_v)`` of q's dtype, lse
    contiguous float32 ``(batch, heads, seqlen_q)`` (natural log; includes the sink); out is
    bf16 for float8_e4m3fn inputs (with their descales, see :func:`flash_attn_func`). Validates
    its arguments itself (see :func:`flash_attn_func`), so calling it directly is safe.
    ``deterministic`` does not change the forward (always deterministic); it is an argument of
    the op so that its autograd formula hands it to the backward, also in a torch.compile graph.
    ``pack_gqa``: FA3's PackGQA hint; ``num_splits``: FA3's split-KV count (both: see :func:`flash_attn_func`);
    neither changes the result beyond fp32 rounding order.
    """
    p = _check_fwd(q, k, v, window_left, window_right, softcap, learnable_sink, q_descale, k_descale, v_descale)
    descales = (q_descale, k_descale, v_descale)
    call = _fwd_call(p, q, k, v, bool(causal), int(window_left), int(window_right), float(softcap), descales,
                     None if pack_gqa is None else bool(pack_gqa), int(num_splits))
    return _fwd_run(call, q, k, v, softmax_scale, causal, window_left, window_right, softcap, learnable_sink, descales)


_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _descale_arg(t: Optional[torch.Tensor], device: int, ptr: Optional[int] = None) -> Optional["_core.TensorArg"]:
    """The core's view of a float32 descale (None for None); ``ptr``: instead of its address."""
    return None if t is None else _core.TensorArg(t.data_ptr() if ptr is None else ptr, tuple(t.shape),
                                                  tuple(t.stride()), "fp32", device)


def _fwd_run(call: _FwdCall, q, k, v, softmax_scale, causal, window_left, window_right, softcap,
             learnable_sink, descales=(None, None, None), want_lse: bool = True) -> tuple:
    """The forward for arguments already validated (``call``: their :class:`_FwdCall`): outputs, launch.
    ``(out, lse)``; with ``want_lse`` False lse may come back None: where the prepared launch serves the
    call, no lse is allocated and the kernel writes none (a null lse pointer): one allocation less per
    call (about 2 us of host time on an H100 host, docs/PERF.md)."""
    p = call.problem
    _check_device_capability(p.device)
    # size= as a keyword: torch parses a positional size tuple slower (measured: 0.5 us per tensor
    # on torch 2.13 CPU; 0.5 us for lse and 1.3 us for out on an H200 host, torch 2.11)
    out = q.new_empty(size=call.out_shape, dtype=call.out_dtype)
    lse = None
    if want_lse or call.launch is None or call.empty:
        lse = q.new_empty(size=call.lse_shape, dtype=torch.float32)
    if call.empty:
        if not p.nothing_to_compute:
            # seqlen_k == 0: every query attends to nothing: out 0, lse -inf (FA3's empty rows),
            # or with a sink lse = log(exp(sink)) = sink[h] (the sink is the only term of the sum).
            out.zero_()
            if learnable_sink is None:
                lse.fill_(-math.inf)
            else:
                lse.copy_(learnable_sink.view(1, p.heads, 1).expand(p.lse_shape))
        return out, lse
    sink = None if learnable_sink is None else learnable_sink.contiguous()  # a copy only if strided
    sink_ptr = 0 if sink is None else sink.data_ptr()
    dev = p.device
    if call.launch is not None:  # q, k, v read in place: the prepared launch, unless an address is misaligned
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if call.split is not None and not (q_ptr | k_ptr | v_ptr) % _v.TMA_ALIGN_BYTES:
            if lse is None:  # (the combine writes lse)
                lse = q.new_empty(size=call.lse_shape, dtype=torch.float32)
            _split_run(call, q_ptr, k_ptr, v_ptr, out, lse, softmax_scale, softcap, sink_ptr, _current_stream(dev))
            del sink  # a copy is released only after the launches are enqueued
            return out, lse
        if not (q_ptr | k_ptr | v_ptr) % _v.TMA_ALIGN_BYTES:
            qd, kd, vd = descales
            _core.launch_forward(call.launch, q_ptr, k_ptr, v_ptr, out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                                 float(softmax_scale), float(softcap), _current_stream(dev), sink_ptr,
                                 0 if qd is None else qd.data_ptr(), 0 if kd is None else kd.data_ptr(),
                                 0 if vd is None else vd.data_ptr())
            del sink  # a copy is released only after the launch is enqueued
            return out, lse
    if lse is None:  # (a misaligned address: the copies' path below, which writes lse)
        lse = q.new_empty(size=call.lse_shape, dtype=torch.float32)
    # Copies where TMA cannot read an input in place (layout or address), which stay referenced
    # until the launch is enqueued; after that, freeing them is stream-ordered by the caching
    # allocator (same stream), so the kernel reads them safely.
    dtype = p.dtype
    qc, qa = _input_arg(q, call.inputs[0], dtype, dev)
    kc, ka = _input_arg(k, call.inputs[1], dtype, dev)
    vc, va = _input_arg(v, call.inputs[2], dtype, dev)
    _core.attention_forward(
        qa,
        ka,
        va,
        _core.TensorArg(out.data_ptr(), call.out_shape, call.out_strides, p.out_dtype, dev),  # fresh and contiguous
        _core.TensorArg(lse.data_ptr(), call.lse_shape, call.lse_strides, "fp32", dev),
        float(softmax_scale),
        bool(causal),
        _current_stream(dev),
        window_size=(int(window_left), int(window_right)),
        softcap=float(softcap),
        sink=sink_ptr,
        q_descale=_descale_arg(descales[0], dev),
        k_descale=_descale_arg(descales[1], dev),
        v_descale=_descale_arg(descales[2], dev),
        pack_gqa=call.pack_gqa,
    )  # selects the variant (cached per key) and raises MissingVariantError before launching
    del qc, kc, vc, sink  # any copies are released only after the launch is enqueued
    return out, lse


def _split_run(call: _FwdCall, q_ptr: int, k_ptr: int, v_ptr: int, out: torch.Tensor, lse: torch.Tensor,
               softmax_scale, softcap, sink_ptr: int, stream: int) -> None:
    """A split-KV call's launches (:func:`flashgen.split_kv.launch_split_forward`) into ``out`` and ``lse``
    (contiguous, as flash_attn_func returns them) on ``stream``, with a workspace of this call for the partials
    (one allocation; uninitialised: the kernel writes every row of it)."""
    s = call.split
    workspace = out.new_empty(size=(-(-s.workspace_bytes // 4),), dtype=torch.float32)
    _split_kv.launch_split_forward(s, q_ptr, k_ptr, v_ptr, workspace.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                   softmax_scale, softcap, stream, sink_ptr)
    del workspace  # released after the launches are enqueued (stream-ordered)


def _input_arg(t: torch.Tensor, layout, dtype: str, device: int) -> tuple:
    """``(copy or None, TensorArg)`` of an input: ``t`` in place when its layout (``layout``, from
    :func:`_input_layout`) and its address suit TMA, else :func:`_tma_arg`'s copy."""
    if layout is not None:
        ptr = t.data_ptr()
        if not ptr % _v.TMA_ALIGN_BYTES:
            return None, _core.TensorArg(ptr, layout[0], layout[1], dtype, device)
    return _tma_arg(t, dtype, device)


_fwd = torch.library.custom_op("flashgen::fwd", _fwd_impl, mutates_args=())


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None, q_descale=None, k_descale=None, v_descale=None, pack_gqa=None, num_splits=1):
    p = _check_fwd(q, k, v, window_left, window_right, softcap, learnable_sink, q_descale, k_descale, v_descale)
    out = q.new_empty(p.out_shape, dtype=_TORCH_DTYPES[p.out_dtype])  # contiguous, on q's device: as the real op
    lse = q.new_empty(p.lse_shape, dtype=torch.float32)
    return out, lse


def _check_backward(dout, q, k, v, out, lse, window_left=-1, window_right=-1, softcap=0.0) -> tuple:
    """``(Problem, lse)``: q, k, v, the window and softcap checked
    (:func:`flashgen._validate.check_inputs`), then dout, out and lse
    (:func:`flashgen._validate.check_backward`); lse is made contiguous first (a copy only if it
    is not, as for any input the kernels cannot read in place)."""
    lse = lse.contiguous()
    p = _v.check_inputs(_array_info(q), _array_info(k), _array_info(v),
                        also=_v.window_size_problems((window_left, window_right)) + _v.softcap_problems(softcap))
    _v.check_backward(p, _array_info(dout), _array_info(out), _array_info(lse))
    return p, lse


class _BwdCall(NamedTuple):
    """Everything of a backward call that its validated metadata decides, made by :func:`_bwd_call`: the Problem,
    the workspace's size and, when TMA reads dout, q, k, v, out all in place, the core's prepared launch
    (:func:`flashgen.core.prepare_backward`). The backward op keeps one per key (``_bwd_calls``: the six arrays'
    shapes, strides, dtypes and devices, the mask, softcap, causal and deterministic: all that the checks and this
    record read, never the data), so a training loop's repeated backward skips both; immutable, so calls on any
    thread may share it. What depends on the data itself (addresses: alignment, copies) is done per
    call by :func:`_bwd_impl`."""

    problem: _v.Problem
    empty: bool  # nothing to launch: batch, seqlen_q or seqlen_k is 0
    nbytes: int  # the workspace (0 when empty)
    launch: Optional[_core.PreparedBackward]  # when dout, q, k, v, out are all read in place (and not empty)


_bwd_calls: dict = {}  # _bwd_impl's key -> _BwdCall; immutable values (bounded by _FWD_CALL_CACHE_MAX)


def _bwd_call(p: _v.Problem, dout, q, k, v, out, causal: bool, deterministic: bool, window: tuple,
              softcap: float) -> _BwdCall:
    """The :class:`_BwdCall` of valid arguments (``p``: their Problem, on a Hopper device). Selects the variant:
    MissingVariantError when no bwd variant serves the call (before any allocation)."""
    if p.nothing_to_compute or p.seqlen_k == 0:
        return _BwdCall(p, True, 0, None)
    es = _v.ELEMENT_SIZE[p.dtype]
    inputs = tuple(_input_layout(t, es) for t in (dout, q, k, v, out))
    dev = p.device
    if None in inputs:  # copied per call (_launch_backward)
        nbytes = _core.backward_workspace_bytes(p.batch, p.seqlen_q, p.heads, p.heads_k, p.head_dim, p.dtype,
                                                causal, dev, seqlen_k=p.seqlen_k, window_size=window, softcap=softcap,
                                                head_dim_v=p.head_dim_v)
        return _BwdCall(p, False, nbytes, None)
    # the fresh contiguous dq, dk, dv that _bwd_impl allocates per call
    grads = tuple(_core.TensorArg(0, shape, _v.tma_strides(shape, _v.contiguous_strides(shape)), p.dtype, dev)
                  for shape in (p.q_shape, p.k_shape, p.v_shape))
    prepared = _core.prepare_backward(
        *(_core.TensorArg(0, shape, strides, p.dtype, dev) for shape, strides in inputs),
        _core.TensorArg(0, p.lse_shape, _v.contiguous_strides(p.lse_shape), "fp32", dev), *grads, causal, deterministic,
        window_size=window, softcap=softcap)
    return _BwdCall(p, False, prepared.nbytes, prepared)


def _bwd_impl(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
    window_right: int = -1, softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic,
    window_left=-1, window_right=-1, softcap=0.0) -> (dq, dk, dv)``: the gradients of
    :func:`flash_attn_func`'s out with respect to q, k, v.

    dout, out: ``(batch, seqlen_q, heads, head_dim_v)`` of q's dtype (out and lse are the
    forward's outputs for the same q, k, v, softmax_scale, causal, window and softcap); lse:
    float32 ``(batch, heads, seqlen_q)``. q, k, v as in :func:`flash_attn_func` (head_dim_v may
    differ from head_dim). Returns contiguous dq, dk, dv of q's, k's and v's shapes and dtype
    (dk, dv of a GQA group summed over its query heads). ``deterministic``: bitwise-reproducible
    results. A learnable sink needs nothing here (the forward's lse includes it); its gradient
    is computed by the autograd formula (:func:`_sink_grad`).

    Inputs TMA cannot read in place (e.g. the stride-0 gradient of ``out.sum()``) are copied
    first, as in the forward. The checks, the variant and the launch are resolved once per metadata key
    (:class:`_BwdCall`, ``_bwd_calls``); a call that raises is not kept. (The fake implementation checks every
    call: its shapes may be symbolic.) Empty problems launch nothing: dq = 0 when seqlen_k is 0, and
    dk = dv = 0 when batch or seqlen_q is 0. Validates its arguments (flashgen.InputError and
    the rest as :func:`flash_attn_func`); MissingVariantError when no bwd variant serves (dtype,
    max(head_dim, head_dim_v), mask, softcap).
    """
    key = (*((t.shape, t.stride(), t.dtype, _device_of(t)) if isinstance(t, torch.Tensor) else type(t)
             for t in (dout, q, k, v, out, lse)), window_left, window_right, softcap, causal, deterministic)
    call = _bwd_calls.get(key)
    if call is None:
        p, lse = _check_backward(dout, q, k, v, out, lse, window_left, window_right, softcap)
        _check_device_capability(p.device)
        call = _bwd_call(p, dout, q, k, v, out, bool(causal), bool(deterministic),
                         (int(window_left), int(window_right)), float(softcap))
        _launch.cache_put(_bwd_calls, key, call, _FWD_CALL_CACHE_MAX)
    else:
        p = call.problem
        lse = lse.contiguous()
        _check_device_capability(p.device)
    if call.empty:
        # nothing to launch: no key (dq = 0: out does not depend on q) or no query (dk = dv = 0)
        return q.new_zeros(p.q_shape), k.new_zeros(p.k_shape), v.new_zeros(p.v_shape)
    # size= as a keyword (see _fwd_run); contiguous, of q's, k's, v's dtype
    grads = (q.new_empty(size=p.q_shape), k.new_empty(size=p.k_shape), v.new_empty(size=p.v_shape))
    dev = p.device
    prep = call.launch
    if prep is not None:  # dout, q, k, v, out read in place: the prepared launch, unless an address is misaligned
        do_ptr, q_ptr, k_ptr, v_ptr, o_ptr = dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if not (do_ptr | q_ptr | k_ptr | v_ptr | o_ptr) % _v.TMA_ALIGN_BYTES:
            dq, dk, dv = grads
            workspace = _workspace(q, call.nbytes)
            _core.launch_backward(prep, do_ptr, q_ptr, k_ptr, v_ptr, o_ptr, lse.data_ptr(), dq.data_ptr(),
                                  dk.data_ptr(), dv.data_ptr(), workspace.data_ptr(), float(softmax_scale),
                                  float(softcap), _current_stream(dev))
            del workspace  # released once the launches are enqueued (stream-ordered)
            return grads
    _launch_backward((dout, q, k, v, out), _lse_arg(lse, p), grads, p.dtype, dev, call.nbytes, softmax_scale,
                     bool(causal), deterministic, (int(window_left), int(window_right)), float(softcap))
    return grads


def _launch_backward(inputs: tuple, lse_arg, grads: tuple, dtype: str, dev: int, nbytes: int, softmax_scale, causal,
                     deterministic, window: tuple, softcap: float, varlen=None) -> None:
    """``core.attention_backward`` on (dout, q, k, v, out) = ``inputs`` (each as TMA reads it: a layout copy where it
    cannot read it in place), ``lse_arg`` and fresh contiguous ``grads`` (dq, dk, dv), with a workspace of
    ``nbytes`` from torch's allocator on the current stream; the copies and the workspace are released once the
    launches are enqueued (stream-ordered). For :func:`_bwd_impl` and :func:`_varlen_bwd_impl`."""
    args = [_tma_arg(t, dtype, dev) for t in inputs]  # (tensor kept alive, TensorArg)
    workspace = _workspace(inputs[1], nbytes)
    _core.attention_backward(*(arg for _, arg in args), lse_arg, *(_tma_arg(g, dtype, dev)[1] for g in grads),
                             float(softmax_scale), bool(causal), bool(deterministic), _current_stream(dev),
                             workspace.data_ptr(), window_size=window, softcap=softcap, varlen=varlen)
    del args, workspace


_bwd = torch.library.custom_op("flashgen::bwd", _bwd_impl, mutates_args=())


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1, window_right=-1,
              softcap=0.0):
    p, _ = _check_backward(dout, q, k, v, out, lse, window_left, window_right, softcap)
    return q.new_empty(p.q_shape), k.new_empty(p.k_shape), v.new_empty(p.v_shape)  # as the real op


def _sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The gradient of a loss with respect to ``learnable_sink``, given the gradient ``dout`` of
    that loss with respect to out (the gradient through lse is ignored, as for q, k, v).

    With ``L[b,h,i] = log(exp(sink[h]) + sum_j exp(s[b,h,i,j]))`` (lse) and
    ``out[b,i,h] = sum_j exp(s[b,h,i,j] - L[b,h,i]) v_j``: ``d out / d sink[h] = -exp(sink[h] - L) out``,
    so ``d_sink[h] = -sum_{b,i} exp(sink[h] - lse[b,h,i]) * dPsum[b,h,i]`` with
    ``dPsum[b,h,i] = sum_d dout[b,i,h,d] * out[b,i,h,d]``, in float32; rows with lse = -inf
    (no key and a sink of -inf) contribute 0. dout, out ``(batch, seqlen_q, heads, head_dim_v)``,
    lse float32 ``(batch, heads, seqlen_q)``, sink ``(heads,)``; returns sink's dtype and shape.
    Torch ops only, so torch.compile traces it into the backward graph."""
    dpsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    lse = lse.float()
    w = torch.exp(sink.float().reshape(1, -1, 1) - lse)
    w = torch.where(lse == -math.inf, torch.zeros_like(w), w)  # exp(-inf - -inf) = nan: such rows add nothing
    return (-(w * dpsum).sum(dim=(0, 2))).to(sink.dtype).reshape(sink.shape)


def _setup_context(ctx, inputs, output):
    """Saves what the backward needs, no more: q, k, v, out, lse (and learnable_sink when given)
    and the scalars."""
    q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, sink, *_descales = inputs
    out, lse = output
    ctx.has_sink = sink is not None
    if ctx.has_sink:
        ctx.save_for_backward(q, k, v, out, lse, sink)
    else:
        ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap


def _backward(ctx, grad_out, grad_lse, bwd=None):
    """dq, dk, dv from grad_out through ``torch.ops.flashgen.bwd`` (or ``bwd``, the same signature: :class:`_FwdFn`
    calls :func:`_bwd_impl` itself), and learnable_sink's gradient (:func:`_sink_grad`) when it needs one. grad_lse
    is ignored, as FA3 does: a loss that uses lse gets no gradient through it."""
    q, k, v, out, lse, *rest = ctx.saved_tensors
    dq, dk, dv = (bwd or torch.ops.flashgen.bwd)(grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                                                 ctx.deterministic, ctx.window_left, ctx.window_right, ctx.softcap)
    d_sink = None
    if ctx.has_sink and ctx.needs_input_grad[9]:
        d_sink = _sink_grad(grad_out, out, lse, rest[0])
    return dq, dk, dv, None, None, None, None, None, None, d_sink, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def _eager_function(name: str, impl, setup_context, backward, bwd_impl, doc: str) -> type:
    """A torch.autograd.Function that runs a custom op's implementation ``impl`` and its autograd formula
    (``setup_context``, then ``backward(ctx, *grads, bwd_impl)``) without the custom-op dispatcher, whose autograd
    wrapper costs host time every training step (CPU stub, scripts/overhead_cpu_stub.py). For eager calls on plain
    tensors; torch.compile, tracing and tensor subclasses keep the ops."""
    def forward(ctx, *inputs):
        outputs = impl(*inputs)
        setup_context(ctx, inputs, outputs)
        # The backward ignores lse's gradient (FA3's), so autograd need not make a zero tensor for it every step
        # (an allocation and a fill kernel on the GPU; the custom op's autograd wrapper, under torch.compile, still
        # does); out's is made below where the loss does not use out.
        ctx.set_materialize_grads(False)
        return outputs

    def backward_(ctx, grad_out, *grads):
        if grad_out is None:  # out is not in the loss (lse alone is): zeros, as autograd would have materialised
            grad_out = torch.zeros_like(ctx.saved_tensors[3])  # (both setup_contexts save q, k, v, out first)
        return backward(ctx, grad_out, *grads, bwd_impl)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                    "backward": staticmethod(backward_), "__doc__": doc})


#: ``torch.ops.flashgen.fwd`` with its autograd formula (:func:`_setup_context`, :func:`_backward` with
#: :func:`_bwd_impl`) for eager calls that want gradients: CPU-stub training step 265 -> 174 us; with the forward's
#: checks and prepared launch kept per key (:func:`_fwd_grad_impl`) and the backward's checks (then ``_bwd_checked``)
#: 217-230 -> 166-169 us (session 14, three alternated runs); with the backward's prepared launch as well
#: (:class:`_BwdCall`, core.prepare_backward / launch_backward) 167-178 -> 92-94 us (three alternated runs).
_FwdFn = _eager_function("_FwdFn", _fwd_grad_impl, _setup_context, _backward, _bwd_impl,
                         "flashgen::fwd and its autograd formula without the dispatcher (interface._eager_function).")


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------

def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    *,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: tuple = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """Scaled dot-product attention, FlashAttention-3 on Hopper (sm_90a); differentiable.

    ``out[b, i, h] = sum_j softmax_j(s[b, h, i, j]) v[b, j, h // g]`` with ``g = heads // heads_k``
    (GQA/MQA) and the logits ``s = softmax_scale * q[b, i, h] . k[b, j, h // g]`` (with
    ``softcap`` c > 0: ``s = c * tanh(softmax_scale * q . k / c)``), keys outside the mask
    (``causal`` / ``window_size``) dropped. Computed by flashgen's FA3 forward kernels
    (Shah et al., arXiv 2407.08608, §3, Algorithms 1-2: tiled online softmax, fp32
    accumulation), with the argument names and semantics of FA3's
    ``flash_attn_interface.flash_attn_func`` (plus ``learnable_sink``, as in gpt-oss / FA4).

    Gradients: when q, k, v (or learnable_sink) require grad (and grad mode is on), backward
    through ``out`` gives dq, dk, dv of q's, k's and v's shapes and dtype, computed by
    flashgen's bwd kernels (the FlashAttention-2/3 backward: P recomputed from the forward's
    lse, ``dS = P ∘ (dP − rowsum(dO ∘ O))``, fp32 accumulation; with softcap dS is scaled by the
    tanh's derivative; dk, dv of a GQA group summed over its query heads), and d_sink (see
    learnable_sink). The forward then saves q, k, v, out and lse (and learnable_sink) for it,
    no more. As in FA3, the gradient with respect to the returned lse is ignored (a loss
    through lse alone gives zero gradients). head_dim_v may differ from head_dim in the backward
    too (e.g. 192 / 128): it runs on the bwd variant of max(head_dim, head_dim_v), as FA3's.

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)`` CUDA tensor, float16, bfloat16 or
            float8_e4m3fn (FP8: see q_descale; the output is then bfloat16).
        k: ``(batch, seqlen_k, heads_k, head_dim)``, same dtype and device as q.
        v: ``(batch, seqlen_k, heads_k, head_dim_v)``, same dtype and device as q.
            heads must be a multiple of heads_k; head_dim and head_dim_v multiples of 8 in
            8..256; with float16 / bfloat16 head_dim_v may go up to 512 (FA3's limit), served
            as two calls on v's column halves (q k^T and the softmax computed twice). A head
            dim with no variant of its own runs on the smallest built larger one (zero padded,
            as FA3 rounds up to its compiled sizes); a call no built variant covers raises
            MissingVariantError.
        softmax_scale: multiplies q.k before the softmax; None means ``head_dim ** -0.5``.
            Any finite float (FA3 accepts zero and negative scales too).
        causal: bottom-right aligned causal mask: query row i sees keys
            ``j <= i + seqlen_k - seqlen_q`` (FA3's convention); same as ``window_size``'s right
            side set to 0. A row that sees no key outputs 0 with lse -inf (or lse = sink).
        window_size: ``(left, right)``, each an int >= -1 or None (-1 / None: unbounded):
            sliding-window (local) attention, bottom-right aligned as in FA3: query row i sees
            keys ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
            ``causal=True`` forces right = 0, so ``causal=True, window_size=(L, -1)`` is a
            causal sliding window of L keys before the diagonal (L + 1 with it).
        softcap: logit soft-capping (FA3; Gemma 2): a finite float >= 0, 0 = off; with c > 0
            the logits are ``c * tanh(softmax_scale * q.k / c)``, in (-c, c).
        learnable_sink: None, or a float32 ``(heads,)`` CUDA tensor on q's device, any strides:
            one logit per query head (gpt-oss; FlashAttention-4's ``learnable_sink``), in the
            units of the logits s above (after softmax_scale and softcap), added to each row's
            softmax denominator only: ``out_i = sum_j exp(s_ij - L_i) v_j`` with
            ``L_i = log(exp(sink[h]) + sum_j exp(s_ij))``; the returned lse is L (includes the
            sink). Differentiable: ``d_sink[h] = -sum_{b,i} exp(sink[h] - lse[b,h,i]) *
            sum_d dout[b,i,h,d] out[b,i,h,d]`` (computed in float32 with torch ops).
        q_descale, k_descale, v_descale: FP8 only (float8_e4m3fn q, k, v; FA3 paper §3.3):
            None (1) or float32 CUDA tensors on q's device, any strides, positive: the
            logits use ``q * q_descale`` and ``k * k_descale``, and out uses ``v * v_descale``.
            Shapes: q_descale ``(batch, heads_k)`` (FA3's: one per GQA group) or
            ``(batch, heads, ceil(seqlen_q / 64))`` (block quantization: one per 64 rows of each
            query head); k_descale ``(batch, heads_k)`` or ``(batch, heads_k, ceil(seqlen_k /
            64))``; v_descale ``(batch, heads_k)``. ``flashgen.quantize_fp8(q, k, v)`` makes e4m3
            inputs and descales from fp16/bf16 ones. FP8 serves every mask (causal, windows),
            softcap and learnable_sink as the 16-bit forward does (with softcap the descales
            scale q.k before the tanh); head_dim_v == head_dim only, and no backward yet.
        attention_chunk: FA3's chunked attention (Llama 4): an int >= 0 (None or 0: off). With
            C > 0 query row i sees only the keys of its chunk of C key positions,
            ``floor((i + seqlen_k - seqlen_q) / C) * C <= j < that + C``, within its causal /
            window mask (FA3's ``construct_chunk_mask``). Runs as at most three calls of the same
            kernels on slices of q, k, v (the whole chunks batched), each with the call's mask
            (:func:`flashgen.core.chunk_pieces`); differentiable (FA3 has no backward for it).
            Block-quantized FP8 descales need every chunk boundary at a multiple of 64 rows.
        qv: FA3's absorbed-MLA input, not implemented: anything but None raises
            NotImplementedError naming it.
        pack_gqa: FA3's PackGQA hint (a K/V head's query heads in one tile, so K and V are read
            once per group); it never changes the result. None: flashgen.core.pack_gqa_rule
            decides (measured on decode-like calls, docs/PERF.md); False: never packed; True:
            packed when the call has GQA (heads > heads_k) and a built PackGQA variant serves it
            (no softcap, no FP8 ones yet), else unpacked. Anything but None/True/False raises
            TypeError.
        num_splits: FA3's split-KV count (flash-decoding: the keys of each tile split into that many
            shares run as separate tiles, their partial outputs merged by the combine kernel, as
            :func:`flash_attn_combine`): an int; 1 (FA3's default) none, 0 or less chosen by
            core.varlen_num_splits (split where the tiles do not fill the GPU, e.g. decode-like calls over
            long keys, by a cost model fitted on an H100 (core.SPLIT_MODEL; FA3's heuristic for other calls);
            unsplit otherwise or with FLASHGEN_SPLIT_KV_AUTO=0), n
            that many (at most core.MAX_SPLITS and one per 64 keys). It runs on the varlen kernel over
            the padded batch where one is built for the call, for fp16 / bf16 inputs that TMA reads in
            place (a copied input runs unsplit); the backward reads the merged out and lse as any. It
            never changes the result beyond fp32 rounding order (the merge is in fp32, fixed order).
        sm_margin: FA3 scheduling hint; accepted and ignored (it never changes the result).
        deterministic: the backward gives bitwise-reproducible gradients (its dq
            accumulation runs in a fixed order, at some cost in speed); the forward is
            always deterministic. Without it, causal calls with seqlen_k <= 512 (2048 at
            head_dim 256) take the ordered path anyway, where it measured faster
            (core.ORDERED_CAUSAL_MAX_SEQLEN_K, ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS).
        return_attn_probs: when True return ``(out, lse)`` (as FA3 does), else ``out``.
        The arguments after ``causal`` are keyword-only, so a positional call written for
        a different argument order fails loudly instead of binding wrongly.

    Returns:
        out: ``(batch, seqlen_q, heads, head_dim_v)``, q's dtype (bfloat16 for FP8 inputs),
            contiguous.
        lse (only with return_attn_probs): float32 ``(batch, heads, seqlen_q)``, the
        natural-log log-sum-exp of the logits of each query row (with the sink if given).

    Layouts and copies: the kernels read q, k, v through TMA, which needs the last dim
    contiguous (stride 1), every other stride a multiple of 16 bytes, and a 16-byte
    aligned base address. Inputs that meet this are used in place with their own strides,
    with no copy: e.g. ``qkv[:, :, 0]`` slices of a packed ``(batch, seqlen, 3, heads,
    head_dim)`` tensor, KV-cache prefixes ``k_cache[:, :seqlen_k]``, BHSD tensors
    transposed to BSHD. Any other layout is copied to a contiguous tensor first (like
    FA3, which calls ``.contiguous()`` when the last dim is not contiguous), at the cost
    of one extra read and write of that input (a strided learnable_sink is copied too).
    Empty problems (batch, seqlen_q or seqlen_k of 0) launch nothing: out is empty, or
    zeros when seqlen_k is 0, with lse -inf (lse = sink[h] with a learnable_sink).
    The backward reads q, k, v and the gradient of out by the same rule (a broadcast
    gradient such as that of ``out.sum()`` is copied) and returns contiguous gradients
    (through autograd's views for sliced inputs); empty problems give zero gradients
    (dq when seqlen_k is 0, dk and dv when seqlen_q is 0) without a launch.

    torch.compile(fullgraph=True) traces forward and backward (ops ``torch.ops.flashgen.fwd``
    and ``torch.ops.flashgen.bwd``, the sink gradient as torch ops); both run on the current
    stream with no host synchronisation, so CUDA graphs capture them.

    Raises:
        TypeError: q, k or v not a torch.Tensor; num_splits not an int; dtype not float16/bfloat16/float8_e4m3fn;
            dtypes of q, k, v differ; softmax_scale or softcap not a real number; window_size
            not a tuple/list or an entry not an int or None; learnable_sink or a descale not a
            torch.Tensor or not float32; attention_chunk not an int.
        ValueError: not CUDA tensors or not on one device; not 4-D; batch, seqlen or
            heads mismatched between q, k, v; head_dim of k differs from q's; heads not a
            multiple of heads_k; head_dim / head_dim_v not a multiple of 8 in 8..256 (head_dim_v:
            8..512 for 16-bit inputs);
            softmax_scale NaN or infinite; softcap NaN, infinite or negative; window_size
            not of 2 entries or an entry < -1; learnable_sink not of shape (heads,) or not
            on q's device; attention_chunk < 0.
        RuntimeError: the GPU is not compute capability 9.x (Hopper).
        NotImplementedError: qv (an FA3 feature not built yet), float8_e5m2 or an fnuz
            fp8 format (only OCP float8_e4m3fn is read), FP8 with head_dim_v != head_dim or
            inputs that require grad, block FP8 descales with an attention_chunk whose
            boundaries cut their 64-row blocks.
        ValueError (descales): a descale of the wrong shape or device, or given with 16-bit inputs.
        flashgen.InputError: problems of several of the kinds above at once (it is both a
            ValueError and a TypeError). Every problem found is listed in the one error,
            one line each, not only the first (learnable_sink's shape, dtype and device are
            checked once q, k, v are valid).
        flashgen.core.MissingVariantError: no built variant serves (dtype, head_dim,
            head_dim_v, mask, softcap); the message names the ``flashgen add-variant``
            command. In backward: no bwd variant serves (dtype, max(head_dim, head_dim_v),
            mask, softcap).
    """
    if (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and learnable_sink is None
            and v.shape[-1:] <= _ONE_CALL_HEAD_DIM_V  # (torch.Size: a tuple; () for a 0-d v, checked later)
            and (q_descale is None or type(q_descale) is _Tensor) and (k_descale is None or type(k_descale) is _Tensor)
            and (v_descale is None or type(v_descale) is _Tensor) and qv is None
            and attention_chunk in (0, None) and type(softcap) is float and 0.0 <= softcap < math.inf
            and (softmax_scale is None or type(softmax_scale) is float and -math.inf < softmax_scale < math.inf)
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and window_size[0] >= -1 and window_size[1] >= -1
            and (pack_gqa is None or type(pack_gqa) is bool) and type(num_splits) is int
            and not ((q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())
            and not torch.compiler.is_compiling()):
        # The common call, eager, checked inline: plain tensors, no sink, qv or attention_chunk,
        # descales None or plain tensors (FP8 calls), a float softcap >= 0, softmax_scale None or a
        # finite float, window_size a tuple of two ints >= -1, nothing requiring grad. For these the
        # checks below (softmax_scale_problems, feature_problems, check_softmax_scale, window_pair,
        # the grad check) find no problem and change no value, so this branch is the eager branch
        # below minus their function calls (about 1 us of host time per call; an FP8 call with
        # descales about 14 us less on the CPU stub), with the same cache key and the same checks of
        # q, k, v, the descales and FP8's on a miss (_new_fwd_call). The key is _fwd_call_key's, inline.
        causal = bool(causal)
        window_left, window_right = window_size
        descales = (q_descale, k_descale, v_descale)
        extras = None if _no_descales(descales) else _extras_key(None, descales)
        key = (q.shape, q.stride(), q.dtype, _device_of(q), k.shape, k.stride(), k.dtype, _device_of(k),
               v.shape, v.stride(), v.dtype, _device_of(v), causal, window_left, window_right, softcap != 0.0, extras,
               pack_gqa, num_splits)
        call = _fwd_calls.get(key) or _new_fwd_call(key, q, k, v, causal, window_left, window_right, softcap, None,
                                                    descales, pack_gqa, num_splits)
        out, lse = _fwd_run(call, q, k, v, call.problem.head_dim ** -0.5 if softmax_scale is None else softmax_scale,
                            causal, window_left, window_right, softcap, None, descales, return_attn_probs)
        return (out, lse) if return_attn_probs else out
    plain = type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor  # (the common case, checked fast)
    not_tensors = [] if plain else [(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
                                    for name, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor)]
    if learnable_sink is not None and not isinstance(learnable_sink, torch.Tensor):
        not_tensors.append((TypeError, "learnable_sink must be None or a float32 (heads,) torch.Tensor, got "
                                       f"{type(learnable_sink).__name__}"))
    if pack_gqa is not None and type(pack_gqa) is not bool:
        not_tensors.append((TypeError, f"pack_gqa must be None, True or False, got {type(pack_gqa).__name__}"))
    not_tensors += _v.num_splits_problems(num_splits)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None and not isinstance(t, torch.Tensor):
                not_tensors.append((TypeError, f"{name} must be None or a float32 torch.Tensor, got {type(t).__name__}"))
    other = _v.softmax_scale_problems(softmax_scale) + _v.feature_problems(
        window_size=window_size,
        softcap=softcap,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        qv=qv,
        attention_chunk=attention_chunk,
    )
    if not_tensors or other:  # one error naming q, k and v's problems too (else the op checks them)
        infos = [_array_info(t) if isinstance(t, torch.Tensor) else None for t in (q, k, v)]
        wide = MAX_SPLIT_HEAD_DIM_V if isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16) \
            else _v.MAX_HEAD_DIM  # (head_dim_v over 256 runs as two calls: _split_head_dim_v)
        _v.raise_problems(not_tensors + _v.input_problems(*infos, max_head_dim_v=wide) + other)
    head_dim = q.shape[-1] if q.dim() > 0 else 1
    scale = _v.check_softmax_scale(softmax_scale, head_dim)
    window_left, window_right = _v.window_pair(window_size)
    softcap = float(softcap)
    sink = learnable_sink
    descales = (q_descale, k_descale, v_descale)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sink is not None and sink.requires_grad))
    if grad and q.dtype in _FP8_TORCH_DTYPES:
        raise NotImplementedError("flashgen: the FP8 (float8_e4m3fn) forward has no backward (FA3 has none either); "
                                  "call it under torch.no_grad() or with inputs that do not require grad")
    causal = bool(causal)
    splits = int(num_splits)
    if isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[3] > _v.MAX_HEAD_DIM:
        # FA3's head_dim_v up to 512 (16-bit): two calls, each on half of v's columns
        return _split_head_dim_v(q, k, v, scale, causal, window_size, attention_chunk, softcap, sink, descales,
                                 pack_gqa, deterministic, return_attn_probs)
    if attention_chunk:  # FA3's chunked attention: the call's independent pieces (None / 0: off)
        chunked = _attention_chunks(q, k, v, int(attention_chunk), scale, causal, (window_left, window_right), softcap,
                                    sink, descales, pack_gqa, deterministic, return_attn_probs)
        if chunked is not None:
            return chunked if return_attn_probs else chunked[0]
    if (plain and (sink is None or type(sink) is _Tensor) and (q_descale is None or type(q_descale) is _Tensor)
            and (k_descale is None or type(k_descale) is _Tensor) and (v_descale is None or type(v_descale) is _Tensor)
            and not grad and not torch.compiler.is_compiling()):
        # Eager fast path: the op's own implementation without the custom-op dispatcher, which
        # costs more host time per call than the whole launch (measured on H200). Tracing,
        # torch.compile, tensor subclasses and autograd go through torch.ops.flashgen.fwd.
        # window_size and softcap were validated above; q, k, v, the sink and the descales are
        # validated once per key: everything the checks and the _FwdCall depend on.
        key = _fwd_call_key(q, k, v, causal, window_left, window_right, softcap, sink, descales, pack_gqa, splits)
        call = _fwd_calls.get(key) or _new_fwd_call(key, q, k, v, causal, window_left, window_right, softcap, sink,
                                                    descales, pack_gqa, splits)
        out, lse = _fwd_run(call, q, k, v, scale, causal, window_left, window_right, softcap, sink, descales,
                            return_attn_probs)
    elif (grad and plain and (sink is None or type(sink) is _Tensor) and all(
            d is None or type(d) is _Tensor for d in descales) and not torch.compiler.is_compiling()):
        # eager, gradients wanted, plain tensors: the op's code without the dispatcher (_FwdFn)
        out, lse = _FwdFn.apply(q, k, v, scale, causal, bool(deterministic), window_left, window_right, softcap, sink,
                                *descales, pack_gqa, splits)
    else:
        out, lse = torch.ops.flashgen.fwd(q, k, v, scale, causal, bool(deterministic), window_left,
                                          window_right, softcap, sink, *descales, pack_gqa, splits)
    if return_attn_probs:
        return out, lse
    return out


def _attend(q, k, v, scale, causal: bool, window_size, softcap, sink, descales: tuple, pack_gqa, deterministic,
            want_lse: bool, attention_chunk=0) -> tuple:
    """One :func:`flash_attn_func` call of an entry composed of several (attention_chunk's pieces,
    head_dim_v's halves, varlen's runs, kvcache's entries), with the caller's arguments;
    ``(out, lse)``, lse None unless ``want_lse``."""
    res = flash_attn_func(q, k, v, scale, causal, q_descale=descales[0], k_descale=descales[1],
                          v_descale=descales[2], window_size=window_size, attention_chunk=attention_chunk,
                          softcap=softcap, pack_gqa=pack_gqa, deterministic=deterministic,
                          return_attn_probs=want_lse, learnable_sink=sink)
    return res if want_lse else (res, None)


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    """out's dtype for inputs of q's dtype: q's, bfloat16 for FP8 (FA3's)."""
    return torch.bfloat16 if q.dtype in _FP8_TORCH_DTYPES else q.dtype


def _host_ints(name: str, t, device: int) -> list:
    """A varlen index tensor (cu_seqlens_* / seqused_*) as a host list of ints: a 1-D int32 torch
    tensor on q's GPU (read with one synchronisation) or on the CPU (no synchronisation).
    TypeError / ValueError naming it (:func:`_check_index_tensor`); NotImplementedError for a GPU tensor under
    CUDA-graph capture (the callers read on the host only what their on-device paths do not serve)."""
    _check_index_tensor(name, t, device)
    if t.device.type != "cpu" and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(f"flashgen: this call reads {name} on the host, which a CUDA graph capture forbids "
                                  "for a GPU tensor (on the GPU alone run fp16 / bf16 calls that the varlen kernels "
                                  "serve, with a varlen variant built); pass it as a CPU tensor to capture the call")
    return t.tolist()


def _varlen_kernel_serves(q, k, v, sink, descales: tuple, attention_chunk: int, max_seqlen_q: int,
                          max_seqlen_k: int, on_device: bool = False, gradients: bool = False,
                          softcap: float = 0.0) -> bool:
    """Whether a varlen or kvcache call may run on the varlen kernel (core.Varlen) instead of one
    flash_attn_func call per run of equal lengths: the kernel is switched on (core.VARLEN_KERNEL), no
    gradient is wanted unless ``gradients`` (the caller, :func:`_varlen_bwd_serves`, runs the varlen backward
    too), fp16 / bf16 without descales, no attention_chunk, no softcap unless core.VARLEN_SOFTCAP, head dims within
    one call's, something to compute, and no CUDA-graph capture (the host lists of lengths would be copied to the
    GPU) unless ``on_device`` (every length array is already a GPU tensor). Whether a variant is built is the
    core's to say (MissingVariantError, :func:`_varlen_kernel`)."""
    return (_core.VARLEN_KERNEL and not attention_chunk and q.dtype in (torch.float16, torch.bfloat16)
            and (not softcap or _core.VARLEN_SOFTCAP)
            and _no_descales(descales) and max_seqlen_q > 0 and max_seqlen_k > 0
            and q.shape[-1] <= _v.MAX_HEAD_DIM and v.shape[-1] <= _v.MAX_HEAD_DIM
            and (gradients or not (torch.is_grad_enabled()
                                   and any(t is not None and t.requires_grad for t in (q, k, v, sink))))
            and (on_device or not _capturing(q)))


def _splits_arg(num_splits) -> int:
    """FA3's ``num_splits`` as the varlen kernel's: an int, <= 0 chosen (the heuristic's while core.SPLIT_KV_AUTO, the
    default; else unsplit), else that many (capped by :func:`_varlen_kernel`). TypeError for a non-int."""
    _v.raise_problems(_v.num_splits_problems(num_splits))
    return max(int(num_splits), 0)


def _int32_like(t, like: torch.Tensor) -> torch.Tensor:
    """Lengths or offsets (a host list, or an int32 tensor on ``like``'s device or the CPU) as a
    contiguous int32 tensor on ``like``'s device (a tensor already there as it is, when contiguous)."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.int32 and t.device == like.device and t.is_contiguous():
            return t  # (as .to and .contiguous would return it, without their dispatch: a decode step's seqused_k)
        return t.to(device=like.device, dtype=torch.int32).contiguous()
    return torch.tensor(t, dtype=torch.int32, device=like.device)


def _key_bound(max_seqlen_k: int, lengths_read: bool, rows: int | None) -> int:
    """The varlen kernel's max_seqlen_k for a call whose longest sequence has ``max_seqlen_k`` keys. Where the kernel
    reads each sequence's key count (``lengths_read``: cu_seqlens_k or seqused_k given) it is only a bound (the mask's
    unbounded window sides, the tile order's L2 sections), so it is rounded up to a power of two, at most ``rows``
    (a padded k's rows or a paged cache's positions; None for a packed k): a decode whose caches grow by a token a
    step then reuses its prepared launch (core.prepare_forward's key holds max_seqlen_k) instead of preparing one
    per step (CPU-stub host time per step, 64 caches: 168 -> 111 us). The tuning bucket ((n - 1).bit_length()) is
    the same either way; the caller keeps the mask its own lengths give (a window's left side reaching every key is
    passed as unbounded). Otherwise (a padded k without seqused_k) it is the sequences' length itself: returned as
    it is."""
    if not lengths_read or max_seqlen_k <= 1:
        return int(max_seqlen_k)
    bound = 1 << (int(max_seqlen_k) - 1).bit_length()
    return bound if rows is None else max(int(max_seqlen_k), min(bound, rows))


_varlen_problems: dict = {}  # _varlen_checked's key -> _v.Problem; immutable values


def _varlen_checked(q, k, v, packed_q: bool, packed_k: bool, window_size, softcap, sink) -> _v.Problem:
    """:func:`_check_fwd` of a varlen kernel call's q, k, v, window, softcap and sink (a packed side as a batch of one,
    then a padded side's first entry, so that the batches agree), kept per metadata key as flash_attn_func keeps its
    checked calls (``_fwd_calls``: the checks read shapes, strides, dtypes and devices, never the data), so a
    repeated call skips them (about a quarter of the varlen forward's host work on the CPU stub). Raises what
    :func:`_check_fwd` raises, every call (a failure is not kept)."""
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    key = (q.shape, q.stride(), q.dtype, _device_of(q), k.shape, k.stride(), k.dtype, _device_of(k), v.shape,
           v.stride(), v.dtype, _device_of(v), packed_q, packed_k, window, float(softcap),
           _extras_key(sink, (None, None, None)))
    p = _varlen_problems.get(key)
    if p is None:
        views = [t[None] if packed else t[:1] if packed_q or packed_k else t
                 for t, packed in ((q, packed_q), (k, packed_k), (v, packed_k))]
        _v.raise_problems(_v.window_size_problems(window_size))
        p = _check_fwd(*views, *_v.window_pair(window_size), float(softcap), sink)
        _launch.cache_put(_varlen_problems, key, p, _FWD_CALL_CACHE_MAX)
    return p


class _VarlenCall(NamedTuple):
    """What a varlen-kernel call's metadata decides (:func:`_varlen_call`), kept per metadata key. Immutable."""

    layouts: tuple  # q, k, v's _input_layout (None: copied for TMA)
    out_shape: tuple
    lse_shape: tuple
    splits: int  # split-KV shares (1: unsplit)
    prep: bool  # the varlen_prep kernel checks the offsets (and fills out / lse)
    fill: bool  # torch ops fill out / lse (rows of no sequence)
    key_bound: int  # the kernel's max_seqlen_k (_key_bound)
    window: tuple  # the kernel's (left, right)
    paging: tuple  # (page_table_stride, page_size), (0, 0) unpaged
    scale: float  # softmax_scale


_varlen_calls: dict = {}  # _varlen_call's key -> _VarlenCall; immutable values


def _varlen_call(p: _v.Problem, q, k, v, seqlens: tuple, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                 softmax_scale, causal: bool, window_size, softcap: float, fill: bool, cache: tuple, num_splits: int,
                 check_offsets: bool) -> _VarlenCall:
    """The metadata part of a :func:`_varlen_kernel` call (its arguments, ``p`` its checked Problem): the layouts,
    shapes, split count, which kernels check and fill, the kernel's key bound, window, paging and scale, kept per
    metadata key (the shapes and strides, which length arrays are given, the page table's width, the lengths'
    bounds, the scalars, and the switches and split settings read: core.SPLIT_KV_AUTO, SPLIT_MODEL,
    DECODE_SPLIT_BLOCKS, MAX_SPLITS, VARLEN_PREP_KERNEL), so a repeated call skips the work (about a third of a
    kvcache step's host time on the CPU stub). Raises TypeError / ValueError naming softmax_scale
    (:func:`flashgen._validate.check_softmax_scale`), every call, where it is not a finite real number or None."""
    scale = _v.check_softmax_scale(softmax_scale, p.head_dim)  # (TypeError / ValueError naming it, before the key)
    table = cache[2]
    pages = None if table is None else (table.shape[1] if isinstance(table, torch.Tensor) else len(table[0]))
    window = _v.window_pair(window_size)
    key = (p, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), tuple(t is None for t in seqlens),
           tuple(t is None for t in cache), pages, int(batch), int(max_seqlen_q), int(max_seqlen_k), scale,
           bool(causal), tuple(window), float(softcap), bool(fill), int(num_splits), bool(check_offsets),
           _core.SPLIT_KV_AUTO, _core.SPLIT_MODEL, _core.DECODE_SPLIT_BLOCKS, _core.MAX_SPLITS, _core.VARLEN_PREP_KERNEL)
    c = _varlen_calls.get(key)
    if c is not None:
        return c
    packed_q, packed_k = seqlens[0] is not None, seqlens[1] is not None
    es = _v.ELEMENT_SIZE[p.dtype]
    equal = all(t is None for t in (*seqlens, cache[1], cache[2]))  # every sequence max_seqlen_k keys, unpaged
    splits = _split_kv.split_count(num_splits, batch, p.heads, p.heads_k, max_seqlen_q, max_seqlen_k, p.device, causal,
                                   window, (p.head_dim + p.head_dim_v) * es if equal else 0)
    if splits > 1 and not _core.variant_built("combine", {"dtype": p.out_dtype}):
        splits = 1  # the merge needs a combine variant for out's dtype: without one, no split
    prep = (fill or check_offsets) and packed_q and packed_k and _varlen_prep_on()
    key_bound = _key_bound(max_seqlen_k, packed_k or seqlens[3] is not None,
                           None if packed_k else k.shape[1] if table is None else pages * k.shape[1])
    if key_bound != max_seqlen_k and 0 <= window[0] and window[0] >= max_seqlen_k - 1:
        # a left side that reaches every key of the longest sequence is unbounded (core.mask_spec, which sees only
        # the bound): the call keeps the mask, and so the variant, that its own lengths give
        window = (-1, window[1])
    c = _VarlenCall((_input_layout(q, es), _input_layout(k, es), _input_layout(v, es)),
                    tuple(q.shape[:-1]) + (v.shape[-1],),
                    (p.heads, q.shape[0]) if packed_q else (q.shape[0], p.heads, q.shape[1]), splits, prep,
                    fill and not prep,  # (the prep kernel fills out / lse itself)
                    key_bound, tuple(window), (0, 0) if table is None else (pages, k.shape[1]), scale)
    return _launch.cache_put(_varlen_calls, key, c, _FWD_CALL_CACHE_MAX)


def _varlen_kernel(q, k, v, seqlens: tuple, batch: int, max_seqlen_q: int, max_seqlen_k: int, softmax_scale,
                   causal: bool, window_size, softcap: float, sink, fill: bool, problem: _v.Problem | None = None,
                   cache: tuple = (None, None, None), num_splits: int = 1, check_offsets: bool = False):
    """One launch of the varlen kernel (``core.attention_forward(varlen=...)``, FA3's varlen) for the
    arguments of :func:`flash_attn_varlen_func` or :func:`flash_attn_with_kvcache`, already checked
    against each other; ``(out, lse)``, or None where no varlen variant is built for the call's key
    (the caller then composes it of flash_attn_func calls).

    ``seqlens``: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), each None or int32 (a tensor on q's
    device or the CPU, or a host list). With cu_seqlens_q q is ``(total_q, heads, head_dim)``, out
    ``(total_q, heads, head_dim_v)`` and lse ``(heads, total_q)``; without, q is ``(batch, seqlen_q, heads,
    head_dim)``, out alike and lse ``(batch, heads, seqlen_q)``; k and v the same with cu_seqlens_k.
    ``fill``: some out / lse rows belong to no sequence (or are past a seqused): they are set to 0 / -inf
    first, as the kernel writes only the sequences' rows. ``check_offsets``: the offsets' values have not been
    checked (no host read: :func:`_varlen_on_device`): they are checked on the GPU first, a device-side assert
    naming the argument where FA3's contract is broken. Both (with packed q and k) by one launch of the
    varlen_prep kernel where :func:`_varlen_prep_on` (runtime/varlen_prep.py: it writes only the rows of no
    sequence), else by torch ops (:func:`_check_offsets_on_device`, memsets of out and lse). ``problem``: what
    :func:`_check_fwd` returned for these q, k, v, window and softcap where the caller has run it (kvcache), else
    they are checked here.
    ``cache``: a padded k / v as a KV cache (kvcache's checked arguments, each None or int32 as ``seqlens``):
    (cache_batch_idx (batch,), cache_leftpad (batch,), page_table (batch, pages)); with a page table k / v
    are ``(num_pages, page_size, heads_k, dim)`` (core.Varlen: page_size a multiple of 8, no batch_idx or
    leftpad with it).
    ``num_splits`` (FA3's): 1 none, 0 chosen (:func:`flashgen.core.varlen_num_splits` decides
    while core.SPLIT_KV_AUTO, the default; else none), n > 1 that many (at most
    core.MAX_SPLITS and one per 64 keys): split-KV (flash-decoding), each split's fp32 partial O and LSE from the
    kernel, merged by :func:`flash_attn_combine` into out / lse (every row: those of no sequence get 0 / -inf).
    Raises what :func:`_check_fwd` raises."""
    packed_q, packed_k = seqlens[0] is not None, seqlens[1] is not None
    p = problem if problem is not None else _varlen_checked(q, k, v, packed_q, packed_k, window_size, softcap, sink)
    dev = p.device
    _check_device_capability(dev)
    c = _varlen_call(p, q, k, v, seqlens, batch, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                     softcap, fill, cache, num_splits, check_offsets)
    qc, qa = _input_arg(q, c.layouts[0], p.dtype, dev)
    kc, ka = _input_arg(k, c.layouts[1], p.dtype, dev)
    vc, va = _input_arg(v, c.layouts[2], p.dtype, dev)
    out_shape, lse_shape, splits, prep, fill = c.out_shape, c.lse_shape, c.splits, c.prep, c.fill
    arrays = [None if t is None else _int32_like(t, q) for t in (*seqlens, *cache)]  # referenced until enqueued
    if check_offsets and not prep:
        _check_offsets_on_device(*arrays[:4], q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if splits > 1:  # split 0's partial buffers (every split's at its stride); lse -inf where no split writes
        out = torch.empty((splits,) + out_shape, dtype=torch.float32, device=q.device)
        lse = torch.full((splits,) + lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    else:
        out = q.new_zeros(out_shape) if fill else q.new_empty(out_shape)
        lse = (q.new_full(lse_shape, -math.inf, dtype=torch.float32) if fill
               else q.new_empty(lse_shape, dtype=torch.float32))
    if prep:  # (split-KV: check only, as flash_attn_combine writes every row)
        _varlen_prep_launch(arrays[:4], batch, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                            (out, lse) if splits == 1 else None, dev)
    first = (lambda t: t[0]) if splits > 1 else (lambda t: t)  # noqa: E731
    sink_t = None if sink is None else sink.contiguous()
    try:
        _core.attention_forward(
            qa, ka, va, _core.TensorArg(out.data_ptr(), out_shape, tuple(first(out).stride()),
                                        "fp32" if splits > 1 else p.dtype, dev),
            _core.TensorArg(lse.data_ptr(), lse_shape, tuple(first(lse).stride()), "fp32", dev), c.scale,
            bool(causal), _current_stream(dev), window_size=c.window, softcap=float(softcap),
            sink=0 if sink_t is None else sink_t.data_ptr(),
            varlen=_core.Varlen(*(0 if a is None else a.data_ptr() for a in arrays[:4]), batch, int(max_seqlen_q),
                                c.key_bound, *(0 if a is None else a.data_ptr() for a in arrays[4:]),
                                *c.paging, splits, out.stride(0) if splits > 1 else 0,
                                lse.stride(0) if splits > 1 else 0))
    except _core.MissingVariantError:
        return None
    del qc, kc, vc, arrays, sink_t  # released only after the launch is enqueued (stream-ordered)
    if splits == 1:
        return out, lse
    # the merge (flash_attn_combine's kernel, prepared per metadata: combine.prepare_combine): the partials as its
    # (splits, batch, seqlen, heads, ...) and out / lse as its (batch, seqlen, heads, ...) views (a packed q: batch 1)
    merged = q.new_empty(out_shape, dtype=_out_dtype(q))
    merged_lse = q.new_empty(lse_shape, dtype=torch.float32)
    views = ((out[:, None], lse.transpose(1, 2)[:, None], merged[None], merged_lse.t()[None]) if packed_q
             else (out, lse.transpose(2, 3), merged, merged_lse.transpose(1, 2)))
    out_dtype = _DTYPE_NAMES[merged.dtype]
    merge = _combine.prepare_combine(*(_core.TensorArg(0, tuple(t.shape), tuple(t.stride()), dt, dev) for t, dt in
                                       zip(views, ("fp32", "fp32", out_dtype, "fp32"))), out_dtype)
    _combine.launch_combine(merge, out.data_ptr(), lse.data_ptr(), merged.data_ptr(), merged_lse.data_ptr(),
                            _current_stream(dev))
    del out, lse  # the partials: released after the merge is enqueued (stream-ordered)
    return merged, merged_lse


def _varlen_bwd_serves(q, k, v, batch: int, seqused: tuple, sink, descales: tuple, attention_chunk: int,
                       softcap, causal: bool, window_size, max_seqlen_q: int, max_seqlen_k: int,
                       on_device: bool = False) -> bool:
    """Whether a flash_attn_varlen_func call of ``batch`` sequences that wants gradients runs on the varlen kernels
    both ways (``torch.ops.flashgen.varlen_fwd`` and its autograd formula, ``varlen_bwd``): the varlen forward serves
    it (:func:`_varlen_kernel_serves`), the backward is switched on (core.VARLEN_BWD_KERNEL), no softcap (configs/bwd.yaml
    builds no varlen softcap backward), at most core.MAX_VARLEN_BWD_SEQUENCES sequences, both varlen variants built, and no
    seqused. A learnable_sink is served: the forward's lse includes it, so the backward kernels need nothing more,
    and its gradient is torch ops (:func:`_sink_grad`). (The backward kernels take each sequence's length from the
    offsets and read no seqused, so calls with seqused stay composed, which is exact. Their tiles zero the rows they
    read past a sequence's end (bwd.cu.j2 zero_past), so rows past the last offsets may hold anything; where the
    offsets are read on the host they are cut off before the kernels all the same: flash_attn_varlen_func.)
    ``on_device``: the offsets are GPU tensors read by no one on the host
    (:func:`_varlen_on_device`), so a CUDA-graph capture may take the call (:func:`_varlen_kernel_serves`)."""
    if not _core.VARLEN_BWD_KERNEL or any(t is not None for t in seqused) or softcap:
        return False
    if batch > _core.MAX_VARLEN_BWD_SEQUENCES or not _varlen_kernel_serves(
            q, k, v, None, descales, attention_chunk, max_seqlen_q, max_seqlen_k, on_device=on_device,
            gradients=True):
        return False
    return _varlen_built(q, v, causal, window_size, 0.0, True, max_seqlen_q, max_seqlen_k)


def _varlen_built(q, v, causal: bool, window_size, softcap, backward: bool, max_seqlen_q, max_seqlen_k) -> bool:
    """:func:`_varlen_variants_built` for a call's q, v, mask arguments and lengths: the head dims as constants
    (:func:`_constant`), the lengths as ints eagerly and None under torch.compile (:func:`_lengths`)."""
    return _varlen_variants_built(_DTYPE_NAMES[q.dtype], _constant(q.shape[-1]), _constant(v.shape[-1]), bool(causal),
                                  tuple(_v.window_pair(window_size)), bool(softcap), backward,
                                  _lengths(max_seqlen_q, max_seqlen_k))


def _lengths(max_seqlen_q, max_seqlen_k) -> tuple | None:
    """``(max_seqlen_q, max_seqlen_k)`` as ints for :func:`_varlen_variants_built`'s mask check, or None under
    torch.compile (they may be symbolic there: the check then covers every mask the call could select)."""
    return None if torch.compiler.is_compiling() else (int(max_seqlen_q), int(max_seqlen_k))


def _constant(n) -> int:
    """``n`` as a Python int: itself, or, for a SymInt (a head dim under torch.compile with dynamic shapes), the value
    found by comparisons, each a guard, so that the graph specialises on it (a head dim selects the variant) and a
    :func:`_varlen_variants_built` call, which needs constants, can be traced."""
    if not torch.compiler.is_compiling():  # (eager: an int; under dynamo isinstance(n, int) is True for a SymInt)
        return int(n)
    lo, hi = 0, 1 << 20
    while lo < hi:
        mid = (lo + hi) // 2
        if n <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


@torch.compiler.assume_constant_result
def _varlen_variants_built(dtype: str, head_dim: int, head_dim_v: int, causal: bool, window: tuple, softcap: bool,
                           backward: bool, lengths: tuple | None = None) -> bool:
    """Whether the varlen forward variant (and with ``backward`` the varlen bwd variant) is built for the mask of a
    call with ``lengths`` = (max_seqlen_q, max_seqlen_k) (core.varlen_variant_built, core.varlen_bwd_variant_built),
    or, with ``lengths`` None, for every mask a call of this metadata can select, whatever its lengths
    (core.mask_spec: a window side that reaches every key or row is unbounded, so a band may run as causal or
    unmasked). Under torch.compile the lengths may be symbolic, so callers pass None there; the result is a
    constant (the manifest is read when the graph is traced, not traced itself), so choosing the varlen ops is no
    graph break. The ops select the variant of the call's lengths when they run."""
    big = 1 << 30
    for seqlen_q, seqlen_k in ((lengths,) if lengths is not None  # each side unbounded or not
                               else ((1, 1), (1, big), (big, 1), (big, big))):
        if not _core.varlen_variant_built(dtype, head_dim, head_dim_v, causal, window, seqlen_q, seqlen_k,
                                          1.0 if softcap else 0.0):
            return False
        if backward and not _core.varlen_bwd_variant_built(dtype, head_dim, head_dim_v, causal, window, seqlen_q,
                                                           seqlen_k):
            return False
    return True


def _varlen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                     window_right: int, softcap: float, learnable_sink: Optional[torch.Tensor], num_splits: int,
                     deterministic: bool, fill: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, learnable_sink, num_splits,
    deterministic, fill) -> (out, lse)``: one launch of the varlen kernel (:func:`_varlen_kernel`, FA3's varlen
    forward) over packed q ``(total_q, heads, head_dim)``, k ``(total_k, heads_k, head_dim)``, v ``(total_k,
    heads_k, head_dim_v)`` (fp16 / bf16) with int32 offsets ``(batch + 1,)`` and seqused ``(batch,)`` or None on
    q's device, checked by the caller (flash_attn_varlen_func: on the host, or on the GPU by
    ``fill`` below). max_seqlen_q / max_seqlen_k: at least every sequence's (FA3's grid sizes).
    ``fill``: the offsets were not read on the host (:func:`_varlen_on_device` passes True): their values are
    checked on the GPU and out / lse hold 0 / -inf in the rows of no sequence (``_varlen_kernel``'s check_offsets and
    fill). ``deterministic``: kept for the backward (:func:`_varlen_backward`). Returns contiguous out
    ``(total_q, heads, head_dim_v)`` of q's dtype and float32 lse ``(heads, total_q)``. MissingVariantError where no
    varlen variant serves the call."""
    res = _varlen_kernel(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), cu_seqlens_q.shape[0] - 1,
                         int(max_seqlen_q), int(max_seqlen_k), float(softmax_scale), bool(causal),
                         (int(window_left), int(window_right)), float(softcap), learnable_sink, bool(fill),
                         num_splits=int(num_splits), check_offsets=bool(fill))
    if res is None:
        raise _core.MissingVariantError("flashgen: no varlen forward variant serves this call (flashgen add-variant "
                                        "fwd --set varlen=true ...)")
    return res  # (out and lse contiguous, split or not)


_varlen_fwd = torch.library.custom_op("flashgen::varlen_fwd", _varlen_fwd_impl, mutates_args=())


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_left, window_right, softcap, learnable_sink, num_splits,
                     deterministic, fill):
    # the real op's checks of q, k, v (dtypes, heads, head dims, devices), the window, softcap and the sink, on the
    # packed tensors as a batch of one (as _varlen_kernel): under torch.compile they run when the graph is traced
    _check_fwd(q[None], k[None], v[None], window_left, window_right, softcap, learnable_sink)
    return (q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=_out_dtype(q)),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))  # contiguous, as the real op


def _varlen_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                     deterministic: bool, fill: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic, fill) -> (dq, dk, dv)``: the
    gradients of ``varlen_fwd``'s out (no seqused or softcap: :func:`_varlen_bwd_serves`) by the varlen
    backward (``core.attention_backward(varlen=...)``: preprocess, main, postprocess over every sequence at once;
    bwd.cu.j2 kVarlen), FA3's varlen backward (hopper/flash_bwd_launch_template.h). dout, out ``(total_q, heads,
    head_dim_v)``, lse float32 ``(heads, total_q)``, the rest as ``varlen_fwd``'s. The kernels write every row of a
    sequence; ``fill``: the preprocess zeroes the rows past the last offsets too (core.BwdVarlen.zero_tail: no
    memset of the whole gradients; a caller that cut those rows off passes False). A learnable_sink needs nothing
    here (the forward's lse includes it; its gradient is :func:`_varlen_backward`'s). Returns contiguous dq, dk, dv
    of q's, k's, v's shapes and dtype."""
    dev = _device_of(q)[1]
    dtype = _DTYPE_NAMES[q.dtype]
    batch = cu_seqlens_q.shape[0] - 1
    window = (int(window_left), int(window_right))
    nbytes = _core.backward_workspace_bytes(
        batch, int(max_seqlen_q), q.shape[1], k.shape[1], q.shape[2], dtype, bool(causal), dev,
        seqlen_k=int(max_seqlen_k), window_size=window, softcap=0.0, head_dim_v=v.shape[2], varlen_total_q=q.shape[0])
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    lse = lse.contiguous()
    _launch_backward((dout.to(q.dtype), q, k, v, out),
                     _core.TensorArg(lse.data_ptr(), tuple(lse.shape), tuple(lse.stride()), "fp32", dev), grads,
                     dtype, dev, nbytes, softmax_scale, causal, deterministic, window, 0.0,
                     _core.BwdVarlen(cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), batch, int(max_seqlen_q),
                                     int(max_seqlen_k), bool(fill)))
    return grads


_varlen_bwd = torch.library.custom_op("flashgen::varlen_bwd", _varlen_bwd_impl, mutates_args=())


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, deterministic, fill):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _varlen_setup_context(ctx, inputs, output):
    """Saves what the varlen backward needs: q, k, v, out, lse, the offsets, the scalars and learnable_sink when
    given; notes what it does not take (seqused, softcap: :func:`_varlen_bwd_serves` keeps such calls off these ops
    when they want gradients)."""
    (q, k, v, cu_q, cu_k, seqused_q, seqused_k, max_q, max_k, scale, causal, window_left, window_right, softcap,
     sink, _splits, deterministic, fill) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # (FA3's: no gradient through lse)
    ctx.has_sink = sink is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, *((sink,) if ctx.has_sink else ()))
    ctx.args = (max_q, max_k, scale, causal, window_left, window_right, deterministic, fill)
    ctx.served = seqused_q is None and seqused_k is None and not softcap


def _varlen_backward(ctx, grad_out, grad_lse, bwd=None):
    """dq, dk, dv through ``torch.ops.flashgen.varlen_bwd`` (or ``bwd``, the same signature: :class:`_VarlenFn`
    calls the implementation itself), and learnable_sink's gradient (:func:`_sink_grad` over the packed rows as one
    batch of one: rows of no sequence have lse -inf and add nothing); grad_lse is ignored, as FA3 does."""
    if not ctx.served:
        raise NotImplementedError("flashgen: the varlen backward takes no seqused or softcap")
    q, k, v, out, lse, cu_q, cu_k, *sink = ctx.saved_tensors
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):  # (only the sink's gradient wanted: no backward kernels)
        dq, dk, dv = (bwd or torch.ops.flashgen.varlen_bwd)(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    d_sink = _sink_grad(grad_out[None], out[None], lse[None], sink[0]) if ctx.has_sink and ctx.needs_input_grad[14] \
        else None
    return (dq, dk, dv) + (None,) * 11 + (d_sink,) + (None,) * 3


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


#: ``torch.ops.flashgen.varlen_fwd`` with its autograd formula (:func:`_varlen_setup_context`, :func:`_varlen_backward`
#: with :func:`_varlen_bwd_impl`) for eager calls: CPU-stub training step 467 -> 276-285 us.
_VarlenFn = _eager_function("_VarlenFn", _varlen_fwd_impl, _varlen_setup_context, _varlen_backward,
                            _varlen_bwd_impl, "flashgen::varlen_fwd and its autograd formula without the dispatcher "
                            "(interface._eager_function).")


def _varlen_apply(*inputs) -> tuple:
    """``(out, lse)`` of ``varlen_fwd(*inputs)`` with its gradients: the custom op under torch.compile, else
    :class:`_VarlenFn` (the same code without the dispatcher's host time), or, where no input wants a gradient,
    the op's implementation itself (no autograd node: as flash_attn_func's eager fast path)."""
    if torch.compiler.is_compiling():
        return torch.ops.flashgen.varlen_fwd(*inputs)
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
        return _varlen_fwd_impl(*inputs)
    return _VarlenFn.apply(*inputs)


def _capturing(q: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on q's current stream (a seam: CPU tests set it)."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _on_q_device(q: torch.Tensor, tensors) -> bool:
    """Whether every tensor among ``tensors`` (None and ints allowed) is on q's device: the lengths a call would
    otherwise read on the host (a no-host-read path needs them there)."""
    return all(not isinstance(t, torch.Tensor) or t.device == q.device for t in tensors)


def _check_index_tensor(name: str, t, device, batch: int | None = None) -> None:
    """TypeError / ValueError naming ``name`` unless ``t`` is a 1-D int32 torch tensor (of ``batch`` entries when
    given) on q's GPU ``device`` or on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashgen: {name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"flashgen: {name} must be a 1-D int32 tensor, got {t.dim()}-D {t.dtype}")
    if t.device.type != "cpu" and _device_of(t) != (True, device):
        raise ValueError(f"flashgen: {name} must be on q's device (cuda:{device}) or on the CPU, got {t.device}")
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"flashgen: {name} must have {batch} entries, got {t.shape[0]}")


def _check_offsets_on_device(cu_q, cu_k, seqused_q, seqused_k, total_q: int, total_k: int, max_seqlen_q: int,
                             max_seqlen_k: int) -> None:
    """FA3's varlen contract (flashgen._validate.varlen_problems), checked on the GPU by torch ops
    (``torch._assert_async``) where the varlen_prep kernel does not run (:func:`_varlen_prep_on`): offsets from 0,
    non-decreasing, the last at most total_q / total_k; seqused between 0 and its sequence's rows; max_seqlen_q /
    max_seqlen_k at least every (used) sequence's length. A broken contract is an error of the stream (a device-side
    assert, which loses the CUDA context), not a read or write out of bounds; each message names the argument (not
    the values: under torch.compile they may be symbolic), the kernel's own (varlen_prep.contract_messages)."""
    messages = iter(_prep_family.contract_messages())
    for cu, used, total, longest in ((cu_q, seqused_q, total_q, max_seqlen_q), (cu_k, seqused_k, total_k, max_seqlen_k)):
        lens = cu[1:] - cu[:-1]
        torch._assert_async((cu[0] == 0) & (lens >= 0).all() & (cu[-1] <= total), next(messages))
        used_message = next(messages)
        if used is not None:
            torch._assert_async(((used >= 0) & (used <= lens)).all(), used_message)
            lens = used
        torch._assert_async((lens <= longest).all(), next(messages))


def _varlen_prep_on() -> bool:
    """Whether the varlen_prep kernel checks the offsets and fills out / lse before the varlen forward
    (core.VARLEN_PREP_KERNEL and its variant built). Asked inside the varlen op (never traced by torch.compile)."""
    return _core.VARLEN_PREP_KERNEL and _core.variant_built(_varlen_prep.FAMILY, {})


def _varlen_prep_launch(seqlens: tuple, batch: int, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int,
                        fill, device: int) -> None:
    """One launch of the varlen_prep kernel (:func:`flashgen.varlen_prep.varlen_prepare`) on the current stream:
    ``seqlens`` = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), int32 tensors on q's GPU (seqused None or
    a tensor) checked against FA3's contract; ``fill``: None, or the contiguous (out ``(total_q, heads,
    head_dim_v)``, lse ``(heads, total_q)``) whose rows of no sequence it sets to 0 / -inf."""
    out, lse = fill if fill is not None else (None, None)
    _varlen_prep.varlen_prepare(
        *(0 if t is None else t.data_ptr() for t in seqlens), batch, total_q, total_k, int(max_seqlen_q),
        int(max_seqlen_k), 0 if out is None or out.numel() == 0 else out.data_ptr(),
        0 if out is None else out.shape[1] * out.shape[2] * out.element_size(), 0 if lse is None else lse.data_ptr(),
        0 if out is None else out.shape[1], _current_stream(device), device)


def _varlen_on_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                      softmax_scale, causal, window_size, softcap, learnable_sink, descales: tuple,
                      attention_chunk, num_splits, deterministic):
    """:func:`flash_attn_varlen_func` without reading an offset or length on the host (under torch.compile, where
    the read would be a graph break, and under CUDA-graph capture, where it cannot happen): ``(out, lse)`` from the
    varlen ops (``torch.ops.flashgen.varlen_fwd``, with gradients ``varlen_bwd``), or None where they do not serve
    the call (the caller then reads the offsets: a graph break under torch.compile, NotImplementedError under
    capture). The offsets' shapes, dtypes and devices, the window, softcap and softmax_scale are checked here; q, k,
    v and the sink by the op (its fake implementation when torch.compile traces it); the offsets' values by the
    op, on the GPU (the varlen_prep kernel or :func:`_check_offsets_on_device`: :func:`_varlen_kernel`).
    max_seqlen_q / max_seqlen_k size the grids, as in FA3. As the offsets' end is not known on the host, out / lse
    get 0 / -inf in the rows of no sequence, and the backward's preprocess zeroes the gradients' rows past the last
    offsets.
    The backward's tiles read rows past a sequence's end (the next sequence's, or past the last offsets whatever is
    there) and zero them before any GEMM (bwd.cu.j2 zero_past), so those rows may hold anything, NaN included (FA3
    needs them finite)."""
    device = _device_of(q)[1]
    if q.dtype not in (torch.float16, torch.bfloat16) or not _v._is_int(max_seqlen_q) or not _v._is_int(max_seqlen_k):
        return None
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, device)
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, device, batch + 1)
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_index_tensor(name, t, device, batch)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    _v.raise_problems(_v.window_size_problems(window_size) + _v.softcap_problems(softcap))
    window = tuple(_v.window_pair(window_size))
    if batch < 1 or not (
            _varlen_bwd_serves(q, k, v, batch, (seqused_q, seqused_k), learnable_sink, descales, attention_chunk,
                               softcap, causal, window, max_seqlen_q, max_seqlen_k, on_device=True) if grad
            else _varlen_kernel_serves(q, k, v, learnable_sink, descales, attention_chunk, max_seqlen_q,
                                       max_seqlen_k, on_device=True, softcap=softcap)
            and _varlen_built(q, v, causal, window, softcap, False, max_seqlen_q, max_seqlen_k)):
        return None
    scale = _v.check_softmax_scale(softmax_scale, q.shape[-1])
    cu_q, cu_k = _int32_like(cu_seqlens_q, q), _int32_like(cu_seqlens_k, q)
    used = tuple(None if t is None else _int32_like(t, q) for t in (seqused_q, seqused_k))
    # (the offsets' values are checked by the op, on the GPU: _varlen_kernel's check_offsets; max_seqlen_q / _k
    # passed as they are: under torch.compile they may be symbolic)
    return _varlen_apply(q, k, v, cu_q, cu_k, *used, max_seqlen_q, max_seqlen_k, scale, bool(causal), *window,
                         float(softcap), learnable_sink, 1 if grad else _splits_arg(num_splits), bool(deterministic),
                         True)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    qv: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: tuple = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
):
    """FA3's ``flash_attn_varlen_func``: attention over a batch of sequences of different lengths
    packed along the first dim, with FA3's arguments and semantics; differentiable.

    Sequence b is q's rows ``[cu_seqlens_q[b], cu_seqlens_q[b] + seqlen_q_b)`` and k's / v's rows
    ``[cu_seqlens_k[b], cu_seqlens_k[b] + seqlen_k_b)``, where seqlen is the cu_seqlens difference or,
    when given, ``seqused_q[b]`` / ``seqused_k[b]`` (the rest of the sequence's rows are unused);
    each sequence is one attention with :func:`flash_attn_func`'s semantics (causal and window
    masks bottom-right aligned per sequence, attention_chunk, softcap, learnable_sink, GQA).

    How it runs: with every offset on q's GPU (eagerly while core.VARLEN_NO_HOST_READ is on, the default; under
    torch.compile; under CUDA-graph capture) nothing is read on the host where the varlen kernels serve the call,
    as in FA3 (:func:`_varlen_on_device`: ``torch.ops.flashgen.varlen_fwd``,
    and ``varlen_bwd`` for gradients; the offsets' values checked on the GPU, and the rows of no sequence filled, by
    one launch of the varlen_prep kernel (``FLASHGEN_VARLEN_PREP_KERNEL=0``: ``torch._assert_async`` ops and
    memsets); FA3's max_seqlen_q / max_seqlen_k as the grids' sizes): ``fullgraph=True`` traces through it and a changing
    max_seqlen does not recompile per value. Otherwise (CPU offsets, ``FLASHGEN_VARLEN_NO_HOST_READ=0``, a call the
    varlen ops do not serve) the offsets are read on the host and checked, a synchronisation when they are on the
    GPU (under torch.compile a graph break; under capture NotImplementedError; CPU offsets can be captured). With
    the varlen kernel (core.VARLEN_KERNEL, on unless ``FLASHGEN_VARLEN_KERNEL=0``) a call that
    wants no gradient, fp16 / bf16 without descales or attention_chunk, is one launch of it, which
    reads the offsets itself (:func:`_varlen_kernel`). A call that wants gradients takes the varlen kernels both
    ways where core.VARLEN_BWD_KERNEL is on (the default; ``FLASHGEN_VARLEN_BWD_KERNEL=0`` switches it off) and
    :func:`_varlen_bwd_serves` admits it (no seqused, softcap or attention_chunk; rows past the last
    offsets are cut off first where the offsets are read on the host): ``torch.ops.flashgen.varlen_fwd`` /
    ``varlen_bwd``, FA3's varlen backward. Otherwise: one :func:`flash_attn_func` call per
    run of consecutive sequences of equal lengths (the run as its batch), on views of q, k, v (no
    copy), and the outputs are concatenated; launch cost then grows with the number of distinct
    neighbouring lengths. Where padding a sequence at its end is invisible to it (causal, or a window
    whose right side is 0, as many query rows as keys, no attention_chunk: the packed documents of
    training), sequences of similar lengths share one call on a zero-padded copy instead
    (:func:`_varlen_groups`: while the padding adds less work than a call costs, VARLEN_CALL_WORK), when
    that makes fewer calls; the padded rows' gradients are 0, so dq, dk, dv are exact. Under
    torch.compile a call the varlen ops do not serve reads the offsets: a graph break (``fullgraph=True``
    refuses it).

    Args:
        q: ``(total_q, heads, head_dim)``; k: ``(total_k, heads_k, head_dim)``; v: ``(total_k,
            heads_k, head_dim_v)``: the dtypes, head dims and heads of :func:`flash_attn_func`.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, 0 first, non-decreasing, the last at
            most total_q / total_k; on q's GPU or on the CPU.
        max_seqlen_q, max_seqlen_k: ints, at least the longest (used) sequence (FA3's grid sizes).
        seqused_q, seqused_k: None or int32 ``(batch,)``: the rows used of each sequence.
        q_descale, k_descale, v_descale: FP8 only: None or float32 ``(batch, heads_k)`` (FA3's).
        softmax_scale, causal, window_size, attention_chunk, softcap, deterministic, pack_gqa,
        learnable_sink: as :func:`flash_attn_func`. qv: not implemented (NotImplementedError).
        num_splits: FA3's split-KV count where the varlen kernel runs the call: 1 (default) none, 0 or less
            chosen (core.varlen_num_splits while core.SPLIT_KV_AUTO, the default; else none), n that many; merged by
            :func:`flash_attn_combine`. The composed
            path ignores it. sm_margin: accepted and ignored.
        return_attn_probs: also return lse.

    Returns:
        out ``(total_q, heads, head_dim_v)`` of q's dtype (bfloat16 for FP8), zero in the rows no
        sequence uses; with return_attn_probs also lse, float32 ``(heads, total_q)`` (FA3's varlen
        layout; -inf in unused rows).

    Raises:
        TypeError / ValueError naming the argument: q, k, v not 3-D tensors of matching heads and
        dims; cu_seqlens / seqused not 1-D int32 tensors on q's device or the CPU, or not
        consistent with each other and the totals (flashgen._validate.varlen_problems); max_seqlen
        smaller than a sequence; FP8 descales not of shape (batch, heads_k). Without a host read
        (GPU offsets by default, torch.compile, capture) the values are checked on the GPU: a broken contract is a
        device-side assert naming the argument (RuntimeError on the CPU; on a GPU it loses the CUDA context, as
        any device assert; ``FLASHGEN_VARLEN_NO_HOST_READ=0`` gets the ValueError instead, at a synchronisation).
        NotImplementedError: qv; GPU cu_seqlens under CUDA-graph capture for a call the varlen ops do not serve.
        Then whatever each call of :func:`flash_attn_func` raises.
    """
    if qv is not None:
        raise NotImplementedError("flashgen: qv (absorbed MLA) is not supported yet; pass qv=None")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashgen: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"flashgen: {name} must be 3-D (total, heads, head_dim) for flash_attn_varlen_func, "
                             f"got {t.dim()}-D shape {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"flashgen: k and v must have the same total_k (dim 0), got {k.shape[0]} and {v.shape[0]}")
    device = _device_of(q)[1]
    if torch.compiler.is_compiling() or ((_core.VARLEN_NO_HOST_READ or _capturing(q)) and _on_q_device(
            q, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))):
        # no read of the offsets on the host (torch.compile, capture, or eager with core.VARLEN_NO_HOST_READ): the
        # varlen ops, the offsets checked on the GPU (or, where they do not serve the call, the host path below: a
        # graph break under torch.compile, NotImplementedError under capture)
        res = _varlen_on_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                                softmax_scale, causal, window_size, softcap, learnable_sink,
                                (q_descale, k_descale, v_descale), attention_chunk, num_splits, deterministic)
        if res is not None:
            return res if return_attn_probs else res[0]
    cu_q, cu_k = _host_ints("cu_seqlens_q", cu_seqlens_q, device), _host_ints("cu_seqlens_k", cu_seqlens_k, device)
    used_q = None if seqused_q is None else _host_ints("seqused_q", seqused_q, device)
    used_k = None if seqused_k is None else _host_ints("seqused_k", seqused_k, device)
    _v.raise_problems(_v.varlen_problems(q.shape[0], k.shape[0], cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                         used_q, used_k))
    batch = len(cu_q) - 1
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if d is not None and (not isinstance(d, torch.Tensor) or tuple(d.shape) != (batch, k.shape[1])):
            raise ValueError(f"flashgen: {name} must be None or a float32 (batch, heads_k) = {(batch, k.shape[1])} "
                             f"tensor for flash_attn_varlen_func, got "
                             f"{tuple(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}")
    lq = [b - a for a, b in zip(cu_q, cu_q[1:])] if used_q is None else used_q
    lk = [b - a for a, b in zip(cu_k, cu_k[1:])] if used_k is None else used_k
    unused_q = [cu_q[b + 1] - cu_q[b] - lq[b] for b in range(batch)]
    unused_k = [cu_k[b + 1] - cu_k[b] - lk[b] for b in range(batch)]
    _v.raise_problems(_v.window_size_problems(window_size))  # (before _varlen_bwd_serves reads it as ints)
    if batch and any(t is not None and t.requires_grad for t in (q, k, v, learnable_sink)) and torch.is_grad_enabled() \
            and _varlen_bwd_serves(
            q, k, v, batch, (seqused_q, seqused_k), learnable_sink, (q_descale, k_descale, v_descale),
            attention_chunk, softcap, causal, window_size, max(lq), max(lk)):
        # the kernels see the sequences' rows alone: rows past the last offsets (which may hold anything) are cut off,
        # so no load reads them (TMA zero-fills past a tensor's end); out 0 / lse -inf there, their gradients 0
        tq, tk = cu_q[-1], cu_k[-1]
        window = _v.window_pair(window_size)
        out, lse = _varlen_apply(
            q[:tq], k[:tk], v[:tk], _int32_like(cu_seqlens_q, q), _int32_like(cu_seqlens_k, q), None, None, max(lq),
            max(lk), _v.check_softmax_scale(softmax_scale, q.shape[-1]), bool(causal), *window, 0.0,
            learnable_sink, 1, bool(deterministic), False)
        if tq < q.shape[0]:
            out = torch.cat([out, out.new_zeros((q.shape[0] - tq,) + tuple(out.shape[1:]))])
            lse = torch.cat([lse, lse.new_full((lse.shape[0], q.shape[0] - tq), -math.inf)], dim=1)
        return (out, lse) if return_attn_probs else out
    if batch and _varlen_kernel_serves(q, k, v, learnable_sink, (q_descale, k_descale, v_descale), attention_chunk,
                                       max(lq), max(lk), softcap=softcap):
        res = _varlen_kernel(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), batch, max(lq), max(lk),
                             softmax_scale, causal, window_size, softcap, learnable_sink,
                             fill=any(unused_q) or cu_q[-1] < q.shape[0], num_splits=_splits_arg(num_splits))
        if res is not None:
            return res if return_attn_probs else res[0]
    # runs of consecutive sequences of equal lengths with no unused rows between them: one call each,
    # the run's sequences as its batch (a view: the rows are consecutive)
    runs = _varlen_runs(lq, lk, unused_q, unused_k, range(batch))
    # Where padding at a sequence's end is invisible to its rows (the mask's right side at the diagonal, as many
    # query rows as keys), sequences of similar lengths run as one padded call instead (fewer calls, some padding).
    closed = (causal or (window_size[1] is not None and window_size[1] == 0)) and not attention_chunk
    members = [b for b in range(batch) if closed and lq[b] == lk[b] > 0]
    groups = _varlen_groups(lq, members, q.shape[1] * q.shape[2])
    others = _varlen_runs(lq, lk, unused_q, unused_k, [b for b in range(batch) if b not in set(members)])
    if len(groups) + len(others) < len(runs):
        return _varlen_padded(q, k, v, cu_q, cu_k, lq, lk, groups, others, softmax_scale, causal, window_size, softcap,
                              learnable_sink, (q_descale, k_descale, v_descale), pack_gqa, deterministic,
                              return_attn_probs)
    q_sizes, k_sizes = [], []  # each run's used rows, then the unused rows after it; then the rows past the last
    for b0, m in runs:
        last = b0 + m - 1
        q_sizes += [m * lq[b0], unused_q[last]]
        k_sizes += [m * lk[b0], unused_k[last]]
    q_sizes.append(q.shape[0] - cu_q[-1])
    k_sizes.append(k.shape[0] - cu_k[-1])
    qs, ks, vs = q.split(q_sizes), k.split(k_sizes), v.split(k_sizes)
    outs, lses = [], []
    for i, (b0, m) in enumerate(runs):
        ds = tuple(None if d is None else d[b0:b0 + m] for d in (q_descale, k_descale, v_descale))
        o, lse = _attend(qs[2 * i].reshape(m, lq[b0], *q.shape[1:]), ks[2 * i].reshape(m, lk[b0], *k.shape[1:]),
                         vs[2 * i].reshape(m, lk[b0], *v.shape[1:]), softmax_scale, causal, window_size, softcap,
                         learnable_sink, ds, pack_gqa, deterministic, True, attention_chunk)
        outs.append(o.reshape(m * lq[b0], *o.shape[2:]))
        lses.append(lse.transpose(0, 1).reshape(lse.shape[1], m * lq[b0]))
        unused = q_sizes[2 * i + 1]
        if unused:
            outs.append(o.new_zeros((unused,) + tuple(o.shape[2:])))
            lses.append(lse.new_full((lse.shape[1], unused), -math.inf))
    if q_sizes[-1] or not outs:  # rows past the last sequence (or no sequence at all)
        dv = v.shape[2]
        outs.append(q.new_zeros((q_sizes[-1], q.shape[1], dv), dtype=_out_dtype(q)))
        lses.append(q.new_full((q.shape[1], q_sizes[-1]), -math.inf, dtype=torch.float32))
    out = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    if not return_attn_probs:
        return out
    return out, (torch.cat(lses, dim=1) if len(lses) > 1 else lses[0])


def _varlen_runs(lq: list, lk: list, unused_q: list, unused_k: list, seqs) -> list:
    """``[first, count]`` runs of the sequences ``seqs`` (ascending indices): neighbours (b - 1, b both in seqs)
    of equal lengths with no unused rows between them share a run, which is one call on views."""
    runs, prev = [], None
    for b in seqs:
        if runs and prev == b - 1 and (lq[b], lk[b]) == (lq[runs[-1][0]], lk[runs[-1][0]]) and not unused_q[b - 1] \
                and not unused_k[b - 1]:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
        prev = b
    return runs


#: flash_attn_varlen_func's padded groups: the padded work worth one call's fixed cost, in heads x head_dim x
#: token^2 (a call pays its launches and its tiles' ramp whatever its size). An estimate, not a measurement:
#: about 60 us per forward + backward call at 400 TFLOP/s, whose work is 7 heads head_dim L^2 FLOP per
#: sequence of L tokens (causal). scripts/varlen_bench.py times the groups against one call per run; 0: no groups.
VARLEN_CALL_WORK = 3.4e9


def _varlen_groups(lens: list, seqs: list, width: int) -> list:
    """The sequences ``seqs`` (lengths ``lens[b]``) as groups of one padded call each: longest first, a group
    takes the next sequence (length l) while padding it to the group's longest L adds less work than the call
    it saves, ``(L^2 - l^2) width <= VARLEN_CALL_WORK`` (``width`` = heads x head_dim): short sequences share calls,
    long ones of other lengths keep their own."""
    groups = []
    for b in sorted(seqs, key=lambda x: -lens[x]):
        if groups and (lens[groups[-1][0]] ** 2 - lens[b] ** 2) * width <= VARLEN_CALL_WORK:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _varlen_padded(q, k, v, cu_q: list, cu_k: list, lq: list, lk: list, groups: list, runs: list, softmax_scale,
                   causal, window_size, softcap, sink, descales: tuple, pack_gqa, deterministic, want_lse: bool):
    """flash_attn_varlen_func's composed path with padded groups (:func:`_varlen_groups`): each group's sequences
    (as many query rows as keys, ``lq[b] == lk[b]``; a mask whose right side is the diagonal) copied into a zero-padded
    batch ``(count, longest, heads, dim)``, one :func:`_attend` call, their rows gathered back; each of ``runs``
    (``[first, count]``, the other sequences; used rows ``lq`` / ``lk``) one call on views as before. A padded row or key sits after every
    row and key of its sequence, so no row of the sequence sees a padded key, and the padded rows' outputs are
    dropped: their gradient is 0, so they add nothing to dk, dv (dS = P (dP - dPsum) = 0 there). Returns what
    flash_attn_varlen_func returns; out rows of no sequence 0, their lse -inf."""
    heads, dv = q.shape[1], v.shape[2]
    out = q.new_zeros((q.shape[0], heads, dv), dtype=_out_dtype(q))
    lse = q.new_full((heads, q.shape[0]), -math.inf, dtype=torch.float32) if want_lse else None
    on = lambda values: torch.tensor(values, dtype=torch.long, device=q.device)  # noqa: E731
    for g in groups:
        longest = lq[g[0]]
        entry = on([j for j, b in enumerate(g) for _ in range(lq[b])])
        pos = on([i for b in g for i in range(lq[b])])
        q_rows = on([cu_q[b] + i for b in g for i in range(lq[b])])
        k_rows = on([cu_k[b] + i for b in g for i in range(lq[b])])

        def padded(t, rows):
            if t.dtype in _FP8_TORCH_DTYPES:  # copied as bytes (e4m3 0x00 is +0; no gradient to keep)
                return padded(t.view(torch.uint8), rows).view(t.dtype)
            return t.new_zeros((len(g), longest) + tuple(t.shape[1:])).index_put((entry, pos), t[rows])

        ds = tuple(None if d is None else d[on(g)] for d in descales)
        o, l = _attend(padded(q, q_rows), padded(k, k_rows), padded(v, k_rows), softmax_scale, causal, window_size,
                       softcap, sink, ds, pack_gqa, deterministic, want_lse)
        out.index_put_((q_rows,), o[entry, pos])
        if want_lse:
            lse[:, q_rows] = l[entry, :, pos].transpose(0, 1)
    for b0, m in runs:
        rows = slice(cu_q[b0], cu_q[b0] + m * lq[b0])
        keys = slice(cu_k[b0], cu_k[b0] + m * lk[b0])
        ds = tuple(None if d is None else d[b0:b0 + m] for d in descales)
        o, l = _attend(q[rows].reshape(m, lq[b0], *q.shape[1:]), k[keys].reshape(m, lk[b0], *k.shape[1:]),
                       v[keys].reshape(m, lk[b0], *v.shape[1:]), softmax_scale, causal, window_size, softcap, sink,
                       ds, pack_gqa, deterministic, want_lse)
        out[rows] = o.reshape(m * lq[b0], heads, dv)
        if want_lse:
            lse[:, rows] = l.transpose(0, 1).reshape(heads, m * lq[b0])
    return (out, lse) if want_lse else out


MAX_SPLIT_HEAD_DIM_V = 2 * _v.MAX_HEAD_DIM  # FA3 serves head_dim_v up to 512 (16-bit, head_dim <= 64)
_ONE_CALL_HEAD_DIM_V = (_v.MAX_HEAD_DIM,)  # flash_attn_func's fast path: v.shape[-1:] <= this


def _split_head_dim_v(q, k, v, scale: float, causal: bool, window_size, attention_chunk, softcap: float, sink,
                      descales: tuple, pack_gqa, deterministic, want_lse: bool):
    """flash_attn_func for a head_dim_v over one kernel's 256 (FA3 serves up to 512 in 16 bits): the
    softmax weights depend on q and k alone, so out's columns split into two calls of the same
    arguments on v's two column halves (each a multiple of 8, read in place: a column slice keeps
    v's strides), whose outs are concatenated; lse is the first call's (both compute the same).
    Autograd sums the two calls' dq and dk and concatenates dv (dS is linear in dO and V's
    columns). Costs q k^T and the softmax twice. ValueError for head_dim_v over 512 or not a
    multiple of 8, NotImplementedError for float8_e4m3fn (FA3: 16-bit only); the rest is each
    call's own checking. Returns what flash_attn_func returns."""
    dv = v.shape[3]
    if dv > MAX_SPLIT_HEAD_DIM_V or dv % _v.HEAD_DIM_MULTIPLE:
        raise ValueError(f"flashgen: head_dim_v (dim 3 of v) must be a multiple of {_v.HEAD_DIM_MULTIPLE} up to "
                         f"{_v.MAX_HEAD_DIM}, or up to {MAX_SPLIT_HEAD_DIM_V} with float16 / bfloat16 inputs, got {dv}")
    if v.dtype in _FP8_TORCH_DTYPES:
        raise NotImplementedError(f"flashgen: head_dim_v ({dv}) over {_v.MAX_HEAD_DIM} is served for float16 / "
                                  "bfloat16 inputs only (as in FA3)")
    half = -(-dv // (2 * _v.HEAD_DIM_MULTIPLE)) * _v.HEAD_DIM_MULTIPLE
    res = [_attend(q, k, part, scale, causal, window_size, softcap, sink, descales, pack_gqa, deterministic, want_lse,
                   attention_chunk) for part in (v[..., :half], v[..., half:])]
    out = torch.cat([o for o, _ in res], dim=-1)
    return (out, res[0][1]) if want_lse else out


def _chunk_descale(t: Optional[torch.Tensor], name: str, begin: int, end: int, chunks: int, batch: int):
    """A descale of an ``attention_chunk`` piece (:func:`_attention_chunks`) whose q (or k) rows are
    ``[begin, end)``, as ``chunks`` calls' worth of batch: FA3's ``(batch, heads_k)`` is the same
    for every piece (repeated per chunk); a block descale ``(batch, heads, blocks of 64 rows)`` is
    sliced at the piece's 64-row blocks, which needs the piece (and each of its chunks) to start on
    one: NotImplementedError otherwise."""
    if t is None or t.dim() == 2:
        return t if t is None or chunks == 1 else t.repeat_interleave(chunks, dim=0)
    block = _core.QUANT_BLOCK
    if begin % block or (chunks > 1 and (end - begin) // chunks % block):
        raise NotImplementedError(
            f"flashgen: attention_chunk with a block {name} (one scale per {block} rows) needs every chunk "
            f"boundary at a multiple of {block} rows of {name[0]} (here a piece starts at row {begin}); use an "
            f"attention_chunk that is a multiple of {block} with seqlen_k - seqlen_q a multiple of {block}, or "
            "(batch, heads_k) descales")
    part = t[:, :, begin // block:-(-end // block)]
    if chunks > 1:
        part = part.reshape(batch, part.shape[1], chunks, -1).transpose(1, 2).reshape(batch * chunks, part.shape[1], -1)
    return part


def _attention_chunks(q, k, v, attention_chunk: int, scale: float, causal: bool, window: tuple, softcap: float,
                      sink, descales: tuple, pack_gqa, deterministic, want_lse: bool):
    """flash_attn_func with FA3's ``attention_chunk`` C > 0: query row i sees only the keys of its
    chunk, ``floor((i + seqlen_k - seqlen_q) / C) * C <= j < that + C`` (FA3's
    ``construct_chunk_mask``), within its causal / window mask. Rows and keys split into at most
    three independent pieces (:func:`flashgen.core.chunk_pieces`), each an ordinary call of the
    same arguments on slices of q, k, v (the whole chunks of the middle piece as one call with
    chunks x batch); out and lse are their rows in order. Autograd runs through the pieces
    (slices, reshapes and cat are differentiable), so unlike FA3 the backward works too.

    Returns ``(out, lse)`` (lse None unless ``want_lse``), or None when the chunks cut nothing
    (the call is one piece: the caller runs it as usual). Validates q, k, v and the rest first
    (the errors of :func:`flash_attn_func`); NotImplementedError for block descales whose 64-row
    blocks a chunk boundary cuts, before any launch."""
    _check_fwd(q, k, v, window[0], window[1], softcap, sink, *descales)
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, heads_k, head_dim_v = v.shape
    pieces = _core.chunk_pieces(seqlen_q, seqlen_k, attention_chunk)
    if batch == 0 or pieces == [_core.ChunkPiece(0, seqlen_q, 0, seqlen_k, 1)]:
        return None
    calls = []  # every slice and descale made (and checked) before the first launch
    for pc in pieces:
        n = pc.chunks
        qs, ks, vs = q[:, pc.q_begin:pc.q_end], k[:, pc.k_begin:pc.k_end], v[:, pc.k_begin:pc.k_end]
        if n > 1:  # whole chunks as the batch of one call (a view when the strides allow, else a copy)
            qs = qs.reshape(batch * n, -1, heads, head_dim)
            ks, vs = ks.reshape(batch * n, -1, heads_k, head_dim), vs.reshape(batch * n, -1, heads_k, head_dim_v)
        ds = (_chunk_descale(descales[0], "q_descale", pc.q_begin, pc.q_end, n, batch),
              _chunk_descale(descales[1], "k_descale", pc.k_begin, pc.k_end, n, batch),
              _chunk_descale(descales[2], "v_descale", pc.k_begin, pc.k_end, n, batch))
        calls.append((n, qs, ks, vs, ds))
    outs, lses = [], []
    for n, qs, ks, vs, ds in calls:
        o, lse = _attend(qs, ks, vs, scale, causal, window, softcap, sink, ds, pack_gqa, deterministic, want_lse)
        if n > 1:
            o = o.reshape(batch, -1, heads, head_dim_v)
            if lse is not None:
                lse = lse.reshape(batch, n, heads, -1).transpose(1, 2).reshape(batch, heads, -1)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    if not want_lse:
        return out, None
    return out, (torch.cat(lses, dim=2) if len(lses) > 1 else lses[0])


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    window_size: tuple = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: bool = False,
    num_heads_q: Optional[int] = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
):
    """FA3's ``flash_attn_qkvpacked_func``: attention over q, k, v packed in one tensor, with FA3's
    arguments in FA3's order; the same as :func:`flash_attn_func` on its three views (no copy when
    their layout suits TMA, as for any flash_attn_func input), differentiable (the gradient comes
    back packed, in qkv's shape).

    Args:
        qkv: ``(batch, seqlen, 3, heads, head_dim)`` (q, k, v stacked on dim 2), or, for MQA/GQA,
            ``(batch, seqlen, num_heads_q + 2 * heads_k, head_dim)`` with ``num_heads_q`` given
            (the q heads, then k's, then v's: FA3's layout). float16, bfloat16 or float8_e4m3fn.
        num_heads_q: the q heads of a 4-D qkv (ignored for a 5-D one).
        softmax_scale, causal, q_descale, k_descale, v_descale, window_size, attention_chunk,
        softcap, deterministic, return_attn_probs: as :func:`flash_attn_func` (softmax_scale None:
        ``head_dim ** -0.5``).
        sm_margin: accepted and ignored, as in flash_attn_func.

    Returns:
        out ``(batch, seqlen, heads, head_dim)``, and lse float32 ``(batch, heads, seqlen)`` with
        return_attn_probs.

    Raises:
        TypeError: qkv not a torch.Tensor, num_heads_q not an int.
        ValueError: qkv not 5-D with 3 on dim 2, or 4-D without a num_heads_q that leaves an even,
            non-zero number of heads for k and v; then whatever :func:`flash_attn_func` raises.
    """
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"flashgen: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"flashgen: a 5-D qkv must be (batch, seqlen, 3, heads, head_dim), got shape "
                             f"{tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=2)
    elif qkv.dim() == 4:
        if num_heads_q is None or isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int):
            raise TypeError("flashgen: a 4-D qkv (batch, seqlen, num_heads_q + 2 * heads_k, head_dim) needs "
                            f"num_heads_q, an int; got {type(num_heads_q).__name__}")
        heads_k, odd = divmod(qkv.shape[2] - num_heads_q, 2)
        if num_heads_q < 1 or heads_k < 1 or odd:
            raise ValueError(f"flashgen: qkv has {qkv.shape[2]} heads on dim 2, which num_heads_q={num_heads_q} "
                             "does not split into num_heads_q + 2 * heads_k with heads_k >= 1")
        q, k, v = qkv.split([num_heads_q, heads_k, heads_k], dim=2)
    else:
        raise ValueError(f"flashgen: qkv must be 5-D (batch, seqlen, 3, heads, head_dim) or 4-D with num_heads_q, "
                         f"got {qkv.dim()}-D shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale, causal, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale, window_size=window_size, attention_chunk=attention_chunk,
                           softcap=softcap, deterministic=deterministic, sm_margin=sm_margin,
                           return_attn_probs=return_attn_probs)


# ======================================================================================
# flash_attn_combine: split-KV combine (FA3's flash_attn_combine)
# ======================================================================================
# Two custom ops, so torch.compile sees exactly what each call does:
#   flashgen::combine(out_partial, lse_partial, out_dtype) -> (out, lse)      functional
#   flashgen::combine_out(out_partial, lse_partial, out!, out_dtype) -> lse   writes `out` in place
# (a custom op may not return one of its inputs, so the `out=` form returns only lse and declares
# `out` mutated; flash_attn_combine returns (out, lse) around it).

from . import combine as _combine  # noqa: E402  (section appended after the forward API)

_COMBINE_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _combine_dtype_name(dtype) -> str:
    """flashgen's name of an output dtype, or its spelling (rejected by check_combine)."""
    name = _COMBINE_DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype)


def _combine_check(out_partial, lse_partial, out_dtype, out=None) -> "_combine.CombineProblem":
    return _combine.check_combine(_array_info(out_partial), _array_info(lse_partial), _combine_dtype_name(out_dtype),
                                  None if out is None else _array_info(out))


def _combine_lse_buffer(like: torch.Tensor, p) -> torch.Tensor:
    """FA3's LSE output: a contiguous float32 (batch, heads, seqlen) buffer, returned as its
    (batch, seqlen, heads) transpose(1, 2) view."""
    return like.new_empty(p.lse_buffer_shape, dtype=torch.float32).transpose(1, 2)


def _tensor_arg(t: torch.Tensor, dtype: str, device: int) -> "_core.TensorArg":
    """The framework-neutral view of ``t`` as it is (its own strides; no copy)."""
    return _core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, device)


def _combine_launch(out_partial, lse_partial, out, lse, p) -> None:
    dev = p.device
    _combine.attention_combine(
        _tensor_arg(out_partial, "fp32", dev),
        _tensor_arg(lse_partial, "fp32", dev),
        _tensor_arg(out, p.out_dtype, dev),
        _tensor_arg(lse, "fp32", dev),
        p.out_dtype,
        _current_stream(dev),
    )  # selects the variant (cached) and raises MissingVariantError before launching


def _combine_impl(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.combine(out_partial, lse_partial, out_dtype) -> (out, lse)``: the
    functional op behind :func:`flash_attn_combine` (fresh ``out``, contiguous). Validates."""
    p = _combine_check(out_partial, lse_partial, out_dtype)
    _check_device_capability(p.device)
    out = out_partial.new_empty(p.out_shape, dtype=out_dtype)
    lse = _combine_lse_buffer(out_partial, p)
    if not p.nothing_to_compute:
        _combine_launch(out_partial, lse_partial, out, lse, p)
    return out, lse


def _combine_out_impl(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``torch.ops.flashgen.combine_out(out_partial, lse_partial, out, out_dtype) -> lse``: the
    in-place op behind ``flash_attn_combine(..., out=out)``; writes ``out``. Validates."""
    p = _combine_check(out_partial, lse_partial, out_dtype, out)
    _check_device_capability(p.device)
    lse = _combine_lse_buffer(out_partial, p)
    if not p.nothing_to_compute:
        _combine_launch(out_partial, lse_partial, out, lse, p)
    return lse


_combine_op = torch.library.custom_op("flashgen::combine", _combine_impl, mutates_args=())
_combine_out_op = torch.library.custom_op("flashgen::combine_out", _combine_out_impl, mutates_args=("out",))


@_combine_op.register_fake
def _combine_fake(out_partial, lse_partial, out_dtype):
    p = _combine_check(out_partial, lse_partial, out_dtype)
    return out_partial.new_empty(p.out_shape, dtype=out_dtype), _combine_lse_buffer(out_partial, p)


@_combine_out_op.register_fake
def _combine_out_fake(out_partial, lse_partial, out, out_dtype):
    p = _combine_check(out_partial, lse_partial, out_dtype, out)
    return _combine_lse_buffer(out_partial, p)


def flash_attn_combine(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge split-KV partial attention outputs: FA3's ``flash_attn_combine``.

    Split-KV attention (flash-decoding; FlashAttention-3, arXiv 2407.08608, §3, and FA3's
    ``flash_attn_combine`` / ``mha_combine``) computes attention over ``num_splits`` slices of
    the keys; slice s gives a partial output O_s (normalised within the slice) and its
    log-sum-exp L_s. This merges them per row (b, l, h), in fp32:
    ``M = max_s L_s``, ``w_s = exp(L_s - M)``, ``lse = M + log(sum_s w_s)``,
    ``out = sum_s (w_s / sum_s w_s) O_s``. A slice with L_s = -inf (it saw no key) contributes
    nothing and its O_s is not read (garbage or NaN there does not leak); a row whose slices
    are all -inf gives out 0 and lse -inf.

    Args:
        out_partial: float32 ``(num_splits, batch, seqlen, heads, head_dim)`` CUDA tensor,
            1 <= num_splits <= 256, 1 <= head_dim <= 256; its last dim must be contiguous
            (stride 1), other strides are free (no copy is made).
        lse_partial: float32 ``(num_splits, batch, seqlen, heads)`` on the same device, natural
            log, any strides (FA3's layout is a transposed ``(num_splits, batch, heads, seqlen)``
            buffer, which reads fastest).
        out: optional preallocated ``(batch, seqlen, heads, head_dim)`` tensor of out_dtype on
            the same device, last dim contiguous, other strides free; written in place and
            returned.
        out_dtype: torch.float32 (default: out_partial's dtype, which is float32),
            torch.bfloat16 or torch.float16. With ``out``, it must equal ``out.dtype`` (as in FA3).

    Returns:
        ``(out, lse)``: out ``(batch, seqlen, heads, head_dim)`` of out_dtype (contiguous when
        allocated here); lse float32 with shape ``(batch, seqlen, heads)``, the ``transpose(1, 2)``
        view of a contiguous ``(batch, heads, seqlen)`` buffer (exactly FA3's layout). batch,
        seqlen or heads of 0 launch nothing and give empty outputs.

    torch.compile: the call is the custom op ``torch.ops.flashgen.combine`` (functional) or,
    with ``out``, ``torch.ops.flashgen.combine_out``, which declares ``out`` mutated and writes
    it directly (no extra copy); both have fake implementations, so
    ``torch.compile(fullgraph=True)`` traces through without graph breaks. The kernel runs on
    ``torch.cuda.current_stream()`` with no host synchronisation (CUDA-graph capturable).
    Not differentiable (FA3's combine has no backward): with inputs that require grad, a
    backward through the outputs raises RuntimeError (no autograd formula is registered).

    Raises:
        TypeError: an argument is not a torch.Tensor; out_partial or lse_partial not float32;
            out_dtype not float32/bfloat16/float16; out's dtype not out_dtype.
        ValueError: not CUDA tensors or not on one device; out_partial not 5-D or lse_partial
            not 4-D; lse_partial's shape not out_partial's first four dims; num_splits not in
            1..256; head_dim not in 1..256; a last dim not contiguous; out of the wrong shape or
            with overlapping elements.
        flashgen.InputError (alias flashgen.combine.CombineArgumentError): dtype and shape
            problems together (it is both a TypeError and a ValueError). Every problem found
            is listed in the one error, one line each, not only the first.
        RuntimeError: the GPU is not compute capability 9.x (Hopper).
        flashgen.dispatch.MissingVariantError: no combine variant for out_dtype is built; the
            message names the ``flashgen add-variant`` command.
    """
    not_tensors = [(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
                   for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out))
                   if t is not None and not isinstance(t, torch.Tensor)]
    bad_dtype = []
    if out_dtype is None:
        out_dtype = torch.float32  # out_partial's dtype: the only one it may have
    elif not isinstance(out_dtype, torch.dtype):
        bad_dtype = [(TypeError, "out_dtype must be a torch.dtype (torch.float32, torch.bfloat16 or "
                                 f"torch.float16), got {out_dtype!r}")]
    if not_tensors or bad_dtype:  # one error naming the tensors' problems too
        op_info, lp_info, out_info = (_array_info(t) if isinstance(t, torch.Tensor) else None
                                      for t in (out_partial, lse_partial, out))
        tensor_problems = _combine.combine_problems(op_info, lp_info, None, out_info)  # out_dtype: reported
        _v.raise_problems(not_tensors + bad_dtype + tensor_problems, _combine.CONTEXT)
    tensors = (out_partial, lse_partial) if out is None else (out_partial, lse_partial, out)
    eager = (all(type(t) is torch.Tensor for t in tensors) and not torch.compiler.is_compiling()
             and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
    if out is None:
        # Eager fast path: the implementation without the custom-op dispatcher (as flash_attn_func).
        return _combine_impl(out_partial, lse_partial, out_dtype) if eager else \
            torch.ops.flashgen.combine(out_partial, lse_partial, out_dtype)
    if eager:
        lse = _combine_out_impl(out_partial, lse_partial, out, out_dtype)
    else:
        lse = torch.ops.flashgen.combine_out(out_partial, lse_partial, out, out_dtype)
    return out, lse


# ======================================================================================
# quantize_fp8: e4m3 q, k, v with block scales and incoherent processing (FA3 §3.3)
# ======================================================================================
# One custom op, flashgen::quantize_fp8(q, k, v, incoherent, block_quant, seed) -> (q8, k8, v8,
# q_descale, k_descale, v_descale), with a fake implementation (torch.compile) and no autograd
# formula (quantization has no useful gradient).

import functools  # noqa: E402

from . import quantize as _quant  # noqa: E402

QUANT_BLOCK = _quant.QUANT_BLOCK


@functools.lru_cache(maxsize=64)
def _sign_draw(head_dim: int, seed: int) -> tuple:
    """The negative signs (bools) of :func:`incoherent_signs`, drawn once per (head_dim, seed)."""
    bits = torch.randint(0, 2, (head_dim,), generator=torch.Generator(device="cpu").manual_seed(seed))
    return tuple(bool(b) for b in bits.tolist())


@functools.lru_cache(maxsize=64)
def _sign_bits(head_dim: int, seed: int) -> tuple:
    """The kernels' ``sign_bits0..7`` for (head_dim, seed), packed once."""
    return _quant.pack_sign_bits(_sign_draw(head_dim, seed))


def incoherent_signs(head_dim: int, seed: int = 0) -> torch.Tensor:
    """The ±1 vector s of :func:`quantize_fp8`'s incoherent processing: float32 ``(head_dim,)`` on the
    CPU, ``s = 1 - 2 * torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed))``
    (so reproducible and independent of the device). Inverse of the transform, per B-block of a row:
    ``x = (x' H_B / sqrt(B)) ⊙ s`` (H_B is symmetric and H_B H_B = B I)."""
    return 1.0 - 2.0 * torch.tensor(_sign_draw(int(head_dim), int(seed)), dtype=torch.float32)


def _quant_check(q, k, v, incoherent, block_quant, seed) -> _v.Problem:
    return _quant.check_quantize(_array_info(q), _array_info(k), _array_info(v),
                                 also=_quant.flag_problems(incoherent, block_quant, seed))


def _quant_shapes(p: _v.Problem, block_quant: bool) -> tuple:
    """The shapes of q8, k8, v8 and of the three descales."""
    return (p.q_shape, p.k_shape, p.v_shape, *_quant.descale_shapes(p, block_quant))


def _quant_outputs(q: torch.Tensor, shapes: tuple) -> tuple:
    """Fresh contiguous outputs of :func:`_quant_shapes`: q8, k8, v8 (e4m3) and the three fp32 descales."""
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    return (q.new_empty(shapes[0], dtype=e4m3), q.new_empty(shapes[1], dtype=e4m3), q.new_empty(shapes[2], dtype=e4m3),
            q.new_empty(shapes[3], dtype=f32), q.new_empty(shapes[4], dtype=f32), q.new_empty(shapes[5], dtype=f32))


def _quant_signs(p: _v.Problem, incoherent: bool, seed: int) -> tuple:
    """The kernels' ``sign_bits0..7``: those of (head_dim, seed) with incoherent processing, else 0."""
    return _sign_bits(p.head_dim, int(seed)) if incoherent else (0,) * _quant.SIGN_WORDS


class _QuantCall(NamedTuple):
    """What a quantize call's validated metadata decides (:func:`_quant_call`): the Problem, the
    outputs' shapes and, when q, k, v have a layout the kernels read in place and no tensor is
    empty, the prepared launches (:func:`flashgen.quantize.prepare_quantize`). :func:`_quantize_impl`
    keeps one per key (``_quant_calls``: shapes, strides, dtypes, devices, flags, seed), so a
    repeated call skips the validation and the params; immutable, so calls on any thread may share
    it. The inputs' addresses (16-byte alignment) are checked per call."""

    problem: _v.Problem
    shapes: tuple  # q8, k8, v8, q_descale, k_descale, v_descale
    prepared: Optional[_quant.PreparedQuantize]


_quant_calls: dict = {}  # key (see _quantize_impl) -> _QuantCall; immutable values
_QUANT_CALL_CACHE_MAX = 1024  # bounded: cleared when full (dropping entries is safe)


def _quant_call(q, k, v, incoherent: bool, block_quant: bool, seed: int) -> _QuantCall:
    """Validate a quantize call (every problem in one error), then make its :class:`_QuantCall`:
    RuntimeError on a GPU that is not Hopper; MissingVariantError when no quant variant serves the
    dtype and there is a kernel to launch."""
    p = _quant_check(q, k, v, incoherent, block_quant, seed)
    _check_device_capability(p.device)
    prepared = None
    if all(_quant.reads_in_place(t.shape, t.stride()) for t in (q, k, v)) and p.batch and p.seqlen_q and p.seqlen_k:
        prepared = _quant.prepare_quantize(p, (q.stride(), k.stride(), v.stride()), incoherent, block_quant,
                                           _quant_signs(p, incoherent, seed))
    return _QuantCall(p, _quant_shapes(p, block_quant), prepared)


def _quantize_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, incoherent: bool, block_quant: bool,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.flashgen.quantize_fp8(q, k, v, incoherent, block_quant, seed) -> (q8, k8, v8, q_descale,
    k_descale, v_descale)``: the op behind :func:`quantize_fp8`. Validates its arguments (once per key:
    ``_quant_calls``)."""
    key = (q.shape, q.stride(), q.dtype, _device_of(q), k.shape, k.stride(), k.dtype, _device_of(k),
           v.shape, v.stride(), v.dtype, _device_of(v), incoherent, block_quant, seed)
    call = _quant_calls.get(key)
    if call is None:
        call = _quant_call(q, k, v, incoherent, block_quant, seed)
        _launch.cache_put(_quant_calls, key, call, _QUANT_CALL_CACHE_MAX)
    prep = call.prepared
    if prep is not None:
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if not (ptrs[0] | ptrs[1] | ptrs[2]) % 16:  # read in place (the layout is the key's): the common call
            outs = _quant_outputs(q, call.shapes)
            workspace = _workspace(q, max(prep.workspace_bytes, 1))
            _quant.launch_quantize(prep, (*ptrs, *(t.data_ptr() for t in outs)), workspace.data_ptr(),
                                   _current_stream(call.problem.device))
            return outs  # (the workspace is released after the launches are enqueued: stream-ordered)
    p = call.problem
    outs = _quant_outputs(q, call.shapes)
    q8, k8, v8, qd, kd, vd = outs
    # a tensor with no rows: its global descales are those of amax 0 (its block descales are empty)
    if p.batch and not p.seqlen_q:
        qd.fill_(1.0)
    if p.batch and not p.seqlen_k:
        kd.fill_(1.0)
        vd.fill_(1.0)
    if p.batch == 0 or (p.seqlen_q == 0 and p.seqlen_k == 0):
        return outs
    dev = p.device
    inputs = [_tma_arg(t, p.dtype, dev) for t in (q, k, v)]  # a copy where 16-byte loads cannot read t
    nbytes, _ = _quant.workspace_layout(p, block_quant)
    workspace = _workspace(q, max(nbytes, 1))
    sign_bits = _quant_signs(p, incoherent, seed)
    _quant.quantize_fp8_launch(
        *(arg for _, arg in inputs),
        _tensor_arg(q8, "fp8_e4m3", dev), _tensor_arg(k8, "fp8_e4m3", dev), _tensor_arg(v8, "fp8_e4m3", dev),
        _tensor_arg(qd, "fp32", dev), _tensor_arg(kd, "fp32", dev), _tensor_arg(vd, "fp32", dev),
        workspace.data_ptr(), p, bool(incoherent), bool(block_quant), sign_bits, _current_stream(dev),
    )  # selects the variant (cached) and raises MissingVariantError before launching
    del inputs, workspace  # copies and the workspace are released after the launches are enqueued
    return outs


_quant_op = torch.library.custom_op("flashgen::quantize_fp8", _quantize_impl, mutates_args=())


@_quant_op.register_fake
def _quantize_fake(q, k, v, incoherent, block_quant, seed):
    return _quant_outputs(q, _quant_shapes(_quant_check(q, k, v, incoherent, block_quant, seed), block_quant))


def quantize_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, incoherent: bool = True,
                 block_quant: bool = True, seed: int = 0):
    """Quantize q, k, v to FP8 (e4m3) for the FP8 attention forward, the FlashAttention-3 way.

    Method (FlashAttention-3, Shah et al., arXiv 2407.08608, §3.3 and Table 3): two ways to cut
    the error of FP8 attention on inputs with outlier features, both on by default.

    * Incoherent processing (``incoherent``, q and k only): ``x' = (x ⊙ s) H_B / sqrt(B)`` on
      every block of B consecutive head_dim coordinates of every row, where B is the largest
      power of two dividing head_dim, at most 256 (head_dim 64 / 128 / 256: one block of the whole
      dim; 96: 3 blocks of 32; 192: 3 blocks of 64), H_B the Walsh-Hadamard (Sylvester, natural
      order) matrix and s a ±1 vector of length head_dim drawn from ``seed``
      (:func:`incoherent_signs`: a CPU ``torch.Generator``, so reproducible on any device). q and
      k get the same s, so the transform is orthogonal and ``q' k'ᵀ = q kᵀ``: attention on
      (q', k', v) is attention on (q, k, v), while an outlier coordinate is spread over B
      coordinates, which shrinks the amax the scale must cover. Computed by a fused fast
      Walsh-Hadamard transform, O(B log B) per row. v is never transformed.
    * Block quantization (``block_quant``): one scale per ``QUANT_BLOCK`` (64) rows of each q / k
      head instead of one per head.

    Then ``x8 = satfinite_e4m3(x' / descale)`` with ``descale = amax(|x'|) / 448`` over the
    scale's group (descale 1 where the amax is 0), rounded to nearest even, saturated to ±448.

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)`` CUDA tensor, float16 or bfloat16.
        k: ``(batch, seqlen_k, heads_k, head_dim)``, same dtype and device.
        v: ``(batch, seqlen_k, heads_k, head_dim_v)``, same dtype and device.
            heads a multiple of heads_k (GQA / MQA); head_dim and head_dim_v multiples of 8 in
            8..256. Any strides: inputs whose last dim is contiguous with 16-byte aligned rows
            (e.g. slices of a packed qkv) are read in place, others are copied first.
        incoherent: apply the random Hadamard transform to q and k (default True).
        block_quant: one scale per 64-row block of each q / k head (default True); else one per
            (batch, key head), FA3's descale shape.
        seed: int in [0, 2^64 - 1], the seed of s (default 0).

    Returns:
        ``(q8, k8, v8, q_descale, k_descale, v_descale)``, all contiguous on q's device:

        * q8, k8, v8: torch.float8_e4m3fn of q's, k's and v's shapes (q8 and k8 hold q', k' when
          ``incoherent``).
        * q_descale: float32 ``(batch, heads, ceil(seqlen_q / 64))`` with block_quant (the amax
          of 64 rows x head_dim of one query head); else ``(batch, heads_k)``: the amax over all
          rows and the query heads ``hk * g .. hk * g + g - 1`` of key head hk's GQA group
          (g = heads // heads_k).
        * k_descale: float32 ``(batch, heads_k, ceil(seqlen_k / 64))`` with block_quant, else
          ``(batch, heads_k)``.
        * v_descale: float32 ``(batch, heads_k)`` (amax over the head's rows).

        Dequantized, ``x8.float() * descale`` (broadcast over the descale's group) approximates
        x'. Descales are multipliers, in the units of x.

    Recommended use: bf16 attention in FP8, through the FP8 forward (e4m3 inputs, bf16 output)::

        q8, k8, v8, q_descale, k_descale, v_descale = flashgen.quantize_fp8(q, k, v)
        out = flashgen.flash_attn_func(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                       v_descale=v_descale)

    (the softmax scale defaults to head_dim ** -0.5 of the original q, which the transform keeps).

    Empty problems (batch 0, or both seqlens 0) launch no kernel of flashgen's; a tensor with no
    rows gets empty e4m3 and block descales and global descales of 1 (amax 0). Runs on ``torch.cuda.current_stream()`` with no host
    synchronisation (two kernel launches), so CUDA graphs capture it; ``torch.compile
    (fullgraph=True)`` traces it as the custom op ``torch.ops.flashgen.quantize_fp8`` (with a fake
    implementation). Not differentiable.

    Raises:
        TypeError: q, k or v not a torch.Tensor; dtype not float16 / bfloat16 (fp8 inputs
            included), dtypes differ; incoherent / block_quant not a bool; seed not an int.
        ValueError: not CUDA tensors on one device; not 4-D; batch, seqlen or heads mismatched;
            heads not a multiple of heads_k; head_dim / head_dim_v not a multiple of 8 in
            8..256; seed out of range; sizes beyond 32-bit indexing.
        flashgen.InputError: problems of several kinds at once; every problem is listed, one line
            each, the message starting with ``"flashgen: quantize_fp8: "``.
        RuntimeError: the GPU is not compute capability 9.x (Hopper).
        flashgen.MissingVariantError: no quant variant for the dtype is built; the message names
            the ``flashgen add-variant`` command.
    """
    not_tensors = [(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
                   for name, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor)]
    flags = _quant.flag_problems(incoherent, block_quant, seed)
    if not_tensors or flags:  # one error naming q, k and v's problems too
        infos = [_array_info(t) if isinstance(t, torch.Tensor) else None for t in (q, k, v)]
        _v.raise_problems(not_tensors + _quant.quantize_problems(*infos) + flags, _quant.CONTEXT)
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        # Eager fast path: the op's implementation without the custom-op dispatcher (as flash_attn_func).
        return _quantize_impl(q, k, v, incoherent, block_quant, int(seed))
    return torch.ops.flashgen.quantize_fp8(q, k, v, incoherent, block_quant, int(seed))
