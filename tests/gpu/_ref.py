"""References shared by the tests (GPU and CPU): float32 attention, FA3's error rule, the float64 combine."""

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
    """FA3's forward test rule: max|out-ref| <= factor*max|out_pt-ref| + 2*rounding noise of ref."""
    err = (out.float() - ref.float()).abs().max().item()
    base = (out_lowprec.float() - ref.float()).abs().max().item()
    noise = ((ref + 0.3 - 0.3) - ref).abs().max().item()
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
