"""Host time per forward call with the CUDA driver stubbed out: runs on a machine without a GPU.

Measures the Python cost of ``flashgen.flash_attn_func`` and ``flashgen.core.attention_forward`` on
the small problem of ``flashgen.bench.measure_overhead`` (q, k, v (1, 128, 1, 128) bf16), with:

* ``flashgen.launch._driver`` replaced by a fake module whose calls return ``(0, value)`` tuples at
  once (so the cost of cuda-python's own argument conversion and of the driver is NOT in these
  numbers: on a GPU add the real cuCtxGetCurrent, cuLaunchKernel(Ex) and, on a tensor-map cache
  miss, cuTensorMapEncodeTiled);
* a throwaway manifest with one fwd variant (the real FwdParams layout) and no fatbin read;
* CPU tensors counted as CUDA device 0 (``flashgen.interface._device_of``, with the same two
  tensor queries as the real one, ``is_cuda`` and ``get_device()``) and a fixed stream handle
  (``flashgen.interface._current_stream``): torch's stream lookup is NOT measured either.

So the numbers compare flashgen's own Python work before and after a change, nothing more; the GPU
measurement is ``flashgen.bench.measure_overhead`` (``flashgen bench``) and
``scripts/overhead_profile.py``. Usage: ``python scripts/overhead_cpu_stub.py [--n 20000] [--profile]``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace



def fwd_params_layout() -> dict:
    """The real FwdParams layout (generator/families/fwd.py), as the manifest records it."""
    from flashgen.generator.families.fwd import PARAMS

    return PARAMS.layout()


def write_manifest(folder: str, cluster=(1, 1, 1)) -> None:
    key = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": False, "local": False, "softcap": False}
    tile = {"block_m": 128, "block_n": 128, "stages": 2, "consumer_wgs": 2, "pingpong": True, "overlap": True,
            "persistent": True}
    name = "fwd_bf16_hd128_stub"
    rec = {"name": name, "key": "0" * 64, "family": "fwd", "params": {"family": "fwd", **key, **tile},
           "dispatch": key, "default": True, "fatbin": f"fatbin/{name}.fatbin", "sha256": "0" * 64,
           "kernels": [{"role": "main", "symbol": f"flashgen_{name}_main", "threads": 384, "cluster": list(cluster),
                        "smem_bytes": 198656, "registers": 168, "spill_bytes": 0, "stack_bytes": 0,
                        "tensor_maps": ["q", "k", "v", "o"], "sass": [],
                        "params": fwd_params_layout()}]}
    # the same kernel record as an e4m3 variant: FP8 calls with descales take the same launch path
    fp8 = json.loads(json.dumps(rec).replace("bf16", "e4m3"))
    # and as a varlen variant (core.Varlen: flash_attn_with_kvcache / flash_attn_varlen_func in one launch)
    varlen = json.loads(json.dumps(rec).replace("hd128_stub", "hd128_varlen_stub"))
    varlen["params"]["varlen"] = varlen["dispatch"]["varlen"] = True
    # and its PackGQA twin (decode with GQA on a padded q picks it, as in the default build)
    packed = json.loads(json.dumps(varlen).replace("hd128_varlen_stub", "hd128_packgqa_varlen_stub"))
    packed["params"]["pack_gqa"] = packed["dispatch"]["pack_gqa"] = True
    # and the bf16 combine variant (split-KV's merge of a varlen call's partials)
    from flashgen.generator.families.combine import PARAMS as COMBINE_PARAMS

    combine = {"name": "combine_bf16_stub", "key": "1" * 64, "family": "combine",
               "params": {"family": "combine", "dtype": "bf16", "block_m": 8, "threads": 128},
               "dispatch": {"dtype": "bf16"}, "default": True, "fatbin": "fatbin/combine_bf16_stub.fatbin",
               "sha256": "0" * 64,
               "kernels": [{"role": "main", "symbol": "flashgen_combine_bf16_stub_main", "threads": 128,
                            "cluster": [1, 1, 1], "smem_bytes": 0, "registers": 77, "spill_bytes": 0, "stack_bytes": 0,
                            "tensor_maps": [], "sass": [], "params": COMBINE_PARAMS.layout()}]}
    # and the bf16 hd128 causal backward, plain and varlen (the training step's), from the family module
    from flashgen.generator.families import bwd as bwd_mod

    bwds = []
    for vl in (False, True):
        bkey = {"dtype": "bf16", "head_dim": 128, "causal": True, "local": False, "softcap": False, "varlen": vl}
        bparams = {"family": "bwd", **bwd_mod.FAMILY.suggest(bkey)}
        bname = f"bwd_bf16_hd128_causal{'_varlen' if vl else ''}_stub"
        bwds.append({"name": bname, "key": ("3" if vl else "2") * 64, "family": "bwd", "params": bparams,
                     "dispatch": bkey, "default": True, "fatbin": f"fatbin/{bname}.fatbin", "sha256": "0" * 64,
                     "kernels": [{"role": k.role, "symbol": f"flashgen_{bname}_{k.role}", "threads": k.threads,
                                  "cluster": list(k.cluster), "smem_bytes": k.smem_bytes, "registers": 168,
                                  "spill_bytes": 0, "stack_bytes": 0, "tensor_maps": list(k.tensor_maps), "sass": [],
                                  "params": k.params.layout()}
                                 for k in bwd_mod.FAMILY.kernels(bparams, bwd_mod.FAMILY.resources(bparams))]})
    # and the varlen_prep kernel (the offsets checked and out / lse filled where they are not read on the host)
    from flashgen.generator.families.varlen_prep import KVCACHE_PARAMS
    from flashgen.generator.families.varlen_prep import PARAMS as PREP_PARAMS

    prep = {"name": "varlen_prep_stub", "key": "4" * 64, "family": "varlen_prep",
            "params": {"family": "varlen_prep", "threads": 256}, "dispatch": {}, "default": True,
            "fatbin": "fatbin/varlen_prep_stub.fatbin", "sha256": "0" * 64,
            "kernels": [{"role": "main", "symbol": "flashgen_varlen_prep_stub_main", "threads": 256,
                         "cluster": [1, 1, 1], "smem_bytes": 0, "registers": 40, "spill_bytes": 0, "stack_bytes": 0,
                         "tensor_maps": [], "sass": [], "params": PREP_PARAMS.layout()},
                        {"role": "kvcache", "symbol": "flashgen_varlen_prep_stub_kvcache", "threads": 256,
                         "cluster": [1, 1, 1], "smem_bytes": 0, "registers": 32, "spill_bytes": 0, "stack_bytes": 0,
                         "tensor_maps": [], "sass": [], "params": KVCACHE_PARAMS.layout()}]}
    causal = json.loads(json.dumps(rec).replace("hd128_stub", "hd128_causal_stub"))
    causal["params"]["causal"] = causal["dispatch"]["causal"] = True
    causal_varlen = json.loads(json.dumps(varlen).replace("hd128_varlen_stub", "hd128_causal_varlen_stub"))
    causal_varlen["params"]["causal"] = causal_varlen["dispatch"]["causal"] = True
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"schema": 2, "arch": "sm_90a", "nvcc": {"path": "nvcc", "version": "13.0"},
                   "variants": [rec, fp8, varlen, packed, combine, causal, causal_varlen, *bwds, prep]}, f)


class _Handle:
    """A driver handle (CUcontext, CUfunction, CUstream, CUtensorMap ...): int() and getPtr()."""

    def __init__(self, value=0):
        self.value = int(value)

    def __int__(self):
        return self.value

    def getPtr(self):
        return id(self)


class _Enum:
    def __getattr__(self, name):
        return name


def fake_driver():
    """A stand-in for cuda.bindings.driver: every call returns (0, value) immediately."""
    ok = 0
    ctx = _Handle(0x1234)
    calls = {"launch": 0, "encode": 0}

    def launch_ex(cfg, f, args, extra):
        calls["launch"] += 1
        return (ok,)

    def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        calls["launch"] += 1
        return (ok,)

    def encode(*a):
        calls["encode"] += 1
        return (ok, _Handle())

    attrs = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9, "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
             "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 132, "CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE": 2619000,
             "CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH": 5120}
    d = SimpleNamespace(
        calls=calls,
        cuInit=lambda flags: (ok,),
        cuDeviceGet=lambda i: (ok, i),
        cuDevicePrimaryCtxRetain=lambda dev: (ok, ctx),
        cuCtxGetCurrent=lambda: (ok, ctx),
        cuCtxPushCurrent=lambda c: (ok,),
        cuCtxPopCurrent=lambda: (ok, ctx),
        CUdevice_attribute=SimpleNamespace(**{k: i for i, k in enumerate(attrs)}),
        cuDeviceGetAttribute=lambda attr, dev: (ok, list(attrs.values())[attr]),
        cuDeviceGetName=lambda n, dev: (ok, b"Stub GPU\0"),
        cuGetErrorName=lambda e: (ok, b"CUDA_ERROR_STUB"),
        cuLibraryLoadData=lambda *a: (ok, _Handle(1)),
        cuLibraryGetKernel=lambda lib, sym: (ok, _Handle(2)),
        cuKernelGetFunction=lambda k: (ok, _Handle(3)),
        cuFuncSetAttribute=lambda *a: (ok,),
        CUfunction_attribute=_Enum(),
        CUstream=_Handle,
        CUlaunchConfig=lambda: SimpleNamespace(),
        CUlaunchAttribute=lambda: SimpleNamespace(value=SimpleNamespace(clusterDim=SimpleNamespace())),
        CUlaunchAttributeID=_Enum(),
        cuLaunchKernelEx=launch_ex,
        cuLaunchKernel=launch,
        cuTensorMapEncodeTiled=encode,
        CUtensorMapDataType=_Enum(),
        CUtensorMapInterleave=_Enum(),
        CUtensorMapSwizzle=_Enum(),
        CUtensorMapL2promotion=_Enum(),
        CUtensorMapFloatOOBfill=_Enum(),
        cuuint64_t=int,
        cuuint32_t=int,
        # causal calls with more tiles than SMs: the stream's tile counter (launch._launch_argv)
        cuStreamIsCapturing=lambda stream: (ok, 0),
        cuStreamGetId=lambda stream: (ok, 1),
        CUmemPoolProps=lambda: SimpleNamespace(location=SimpleNamespace()),
        CUmemAllocationType=_Enum(),
        CUmemAllocationHandleType=_Enum(),
        CUmemLocationType=_Enum(),
        CUmemPool_attribute=_Enum(),
        cuMemPoolCreate=lambda props: (ok, _Handle(9)),
        cuMemPoolSetAttribute=lambda *a: (ok,),
        cuMemAllocFromPoolAsync=lambda size, pool, stream: (ok, 0x7000_0000),
        cuMemsetD32Async=lambda *a: (ok,),
        cuMemFreeAsync=lambda *a: (ok,),
    )
    return d


def install(kernel_dir: str):
    """Point flashgen at the stub manifest and the fake driver; returns (torch, flashgen modules, driver)."""
    os.environ["FLASHGEN_KERNEL_DIR"] = kernel_dir
    os.environ["FLASHGEN_TUNE_TABLE"] = "off"
    import torch

    from flashgen import core, interface, launch

    drv = fake_driver()
    launch._drv = drv
    launch._driver = lambda: drv
    launch.read_fatbin = lambda path, sha: b""
    interface._device_of = lambda t: (not t.is_cuda, t.get_device() + 1)  # CPU (-1) counts as cuda:0
    interface._current_stream = lambda device: 7
    return torch, core, interface, launch, drv


def timeit(fn, n: int) -> float:
    """Microseconds of this thread's CPU time per call of ``fn``: the best of 7 runs of n calls
    (CPU time, not wall time, so that other processes on a busy machine disturb it less)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(7):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--profile", action="store_true", help="cProfile flash_attn_func instead of timing")
    ap.add_argument("--only", default="", help="only the calls whose name contains this text")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as kdir:
        write_manifest(kdir)
        torch, core, interface, launch, drv = install(kdir)
        q, k, v = (torch.randn(1, 128, 1, 128, dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(1, 1, 128, dtype=torch.float32)
        args = [core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, 0)
                for t, dt in ((q, "bf16"), (k, "bf16"), (v, "bf16"), (out, "bf16"), (lse, "fp32"))]
        q8 = q.to(torch.float8_e4m3fn)
        ds = torch.ones(1, 1)
        fns = {"flash_attn_func": lambda: interface.flash_attn_func(q, k, v),
               "flash_attn_func e4m3 + descales": lambda: interface.flash_attn_func(q8, q8, q8, q_descale=ds,
                                                                                    k_descale=ds, v_descale=ds),
               "core.attention_forward": lambda: core.attention_forward(*args, 0.088, False, 7)}
        from flashgen import flash_attn_with_kvcache

        # decode: 64 caches of distinct lengths, one query and one new key each (GQA 32 / 8): the varlen kernel's one launch
        # against the composed path's one flash_attn_func call per entry (core.VARLEN_KERNEL on / off)
        qd = torch.randn(64, 1, 32, 128, dtype=torch.bfloat16)
        kc, vc = (torch.randn(64, 1024, 8, 128, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.arange(300, 364, dtype=torch.int32)

        kn, vn = (torch.randn(64, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2))

        def decode(on: bool, prep: bool = False):  # one new token per entry appended (the same positions every call),
            # then attention; prep: the checks and the append by the kvcache kernel (core.VARLEN_PREP_KERNEL), else by
            # torch ops (index_put: real CPU copies here, of 64 x 8 x 128 elements, which a GPU would only queue)
            core.VARLEN_KERNEL = on
            core.VARLEN_PREP_KERNEL = prep
            return flash_attn_with_kvcache(qd, kc, vc, kn, vn, cache_seqlens=lens, causal=True)

        fns["flash_attn_with_kvcache, 64 entries, varlen kernel"] = lambda: decode(True)
        fns["flash_attn_with_kvcache, 64 entries, varlen kernel + kvcache prep kernel"] = lambda: decode(True, True)
        fns["flash_attn_with_kvcache, 64 entries, composed"] = lambda: decode(False)
        # the same caches as pages of 16 rows (kernel only: the composed path's per-entry gathers are real copies on
        # the CPU, which a GPU would only queue, so its time here would not be host time)
        kp, vp = (c.view(64 * 64, 16, 8, 128) for c in (kc, vc))
        table = torch.randperm(64 * 64, generator=torch.Generator().manual_seed(0)).view(64, 64).to(torch.int32)

        def decode_paged(prep: bool = False):
            core.VARLEN_KERNEL = True
            core.VARLEN_PREP_KERNEL = prep
            return flash_attn_with_kvcache(qd, kp, vp, kn, vn, cache_seqlens=lens, page_table=table, causal=True)

        fns["flash_attn_with_kvcache, 64 entries, paged (16 rows), varlen kernel"] = decode_paged
        fns["flash_attn_with_kvcache, 64 entries, paged (16 rows), varlen kernel + kvcache prep kernel"] = \
            lambda: decode_paged(True)

        def decode_split():  # 8 long caches: split-KV (4 splits) and the combine's launch
            core.VARLEN_KERNEL = True
            return flash_attn_with_kvcache(qd[:8], kc[:8], vc[:8], cache_seqlens=lens[:8], causal=True, num_splits=4)

        fns["flash_attn_with_kvcache, 8 entries, 4 splits + combine, varlen kernel"] = decode_split

        def func_split():  # flash_attn_func's num_splits (flashgen.split_kv): the prepared varlen + combine launches
            core.VARLEN_KERNEL = True
            return interface.flash_attn_func(qd[:8], kc[:8], vc[:8], num_splits=4)

        fns["flash_attn_func, 8 entries of 1 row over 1k keys, 4 splits + combine"] = func_split

        # training on packed documents: flash_attn_varlen_func forward + backward (torch.autograd.grad), 16 documents of
        # distinct lengths, on the varlen kernels both ways against the composed path (its padded groups). Small
        # tensors (1 head, 8-53 tokens): the composed path's index copies and the autograd graph's own ops are real
        # CPU work here, which a GPU would only queue, so they are kept small; the kernels' path has none.
        doc_lens = [8 + 3 * i for i in range(16)]
        cu_docs = torch.tensor([0] + torch.tensor(doc_lens).cumsum(0).tolist(), dtype=torch.int32)
        qt, kt, vt = (torch.randn(sum(doc_lens), 1, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout_t = torch.randn(sum(doc_lens), 1, 128, dtype=torch.bfloat16)

        def train_step(on: bool, prep: bool = False):
            core.VARLEN_KERNEL = core.VARLEN_BWD_KERNEL = on
            core.VARLEN_PREP_KERNEL = prep
            out_t = interface.flash_attn_varlen_func(qt, kt, vt, cu_docs, cu_docs, max(doc_lens), max(doc_lens),
                                                     causal=True)
            return torch.autograd.grad(out_t, (qt, kt, vt), dout_t)

        # a training step of flash_attn_func (bf16 hd128 causal): torch.ops.flashgen.fwd's autograd formula and
        # torch.ops.flashgen.bwd (preprocess, main, postprocess)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        dout_g = torch.randn_like(q)

        def fa_train():
            out_g = interface.flash_attn_func(qg, kg, vg, causal=True)
            return torch.autograd.grad(out_g, (qg, kg, vg), dout_g)

        def varlen_fwd(prep: bool = False):  # the forward alone (no gradient): the varlen kernel; the stub's CPU
            # offsets count as on q's device, so this times the no-host-read path (core.VARLEN_NO_HOST_READ, the
            # default; =0: the host path); prep: core.VARLEN_PREP_KERNEL (one launch instead of torch checks + memsets)
            core.VARLEN_KERNEL = True
            core.VARLEN_PREP_KERNEL = prep
            with torch.no_grad():
                return interface.flash_attn_varlen_func(qt, kt, vt, cu_docs, cu_docs, max(doc_lens), max(doc_lens),
                                                        causal=True)

        fns["flash_attn_func forward + backward (causal)"] = fa_train
        fns["flash_attn_varlen_func forward, 16 documents, varlen kernel"] = varlen_fwd
        fns["flash_attn_varlen_func forward, 16 documents, varlen kernel + prep kernel"] = lambda: varlen_fwd(True)
        fns["flash_attn_varlen_func forward + backward, 16 documents, varlen kernels"] = lambda: train_step(True)
        fns["flash_attn_varlen_func forward + backward, 16 documents, varlen kernels + prep kernel"] = \
            lambda: train_step(True, True)
        fns["flash_attn_varlen_func forward + backward, 16 documents, composed"] = lambda: train_step(False)
        fns = {name: fn for name, fn in fns.items() if a.only in name}
        if a.profile:
            import cProfile
            import pstats

            for fn in fns.values():
                timeit(fn, 100)
            for name, fn in fns.items():
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(a.n):
                    fn()
                pr.disable()
                print(f"==== {name}")
                # (STUB_SORT: a pstats sort key, e.g. cumulative; STUB_ROWS: how many rows)
                stats = pstats.Stats(pr).sort_stats(os.environ.get("STUB_SORT", "tottime"))
                stats.print_stats(int(os.environ.get("STUB_ROWS", "16")))
            return 0
        print(f"flashgen from {os.path.dirname(interface.__file__)}; torch {torch.__version__}; "
              f"python {sys.version.split()[0]}; CUDA driver stubbed (CPU-stub numbers)")
        for name, fn in fns.items():
            before = drv.calls["launch"]
            us = timeit(fn, a.n if "64 entries" not in name and "16 documents" not in name else max(a.n // 100, 20))
            assert drv.calls["launch"] > before, "no launch reached the (fake) driver"
            print(f"CPU-stub host time per call, {name}: {us:.2f} us")
        empty = torch.empty((1, 128, 1, 128), dtype=torch.bfloat16)
        print(f"(reference: torch.empty of out's shape: {timeit(lambda: torch.empty((1, 128, 1, 128), dtype=torch.bfloat16), a.n):.2f} us, "
              f"new_empty: {timeit(lambda: q.new_empty((1, 128, 1, 128)), a.n):.2f} us, "
              f"data_ptr: {timeit(empty.data_ptr, a.n):.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
