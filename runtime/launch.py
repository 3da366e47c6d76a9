"""Loading fatbins and launching kernels with cuda-python (cuda.bindings.driver); generic over families.

Per (variant, role, device), once: cuLibraryLoadData (per variant), cuLibraryGetKernel,
cuKernelGetFunction and raising the kernel's dynamic shared-memory limit; a params packer built
from the layout the manifest records. Per call (:func:`launch`, or :func:`launch_prepared` for a
launch whose fixed part :func:`prepare_launch` resolved once): the params bytes and the argument
array are built for that call alone, so any number of threads and streams may launch at once;
kernels without a cluster or a programmatic dependency (PDL) launch with cuLaunchKernel, others with
cuLaunchKernelEx. TMA descriptors (:func:`tensor_map`) are immutable once encoded and cached by every
argument including the address, so sharing them between calls is safe.

A launch runs in the device's primary context (the one torch, CuPy and JAX use); when another
context is current on the calling thread it is pushed for the launch and popped after, so a call
never changes the caller's current context or device.
"""

from __future__ import annotations

import ctypes
import operator
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from .manifest import Kernel, Variant, read_fatbin

_lock = threading.RLock()  # loading (re-entered by get_kernel -> primary_context) and a stream's first tile counter only
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


# ------------------------------------------------------------------------------------ caches
def cache_put(cache: dict, key, value, limit: int):
    """``cache[key] = value`` in a bounded per-process cache of immutable values, emptied first when it
    holds ``limit`` entries (dropping entries is always safe: a miss only rebuilds one). Returns
    ``value``. The runtime's lookup caches (kernels' streams, TMA maps, prepared calls) use it; values
    are never mutated after insertion, so concurrent callers may share them."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


# ------------------------------------------------------------------------------------ devices
_initialized = False
_primary: dict[int, object] = {}  # device ordinal -> retained primary CUcontext (one retain per process)


def primary_context(device: int):
    """The device's primary context, retained once per process (what torch and CuPy use)."""
    ctx = _primary.get(device)
    if ctx is None:
        global _initialized
        with _lock:
            ctx = _primary.get(device)
            if ctx is None:
                d = _driver()
                if not _initialized:
                    check(d.cuInit(0), "cuInit")
                    _initialized = True
                dev = check(d.cuDeviceGet(device), "cuDeviceGet")
                ctx = _primary[device] = check(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return ctx


def _push_primary(device: int) -> bool:
    """Make the device's primary context current on this thread if another one is (or none is):
    True when it was pushed (the caller pops it after). The launch path's context step."""
    d = _driver()
    ctx = _primary.get(device) or primary_context(device)
    err, cur = d.cuCtxGetCurrent()
    if err:
        check((err, cur), "cuCtxGetCurrent")
    # cuda-bindings' handles compare by value (``!=`` about 20 ns, two int() about 180 ns on an H200
    # host); where a handle type compares by identity only, the ints decide, as before.
    if cur is None or (cur != ctx and int(cur) != int(ctx)):
        check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        return True
    return False


class device_context:
    """``with device_context(device):`` makes the device's primary context current for the block
    and restores the caller's afterwards (pushed and popped only when it differs)."""

    __slots__ = ("device", "pushed")

    def __init__(self, device: int):
        self.device = device
        self.pushed = False

    def __enter__(self):
        self.pushed = _push_primary(self.device)
        return self

    def __exit__(self, *exc):
        if self.pushed:
            check(_driver().cuCtxPopCurrent(), "cuCtxPopCurrent")
        return False


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


_capabilities: dict[int, tuple[int, int]] = {}  # device -> (major, minor); checked on every API call


def device_capability(device: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device `device` (asked once per device)."""
    cap = _capabilities.get(device)
    if cap is None:
        cap = _capabilities[device] = (
            device_attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            device_attribute(device, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        )
    return cap


def num_sms(device: int) -> int:
    return device_attribute(device, "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT")


def dram_bandwidth(device: int) -> float:
    """The device memory's peak bandwidth in bytes per microsecond: 2 transfers per memory clock (kHz, as the
    driver reports it) times the bus width (bits) / 8 (an H100 SXM: 3.35e6, 3.35 TB/s)."""
    clock_khz = device_attribute(device, "CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE")
    bus_bits = device_attribute(device, "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH")
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e6


_names: dict[int, str] = {}


def device_name(device: int) -> str:
    """The device's name as cuDeviceGetName reports it (the string torch.cuda.get_device_name
    gives, e.g. "NVIDIA H100 80GB HBM3"); cached per device."""
    name = _names.get(device)
    if name is None:
        d = _driver()
        check(d.cuInit(0), "cuInit")
        dev = check(d.cuDeviceGet(device), "cuDeviceGet")
        raw = check(d.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = _names[device] = (raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes)
                                 else str(raw)).strip()
    return name


# ------------------------------------------------------------------------------------ params
_FORMAT = {"i32": "i", "u32": "I", "i64": "q", "f32": "f", "ptr": "Q"}
_SLOT_STRUCTS = {code: struct.Struct("<" + code) for code in _FORMAT.values()}


class ParamsPacker:
    """Packs a kernel's params struct from the layout the manifest records
    (``{"struct", "size", "fields": [[name, type, offset], ...]}``, docs/CONTRACTS.md §3)."""

    __slots__ = ("names", "size", "_struct", "_slots", "_codes")

    def __init__(self, layout: dict):
        fmt, pos = "<", 0
        self.names = []
        self._slots = {}  # field name -> (pack_into of its type, byte offset)
        self._codes = {}  # field name -> its struct format code
        for name, typ, off in layout["fields"]:
            if off < pos:
                raise ValueError(f"params {layout['struct']}: field {name} overlaps the previous one")
            fmt += f"{off - pos}x" if off > pos else ""
            fmt += _FORMAT[typ]
            pos = off + struct.calcsize("<" + _FORMAT[typ])
            self.names.append(name)
            self._slots[name] = (_SLOT_STRUCTS[_FORMAT[typ]].pack_into, off)
            self._codes[name] = _FORMAT[typ]
        self.size = int(layout["size"])
        fmt += f"{self.size - pos}x" if self.size > pos else ""
        self._struct = struct.Struct(fmt)
        if self._struct.size != self.size:
            raise ValueError(f"params {layout['struct']}: fields span {self._struct.size} bytes, layout says {self.size}")

    def pack(self, values: dict) -> bytes:
        """The struct's bytes; KeyError naming a missing field, struct.error for a bad value."""
        try:
            return self._struct.pack(*[values[n] for n in self.names])
        except KeyError as e:
            raise KeyError(f"params field {e.args[0]!r} not given (fields: {', '.join(self.names)})") from None

    def slots(self, names: tuple) -> tuple:
        """``((pack_into, offset), ...)`` writing the fields ``names`` (in that order) into packed
        bytes: how :func:`launch_prepared` fills a call's own fields. KeyError for an unknown name."""
        try:
            return tuple(self._slots[n] for n in names)
        except KeyError as e:
            raise KeyError(f"params field {e.args[0]!r} not in the struct (fields: {', '.join(self.names)})") from None


# ------------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class LoadedKernel:
    """A kernel resolved in a device's primary context; immutable, shared by all calls."""

    variant: Variant
    record: Kernel  # the manifest's kernel record (threads, smem_bytes, cluster, tensor_maps, params)
    function: object  # CUfunction
    device: int
    packer: ParamsPacker
    argv_type: type = field(init=False, repr=False, compare=False)  # ctypes void*[maps + 1]: the argument array
    params_type: type = field(init=False, repr=False, compare=False)  # ctypes char[size]: a call's params buffer
    # cuLaunchKernelEx's attributes (cluster shape, PDL), built once (built per call they took about 6 us
    # of host time per launch on the build machine's CPU) and never modified; () for cuLaunchKernel
    launch_attrs: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "argv_type", ctypes.c_void_p * (len(self.record.tensor_maps) + 1))
        object.__setattr__(self, "params_type", ctypes.c_char * self.packer.size)
        object.__setattr__(self, "launch_attrs", _launch_attrs(self.record))


#: Set to 0 to launch ``pdl`` kernels as plain stream-ordered launches (read when a kernel is loaded): each
#: kernel then runs after the one before it has completed, so profilers time each kernel alone
#: (scripts/bwd_split.py), and a process can be compared with one that overlaps them.
PDL_ENV = "FLASHGEN_PDL"


def _launch_attrs(rec: Kernel) -> tuple:
    """The CUlaunchAttributes of a kernel record: its cluster shape when not (1, 1, 1), programmatic
    stream serialization when it is a ``pdl`` kernel (docs/CONTRACTS.md §4) and ``$FLASHGEN_PDL`` is not
    ``0`` (such a kernel's ``griddepcontrol.wait`` returns at once when launched without it)."""
    clustered = tuple(rec.cluster) != (1, 1, 1)
    pdl = rec.pdl and os.environ.get(PDL_ENV, "1").strip() != "0"
    if not (clustered or pdl):
        return ()
    d, attrs = _driver(), []
    if clustered:
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = rec.cluster
        attrs.append(attr)
    if pdl:  # may overlap the previous kernel on the stream (manifest Kernel.pdl)
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    return tuple(attrs)


_libraries: dict[str, object] = {}
_kernels: dict[tuple[str, str, int], LoadedKernel] = {}


def get_kernel(variant: Variant, role: str, device: int) -> LoadedKernel:
    """Load the variant's fatbin (once per process) and resolve its ``role`` kernel for ``device``
    (once); KeyError if the variant has no such kernel, ManifestError if the fatbin's sha256
    differs from the manifest's, CudaError if the driver refuses it."""
    key = (variant.name, role, device)
    k = _kernels.get(key)
    if k is not None:
        return k
    rec = variant.kernel(role)
    with _lock:
        k = _kernels.get(key)
        if k is not None:
            return k
        d = _driver()
        with device_context(device):
            lib = _libraries.get(variant.name)
            if lib is None:
                data = read_fatbin(variant.fatbin, variant.sha256)
                lib = check(d.cuLibraryLoadData(data, None, None, 0, None, None, 0), f"cuLibraryLoadData({variant.name})")
                _libraries[variant.name] = lib
            kern = check(d.cuLibraryGetKernel(lib, rec.symbol.encode()), f"cuLibraryGetKernel({rec.symbol})")
            func = check(d.cuKernelGetFunction(kern), "cuKernelGetFunction")
            if rec.smem_bytes > 0:
                check(
                    d.cuFuncSetAttribute(
                        func, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, rec.smem_bytes
                    ),
                    f"cuFuncSetAttribute(max dynamic smem = {rec.smem_bytes})",
                )
        k = LoadedKernel(variant, rec, func, device, ParamsPacker(rec.params))
        _kernels[key] = k
        return k


_streams: dict[int, object] = {}  # CUstream wrappers by handle (immutable values; bounded)
_STREAM_CACHE_MAX = 1024


def _stream(handle: int):
    s = _streams.get(handle)
    if s is None:
        s = cache_put(_streams, handle, _driver().CUstream(handle), _STREAM_CACHE_MAX)
    return s


# ------------------------------------------------------------------------------------ tile counters
# A causal persistent forward claims its tiles from an int32 that is 0 when the kernel starts, and the kernel
# leaves it at 0 (scheduler.cuh TileScheduler::next: the claims are an atomicInc that wraps at num_tiles - 1, and the
# launch makes exactly num_tiles of them). So one counter per stream serves every launch on that stream in turn: the
# stream orders them, and no memset runs before each (1.1-1.6 % of a causal 512 / 1k call on the H100, session 12;
# and three driver calls of host time). Launches on other streams have counters of their own. Under CUDA-graph
# capture a launch still takes a counter of its own (an allocation, memset and free of the graph's): a graph may be
# replayed on any stream, beside eager calls.
_COUNTER_POOL_KEEP = 1 << 20  # bytes the pool keeps reserved across synchronizations (its counters are 4 bytes)
_counter_pools: dict[int, object] = {}  # device -> CUmemoryPool (flashgen's own, made once)
# (device, stream handle) -> that stream's tile counter (a device address), made once per stream and never freed
# (4 bytes). Handles 0 (the default stream, which is per thread where cuda-python runs with per-thread default
# streams) and 2 (CU_STREAM_PER_THREAD) may name another stream on each thread: keyed (device, -1, the driver's
# stream id). A stream's handle comes back only once its work is done (cuStreamDestroy releases it then).
_stream_counters: dict[tuple, int] = {}
_NOT_CAPTURING = 0  # CU_STREAM_CAPTURE_STATUS_NONE (an int enum)


def _counter_pool(device: int):
    """flashgen's stream-ordered memory pool on ``device`` for tile counters: its own pool
    (the device's default pool is left as it is), keeping _COUNTER_POOL_KEEP bytes reserved so a
    synchronization does not hand its memory back. Made once per device, in the primary context."""
    return _make_pool(device, _COUNTER_POOL_KEEP, _counter_pools)


def _zeroed_counter(device: int, hstream) -> int:
    """A new int32 tile counter on ``device``: 4 bytes from :func:`_counter_pool`, allocated and zeroed on
    ``hstream`` (stream-ordered: zero for any launch that follows there). CudaError if the driver refuses either."""
    d = _driver()
    ptr = int(check(d.cuMemAllocFromPoolAsync(4, _counter_pools.get(device) or _counter_pool(device), hstream),
                    "cuMemAllocFromPoolAsync(tile counter)"))
    check(d.cuMemsetD32Async(ptr, 0, 1, hstream), "cuMemsetD32Async(tile counter)")
    return ptr


def _stream_counter(device: int, stream: int, hstream) -> int:
    """The tile counter of ``stream`` (a CUstream handle as int; ``hstream`` its wrapper) on ``device``: made on
    the first call for that stream (:func:`_zeroed_counter`), then the same address. In the primary context (the
    caller's). CudaError if the driver refuses the allocation, memset or stream id."""
    if stream > 2:
        key = (device, stream)
    else:
        key = (device, -1, int(check(_driver().cuStreamGetId(hstream), "cuStreamGetId")))
    ptr = _stream_counters.get(key)
    if ptr is None:
        with _lock:  # (once per stream)
            ptr = _stream_counters.get(key)
            if ptr is None:
                ptr = _stream_counters[key] = _zeroed_counter(device, hstream)
    return ptr


#: Bytes flashgen's scratch pool keeps reserved across synchronizations (per-call scratch: the
#: FP8 forward's V^T with vt_global variants). Above it, a synchronization hands memory back to
#: the driver, and the next call's allocation maps it again.
_SCRATCH_POOL_KEEP = 256 << 20
_scratch_pools: dict[int, object] = {}  # device -> CUmemoryPool (flashgen's own, made once)


def _make_pool(device: int, keep: int, pools: dict):
    """A stream-ordered memory pool of flashgen's own on ``device`` (the device's default pool is
    left as it is) that keeps ``keep`` bytes reserved across synchronizations; made once per device
    and kept in ``pools``, in the primary context."""
    pool = pools.get(device)
    if pool is None:
        with _lock:
            pool = pools.get(device)
            if pool is None:
                d = _driver()
                props = d.CUmemPoolProps()
                props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                props.handleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
                props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                props.location.id = device
                pool = check(d.cuMemPoolCreate(props), "cuMemPoolCreate")
                check(d.cuMemPoolSetAttribute(pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                              d.cuuint64_t(keep)), "cuMemPoolSetAttribute")
                pools[device] = pool
    return pool


class scratch:
    """``with scratch(device, nbytes, stream) as ptr:`` ``nbytes`` of device memory (256-byte
    aligned, uninitialised) that belongs to this call alone: allocated from flashgen's scratch pool
    on ``stream`` (a CUstream handle as int) on entry and freed on ``stream`` on exit, both
    stream-ordered, so kernels launched on ``stream`` inside the block may use it and later work
    reuses it only after them (under CUDA-graph capture: the graph's own allocation and free
    nodes). In the device's primary context, as a launch. CudaError if the allocation fails."""

    __slots__ = ("device", "nbytes", "stream", "ptr")

    def __init__(self, device: int, nbytes: int, stream: int):
        self.device, self.nbytes, self.stream, self.ptr = device, int(nbytes), stream, None

    def __enter__(self) -> int:
        with device_context(self.device):
            pool = _scratch_pools.get(self.device) or _make_pool(self.device, _SCRATCH_POOL_KEEP, _scratch_pools)
            self.ptr = check(_driver().cuMemAllocFromPoolAsync(max(self.nbytes, 1), pool, _stream(self.stream)),
                             f"cuMemAllocFromPoolAsync(scratch, {self.nbytes} bytes)")
        return int(self.ptr)

    def __exit__(self, *exc):
        with device_context(self.device):
            check(_driver().cuMemFreeAsync(self.ptr, _stream(self.stream)), "cuMemFreeAsync(scratch)")


def _launch_argv(kernel: LoadedKernel, grid: tuple, argv, stream: int, counter=None, buf=None) -> None:
    """Launch ``kernel`` with the argument array ``argv`` (a ctypes object whose memory starts with
    it: a void* array, or :func:`launch_prepared`'s argument block; kept alive by the caller) in the
    device's primary context: pushed only when another one is current on this thread, and popped
    after (:func:`_push_primary`, as :class:`device_context`; no context-manager object on this
    per-call path).

    ``counter`` ((pack_into, offset) of a pointer field in ``buf``, the bytes holding the params:
    :func:`launch_prepared`'s argument block, the offset counting from its start): the field gets an
    int32 tile counter that is zero when the kernel starts and that the kernel leaves at zero: the
    stream's (:func:`_stream_counter`, so launches on one stream take it in turn and launches on
    others never share it); under CUDA-graph capture one of the launch's own instead
    (:func:`_zeroed_counter` on ``stream``, freed on ``stream`` after the kernel: the graph's own
    allocation, memset and free nodes, as a graph may be replayed on any stream)."""
    rec = kernel.record
    d = _driver()
    pushed = _push_primary(kernel.device)
    ctr = None
    try:
        hstream = _streams.get(stream) or _stream(stream)
        if counter is not None:
            if check(d.cuStreamIsCapturing(hstream), "cuStreamIsCapturing") == _NOT_CAPTURING:
                ptr = _stream_counters.get((kernel.device, stream)) or _stream_counter(kernel.device, stream, hstream)
            else:
                ctr = ptr = _zeroed_counter(kernel.device, hstream)
            counter[0](buf, counter[1], ptr)
        attrs = kernel.launch_attrs
        if not attrs:
            err = d.cuLaunchKernel(kernel.function, grid[0], grid[1], grid[2], rec.threads, 1, 1, rec.smem_bytes,
                                   hstream, ctypes.addressof(argv), 0)[0]
            what = "cuLaunchKernel"
        else:
            cfg = d.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = rec.threads, 1, 1
            cfg.sharedMemBytes = rec.smem_bytes
            cfg.hStream = hstream
            cfg.attrs = list(attrs)
            cfg.numAttrs = len(attrs)
            err = d.cuLaunchKernelEx(cfg, kernel.function, ctypes.addressof(argv), 0)[0]
            what = "cuLaunchKernelEx"
    finally:
        if ctr is not None:
            check(d.cuMemFreeAsync(ctr, hstream), "cuMemFreeAsync(tile counter)")
        if pushed:
            check(d.cuCtxPopCurrent(), "cuCtxPopCurrent")
    if err:
        check((err,), f"{what}({rec.symbol})")


def launch(kernel: LoadedKernel, grid: tuple, tensor_maps: tuple, params: dict, stream: int,
           device: int | None = None) -> None:
    """Launch ``kernel`` on ``stream`` (a CUstream handle as int) over ``grid`` (x, y, z) CTAs of
    the recorded thread count, with the recorded dynamic shared memory and cluster shape.

    ``tensor_maps``: one CUtensorMap per name in the kernel's ``tensor_maps`` record, in order;
    ``params``: the params struct's fields by name; ``device``, if given, must be the kernel's.
    Everything built here belongs to this call. Raises ValueError for a wrong number of tensor
    maps or another device, KeyError for a missing field, CudaError if the launch fails."""
    rec = kernel.record
    if device is not None and device != kernel.device:
        raise ValueError(f"flashgen: kernel {rec.symbol} was loaded for cuda:{kernel.device}, not cuda:{device}")
    if len(tensor_maps) != len(rec.tensor_maps):
        raise ValueError(f"flashgen: {rec.symbol} takes tensor maps {list(rec.tensor_maps)}, got {len(tensor_maps)}")
    buf = kernel.params_type.from_buffer_copy(kernel.packer.pack(params))
    argv = kernel.argv_type(*[m.getPtr() for m in tensor_maps], ctypes.addressof(buf))
    _launch_argv(kernel, tuple(int(g) for g in grid), argv, stream)


class PreparedLaunch(NamedTuple):
    """A launch of one kernel whose grid and params are fixed except for a few per-call fields
    (device addresses, scales): made once by :func:`prepare_launch`, launched any number of times
    by :func:`launch_prepared`. Immutable, so calls on any thread may share it.

    Each launch packs its own argument block (``block_type``, zeroed when made): the argument array
    (one pointer per tensor map, then the params' address, ``head`` bytes) followed by the params
    struct, written by ONE ``pack_block`` call whose arguments ``arrange`` picks from (map pointers,
    params address, per-call values, ``chunks``): the per-call fields in offset order and, between
    them, the fixed bytes of ``params`` as ``Ns`` chunks. One ctypes object and one pack per launch
    instead of a params copy, a pack_into per field and a ctypes array built from Python ints
    (about 1 us less host time per call)."""

    kernel: LoadedKernel
    grid: tuple  # (x, y, z) CTAs, ints
    params: bytes  # the packed params struct, the per-call fields zero
    per_call: tuple  # the names of the per-call fields, in launch_prepared's order
    counter: tuple | None = None  # (pack_into, offset in the argument block) of the pointer field that gets the
    #                               launch's tile counter (_launch_argv: the stream's, or under capture its own)
    block_type: type | None = None  # ctypes uint64[n]: the argument array and the params, 8-byte aligned
    head: int = 0  # bytes of the argument array: where the params start in the block
    pack_block: object = None  # Struct.pack_into writing the whole block
    arrange: object = None  # operator.itemgetter: pack_block's arguments from
    #                         (map pointers..., params address, values..., chunks...)
    chunks: tuple = ()  # the fixed params bytes between (and around) the per-call fields


def _block_layout(kernel: LoadedKernel, params: bytes, per_call: tuple) -> tuple:
    """(block_type, head, pack_block, arrange, chunks) of :class:`PreparedLaunch` for these per-call
    fields (names) over the packed ``params``. ValueError if two per-call fields overlap."""
    packer = kernel.packer
    nmaps = len(kernel.record.tensor_maps)
    head = 8 * (nmaps + 1)
    nv = len(per_call)
    offsets = [off for _, off in packer.slots(per_call)]  # KeyError naming an unknown field
    fmt, picks, chunks, pos = ["<", "Q" * (nmaps + 1)], list(range(nmaps + 1)), [], 0
    for i in sorted(range(nv), key=offsets.__getitem__):
        name = per_call[i]
        code, off = packer._codes[name], offsets[i]
        if off < pos:
            raise ValueError(f"flashgen: per-call params field {name!r} overlaps another")
        if off > pos:  # the fixed bytes before this field
            fmt.append(f"{off - pos}s")
            picks.append(nmaps + 1 + nv + len(chunks))
            chunks.append(params[pos:off])
        fmt.append(code)
        picks.append(nmaps + 1 + i)
        pos = off + struct.calcsize("<" + code)
    if len(params) > pos:
        fmt.append(f"{len(params) - pos}s")
        picks.append(nmaps + 1 + nv + len(chunks))
        chunks.append(params[pos:])
    block = struct.Struct("".join(fmt))
    arrange = operator.itemgetter(*picks) if len(picks) > 1 else (lambda t, i=picks[0]: (t[i],))
    return ctypes.c_uint64 * (-(-block.size // 8)), head, block.pack_into, arrange, tuple(chunks)


def prepare_launch(kernel: LoadedKernel, grid: tuple, params: dict, per_call: tuple,
                   counter: str | None = None) -> PreparedLaunch:
    """The fixed part of a launch of ``kernel`` over ``grid``: ``params`` gives every field of the
    params struct but those named in ``per_call``, whose values each :func:`launch_prepared` call
    gives, in that order, and ``counter``, a pointer field that each launch fills with an int32
    tile counter, zero at the kernel's start, that the kernel leaves at zero (:func:`_launch_argv`:
    the stream's, or under CUDA-graph capture one of the launch's own). KeyError for a missing or
    unknown field, struct.error for a bad value."""
    extra = (counter,) if counter else ()
    fixed = {**params, **{n: 0 for n in (*per_call, *extra)}}
    packed = kernel.packer.pack(fixed)
    block_type, head, pack_block, arrange, chunks = _block_layout(kernel, packed, tuple(per_call))
    ctr = None
    if counter:
        pack_into, offset = kernel.packer.slots(extra)[0]
        ctr = (pack_into, head + offset)  # in the argument block, after the argument array
    return PreparedLaunch(kernel, tuple(int(g) for g in grid), packed, tuple(per_call), ctr, block_type, head,
                          pack_block, arrange, chunks)


def launch_prepared(prep: PreparedLaunch, tensor_maps: tuple, values: tuple, stream: int) -> None:
    """Launch ``prep`` on ``stream`` (a CUstream handle as int), with ``tensor_maps`` (one per
    name in the kernel's ``tensor_maps`` record) and ``values``, the per-call fields in the order
    :func:`prepare_launch` was given. The argument block (argument array and params bytes) is this
    call's own. ValueError for a wrong number of tensor maps or values, struct.error for a bad
    value, CudaError if the launch fails."""
    kernel = prep.kernel
    if len(tensor_maps) != len(kernel.record.tensor_maps) or len(values) != len(prep.per_call):
        raise ValueError(f"flashgen: {kernel.record.symbol} takes tensor maps {list(kernel.record.tensor_maps)} and "
                         f"{len(prep.per_call)} per-call params, got {len(tensor_maps)} and {len(values)}")
    block = prep.block_type()  # this call's own, zeroed
    prep.pack_block(block, 0, *prep.arrange((*[m.getPtr() for m in tensor_maps], ctypes.addressof(block) + prep.head,
                                             *values, *prep.chunks)))
    _launch_argv(kernel, prep.grid, block, stream, prep.counter, block)


# ------------------------------------------------------------------------------------- TMA maps
_TMA_DTYPES = {
    "bf16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
    "fp16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2),
    "e4m3": ("CU_TENSOR_MAP_DATA_TYPE_UINT8", 1),  # TMA moves bytes; the kernel reads them as e4m3
    "fp32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4),
}
_SWIZZLE = {0: "CU_TENSOR_MAP_SWIZZLE_NONE", 32: "CU_TENSOR_MAP_SWIZZLE_32B",
            64: "CU_TENSOR_MAP_SWIZZLE_64B", 128: "CU_TENSOR_MAP_SWIZZLE_128B"}
_TMAP_CACHE_MAX = 4096
_tmaps: dict[tuple, object] = {}  # (TensorMapGeometry, address) -> CUtensorMap (immutable; bounded)
_geometries: dict[tuple, "TensorMapGeometry"] = {}  # tensor_map's arguments but the address -> geometry (bounded)


class TensorMapGeometry:
    """Everything of a tiled TMA descriptor but its address, checked once (:func:`map_geometry`);
    :func:`tensor_map_at` gives its descriptor at an address. Immutable; compared and hashed by
    identity, so a cache key holding one is cheap (and keeps it alive); map_geometry hands equal
    arguments the same object. The driver's argument objects are built at the first encode."""

    __slots__ = ("dtype", "dims", "strides_bytes", "box", "swizzle", "device", "_encode_args")

    def __init__(self, dtype: str, dims: tuple, strides_bytes: tuple, box: tuple, swizzle: int, device):
        self.dtype, self.dims, self.strides_bytes, self.box = dtype, tuple(dims), tuple(strides_bytes), tuple(box)
        self.swizzle, self.device = swizzle, device
        self._encode_args = None

    def __repr__(self):
        return (f"TensorMapGeometry({self.dtype}, dims={self.dims}, strides={self.strides_bytes}, box={self.box}, "
                f"swizzle={self.swizzle}, device={self.device})")

    def encode_args(self) -> tuple:
        """cuTensorMapEncodeTiled's arguments but the address: (dtype, rank, dims, strides, box,
        element strides, interleave, swizzle, L2 promotion, OOB fill), driver objects made once."""
        args = self._encode_args
        if args is None:
            d = _driver()
            rank = len(self.dims)
            args = self._encode_args = (
                getattr(d.CUtensorMapDataType, _TMA_DTYPES[self.dtype][0]), rank,
                tuple(d.cuuint64_t(int(x)) for x in self.dims), tuple(d.cuuint64_t(int(x)) for x in self.strides_bytes),
                tuple(d.cuuint32_t(int(x)) for x in self.box), tuple(d.cuuint32_t(1) for _ in range(rank)),
                d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, getattr(d.CUtensorMapSwizzle, _SWIZZLE[self.swizzle]),
                d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        return args


def map_geometry(dtype: str, dims: tuple, strides_bytes: tuple, box: tuple, swizzle: int = 128,
                 device: int | None = None) -> TensorMapGeometry:
    """The :class:`TensorMapGeometry` of :func:`tensor_map`'s arguments but the address (one
    object per distinct arguments while cached). ValueError for a bad dtype, swizzle or rank."""
    key = (dtype, dims, strides_bytes, box, swizzle, device)
    g = _geometries.get(key)
    if g is None:
        if dtype not in _TMA_DTYPES:
            raise ValueError(f"flashgen: tensor_map dtype {dtype!r} not one of {', '.join(_TMA_DTYPES)}")
        if swizzle not in _SWIZZLE:
            raise ValueError(f"flashgen: tensor_map swizzle {swizzle!r} not one of {', '.join(map(str, _SWIZZLE))}")
        rank = len(dims)
        if not (1 <= rank <= 5 and len(box) == rank and len(strides_bytes) == rank - 1):
            raise ValueError(f"flashgen: tensor_map needs rank 1..5 with len(box) = rank and rank - 1 strides; "
                             f"got dims {dims}, strides {strides_bytes}, box {box}")
        g = TensorMapGeometry(dtype, dims, strides_bytes, box, swizzle, device)
        cache_put(_geometries, key, g, _TMAP_CACHE_MAX)
    return g


def tensor_map(ptr: int, dtype: str, dims: tuple, strides_bytes: tuple, box: tuple, swizzle: int = 128,
               device: int | None = None):
    """A tiled TMA descriptor (cuTensorMapEncodeTiled) of rank len(dims) <= 5.

    dims: extents innermost first; strides_bytes: byte strides of dims 1.. (multiples of 16);
    box: tile extent per dim (innermost box bytes <= the swizzle width when swizzled); dtype one of
    fp16, bf16, e4m3, fp32; swizzle 0, 32, 64 or 128 bytes. Out-of-range elements load as zeros.
    The map is immutable and cached by all arguments (the address included): calls on any thread
    may share it. ``device``: the ordinal the memory lives on; the driver encodes a map only with a
    context current, so a new map is encoded inside :class:`device_context` (pass it whenever the
    calling thread may have no context, i.e. always from an API path). ValueError for a bad dtype,
    swizzle or rank; CudaError if the driver refuses. Same as
    ``tensor_map_at(map_geometry(dtype, dims, strides_bytes, box, swizzle, device), ptr)``."""
    return tensor_map_at(map_geometry(dtype, dims, strides_bytes, box, swizzle, device), ptr)


def tensor_map_at(geometry: TensorMapGeometry, ptr: int):
    """The TMA descriptor of ``geometry`` at device address ``ptr`` (see :func:`tensor_map`):
    cached by (geometry, address), encoded on a miss (inside the geometry's device's
    :class:`device_context` when it names one). CudaError if the driver refuses."""
    key = (geometry, ptr)
    tmap = _tmaps.get(key)
    if tmap is not None:
        return tmap
    d = _driver()
    dtype_, rank, dims, strides, box, elem, interleave, swizzle, l2, oob = geometry.encode_args()
    what = (f"cuTensorMapEncodeTiled(dtype={geometry.dtype}, dims={geometry.dims}, strides={geometry.strides_bytes}, "
            f"box={geometry.box})")
    if geometry.device is not None:
        with device_context(geometry.device):
            tmap = check(d.cuTensorMapEncodeTiled(dtype_, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2,
                                                  oob), what)
    else:
        tmap = check(d.cuTensorMapEncodeTiled(dtype_, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob),
                     what)
    return cache_put(_tmaps, key, tmap, _TMAP_CACHE_MAX)
