"""GPU correctness of the backward pass (dQ, dK, dV) against a float32 reference, FA3's rule.

Entry points: ``flashgen.flash_attn_func`` made differentiable (the custom op
``torch.ops.flashgen.bwd`` behind its autograd formula) and the DLPack entry
``flashgen.flash_attn_backward(dout, q, k, v, out, lse, *, softmax_scale, causal, deterministic,
stream, dq, dk, dv) -> (dq, dk, dv)``, here called with torch tensors.

Rule (FA3, hopper/test_flash_attn.py, gradients): for dx in dq, dk, dv,
``max|dx - dx_ref| <= 2 max|dx_pt - dx_ref| + 2 max|(dx_ref + 0.3 - 0.3) - dx_ref| (+ 1e-6)``,
with dx_ref the gradient of the float32 attention on upcast inputs (rounded once to the input
dtype, as FA3's leaves are) and dx_pt the same computed entirely in the input dtype
(_ref.attention_grads_ref, _ref.check_bwd).

What is covered, and how each part can fail:

* Grid: fp16 / bf16 x head_dim 64, 96, 128, 192, 256 x causal (bottom-right) or not x FA3's kinds
  of (seqlen_q, seqlen_k) (1/1, 17/113, 113/17, 239/1, 1023/1024 ... plus odd lengths) with
  batch 1..9 and heads_k ratios 1, 2, 3, 8 (MHA, GQA, MQA); both deterministic=False and True.
  dq/dk/dv are handed to flash_attn_backward filled with NaN and torch's allocator is left with
  NaN blocks (_ref.poison_cached_blocks) before every call: an element not written, or a scratch
  accumulator not zeroed, shows as NaN. (4224, 4224) for a few combinations only (time).
  out and lse come from flashgen's forward when its variant is built, else from the reference.
* Outliers in q, k, v (a few values of N(0, 100)); any softmax_scale (0.3, -0.2, 0, 2).
* Causal rows that see no key (seqlen_q > seqlen_k) get dq exactly 0 and whatever their dout
  holds does not reach dk, dv; keys whose every seeing row has dout = 0 get dk = dv = 0 exactly.
* deterministic=True: 100 repeated runs bitwise equal on a shape where 13 n-blocks add into each
  dq row and two query heads into each dk/dv row; FA3's race test: 500 repeats of a (4224, 4224)
  (and a (2000, 4000)) problem, every result bitwise equal to the first.
* Layouts: packed qkv slices, BHSD tensors transposed to BSHD, inputs whose last dim is not
  contiguous and a strided dout give the bits of the contiguous call, in the input's dtype/shape.
* flash_attn_backward on torch tensors (allocating, and into caller buffers on a side stream)
  gives the bits of autograd through flash_attn_func.
* torch.compile(fullgraph=True) of a forward + backward step gives eager's bits; a CUDA graph
  of a training step (forward + backward on static tensors) replays on new data correctly.
* head_dim_v != head_dim ((192, 128), (64, 128), (128, 64), (64, 256), (256, 64); FA3 serves them
  with the backward of max(head_dim, head_dim_v)): the same rule, GQA 2, odd lengths, causal or
  not, both deterministic modes, NaN-poisoned gradients; autograd through flash_attn_func where
  a forward variant serves the pair, with the DLPack entry's bits.

A parameter combination is skipped only when no bwd variant serves it (select_variant('bwd', ...)
raises MissingVariantError): the skip reason starts with MISSING-BWD-VARIANT. Every other test
needs its variants and says so the same way. Skipped without an sm_90 GPU (conftest.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from _ref import (  # noqa: E402  (tests/gpu is on sys.path: conftest.py)
    DTYPE_NAMES,
    attention_ref,
    bitwise_equal,
    check_bwd,
    check_fwd,
    compiled_step_matches_eager,
    first_difference,
    make_qkv,
    poison_cached_blocks,
    randn,
    run_child_or_fail,
    variant_missing,
)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 96, 128, 192, 256]
NAN = float("nan")


# --------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------

def bwd_missing(dtype, d: int, causal: bool):
    """None when a bwd variant serves (dtype, head_dim, causal), else the skip reason
    (MISSING-BWD-VARIANT ...; see _ref.variant_missing)."""
    return variant_missing("bwd", {"dtype": DTYPE_NAMES[dtype], "head_dim": d, "causal": bool(causal)})


def need_bwd(dtype, d: int, causal: bool) -> None:
    """Skip the test unless a bwd variant serves (dtype, head_dim, causal) (see bwd_missing)."""
    why = bwd_missing(dtype, d, causal)
    if why:
        pytest.skip(why)


def fwd_built(dtype, d: int, causal: bool) -> bool:
    return variant_missing("fwd", {"dtype": DTYPE_NAMES[dtype], "head_dim": d, "head_dim_v": d,
                                   "causal": bool(causal)}) is None


def pick(dtype=None, causals=(False, True)):
    """(dtype, head_dim) with a forward and a backward variant built for every causal in
    ``causals`` (head_dim 128 first, then 64, 256, 96, 192; bf16 first); else skip, naming why."""
    why = []
    for d in (128, 64, 256, 96, 192):
        for dt in ((dtype,) if dtype is not None else DTYPES):
            missing = [f"fwd {DTYPE_NAMES[dt]} hd{d} causal={c}" for c in causals if not fwd_built(dt, d, c)]
            missing += [m for m in (bwd_missing(dt, d, c) for c in causals) if m]
            if not missing:
                return dt, d
            why += missing
    pytest.skip("MISSING-BWD-VARIANT: no head_dim has both a forward and a backward variant built: "
                + "; ".join(why[:4]))


# --------------------------------------------------------------------------------------
# Calls
# --------------------------------------------------------------------------------------

def as_torch(x):
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def fwd_missing_dv(dtype, d: int, dv: int, causal: bool):
    """None when a fwd variant serves head_dim ``d`` with head_dim_v ``dv`` (as the runtime
    dispatches: head dims round up to a built size, e.g. (64, 128) on hd128), else the skip
    reason (MISSING-FWD-VARIANT ...; see _ref.variant_missing)."""
    return variant_missing("fwd", {"dtype": DTYPE_NAMES[dtype], "head_dim": d, "head_dim_v": dv,
                                   "causal": bool(causal)}, round_up=("head_dim", "head_dim_v"))


def forward_out_lse(q, k, v, causal: bool, scale: float):
    """(out, lse) to feed the backward: flashgen's forward when its variant is built, else the
    float32 reference (out rounded to q's dtype, lse float32 (batch, heads, seqlen_q)), so the
    backward kernels of head dims without a forward variant are tested all the same."""
    d, dv = q.shape[-1], v.shape[-1]
    built = fwd_built(q.dtype, d, causal) if dv == d else fwd_missing_dv(q.dtype, d, dv, causal) is None
    if built:
        with torch.no_grad():
            return flashgen.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    out, lse = attention_ref(q, k, v, causal, scale, upcast=True)
    return out, lse.contiguous()


def nan_like(x):
    """A contiguous NaN-filled tensor of x's shape, dtype and device."""
    return torch.full(x.shape, NAN, dtype=x.dtype, device=x.device)


def fg_backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool = False,
                bufs=None):
    """flashgen.flash_attn_backward on torch's current stream into NaN-poisoned dq, dk, dv
    (``bufs``, refilled with NaN, or new ones), after leaving NaN blocks in torch's allocator.
    Checks that the given buffers are the ones returned; returns (dq, dk, dv)."""
    if bufs is None:
        bufs = tuple(nan_like(x) for x in (q, k, v))
    else:
        for t in bufs:
            t.fill_(NAN)
    poison_cached_blocks(8 * sum(x.numel() for x in (q, k, v)))
    got = flashgen.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                       deterministic=deterministic, stream=torch.cuda.current_stream(),
                                       dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert [as_torch(t).data_ptr() for t in got] == [t.data_ptr() for t in bufs], \
        "flash_attn_backward did not return the dq, dk, dv it was given"
    return bufs


def autograd_grads(q, k, v, dout, causal: bool, scale=None, deterministic: bool = False):
    """(out, (dq, dk, dv)): flash_attn_func on fresh leaves holding q, k, v's values (and
    layouts), then torch.autograd.grad of out for ``dout``."""
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    out = flashgen.flash_attn_func(*leaves, softmax_scale=scale, causal=causal, deterministic=deterministic)
    return out, torch.autograd.grad(out, leaves, dout)


# --------------------------------------------------------------------------------------
# Correctness grid
# --------------------------------------------------------------------------------------

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k): FA3's kinds of lengths, odd ones, GQA 1/2/3/8
    (1, 1, 1, 2, 2),
    (9, 17, 113, 8, 1),      # MQA (ratio 8), batch 9
    (3, 113, 17, 4, 2),      # GQA 2; causal: 96 rows see no key
    (2, 239, 1, 6, 6),       # one key: causal rows 0..237 see nothing
    (4, 799, 3, 6, 2),       # GQA 3
    (5, 113, 203, 4, 4),
    (7, 384, 256, 8, 2),     # GQA 4, batch 7
    (2, 1023, 1024, 8, 1),   # MQA: many n-blocks into each dq row, 8 heads into each dk row
    (1, 1024, 1023, 6, 3),
]


def _check_shape(dtype, d, causal, shape, seed, outliers=False, scale=None):
    """One backward problem through flash_attn_backward, both deterministic modes, each against
    the reference by FA3's rule."""
    need_bwd(dtype, d, causal)
    b, sq, sk, h, hk = shape
    scale = d ** -0.5 if scale is None else scale
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=seed, outliers=outliers)
    dout = randn(b, sq, h, d, dtype=dtype, seed=seed + 3)
    out, lse = forward_out_lse(q, k, v, causal, scale)
    got = {f"deterministic={det}": fg_backward(dout, q, k, v, out, lse, causal, scale, deterministic=det)
           for det in (False, True)}
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, got, scale)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_matches_reference(dtype, d, causal, shape):
    _check_shape(dtype, d, causal, shape, seed=shape[1] * 7 + shape[2] + d)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_block_m_80_matches_reference(dtype, shape, monkeypatch):
    """The non-causal head_dim 128 block_m 80 variant (FA3's 80 x 128 tile, dQ computed transposed:
    generator/families/bwd.py dq_swap), which serves calls from seqlen_q >= core.DQ_SWAP_MIN_SEQLEN_Q
    on: every shape of the grid (odd lengths, a last block of 1-79 rows, GQA/MQA), both
    deterministic modes, with the threshold lowered to 1 for the test."""
    from flashgen import core

    need_bwd(dtype, 128, False)
    monkeypatch.setattr(core, "DQ_SWAP_MIN_SEQLEN_Q", 1)
    monkeypatch.setattr(core, "_bwd_plans", {})
    b, sq, sk, h, hk = shape
    plan = core._bwd_plan(DTYPE_NAMES[dtype], 128, core.mask_spec(False, (-1, -1), sq, sk), False,
                          torch.cuda.current_device(), None, sq)
    if plan.block_m != 80:
        pytest.skip(f"MISSING-BWD-VARIANT: no block_m 80 bwd variant of {DTYPE_NAMES[dtype]} hd128 non-causal "
                    "is built (configs/bwd.yaml extra)")
    _check_shape(dtype, 128, False, shape, seed=sq * 5 + sk)


@pytest.mark.parametrize("dtype,d,causal", [
    (torch.bfloat16, 128, False), (torch.bfloat16, 128, True), (torch.float16, 64, False),
    (torch.bfloat16, 256, True), (torch.float16, 192, True),
], ids=lambda x: DTYPE_NAMES.get(x, str(x)) if isinstance(x, torch.dtype) else str(x))
def test_backward_long_4224(dtype, d, causal):
    """FA3's longest case, (4224, 4224): 33 blocks of 128 plus one partial, GQA 3."""
    _check_shape(dtype, d, causal, (1, 4224, 4224, 6, 2), seed=d)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [128, 256], ids=lambda d: f"hd{d}")
def test_backward_chain_longer_than_the_gpu(d, causal):
    """seqlen_k 9001: 141 key blocks of 64 (71 of 128) add to each query block's dQ, more CTAs
    than the GPU holds at once where block_n is 64, so the deterministic run takes the hand-off
    signalled one block late (core._deterministic_mode 2); both modes against the reference."""
    _check_shape(torch.bfloat16, d, causal, (1, 333, 9001, 2, 1), seed=9001 + d)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_outliers(dtype, d, causal):
    _check_shape(dtype, d, causal, (2, 777, 1299, 4, 2), seed=100 + d, outliers=True)


@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0, 2.0])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_backward_any_softmax_scale(scale, causal):
    _check_shape(torch.bfloat16, 128, causal, (2, 129, 257, 4, 2), seed=7, scale=scale)


# --------------------------------------------------------------------------------------
# Rows and keys that get no gradient
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 300, 129, 4, 2), (3, 129, 300, 4, 1)],
                         ids=["q300_k129_blind_rows", "q129_k300"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"hd{d}")
def test_causal_rows_and_keys_without_gradient(d, shape):
    """Bottom-right causal: row i sees keys j <= i + seqlen_k - seqlen_q.

    * seqlen_q > seqlen_k: rows i < seqlen_q - seqlen_k see no key (out 0, lse -inf): their dq
      must be exactly 0, and their dout must not reach dk, dv (a kernel forming exp(s - lse) with
      lse = -inf gets inf/NaN there): replacing it by values of 1e3 changes no bit of dq, dk, dv.
    * The last row sees every key, so no key goes unseen; keys j >= seqlen_k - 37 are seen only by
      the last 37 rows, and with dout = 0 on those rows nothing flows into them: dk = dv = 0
      exactly (masked P is exactly 0, and dS = P (dP - D) with dP = D = 0 on zero-dout rows).
    """
    dtype, causal = torch.bfloat16, True
    need_bwd(dtype, d, causal)
    b, sq, sk, h, hk = shape
    blind, r = max(sq - sk, 0), 37
    scale = d ** -0.5
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=d + sq)
    dout = randn(b, sq, h, d, dtype=dtype, seed=d + sq + 3)
    dout[:, sq - r:] = 0
    out, lse = forward_out_lse(q, k, v, causal, scale)
    dq, dk, dv = fg_backward(dout, q, k, v, out, lse, causal, scale, deterministic=True)
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, (dq, dk, dv), scale)
    if blind:
        nz = int((dq[:, :blind] != 0).sum())
        assert nz == 0, f"{nz} dq elements of the {blind} rows that see no key are not 0"
    for name, g in (("dk", dk), ("dv", dv)):
        nz = int((g[:, sk - r:] != 0).sum())
        assert nz == 0, f"{nz} {name} elements of the last {r} keys (whose rows all have dout 0) are not 0"
    if blind:
        loud = dout.clone()
        loud[:, :blind] = 1e3 * randn(b, blind, h, d, dtype=dtype, seed=d + 9)
        dq2, dk2, dv2 = fg_backward(loud, q, k, v, out, lse, causal, scale, deterministic=True)
        torch.cuda.synchronize()
        for name, a, a2 in (("dq", dq, dq2), ("dk", dk, dk2), ("dv", dv, dv2)):
            assert torch.equal(a, a2), (f"{name} changed with the dout of rows that see no key: "
                                        f"{first_difference(a, a2)}")


# --------------------------------------------------------------------------------------
# Deterministic mode
# --------------------------------------------------------------------------------------

def _repeat_bitwise(dtype, d, causal, shape, repeats, seed):
    """Run the deterministic backward ``repeats`` more times into the same NaN-refilled buffers;
    every result must carry the first one's bits. The first is checked against the reference."""
    need_bwd(dtype, d, causal)
    b, sq, sk, h, hk = shape
    scale = d ** -0.5
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=seed)
    dout = randn(b, sq, h, d, dtype=dtype, seed=seed + 3)
    out, lse = forward_out_lse(q, k, v, causal, scale)
    first = tuple(t.clone() for t in fg_backward(dout, q, k, v, out, lse, causal, scale, deterministic=True))
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, first, scale)
    bufs = tuple(nan_like(x) for x in (q, k, v))
    for i in range(repeats):
        fg_backward(dout, q, k, v, out, lse, causal, scale, deterministic=True, bufs=bufs)
        for name, a, a2 in zip(("dq", "dk", "dv"), first, bufs):
            assert bitwise_equal(a, a2), f"run {i + 1} of {repeats}: {name} differs from run 0: {first_difference(a, a2)}"


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, d) for d in HEAD_DIMS] + [(torch.float16, 128)],
                         ids=[f"bf16_hd{d}" for d in HEAD_DIMS] + ["fp16_hd128"])
def test_deterministic_100_runs_bitwise_equal(dtype, d, causal):
    """seqlen 1537 = 12 x 128 + 1: every dq row sums 13 n-blocks' contributions, every dk/dv row
    two query heads' (GQA 2), so an unordered accumulation would show within 100 runs."""
    _repeat_bitwise(dtype, d, causal, (2, 1537, 1537, 4, 2), repeats=100, seed=d)


@pytest.mark.parametrize("d,causal,shape", [
    (128, False, (2, 4224, 4224, 6, 2)),
    (128, True, (2, 4224, 4224, 6, 2)),
    (64, False, (2, 4224, 4224, 6, 2)),
    (64, True, (2, 4224, 4224, 6, 2)),
    (128, False, (2, 2000, 4000, 6, 1)),
], ids=["hd128_4224", "hd128_4224_causal", "hd64_4224", "hd64_4224_causal", "hd128_2000x4000_mqa"])
def test_deterministic_race_big(d, causal, shape):
    """FA3's race test (tests/cute/test_flash_attn_race_condition.py) in short: 500 repeats of a
    big problem with GQA/MQA on the deterministic path, every result bitwise equal to the first."""
    _repeat_bitwise(torch.bfloat16, d, causal, shape, repeats=500, seed=d + 1)


@pytest.mark.parametrize("d,causal,shape", [
    (128, False, (32, 512, 512, 16, 16)),
    (128, True, (32, 512, 512, 16, 16)),
    (64, False, (16, 1024, 1024, 32, 8)),
    (256, True, (8, 1000, 1000, 8, 8)),
    (256, False, (8, 2048, 2048, 8, 8)),
    (256, False, (1, 1000, 16384, 4, 2)),
    (256, True, (1, 16384, 16384, 2, 2)),
    (256, True, (2, 8192, 8192, 2, 1)),
    (128, False, (2, 9001, 9001, 2, 2)),
    (256, False, (2, 777, 5900, 2, 2)),
], ids=["hd128_512x32", "hd128_512x32_causal", "hd64_1024x16_gqa", "hd256_1000x8_causal", "hd256_2048x8",
        "hd256_k16384_late_handoff", "hd256_16384_causal_late_handoff", "hd256_8192_causal_mode1",
        "hd128_9001_mode1", "hd256_5900_mode1_lone_block"])
def test_deterministic_many_waves_finish(d, causal, shape):
    """The deterministic hand-off with more CTAs than fit on the GPU at once (FA3-protocol shapes:
    2048 CTAs at seqlen 512): 200 runs in a child process under a time limit, every result
    bitwise equal to the first. A two-reducer-warp hand-off passed every single-wave test and hung
    here (docs/results/bwd_det_h200/); a hang must fail the test, not the suite. The seqlen_k 16384
    shapes have chains of 256 key blocks per query block: the late hand-off (mode 2); the 8192 and
    9001 ones 128 and 71 (mode 1: more than half the SMs); the others at most 32 (mode 3: the
    rotated non-causal order; core._deterministic_mode). At head_dim 256 (ds_pairs: turns by pairs
    of key blocks) the 5900 one has 93 key blocks, mode 1 with a lone last block."""
    need_bwd(torch.bfloat16, d, causal)
    run_child_or_fail(f"import torch, test_bwd_gpu as t; "
                      f"t._repeat_bitwise(torch.bfloat16, {d}, {causal}, {shape}, repeats=200, seed=5)", 180,
                      f"200 deterministic backward runs of {shape} (hd {d}, causal {causal}): a cross-CTA hand-off deadlock")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", ["fa3_512", "gqa_q_longer"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_on_a_poisoned_workspace(d, shape, causal, deterministic):
    """core.attention_backward on a workspace filled with 0x7f bytes (LSE_log2, dPsum and the dQ
    accumulator about 3.4e38, the semaphores far past any count): its gradients pass FA3's rule three
    times in a row, and deterministic runs are bitwise equal. What the preprocess must reset (the
    semaphores; the accumulator, or in ordered runs the query blocks no key block visits, whose first
    share is stored instead) would show if it did not. fa3_512: 8k tokens at seqlen 512;
    gqa_q_longer: 3 x 700 queries on 300 keys, 8 heads on 2 (causal: the first query blocks are
    visited by no key block; head_dim 256: a lone key block of the 2-CTA pairs)."""
    from flashgen import core
    from flashgen.bench import tensor_arg as arg

    dtype = torch.bfloat16
    need_bwd(dtype, d, causal)
    b, sq, sk, h, hk = (16, 512, 512, 1024 // d, 1024 // d) if shape == "fa3_512" else (3, 700, 300, 8, 2)
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=11)
    dout = randn(b, sq, h, d, dtype=dtype, seed=12)
    scale = d ** -0.5
    out, lse = forward_out_lse(q, k, v, causal, scale)
    ws = torch.empty(core.backward_workspace_bytes(b, sq, h, hk, d, "bf16", causal, q.device.index, seqlen_k=sk), dtype=torch.uint8,
                     device="cuda")
    runs = []
    for _ in range(3):
        ws.fill_(0x7F)
        grads = tuple(nan_like(x) for x in (q, k, v))
        core.attention_backward(*(arg(x) for x in (dout, q, k, v, out, lse)), *(arg(g) for g in grads), scale,
                                causal, deterministic, torch.cuda.current_stream().cuda_stream, ws.data_ptr())
        runs.append(grads)
    check_bwd(q, k, v, dout, causal, {f"run {i}": g for i, g in enumerate(runs)}, scale)
    if deterministic:
        for i in (1, 2):
            assert all(bitwise_equal(a, r) for a, r in zip(runs[0], runs[i])), (
                f"deterministic run {i}: " + "; ".join(first_difference(a, r) for a, r in zip(runs[0], runs[i])))


@pytest.mark.parametrize("waves", [0.0, 0.5, 1e9], ids=["no_tail", "mixed", "all_tail"])
@pytest.mark.parametrize("d,shape", [(64, (20, 500, 500, 8, 4)), (128, (20, 500, 500, 8, 4)),
                                     (256, (6, 1950, 1950, 8, 2)), (256, (9, 481, 481, 6, 3))],
                         ids=["hd64", "hd128", "hd256_lone_block", "hd256_gqa3"])
def test_backward_unordered_tail_matches_reference(d, shape, waves, monkeypatch):
    """Short causal calls that are not deterministic take the ordered path, whose last (batch, head_k)
    groups run unordered and longest first (core.UNORDERED_TAIL_WAVES, bwd.cu.j2 GridCta): none of
    them (waves 0), some (0.5 waves: 17 of 80 groups at head_dim 64 / 128, 3 of 12 at 256 with 31 key
    blocks, a lone one in a 2-CTA pair, 9 of 27 at 256 with GQA 3) or all: every split passes FA3's
    rule on NaN-poisoned gradients, and the tail's accumulators (zeroed by the preprocess only there)
    are right on a workspace that torch's allocator left NaN."""
    _tail_case(d, shape, "UNORDERED_TAIL_WAVES", waves, monkeypatch)


@pytest.mark.parametrize("waves", [0.0, 0.5, 1e9], ids=["no_tail", "mixed", "all_tail"])
@pytest.mark.parametrize("d,shape", [(64, (4, 1100, 1100, 8, 4)), (128, (3, 1300, 900, 6, 3)),
                                     (192, (2, 1000, 1000, 4, 4)), (256, (3, 2100, 2100, 4, 2))],
                         ids=["hd64", "hd128_sq_gt_sk", "hd192", "hd256_lone_block"])
def test_backward_unordered_causal_tail_matches_reference(d, shape, waves, monkeypatch):
    """Causal calls past the ordered bounds that are not deterministic run unordered throughout; their
    last (batch, head_k) groups are launched longest first across them (core.UNORDERED_CAUSAL_TAIL_WAVES,
    bwd.cu.j2 GridCta): none, some (0.5 waves) or all of them, each passes FA3's rule on NaN-poisoned
    gradients (hd256 with 33 key blocks: a lone one in a 2-CTA pair; hd128 with seqlen_q > seqlen_k)."""
    _tail_case(d, shape, "UNORDERED_CAUSAL_TAIL_WAVES", waves, monkeypatch)


@pytest.mark.parametrize("d,shape", [(64, (1, 700, 900, 4, 4)), (96, (2, 1500, 1200, 3, 3)),
                                     (128, (2, 1000, 1000, 6, 2)), (128, (1, 2100, 2050, 4, 2)),
                                     (128, (1, 5200, 5100, 4, 2)), (64, (1, 8300, 8200, 2, 1))],
                         ids=["hd64_uneven_pieces", "hd96", "hd128_gqa3_mid_head", "hd128_block_m_80",
                              "hd128_rotated_gqa2", "hd64_rotated"])
def test_backward_split_tail_matches_reference(d, shape):
    """Non-causal calls that are not deterministic split their main grid's last partial wave
    (core._split_tail, bwd.cu.j2 kSplitTail): each unit of it runs as P CTAs over parts of its query
    blocks (pieces that start inside a query head's blocks with GQA, uneven pieces), whose fp32 dK / dV
    partials the unit's last piece adds in piece order. Each shape here splits (asserted); the gradients
    pass FA3's rule on NaN-poisoned buffers and a NaN workspace, and dK / dV carry the same bits in three
    runs (the sum's order does not depend on which piece ends last). The last two shapes have at least
    core.ROTATE_UNORDERED_MIN_M_BLOCKS query blocks, so their key blocks also visit the query blocks
    rotated (BwdParams.rotate; with GQA the producer's head steps inside rotated, split pieces)."""
    from flashgen import core

    dtype = torch.bfloat16
    need_bwd(dtype, d, False)
    b, sq, sk, h, hk = shape
    plan = core._bwd_plan("bf16", d, core.mask_spec(False, (-1, -1), sq, sk), False, torch.cuda.current_device(),
                          None, sq)
    units = core._bwd_units(plan, b, hk, sk)
    split = core._call_split(plan, core.mask_spec(False, (-1, -1), sq, sk), False, units, sq, h, hk)
    assert split[1] > 1 and split[0] == units % plan.sms, (split, units)
    rotated = -(-sq // plan.block_m) >= core.ROTATE_UNORDERED_MIN_M_BLOCKS and -(-sk // 128) <= -(-sq // plan.block_m)
    assert rotated == (sq > 5000), (sq, plan.block_m)
    call, first = _checked_noncausal(d, shape, 31, f"split {split}")
    for run in range(2):
        again = call()
        for name, a, a2 in (("dk", first[1], again[1]), ("dv", first[2], again[2])):
            assert bitwise_equal(a, a2), f"run {run + 1}: {name} differs: {first_difference(a, a2)}"


def _checked_noncausal(d, shape, seed, label):
    """One non-causal bf16 backward of ``shape`` (b, seqlen_q, seqlen_k, heads, heads_k) on NaN-poisoned
    buffers, checked by FA3's rule under ``label``: returns (call, its gradients), call() running the
    same backward again (synchronised)."""
    b, sq, sk, h, hk = shape
    scale = d ** -0.5
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=seed)
    dout = randn(b, sq, h, d, dtype=torch.bfloat16, seed=seed + 1)
    out, lse = forward_out_lse(q, k, v, False, scale)

    def call():
        got = fg_backward(dout, q, k, v, out, lse, False, scale)
        torch.cuda.synchronize()
        return got

    first = tuple(t.clone() for t in call())
    check_bwd(q, k, v, dout, False, {label: first}, scale)
    return call, first


@pytest.mark.parametrize("d,shape", [(64, (20, 500, 501, 8, 4)), (96, (10, 250, 700, 6, 3)),
                                     (128, (9, 500, 1000, 16, 16)), (128, (1, 100, 17000, 2, 1)),
                                     (64, (3, 129, 6000, 4, 1))],
                         ids=["hd64_gqa2", "hd96_gqa2_odd", "hd128_sk_longer", "hd128_133_units", "hd64_mqa"])
def test_backward_persistent_matches_reference(d, shape, monkeypatch):
    """Non-causal calls that are not deterministic, with more units than SMs and at most
    core.PERSISTENT_MAX_BLOCKS blocks each, run the persistent grid (core._persistent_units, bwd.cu.j2
    kPersistent: one CTA per SM over the units in turn, each unit's K / V loaded under the last unit's
    dK / dV stores, which go out through the dS^T and dQ staging buffers). Each shape here runs it
    (asserted; 133 units: one CTA runs two, the first and the 133rd): the gradients pass FA3's rule on
    NaN-poisoned buffers, and dK / dV carry the bits of the plain grid (the split tail off: a unit's dK
    and dV are summed in the same order either way; only dQ's fp32 additions are unordered)."""
    from flashgen import core

    dtype = torch.bfloat16
    need_bwd(dtype, d, False)
    b, sq, sk, h, hk = shape
    mask = core.mask_spec(False, (-1, -1), sq, sk)
    plan = core._bwd_plan("bf16", d, mask, False, torch.cuda.current_device(), None, sq)
    units = core._bwd_units(plan, b, hk, sk)
    blocks = -(-sq // plan.block_m) * (h // hk)
    assert core._persistent_units(plan, mask, False, units, blocks) == units > plan.sms, (units, blocks)
    call, got = _checked_noncausal(d, shape, 41, "persistent")
    monkeypatch.setattr(core, "PERSISTENT_BWD", 0)
    monkeypatch.setattr(core, "SPLIT_TAIL_MAX_PIECES", 1)
    plain = call()
    for name, a, a2 in (("dk", got[1], plain[1]), ("dv", got[2], plain[2])):
        assert bitwise_equal(a, a2), f"{name}: persistent and plain differ: {first_difference(a, a2)}"


def _tail_case(d, shape, knob, waves, monkeypatch):
    """One causal backward, not deterministic, with core.<knob> = waves, checked as in check_bwd."""
    from flashgen import core

    dtype = torch.bfloat16
    need_bwd(dtype, d, True)
    monkeypatch.setattr(core, knob, waves)
    b, sq, sk, h, hk = shape
    scale = d ** -0.5
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=21)
    dout = randn(b, sq, h, d, dtype=dtype, seed=22)
    out, lse = forward_out_lse(q, k, v, True, scale)
    got = fg_backward(dout, q, k, v, out, lse, True, scale)
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, True, {f"waves {waves}": got}, scale)


# --------------------------------------------------------------------------------------
# Layouts, dtypes and shapes of the gradients
# --------------------------------------------------------------------------------------

def _leaves(layout, b, s, h, hk, d, dtype, seed):
    """(q, k, v views for flash_attn_func, leaves to read .grad from, grads -> (dq, dk, dv) as
    (b, s, heads, d) tensors) for one input layout."""
    if layout == "packed_qkv":  # (b, s, 3, h, d): q, k, v are strided slices (h == hk)
        packed = randn(b, s, 3, h, d, dtype=dtype, seed=seed).requires_grad_()
        return packed.unbind(2), (packed,), lambda: packed.grad.unbind(2)
    if layout == "bhsd":  # (b, heads, s, d) tensors seen as BSHD through transpose(1, 2)
        lv = [randn(b, n, s, d, dtype=dtype, seed=seed + i).requires_grad_() for i, n in enumerate((h, hk, hk))]
        return tuple(x.transpose(1, 2) for x in lv), lv, lambda: tuple(x.grad.transpose(1, 2) for x in lv)
    if layout == "last_dim_strided":  # last dim not contiguous: the API must copy, grads still in this layout's shape
        lv = [randn(b, s, n, d, dtype=dtype, seed=seed + i).transpose(-1, -2).contiguous().transpose(-1, -2)
              .requires_grad_() for i, n in enumerate((h, hk, hk))]
        return tuple(lv), lv, lambda: tuple(x.grad for x in lv)
    lv = list(make_qkv(b, s, s, h, hk, d, dtype, seed=seed))  # contiguous, with a strided dout
    lv = [x.requires_grad_() for x in lv]
    return tuple(lv), lv, lambda: tuple(x.grad for x in lv)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("layout", ["packed_qkv", "bhsd", "last_dim_strided", "strided_dout"])
def test_strided_inputs_give_the_contiguous_gradients(layout, causal):
    """Autograd through flash_attn_func(deterministic=True) on each layout gives the same bits as
    on contiguous copies of the same values; gradients come back in the input's dtype and shape."""
    dtype, d = pick(causals=(causal,))
    b, s, h = 2, 333, 4
    hk = h if layout == "packed_qkv" else 2
    (q, k, v), leaves, grads_of = _leaves(layout, b, s, h, hk, d, dtype, seed=17)
    dout = randn(b, s, h, d, dtype=dtype, seed=21)
    if layout == "strided_dout":  # e.g. the gradient of a transpose downstream: BHSD memory
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
        assert not dout.is_contiguous()
    out = flashgen.flash_attn_func(q, k, v, causal=causal, deterministic=True)
    out.backward(dout)
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
    got = grads_of()
    out_c, want = autograd_grads(*(x.detach().contiguous() for x in (q, k, v)), dout.contiguous(), causal,
                                 deterministic=True)
    assert torch.equal(out, out_c), "forward output differs from the contiguous call"
    for name, x, g, w in zip(("dq", "dk", "dv"), (q, k, v), got, want):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {tuple(g.shape)} {g.dtype}"
        assert bitwise_equal(g.contiguous(), w), f"{layout}: {name} differs from the contiguous call's: " \
                                                 f"{first_difference(g, w)}"
    check_bwd(q.detach(), k.detach(), v.detach(), dout, causal, want)


# --------------------------------------------------------------------------------------
# DLPack entry vs autograd
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dlpack_entry_matches_autograd(dtype, causal):
    """flash_attn_backward(dout, q, k, v, out, lse) with torch tensors, allocating its outputs,
    and again into caller buffers on a side stream, gives autograd's bits (deterministic=True,
    softmax_scale 0.1, GQA 4, out and lse from flash_attn_func(return_attn_probs=True))."""
    dtype, d = pick(dtype=dtype, causals=(causal,))
    q, k, v = make_qkv(2, 333, 257, 8, 2, d, dtype, seed=31)
    dout = randn(2, 333, 8, d, dtype=dtype, seed=34)
    leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashgen.flash_attn_func(*leaves, softmax_scale=0.1, causal=causal, deterministic=True,
                                        return_attn_probs=True)
    want = torch.autograd.grad(out, leaves, dout)  # lse is an output too: its gradient is None
    out, lse = out.detach(), lse.detach()
    got = flashgen.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.1, causal=causal,
                                       deterministic=True, stream=torch.cuda.current_stream())
    got = [as_torch(t) for t in got]
    torch.cuda.synchronize()
    for name, x, g, w in zip(("dq", "dk", "dv"), (q, k, v), got, want):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device, f"{name}: {g.shape} {g.dtype}"
        assert bitwise_equal(g, w), f"allocating call: {name} differs from autograd's: {first_difference(g, w)}"
    side = torch.cuda.Stream()
    bufs = tuple(nan_like(x) for x in (q, k, v))
    side.wait_stream(torch.cuda.current_stream())  # inputs and the NaN fill are ordered before the launch
    torch.cuda._sleep(2_000_000)  # keep the current stream busy: a launch sent there would finish late
    flashgen.flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=0.1, causal=causal, deterministic=True,
                                 stream=side, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    side.synchronize()
    for name, g, w in zip(("dq", "dk", "dv"), bufs, want):
        assert bitwise_equal(g, w), f"side stream, caller buffers: {name} differs: {first_difference(g, w)}"
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, tuple(want), 0.1)


# --------------------------------------------------------------------------------------
# torch.compile and CUDA graphs
# --------------------------------------------------------------------------------------

def test_torch_compile_fullgraph_forward_backward():
    """A step (scale q, attention, float32 weighted sum) compiled with fullgraph=True: the loss
    matches eager and its gradients through torch.ops.flashgen.bwd have eager's bits (the same
    kernels on the same values; deterministic=True), for two shapes (a recompile)."""
    torch._dynamo.reset()
    dtype, d = pick(causals=(True,))

    def step(q, k, v, w):
        out = flashgen.flash_attn_func(q * 1.5, k, v, causal=True, deterministic=True)
        return (out.float() * w).sum()

    compiled = torch.compile(step, fullgraph=True)
    for seed, sq in ((0, 128), (1, 77)):
        q, k, v = make_qkv(2, sq, 200, 4, 2, d, dtype, seed=seed)
        w = randn(2, sq, 4, d, dtype=torch.float32, seed=seed + 5)
        compiled_step_matches_eager(step, compiled, (q, k, v), w, f"seqlen_q {sq}")


def test_cuda_graph_training_step_replays_on_new_data():
    """Forward + backward of flash_attn_func on static tensors captured in one CUDA graph (the
    gradients allocated during capture, as in PyTorch's whole-network capture); replayed after
    copying new values into the static inputs, the static gradients carry the bits of an eager
    step on those values and pass the reference rule."""
    dtype, d = pick(causals=(True,))
    b, s, h, hk = 2, 257, 4, 2
    q, k, v = (x.requires_grad_() for x in make_qkv(b, s, s, h, hk, d, dtype, seed=40))
    g = randn(b, s, h, d, dtype=dtype, seed=43)

    def step():
        flashgen.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture (kernel loading, allocator)
        for _ in range(2):
            step()
            for t in (q, k, v):
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    static = (q.grad, k.grad, v.grad)
    for seed in (50, 60):
        nq, nk, nv = make_qkv(b, s, s, h, hk, d, dtype, seed=seed)
        ng = randn(b, s, h, d, dtype=dtype, seed=seed + 3)
        with torch.no_grad():
            for dst, src in ((q, nq), (k, nk), (v, nv), (g, ng)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _, want = autograd_grads(nq, nk, nv, ng, True, deterministic=True)
        for name, a, w in zip(("dq", "dk", "dv"), static, want):
            assert bitwise_equal(a, w), f"replay (seed {seed}): {name} differs from eager: {first_difference(a, w)}"
        check_bwd(nq, nk, nv, ng, True, static)


# --------------------------------------------------------------------------------------
# head_dim_v != head_dim
# --------------------------------------------------------------------------------------

# (head_dim, head_dim_v): DeepSeek's (192, 128); smaller q/k (64, 128) and v (128, 64) on hd128; and
# pairs where whole column slices of dK ((64, 256): hd256's second 128-column slice) or dV ((256,
# 64); (192, 128): hd192's third 64-column slice) lie past the gradient's width.
HDV_PAIRS = [(192, 128), (64, 128), (128, 64), (64, 256), (256, 64)]
HDV_SHAPES = [  # (batch, seqlen_q, seqlen_k, heads, heads_k): GQA 2, odd lengths
    (2, 113, 239, 4, 2),
    (3, 239, 113, 8, 4),  # causal: 126 rows see no key
]


def make_qkv_dv(b, sq, sk, h, hk, d, dv, dtype, seed: int):
    """make_qkv's q and k (head_dim d), v of head_dim_v dv."""
    q, k, _ = make_qkv(b, sq, sk, h, hk, d, dtype, seed=seed)
    return q, k, randn(b, sk, hk, dv, dtype=dtype, seed=seed + 2)


def hdv_id(pair) -> str:
    return "hd{}v{}".format(*pair)


@pytest.mark.parametrize("shape", HDV_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("pair", HDV_PAIRS, ids=hdv_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_backward_head_dim_v_matches_reference(dtype, pair, causal, shape):
    """head_dim_v != head_dim through flash_attn_backward (NaN-poisoned dq, dk, dv of q's, k's and
    v's shapes; both deterministic modes) by FA3's rule; it runs on the bwd variant of max(head_dim,
    head_dim_v). out and lse from flashgen's forward where a variant serves the pair, else from
    the reference (flashgen's out and lse are checked against it first). Causal rows that see no
    key get dq exactly 0."""
    d, dv = pair
    need_bwd(dtype, max(d, dv), causal)
    b, sq, sk, h, hk = shape
    scale = d ** -0.5
    seed = sq * 7 + sk + d + 3 * dv
    q, k, v = make_qkv_dv(b, sq, sk, h, hk, d, dv, dtype, seed)
    dout = randn(b, sq, h, dv, dtype=dtype, seed=seed + 3)
    out, lse = forward_out_lse(q, k, v, causal, scale)
    assert out.shape == (b, sq, h, dv)
    if fwd_missing_dv(dtype, d, dv, causal) is None:  # flashgen's forward: checked first, to tell the two apart
        check_fwd(q, k, v, causal, out, lse, scale)
    got = {f"deterministic={det}": fg_backward(dout, q, k, v, out, lse, causal, scale, deterministic=det)
           for det in (False, True)}
    torch.cuda.synchronize()
    check_bwd(q, k, v, dout, causal, got, scale)
    blind = max(sq - sk, 0) if causal else 0
    for label, (dq, _, _) in got.items():
        nz = int((dq[:, :blind] != 0).sum())
        assert nz == 0, f"{label}: {nz} dq elements of the {blind} rows that see no key are not 0"


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("pair", [(192, 128), (64, 128), (128, 64)], ids=hdv_id)
def test_backward_head_dim_v_autograd_matches_dlpack(pair, causal):
    """Autograd through flash_attn_func (deterministic=True) for head_dim_v != head_dim: gradients
    of q's, k's and v's shapes by FA3's rule, with the bits of flash_attn_backward on the same
    out and lse. Needs a forward variant serving the pair (configs/fwd.yaml builds (192, 128);
    (64, 128) and (128, 64) run on hd128): skipped with MISSING-FWD-VARIANT otherwise."""
    d, dv = pair
    dtype = torch.bfloat16
    why = fwd_missing_dv(dtype, d, dv, causal) or bwd_missing(dtype, max(d, dv), causal)
    if why:
        pytest.skip(why)
    b, sq, sk, h, hk = 2, 113, 239, 4, 2
    q, k, v = make_qkv_dv(b, sq, sk, h, hk, d, dv, dtype, seed=d + dv)
    dout = randn(b, sq, h, dv, dtype=dtype, seed=d + dv + 3)
    leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flashgen.flash_attn_func(*leaves, causal=causal, deterministic=True, return_attn_probs=True)
    poison_cached_blocks(8 * sum(x.numel() for x in (q, k, v)))
    want = torch.autograd.grad(out, leaves, dout)
    got = fg_backward(dout, q, k, v, out.detach(), lse.detach(), causal, d ** -0.5, deterministic=True)
    torch.cuda.synchronize()
    for name, x, g, w in zip(("dq", "dk", "dv"), (q, k, v), got, want):
        assert w.shape == x.shape and w.dtype == x.dtype, f"{name}: {tuple(w.shape)} {w.dtype}"
        assert bitwise_equal(g, w), f"{name}: flash_attn_backward differs from autograd's: {first_difference(g, w)}"
    check_bwd(q, k, v, dout, causal, tuple(want), d ** -0.5)
