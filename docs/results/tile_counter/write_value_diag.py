"""Which device memory cuStreamWriteValue32 accepts on this driver, and what a 4-byte memset costs on the
GPU's timeline (triton do_bench median, L2 flushed between repetitions) beside a causal forward call."""
import torch
from cuda.bindings import driver as d

from flashgen import launch
from flashgen.bench import _time_ms
from flashgen.interface import flash_attn_func

torch.cuda.init()
torch.empty(1, device="cuda")
s = torch.cuda.current_stream().cuda_stream
hs = d.CUstream(s)
print("driver", d.cuDriverGetVersion())
err, dev = d.cuDeviceGet(0)
for a in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1", "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"):
    if hasattr(d.CUdevice_attribute, a):
        print(a, d.cuDeviceGetAttribute(getattr(d.CUdevice_attribute, a), dev))
t = torch.zeros(4, dtype=torch.int32, device="cuda")
print("torch caching allocator memory:", d.cuStreamWriteValue32(hs, d.CUdeviceptr(t.data_ptr()), 7, 0))
print("  with cuuint32_t:", d.cuStreamWriteValue32(hs, d.CUdeviceptr(t.data_ptr()), d.cuuint32_t(7), 0))
torch.cuda.synchronize(); print("  value now", t.tolist())
err, p = d.cuMemAlloc(4)
print("cuMemAlloc memory:", d.cuStreamWriteValue32(hs, p, 0, 0))
pool = launch._counter_pool(0)
err, q = d.cuMemAllocFromPoolAsync(4, pool, hs)
print("pool memory (stream-ordered):", d.cuStreamWriteValue32(hs, q, 0, 0))
torch.cuda.synchronize()
print("pool memory after a sync:", d.cuStreamWriteValue32(hs, q, 0, 0))
err, dp = d.cuDeviceGetDefaultMemPool(dev)
err, r = d.cuMemAllocFromPoolAsync(4, dp, hs)
print("default pool memory:", d.cuStreamWriteValue32(hs, r, 0, 0))
torch.cuda.synchronize()
x = torch.empty(1, dtype=torch.int32, device="cuda")
memset = lambda: d.cuMemsetD32Async(d.CUdeviceptr(x.data_ptr()), 0, 1, hs)  # noqa: E731
print("memset 4 bytes alone: %.2f us" % (1000 * _time_ms(memset)))
for hd, sl in ((64, 512), (128, 512), (256, 512), (64, 2048)):
    b, h = 16384 // sl, 2048 // hd
    q_, k_, v_ = (torch.randn(b, sl, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fa = lambda: flash_attn_func(q_, k_, v_, causal=True)  # noqa: E731
    both = lambda: (memset(), flash_attn_func(q_, k_, v_, causal=True))  # noqa: E731
    print(f"hd{hd} causal {sl}: call {1000 * _time_ms(fa):.1f} us, memset + call {1000 * _time_ms(both):.1f} us, "
          f"call again {1000 * _time_ms(fa):.1f} us")
