"""PackGQA (FA3's: a K/V head's query heads packed into one tile) against the unpacked forward and
SDPA on decode-like GQA calls: the measurement behind flashgen.core.pack_gqa_rule.

For each (seqlen_q, seqlen_k, group, causal): microseconds per call of flash_attn_func with the
rule forced to pack and forced not to, which of the two the rule picks, and SDPA's cuDNN and flash
backends (``enable_gqa=True``; where a backend refuses it, K/V expanded to every query head before
timing, as a user without GQA support would). Timing: flashgen.bench._time_ms (triton do_bench,
L2 flushed before each repetition, median). bf16, batch 16, heads 32, head_dim 128 (--head-dim).
SDPA's is_causal is top-left aligned, FA3's bottom-right: causal rows are timed for flashgen only.

    python scripts/packgqa_bench.py [--head-dim 128] [--batch 16] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import sys

import torch

import flashgen
import flashgen.core as core
import flashgen.interface as interface
from flashgen.bench import _time_ms


def _sdpa(backend, q, k, v):
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    for gqa in (True, False):
        if gqa:
            args, kw = (qt, kt, vt), {"enable_gqa": True}
        else:
            args, kw = (qt, kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)), {}

        def fn(args=args, kw=kw):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(*args, **kw)

        try:
            fn()
            torch.cuda.synchronize()
            return fn, gqa
        except Exception:  # noqa: BLE001 -- this backend refuses the form
            continue
    return None, None


def _forget_prepared(plans: bool = False) -> None:
    """The prepared forward calls emptied (and with ``plans`` the resolved plans), so the next call asks the rules."""
    interface._fwd_calls.clear()
    core._prepared_forwards.clear()
    if plans:
        core._plans.clear()


@contextlib.contextmanager
def _forced(pack: bool):
    """core.pack_gqa_rule answering ``pack``; the prepared calls emptied on entry and exit."""
    real = core.pack_gqa_rule
    core.pack_gqa_rule = lambda *a: pack
    _forget_prepared()
    try:
        yield
    finally:
        core.pack_gqa_rule = real
        _forget_prepared()


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    d, b, h = a.head_dim, a.batch, a.heads
    rows = []
    print(f"# PackGQA, {torch.cuda.get_device_name()}, bf16, batch {b}, heads {h}, head_dim {d}; us per call")
    print("| seqlen_q | seqlen_k | group | causal | packed | unpacked | unpacked/packed | rule | cuDNN | FA2 | best SDPA / flashgen |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sk in (1024, 8192):
        for group in (4, 8):
            for sq in (1, 4, 16, 64, 128, 512):
                for causal in (False, True):
                    if causal and sq == 1:
                        continue
                    hk = h // group
                    g = torch.Generator(device="cuda").manual_seed(sq + sk)
                    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
                    t = {}
                    for pack in (True, False):
                        with _forced(pack):
                            t[pack] = 1e3 * _time_ms(lambda: flashgen.flash_attn_func(q, k, v, causal=causal))
                    plan = core._plan("bf16", d, d, core.mask_spec(causal, (-1, -1), sq, sk), False, 0, None,
                                      bucket=(sk - 1).bit_length())
                    rule = core.pack_gqa_rule(sq, h, hk, plan.block_m)
                    peers, forms = {}, {}
                    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                        fn, gqa = (None, None) if causal else _sdpa(backend, q, k, v)
                        peers[name] = 1e3 * _time_ms(fn) if fn else float("nan")
                        forms[f"{name}_form"] = "" if fn is None else "enable_gqa" if gqa else "expanded"
                    best = min((x for x in peers.values() if x == x), default=float("nan"))
                    fg = t[rule]
                    row = dict(seqlen_q=sq, seqlen_k=sk, group=group, causal=causal, packed_us=t[True],
                               unpacked_us=t[False], speedup=t[False] / t[True], rule="pack" if rule else "unpacked",
                               cudnn_us=peers["cudnn"], fa2_us=peers["fa2"], vs_best_sdpa=best / fg, **forms)
                    rows.append(row)
                    print(f"| {sq} | {sk} | {group} | {'yes' if causal else 'no'} | {t[True]:.1f} | {t[False]:.1f} | "
                          f"{row['speedup']:.2f} | {row['rule']} | {peers['cudnn']:.1f} | {peers['fa2']:.1f} | "
                          f"{row['vs_best_sdpa']:.2f} |", flush=True)
                    del q, k, v
    wrong = [r for r in rows if (r["rule"] == "pack") != (r["speedup"] > 1.0) and abs(r["speedup"] - 1) > 0.03]
    print(f"rule disagrees with the faster kernel by more than 3 % at {len(wrong)} of {len(rows)} points"
          + "".join(f"\n  q{r['seqlen_q']} k{r['seqlen_k']} g{r['group']} causal={r['causal']}: "
                    f"rule {r['rule']}, unpacked/packed {r['speedup']:.2f}" for r in wrong))
    _write_csv(a.csv, rows)
    return 0


def _write_csv(path, rows: list) -> None:
    """``rows`` (dicts of one set of keys) as a CSV at ``path``; nothing when ``path`` is None."""
    if path:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
