"""CPU tests of what the forward resolves once per metadata key, so that a call costs little host time:
flash_attn_func's prepared calls (``interface._fwd_calls``) and the core's prepared launches
(``core.prepare_forward`` / ``launch_forward``, ``launch.prepare_launch`` / ``launch_prepared``,
TMA maps by geometry and address).

What is asserted: a cache never serves a wrong answer (calls differing in one piece of metadata --
strides, dtype, device, causal, window, softcap, heads, seqlen, sink, descales -- get their own
entries and correct results; values that are per call -- softmax_scale, softcap's value, addresses,
stream -- are taken from each call), errors are raised as without the caches (a misaligned address
on a cached key is still copied by flash_attn_func and refused by the core), caches are bounded,
and the launch itself (params bytes, grid, TMA maps, context push/pop, cuLaunchKernel vs
cuLaunchKernelEx) is what the uncached code produced, from any number of threads.

No GPU: flash_attn_func runs on test_api_validation's emulated core (``fake_gpu``); the core and
launcher run for real on a fake CUDA driver (``driver``) that records every launch and reads its
params bytes and tensor maps back through the argument array.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

import flashgen.core as core
import flashgen.interface as interface
from flashgen import launch, tuning
from flashgen.generator.families import fwd as fwd_mod
from flashgen.interface import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from _ref import dequantize_fp8  # noqa: E402  (torch only: runs on the CPU)
from test_api_validation import fake_gpu, qkv, reference  # noqa: E402,F401  (fake_gpu: a fixture)


def close(out, q, k, v, scale, causal=False, window_size=(-1, -1), softcap=0.0, sink=None, lse=None):
    ref, ref_lse = reference(q, k, v, scale, causal, window_size, softcap, sink)
    tol = 2e-3 if out.dtype == torch.float16 else 1.6e-2
    assert (out.float() - ref).abs().max().item() <= tol
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.fixture
def prepared_launches(fake_gpu, monkeypatch):
    """The launches that went through the prepared path (core.launch_forward), as (q, k, v) addresses."""
    seen = []
    real = core.launch_forward

    def spy(prep, q_ptr, k_ptr, v_ptr, *a):
        seen.append((q_ptr, k_ptr, v_ptr))
        return real(prep, q_ptr, k_ptr, v_ptr, *a)

    monkeypatch.setattr(core, "launch_forward", spy)
    return seen


# ======================================================================== flash_attn_func's prepared calls
def test_calls_differing_in_one_piece_of_metadata_get_their_own_entries(fake_gpu, monkeypatch):
    base = qkv(b=2, sq=5, sk=7, h=4, hk=2, d=64)
    q, k, v = base
    packed = torch.randn(2, 5, 3, 4, 64).half()  # q's shape, other strides
    packed[:, :, 1] = q
    q_strided = packed[:, :, 1]
    assert q_strided.shape == q.shape and q_strided.stride() != q.stride()
    on_dev1 = set()
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1 if id(t) in on_dev1 else 0))
    qd1, kd1, vd1 = (t.clone() for t in base)
    on_dev1.update(id(t) for t in (qd1, kd1, vd1))
    bf = [t.to(torch.bfloat16) for t in base]
    gqa = qkv(b=2, sq=5, sk=7, h=4, hk=1, d=64, seed=1)
    longer = qkv(b=2, sq=5, sk=9, h=4, hk=2, d=64, seed=2)
    calls = [  # (args, kwargs, what the emulated core must have been handed)
        ((q, k, v), {}, {}),
        ((q_strided, k, v), {}, {"q_strides": q_strided.stride()}),
        (tuple(bf), {}, {"dtype": "bf16"}),
        ((qd1, kd1, vd1), {}, {"device": 1}),
        ((q, k, v), {"causal": True}, {"causal": True}),
        ((q, k, v), {"window_size": (2, 1)}, {"window_size": (2, 1)}),
        ((q, k, v), {"softcap": 4.0}, {"softcap": 4.0}),
        (gqa, {}, {"heads_k": 1}),
        (longer, {}, {"seqlen_k": 9}),
    ]
    for round_ in range(2):  # the first round fills the cache, the second hits every entry
        for i, (args, kw, want) in enumerate(calls):
            out, lse = flash_attn_func(*args, return_attn_probs=True, **kw)
            call = fake_gpu.calls[-1]
            close(out, *args, 64 ** -0.5, kw.get("causal", False), kw.get("window_size", (-1, -1)),
                  kw.get("softcap", 0.0), lse=lse)
            assert call["q"].strides == want.get("q_strides", args[0].stride()), i
            assert call["q"].dtype == want.get("dtype", "fp16") and call["q"].device == want.get("device", 0), i
            assert call["causal"] is want.get("causal", False) and call["window_size"] == want.get("window_size", (-1, -1))
            assert call["softcap"] == want.get("softcap", 0.0)
            assert (call["k"].shape[1], call["k"].shape[2]) == (want.get("seqlen_k", 7), want.get("heads_k", 2))
        assert len(interface._fwd_calls) == len(calls), round_
    assert len(fake_gpu.calls) == 2 * len(calls)
    assert len(fake_gpu.selected) == len(calls)  # one variant selection per key, none on a hit


def test_per_call_values_are_not_cached(fake_gpu):
    q, k, v = qkv()
    for scale in (None, 0.3, 0.3, -0.7, 0.0, 2):
        out, lse = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
        want = 64 ** -0.5 if scale is None else float(scale)
        assert fake_gpu.calls[-1]["scale"] == want and type(fake_gpu.calls[-1]["scale"]) is float
        close(out, q, k, v, want, lse=lse)
    for cap in (1.5, 6.0, 1.5):  # softcap on: one key, its value per call
        out = flash_attn_func(q, k, v, softcap=cap)
        assert fake_gpu.calls[-1]["softcap"] == cap
        close(out, q, k, v, 64 ** -0.5, softcap=cap)
    assert len(interface._fwd_calls) == 2
    q2, k2, v2 = qkv(seed=9)  # same metadata, other memory: its own addresses
    out = flash_attn_func(q2, k2, v2)
    assert fake_gpu.calls[-1]["q"].ptr == q2.data_ptr() and fake_gpu.calls[-1]["v"].ptr == v2.data_ptr()
    close(out, q2, k2, v2, 64 ** -0.5)


def test_misaligned_input_on_a_cached_key_is_still_copied(fake_gpu, prepared_launches):
    q, k, v = qkv(b=1, sq=8, sk=16, h=2, hk=2, d=64)
    flat = torch.empty(k.numel() + 1, dtype=k.dtype)
    k_mis = flat[1:].view(k.shape)  # k's shape and strides, base 2 bytes off alignment
    k_mis.copy_(k)
    assert k_mis.stride() == k.stride() and k_mis.data_ptr() % 16 != 0
    out = flash_attn_func(q, k, v)  # fills the cache: the prepared launch
    assert prepared_launches == [(q.data_ptr(), k.data_ptr(), v.data_ptr())]
    out_mis = flash_attn_func(q, k_mis, v)  # same key, misaligned: copied, through core.attention_forward
    assert len(prepared_launches) == 1 and len(interface._fwd_calls) == 1
    call = fake_gpu.calls[-1]
    assert call["k"].ptr != k_mis.data_ptr() and call["k"].ptr % 16 == 0 and call["q"].ptr == q.data_ptr()
    assert torch.equal(out_mis, out)
    flash_attn_func(q, k, v)  # aligned again: the prepared launch, in place
    assert prepared_launches[-1] == (q.data_ptr(), k.data_ptr(), v.data_ptr())


def test_layout_that_needs_a_copy_is_copied_on_every_call(fake_gpu, prepared_launches):
    q, k, v = qkv(b=1, sq=8, sk=16, h=2, hk=2, d=64)
    q_t = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    for _ in range(2):
        out = flash_attn_func(q_t, k, v)
        call = fake_gpu.calls[-1]
        assert call["q"].ptr != q_t.data_ptr() and call["k"].ptr == k.data_ptr()
        close(out, q, k, v, 64 ** -0.5)
    assert prepared_launches == [] and interface._fwd_calls[next(iter(interface._fwd_calls))].launch is None


def test_validation_errors_are_not_cached_away(fake_gpu, monkeypatch):
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    q1 = q.clone()
    monkeypatch.setattr(interface, "_device_of", lambda t: (True, 1) if t is q1 else (True, 0))
    with pytest.raises(ValueError, match="q, k and v must be on the same CUDA device"):
        flash_attn_func(q1, k, v)
    monkeypatch.setattr(interface, "_device_of", lambda t: (False, None) if t is q1 else (True, 0))
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        flash_attn_func(q1, k, v)
    with pytest.raises(TypeError, match="q, k and v must have the same dtype"):
        flash_attn_func(q, k, v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="k and v must have the same seqlen_k"):
        flash_attn_func(q, k, v[:, :6])
    sink = torch.zeros(4)
    flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(heads,\)"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="learnable_sink must have dtype float32"):
        flash_attn_func(q, k, v, learnable_sink=sink.double())
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        flash_attn_func(q, k, v, softmax_scale=math.inf)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(True, -1))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    ones = torch.ones(2, 2)
    flash_attn_func(q8, k8, v8, q_descale=ones)
    with pytest.raises(ValueError, match="q_descale must have shape"):
        flash_attn_func(q8, k8, v8, q_descale=torch.ones(2, 3))
    with pytest.raises(NotImplementedError, match="head_dim_v .* is not supported with float8_e4m3fn"):
        flash_attn_func(q8, k8, v8[..., :32].contiguous(), q_descale=ones)
    assert len(interface._fwd_calls) == 3  # the three calls that passed


def test_sink_and_descales_are_per_call_with_their_metadata_in_the_key(fake_gpu):
    q, k, v = qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64)
    for seed in (1, 2):
        sink = torch.randn(4, generator=torch.Generator().manual_seed(seed))
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
        assert fake_gpu.calls[-1]["sink"] == sink.data_ptr() and torch.equal(fake_gpu.calls[-1]["sink_values"], sink)
        close(out, q, k, v, 64 ** -0.5, sink=sink, lse=lse)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    for ds in ((torch.rand(2, 2) + 0.5, None, torch.rand(2, 2) + 0.5),
               (torch.rand(2, 4, 2) + 0.5, torch.rand(2, 2, 3) + 0.5, None),
               (torch.rand(2, 2) + 0.5, None, torch.rand(2, 2) + 0.5)):
        out = flash_attn_func(q8, k8, v8, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        got = fake_gpu.calls[-1]["descales"]
        for name, want in zip("qkv", ds):
            assert (got[name] is None) == (want is None) and (want is None or torch.equal(got[name], want))
        deq = [dequantize_fp8(x, d) for x, d in zip((q8, k8, v8), ds)]
        torch.testing.assert_close(out.float(), reference(*deq, 64 ** -0.5, False)[0], atol=1e-2, rtol=1e-2)
    assert len(interface._fwd_calls) == 3  # sink; the two descale layouts


def test_fp8_calls_with_descales_take_the_inline_path(fake_gpu, monkeypatch):
    """An eager FP8 call with plain-tensor descales is checked inline (no feature_problems call per call)
    under the same cache key as the general path (softcap given as an int goes there: no new entry)."""
    q, k, v = qkv(b=2, sq=70, sk=130, h=4, hk=2, d=64)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    ds = torch.rand(2, 2) + 0.5
    out1 = flash_attn_func(q8, k8, v8, q_descale=ds, v_descale=ds)  # the miss validates (any path)
    assert len(interface._fwd_calls) == 1

    def general(**kw):
        raise AssertionError("the general path's checks ran")

    with monkeypatch.context() as m:
        m.setattr(interface._v, "feature_problems", general)
        out2 = flash_attn_func(q8, k8, v8, q_descale=ds, v_descale=ds)
    assert torch.equal(out1, out2) and len(interface._fwd_calls) == 1
    out3 = flash_attn_func(q8, k8, v8, q_descale=ds, v_descale=ds, softcap=0)  # an int: the general path
    assert torch.equal(out1, out3) and len(interface._fwd_calls) == 1


def test_the_prepared_call_cache_is_bounded(fake_gpu, monkeypatch):
    monkeypatch.setattr(interface, "_FWD_CALL_CACHE_MAX", 3)
    for sq in range(1, 11):
        q, k, v = qkv(b=1, sq=sq, sk=5, h=2, hk=2, d=64)
        out = flash_attn_func(q, k, v)
        close(out, q, k, v, 64 ** -0.5)
        assert len(interface._fwd_calls) <= 3


def test_capability_is_checked_on_every_call(fake_gpu, monkeypatch):
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    monkeypatch.setattr(core, "device_capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match="needs an NVIDIA Hopper GPU"):
        flash_attn_func(q, k, v)


# ======================================================================== the core and launcher, fake driver
KEYS = [dict(dtype=dt, head_dim=hd, head_dim_v=hd, causal=c, local=lo, softcap=sc)
        for dt in ("bf16", "fp16") for hd in (64, 128) for c in (False, True) for lo in (False, True)
        for sc in (False, True) if not (c and lo)] + \
       [dict(dtype="e4m3", head_dim=hd, head_dim_v=hd, causal=c, local=False, softcap=False)
        for hd in (64, 128) for c in (False, True)]
FWD_LAYOUT = fwd_mod.PARAMS.layout()
FWD_OFFSETS = {n: off for n, _, off in FWD_LAYOUT["fields"]}


def record(key: dict, cluster=(1, 1, 1)) -> dict:
    bm = 128 if key["head_dim"] == 128 else 192
    name = "fwd_{dtype}_hd{head_dim}_c{causal:d}_l{local:d}_s{softcap:d}".format(**key) + \
        ("_packgqa" if key.get("pack_gqa") else "") + ("_varlen" if key.get("varlen") else "")
    return {"name": name, "key": "0" * 64, "family": "fwd",
            "params": {"family": "fwd", **key, "block_m": bm, "block_n": 128, "stages": 2, "consumer_wgs": 2,
                       "pingpong": True, "overlap": True, "persistent": key["causal"]},
            "dispatch": dict(key), "default": True, "fatbin": f"fatbin/{name}.fatbin", "sha256": "0" * 64,
            "kernels": [{"role": "main", "symbol": f"flashgen_{name}_main", "threads": 384, "cluster": list(cluster),
                         "smem_bytes": 1000 + key["head_dim"], "registers": 168, "spill_bytes": 0, "stack_bytes": 0,
                         "tensor_maps": ["q", "k", "v", "o"], "sass": [], "params": FWD_LAYOUT}]}


class _Handle:
    """A driver handle: int() and getPtr() (the address the argument array holds)."""

    def __init__(self, value=0, **info):
        self.value = value
        self.__dict__.update(info)

    def __int__(self):
        return self.value

    def getPtr(self):
        return id(self)


class _Names:
    def __getattr__(self, name):
        return name


class FakeDriver:
    """cuda.bindings.driver as the launcher uses it: calls succeed at once and are recorded; a
    launch's params bytes and tensor maps are read back through its argument array."""

    SM_COUNT = 132

    def __init__(self):
        self.primary = {0: _Handle(0x1000), 1: _Handle(0x1001)}
        self.current = self.primary[0]
        self.launches, self.encodes, self.ctx_ops = [], [], []
        self.maps = {}  # id -> encoded map (kept alive by launch._tmaps too)
        self.lock = threading.Lock()
        self.attributes = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9,
                           "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
                           "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": self.SM_COUNT,
                           # an H100 SXM's HBM3: 2619 MHz x 5120 bits (launch.dram_bandwidth: 3.35e6 bytes per us)
                           "CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE": 2619000,
                           "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH": 5120}
        self.CUdevice_attribute = type("CUdevice_attribute", (), {n: i for i, n in enumerate(self.attributes)})
        self.mem_ops = []  # tile counters: ("alloc" | "memset" | "launch" | "free", pointer, stream, ...) in call order
        self.next_ptr = 0x7000_0000
        self.capturing = set()  # stream handles under CUDA-graph capture (cuStreamIsCapturing)
        for n in ("CUfunction_attribute", "CUlaunchAttributeID", "CUtensorMapDataType", "CUtensorMapInterleave",
                  "CUtensorMapSwizzle", "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill", "CUmemAllocationType",
                  "CUmemAllocationHandleType", "CUmemLocationType", "CUmemPool_attribute"):
            setattr(self, n, _Names())
        self.cuuint64_t = self.cuuint32_t = int
        self.CUstream = _Handle

    def cuInit(self, flags):
        return (0,)

    def CUmemPoolProps(self):
        return _Handle(location=_Handle())

    def cuMemPoolCreate(self, props):
        assert props.location.type == "CU_MEM_LOCATION_TYPE_DEVICE" and int(self.current) == int(
            self.primary[props.location.id])
        return (0, _Handle(0x900 + props.location.id, device=props.location.id))

    def cuMemPoolSetAttribute(self, pool, attr, value):
        assert attr == "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD" and value > 0
        return (0,)

    def cuMemAllocFromPoolAsync(self, size, pool, stream):
        with self.lock:
            ptr, self.next_ptr = self.next_ptr, self.next_ptr + 256
            self.mem_ops.append(("alloc", ptr, int(stream), size, pool.device, threading.get_ident()))
        return (0, ptr)

    def cuStreamIsCapturing(self, stream):
        return (0, 1 if int(stream) in self.capturing else 0)  # CU_STREAM_CAPTURE_STATUS_ACTIVE / _NONE

    def cuStreamGetId(self, stream):
        # handles 0 and 2: a stream of each thread (per-thread default streams); others: one stream per handle
        return (0, hash((int(stream), threading.get_ident() if int(stream) in (0, 2) else 0)) & ((1 << 63) - 1))

    def cuMemsetD32Async(self, ptr, value, count, stream):
        with self.lock:
            self.mem_ops.append(("memset", int(ptr), int(stream), value, count, threading.get_ident()))
        return (0,)

    def cuMemFreeAsync(self, ptr, stream):
        with self.lock:
            self.mem_ops.append(("free", int(ptr), int(stream), threading.get_ident()))
        return (0,)

    def cuDeviceGet(self, i):
        return (0, i)

    def cuDevicePrimaryCtxRetain(self, dev):
        return (0, self.primary[dev])

    def cuDeviceGetAttribute(self, attr, dev):
        return (0, list(self.attributes.values())[attr])

    def cuDeviceGetName(self, n, dev):
        return (0, b"Fake GPU\0")

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_FAKE")

    def cuCtxGetCurrent(self):
        return (0, self.current)

    def cuCtxPushCurrent(self, ctx):
        self.ctx_ops.append(("push", int(ctx)))
        self._saved, self.current = self.current, ctx
        return (0,)

    def cuCtxPopCurrent(self):
        self.ctx_ops.append(("pop", int(self.current)))
        self.current = self._saved
        return (0, self.current)

    def cuLibraryLoadData(self, *a):
        return (0, _Handle(1))

    def cuLibraryGetKernel(self, lib, sym):
        return (0, _Handle(2, symbol=sym.decode()))

    def cuKernelGetFunction(self, kern):
        return (0, _Handle(3, symbol=kern.symbol))

    def cuFuncSetAttribute(self, *a):
        return (0,)

    def cuTensorMapEncodeTiled(self, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        m = _Handle(0, ptr=ptr, dtype=dtype, dims=tuple(dims), strides=tuple(strides), box=tuple(box), swizzle=swizzle,
                    ctx=int(self.current))
        with self.lock:
            self.maps[id(m)] = m
            self.encodes.append(m)
        return (0, m)

    def _record(self, f, grid, block, smem, stream, argv_addr, cluster):
        nmaps = 0 if f.symbol.endswith("_vt") else 4  # vt_global's preprocess takes no tensor map
        argv = (ctypes.c_void_p * (nmaps + 1)).from_address(argv_addr)
        with self.lock:
            maps = [self.maps[p] for p in argv[:nmaps]]
        params = ctypes.string_at(argv[nmaps], FWD_LAYOUT["size"])
        (counter,) = struct.unpack_from("<Q", params, FWD_OFFSETS["stream_tile_counter"])
        with self.lock:
            self.mem_ops.append(("launch", counter, int(stream), threading.get_ident()))
        self.launches.append(dict(symbol=f.symbol, grid=grid, block=block, smem=smem, stream=int(stream), maps=maps,
                                  params=params, ctx=int(self.current), cluster=cluster, thread=threading.get_ident(),
                                  stream_tile_counter=counter))

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        assert extra == 0
        self._record(f, (gx, gy, gz), (bx, by, bz), smem, stream, kernel_params, None)
        return (0,)

    def CUlaunchConfig(self):
        return _Handle()

    def CUlaunchAttribute(self):
        return _Handle(value=_Handle(clusterDim=_Handle()))

    def cuLaunchKernelEx(self, cfg, f, kernel_params, extra):
        dim = cfg.attrs[0].value.clusterDim
        self._record(f, (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                     cfg.sharedMemBytes, cfg.hStream, kernel_params, (dim.x, dim.y, dim.z))
        return (0,)


def _fresh_state(monkeypatch):
    for name, value in (("_drv", None), ("_initialized", False), ("_primary", {}), ("_attr_cache", {}),
                        ("_capabilities", {}), ("_names", {}), ("_libraries", {}), ("_kernels", {}), ("_streams", {}),
                        ("_tmaps", {}), ("_geometries", {}), ("_stream_counters", {})):
        monkeypatch.setattr(launch, name, value)
    monkeypatch.setattr(core, "_plans", {})
    monkeypatch.setattr(core, "_prepared_forwards", {})
    tuning.reset()


def _fake_driver(tmp_path, monkeypatch, keys, extra=()):
    """The real core and launcher on a FakeDriver, with a manifest of fwd variants for ``keys`` (and the
    records ``extra``)."""
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 2, "arch": "sm_90a", "nvcc": {"version": "13.0"},
                                                        "variants": [record(k) for k in keys] + list(extra)}))
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", "off")
    for var in ("FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    _fresh_state(monkeypatch)
    d = FakeDriver()
    monkeypatch.setattr(launch, "_driver", lambda: d)
    monkeypatch.setattr(launch, "read_fatbin", lambda path, sha: b"")
    return d


def test_vt_global_launches_its_preprocess_then_main_on_scratch_of_the_call(tmp_path, monkeypatch):
    """A vt_global variant (fwd.py): each call allocates its V^T scratch (fwd.vt_scratch_bytes) from the
    scratch pool on the call's stream, launches the ``vt`` preprocess (V's address and strides, the
    scratch, the grid of fwd.vt_grid), then ``main`` with its V map over the scratch (keys innermost,
    128-key boxes of head_dim rows), then frees the scratch on the stream: every step stream-ordered."""
    key = dict(dtype="e4m3", head_dim=128, head_dim_v=128, causal=False, local=False, softcap=False)
    rec = record(key)
    rec["params"]["vt_global"] = True
    main = rec["kernels"][0]
    rec["kernels"] = [{**main, "role": "vt", "symbol": main["symbol"][:-len("main")] + "vt", "threads": 256,
                       "smem_bytes": 0, "tensor_maps": []}, main]
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 2, "arch": "sm_90a", "nvcc": {"version": "13.0"},
                                                        "variants": [rec]}))
    monkeypatch.setenv("FLASHGEN_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHGEN_TUNE_TABLE", "off")
    for var in ("FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR"):
        monkeypatch.delenv(var, raising=False)
    _fresh_state(monkeypatch)
    monkeypatch.setattr(launch, "_scratch_pools", {})
    d = FakeDriver()
    monkeypatch.setattr(launch, "_driver", lambda: d)
    monkeypatch.setattr(launch, "read_fatbin", lambda path, sha: b"")
    b, sq, h, sk, hk = 2, 300, 4, 500, 2
    q = targ((b, sq, h, 128), "fp8_e4m3", 1 << 24)
    k = targ((b, sk, hk, 128), "fp8_e4m3", 2 << 24)
    v = targ((b, sk, hk, 128), "fp8_e4m3", 3 << 24, strides=(sk * 2 * hk * 128, 2 * hk * 128, 128, 1))  # packed K/V
    out = targ((b, sq, h, 128), "bf16", 4 << 24)
    lse = targ((b, h, sq), "fp32", 5 << 24)
    for stream in (7, 8):
        n = len(d.launches)
        core.attention_forward(q, k, v, out, lse, 0.1, False, stream)
        pre, run = d.launches[n:]
        assert pre["symbol"].endswith("_vt") and run["symbol"].endswith("_main") and pre["stream"] == run["stream"] == stream
        assert pre["grid"] == fwd_mod.vt_grid(b, hk, 128, sk, 128) == (4, 1, 4) and pre["block"] == (256, 1, 1)
        allocs = [op for op in d.mem_ops if op[0] == "alloc" and op[2] == stream]
        assert len(allocs) == 1 and allocs[0][3] == fwd_mod.vt_scratch_bytes(b, hk, 128, sk) == b * hk * 128 * 512
        ptr = allocs[0][1]
        fields = lambda blob, *names: [struct.unpack_from("<Q" if n in ("v", "vt") else "<q" if "stride" in n else "<i",
                                                          blob, FWD_OFFSETS[n])[0] for n in names]  # noqa: E731
        assert fields(pre["params"], "v", "vt", "vt_seqlen", "v_stride_batch", "v_stride_seq", "v_stride_head") == [
            v.ptr, ptr, 512, v.strides[0], v.strides[1], v.strides[2]]
        vmap = run["maps"][2]
        assert (vmap.ptr, vmap.dims, vmap.strides, vmap.box) == (ptr, (512, 128, hk, b), (512, 128 * 512, hk * 128 * 512),
                                                                 (128, 128, 1, 1))
        ops = [op[:2] for op in d.mem_ops if op[2] == stream]
        assert ops == [("alloc", ptr), ("launch", 0), ("launch", 0), ("free", ptr)]


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """The real core and launcher on a FakeDriver, with a manifest of fwd variants for KEYS."""
    yield _fake_driver(tmp_path, monkeypatch, KEYS)
    tuning.reset()


def targ(shape, dtype="bf16", ptr=1 << 20, strides=None, device=0):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return core.TensorArg(ptr, tuple(shape), tuple(strides), dtype, device)


def expected_params(q, k, v, out, lse, scale, causal, window, softcap, sink, bm, sms, descales=(None, None, None),
                    stream_tile_counter=0):
    """The params dict the forward packed before prepared launches (one dict per call, every field)."""
    b, sq, h, d = q.shape
    _, sk, hk, dv = v.shape
    mask = core.mask_spec(causal, window, sq, sk)
    scale_log2, softcap_scale = core.softmax_constants(scale, softcap)
    num_m = -(-sq // bm)
    return {"lse": lse.ptr, "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_k": hk, "batch": b,
            "num_m_blocks": num_m, "num_tiles": num_m * h * b, "scale_log2": scale_log2, "softmax_scale": float(scale),
            "softcap_scale": softcap_scale, "window_left": mask.left, "window_right": mask.right, "sink": sink,
            "o": out.ptr, "o_stride_batch": out.strides[0], "o_stride_seq": out.strides[1],
            "o_stride_head": out.strides[2], "head_dim_v": dv, "group": h // hk, "tile_queries": bm,
            "section_heads": core.section_heads(b, h, hk, sk, d, dv, 1 if q.dtype == "fp8_e4m3" else 2),
            "tail_section": core.tail_section(b, h, hk, sk, d, dv, 1 if q.dtype == "fp8_e4m3" else 2),
            "stream_tile_counter": stream_tile_counter, "v": 0, "v_stride_batch": v.strides[0], "v_stride_seq": v.strides[1],
            "v_stride_head": v.strides[2], "vt": 0, "vt_seqlen": -(-sk // 16) * 16,
            **core._descale_params("q", descales[0], h, hk, True), **core._descale_params("k", descales[1], h, hk, True),
            **core._descale_params("v", descales[2], h, hk, False),
            "cu_seqlens_q": 0, "cu_seqlens_k": 0, "seqused_q": 0, "seqused_k": 0, "lse_stride_batch": 0,
            "lse_stride_head": 0, "kv_batch_idx": 0, "leftpad_k": 0, "page_table": 0, "page_table_stride": 0,
            "page_size": 0, "page_box": 0, "num_splits": 1, "o_stride_split": 0, "lse_stride_split": 0, "split_mul": 0,
            "split_shift": 0}


def check_launch(rec, q, k, v, out, lse, scale, causal, window=(-1, -1), softcap=0.0, sink=0, stream=7,
                 descales=(None, None, None)):
    """A recorded launch against what the uncached forward launched for these arguments."""
    dt = core._VARIANT_DTYPE.get(q.dtype, q.dtype)
    m = core.mask_spec(causal, window, q.shape[1], k.shape[1])
    key = dict(dtype=dt, head_dim=q.shape[3], head_dim_v=v.shape[3], causal=m.causal, local=m.local,
               softcap=softcap > 0)
    name = "fwd_{dtype}_hd{head_dim}_c{causal:d}_l{local:d}_s{softcap:d}".format(**key) + \
        ("_packgqa" if key.get("pack_gqa") else "")
    bm = 128 if q.shape[3] == 128 else 192
    tiles = -(-q.shape[1] // bm) * q.shape[2] * q.shape[0]
    persistent = m.causal
    assert rec["symbol"] == f"flashgen_{name}_main"
    assert rec["grid"] == (max(min(tiles, FakeDriver.SM_COUNT) if persistent else tiles, 1), 1, 1)
    assert rec["block"] == (384, 1, 1) and rec["smem"] == 1000 + q.shape[3] and rec["stream"] == stream
    # causal persistent variants claim tiles from a counter of their own (fwd.dynamic_schedule)
    assert (rec["stream_tile_counter"] != 0) == (m.causal and persistent and tiles > FakeDriver.SM_COUNT)
    want = launch.ParamsPacker(FWD_LAYOUT).pack(expected_params(q, k, v, out, lse, scale, causal, window, softcap,
                                                                sink, bm, FakeDriver.SM_COUNT, descales,
                                                                rec["stream_tile_counter"]))
    assert rec["params"] == want
    # the variant's head dim decides each map's row: 64 bytes (SWIZZLE_64B) for e4m3 head_dim <= 64,
    # else 128 (smem.cuh: SmemTileSW, fwd.operand_row_bytes); the output (16-bit) is always 128
    swz = {"bf16": 128, "fp16": 128, "fp8_e4m3": 64 if q.shape[3] <= 64 else 128}
    for t, tm, rows in zip((q, k, v, out), rec["maps"], (bm, 128, 128, 64)):
        es = {"bf16": 2, "fp16": 2, "fp8_e4m3": 1}[t.dtype]
        b, s, h, d = t.shape
        row_bytes = swz[t.dtype]
        assert (tm.ptr, tm.dims, tm.strides, tm.box) == (
            t.ptr, (d, s, h, b), (t.strides[1] * es, t.strides[2] * es, t.strides[0] * es), (row_bytes // es, rows, 1, 1))
        assert tm.swizzle == getattr(launch._driver().CUtensorMapSwizzle, launch._SWIZZLE[row_bytes])


CONFIGS = [  # (q shape, k/v shape, dtype, causal, window, softcap)
    ((2, 300, 4, 128), (2, 500, 2, 128), "bf16", False, (-1, -1), 0.0),
    ((2, 300, 4, 128), (2, 500, 2, 128), "bf16", True, (-1, -1), 0.0),
    ((2, 300, 4, 128), (2, 500, 2, 128), "bf16", False, (64, 8), 0.0),
    ((2, 300, 4, 128), (2, 500, 2, 128), "bf16", False, (-1, -1), 30.0),
    ((2, 300, 4, 128), (2, 500, 2, 128), "fp16", False, (-1, -1), 0.0),
    ((1, 7, 8, 64), (1, 9, 1, 64), "fp16", True, (3, -1), 5.0),
    ((3, 1000, 16, 128), (3, 1000, 16, 128), "bf16", True, (-1, -1), 0.0),
]


def test_prepared_launches_are_the_uncached_launches(driver):
    stream = 7
    for rnd in range(2):  # the first round prepares, the second hits the cache with other addresses
        for i, (qs, ks, dt, causal, window, cap) in enumerate(CONFIGS):
            base = (rnd * 64 + i) << 24
            q, k, v = targ(qs, dt, base), targ(ks, dt, base + (1 << 22)), targ(ks, dt, base + (2 << 22))
            out = targ(qs, dt, base + (3 << 22))
            lse = targ((qs[0], qs[2], qs[1]), "fp32", base + (4 << 22))
            scale = 0.1 + i + rnd
            used = core.attention_forward(q, k, v, out, lse, scale, causal, stream, window_size=window, softcap=cap,
                                          sink=base + 64 if rnd else 0)
            check_launch(driver.launches[-1], q, k, v, out, lse, scale, causal, window, cap,
                         base + 64 if rnd else 0, stream)
            assert used.name in driver.launches[-1]["symbol"]
            stream += 1
        assert len(core._prepared_forwards) == len(CONFIGS)
    assert len(driver.launches) == 2 * len(CONFIGS)


def test_strides_of_out_and_inputs_are_in_the_key(driver):
    q, k, v = targ((2, 64, 4, 128)), targ((2, 64, 4, 128), ptr=2 << 20), targ((2, 64, 4, 128), ptr=3 << 20)
    lse = targ((2, 4, 64), "fp32", 4 << 20)
    dense, wide = targ((2, 64, 4, 128), ptr=5 << 20), targ((2, 64, 4, 128), ptr=5 << 20, strides=(64 * 1024, 1024, 128, 1))
    k_packed = targ((2, 64, 4, 128), ptr=2 << 20, strides=(64 * 1536, 1536, 128, 1))
    for args in ((q, k, v, dense), (q, k, v, wide), (q, k_packed, v, dense), (q, k, v, dense), (q, k_packed, v, wide)):
        core.attention_forward(*args, lse, 0.125, False, 3)
        check_launch(driver.launches[-1], *args, lse, 0.125, False, stream=3)
    assert len(core._prepared_forwards) == 4


def test_fp8_descales_metadata_and_addresses(driver):
    q, k, v = (targ((2, 70, 4, 128), "fp8_e4m3", p << 20) for p in (1, 2, 3))
    out, lse = targ((2, 70, 4, 128), "bf16", 4 << 20), targ((2, 4, 70), "fp32", 5 << 20)
    for qd, kd in ((targ((2, 4, 2), "fp32", 6 << 20), targ((2, 4, 2), "fp32", 7 << 20)),
                   (targ((2, 4), "fp32", 8 << 20, strides=(1, 2)), None),
                   (targ((2, 4, 2), "fp32", 9 << 20), targ((2, 4, 2), "fp32", 10 << 20))):
        core.attention_forward(q, k, v, out, lse, 0.09, True, 1, q_descale=qd, k_descale=kd)
        check_launch(driver.launches[-1], q, k, v, out, lse, 0.09, True, stream=1, descales=(qd, kd, None))
    assert len(core._prepared_forwards) == 2


def test_fp8_head_dim_64_maps_have_64_byte_rows(driver):
    """e4m3 at head_dim <= 64 runs on 64-byte shared-memory rows (the 64-byte swizzle), not padded
    to 128: the TMA boxes are 64 elements wide and the maps swizzle 64 bytes (check_launch)."""
    for d in (64, 48):  # 48: served by the head_dim 64 variant
        q, k, v = (targ((2, 70, 4, d), "fp8_e4m3", p << 20) for p in (1, 2, 3))
        out, lse = targ((2, 70, 4, d), "bf16", 4 << 20), targ((2, 4, 70), "fp32", 5 << 20)
        used = core.attention_forward(q, k, v, out, lse, 0.125, False, 1)
        assert used.params["head_dim"] == 64
        if d == 64:
            check_launch(driver.launches[-1], q, k, v, out, lse, 0.125, False, stream=1)
        assert [(m.box[0], m.swizzle) for m in driver.launches[-1]["maps"]] == \
            [(64, "CU_TENSOR_MAP_SWIZZLE_64B")] * 3 + [(64, "CU_TENSOR_MAP_SWIZZLE_128B")]


def test_a_named_variant_must_serve_the_call(driver):
    """core.attention_forward(variant=...) refuses a variant that would compute something else
    (a softcap variant without softcap, a causal one for a non-causal call, a smaller head dim,
    another dtype) instead of launching it; a local variant serves any mask."""
    from flashgen.manifest import load_manifest

    by_key = {(v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["softcap"]): v
              for v in load_manifest().variants}
    q, k, v = (targ((1, 64, 2, 128), ptr=p << 20) for p in (1, 2, 3))
    out, lse = targ((1, 64, 2, 128), ptr=4 << 20), targ((1, 2, 64), "fp32", 5 << 20)
    run = lambda var, causal=False, **kw: core.attention_forward(q, k, v, out, lse, 0.1, causal, 1, variant=var, **kw)
    for var, kw, causal, why in ((by_key["bf16", 128, False, False, True], {}, False, "softcap True"),
                                 (by_key["bf16", 128, True, False, False], {}, False, "mask causal"),
                                 (by_key["bf16", 64, False, False, False], {}, False, "head dims 64/64"),
                                 (by_key["fp16", 128, False, False, False], {}, False, "dtype 'fp16'"),
                                 (by_key["bf16", 128, False, False, False], {"window_size": (8, 8)}, False, "local")):
        with pytest.raises(ValueError, match=f"does not serve this call: .*{why}"):
            run(var, causal, **kw)
    n = len(driver.launches)
    assert n == 0
    run(by_key["bf16", 128, False, True, False], True)  # the local kernel serves causal
    run(by_key["bf16", 128, False, True, False], False, window_size=(8, 8))
    run(by_key["bf16", 128, False, False, True], False, softcap=5.0)
    assert len(driver.launches) == 3


def test_misaligned_address_after_a_cache_hit_is_refused_as_before(driver):
    q, k, v = targ((1, 64, 2, 128)), targ((1, 64, 2, 128), ptr=2 << 20), targ((1, 64, 2, 128), ptr=3 << 20)
    out, lse = targ((1, 64, 2, 128), ptr=4 << 20), targ((1, 2, 64), "fp32", 5 << 20)
    bad_k = k._replace(ptr=k.ptr + 8)
    with pytest.raises(ValueError) as fresh:  # a new key: the full checks
        core.attention_forward(q, bad_k, v, out, lse, 0.1, False, 0)
    assert core._prepared_forwards == {}
    core.attention_forward(q, k, v, out, lse, 0.1, False, 0)
    n = len(driver.launches)
    with pytest.raises(ValueError) as cached:  # the key is cached: still refused, same message
        core.attention_forward(q, bad_k, v, out, lse, 0.1, False, 0)
    assert str(cached.value) == str(fresh.value) == \
        f"flashgen: TMA cannot address k: its base address 0x{bad_k.ptr:x} is not 16-byte aligned"
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        core.attention_forward(q, k, v, out, lse, math.nan, False, 0)
    assert len(driver.launches) == n  # nothing launched


def test_errors_come_in_the_uncached_order(driver):
    q, v = targ((1, 64, 3, 128)), targ((1, 64, 2, 128), ptr=3 << 20)
    out, lse = targ((1, 64, 3, 128), ptr=4 << 20), targ((1, 3, 64), "fp32", 5 << 20)
    with pytest.raises(ValueError, match=r"heads \(3\) must be a multiple of heads_k \(2\)"):
        core.attention_forward(q._replace(ptr=1), v, v, out, lse, math.nan, False, 0)
    q = targ((1, 64, 2, 256))
    v = targ((1, 64, 2, 256), ptr=3 << 20)
    out = targ((1, 64, 2, 256), ptr=4 << 20)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):  # before the variant lookup (no hd256 built)
        core.attention_forward(q, v, v, out, lse, math.nan, False, 0)
    with pytest.raises(core.MissingVariantError):
        core.attention_forward(q, v, v, out, lse, 0.1, False, 0)


def test_caches_are_bounded(driver, monkeypatch):
    monkeypatch.setattr(core, "_PREPARED_CACHE_MAX", 3)
    monkeypatch.setattr(launch, "_TMAP_CACHE_MAX", 5)
    monkeypatch.setattr(launch, "_STREAM_CACHE_MAX", 2)
    for i in range(12):
        q = targ((1, 16 + i, 2, 64), "fp16", (i + 1) << 24)
        kv = targ((1, 32, 2, 64), "fp16", (i + 1) << 24 | 1 << 20)
        out, lse = targ((1, 16 + i, 2, 64), "fp16", (i + 1) << 24 | 2 << 20), targ((1, 2, 16 + i), "fp32", 3 << 20)
        core.attention_forward(q, kv, kv, out, lse, 0.2, bool(i % 2), 100 + i)
        check_launch(driver.launches[-1], q, kv, kv, out, lse, 0.2, bool(i % 2), stream=100 + i)
        assert len(core._prepared_forwards) <= 3 and len(launch._tmaps) <= 5 and len(launch._streams) <= 2
        assert len(launch._geometries) <= 5
    assert len(interface._fwd_calls) <= interface._FWD_CALL_CACHE_MAX


def test_launch_pushes_the_primary_context_only_when_another_is_current(driver):
    q, k, v = targ((1, 64, 2, 64)), targ((1, 64, 2, 64), ptr=2 << 20), targ((1, 64, 2, 64), ptr=3 << 20)
    out, lse = targ((1, 64, 2, 64), ptr=4 << 20), targ((1, 2, 64), "fp32", 5 << 20)
    core.attention_forward(q, k, v, out, lse, 0.1, False, 0)
    assert driver.ctx_ops == [] and driver.launches[-1]["ctx"] == 0x1000
    other = _Handle(0x2000)  # a context of the caller's: pushed over for the launch, current again after
    driver.current = other
    core.attention_forward(q, k, v, out, lse, 0.1, False, 0)
    assert driver.ctx_ops == [("push", 0x1000), ("pop", 0x1000)] and driver.current is other
    assert driver.launches[-1]["ctx"] == 0x1000
    driver.ctx_ops.clear()
    driver.current = driver.primary[0]  # a call for cuda:1 from cuda:0's context: runs in cuda:1's, restores cuda:0's
    q1, k1, v1, out1 = (t._replace(device=1) for t in (q, k, v, out))
    core.attention_forward(q1, k1, v1, out1, lse, 0.1, False, 0)
    assert driver.launches[-1]["ctx"] == 0x1001 and driver.current is driver.primary[0]
    assert all(m.ctx == 0x1001 for m in driver.launches[-1]["maps"])  # its maps were encoded in cuda:1's context


def test_cluster_kernels_launch_with_launch_kernel_ex(tmp_path, driver, monkeypatch):
    key = KEYS[0]
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": 2, "arch": "sm_90a", "nvcc": {"version": "13.0"},
                                                        "variants": [record(key, cluster=(2, 1, 1))]}))
    _fresh_state(monkeypatch)
    q, k, v = targ((1, 64, 2, 64)), targ((1, 64, 2, 64), ptr=2 << 20), targ((1, 64, 2, 64), ptr=3 << 20)
    out, lse = targ((1, 64, 2, 64), ptr=4 << 20), targ((1, 2, 64), "fp32", 5 << 20)
    core.attention_forward(q, k, v, out, lse, 0.1, False, 9)
    rec = driver.launches[-1]
    assert rec["cluster"] == (2, 1, 1) and rec["stream"] == 9
    check_launch(rec, q, k, v, out, lse, 0.1, False, stream=9)


def _on_threads(n: int, body) -> list:
    """Run ``body(t)`` for t in range(n) on n threads at once; the exceptions they raised."""
    errors = []

    def worker(t):
        try:
            body(t)
        except Exception as e:  # noqa: BLE001 -- returned
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


def test_concurrent_calls_on_threads_each_launch_their_own_arguments(driver):
    def body(t):
        for i in range(150):
            sq = 16 + (t * 7 + i) % 40
            base = (t * 1000 + i + 1) << 24
            q = targ((1, sq, 2, 64), "fp16", base)
            kv = targ((1, 48, 2, 64), "fp16", base + (1 << 20))
            out, lse = targ((1, sq, 2, 64), "fp16", base + (2 << 20)), targ((1, 2, sq), "fp32", base + (3 << 20))
            core.attention_forward(q, kv, kv, out, lse, 0.01 * (t + 1), i % 3 == 0, 1000 * t + i)

    assert _on_threads(6, body) == []
    assert len(driver.launches) == 6 * 150
    for rec in driver.launches:
        t, i = divmod(rec["stream"], 1000)
        sq = 16 + (t * 7 + i) % 40
        base = (t * 1000 + i + 1) << 24
        q = targ((1, sq, 2, 64), "fp16", base)
        kv = targ((1, 48, 2, 64), "fp16", base + (1 << 20))
        out, lse = targ((1, sq, 2, 64), "fp16", base + (2 << 20)), targ((1, 2, sq), "fp32", base + (3 << 20))
        check_launch(rec, q, kv, kv, out, lse, 0.01 * (t + 1), i % 3 == 0, stream=1000 * t + i)
    check_counter_protocol(driver.mem_ops, causal_launches=0)  # at most 2 tiles: one per CTA, no counter


def check_counter_protocol(ops, causal_launches, capturing=()):
    """Each launch with a tile counter: outside CUDA-graph capture, its stream's counter: one 4-byte allocation
    from device 0's pool per stream (per thread for handles 0 and 2, which name a stream per thread) and a memset
    of that one int32 to 0 on the stream, before the stream's first such launch; the same pointer for every later
    launch on the stream, never another stream's, never freed. On a stream in ``capturing``: a counter of the
    launch's own (an allocation, a memset, the launch and its free, in that order on its stream and thread), no
    pointer live in two launches at once."""
    owner, zeroed, freed, own, by_stream = {}, set(), set(), {}, {}
    launches = 0
    for op in ops:
        kind, ptr, stream, thread = op[0], op[1], op[2], op[-1]
        key = (stream, thread if stream in (0, 2) else None)
        if kind == "alloc":
            assert op[3:5] == (4, 0) and ptr not in owner
            owner[ptr] = (key, thread)
            if stream in capturing:
                own[thread] = ptr  # the launch that follows on this thread takes it
        elif kind == "memset":
            assert op[3:5] == (0, 1) and owner[ptr][0] == key and ptr not in zeroed
            zeroed.add(ptr)
        elif kind == "launch" and ptr:
            launches += 1
            assert ptr in zeroed and ptr not in freed and owner[ptr][0] == key
            if stream in capturing:
                assert own.pop(thread) == ptr
            else:
                assert by_stream.setdefault(key, ptr) == ptr  # the stream's one counter
        elif kind == "free":
            assert stream in capturing and owner[ptr][0] == key and ptr not in own.values()
            freed.add(ptr)
            del owner[ptr]  # (an address may come back only after its free)
    assert not own and launches == causal_launches
    assert not [ptr for ptr, (key, _) in owner.items() if key[0] in capturing]  # (every captured one freed)
    assert len({key for key, _ in owner.values()}) == len(owner)  # one counter per stream
    return by_stream


BIG = (2, 3000, 8, 128)  # 24 query blocks x 8 heads x 2 = 384 tiles > 132 SMs
SMALL = (2, 300, 8, 128)  # 3 x 8 x 2 = 48 tiles


def _causal_call(shape, causal, stream, base=0):
    b, s, h, d = shape
    q, kv = targ(shape, ptr=base + (1 << 20)), targ(shape, ptr=base + (1 << 26))
    out, lse = targ(shape, ptr=base + (2 << 26)), targ((b, h, s), "fp32", ptr=base + (3 << 26))
    core.attention_forward(q, kv, kv, out, lse, 0.1, causal, stream=stream)
    return q, kv, out, lse


def test_causal_launches_take_their_streams_counter(driver):
    """More causal tiles than SMs: the launch takes its stream's counter (made and zeroed on the stream's first
    such launch, then the same one: the kernel leaves it at 0); no more tiles than SMs, or not causal: none (the
    static order). Another stream has a counter of its own."""
    for shape, causal, stream in ((BIG, True, 11), (BIG, False, 11), (SMALL, True, 11), (BIG, True, 11),
                                  (BIG, True, 12), (BIG, True, 11)):
        q, kv, out, lse = _causal_call(shape, causal, stream)
        check_launch(driver.launches[-1], q, kv, kv, out, lse, 0.1, causal, stream=stream)
    assert [op[:3:2] for op in driver.mem_ops] == [
        ("alloc", 11), ("memset", 11), ("launch", 11), ("launch", 11), ("launch", 11), ("launch", 11),
        ("alloc", 12), ("memset", 12), ("launch", 12), ("launch", 11)]
    counters = check_counter_protocol(driver.mem_ops, causal_launches=4)
    assert len(set(counters.values())) == 2
    assert [r["stream_tile_counter"] != 0 for r in driver.launches] == [True, False, False, True, True, True]


def test_causal_launches_under_capture_get_a_counter_of_their_own(driver):
    """Under CUDA-graph capture a causal launch takes a counter of its own (the graph's allocation, memset and
    free around it: a graph may be replayed on any stream); after the capture the stream has one counter."""
    driver.capturing.add(13)
    for _ in range(2):
        _causal_call(BIG, True, 13)
    driver.capturing.clear()
    for _ in range(2):
        _causal_call(BIG, True, 13)
    assert [op[0] for op in driver.mem_ops] == ["alloc", "memset", "launch", "free"] * 2 + [
        "alloc", "memset", "launch", "launch"]
    check_counter_protocol(driver.mem_ops[:8], causal_launches=2, capturing=(13,))
    check_counter_protocol(driver.mem_ops[8:], causal_launches=2)
    ptrs = [op[1] for op in driver.mem_ops if op[0] == "launch"]
    assert ptrs[0] != ptrs[1] and ptrs[2] == ptrs[3] and ptrs[2] not in ptrs[:2]


def test_threads_on_their_own_and_on_per_thread_streams_never_share_a_counter(driver):
    """Threads calling at once: each stream's launches take that stream's counter, and the handles of per-thread
    streams (0, 2) give each thread a counter of its own (keyed by the driver's stream id)."""
    alive = threading.Barrier(4)  # (all four threads live at once: a thread's ident may come back after it ends)

    def body(t):
        alive.wait()
        for i in range(20):
            _causal_call(BIG, True, (100 + t, 0, 2)[i % 3], base=(t * 64 + i) << 32)
        alive.wait()

    assert _on_threads(4, body) == []
    counters = check_counter_protocol(driver.mem_ops, causal_launches=80)
    assert len(counters) == 4 * 3 and len(set(counters.values())) == 12


def test_prepare_launch_checks_its_fields():
    layout = {"struct": "S", "size": 16, "fields": [["a", "i32", 0], ["p", "ptr", 8]]}
    rec = launch.Kernel(role="main", symbol="s", threads=32, cluster=(1, 1, 1), smem_bytes=0, tensor_maps=(),
                        params=layout)
    v = launch.Variant(name="x", family="f", params={}, dispatch={}, kernels=(rec,))
    k = launch.LoadedKernel(v, rec, None, 0, launch.ParamsPacker(layout))
    prep = launch.prepare_launch(k, (2, 1, 1), {"a": -3}, ("p",))
    assert prep.params == struct.pack("<i4xQ", -3, 0) and prep.grid == (2, 1, 1)
    with pytest.raises(KeyError, match="'nope' not in the struct"):
        launch.prepare_launch(k, (1, 1, 1), {"a": 1, "p": 0}, ("nope",))
    with pytest.raises(KeyError, match="'a' not given"):
        launch.prepare_launch(k, (1, 1, 1), {}, ("p",))
    with pytest.raises(ValueError, match="1 per-call params, got 0 and 2"):
        launch.launch_prepared(prep, (), (1, 2), 0)


# ======================================================================== PackGQA (flashgen.core.pack_gqa_rule)
PACK_KEYS = KEYS + [dict(dtype="bf16", head_dim=128, head_dim_v=128, causal=c, local=False, softcap=False,
                         pack_gqa=True) for c in (False, True)]


def test_pack_gqa_rule():
    # FA3's share-of-rows rule at block_m 128: decode packs, full tiles do not, no GQA never
    assert core.pack_gqa_rule(1, 32, 4, 128) and core.pack_gqa_rule(16, 32, 8, 128) and core.pack_gqa_rule(64, 32, 4, 128)
    assert not core.pack_gqa_rule(128, 32, 4, 128) and not core.pack_gqa_rule(2048, 32, 4, 128)
    assert not core.pack_gqa_rule(1, 8, 8, 128)  # group 1
    assert not core.pack_gqa_rule(1, 512, 1, 128)  # group 512 > block_m: a tile cannot hold one position
    # group 7 at block_m 128: 18 positions (126 rows) per tile; 300 rows unpacked fill 300/384, packed 2100/2176
    assert core.pack_gqa_rule(300, 28, 4, 128)


VARLEN_KEYS = KEYS + [dict(dtype="bf16", head_dim=128, head_dim_v=128, causal=c, local=False, softcap=False,
                           varlen=True, pack_gqa=pk) for c in (False, True) for pk in (False, True)]


def _params_of(rec) -> dict:
    return {n: struct.unpack_from({"i32": "<i", "u32": "<I", "ptr": "<Q", "f32": "<f", "i64": "<q"}[t], rec["params"],
                                  off)[0]
            for n, t, off in FWD_LAYOUT["fields"]}


def test_varlen_launch_maps_params_and_grid(tmp_path, monkeypatch):
    """core.attention_forward(varlen=...): the varlen variant of the key, a packed side as a map of batch 1 over
    its tokens, the grid of the sequences and the longest lengths, out's and lse's strides for rows at the
    sequences' offsets (batch stride 0 when packed), and the arrays' addresses per call; a padded side keeps its
    batch (kvcache: seqused_k alone)."""
    d = _fake_driver(tmp_path, monkeypatch, VARLEN_KEYS)
    try:
        tq, tk, h, hk, n = 300, 700, 8, 2, 5
        q, out = targ((tq, h, 128), ptr=1 << 24), targ((tq, h, 128), ptr=4 << 24)
        k, v = targ((tk, hk, 128), ptr=2 << 24), targ((tk, hk, 128), ptr=3 << 24)
        lse = targ((h, tq), "fp32", 5 << 24)
        vl = core.Varlen(6 << 24, 7 << 24, 0, 8 << 24, n, 100, 250)
        used = core.attention_forward(q, k, v, out, lse, 0.1, True, 5, varlen=vl)
        assert used.params["varlen"] and "c1" in d.launches[-1]["symbol"]
        rec = d.launches[-1]
        got = _params_of(rec)
        num_m = -(-100 // 128)
        assert (got["batch"], got["seqlen_q"], got["seqlen_k"], got["num_m_blocks"], got["num_tiles"]) == \
            (n, 100, 250, num_m, num_m * h * n)
        assert (got["cu_seqlens_q"], got["cu_seqlens_k"], got["seqused_q"], got["seqused_k"]) == \
            (6 << 24, 7 << 24, 0, 8 << 24)
        assert (got["o"], got["o_stride_batch"], got["o_stride_seq"], got["o_stride_head"]) == (4 << 24, 0, h * 128, 128)
        assert (got["lse"], got["lse_stride_batch"], got["lse_stride_head"]) == (5 << 24, 0, tq)
        assert (got["window_left"], got["window_right"]) == (250, 0)
        qm, km = rec["maps"][0], rec["maps"][1]
        assert qm.dims == (128, tq, h, 1) and km.dims == (128, tk, hk, 1)
        # the addresses are per call, on the same prepared launch
        core.attention_forward(q, k, v, out, lse, 0.1, True, 5, varlen=vl._replace(cu_seqlens_q=9 << 24, seqused_k=0))
        got = _params_of(d.launches[-1])
        assert (got["cu_seqlens_q"], got["seqused_k"]) == (9 << 24, 0)
        # a padded q and cache (kvcache): batch entries, seqused_k, lse (batch, heads, seqlen_q)
        b, sq, sc = 3, 4, 512
        q4, o4 = targ((b, sq, h, 128), ptr=10 << 24), targ((b, sq, h, 128), ptr=11 << 24)
        kc, vc = targ((b, sc, hk, 128), ptr=12 << 24), targ((b, sc, hk, 128), ptr=13 << 24)
        core.attention_forward(q4, kc, vc, o4, targ((b, h, sq), "fp32", 14 << 24), 0.1, False, 5, pack_gqa=False,
                               varlen=core.Varlen(0, 0, 0, 15 << 24, b, sq, 300))
        rec = d.launches[-1]
        got = _params_of(rec)
        assert "c0" in rec["symbol"] and (got["batch"], got["seqlen_q"], got["seqlen_k"]) == (b, sq, 300)
        assert (got["o_stride_batch"], got["lse_stride_batch"], got["lse_stride_head"]) == (sq * h * 128, h * sq, sq)
        assert rec["maps"][0].dims == (128, sq, h, b) and rec["maps"][1].dims == (128, sc, hk, b)
        # decode-like GQA on a padded q (kvcache): PackGQA's varlen variant by the rule, its 5-D Q map, lse strides
        qd, od = targ((b, 1, h, 128), ptr=16 << 24), targ((b, 1, h, 128), ptr=17 << 24)
        used = core.attention_forward(qd, kc, vc, od, targ((b, h, 1), "fp32", 18 << 24), 0.1, True, 5,
                                      varlen=core.Varlen(0, 0, 0, 15 << 24, b, 1, 300))
        rec = d.launches[-1]
        got = _params_of(rec)
        assert used.params["pack_gqa"] and used.params["varlen"] and "_packgqa_varlen" in rec["symbol"]
        assert (got["group"], got["tile_queries"], got["num_tiles"]) == (4, 32, hk * b)
        assert (got["lse_stride_batch"], got["lse_stride_head"], got["seqused_k"]) == (h, 1, 15 << 24)
        assert rec["maps"][0].dims == (128, 4, 1, hk, b)
        core.attention_forward(qd, kc, vc, od, targ((b, h, 1), "fp32", 18 << 24), 0.1, True, 5, pack_gqa=False,
                               varlen=core.Varlen(0, 0, 0, 15 << 24, b, 1, 300))
        assert "_packgqa" not in d.launches[-1]["symbol"] and "_varlen" in d.launches[-1]["symbol"]
        # a KV cache: cache rows through kv_batch_idx, left padding, and a paged cache (pages of 48 rows: boxes of
        # gcd(48, block_n 128) = 16 rows, in the K and V maps over (num_pages, 48, heads_k, dim))
        kr, vr = targ((7, sc, hk, 128), ptr=22 << 24), targ((7, sc, hk, 128), ptr=23 << 24)
        core.attention_forward(q4, kr, vr, o4, targ((b, h, sq), "fp32", 14 << 24), 0.1, False, 5, pack_gqa=False,
                               varlen=core.Varlen(0, 0, 0, 15 << 24, b, sq, 300, kv_batch_idx=24 << 24,
                                                  leftpad_k=25 << 24))
        rec = d.launches[-1]
        got = _params_of(rec)
        assert (got["kv_batch_idx"], got["leftpad_k"], got["page_table"], got["page_box"]) == (24 << 24, 25 << 24, 0, 0)
        assert rec["maps"][1].dims == (128, sc, hk, 7) and rec["maps"][1].box[1] == 128
        kp, vp = targ((40, 48, hk, 128), ptr=26 << 24), targ((40, 48, hk, 128), ptr=27 << 24)
        paged = core.Varlen(0, 0, 0, 15 << 24, b, sq, 300, page_table=28 << 24, page_table_stride=9, page_size=48)
        core.attention_forward(q4, kp, vp, o4, targ((b, h, sq), "fp32", 14 << 24), 0.1, False, 5, pack_gqa=False,
                               varlen=paged)
        rec = d.launches[-1]
        got = _params_of(rec)
        assert (got["page_table"], got["page_table_stride"], got["page_size"], got["page_box"]) == (28 << 24, 9, 48, 16)
        assert got["kv_batch_idx"] == 0 and got["seqlen_k"] == 300
        assert [(m.dims, m.box[1]) for m in rec["maps"][1:3]] == [((128, 48, hk, 40), 16)] * 2
        for bad, what in ((paged._replace(page_size=44), "multiple of 8"), (paged._replace(leftpad_k=1), "leftpad_k"),
                          (paged._replace(page_size=16), "page_size")):
            with pytest.raises(ValueError, match=what):
                core.attention_forward(q4, kp, vp, o4, targ((b, h, sq), "fp32", 14 << 24), 0.1, False, 5,
                                       pack_gqa=False, varlen=bad)
        # split-KV: the scheduler's batch is sequences x splits, fast_div of the count, the partials' strides; the
        # o map over q's geometry (out is the fp32 partial)
        o32 = targ((b, sq, h, 128), "fp32", 29 << 24)
        core.attention_forward(q4, kc, vc, o32, targ((b, h, sq), "fp32", 30 << 24), 0.1, False, 5, pack_gqa=False,
                               varlen=core.Varlen(0, 0, 0, 15 << 24, b, sq, 300, num_splits=3,
                                                  o_stride_split=b * sq * h * 128, lse_stride_split=b * h * sq))
        rec = d.launches[-1]
        got = _params_of(rec)
        mul, shift = core.fast_div(3)
        assert (got["num_splits"], got["batch"], got["num_tiles"], got["split_mul"], got["split_shift"]) == \
            (3, 3 * b, 3 * b * h * -(-sq // 128), mul, shift)
        assert (got["o_stride_split"], got["lse_stride_split"], got["o"]) == (b * sq * h * 128, b * h * sq, 29 << 24)
        assert rec["maps"][3].dims == (128, sq, h, b) and rec["maps"][3].dtype == rec["maps"][0].dtype
        # a packed q is never packed by the rule (PackGQA's Q map has a batch dim)
        q1, o1 = targ((5, h, 128), ptr=19 << 24), targ((5, h, 128), ptr=20 << 24)
        core.attention_forward(q1, k, v, o1, targ((h, 5), "fp32", 21 << 24), 0.1, False, 5,
                               varlen=core.Varlen(6 << 24, 7 << 24, 0, 0, 5, 1, 250))
        assert "_packgqa" not in d.launches[-1]["symbol"] and "_varlen" in d.launches[-1]["symbol"]
        # what the varlen kernels do not serve
        with pytest.raises(ValueError, match="3-D"):
            core.attention_forward(q4, kc, vc, o4, lse, 0.1, False, 5, varlen=vl)
        with pytest.raises(ValueError, match="batch = 4"):
            core.attention_forward(q4, kc, vc, o4, lse, 0.1, False, 5, varlen=core.Varlen(0, 0, 0, 1 << 20, 4, sq, 9))
        with pytest.raises(ValueError, match="PackGQA"):
            core.attention_forward(q, k, v, out, lse, 0.1, True, 5, varlen=vl, pack_gqa=True)
        with pytest.raises(core.MissingVariantError):  # no fp16 varlen variant in this manifest
            core.attention_forward(q._replace(dtype="fp16"), k._replace(dtype="fp16"), v._replace(dtype="fp16"),
                                   out._replace(dtype="fp16"), lse, 0.1, True, 5, varlen=vl)
    finally:
        tuning.reset()


def test_packed_launch_maps_params_and_grid(tmp_path, monkeypatch):
    d = _fake_driver(tmp_path, monkeypatch, PACK_KEYS)
    try:
        b, sq, sk, h, hk = 3, 17, 513, 28, 4  # group 7: 18 positions and 2 padding rows per 128-row tile
        q = targ((b, sq, h, 128), ptr=1 << 24)
        k, v = targ((b, sk, hk, 128), ptr=2 << 24), targ((b, sk, hk, 128), ptr=3 << 24)
        out, lse = targ((b, sq, h, 128), ptr=4 << 24), targ((b, h, sq), "fp32", 5 << 24)
        used = core.attention_forward(q, k, v, out, lse, 0.1, True, 5)
        assert used.params["pack_gqa"] and "packgqa" in d.launches[-1]["symbol"]
        rec = d.launches[-1]
        num_m = -(-sq // 18)
        got = _params_of(rec)
        assert (got["group"], got["tile_queries"], got["num_m_blocks"], got["num_tiles"]) == (7, 18, num_m, num_m * hk * b)
        assert got["section_heads"] == core.section_heads(b, hk, hk, sk, 128, 128, 2) and got["heads"] == h
        assert got["tail_section"] == core.tail_section(b, hk, hk, sk, 128, 128, 2)
        assert rec["grid"] == (min(num_m * hk * b, FakeDriver.SM_COUNT), 1, 1)
        qm = rec["maps"][0]  # 5-D: (head_dim, head in group, seqlen, K/V head, batch), box one chunk x 7 x 18
        assert (qm.dims, qm.box) == ((128, 7, sq, hk, b), (64, 7, 18, 1, 1))
        assert qm.strides == (128 * 2, h * 128 * 2, 7 * 128 * 2, sq * h * 128 * 2)
        # the unpacked kernel when the rule says so, or when no packed variant serves the key
        core.attention_forward(targ((b, 300, h, 128), ptr=6 << 24), k, v, targ((b, 300, h, 128), ptr=7 << 24),
                               targ((b, h, 300), "fp32", 8 << 24), 0.1, True, 5, pack_gqa=False)
        assert "packgqa" not in d.launches[-1]["symbol"]
        q16 = targ((b, sq, h, 128), "fp16", 9 << 24)
        kv16 = targ((b, sk, hk, 128), "fp16", 10 << 24)
        core.attention_forward(q16, kv16, kv16, targ((b, sq, h, 128), "fp16", 11 << 24), lse, 0.1, True, 5)
        assert "packgqa" not in d.launches[-1]["symbol"]  # no fp16 packed variant: the rule's choice falls back
        with pytest.raises(core.MissingVariantError):  # asked for: no fallback
            core.attention_forward(q16, kv16, kv16, targ((b, sq, h, 128), "fp16", 11 << 24), lse, 0.1, True, 5,
                                   pack_gqa=True)
    finally:
        tuning.reset()


def _tile_record(key: dict, block_m: int, consumer_wgs: int, default: bool, tag: str) -> dict:
    """record(key) at another tile, named with ``tag``."""
    rec = record(key)
    name = rec["name"] + tag
    rec.update(name=name, fatbin=f"fatbin/{name}.fatbin", default=default)
    rec["params"].update(block_m=block_m, consumer_wgs=consumer_wgs)
    rec["kernels"][0]["symbol"] = f"flashgen_{name}_main"
    return rec


def test_decode_like_packed_calls_take_the_decode_tile(tmp_path, monkeypatch):
    """PackGQA calls with seqlen_q <= core.PACK_GQA_DECODE_MAX_SEQLEN_Q run on the key's decode tile (configs/fwd.yaml
    extra: 128 x 128, 2 consumer warpgroups at head_dim 64) where one is built, by the rule or asked for; longer
    ones, a group that the decode tile cannot hold, keys without one and a named variant run on the key's own tile."""
    packed = dict(dtype="bf16", head_dim=64, head_dim_v=64, causal=False, local=False, softcap=False, pack_gqa=True)
    own16 = dict(packed, dtype="fp16")
    recs = [_tile_record(packed, 192, 3, True, "_own"), _tile_record(packed, 128, 2, False, "_decode"),
            _tile_record(own16, 192, 3, True, "_own")]
    d = _fake_driver(tmp_path, monkeypatch, KEYS, recs)
    try:
        assert core.PACK_GQA_DECODE_MAX_SEQLEN_Q == 64 and core._PACK_GQA_DECODE_TILE == {"block_m": 128, "consumer_wgs": 2}
        b, sk, hk = 2, 1000, 4

        def run(sq, h, dtype="bf16", **kw):
            q, out = targ((b, sq, h, 64), dtype, 1 << 24), targ((b, sq, h, 64), dtype, 4 << 24)
            k, v = targ((b, sk, hk, 64), dtype, 2 << 24), targ((b, sk, hk, 64), dtype, 3 << 24)
            used = core.attention_forward(q, k, v, out, targ((b, h, sq), "fp32", 5 << 24), 0.1, False, 5, **kw)
            return used, d.launches[-1]["symbol"], _params_of(d.launches[-1])["tile_queries"]

        for sq in (1, 4, 64):  # group 4: 32 positions per 128-row tile
            used, sym, tq = run(sq, 4 * hk)
            assert used.params["pack_gqa"] and "_decode" in sym and tq == 32 and not used.default, sq
        used, sym, tq = run(65, 4 * hk, pack_gqa=True)  # past the bound: the key's 192-row tile, 48 positions
        assert "_own" in sym and tq == 48 and used.default
        used, sym, tq = run(16, 4 * hk, pack_gqa=True)  # asked for
        assert "_decode" in sym and tq == 32
        used, sym, tq = run(1, 160 * hk)  # group 160 > 128 rows: the key's tile holds it (one position)
        assert used.params["pack_gqa"] and "_own" in sym and tq == 1
        used, sym, tq = run(1, 160 * hk, pack_gqa=True)
        assert "_own" in sym and tq == 1
        used, sym, tq = run(1, 4 * hk, "fp16")  # no decode tile built for the key
        assert "_own" in sym and tq == 48
        from flashgen.manifest import load_manifest
        own = next(v for v in load_manifest().variants if v.name.endswith("_own") and v.params["dtype"] == "bf16")
        used, sym, tq = run(1, 4 * hk, variant=own)
        assert used is own and tq == 48
        assert core.pack_gqa_served("bf16", 64, 64, False, (-1, -1), 1, sk, 0.0, 160 * hk, hk, 0)
        assert not core.pack_gqa_served("bf16", 64, 64, False, (-1, -1), 1, sk, 0.0, 200 * hk, hk, 0)
    finally:
        tuning.reset()


def test_one_warpgroup_decode_tile_by_packed_rows(tmp_path, monkeypatch):
    """PackGQA calls whose packed rows (group x seqlen_q) fit 64 run on the key's one-warpgroup tile (64 x 128,
    core.DECODE_WG1) where one is built, 64 query rows per tile; more rows with seqlen_q <= 64 on the 128-row
    decode tile; without a one-warpgroup tile or with DECODE_WG1 off, the 128-row tile (or the key's own)."""
    packed = dict(dtype="bf16", head_dim=64, head_dim_v=64, causal=False, local=False, softcap=False, pack_gqa=True)
    own16 = dict(packed, dtype="fp16")
    wg1 = _tile_record(packed, 64, 1, False, "_wg1")
    wg1["params"].update(pingpong=False)
    recs = [_tile_record(packed, 192, 3, True, "_own"), _tile_record(packed, 128, 2, False, "_decode"), wg1,
            _tile_record(own16, 192, 3, True, "_own")]
    d = _fake_driver(tmp_path, monkeypatch, KEYS, recs)
    monkeypatch.setattr(core, "DECODE_WG1", True)
    try:
        assert core._DECODE_WG1_TILE == {"block_m": 64, "consumer_wgs": 1}
        b, sk, hk = 2, 1000, 4

        def run(sq, h, dtype="bf16", **kw):
            q, out = targ((b, sq, h, 64), dtype, 1 << 24), targ((b, sq, h, 64), dtype, 4 << 24)
            k, v = targ((b, sk, hk, 64), dtype, 2 << 24), targ((b, sk, hk, 64), dtype, 3 << 24)
            core.attention_forward(q, k, v, out, targ((b, h, sq), "fp32", 5 << 24), 0.1, False, 5, **kw)
            return d.launches[-1]["symbol"], _params_of(d.launches[-1])["tile_queries"]

        # group 4: rows 4 x seqlen_q; group 8: 8 x seqlen_q; group 64: 64 rows at seqlen_q 1
        for sq, group, tag, tq in ((1, 4, "_wg1", 16), (16, 4, "_wg1", 16), (17, 4, "_decode", 32),
                                   (8, 8, "_wg1", 8), (9, 8, "_decode", 16), (1, 64, "_wg1", 1),
                                   (64, 4, "_decode", 32), (65, 4, "_own", 48)):
            sym, got = run(sq, group * hk, pack_gqa=True)
            assert tag in sym and got == tq, (sq, group, sym, got)
        sym, tq = run(1, 4 * hk, "fp16", pack_gqa=True)  # no decode tile built for the key: its own
        assert "_own" in sym and tq == 48
        monkeypatch.setattr(core, "DECODE_WG1", False)
        sym, tq = run(2, 4 * hk, pack_gqa=True)  # a new question (seqlen_q 2): the 128-row decode tile
        assert "_decode" in sym and tq == 32
    finally:
        tuning.reset()


def test_few_tile_calls_take_the_128_row_tile(tmp_path, monkeypatch):
    """16-bit calls whose 192-row tiles are few (core.FEW_TILE) run on the key's 128 x 128 two-warpgroup tile where it
    takes no more waves of tiles over the 132 SMs (packed by pack_gqa_rule at 128 rows), and stay on the key's tile
    where it takes more, without the tile built, with FEW_TILE off, with a variant named, and for causal calls whose
    mask removes more than a little (seqlen_k < 8 seqlen_q), local windows and softcap."""
    base = dict(dtype="bf16", head_dim=64, head_dim_v=64, causal=False, local=False, softcap=False)
    recs = []
    for key in (base, dict(base, causal=True), dict(base, local=True), dict(base, softcap=True)):
        for pg in (False, True):
            k = dict(key, pack_gqa=pg)
            recs += [_tile_record(k, 192, 3, True, "_own"), _tile_record(k, 128, 2, False, "_few")]
    recs.append(_tile_record(dict(base, dtype="fp16"), 192, 3, True, "_own"))
    d = _fake_driver(tmp_path, monkeypatch, KEYS, recs)
    monkeypatch.setattr(core, "FEW_TILE", True)
    try:
        assert core._FEW_TILE == {"block_m": 128, "consumer_wgs": 2} and core.FEW_TILE_CAUSAL_KEYS == 8

        def run(b, sq, sk, h, hk, dtype="bf16", causal=False, window=(-1, -1), softcap=0.0, **kw):
            q, out = targ((b, sq, h, 64), dtype, 1 << 24), targ((b, sq, h, 64), dtype, 4 << 24)
            k, v = targ((b, sk, hk, 64), dtype, 2 << 24), targ((b, sk, hk, 64), dtype, 3 << 24)
            core.attention_forward(q, k, v, out, targ((b, h, sq), "fp32", 5 << 24), 0.1, causal, 5,
                                   window_size=window, softcap=softcap, **kw)
            rec = d.launches[-1]
            return rec["symbol"], _params_of(rec)["num_tiles"]

        # 2 x 32 heads x 512 queries: 3 x 64 = 192 tiles of 192 rows (2 waves), 4 x 64 = 256 of 128 (2 waves)
        sym, tiles = run(2, 512, 16384, 32, 8)
        assert "_few" in sym and "packgqa" not in sym and tiles == 256, (sym, tiles)
        sym, tiles = run(2, 512, 16384, 32, 8, causal=True)  # 16384 >= 8 x 512: the mask removes little
        assert "_few" in sym and "_c1_" in sym and tiles == 256
        # 768 queries at batch 1: 4 x 32 = 128 tiles (1 wave) against 6 x 32 = 192 (2 waves)
        sym, tiles = run(1, 768, 16384, 32, 8)
        assert "_few" not in sym and tiles == 128
        # packed at 192 rows (group 8, 128 queries: 6 x 4 x 4 = 96 tiles), not at 128 (128 x 4 x 4 = 128 tiles)
        sym, tiles = run(4, 128, 8192, 32, 4)
        assert "_few" in sym and "packgqa" not in sym and tiles == 128
        # packed at both: group 8, 100 queries, 24 or 16 positions a tile: 5 x 8 = 40 or 7 x 8 = 56 tiles
        sym, tiles = run(2, 100, 8192, 32, 4)
        assert "_few" in sym and "packgqa" in sym and tiles == 56
        sym, tiles = run(2, 512, 2048, 32, 8, causal=True)  # 2048 < 8 x 512: the key's tile
        assert "_few" not in sym and tiles == 192
        for kw in (dict(window=(256, 0)), dict(softcap=15.0), dict(dtype="fp16")):
            sym, _ = run(2, 512, 16384, 32, 8, **kw)
            assert "_few" not in sym, kw
        own = next(v for v in core.load_manifest().variants if v.name.endswith("_c0_l0_s0_own"))
        sym, _ = run(2, 512, 16384, 32, 8, variant=own)
        assert "_own" in sym
        for sq in (512, 1024, 2048, 4096, 8192, 16384):  # FA3's grid (16k tokens, 32 heads): 21-24 waves against 32
            sym, _ = run(16384 // sq, sq, sq, 32, 32)
            assert "_few" not in sym, sq
        monkeypatch.setattr(core, "FEW_TILE", False)
        sym, tiles = run(2, 513, 16384, 32, 8)  # a new shape (prepared calls are per shape)
        assert "_few" not in sym and tiles == 192
    finally:
        tuning.reset()


def test_few_tile_varlen_calls_take_the_128_row_tile(tmp_path, monkeypatch):
    """Varlen-kernel calls (a kvcache chunked prefill over a padded q, a packed q by cu_seqlens_q, a split call's
    partials) take the key's 128 x 128 two-warpgroup varlen tile by core.FEW_TILE's wave rule only while
    core.FEW_TILE_VARLEN: off (the default), with FEW_TILE off, or where the 128-row tiles take more waves (a split
    call's tiles x splits counted), they stay on the key's 192-row tile."""
    base = dict(dtype="bf16", head_dim=64, head_dim_v=64, causal=False, local=False, softcap=False, varlen=True)
    recs = []
    for key in (base, dict(base, causal=True)):
        for pg in (False, True):
            k = dict(key, pack_gqa=pg)
            recs += [_tile_record(k, 192 if not pg else 128, 3 if not pg else 2, True, "_own")]
            if not pg:
                recs.append(_tile_record(k, 128, 2, False, "_few"))
    d = _fake_driver(tmp_path, monkeypatch, KEYS, recs)
    assert core.FEW_TILE_VARLEN is False  # (off until measured on a GPU)
    monkeypatch.setattr(core, "FEW_TILE", True)
    try:
        def run(b, sq, sk, h, hk, causal=False, packed_q=False, splits=1):
            q, out = targ((b, sq, h, 64), "bf16", 1 << 24), targ((b, sq, h, 64), "bf16", 4 << 24)
            k, v = targ((b, sk, hk, 64), "bf16", 2 << 24), targ((b, sk, hk, 64), "bf16", 3 << 24)
            lse = targ((b, h, sq), "fp32", 5 << 24)
            if packed_q:
                q, out = targ((b * sq, h, 64), "bf16", 1 << 24), targ((b * sq, h, 64), "bf16", 4 << 24)
                lse = targ((h, b * sq), "fp32", 5 << 24)
                vl = core.Varlen(6 << 24, 0, 0, 8 << 24, b, sq, sk)
            elif splits > 1:
                out = targ((b, sq, h, 64), "fp32", 4 << 24)
                vl = core.Varlen(0, 0, 0, 8 << 24, b, sq, sk, num_splits=splits, o_stride_split=b * sq * h * 64,
                                 lse_stride_split=b * h * sq)
            else:
                vl = core.Varlen(0, 0, 0, 8 << 24, b, sq, sk)  # a KV cache's lengths (seqused_k)
            core.attention_forward(q, k, v, out, lse, 0.1, causal, 5, varlen=vl)
            rec = d.launches[-1]
            return rec["symbol"], _params_of(rec)["num_tiles"]

        # 2 x 32 heads x 512 queries over a 16k cache: 192 tiles of 192 rows, 256 of 128 (2 waves each)
        sym, tiles = run(2, 512, 16384, 32, 8)
        assert "_own" in sym and "_varlen" in sym and tiles == 192, (sym, tiles)  # FEW_TILE_VARLEN off
        monkeypatch.setattr(core, "FEW_TILE_VARLEN", True)
        sym, tiles = run(2, 512, 16383, 32, 8)  # (a new shape: prepared calls are per shape)
        assert "_few" in sym and "_varlen" in sym and "packgqa" not in sym and tiles == 256, (sym, tiles)
        sym, tiles = run(2, 512, 16384, 32, 8, causal=True)  # 16384 >= 8 x 512
        assert "_few" in sym and "_c1_" in sym and tiles == 256, (sym, tiles)
        sym, tiles = run(2, 512, 2048, 32, 8, causal=True)  # 2048 < 8 x 512: the key's tile
        assert "_own" in sym and tiles == 192
        sym, tiles = run(1, 768, 16384, 32, 8)  # 128 tiles (1 wave) against 192 (2 waves)
        assert "_own" in sym and tiles == 128
        sym, tiles = run(2, 512, 16000, 32, 8, packed_q=True)  # q packed by cu_seqlens_q: max_seqlen_q's tiles
        assert "_few" in sym and "packgqa" not in sym and tiles == 256, (sym, tiles)
        # split partials: 2 splits x 96 tiles of 192 rows = 192 (2 waves), of 128 rows 2 x 128 = 256 (2 waves)
        sym, tiles = run(1, 512, 16384, 32, 8, splits=2)
        assert "_few" in sym and tiles == 256, (sym, tiles)
        # 3 splits: 288 tiles of 192 rows (3 waves) against 384 of 128 (3 waves); 4 splits: 384 (3) against 512 (4)
        assert run(1, 512, 16380, 32, 8, splits=3) == (sym, 384)
        sym, tiles = run(1, 512, 16384, 32, 8, splits=4)
        assert "_own" in sym and tiles == 384, (sym, tiles)
        monkeypatch.setattr(core, "FEW_TILE", False)
        sym, tiles = run(2, 512, 16385, 32, 8)
        assert "_own" in sym and tiles == 192
    finally:
        tuning.reset()


class _ExDriver(FakeDriver):
    """FakeDriver whose launches record only the symbol, the stream and (cuLaunchKernelEx) the
    attributes as (id, value) pairs."""

    def __init__(self):
        super().__init__()
        self.ex, self.plain = [], []

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        self.plain.append((f.symbol, int(stream)))
        return (0,)

    def CUlaunchAttribute(self):
        return _Handle(value=_Handle(clusterDim=_Handle()))

    def cuLaunchKernelEx(self, cfg, f, kernel_params, extra):
        out = []
        for a in cfg.attrs[:cfg.numAttrs]:
            if a.id == "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION":
                d = a.value.clusterDim
                out.append((a.id, (d.x, d.y, d.z)))
            else:
                out.append((a.id, a.value.programmaticStreamSerializationAllowed))
        self.ex.append((f.symbol, int(cfg.hStream), out))
        return (0,)


def _ex_kernel(monkeypatch, cluster, pdl):
    """An _ExDriver in place of the driver and a kernel "k_main" loaded through it (its launch
    attributes are built here, at load), with the given cluster shape and ``pdl`` record."""
    from flashgen.manifest import Kernel, Variant

    _fresh_state(monkeypatch)
    d = _ExDriver()
    monkeypatch.setattr(launch, "_driver", lambda: d)
    layout = {"struct": "P", "size": 8, "fields": [["x", "i64", 0]]}
    rec = Kernel(role="main", symbol="k_main", threads=128, cluster=cluster, smem_bytes=0, tensor_maps=(),
                 params=layout, pdl=pdl)
    var = Variant(name="v", family="bwd", params={}, dispatch={}, kernels=(rec,))
    return d, launch.LoadedKernel(var, rec, _Handle(3, symbol="k_main"), 0, launch.ParamsPacker(layout))


@pytest.mark.parametrize("cluster", [(1, 1, 1), (2, 1, 1)], ids=["single", "cluster"])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_pdl_kernels_launch_as_programmatic_dependents(monkeypatch, cluster, pdl):
    """A kernel whose manifest record has ``pdl`` (the backward's main and post: generator KernelSpec.pdl)
    launches through cuLaunchKernelEx with the programmatic stream serialization attribute allowed
    (beside the cluster attribute when clustered); one with neither through cuLaunchKernel."""
    d, kern = _ex_kernel(monkeypatch, cluster, pdl)
    launch.launch(kern, (4, 1, 1), (), {"x": 5}, 9)
    want = ([("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", cluster)] if cluster != (1, 1, 1) else []) + (
        [("CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION", 1)] if pdl else [])
    if want:
        assert d.ex == [("k_main", 9, want)] and d.plain == []
    else:
        assert d.ex == [] and d.plain == [("k_main", 9)]


@pytest.mark.parametrize("cluster", [(1, 1, 1), (2, 1, 1)], ids=["single", "cluster"])
def test_flashgen_pdl_0_launches_pdl_kernels_plainly(monkeypatch, cluster):
    """With $FLASHGEN_PDL=0 (read when the kernel is loaded) a ``pdl`` kernel launches without the
    programmatic attribute: through cuLaunchKernel, or with only its cluster attribute."""
    monkeypatch.setenv(launch.PDL_ENV, "0")
    d, kern = _ex_kernel(monkeypatch, cluster, True)
    monkeypatch.setenv(launch.PDL_ENV, "1")  # read at load: this kernel stays plain
    launch.launch(kern, (4, 1, 1), (), {"x": 5}, 9)
    if cluster == (1, 1, 1):
        assert d.ex == [] and d.plain == [("k_main", 9)]
    else:
        assert d.ex == [("k_main", 9, [("CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", cluster)])] and d.plain == []
