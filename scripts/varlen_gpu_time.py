"""GPU time and host time per call of varlen_bench.py's workloads: the varlen kernel, the composed path, SDPA.

varlen_bench.py times each call with CUDA events around it (triton's do_bench), which counts the host's work
after a synchronisation: flashgen's varlen and kvcache entries read their lengths on the host (one sync a call),
SDPA does not. This script separates the two:

* ``gpu us``: the device time of every kernel (and memset / memcpy) one call launches, from torch.profiler's CUDA
  activity (CUPTI), summed, averaged over ``--n`` calls: what the call costs the GPU, as it would under a CUDA
  graph. The L2 is not flushed (every workload's K / V is larger than the H200's 50 MB L2 but the 4-doc packed
  one, 25 MB of K / V).
* ``host us``: wall time per call of ``--n`` back-to-back eager calls, then a synchronize (flashgen's syncs
  included: what an eager loop sees when it is host-bound).

The training steps (forward + backward over causal packed documents, varlen_bench.py's training table, the same
lengths) come first: the varlen kernels with the host read of the offsets and without it (core.VARLEN_NO_HOST_READ),
the padded groups, SDPA's nested tensors. Rows ending ", prep" run with core.VARLEN_PREP_KERNEL on (the varlen_prep
kernel instead of the torch checks and memsets). The decode steps last: flash_attn_with_kvcache appending one token per
entry with the lengths on the GPU (kvcache._step_on_device), the checks and the append by torch ops or, rows ending
", prep", by the varlen_prep variant's kvcache kernel; then two prefill steps (1024 tokens into each of 8 caches).

Usage (a GPU): python scripts/varlen_gpu_time.py [--n 20] [--decode-only]. Prints one markdown table.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashgen.core as core
from varlen_bench import forward_cases, train_case


def gpu_us(fn, n: int) -> tuple[float, str]:
    """Device microseconds per call (every CUDA event of n calls / n), the three costliest kernels and the varlen_prep
    variant's kernels wherever they rank (as ``prep:<role>``)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / n
    if not per:  # (a profiler without CUDA activity: no figure rather than 0)
        raise RuntimeError("torch.profiler recorded no CUDA event (CUPTI unavailable?)")
    top = sorted(per.items(), key=lambda kv: -kv[1])[:3]
    top += [(f"prep:{name.rsplit('_', 1)[-1]}", us) for name, us in per.items() if "varlen_prep" in name]
    return sum(per.values()), "; ".join(f"{name[:40]} {us:.1f}" for name, us in top)


def host_us(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def row(name: str, path: str, fn, n: int) -> None:
    """One table row: GPU and host time of ``fn`` (or why it could not run: reported, not fatal)."""
    try:
        g, top = gpu_us(fn, n)
        h = host_us(fn, n)
    except Exception as e:  # noqa: BLE001
        print(f"| {name} | {path} | failed: {type(e).__name__}: {str(e)[:120]} | | |")
        return
    print(f"| {name} | {path} | {g:.1f} | {h:.1f} | {top} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-only", action="store_true", help="only the decode steps (the kvcache kernel's rows)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    # varlen_bench.py's workloads, the same lengths (its training cases next); none with --decode-only
    cases = [] if a.decode_only else forward_cases(rng, a.seed)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; n = {a.n} calls each")
    print("| workload | path | gpu us | host us | costliest kernels (us per call) |")
    print("|---|---|---|---|---|")
    from flashgen import interface

    # (", prep": core.VARLEN_PREP_KERNEL on, the varlen_prep kernel instead of the torch checks and memsets)
    saved = (core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, core.VARLEN_NO_HOST_READ, interface.VARLEN_CALL_WORK,
             getattr(core, "VARLEN_PREP_KERNEL", False))  # (an older tree, as varlenab's old side, may lack it)
    for n_docs, tokens in () if a.decode_only else ((16, 8192), (64, 16384), (256, 16384)):
        kernels, kernels_dev, grouped, _per_run, sdpa, _flops, name, leaves = train_case(rng, n_docs, tokens)
        for path, step, prep in (("train: varlen kernels", kernels, False),
                                 ("train: kernels, no host read", kernels_dev, False),
                                 ("train: kernels, no host read, prep", kernels_dev, True),
                                 ("train: padded groups", grouped, False), ("train: SDPA nested", sdpa, False)):
            def fn(step=step, prep=prep):  # (fresh gradients each step: no accumulation kernels in the GPU time)
                core.VARLEN_PREP_KERNEL = prep
                for t in leaves:
                    t.grad = None
                step()
            row(name, path, fn, a.n)
    core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, core.VARLEN_NO_HOST_READ, interface.VARLEN_CALL_WORK = saved[:4]
    with torch.no_grad():
        for run, sdpa, _flops, name in cases:
            for path, fn, on in (("varlen kernel", run, True), ("varlen kernel, no host read", run, "dev"),
                                 ("varlen kernel, no host read, prep", run, "prep"),
                                 ("composed", run, False), ("SDPA", sdpa, True)):
                core.VARLEN_KERNEL = bool(on)
                core.VARLEN_NO_HOST_READ = on in ("dev", "prep")
                core.VARLEN_PREP_KERNEL = on == "prep"
                row(name, path, fn, a.n)
    core.VARLEN_KERNEL, core.VARLEN_NO_HOST_READ, core.VARLEN_PREP_KERNEL = saved[0], saved[2], saved[4]
    with torch.no_grad():
        rotary_kernel = getattr(core, "KVCACHE_ROTARY_KERNEL", False)
        for name, step in decode_steps(a.seed):
            kind = name.split()[0]  # decode or prefill
            paths = [(f"{kind} step, torch append", False, False), (f"{kind} step, prep", True, False)]
            if "rotary" in name:  # (", rotary in prep": core.KVCACHE_ROTARY_KERNEL, q and k rotated in that kernel)
                paths.append((f"{kind} step, prep, rotary in prep", True, True))
            for path, prep, rot in paths:
                def fn(step=step, prep=prep, rot=rot):
                    core.VARLEN_PREP_KERNEL = prep
                    core.KVCACHE_ROTARY_KERNEL = rot
                    step()
                row(name, path, fn, a.n)
    core.VARLEN_PREP_KERNEL, core.KVCACHE_ROTARY_KERNEL = saved[4], rotary_kernel


def decode_steps(seed: int):
    """Decode steps with an append (one new token per entry, bf16, 32 query heads over 8 K/V heads of 128, causal,
    lengths on the GPU): ``(name, step)`` for 8 and 64 caches of 4096 positions, unpaged and in pages of 64, and 64
    caches with rotary (Llama's: every dim, halves, bf16 tables); then prefill steps, 1024 new tokens (and q rows)
    into each of 8 caches, without and with rotary. Each step writes the same positions (the lengths do not grow),
    so every repetition does the same work."""
    import flashgen

    g = torch.Generator(device="cuda").manual_seed(seed)
    for batch, page, rotary, new in ((8, None, False, 1), (64, None, False, 1), (64, 64, False, 1),
                                     (64, None, True, 1), (8, None, False, 1024), (8, None, True, 1024)):
        cache = 4096
        r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v = r(batch, new, 32, 128), r(batch, new, 8, 128), r(batch, new, 8, 128)
        lens = torch.randint(1, cache - new, (batch,), generator=g, device="cuda", dtype=torch.int32)
        table = None
        if page:
            per = cache // page
            table = torch.randperm(batch * per, generator=g, device="cuda").view(batch, per).int()
            kc, vc = r(batch * per, page, 8, 128), r(batch * per, page, 8, 128)
        else:
            kc, vc = r(batch, cache, 8, 128), r(batch, cache, 8, 128)

        rope = {}
        if rotary:
            angle = torch.rand(cache, 64, generator=g, device="cuda") * 6.283
            rope = dict(rotary_cos=torch.cos(angle).bfloat16(), rotary_sin=torch.sin(angle).bfloat16(),
                        rotary_interleaved=False)

        def step(q=q, k=k, v=v, kc=kc, vc=vc, lens=lens, table=table, rope=rope):
            return flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, page_table=table, causal=True,
                                                    **rope)
        yield (f"{'decode' if new == 1 else 'prefill'} {batch} caches of {cache}{f', pages of {page}' if page else ''}"
               f"{', rotary' if rotary else ''}, +{new} token{'s' if new > 1 else ''}"), step


if __name__ == "__main__":
    main()
