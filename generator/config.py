"""Config files: schema, validation and expansion into variants.

Every ``configs/*.yaml`` is one mapping with these top-level keys (all but ``family`` optional):

``family``         str, the template family: ``fwd`` (templates/fwd.cu.j2)
``description``    str, free text
``default_build``  bool (default true): part of the default build set (``flashgen build`` without
                   ``--all``); false for sets only ``--all`` / ``make build-all`` builds
``defaults``       knob defaults: ``stages`` (2), ``pingpong``, ``overlap``, ``persistent`` (true)
``matrix``         axes ``dtype``, ``head_dim``, ``causal``: lists (or one scalar); every combination
                   is a point whose tile comes from ``tiles``
``tiles``          list of rows: ``head_dim`` (required), ``dtype`` and ``causal`` (optional, to narrow
                   the match), ``block_m``, ``block_n``, ``consumer_wgs`` (required) and optional knob
                   overrides ``stages``, ``pingpong``, ``overlap``, ``persistent``. The most specific
                   matching row wins. This is also the runtime's tile choice: variants made from a
                   row are marked ``"default": true`` in the manifest.
``exclude``        list of rules; a matrix point whose params match every key of a rule (a value or a
                   list of values) is dropped
``extra``          list of explicit points, each with any variant key (CONTRACTS.md §1, except
                   ``family``); ``dtype``, ``head_dim`` and ``causal`` are required; keys left out come
                   from the matching ``tiles`` row, then ``defaults``. ``flashgen add-variant`` appends here.

All problems of all files are collected (never only the first) and raised together as one
:class:`ConfigError` whose lines name file, key, value and what is allowed.
"""
from __future__ import annotations

import copy
import fnmatch
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import ConfigError
from .feasibility import CONSUMER_WGS, DTYPES, HEAD_DIMS, STAGES, fwd_problems, fwd_resources
from .naming import BOOL_KEYS, INT_KEYS, PARAM_KEYS, canonical_params, symbol_for, variant_name

FAMILIES = ("fwd",)
TOP_KEYS = ("family", "description", "default_build", "defaults", "matrix", "tiles", "exclude", "extra")
KNOB_KEYS = ("stages", "pingpong", "overlap", "persistent")
BUILTIN_DEFAULTS = {"stages": 2, "pingpong": True, "overlap": True, "persistent": True}
MATRIX_KEYS = ("dtype", "head_dim", "causal")
TILE_MATCH_KEYS = ("head_dim", "dtype", "causal")
TILE_REQUIRED = ("head_dim", "block_m", "block_n", "consumer_wgs")
TILE_KEYS = TILE_MATCH_KEYS + ("block_m", "block_n", "consumer_wgs") + KNOB_KEYS
POINT_KEYS = tuple(k for k in PARAM_KEYS if k != "family")
POINT_REQUIRED = ("dtype", "head_dim", "causal")
# Single-key value sets checked while parsing (combinations are checked in feasibility.py)
ENUMS = {"dtype": DTYPES, "head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS, "consumer_wgs": CONSUMER_WGS,
         "stages": STAGES, "family": FAMILIES}


@dataclass
class Variant:
    """One kernel variant: canonical params plus everything derived from them."""

    name: str
    symbol: str
    params: dict
    resources: dict
    default: bool = False  # the tile table's choice for its (dtype, head_dim, causal)
    default_build: bool = False  # in the default build set
    sources: list = field(default_factory=list)  # e.g. "configs/fwd.yaml: matrix"

    @property
    def family(self) -> str:
        return self.params["family"]


# ---------------------------------------------------------------------------------------- YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, label: str, problems: list):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        ctx = getattr(e, "context", None)
        problems.append(f"{label}:{where}: invalid YAML: {(ctx + ': ') if ctx else ''}{what}")
        return None


# ------------------------------------------------------------------------------------ checking


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)


def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", str: "string", float: "float", list: "list",
            dict: "mapping", type(None): "null"}.get(type(v), type(v).__name__)


def _check_value(key: str, value, where: str, problems: list) -> bool:
    """Type and single-key range check of one variant key. Returns True if it is usable."""
    if key in INT_KEYS:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif key in BOOL_KEYS:
        ok, want = isinstance(value, bool), "a boolean (true/false)"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        problems.append(f"{where} = {_fmt(value)}: wrong type {_type_name(value)}, expected {want}")
        return False
    allowed = ENUMS.get(key)
    if allowed is not None and value not in allowed:
        problems.append(f"{where} = {_fmt(value)}: not allowed; allowed: {', '.join(map(_fmt, allowed))}")
        return False
    if key == "block_n" and not (16 <= value <= 256 and value % 16 == 0):
        problems.append(f"{where} = {value}: not allowed; allowed: a multiple of 16 in [16, 256] "
                        "(WGMMA N <= 256; the PV GEMM steps k16 over block_n)")
        return False
    if key == "block_m" and value not in (128, 192):
        problems.append(f"{where} = {value}: not allowed; allowed: 64 * consumer_wgs, i.e. 128 or 192")
        return False
    return True


def _check_mapping(obj, where: str, allowed: tuple, problems: list, required: tuple = ()) -> bool:
    if not isinstance(obj, dict):
        problems.append(f"{where}: wrong type {_type_name(obj)}, expected a mapping")
        return False
    ok = True
    for k in obj:
        if k not in allowed:
            problems.append(f"{where}.{k}: unknown key (value {_fmt(obj[k])}); allowed keys: {', '.join(allowed)}")
            ok = False
    for k in required:
        if k not in obj:
            problems.append(f"{where}: missing required key {k!r}")
            ok = False
    return ok


def _as_list(v):
    return v if isinstance(v, list) else [v]


@dataclass
class _Doc:
    label: str  # file path relative to the root, for messages
    data: dict


def _validate_doc(doc: _Doc, problems: list) -> bool:
    """Schema check of one file. Returns True when it can be expanded."""
    f, d = doc.label, doc.data
    n0 = len(problems)
    if d is None:
        d = doc.data = {}
    if not isinstance(d, dict):
        problems.append(f"{f}: wrong type {_type_name(d)} at top level, expected a mapping with keys "
                        f"{', '.join(TOP_KEYS)}")
        return False
    for k in d:
        if k not in TOP_KEYS:
            problems.append(f"{f}: {k}: unknown key (value {_fmt(d[k])}); allowed keys: {', '.join(TOP_KEYS)}")
    if "family" not in d:
        problems.append(f"{f}: missing required key 'family'; allowed: {', '.join(FAMILIES)}")
    else:
        _check_value("family", d["family"], f"{f}: family", problems)
    if "description" in d and not isinstance(d["description"], str):
        problems.append(f"{f}: description = {_fmt(d['description'])}: wrong type {_type_name(d['description'])}, expected a string")
    if "default_build" in d and not isinstance(d["default_build"], bool):
        problems.append(f"{f}: default_build = {_fmt(d['default_build'])}: wrong type "
                        f"{_type_name(d['default_build'])}, expected a boolean (true/false)")
    if "defaults" in d and _check_mapping(d["defaults"], f"{f}: defaults", KNOB_KEYS, problems):
        for k, v in d["defaults"].items():
            _check_value(k, v, f"{f}: defaults.{k}", problems)
    if "matrix" in d and _check_mapping(d["matrix"], f"{f}: matrix", MATRIX_KEYS, problems):
        for k, vs in d["matrix"].items():
            vs = _as_list(vs)
            if not vs:
                problems.append(f"{f}: matrix.{k}: empty list; give at least one value")
            for i, v in enumerate(vs):
                _check_value(k, v, f"{f}: matrix.{k}[{i}]", problems)
        for k in MATRIX_KEYS:
            if k not in d["matrix"]:
                problems.append(f"{f}: matrix: missing required key {k!r}")
    for sect, allowed, required in (("tiles", TILE_KEYS, TILE_REQUIRED), ("exclude", POINT_KEYS, ()),
                                    ("extra", POINT_KEYS, POINT_REQUIRED)):
        if sect not in d or d[sect] is None:
            d[sect] = []
            continue
        if not isinstance(d[sect], list):
            problems.append(f"{f}: {sect}: wrong type {_type_name(d[sect])}, expected a list of mappings")
            continue
        for i, row in enumerate(d[sect]):
            where = f"{f}: {sect}[{i}]"
            if not _check_mapping(row, where, allowed, problems, required):
                continue
            for k, v in row.items():
                if sect == "exclude":
                    for j, vv in enumerate(_as_list(v)):
                        _check_value(k, vv, f"{where}.{k}" + (f"[{j}]" if isinstance(v, list) else ""), problems)
                else:
                    _check_value(k, v, f"{where}.{k}", problems)
    if len(problems) == n0:  # duplicate tile keys make the choice ambiguous
        seen = {}
        for i, row in enumerate(d["tiles"]):
            key = tuple(row.get(k) for k in TILE_MATCH_KEYS)
            if key in seen:
                problems.append(f"{f}: tiles[{i}]: same head_dim/dtype/causal as tiles[{seen[key]}] "
                                f"({', '.join(f'{k}={_fmt(v)}' for k, v in zip(TILE_MATCH_KEYS, key) if v is not None)}); "
                                "allowed: one row per key")
            seen.setdefault(key, i)
    return len(problems) == n0


def _match_tile(doc: _Doc, point: dict):
    """(index, row) of the most specific tiles row matching point, or (None, None)."""
    best, best_score = (None, None), -1
    for i, row in enumerate(doc.data["tiles"]):
        if any(k in row and row[k] != point[k] for k in TILE_MATCH_KEYS):
            continue
        score = sum(k in row for k in TILE_MATCH_KEYS)
        if score > best_score:
            best, best_score = (i, row), score
    return best


def _excluded(doc: _Doc, params: dict) -> bool:
    return any(all(params.get(k) in _as_list(v) for k, v in rule.items()) for rule in doc.data["exclude"])


def _expand_doc(doc: _Doc, problems: list) -> list[Variant]:
    f, d = doc.label, doc.data
    family = d["family"]
    defaults = {**BUILTIN_DEFAULTS, **(d.get("defaults") or {})}
    default_src = {k: (f"defaults.{k}" if k in (d.get("defaults") or {}) else "built-in default") for k in KNOB_KEYS}
    points = []  # (params, provenance, is_default, source)
    m = d.get("matrix")
    if m:
        axes = [_as_list(m[k]) for k in MATRIX_KEYS]
        for combo in itertools.product(*axes):
            point = dict(zip(MATRIX_KEYS, combo))
            desc = ", ".join(f"{k}={_fmt(v)}" for k, v in point.items())
            i, row = _match_tile(doc, point)
            if row is None:
                problems.append(f"{f}: matrix point {desc}: no tiles row matches; allowed: add a tiles row "
                                f"with head_dim: {point['head_dim']} (and block_m, block_n, consumer_wgs)")
                continue
            params = {"family": family, **point, "head_dim_v": point["head_dim"], **defaults}
            prov = {k: f"matrix.{k}" for k in MATRIX_KEYS} | dict(default_src) | {"head_dim_v": "matrix.head_dim"}
            for k, v in row.items():
                if k not in TILE_MATCH_KEYS:
                    params[k], prov[k] = v, f"tiles[{i}].{k}"
            if _excluded(doc, params):
                continue
            points.append((params, prov, True, f"{f}: matrix ({desc}) with tiles[{i}]"))
    for j, pt in enumerate(d["extra"]):
        i, row = _match_tile(doc, pt)
        params = {"family": family, "head_dim_v": pt["head_dim"], **defaults}
        prov = {"head_dim_v": f"extra[{j}].head_dim"} | dict(default_src)
        if row is not None:
            for k, v in row.items():
                if k not in TILE_MATCH_KEYS:
                    params[k], prov[k] = v, f"tiles[{i}].{k}"
        for k, v in pt.items():
            params[k], prov[k] = v, f"extra[{j}].{k}"
        missing = [k for k in ("block_m", "block_n", "consumer_wgs") if k not in params]
        if missing:
            problems.append(f"{f}: extra[{j}]: missing {', '.join(missing)} and no tiles row matches "
                            f"head_dim={pt['head_dim']}; allowed: give them in the point or add a tiles row")
            continue
        points.append((params, prov, False, f"{f}: extra[{j}]"))

    out = []
    for params, prov, is_default, source in points:
        bad = fwd_problems(params)
        if bad:
            ctx = ", ".join(f"{k}={_fmt(params[k])}" for k in ("dtype", "head_dim", "causal"))
            for key, value, allowed in bad:
                src = prov.get(key) or prov.get("block_n")
                problems.append(f"{f}: {src} ({key} = {_fmt(value)}, variant {ctx} from {source.split(': ', 1)[1]}): "
                                f"not allowed; allowed: {allowed}")
            continue
        cp = canonical_params(params)
        name = variant_name(cp)
        out.append(Variant(name=name, symbol=symbol_for(name), params=cp, resources=fwd_resources(cp),
                           default=is_default, default_build=d.get("default_build", True), sources=[source]))
    return out


# ------------------------------------------------------------------------------------- public


def config_files(configs_dir: Path) -> list[Path]:
    return sorted([*Path(configs_dir).glob("*.yaml"), *Path(configs_dir).glob("*.yml")])


def load_variants(project, overrides: dict | None = None) -> list[Variant]:
    """Validate every config file of ``project`` and expand them into variants (sorted by name).

    ``overrides`` maps a config path to parsed data used instead of the file's content (the
    add-variant command validates its edit this way before writing). Raises ConfigError with
    every problem found."""
    problems: list[str] = []
    overrides = {Path(k).resolve(): v for k, v in (overrides or {}).items()}
    paths = config_files(project.configs_dir)
    for p in overrides:
        if p not in [q.resolve() for q in paths]:
            paths.append(p)
    if not paths:
        raise ConfigError([f"{project.rel(project.configs_dir)}: no *.yaml config files"])
    docs = []
    for path in paths:
        label = project.rel(path)
        if path.resolve() in overrides:
            data = copy.deepcopy(overrides[path.resolve()])
        else:
            try:
                data = parse_yaml(path.read_text(), label, problems)
            except OSError as e:
                problems.append(f"{label}: cannot read: {e.strerror}")
                continue
            if data is None and problems and problems[-1].startswith(label):
                continue
        docs.append(_Doc(label, data))
    by_name: dict[str, Variant] = {}
    for doc in docs:
        if not _validate_doc(doc, problems):
            continue
        for v in _expand_doc(doc, problems):
            if v.name in by_name:  # the same point from two places: one variant
                w = by_name[v.name]
                w.default |= v.default
                w.default_build |= v.default_build
                w.sources += v.sources
            else:
                by_name[v.name] = v
    # the tile table must name one choice per (family, dtype, head_dim, head_dim_v, causal)
    chosen: dict[tuple, Variant] = {}
    for v in sorted(by_name.values(), key=lambda v: v.name):
        if not v.default:
            continue
        key = tuple(v.params[k] for k in ("family", "dtype", "head_dim", "head_dim_v", "causal"))
        if key in chosen:
            problems.append(f"{v.sources[0].split(': ')[0]}: tiles: two default tiles for "
                            f"dtype={key[1]}, head_dim={key[2]}, causal={_fmt(key[4])}: {chosen[key].name} "
                            f"({chosen[key].sources[0]}) and {v.name} ({v.sources[0]}); allowed: one")
        else:
            chosen[key] = v
    if problems:
        raise ConfigError(problems)
    return sorted(by_name.values(), key=lambda v: v.name)


def select(variants: list[Variant], pattern: str | None = None, all_: bool = False) -> list[Variant]:
    """The default build set (every variant with ``all_``), narrowed by a name glob.

    ``pattern`` is one or more comma-separated fnmatch globs; a pattern without wildcards matches
    as a substring."""
    pool = [v for v in variants if all_ or v.default_build]
    if pattern:
        pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in pattern.split(",") if p]
        pool = [v for v in pool if any(fnmatch.fnmatchcase(v.name, p) for p in pats)]
    return pool
