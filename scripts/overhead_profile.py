"""Where the host time of one forward call goes (cProfile over many calls of a tiny problem)."""
import cProfile
import pstats

import torch

from flashgen import core
from flashgen.interface import flash_attn_func

q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(1, 1, 128, device="cuda")
args = [core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, 0)
        for t, dt in ((q, "bf16"), (k, "bf16"), (v, "bf16"), (out, "bf16"), (lse, "fp32"))]
stream = torch.cuda.current_stream().cuda_stream
for fn, name in ((lambda: flash_attn_func(q, k, v), "flash_attn_func"),
                 (lambda: core.attention_forward(*args, 0.1, False, stream), "core")):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"==== {name}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
