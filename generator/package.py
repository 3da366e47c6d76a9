"""The kernels a package ships: what the build backend (setup.py) runs for `pip install .`,
`pip wheel .`, `python -m build` and `make wheel`.

:func:`package_kernels` builds the chosen variant set with the normal build (same cache, so a
checkout that ran `make build` compiles nothing again) and writes ``<dest>/manifest.json`` and
``<dest>/fatbin/*.fatbin`` with exactly that set, every variant freshly built from the sources
being packaged (never a stale one), and the tune tables of configs/tune/ as ``<dest>/tune/``
(flashgen/tuning.py reads them there). Any failure raises: a package without its kernels is never
made.

The set comes from ``$FLASHGEN_VARIANTS``: ``default`` (or unset) for the default build set, the
same as `flashgen build` (the configs marked ``default_build: true`` plus every tile the shipped
tune tables name: generator/config.py); ``all`` for every configured variant (``make
build-all``); anything else is a comma-separated list of globs over every configured variant (as
`flashgen build --all --filter`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .errors import BuildError

ENV = "FLASHGEN_VARIANTS"


def chosen_variants(variants, spec: str | None):
    """The variants ``spec`` (FLASHGEN_VARIANTS' value) names; BuildError when it names none."""
    from .config import select

    spec = (spec or "default").strip()
    if spec == "default":
        chosen = select(variants, None, False)
    elif spec == "all":
        chosen = select(variants, None, True)
    else:
        chosen = select(variants, spec, True)
    if not chosen:
        raise BuildError([("package", f"{ENV}={spec!r} selects no variant; use 'default', 'all' or "
                                      "name globs that match configured variants (`flashgen list --all`)")])
    return chosen


def package_kernels(root: Path, dest: Path, spec: str | None = None, log=print) -> list[str]:
    """Build the set ``spec`` (default: ``$FLASHGEN_VARIANTS``) of the project at ``root`` and
    write its manifest and fatbins under ``dest``. Returns the variant names packaged.

    Raises ConfigError for invalid configs, ToolchainError without nvcc, BuildError naming every
    variant that failed to render or compile."""
    from .build import build
    from .config import load_variants
    from .project import Project
    from .tunetable import table_files

    project = Project(Path(root).resolve())
    variants = load_variants(project, warn=lambda msg: log(f"flashgen: warning: {msg}"))
    chosen = chosen_variants(variants, spec if spec is not None else os.environ.get(ENV))
    log(f"flashgen: packaging {len(chosen)} kernel variants ({ENV}={os.environ.get(ENV, 'default')})")
    res = build(project, chosen, all_variants=variants, log=log)
    if res.failed:
        raise BuildError(res.failed)
    names = {v.name for v in chosen}
    entries = [e for e in res.manifest["variants"] if e["name"] in names and not e.get("stale")]
    missing = names - {e["name"] for e in entries}
    if missing:  # cannot happen after a build without failures; never package less than asked
        raise BuildError([(n, "not built") for n in sorted(missing)])
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "fatbin").mkdir(parents=True)
    for e in entries:
        shutil.copyfile(project.build_dir / e["fatbin"], dest / e["fatbin"])
    manifest = {**res.manifest, "variants": entries}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    tables = table_files(project.configs_dir)  # the tables whose tiles the default set has (config.py)
    if tables:  # the runtime reads <kernel dir>/tune/<gpu-slug>.yaml (flashgen/tuning.py)
        (dest / "tune").mkdir()
        for t in tables:
            shutil.copyfile(t, dest / "tune" / t.name)
        tuned = sum(bool(v.tuned) for v in chosen)
        log(f"flashgen: shipping {len(tables)} tune table(s): {', '.join(t.name for t in tables)} ({tuned} of the "
            "packaged variants are there as tiles they name; a tile serves only where this package has it)")
    return sorted(names)
