"""Per-GPU tune tables (``configs/tune/<gpu-slug>.yaml``, written by ``flashgen tune``): the
format's validation and the tiles a table names, shared by the runtime and the generator.

The runtime (flashgen/tuning.py, which documents the format and the lookup) serves a table's tile
for a call's dispatch key and seqlen_k when that tile is built; the generator (config.py,
:func:`~flashgen.generator.config.load_variants`) puts every tile a table in ``configs/tune/``
names into the default build set, so the default build (and the default wheel) has the winners.
Both validate a table with :func:`check_table`, so they agree on which tables count: one that
fails it is ignored by both (the runtime warns once per process, the generator on every load).

Nothing here imports the runtime: setup.py loads the generator on its own to package a wheel.
"""
from __future__ import annotations

import datetime
import re
from pathlib import Path

from . import families

SCHEMA = 1
TABLE_DIR = "tune"  # beside the manifest (<kernel dir>/tune) and in a checkout (configs/tune)
TOP_KEYS = ("schema", "gpu", "date", "flashgen", "protocol", "entries")
ENTRY_KEYS = ("family", "key", "default_tile", "rows")
ROW_KEYS = ("max_seqlen_k", "tile", "measured")
MEASURED_KEYS = ("seqlen", "tflops", "default_tflops")


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-") or "unknown-gpu"


# ---------------------------------------------------------------------------------- validation
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else repr(v) if isinstance(v, str) else str(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mapping(obj, where: str, allowed: tuple, required: tuple, problems: list) -> bool:
    """The config files' check (config.py): a mapping, no unknown key, every required one."""
    from .config import _check_mapping

    return _check_mapping(obj, where, allowed, problems, required)


def _scalars(obj, where: str, problems: list) -> bool:
    """A non-empty mapping of names to int / bool / str values (a dispatch key or a tile)."""
    if not isinstance(obj, dict) or not obj:
        problems.append(f"{where}: expected a non-empty mapping of names to values, got {_fmt(obj)}")
        return False
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, (int, bool, str))]
    for k in bad:
        problems.append(f"{where}.{k}: {_fmt(obj[k])}: expected an integer, boolean or string")
    return not bad


def _check_row(row, where: str, key: dict, problems: list) -> bool:
    if not _mapping(row, where, ROW_KEYS, ("max_seqlen_k", "tile"), problems):
        return False
    n0 = len(problems)
    m = row["max_seqlen_k"]
    if m is not None and not (_is_int(m) and m >= 1 and m & (m - 1) == 0):
        problems.append(f"{where}.max_seqlen_k = {_fmt(m)}: not allowed; allowed: a power of two >= 1 (the runtime "
                        "buckets seqlen_k by powers of two), or null (no upper bound)")
    tile = row["tile"]
    if not isinstance(tile, dict) and tile != "default":
        problems.append(f"{where}.tile = {_fmt(tile)}: not allowed; allowed: a mapping of tile parameters, "
                        "or 'default'")
    elif tile != "default" and _scalars(tile, f"{where}.tile", problems):
        for k in tile:
            if k in key:
                problems.append(f"{where}.tile.{k}: a dispatch key, not a tile parameter; the entry's key sets it")
    measured = row.get("measured", [])
    if not isinstance(measured, list):
        problems.append(f"{where}.measured: expected a list, got {_fmt(measured)}")
    else:
        for j, m in enumerate(measured):
            w = f"{where}.measured[{j}]"
            if _mapping(m, w, MEASURED_KEYS, ("seqlen",), problems):
                if not (_is_int(m["seqlen"]) and m["seqlen"] >= 1):
                    problems.append(f"{w}.seqlen = {_fmt(m['seqlen'])}: expected an integer >= 1")
                for k in ("tflops", "default_tflops"):
                    if k in m and not (_is_num(m[k]) and m[k] >= 0):
                        problems.append(f"{w}.{k} = {_fmt(m[k])}: expected a number >= 0")
    return len(problems) == n0


def check_table(data, label: str) -> list[str]:
    """Every problem of a parsed table, one line each naming ``label`` (the file) and the row."""
    problems: list[str] = []
    if not _mapping(data, label, TOP_KEYS, TOP_KEYS, problems):
        return problems
    if data["schema"] != SCHEMA:
        problems.append(f"{label}: schema = {_fmt(data['schema'])}: this flashgen reads schema {SCHEMA}; "
                        "re-run `flashgen tune`")
    if not isinstance(data["gpu"], str) or not data["gpu"].strip():
        problems.append(f"{label}: gpu = {_fmt(data['gpu'])}: expected the GPU's name (a non-empty string)")
    date = data["date"]
    if not isinstance(date, datetime.date):
        try:
            datetime.date.fromisoformat(str(date))
        except ValueError:
            problems.append(f"{label}: date = {_fmt(date)}: expected a date, YYYY-MM-DD")
    if _mapping(data["flashgen"], f"{label}: flashgen", ("version", "commit"), ("version", "commit"), problems):
        for k in ("version", "commit"):
            if not isinstance(data["flashgen"][k], str):
                problems.append(f"{label}: flashgen.{k} = {_fmt(data['flashgen'][k])}: expected a string")
    if not isinstance(data["protocol"], dict):
        problems.append(f"{label}: protocol: expected a mapping (how the table was measured), got {_fmt(data['protocol'])}")
    entries = data["entries"]
    if not isinstance(entries, list):
        problems.append(f"{label}: entries: expected a list, got {_fmt(entries)}")
        return problems
    seen: dict = {}
    for i, e in enumerate(entries):
        where = f"{label}: entries[{i}]"
        if not _mapping(e, where, ENTRY_KEYS, ENTRY_KEYS, problems):
            continue
        if not isinstance(e["family"], str):
            problems.append(f"{where}.family = {_fmt(e['family'])}: expected a family name (a string)")
        if not _scalars(e["key"], f"{where}.key", problems):
            continue
        _scalars(e["default_tile"], f"{where}.default_tile", problems)
        ident = (e["family"], *sorted(e["key"].items())) if isinstance(e["family"], str) else None
        if ident in seen:
            problems.append(f"{where}: same family and key as entries[{seen[ident]}]; allowed: one entry per key")
        seen.setdefault(ident, i)
        rows = e["rows"]
        if not isinstance(rows, list) or not rows:
            problems.append(f"{where}.rows: expected a non-empty list of rows, got {_fmt(rows)}")
            continue
        prev = 0
        for j, r in enumerate(rows):
            w = f"{where}.rows[{j}]"
            if not _check_row(r, w, e["key"], problems):
                continue
            m = r["max_seqlen_k"]
            if m is None and j != len(rows) - 1:
                problems.append(f"{w}.max_seqlen_k = null: only the last row may have no upper bound")
            elif m is not None and m <= prev:
                problems.append(f"{w}.max_seqlen_k = {m}: not above the previous row's ({prev}); "
                                "allowed: ascending bounds")
            prev = m if m is not None else prev
    return problems



# ---------------------------------------------------------------------------------- reading
def table_files(configs_dir) -> list[Path]:
    """The tables of a checkout: ``<configs_dir>/tune/*.yaml`` (what a wheel ships beside its kernels)."""
    return sorted((Path(configs_dir) / TABLE_DIR).glob("*.yaml"))


def read_table(path, label: str | None = None) -> tuple[dict | None, list[str]]:
    """(parsed table, problems) of one table file, every problem a line naming ``label`` (default:
    the path) and the row. Besides :func:`check_table`: the file must be named after its GPU
    (``<gpu-slug>.yaml``), as the runtime finds a table by the slug of the device's name and
    ignores one measured on another GPU. ``None`` when the file cannot be read or parsed."""
    import yaml

    label = label or str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())  # as the runtime reads it (flashgen/tuning.py)
    except OSError as e:
        return None, [f"{label}: cannot read: {e.strerror or e}"]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        return None, [f"{label}:{where}: invalid YAML: {getattr(e, 'problem', None) or e}"]
    problems = check_table(data, label)
    if not problems and Path(path).name != f"{gpu_slug(data['gpu'])}.yaml":
        problems.append(f"{label}: gpu = {_fmt(data['gpu'])}: the file of this GPU is {gpu_slug(data['gpu'])}.yaml; "
                        "the runtime looks a table up by the slug of the device's name")
    return data, problems


def named_tiles(data: dict) -> list[tuple[str, str, dict, dict]]:
    """Every tile a valid table names (rows with ``tile: default`` name none): (where, e.g.
    ``entries[2].rows[1]``, family, dispatch key, tile)."""
    return [(f"entries[{i}].rows[{j}]", e["family"], families.full_key(e["family"], e["key"]), dict(r["tile"]))
            for i, e in enumerate(data["entries"]) for j, r in enumerate(e["rows"]) if r["tile"] != "default"]


def has_tile(params: dict, tile: dict) -> bool:
    """Whether a variant's params carry ``tile`` (the runtime's match, flashgen/tuning.py)."""
    return all(params.get(k) == x for k, x in tile.items())


def pick_variant(variants, family: str, dispatch: dict, tile: dict, like=None):
    """Of ``variants`` (objects with family, dispatch, params, default, name), the one a table row's
    ``tile`` names for (family, full dispatch key), or None: the default, then the one that agrees
    with ``like`` (the key's default variant) on the keys the tile leaves out (a table written before
    a knob existed names no value for it), then the first by name. The runtime's choice among the
    built variants (flashgen/tuning.py) and the default build's (generator/config.py) alike."""
    hits = [v for v in variants if v.family == family and v.dispatch == dispatch and has_tile(v.params, tile)]

    def unlike(v):
        return like is not None and any(v.params.get(k) != x for k, x in like.params.items() if k not in tile)

    return min(hits, key=lambda v: (not v.default, unlike(v), v.name)) if hits else None

