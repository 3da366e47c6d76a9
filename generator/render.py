"""Rendering a variant's CUDA source with Jinja2 (StrictUndefined: a missing variable is an error)."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import jinja2

from . import abi
from .errors import BuildError


@functools.lru_cache(maxsize=8)
def _env(templates_dir: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_vars(variant) -> dict:
    """What a template sees (docs/CONTRACTS.md §2): the canonical params, the family's resources
    (``smem`` layout included), ``name``, ``kernels`` (per role: symbol, threads, smem_bytes,
    cluster, params_struct) and ``params_decls`` (the params structs as C++ with layout asserts)."""
    kernels = {k.role: {"symbol": variant.symbol(k.role), "threads": k.threads, "smem_bytes": k.smem_bytes,
                        "cluster": list(k.cluster), "params_struct": k.params.name} for k in variant.kernels}
    return {**variant.params, **variant.resources, "name": variant.name, "kernels": kernels,
            "params_decls": abi.render_decls(k.params for k in variant.kernels)}


# Put first in the source of a variant with a kernel launched in clusters: its WGMMA descriptors
# mask the CTA rank off the shared addresses (templates/include/flashgen/ptx.cuh make_smem_desc).
CLUSTER_DEFINE = "#define FLASHGEN_CLUSTER_LAUNCH 1  // a kernel of this variant launches in clusters\n"


def render(variant, templates_dir: Path) -> str:
    """The CUDA source of ``variant`` from templates/<family>.cu.j2 (BuildError naming the variant),
    after CLUSTER_DEFINE when one of its kernels has a cluster shape other than (1, 1, 1)."""
    tname = f"{variant.family}.cu.j2"
    clustered = any(tuple(k.cluster) != (1, 1, 1) for k in variant.kernels)
    try:
        src = _env(str(templates_dir)).get_template(tname).render(**template_vars(variant))
        return CLUSTER_DEFINE + src if clustered else src
    except jinja2.TemplateNotFound:
        raise BuildError([(variant.name, f"template {Path(templates_dir) / tname} not found")]) from None
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise BuildError([(variant.name, f"rendering {tname}{where}: {type(e).__name__}: {e}")]) from None


_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def local_headers(source: str, include_dir: Path, source_dir: Path | None = None) -> list[Path]:
    """Every project header the source includes, directly or not (sorted, resolved).

    Follows ``#include "..."`` (relative to the includer, then include_dir) and ``#include <...>``
    (include_dir only). Headers outside include_dir (CUDA's) are covered by the nvcc version in
    the cache key. Conditional includes are followed too: the list over-approximates, never misses."""
    include_dir = Path(include_dir).resolve()
    found: dict[Path, None] = {}
    todo = [(source, Path(source_dir).resolve() if source_dir else None)]
    while todo:
        text, here = todo.pop()
        for kind, name in _INCLUDE.findall(text):
            cands = ([here / name] if (kind == '"' and here is not None) else []) + [include_dir / name]
            for c in cands:
                if c.is_file():
                    c = c.resolve()
                    if c not in found:
                        found[c] = None
                        todo.append((c.read_text(errors="replace"), c.parent))
                    break
    return sorted(found)
