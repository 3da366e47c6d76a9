"""Choosing the compiled variant for a call (generic over families).

A call names its family and its dispatch key (the family module's ``dispatch_keys``, e.g. dtype,
head_dim, head_dim_v and causal for ``fwd``; the manifest records each variant's key). A variant
whose key matches exactly serves it. Among several (ablation builds, points added with
`flashgen add-variant`), the one marked ``default`` in the manifest wins: it is the tile table's
choice (``tiles:`` in the family's config), recorded by the generator. Otherwise the first by
name wins, deterministically.

Head dims round up: a family names the dispatch keys a larger built value also serves (``round_up``
of :func:`select_variant`; the fwd and bwd kernels pad head dims with TMA's zero fill, as FA3
serves any head_dim <= 256 by the next compiled size). Without an exact match, the smallest built
sizes that cover the call serve it.
"""

from __future__ import annotations

from .generator.families import full_key  # noqa: F401 -- re-exported: keys with defaults filled in
from .manifest import Manifest, Variant, load_manifest


class MissingVariantError(LookupError):
    """No built variant serves the request; the message names it and the command that builds it."""


def _fmt(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def add_variant_command(family: str, key: dict) -> str:
    """The `flashgen add-variant` command that builds a variant serving ``key`` (the family
    module suggests the tile; without the generator installed, the key alone)."""
    try:
        from .generator import families

        point = families.get(family).suggest(dict(key))
    except Exception:  # noqa: BLE001 -- a hint only; never mask the real error
        point = dict(key)
    opts = []
    for k, v in point.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            opts.append(flag if v else f"--no-{k.replace('_', '-')}")
        else:
            opts.append(f"{flag} {v}")
    return f"flashgen add-variant {family} " + " ".join(opts)


def select_variant(family: str, key: dict, manifest: Manifest | None = None, round_up: tuple = ()) -> Variant:
    """The built variant of ``family`` whose dispatch key equals ``key`` (keys with a default may
    be left out: :func:`full_key`); MissingVariantError (naming the key, what is built
    and the command that builds it) if there is none.

    ``round_up``: keys (e.g. ``("head_dim", "head_dim_v")``) for which a variant built for a larger
    value also serves; without an exact match the candidate with the smallest sum of those keys
    wins (then the tile table's choice, then the name)."""
    m = manifest or load_manifest()
    asked, key = key, full_key(family, key)
    cands = m.by_key().get((family, *sorted(key.items())))
    if not cands and round_up:
        fixed = {k: x for k, x in key.items() if k not in round_up}

        def covers(v: Variant) -> bool:
            d = v.dispatch
            return (v.family == family and all(d.get(k) == x for k, x in fixed.items())
                    and all(isinstance(d.get(k), int) and d[k] >= key[k] for k in round_up if k in key))

        covering = [v for v in m.variants if covers(v)]
        if covering:
            size = min(sum(v.dispatch[k] for k in round_up if k in key) for v in covering)
            cands = [v for v in covering if sum(v.dispatch[k] for k in round_up if k in key) == size]
    if not cands:
        built = sorted({", ".join(f"{k}={_fmt(x)}" for k, x in v.dispatch.items())
                        for v in m.variants if v.family == family})
        want = ", ".join(f"{k}={_fmt(x)}" for k, x in asked.items())
        raise MissingVariantError(
            f"flashgen: no built {family} variant serves {want} "
            f"(built {family} variants: {'; '.join(built) or 'none'}; manifest {m.path}). "
            f"Build it with: {add_variant_command(family, asked)}"
        )
    defaults = [v for v in cands if v.default]
    return min(defaults or cands, key=lambda v: v.name)
