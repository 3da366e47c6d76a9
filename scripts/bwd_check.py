"""Backward kernels straight through flashgen.core (no autograd layer): gradients against a float32
reference with FA3's rule, determinism, and a short timing against SDPA (cuDNN, flash).

    python scripts/bwd_check.py correct      # the shape/head_dim/causal/GQA sweep
    python scripts/bwd_check.py time         # FA3-protocol points, backward only, L2 flushed
A development tool for the device machine; the test suite's GPU tests are tests/gpu/test_bwd_gpu.py."""
from __future__ import annotations

import math
import sys

import torch

from flashgen import core
from flashgen.bench import _time_ms

NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def arg(t):
    return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), NAMES[t.dtype], t.device.index or 0)


def fwd(q, k, v, causal, scale):
    b, sq, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
    core.attention_forward(arg(q), arg(k), arg(v), arg(out), arg(lse), scale, causal,
                           torch.cuda.current_stream().cuda_stream)
    return out, lse


def bwd(dout, q, k, v, out, lse, causal, scale, deterministic=False, poison=True):
    dq, dk, dv = (torch.full_like(x, float("nan")) if poison else torch.empty_like(x) for x in (q, k, v))
    b, sq, h, d = q.shape
    nbytes = core.backward_workspace_bytes(b, sq, h, k.shape[2], d, NAMES[q.dtype], causal, q.device.index or 0)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    core.attention_backward(arg(dout), arg(q), arg(k), arg(v), arg(out), arg(lse), arg(dq), arg(dk), arg(dv),
                            scale, causal, deterministic, torch.cuda.current_stream().cuda_stream, ws.data_ptr())
    return dq, dk, dv


def ref_grads(q, k, v, dout, causal, scale, upcast):
    qq, kk, vv = (x.detach().clone().float() if upcast else x.detach().clone() for x in (q, k, v))
    for x in (qq, kk, vv):
        x.requires_grad_(True)
    h, hk = q.shape[2], k.shape[2]
    k2, v2 = kk.repeat_interleave(h // hk, 2), vv.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, k2) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        row = torch.arange(sq, device=q.device).view(-1, 1)
        col = torch.arange(sk, device=q.device).view(1, -1)
        s = s.masked_fill(col > row + sk - sq, float("-inf"))
    p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(s.dtype)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v2)
    o.backward(dout.to(o.dtype))
    return qq.grad, kk.grad, vv.grad


def correct():
    torch.manual_seed(0)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 96, 128, 192, 256):
            for causal in (False, True):
                for (sq, sk) in ((1, 1), (17, 113), (113, 17), (239, 1), (1023, 1024), (300, 777)):
                    cases.append((dtype, d, causal, sq, sk, 2, 4, 2 if (sq + d) % 3 == 0 else 4))
    cases.append((torch.bfloat16, 128, True, 4224, 4224, 1, 2, 2))
    cases.append((torch.bfloat16, 64, False, 2048, 2048, 3, 8, 1))
    bad = 0
    for dtype, d, causal, sq, sk, b, h, hk in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
        dout = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
        scale = d ** -0.5
        out, lse = fwd(q, k, v, causal, scale)
        got = bwd(dout, q, k, v, out, lse, causal, scale)
        ref = ref_grads(q, k, v, dout, causal, scale, True)
        pt = ref_grads(q, k, v, dout, causal, scale, False)
        msgs = []
        for name, g, r, lp in zip(("dq", "dk", "dv"), got, ref, pt):
            err = (g.float() - r).abs().max().item()
            base = (lp.float() - r).abs().max().item()
            noise = ((r + 0.3 - 0.3) - r).abs().max().item()
            ok = err <= 2 * base + 2 * noise + 1e-4 and not torch.isnan(g).any().item()
            msgs.append(f"{name} {err:.2e}/{base:.2e}{'' if ok else ' FAIL'}")
            bad += not ok
        print(f"{NAMES[dtype]} d{d} {'c' if causal else 'n'} sq{sq} sk{sk} b{b} h{h}/{hk}: " + ", ".join(msgs), flush=True)
    # determinism: 30 repeats bitwise equal (deterministic); default: report whether it varies
    for causal, d in ((False, 128), (True, 128), (True, 64), (False, 256)):
        q = torch.randn(2, 2048, 8, d, device="cuda", dtype=torch.bfloat16)
        k, v, dout = torch.randn_like(q[:, :1800]), torch.randn_like(q[:, :1800]), torch.randn_like(q)
        out, lse = fwd(q, k, v, causal, d ** -0.5)
        for det in (True, False):
            first = bwd(dout, q, k, v, out, lse, causal, d ** -0.5, det)
            same = all(all(torch.equal(a, b) for a, b in zip(first, bwd(dout, q, k, v, out, lse, causal, d ** -0.5, det)))
                       for _ in range(30))
            print(f"causal={causal} d{d} deterministic={det}: 30 repeats bitwise equal: {same}")
            if det and not same:
                bad += 1
    print(f"correct: {bad} failures")
    return bad


def timing(points=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    points = points or [(d, c, s) for d in (64, 128, 256) for c in (False, True) for s in (512, 2048, 8192, 16384)]
    for d, causal, s in points:
        if True:
            if True:
                b, h = 16384 // s, 2048 // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = fwd(q, k, v, causal, d ** -0.5)
                fl = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                res = {}
                for det in (False, True):
                    res["det" if det else "fg"] = fl / _time_ms(
                        lambda: bwd(dout, q, k, v, out, lse, causal, d ** -0.5, det, poison=False)) / 1e9
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
                    try:
                        with sdpa_kernel([be]):
                            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        g = dout.transpose(1, 2)
                        res[name] = fl / _time_ms(lambda: torch.autograd.grad(o, (qt, kt, vt), g, retain_graph=True)) / 1e9
                    except Exception as e:  # noqa: BLE001
                        res[name] = float("nan")
                best = max(x for x in (res["cudnn"], res["fa2"]) if x == x)
                print(f"d{d} {'causal' if causal else 'noncausal'} s{s}: flashgen {res['fg']:.0f} det {res['det']:.0f} "
                      f"cudnn {res['cudnn']:.0f} fa2 {res['fa2']:.0f}  ratio {res['fg'] / best:.2f}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "correct"
    if what == "correct":
        sys.exit(1 if correct() else 0)
    timing([(64, False, 8192), (128, False, 8192), (128, True, 8192), (256, False, 8192)] if what == "quick" else None)
