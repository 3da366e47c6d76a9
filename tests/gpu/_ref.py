"""References shared by the tests (GPU and CPU): float32 attention and its gradients, FA3's error
rule, the float64 combine, random inputs, bitwise comparison and allocator poisoning."""

from __future__ import annotations

import math

import torch


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), device=None,
                 attention_chunk: int = 0):
    """FA3's mask (hopper/flash_api.cpp; test_util.construct_local_mask), bottom-right aligned:
    bool ``(seqlen_q, seqlen_k)``, True where query row i sees key j, i.e.
    ``i + sk - sq - left <= j <= i + sk - sq + right`` with ``window_size = (left, right)``; a side
    of -1 (any negative) or None is unbounded; ``causal`` forces right = 0 (so causal with
    (left, -1) is the causal sliding window). ``attention_chunk`` C > 0 (FA3's
    test_util.construct_chunk_mask) also keeps row i to the keys of its chunk:
    ``c <= j < c + C`` with ``c = (i + sk - sq) - (i + sk - sq) mod C`` (floor mod: a row before the
    first key position has a chunk of negative keys, so it sees none). None when nothing is masked."""
    left, right = (-1 if x is None else int(x) for x in window_size)
    if causal:
        right = 0
    if left < 0 and right < 0 and not attention_chunk:
        return None
    row = torch.arange(seqlen_q, device=device).view(-1, 1)
    col = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = row + seqlen_k - seqlen_q
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        vis &= col <= diag + right
    if left >= 0:
        vis &= col >= diag - left
    if attention_chunk:
        start = diag - torch.remainder(diag, attention_chunk)
        vis &= (col >= start) & (col < start + attention_chunk)
    return vis


def attention_ref(q, k, v, causal: bool, softmax_scale: float, upcast: bool = True, *,
                  window_size=(-1, -1), softcap: float = 0.0, sink=None, attention_chunk: int = 0):
    """softmax(logits + mask) v, and the row logsumexp (natural log).

    logits = scale q k^T, or with ``softcap`` c > 0 ``c * tanh(scale q k^T / c)`` (FA3, Gemma 2;
    before masking). Mask: :func:`visible_mask` of ``causal``, ``window_size`` and
    ``attention_chunk`` (FA3's semantics, bottom-right aligned). ``sink``: None or float32 ``(heads,)`` learnable sink logits
    (gpt-oss; FA3's ``learnable_sink``) in the units of the final logits: a column of them is
    concatenated to the logits before the softmax and dropped after (gpt-oss's reference), so
    each row's denominator gets exp(sink_h) and lse includes it.

    upcast=True computes in float32 on upcast inputs; upcast=False computes in the input dtype
    (FA3's `out_pt` baseline, as hopper/test_util.attention_ref: scores and softcap's tanh in the
    input dtype; with a sink the softmax runs in float32, as FA3's). GQA/MQA: k/v heads are
    repeated to q's heads. Rows that see no key: out 0, lse -inf (with a sink: its logit).
    Returns (out in q's dtype, lse float32 (batch, heads, seqlen_q)).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    h, hk = q.shape[2], k.shape[2]
    if h != hk:
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q * softmax_scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    vis = visible_mask(sq, sk, causal, window_size, device=q.device, attention_chunk=attention_chunk)
    if vis is not None:
        scores = scores.masked_fill(~vis, float("-inf"))
    if sink is None:
        lse = torch.logsumexp(scores.float(), dim=-1)
        attn = torch.softmax(scores, dim=-1)
    else:
        logits = torch.cat([scores.float(), sink.float().view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        attn = torch.softmax(logits, dim=-1)[..., :-1]
    attn = torch.nan_to_num(attn, nan=0.0)  # rows with nothing to attend to give 0
    out = torch.einsum("bhqk,bkhd->bqhd", attn.to(v.dtype), v)
    return out.to(dtype), lse


def fa3_rule_ok(out, ref, out_lowprec, factor: float = 2.0, *, atol: float = 0.0):
    """FA3's forward test rule: max|out-ref| <= factor*max|out_pt-ref| + 2*rounding noise of ref
    (+ ``atol``: FA3 adds 3e-4 to the gradients' bound under softcap).

    The noise is FA3's ``(ref + 0.3 - 0.3) - ref`` as CUDA evaluates it for a half-precision
    ref: each op in float32 with the scalar kept in float32, the result rounded to ref's dtype
    (so it is about half an ulp of 0.3 + |ref| even where ref is 0). Spelled out here so that it
    is the same on the CPU, where torch would round the scalar 0.3 to ref's dtype first."""
    err = (out.float() - ref.float()).abs().max().item()
    base = (out_lowprec.float() - ref.float()).abs().max().item()
    dt = ref.dtype
    noise = ((((ref.float() + 0.3).to(dt).float() - 0.3).to(dt).float() - ref.float())).abs().max().item()
    return err <= factor * base + 2 * noise + atol + 1e-6, err, base


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


def lse_atol(softcap: float = 0.0) -> float:
    """Tolerance of a kernel's lse against the float32 reference: 2e-3, plus softcap * 2^-10 under
    softcap (the kernels' tanh is PTX tanh.approx.f32, relative error about 2^-11, so each logit
    c * tanh(.) may be off by c * 2^-11; twice that as margin)."""
    return 2e-3 + (softcap * 2.0 ** -10 if softcap > 0 else 0.0)


def check_fwd(q, k, v, causal: bool, out, lse, softmax_scale: float | None = None, *,
              window_size=(-1, -1), softcap: float = 0.0, sink=None, factor: float | None = None,
              attention_chunk: int = 0) -> None:
    """Assert a forward's (out, lse) against the float32 reference on upcast inputs: FA3's rule for
    out (factor 2, or 3 under softcap as in FA3's tests; ``factor`` overrides), no NaN in out,
    lse -inf exactly where the reference's is and within :func:`lse_atol` elsewhere.
    ``window_size``, ``softcap``, ``sink``, ``attention_chunk``: as :func:`attention_ref`."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    feats = dict(window_size=window_size, softcap=softcap, sink=sink, attention_chunk=attention_chunk)
    factor = factor if factor is not None else (3.0 if softcap > 0 else 2.0)
    ref, lse_ref = attention_ref(q, k, v, causal, scale, upcast=True, **feats)
    pt, _ = attention_ref(q, k, v, causal, scale, upcast=False, **feats)
    nan = int(torch.isnan(out).sum())
    assert nan == 0, f"out has {nan} NaN elements (not written, or a NaN leaked)"
    ok, err, base = fa3_rule_ok(out, ref, pt, factor)
    assert ok, f"max|out - ref| = {err:.3e} > {factor} x the low-precision baseline's {base:.3e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf pattern differs from the reference"
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=lse_atol(softcap), rtol=1e-4)


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


def attention_grads_ref(q, k, v, dout, causal: bool, softmax_scale: float, upcast: bool = True, *,
                        window_size=(-1, -1), softcap: float = 0.0, sink=None, attention_chunk: int = 0):
    """(dq, dk, dv) of :func:`attention_ref`'s output for the incoming gradient ``dout``, by
    autograd, exactly as FA3's hopper/test_flash_attn.py forms dq_ref / dq_pt: the leaves are
    q, k, v in their own dtype (fp16/bf16), so with upcast=True the whole computation runs in
    float32 on the upcast inputs and each gradient is rounded to the input dtype once, at the
    end; upcast=False computes everything in the input dtype (FA3's PyTorch baseline ``_pt``).
    GQA/MQA: dk, dv are summed over the query heads sharing a key head (repeat_interleave's
    backward). Shapes and dtypes are those of q, k, v; rows that see no key get dq = 0.

    ``window_size``, ``softcap``, ``attention_chunk``: as :func:`attention_ref`. With ``sink`` (float32 ``(heads,)``,
    a leaf too) the result is ``(dq, dk, dv, dsink)``, dsink float32 ``(heads,)``."""
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    if sink is not None:
        leaves += (sink.detach().float().requires_grad_(),)
    with torch.enable_grad():
        out, _ = attention_ref(*leaves[:3], causal, softmax_scale, upcast=upcast, window_size=window_size,
                               softcap=softcap, sink=leaves[3] if sink is not None else None,
                               attention_chunk=attention_chunk)
        return torch.autograd.grad(out, leaves, dout)


def dsink_noise(q, k, v, dout, causal: bool, softmax_scale: float, sink, *, window_size=(-1, -1),
                softcap: float = 0.0, attention_chunk: int = 0):
    """Per head, the size of the error dsink gets from out's rounding: float32 ``(heads,)``.

    dsink_h = -sum_rows exp(sink_h - lse) (dout . out), and a kernel forms it from its out in the
    input dtype, whose elements are off by about eps = finfo(dtype).eps relative, independently
    across the head dim and the rows; so the error has a standard deviation of about
    ``eps * sqrt(sum_rows (exp(sink - lse) |dout o out|_2)^2)`` (out, lse: the reference's)."""
    out, lse = attention_ref(q, k, v, causal, softmax_scale, upcast=True, window_size=window_size,
                             softcap=softcap, sink=sink, attention_chunk=attention_chunk)
    p = torch.exp(sink.float().view(1, -1, 1) - lse)  # (b, h, sq)
    row = (dout.float() * out.float()).pow(2).sum(-1).sqrt().transpose(1, 2)  # (b, h, sq)
    return torch.finfo(q.dtype).eps * (p * row).pow(2).sum((0, 2)).sqrt()


def check_bwd(q, k, v, dout, causal: bool, grads, softmax_scale: float | None = None, factor: float = 2.0, *,
              window_size=(-1, -1), softcap: float = 0.0, sink=None, attention_chunk: int = 0):
    """Assert flashgen's gradients ``grads = (dq, dk, dv)`` of attention(q, k, v) for ``dout``
    against the float32 reference with FA3's rule (hopper/test_flash_attn.py, gradients):
    ``max|dx - dx_ref| <= 2 max|dx_pt - dx_ref| + 2 max|(dx_ref + 0.3 - 0.3) - dx_ref| + 1e-6``
    for dx in dq, dk, dv, with dx_ref from :func:`attention_grads_ref` (upcast) and dx_pt from
    the same in the input dtype. Also: each gradient has its input's shape and dtype and holds
    no NaN / inf (outputs handed in NaN-poisoned must be fully written). ``grads`` may be a dict
    name -> (dq, dk, dv) to check several results against one reference (computed once).

    ``window_size``, ``softcap``, ``sink``, ``attention_chunk``: as :func:`attention_ref`; under softcap the bound gets
    FA3's + 3e-4. With ``sink``, each result may hold a 4th entry, dsink (float32 ``(heads,)``),
    checked per head: ``|dsink - dsink_ref| <= factor max|dsink_pt - dsink_ref| + 6 noise + 1e-5``
    with noise = :func:`dsink_noise` (a kernel's dsink comes from its rounded out: 6 standard
    deviations of that effect)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    feats = dict(window_size=window_size, softcap=softcap, sink=sink, attention_chunk=attention_chunk)
    ref = attention_grads_ref(q, k, v, dout, causal, scale, upcast=True, **feats)
    pt = attention_grads_ref(q, k, v, dout, causal, scale, upcast=False, **feats)
    atol = 3e-4 if softcap > 0 else 0.0
    results = grads if isinstance(grads, dict) else {"flashgen": grads}
    for label, got in results.items():
        for name, x, g, r, p in zip(("dq", "dk", "dv"), (q, k, v), got, ref, pt):
            assert g.shape == x.shape and g.dtype == x.dtype, (
                f"{label}: {name} is {tuple(g.shape)} {g.dtype}, its input {tuple(x.shape)} {x.dtype}")
            bad = (~torch.isfinite(g)).sum().item()
            assert bad == 0, f"{label}: {name} has {bad} NaN/inf elements (not written, or a NaN/inf leaked)"
            ok, err, base = fa3_rule_ok(g, r, p, factor, atol=atol)
            assert ok, (f"{label}: max|{name} - {name}_ref| = {err:.3e} > {factor} x the low-precision "
                        f"baseline's {base:.3e} + noise")
        if sink is not None and len(got) > 3:
            _check_dsink(label, got[3], ref[3], pt[3], factor,
                         dsink_noise(q, k, v, dout, causal, scale, sink, window_size=window_size, softcap=softcap,
                                     attention_chunk=attention_chunk))


def _check_dsink(label, ds, ds_ref, ds_pt, factor, noise) -> None:
    assert ds is not None, f"{label}: no dsink (the sink's gradient is None)"
    assert ds.shape == ds_ref.shape and ds.dtype == torch.float32, \
        f"{label}: dsink is {tuple(ds.shape)} {ds.dtype}, not {tuple(ds_ref.shape)} float32"
    assert bool(torch.isfinite(ds).all()), f"{label}: dsink has NaN/inf elements: {ds.tolist()}"
    err = (ds - ds_ref).abs()
    base = (ds_pt - ds_ref).abs().max().item()
    bound = factor * base + 6 * noise + 1e-5
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{label}: head {worst}: |dsink - dsink_ref| = {err[worst].item():.3e} > bound {bound[worst].item():.3e} "
        f"(dsink {ds[worst].item():.6g}, ref {ds_ref[worst].item():.6g}; low-precision baseline's max error "
        f"{base:.3e}, rounding noise {noise[worst].item():.3e})")


def bitwise_equal(a, b) -> bool:
    """True when a and b have the same shape and dtype and identical bits element by element
    (unlike torch.equal, NaN payloads and the sign of zero count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def first_difference(a, b) -> str:
    """Where two tensors of one shape differ: count, first index and the two values."""
    diff = a.float() != b.float()  # NaN counts as different from everything
    n = int(diff.sum())
    if not n:
        return "same values, different bits (signed zeros / NaN payloads)"
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return f"{n} elements differ, first at {idx}: {a[idx].item()!r} vs {b[idx].item()!r}"


def compiled_step_matches_eager(step, compiled, inputs, w, label: str) -> tuple:
    """Run a training step eagerly and compiled on fresh leaf copies of ``inputs`` (q, k, v first),
    backward both; assert the losses agree (rtol 1e-5, atol 1e-3) and dq, dk, dv are bitwise equal.
    Returns (eager leaves, compiled leaves) for further checks."""
    eager_leaves = [x.clone().requires_grad_() for x in inputs]
    comp_leaves = [x.clone().requires_grad_() for x in inputs]
    loss_e = step(*eager_leaves, w)
    loss_e.backward()
    loss_c = compiled(*comp_leaves, w)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-3)
    for name, a, b in zip(("dq", "dk", "dv"), comp_leaves, eager_leaves):
        assert a.grad is not None, f"compiled step gave no {name}"
        assert bitwise_equal(a.grad, b.grad), f"{label}: compiled {name} differs from eager: " \
                                              f"{first_difference(a.grad, b.grad)}"
    return eager_leaves, comp_leaves


def run_child_or_fail(call: str, timeout: float, hang: str) -> None:
    """Run ``call`` (Python source naming a test module of tests/gpu, e.g. ``"import test_fp8_gpu as t;
    t._repeat(30)"``) in a child interpreter under a time limit (seconds): a kernel that deadlocks
    fails the calling test with ``hang`` instead of hanging the suite; the child's failure fails it
    with the child's stderr."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    here = Path(__file__).resolve().parent
    child = f"import sys; sys.path[:0] = [{str(here)!r}]; {call}; print('ok')"
    try:
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{hang} (did not finish in {timeout:g} s)")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def poison_cached_blocks(nbytes: int, device="cuda") -> None:
    """Leave NaN in torch's caching allocator: a block of max(nbytes, 2 MiB) (large pool) and one
    of 1 MiB (small pool) are filled with float32 NaN on the current stream and freed, so that
    scratch memory the code under test takes from torch right after (e.g. a float32 dQ
    accumulator) starts as NaN, not as the zeros of fresh memory: one left uninitialised shows
    in the result. Best effort: the allocator may hand out other blocks."""
    for n in (1 << 20, max(int(nbytes), 2 << 20)):
        torch.full((n // 4,), float("nan"), dtype=torch.float32, device=device)


# Offsets that break FA3's varlen contract (three sequences of 5, 5 and 10 rows of q and k, max_seqlen_q 10 or 12),
# each with the fragment of the error that must name the argument: the host's ValueError, or the device-side assert
# of the no-host-read path (interface._check_offsets_on_device).
BAD_VARLEN_OFFSETS = [
    (dict(cu_q=[0, 5, 3, 20]), "cu_seqlens_q must start at 0, not decrease"),
    (dict(cu_k=[1, 5, 10, 20]), "cu_seqlens_k must start at 0"),
    (dict(cu_k=[0, 5, 10, 99]), "end at most at"),
    (dict(max_q=6), "max_seqlen_q is less than the longest sequence"),
    (dict(used_k=[5, 6, 11]), "seqused_k must be between 0 and each sequence's length"),
]


def varlen_launches(monkeypatch, entry: str) -> list:
    """Record each call of ``flashgen.core.<entry>`` (attention_forward or attention_backward) for the test: the
    returned list gets its ``varlen`` argument (None: not a varlen launch)."""
    import flashgen

    launches = []
    real = getattr(flashgen.core, entry)
    monkeypatch.setattr(flashgen.core, entry, lambda *a, **kw: launches.append(kw.get("varlen")) or real(*a, **kw))
    return launches


def varlen_kernels_on(monkeypatch) -> list:
    """Switch both varlen kernels on for the test (flashgen.core.VARLEN_KERNEL, VARLEN_BWD_KERNEL) and record each
    backward launch: a core.attention_backward call's ``varlen`` argument (:func:`varlen_launches`; None: not a
    varlen launch), and None for each prepared launch of the plain backward (core.launch_backward called by
    interface._bwd_impl itself, not from inside attention_backward)."""
    import flashgen

    core = flashgen.core
    monkeypatch.setattr(core, "VARLEN_KERNEL", True)
    monkeypatch.setattr(core, "VARLEN_BWD_KERNEL", True)
    launches = varlen_launches(monkeypatch, "attention_backward")
    spied, real = core.attention_backward, core.launch_backward
    inside = []  # attention_backward calls in progress (it launches through core.launch_backward)

    def attention_backward(*a, **kw):
        inside.append(True)
        try:
            return spied(*a, **kw)
        finally:
            inside.pop()

    def launch_backward(*a, **kw):
        if not inside:
            launches.append(None)
        return real(*a, **kw)

    monkeypatch.setattr(core, "attention_backward", attention_backward)
    monkeypatch.setattr(core, "launch_backward", launch_backward)
    return launches


def captured(call, rounds: int = 1, warmup=None):
    """``call()`` run ``rounds`` times on a side stream (kernels loaded, prepared launches cached), inside the context
    manager ``warmup`` when given (e.g. one that sets a seam so that the warm-up takes the path the capture takes), then
    captured in a CUDA graph: ``(graph, what the captured call returned)``."""
    import contextlib

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with warmup if warmup is not None else contextlib.nullcontext(), torch.cuda.stream(side):
        for _ in range(rounds):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = call()
    return graph, res


def variant_missing(family: str, key: dict, *, round_up: tuple = ()):
    """None when a built variant of ``family`` serves the dispatch key ``key``, else why not: a
    skip reason starting ``MISSING-<FAMILY>-VARIANT`` (or saying there is no kernel manifest).

    flashgen.dispatch.select_variant decides; should the family's dispatch key hold more fields
    than ``key`` gives, a built variant whose key contains all of ``key``'s items serves too.
    ``round_up``: keys (e.g. ``("head_dim", "head_dim_v")``) that a variant built for a larger
    value serves too (select_variant's ``round_up``, as the runtime dispatches head dims)."""
    from flashgen.dispatch import MissingVariantError, select_variant
    from flashgen.manifest import load_manifest

    try:
        if round_up:
            select_variant(family, key, round_up=tuple(round_up))
        else:
            select_variant(family, key)
        return None
    except MissingVariantError as e:
        err = e
    except Exception as e:  # noqa: BLE001 -- no manifest at all
        return f"no kernel manifest ({e}); run flashgen build"

    def serves(d: dict) -> bool:
        return all(d.get(n) == x or (n in round_up and isinstance(d.get(n), int) and d[n] >= x)
                   for n, x in key.items())

    if any(v.family == family and serves(v.dispatch) for v in load_manifest().variants):
        return None
    return f"MISSING-{family.upper()}-VARIANT {key}: select_variant raised MissingVariantError: {err}"


def dequantize_fp8(x8, descale, block: int = 64):
    """x8 (batch, seqlen, heads_x, head_dim) e4m3 times its descale, in float32: None (1), FA3's
    (batch, heads_k) (heads_x a multiple of heads_k: query head h uses column h // (heads_x /
    heads_k)), or block quantization's (batch, heads_x, ceil(seqlen / block)), one per `block` rows."""
    x = x8.float()
    if descale is None:
        return x
    b, s, hx, _ = x.shape
    d = descale.float()
    if d.dim() == 2:
        d = d.repeat_interleave(hx // d.shape[1], dim=1)  # (b, hx)
        return x * d[:, None, :, None]
    rows = d[:, :, torch.arange(s, device=d.device) // block]  # (b, hx, s)
    return x * rows.permute(0, 2, 1)[..., None]


# --------------------------------------------------------------------------------------
# KV cache (flashgen.flash_attn_with_kvcache): FA3's test_flash_attn_kvcache reference
# --------------------------------------------------------------------------------------

def rotate_half(x, interleaved):
    """FA3's rotary ``rotate_half``: (-x2, x1) over the two halves of the last dim, or over its even /
    odd pairs when ``interleaved``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_ref(x, cos, sin, pos, interleaved):
    """x (s, h, d) at positions pos (s,): FA3's apply_rotary_emb_torch form, in float32."""
    rd = 2 * cos.shape[1]
    c, s_ = cos[pos].float(), sin[pos].float()
    rep = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    c, s_ = rep(c)[:, None], rep(s_)[:, None]
    xr = x[..., :rd].float()
    return torch.cat(((xr * c + rotate_half(xr, interleaved) * s_).to(x.dtype), x[..., rd:]), dim=-1)


def logical_cache(kc, table, rows, batch):
    """Each entry's cache rows as (batch, positions, heads_k, d): rows of kc, or the table's pages."""
    if table is None:
        return kc[rows]
    return kc[table.long()].flatten(1, 2)


def kvcache_reference(q, k, v, kc, vc, table, lens, leftpad, rows, causal, window, rope=None, interleaved=True,
                      upcast=True, softcap: float = 0.0):
    """(out, lse, k cache after, v cache after) of FA3's flash_attn_with_kvcache semantics
    (hopper/test_flash_attn.py::test_flash_attn_kvcache): entry b's cache is row ``rows[b]`` of kc / vc
    (or the pages ``table[b]``); the new k / v (``(batch, seqlen_new, heads_k, d)`` or None) go to
    positions ``[lens[b], lens[b] + seqlen_new)`` after the rotary embedding (``rope = (cos, sin)``);
    q is rotated at ``lens[b] + i`` (causal / local) or ``lens[b]``; entry b attends to positions
    ``[leftpad[b], lens[b] + seqlen_new)`` with bottom-right aligned masks (:func:`attention_ref`,
    upcast or in the input dtype; ``softcap`` as there). out ``(batch, seqlen_q, heads, d)``, lse ``(batch, heads,
    seqlen_q)``."""
    batch = q.shape[0]
    kref, vref = logical_cache(kc, table, rows, batch).clone(), logical_cache(vc, table, rows, batch).clone()
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    local = any(x >= 0 for x in window)
    for b in range(batch):
        qb = q[b]
        if rope is not None:
            cos, sin = rope
            qpos = torch.arange(lens[b], lens[b] + qb.shape[0]) if (causal or local) else torch.full((qb.shape[0],), lens[b])
            qb = rotary_ref(qb, cos, sin, qpos, interleaved)
        if new:
            kb = k[b] if rope is None else rotary_ref(k[b], rope[0], rope[1], torch.arange(lens[b], lens[b] + new),
                                                      interleaved)
            kref[b, lens[b]:lens[b] + new] = kb
            vref[b, lens[b]:lens[b] + new] = v[b]
        lo, hi = leftpad[b], lens[b] + new
        o, l = attention_ref(qb[None], kref[b:b + 1, lo:hi], vref[b:b + 1, lo:hi], causal, q.shape[-1] ** -0.5,
                             upcast=upcast, window_size=window, softcap=softcap)
        outs.append(o[0])
        lses.append(l[0])
    return torch.stack(outs), torch.stack(lses), kref, vref


# --------------------------------------------------------------------------------------
# FP8 quantization (flashgen.quantize_fp8): FA3 §3.3 block scales and incoherent processing
# --------------------------------------------------------------------------------------

E4M3_MAX = 448.0
QUANT_BLOCK = 64


def hadamard_matrix(n: int, dtype=torch.float64, device=None):
    """The n x n Walsh-Hadamard matrix in natural (Sylvester) order, entries ±1:
    H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == n, f"{n} is not a power of two"
    return h


def hadamard_block(head_dim: int) -> int:
    """B: the largest power of two dividing head_dim, at most 256."""
    return min(head_dim & -head_dim, 256)


def incoherent_ref(x, signs, dtype=torch.float64):
    """x' = (x ⊙ s) H_B / sqrt(B) on every block of B = hadamard_block(head_dim) consecutive
    coordinates of the last dim, computed in ``dtype`` (float64 by default) from x upcast;
    ``signs``: the ±1 vector (head_dim,)."""
    d = x.shape[-1]
    b = hadamard_block(d)
    h = hadamard_matrix(b, dtype=dtype, device=x.device) / math.sqrt(b)
    xs = x.to(dtype) * signs.to(dtype=dtype, device=x.device)
    return (xs.reshape(*x.shape[:-1], d // b, b) @ h).reshape(x.shape)


def expand_descale(descale, x_shape):
    """A descale of :func:`flashgen.quantize_fp8` broadcast to ``(batch, seqlen, heads, 1)`` of the
    tensor of shape ``x_shape``: per-block ``(batch, heads, blocks)`` (64 rows each), or per key
    head ``(batch, heads_k)`` shared by the ``heads // heads_k`` heads of each group."""
    b, s, h, _ = x_shape
    if descale.dim() == 3:
        rows = torch.arange(s, device=descale.device) // QUANT_BLOCK
        return descale[:, :, rows].transpose(1, 2).unsqueeze(-1)  # (b, s, h, 1)
    g = h // descale.shape[1]
    return descale.repeat_interleave(g, dim=1).view(b, 1, h, 1)


def _group_amax(x, block: bool, heads_k: int):
    """amax of |x| (float32 (batch, seqlen, heads, dim)) per (batch, head, 64-row block) when
    ``block``, else per (batch, key head) over all rows and the heads of the key head's group."""
    b, s, h, d = x.shape
    a = x.abs()
    if block:
        nb = -(-s // QUANT_BLOCK)
        pad = torch.zeros(b, nb * QUANT_BLOCK - s, h, d, dtype=a.dtype, device=a.device)
        a = torch.cat([a, pad], 1).view(b, nb, QUANT_BLOCK, h, d)
        return a.amax(dim=(2, 4)).transpose(1, 2).contiguous() if s else a.new_zeros(b, h, 0)
    if s == 0:
        return a.new_zeros(b, heads_k)
    return a.view(b, s, heads_k, h // heads_k, d).amax(dim=(1, 3, 4))


def quantize_ref(q, k, v, incoherent: bool = True, block_quant: bool = True, signs=None):
    """What :func:`flashgen.quantize_fp8` computes, in torch: ``(q8, k8, v8, q_descale, k_descale,
    v_descale)`` plus ``(q', k')`` in float32.

    x' (float32): :func:`incoherent_ref` in float64 rounded once (q and k, when ``incoherent``;
    ``signs`` the ±1 vector), else x. descale = amax / 448 in float32 (1 where amax is 0) per
    group (see :func:`_group_amax`; v always per key head); x8 = clamp(x' / descale, ±448) rounded
    to e4m3 by torch (round to nearest even)."""
    hk = k.shape[2]
    outs8, descales, primes = [], [], []
    for name, x in (("q", q), ("k", k), ("v", v)):
        xp = incoherent_ref(x, signs).float() if incoherent and name != "v" else x.float()
        amax = _group_amax(xp, block_quant and name != "v", hk)
        descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        x8 = (xp / expand_descale(descale, x.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        outs8.append(x8)
        descales.append(descale)
        primes.append(xp)
    return (*outs8, *descales), tuple(primes[:2])


def e4m3_code_distance(a, b):
    """|code(a) - code(b)| element-wise for e4m3 tensors, code = the sign-magnitude byte as a signed
    integer (+0 and -0 are both 0), so adjacent representable values are 1 apart."""
    def code(x):
        u = x.view(torch.uint8).to(torch.int32)
        mag = u & 0x7F
        return torch.where(u >= 0x80, -mag, mag)
    return (code(a) - code(b)).abs()


#: Of the elements of a transformed tensor (q8, k8 with incoherent processing), the fraction that
#: may be one e4m3 code off the reference (see :func:`check_quantized`).
QUANT_MAX_FRAC = 1e-4


def check_quantized(got, q, k, v, incoherent: bool, block_quant: bool, signs, max_frac: float = QUANT_MAX_FRAC):
    """Assert :func:`flashgen.quantize_fp8`'s outputs ``got`` against :func:`quantize_ref` (``signs``:
    the ±1 vector, flashgen.interface.incoherent_signs(head_dim, seed)):

    * shapes, dtypes, contiguity, q's device; no NaN anywhere (saturating rounding never makes one,
      so a NaN is memory the kernels did not write);
    * descales equal to 1e-6 relative (the kernel's amax is the max of its own fp32 x');
    * where no transform runs (v; q and k without ``incoherent``) also at most one code apart, for at
      most 1 % of the elements: measured on H200, up to 0.8 % of the bytes differ by one code from
      torch's (the kernels are built with --use_fast_math, so the division's correction step is not
      IEEE-exact; a one-code difference is a tie-side choice at e4m3's 2^-3 spacing);
    * after the transform, one code apart for at most ``max_frac`` of the elements, none further:
      the kernel's x' is a sum of rounded fp32 butterflies, the reference's the exact product rounded
      once; a few fp32 ulps (2^-23 relative) move x' / descale across an e4m3 rounding boundary
      (spacing 2^-3 relative) with probability ~ 1e-6 per element."""
    ref, _ = quantize_ref(q, k, v, incoherent, block_quant, signs)
    names = ("q8", "k8", "v8", "q_descale", "k_descale", "v_descale")
    for name, a, r in zip(names, got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, (name, tuple(a.shape), tuple(r.shape), a.dtype)
        assert a.is_contiguous() and a.device == q.device, name
        nan = int(a.float().isnan().sum())
        assert nan == 0, f"{name}: {nan} NaN elements (not written?)"
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, r, rtol=1e-6, atol=0, msg=name)
        elif a.numel():
            bound = max_frac if incoherent and name != "v8" else 1e-2
            dist = e4m3_code_distance(a, r)
            assert dist.max().item() <= 1, f"{name}: an element is {dist.max().item()} e4m3 codes off"
            frac = dist.float().mean().item()
            assert frac <= bound, f"{name}: {frac:.2e} of the elements one code off (bound {bound})"


_children: dict = {}  # start_child's key -> its running subprocess.Popen, until assert_child_asserts reads it


def _child_key(code: str, env: dict) -> tuple:
    return code, tuple(sorted(env.items()))


def start_child(code: str, env: dict) -> None:
    """Start ``code`` in a child interpreter with ``env`` added to the environment, unless one is already running for
    them. Tests that provoke device asserts (each needs a fresh CUDA context) start all their cases' children first,
    from a module fixture, so that the children's start-up (torch, flashgen, a CUDA context: 10-15 s each on a fresh
    H200) overlaps instead of adding up."""
    import os
    import subprocess
    import sys

    key = _child_key(code, env)
    if key not in _children:
        _children[key] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
                                          preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """(In the child, before exec.) Linux: SIGKILL this child when the test process dies (prctl PR_SET_PDEATHSIG), so
    that a test run cut by its timeout leaves no device-asserting children on the GPU (session 2026-12-06 (10): after
    one such cut, with 14 children running, no later process on that H100 could create a CUDA context)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # (not Linux: the children outlive a killed parent)
        pass


def assert_child_asserts(code: str, fragment: str, env: dict, what) -> None:
    """The child interpreter of ``code`` and ``env`` (:func:`start_child`; started here if it was not): it must print
    ``raised:`` (it catches the error at its synchronisation and prints it) and its output must contain ``fragment``
    (the assert's message names the argument). ``what`` names the case in the failure message. A child still running
    after 180 s is killed and fails the test."""
    import subprocess

    start_child(code, env)
    proc = _children.pop(_child_key(code, env))
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child for {what} ran past 180 s: {(out + err)[-2000:]}") from None
    text = out + err
    assert "raised:" in out, f"no error for {what}: {text[-2000:]}"
    assert fragment in text, f"the device assert for {what} does not name the argument ({fragment!r}): {text[-2000:]}"
