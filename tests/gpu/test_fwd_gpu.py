"""GPU correctness of the forward kernels against a float32 reference (FA3's rule).

Outputs are poisoned (NaN) before every launch and every element must be written; inputs are
random (never zeros), lengths odd; repeated runs must be bitwise identical.
"""

from __future__ import annotations

import fnmatch
import math
import os

import pytest

torch = pytest.importorskip("torch")

from flashgen import core  # noqa: E402
from flashgen.manifest import load_manifest  # noqa: E402

from _ref import attention_ref, fa3_rule_ok  # noqa: E402

DT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def arg(t):
    return core.TensorArg(t.data_ptr(), tuple(t.shape), tuple(t.stride()), DT.get(t.dtype, "fp32"), t.device.index or 0)


def run_fwd(q, k, v, causal, scale, variant=None, softcap=0.0):
    b, sq, h, _ = q.shape
    out = torch.full((b, sq, h, v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device=q.device)
    core.attention_forward(arg(q), arg(k), arg(v), arg(out), arg(lse), scale, causal,
                           torch.cuda.current_stream().cuda_stream, variant=variant, softcap=softcap)
    return out, lse


def make_inputs(b, sq, sk, h, hk, d, dtype, outliers=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32)
        if outliers:  # N(0,1) + N(0,100) * Bernoulli(0.001)
            mask = torch.rand(*shape, generator=g, device="cuda") < 1e-3
            x = x + mask * torch.randn(*shape, generator=g, device="cuda") * 10.0
        return x.to(dtype)

    return rnd(b, sq, h, d), rnd(b, sk, hk, d), rnd(b, sk, hk, d)


def check(q, k, v, causal, scale=None, variant=None, factor=2.0, softcap=0.0):
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    out, lse = run_fwd(q, k, v, causal, scale, variant, softcap)
    torch.cuda.synchronize()
    ref, lse_ref = attention_ref(q, k, v, causal, scale, upcast=True, softcap=softcap)
    pt, _ = attention_ref(q, k, v, causal, scale, upcast=False, softcap=softcap)
    assert not torch.isnan(out).any(), "some output elements were not written (NaN poison survived)"
    ok, err, base = fa3_rule_ok(out, ref, pt, factor)
    assert ok, f"max err {err:.3e} > {factor} x lowprec err {base:.3e}"
    assert not torch.isnan(lse).any(), "some LSE elements were not written"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "LSE -inf pattern differs from the reference"
    # MUFU tanh (relative error about 2^-11) moves the capped logits by up to softcap * 2^-11
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3 + softcap * 2**-10, rtol=1e-4)
    return out, lse


def built(dtype, d, causal):
    try:
        m = load_manifest()
    except Exception:
        return False
    # the unpacked kernel (pack_gqa false): the one these shapes run
    return any(v.dispatch == {"dtype": DT[dtype], "head_dim": d, "head_dim_v": d, "causal": causal, "local": False,
                              "softcap": False, "pack_gqa": False, "varlen": False}
               for v in m.variants if v.family == "fwd")


SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k)
    (1, 1, 1, 2, 2),
    (9, 17, 113, 8, 1),   # MQA, batch 9
    (3, 113, 17, 4, 2),   # GQA 2, seqlen_q > seqlen_k (causal rows with nothing to attend)
    (2, 1023, 1024, 8, 1),  # GQA 8
    (1, 4097, 4097, 2, 2),
    # 1152 tiles at block_m 128: several per CTA, one K/V block each; causal: most rows see no key,
    # so tiles with no block sit between tiles with one in the same CTA
    (6, 1000, 70, 24, 8),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
def test_forward_matches_reference(dtype, d, causal, shape):
    if not built(dtype, d, causal):
        pytest.skip(f"MISSING-FWD-VARIANT {DT[dtype]} hd{d} causal={causal}")
    b, sq, sk, h, hk = shape
    q, k, v = make_inputs(b, sq, sk, h, hk, d, dtype, seed=sq * 7 + sk)
    check(q, k, v, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_outliers_and_repeatability(d, causal):
    dtype = torch.bfloat16
    if not built(dtype, d, causal):
        pytest.skip(f"MISSING-FWD-VARIANT {DT[dtype]} hd{d} causal={causal}")
    q, k, v = make_inputs(2, 777, 1299, 4, 2, d, dtype, outliers=True, seed=d)
    out1, lse1 = check(q, k, v, causal)
    for _ in range(3):
        out2, lse2 = run_fwd(q, k, v, causal, d ** -0.5)
        assert torch.equal(out1, out2) and torch.equal(lse1, lse2), "repeated runs differ: a race"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("tail", ["remainder", "merged"])
def test_causal_tile_claims(d, tail, monkeypatch):
    """Causal persistent variants claim tiles from a per-launch counter, in L2 sections
    (scheduler.cuh): with many more tiles than SMs and sections of a few (batch, head) pairs
    (L2_SECTION_BYTES shrunk so 3 pairs' K/V fill one, or the K/V head cap set to 3 with room for 8:
    then the last section is the remainder's 2 pairs and the section before it, 5), every tile is
    written and right (FA3's rule, NaN-poisoned outputs), runs repeat bitwise, and launches on two
    streams at once (each with its own counter) give the same bits."""
    dtype = torch.bfloat16
    if not built(dtype, d, True):
        pytest.skip(f"MISSING-FWD-VARIANT {DT[dtype]} hd{d} causal=True")
    b, s, h = 5, 1531, 7  # 5 x 7 pairs, 12 query blocks each at block_m 128: 420 tiles on 132 SMs
    monkeypatch.setattr(core, "L2_SECTION_BYTES", (3 if tail == "remainder" else 8) * s * 2 * d * 2)
    if tail == "merged":
        monkeypatch.setattr(core, "L2_SECTION_KV_HEADS", 3)
    monkeypatch.setattr(core, "_prepared_forwards", {})
    assert core.section_heads(b, h, h, s, d, d, 2) == 3
    assert core.tail_heads(b, h, h, s, d, d, 2) == (2 if tail == "remainder" else 5)
    q, k, v = make_inputs(b, s, s, h, h, d, dtype, seed=d + 1)
    out1, lse1 = check(q, k, v, True)
    side = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(3):
        torch.cuda.synchronize()
        res = []
        for st in side:
            with torch.cuda.stream(st):
                res.append(run_fwd(q, k, v, True, d ** -0.5))
        torch.cuda.synchronize()
        for out2, lse2 in res:
            assert torch.equal(out1, out2) and torch.equal(lse1, lse2), "runs differ: a race in the tile claims"
    # captured in a CUDA graph (the counter's allocation, memset and free become graph nodes)
    side[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side[0]):
        run_fwd(q, k, v, True, d ** -0.5)
    torch.cuda.current_stream().wait_stream(side[0])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out3, lse3 = run_fwd(q, k, v, True, d ** -0.5)
    for _ in range(2):
        out3.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out1, out3) and torch.equal(lse1, lse3), "graph replay differs"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("ramp", [4.0, 40.0])
def test_growing_row_max(d, causal, ramp):
    """Lazy rescaling (softmax.cuh, FA4's): a 16-bit row keeps its running max until a block's max
    exceeds it by more than 2^8. Keys get a logit ramp that grows by `ramp` (natural units) per 128
    keys toward key 0, which the kernel reaches last (blocks run right to left), so every block
    raises the row max: by less than 2^8 per block (ramp 4: the stale max is kept for a block, P up
    to e^4 = 2^5.8, then O is rescaled) and by far more (ramp 40: O and l rescaled every block).
    FA3's rule against the float32 reference, LSE to 2e-3."""
    dtype = torch.bfloat16
    if not built(dtype, d, causal):
        pytest.skip(f"MISSING-FWD-VARIANT {DT[dtype]} hd{d} causal={causal}")
    b, sq, sk, h = 2, 301, 1000, 4
    q, k, v = make_inputs(b, sq, sk, h, h, d, dtype, seed=d + int(ramp))
    q, k = _ramped(q, k, ramp)
    check(q, k, v, causal)


def _ramped(q, k, ramp):
    """q, k with a logit ramp of `ramp` (natural units) per 128 keys toward key 0 (scale 1/sqrt(d))."""
    d, sk = q.shape[-1], k.shape[1]
    u = torch.ones(d, device="cuda") / d ** 0.5
    ramp_j = ramp * (sk - 1 - torch.arange(sk, device="cuda", dtype=torch.float32)) / 128
    return (q.float() + d ** 0.5 * u).to(q.dtype), (k.float() + ramp_j[None, :, None, None] * u).to(k.dtype)


@pytest.mark.parametrize("ramp", [0.0, 4.0, 9.0, 40.0])
def test_spec_max_variants(ramp):
    """spec_max (softmax.cuh update_speculative): the exponentials of a tile's middle K/V blocks taken
    with the running max kept, accepted when every thread's row sums stay <= 2^15, else S recomputed
    and the plain update run. Every built spec_max variant (fwd.py spec_max), forced, against the float32
    reference (FA3's rule), with the logit ramp of test_growing_row_max toward key 0 (reached last):
    0 (random logits: accepted), 4 (P up to e^4 per key: accepted, O not rescaled), 9 (about 2^13 per
    key: some warpgroups near the bound fall back) and 40 (every middle block falls back). 1000 keys:
    8 blocks of 128, 6 of them middle ones."""
    from generator.families.fwd import spec_max

    vs = [v for v in load_manifest().variants if v.family == "fwd" and spec_max(v.params) and not v.params["local"]
          and not v.params.get("varlen")]  # (varlen variants: test_features_gpu.py's varlen tests)
    if not vs:
        pytest.skip("MISSING-FWD-VARIANT: no spec_max variant is built")
    for var in vs:
        p = var.params
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
        q, k, v = make_inputs(2, 301, 1000, 4, 2, p["head_dim"], dtype, seed=p["head_dim"] + int(ramp))
        q, k = _ramped(q, k, ramp)
        check(q, k, v[..., :p["head_dim_v"]].contiguous(), bool(p["causal"]), variant=var)


@pytest.mark.parametrize("sq,sk", [(512, 512), (500, 512), (512, 540), (200, 1000), (1000, 200), (129, 129),
                                   (64, 64), (64, 300), (333, 517)])
def test_half_first_block_variants(sq, sk):
    """half_first (fwd.py; fwd.cu.j2 kHalfFirst, mask.cuh sees_right_half): a consumer warpgroup whose rows
    see no key of the right half of its tile's first K/V block masks and softmaxes that block's left half
    alone (P's right half 0; the GEMMs stay whole).
    Every built 16-bit half_first variant, forced, against the float32 reference (FA3's rule), on
    bottom-right causal alignments where the first warpgroup takes the half block in every tile
    (sq = sk, a multiple of 128), in some tiles and not others (sq != sk), where neither does (sk =
    sq + 28), where a tile's rows see nothing (sq > sk), and a ragged last block (64 rows, 300 keys: the
    rows see keys up to 299, none of the right half of the block of keys 256-383 at block_n 128).
    (333, 517): at block_n 112 the ragged last tile's first warpgroup (rows to 319, keys to 503) sees keys
    48-55 of its first block (448-559), inside the P V GEMM's fourth 16-key step: half_first_gemm's
    P V over the left half must take that step (it once stopped at three, 4.9e-2 against 7.8e-3).
    The first_block_skip variants (fwd.py; hd256 causal tiles with block_n <= 64, where the first warpgroup
    skips a first block it sees none of) run the same alignments."""
    from generator.families.fwd import first_block_skip, half_first

    vs = [v for v in load_manifest().variants if v.family == "fwd" and v.params["dtype"] != "e4m3"
          and (half_first(v.params) or first_block_skip(v.params)) and not v.params.get("varlen")]
    if not vs:
        pytest.skip("MISSING-FWD-VARIANT: no 16-bit half_first or first_block_skip variant is built")
    for var in vs:
        p = var.params
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
        softcap = 15.0 if p["softcap"] else 0.0
        q, k, v = make_inputs(2, sq, sk, 4, 2, p["head_dim"], dtype, seed=sq + 3 * sk + p["head_dim"])
        check(q, k, v[..., :p["head_dim_v"]].contiguous(), True, variant=var, softcap=softcap,
              factor=3.0 if softcap else 2.0)


@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0, 2.0])
def test_any_softmax_scale(scale):
    q, k, v = make_inputs(2, 129, 257, 4, 4, 128, torch.bfloat16, seed=3)
    for causal in (False, True):
        if built(torch.bfloat16, 128, causal):
            check(q, k, v, causal, scale=scale)


def test_packed_qkv_strides():
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.is_contiguous()
    check(q, k, v, causal=True)


def test_every_built_variant():
    """Each variant in the manifest (ablation and added points too) is correct on one odd shape
    (FLASHGEN_TEST_VARIANTS, an fnmatch pattern: only the variants whose names match it)."""
    pattern = os.environ.get("FLASHGEN_TEST_VARIANTS", "*")
    for var in load_manifest().variants:
        if var.family != "fwd" or not fnmatch.fnmatch(var.name, pattern):
            continue
        p = var.params
        if p["dtype"] == "e4m3":
            continue  # test_fp8_gpu.py::test_every_built_fp8_variant
        if p.get("varlen"):
            continue  # a varlen variant serves varlen calls only: test_features_gpu.py's varlen tests
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[p["dtype"]]
        softcap = 15.0 if p["softcap"] else 0.0  # FA3's softcap tests: 15, rule factor 3
        # one tile per CTA; then 192-288 tiles (several per CTA, one after another), causal with
        # tiles that see no key between the others
        for shape, seed in (((2, 301, 517, 4, 2), 11), ((2, 1100, 300, 16, 4), 12)):
            q, k, v = make_inputs(*shape, p["head_dim"], dtype, seed=seed)
            v = v[..., :p["head_dim_v"]].contiguous()
            check(q, k, v, bool(p["causal"]), variant=var, softcap=softcap, factor=3.0 if softcap else 2.0)
