"""The ``flashgen`` command line (click): list, build, add-variant, info, bench, tune.

Exit status: 0 ok; 1 a variant failed to build; 2 invalid configs or arguments (one line per
problem, naming file, key, value and what is allowed); 3 no usable toolchain.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import click

EXIT_BUILD_FAILED = 1
EXIT_CONFIG = 2
EXIT_TOOLCHAIN = 3


def _gen():
    """Import the generator lazily (keeps `flashgen --help` and `flashgen bench` light)."""
    from . import generator

    return generator


def _fail_config(err) -> None:
    for line in err.problems:
        click.echo(f"error: {line}", err=True)
    n = len(err.problems)
    click.echo(f"flashgen: {n} config problem{'s' if n != 1 else ''}; nothing was built", err=True)
    sys.exit(EXIT_CONFIG)


def _fail_toolchain(err) -> None:
    click.echo(f"error: {err}", err=True)
    sys.exit(EXIT_TOOLCHAIN)


_warned: set = set()  # tune-table warnings printed by this command (add-variant loads twice)


def _warn_table(message: str) -> None:
    """A tune table's problem (generator/config.py, "The default build set"): a warning, never an exit."""
    if message not in _warned:
        _warned.add(message)
        click.echo(f"warning: {message}", err=True)


def _load(project=None, overrides=None):
    g = _gen()
    from .generator.config import load_variants
    from .generator.project import Project

    try:
        project = project or Project.locate()
        return project, load_variants(project, overrides, warn=_warn_table)
    except g.ConfigError as e:
        _fail_config(e)


def _installed_manifest():
    """(path, data, where it comes from) of the manifest the runtime would load, or (None, None, None).

    The same lookup as the runtime's (flashgen.manifest.candidate_paths), so `info`, `list` and the
    runtime always name the same file."""
    from .manifest import ManifestError, find_manifest

    try:
        path, source = find_manifest(with_source=True)
        return path, json.loads(path.read_text()), source
    except (ManifestError, OSError, ValueError):
        return None, None, None


def _say_where_runtime_reads(project) -> None:
    """After a build: say so when the runtime will load another manifest than the one just written."""
    from .manifest import ManifestError, find_manifest

    try:
        path, source = find_manifest(with_source=True)
    except ManifestError:
        path, source = None, None
    if path is None or path.resolve() != project.manifest_path.resolve():
        where = f"{path} ({source})" if path else "no manifest"
        click.echo(f"note: the runtime loads {where}, not {project.manifest_path}; to use this build, "
                   f"set FLASHGEN_KERNEL_DIR={project.build_dir}", err=True)


def _run_build(project, selected, variants, jobs) -> None:
    g = _gen()
    from .generator.build import build

    if not selected:
        click.echo("no variants selected (check --filter; non-default sets need --all)", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        res = build(project, selected, all_variants=variants, jobs=jobs, log=lambda s: click.echo(s))
    except g.ToolchainError as e:
        _fail_toolchain(e)
    if res.failed:
        click.echo(f"flashgen: {len(res.failed)} variant(s) failed:", err=True)
        for name, msg in res.failed:
            click.echo(f"  {name}: {msg}", err=True)
        _say_where_runtime_reads(project)
        sys.exit(EXIT_BUILD_FAILED)
    _say_where_runtime_reads(project)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flashgen", message="flashgen %(version)s")
def main():
    """flashgen: FlashAttention-3 forward kernels for Hopper, built ahead of time.

    configs/*.yaml -> templates/*.cu.j2 -> nvcc fatbins -> build/manifest.json -> runtime.
    The project root is $FLASHGEN_ROOT, else the nearest folder above the current one that has
    configs/ and templates/, else the checkout this package was installed from."""
    _warned.clear()  # each command prints each tune-table warning once


@main.command("list")
@click.option("--filter", "pattern", metavar="GLOB", help="Only names matching this glob (comma-separated globs; no wildcard = substring).")
@click.option("--all", "all_", is_flag=True, help="Every configured variant, not only the default build set.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(pattern, all_, as_json):
    """List variants from configs/, built or not.

    BUILT is `yes` when build/ holds a fatbin compiled from the current configs, templates,
    headers and nvcc; `stale` when the manifest has an older build; `no` otherwise. DEFAULT `*`
    marks the tile table's choice (what the runtime dispatches to). `(tuned: GPU)` marks a variant
    that is in the default set because that GPU's tune table (configs/tune/) names its tile. Outside
    a checkout (an installed wheel) the installed manifest's variants are listed."""
    g = _gen()
    from .generator.build import built_names
    from .generator.config import select
    from .generator.project import find_root
    from .generator.toolchain import find_nvcc

    if find_root() is None:
        path, data, _ = _installed_manifest()
        if data is None:
            click.echo("no flashgen project here and no installed kernel manifest", err=True)
            sys.exit(EXIT_CONFIG)
        rows = [{"name": e["name"], "default": bool(e.get("default")), "built": "yes", "params": e["params"]}
                for e in data.get("variants", [])]
        if pattern:
            import fnmatch

            pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in pattern.split(",") if p]
            rows = [r for r in rows if any(fnmatch.fnmatchcase(r["name"], p) for p in pats)]
        source = f"manifest {path}"
    else:
        project, variants = _load()
        chosen = select(variants, pattern, all_)
        try:
            current = built_names(project, variants, find_nvcc())
        except g.ToolchainError:
            current = None
        in_manifest = built_names(project, variants, None)
        rows = []
        for v in chosen:
            if current is None:
                built = "yes" if v.name in in_manifest else "no"
            else:
                built = "yes" if v.name in current else ("stale" if v.name in in_manifest else "no")
            rows.append({"name": v.name, "default": v.default, "built": built, "params": v.params,
                         "default_build": v.default_build, "tuned": v.tuned, "sources": v.sources})
        source = f"configs in {project.root}"
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    width = max([len(r["name"]) for r in rows] + [4])
    click.echo(f"{'NAME':<{width}}  DEFAULT  BUILT")
    for r in rows:
        why = f"  (tuned: {', '.join(r['tuned'])})" if r.get("tuned") else ""
        click.echo(f"{r['name']:<{width}}  {'*' if r['default'] else ' ':^7}  {r['built']:<5}{why}".rstrip())
    nb = sum(r["built"] == "yes" for r in rows)
    nt = sum(bool(r.get("tuned")) for r in rows)
    tables = sorted({t for r in rows for t in r.get("tuned", [])})
    click.echo(f"{len(rows)} variants ({nb} built) from {source}"
               + (f"; {nt} of them in the default set as tuned tiles ({', '.join(tables)})" if nt else ""))


@main.command("build")
@click.option("--filter", "pattern", metavar="GLOB", help="Only names matching this glob (comma-separated; no wildcard = substring).")
@click.option("--all", "all_", is_flag=True, help="Every configured variant (e.g. the ablation set), not only the default set.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel nvcc jobs (default: min(cores, free memory / 1.5 GB)).")
def build_cmd(pattern, all_, jobs):
    """Validate configs, render and compile variants, write build/manifest.json.

    Compiles only what the content-addressed cache (build/cache) lacks; a rebuild with nothing
    changed compiles nothing. Fails (exit 1) on compiler errors, register spills, or ptxas
    advisories that mean a slow kernel (C7508, C7511/C7512/C7515/C7517/C7519 and any
    other "wgmma serialized" advisory: generator/ptxas.py)."""
    from .generator.config import select

    project, variants = _load()
    selected = select(variants, pattern, all_)
    if pattern and not selected and not all_ and select(variants, pattern, True):
        click.echo(f"--filter {pattern!r} matches only variants outside the default set; add --all", err=True)
        sys.exit(EXIT_CONFIG)
    tuned = [v for v in selected if v.tuned]
    if tuned and not all_:
        tables = sorted({t for v in tuned for t in v.tuned})
        click.echo(f"default set: {len(selected)} variants, {len(tuned)} of them tiles named by tune tables "
                   f"({', '.join(tables)}; configs/tune/)")
    _run_build(project, selected, variants, jobs)


def _append_point_text(text: str, point: str) -> str | None:
    """Append ``- {...}`` to a trailing block-style ``extra:`` list, keeping comments and the
    list's indentation. None when the file's layout does not allow a plain append."""
    lines = text.rstrip("\n").splitlines()
    idx = [i for i, ln in enumerate(lines) if ln.rstrip() == "extra:"]
    if len(idx) != 1:
        return None
    indent = None
    for ln in lines[idx[0] + 1:]:  # everything after must belong to the list (or be comments)
        s = ln.strip()
        if not s or s.startswith("#"):
            continue
        if not ln.startswith((" ", "\t", "-")):
            return None
        if indent is None and s.startswith("- "):
            indent = ln[: len(ln) - len(ln.lstrip())]
    if indent is None:
        return None
    return "\n".join(lines) + "\n" + f"{indent}- {point}" + "\n"


def _add_variant(family, point: dict, config_path: str, do_build: bool, jobs) -> None:
    """Validate ``point`` with every config file, append it to the config's `extra:`, build it."""
    import yaml

    g = _gen()
    from .generator.config import parse_yaml
    from .generator.fsutil import atomic_write_text
    from .generator.naming import canonical_params, variant_name
    from .generator.project import Project

    try:
        project = Project.locate()
    except g.ConfigError as e:
        _fail_config(e)
    path = Path(config_path)
    if not path.is_absolute():
        path = project.root / path
    label = project.rel(path)
    if path.resolve().parent != project.configs_dir.resolve() or path.suffix not in (".yaml", ".yml"):
        _fail_config(g.ConfigError([
            f"--config {config_path}: the build reads only {project.rel(project.configs_dir)}/*.yaml, so a point "
            f"added there would never be built; pass a .yaml file directly in {project.rel(project.configs_dir)}/ "
            f"(default: configs/{family.name}_extra.yaml)"]))
    if path.exists():
        old_text = path.read_text()
        problems = []
        data = parse_yaml(old_text, label, problems)
        if problems:
            _fail_config(g.ConfigError(problems))
        if not isinstance(data, dict):
            _fail_config(g.ConfigError([f"{label}: not a mapping; cannot add to its extra: list"]))
        if data.get("family") != family.name:
            _fail_config(g.ConfigError([f"{label}: family is {data.get('family')!r}, not {family.name!r}; "
                                        f"pass --config with a {family.name} config file"]))
    else:
        old_text = None
        data = {"family": family.name, "description": "variants added with `flashgen add-variant`",
                "default_build": True, "extra": []}
    new = copy.deepcopy(data)
    extra = new.get("extra") or []
    if not isinstance(extra, list):
        _fail_config(g.ConfigError([f"{label}: extra: not a list; cannot append"]))
    full = family.derive({"family": family.name, **family.knob_defaults(), **point})
    name = variant_name(canonical_params(full))
    _, existing = _load(project)  # exits 2 on any problem in the files as they are
    already = [v for v in existing if v.name == name]
    if not already:
        extra.append(point)
    new["extra"] = extra
    project, variants = _load(project, overrides={path: new})  # exits 2 on any problem
    target = [v for v in variants if v.name == name]
    if not target:  # e.g. dropped by the file's exclude rules
        _fail_config(g.ConfigError([f"{label}: the new point {name} does not produce a variant (exclude rule?)"]))
    if already:
        click.echo(f"{label}: not added: {name} is already configured ({'; '.join(already[0].sources)})")
    else:
        flow = yaml.safe_dump(point, default_flow_style=True, sort_keys=False, width=1 << 16).strip()
        if old_text is None:
            text = ("# Variants added by `flashgen add-variant` (schema: generator/config.py).\n"
                    f"family: {family.name}\ndescription: variants added with `flashgen add-variant`\n"
                    "default_build: true\nextra:\n" f"  - {flow}\n")
        elif isinstance(data.get("extra"), list) and data.get("extra"):
            text = _append_point_text(old_text, flow)
        else:
            text = None
        if text is None or parse_yaml(text, label, []) != new:  # odd layout: rewrite (comments lost)
            text = yaml.safe_dump(new, sort_keys=False, default_flow_style=None, width=1 << 16)
        atomic_write_text(path, text)
        click.echo(f"{label}: added {name}")
    if do_build:
        _run_build(project, target, variants, jobs)
        click.echo(f"built {name}; the runtime can dispatch to it now")


def _family_command(family) -> click.Command:
    """``flashgen add-variant <family> --<key> VALUE ...``: one option per key of the family module."""
    params = []
    for k in family.keys:
        flag = "--" + k.name.replace("_", "-")
        what = k.doc or k.name
        if k.allowed is not None:
            what += f" ({', '.join(map(str, k.allowed))})"
        if k.type is bool:
            default = k.default if k.role == "knob" else False
            params.append(click.Option([f"{flag}/--no-{k.name.replace('_', '-')}", k.name], default=default,
                                       show_default=True, help=what))
        else:
            ty = click.Choice(list(k.allowed)) if (k.type is str and k.allowed) else k.type
            params.append(click.Option([flag, k.name], type=ty, required=k.role == "axis",
                                       default=k.default if k.role == "knob" else None,
                                       show_default=k.role == "knob", help=what + ("" if k.role != "derived" else
                                                                                   " [default: derived]")))
    params += [
        click.Option(["--config", "config_path"], default=f"configs/{family.name}_extra.yaml", show_default=True,
                     help="Config file whose `extra:` list gets the point (created if missing; relative to the project root)."),
        click.Option(["--build/--no-build", "do_build"], default=True, show_default=True,
                     help="Compile it and update the manifest."),
        click.Option(["-j", "--jobs"], type=click.IntRange(min=1), default=None, help="Parallel nvcc jobs."),
    ]

    def run(config_path, do_build, jobs, **values):
        point = {k.name: values[k.name] for k in family.keys if values.get(k.name) is not None}
        derived = family.derive({k: v for k, v in point.items() if family.key(k).role != "derived"})
        for k in family.names("derived"):  # a derived key given at its derived value: keep the point minimal
            if k in point and derived.get(k) == point[k]:
                point.pop(k)
        _add_variant(family, point, config_path, do_build, jobs)

    return click.Command(family.name, params=params, callback=run,
                         help=f"Add one {family.name} variant ({family.doc}): validated with every config file "
                              "before anything is written (invalid: exit 2, file unchanged), appended to the "
                              "config's `extra:` list, built, and listed in the manifest so the runtime can "
                              "dispatch to it at once.")


class _FamilyGroup(click.Group):
    """Subcommands made from the family modules (generator/families), loaded on demand."""

    def list_commands(self, ctx):
        from .generator import families

        return list(families.names())

    def get_command(self, ctx, name):
        from .generator import families

        return _family_command(families.get(name)) if name in families.names() else None


@main.group("add-variant", cls=_FamilyGroup)
def add_variant_cmd():
    """Add one variant of a family to a config file and build it: `flashgen add-variant FAMILY --help`."""


@main.command("info")
def info_cmd():
    """Show the toolchain (nvcc path and version, cuobjdump), the GPU if any, and the manifest."""
    g = _gen()
    from .generator.project import find_root
    from .generator.toolchain import find_cuobjdump, find_nvcc

    try:
        nv = find_nvcc()
        click.echo(f"nvcc:      {nv.path} (release {nv.release}; found via {nv.source})")
    except g.ToolchainError as e:
        click.echo(f"nvcc:      not found ({e})")
    try:
        click.echo(f"cuobjdump: {find_cuobjdump()}")
    except g.ToolchainError:
        click.echo("cuobjdump: not found (pip install nvidia-cuda-cuobjdump)")
    click.echo(f"gpu:       {_gpu_summary()}")
    root = find_root()
    click.echo(f"project:   {root if root else 'none (installed package only)'}")
    path, data, source = _installed_manifest()
    if data is None:
        from .manifest import candidate_paths

        click.echo("manifest:  none found (run `make build` or `flashgen build`); the runtime looks at: "
                   + ", ".join(f"{p} ({s})" for p, s in candidate_paths(with_sources=True)))
        return
    click.echo(f"tune:      {_tune_summary(path)}")
    vs = data.get("variants", [])
    nvm = data.get("nvcc", {})
    click.echo(f"manifest:  {path} (from {source}: the one the runtime loads; schema {data.get('schema')}, "
               f"{data.get('arch')}, nvcc {nvm.get('version', '?')})")
    click.echo(f"variants:  {len(vs)} built, {sum(bool(v.get('default')) for v in vs)} default tiles")
    for v in vs:
        key = " ".join(f"{k}={x}" for k, x in v.get("dispatch", {}).items())
        for k in v.get("kernels", []):
            click.echo(f"  {'*' if v.get('default') else ' '} {v['name']}{' (stale)' if v.get('stale') else ''} [{k.get('role')}]  regs={k.get('registers')} "
                       f"smem={k.get('smem_bytes')} spill={k.get('spill_bytes')} ({v.get('family')}: {key})")


def _tune_summary(manifest_path) -> str:
    """Which tune table the runtime reads for GPU 0 and how many of its tiles are built; never raises."""
    import os

    from . import tuning
    from .manifest import load_manifest

    env = os.environ.get(tuning.ENV)
    where = f"{tuning.ENV}={env}" if env else "looked in " + ", ".join(map(str, tuning.table_dirs(manifest_path)))
    try:
        from .launch import device_name

        gpu = device_name(0)
    except Exception:  # noqa: BLE001 -- no driver or no GPU
        return f"no GPU to choose a table for ({where})"
    try:
        path, _ = tuning.find_table(gpu, manifest_path)
        if path is None:
            return f"no table for {gpu} ({where}): the default tiles serve"
        table, m = tuning.load_table(path), load_manifest(manifest_path)
        named = [(e, r.tile) for e in table.entries.values() for r in e.rows if r.tile is not None]
        built = sum(tuning.variant_with_tile(m, e.family, e.key, tile) is not None for e, tile in named)
        return (f"{path} (measured on {table.gpu}, {table.date}): {len(table.entries)} keys, "
                f"{built} of {len(named)} non-default tiles built (the others fall back to the default)")
    except Exception as e:  # noqa: BLE001 -- an unreadable table is ignored by the runtime too
        return f"table for {gpu} is invalid, the runtime ignores it: {e}"


def _gpu_summary() -> str:
    """GPUs seen by the CUDA driver through cuda-bindings; never raises."""
    try:
        from cuda.bindings import driver as drv
    except Exception as e:  # noqa: BLE001
        return f"unknown (cuda-bindings not importable: {type(e).__name__})"
    try:
        (err,) = drv.cuInit(0)
        if err != drv.CUresult.CUDA_SUCCESS:
            return f"none ({getattr(err, 'name', err)})"
        err, n = drv.cuDeviceGetCount()
        if err != drv.CUresult.CUDA_SUCCESS or n == 0:
            return "none"
        out = []
        for i in range(n):
            _, dev = drv.cuDeviceGet(i)
            _, raw = drv.cuDeviceGetName(256, dev)
            name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            _, major = drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            _, minor = drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            out.append(f"{i}: {name} (sm_{major}{minor})")
        return "; ".join(out)
    except Exception as e:  # noqa: BLE001 -- no driver, no device: report, never crash
        return f"none ({type(e).__name__}: {str(e)[:120]})"


@main.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_cmd(args):
    """Benchmark kernels: forwards every option to flashgen.bench.main.

    Options are the benchmark's own; see them with `flashgen bench -- --help`."""
    try:
        from . import bench
    except ImportError as e:
        click.echo(f"error: flashgen.bench is not available ({e})", err=True)
        sys.exit(EXIT_TOOLCHAIN)
    entry = bench.main
    if isinstance(entry, click.Command):
        entry.main(args=list(args), prog_name="flashgen bench", standalone_mode=True)
        return
    rc = entry(list(args))
    sys.exit(rc if isinstance(rc, int) else 0)


def _register_tune() -> None:
    """`flashgen tune` lives beside the sweep it runs (flashgen/tune.py)."""
    from .tune import command

    main.add_command(command, "tune")


_register_tune()


if __name__ == "__main__":
    main()
