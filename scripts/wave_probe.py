"""What the last partial wave of a non-causal forward costs (a GPU probe, issues 10 and 11; STATUS.md "The
non-causal grid's last wave").

FA3's grid has 16k tokens and 2048 / head_dim heads, so a non-causal call has 2^k tiles (hd128: 2048 tiles of
128 rows) against 132 SMs: 15.52 waves of the static persistent order run as 16, the last with 68 of the 132 CTAs.
This probe times flash_attn_func at one point twice, interleaved round by round (the grid's method: triton
do_bench, L2 flushed, median):

- ``full``: the call as shipped (num_tiles tiles);
- ``whole_waves``: the same prepared launch with ``num_tiles`` cut to the whole waves (floor(tiles / grid) x
  grid), so every CTA runs the same number of tiles and the tail is gone. Its output is incomplete (the dropped
  tiles are not computed): a probe, not a call.

It prints the time per tile of each (the ratio says how much the partial wave costs against the 3.1 % of the
static bound), for bf16 and e4m3 (FA3 descales of ones).

Usage: python scripts/wave_probe.py [--head-dim 128] [--seqlen 16384] [--dtypes bf16,e4m3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--dtypes", default="bf16,e4m3")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import torch

    import flashgen
    from flashgen import core, interface, launch
    from flashgen.bench import _time_ms as time_ms  # the grid's timing (as fp8_bench.py)

    d, s = a.head_dim, a.seqlen
    b, h = max(1, 16384 // s), 2048 // d
    real_prepare = launch.prepare_launch
    cut = {"on": False, "tiles": None}

    def prepare_launch(kernel, grid, params, per_call, counter=None):  # num_tiles cut to whole waves when on
        if cut["on"] and kernel.record.role == "main" and params.get("num_tiles", 0) > grid[0]:
            cut["tiles"] = (params["num_tiles"], params["num_tiles"] // grid[0] * grid[0], grid[0])
            params = {**params, "num_tiles": cut["tiles"][1]}
        return real_prepare(kernel, grid, params, per_call, counter)

    launch.prepare_launch = prepare_launch
    print(f"# {torch.cuda.get_device_name()}: hd{d} non-causal seqlen {s}, batch {b}, heads {h}; flashgen from "
          f"{Path(flashgen.__file__).resolve().parent}")
    print("| dtype | tiles / whole-wave tiles / grid | round | full ms | whole waves ms | full us a tile "
          "| whole waves us a tile | full / whole-waves per tile |")
    print("|---|---|---|---|---|---|---|---|")
    for dt in a.dtypes.split(","):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        kw = {}
        if dt == "e4m3":
            q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            ones = torch.ones(b, h, device="cuda", dtype=torch.float32)
            kw = {"q_descale": ones, "k_descale": ones, "v_descale": ones}
        elif dt == "fp16":
            q, k, v = (x.half() for x in (q, k, v))
        caches = (core._prepared_forwards, interface._fwd_calls)  # the prepared launch, and the call holding it

        def use(form):
            for c, saved in zip(caches, form):
                c.clear()
                c.update(saved)

        forms, cut["tiles"] = {}, None
        for name, on in (("full", False), ("whole_waves", True)):
            use(({}, {}))
            cut["on"] = on
            flashgen.flash_attn_func(q, k, v, **kw)  # prepares (and caches) this form's launch
            forms[name] = tuple(dict(c) for c in caches)
        if cut["tiles"] is None:
            print(f"| {dt} | no more tiles than CTAs: nothing to cut | | | | | | |")
            continue
        tiles, whole, grid = cut["tiles"]
        runs = {"full": [], "whole_waves": []}
        for r in range(a.rounds):
            for name in runs:
                use(forms[name])
                runs[name].append(time_ms(lambda: flashgen.flash_attn_func(q, k, v, **kw)))
            f, w = runs["full"][-1], runs["whole_waves"][-1]
            print(f"| {dt} | {tiles} / {whole} / {grid} | {r + 1} | {f:.4f} | {w:.4f} | {f * 1e3 / tiles:.3f} | "
                  f"{w * 1e3 / whole:.3f} | {(f / tiles) / (w / whole):.4f} |")
        f, w = statistics.median(runs["full"]), statistics.median(runs["whole_waves"])
        print(f"| {dt} | median | | {f:.4f} | {w:.4f} | | | {(f / tiles) / (w / whole):.4f} "
              f"(static bound {-(-tiles // grid) / (tiles / grid):.4f}) |")
    core._prepared_forwards.clear()
    interface._fwd_calls.clear()
    launch.prepare_launch = real_prepare
    return 0


if __name__ == "__main__":
    sys.exit(main())
