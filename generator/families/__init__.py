"""Kernel families: one small module each, the only code that knows a family.

A family module (``generator/families/<name>.py``) defines a :class:`Family` subclass instance
named ``FAMILY``. It declares the family's parameter keys (axes of the config matrix, tile keys,
knobs, derived keys), its feasibility rules, the resources and shared-memory layout its template
needs, its name parts, the kernels a variant contains (role, threads, cluster, dynamic shared
memory, tensor maps, params struct) and its dispatch key. The config loader, renderer, builder,
manifest writer, loader and launcher are generic and call these hooks (docs/CONTRACTS.md §1).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from ..abi import ParamsStruct

ROLES = ("axis", "tile", "knob", "derived")


@dataclass(frozen=True)
class Key:
    """One parameter of a family's variants.

    role: ``axis`` (a config-matrix axis and part of what a call matches), ``tile`` (given by a
    ``tiles:`` row or an explicit point), ``knob`` (tuning switch with a default), ``derived``
    (computed by :meth:`Family.derive` unless a point sets it). ``allowed`` lists the legal values,
    or ``check`` returns None for a legal value and the text of what is allowed otherwise."""

    name: str
    type: type  # int, bool or str
    role: str
    allowed: tuple | None = None
    check: Callable | None = None
    default: object = None  # knobs; an axis with a default may be left out of a config
    doc: str = ""

    def problem(self, value) -> str | None:
        """What is allowed, if ``value`` (already of the right type) is not; else None."""
        if self.allowed is not None and value not in self.allowed:
            return ", ".join(_fmt(v) for v in self.allowed)
        if self.check is not None:
            return self.check(value)
        return None


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a variant, as the launcher needs it (recorded in the manifest)."""

    role: str
    threads: int
    smem_bytes: int  # dynamic shared memory the launch requests
    params: ParamsStruct
    tensor_maps: tuple = ()  # names of the CUtensorMap parameters, in order, before the params struct
    cluster: tuple = (1, 1, 1)
    sass: tuple = ()  # opcodes its SASS must contain (e.g. HGMMA: not the slow HMMA path)
    # Launched as a programmatic dependent of the kernel before it on the stream (PDL: it may start
    # once every CTA of that one has run griddepcontrol.launch_dependents or exited); each of its
    # threads that reads that kernel's output runs griddepcontrol.wait first (docs/CONTRACTS.md §4).
    pdl: bool = False


@dataclass
class Family:
    """Base of every family module's ``FAMILY``; subclasses fill in the hooks."""

    name: str
    keys: tuple  # of Key, in canonical order (after "family")
    tile_match: tuple = ()  # axes a `tiles:` row may be keyed by, most significant first
    tile_required: tuple = ()  # keys every `tiles:` row must give
    dispatch_keys: tuple = ()  # the keys a call is matched on (the manifest's "dispatch")
    doc: str = ""
    _by_name: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_name = {k.name: k for k in self.keys}
        for k in self.keys:
            assert k.role in ROLES, (self.name, k)

    # -- schema ------------------------------------------------------------------------
    @property
    def template(self) -> str:
        return f"{self.name}.cu.j2"

    def key(self, name: str) -> Key | None:
        return self._by_name.get(name)

    def names(self, *roles) -> tuple:
        return tuple(k.name for k in self.keys if not roles or k.role in roles)

    @property
    def param_keys(self) -> tuple:
        """Canonical parameter order: family, then the declared keys."""
        return ("family",) + self.names()

    def knob_defaults(self) -> dict:
        return {k.name: k.default for k in self.keys if k.role == "knob"}

    def dispatch_defaults(self) -> dict:
        """The dispatch keys a request (a call's key, a tune table's entry) may leave out: those
        with a default (e.g. fwd's ``pack_gqa``: False)."""
        return {k: self._by_name[k].default for k in self.dispatch_keys
                if k in self._by_name and self._by_name[k].default is not None}

    # -- hooks -------------------------------------------------------------------------
    def derive(self, params: dict) -> dict:
        """Fill derived keys a point left out (default: none)."""
        return params

    def problems(self, params: dict) -> list:
        """Every reason the point cannot be built: ``[(key, value, what is allowed)]``."""
        return []

    def resources(self, params: dict) -> dict:
        """Derived numbers the template receives (must include ``smem`` and ``smem_bytes``)."""
        return {"smem": {}, "smem_bytes": 0}

    def kernels(self, params: dict, resources: dict) -> list:
        """The variant's kernels (list of KernelSpec)."""
        raise NotImplementedError

    def name_parts(self, params: dict) -> list:
        """Readable parts of the variant name (after the family name, before the hash)."""
        return [str(params[k]) for k in self.names()]

    def dispatch(self, params: dict) -> dict:
        """The manifest's dispatch record: what a call must match."""
        return {k: params[k] for k in self.dispatch_keys}

    def suggest(self, key: dict) -> dict:
        """A buildable point (all non-derived keys) serving dispatch ``key``; for error messages.
        Default: the key with every knob at its default."""
        return {**key, **self.knob_defaults()}


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, str) else str(v)


@functools.lru_cache(maxsize=None)
def names() -> tuple:
    """Every family (the modules of this package; listed once per process)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def get(name: str) -> Family:
    """The family called ``name``; KeyError naming the known ones."""
    if name not in names():
        raise KeyError(f"unknown family {name!r}; known: {', '.join(names())}")
    return importlib.import_module(f"{__name__}.{name}").FAMILY


def full_key(family: str, key: dict) -> dict:
    """A request's dispatch key (a call's, a tune table entry's) with the keys it may leave out
    (:meth:`Family.dispatch_defaults`, e.g. fwd's pack_gqa: False, which tables written before it
    lack) filled in; as given for an unknown family."""
    try:
        return {**key, **{k: x for k, x in get(family).dispatch_defaults().items() if k not in key}}
    except KeyError:
        return dict(key)
