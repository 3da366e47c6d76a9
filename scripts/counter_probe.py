"""What the causal tile counter's per-call memset costs a flash_attn_func call (a GPU probe, issue 11).

Until session 13 a causal persistent forward got a 4-byte tile counter per launch: allocated from flashgen's
pool, zeroed by ``cuMemsetD32Async`` and freed, all on the call's stream (launch._launch_argv); since then an
eager call takes its stream's counter, which the kernel leaves at 0 (no memset). Run against an older tree
(device_check.sh counter with OLD=1), the probe measures what the memset cost there. This script
times one FA3-protocol point three ways, interleaved round by round, each repetition after a 256 MB
L2 flush and bracketed by CUDA events (the grid's method):

- ``flashgen``: flash_attn_func as shipped (the memset inside the timed region);
- ``no_memset``: the same call with the counter taken from a buffer zeroed *before* the start event
  (the driver's pool allocation, memset and free replaced in this process only), so the timed
  region holds the kernel alone (only where the call takes a counter of its own: a tree whose causal
  calls take their stream's counter, which needs no memset, has no such form);
- ``cudnn``: SDPA's cuDNN backend on the same tensors (BHSD views).

It first checks that the two flashgen forms give the same output bit for bit (the probe's counter
must be a real zero counter), then prints medians per round and the ratios, and the GPU ops of one
call of each form from torch.profiler (names, durations, gaps between them).

Usage: python scripts/counter_probe.py [--dtype bf16] [--head-dim 256] [--seqlen 512] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _PrezeroedCounter:
    """A stand-in for cuda.bindings.driver in flashgen.launch: 4-byte pool allocations (the tile counter) return
    ``ptr`` (a buffer the caller zeroes before each call), counted in ``hits``, and their memset and free do nothing;
    everything else is the real driver's."""

    def __init__(self, real, ptr: int):
        self._real, self._ptr, self.hits = real, ptr, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        if nbytes == 4:
            self.hits += 1
            return self._real.CUresult.CUDA_SUCCESS, self._real.CUdeviceptr(self._ptr)
        return self._real.cuMemAllocFromPoolAsync(nbytes, pool, stream)

    def cuMemsetD32Async(self, ptr, value, count, stream):
        if int(ptr) == self._ptr:
            return (self._real.CUresult.CUDA_SUCCESS,)
        return self._real.cuMemsetD32Async(ptr, value, count, stream)

    def cuMemFreeAsync(self, ptr, stream):
        if int(ptr) == self._ptr:
            return (self._real.CUresult.CUDA_SUCCESS,)
        return self._real.cuMemFreeAsync(ptr, stream)


def _timed(fn, before, flush, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` repetitions, each after ``flush.zero_()`` and ``before()``, bracketed by
    CUDA events (flashgen.bench._time_ms's fallback method, with the ``before`` hook outside the timed region that
    triton's do_bench, which _time_ms prefers, has no room for)."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        before()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _ops(fn, before, flush) -> list:
    """(name, start us, duration us) of the GPU ops one call of ``fn`` enqueues (torch.profiler), relative to the
    first op after the flush and ``before``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush.zero_()
    before()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    return [(e.name[:60], e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in evs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-ops", action="store_true", help="skip the torch.profiler listing of each form's GPU ops")
    a = ap.parse_args(argv)

    import torch
    from torch.nn.attention import SDPBackend

    import flashgen
    from flashgen import launch
    from flashgen.bench import _flops, _sdpa_fn

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    s, d = a.seqlen, a.head_dim
    b, h = 16384 // s, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    flops = _flops(b, h, s, d, True)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    counter = torch.zeros(64, dtype=torch.int32, device="cuda")  # (256 bytes: the pool's alignment)

    def fg():
        return flashgen.flash_attn_func(q, k, v, causal=True)

    cudnn = _sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, True)  # (BHSD views of the BSHD tensors, as the grid's)
    if cudnn is None:
        print("FAILED: SDPA's cuDNN backend does not run this call here")
        return 1

    real = launch._driver()
    probe = _PrezeroedCounter(real, counter.data_ptr())

    def shipped():
        launch._drv = real

    def prezeroed():
        launch._drv = probe
        counter.zero_()

    shipped()
    ref = fg().clone()
    prezeroed()
    alt = fg().clone()
    shipped()
    torch.cuda.synchronize()
    same = torch.equal(ref, alt)
    print(f"{torch.cuda.get_device_name()}; {a.dtype} hd{d} causal seqlen {s} (batch {b}, heads {h}); "
          f"no_memset output equal to shipped: {same}")
    if not same:
        print("FAILED: the probe's counter changed the output")
        return 1
    forms = {"flashgen": (fg, shipped), "no_memset": (fg, prezeroed), "cudnn": (cudnn, shipped)}
    if probe.hits == 0:  # (a launch path whose counter is not a 4-byte pool allocation: no_memset would be flashgen)
        if not hasattr(launch, "_stream_counters"):
            print("FAILED: the call took no 4-byte tile counter, so the no_memset form would time the shipped call")
            return 1
        print("the call takes its stream's tile counter (no memset per call): no no_memset form")
        del forms["no_memset"]
    for fn, before in forms.values():  # warm-up
        _timed(fn, before, flush, 20)
    res = {name: [] for name in forms}
    for r in range(a.rounds):
        for name, (fn, before) in forms.items():
            res[name].append(_timed(fn, before, flush, a.reps))
        print(f"round {r + 1}: " + ", ".join(f"{n} {res[n][-1] * 1e3:.1f} us" for n in forms), flush=True)
    shipped()
    print("\n| form | median us per round | TFLOP/s (median of rounds) | vs cudnn |")
    print("|---|---|---|---|")
    med = {n: statistics.median(x) for n, x in res.items()}
    for n in forms:
        print(f"| {n} | {' / '.join(f'{t * 1e3:.1f}' for t in res[n])} | {flops / (med[n] * 1e-3) / 1e12:.1f} | "
              f"{med['cudnn'] / med[n]:.4f} |")
    for name, (fn, before) in ([] if a.no_ops else forms.items()):
        ops = _ops(fn, before, flush)
        shipped()
        print(f"\n{name}: " + "; ".join(f"{n} @{t:.1f} +{dur:.1f} us" for n, t, dur in ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
