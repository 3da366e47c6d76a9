"""Time the varlen kernel (flashgen.core.Varlen: one launch that reads cu_seqlens / seqused) against the
composed path it replaces (one flash_attn_func call per run of equal lengths), in one process, on a GPU.

Three workloads, bf16, head_dim 128; the first two forward without gradient:
  packed:  N documents of random lengths packed into TOKENS tokens (training with document masking; causal),
           flash_attn_varlen_func, heads 16 / 16;
  decode:  B caches of random lengths up to CACHE, one new query each (serving; GQA 32 / 8),
           flash_attn_with_kvcache without appending (split-KV as its heuristic picks; one case also without);
           also as paged caches (pages of 16 and 256 rows, shuffled), whose composed path gathers each entry's pages;
  train:   causal packed documents, forward + backward: the varlen kernels both ways (core.VARLEN_BWD_KERNEL, the
           varlen backward: bwd.cu.j2 kVarlen), the composed path's padded groups of similar lengths, and one call
           per run of equal neighbours (its way before); SDPA's nested tensors forward + backward as the peer.
PyTorch SDPA in the same process as the peer: nested (jagged) tensors for the packed documents (one SDPA call per
document where SDPA refuses causal nested tensors), the padded caches with a key mask for decode. Each is timed with flashgen.bench._time_ms (triton do_bench style: L2 flushed before every repetition, median),
kernel on then off, ROUNDS times, alternated. Before timing, the two paths' outputs are compared (same inputs),
and the table prints TFLOP/s (causal FLOPs counted per document) and the speedup. A GPU test pass first is
the caller's (scripts/device_check.sh varlen). Usage: python scripts/varlen_bench.py [--rounds 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import inspect
import random

import torch

import flashgen
import flashgen.core as core
from flashgen.bench import _time_ms


def packed_case(rng, n_docs: int, tokens: int, h: int = 16, d: int = 128):
    cuts = sorted(rng.sample(range(1, tokens), n_docs - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
    cu = torch.tensor([0] + cuts + [tokens], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = sum(2 * 2 * h * d * n * (n + 1) // 2 for n in lens)  # causal: QK^T and PV over the lower triangle

    def run():
        return flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)

    def sdpa_nested():  # PyTorch's own varlen: nested (jagged) tensors through SDPA, whichever backend it picks
        nt = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2) for t in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*nt, is_causal=True)

    def sdpa_loop():  # one SDPA call per document (where SDPA refuses causal nested tensors)
        bounds = cu.tolist()
        return [torch.nn.functional.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                                                 is_causal=True)
                for a, b in zip(bounds, bounds[1:])]

    def sdpa():
        try:
            return sdpa_nested()
        except RuntimeError:
            return sdpa_loop()
    return run, sdpa, flops, f"packed {n_docs} docs / {tokens} tokens (max {max(lens)})"


def paged_copy(kc, vc, page: int, seed: int):
    """Padded caches kc, vc (batch, cache, heads_k, d) as pages of ``page`` rows in a pool shuffled by ``seed``:
    (page_table (batch, cache / page) int32, k pool, v pool (batch * cache / page, page, heads_k, d)), the same keys
    in the same order per entry (flash_attn_with_kvcache's page_table form)."""
    batch, cache, hk, d = kc.shape
    per = cache // page
    order = torch.randperm(batch * per, generator=torch.Generator().manual_seed(seed))
    table = order.view(batch, per).to(device=kc.device, dtype=torch.int32)
    kp, vp = (torch.empty(batch * per, page, hk, d, device=kc.device, dtype=kc.dtype) for _ in range(2))
    kp[table.long().flatten()] = kc.view(batch * per, page, hk, d)
    vp[table.long().flatten()] = vc.view(batch * per, page, hk, d)
    return table, kp, vp


def decode_case(rng, batch: int, cache: int, h: int = 32, hk: int = 8, d: int = 128, page: int | None = None,
                num_splits: int = 0):
    lens = [rng.randint(1, cache) for _ in range(batch)]
    q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    flops = sum(2 * 2 * h * d * n for n in lens)
    table, kp, vp = None, kc, vc
    if page:  # the same caches as pages of `page` rows in a shuffled pool (SDPA below reads the padded ones)
        table, kp, vp = paged_copy(kc, vc, page, rng.randint(0, 1 << 30))

    def run():  # (num_splits 0: FA3's heuristic, switched on for the call: core.SPLIT_KV_AUTO)
        auto, core.SPLIT_KV_AUTO = core.SPLIT_KV_AUTO, num_splits == 0
        try:
            return flashgen.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, page_table=table, causal=True,
                                                    num_splits=num_splits)
        finally:
            core.SPLIT_KV_AUTO = auto

    mask = (torch.arange(cache, device="cuda")[None, :] < seqlens[:, None])[:, None, None, :]

    def sdpa():  # the padded caches with a key mask (SDPA has no per-entry lengths)
        return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                                                vc.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    paged = f", pages of {page}" if page else ""
    split = ", no split-KV" if num_splits == 1 else ", split-KV by the heuristic" if num_splits == 0 else ""
    return run, sdpa, flops, f"decode {batch} caches up to {cache} (mean {sum(lens) // batch}){paged}{split}"


def train_case(rng, n_docs: int, tokens: int, h: int = 16, d: int = 128):
    """Forward + backward of causal packed documents (training): the steps (kernels, kernels_dev, groups, per_run,
    sdpa): the varlen kernels both ways (both switches on), the same without the host read of the offsets
    (core.VARLEN_NO_HOST_READ: no synchronisation), the composed path's padded groups (interface._varlen_padded) and
    one call per run of equal neighbours (VARLEN_CALL_WORK 0), SDPA on nested tensors; same process."""
    from flashgen import interface

    cuts = sorted(rng.sample(range(1, tokens), n_docs - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
    cu = torch.tensor([0] + cuts + [tokens], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(tokens, h, d, device="cuda", dtype=torch.bfloat16)
    flops = 3.5 * sum(2 * 2 * h * d * n * (n + 1) // 2 for n in lens)  # forward + backward (2.5x)

    def step(work, kernels=False, on_device=False):
        def run():
            interface.VARLEN_CALL_WORK = work
            core.VARLEN_KERNEL = core.VARLEN_BWD_KERNEL = kernels
            core.VARLEN_NO_HOST_READ = on_device
            out = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
            out.backward(dout)
            return out
        return run

    def sdpa():  # PyTorch's own varlen training step: nested (jagged) tensors, forward + backward
        nt = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2) for t in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*nt, is_causal=True).transpose(1, 2).values()
        out.backward(dout)
        return out
    return (step(3.4e9, True), step(3.4e9, True, True), step(3.4e9), step(0.0), sdpa, flops,
            f"train {n_docs} docs / {tokens} tokens (max {max(lens)})", (q, k, v))


def forward_cases(rng: random.Random, seed: int) -> list:
    """The forward workloads, (run, sdpa, flops, name) each: drawn from ``rng`` (random.Random(seed), which the caller
    may draw on after), the split-KV pair from seed + 1 (varlen_gpu_time.py times the same)."""
    return [packed_case(rng, 16, 8192), packed_case(rng, 64, 16384), packed_case(rng, 4, 4096),
            decode_case(rng, 64, 8192),
            # (the same lengths with and without split-KV)
            decode_case(random.Random(seed + 1), 8, 32768), decode_case(random.Random(seed + 1), 8, 32768,
                                                                        num_splits=1),
            decode_case(rng, 256, 2048),
            decode_case(rng, 64, 8192, page=16), decode_case(rng, 64, 8192, page=256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    cases = forward_cases(rng, args.seed)
    # training first (forward + backward: the varlen kernels both ways, the padded groups, one call per run, SDPA
    # nested), so that its table is out before a timeout could cut the forward's; the same draws as before
    # (forward_cases drew first)
    from flashgen import interface

    saved = (core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, interface.VARLEN_CALL_WORK, core.launch_backward,
             core.VARLEN_NO_HOST_READ)
    # (every backward launch goes through core.launch_backward: the prepared plain calls directly, the varlen kernel's
    # through core.attention_backward; its last argument is a varlen call's addresses, () otherwise)
    launch_sig = inspect.signature(core.launch_backward)
    train_rows = []
    for n_docs, tokens in ((16, 8192), (64, 16384), (256, 16384)):
        kernels, kernels_dev, grouped, per_run, sdpa, flops, name, leaves = train_case(rng, n_docs, tokens)
        results = []
        for fn in (kernels, grouped, per_run, kernels_dev):  # out and grads of each, from fresh gradients
            for t in leaves:
                t.grad = None
            launches = []
            core.launch_backward = lambda *a, **kw: launches.append(
                bool(launch_sig.bind(*a, **kw).arguments.get("varlen"))) or saved[3](*a, **kw)
            results.append([fn().detach().clone()] + [t.grad.clone() for t in leaves])
            core.launch_backward = saved[3]
            # the step ran the path it names: one varlen launch, or plain backward launches only
            if (launches != [True]) if fn in (kernels, kernels_dev) else (not launches or any(launches)):
                raise RuntimeError(f"{name}: backward launches {len(launches)}, varlen {launches}: not the path timed")
        err = [max((x.float() - y.float()).abs().max().item() for x, y in zip(results[i], results[2]))
               for i in (0, 1, 3)]
        steps = {"kernels": kernels, "kernels_dev": kernels_dev, "groups": grouped, "per_run": per_run, "sdpa": sdpa}
        times = {w: [] for w in steps}
        for _ in range(args.rounds):
            for w, fn in steps.items():
                try:
                    times[w].append(_time_ms(fn))
                except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
                    print(f"{name}: {w} failed: {type(e).__name__}: {str(e)[:200]}")
                    times[w].append(float("nan"))
        best = {w: min(t) for w, t in times.items()}
        train_rows.append((name, err, times, flops / best["kernels"] / 1e9, best))
    core.VARLEN_KERNEL, core.VARLEN_BWD_KERNEL, interface.VARLEN_CALL_WORK = saved[:3]
    core.VARLEN_NO_HOST_READ = saved[4]
    print("| training workload | max abs diff vs per-run (kernels; groups; no host read) | kernels ms | "
          "kernels, no host read ms | padded groups ms | one call per run ms | SDPA nested ms | kernels TFLOP/s | "
          "kernels / no host read | groups / kernels | per-run / kernels | SDPA / kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, err, times, f, best in train_rows:
        ms = [" / ".join(f"{x:.3f}" for x in times[w]) for w in ("kernels", "kernels_dev", "groups", "per_run", "sdpa")]
        print(f"| {name} | {err[0]:.2e}; {err[1]:.2e}; {err[2]:.2e} | {' | '.join(ms)} | {f:.0f} | "
              f"{best['kernels'] / best['kernels_dev']:.2f}x | "
              f"{best['groups'] / best['kernels']:.2f}x | {best['per_run'] / best['kernels']:.2f}x | "
              f"{best['sdpa'] / best['kernels']:.2f}x |")
    print(flush=True)
    rows = []
    with torch.no_grad():
        for run, sdpa, flops, name in cases:
            core.VARLEN_KERNEL = True
            a = run()
            core.VARLEN_KERNEL = False
            b = run()
            core.VARLEN_KERNEL = core.VARLEN_NO_HOST_READ = True
            c = run()
            core.VARLEN_NO_HOST_READ = saved[4]
            err = max((a.float() - b.float()).abs().max().item(), (c.float() - b.float()).abs().max().item())
            times = {True: [], False: [], "dev": []}
            for _ in range(args.rounds):
                for on in (True, False, "dev"):  # the kernel, the composed path, the kernel without a host read
                    core.VARLEN_KERNEL = bool(on)
                    core.VARLEN_NO_HOST_READ = on == "dev"
                    times[on].append(_time_ms(run))
            core.VARLEN_NO_HOST_READ = saved[4]
            t_on, t_off = min(times[True]), min(times[False])
            try:
                t_sdpa = min(_time_ms(sdpa) for _ in range(args.rounds))
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
                print(f"{name}: SDPA failed: {type(e).__name__}: {str(e)[:200]}")
                t_sdpa = float("nan")
            rows.append((name, err, times[True], times[False], flops / t_on / 1e9, flops / t_off / 1e9, t_off / t_on,
                         t_sdpa, times["dev"]))
    print("| workload | max abs(kernel or no host read - composed) | kernel ms (rounds) | kernel, no host read ms | "
          "composed ms (rounds) | SDPA ms | kernel TFLOP/s | composed TFLOP/s | composed ms / kernel ms | "
          "kernel / no host read | SDPA ms / kernel ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, err, on, off, f_on, f_off, sp, t_sdpa, dev in rows:
        print(f"| {name} | {err:.2e} | {' / '.join(f'{x:.3f}' for x in on)} | {' / '.join(f'{x:.3f}' for x in dev)} | "
              f"{' / '.join(f'{x:.3f}' for x in off)} | {t_sdpa:.3f} | {f_on:.0f} | {f_off:.0f} | {sp:.2f}x | "
              f"{min(on) / min(dev):.2f}x | {t_sdpa / min(on):.2f}x |")
    print(flush=True)


if __name__ == "__main__":
    main()
