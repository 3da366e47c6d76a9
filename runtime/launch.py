"""Loading fatbins and launching kernels with cuda-python (cuda.bindings.driver).

Per variant and device, once: cuLibraryLoadData, cuLibraryGetKernel, cuKernelGetFunction and
raising the dynamic shared-memory limit. Per call: TMA descriptors from a cache keyed by
(dtype, shape, strides, box) and re-pointed with cuTensorMapReplaceAddress when only the address
changed; a ctypes parameter block; one cuLaunchKernelEx on the caller's stream.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from .manifest import Variant, read_fatbin

_lock = threading.Lock()


_drv = None


def _driver():
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError("flashgen needs cuda-python (`pip install cuda-bindings`) to launch kernels") from e
        _drv = driver
    return _drv


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def check(result, what: str):
    """Unpack a cuda.bindings (err, *values) tuple, raising CudaError on failure."""
    err, *rest = result
    if int(err) != 0:
        d = _driver()
        _, name = d.cuGetErrorName(err)
        raise CudaError(f"flashgen: {what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


_initialized = False


def ensure_context(device: int) -> None:
    """Make sure a context for `device` is current (the primary context, as torch and CuPy use)."""
    global _initialized
    d = _driver()
    if not _initialized:
        check(d.cuInit(0), "cuInit")
        _initialized = True
    ctx = check(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0:
        dev = check(d.cuCtxGetDevice(), "cuCtxGetDevice")
        if int(dev) == device:
            return
    dev = check(d.cuDeviceGet(device), "cuDeviceGet")
    pctx = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(d.cuCtxSetCurrent(pctx), "cuCtxSetCurrent")


_attr_cache: dict[tuple[int, int], int] = {}


def device_attribute(device: int, attr_name: str) -> int:
    d = _driver()
    attr = getattr(d.CUdevice_attribute, attr_name)
    key = (device, int(attr))
    if key not in _attr_cache:
        check(d.cuInit(0), "cuInit")
        dev = check(d.cuDeviceGet(device), "cuDeviceGet")
        _attr_cache[key] = int(check(d.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({attr_name})"))
    return _attr_cache[key]


def device_capability(device: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `device`."""
    return (
        device_attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
        device_attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
    )


def num_sms(device: int) -> int:
    return device_attribute(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")


# ------------------------------------------------------------------------------------------ kernels
@dataclass
class LoadedKernel:
    variant: Variant
    function: object  # CUfunction
    config: object  # CUlaunchConfig, reused (grid and stream rewritten per call)


_libraries: dict[str, object] = {}
_kernels: dict[tuple[str, int], LoadedKernel] = {}


def get_kernel(variant: Variant, device: int) -> LoadedKernel:
    """Load the variant's fatbin (once per process) and resolve its kernel for `device` (once)."""
    key = (variant.name, device)
    k = _kernels.get(key)
    if k is not None:
        return k
    with _lock:
        k = _kernels.get(key)
        if k is not None:
            return k
        d = _driver()
        ensure_context(device)
        lib = _libraries.get(variant.name)
        if lib is None:
            data = read_fatbin(variant.fatbin, variant.sha256)
            lib = check(d.cuLibraryLoadData(data, None, None, 0, None, None, 0), f"cuLibraryLoadData({variant.name})")
            _libraries[variant.name] = lib
        kern = check(d.cuLibraryGetKernel(lib, variant.symbol.encode()), f"cuLibraryGetKernel({variant.symbol})")
        func = check(d.cuKernelGetFunction(kern), "cuKernelGetFunction")
        check(
            d.cuFuncSetAttribute(
                func, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, variant.smem_bytes
            ),
            f"cuFuncSetAttribute(max dynamic smem = {variant.smem_bytes})",
        )
        cfg = d.CUlaunchConfig()
        cfg.gridDimY = cfg.gridDimZ = 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = variant.threads, 1, 1
        cfg.sharedMemBytes = variant.smem_bytes
        cfg.numAttrs = 0
        k = LoadedKernel(variant, func, cfg)
        _kernels[key] = k
        return k


# ------------------------------------------------------------------------------------- TMA maps
_TMA_DTYPES = {"bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "fp16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}
_ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class _MapEntry:
    __slots__ = ("tmap", "addr")

    def __init__(self, tmap, addr):
        self.tmap = tmap
        self.addr = addr


_tmaps: dict[tuple, _MapEntry] = {}


def tensor_map_bshd(slot: str, ptr: int, shape: tuple, strides: tuple, dtype: str, box_rows: int):
    """128B-swizzled 4-D TMA descriptor over a BSHD tensor for tiles of (box_rows x 64) elements.

    `slot` names the kernel argument the map is for ('q', 'k', 'v', 'o'): one launch passes several
    maps of identical layout, so each argument owns its cached descriptor (re-pointing a shared one
    would leave every argument at the last address).

    shape = (batch, seqlen, heads, head_dim), strides in elements (last must be 1). Dims are given
    to the driver innermost first: (head_dim, seqlen, heads, batch). Cached; only the address is
    rewritten (cuTensorMapReplaceAddress) when the same layout comes back at a new pointer.
    """
    key = (slot, dtype, shape, strides, box_rows)
    entry = _tmaps.get(key)
    d = _driver()
    if entry is not None:
        if entry.addr != ptr:
            check(d.cuTensorMapReplaceAddress(entry.tmap, ptr), "cuTensorMapReplaceAddress")
            entry.addr = ptr
        return entry.tmap
    b, s, h, hd = shape
    es = _ELEM_BYTES[dtype]
    dims = [d.cuuint64_t(hd), d.cuuint64_t(s), d.cuuint64_t(h), d.cuuint64_t(b)]
    gstrides = [d.cuuint64_t(strides[1] * es), d.cuuint64_t(strides[2] * es), d.cuuint64_t(strides[0] * es)]
    box = [d.cuuint32_t(64), d.cuuint32_t(box_rows), d.cuuint32_t(1), d.cuuint32_t(1)]
    estr = [d.cuuint32_t(1)] * 4
    tmap = check(
        d.cuTensorMapEncodeTiled(
            getattr(d.CUtensorMapDataType, _TMA_DTYPES[dtype]),
            4,
            ptr,
            dims,
            gstrides,
            box,
            estr,
            d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        f"cuTensorMapEncodeTiled(shape={shape}, strides={strides}, box_rows={box_rows})",
    )
    if len(_tmaps) > 4096:  # bound the cache; layouts are few in practice
        _tmaps.clear()
    _tmaps[key] = _MapEntry(tmap, ptr)
    return tmap


# ------------------------------------------------------------------------------------ params

class FwdParams(ctypes.Structure):
    """Mirror of flashgen::FwdParams (templates/include/flashgen/params.cuh)."""

    _fields_ = [
        ("lse", ctypes.c_void_p),
        ("seqlen_q", ctypes.c_int),
        ("seqlen_k", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("heads_k", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("num_m_blocks", ctypes.c_int),
        ("num_tiles", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
        ("softmax_scale", ctypes.c_float),
    ]


_streams: dict[int, object] = {}


def launch_fwd(kernel: LoadedKernel, maps: tuple, params: FwdParams, grid: int, stream: int) -> None:
    """cuLaunchKernelEx(kernel, grid x threads, maps..., params) on `stream` (a CUstream as int)."""
    cfg = kernel.config
    cfg.gridDimX = grid
    cs = _streams.get(stream)
    if cs is None:
        cs = _streams[stream] = _driver().CUstream(stream)
    cfg.hStream = cs
    args = (ctypes.c_void_p * 5)(maps[0].getPtr(), maps[1].getPtr(), maps[2].getPtr(), maps[3].getPtr(),
                                  ctypes.addressof(params))
    err = _driver().cuLaunchKernelEx(cfg, kernel.function, ctypes.addressof(args), 0)
    if int(err[0]) != 0:
        check(err, f"cuLaunchKernelEx({kernel.variant.name})")
