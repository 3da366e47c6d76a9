"""Reading build/manifest.json: the runtime's only source of truth about built variants.

The runtime never parses variant names; everything it needs (parameters, dispatch key, fatbin
path, and per kernel: symbol, threads, cluster, shared memory, tensor-map arguments and the params
struct's layout) is recorded explicitly by the generator (docs/CONTRACTS.md §5). Nothing here
knows a family.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .generator.families import full_key

MANIFEST_NAME = "manifest.json"
SUPPORTED_SCHEMA = 2


class ManifestError(RuntimeError):
    """The manifest is missing, unreadable, or disagrees with the fatbin it names."""


@dataclass(frozen=True)
class Kernel:
    """One kernel of a variant (a manifest v2 ``kernels`` record)."""

    role: str
    symbol: str
    threads: int
    cluster: tuple
    smem_bytes: int
    tensor_maps: tuple
    params: dict = field(hash=False, compare=False)  # {"struct", "size", "fields": [[name, type, offset]]}
    registers: int = 0
    spill_bytes: int = 0
    pdl: bool = False  # launched as a programmatic dependent of the previous kernel (generator KernelSpec.pdl)


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant, as recorded in the manifest."""

    name: str
    family: str
    params: dict[str, Any] = field(hash=False, compare=False)
    dispatch: dict[str, Any] = field(hash=False, compare=False)
    kernels: tuple = field(hash=False, compare=False)  # of Kernel
    fatbin: Path = Path()
    sha256: str = ""
    default: bool = False

    def __post_init__(self):
        # a record may leave out dispatch keys with a default (fwd's pack_gqa, added later): filled in
        object.__setattr__(self, "dispatch", full_key(self.family, self.dispatch))

    @property
    def key(self) -> tuple:
        """(family, dispatch items): what a call must match exactly."""
        return (self.family, *sorted(self.dispatch.items()))

    def kernel(self, role: str) -> Kernel:
        for k in self.kernels:
            if k.role == role:
                return k
        raise KeyError(f"variant {self.name} has no kernel {role!r} (has {', '.join(k.role for k in self.kernels)})")


@dataclass(frozen=True)
class Manifest:
    path: Path
    variants: tuple[Variant, ...]
    nvcc_version: str = ""

    def by_key(self) -> dict[tuple, tuple[Variant, ...]]:
        """The variants grouped by :attr:`Variant.key`, in manifest order. Built once per Manifest (load_manifest
        keeps one per file version) and shared: read it, do not change it."""
        return self._by_key

    @functools.cached_property
    def _by_key(self) -> dict[tuple, tuple[Variant, ...]]:
        out: dict[tuple, list[Variant]] = {}
        for v in self.variants:
            out.setdefault(v.key, []).append(v)
        return {k: tuple(vs) for k, vs in out.items()}


def _is_checkout(path: Path) -> bool:
    return (path / "configs").is_dir() and (path / "templates").is_dir()


def candidate_paths(with_sources: bool = False) -> list:
    """Where the runtime looks for the manifest, in order (the CLI's ``info`` and ``build`` use
    this same list, so both always agree on which manifest is in use):

    1. ``$FLASHGEN_KERNEL_DIR/manifest.json`` -- an explicit kernel folder;
    2. ``$FLASHGEN_BUILD_DIR/manifest.json`` -- where ``flashgen build`` writes when that is set;
    3. ``$FLASHGEN_ROOT/build/manifest.json`` -- the build folder of the project the CLI uses;
    4. the installed package's ``_kernels/manifest.json`` -- what a wheel or ``pip install .`` ships;
    5. ``<checkout>/build/manifest.json`` -- an editable install or a source tree (only when the
       folder above this package is a checkout, with configs/ and templates/).

    Paths only, or (path, where it comes from) pairs when ``with_sources``."""
    out = []
    for var, sub in (("FLASHGEN_KERNEL_DIR", ""), ("FLASHGEN_BUILD_DIR", ""), ("FLASHGEN_ROOT", "build")):
        env = os.environ.get(var)
        if env:
            out.append((Path(env).resolve() / sub / MANIFEST_NAME, f"${var}"))
    here = Path(__file__).resolve().parent
    out.append((here / "_kernels" / MANIFEST_NAME, "installed package"))
    if _is_checkout(here.parent):
        out.append((here.parent / "build" / MANIFEST_NAME, f"checkout {here.parent}"))
    return out if with_sources else [p for p, _ in out]


def find_manifest(with_source: bool = False):
    """The first existing manifest among :func:`candidate_paths` (with where it comes from when
    ``with_source``); ManifestError naming every place tried if there is none."""
    cands = candidate_paths(with_sources=True)
    for p, src in cands:
        if p.is_file():
            return (p, src) if with_source else p
    tried = ", ".join(f"{p} ({src})" for p, src in cands)
    raise ManifestError(
        f"flashgen: no kernel manifest found (looked at {tried}). Build kernels with `make build` "
        "or `flashgen build` in a checkout, install a flashgen wheel (`pip install .` compiles the "
        "default kernels), or point FLASHGEN_KERNEL_DIR at a folder holding manifest.json."
    )


def _kernel(rec: dict) -> Kernel:
    return Kernel(role=rec["role"], symbol=rec["symbol"], threads=int(rec["threads"]),
                  cluster=tuple(int(c) for c in rec["cluster"]), smem_bytes=int(rec["smem_bytes"]),
                  tensor_maps=tuple(rec["tensor_maps"]), params=dict(rec["params"]),
                  registers=int(rec.get("registers", 0)), spill_bytes=int(rec.get("spill_bytes", 0)),
                  pdl=bool(rec.get("pdl", False)))


def parse_manifest(path: Path) -> Manifest:
    """Parse and check one manifest file (schema version, required fields). Raises ManifestError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"flashgen: cannot read manifest {path}: {e}") from e
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SUPPORTED_SCHEMA:
        raise ManifestError(
            f"flashgen: manifest {path} has schema {schema!r}, this flashgen reads schema {SUPPORTED_SCHEMA}: "
            "rebuild the kernels with this version (`flashgen build`, or `make build` in a checkout), "
            "or install a flashgen wheel built with it"
        )
    base = Path(path).parent
    variants = []
    for rec in data.get("variants", []):
        try:
            variants.append(
                Variant(
                    name=rec["name"],
                    family=rec["family"],
                    params=dict(rec["params"]),
                    dispatch=dict(rec["dispatch"]),
                    kernels=tuple(_kernel(k) for k in rec["kernels"]),
                    fatbin=base / rec["fatbin"],
                    sha256=rec["sha256"],
                    default=bool(rec.get("default", False)),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"flashgen: malformed variant record in {path}: {e!r}") from e
    return Manifest(path=Path(path), variants=tuple(variants), nvcc_version=str(data.get("nvcc", {}).get("version", "")))


_cache: dict[Path, tuple[float, Manifest]] = {}


def load_manifest(path: Path | None = None) -> Manifest:
    """Load (and cache, re-reading when the file changes on disk) the active manifest."""
    path = Path(path) if path else find_manifest()
    stat = path.stat()
    stamp = (stat.st_mtime_ns, stat.st_size)
    hit = _cache.get(path)
    if hit and hit[0] == stamp:
        return hit[1]
    m = parse_manifest(path)
    _cache[path] = (stamp, m)
    return m


@functools.lru_cache(maxsize=None)
def read_fatbin(path: Path, sha256: str) -> bytes:
    """Read a fatbin and verify its sha256 against the manifest (a stale or corrupt file is an error)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ManifestError(f"flashgen: cannot read fatbin {path}: {e}") from e
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ManifestError(f"flashgen: fatbin {path} has sha256 {digest[:12]}..., manifest says {sha256[:12]}...; rebuild")
    return data
