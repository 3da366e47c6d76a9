"""Choosing the compiled variant for a call.

A call is served by a variant whose (family, dtype, head_dim, head_dim_v, causal) match exactly.
Among several (e.g. ablation builds or points added with `flashgen add-variant`), the one marked
`default` in the manifest wins: it is the choice of the tile table in configs/fwd.yaml
(`tiles:`), recorded by the generator. Otherwise the variant added most specifically wins
deterministically (sorted by name).
"""

from __future__ import annotations

from .manifest import Manifest, Variant, load_manifest


class MissingVariantError(LookupError):
    """No built variant serves the request; the message names it and the command that builds it."""


def suggest_tile(head_dim: int, causal: bool) -> tuple[int, int]:
    """(block_m, block_n) a new variant would start from (FA3's published tiles, DESIGN.md §4)."""
    if head_dim <= 64:
        return 192, 128
    if head_dim <= 128:
        return (128, 128) if causal or head_dim <= 96 else (128, 176)
    if head_dim <= 192:
        return 128, 112
    return 128, 80


def add_variant_command(dtype: str, head_dim: int, head_dim_v: int, causal: bool) -> str:
    bm, bn = suggest_tile(max(head_dim, head_dim_v), causal)
    cmd = f"flashgen add-variant --dtype {dtype} --head-dim {head_dim}"
    if head_dim_v != head_dim:
        cmd += f" --head-dim-v {head_dim_v}"
    cmd += " --causal" if causal else ""
    cmd += f" --block-m {bm} --block-n {bn} --consumer-wgs {bm // 64}"
    return cmd


def select_variant(dtype: str, head_dim: int, head_dim_v: int, causal: bool, seqlen_q: int = 0, seqlen_k: int = 0,
                   manifest: Manifest | None = None, family: str = "fwd") -> Variant:
    """The variant serving (dtype, head_dim, head_dim_v, causal); MissingVariantError if none is built.

    seqlen_q / seqlen_k are accepted for shape-dependent choices; the current tile table has one
    tile per (head_dim, dtype, causal), so they do not change the answer yet.
    """
    m = manifest or load_manifest()
    cands = m.by_key().get((family, dtype, int(head_dim), int(head_dim_v), bool(causal)))
    if not cands:
        built = sorted({(v.params["dtype"], v.params["head_dim"], bool(v.params["causal"])) for v in m.variants})
        built_s = ", ".join(f"{d}/hd{h}/{'causal' if c else 'noncausal'}" for d, h, c in built) or "none"
        raise MissingVariantError(
            f"flashgen: no built {family} variant serves dtype={dtype} head_dim={head_dim} head_dim_v={head_dim_v} "
            f"causal={causal} (built: {built_s}; manifest {m.path}). "
            f"Build it with: {add_variant_command(dtype, head_dim, head_dim_v, causal)}"
        )
    defaults = [v for v in cands if v.default]
    return min(defaults or cands, key=lambda v: v.name)
