"""Reading build/manifest.json: the runtime's only source of truth about built variants.

The runtime never parses variant names; everything it needs (parameters, symbol, fatbin path,
threads, shared memory) is recorded explicitly by the generator (docs/CONTRACTS.md §3).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
SUPPORTED_SCHEMA = 1


class ManifestError(RuntimeError):
    """The manifest is missing, unreadable, or disagrees with the fatbin it names."""


@dataclass(frozen=True)
class Variant:
    """One compiled kernel variant, as recorded in the manifest."""

    name: str
    params: dict[str, Any] = field(hash=False, compare=False)
    symbol: str = ""
    fatbin: Path = Path()
    sha256: str = ""
    threads: int = 0
    smem_bytes: int = 0
    default: bool = False
    registers: int = 0
    spill_bytes: int = 0

    @property
    def key(self) -> tuple:
        """(family, dtype, head_dim, head_dim_v, causal): what a call must match exactly."""
        p = self.params
        return (p["family"], p["dtype"], p["head_dim"], p.get("head_dim_v", p["head_dim"]), bool(p["causal"]))


@dataclass(frozen=True)
class Manifest:
    path: Path
    variants: tuple[Variant, ...]
    nvcc_version: str = ""

    def by_key(self) -> dict[tuple, list[Variant]]:
        out: dict[tuple, list[Variant]] = {}
        for v in self.variants:
            out.setdefault(v.key, []).append(v)
        return out


def candidate_paths() -> list[Path]:
    """Where the manifest is looked for, in order: $FLASHGEN_KERNEL_DIR, the installed package's
    _kernels/ (what the wheel ships), then <repo>/build/ (editable installs and source trees)."""
    paths = []
    env = os.environ.get("FLASHGEN_KERNEL_DIR")
    if env:
        paths.append(Path(env) / MANIFEST_NAME)
    here = Path(__file__).resolve().parent
    paths.append(here / "_kernels" / MANIFEST_NAME)
    paths.append(here.parent / "build" / MANIFEST_NAME)
    return paths


def find_manifest() -> Path:
    """The first existing manifest among candidate_paths(); ManifestError naming them all if none."""
    for p in candidate_paths():
        if p.is_file():
            return p
    tried = ", ".join(str(p) for p in candidate_paths())
    raise ManifestError(
        f"flashgen: no kernel manifest found (looked at {tried}). Build kernels with `make build` "
        "or `flashgen build`, or point FLASHGEN_KERNEL_DIR at a folder holding manifest.json."
    )


def parse_manifest(path: Path) -> Manifest:
    """Parse and check one manifest file (schema version, required fields). Raises ManifestError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"flashgen: cannot read manifest {path}: {e}") from e
    if data.get("schema") != SUPPORTED_SCHEMA:
        raise ManifestError(f"flashgen: manifest {path} has schema {data.get('schema')!r}, expected {SUPPORTED_SCHEMA}")
    base = Path(path).parent
    variants = []
    for rec in data.get("variants", []):
        try:
            variants.append(
                Variant(
                    name=rec["name"],
                    params=dict(rec["params"]),
                    symbol=rec["symbol"],
                    fatbin=base / rec["fatbin"],
                    sha256=rec["sha256"],
                    threads=int(rec["threads"]),
                    smem_bytes=int(rec["smem_bytes"]),
                    default=bool(rec.get("default", False)),
                    registers=int(rec.get("registers", 0)),
                    spill_bytes=int(rec.get("spill_bytes", 0)),
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
