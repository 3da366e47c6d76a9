"""Config files: schema, validation and expansion into variants (generic over families).

Every ``configs/*.yaml`` is one mapping with these top-level keys (all but ``family`` optional);
which keys may appear inside ``defaults``, ``matrix``, ``tiles``, ``exclude`` and ``extra`` is
declared by the family module (generator/families/<family>.py, its ``keys``):

``family``         str, the kernel family (a module of generator/families; template templates/<family>.cu.j2)
``description``    str, free text
``default_build``  bool (default true): part of the default build set (``flashgen build`` without
                   ``--all``); false for sets only ``--all`` / ``make build-all`` builds (but see
                   "The default build set" below: a variant a tune table names is in it anyway)
``defaults``       knob defaults (the family's ``knob`` keys; built-in defaults otherwise)
``matrix``         the family's ``axis`` keys: lists (or one scalar); every combination is a point
                   whose tile keys come from ``tiles``. An axis with a default (e.g. fwd's ``softcap``,
                   false) may be left out: it then takes its default alone
``tiles``          list of rows keyed by the family's ``tile_match`` axes (each optional, to narrow the
                   match) giving its ``tile`` keys and optional knob overrides; the family's
                   ``tile_required`` keys must be in every row. The most specific matching row wins.
                   This is also the runtime's choice: variants made from a row are marked
                   ``"default": true`` in the manifest.
``candidates``     rows like ``tiles`` (same keys) naming alternative tiles: every matrix point gets one
                   more variant, not ``default``, per row that matches it (every matching row, not only
                   the most specific). The tile candidates ``flashgen tune`` times (configs/fwd_tune.yaml);
                   a file with ``candidates`` needs no ``tiles`` row for its matrix points
``exclude``        list of rules; a matrix point whose params match every key of a rule (a value or a
                   list of values) is dropped (candidates included)
``extra``          list of explicit points, each with any of the family's keys; the axes are required
                   (those with a default may be left out);
                   keys left out come from the matching ``tiles`` row, then ``defaults``.
                   ``flashgen add-variant`` appends here.

All problems of all files are collected (never only the first) and raised together as one
:class:`ConfigError` whose lines name file, key, value and what is allowed.

The default build set (``flashgen build``, ``make build``, a wheel with FLASHGEN_VARIANTS unset or
``default``; :func:`select` without ``all_``) is

1. every variant of a file with ``default_build: true``, and
2. every variant a tune table names: each ``configs/tune/*.yaml`` (per-GPU tables written by
   ``flashgen tune``; format: generator/tunetable.py) gives, per dispatch key and seqlen_k range,
   the tile the runtime serves there; the variant of that key with that tile (the one the runtime
   would pick) joins the default set, whatever its file's ``default_build`` (typically a
   ``candidates`` row of a ``default_build: false`` file). Only the winners: the other candidates
   stay outside. :attr:`Variant.tuned` lists the tables (file stems, e.g. ``nvidia-h200``) that
   add a variant. A new table is picked up by the next load, with no code or config change.

A table never makes :func:`load_variants` fail (it is a measurement of one GPU, and the runtime
never fails a call on one either; a table for another GPU must not break this build or a
``pip install``), but nothing is dropped silently: a table that fails validation (which the
runtime ignores as a whole) and a tile that no config makes (which the runtime cannot serve; it
falls back to the default tile) are each reported through ``warn`` (default: a
:class:`TuneTableWarning`), naming the table file and the entry/row. The CLI prints these as
``warning:`` lines on every load; the tests assert that the shipped tables give none.
"""
from __future__ import annotations

import copy
import fnmatch
import itertools
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import families, tunetable
from .errors import ConfigError, TuneTableWarning
from .naming import canonical_params, symbol_for, variant_name

TOP_KEYS = ("family", "description", "default_build", "defaults", "matrix", "tiles", "candidates", "exclude", "extra")


@dataclass
class Variant:
    """One kernel variant: canonical params plus everything derived from them."""

    name: str
    params: dict
    resources: dict
    kernels: list  # of families.KernelSpec
    default: bool = False  # the tile table's choice for its dispatch key
    default_build: bool = False  # in the default build set
    sources: list = field(default_factory=list)  # e.g. "configs/fwd.yaml: matrix"
    tuned: list = field(default_factory=list)  # tune tables (stems) that put it in the default set

    @property
    def family(self) -> str:
        return self.params["family"]

    @property
    def dispatch(self) -> dict:
        return families.get(self.family).dispatch(self.params)

    def symbol(self, role: str) -> str:
        return symbol_for(self.name, role)

    @property
    def symbols(self) -> list:
        """The extern "C" symbol of every kernel of the variant."""
        return [self.symbol(k.role) for k in self.kernels]


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


def _check_value(fam, key: str, value, where: str, problems: list) -> bool:
    """Type and single-key range check of one variant key of family ``fam``. True if usable."""
    spec = fam.key(key)
    if spec.type is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif spec.type is bool:
        ok, want = isinstance(value, bool), "a boolean (true/false)"
    else:
        ok, want = isinstance(value, str), "a string"
    if not ok:
        problems.append(f"{where} = {_fmt(value)}: wrong type {_type_name(value)}, expected {want}")
        return False
    allowed = spec.problem(value)
    if allowed is not None:
        problems.append(f"{where} = {_fmt(value)}: not allowed; allowed: {allowed}")
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
    fam: object = None  # its families.Family, once known


def _validate_doc(doc: _Doc, problems: list) -> bool:
    """Schema check of one file against its family's keys. Returns True when it can be expanded."""
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
    known = families.names()
    if "family" not in d:
        problems.append(f"{f}: missing required key 'family'; allowed: {', '.join(known)}")
        return False
    if not isinstance(d["family"], str) or d["family"] not in known:
        problems.append(f"{f}: family = {_fmt(d['family'])}: not allowed; allowed: {', '.join(known)}")
        return False
    fam = doc.fam = families.get(d["family"])
    axes, knobs = fam.names("axis"), fam.names("knob")
    point_keys = fam.names()
    if "description" in d and not isinstance(d["description"], str):
        problems.append(f"{f}: description = {_fmt(d['description'])}: wrong type {_type_name(d['description'])}, expected a string")
    if "default_build" in d and not isinstance(d["default_build"], bool):
        problems.append(f"{f}: default_build = {_fmt(d['default_build'])}: wrong type "
                        f"{_type_name(d['default_build'])}, expected a boolean (true/false)")
    if "defaults" in d and _check_mapping(d["defaults"], f"{f}: defaults", knobs, problems):
        for k, v in d["defaults"].items():
            _check_value(fam, k, v, f"{f}: defaults.{k}", problems)
    if "matrix" in d and _check_mapping(d["matrix"], f"{f}: matrix", axes, problems):
        for k, vs in d["matrix"].items():
            vs = _as_list(vs)
            if not vs:
                problems.append(f"{f}: matrix.{k}: empty list; give at least one value")
            for i, v in enumerate(vs):
                _check_value(fam, k, v, f"{f}: matrix.{k}[{i}]", problems)
        for k in axes:
            if k not in d["matrix"] and fam.key(k).default is None:
                problems.append(f"{f}: matrix: missing required key {k!r}")
    tile_keys = fam.tile_match + fam.names("tile", "knob")
    for sect, allowed, required in (("tiles", tile_keys, fam.tile_required), ("candidates", tile_keys, fam.tile_required),
                                    ("exclude", point_keys, ()),
                                    ("extra", point_keys, tuple(k for k in axes if fam.key(k).default is None))):
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
                        _check_value(fam, k, vv, f"{where}.{k}" + (f"[{j}]" if isinstance(v, list) else ""), problems)
                else:
                    _check_value(fam, k, v, f"{where}.{k}", problems)
    if len(problems) == n0:  # duplicate tile keys make the choice ambiguous
        seen = {}
        for i, row in enumerate(d["tiles"]):
            key = tuple(row.get(k) for k in fam.tile_match)
            if key in seen:
                problems.append(f"{f}: tiles[{i}]: same {'/'.join(fam.tile_match)} as tiles[{seen[key]}] "
                                f"({', '.join(f'{k}={_fmt(v)}' for k, v in zip(fam.tile_match, key) if v is not None)}); "
                                "allowed: one row per key")
            seen.setdefault(key, i)
    return len(problems) == n0


def _row_matches(doc: _Doc, row: dict, point: dict) -> bool:
    return not any(k in row and row[k] != point.get(k) for k in doc.fam.tile_match)


def _match_tile(doc: _Doc, point: dict):
    """(index, row) of the most specific tiles row matching point, or (None, None)."""
    best, best_score = (None, None), -1
    for i, row in enumerate(doc.data["tiles"]):
        if not _row_matches(doc, row, point):
            continue
        score = sum(k in row for k in doc.fam.tile_match)
        if score > best_score:
            best, best_score = (i, row), score
    return best


def _apply_row(doc: _Doc, params: dict, prov: dict, sect: str, i, row) -> None:
    """Set a tiles/candidates row's tile keys and knob overrides on ``params`` (provenance in ``prov``)."""
    for k, v in (row or {}).items():
        if k not in doc.fam.tile_match:
            params[k], prov[k] = v, f"{sect}[{i}].{k}"


def _excluded(doc: _Doc, params: dict) -> bool:
    return any(all(params.get(k) in _as_list(v) for k, v in rule.items()) for rule in doc.data["exclude"])


def _expand_doc(doc: _Doc, problems: list) -> list[Variant]:
    f, d, fam = doc.label, doc.data, doc.fam
    axes, match = fam.names("axis"), fam.tile_match
    given = d.get("defaults") or {}
    axis_defaults = {k.name: k.default for k in fam.keys if k.role == "axis" and k.default is not None}
    defaults = {**fam.knob_defaults(), **given}
    default_src = {k: (f"defaults.{k}" if k in given else "built-in default") for k in fam.names("knob")}
    tile_given = fam.names("tile")
    points = []  # (params, provenance, is_default, source)
    m = d.get("matrix")
    if m is not None:  # (a family without axes: `matrix: {}` is its one point)
        for combo in itertools.product(*[_as_list(m[k] if k in m else axis_defaults[k]) for k in axes]):
            point = dict(zip(axes, combo))
            desc = ", ".join(f"{k}={_fmt(v)}" for k, v in point.items())
            i, row = _match_tile(doc, point)
            cands = [(j, c) for j, c in enumerate(d["candidates"]) if _row_matches(doc, c, point)]
            if row is None and tile_given and not cands:
                problems.append(f"{f}: matrix point {desc}: no tiles row matches; allowed: add a tiles row "
                                f"with {match[0]}: {_fmt(point[match[0]])} (and {', '.join(tile_given)})"
                                + (" or a candidates row" if d["candidates"] else ""))
                continue
            rows = ([("tiles", i, row)] if row is not None or not tile_given else []) + [("candidates", j, c) for j, c in cands]
            for sect, i, row in rows:
                params = {"family": fam.name, **point, **defaults}
                prov = {k: f"matrix.{k}" for k in axes} | dict(default_src)
                _apply_row(doc, params, prov, sect, i, row)
                if _excluded(doc, fam.derive(dict(params))):
                    continue
                points.append((params, prov, sect == "tiles", f"{f}: matrix ({desc})" + (f" with {sect}[{i}]" if row else "")))
    for j, pt in enumerate(d["extra"]):
        i, row = _match_tile(doc, pt)
        params = {"family": fam.name, **axis_defaults, **defaults}
        prov = dict(default_src)
        _apply_row(doc, params, prov, "tiles", i, row)
        for k, v in pt.items():
            params[k], prov[k] = v, f"extra[{j}].{k}"
        params = fam.derive(params)
        missing = [k for k in tile_given if k not in params]
        if missing:
            problems.append(f"{f}: extra[{j}]: missing {', '.join(missing)} and no tiles row matches "
                            f"{', '.join(f'{k}={_fmt(pt[k])}' for k in match if k in pt)}; "
                            "allowed: give them in the point or add a tiles row")
            continue
        points.append((params, prov, False, f"{f}: extra[{j}]"))

    out = []
    for params, prov, is_default, source in points:
        params = fam.derive(params)
        for k in fam.names("derived"):
            prov.setdefault(k, "derived")
        bad = fam.problems(params)
        if bad:
            ctx = ", ".join(f"{k}={_fmt(params[k])}" for k in axes)
            for key, value, allowed in bad:
                src = prov.get(key) or next((prov[k] for k in tile_given if k in prov), "derived")
                problems.append(f"{f}: {src} ({key} = {_fmt(value)}, variant {ctx} from {source.split(': ', 1)[1]}): "
                                f"not allowed; allowed: {allowed}")
            continue
        cp = canonical_params(params)
        res = fam.resources(cp)
        out.append(Variant(name=variant_name(cp), params=cp, resources=res, kernels=fam.kernels(cp, res),
                           default=is_default, default_build=d.get("default_build", True), sources=[source]))
    return out


# ------------------------------------------------------------------------------------- public


def config_files(configs_dir: Path) -> list[Path]:
    return sorted([*Path(configs_dir).glob("*.yaml"), *Path(configs_dir).glob("*.yml")])


def load_variants(project, overrides: dict | None = None, warn=None) -> list[Variant]:
    """Validate every config file of ``project`` and expand them into variants (sorted by name),
    the tiles its tune tables name marked ``default_build`` (module docstring, "The default build set").

    ``overrides`` maps a config path to parsed data used instead of the file's content (the
    add-variant command validates its edit this way before writing). Raises ConfigError with
    every problem found in the configs. ``warn(message)`` receives each problem of a tune table
    (default: ``warnings.warn`` with :class:`TuneTableWarning`)."""
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
    # the tile table must name one choice per (family, dispatch key)
    chosen: dict[tuple, Variant] = {}
    for v in sorted(by_name.values(), key=lambda v: v.name):
        if not v.default:
            continue
        key = (v.family, *v.dispatch.items())
        if key in chosen:
            what = ", ".join(f"{k}={_fmt(x)}" for k, x in v.dispatch.items())
            problems.append(f"{v.sources[0].split(': ')[0]}: tiles: two default tiles for {v.family} "
                            f"{what}: {chosen[key].name} ({chosen[key].sources[0]}) and {v.name} ({v.sources[0]}); "
                            "allowed: one")
        else:
            chosen[key] = v
    if problems:
        raise ConfigError(problems)
    out = sorted(by_name.values(), key=lambda v: v.name)
    _add_tuned(project, out, warn or (lambda msg: warnings.warn(msg, TuneTableWarning, stacklevel=3)))
    return out


def _tile_text(tile: dict) -> str:
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in tile.items()) + "}"


def _add_tuned(project, variants: list[Variant], warn) -> None:
    """Put every variant a tune table of ``project`` names into the default build set (the rule of
    the module docstring); ``warn`` each table problem and each tile no config makes."""
    by_config = {v.name for v in variants if v.default_build}
    for path in tunetable.table_files(project.configs_dir):
        label = project.rel(path)
        data, problems = tunetable.read_table(path, label)
        if problems:
            warn(f"{label}: invalid tune table: none of its tiles joins the default build (the runtime ignores the "
                 "whole table too):\n  " + "\n  ".join(problems))
            continue
        for where, family, key, tile in tunetable.named_tiles(data):
            like = next((v for v in variants if v.family == family and v.dispatch == key and v.default), None)
            v = tunetable.pick_variant(variants, family, key, tile, like)  # the runtime's choice among built ones
            if v is not None:
                v.sources.append(f"{label}: {where}")
                if v.name not in by_config:  # in the default set because of this table
                    v.default_build = True
                    if path.stem not in v.tuned:
                        v.tuned.append(path.stem)
                continue
            what = f"{label}: {where}.tile = {_tile_text(tile)}"
            if family not in families.names():
                why = f"family {_fmt(family)} is not a family (allowed: {', '.join(families.names())})"
            else:
                fam = families.get(family)
                unknown = [k for k in tile if k not in fam.names()]
                same_key = [v for v in variants if v.family == family and v.dispatch == key]
                ctx = f"{family} {', '.join(f'{k}={_fmt(x)}' for k, x in key.items())}"
                if unknown:
                    why = f"{', '.join(map(repr, unknown))}: not a key of {family} (allowed: {', '.join(fam.names())})"
                elif not same_key:
                    why = f"no config makes a variant of {ctx}"
                else:
                    why = (f"no config makes {ctx} with this tile (the key has {len(same_key)} configured "
                           "tile(s); `flashgen list --all` lists them)")
            warn(f"{what}: {why}; it cannot join the default build and the runtime serves the default tile "
                 "there instead; allowed: a configured tile (add it, e.g. as a `candidates:` row), or re-run "
                 "`flashgen tune`")


def select(variants: list[Variant], pattern: str | None = None, all_: bool = False) -> list[Variant]:
    """The default build set (every variant with ``all_``), narrowed by a name glob.

    The default set is the variants marked ``default_build``: those of ``default_build: true``
    files and those a tune table names (:func:`load_variants`; module docstring).

    ``pattern`` is one or more comma-separated fnmatch globs; a pattern without wildcards matches
    as a substring."""
    pool = [v for v in variants if all_ or v.default_build]
    if pattern:
        pats = [p if any(c in p for c in "*?[") else f"*{p}*" for p in pattern.split(",") if p]
        pool = [v for v in pool if any(fnmatch.fnmatchcase(v.name, p) for p in pats)]
    return pool
