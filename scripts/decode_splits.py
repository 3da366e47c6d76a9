"""Decode steps of flash_attn_with_kvcache against the split count (split-KV, FA3's ``num_splits``), timed as a
server runs them: each step captured in a CUDA graph over several layers' caches and replayed.

A workload is ``batch`` caches of ``cache`` positions (bf16, 32 query heads over 8 K/V heads of 128, causal, one new
token appended per entry, the lengths an int32 tensor on the GPU: the kernel path of kvcache._step_on_device),
optionally paged. One graph holds ``--layers`` such calls, each on its own caches (so the K / V read is
``layers`` times larger than the L2, as in a model's decode step); it is replayed ``--reps`` times between two CUDA
events, after a warm-up replay. Reported per call (one layer): microseconds, and the K / V bytes that the call must
read (sum over entries of (length + 1) x heads_k x head_dim x 2 bytes x 2) over that time, in GB/s.

Two length distributions per workload: ``full``, each entry's length uniform in [1, cache) (one entry: cache - 1),
and ``short``, uniform in [1, cache / 8) (one entry: cache / 8): a cache allocated for longer sequences than it
holds, which the split heuristic cannot tell from the other (it sees the cache's positions, not the lengths).

For each workload the split counts of ``--splits`` run in turn, with the choices of core.varlen_num_splits under
each DECODE_SPLIT_BLOCKS of ``--rules`` (0 = FA3's rule alone) added, each checked against the unsplit call's
output (max abs difference, bf16) before it is timed. Rounds (``--rounds``) repeat the whole sweep, so the spread
shows. The last table: per workload the time each rule's choice takes over the best split count's, and their
geometric means.

Usage (a GPU): python scripts/decode_splits.py [--rounds 2] [--layers 8] [--reps 20]. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import math

import torch

import flashgen
import flashgen.core as core

HEADS, HEADS_K, D = 32, 8, 128


def workloads(quick: bool):
    """(name, batch, cache positions, page size or None)."""
    rows = [(1, 8192, None), (1, 32768, None), (4, 16384, None), (8, 4096, None), (8, 32768, None), (16, 8192, None),
            (32, 4096, None), (48, 4096, None), (64, 4096, None), (128, 2048, None), (8, 32768, 64), (64, 4096, 64)]
    if quick:
        rows = rows[3:4]
    for batch, cache, page in rows:
        yield f"{batch} x {cache}{f', pages of {page}' if page else ''}", batch, cache, page


def lengths(batch: int, cache: int, dist: str, g: torch.Generator) -> torch.Tensor:
    top = cache if dist == "full" else cache // 8
    if batch == 1:
        return torch.full((1,), top - 1, dtype=torch.int32, device="cuda")
    return torch.randint(1, top - 1, (batch,), generator=g, device="cuda", dtype=torch.int32)


def rule_choice(blocks_rule: int, batch: int, cache: int) -> int:
    saved = core.DECODE_SPLIT_BLOCKS
    core.DECODE_SPLIT_BLOCKS = blocks_rule
    try:
        return core.varlen_num_splits(batch, HEADS, HEADS_K, 1, cache, torch.cuda.current_device())
    finally:
        core.DECODE_SPLIT_BLOCKS = saved


def make_layer(batch: int, cache: int, page, g: torch.Generator):
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    if page:
        per = cache // page
        table = torch.randperm(batch * per, generator=g, device="cuda").view(batch, per).int()
        return r(batch * per, page, HEADS_K, D), r(batch * per, page, HEADS_K, D), table
    return r(batch, cache, HEADS_K, D), r(batch, cache, HEADS_K, D), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16,24,32")
    ap.add_argument("--rules", default="0,16,32,64", help="DECODE_SPLIT_BLOCKS values whose choices are timed too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one workload (a smoke run)")
    a = ap.parse_args()
    rules = [int(r) for r in a.rules.split(",")]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; bf16 GQA {HEADS}/{HEADS_K} hd{D}, causal, "
          f"+1 token; {a.layers} layers per graph, {a.reps} replays; us and GB/s per call")
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    summary = []  # (workload, dist, {rule: ratio to best}, best split, best us)
    for name, batch, cache, page in workloads(a.quick):
        layers = [make_layer(batch, cache, page, g) for _ in range(a.layers)]
        q = torch.randn(batch, 1, HEADS, D, generator=g, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(batch, 1, HEADS_K, D, generator=g, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn(batch, 1, HEADS_K, D, generator=g, device="cuda", dtype=torch.bfloat16)
        choices = {r: rule_choice(r, batch, cache) for r in rules}
        splits = sorted({int(s) for s in a.splits.split(",")} | set(choices.values()))
        for dist in ("full", "short"):
            lens = lengths(batch, cache, dist, g)
            kv_bytes = int((lens.long() + 1).sum()) * HEADS_K * D * 2 * 2

            def call(layer, s, lens=lens):
                kc, vc, table = layer
                return flashgen.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, page_table=table,
                                                        causal=True, num_splits=s)

            ref = call(layers[0], 1).float()
            picks = ", ".join(f"B={r}: {n}" if r else f"FA3's: {n}" for r, n in choices.items())
            print(f"\n### {name}, {dist} lengths (choices: {picks}; K/V per call {kv_bytes / 1e6:.1f} MB)")
            print("| num_splits | " + " | ".join(f"round {r + 1} us | GB/s" for r in range(a.rounds)) + " | max diff |")
            print("|---|" + "---|---|" * a.rounds + "---|")
            results = {s: [] for s in splits}
            diffs = {}
            for _ in range(a.rounds):
                for s in splits:
                    diffs[s] = (call(layers[0], s).float() - ref).abs().max().item()
                    graph = torch.cuda.CUDAGraph()
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for layer in layers:  # warm-up on the side stream (loads, prepared launches) before capture
                            call(layer, s)
                        with torch.cuda.graph(graph, stream=stream):
                            for layer in layers:
                                call(layer, s)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph.replay()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(a.reps):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    results[s].append(start.elapsed_time(end) * 1e3 / (a.reps * a.layers))
                    del graph
            for s in splits:
                cells = " | ".join(f"{us:.1f} | {kv_bytes / us / 1e3:.0f}" for us in results[s])
                marks = ", ".join(f"B={r}" if r else "FA3" for r, n in choices.items() if n == s)
                print(f"| {s}{f' ({marks})' if marks else ''} | {cells} | {diffs[s]:.2e} |", flush=True)
            mean = {s: sum(v) / len(v) for s, v in results.items()}
            best = min(mean, key=mean.get)
            summary.append((name, dist, {r: mean[n] / mean[best] for r, n in choices.items()}, best, mean[best]))
        del layers
        torch.cuda.empty_cache()
    print("\n### Each rule's choice over the best split count (1.000 = the best; mean of the rounds)")
    print("| workload | lengths | best (us) | " + " | ".join(f"B={r}" if r else "FA3's rule" for r in rules) + " |")
    print("|---|---|---|" + "---|" * len(rules))
    for name, dist, ratio, best, us in summary:
        print(f"| {name} | {dist} | {best} ({us:.1f}) | " + " | ".join(f"{ratio[r]:.3f}" for r in rules) + " |")
    geo = {r: math.exp(sum(math.log(x[2][r]) for x in summary) / len(summary)) for r in rules}
    worst = {r: max(x[2][r] for x in summary) for r in rules}
    print("| geomean | | | " + " | ".join(f"{geo[r]:.3f}" for r in rules) + " |")
    print("| worst | | | " + " | ".join(f"{worst[r]:.3f}" for r in rules) + " |")

if __name__ == "__main__":
    main()
