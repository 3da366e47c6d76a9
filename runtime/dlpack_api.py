"""Framework-neutral entry of flashgen: the FA3 forward and backward on any DLPack array (CuPy, JAX, torch...).

Nothing here imports torch at module level, and nothing needs it: arrays are read through
the DLPack protocol (``__dlpack__`` / ``__dlpack_device__``) with cuda.core's
``StridedMemoryView`` (NVIDIA's maintained DLPack / CUDA-array-interface reader), which
gives the device address, shape, strides (elements), dtype and device of each array and
performs the DLPack stream handshake with the producer. The launches go through
``flashgen.core.attention_forward`` / ``attention_backward``, the same path as the torch API.
Method: FlashAttention-3 forward (arXiv 2407.08608, §3, Algorithms 1-2); the
FlashAttention-2/3 backward (P recomputed from the forward's LSE, dS = P∘(dP − rowsum(dO∘O))).

Dependencies: ``cuda-core`` (for StridedMemoryView). bfloat16 arrays: cuda.core names
their dtype through ``ml_dtypes``; without it flashgen falls back on the array's own
``dtype`` attribute (torch and JAX spell it ``bfloat16``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from . import _validate as _v
from . import core as _core
from . import split_kv as _split_kv

__all__ = ["flash_attn_forward", "flash_attn_backward"]

# DLPack DLDeviceType codes (dlpack.h).
kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
_DEVICE_TYPE_NAMES = {1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan",
                      8: "kDLMetal", 10: "kDLROCM", 13: "kDLCUDAManaged", 14: "kDLOneAPI"}
#: Device types whose memory the kernels can read through TMA (device or managed memory).
#: Module-level so CPU tests can add kDLCPU.
_CUDA_DEVICE_TYPES = frozenset({kDLCUDA, kDLCUDAManaged})

# numpy / ml_dtypes / torch spellings -> flashgen names. Only float8_e4m3fn (OCP) is served; the
# other e4m3 formats differ in exponent bias or NaN encoding (reading them as e4m3fn would be
# wrong), so they are named to be refused (_validate: fp8_other).
_DTYPE_BY_NAME = {
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32", "float": "fp32",
    "float8_e4m3fn": "fp8_e4m3", "float8_e4m3fnuz": "fp8_other", "float8_e4m3": "fp8_other",
    "float8_e4m3b11fnuz": "fp8_other",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_other",
}

_NEG_INF_F32_BITS = 0xFF800000


class _Array:
    """One array as read through DLPack: its ArrayInfo, device address and owner."""

    __slots__ = ("name", "obj", "info", "ptr", "view")

    def __init__(self, name, obj, info, ptr, view):
        self.name, self.obj, self.info, self.ptr, self.view = name, obj, info, ptr, view


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------

def _stream_handle(stream: Any) -> int:
    """CUstream handle (int) of ``stream``: None -> 0 (the legacy default stream); an int;
    an object with ``__cuda_stream__()`` (cuda.core, recent CuPy / torch); a torch.cuda.Stream
    (``.cuda_stream``); a CuPy stream (``.ptr``). TypeError otherwise."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError("flashgen: stream must be a CUstream handle (int) or a stream object, got bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"flashgen: stream handle must be >= 0, got {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        val = proto() if callable(proto) else proto
        # protocol: (version, handle)
        return int(val[1]) if isinstance(val, tuple) else int(val)
    for attr in ("cuda_stream", "ptr", "handle"):
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    raise TypeError(
        "flashgen: stream must be None, a CUstream handle (int), or an object with "
        f"__cuda_stream__ / .cuda_stream / .ptr, got {type(stream).__name__}"
    )


def _dlpack_stream(handle: int) -> int:
    """The consumer-stream value for ``__dlpack__(stream=...)``: DLPack forbids 0 and spells
    the legacy default stream 1 (and the per-thread default stream 2, the same as CUDA's
    CU_STREAM_PER_THREAD handle)."""
    return 1 if handle == 0 else handle


# --------------------------------------------------------------------------------------
# Reading arrays
# --------------------------------------------------------------------------------------

def _smv():
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "flashgen.dlpack_api needs cuda-core (`pip install cuda-core`) to read DLPack arrays"
        ) from e
    return StridedMemoryView


def _dtype_name(view, obj) -> tuple:
    """(flashgen dtype name or None, spelling for messages)."""
    try:
        dt = view.dtype
        spelled = str(dt)
    except (NotImplementedError, TypeError):
        # cuda.core names narrow types (bfloat16, fp8) through ml_dtypes, and raises for DLPack's
        # float8 codes it has no numpy dtype for (TypeError "Unsupported dtype", cuda-core 0.4):
        # fall back on the producer's own dtype attribute.
        spelled = str(getattr(obj, "dtype", "unknown"))
    key = spelled.rsplit(".", 1)[-1]  # 'torch.bfloat16' -> 'bfloat16'
    return _DTYPE_BY_NAME.get(key), spelled


def _not_dlpack(name: str, obj: Any) -> list:
    """[(TypeError, message)] when ``obj`` is not a DLPack array, else []."""
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return []
    return [(TypeError, f"{name} must be a DLPack array (with __dlpack__ and __dlpack_device__, "
                        f"e.g. a CuPy, JAX or torch array), got {type(obj).__name__}")]


def _read_all(named, dl_stream: int) -> tuple:
    """``(arrays, problems)`` for ``(name, obj)`` pairs: ``{name: _Array}`` for each obj that is
    a DLPack array, and a TypeError problem naming each that is not."""
    arrays, problems = {}, []
    for name, obj in named:
        why = _not_dlpack(name, obj)
        problems += why
        if not why:
            arrays[name] = _read(name, obj, dl_stream)
    return arrays, problems


def _readonly(a: _Array) -> list:
    """[(ValueError, message)] when the output ``a`` is read-only, else []."""
    if a.view is not None and getattr(a.view, "readonly", False):
        return [(ValueError, f"{a.name} is read-only; pass a writable array")]
    return []


class _CapsuleOnly:
    """An array's DLPack protocol and nothing else (no framework type a reader could special-case)."""

    def __init__(self, obj):
        self._obj = obj

    def __dlpack__(self, *args, **kwargs):
        return self._obj.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._obj.__dlpack_device__()


def _read(name: str, obj: Any, dl_stream: int) -> _Array:
    _v.raise_problems(_not_dlpack(name, obj))
    dev_type, dev_id = obj.__dlpack_device__()
    dev_type, dev_id = int(dev_type), int(dev_id)
    if dev_type not in _CUDA_DEVICE_TYPES:
        # Not read (the memory is of no use to us): shape and dtype from the object's own
        # attributes, so that the other problems of this array are reported with the device.
        shape = tuple(getattr(obj, "shape", ()))
        spelled = str(getattr(obj, "dtype", "?"))
        where = f"DLPack device type {dev_type} ({_DEVICE_TYPE_NAMES.get(dev_type, '?')})"
        info = _v.ArrayInfo(shape, _v.contiguous_strides(shape), _DTYPE_BY_NAME.get(spelled.rsplit(".", 1)[-1]),
                            spelled, False, None, where)
        return _Array(name, obj, info, None, None)
    # The producer makes the data ready for work on our stream (DLPack stream handshake);
    # -1 (no synchronisation) for host memory, which has no stream.
    smv = _smv()
    sp = -1 if dev_type == kDLCPU else dl_stream
    # cuda-core >= 0.4 has the classmethod; older releases take the object in the constructor.
    try:
        view = smv.from_dlpack(obj, stream_ptr=sp) if hasattr(smv, "from_dlpack") else smv(obj, stream_ptr=sp)
    except TypeError:
        # cuda-core's fast path for torch tensors (its AOTI bridge) refuses float8 dtypes ("Unsupported
        # AOTI dtype code: 24"; H100, cuda-core with torch 2.11): read the same capsule the generic way.
        view = smv.from_dlpack(_CapsuleOnly(obj), stream_ptr=sp) if hasattr(smv, "from_dlpack") else \
            smv(_CapsuleOnly(obj), stream_ptr=sp)
    shape = tuple(int(n) for n in view.shape)
    strides = view.strides
    strides = _v.contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    dtype, spelled = _dtype_name(view, obj)
    info = _v.ArrayInfo(shape, strides, dtype, spelled, True, dev_id, f"cuda:{dev_id}")
    return _Array(name, obj, info, int(view.ptr), view)


def _tensor_arg(a: _Array, dtype: str, device: int):
    shape = a.info.shape
    return _core.TensorArg(a.ptr, shape, _v.tma_strides(shape, a.info.strides), dtype, device)


def _fp32_arg(a: Optional[_Array], device: int):
    """The core's view of a float32 array (lse, a descale) with its own strides; None for None."""
    return None if a is None else _core.TensorArg(a.ptr, a.info.shape, a.info.strides, "fp32", device)


def _read_inputs(named, dl_stream: int, softmax_scale, window_size=(-1, -1), softcap=0.0, also=()) -> tuple:
    """``(arrays, Problem, scale)``: the first checks of both entries.

    Reads the ``(name, obj)`` pairs (which include q, k and v) into ``{name: _Array}``; raises
    one error naming every argument that is no DLPack array and every problem of q, k, v,
    softmax_scale, window_size and softcap, and the problems ``also`` lists (the same messages as
    flash_attn_func's); then checks the GPU (Hopper). ``scale``: softmax_scale as a float, None
    resolved to ``head_dim ** -0.5``."""
    arrays, not_arrays = _read_all(named, dl_stream)
    scale_problems = (_v.softmax_scale_problems(softmax_scale) + _v.window_size_problems(window_size)
                      + _v.softcap_problems(softcap) + list(also))
    if not_arrays:
        infos = [arrays[name].info if name in arrays else None for name in ("q", "k", "v")]
        _v.raise_problems(not_arrays + _v.input_problems(*infos) + scale_problems)
    p = _v.check_inputs(arrays["q"].info, arrays["k"].info, arrays["v"].info, also=scale_problems)
    scale = _v.check_softmax_scale(softmax_scale, p.head_dim)
    _v.check_capability(_core.device_capability(p.device), p.device)
    return arrays, p, scale


def _tma_read_problems(arrays, p: _v.Problem) -> list:
    """[(ValueError, message)] for each input ``_Array`` (of q's dtype) that TMA cannot read in
    place; the DLPack entries make no copies."""
    es = _v.ELEMENT_SIZE[p.dtype]
    problems = []
    for a in arrays:
        why = _v.tma_layout_problem(a.info.shape, a.info.strides, es, a.ptr)
        if why:
            problems.append((ValueError,
                             f"{a.name} cannot be read by TMA: {why}. The DLPack entry makes no copies: pass "
                             f"{a.name} with a contiguous last dim and 16-byte-aligned other strides and base "
                             "address (e.g. a contiguous copy)"))
    return problems


# --------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------

def _allocate(like: Any, device: int, handle: int, specs: list, caller: str = "") -> list:
    """Arrays allocated by ``like``'s framework when it is torch, else by CuPy, on ``handle``'s
    stream so the allocator orders reuse of the memory after our kernel.

    ``specs``: per array ``(what, shape, dtype, perm)`` -- ``what`` says in messages what to pass
    instead (e.g. ``"out= (bf16, shape (2, 3, 4, 64))"``), ``dtype`` one of fp32/fp16/bf16,
    ``perm`` None or the axes the contiguous buffer is permuted to -- or None for an array not
    wanted (None in its place). TypeError naming what to pass when there is no allocator for
    ``like``'s framework, or when CuPy would have to make a bfloat16 array."""
    mod = type(like).__module__.split(".", 1)[0]
    if mod == "torch" and "torch" in sys.modules:
        import torch

        dev = torch.device("cuda", device)
        tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        st = torch.cuda.default_stream(dev) if handle in (0, 1) else torch.cuda.ExternalStream(handle, device=dev)
        with torch.cuda.stream(st):
            arrays = [None if sp is None else torch.empty(sp[1], dtype=tdt[sp[2]], device=dev) for sp in specs]
        return [a if a is None or sp[3] is None else a.permute(*sp[3]) for a, sp in zip(arrays, specs)]
    wanted = [sp for sp in specs if sp is not None]
    try:
        import cupy
    except ImportError:
        raise TypeError(
            f"flashgen: {caller}{' / '.join(sp[0].split('=')[0] for sp in wanted)} not given and there is no "
            f"allocator for {type(like).__name__} arrays: pass {' and '.join(sp[0] for sp in wanted)} device "
            "arrays, or install CuPy") from None
    bf16 = [sp[0] for sp in wanted if sp[2] == "bf16"]
    if bf16:
        raise TypeError(f"flashgen: {caller}CuPy cannot allocate bfloat16 arrays: pass {' and '.join(bf16)}")
    cdt = {"fp32": cupy.float32, "fp16": cupy.float16}
    with cupy.cuda.Device(device):
        st = cupy.cuda.Stream.null if handle in (0, 1) else cupy.cuda.ExternalStream(handle, device)
        with st:
            arrays = [None if sp is None else cupy.empty(sp[1], dtype=cdt[sp[2]]) for sp in specs]
    return [a if a is None or sp[3] is None else a.transpose(*sp[3]) for a, sp in zip(arrays, specs)]


def _allocate_missing(like: Any, device: int, handle: int, dl_stream: int, outputs: list,
                      caller: str = "") -> list:
    """``[(array, _Array), ...]``, one per ``(name, array or None, its _Array or None, spec)`` of
    ``outputs``: the caller's array and read view where given, else an array made by
    :func:`_allocate` from ``spec`` and read back. Only the missing ones are allocated, in one call."""
    missing = [spec if obj is None else None for _, obj, _, spec in outputs]
    made = _allocate(like, device, handle, missing, caller) if any(missing) else missing
    return [(obj, a) if m is None else (m, _read(name, m, dl_stream))
            for (name, obj, a, _), m in zip(outputs, made)]


def _workspace(like: Any, device: int, handle: int, dl_stream: int, nbytes: int, caller: str) -> tuple:
    """``(array, address)``: ``nbytes`` of scratch device memory (a float32 array of
    ``ceil(nbytes / 4)`` elements) from ``like``'s framework (torch) or CuPy, on ``handle``'s stream
    (stream-ordered reuse, as the outputs); both allocators give 256-byte-aligned (512) blocks.
    Keep the array referenced until the launches are enqueued. TypeError when there is no
    allocator (the caller cannot pass a workspace)."""
    try:
        (ws,) = _allocate(like, device, handle, [("workspace", (-(-nbytes // 4),), "fp32", None)], caller)
    except TypeError:  # the only cause for an fp32 array: neither torch arrays nor CuPy
        raise TypeError(f"flashgen: {caller}needs {nbytes} bytes of scratch device memory and there is no "
                        f"allocator for {type(like).__name__} arrays: install CuPy, or pass torch tensors") from None
    return ws, _read("workspace", ws, dl_stream).ptr


# Driver memsets and copies for the empty cases (forward, seqlen_k == 0: out = 0, lse = -inf or the
# sink; backward: zero gradients), framework-neutral.
# Module-level so CPU tests can replace them with host memsets.

def _driver_op(device: int, what: str, *args) -> None:
    """One asynchronous driver memset or copy (``cu<what>``) in ``device``'s primary context; the
    caller's context is restored."""
    from . import launch

    d = launch._driver()
    with launch.device_context(device):
        launch.check(getattr(d, f"cu{what}")(*args), f"cu{what}")


def _memset8(device: int, ptr: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver as d

    _driver_op(device, "MemsetD8Async", d.CUdeviceptr(ptr), 0, nbytes, d.CUstream(stream))


def _memset2d8(device: int, ptr: int, pitch: int, width: int, height: int, stream: int) -> None:
    from cuda.bindings import driver as d

    _driver_op(device, "MemsetD2D8Async", d.CUdeviceptr(ptr), pitch, 0, width, height, d.CUstream(stream))


def _memset32(device: int, ptr: int, value: int, count: int, stream: int) -> None:
    from cuda.bindings import driver as d

    _driver_op(device, "MemsetD32Async", d.CUdeviceptr(ptr), value, count, d.CUstream(stream))


def _zero(a: _Array, p: _v.Problem, handle: int, dtype: Optional[str] = None) -> None:
    """Set a 4-D array of ``dtype`` (None: q's) whose last dim is contiguous (as TMA requires) to
    0 on ``handle``'s stream: one memset when it is C-contiguous, else one 2-D memset (or one per
    row) per (batch, head). Nothing for an empty array."""
    es = _v.ELEMENT_SIZE[p.dtype if dtype is None else dtype]
    b, s, h, d = a.info.shape
    if b * s * h * d == 0:
        return
    sb, ss, sh, _ = a.info.strides
    if _v.is_c_contiguous(a.info.shape, a.info.strides):
        _memset8(p.device, a.ptr, b * s * h * d * es, handle)
        return
    for ib in range(b):
        for ih in range(h):
            base = a.ptr + (ib * sb + ih * sh) * es
            if s == 1 or ss < d:
                for i in range(s):
                    _memset8(p.device, base + i * ss * es, d * es, handle)
            else:
                _memset2d8(p.device, base, ss * es, d * es, s, handle)


def _memcpy2d(device: int, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
              stream: int) -> None:
    """Device-to-device copy of ``height`` rows of ``width`` bytes (row r from ``src + r * src_pitch``
    to ``dst + r * dst_pitch``) on ``stream``."""
    from cuda.bindings import driver as d

    c = d.CUDA_MEMCPY2D()
    c.srcMemoryType = c.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
    c.srcDevice, c.srcPitch = d.CUdeviceptr(src), src_pitch
    c.dstDevice, c.dstPitch = d.CUdeviceptr(dst), dst_pitch
    c.WidthInBytes, c.Height = width, height
    _driver_op(device, "Memcpy2DAsync", c, d.CUstream(stream))


def _memcpy(device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
    """Device-to-device copy of ``nbytes`` bytes on ``stream``."""
    from cuda.bindings import driver as d

    _driver_op(device, "MemcpyDtoDAsync", d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, d.CUstream(stream))


def _fill_lse_from_sink(device: int, lse_ptr: int, sink_ptr: int, batch: int, heads: int, seqlen_q: int,
                        stream: int) -> None:
    """``lse[b, h, i] = sink[h]`` for a C-contiguous float32 ``(batch, heads, seqlen_q)`` lse and a
    contiguous float32 ``(heads,)`` sink, all on ``stream`` with device-to-device copies (no
    kernel, no host round trip): sink into column 0 of batch 0, then the filled columns and the
    filled batches doubled, 1 + ceil(log2 seqlen_q) + ceil(log2 batch) copies."""
    row = seqlen_q * 4  # bytes per (b, h) row
    _memcpy2d(device, lse_ptr, row, sink_ptr, 4, 4, heads, stream)  # lse[0, h, 0] = sink[h]
    n = 1
    while n < seqlen_q:  # columns [0, n) -> [n, n + w) of batch 0's rows
        w = min(n, seqlen_q - n)
        _memcpy2d(device, lse_ptr + n * 4, row, lse_ptr, row, w * 4, heads, stream)
        n += w
    slab = heads * row  # bytes per batch
    m = 1
    while m < batch:  # batches [0, m) -> [m, m + c)
        c = min(m, batch - m)
        _memcpy(device, lse_ptr + m * slab, lse_ptr, c * slab, stream)
        m += c


def _fill_attend_nothing(out: _Array, lse: _Array, p: _v.Problem, handle: int, sink: Optional[_Array] = None) -> None:
    """out = 0 and lse = -inf (or lse[b, h, :] = sink[h]) on ``handle``'s stream (seqlen_k == 0:
    every row sees no key)."""
    _zero(out, p, handle, p.out_dtype)
    if sink is None:
        _memset32(p.device, lse.ptr, _NEG_INF_F32_BITS, p.batch * p.heads * p.seqlen_q, handle)
    else:
        _fill_lse_from_sink(p.device, lse.ptr, sink.ptr, p.batch, p.heads, p.seqlen_q, handle)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------

def flash_attn_forward(q, k, v, *, softmax_scale: Optional[float] = None, causal: bool = False,
                       window_size=(-1, -1), softcap: float = 0.0, learnable_sink: Any = None,
                       q_descale: Any = None, k_descale: Any = None, v_descale: Any = None,
                       num_splits: int = 1, stream: Any = None, out: Any = None, lse: Any = None):
    """FlashAttention-3 forward on DLPack arrays; returns ``(out, lse)``.

    Same computation, rules and errors as :func:`flashgen.interface.flash_attn_func`
    (FA3's ``flash_attn_func`` semantics; arXiv 2407.08608, §3, Algorithms 1-2), without
    torch: ``out = softmax(s [+ mask]) v`` per (batch, head), GQA/MQA when heads_k divides
    heads, with logits ``s = softmax_scale * q k^T`` (``c * tanh(softmax_scale * q k^T / c)``
    with softcap c > 0).

    Args:
        q: ``(batch, seqlen_q, heads, head_dim)`` CUDA array, float16, bfloat16 or
            float8_e4m3fn (FP8, FA3 paper §3.3: see q_descale; out is then bfloat16), any
            object with ``__dlpack__`` / ``__dlpack_device__`` (CuPy, JAX, torch, ...).
        k: ``(batch, seqlen_k, heads_k, head_dim)``; v: ``(batch, seqlen_k, heads_k,
            head_dim_v)``; same dtype and device as q. Head dims: multiples of 8 in 8..256,
            served by the smallest built variant that covers them.
        softmax_scale: any finite float; None means ``head_dim ** -0.5``.
        causal: bottom-right aligned causal mask (row i sees keys ``j <= i + seqlen_k -
            seqlen_q``; a row that sees no key gives 0 and lse -inf, or lse = sink).
        window_size: ``(left, right)``, ints >= -1 or None (-1 / None: unbounded): FA3's
            sliding window, bottom-right aligned: row i sees keys ``i + seqlen_k - seqlen_q -
            left <= j <= i + seqlen_k - seqlen_q + right``; causal forces right = 0.
        softcap: FA3 / Gemma 2 logit soft-capping, a finite float >= 0 (0 = off).
        learnable_sink: None, or a float32 ``(heads,)`` C-contiguous array (stride 1; no copy
            is made, so pass a contiguous one) on q's device: one logit per query head (gpt-oss;
            FlashAttention-4), in the units of s, added to each row's softmax denominator only:
            ``out_i = sum_j exp(s_ij - L_i) v_j``, ``L_i = log(exp(sink[h]) + sum_j exp(s_ij))``;
            lse is L. Its gradient: see :func:`flash_attn_backward`.
        q_descale, k_descale, v_descale: FP8 only (float8_e4m3fn q, k, v), as in
            :func:`flashgen.interface.flash_attn_func`: None (1) or float32 arrays on q's
            device, any strides, positive: the logits use ``q * q_descale`` and ``k *
            k_descale``, out uses ``v * v_descale``. Shapes: q_descale ``(batch, heads_k)``
            (FA3's) or ``(batch, heads, ceil(seqlen_q / 64))`` (block quantization);
            k_descale ``(batch, heads_k)`` or ``(batch, heads_k, ceil(seqlen_k / 64))``;
            v_descale ``(batch, heads_k)``. FP8 serves every mask, softcap (the descales
            scale q.k before the tanh) and sinks; head_dim_v == head_dim only.
        num_splits: FA3's split-KV count (flash-decoding; FA3 paper §3), an int: 1 (default, FA3's)
            unsplit; 0 or less chosen by ``flashgen.core.varlen_num_splits`` (splits where the tiles
            do not fill the GPU, e.g. a decode step over a long cache: decode-like calls by a cost model,
            core.SPLIT_MODEL, others by FA3's heuristic); n:
            each tile's keys in n shares (at most core.MAX_SPLITS and one per 64 keys), merged by
            the combine kernel. Results differ from unsplit ones by fp32 rounding only. FP8,
            descales, or no built varlen / combine variant: unsplit. A split call needs scratch
            device memory (fp32 partials: about ``4 x splits x batch x heads x seqlen_q x
            (head_dim_v + 1)`` bytes), allocated on ``stream`` as missing outputs are (torch for
            torch arrays, else CuPy) and released once the launches are enqueued
            (:mod:`flashgen.split_kv`).
        stream: where to launch: None (default) = the legacy default stream (handle 0, which
            synchronises with all blocking streams), an int CUstream handle, or a stream
            object (``__cuda_stream__``, torch.cuda.Stream, cupy.cuda.Stream). It is also
            passed to each array's ``__dlpack__(stream=...)``, so the producer orders its
            pending writes before our kernel (DLPack's stream handshake).
        out: optional ``(batch, seqlen_q, heads, head_dim_v)`` array of q's dtype (bfloat16
            for float8_e4m3fn inputs) on q's device, written in place; its last dim must be
            contiguous and its other strides and base address 16-byte aligned (TMA store).
        lse: optional float32 C-contiguous ``(batch, heads, seqlen_q)`` array on q's
            device, written in place (natural-log log-sum-exp of each row's logits, with the
            sink). When out or lse is missing it is allocated: with torch when q is a torch
            tensor, else with CuPy (CuPy has no bfloat16: pass out for bf16 from JAX);
            without CuPy, pass both. Allocation happens on ``stream``.

    Returns:
        ``(out, lse)``: the given arrays, or the allocated ones.

    Layouts: no copy is ever made here (there is no framework to copy with). q, k and v
    must have a contiguous last dim and 16-byte-aligned other strides and base address
    (TMA): packed-qkv slices and KV-cache prefixes qualify; other layouts raise ValueError
    (make them contiguous first). Empty problems (batch, seqlen_q or seqlen_k of 0) launch
    no kernel (seqlen_k 0: out set to 0 and lse to -inf with driver memsets, or lse[b, h, :]
    to sink[h] with device-to-device copies).

    Raises:
        TypeError: an argument is not a DLPack array; dtypes unsupported or mismatched;
            softmax_scale or softcap not a number; window_size not a tuple/list of ints or
            None; learnable_sink not float32; num_splits not an int; no allocator for missing
            outputs or for a split call's scratch memory.
        ValueError: arrays not in CUDA memory or not on one device; shapes (see
            :func:`flashgen.interface.flash_attn_func`); layouts TMA cannot address; out /
            lse with the wrong shape, dtype, device, layout, or read-only; softmax_scale /
            softcap not finite, softcap < 0; window_size not of 2 entries or an entry < -1;
            learnable_sink not of shape (heads,), not on q's device or not C-contiguous.
        RuntimeError: GPU not compute capability 9.x.
        NotImplementedError: float8_e5m2 or an fnuz fp8 format; float8_e4m3fn with
            head_dim_v != head_dim.
        ValueError (descales): a descale of the wrong shape or device, or given with 16-bit
            inputs; TypeError: a descale not float32.
        flashgen.InputError: problems of several of the kinds above at once (it is both a
            ValueError and a TypeError).
        flashgen.core.MissingVariantError: no built variant serves the request; the message
            names the ``flashgen add-variant`` command that builds it.

    Every problem found is listed in the one error, one line each, with the same messages
    as flash_attn_func's: first those of q, k, v, softmax_scale, window_size and softcap;
    once those are valid, those of the layouts of q, k, v, of out / lse, of learnable_sink
    and of the descales (which depend on q, k, v).
    """
    handle = _stream_handle(stream)  # first: reading the arrays needs it (DLPack handshake)
    dl_stream = _dlpack_stream(handle)
    # Every problem of q, k, v, softmax_scale, window_size and softcap in one error (as flash_attn_func's).
    arrays, p, scale = _read_inputs((("q", q), ("k", k), ("v", v)), dl_stream, softmax_scale, window_size, softcap,
                                    also=_v.num_splits_problems(num_splits))
    qa, ka, va = arrays["q"], arrays["k"], arrays["v"]
    causal = bool(causal)
    window, softcap = _v.window_pair(window_size), float(softcap)
    # Then what depends on valid q, k, v (their layouts; the outputs' and the sink's expected
    # shapes and dtype), in one error: checked before any output is allocated.
    problems = [] if p.nothing_to_compute or p.seqlen_k == 0 else _tma_read_problems((qa, ka, va), p)
    descale_names = ("q_descale", "k_descale", "v_descale")
    arrays, not_arrays = _read_all([(n, x) for n, x in (("out", out), ("lse", lse), ("learnable_sink", learnable_sink),
                                                        *zip(descale_names, (q_descale, k_descale, v_descale)))
                                    if x is not None], dl_stream)
    problems += not_arrays
    oa, la, sa = arrays.get("out"), arrays.get("lse"), arrays.get("learnable_sink")
    if oa is not None:
        problems += _readonly(oa) + _v.out_problems(oa.info, p, oa.ptr)
    if la is not None:
        problems += _readonly(la) + _v.lse_problems(la.info, p, la.ptr)
    if sa is not None:
        problems += _v.learnable_sink_problems(sa.info, p, sa.ptr, contiguous=True)
    descales = tuple(arrays.get(n) for n in descale_names)
    problems += _v.descale_problems(p, {n: None if a is None else a.info for n, a in zip(descale_names, descales)})
    problems += _v.fp8_problems(p)
    _v.raise_problems(problems)
    # Missing outputs: allocated (right by construction).
    (out, oa), (lse, la) = _allocate_missing(q, p.device, handle, dl_stream, [
        ("out", out, oa, (f"out= ({p.out_dtype}, shape {p.out_shape})", p.out_shape, p.out_dtype, None)),
        ("lse", lse, la, (f"lse= (float32, shape {p.lse_shape})", p.lse_shape, "fp32", None))])
    if p.nothing_to_compute:
        return out, lse
    if p.seqlen_k == 0:
        _fill_attend_nothing(oa, la, p, handle, sa)
        return out, lse
    dev = p.device
    split = None if num_splits == 1 else _split_kv.prepare_split_forward(
        p, tuple((a.info.shape, _tensor_arg(a, p.dtype, dev).strides) for a in (qa, ka, va)), causal, window, softcap,
        any(d is not None for d in descales), None, int(num_splits),
        out_strides=_tensor_arg(oa, p.out_dtype, dev).strides)
    if split is not None:  # split-KV: the partials in a workspace of this call, merged into out and lse
        workspace, workspace_ptr = _workspace(
            q, dev, handle, dl_stream, split.workspace_bytes,
            f"flash_attn_forward with num_splits={num_splits} ({split.splits} splits; num_splits=1 needs none) ")
        _split_kv.launch_split_forward(split, qa.ptr, ka.ptr, va.ptr, workspace_ptr, oa.ptr, la.ptr, scale, softcap,
                                       handle, 0 if sa is None else sa.ptr)
        del workspace  # released after the launches are enqueued (stream-ordered)
        return out, lse
    _core.attention_forward(
        _tensor_arg(qa, p.dtype, dev),
        _tensor_arg(ka, p.dtype, dev),
        _tensor_arg(va, p.dtype, dev),
        _tensor_arg(oa, p.out_dtype, dev),
        _fp32_arg(la, dev),
        scale,
        causal,
        handle,
        window_size=window,
        softcap=softcap,
        sink=0 if sa is None else sa.ptr,
        q_descale=_fp32_arg(descales[0], dev),
        k_descale=_fp32_arg(descales[1], dev),
        v_descale=_fp32_arg(descales[2], dev),
    )  # selects the variant (cached per key) and raises MissingVariantError before launching
    return out, lse


#: What each gradient is shaped like: (Problem property, the shape's dims for messages).
_GRADS = (("dq", "q_shape", "(batch, seqlen_q, heads, head_dim)"),
          ("dk", "k_shape", "(batch, seqlen_k, heads_k, head_dim)"),
          ("dv", "v_shape", "(batch, seqlen_k, heads_k, head_dim_v)"))


def flash_attn_backward(dout, q, k, v, out, lse, *, softmax_scale: Optional[float] = None, causal: bool = False,
                        window_size=(-1, -1), softcap: float = 0.0, deterministic: bool = False,
                        stream: Any = None, dq: Any = None, dk: Any = None, dv: Any = None):
    """Gradients of the FlashAttention-3 forward on DLPack arrays; returns ``(dq, dk, dv)``.

    For ``out = softmax(s [+ mask]) v`` per (batch, head) (:func:`flash_attn_forward`: logits
    ``s = softmax_scale * q k^T``, or ``c * tanh(softmax_scale * q k^T / c)`` with softcap c;
    bottom-right aligned causal / sliding-window mask; GQA/MQA when heads_k divides heads) and
    the gradient ``dout`` of a loss with respect to out, computes the loss's gradients with
    respect to q, k and v. Method: the FlashAttention-2/3 backward (FA2 arXiv 2307.08691,
    Algorithm 2; FA3 arXiv 2407.08608): P is recomputed from the forward's lse, ``dV = P^T dO``,
    ``dS = P ∘ (dP − rowsum(dO ∘ O))`` with ``dP = dO V^T`` (times the tanh's derivative
    ``1 - (s / c)^2`` with softcap), ``dQ = scale dS K``, ``dK = scale dS^T Q``, in fp32; dk and
    dv of a GQA group are summed over its query heads. Three kernels run on ``stream``; nothing
    synchronises with the host.

    Learnable sinks: a forward run with ``learnable_sink`` needs nothing more here (its lse
    includes the sink, and dq, dk, dv follow from it). The sink's own gradient is not computed
    here; callers who train sinks compute it from the same arrays (float32; rows with
    lse = -inf contribute 0)::

        dPsum[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]
        d_sink[h] = -sum_{b, i} exp(sink[h] - lse[b, h, i]) * dPsum[b, h, i]

    Args:
        dout: ``(batch, seqlen_q, heads, head_dim_v)`` CUDA array of q's dtype and device (any
            object with ``__dlpack__`` / ``__dlpack_device__``: CuPy, JAX, torch, ...).
        q, k, v: the forward's inputs, as in :func:`flash_attn_forward` (float16 or bfloat16);
            head_dim_v may differ from head_dim (the bwd variant of max(head_dim, head_dim_v)
            serves, as in FA3).
        out: the forward's output, ``(batch, seqlen_q, heads, head_dim_v)`` of q's dtype.
        lse: the forward's log-sum-exp, float32 C-contiguous ``(batch, heads, seqlen_q)``.
        softmax_scale, causal, window_size, softcap: the forward's (softmax_scale None means
            ``head_dim ** -0.5``; window_size and softcap checked as in
            :func:`flash_attn_forward`).
        deterministic: bitwise-reproducible gradients (dq's fp32 accumulation runs in a fixed
            order, at some cost in speed); otherwise results may differ in the last bits from
            run to run.
        stream: where to launch, as in :func:`flash_attn_forward` (None = the legacy default
            stream; also used for the DLPack stream handshake and for allocations).
        dq, dk, dv: optional arrays written in place: dq of q's shape, dk of k's, dv of v's,
            all of q's dtype and device, writable, with a contiguous last dim and 16-byte
            aligned other strides and base address (TMA). Missing ones are allocated on
            ``stream``, contiguous: with torch when q is a torch tensor, else with CuPy (which
            has no bfloat16: pass them for bf16 from JAX).

    Returns:
        ``(dq, dk, dv)``: the given arrays, or the allocated ones.

    Layouts: no copy is ever made. dout, q, k, v and out must have a contiguous last dim and
    16-byte-aligned other strides and base address (ValueError otherwise). The kernels also
    need scratch device memory (:func:`flashgen.core.backward_workspace_bytes` bytes), always
    allocated here on ``stream`` (torch for torch tensors, else CuPy) and released once the
    kernels are enqueued (stream-ordered). Empty problems launch no kernel: dq is set to 0
    when seqlen_k is 0, dk and dv when batch or seqlen_q is 0 (driver memsets).

    Raises:
        TypeError: an argument is not a DLPack array; dtypes unsupported or mismatched (dout,
            out, dq, dk, dv must have q's dtype; lse float32); softmax_scale or softcap not a
            number; window_size not a tuple/list of ints or None; no allocator for missing
            gradients or the workspace (neither torch arrays nor CuPy).
        ValueError: arrays not in CUDA memory or not on q's device; shapes of q, k, v (see
            :func:`flashgen.interface.flash_attn_func`), of dout / out (q's), of lse, of dq /
            dk / dv; layouts TMA cannot address; lse not C-contiguous; a gradient read-only;
            softmax_scale / softcap not finite, softcap < 0; window_size not of 2 entries or
            an entry < -1.
        NotImplementedError: fp8 dtypes.
        RuntimeError: GPU not compute capability 9.x.
        flashgen.InputError: problems of several of the kinds above at once (it is both a
            ValueError and a TypeError).
        flashgen.core.MissingVariantError: no built bwd variant serves (dtype, max(head_dim,
            head_dim_v), mask, softcap); the message names the ``flashgen add-variant`` command that builds it.

    Every problem found is listed in the one error, one line each: first those of q, k, v,
    softmax_scale, window_size, softcap and of any argument that is no DLPack array; once q, k, v are valid, those
    of dout, out, lse, the layouts and dq, dk, dv (which depend on q, k, v).
    """
    caller = "flash_attn_backward: "
    handle = _stream_handle(stream)  # first: reading the arrays needs it (DLPack handshake)
    dl_stream = _dlpack_stream(handle)
    names = ("dout", "q", "k", "v", "out", "lse")
    arrays, p, scale = _read_inputs(tuple(zip(names, (dout, q, k, v, out, lse))), dl_stream, softmax_scale,
                                    window_size, softcap)
    doa, qa, ka, va, oa, la = (arrays[name] for name in names)
    if p.dtype == "fp8_e4m3":
        raise NotImplementedError("flashgen: the FP8 (float8_e4m3fn) forward has no backward (FA3 has none either)")
    causal, deterministic = bool(causal), bool(deterministic)
    window, softcap = _v.window_pair(window_size), float(softcap)
    computes = not (p.nothing_to_compute or p.seqlen_k == 0)
    # What depends on valid q, k, v, in one error, before any allocation.
    problems = _v.backward_problems(p, doa.info, oa.info, la.info, la.ptr)
    if computes:  # layouts of the inputs of q's dtype (a wrong dtype is reported above)
        problems += _tma_read_problems([a for a in (doa, qa, ka, va, oa) if a.info.dtype == p.dtype], p)
    given = {"dq": dq, "dk": dk, "dv": dv}
    grads, not_arrays = _read_all([(name, x) for name, x in given.items() if x is not None], dl_stream)
    problems += not_arrays
    for name, shape_of, dims in _GRADS:
        if name in grads:
            a = grads[name]
            problems += _readonly(a) + _v.array_problems(name, a.info, getattr(p, shape_of), dims, p, a.ptr,
                                                         tma_write=True)
    _v.raise_problems(problems)
    if computes:  # the variant first (MissingVariantError before any allocation), then the workspace
        nbytes = _core.backward_workspace_bytes(p.batch, p.seqlen_q, p.heads, p.heads_k, p.head_dim, p.dtype,
                                                causal, p.device, seqlen_k=p.seqlen_k, window_size=window,
                                                softcap=softcap, head_dim_v=p.head_dim_v)
        workspace, workspace_ptr = _workspace(q, p.device, handle, dl_stream, nbytes, caller)
    # Missing gradients: allocated (right by construction).
    made = _allocate_missing(q, p.device, handle, dl_stream, [
        (name, given[name], grads.get(name),
         (f"{name}= ({p.dtype}, shape {getattr(p, shape_of)})", getattr(p, shape_of), p.dtype, None))
        for name, shape_of, _ in _GRADS], caller)
    (dq, dqa), (dk, dka), (dv, dva) = made
    if not computes:
        for a in (dqa, dka, dva):  # the non-empty ones: dq (no key) or dk, dv (no query)
            _zero(a, p, handle)
        return dq, dk, dv
    dev = p.device
    _core.attention_backward(
        *(_tensor_arg(a, p.dtype, dev) for a in (doa, qa, ka, va, oa)),
        _core.TensorArg(la.ptr, la.info.shape, la.info.strides, "fp32", dev),
        *(_tensor_arg(a, p.dtype, dev) for a in (dqa, dka, dva)),
        scale,
        causal,
        deterministic,
        handle,
        workspace_ptr,
        window_size=window,
        softcap=softcap,
    )  # three launches on `handle`; the workspace is released after them (stream-ordered)
    del workspace
    return dq, dk, dv


# ======================================================================================
# flash_attn_combine_dlpack: split-KV combine on DLPack arrays (FA3's flash_attn_combine)
# ======================================================================================

from . import combine as _combine  # noqa: E402  (section appended after the forward entry)

__all__.append("flash_attn_combine_dlpack")


def _combine_out_dtype(out_dtype: Any) -> str:
    """flashgen's name for an output dtype given as None (float32), a flashgen name ('fp32',
    'bf16', 'fp16'), a framework name ('float32', 'bfloat16', 'float16') or a dtype object
    (numpy / CuPy / ml_dtypes / torch / JAX). Unknown dtypes come back as their spelling, which
    check_combine rejects with a TypeError naming it."""
    if out_dtype is None:
        return "fp32"
    if isinstance(out_dtype, str):
        if out_dtype in _combine.OUT_DTYPES:
            return out_dtype
        spelled = out_dtype
    else:
        spelled = getattr(out_dtype, "name", None)  # numpy / CuPy / ml_dtypes / JAX dtypes
        if not isinstance(spelled, str):
            spelled = getattr(out_dtype, "__name__", None) or str(out_dtype)  # np.float32; torch.float32
    return _DTYPE_BY_NAME.get(spelled.rsplit(".", 1)[-1], spelled)


def flash_attn_combine_dlpack(out_partial, lse_partial, *, out: Any = None, lse: Any = None,
                              out_dtype: Any = None, stream: Any = None):
    """Merge split-KV partial attention outputs on DLPack arrays; returns ``(out, lse)``.

    Same computation, rules and errors as :func:`flashgen.interface.flash_attn_combine` (FA3's
    ``flash_attn_combine``; split-KV / flash-decoding, FlashAttention-3 arXiv 2407.08608, §3),
    without torch: per row (b, l, h), ``M = max_s L_s``, ``w_s = exp(L_s - M)``,
    ``lse = M + log(sum_s w_s)``, ``out = sum_s (w_s / sum w) out_partial_s`` in fp32; splits
    with L_s = -inf are skipped (never read), all -inf gives out 0 and lse -inf.

    Args:
        out_partial: float32 ``(num_splits, batch, seqlen, heads, head_dim)`` CUDA array (any
            object with ``__dlpack__`` / ``__dlpack_device__``: CuPy, JAX, torch, ...),
            1 <= num_splits <= 256, 1 <= head_dim <= 256, last dim contiguous, other strides free.
        lse_partial: float32 ``(num_splits, batch, seqlen, heads)``, natural log, any strides.
        out: optional ``(batch, seqlen, heads, head_dim)`` array of out_dtype on the same device,
            last dim contiguous, written in place.
        lse: optional float32 array written in place: the ``(batch, seqlen, heads)`` transposed
            view of a contiguous ``(batch, heads, seqlen)`` buffer, or that buffer itself.
        out_dtype: None (float32), 'fp32' / 'bf16' / 'fp16', 'float32' / 'bfloat16' / 'float16',
            or a dtype object (numpy, CuPy, ml_dtypes, torch, JAX). With ``out``, it must be
            out's dtype.
        stream: where to launch: None = the legacy default stream (handle 0), an int CUstream
            handle, or a stream object (``__cuda_stream__``, torch.cuda.Stream,
            cupy.cuda.Stream); also passed to each array's ``__dlpack__`` (stream handshake).

    Missing outputs are allocated on ``stream``: with torch when out_partial is a torch tensor,
    else with CuPy (float32 / float16 out; CuPy has no bfloat16, so pass ``out`` for bf16).
    The allocated lse is always the ``(batch, seqlen, heads)`` transposed view of a
    contiguous ``(batch, heads, seqlen)`` buffer (torch ``transpose(1, 2)``, CuPy
    ``transpose(0, 2, 1)``). No copy of any input is ever made.

    Returns:
        ``(out, lse)``: the given arrays, or the allocated ones. batch, seqlen or heads of 0
        launch nothing.

    Raises:
        TypeError: an argument is not a DLPack array; dtypes wrong (see flash_attn_combine);
            no allocator for missing outputs, or a bf16 out to allocate with CuPy.
        ValueError: arrays not in CUDA memory or not on one device; shapes, ranges or layouts
            (see flash_attn_combine); lse not of the layout above; an output read-only.
        flashgen.InputError (alias flashgen.combine.CombineArgumentError): dtype and shape
            problems together (both a TypeError and a ValueError).
        RuntimeError: GPU not compute capability 9.x.
        flashgen.dispatch.MissingVariantError: no combine variant for out_dtype is built.

    Every problem found is listed in the one error, one line each, with the same messages as
    flash_attn_combine's: first those of out_partial, lse_partial, out_dtype and out; once
    those are valid, those of lse (whose expected shape comes from out_partial).
    """
    handle = _stream_handle(stream)
    dl_stream = _dlpack_stream(handle)
    # Every problem of out_partial, lse_partial, out_dtype and out in one error (as flash_attn_combine's).
    given = [("out_partial", out_partial), ("lse_partial", lse_partial)] + ([("out", out)] if out is not None else [])
    arrays, problems = _read_all(given, dl_stream)
    opa, lpa, oa = (arrays.get(name) for name in ("out_partial", "lse_partial", "out"))
    op_info, lp_info, out_info = (None if a is None else a.info for a in (opa, lpa, oa))
    out_dtype = _combine_out_dtype(out_dtype)
    if oa is not None:
        problems += _readonly(oa)
    if opa is None or lpa is None:
        _v.raise_problems(problems + _combine.combine_problems(op_info, lp_info, out_dtype, out_info),
                          _combine.CONTEXT)
    p = _combine.check_combine(op_info, lp_info, out_dtype, out_info, also=problems)
    _v.check_capability(_core.device_capability(p.device), p.device)
    la = None
    if lse is not None:  # its expected shape and device come from the arguments checked above
        arrays, problems = _read_all([("lse", lse)], dl_stream)
        la = arrays.get("lse")
        if la is not None:
            problems += _readonly(la) + _combine.combine_lse_problems(la.info, p, la.ptr)
        _v.raise_problems(problems, _combine.CONTEXT)
    # Missing outputs: allocated (right by construction).
    (out, oa), (lse, la) = _allocate_missing(out_partial, p.device, handle, dl_stream, [
        ("out", out, oa, (f"out= ({p.out_dtype}, shape {p.out_shape})", p.out_shape, p.out_dtype, None)),
        ("lse", lse, la, (f"lse= (float32, the (batch, seqlen, heads) = {p.lse_shape} transpose of a contiguous "
                          f"{p.lse_buffer_shape} buffer)", (p.batch, p.heads, p.seqlen), "fp32", (0, 2, 1)))],
        caller="flash_attn_combine_dlpack: ")
    if p.nothing_to_compute:
        return out, lse
    dev = p.device
    _combine.attention_combine(
        _core.TensorArg(opa.ptr, opa.info.shape, opa.info.strides, "fp32", dev),
        _core.TensorArg(lpa.ptr, lpa.info.shape, lpa.info.strides, "fp32", dev),
        _core.TensorArg(oa.ptr, oa.info.shape, oa.info.strides, p.out_dtype, dev),
        _core.TensorArg(la.ptr, la.info.shape, la.info.strides, "fp32", dev),
        p.out_dtype,
        handle,
    )  # selects the variant (cached) and raises MissingVariantError before launching
    return out, lse
