"""Canonical parameters, variant names and kernel symbols (generic over families).

A name is the family, the family's readable name parts and an 8-hex hash of the canonical
parameters, e.g. ``fwd_bf16_hd128_causal_m128n128_s2_wg2_pp_ov_ps_1a2b3c4d``. The name is for
people and file names only: the manifest records the parameters explicitly and nothing ever
parses a name. Kernel symbols are ``flashgen_<name>_<role>``.
"""
from __future__ import annotations

import hashlib
import json

from . import families


def canonical_params(params: dict) -> dict:
    """The params with exactly the family's keys, in its canonical order, as plain int/bool/str (an
    axis with a default, e.g. fwd's softcap, may be left out)."""
    fam = families.get(params["family"])
    out = {"family": fam.name}
    for k in fam.keys:
        v = params[k.name] if k.name in params or k.role != "axis" or k.default is None else k.default
        out[k.name] = k.type(v)
    return out


def params_hash(params: dict) -> str:
    blob = json.dumps(canonical_params(params), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def variant_name(params: dict) -> str:
    p = canonical_params(params)
    fam = families.get(p["family"])
    return "_".join([fam.name, *fam.name_parts(p), params_hash(p)[:8]])


def symbol_for(name: str, role: str) -> str:
    """The extern "C" symbol of a variant's kernel (a valid C identifier)."""
    return f"flashgen_{name}_{role}"
