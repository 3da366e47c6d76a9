"""Memory bandwidth of torch's own elementwise kernels on the q, k, v bytes of 1 x 16384 x 16 x 128 (bf16, 201 MB
together), triton do_bench (L2 flushed between repetitions), twice each. Used in session 2026-12-04 (5) to see what a
streaming kernel reaches on the H200: a same-dtype copy, the e4m3 cast (quant_bench.py's reference row), a read-only
reduction."""
import torch
from triton.testing import do_bench

x = torch.randn(16384 * 3, 2048, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
z = torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn)
for name, fn, nbytes in [
    ("copy bf16 -> bf16 (read 201 MB, write 201 MB)", lambda: y.copy_(x), 4 * x.numel()),
    ("cast bf16 -> e4m3 (read 201 MB, write 100 MB)", lambda: z.copy_(x), 3 * x.numel()),
    ("sum in fp32 (read 201 MB)", lambda: x.sum(dtype=torch.float32), 2 * x.numel()),
]:
    ms = [do_bench(fn, warmup=5, rep=50) for _ in range(2)]
    print(f"{name}: {ms[0] * 1e3:.1f} / {ms[1] * 1e3:.1f} us -> {nbytes / ms[0] / 1e9:.2f} / {nbytes / ms[1] / 1e9:.2f} TB/s")
