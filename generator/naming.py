"""Canonical parameters, variant names and kernel symbols.

A name spells out every parameter and ends in an 8-hex hash of the canonical parameters, e.g.
``fwd_bf16_hd128_causal_m128n128_s2_wg2_pp_ov_ps_1a2b3c4d``; off knobs read ``nopp`` / ``noov`` /
``nops``; ``hd192v128`` when head_dim_v differs. The name is for people and file names only:
the manifest records the parameters explicitly and nothing ever parses a name.
"""
from __future__ import annotations

import hashlib
import json

# CONTRACTS.md §1, in this order
PARAM_KEYS = (
    "family", "dtype", "head_dim", "head_dim_v", "causal", "block_m", "block_n", "stages",
    "consumer_wgs", "pingpong", "overlap", "persistent",
)
INT_KEYS = frozenset({"head_dim", "head_dim_v", "block_m", "block_n", "stages", "consumer_wgs"})
BOOL_KEYS = frozenset({"causal", "pingpong", "overlap", "persistent"})
STR_KEYS = frozenset({"family", "dtype"})


def canonical_params(params: dict) -> dict:
    """The params with exactly the §1 keys, in §1 order, as plain int/bool/str."""
    out = {}
    for k in PARAM_KEYS:
        v = params[k]
        out[k] = bool(v) if k in BOOL_KEYS else int(v) if k in INT_KEYS else str(v)
    return out


def params_hash(params: dict) -> str:
    blob = json.dumps(canonical_params(params), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def variant_name(params: dict) -> str:
    p = canonical_params(params)
    hd = f"hd{p['head_dim']}" + (f"v{p['head_dim_v']}" if p["head_dim_v"] != p["head_dim"] else "")
    parts = [
        p["family"], p["dtype"], hd, "causal" if p["causal"] else "noncausal",
        f"m{p['block_m']}n{p['block_n']}", f"s{p['stages']}", f"wg{p['consumer_wgs']}",
        "pp" if p["pingpong"] else "nopp", "ov" if p["overlap"] else "noov",
        "ps" if p["persistent"] else "nops", params_hash(p)[:8],
    ]
    return "_".join(parts)


def symbol_for(name: str) -> str:
    """The extern "C" kernel symbol of a variant (a valid C identifier)."""
    return "flashgen_" + name
