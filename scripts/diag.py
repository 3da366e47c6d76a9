"""Quick correctness overview on the GPU: O and LSE errors vs the float32 reference per variant key."""
import sys, os, torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from _ref import attention_ref, fa3_rule_ok
from test_fwd_gpu import run_fwd, make_inputs
from flashgen.manifest import load_manifest
rows = []
for var in load_manifest().variants:
    if var.family != "fwd":
        continue
    p = var.params
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
    for (b, sq, sk, h, hk) in [(1, 1, 1, 2, 2), (1, 1, 7, 1, 1), (2, 17, 113, 4, 2), (2, 300, 517, 4, 2), (1, 1000, 1000, 2, 1)]:
        q, k, v = make_inputs(b, sq, sk, h, hk, p["head_dim"], dtype, seed=sq + sk)
        sc = p["head_dim"] ** -0.5
        out, lse = run_fwd(q, k, v, bool(p["causal"]), sc, var)
        torch.cuda.synchronize()
        ref, lref = attention_ref(q, k, v, bool(p["causal"]), sc)
        pt, _ = attention_ref(q, k, v, bool(p["causal"]), sc, upcast=False)
        ok, err, base = fa3_rule_ok(out, ref, pt)
        fin = torch.isfinite(lref)
        lerr = (lse[fin] - lref[fin]).abs().max().item() if fin.any() else 0.0
        nan = torch.isnan(out).sum().item()
        print(f"{var.name[:48]:<48} {b}x{sq}x{sk}x{h}/{hk} ok={ok} err={err:.2e} base={base:.2e} lse_err={lerr:.2e} nan={nan}")
        if sq == 1 and sk == 1:
            print("   lse", lse.flatten().tolist(), "ref", lref.flatten().tolist())
