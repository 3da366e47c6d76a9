"""A/B of the backward's unordered tail (core.UNORDERED_TAIL_WAVES) on the same kernels, in one process.

Usage: python scripts/bwd_tail_ab.py [--waves 0,1,0.5] [--rounds 2] [--csv OUT.csv]
                                     [--knob UNORDERED_CAUSAL_TAIL_WAVES --points bf16:256:4096,bf16:128:2048]

--knob: the core constant the waves set (default UNORDERED_TAIL_WAVES, the ordered default's tail;
UNORDERED_CAUSAL_TAIL_WAVES: the tail of causal calls that are unordered throughout, whose points
are past the ordered bounds; ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS: the ds_pairs kernels' (head_dim 256) ordered
default's bound on seqlen_k, the values in keys; SPLIT_TAIL_MAX_PIECES: the non-causal split tail, 1 = off,
with :nc points; ROTATE_UNORDERED: rotated query blocks, 0 = off; DQ_SWAP_MIN_SEQLEN_Q: the block_m 80 tile's
bound, the values in rows; PERSISTENT_BWD: the persistent grid, 0 = off, PERSISTENT_MAX_BLOCKS its bound on a
unit's blocks, both with :nc points; BWD_DKV_STEPS: the block_n 128 tiles' dV / dK k-steps issued as P^T / dS^T
are packed, 0 = every call on the dkv_steps-off twins (head_dim 128's in the default build, 64's in
configs/bwd_ablation.yaml, built by `flashgen build --all`); DET_NOSTEPS_HEAD_DIMS: the head dim whose deterministic
calls run on those twins, 0 = none; with --deterministic).
--deterministic: flashgen's deterministic backward is timed instead of its default (SDPA as always).
--points: dtype:head_dim:seqlen entries instead of the defaults below (causal; dtype:head_dim:seqlen:nc non-causal).
--interleave N: instead of one do_bench per value, each round calls the values and the SDPA peers in
turn, one call each, N times (the L2 flushed before each call, CUDA events around it), and takes each
one's median: a drift of the GPU's clock during the round falls on all of them alike.

The points are the ones whose default backward takes the ordered path (core._ordered_default): causal
at seqlen 512 for every head dim, and 1k / 2k for head_dim 256 (the ds_pairs kernels), bf16 and fp16
at head_dim 256, FA3's protocol (16k tokens, hidden 2048). Per point, flashgen's default backward
is timed once per waves value in each round (rounds alternate the values), then SDPA's cuDNN and
flash backends (runtime/bench.py: triton do_bench, L2 flushed, median). Prints TFLOP/s (2.5 x the
forward's FLOPs), each value's best round over the waves-0 one, and the best value over the best
SDPA backend; a markdown table, last.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys

POINTS = [("bf16", d, 512, True) for d in (64, 96, 128, 192, 256)] + [
    ("bf16", 256, 1024, True), ("bf16", 256, 2048, True), ("fp16", 256, 512, True), ("fp16", 256, 2048, True)]


def _interleaved(fns, n):
    """Median milliseconds per call of each of ``fns``, called in turn n times (f0, f1, ..., f0, f1, ...),
    the L2 flushed (bench's flush buffer zeroed) before each call and CUDA events around it."""
    import statistics

    import torch

    from flashgen import bench

    flush = torch.empty(bench._FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for f in fns:
        f()
    torch.cuda.synchronize()
    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)] for _ in fns]
    for i in range(n):
        for j, f in enumerate(fns):
            flush.zero_()
            ev[j][i][0].record()
            f()
            ev[j][i][1].record()
    torch.cuda.synchronize()
    return [statistics.median(a.elapsed_time(b) for a, b in e) for e in ev]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", default="0,1,0.5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--knob", default="UNORDERED_TAIL_WAVES",
                    choices=("UNORDERED_TAIL_WAVES", "UNORDERED_CAUSAL_TAIL_WAVES", "ORDERED_CAUSAL_MAX_SEQLEN_K_PAIRS",
                             "SPLIT_TAIL_MAX_PIECES", "ROTATE_UNORDERED",
                             "DQ_SWAP_MIN_SEQLEN_Q", "PERSISTENT_BWD", "PERSISTENT_MAX_BLOCKS", "BWD_DKV_STEPS",
                             "DET_NOSTEPS_HEAD_DIMS"))
    ap.add_argument("--deterministic", action="store_true", help="time the deterministic backward (default: not)")
    ap.add_argument("--interleave", type=int, default=0, help="calls per value per round, interleaved (0: do_bench)")
    ap.add_argument("--points", default=None, help="dtype:head_dim:seqlen,... (default: the ordered default's points)")
    args = ap.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend

    from flashgen import bench, core

    waves = [float(w) for w in args.waves.split(",")]
    if args.knob in ("SPLIT_TAIL_MAX_PIECES", "ROTATE_UNORDERED", "DQ_SWAP_MIN_SEQLEN_Q", "PERSISTENT_BWD",
                     "PERSISTENT_MAX_BLOCKS", "DET_NOSTEPS_HEAD_DIMS"):  # (DET_NOSTEPS_HEAD_DIMS: a head dim, 0 = none)
        waves = [int(w) for w in waves]
    elif args.knob == "BWD_DKV_STEPS":
        waves = [bool(int(w)) for w in waves]

    def knob_value(w):  # the core constant's value for the waves value w
        return ((w,) if w else ()) if args.knob == "DET_NOSTEPS_HEAD_DIMS" else w

    from flashgen import interface

    def set_knob(value):  # the knobs are read when a call's key is prepared: the prepared backwards emptied
        if getattr(core, args.knob) != value:
            setattr(core, args.knob, value)
            core._prepared_backwards.clear()
            interface._bwd_calls.clear()

    default_waves = getattr(core, args.knob)
    points = POINTS if not args.points else [(x.split(":")[0], int(x.split(":")[1]), int(x.split(":")[2]), not x.endswith(":nc"))
                                              for x in args.points.split(",")]
    gpu = torch.cuda.get_device_name()
    rows = []
    for dt, d, s, causal in points:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device="cuda") for _ in range(3))
        fl = 2.5 * bench._flops(b, h, s, d, causal)
        fn, _ = bench._flashgen_bwd_fn(q, k, v, causal, args.deterministic)
        times = {w: [] for w in waves}
        peer_fns = {name: bench._sdpa_bwd_fn(backend, q, k, v, causal)
                    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION))}
        peer_times = {name: [] for name in peer_fns}

        def with_waves(w):
            def call():
                set_knob(knob_value(w))
                fn()
            return call
        named = [(w, with_waves(w)) for w in waves] + [(n, f) for n, f in peer_fns.items() if f]
        for _ in range(args.rounds):
            if args.interleave:
                for (key, _), ms in zip(named, _interleaved([f for _, f in named], args.interleave)):
                    (times if key in times else peer_times)[key].append(fl / ms / 1e9)
            else:
                for w in waves:
                    set_knob(knob_value(w))
                    times[w].append(fl / bench._time_ms(fn) / 1e9)
        set_knob(default_waves)
        peers = {}
        for name, f in peer_fns.items():
            if not f:
                peers[name] = float("nan")
            elif not args.interleave:
                peers[name] = fl / bench._time_ms(f) / 1e9
            else:
                peers[name] = max(peer_times[name])
        row = {"dtype": dt, "head_dim": d, "seqlen": s, "causal": causal, **{f"w{w:g}": "/".join(f"{x:.1f}" for x in times[w]) for w in waves},
               **{k2: f"{x:.1f}" for k2, x in peers.items()}}
        base = max(times[waves[0]])
        row.update({f"w{w:g}/w{waves[0]:g}": f"{max(times[w]) / base:.3f}" for w in waves[1:]})
        best_peer = max(x for x in peers.values() if x == x)
        row["best/sdpa"] = f"{max(max(t) for t in times.values()) / best_peer:.2f}"
        row[f"w{waves[0]:g}/sdpa"] = f"{base / best_peer:.2f}"
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        del q, k, v, fn
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(f"\n{'deterministic ' if args.deterministic else ''}backward TFLOP/s on {gpu}, by the value of "
          f"core.{args.knob} (w<value>), {args.rounds} alternated rounds each")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    gm = {c: math.exp(sum(math.log(float(r[c])) for r in rows) / len(rows)) for c in cols if "/" in c and c.startswith("w") and "sdpa" not in c}
    print("geometric means: " + ", ".join(f"{c} {v:.3f}" for c, v in gm.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
