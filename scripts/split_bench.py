"""Split-KV through flash_attn_func (FA3's ``num_splits``; flashgen.split_kv) on decode-like calls:
microseconds per call with num_splits=1 (FA3's default: the non-varlen kernel, unsplit) and num_splits=0 (the
split count core.varlen_num_splits chooses, on the varlen kernel plus the combine; and the count FA3's rule chose
before session 24's cost model, core.SPLIT_MODEL), beside SDPA's cuDNN and flash
backends (``enable_gqa=True``, BSHD strides as a user calls it; K/V expanded where a backend refuses GQA) in the
same process. Not causal (SDPA's causal is top-left aligned, FA3's bottom-right; at seqlen_q 1 they differ); with
``--causal`` flashgen's calls are causal (bottom-right: a chunked prefill's mask) and SDPA's stay non-causal (an
upper bound on their time: with seqlen_q << seqlen_k the bottom-right mask removes little).

Timing: flashgen.bench._time_ms (triton do_bench, median, the L2 flushed before each repetition): events around
each call, so host time that outruns the GPU shows. bf16 (--dtype fp16: fp16), heads 32, one row per (head_dim,
batch, group, seqlen_q, seqlen_k).

    python scripts/split_bench.py [--head-dims 64,128] [--shapes 16:8:1:8192,...] [--sweep 2,4,8,16,32] [--csv out.csv]

``--sweep``: each row also times those explicit num_splits (each capped as flash_attn_func caps it:
flashgen.split_kv.split_count) and reports the fastest count of 1, 0's choice and the sweep, with its time and
0's time over it: the data a better rule than FA3's (core.varlen_num_splits) would be fitted to.
``--shapes``: batch:group:seqlen_q:seqlen_k rows instead of the default twelve.
``--twin block_m:consumer_wgs``: each row also times num_splits=1 on that tile of the call's key where one is built
(e.g. 128:2, hd64's 128 x 128 two-warpgroup tile against its 192 x 128 default), the key's own tile where none is:
the data of a tile chosen by the call's waves (few tiles over long keys).
``--kvcache``: flashgen's calls are ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlen_k, ...)``
instead (the varlen kernel over a cache whose lengths the host does not read: a chunked prefill or verify step with
its tokens already appended), num_splits 1 and 0 (FA3's rule: kvcache's default); SDPA's calls are the same.
The CSV's ``tile_1`` / ``tile_0``: the tile num_splits 1 / 0 ran on (block_m x block_n : consumer warpgroups, ``p``
PackGQA), which split_ab.py shows beside an A/B's times.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import flashgen
import flashgen.core as core
from flashgen.bench import _time_ms
from flashgen.split_kv import split_count

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from packgqa_bench import _forget_prepared, _sdpa, _write_csv  # noqa: E402


def _fa3_rule(b: int, h: int, hk: int, sq: int, sk: int, d: int, causal: bool = False) -> int:
    """The count num_splits=0 took before session 24's cost model (core.SPLIT_MODEL off: FA3's rule and the decode
    floor), as flash_attn_func caps it."""
    saved, core.SPLIT_MODEL = core.SPLIT_MODEL, False
    try:
        return split_count(0, b, h, hk, sq, sk, 0, causal, (-1, -1), 4 * d)
    finally:
        core.SPLIT_MODEL = saved


@contextlib.contextmanager
def _twin_tile(block_m: int, consumer_wgs: int):
    """Forward calls resolved on the tile (block_m, consumer_wgs) of their key where one is built (the tune table's
    choice replaced); yields the list of the variants resolved inside; the plans and prepared calls emptied on entry
    and exit."""
    real, chosen = core.tuning.tuned_variant, []

    def pick(default, bucket, device, manifest):
        var = real(default, bucket, device, manifest)
        var = core._key_tile(var, block_m=block_m, consumer_wgs=consumer_wgs) or var
        chosen.append(var.name)
        return var

    core.tuning.tuned_variant = pick
    _forget_prepared(plans=True)
    try:
        yield chosen
    finally:
        core.tuning.tuned_variant = real
        _forget_prepared(plans=True)


def _tile_of(fn) -> str:
    """The tile of the forward variant that one call of ``fn`` launches (its last core.launch_forward: a split call's
    varlen forward), as ``block_m x block_n : consumer_wgs`` (``p``: PackGQA); "?" if none was launched."""
    seen, real = [], core.launch_forward
    core.launch_forward = lambda prep, *a, **kw: seen.append(prep.plan.variant) or real(prep, *a, **kw)
    try:
        fn()
    finally:
        core.launch_forward = real
    if not seen:
        return "?"
    p = seen[-1].params
    return f"{p['block_m']}x{p['block_n']}:{p['consumer_wgs']}" + ("p" if p.get("pack_gqa") else "")


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--shapes", help="batch:group:seqlen_q:seqlen_k,... (default: the twelve below)")
    ap.add_argument("--sweep", default="", help="explicit num_splits to time too, e.g. 2,4,8,16,32")
    ap.add_argument("--twin", default="", help="block_m:consumer_wgs: num_splits=1 on that tile of the key too")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--causal", action="store_true", help="flashgen's calls causal (bottom-right); SDPA's not")
    ap.add_argument("--kvcache", action="store_true", help="flashgen's calls through flash_attn_with_kvcache")
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    causal = a.causal
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    twin = tuple(int(x) for x in a.twin.split(":")) if a.twin else None
    h, rows = a.heads, []
    sweep = [int(x) for x in a.sweep.split(",") if x]
    shapes = ([tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")] if a.shapes else
              [(16, 8, 1, 8192), (16, 4, 1, 8192), (16, 8, 1, 1024), (16, 8, 4, 8192), (16, 8, 16, 8192),
               (16, 8, 64, 8192), (4, 8, 1, 8192), (4, 8, 1, 32768), (1, 8, 1, 32768), (1, 8, 16, 32768),
               (8, 1, 1, 8192), (2, 1, 1, 32768)])
    entry = "flash_attn_with_kvcache" if a.kvcache else "flash_attn_func"
    print(f"# split-KV in {entry}, {torch.cuda.get_device_name()}, {a.dtype}, heads {h}, "
          f"{'flashgen causal (SDPA not)' if causal else 'not causal'}; us per call")
    print("| head_dim | batch | group | seqlen_q | seqlen_k | splits | num_splits=1 | num_splits=0 | 1 / 0 | cuDNN "
          "| FA2 "
          "| best SDPA / flashgen(0) | FA3's rule n | its us / 0's |" + (" fastest n | its us | 0 / fastest |" if sweep else "")
          + (f" {a.twin} tile, 1 | 1 / it |" if twin else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if sweep else "")
          + ("---|---|" if twin else ""))
    for d in (int(x) for x in a.head_dims.split(",")):
        for b, group, sq, sk in shapes:
            hk = h // group
            g = torch.Generator(device="cuda").manual_seed(sq + sk + b)
            q = torch.randn(b, sq, h, d, device="cuda", dtype=dt, generator=g)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
            kvb = 0 if a.kvcache else 4 * d  # (kvcache: lengths not read on the host, FA3's rule; else the padded model)
            runs = {n: split_count(n, b, h, hk, sq, sk, 0, causal, (-1, -1), kvb) for n in (0, *sweep)}  # as called
            splits = runs[0]
            fa3 = _fa3_rule(b, h, hk, sq, sk, d, causal)
            extra = sorted(({runs[n] for n in sweep} | {fa3}) - {1, runs[0]})
            if a.kvcache:
                lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")

                def call(n):
                    return flashgen.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=causal, num_splits=n)
            else:
                def call(n):
                    return flashgen.flash_attn_func(q, k, v, causal=causal, num_splits=n)
            t = {n: 1e3 * _time_ms(lambda n=n: call(n)) for n in (1, 0, *extra)}
            tiles = {n: _tile_of(lambda n=n: call(n)) for n in (1, 0)}  # (after the timing: the calls prepared)
            counts = {1: t[1], runs[0]: t[0], **{n: t[n] for n in extra}}
            fastest = min(counts, key=counts.get)
            if twin:
                with _twin_tile(*twin) as chosen:
                    twin_us = 1e3 * _time_ms(lambda: call(1))
                twin_var = chosen[-1] if chosen else "?"
            peers = {}
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                fn, _ = _sdpa(backend, q, k, v)
                peers[name] = 1e3 * _time_ms(fn) if fn else float("nan")
            best = min((x for x in peers.values() if x == x), default=float("nan"))
            row = dict(head_dim=d, batch=b, group=group, seqlen_q=sq, seqlen_k=sk, splits=splits, unsplit_us=t[1],
                       split_us=t[0], speedup=t[1] / t[0], cudnn_us=peers["cudnn"], fa2_us=peers["fa2"],
                       vs_best_sdpa=best / t[0], fa3_splits=fa3, fa3_us=counts[fa3], fa3_over_0=counts[fa3] / t[0])
            if sweep:
                row.update(fastest_splits=fastest, fastest_us=counts[fastest],
                           split_over_fastest=t[0] / counts[fastest],
                           sweep_us=";".join(f"{n}:{t[n]:.1f}" for n in extra))
            if twin:
                row.update(twin_us=twin_us, unsplit_over_twin=t[1] / twin_us, twin_variant=twin_var)
            row["heads"] = h
            row["causal"] = int(causal)
            row["entry"] = entry
            row["tile_1"], row["tile_0"] = tiles[1], tiles[0]
            row["dtype"] = a.dtype
            rows.append(row)
            print(f"| {d} | {b} | {group} | {sq} | {sk} | {splits} | {t[1]:.1f} | {t[0]:.1f} | {row['speedup']:.2f} | "
                  f"{peers['cudnn']:.1f} | {peers['fa2']:.1f} | {row['vs_best_sdpa']:.2f} | {fa3} | "
                  f"{row['fa3_over_0']:.2f} |"
                  + (f" {fastest} | {counts[fastest]:.1f} | {t[0] / counts[fastest]:.2f} |" if sweep else "")
                  + (f" {twin_us:.1f} | {t[1] / twin_us:.2f} |" if twin else ""),
                  flush=True)
            del q, k, v
    _write_csv(a.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
