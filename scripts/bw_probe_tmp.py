import torch, triton
from triton.testing import do_bench
x = torch.randn(16384*3, 2048, device='cuda', dtype=torch.bfloat16)  # q,k,v of 1x16384x16x128 together: 201 MB
y = torch.empty_like(x)
z = torch.empty(x.shape, device='cuda', dtype=torch.float8_e4m3fn)
r = torch.empty(16384*3*2048//4, device='cuda', dtype=torch.float32)
for name, fn, nbytes in [
    ("copy bf16->bf16 (read+write 2x201MB)", lambda: y.copy_(x), 2*x.numel()*2),
    ("cast bf16->e4m3 (201+100MB)", lambda: z.copy_(x), x.numel()*3),
    ("read-only sum (201MB)", lambda: x.sum(dtype=torch.float32), x.numel()*2),
    ("memcpy-like y.copy_ same", lambda: torch.cuda.memory._record_memory_history if False else y.copy_(x), 2*x.numel()*2),
]:
    ts = [do_bench(fn, warmup=5, rep=50) for _ in range(2)]
    print(f"{name}: {ts[0]*1e3:.1f} / {ts[1]*1e3:.1f} us -> {nbytes/ts[0]/1e9:.0f} / {nbytes/ts[1]/1e9:.0f} GB/s")
