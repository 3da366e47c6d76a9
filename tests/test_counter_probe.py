"""scripts/counter_probe.py's driver stand-in on the CPU (the probe itself needs a GPU): it must take exactly the
tile counter's 4-byte pool allocation, its memset and its free, count what it took (the probe refuses to time a
no_memset form that took nothing), and pass every other driver call through."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

PROBE = Path(__file__).resolve().parent.parent / "scripts" / "counter_probe.py"


def _stand_in(ptr=0x7000):
    spec = importlib.util.spec_from_file_location("counter_probe_under_test", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = []
    real = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), CUdeviceptr=int,
        cuMemAllocFromPoolAsync=lambda n, pool, st: calls.append(("alloc", n)) or (0, 0x9000),
        cuMemsetD32Async=lambda p, v, n, st: calls.append(("memset", int(p))) or (0,),
        cuMemFreeAsync=lambda p, st: calls.append(("free", int(p))) or (0,),
        cuLaunchKernel=lambda *a: calls.append(("launch",)) or (0,))
    return mod._PrezeroedCounter(real, ptr), calls


def test_the_counter_is_taken_and_everything_else_passes_through():
    d, calls = _stand_in()
    assert d.hits == 0
    assert d.cuMemAllocFromPoolAsync(4, "pool", 1) == (0, 0x7000) and d.hits == 1
    assert d.cuMemsetD32Async(0x7000, 0, 1, 1) == (0,) and d.cuMemFreeAsync(0x7000, 1) == (0,)
    assert calls == []  # (the counter's three calls never reach the driver)
    assert d.cuMemAllocFromPoolAsync(16, "pool", 1) == (0, 0x9000) and d.hits == 1  # not a counter: the driver's
    d.cuMemsetD32Async(0x9000, 0, 4, 1)
    d.cuMemFreeAsync(0x9000, 1)
    d.cuLaunchKernel("f")
    assert calls == [("alloc", 16), ("memset", 0x9000), ("free", 0x9000), ("launch",)]
