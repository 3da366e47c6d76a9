"""Render, compile (content-addressed cache, parallel, atomic) and write the manifest.

Cache: ``build/cache/<key>/`` holds ``kernel.fatbin`` and ``report.json`` (ptxas report, command,
compile time). The key is the sha256 of: the rendered source, the path (relative to
templates/include) and content of every project header it includes, the nvcc flags, and nvcc's
``--version`` output and resolved path. File times never matter. A compile writes into a private
temp folder which is renamed into place only when complete and checked, so a killed build leaves
nothing half-written. ``report.json`` records the fatbin's sha256; an entry is reused only when
the fatbin still matches it (a corrupt entry is deleted and rebuilt, with one line saying so).
Builds of the same key take a file lock (``build/cache/.locks/<key>.lock``), so two builds at once
compile each variant once and the second reuses the first's entry. nvcc runs in a process group
of its own that dies with the build, even on ``kill -9`` (generator/procs.py).

After compiling, ``build/fatbin/<name>.fatbin`` and ``build/manifest.json`` (CONTRACTS.md §5) list
every configured variant: its current cache entry when one exists, else the build the previous
manifest published for it (kept, marked ``"stale": true``, while its fatbin still matches). So a
failed render or compile, or a subset build after a header edit, never removes a working kernel.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from . import ptxas
from .errors import BuildError
from .fsutil import atomic_write_bytes, atomic_write_text, write_if_changed
from .procs import Children
from .render import local_headers, render
from .toolchain import Nvcc, find_nvcc

ARCH = "sm_90a"
NVCC_FLAGS = (
    "-gencode", "arch=compute_90a,code=sm_90a",  # SASS only: sm_90a has no forward compatibility
    "-O3", "--use_fast_math", "-std=c++17", "-DNDEBUG", "-lineinfo",
    "-Xptxas", "-v", "-Xfatbin=-compress-all", "-fatbin",
)
MANIFEST_SCHEMA = 2
CACHE_FORMAT = "flashgen-cache-2"  # 2: report.json records the fatbin sha256
JOB_MEM_BYTES = int(float(os.environ.get("FLASHGEN_JOB_MEM_GB", "1.5")) * 2**30)


def nvcc_command(nvcc: str, include_dir: Path, src: Path, out: Path, flags=NVCC_FLAGS) -> list[str]:
    return [nvcc, *flags, f"-I{include_dir}", "-o", str(out), str(src)]


def default_jobs() -> int:
    """min(cores, available memory / ~1.5 GB per nvcc job), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    by_mem = max(1, avail // JOB_MEM_BYTES) if avail else cores
    return max(1, min(cores, by_mem))


@dataclass
class Plan:
    variant: object
    source: str
    headers: list  # paths relative to templates/include
    key: str
    entry: Path  # build/cache/<key>
    _valid: bool | None = field(default=None, repr=False)  # entry checked against its checksum (memo)

    @property
    def name(self) -> str:
        return self.variant.name

    def entry_problem(self) -> str | None:
        """None when the cache entry is complete and its fatbin matches the sha256 recorded in its
        report; else what is wrong ("missing" when there is no entry at all)."""
        fatbin, report = self.entry / "kernel.fatbin", self.entry / "report.json"
        if not self.entry.exists():
            return "missing"
        try:
            want = json.loads(report.read_text()).get("fatbin_sha256")
        except (OSError, ValueError) as e:
            return f"unreadable report.json ({type(e).__name__})"
        if not want:
            return "report.json records no fatbin checksum"
        try:
            got = _sha256(fatbin)
        except OSError as e:
            return f"unreadable kernel.fatbin ({type(e).__name__})"
        return None if got == want else f"kernel.fatbin sha256 {got[:12]}... differs from the recorded {want[:12]}..."

    def cached(self) -> bool:
        """The entry exists and is intact (checked once per plan; :meth:`forget` re-checks)."""
        if self._valid is None:
            self._valid = self.entry_problem() is None
        return self._valid

    def forget(self) -> None:
        self._valid = None


@dataclass
class BuildResult:
    nvcc: Nvcc
    selected: list = field(default_factory=list)  # names asked for
    compiled: list = field(default_factory=list)  # names compiled by nvcc in this run
    cached: list = field(default_factory=list)  # names served by the cache
    failed: list = field(default_factory=list)  # (name, message)
    manifest: dict | None = None
    manifest_path: Path | None = None
    seconds: float = 0.0


class _Keyer:
    """Computes cache keys; reads each header once per build."""

    def __init__(self, project, nvcc: Nvcc, flags):
        self.project = project
        self.include_dir = project.include_dir.resolve()
        self._headers: dict[Path, bytes] = {}
        h = hashlib.sha256()
        h.update(CACHE_FORMAT.encode() + b"\0")
        h.update(json.dumps(list(flags)).encode() + b"\0")
        h.update(nvcc.version.encode() + b"\0")
        h.update(str(Path(nvcc.path).resolve()).encode() + b"\0")
        self._base = h

    def header(self, path: Path) -> bytes:
        if path not in self._headers:
            self._headers[path] = path.read_bytes()
        return self._headers[path]

    def key(self, source: str, src_dir: Path) -> tuple[str, list[str]]:
        h = self._base.copy()
        h.update(b"source\0" + source.encode() + b"\0")
        rels = []
        for p in local_headers(source, self.include_dir, src_dir):
            try:
                rel = str(p.relative_to(self.include_dir))
            except ValueError:
                rel = str(p)
            rels.append(rel)
            h.update(b"header\0" + rel.encode() + b"\0" + self.header(p) + b"\0")
        return h.hexdigest(), rels


def plan_variants(project, variants, nvcc: Nvcc, flags=NVCC_FLAGS) -> tuple[list[Plan], list]:
    """Render every variant and compute its cache key. Returns (plans, [(name, render error)])."""
    keyer = _Keyer(project, nvcc, flags)
    plans, errors = [], []
    for v in variants:
        try:
            src = render(v, project.templates_dir)
        except BuildError as e:
            errors.extend(e.failures)
            continue
        key, headers = keyer.key(src, project.src_dir)
        plans.append(Plan(v, src, headers, key, project.cache_dir / key))
    return plans, errors


def _first_errors(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or "fatal" in ln.lower()]
    pick = errs[:n] if errs else lines[-n:]
    return " | ".join(pick) if pick else "(no compiler output)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temps(cache_dir: Path) -> None:
    """Remove temp folders left by killed builds (their process is gone)."""
    if not cache_dir.is_dir():
        return
    for d in cache_dir.glob(".tmp-*"):
        try:
            pid = int(d.name.split("-")[2])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def drop_corrupt(plan: Plan, log=print) -> None:
    """If the plan's cache entry exists but fails its check, say so in one line and delete it."""
    why = plan.entry_problem()
    if why is None or why == "missing":
        plan._valid = why is None  # checked: cached() need not hash the fatbin again
        return
    log(f"cache: {plan.name}: entry {plan.key[:12]} is corrupt ({why}); rebuilding it")
    trash = plan.entry.with_name(f".tmp-corrupt-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(plan.entry, trash)
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
    plan.forget()


def _lock(project, key: str) -> FileLock:
    d = project.cache_dir / ".locks"
    d.mkdir(parents=True, exist_ok=True)
    return FileLock(str(d / f"{key}.lock"))


def compile_plan(plan: Plan, project, nvcc: Nvcc, flags=NVCC_FLAGS, children: Children | None = None,
                 log=print) -> dict | None:
    """Compile one variant into its cache entry (atomically), holding the key's file lock.
    Returns the report, or None when a concurrent build made the entry while this one waited for
    the lock. Raises BuildError naming the variant on a compiler error or a failed ptxas check."""
    lock = _lock(project, plan.key)
    try:
        lock.acquire(timeout=1)
    except Timeout:
        log(f"waiting for another build compiling {plan.name}")
        lock.acquire()
    try:
        plan.forget()
        if plan.cached():
            return None
        drop_corrupt(plan, log)
        return _compile(plan, project, nvcc, flags, children)
    finally:
        lock.release()


def _compile(plan: Plan, project, nvcc: Nvcc, flags, children: Children | None) -> dict:
    name = plan.name
    src = project.src_dir / f"{name}.cu"
    write_if_changed(src, plan.source)
    tmp = project.cache_dir / f".tmp-{plan.key[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        cmd = nvcc_command(nvcc.path, project.include_dir.resolve(), src, tmp / "kernel.fatbin", flags)
        t0 = time.monotonic()
        if children is None:
            with Children() as own:
                r = own.run(cmd)
        else:
            r = children.run(cmd)
        secs = time.monotonic() - t0
        text = (r.stdout or "") + (r.stderr or "")
        log_dir = project.build_dir / "logs"
        if r.returncode != 0:
            log_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(log_dir / f"{name}.log", " ".join(cmd) + "\n\n" + text)
            why = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"nvcc exit {r.returncode}: {_first_errors(text)}"
            raise BuildError([(name, f"{why} (full log: {project.rel(log_dir / (name + '.log'))})")])
        if not (tmp / "kernel.fatbin").is_file():
            raise BuildError([(name, "nvcc exited 0 but wrote no fatbin")])
        rep = ptxas.parse(text)
        bad = [b for sym in plan.variant.symbols for b in ptxas.problems(rep, sym)]
        bad = list(dict.fromkeys(bad))  # spill/advisory lines are per file, not per symbol
        if bad:
            log_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(log_dir / f"{name}.log", " ".join(cmd) + "\n\n" + text)
            raise BuildError([(name, "; ".join(bad))])
        report = {
            "name": name, "key": plan.key, "symbols": plan.variant.symbols, "params": plan.variant.params,
            "headers": plan.headers, "command": cmd, "nvcc_version": nvcc.release,
            "compile_seconds": round(secs, 3), "fatbin_sha256": _sha256(tmp / "kernel.fatbin"),
            "ptxas": rep, "ptxas_output": text,
        }
        with open(tmp / "report.json", "w") as f:
            json.dump(report, f, indent=1)
        os.rename(tmp, plan.entry)  # atomic publish of the whole entry (under the key's lock)
        plan.forget()
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(plan: Plan, report: dict) -> dict:
    """The manifest v2 record of a built variant (docs/CONTRACTS.md §5)."""
    v = plan.variant
    funcs = report["ptxas"]["functions"]
    kernels = []
    for k in v.kernels:
        sym = v.symbol(k.role)
        f = funcs.get(sym, {})
        kernels.append({
            "role": k.role, "symbol": sym, "threads": k.threads, "cluster": list(k.cluster),
            "smem_bytes": k.smem_bytes, "registers": f.get("registers", 0),
            "spill_bytes": f.get("spill_store_bytes", 0) + f.get("spill_load_bytes", 0),
            "stack_bytes": f.get("stack_bytes", 0), "tensor_maps": list(k.tensor_maps), "sass": list(k.sass),
            "pdl": bool(k.pdl),
            "params": k.params.layout(),
        })
    return {
        "name": v.name, "key": plan.key, "family": v.family, "params": dict(v.params),
        "dispatch": v.dispatch, "default": bool(v.default), "fatbin": f"fatbin/{v.name}.fatbin",
        "sha256": None,  # filled in by write_outputs
        "kernels": kernels,
    }


def _previous_entries(project) -> dict:
    """The previous manifest's variant records by name ({} when there is none or it is unreadable)."""
    try:
        data = json.loads(project.manifest_path.read_text())
        if data.get("schema") == MANIFEST_SCHEMA:
            return {e["name"]: e for e in data.get("variants", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _still_intact(project, entry: dict) -> bool:
    try:
        return _sha256(project.build_dir / entry["fatbin"]) == entry["sha256"]
    except (OSError, KeyError, TypeError):
        return False


def write_outputs(project, plans: list[Plan], nvcc: Nvcc, variants=None) -> dict:
    """Publish build/fatbin/*.fatbin and build/manifest.json (under build/.manifest.lock).

    Every configured variant (``variants``, default: the plans' variants) is listed with its current
    cache entry when that is intact, else with the record the previous manifest had for it when
    that fatbin is still intact (``"stale": true``). Fatbins of variants no longer configured go."""
    variants = list(variants) if variants is not None else [p.variant for p in plans]
    by_name = {p.name: p for p in plans}
    project.build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(project.build_dir / ".manifest.lock")):
        previous = _previous_entries(project)
        entries, keep = [], set()
        for v in sorted(variants, key=lambda v: v.name):
            p = by_name.get(v.name)
            if p is not None and p.cached():
                report = json.loads((p.entry / "report.json").read_text())
                dst = project.fatbin_dir / f"{p.name}.fatbin"
                data = (p.entry / "kernel.fatbin").read_bytes()
                if not dst.is_file() or dst.read_bytes() != data:
                    atomic_write_bytes(dst, data)
                e = manifest_entry(p, report)
                e["sha256"] = report["fatbin_sha256"]
            elif v.name in previous and _still_intact(project, previous[v.name]):
                e = {**previous[v.name], "default": bool(v.default), "stale": True}
            else:
                continue
            entries.append(e)
            keep.add(Path(e["fatbin"]).name)
        if project.fatbin_dir.is_dir():  # fatbins of variants no longer configured or out of date
            for f in project.fatbin_dir.glob("*.fatbin"):
                if f.name not in keep:
                    f.unlink(missing_ok=True)
        manifest = {"schema": MANIFEST_SCHEMA, "arch": ARCH,
                    "nvcc": {"path": nvcc.path, "version": nvcc.release}, "variants": entries}
        atomic_write_text(project.manifest_path, json.dumps(manifest, indent=1) + "\n")
    return manifest


def build(project, selected, all_variants=None, jobs: int | None = None, log=print,
          nvcc: Nvcc | None = None, flags=NVCC_FLAGS) -> BuildResult:
    """Build ``selected`` variants (cached ones cost nothing), then rewrite the manifest over
    ``all_variants`` (default: ``selected``; see :func:`write_outputs`). Failures (render,
    compile, ptxas checks) are collected in the result, not raised; an interrupt kills the
    running nvcc process groups and leaves the previous outputs in place."""
    t_start = time.monotonic()
    nvcc = nvcc or find_nvcc()
    log(f"nvcc: {nvcc.path} (release {nvcc.release}; found via {nvcc.source})")
    all_variants = list(all_variants) if all_variants is not None else list(selected)
    names = {v.name for v in selected}
    for v in selected:
        if v.name not in {w.name for w in all_variants}:
            all_variants.append(v)
    plans, render_errors = plan_variants(project, all_variants, nvcc, flags)
    res = BuildResult(nvcc=nvcc, selected=sorted(names))
    for n, m in render_errors:
        if n in names:
            res.failed.append((n, m))
            log(f"render FAIL  {n}: {m}")
    mine = [p for p in plans if p.name in names]
    for p in mine:  # keep build/src in step for people reading the generated code
        write_if_changed(project.src_dir / f"{p.name}.cu", p.source)
    for p in mine:
        drop_corrupt(p, log)
    todo = [p for p in mine if not p.cached()]
    res.cached = sorted(p.name for p in mine if p.cached())
    clean_stale_temps(project.cache_dir)
    total = len(names)
    jobs = max(1, jobs or default_jobs())
    unrendered = f", {len(res.failed)} failed to render" if res.failed else ""
    if todo:
        log(f"compiling {len(todo)} of {total} variants ({len(res.cached)} cached{unrendered}), "
            f"{min(jobs, len(todo))} parallel jobs")
    elif res.failed:
        log(f"{len(res.failed)} of {total} variants failed to render, {len(res.cached)} cached")
    else:
        log(f"all {total} variants cached; nothing to compile")
    done = total - len(todo)
    lock = threading.Lock()

    if todo:
        with Children() as children, cf.ThreadPoolExecutor(max_workers=min(jobs, len(todo))) as ex:
            futs = {ex.submit(compile_plan, p, project, nvcc, flags, children, log): p for p in todo}
            try:
                for fut in cf.as_completed(futs):
                    p = futs[fut]
                    with lock:
                        done += 1
                        el = time.monotonic() - t_start
                        try:
                            rep = fut.result()
                            if rep is None:
                                res.cached.append(p.name)
                                log(f"[{done}/{total}] {el:6.1f}s  ok    {p.name}  (built by a concurrent build)")
                                continue
                            res.compiled.append(p.name)
                            pt = rep["ptxas"]
                            log(f"[{done}/{total}] {el:6.1f}s  ok    {p.name}  ({rep['compile_seconds']:.1f}s, "
                                f"{pt['registers']} regs, {pt['spill_bytes']} spill bytes)")
                        except BuildError as e:
                            res.failed += e.failures
                            log(f"[{done}/{total}] {el:6.1f}s  FAIL  {p.name}: {e.failures[0][1]}")
                        except Exception as e:  # noqa: BLE001 -- report, keep building the rest
                            res.failed.append((p.name, f"{type(e).__name__}: {e}"))
                            log(f"[{done}/{total}] {el:6.1f}s  FAIL  {p.name}: {type(e).__name__}: {e}")
            except BaseException:
                for f in futs:
                    f.cancel()
                children.kill_all()
                raise
    res.compiled.sort()
    res.cached.sort()
    res.manifest = write_outputs(project, plans, nvcc, all_variants)
    res.manifest_path = project.manifest_path
    res.seconds = time.monotonic() - t_start
    stale = [e["name"] for e in res.manifest["variants"] if e.get("stale")]
    if stale:
        log(f"kept the previous build of {len(stale)} variant(s) whose current build does not exist: "
            f"{', '.join(stale[:6])}{' ...' if len(stale) > 6 else ''}")
    log(f"manifest: {project.rel(project.manifest_path)} ({len(res.manifest['variants'])} variants"
        f"{f', {len(stale)} stale' if stale else ''}); "
        f"compiled {len(res.compiled)}, cached {len(res.cached)}, failed {len(res.failed)} in {res.seconds:.1f}s")
    return res


def built_names(project, variants, nvcc: Nvcc | None = None) -> set[str]:
    """Names of variants whose current cache entry exists (up to date with configs, templates,
    headers and nvcc). Without nvcc, falls back to the manifest's list."""
    if nvcc is None:
        try:
            data = json.loads(project.manifest_path.read_text())
            return {e["name"] for e in data.get("variants", [])}
        except (OSError, ValueError):
            return set()
    plans, _ = plan_variants(project, variants, nvcc)
    return {p.name for p in plans if p.cached()}
