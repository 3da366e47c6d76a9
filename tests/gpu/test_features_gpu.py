"""GPU correctness of FA3's masking and logit features through ``flashgen.flash_attn_func``:
sliding windows (``window_size``), logit soft-capping (``softcap``), learnable sinks
(``learnable_sink``), head dims served by the next built size (and head_dim_v != head_dim: 192 /
128 forward and backward, 64 / 128 and 128 / 64 backward), forward and backward (autograd),
deterministic backward, torch.compile.

Semantics (FA3's, hopper/flash_api.cpp and test_util.py; gpt-oss for the sink), as the reference
:func:`_ref.attention_ref` implements them:

* ``window_size=(left, right)``, bottom-right aligned: query row i sees key j iff
  ``i + sk - sq - left <= j <= i + sk - sq + right`` (-1 or None: that side unbounded);
  ``causal=True`` forces right = 0. A row that sees no key: out 0, lse -inf.
* ``softcap`` c > 0: logits = ``c * tanh(softmax_scale * q.k / c)``, before masking.
* ``learnable_sink`` (float32, one logit per query head): every row's softmax denominator gets
  ``exp(sink_h)``, out does not; lse includes it; a row that sees no key gets out 0, lse = sink.
  Its gradient (d_sink) comes back through autograd.

Rules. Forward: FA3's, ``max|out - ref| <= f max|out_pt - ref| + noise`` with f = 2, 3 under
softcap (hopper/test_flash_attn.py), ref the float32 computation on upcast inputs, out_pt the same
in the input dtype; lse -inf exactly where the reference's is, else within 2e-3 (+ softcap * 2^-10
under softcap: the kernels' tanh.approx.f32); rows that see no key give out exactly 0.
Backward: _ref.check_bwd (FA3's gradient rule, + 3e-4 under softcap as FA3), factor 2, and 3
under softcap (``SOFTCAP_BWD_FACTOR``: FA3's test reuses its forward ``rtol`` for the gradients);
d_sink per head within 2 x the low-precision baseline's error + 6 x its rounding noise
(_ref.dsink_noise).

Inputs are random (never zeros), lengths odd, FA3's kinds of (seqlen_q, seqlen_k); before every
call torch's caching allocator is left with NaN blocks (_ref.poison_cached_blocks), so an output
or scratch element the kernels do not write shows up as NaN.

A test whose variant is not built skips with a reason starting MISSING-FWD-VARIANT /
MISSING-BWD-VARIANT (_ref.variant_missing, with the runtime's head-dim rounding and its
banded/softcap dispatch keys). Skipped without an sm_90 GPU (conftest.py).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.core import chunk_pieces, mask_spec  # noqa: E402
from _ref import (  # noqa: E402  (tests/gpu is on sys.path: conftest.py)
    BAD_VARLEN_OFFSETS,
    assert_child_asserts,
    DTYPE_NAMES,
    attention_ref,
    bitwise_equal,
    captured,
    check_bwd,
    check_fwd,
    compiled_step_matches_eager,
    first_difference,
    make_qkv,
    poison_cached_blocks,
    randn,
    start_child,
    variant_missing,
    varlen_kernels_on,
    varlen_launches,
    visible_mask,
)

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
UNBOUNDED = (-1, -1)
# FA3 (hopper/test_flash_attn.py) checks gradients with its forward's rtol: 2, and 3 under softcap.
SOFTCAP_BWD_FACTOR = 3.0


# --------------------------------------------------------------------------------------
# Cases, variants, calls
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One problem: shape, dtype and the features of the call."""

    b: int
    sq: int
    sk: int
    h: int
    hk: int
    d: int
    dtype: torch.dtype = BF16
    causal: bool = False
    window: tuple = UNBOUNDED
    softcap: float = 0.0
    sink: bool | float = False  # True: make_sink's logits; a float: those plus this offset
    scale: float | None = None
    dv: int | None = None
    chunk: int = 0  # attention_chunk

    @property
    def head_dim_v(self) -> int:
        return self.dv or self.d

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.d ** -0.5

    @property
    def feats(self) -> dict:
        """window_size / softcap / attention_chunk keywords of the _ref functions (the sink is passed
        apart)."""
        return dict(window_size=self.window, softcap=self.softcap, attention_chunk=self.chunk)

    def blind_rows(self):
        """Bool (seqlen_q,) on the GPU: the query rows that see no key."""
        vis = visible_mask(self.sq, self.sk, self.causal, self.window, device="cuda", attention_chunk=self.chunk)
        return torch.zeros(self.sq, dtype=torch.bool, device="cuda") if vis is None else ~vis.any(-1)


def case_id(c: Case) -> str:
    parts = [DTYPE_NAMES[c.dtype], f"hd{c.d}" + (f"v{c.dv}" if c.dv else ""),
             f"b{c.b}_q{c.sq}_k{c.sk}_h{c.h}_hk{c.hk}"]
    if c.causal:
        parts.append("causal")
    if c.window != UNBOUNDED:
        parts.append("w{}_{}".format(*("inf" if x is None or x < 0 else x for x in c.window)))
    if c.chunk:
        parts.append(f"chunk{c.chunk}")
    if c.softcap:
        parts.append(f"cap{c.softcap:g}")
    if c.scale is not None:
        parts.append(f"scale{c.scale:g}")
    if c.sink is True:
        parts.append("sink")
    elif c.sink:
        parts.append(f"sink+{c.sink:g}")
    return "-".join(parts)


def need(c: Case, backward: bool = False) -> None:
    """Skip unless a fwd variant (and with ``backward`` a bwd variant) serves the call: the
    dispatch keys the runtime forms (flashgen.core: ``causal`` / ``local`` from mask_spec,
    ``softcap`` whether c > 0; head dims round up to a built size; the backward of head_dim_v !=
    head_dim runs on the bwd variant of their max)."""
    # attention_chunk: every piece with keys is a call of its own (flashgen.core.chunk_pieces)
    shapes = [(c.sq, c.sk)] if not c.chunk else [
        ((p.q_end - p.q_begin) // p.chunks, (p.k_end - p.k_begin) // p.chunks)
        for p in chunk_pieces(c.sq, c.sk, c.chunk) if p.k_end > p.k_begin]
    # head_dim_v over 256: two calls on v's column halves (interface._split_head_dim_v)
    dv = c.head_dim_v if c.head_dim_v <= 256 else -(-c.head_dim_v // 16) * 8
    for sq, sk in shapes:
        m = mask_spec(c.causal, c.window, sq, sk)
        base = {"dtype": DTYPE_NAMES[c.dtype], "head_dim": c.d, "causal": m.causal, "local": m.local,
                "softcap": c.softcap > 0}
        why = variant_missing("fwd", {**base, "head_dim_v": dv}, round_up=("head_dim", "head_dim_v"))
        if why is None and backward:
            why = variant_missing("bwd", {**base, "head_dim": max(c.d, dv)}, round_up=("head_dim",))
        if why:
            pytest.skip(why)


def make_sink(h: int, seed: int):
    """float32 (h,) sink logits on the GPU: N(0, 4), the first one large (6: comparable to the
    sum of exp(logits) of a row of a few hundred keys) and, from 3 heads on, the last one
    negligible (-20)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = 2.0 * torch.randn(h, generator=g, device="cuda", dtype=torch.float32)
    s[0] = 6.0
    if h >= 3:
        s[-1] = -20.0
    return s


def inputs(c: Case, seed: int):
    """(q, k, v, sink or None) for a case: make_qkv's random inputs (v with head_dim_v); the
    sink: make_sink's, plus the case's offset when it gives one (logits of a large scale and
    softcap are near the cap: a sink must be of that size to matter)."""
    q, k, v = make_qkv(c.b, c.sq, c.sk, c.h, c.hk, c.d, c.dtype, seed=seed)
    if c.dv:
        v = randn(c.b, c.sk, c.hk, c.dv, dtype=c.dtype, seed=seed + 2)
    if c.sink is False:
        return q, k, v, None
    return q, k, v, make_sink(c.h, seed + 5) + (0.0 if c.sink is True else float(c.sink))


def attn(c: Case, q, k, v, sink=None, **kw):
    """flashgen.flash_attn_func with the case's features; (out, lse)."""
    return flashgen.flash_attn_func(q, k, v, softmax_scale=c.scale, causal=c.causal, window_size=c.window,
                                    softcap=c.softcap, learnable_sink=sink, attention_chunk=c.chunk,
                                    return_attn_probs=True, **kw)


def run_forward(c: Case, q, k, v, sink=None):
    """(out, lse) of one forward, after leaving NaN blocks in torch's allocator (out and lse are
    allocated from them: an element not written stays NaN); synchronised."""
    poison_cached_blocks(q.element_size() * c.b * c.sq * c.h * c.head_dim_v + 4 * c.b * c.h * c.sq)
    with torch.no_grad():
        out, lse = attn(c, q, k, v, sink)
    torch.cuda.synchronize()
    assert out.shape == (c.b, c.sq, c.h, c.head_dim_v) and out.dtype == c.dtype, f"out: {out.shape} {out.dtype}"
    assert lse.shape == (c.b, c.h, c.sq) and lse.dtype == torch.float32, f"lse: {lse.shape} {lse.dtype}"
    return out, lse


def check_forward(c: Case, seed: int):
    """One forward against the reference (_ref.check_fwd), plus rows that see no key: out exactly
    0 and lse -inf, or the sink's logit. Returns (q, k, v, sink, out, lse)."""
    need(c)
    q, k, v, sink = inputs(c, seed)
    out, lse = run_forward(c, q, k, v, sink)
    check_fwd(q, k, v, c.causal, out, lse, c.softmax_scale, sink=sink, **c.feats)
    blind = c.blind_rows()
    if blind.any():
        nz = int((out[:, blind] != 0).sum())
        assert nz == 0, f"{nz} out elements of the {int(blind.sum())} rows that see no key are not 0"
        want = (sink.view(1, -1, 1) if sink is not None else torch.tensor(-math.inf, device="cuda")).expand(
            c.b, c.h, int(blind.sum()))
        torch.testing.assert_close(lse[:, :, blind], want, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"lse of the rows that see no key (want -inf or the sink): {m}")
    return q, k, v, sink, out, lse


def grads_of(c: Case, q, k, v, sink, dout, deterministic: bool = False):
    """(out, (dq, dk, dv[, dsink])): flash_attn_func on fresh leaves (the sink a leaf too), then
    torch.autograd.grad of out for ``dout`` after poisoning the allocator (the backward's dq
    accumulator and workspace start as NaN)."""
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    if sink is not None:
        leaves += (sink.detach().clone().requires_grad_(),)
    out, _ = attn(c, *leaves[:3], leaves[3] if sink is not None else None, deterministic=deterministic)
    poison_cached_blocks(8 * sum(x.numel() for x in (q, k, v)))
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    return out.detach(), grads


def random_window(sq: int, sk: int) -> tuple:
    """FA3's random window: torch.randint(0, seqlen_k, (2,)), from a generator seeded by the shape."""
    g = torch.Generator().manual_seed(1000 * sq + sk)
    return tuple(torch.randint(0, sk, (2,), generator=g).tolist())


# --------------------------------------------------------------------------------------
# Sliding windows, forward
# --------------------------------------------------------------------------------------

WINDOW_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim): FA3's lengths, GQA, head dims
    (2, 1, 1, 4, 4, 128),
    (3, 17, 113, 4, 2, 64),
    (3, 113, 17, 4, 1, 128),     # seqlen_q > seqlen_k: rows that see no key
    (2, 239, 1, 4, 2, 96),       # one key
    (1, 1023, 1024, 4, 2, 256),
    (1, 1024, 1023, 6, 3, 192),
]
WINDOWS = [  # (window_size, causal); "random": FA3's torch.randint(0, seqlen_k, (2,))
    ((0, 0), False),
    ((1, -1), False),
    ((-1, 0), False),            # the causal mask as a window
    ((10, -1), False),
    ((-1, 10), False),
    ((3, 7), False),
    ((128, 0), True),            # causal sliding window
    ((50, 50), False),
    ("random", False),
    ("random", True),            # causal: the random right side is forced to 0
]


@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}_hd{}".format(*s))
@pytest.mark.parametrize("window,causal", WINDOWS,
                         ids=[("causal_" if c else "") + ("random" if w == "random" else
                                                          "w{}_{}".format(*(x if x >= 0 else "inf" for x in w)))
                              for w, c in WINDOWS])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_window_forward(dtype, window, causal, shape):
    """out by FA3's rule, lse (-inf pattern and values), rows that see no key give 0 / -inf."""
    b, sq, sk, h, hk, d = shape
    window = random_window(sq, sk) if window == "random" else window
    check_forward(Case(b, sq, sk, h, hk, d, dtype, causal=causal, window=window), seed=sq + sk + d)


@pytest.mark.parametrize("causal,window", [(False, (777, 333)), (True, (1024, -1))],
                         ids=["w777_333", "causal_w1024_inf"])
def test_window_forward_4224(causal, window):
    """FA3's longest length, (4224, 4224): 33 blocks of 128 and a partial one, GQA 2."""
    check_forward(Case(1, 4224, 4224, 4, 2, 128, BF16, causal=causal, window=window), seed=4224)


@pytest.mark.parametrize("shape", [(2, 300, 517, 4, 2), (2, 517, 300, 4, 4)], ids=["q300_k517", "q517_k300"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_window_equivalent_spellings_bitwise(dtype, shape):
    """Spellings of one mask give the same bits (FA3's normalisation): window (-1, 0) and
    (None, 0) are causal; (-1, -1), (None, None) and a window reaching every key are no mask;
    causal with (L, -1), causal with (L, 5) (right forced to 0) and the window (L, 0) are one
    causal sliding window."""
    b, sq, sk, h, hk = shape
    base = Case(b, sq, sk, h, hk, 128, dtype)
    q, k, v, _ = inputs(base, seed=sq)
    groups = {
        "causal": [(True, UNBOUNDED), (False, (-1, 0)), (False, (None, 0)), (True, (-1, 7))],
        "no mask": [(False, UNBOUNDED), (False, (None, None)), (False, (sk + 5, sq + 5)), (False, (sk - 1, sq - 1))],
        "causal window 64": [(True, (64, -1)), (True, (64, 5)), (False, (64, 0))],
    }
    for name, spellings in groups.items():
        outs = []
        for causal, window in spellings:
            c = Case(b, sq, sk, h, hk, 128, dtype, causal=causal, window=window)
            need(c)
            outs.append(((causal, window), run_forward(c, q, k, v)))
        (s0, (o0, l0)) = outs[0]
        check_fwd(q, k, v, s0[0], o0, l0, window_size=s0[1])
        for s, (o, lse) in outs[1:]:
            assert bitwise_equal(o, o0), f"{name}: out of causal={s[0]}, window {s[1]} differs from {s0}: " \
                                         f"{first_difference(o, o0)}"
            assert bitwise_equal(lse, l0), f"{name}: lse of causal={s[0]}, window {s[1]} differs from {s0}"


# --------------------------------------------------------------------------------------
# Softcap, forward
# --------------------------------------------------------------------------------------

SOFTCAP_CASES = [  # softcap 15 at the default scale; 50 with scale 25, where tanh saturates
    Case(2, 239, 387, 4, 2, 128, BF16, softcap=15.0),
    Case(2, 239, 387, 4, 2, 128, FP16, causal=True, softcap=15.0),
    Case(3, 113, 203, 4, 1, 64, BF16, window=(64, 32), softcap=15.0),
    Case(1, 1023, 1024, 4, 2, 256, FP16, causal=True, window=(100, -1), softcap=15.0),
    Case(2, 300, 129, 4, 2, 96, BF16, causal=True, softcap=15.0),            # rows that see no key
    Case(2, 239, 387, 4, 2, 128, BF16, softcap=50.0, scale=25.0),
    Case(2, 239, 387, 4, 4, 64, FP16, causal=True, softcap=50.0, scale=25.0),
    Case(1, 777, 1299, 6, 2, 192, BF16, window=(30, 30), softcap=50.0, scale=25.0),
]


@pytest.mark.parametrize("c", SOFTCAP_CASES, ids=case_id)
def test_softcap_forward(c):
    """FA3's rule with factor 3 (FA3's softcap tolerance), lse within 2e-3 + softcap * 2^-10.
    With scale 25 the test first checks that most logits are in tanh's flat part (|arg| > 2)."""
    if c.scale is not None:
        q, k, _, _ = inputs(c, seed=c.sq + c.d)
        arg = c.softmax_scale * (q[0, :, 0].float() @ k[0, :, 0].float().T) / c.softcap
        assert (arg.abs() > 2).float().mean() > 0.5, "test setup: softcap 50 at this scale does not saturate"
    check_forward(c, seed=c.sq + c.d)


# --------------------------------------------------------------------------------------
# Learnable sink, forward
# --------------------------------------------------------------------------------------

SINK_CASES = [
    Case(2, 113, 257, 8, 2, 128, BF16, sink=True),
    Case(1, 1, 1, 4, 4, 64, FP16, sink=True),
    Case(2, 300, 129, 4, 2, 64, FP16, causal=True, sink=True),            # 171 rows see no key
    Case(2, 257, 100, 4, 4, 128, BF16, window=(0, 0), sink=True),        # 157 rows see no key
    Case(2, 239, 387, 4, 2, 96, BF16, window=(-1, 10), sink=True),
    Case(1, 1023, 1024, 4, 1, 256, FP16, causal=True, window=(200, -1), softcap=15.0, sink=True),
    Case(2, 333, 517, 6, 2, 192, BF16, window=(64, 64), softcap=50.0, scale=25.0, sink=50.0),  # lse ~ 54
]


@pytest.mark.parametrize("c", SINK_CASES, ids=case_id)
def test_learnable_sink_forward(c):
    """out and lse against the reference with the sink's column in the softmax (lse includes
    exp(sink)); rows that see no key give out 0 and lse = sink. Test setup: the sink matters (the
    output without it differs by over 10 % of its largest element)."""
    q, k, v, sink, out, _ = check_forward(c, seed=c.sq + c.sk)
    without, _ = attention_ref(q, k, v, c.causal, c.softmax_scale, sink=None, **c.feats)
    assert (out.float() - without.float()).abs().max() > 0.1 * without.float().abs().max(), \
        "test setup: the sink changes (almost) nothing"


# --------------------------------------------------------------------------------------
# Head dims served by the next built size; head_dim 192 with head_dim_v 128
# --------------------------------------------------------------------------------------

ROUNDED_HEAD_DIMS = [8, 40, 72, 80, 104, 136, 160, 200, 224, 248]


@pytest.mark.parametrize("dtype,causal,window", [(BF16, False, UNBOUNDED), (FP16, True, (96, -1))],
                         ids=["bf16", "fp16_causal_w96"])
@pytest.mark.parametrize("d", ROUNDED_HEAD_DIMS, ids=lambda d: f"hd{d}")
def test_head_dim_rounded_up_forward(d, dtype, causal, window):
    """A head dim with no variant of its own runs on the next built size (64, 96, 128, 192, 256;
    the columns past it zero-filled): out (of the call's head dim) and lse by the usual rule."""
    check_forward(Case(2, 173, 301, 4, 2, d, dtype, causal=causal, window=window), seed=d)


@pytest.mark.parametrize("c", [
    Case(2, 333, 517, 8, 2, 192, BF16, dv=128),
    Case(2, 333, 517, 8, 2, 192, BF16, causal=True, dv=128),
    Case(3, 517, 333, 4, 4, 192, FP16, dv=128),
    Case(3, 517, 333, 4, 4, 192, FP16, causal=True, dv=128),             # rows that see no key
    Case(1, 1023, 1024, 4, 1, 192, BF16, causal=True, window=(128, -1), softcap=15.0, sink=True, dv=128),
], ids=case_id)
def test_head_dim_192_v128_forward(c):
    """DeepSeek's (192, 128) head dims, forward: out (batch, seqlen_q, heads, 128)."""
    check_forward(c, seed=c.sq)


WIDE_V_CASES = [  # FA3's head_dim <= 64 with head_dim_v 256 / 512 (16-bit): 512 runs as two calls of 256
    Case(2, 239, 387, 4, 2, 64, BF16, dv=256),
    Case(2, 239, 387, 4, 2, 64, FP16, causal=True, dv=512),
    Case(3, 517, 333, 6, 2, 64, BF16, causal=True, dv=512),               # rows that see no key
    Case(1, 1023, 1024, 4, 1, 64, BF16, window=(128, 16), softcap=15.0, sink=True, dv=512),
    Case(2, 333, 517, 4, 2, 64, FP16, dv=512, chunk=100),
]


@pytest.mark.parametrize("c", WIDE_V_CASES, ids=case_id)
def test_head_dim_v_256_512_forward(c):
    """head_dim 64 with head_dim_v 256 (the hd256 variant, q and k zero-padded) and 512 (two calls on
    v's column halves), forward against the reference."""
    check_forward(c, seed=c.sq + c.head_dim_v)


@pytest.mark.parametrize("c", WIDE_V_CASES[:3], ids=case_id)
def test_head_dim_v_256_512_backward(c):
    """Their gradients (FA3 has no backward beyond head_dim_v 256; autograd sums the two calls'
    dq and dk and concatenates dv)."""
    check_backward(c, seed=c.sq + c.head_dim_v)


# --------------------------------------------------------------------------------------
# Backward (autograd through flash_attn_func)
# --------------------------------------------------------------------------------------

BWD_CASES = [
    Case(2, 333, 517, 4, 4, 128, BF16, window=(64, 32)),
    Case(3, 113, 203, 4, 2, 64, FP16, window=(0, 0)),
    Case(3, 400, 300, 4, 2, 96, BF16, causal=True, window=(128, -1)),    # rows that see no key
    Case(2, 257, 100, 4, 4, 128, FP16, window=(-1, 10)),                  # rows that see no key
    Case(1, 1023, 1024, 4, 1, 256, BF16, window=random_window(1023, 1024)),
    Case(2, 239, 387, 4, 2, 128, BF16, softcap=15.0),
    Case(2, 239, 387, 4, 2, 64, FP16, causal=True, softcap=15.0),
    Case(2, 239, 387, 4, 2, 128, BF16, window=(50, 50), softcap=50.0, scale=25.0),
    Case(2, 113, 257, 8, 2, 128, BF16, sink=True),
    Case(2, 300, 129, 4, 2, 128, FP16, causal=True, sink=True),           # rows that see no key, with a sink
    Case(2, 333, 517, 6, 3, 192, BF16, window=(100, 20), softcap=15.0, sink=True),
    Case(2, 777, 1299, 8, 2, 128, BF16, window=(100, 50)),                # GQA 4
    Case(2, 777, 1299, 8, 2, 64, FP16, causal=True, window=(256, -1), sink=True),  # GQA 4
]


def check_backward(c: Case, seed: int, deterministic: bool = False):
    """Gradients of one autograd step against the reference (_ref.check_bwd with the case's
    features; d_sink too); returns (q, k, v, sink, dout, grads)."""
    need(c, backward=True)
    q, k, v, sink = inputs(c, seed)
    dout = randn(c.b, c.sq, c.h, c.head_dim_v, dtype=c.dtype, seed=seed + 3)
    _, grads = grads_of(c, q, k, v, sink, dout, deterministic=deterministic)
    factor = SOFTCAP_BWD_FACTOR if c.softcap > 0 else 2.0
    check_bwd(q, k, v, dout, c.causal, grads, c.softmax_scale, factor, sink=sink, **c.feats)
    return q, k, v, sink, dout, grads


@pytest.mark.parametrize("c", BWD_CASES, ids=case_id)
def test_backward_features(c):
    """dq, dk, dv (and d_sink) by FA3's rule; rows that see no key get dq exactly 0."""
    q, k, v, sink, dout, grads = check_backward(c, seed=c.sq + c.sk + c.d)
    blind = c.blind_rows()
    if blind.any():
        nz = int((grads[0][:, blind] != 0).sum())
        assert nz == 0, f"{nz} dq elements of the {int(blind.sum())} rows that see no key are not 0"


@pytest.mark.parametrize("c", [
    Case(2, 333, 517, 8, 4, 192, BF16, causal=True, dv=128),
    Case(3, 517, 333, 4, 2, 192, FP16, causal=True, dv=128),              # rows that see no key
    Case(2, 333, 517, 6, 3, 192, BF16, window=(100, 20), softcap=15.0, sink=True, dv=128),
    Case(1, 1023, 1024, 4, 2, 192, FP16, causal=True, window=(128, -1), softcap=15.0, sink=True, dv=128),
    Case(2, 239, 387, 4, 2, 64, BF16, window=(50, 50), dv=128),
    Case(2, 239, 387, 4, 2, 128, FP16, causal=True, softcap=15.0, dv=64),
], ids=case_id)
def test_head_dim_v_differs_backward(c):
    """head_dim_v != head_dim through autograd, with windows, softcap and sinks (test_bwd_gpu.py
    has the plain grid): dq, dk, dv (and d_sink) by the rule; the backward runs on the bwd
    variant of max(head_dim, head_dim_v); rows that see no key get dq exactly 0."""
    q, k, v, sink, dout, grads = check_backward(c, seed=c.sq + c.d + c.head_dim_v)
    assert grads[2].shape == (c.b, c.sk, c.hk, c.head_dim_v)
    blind = c.blind_rows()
    if blind.any():
        nz = int((grads[0][:, blind] != 0).sum())
        assert nz == 0, f"{nz} dq elements of the {int(blind.sum())} rows that see no key are not 0"


@pytest.mark.parametrize("c", [
    Case(2, 257, 311, 4, 2, 40, BF16),
    Case(2, 257, 311, 4, 2, 72, FP16, causal=True),
    Case(2, 257, 311, 4, 2, 136, BF16, window=(64, 64)),
    Case(2, 257, 311, 4, 2, 200, FP16, causal=True, softcap=15.0),
    Case(2, 257, 311, 4, 2, 248, BF16, sink=True),
], ids=case_id)
def test_head_dim_rounded_up_backward(c):
    """Backward at head dims served by the next built size: gradients of the call's head dim."""
    check_backward(c, seed=c.d)


# --------------------------------------------------------------------------------------
# Deterministic backward
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [
    Case(1, 2048, 2048, 4, 2, 128, BF16, window=(1000, 300)),
    Case(1, 2048, 2048, 4, 2, 128, BF16, causal=True, window=(700, -1)),
    Case(1, 2048, 2048, 4, 2, 64, FP16, window=(512, 512), softcap=30.0, sink=True),
], ids=case_id)
def test_deterministic_window_20_runs_bitwise_equal(c):
    """deterministic=True with a window: 20 autograd runs give the first run's bits (dq, dk, dv
    and d_sink); the first passes the reference rule. Each dq row sums about 10 key blocks of
    the band, each dk/dv row two query heads (GQA 2)."""
    q, k, v, sink, dout, first = check_backward(c, seed=c.d + 11, deterministic=True)
    names = ("dq", "dk", "dv", "dsink")
    for i in range(20):
        _, again = grads_of(c, q, k, v, sink, dout, deterministic=True)
        for name, a, b in zip(names, first, again):
            assert bitwise_equal(a, b), f"run {i + 1} of 20: {name} differs from run 0: {first_difference(a, b)}"


# --------------------------------------------------------------------------------------
# attention_chunk (FA3's chunked attention): forward and backward
# --------------------------------------------------------------------------------------

def random_chunk(sq: int, sk: int) -> int:
    """FA3's random chunk: torch.randint(1, 2 * seqlen_k, (1,)), from a generator seeded by the shape."""
    g = torch.Generator().manual_seed(7 * sq + sk)
    return int(torch.randint(1, 2 * sk, (1,), generator=g))


CHUNK_CASES = [
    Case(2, 1023, 1024, 4, 2, 128, BF16, causal=True, chunk=256),          # a partial first chunk, 3 whole ones
    Case(3, 113, 203, 4, 1, 64, FP16, chunk=50),                           # partial first and last chunks
    Case(2, 517, 300, 4, 2, 96, BF16, causal=True, chunk=128),             # rows that see no key
    Case(1, 4224, 4224, 4, 4, 64, BF16, causal=True, chunk=1000),
    Case(2, 799, 3, 4, 2, 128, FP16, chunk=2),
    Case(2, 1, 1000, 6, 2, 256, BF16, causal=True, chunk=333),             # decode
    Case(2, 239, 387, 4, 2, 192, BF16, window=(64, 16), softcap=30.0, sink=True, chunk=97),
    Case(2, 333, 517, 4, 2, 128, FP16, causal=True, chunk=random_chunk(333, 517)),
    Case(2, 1024, 1024, 8, 2, 128, BF16, chunk=random_chunk(1024, 1024)),
    Case(4, 64, 64, 4, 2, 64, BF16, causal=True, chunk=1),                 # every row its own chunk
]


@pytest.mark.parametrize("c", CHUNK_CASES, ids=case_id)
def test_attention_chunk_forward(c):
    """out and lse against the reference with FA3's chunk mask (test_util.construct_chunk_mask, on top
    of causal / window); rows that see no key give out 0 and lse -inf (or the sink)."""
    check_forward(c, seed=c.sq + c.sk + c.chunk)


@pytest.mark.parametrize("c", [c for c in CHUNK_CASES if c.sq * c.sk <= 1024 * 1024], ids=case_id)
def test_attention_chunk_backward(c):
    """FA3 has no backward with attention_chunk; flashgen's pieces are ordinary calls, so autograd
    gives dq, dk, dv (and d_sink) by FA3's rule against the reference with the chunk mask."""
    check_backward(c, seed=c.sq + c.sk + c.chunk)


# --------------------------------------------------------------------------------------
# flash_attn_varlen_func (FA3's packed sequences; for now one flash_attn_func call per sequence)
# --------------------------------------------------------------------------------------

VARLEN_CASES = [  # (lens_q, lens_k, used_q or None, used_k or None, Case of the features; its sq / sk unused)
    ([113, 1, 517, 64], [203, 300, 517, 1], None, None, Case(4, 0, 0, 6, 2, 128, BF16, causal=True)),
    ([300, 17], [129, 1024], [250, 17], [100, 1000], Case(2, 0, 0, 4, 4, 64, FP16, window=(64, 16))),
    ([239, 387], [387, 239], None, None, Case(2, 0, 0, 8, 2, 192, BF16, softcap=15.0, sink=True, dv=128)),
    ([1023, 5], [1024, 700], None, None, Case(2, 0, 0, 4, 1, 256, BF16, causal=True, chunk=300)),
    # causal self-attention of packed documents: the padded groups (interface._varlen_padded)
    ([300, 287, 17, 5, 129, 120, 64, 1000], [300, 287, 17, 5, 129, 120, 64, 1000], None, None,
     Case(8, 0, 0, 4, 2, 128, BF16, causal=True)),
]


def _varlen_case(lens_q, lens_k, used_q, used_k, c: Case, seed: int, pad: int = 5):
    """Packed inputs on the GPU: each sequence's rows, then ``pad`` unused rows at the end of q and k."""
    tq, tk = sum(lens_q) + pad, sum(lens_k) + pad
    q = randn(tq, c.h, c.d, dtype=c.dtype, seed=seed)
    k = randn(tk, c.hk, c.d, dtype=c.dtype, seed=seed + 1)
    v = randn(tk, c.hk, c.head_dim_v, dtype=c.dtype, seed=seed + 2)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    used = lambda u: None if u is None else torch.tensor(u, dtype=torch.int32, device="cuda")
    sink = make_sink(c.h, seed + 5) if c.sink else None
    return q, k, v, cu(lens_q), cu(lens_k), used(used_q), used(used_k), sink


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda x: case_id(x[4]))
def test_varlen_forward_and_backward(case, monkeypatch):
    """The composed path (the varlen backward switched off, so a call that wants gradients runs flash_attn_func per
    run or padded group): each sequence's out, lse and gradients against the reference of that sequence alone (FA3's
    rules, _ref.check_fwd / check_bwd); rows no sequence uses: out 0, lse -inf, zero gradients."""
    monkeypatch.setattr(flashgen.core, "VARLEN_BWD_KERNEL", False)
    lens_q, lens_k, used_q, used_k, c = case
    uq, uk = used_q or lens_q, used_k or lens_k
    for sq, sk in zip(uq, uk):
        need(Case(1, sq, sk, c.h, c.hk, c.d, c.dtype, c.causal, c.window, c.softcap, c.sink, c.scale, c.dv, c.chunk),
             backward=True)
    q, k, v, cu_q, cu_k, sq_used, sk_used, sink = _varlen_case(lens_q, lens_k, used_q, used_k, c, seed=sum(lens_q))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_cached_blocks(8 * q.numel())
    out, lse = flashgen.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, max(uq), max(uk), sq_used, sk_used, causal=c.causal, window_size=c.window,
        softcap=c.softcap, attention_chunk=c.chunk, learnable_sink=sink, return_attn_probs=True)
    dout = randn(*out.shape, dtype=c.dtype, seed=7)
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    assert out.shape == (q.shape[0], c.h, c.head_dim_v) and lse.shape == (c.h, q.shape[0])
    covered = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
        rq, rk = slice(q0, q0 + uq[b]), slice(k0, k0 + uk[b])
        covered[rq] = True
        qb, kb, vb = q[rq][None], k[rk][None], v[rk][None]
        check_fwd(qb, kb, vb, c.causal, out[rq][None], lse[:, rq][None], c.softmax_scale, sink=sink, **c.feats)
        if uq[b] and uk[b]:
            check_bwd(qb, kb, vb, dout[rq][None], c.causal, tuple(g[r][None] for g, r in zip(grads, (rq, rk, rk))),
                      c.softmax_scale, SOFTCAP_BWD_FACTOR if c.softcap > 0 else 2.0, sink=sink, **c.feats)
    assert not out[~covered].any() and bool((lse[:, ~covered] == -math.inf).all())
    assert not grads[0][~covered].any()


# The varlen kernel (flashgen.core.Varlen; fwd.py varlen): one launch that reads cu_seqlens / seqused itself.
# On by default since these passed on an H200 (core.VARLEN_KERNEL, session 2026-12-05 (2)); the cases switch it on
# themselves.
VARLEN_KERNEL_CASES = [  # (lens_q, lens_k, used_q or None, used_k or None, Case of the features, pad rows)
    ([113, 1, 517, 64], [203, 300, 517, 1], None, None, Case(4, 0, 0, 6, 2, 128, BF16, causal=True), 0),
    ([300, 17], [129, 1024], [250, 17], [100, 1000], Case(2, 0, 0, 4, 4, 64, FP16, window=(64, 16)), 5),
    ([239, 387, 0, 45], [387, 239, 17, 0], None, None, Case(4, 0, 0, 8, 2, 192, BF16, sink=True), 0),
    ([1023, 5, 700], [1024, 700, 9], None, None, Case(3, 0, 0, 4, 1, 256, BF16, causal=True), 3),
    ([77, 301], [77, 301], None, None, Case(2, 0, 0, 4, 2, 96, FP16), 0),
    ([129, 64, 1], [1, 64, 129], None, None, Case(3, 0, 0, 16, 2, 64, BF16, causal=True), 0),
    ([2048, 333], [2048, 4000], None, None, Case(2, 0, 0, 8, 8, 128, FP16, window=(256, 0)), 0),
    # softcap (fwd.py varlen x softcap, session 2026-12-05 (4), written without a GPU, passed on an H100 the same
    # session; core.VARLEN_SOFTCAP, which the test switches on): Gemma 2's 50 at hd256 causal (the softcap tile 128 x 64), hd64 with a window and seqused
    # (192 x 112, three consumer warpgroups), hd128 with a sink
    ([1023, 5, 700], [1024, 700, 9], None, None, Case(3, 0, 0, 8, 4, 256, BF16, causal=True, softcap=50.0), 3),
    ([300, 17], [129, 1024], [250, 17], [100, 1000], Case(2, 0, 0, 4, 4, 64, FP16, window=(64, 16), softcap=5.0), 5),
    ([239, 387, 45], [387, 239, 17], None, None, Case(3, 0, 0, 8, 2, 128, BF16, softcap=15.0, sink=True), 0),
]


@pytest.mark.parametrize("prep", [False, True], ids=["torch_fill", "prep_kernel"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", VARLEN_KERNEL_CASES, ids=lambda x: case_id(x[4]))
def test_varlen_kernel_forward(case, num_splits, prep, monkeypatch):
    """flash_attn_varlen_func on the varlen kernel: one launch; each sequence's out and lse against the
    reference of that sequence alone (_ref.check_fwd, FA3's rule); rows no sequence uses: out 0, lse -inf.
    Without unused rows nothing is zeroed first, so a row the kernel leaves unwritten is NaN (poisoned).
    num_splits 3: split-KV on a packed q (the unpacked epilogue's fp32 partials, the sink in split 0 alone),
    merged by the combine kernel. ``prep``: core.VARLEN_PREP_KERNEL on (the varlen_prep kernel checks the offsets
    and fills the rows of no sequence: out and lse start poisoned) or off (torch checks, memsets)."""
    lens_q, lens_k, used_q, used_k, c, pad = case
    if prep and variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    monkeypatch.setattr(flashgen.core, "VARLEN_PREP_KERNEL", prep)
    uq, uk = used_q or lens_q, used_k or lens_k
    key = {"dtype": DTYPE_NAMES[c.dtype], "head_dim": c.d, "head_dim_v": c.head_dim_v, "softcap": c.softcap > 0,
           "varlen": True}
    m = mask_spec(c.causal, c.window, max(uq), max(uk))
    why = variant_missing("fwd", {**key, "causal": m.causal, "local": m.local}, round_up=("head_dim", "head_dim_v"))
    if why:
        pytest.skip(why)
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", True)
    monkeypatch.setattr(flashgen.core, "VARLEN_SOFTCAP", True)
    launches = varlen_launches(monkeypatch, "attention_forward")
    q, k, v, cu_q, cu_k, sq_used, sk_used, sink = _varlen_case(lens_q, lens_k, used_q, used_k, c, seed=sum(lens_q),
                                                               pad=pad)
    poison_cached_blocks(8 * q.numel())
    with torch.no_grad():
        out, lse = flashgen.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(uq), max(uk), sq_used, sk_used, causal=c.causal, window_size=c.window,
            softcap=c.softcap, learnable_sink=sink, return_attn_probs=True, num_splits=num_splits)
    torch.cuda.synchronize()
    assert len(launches) == 1 and launches[0] is not None and launches[0].num_splits == num_splits
    covered = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
        rq, rk = slice(q0, q0 + uq[b]), slice(k0, k0 + uk[b])
        covered[rq] = True
        if uq[b]:
            check_fwd(q[rq][None], k[rk][None], v[rk][None], c.causal, out[rq][None], lse[:, rq][None],
                      c.softmax_scale, sink=sink, **c.feats)
    assert not out[~covered].any() and bool((lse[:, ~covered] == -math.inf).all())


def test_varlen_kernel_writes_only_the_sequences_rows():
    """core.attention_forward(varlen=...) on NaN-filled out and lse: the sequences' used rows come back
    right, every other row (past seqused, between and after the sequences) is still NaN: the kernel's
    bounded stores write nothing else. Three layouts: packed (cu_seqlens), padded with seqused_q / seqused_k
    and NaN in every row past a sequence (kvcache's; unpacked by pack_gqa=False: out stays NaN-free), and a padded decode-like q of a few rows, which the PackGQA rule
    packs (group 2)."""
    c = Case(3, 0, 0, 4, 2, 128, BF16, causal=True)
    key = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "local": False, "softcap": False,
           "varlen": True}
    why = variant_missing("fwd", key) or variant_missing("fwd", {**key, "pack_gqa": True})
    if why:
        pytest.skip(why)
    core = flashgen.core
    lens, used = [200, 129, 64], [150, 129, 1]
    q, k, v, cu_q, cu_k, sq_used, _, _ = _varlen_case(lens, lens, used, None, c, seed=3)
    dev = torch.cuda.current_device()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")

    def arg(t, dtype="bf16"):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, dev)

    # padded: (batch, 200, heads, d), each sequence's rows at row 0 of its entry, NaN after them (a cache's unused
    # rows may hold any bits: the kernel zeroes V's rows past a sequence's keys, fwd.cu.j2 issue_pv)
    pad = lambda t, cu: torch.stack([torch.nn.functional.pad(t[a:b], (0, 0, 0, 0, 0, 200 - (b - a)), value=float("nan"))
                                     for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])])
    layouts = {"packed": (q, k, v, (cu_q, cu_k, sq_used, None), used),
               "padded": (pad(q, cu_q), pad(k, cu_k), pad(v, cu_k), (None, None, sq_used, i32(lens)), used),
               "decode": (pad(q, cu_q)[:, :4].contiguous(), pad(k, cu_k), pad(v, cu_k),
                          (None, None, i32([3, 1, 2]), i32(lens)), [3, 1, 2])}
    for layout, (qq, kk, vv, arrays, used_l) in layouts.items():
        packed = layout == "packed"
        out = torch.full(qq.shape, float("nan"), dtype=qq.dtype, device="cuda")
        lse_shape = (c.h, qq.shape[0]) if packed else (3, c.h, qq.shape[1])
        lse = torch.full(lse_shape, float("nan"), dtype=torch.float32, device="cuda")
        vl = core.Varlen(*(0 if a is None else a.data_ptr() for a in arrays), 3, max(used_l), max(lens))
        var = core.attention_forward(arg(qq), arg(kk), arg(vv), arg(out), arg(lse, "fp32"), c.softmax_scale, True,
                                     torch.cuda.current_stream().cuda_stream, varlen=vl,
                                     pack_gqa=False if layout == "padded" else None)
        torch.cuda.synchronize()
        assert var.dispatch["varlen"] and var.dispatch["pack_gqa"] == (layout == "decode"), (layout, var.name)
        written = torch.zeros(out.shape[:-2], dtype=torch.bool, device="cuda")
        for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
            rows = (slice(q0, q0 + used_l[b]),) if packed else (b, slice(0, used_l[b]))
            krows = (slice(k0, k0 + lens[b]),) if packed else (b, slice(0, lens[b]))
            written[rows] = True
            lse_b = lse[:, rows[0]] if packed else lse[b, :, :used_l[b]]
            check_fwd(qq[rows][None], kk[krows][None], vv[krows][None], True, out[rows][None], lse_b[None],
                      c.softmax_scale)
        assert bool(out[~written].isnan().all()), f"{layout}: the kernel wrote out rows of no sequence"
        unwritten_lse = lse[:, ~written] if packed else lse.permute(0, 2, 1)[~written]
        assert bool(unwritten_lse.isnan().all()), f"{layout}: the kernel wrote lse rows of no sequence"


# The varlen backward kernels (flashgen.core.BwdVarlen; bwd.py varlen, bwd.cu.j2 kVarlen), written in session
# 2026-12-05 (3) without a GPU; on by default (core.VARLEN_BWD_KERNEL) since these passed on an H100 (session
# 2026-12-05 (4)); the cases switch both varlen kernels on themselves. Every block_m / block_n / slice the varlen variants have (hd64 128 x 128, hd96 / 128
# 64 x 128, the role tiles of hd192 / 256 unpaired), every mask, GQA / MQA, sequences with no query or no key,
# packed documents; rows past the last sequence, NaN (test_varlen_kernel_backward_rows_past_the_last_sequence).
VARLEN_BWD_CASES = [  # (lens_q, lens_k, Case of the features; its b / sq / sk unused)
    ([113, 1, 517, 64], [203, 300, 517, 1], Case(4, 0, 0, 6, 2, 128, BF16, causal=True)),
    ([300, 17, 129], [129, 1024, 129], Case(3, 0, 0, 4, 4, 64, FP16, window=(64, 16))),
    ([239, 387, 0, 45], [387, 239, 17, 0], Case(4, 0, 0, 8, 2, 192, BF16)),
    ([1023, 5, 700], [1024, 700, 9], Case(3, 0, 0, 4, 1, 256, BF16, causal=True)),
    ([77, 301], [77, 301], Case(2, 0, 0, 4, 2, 96, FP16, scale=0.1)),
    ([129, 64, 1], [1, 64, 129], Case(3, 0, 0, 16, 2, 64, BF16, causal=True)),
    ([2048, 333], [2048, 4000], Case(2, 0, 0, 8, 8, 128, FP16, window=(256, 0))),
    ([300, 287, 17, 5, 129, 120, 64, 1000], [300, 287, 17, 5, 129, 120, 64, 1000],
     Case(8, 0, 0, 4, 2, 128, BF16, causal=True)),  # causal packed documents (training)
    # head_dim_v 128: also the first GPU run of the varlen forward at 192 / 128 (on the 192 / 192 variant: no
    # varlen 192 / 128 variant is built); a failure in check_fwd here is the forward's
    ([192, 130], [192, 130], Case(2, 0, 0, 4, 2, 192, BF16, causal=True, dv=128)),
    ([513, 640], [640, 513], Case(2, 0, 0, 4, 2, 256, FP16, window=(100, 50))),  # hd256 local
]


def _varlen_bwd_missing(lens_q, lens_k, c: Case):
    """A skip reason when the varlen forward or backward variant of the call is not built, else None."""
    m = mask_spec(c.causal, c.window, max(lens_q), max(lens_k))
    mask = {"causal": m.causal, "local": m.local, "softcap": False, "varlen": True}
    return (variant_missing("fwd", {"dtype": DTYPE_NAMES[c.dtype], "head_dim": c.d, "head_dim_v": c.head_dim_v, **mask},
                            round_up=("head_dim", "head_dim_v"))
            or variant_missing("bwd", {"dtype": DTYPE_NAMES[c.dtype], "head_dim": max(c.d, c.head_dim_v), **mask},
                               round_up=("head_dim",)))


def _varlen_bwd_run(monkeypatch, lens_q, lens_k, c: Case, deterministic: bool, seed: int, pad: int = 0):
    """flash_attn_varlen_func on both varlen kernels (switched on here) and torch.autograd.grad after poisoning the
    allocator: (q, k, v, cu_q, cu_k, out, lse, dout, grads, the varlen arguments of each backward launch). ``pad``
    rows of NaN after the last sequence in q, k and v."""
    launches = varlen_kernels_on(monkeypatch)
    q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens_q, lens_k, None, None, c, seed=seed, pad=pad)
    for t, n in ((q, sum(lens_q)), (k, sum(lens_k)), (v, sum(lens_k))):
        t[n:] = float("nan")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    poison_cached_blocks(8 * q.numel())
    out, lse = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), softmax_scale=c.scale,
                                               causal=c.causal, window_size=c.window, deterministic=deterministic,
                                               return_attn_probs=True)
    dout = randn(*out.shape, dtype=c.dtype, seed=seed + 7)
    poison_cached_blocks(8 * q.numel())
    grads = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()
    return q, k, v, cu_q, cu_k, out.detach(), lse, dout, grads, launches


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", VARLEN_BWD_CASES, ids=lambda x: case_id(x[2]))
def test_varlen_kernel_backward(case, deterministic, monkeypatch):
    """flash_attn_varlen_func's gradients on the varlen backward kernels: one launch of them; each sequence's dq, dk,
    dv against the reference of that sequence alone (_ref.check_bwd, FA3's rule) on NaN-poisoned scratch and
    gradients; dq 0 in a sequence with no key, dk and dv 0 in a sequence with no query. Deterministic: a second run
    has the same bits."""
    lens_q, lens_k, c = case
    why = _varlen_bwd_missing(lens_q, lens_k, c)
    if why:
        pytest.skip(why)
    q, k, v, cu_q, cu_k, out, lse, dout, grads, launches = _varlen_bwd_run(monkeypatch, lens_q, lens_k, c,
                                                                           deterministic, seed=sum(lens_q))
    assert len(launches) == 1 and launches[0] is not None, "not one launch of the varlen backward"
    assert launches[0].batch == len(lens_q) and (launches[0].max_seqlen_q, launches[0].max_seqlen_k) == \
        (max(lens_q), max(lens_k))
    dq, dk, dv = grads
    for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
        rq, rk = slice(q0, q0 + lens_q[b]), slice(k0, k0 + lens_k[b])
        qb, kb, vb = q[rq][None], k[rk][None], v[rk][None]
        if lens_q[b]:
            check_fwd(qb, kb, vb, c.causal, out[rq][None], lse[:, rq][None], c.softmax_scale, **c.feats)
        if lens_q[b] and lens_k[b]:
            check_bwd(qb, kb, vb, dout[rq][None], c.causal, (dq[rq][None], dk[rk][None], dv[rk][None]),
                      c.softmax_scale, 2.0, **c.feats)
        elif lens_q[b]:
            assert not dq[rq].any(), f"sequence {b} has no key: its dq must be 0"
        elif lens_k[b]:
            assert not dk[rk].any() and not dv[rk].any(), f"sequence {b} has no query: its dk, dv must be 0"
    if deterministic:
        again = _varlen_bwd_run(monkeypatch, lens_q, lens_k, c, True, seed=sum(lens_q))[8]
        for name, a, b in zip(("dq", "dk", "dv"), grads, again):
            assert bitwise_equal(a, b), f"deterministic varlen {name} differs between runs: {first_difference(a, b)}"


def test_varlen_backward_kernels_write_every_row(monkeypatch):
    """core.attention_backward(varlen=...) straight into NaN-filled dq, dk, dv and a workspace of 0xFF bytes (NaN
    floats, semaphores at -1): every row of every sequence comes back finite and right, so no row is left unwritten
    and nothing is read that the preprocess did not write (a semaphore it did not zero would hang the ordered path);
    dq 0 for a sequence without keys, dk and dv 0 for one without queries; each sequence's gradients by FA3's rule.
    bf16 hd128 causal (block_n 128), hd64 non-causal deterministic (block_m 128: two dQ tiles per consumer), hd256
    causal deterministic (the role tiles)."""
    core = flashgen.core
    lens_q, lens_k = [37, 0, 129, 5, 70], [100, 17, 129, 260, 0]
    cases = [(Case(5, 0, 0, 4, 2, d, BF16, causal=causal), det) for d, causal, det in
             ((128, True, False), (64, False, True), (256, True, True))]
    for why in (_varlen_bwd_missing(lens_q, lens_k, c) for c, _ in cases):
        if why:
            pytest.skip(why)
    monkeypatch.setattr(core, "VARLEN_KERNEL", True)
    dev = torch.cuda.current_device()

    def arg(t, dtype="bf16"):
        return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dtype, dev)

    for i, (c, det) in enumerate(cases):
        q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens_q, lens_k, None, None, c, seed=40 + i, pad=0)
        with torch.no_grad():
            out, lse = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=c.causal,
                                                       return_attn_probs=True)
        dout = randn(*out.shape, dtype=c.dtype, seed=50 + i)
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        nbytes = core.backward_workspace_bytes(len(lens_q), max(lens_q), c.h, c.hk, c.d, "bf16", c.causal, dev,
                                               seqlen_k=max(lens_k), head_dim_v=c.d, varlen_total_q=q.shape[0])
        ws = flashgen.interface._workspace(q, nbytes)
        ws.fill_(0xFF)
        core.attention_backward(arg(dout), arg(q), arg(k), arg(v), arg(out), arg(lse, "fp32"), *(arg(g) for g in grads),
                                c.softmax_scale, c.causal, det, torch.cuda.current_stream().cuda_stream, ws.data_ptr(),
                                varlen=core.BwdVarlen(cu_q.data_ptr(), cu_k.data_ptr(), len(lens_q), max(lens_q),
                                                      max(lens_k)))
        torch.cuda.synchronize()
        dq, dk, dv = grads
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert bool(torch.isfinite(g).all()), f"hd{c.d}: {int((~torch.isfinite(g)).sum())} {name} elements unwritten"
        for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
            rq, rk = slice(q0, q0 + lens_q[b]), slice(k0, k0 + lens_k[b])
            if lens_q[b] and lens_k[b]:
                check_bwd(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], c.causal,
                          (dq[rq][None], dk[rk][None], dv[rk][None]), c.softmax_scale, 2.0)
            elif lens_q[b]:
                assert not dq[rq].any(), f"hd{c.d}: sequence {b} has no key: its dq must be 0"
            elif lens_k[b]:
                assert not dk[rk].any() and not dv[rk].any(), f"hd{c.d}: sequence {b} has no query: dk, dv must be 0"


@pytest.mark.parametrize("host_read", [True, False], ids=["host_read", "no_host_read"])
def test_varlen_kernel_backward_rows_past_the_last_sequence(host_read, monkeypatch):
    """Rows past the last offsets of q, k and v hold NaN. With the host read flash_attn_varlen_func cuts them off
    before the varlen kernels (views of the sequences' rows: the TMA loads zero-fill past them); without it
    (core.VARLEN_NO_HOST_READ, as under torch.compile and CUDA graphs) the kernels load them and the backward zeroes
    them in shared memory (bwd.cu.j2 zero_past). Either way every sequence's gradients pass FA3's rule and the rows
    past get out 0, lse -inf and zero gradients. hd128 causal (block_n 128) and hd256 (the role tiles)."""
    monkeypatch.setattr(flashgen.core, "VARLEN_NO_HOST_READ", not host_read)
    cases = (([113, 64, 300], [203, 64, 300], Case(3, 0, 0, 4, 2, 128, BF16, causal=True)),
             ([77, 129], [129, 77], Case(2, 0, 0, 4, 2, 256, FP16)))
    for why in (_varlen_bwd_missing(*case) for case in cases):
        if why:
            pytest.skip(why)
    for lens_q, lens_k, c in cases:
        q, k, v, cu_q, cu_k, out, lse, dout, grads, launches = _varlen_bwd_run(monkeypatch, lens_q, lens_k, c, False,
                                                                               seed=9, pad=37)
        assert len(launches) == 1 and launches[0] is not None
        tq, tk = sum(lens_q), sum(lens_k)
        assert not out[tq:].any() and bool((lse[:, tq:] == -math.inf).all())
        dq, dk, dv = grads
        assert not dq[tq:].any() and not dk[tk:].any() and not dv[tk:].any()
        for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
            rq, rk = slice(q0, q0 + lens_q[b]), slice(k0, k0 + lens_k[b])
            check_bwd(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], c.causal,
                      (dq[rq][None], dk[rk][None], dv[rk][None]), c.softmax_scale, 2.0, **c.feats)


def test_varlen_kernel_backward_no_sequence_has_a_key(monkeypatch):
    """Without a host read max_seqlen_k is FA3's bound, so a call whose sequences all have no key still runs the
    varlen kernels: every main CTA is past its keys, and CTA 0 waits for the preprocess so that the postprocess reads
    a zeroed dQ accumulator (bwd.cu.j2). out 0, lse -inf, dq 0 (on poisoned scratch), 20 times."""
    lens_q, lens_k = [37, 64, 5], [0, 0, 0]
    c = Case(3, 0, 0, 4, 2, 128, BF16, causal=False)
    why = _varlen_bwd_missing(lens_q, [1, 1, 1], c)
    if why:
        pytest.skip(why)
    monkeypatch.setattr(flashgen.core, "VARLEN_NO_HOST_READ", True)
    launches = varlen_kernels_on(monkeypatch)
    q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens_q, lens_k, None, None, c, seed=5, pad=3)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for i in range(20):
        poison_cached_blocks(64 * q.numel())
        out, lse = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, 64, 16, return_attn_probs=True)
        dout = randn(*out.shape, dtype=c.dtype, seed=i)
        poison_cached_blocks(64 * q.numel())
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        assert not out.any() and bool((lse == -math.inf).all()), f"run {i}: out / lse of rows without keys"
        assert not dq.any() and not dk.any() and not dv.any(), f"run {i}: gradients of a call without keys"
    assert len(launches) == 20 and all(x is not None for x in launches), "not the varlen backward"


@pytest.mark.parametrize("with_used", [False, True], ids=["offsets", "seqused_q"])
def test_varlen_prep_kernel_fills_exactly_the_rows_of_no_sequence(with_used):
    """The varlen_prep kernel (flashgen.varlen_prep.varlen_prepare, through interface._varlen_prep_launch) on
    NaN-filled out / lse: every row of no sequence (past the last offset; with seqused_q, also each sequence's rows
    past its used ones) becomes out 0 / lse -inf, every other row keeps its NaN (nothing else is written). 1100
    sequences (more than CTA 0's 256 checking threads), every seventh empty, 37 rows past the last offset, more rows
    than the grid has warps (the grid-stride loop), a row of 3 x 72 bf16 (432 bytes: 27 16-byte stores). A
    check-only launch writes nothing. Valid offsets: no assert."""
    from flashgen import interface

    why = variant_missing("varlen_prep", {})
    if why:
        pytest.skip(why)
    g = torch.Generator().manual_seed(11)
    batch, heads, dv = 1100, 3, 72
    lens = torch.randint(1, 40, (batch,), generator=g)
    lens[::7] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    total = int(cu[-1]) + 37
    used = (lens.float() * torch.rand(batch, generator=g)).long() if with_used else lens
    unused = torch.ones(total, dtype=torch.bool)
    for b in range(batch):
        unused[int(cu[b]):int(cu[b]) + int(used[b])] = False
    seqlens = (cu.to(torch.int32).to("cuda"), cu.to(torch.int32).to("cuda"),
               used.to(torch.int32).to("cuda") if with_used else None, None)
    out = torch.full((total, heads, dv), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((heads, total), float("nan"), dtype=torch.float32, device="cuda")
    longest, dev = int(lens.max()), torch.cuda.current_device()
    interface._varlen_prep_launch(seqlens, batch, total, total, longest, longest, None, dev)
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all(), "a check-only launch wrote"
    interface._varlen_prep_launch(seqlens, batch, total, total, longest, longest, (out, lse), dev)
    torch.cuda.synchronize()
    unused = unused.to("cuda")
    assert int(unused.sum()) >= 37
    assert not out[unused].any() and bool((lse[:, unused] == -math.inf).all()), "a row of no sequence not filled"
    assert out[~unused].isnan().all() and lse[:, ~unused].isnan().all(), "a sequence's row written"


_BAD_OFFSETS_CHILD = """
import torch, flashgen
g = torch.Generator(device="cuda").manual_seed(3)
q, k, v = (torch.randn(20, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
bad = {bad!r}
cu = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")
kw = {{"seqused_k": cu(bad["used_k"])}} if "used_k" in bad else {{}}
try:
    flashgen.flash_attn_varlen_func(q, k, v, cu(bad.get("cu_q", [0, 5, 10, 20])), cu(bad.get("cu_k", [0, 5, 10, 20])),
                                    bad.get("max_q", 10), 10, causal=True, **kw)
    torch.cuda.synchronize()
    print("no error")
except Exception as e:  # (torch's RuntimeError at the synchronisation, or a later launch's CUDA error)
    print("raised:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
"""


def _bad_offsets_env(prep: str) -> dict:
    return {"FLASHGEN_VARLEN_NO_HOST_READ": "1", "FLASHGEN_VARLEN_PREP_KERNEL": prep}


@pytest.fixture(scope="module")
def bad_offsets_children():
    """Every case's child interpreter started at once (their start-up overlaps: _ref.start_child)."""
    for prep in ("0", "1"):
        if prep == "0" or not variant_missing("varlen_prep", {}):
            for bad, _ in BAD_VARLEN_OFFSETS:
                start_child(_BAD_OFFSETS_CHILD.format(bad=bad), _bad_offsets_env(prep))


@pytest.mark.parametrize("prep", ["0", "1"], ids=["torch_checks", "prep_kernel"])
@pytest.mark.parametrize("bad,fragment", BAD_VARLEN_OFFSETS)
def test_varlen_bad_gpu_offsets_are_a_device_assert_naming_the_argument(bad, fragment, prep, bad_offsets_children):
    """Eager flash_attn_varlen_func with GPU offsets and core.VARLEN_NO_HOST_READ on (as under torch.compile and CUDA
    graphs) reads them on the GPU: FA3's contract broken is a device-side assert (torch._assert_async, or with
    core.VARLEN_PREP_KERNEL the varlen_prep kernel's assert) whose message names the argument, raised at the next
    synchronisation. In a child interpreter (an assert loses the CUDA context)."""
    if prep == "1" and variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    assert_child_asserts(_BAD_OFFSETS_CHILD.format(bad=bad), fragment, _bad_offsets_env(prep), bad)


@pytest.mark.parametrize("host_read", [True, False], ids=["host_read", "no_host_read"])
def test_varlen_kernel_backward_sequences_are_isolated(host_read, monkeypatch):
    """One sequence's rows of q, k and v hold NaN (its own out and gradients are NaN): the varlen backward's tiles of
    its neighbours read those rows past their ends (their last query and key blocks) and zero them before any GEMM
    (bwd.cu.j2 zero_past), so every other sequence's gradients pass FA3's rule (FA3's backward lets them through).
    Lengths off the block sizes; hd128 causal (block_n 128, both consumers zero) and hd256 (the role tiles: consumer 0
    zeroes Q and dO, consumer 1 waits for it)."""
    monkeypatch.setattr(flashgen.core, "VARLEN_NO_HOST_READ", not host_read)
    cases = (([113, 70, 300, 45], [203, 64, 300, 77], Case(4, 0, 0, 4, 2, 128, BF16, causal=True)),
             ([77, 129, 50], [129, 77, 99], Case(3, 0, 0, 4, 2, 256, FP16)))
    for why in (_varlen_bwd_missing(*case) for case in cases):
        if why:
            pytest.skip(why)
    launches = varlen_kernels_on(monkeypatch)
    for lens_q, lens_k, c in cases:
        launches.clear()
        bad = 1  # the sequence whose rows hold NaN
        q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens_q, lens_k, None, None, c, seed=21, pad=0)
        rq_bad = slice(sum(lens_q[:bad]), sum(lens_q[:bad + 1]))
        rk_bad = slice(sum(lens_k[:bad]), sum(lens_k[:bad + 1]))
        q[rq_bad] = float("nan")
        k[rk_bad] = float("nan")
        v[rk_bad] = float("nan")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        poison_cached_blocks(8 * q.numel())
        out, lse = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   softmax_scale=c.scale, causal=c.causal, return_attn_probs=True)
        dout = randn(*out.shape, dtype=c.dtype, seed=23)
        poison_cached_blocks(8 * q.numel())
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        assert len(launches) == 1 and launches[0] is not None, "not one launch of the varlen backward"
        assert dq[rq_bad].isnan().any(), "the NaN sequence's own dq should be NaN (else the test proves nothing)"
        for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
            if b == bad:
                continue
            rq, rk = slice(q0, q0 + lens_q[b]), slice(k0, k0 + lens_k[b])
            check_fwd(q[rq][None], k[rk][None], v[rk][None], c.causal, out[rq][None].detach(), lse[:, rq][None],
                      c.softmax_scale)
            check_bwd(q[rq][None], k[rk][None], v[rk][None], dout[rq][None], c.causal,
                      (dq[rq][None], dk[rk][None], dv[rk][None]), c.softmax_scale, 2.0)


def test_varlen_kernel_backward_deterministic_race(monkeypatch):
    """A race test in FA3's manner on the varlen backward: packed causal documents of random lengths (8k tokens, head
    dims 128 and 256: both dQ paths, the staged tiles and the role tiles' ring staging), deterministic, 50 backward
    runs on poisoned scratch (each one launch of the varlen backward), every dq, dk, dv bitwise equal to the first,
    whose sequences pass FA3's rule."""
    g = torch.Generator().manual_seed(11)
    lens = []
    while sum(lens) < 8192 - 1100:
        lens.append(int(torch.randint(1, 1100, (1,), generator=g)))
    cases = [Case(len(lens), 0, 0, 8, 2, d, BF16, causal=True) for d in (128, 256)]
    for why in (_varlen_bwd_missing(lens, lens, c) for c in cases):
        if why:
            pytest.skip(why)
    launches = varlen_kernels_on(monkeypatch)
    for c in cases:
        d = c.d
        launches.clear()
        q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens, lens, None, None, c, seed=d, pad=0)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens), max(lens), causal=True,
                                              deterministic=True)
        dout = randn(*out.shape, dtype=c.dtype, seed=d + 1)
        first = None
        for i in range(50):
            poison_cached_blocks(8 * q.numel())
            grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
            if first is None:
                first = grads
                continue
            for name, a, b in zip(("dq", "dk", "dv"), first, grads):
                assert bitwise_equal(a, b), f"hd{d} run {i}: {name} differs: {first_difference(a, b)}"
        assert len(launches) == 50 and all(x is not None for x in launches), "not the varlen backward"
        for a, b in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
            r = slice(a, b)
            check_bwd(q[r][None], k[r][None], v[r][None], dout[r][None], True, tuple(x[r][None] for x in first),
                      c.softmax_scale, 2.0)


def test_varlen_kernel_backward_learnable_sink(monkeypatch):
    """A learnable_sink (gpt-oss: sliding window and sinks) on both varlen kernels: each sequence's dq, dk, dv pass
    FA3's rule against the reference with the sink; d_sink (torch ops over the forward's out and lse, all sequences)
    and every gradient match the composed path (the varlen backward switched off: flash_attn_func per run, whose
    sink gradient is tested), d_sink within 1 % + 1e-3. bf16 hd64 window (128, 0), GQA 8 / 2."""
    lens = [300, 17, 129, 513, 64]
    c = Case(5, 0, 0, 8, 2, 64, BF16, window=(128, 0))
    why = _varlen_bwd_missing(lens, lens, c)
    if why:
        pytest.skip(why)
    launches = varlen_kernels_on(monkeypatch)
    q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens, lens, None, None, c, seed=8, pad=0)
    sink = make_sink(c.h, 9)
    dout = randn(q.shape[0], c.h, c.d, dtype=c.dtype, seed=10)
    got = {}
    for on in (True, False):
        monkeypatch.setattr(flashgen.core, "VARLEN_BWD_KERNEL", on)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        launches.clear()
        poison_cached_blocks(8 * q.numel())
        out = flashgen.flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(lens), max(lens), window_size=c.window,
                                              learnable_sink=leaves[3])
        got[on] = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        assert [x is not None for x in launches] == ([True] if on else [False] * len(launches)) and launches
    dq, dk, dv, d_sink = got[True]
    for a, b in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
        r = slice(a, b)
        check_bwd(q[r][None], k[r][None], v[r][None], dout[r][None], False, (dq[r][None], dk[r][None], dv[r][None]),
                  c.softmax_scale, 2.0, window_size=c.window, sink=sink)
    for name, a, b in zip(("dq", "dk", "dv"), got[True][:3], got[False][:3]):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * max(1.0, b.float().abs().max().item()), f"{name}: {err} from the composed path's"
    torch.testing.assert_close(d_sink, got[False][3], rtol=1e-2, atol=1e-3)


# flash_attn_varlen_func without a host read of the offsets (interface._varlen_on_device, session 2026-12-05 (4),
# written without a GPU): under CUDA-graph capture with GPU offsets and under torch.compile(fullgraph=True), the
# varlen ops (torch.ops.flashgen.varlen_fwd / varlen_bwd) with the offsets checked on the GPU.

def _captured_varlen(monkeypatch, call):
    """_ref.captured with two warm-up rounds through the on-device path (interface._capturing set, so the warm-up
    prepares the launches the capture makes): ``(graph, what the capture returned)``."""
    @contextlib.contextmanager
    def seam():
        with monkeypatch.context() as mp:
            mp.setattr(flashgen.interface, "_capturing", lambda q: True)
            yield

    return captured(call, rounds=2, warmup=seam())


def _no_host_read_built(c: Case, backward: bool) -> bool:
    """Whether the no-host-read path serves Case ``c``: the varlen variants (fwd, and bwd with ``backward``) of every
    mask its lengths could select (interface._varlen_variants_built, which that path asks)."""
    from flashgen._validate import window_pair

    return flashgen.interface._varlen_variants_built(DTYPE_NAMES[c.dtype], c.d, c.head_dim_v, c.causal,
                                                     tuple(window_pair(c.window)), c.softcap > 0, backward)


def _refill(dst: tuple, src: tuple) -> None:
    with torch.no_grad():
        for a, b in zip(dst, src):
            a.copy_(b)


@pytest.mark.parametrize("prep", [False, True], ids=["torch_fill", "prep_kernel"])
def test_varlen_kernel_cuda_graph_replays_new_offsets(prep, monkeypatch):
    """A forward of flash_attn_varlen_func with GPU offsets captured in a CUDA graph (no host read: the offsets
    checked by torch._assert_async, or with ``prep`` by the varlen_prep kernel, which also fills the rows of no
    sequence of the new offsets at each replay), replayed after new offsets (other lengths, the same count and
    total) and new values are copied into the static tensors: each sequence's out and lse pass FA3's rule, rows
    past the last offsets are 0 / -inf. bf16 hd128 causal; fp16 hd64 with a window and seqused_k."""
    cases = [(Case(4, 0, 0, 8, 2, 128, BF16, causal=True), ([300, 17, 129, 64], [5, 400, 100, 5]), False),
             (Case(3, 0, 0, 4, 1, 64, FP16, window=(40, 7)), ([100, 1, 250], [200, 150, 1]), True)]
    if prep and variant_missing("varlen_prep", {}):
        pytest.skip(variant_missing("varlen_prep", {}))
    monkeypatch.setattr(flashgen.core, "VARLEN_PREP_KERNEL", prep)
    monkeypatch.setattr(flashgen.core, "VARLEN_KERNEL", True)
    for c, (lens_a, lens_b), used in cases:
        if not _no_host_read_built(c, backward=False):
            pytest.skip("MISSING-FWD-VARIANT: the no-host-read path needs the varlen variant of every mask the call "
                        "can select (interface._varlen_variants_built)")
        static = _varlen_case(lens_a, lens_a, None, [n - n // 3 for n in lens_a] if used else None, c, seed=1, pad=6)
        q, k, v, cu_q, cu_k, _, used_k, _ = static

        def call():
            return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 512, 512, seqused_k=used_k, causal=c.causal,
                                                   window_size=c.window, return_attn_probs=True)

        graph, (out, lse) = _captured_varlen(monkeypatch, call)
        for lens, seed in ((lens_a, 2), (lens_b, 3)):
            uk = [n - n // 3 for n in lens] if used else lens
            new = _varlen_case(lens, lens, None, uk if used else None, c, seed=seed, pad=6)
            _refill((q, k, v, cu_q, cu_k) + ((used_k,) if used else ()), new[:5] + ((new[6],) if used else ()))
            graph.replay()
            torch.cuda.synchronize()
            for b, (q0, k0) in enumerate(zip(cu_q.tolist()[:-1], cu_k.tolist()[:-1])):
                rq, rk = slice(q0, q0 + lens[b]), slice(k0, k0 + uk[b])
                check_fwd(q[rq][None], k[rk][None], v[rk][None], c.causal, out[rq][None], lse[:, rq][None],
                          c.softmax_scale, **c.feats)
            tq = sum(lens)
            assert not out[tq:].any() and bool((lse[:, tq:] == -math.inf).all()), f"lens {lens}: rows past the last"


def test_varlen_kernel_cuda_graph_training_step(monkeypatch):
    """Forward and backward of flash_attn_varlen_func (both varlen kernels, deterministic) with GPU offsets captured
    in one CUDA graph, replayed on new documents (other lengths, same count and total) copied into the static
    tensors: each sequence's gradients pass FA3's rule; the rows past the last offsets (finite here: the kernels are
    not told where the sequences end, as in FA3) get zero gradients. bf16 hd128 causal packed documents."""
    c = Case(4, 0, 0, 8, 2, 128, BF16, causal=True)
    lens_a, lens_b = [300, 17, 129, 64], [5, 400, 100, 5]
    why = _varlen_bwd_missing(lens_a, lens_a, c) or _varlen_bwd_missing(lens_b, lens_b, c)
    if why or not _no_host_read_built(c, backward=True):
        pytest.skip(why or "MISSING-VARIANT: the no-host-read path needs every mask's varlen variants")
    launches = varlen_kernels_on(monkeypatch)
    q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens_a, lens_a, None, None, c, seed=4, pad=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    g = randn(q.shape[0], c.h, c.d, dtype=c.dtype, seed=5)

    def step():
        out = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 512, 512, causal=True, deterministic=True)
        out.backward(g)
        for t in (q, k, v):  # (the warm-up's gradients are dropped; the capture's are allocated in its pool)
            if t.grad is not None and not torch.cuda.is_current_stream_capturing():
                t.grad = None

    graph, _ = _captured_varlen(monkeypatch, step)
    grads = (q.grad, k.grad, v.grad)
    assert launches and all(x is not None for x in launches), "not the varlen backward"
    for lens, seed in ((lens_b, 6), (lens_a, 7)):
        nq, nk, nv, ncq, nck, _, _, _ = _varlen_case(lens, lens, None, None, c, seed=seed, pad=6)
        _refill((q, k, v, cu_q, cu_k, g), (nq, nk, nv, ncq, nck, randn(*g.shape, dtype=c.dtype, seed=seed + 1)))
        graph.replay()
        torch.cuda.synchronize()
        dq, dk, dv = grads
        for a, b in zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]):
            r = slice(a, b)
            check_bwd(q[r][None].detach(), k[r][None].detach(), v[r][None].detach(), g[r][None], True,
                      (dq[r][None], dk[r][None], dv[r][None]), c.softmax_scale, 2.0)
        tq = sum(lens)
        assert not dq[tq:].any() and not dk[tq:].any() and not dv[tq:].any(), f"lens {lens}: rows past the last"


def test_varlen_kernel_compile_fullgraph_training_step(monkeypatch):
    """A training step on packed documents (flash_attn_varlen_func on both varlen kernels, deterministic) compiled
    with fullgraph=True (inductor; no graph break: the offsets are not read on the host) against eager (which reads
    them): the same loss and dq, dk, dv bits, for two layouts of documents (a recompile for the new max_seqlen)."""
    c = Case(4, 0, 0, 8, 2, 128, BF16, causal=True)
    layouts = ([300, 17, 129, 64], [5, 400, 100, 5])
    for lens in layouts:
        why = _varlen_bwd_missing(lens, lens, c)
        if why or not _no_host_read_built(c, backward=True):
            pytest.skip(why or "MISSING-VARIANT: the no-host-read path needs every mask's varlen variants")
    launches = varlen_kernels_on(monkeypatch)
    torch._dynamo.reset()

    def step(q, k, v, cu_q, cu_k, w, longest: int):
        out = flashgen.flash_attn_varlen_func(q * 1.5, k, v, cu_q, cu_k, longest, longest, causal=True,
                                              deterministic=True)
        return (out.float() * w).sum()

    compiled = torch.compile(step, fullgraph=True)
    for i, lens in enumerate(layouts):
        q, k, v, cu_q, cu_k, _, _, _ = _varlen_case(lens, lens, None, None, c, seed=20 + i, pad=0)
        w = randn(q.shape[0], c.h, c.d, dtype=torch.float32, seed=30 + i).to(BF16).float()
        launches.clear()
        # (max_seqlen the longest document, as eager passes to the kernels: the same launches both ways)
        compiled_step_matches_eager(lambda q, k, v, w: step(q, k, v, cu_q, cu_k, w, max(lens)),
                                    lambda q, k, v, w: compiled(q, k, v, cu_q, cu_k, w, max(lens)), (q, k, v), w,
                                    f"lens {lens}")
        assert len(launches) == 2 and all(x is not None for x in launches), "not the varlen backward both times"


# --------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------

def test_torch_compile_fullgraph_window_softcap_sink():
    """A step (scale q, attention with a causal sliding window, softcap and a learnable sink,
    float32 weighted sum) compiled with fullgraph=True, for two shapes: the loss matches eager,
    dq, dk, dv have eager's bits (same kernels, deterministic=True), d_sink matches eager (a
    float32 reduction the compiler may order differently); the compiled forward alone gives
    eager's out and lse bits."""
    torch._dynamo.reset()
    c0 = Case(2, 128, 200, 4, 2, 128, BF16, causal=True, window=(64, -1), softcap=20.0, sink=True)
    need(c0, backward=True)

    def step(q, k, v, sink, w):
        out = flashgen.flash_attn_func(q * 1.5, k, v, causal=True, window_size=(64, -1), softcap=20.0,
                                       learnable_sink=sink, deterministic=True)
        return (out.float() * w).sum()

    def fwd(q, k, v, sink):
        return flashgen.flash_attn_func(q, k, v, causal=True, window_size=(64, -1), softcap=20.0,
                                        learnable_sink=sink, return_attn_probs=True)

    compiled, compiled_fwd = torch.compile(step, fullgraph=True), torch.compile(fwd, fullgraph=True)
    for seed, sq in ((0, 128), (1, 77)):
        c = Case(2, sq, 200, 4, 2, 128, BF16, causal=True, window=(64, -1), softcap=20.0, sink=True)
        q, k, v, sink = inputs(c, seed)
        # bf16-exact weights: out's gradient is w cast to bf16, which inductor may fuse away
        # (it keeps fused intermediates in fp32) in the d_sink expression but not in eager
        w = randn(2, sq, 4, 128, dtype=torch.float32, seed=seed + 7).to(BF16).float()
        eager_leaves, comp_leaves = compiled_step_matches_eager(step, compiled, (q, k, v, sink), w, f"seqlen_q {sq}")
        assert comp_leaves[3].grad is not None, "compiled step gave no d_sink"
        torch.testing.assert_close(comp_leaves[3].grad, eager_leaves[3].grad, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            (oe, le), (oc, lc) = fwd(q, k, v, sink), compiled_fwd(q, k, v, sink)
        assert bitwise_equal(oc, oe) and bitwise_equal(lc, le), "compiled forward differs from eager"
        check_fwd(q, k, v, True, oe, le, sink=sink, window_size=(64, -1), softcap=20.0)
