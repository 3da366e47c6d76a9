"""ds_pairs check (device machine): the hd256 backward's gradients, unordered (paired) and
deterministic (paired, ordered by pair), against the float32 reference: max |err| / max |ref| per gradient, and
for dk / dv the 64-row key blocks holding NaN (the poison of rows never written).
python scripts/pairs_smoke.py"""
import sys

import torch

sys.path.insert(0, "tests/gpu")
from test_bwd_gpu import fg_backward, forward_out_lse  # noqa: E402
from _ref import attention_grads_ref, make_qkv, randn  # noqa: E402

bad = 0
for (b, sq, sk, h, hk, causal) in [(1, 128, 128, 1, 1, False), (1, 1024, 1024, 4, 4, False), (1, 1024, 1024, 4, 4, True),
                                   (2, 333, 517, 4, 2, True), (2, 1, 130, 2, 2, False),
                                   (2, 1100, 333, 4, 2, False), (1, 700, 5900, 2, 1, False), (1, 300, 9001, 2, 1, True)]:
    d = 256
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=1)
    dout = randn(b, sq, h, d, dtype=torch.bfloat16, seed=4)
    out, lse = forward_out_lse(q, k, v, causal, d ** -0.5)
    ref = attention_grads_ref(q, k, v, dout, causal, d ** -0.5)
    for det in (True, False):
        got = fg_backward(dout, q, k, v, out, lse, causal, d ** -0.5, deterministic=det)
        torch.cuda.synchronize()
        msg = []
        for name, a, r in zip(("dq", "dk", "dv"), got, ref):
            e = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-20)).item()
            ok = e < 2e-2
            bad += not ok
            extra = ""
            if not ok and name != "dq":
                rows = torch.isnan(a.float()).any(-1).any(-1).any(0)  # (seqlen_k,)
                nb = [i for i in range(0, rows.numel(), 64) if rows[i:i + 64].any()]
                eb = (a.float() - r.float()).abs().nan_to_num(1e9).amax(dim=(0, 2, 3))
                worst = [i // 64 for i in range(0, eb.numel(), 64) if eb[i:i + 64].max() > 2e-2 * r.float().abs().max()]
                extra = f" (NaN blocks {[i // 64 for i in nb]}, bad blocks {worst})"
            msg.append(f"{name} {e:.2e}{'' if ok else ' BAD' + extra}")
        print((b, sq, sk, h, hk, causal), "det" if det else "default", " ".join(msg), flush=True)
print("smoke:", "FAIL" if bad else "ok")
