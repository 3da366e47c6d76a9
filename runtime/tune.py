"""`flashgen tune`: time every built tile of each forward dispatch key on this GPU, keep the winners.

Protocol (FA3 paper §4.1, DESIGN.md §6): per dispatch key (dtype, head_dim, causal; head_dim_v =
head_dim, no window, no softcap) and seqlen, total tokens 16384 (batch = 16384 / seqlen), hidden
2048 (heads = 2048 // head_dim), random normal q/k/v in BSHD (e4m3: rounded to e4m3, no descales,
bf16 output, no lse: FP8's usual call). FLOPs = 4 * batch * heads * seqlen^2
* head_dim, halved for causal. Each built variant of the key is launched through
``flashgen.core.attention_forward(..., variant=...)`` and timed with ``flashgen.bench._time_ms``
(triton's do_bench: L2 flushed before every repetition, median). The default tile is timed first
and last at every point and the better of the two is its figure, so drift during the point counts
against the candidates. With ``rounds`` > 1 (``--rounds``; 1 by default, which keeps the full
default sweep, about 3 minutes, inside scripts/device_check.sh's limits) the whole order (default,
candidates, default) runs that many times and each variant's figure is its best round: single
100 ms timings picked different tiles from one run to the next at head_dim 256 causal 1k / 2k on an
H200 (docs/PERF.md, 2026-11-23, where a 300 ms run gave the choice that old/new alternations
supported); alternated passes also sample each variant at two moments of the GPU's clock drift.

Choice: at each seqlen the fastest candidate wins only if it beats the default by more than
``min_gain`` (2 %; the same-code spread inside one run is about 1 %, run to run about ±5 %), else
the default stays. Adjacent seqlens with the same winner merge into one row whose bound is the
largest seqlen of the run (the last row has none): a call with seqlen_k between two measured
seqlens is served by the winner of the larger one. Before timing, each candidate's output at the
key's first seqlen is compared with the default's (max |difference| <= 0.01 + 0.01 max |default|);
a candidate that fails is reported and left out.

Writes a tune table (format: flashgen/tuning.py) and prints a markdown table of the evidence.
"""
from __future__ import annotations

import datetime
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from . import tuning
from .dispatch import full_key

FAMILIES = ("fwd",)  # what `flashgen tune` can time (the FA3 protocol's forward)
TOTAL_TOKENS = 16384
HIDDEN = 2048
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
MIN_GAIN = 0.02
WARMUP_MS = 25
REP_MS = 100
ROUNDS = 1  # passes over a point's variants (default, candidates, default); each variant's best counts
OVERHEAD_MS = 60  # per timing beyond warmup + rep (do_bench's estimate runs, flushes, launches), measured loosely
CHECK_ATOL = CHECK_RTOL = 1e-2
EXIT_OPTIONS = 2  # = flashgen.cli.EXIT_CONFIG (cli imports this module, so it cannot be imported here)


class TuneError(RuntimeError):
    """No key could be timed (every point failed); the message says so."""


@dataclass
class KeyPlan:
    """One dispatch key: its default variant and every built (or configured) variant serving it,
    the default first."""

    key: dict
    default: object  # a manifest Variant (or a generator Variant for a dry run before a build)
    candidates: list
    failed: dict = field(default_factory=dict)  # variant name -> why it was left out


def keys(dtypes, head_dims, causals) -> list[dict]:
    """The fwd dispatch keys tuned: dtype x head_dim x causal, head_dim_v = head_dim, no window,
    softcap, PackGQA or varlen."""
    return [{"dtype": t, "head_dim": d, "head_dim_v": d, "causal": c, "local": False, "softcap": False,
             "pack_gqa": False, "varlen": False}
            for t in dtypes for d in head_dims for c in causals]


def plan(variants, family: str, wanted: list[dict]) -> tuple[list[KeyPlan], list[dict]]:
    """(a KeyPlan per key with at least one variant, the keys with none). The default is what
    dispatch picks without a table (the ``default`` variant, else the first by name)."""
    plans, missing = [], []
    for key in wanted:  # (keys compared with their defaults filled in: a key written before an axis existed matches)
        want = full_key(family, key)
        vs = sorted((v for v in variants if v.family == family and full_key(family, v.dispatch) == want),
                    key=lambda v: v.name)
        if not vs:
            missing.append(key)
            continue
        default = next((v for v in vs if v.default), vs[0])
        plans.append(KeyPlan(key, default, [default] + [v for v in vs if v is not default]))
    return plans, missing


def tile_label(tile: dict) -> str:
    """Short form of a fwd tile: "128x176 s2 wg2", then the knobs that differ from their defaults
    (fwd.py's keys): "no-pingpong" for one that is off, "exp_turns" for one that is on."""
    from .generator import families

    defaults = {k.name: k.default for k in families.get("fwd").keys if k.role == "knob"}
    t = dict(tile)
    parts = []
    if "block_m" in t and "block_n" in t:
        parts.append(f"{t.pop('block_m')}x{t.pop('block_n')}")
    for k, short in (("stages", "s"), ("consumer_wgs", "wg")):
        if k in t:
            parts.append(f"{short}{t.pop(k)}")
    for k, v in t.items():
        if v == defaults.get(k, True):
            continue
        parts.append(f"no-{k}" if v is False else k if v is True else f"{k}={v}")
    return " ".join(parts)


def key_label(key: dict) -> str:
    mask = "causal" if key.get("causal") else "local" if key.get("local") else "noncausal"
    hd = f"hd{key['head_dim']}" + (f"v{key['head_dim_v']}" if key.get("head_dim_v", key["head_dim"]) != key["head_dim"] else "")
    return " ".join([key["dtype"], hd, mask] + (["softcap"] if key.get("softcap") else []))


def _tile(v) -> dict:
    return tuning.tile_of(v.params, v.dispatch)


def estimate_seconds(plans, seqlens, warmup_ms: float, rep_ms: float, rounds: int = ROUNDS) -> float:
    """Rough wall time of the sweep: per round one timing per candidate per point (two for the
    default) at warmup + rep + OVERHEAD_MS each, plus a correctness launch per candidate and key."""
    timings = rounds * sum(len(p.candidates) + 1 for p in plans) * len(seqlens)
    return timings * (warmup_ms + rep_ms + OVERHEAD_MS) / 1000 + 0.05 * sum(len(p.candidates) for p in plans)


def decide(default_tflops: float, measured: dict, default_name: str, min_gain: float) -> str:
    """The winner's name at one point: the fastest candidate if it beats ``default_tflops`` by more
    than ``min_gain`` (a fraction), else the default."""
    best = max((n for n in measured if n != default_name and measured[n] == measured[n]),
               key=lambda n: measured[n], default=None)
    if best is not None and measured[best] > default_tflops * (1 + min_gain):
        return best
    return default_name


def merge_rows(seqlens, winners: list[str]) -> list[tuple]:
    """Adjacent seqlens with the same winner as (max_seqlen_k or None for the last, winner, [seqlens])."""
    runs: list = []
    for s, w in zip(seqlens, winners):
        if runs and runs[-1][1] == w:
            runs[-1][2].append(s)
        else:
            runs.append([s, w, [s]])
    return [(None if i == len(runs) - 1 else r[2][-1], r[1], r[2]) for i, r in enumerate(runs)]


# ------------------------------------------------------------------------------------ GPU part
class _Point:
    """One FA3-protocol point on the current CUDA device: inputs made once, any variant launched on them."""

    def __init__(self, key: dict, seqlen: int):
        import torch

        from . import bench, core

        self._core, self._bench, self._torch = core, bench, torch
        fp8 = key["dtype"] == "e4m3"  # e4m3 q/k/v (random normal rounded to e4m3), no descales, bf16 out
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}[key["dtype"]]
        d, self.causal = key["head_dim"], key["causal"]
        b, h = TOTAL_TOKENS // seqlen, HIDDEN // d
        q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype) for _ in range(3))
        self.out = torch.empty_like(q)
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        self._keep = (q, k, v, torch.empty(b, h, seqlen, device="cuda", dtype=torch.float32))
        # e4m3 without the lse (flash_attn_func's FP8 call without return_attn_probs: the FP8 rowsum_mma
        # variants then skip their exact row sums); 16-bit with it (training saves it)
        self.args = tuple(bench.tensor_arg(t) for t in (q, k, v, self.out)) + (None if fp8 else bench.tensor_arg(self._keep[3]),)
        self.flops = bench._flops(b, h, seqlen, d, self.causal)
        self.scale = d ** -0.5
        self.stream = torch.cuda.current_stream().cuda_stream

    def _run(self, variant):
        self._core.attention_forward(*self.args, self.scale, self.causal, self.stream, variant=variant)

    def time_ms(self, variant, warmup_ms: float, rep_ms: float) -> float:
        return self._bench._time_ms(lambda: self._run(variant), warmup_ms, rep_ms)

    def output(self, variant):
        """The variant's output (fp32 copy) on a NaN-poisoned out buffer."""
        self.out.fill_(float("nan"))
        self._run(variant)
        self._torch.cuda.synchronize()
        return self.out.float()

    @staticmethod
    def mismatch(out, ref) -> str | None:
        """Why ``out`` is not ``ref`` within CHECK_ATOL + CHECK_RTOL * max |ref| (None if it is)."""
        err = float((out - ref).abs().max())
        tol = CHECK_ATOL + CHECK_RTOL * float(ref.abs().max())
        return None if err <= tol else f"output differs from the default's: max |diff| {err:.3g} > {tol:.3g}"


def gpu_name() -> str | None:
    """The current CUDA device's name (torch.cuda.get_device_name), or None without a GPU or torch."""
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 -- no torch, no driver: no GPU
        return None


def sweep(plans, seqlens, warmup_ms=WARMUP_MS, rep_ms=REP_MS, log=print, rounds: int = ROUNDS) -> dict:
    """TFLOP/s per (key index, seqlen): ``{(i, s): {variant name: tflops, "__default2__": tflops}}``,
    each the best of ``rounds`` passes over the order (default, candidates, default).

    Candidates failing the output check or raising are recorded in ``plan.failed`` and skipped."""
    results: dict = {}
    for i, p in enumerate(plans):
        label = key_label(p.key)
        checked = False
        for s in seqlens:
            try:
                pt = _Point(p.key, s)
            except Exception as e:  # noqa: BLE001 -- e.g. out of memory: this point only
                log(f"  {label} seqlen {s}: cannot make inputs ({type(e).__name__}: {e}); skipped")
                continue
            if not checked:  # at the key's first point: each candidate's output against the default's
                checked = True
                try:
                    ref = pt.output(p.default)
                except Exception as e:  # noqa: BLE001 -- the key cannot be tuned without its default
                    log(f"  {label}: the default {p.default.name} failed ({type(e).__name__}: {e}); key skipped")
                    break
                for v in p.candidates[1:]:
                    try:
                        why = pt.mismatch(pt.output(v), ref)
                    except Exception as e:  # noqa: BLE001
                        why = f"{type(e).__name__}: {e}"
                    if why:
                        p.failed[v.name] = why
                        log(f"  {label}: left out {tile_label(_tile(v))} ({v.name}): {why}")
                del ref
            res: dict = {}
            order = [v for v in p.candidates if v.name not in p.failed] + [p.default]
            raised: set = set()  # variants that raised at this point: not timed in its later rounds
            for _ in range(rounds):
                skip = set(raised)  # (within a round as with one round: the default's last slot still runs)
                for n, v in enumerate(order):
                    if v.name in skip:
                        continue
                    slot = "__default2__" if n == len(order) - 1 else v.name
                    try:
                        tflops = pt.flops / pt.time_ms(v, warmup_ms, rep_ms) / 1e9
                    except Exception as e:  # noqa: BLE001
                        raised.add(v.name)
                        p.failed.setdefault(v.name, f"{type(e).__name__}: {e}")
                        log(f"  {label} seqlen {s}: {tile_label(_tile(v))} failed: {type(e).__name__}: {e}")
                        res.pop(slot, None)
                        continue
                    res[slot] = max(res.get(slot, tflops), tflops)
            results[(i, s)] = res
            best = max(res.values(), default=float("nan"))
            log(f"  {label} seqlen {s}: {len(res)} figures ({rounds} rounds), best {best:.1f} TFLOP/s")
            del pt
    return results


# ------------------------------------------------------------------------------------ table
def _commit(root) -> str:
    if root is None:
        return "unknown"
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty == 1 else "")) if sha else "unknown"


def protocol(seqlens, warmup_ms, rep_ms, min_gain, rounds: int = ROUNDS) -> dict:
    return {"family": "fwd", "total_tokens": TOTAL_TOKENS, "hidden": HIDDEN, "seqlens": list(seqlens),
            "inputs": "random normal, BSHD, batch = total_tokens / seqlen, heads = hidden // head_dim; "
                      "e4m3: rounded to e4m3, no descales, bf16 output, no lse",
            "flops": "4 * batch * heads * seqlen^2 * head_dim, halved for causal",
            "timer": "flashgen.bench._time_ms (triton do_bench: L2 flushed before each repetition, median)",
            "warmup_ms": warmup_ms, "rep_ms": rep_ms, "rounds": rounds,
            "baseline": "default tile timed first and last at each point; the better of the two",
            "figure": "each variant's best over the rounds (default, candidates, default; alternated)",
            "min_gain": min_gain}


def build_table(gpu: str, plans, seqlens, results, proto: dict, commit: str, version: str) -> tuple[dict, list]:
    """(table data, markdown rows) from :func:`sweep`'s results; keys whose default could not be
    timed at any seqlen are left out."""
    entries, md = [], []
    min_gain = proto["min_gain"]
    for i, p in enumerate(plans):
        pts = []
        for s in seqlens:
            res = dict(results.get((i, s), {}))
            d2 = res.pop("__default2__", float("nan"))
            d1 = res.get(p.default.name, float("nan"))
            base = max((x for x in (d1, d2) if x == x), default=float("nan"))
            if base != base:
                continue
            w = decide(base, res, p.default.name, min_gain)
            pts.append((s, w, res.get(w, base) if w != p.default.name else base, base, res))
        if not pts:
            continue
        by_name = {v.name: v for v in p.candidates}
        rows = []
        for bound, w, ss in merge_rows([x[0] for x in pts], [x[1] for x in pts]):
            measured = [{"seqlen": s, "tflops": round(t, 1), "default_tflops": round(b, 1)}
                        for s, _, t, b, _ in pts if s in ss]
            rows.append({"max_seqlen_k": bound, "tile": "default" if w == p.default.name else _tile(by_name[w]),
                         "measured": measured})
        entries.append({"family": p.default.family, "key": dict(p.default.dispatch), "default_tile": _tile(p.default),
                        "rows": rows})
        for s, w, t, b, res in pts:
            win = tile_label(_tile(by_name[w])) + (" (default)" if w == p.default.name else "")
            best = max((n for n in res if n != p.default.name), key=lambda n: res[n], default=None)
            note = ""
            if w == p.default.name and best is not None and res[best] > b:
                note = f"{tile_label(_tile(by_name[best]))} {(res[best] / b - 1) * 100:+.1f} %: within the {min_gain:.0%} guard"
            md.append((key_label(p.key), s, b, win, t, t / b - 1, note))
    data = {"schema": tuning.SCHEMA, "gpu": gpu, "date": datetime.date.today().isoformat(),
            "flashgen": {"version": version, "commit": commit}, "protocol": proto, "entries": entries}
    return data, md


def markdown(md_rows) -> str:
    lines = ["| key | seqlen | default TFLOP/s | winner | winner TFLOP/s | gain | note |",
             "|---|---|---|---|---|---|---|"]
    for key, s, b, win, t, gain, note in md_rows:
        lines.append(f"| {key} | {s} | {b:.1f} | {win} | {t:.1f} | {gain * 100:+.1f} % | {note} |")
    return "\n".join(lines)


def default_output(gpu: str | None) -> Path:
    """configs/tune/<gpu-slug>.yaml of the source checkout when there is one, else ./<gpu-slug>.yaml."""
    from .generator.project import find_root

    name = f"{tuning.gpu_slug(gpu) if gpu else '<gpu-slug>'}.yaml"
    root = find_root()
    return root / "configs" / tuning.TABLE_DIR / name if root is not None else Path.cwd() / name


def check_seqlens(seqlens) -> list[str]:
    """Problems with a seqlen list: each must divide TOTAL_TOKENS (so a power of two, batch >= 1)."""
    return [f"seqlen {s}: not allowed; allowed: a power of two dividing {TOTAL_TOKENS} (batch = {TOTAL_TOKENS} / seqlen)"
            for s in seqlens if not (isinstance(s, int) and 1 <= s <= TOTAL_TOKENS and TOTAL_TOKENS % s == 0)]


def merge_tables(new: dict, old: dict) -> dict:
    """``new`` with the entries of ``old`` (a table of the same GPU) whose keys ``new`` did not time
    appended, and a record of them in the protocol (``kept``: their keys, and the date, commit and
    min_gain of the run they come from; the rest of that run's protocol was new's unless said). TuneError
    when the GPUs differ."""
    if old.get("gpu") != new["gpu"]:
        raise TuneError(f"--merge: the existing table is of {old.get('gpu')!r}, not {new['gpu']!r}; no table written")
    timed = {(e["family"], *sorted(e["key"].items())) for e in new["entries"]}
    kept = [e for e in old["entries"] if (e["family"], *sorted(e["key"].items())) not in timed]
    out = {**new, "entries": new["entries"] + kept}
    if kept:
        prev = old.get("protocol", {}).get("kept", [])  # entries an earlier merge kept stay attributed to their run
        prev_keys = {str(k) for p in prev for k in p["keys"]}
        kept_keys = {str(e["key"]) for e in kept}
        own = [dict(e["key"]) for e in kept if str(e["key"]) not in prev_keys]  # copies: no YAML anchors
        old_gain = old.get("protocol", {}).get("min_gain", MIN_GAIN)  # (runs recorded before min_gain was: old's)
        runs = [{**p, "min_gain": p.get("min_gain", old_gain),
                 "keys": [dict(k) for k in p["keys"] if str(k) in kept_keys]} for p in prev]
        runs = [p for p in runs if p["keys"]]
        if own:
            runs.append({"date": str(old["date"]), "commit": old["flashgen"]["commit"], "min_gain": old_gain,
                         "keys": own})
        out["protocol"] = {**new["protocol"], "kept": runs}
    return out


def run(plans, seqlens, gpu: str, output: Path, *, warmup_ms=WARMUP_MS, rep_ms=REP_MS, min_gain=MIN_GAIN,
        root=None, version: str = "", commit: str | None = None, log=print, merge: bool = False,
        rounds: int = ROUNDS) -> tuple[dict, str]:
    """Sweep, choose, write ``output`` (atomically; validated by reading it back). Returns (table
    data, markdown). TuneError when no key could be timed. ``merge``: keep the entries of the table
    already at ``output`` for the keys this run did not time (:func:`merge_tables`)."""
    from .generator.fsutil import atomic_write_text

    old = None
    if merge and Path(output).exists():  # read (and its GPU checked) before the sweep, not after it
        import yaml

        old = yaml.safe_load(Path(output).read_text())
        if old.get("gpu") != gpu:
            raise TuneError(f"--merge: {output} is the table of {old.get('gpu')!r}, not {gpu!r}; nothing timed")
    results = sweep(plans, seqlens, warmup_ms, rep_ms, log, rounds)
    proto = protocol(seqlens, warmup_ms, rep_ms, min_gain, rounds)
    data, md = build_table(gpu, plans, seqlens, results, proto, commit or _commit(root), version)
    if not data["entries"]:
        raise TuneError("no key could be timed (see the messages above); no table written")
    if old is not None:
        data = merge_tables(data, old)
    atomic_write_text(output, tuning.table_text(data))
    tuning.load_table(output)  # what the runtime will read: must validate
    return data, markdown(md)


def fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


# ------------------------------------------------------------------------------------ CLI
def _csv(text: str, what: str, conv, allowed=None) -> list:
    """A comma-separated option value converted item by item; exit 2 naming the option and the item."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            val = conv(item)
        except ValueError:
            val = None
        if val is None or (allowed is not None and val not in allowed):
            click.echo(f"error: {what} {item!r}: not allowed; allowed: "
                       f"{', '.join(map(str, allowed)) if allowed else 'integers'}", err=True)
            sys.exit(EXIT_OPTIONS)
        out.append(val)
    if not out:
        click.echo(f"error: {what}: empty list", err=True)
        sys.exit(EXIT_OPTIONS)
    return out


def _bool(text: str) -> bool:
    t = text.lower()
    if t not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError(text)
    return t in ("true", "1", "yes", "on")


@click.command("tune")
@click.option("--family", type=click.Choice(FAMILIES), default=FAMILIES[0], show_default=True,
              help="Kernel family to tune (the forward; its tables are what the runtime reads).")
@click.option("--dtypes", default="bf16,fp16,e4m3", show_default=True,
              help="Comma-separated dtypes (bf16, fp16, e4m3: e4m3 inputs without descales, bf16 output).")
@click.option("--head-dims", default="64,128,256", show_default=True, help="Comma-separated head dims.")
@click.option("--causal", "causal_s", default="false,true", show_default=True, help="Comma-separated: false, true.")
@click.option("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)), show_default=True,
              help="Comma-separated seqlens, each a power of two dividing 16384 (batch = 16384 / seqlen).")
@click.option("--min-gain", type=click.FloatRange(min=0.0), default=MIN_GAIN, show_default=True,
              help="Noise guard: a candidate replaces the default at a seqlen only when faster by more than this fraction.")
@click.option("--warmup-ms", type=click.IntRange(min=1), default=WARMUP_MS, show_default=True,
              help="do_bench warmup (ms) per timing.")
@click.option("--rep-ms", type=click.IntRange(min=1), default=REP_MS, show_default=True,
              help="do_bench repetitions (ms) per timing.")
@click.option("--rounds", type=click.IntRange(min=1), default=ROUNDS, show_default=True,
              help="Passes over each point's variants (default, candidates, default); each variant's best pass counts.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Table to write [default: configs/tune/<gpu-slug>.yaml in a source checkout, else ./<gpu-slug>.yaml].")
@click.option("--build/--no-build", "do_build", default=False, show_default=True,
              help="First build the default set and every configured variant of the keys (configs/fwd_tune.yaml's "
                   "candidates, ablation points): what a fresh checkout needs.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel nvcc jobs for --build.")
@click.option("--commit", default=None, help="Source commit recorded in the table [default: `git rev-parse` of the "
                                             "checkout, 'unknown' without git].")
@click.option("--merge", is_flag=True, help="Keep the entries of the existing output table for the keys this run does "
              "not time (e.g. --dtypes e4m3 re-tunes e4m3 alone); the protocol records their date and commit.")
@click.option("--dry-run", is_flag=True, help="Print the plan (keys, candidates, timings, time estimate) and stop.")
def command(family, dtypes, head_dims, causal_s, seqlens, min_gain, warmup_ms, rep_ms, rounds, output, do_build, jobs,
            commit, merge, dry_run):
    """Time every built tile of each forward dispatch key on this GPU and write the winners.

    Measures, per key (dtype x head_dim x causal; no window, no softcap) and seqlen, the forward
    TFLOP/s of every built variant of the key under the FA3 protocol: 16384 tokens (batch = 16384 /
    seqlen), hidden 2048 (heads = 2048 / head_dim), FLOPs 4·batch·heads·seqlen²·head_dim (halved
    for causal), timed as triton's do_bench (L2 flushed before each repetition, median), in
    --rounds passes over the point (default, candidates, default), each variant's best pass
    counting; the default's first and last timings both count for it. A candidate wins a seqlen only
    if it beats the default by more than --min-gain (2 %: noise guard); adjacent seqlens with the
    same winner merge into one seqlen_k range. Candidates whose output differs from the default's
    are left out.

    Output: the tune table (YAML: GPU name, date, flashgen version and commit, protocol, and per
    key the tile per seqlen_k range with the winner's and the default's TFLOP/s), read by the
    runtime for this GPU (flashgen/tuning.py; FLASHGEN_TUNE_TABLE overrides), and a markdown table
    (key, seqlen, default TFLOP/s, winner, winner TFLOP/s, gain, and a note where a faster
    candidate stayed inside the guard) on stdout.

    Errors: exit 2 for bad options; 3 without a CUDA GPU (or torch); 1 when no key has a built
    candidate besides its default (build them: --build), a build fails, or no key could be timed."""
    import time

    from .cli import EXIT_BUILD_FAILED, EXIT_CONFIG, EXIT_TOOLCHAIN, _load, _run_build
    from .generator import families

    fam = families.get(family)
    dts = _csv(dtypes, "--dtypes", str, fam.key("dtype").allowed)
    hds = _csv(head_dims, "--head-dims", int, fam.key("head_dim").allowed)
    causals = _csv(causal_s, "--causal", _bool)
    sls = sorted(set(_csv(seqlens, "--seqlens", int)))
    for problem in check_seqlens(sls):
        click.echo(f"error: --seqlens: {problem}", err=True)
        sys.exit(EXIT_CONFIG)
    gpu = gpu_name()
    if gpu is None and not dry_run:
        click.echo("error: flashgen tune needs a CUDA GPU and torch (none found); --dry-run prints the plan", err=True)
        sys.exit(EXIT_TOOLCHAIN)
    wanted = keys(dts, hds, causals)
    source = None
    if do_build:
        from .generator.config import select

        project, variants = _load()
        extra = [v for v in variants if v.family == family and v.dispatch in wanted and not v.default_build]
        selected = select(variants) + extra
        if dry_run:
            source, pool = f"configured in {project.root} (what --build builds)", variants
        else:
            _run_build(project, selected, variants, jobs)
    manifest = None
    if source is None:
        from .manifest import ManifestError, load_manifest

        try:
            manifest = load_manifest()
            source, pool = f"built, manifest {manifest.path}", manifest.variants
        except ManifestError as e:
            if not dry_run:
                click.echo(f"error: {e}", err=True)
                sys.exit(EXIT_BUILD_FAILED)
            source, pool = f"nothing built ({e})", []
    plans, missing = plan(pool, family, wanted)
    alone = [p for p in plans if len(p.candidates) < 2]
    plans = [p for p in plans if len(p.candidates) >= 2]
    out = output or default_output(gpu)
    est = estimate_seconds(plans, sls, warmup_ms, rep_ms, rounds)
    click.echo(f"flashgen tune: {gpu or 'no GPU'} -> {out}")
    click.echo(f"protocol: {family}, {TOTAL_TOKENS} tokens, hidden {HIDDEN}, seqlens {','.join(map(str, sls))}; "
               f"do_bench warmup {warmup_ms} ms, rep {rep_ms} ms, {rounds} rounds; min gain {min_gain:.0%}; "
               f"variants {source}")
    for p in plans:
        cands = ", ".join(tile_label(tuning.tile_of(v.params, v.dispatch)) + (" (default)" if v is p.default else "")
                          for v in p.candidates)
        click.echo(f"  {key_label(p.key):<22} {cands}")
    for p in alone:
        click.echo(f"  {key_label(p.key):<22} only the default is built: not timed")
    for k in missing:
        click.echo(f"  {key_label(k):<22} no built variant: not timed")
    n_timings = rounds * sum(len(p.candidates) + 1 for p in plans) * len(sls)
    click.echo(f"{len(plans)} keys, {sum(len(p.candidates) for p in plans)} variants, {len(sls)} seqlens: "
               f"{n_timings} timings, about {fmt_seconds(est)}")
    if dry_run:
        return
    if not plans:
        click.echo("error: no key has a built candidate besides its default; build them with `flashgen tune --build` "
                   "(or `flashgen build --all`)", err=True)
        sys.exit(EXIT_BUILD_FAILED)
    from . import __version__
    from .generator.project import find_root

    t0 = time.monotonic()
    try:
        _, md = run(plans, sls, gpu, out, warmup_ms=warmup_ms, rep_ms=rep_ms, min_gain=min_gain, root=find_root(),
                    version=__version__, commit=commit, log=click.echo, merge=merge, rounds=rounds)
    except TuneError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BUILD_FAILED)
    click.echo(f"\n{md}\n")
    click.echo(f"wrote {out} in {fmt_seconds(time.monotonic() - t0)} (estimate {fmt_seconds(est)})")
    found, _ = tuning.find_table(gpu, manifest.path if manifest else None)
    if found is None or found.resolve() != out.resolve():
        click.echo(f"note: the runtime does not read {out} for this GPU ({'it reads ' + str(found) if found else 'no table'}); "
                   f"set FLASHGEN_TUNE_TABLE={out} to use it", err=True)
