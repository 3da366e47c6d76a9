"""References shared by the tests (GPU and CPU): float32 attention and its gradients, FA3's error
rule, the float64 combine, random inputs, bitwise comparison and allocator poisoning."""

from __future__ import annotations

import math

import torch


def attention_ref(q, k, v, causal: bool, softmax_scale: float, upcast: bool = True):
    """softmax(scale q k^T + bottom-right causal mask) v, and the row logsumexp (natural log).

    upcast=True computes in float32 on upcast inputs; upcast=False computes in the input dtype
    (FA3's `out_pt` baseline). GQA/MQA: k/v heads are repeated to q's heads.
    Returns (out in q's dtype, lse float32 (batch, heads, seqlen_q)).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    h, hk = q.shape[2], k.shape[2]
    if h != hk:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    sq, sk = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q * softmax_scale, k)
    if causal:
        row = torch.arange(sq, device=q.device).view(-1, 1)
        col = torch.arange(sk, device=q.device).view(1, -1)
        scores = scores.masked_fill(col > row + sk - sq, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    attn = torch.softmax(scores, dim=-1)
    attn = torch.nan_to_num(attn, nan=0.0)  # rows with nothing to attend to give 0
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out.to(dtype), lse


def fa3_rule_ok(out, ref, out_lowprec, factor: float = 2.0):
    """FA3's forward test rule: max|out-ref| <= factor*max|out_pt-ref| + 2*rounding noise of ref.

    The noise is FA3's ``(ref + 0.3 - 0.3) - ref`` as CUDA evaluates it for a half-precision
    ref: each op in float32 with the scalar kept in float32, the result rounded to ref's dtype
    (so it is about half an ulp of 0.3 + |ref| even where ref is 0). Spelled out here so that it
    is the same on the CPU, where torch would round the scalar 0.3 to ref's dtype first."""
    err = (out.float() - ref.float()).abs().max().item()
    base = (out_lowprec.float() - ref.float()).abs().max().item()
    dt = ref.dtype
    noise = ((((ref.float() + 0.3).to(dt).float() - 0.3).to(dt).float() - ref.float())).abs().max().item()
    return err <= factor * base + 2 * noise + 1e-6, err, base


def combine_ref(out_partial, lse_partial):
    """float64 merge of split-KV partials on the upcast inputs: (out (b, s, h, d), lse (b, s, h)).
    Splits with L_s = -inf get weight 0 and their partials are not used (even NaN ones);
    rows with every split -inf give (0, -inf)."""
    op, lp = out_partial.double(), lse_partial.double()
    m = lp.amax(0)
    shift = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w = torch.exp(lp - shift)
    total = w.sum(0)
    lse = torch.where(total > 0, shift + torch.log(total), torch.full_like(total, -math.inf))
    scale = torch.where(total > 0, w / total, torch.zeros_like(w))[..., None]
    out = torch.where(scale != 0, scale * op, torch.zeros_like(op)).sum(0)
    return out, lse


def check_fwd(q, k, v, causal: bool, out, lse, softmax_scale: float | None = None) -> None:
    """Assert a forward's (out, lse) against the float32 reference on upcast inputs: FA3's rule for
    out, lse -inf exactly where the reference's is and within 2e-3 elsewhere."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ref, lse_ref = attention_ref(q, k, v, causal, scale, upcast=True)
    pt, _ = attention_ref(q, k, v, causal, scale, upcast=False)
    ok, err, base = fa3_rule_ok(out, ref, pt)
    assert ok, f"max|out - ref| = {err:.3e} > 2 x the low-precision baseline's {base:.3e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf pattern differs from the reference"
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-4)


# --------------------------------------------------------------------------------------
# Backward: reference gradients, FA3's rule on dQ/dK/dV, inputs, poisoning
# --------------------------------------------------------------------------------------

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def randn(*shape, dtype=torch.bfloat16, seed: int = 0, outliers: bool = False, device="cuda"):
    """N(0, 1) drawn in float32 from a generator seeded with ``seed`` on ``device``, rounded to
    ``dtype``. outliers=True adds N(0, 100) to a Bernoulli(1e-3) subset of the elements (a few
    large values, as test_fwd_gpu's inputs with outliers). Never zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    if outliers:
        mask = torch.rand(*shape, generator=g, device=device) < 1e-3
        x = x + mask * torch.randn(*shape, generator=g, device=device) * 10.0
    return x.to(dtype)


def make_qkv(b, sq, sk, h, hk, d, dtype, seed: int = 0, outliers: bool = False, device="cuda"):
    """Random q ``(b, sq, h, d)``, k and v ``(b, sk, hk, d)`` of ``dtype`` (contiguous BSHD; see
    :func:`randn`), each from its own seed so q, k and v differ."""
    return (randn(b, sq, h, d, dtype=dtype, seed=seed, outliers=outliers, device=device),
            randn(b, sk, hk, d, dtype=dtype, seed=seed + 1, outliers=outliers, device=device),
            randn(b, sk, hk, d, dtype=dtype, seed=seed + 2, outliers=outliers, device=device))


def attention_grads_ref(q, k, v, dout, causal: bool, softmax_scale: float, upcast: bool = True):
    """(dq, dk, dv) of :func:`attention_ref`'s output for the incoming gradient ``dout``, by
    autograd, exactly as FA3's hopper/test_flash_attn.py forms dq_ref / dq_pt: the leaves are
    q, k, v in their own dtype (fp16/bf16), so with upcast=True the whole computation runs in
    float32 on the upcast inputs and each gradient is rounded to the input dtype once, at the
    end; upcast=False computes everything in the input dtype (FA3's PyTorch baseline ``_pt``).
    GQA/MQA: dk, dv are summed over the query heads sharing a key head (repeat_interleave's
    backward). Shapes and dtypes are those of q, k, v; rows that see no key get dq = 0."""
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        out, _ = attention_ref(*leaves, causal, softmax_scale, upcast=upcast)
        return torch.autograd.grad(out, leaves, dout)


def check_bwd(q, k, v, dout, causal: bool, grads, softmax_scale: float | None = None, factor: float = 2.0):
    """Assert flashgen's gradients ``grads = (dq, dk, dv)`` of attention(q, k, v) for ``dout``
    against the float32 reference with FA3's rule (hopper/test_flash_attn.py, gradients):
    ``max|dx - dx_ref| <= 2 max|dx_pt - dx_ref| + 2 max|(dx_ref + 0.3 - 0.3) - dx_ref| + 1e-6``
    for dx in dq, dk, dv, with dx_ref from :func:`attention_grads_ref` (upcast) and dx_pt from
    the same in the input dtype. Also: each gradient has its input's shape and dtype and holds
    no NaN / inf (outputs handed in NaN-poisoned must be fully written). ``grads`` may be a dict
    name -> (dq, dk, dv) to check several results against one reference (computed once)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    ref = attention_grads_ref(q, k, v, dout, causal, scale, upcast=True)
    pt = attention_grads_ref(q, k, v, dout, causal, scale, upcast=False)
    results = grads if isinstance(grads, dict) else {"flashgen": grads}
    for label, got in results.items():
        for name, x, g, r, p in zip(("dq", "dk", "dv"), (q, k, v), got, ref, pt):
            assert g.shape == x.shape and g.dtype == x.dtype, (
                f"{label}: {name} is {tuple(g.shape)} {g.dtype}, its input {tuple(x.shape)} {x.dtype}")
            bad = (~torch.isfinite(g)).sum().item()
            assert bad == 0, f"{label}: {name} has {bad} NaN/inf elements (not written, or a NaN/inf leaked)"
            ok, err, base = fa3_rule_ok(g, r, p, factor)
            assert ok, (f"{label}: max|{name} - {name}_ref| = {err:.3e} > {factor} x the low-precision "
                        f"baseline's {base:.3e} + noise")


def bitwise_equal(a, b) -> bool:
    """True when a and b have the same shape and dtype and identical bits element by element
    (unlike torch.equal, NaN payloads and the sign of zero count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def poison_cached_blocks(nbytes: int, device="cuda") -> None:
    """Leave NaN in torch's caching allocator: a block of max(nbytes, 2 MiB) (large pool) and one
    of 1 MiB (small pool) are filled with float32 NaN on the current stream and freed, so that
    scratch memory the code under test takes from torch right after (e.g. a float32 dQ
    accumulator) starts as NaN, not as the zeros of fresh memory: one left uninitialised shows
    in the result. Best effort: the allocator may hand out other blocks."""
    for n in (1 << 20, max(int(nbytes), 2 << 20)):
        torch.full((n // 4,), float("nan"), dtype=torch.float32, device=device)


def variant_missing(family: str, key: dict):
    """None when a built variant of ``family`` serves the dispatch key ``key``, else why not: a
    skip reason starting ``MISSING-<FAMILY>-VARIANT`` (or saying there is no kernel manifest).

    flashgen.dispatch.select_variant decides; should the family's dispatch key hold more fields
    than ``key`` gives, a built variant whose key contains all of ``key``'s items serves too."""
    from flashgen.dispatch import MissingVariantError, select_variant
    from flashgen.manifest import load_manifest

    try:
        select_variant(family, key)
        return None
    except MissingVariantError as e:
        err = e
    except Exception as e:  # noqa: BLE001 -- no manifest at all
        return f"no kernel manifest ({e}); run flashgen build"
    if any(v.family == family and all(v.dispatch.get(n) == x for n, x in key.items())
           for v in load_manifest().variants):
        return None
    return f"MISSING-{family.upper()}-VARIANT {key}: select_variant raised MissingVariantError: {err}"
