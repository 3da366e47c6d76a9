import sys, torch
sys.path.insert(0, "tests/gpu")
from test_bwd_gpu import fg_backward, forward_out_lse
from _ref import make_qkv, randn
torch.manual_seed(0)
for (b, sq, sk, h, hk, d, causal) in [(1, 1024, 1024, 4, 4, 256, False), (1, 1024, 1024, 4, 4, 256, True), (2, 300, 300, 2, 2, 256, False), (1, 128, 128, 1, 1, 256, False)]:
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=1)
    dout = randn(b, sq, h, d, dtype=torch.bfloat16, seed=4)
    out, lse = forward_out_lse(q, k, v, causal, d ** -0.5)
    res = {}
    for det in (True, False):
        res[det] = fg_backward(dout, q, k, v, out, lse, causal, d ** -0.5, deterministic=det)
    torch.cuda.synchronize()
    for i, name in enumerate(("dq", "dk", "dv")):
        a, bb = res[True][i].float(), res[False][i].float()
        diff = (a - bb).abs()
        # per column half and per key block of dq
        msg = f"{name}: max|det-nondet| {diff.max().item():.4g} (scale {a.abs().max().item():.3g})"
        if name == "dq":
            msg += f" half0 {diff[..., :d//2].max().item():.3g} half1 {diff[..., d//2:].max().item():.3g}"
        print((b, sq, sk, h, d, causal), msg, flush=True)
