"""A few forward (or backward) calls of one FA3-protocol point, for Nsight Compute (scripts/device_check.sh prof).

Usage: python scripts/profile_fwd.py --dtype e4m3|bf16|fp16 --head-dim 128 [--causal] [--seqlen 16384] [--calls 3]
                                     [--impl flashgen|cudnn|fa2] [--backward [--deterministic]] [--variant GLOB]
16384 tokens, hidden 2048 (batch = 16384 / seqlen, heads = 2048 / head_dim); e4m3 inputs are bf16 random
normal cast to float8_e4m3fn with unit FA3 descales. --impl cudnn / fa2: PyTorch SDPA with that backend on
the same tensors in BSHD strides; e4m3 with --impl cudnn: cuDNN's own FP8 forward (scripts/cudnn_fp8_peer.py).
--backward: the backward alone, 16-bit: flashgen's (bench._flashgen_bwd_fn: a forward made once, its three
kernels per call) or, with --impl cudnn / fa2, SDPA's (bench._sdpa_bwd_fn: autograd.grad on a forward made once). The last call runs inside the NVTX range "prof" (for `ncu --nvtx --nvtx-include prof/`).
Prints the kernel time of the last call (CUDA events)."""
import argparse

import torch

import flashgen


def point_args(ap: argparse.ArgumentParser) -> None:
    """The options that choose an FA3-protocol point and what runs there (shared with clock_probe.py)."""
    ap.add_argument("--dtype", default="e4m3", choices=("e4m3", "bf16", "fp16"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--impl", default="flashgen", choices=("flashgen", "cudnn", "fa2"))
    ap.add_argument("--backward", action="store_true", help="the backward alone (16-bit)")
    ap.add_argument("--deterministic", action="store_true", help="with --backward: flashgen's deterministic=True")
    ap.add_argument("--variant", default=None,
                    help="flashgen forward only: the built variant whose name matches this glob (one), forced through "
                         "flashgen.core.attention_forward (e4m3 without the lse, as flash_attn_func's FP8 call; 16-bit with it)")


def label(a) -> str:
    """What runs, for the scripts' output lines: implementation, direction, dtype, head_dim, mask, seqlen."""
    what = (" backward" + (" deterministic" if a.deterministic else "")) if a.backward else ""
    forced = f" variant={a.variant}" if a.variant else ""
    return f"{a.impl}{what} {a.dtype} hd{a.head_dim} causal={a.causal} s{a.seqlen}{forced}"


def point(a):
    """(q, k, v, descale kwargs, batch, heads) of the point: BSHD random normal, e4m3 cast from bf16
    with unit FA3 descales."""
    s, d = a.seqlen, a.head_dim
    b, h = 16384 // s, 2048 // d
    base = torch.bfloat16 if a.dtype != "fp16" else torch.float16
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=base) for _ in range(3))
    kw = {}
    if a.dtype == "e4m3":
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        kw = {n: torch.ones(b, h, device="cuda") for n in ("q_descale", "k_descale", "v_descale")}
    return q, k, v, kw, b, h


def _forced_call(a, q, k, v, kw):
    """One forward of the point by the built variant matching a.variant (exactly one, of the point's dtype,
    head_dim and mask), through flashgen.core.attention_forward: e4m3 without the lse, 16-bit with it."""
    import fnmatch

    from flashgen import core
    from flashgen.bench import tensor_arg
    from flashgen.manifest import load_manifest

    vs = [v_ for v_ in load_manifest().variants if v_.family == "fwd" and fnmatch.fnmatch(v_.name, a.variant)
          and v_.params["dtype"] == a.dtype and v_.params["head_dim"] == a.head_dim
          and v_.params["causal"] == a.causal and not (v_.params["local"] or v_.params["softcap"] or v_.params["pack_gqa"])]
    if len(vs) != 1:
        raise SystemExit(f"--variant {a.variant}: {len(vs)} built variants of this point match (one needed): "
                         + ", ".join(v_.name for v_ in vs))

    b, s, h, d = q.shape
    out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16 if a.dtype == "e4m3" else q.dtype)
    lse = None if a.dtype == "e4m3" else torch.empty(b, h, s, device="cuda")
    ds = {n: tensor_arg(t) for n, t in kw.items()}
    stream = torch.cuda.current_stream().cuda_stream

    args = (*(tensor_arg(t) for t in (q, k, v, out)), None if lse is None else tensor_arg(lse))

    def call():
        core.attention_forward(*args, d ** -0.5, a.causal, stream, variant=vs[0], **ds)
    return call


def make_call(a):
    """(call, flops): one forward (or, with --backward, backward) of the point by a.impl, and
    the FLOPs one call counts (FA3's: 4 b h s^2 d, halved when causal, times 2.5 for the backward).
    Raises SystemExit for a combination no implementation has (FP8 backward, FA2 FP8)."""
    s, d = a.seqlen, a.head_dim
    q, k, v, kw, b, h = point(a)
    flops = 4 * b * h * s * s * d / (2 if a.causal else 1) * (2.5 if a.backward else 1)
    if a.backward:
        if a.dtype == "e4m3":
            raise SystemExit("--backward: 16-bit dtypes only")
        from flashgen.bench import _flashgen_bwd_fn, _sdpa_bwd_fn
        if a.impl == "flashgen":
            call, _ = _flashgen_bwd_fn(q, k, v, a.causal, a.deterministic)
        else:
            from torch.nn.attention import SDPBackend
            backend = SDPBackend.CUDNN_ATTENTION if a.impl == "cudnn" else SDPBackend.FLASH_ATTENTION
            call = _sdpa_bwd_fn(backend, q, k, v, a.causal)
            if call is None:
                raise SystemExit(f"SDPA {a.impl} refused the backward of this point")
    elif a.impl == "flashgen" and a.variant:
        call = _forced_call(a, q, k, v, kw)
    elif a.impl == "flashgen":
        def call():
            flashgen.flash_attn_func(q, k, v, causal=a.causal, **kw)
    elif a.dtype == "e4m3":  # cuDNN's own FP8 forward (PyTorch's SDPA has no FP8 path)
        if a.impl != "cudnn":
            raise SystemExit("--impl fa2: 16-bit dtypes only")
        from cudnn_fp8_peer import cudnn_fp8_fn  # scripts/ is the script's folder: on sys.path
        call, why = cudnn_fp8_fn(q, k, v, a.causal)
        if call is None:
            raise SystemExit(f"cuDNN FP8: {why}")
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.CUDNN_ATTENTION if a.impl == "cudnn" else SDPBackend.FLASH_ATTENTION

        def call():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=a.causal)
    return call, flops


def main() -> None:
    ap = argparse.ArgumentParser()
    point_args(ap)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    call, flops = make_call(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(a.calls):
        if i == a.calls - 1:
            torch.cuda.nvtx.range_push("prof")
        e0.record()
        call()
        e1.record()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1)
    print(f"{label(a)}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (last call)")


if __name__ == "__main__":
    main()
