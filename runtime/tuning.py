"""Per-GPU tile tables: which built variant serves a forward call, by dispatch key and seqlen_k.

Without a table, a dispatch key is served by the variant the config's ``tiles:`` row marks
``default``. ``flashgen tune`` (flashgen/tune.py) times every built variant of each key on one
GPU and writes the winners into a table, ``<gpu-slug>.yaml`` (the slug of the GPU's name, e.g.
``nvidia-h100-80gb-hbm3.yaml`` for "NVIDIA H100 80GB HBM3"), which the runtime then reads.

Where the runtime looks, for the name the CUDA driver gives the call's device (cuDeviceGetName,
the string ``torch.cuda.get_device_name`` shows):

1. ``$FLASHGEN_TUNE_TABLE``: ``off`` disables tables; a file is used whatever GPU it was measured
   on; a folder is searched for ``<gpu-slug>.yaml``;
2. ``<kernel folder>/tune/<gpu-slug>.yaml``, beside the manifest in use (a wheel ships the tables
   of configs/tune/ as ``flashgen/_kernels/tune/``);
3. ``configs/tune/<gpu-slug>.yaml`` of the source checkout (``$FLASHGEN_ROOT``, or the checkout
   an editable install runs from): where ``flashgen tune`` writes.

A table is read once per (device, manifest) and process. A table that cannot be read or fails
validation never fails a call: it is ignored with one warning naming the file and the row, and
the default tiles serve. A row naming a tile that is not built also falls back to the default
(silently; ``flashgen info`` counts them). The default build set includes every tile that the
checkout's tables (configs/tune/*.yaml) name (generator/config.py), so this happens with a set
made without them (FLASHGEN_VARIANTS globs), a table newer than the build, or a tile no config
makes (which the generator warns about).

Format (schema 1; YAML; :func:`check_table`, in generator/tunetable.py, is the validation)::

    schema: 1
    gpu: NVIDIA H200                 # as the driver names it; the file name is its slug
    date: '2026-11-22'
    flashgen: {version: 0.1.0, commit: f7aef07}
    protocol: {...}                  # how it was measured (free-form mapping; tune writes it)
    entries:
    - family: fwd
      key: {dtype: bf16, head_dim: 128, head_dim_v: 128, causal: false, local: false, softcap: false}
      default_tile: {block_m: 128, block_n: 128, stages: 2, consumer_wgs: 2, ...}   # when measured
      rows:                          # ascending max_seqlen_k; the first row with seqlen_k <= it serves
      - max_seqlen_k: 1024           # a power of two; null on the last row: no upper bound
        tile: {block_m: 128, block_n: 112, stages: 2, consumer_wgs: 2, ...}   # or: default
        measured: [{seqlen: 512, tflops: 401.2, default_tflops: 380.5}, ...]  # evidence (optional)

A tile is every parameter of a variant outside its dispatch key (for fwd: block_m, block_n,
stages, consumer_wgs, pingpong, overlap, persistent), never a variant name, so tables survive
renames. A call's seqlen_k bucket is ``(seqlen_k - 1).bit_length()`` (seqlen_k in (2^(b-1), 2^b]),
which is why bounds are powers of two: core's plan cache keys on the bucket, so the per-call cost
is one integer operation and the dict lookup the cache already does.
"""
from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

# The format's validation lives in the generator (generator/tunetable.py), which also reads the
# checkout's tables to put their tiles into the default build: one check for both.
from .dispatch import full_key
from .generator.tunetable import (  # noqa: F401 -- re-exported: flashgen.tuning.check_table etc.
    ENTRY_KEYS, MEASURED_KEYS, ROW_KEYS, SCHEMA, TABLE_DIR, TOP_KEYS, check_table, gpu_slug, has_tile, pick_variant)

ENV = "FLASHGEN_TUNE_TABLE"


class TuneTableError(ValueError):
    """A tune table cannot be read or is invalid; the message names the file and every bad row."""


def seqlen_bucket(seqlen_k: int) -> int:
    """b such that 2^(b-1) < seqlen_k <= 2^b (0 for seqlen_k <= 1)."""
    return max(int(seqlen_k) - 1, 0).bit_length()


def tile_of(params: dict, dispatch: dict) -> dict:
    """A variant's tile: its parameters outside the family name and the dispatch key."""
    return {k: v for k, v in params.items() if k != "family" and k not in dispatch}


@dataclass(frozen=True)
class Row:
    max_seqlen_k: int | None  # None: no upper bound
    tile: dict | None  # None: the default tile
    measured: tuple = ()


@dataclass(frozen=True)
class Entry:
    family: str
    key: dict
    default_tile: dict
    rows: tuple  # of Row, ascending max_seqlen_k

    def row_for(self, bucket: int) -> Row | None:
        """The row serving seqlen_k bucket ``bucket`` (None: above the last bound)."""
        for r in self.rows:
            if r.max_seqlen_k is None or seqlen_bucket(r.max_seqlen_k) >= bucket:
                return r
        return None


@dataclass(frozen=True)
class Table:
    path: Path
    gpu: str
    date: str
    flashgen: dict
    protocol: dict
    entries: dict  # (family, *sorted(key.items())) -> Entry, the key as the file gives it

    def entry_for(self, family: str, dispatch: dict):
        """The entry of ``family``'s dispatch key ``dispatch``, or None; a key may leave out the
        dispatch keys at their defaults (e.g. fwd's pack_gqa: False, which tables written before
        it lack): both sides are compared with them filled in (flashgen.dispatch.full_key)."""
        want = full_key(family, dispatch)
        return next((e for e in self.entries.values() if e.family == family and full_key(family, e.key) == want), None)


# ---------------------------------------------------------------------------------- reading
def table_from_data(data, path) -> Table:
    """A validated :class:`Table` from parsed YAML; TuneTableError listing every problem."""
    label = str(path)
    problems = check_table(data, label)
    if problems:
        raise TuneTableError("\n".join(problems))
    entries = {}
    for e in data["entries"]:
        rows = tuple(Row(r["max_seqlen_k"], None if r["tile"] == "default" else dict(r["tile"]),
                         tuple(dict(m) for m in r.get("measured") or ())) for r in e["rows"])
        entry = Entry(e["family"], dict(e["key"]), dict(e["default_tile"]), rows)
        entries[(entry.family, *sorted(entry.key.items()))] = entry
    return Table(Path(path), data["gpu"], str(data["date"]), dict(data["flashgen"]), dict(data["protocol"]), entries)


def load_table(path) -> Table:
    """Read and validate a table file; TuneTableError naming the file (and each bad row)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise TuneTableError(f"{path}: cannot read: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise TuneTableError(f"{path}:{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from e
    return table_from_data(data, path)


def table_text(data: dict) -> str:
    """The YAML text of a table (validated first: TuneTableError if ``data`` is not a valid table)."""
    import yaml

    problems = check_table(data, "table")
    if problems:
        raise TuneTableError("\n".join(problems))
    head = ("# flashgen tune table: per forward dispatch key, the tile serving each seqlen_k range on this GPU.\n"
            "# Written by `flashgen tune`; format and lookup: flashgen/tuning.py (runtime/tuning.py).\n")
    return head + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)


# ---------------------------------------------------------------------------------- lookup
def table_dirs(manifest_path=None) -> list[Path]:
    """Folders searched for ``<gpu-slug>.yaml``, in order (module docstring, 2 and 3)."""
    from .manifest import _is_checkout

    out = []
    if manifest_path is not None:
        out.append(Path(manifest_path).resolve().parent / TABLE_DIR)
    roots = []
    if os.environ.get("FLASHGEN_ROOT"):
        roots.append(Path(os.environ["FLASHGEN_ROOT"]).resolve())
    here = Path(__file__).resolve().parent
    if _is_checkout(here.parent):
        roots.append(here.parent)
    out += [r / "configs" / TABLE_DIR for r in roots]
    return list(dict.fromkeys(out))


def find_table(gpu_name: str, manifest_path=None) -> tuple[Path | None, bool]:
    """(the table file for ``gpu_name``, whether $FLASHGEN_TUNE_TABLE named it); (None, ...) when
    there is none or tables are off. A file named by the variable is returned even if missing (its
    load then fails with a warning)."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() == "off":
        return None, True
    name = f"{gpu_slug(gpu_name)}.yaml"
    if env:
        p = Path(env).expanduser()
        if p.is_dir():
            return (p / name if (p / name).is_file() else None), True
        return p, True
    for d in table_dirs(manifest_path):
        if (d / name).is_file():
            return d / name, False
    return None, False


_tables: dict = {}  # (device, manifest path) -> Table | None
_warned: set = set()
_lock = threading.Lock()


def _warn_once(msg: str) -> None:
    with _lock:
        if msg in _warned:
            return
        _warned.add(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget the tables read and the warnings given (the next resolution reads them again; core's
    plan cache, ``flashgen.core._plans``, keeps the choices already made)."""
    with _lock:
        _tables.clear()
        _warned.clear()


def table_for(device: int, manifest_path=None) -> Table | None:
    """The table serving ``device`` (read once per (device, manifest)); None when there is none,
    tables are off, or it is invalid (then with one warning naming the file and the rows)."""
    ck = (device, str(manifest_path))
    if ck in _tables:
        return _tables[ck]
    from .launch import device_name

    gpu = device_name(device)
    path, explicit = find_table(gpu, manifest_path)
    table = None
    if path is not None:
        try:
            table = load_table(path)
            if not explicit and gpu_slug(table.gpu) != gpu_slug(gpu):
                raise TuneTableError(f"{path}: gpu = {table.gpu!r}, but it was found for this GPU, {gpu!r}")
        except TuneTableError as e:
            table = None
            _warn_once(f"flashgen: ignoring tune table {path} (the default tiles serve instead):\n{e}")
    _tables[ck] = table
    return table


def variant_with_tile(manifest, family: str, dispatch: dict, tile: dict, like=None):
    """The built variant of ``family`` with dispatch key ``dispatch`` and ``tile`` (None if not
    built). Among several (a table written before a knob existed names no value for it): the
    default, then the one that agrees with ``like`` (the key's default variant) on the keys the tile
    leaves out, then the first by name."""
    return pick_variant(manifest.variants, family, full_key(family, dispatch), tile, like)


def tuned_variant(default, bucket: int, device: int, manifest):
    """The variant the table of ``device``'s GPU names for ``default``'s dispatch key at seqlen_k
    bucket ``bucket`` when it is built, else ``default``. Never raises: any failure (a table that
    cannot be read, a driver error naming the GPU) gives ``default`` with one warning."""
    try:
        table = table_for(device, manifest.path)
        if table is None:
            return default
        entry = table.entry_for(default.family, default.dispatch)
        row = entry.row_for(bucket) if entry is not None else None
        if row is None or row.tile is None:
            return default
        return variant_with_tile(manifest, default.family, default.dispatch, row.tile, like=default) or default
    except Exception as e:  # noqa: BLE001 -- a table must never fail a call
        _warn_once(f"flashgen: tune table lookup failed ({type(e).__name__}: {e}); the default tiles serve")
        return default
