"""Where the host time of one forward call goes, on a GPU: flashgen.bench.measure_overhead's numbers
(flash_attn_func, core.attention_forward and SDPA on q, k, v (1, 128, 1, 128) bf16), then cProfile
over many calls of flash_attn_func's eager fast path and of core.attention_forward.

Usage: python scripts/overhead_profile.py [--calls 2000] [--top 20]
(without a GPU: scripts/overhead_cpu_stub.py, the same calls with the CUDA driver stubbed.)
"""
import argparse
import cProfile
import pstats

import torch

from flashgen import core
from flashgen.bench import measure_overhead
from flashgen.interface import flash_attn_func

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--calls", type=int, default=2000)
ap.add_argument("--top", type=int, default=20)
a = ap.parse_args()

print(f"host time per call on {torch.cuda.get_device_name()}, torch {torch.__version__}:")
for name, us in measure_overhead().items():
    print(f"  {name}: {us:.1f} us")

q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device="cuda")
args = [core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, 0)
        for t, dt in ((q, "bf16"), (k, "bf16"), (v, "bf16"), (out, "bf16"), (lse, "fp32"))]
stream = torch.cuda.current_stream().cuda_stream
for fn, name in ((lambda: flash_attn_func(q, k, v), "flash_attn_func"),
                 (lambda: core.attention_forward(*args, 0.1, False, stream), "core.attention_forward")):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"==== {name} (cProfile, {a.calls} calls; times include the profiler's own overhead)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
