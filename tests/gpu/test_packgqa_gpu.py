"""GPU correctness of PackGQA (FA3's: the query heads of one K/V head packed into one tile;
templates/fwd.cu.j2 ``kPackGqa``, flashgen.core.pack_gqa_rule) through ``flashgen.flash_attn_func``.

Each case runs twice, with the rule forced to pack and forced not to (``core.pack_gqa_rule``
patched, the prepared-call caches emptied), and a spy on ``core.launch_forward`` asserts which
kernel ran. Both outputs are checked against the float32 reference on upcast inputs with FA3's
rule (_ref.check_fwd: out within 2x the low-precision baseline's error, lse -inf exactly where the
reference's is), out and lse allocated from NaN-poisoned blocks (an element not written shows up
as NaN). Shapes: GQA groups 2-16 (7 and 6: groups that do not divide the tile, whose last rows are
padding), MQA, odd lengths, seqlen_q > seqlen_k (causal rows that see no key), several tiles per
CTA (the persistent loop and the causal tile counter), windows, sinks (per query head: a thread's
two rows may be of two heads), and the rule's own choice for decode-like calls.

A case whose PackGQA variant is not built skips (MISSING-FWD-VARIANT). Skipped without an sm_90 GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
import flashgen.core as core  # noqa: E402
import flashgen.dlpack_api as dlpack_api  # noqa: E402
import flashgen.interface as interface  # noqa: E402
import flashgen.split_kv as split_kv  # noqa: E402
from flashgen.core import mask_spec  # noqa: E402
from flashgen.manifest import load_manifest  # noqa: E402
from _ref import DTYPE_NAMES, bitwise_equal, check_fwd, make_qkv, poison_cached_blocks, variant_missing  # noqa: E402

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, causal, window)
CASES = [
    (2, 1, 1000, 32, 4, 128, BF16, False, (-1, -1)),    # decode, group 8
    (2, 1, 1000, 32, 4, 128, BF16, True, (-1, -1)),     # causal decode = unmasked (FA3)
    (3, 7, 333, 12, 2, 64, FP16, True, (-1, -1)),       # group 6, the decode tile: 21 positions x 6 of 128 rows
    (1, 17, 513, 28, 4, 128, BF16, True, (-1, -1)),     # group 7 (Qwen2): 126 of 128 rows, 2 padding
    (2, 113, 203, 16, 2, 256, BF16, False, (-1, -1)),   # several tiles per head
    (2, 113, 203, 16, 2, 256, FP16, True, (-1, -1)),
    (1, 300, 300, 8, 1, 64, BF16, True, (-1, -1)),      # MQA
    (2, 239, 61, 8, 2, 128, FP16, True, (-1, -1)),      # seqlen_q > seqlen_k: early rows see no key
    (16, 200, 777, 16, 2, 128, BF16, True, (-1, -1)),   # 416 tiles: persistent CTAs, tile counter
    (16, 200, 777, 16, 2, 64, FP16, False, (-1, -1)),   # 224 tiles, static persistent order
    (2, 57, 500, 32, 2, 96, BF16, False, (-1, -1)),     # head_dim 96, group 16
    (2, 129, 400, 8, 2, 128, BF16, False, (100, 3)),    # sliding window (local)
    (2, 64, 1024, 32, 8, 64, FP16, True, (256, -1)),    # causal with a window
    (2, 65, 129, 4, 4, 128, BF16, False, (-1, -1)),     # group 1 (MHA) forced packed
]


def case_id(c) -> str:
    b, sq, sk, h, hk, d, dt, causal, w = c
    s = f"{DTYPE_NAMES[dt]}-hd{d}-b{b}_q{sq}_k{sk}_h{h}_hk{hk}"
    return s + ("-causal" if causal else "") + ("" if w == (-1, -1) else "-w{}_{}".format(*w))


def need_pack(c, kind: str = "pack_gqa") -> None:
    """Skip unless the case's ``kind`` of fwd variant (``pack_gqa``, or ``varlen``) is built for its key."""
    b, sq, sk, h, hk, d, dt, causal, w = c[:9]
    m = mask_spec(causal, w, sq, sk)
    why = variant_missing("fwd", {"dtype": DTYPE_NAMES[dt], "head_dim": d, "head_dim_v": d, "causal": m.causal,
                                  "local": m.local, "softcap": False, kind: True},
                          round_up=("head_dim", "head_dim_v"))
    if why:
        pytest.skip(why)


@pytest.fixture
def used(monkeypatch):
    """The variants core.launch_forward launched, in order (the prepared calls emptied afterwards)."""
    seen = []
    real = core.launch_forward

    def spy(prep, *a, **kw):
        seen.append(prep.plan.variant)
        return real(prep, *a, **kw)

    monkeypatch.setattr(core, "launch_forward", spy)
    yield seen
    interface._fwd_calls.clear()  # prepared under a forced rule: not for later tests
    core._prepared_forwards.clear()


def forced(monkeypatch, pack: bool) -> None:
    """The rule forced to ``pack``; the prepared calls emptied so that the next call asks it."""
    monkeypatch.setattr(core, "pack_gqa_rule", lambda *a: pack)
    interface._fwd_calls.clear()
    core._prepared_forwards.clear()


def run(q, k, v, causal, window, sink=None):
    b, sq, h = q.shape[:3]
    poison_cached_blocks(q.element_size() * b * sq * h * v.shape[-1] + 4 * b * h * sq)
    with torch.no_grad():
        out, lse = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink,
                                           return_attn_probs=True)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_packed_and_unpacked_match_the_reference(c, used, monkeypatch):
    need_pack(c)
    b, sq, sk, h, hk, d, dt, causal, w = c
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=sq + sk + h)
    results = {}
    for pack in (True, False):
        forced(monkeypatch, pack)
        out, lse = run(q, k, v, causal, w)
        assert bool(used[-1].params.get("pack_gqa")) == pack, f"ran {used[-1].name}, wanted pack_gqa={pack}"
        check_fwd(q, k, v, causal, out, lse, window_size=w)
        results[pack] = out
    # the same softmax in another row order: equal up to fp32 rounding
    torch.testing.assert_close(results[True], results[False], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("c", [(2, 5, 300, 16, 2, 128, BF16, True, (-1, -1)),
                               (1, 33, 129, 12, 2, 64, FP16, False, (-1, -1))], ids=case_id)
def test_packed_sinks_per_query_head(c, used, monkeypatch):
    """A tile's rows belong to several heads: each row adds its own head's sink."""
    need_pack(c)
    b, sq, sk, h, hk, d, dt, causal, w = c
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=7)
    g = torch.Generator(device="cuda").manual_seed(3)
    sink = 3.0 * torch.randn(h, generator=g, device="cuda", dtype=torch.float32)
    sink[0], sink[-1] = 6.0, -20.0
    forced(monkeypatch, True)
    out, lse = run(q, k, v, causal, w, sink)
    assert used[-1].params.get("pack_gqa")
    check_fwd(q, k, v, causal, out, lse, sink=sink)


def test_rule_packs_decode_and_not_prefill(used, monkeypatch):
    """The rule's own choice (flashgen.core.pack_gqa_rule): a decode step (seqlen_q 1, group 8)
    packs, a prompt (seqlen_q 2048) does not; both correct."""
    need_pack((1, 1, 64, 32, 4, 128, BF16, False, (-1, -1)))
    interface._fwd_calls.clear()
    core._prepared_forwards.clear()
    for sq, want in ((1, True), (2048, False)):
        q, k, v = make_qkv(2, sq, 2048, 32, 4, 128, BF16, seed=sq)
        out, lse = run(q, k, v, True, (-1, -1))
        assert bool(used[-1].params.get("pack_gqa")) == want, (sq, used[-1].name)
        check_fwd(q, k, v, True, out, lse)


def _decode_tiles_built(head_dim: int) -> bool:
    """Whether bf16 ``head_dim``'s non-varlen PackGQA decode tiles are built: 128 x 128 wg2 (head_dim 64) and the
    one-warpgroup tile (64 x 128; 64 x 64 at head_dim 256; configs/fwd.yaml extra)."""
    tiles = {(v.params["block_m"], v.params["consumer_wgs"]) for v in load_manifest().variants
             if v.family == "fwd" and v.params.get("pack_gqa") and not v.params.get("varlen")
             and v.params["head_dim"] == head_dim and v.params["dtype"] == "bf16" and not v.default}
    return (64, 1) in tiles and (head_dim != 64 or (128, 2) in tiles)


@pytest.mark.parametrize("wg1", [True, False], ids=["wg1", "nowg1"])
def test_decode_tile_by_seqlen_q(used, monkeypatch, wg1):
    """head_dim 64's PackGQA decode tiles (configs/fwd.yaml extra): calls whose packed rows (group x seqlen_q) fit
    64 run on the one-warpgroup 64 x 128 tile while core.DECODE_WG1 (wg1), the others with seqlen_q <=
    core.PACK_GQA_DECODE_MAX_SEQLEN_Q on 128 x 128 with 2 consumer warpgroups, longer ones on the key's 192-row
    tile (core.FEW_TILE off); each against the reference, groups 4 and 8, causal or not, seqlen_q 1-128."""
    if not _decode_tiles_built(64):
        pytest.skip("MISSING-FWD-VARIANT: head_dim 64's PackGQA decode tiles not built")
    monkeypatch.setattr(core, "DECODE_WG1", wg1)
    monkeypatch.setattr(core, "FEW_TILE", False)  # (test_few_tile_calls: seqlen_q 65-128 over 777 keys would take it)
    forced(monkeypatch, True)
    for sq, hk, causal in ((1, 8, False), (1, 4, True), (2, 4, False), (8, 4, True), (16, 8, False), (9, 4, False),
                           (64, 4, True), (64, 8, False), (65, 4, True), (128, 8, False)):
        q, k, v = make_qkv(2, sq, 777, 32, hk, 64, BF16, seed=sq + hk)
        out, lse = run(q, k, v, causal, (-1, -1))
        var = used[-1]
        rows = 32 // hk * sq
        want = (64 if wg1 and rows <= 64 else 128) if sq <= 64 else 192
        assert var.params.get("pack_gqa") and var.params["block_m"] == want, (sq, hk, var.name)
        check_fwd(q, k, v, causal, out, lse)


def test_few_tile_calls(used, monkeypatch):
    """Calls whose 192-row tiles are few (core.FEW_TILE) run on head_dim 64's 128 x 128 two-warpgroup tile where it
    takes no more waves over the SMs (unpacked, packed at 128 rows, causal over >= 8x as many keys, an MHA decode),
    the others on the key's 192-row tile; each against the reference, fp16 and bf16."""
    few = {(v.params["dtype"], v.params["causal"], bool(v.params.get("pack_gqa"))) for v in load_manifest().variants
           if v.family == "fwd" and v.params["head_dim"] == 64 and not v.params.get("varlen")
           and (v.params["block_m"], v.params["consumer_wgs"]) == (128, 2)}
    if len(few) < 8:
        pytest.skip(f"MISSING-FWD-VARIANT: head_dim 64's 128 x 128 wg2 tiles not built for every key ({sorted(few)})")
    monkeypatch.setattr(core, "FEW_TILE", True)
    interface._fwd_calls.clear()
    core._prepared_forwards.clear()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (batch, seqlen_q, seqlen_k, heads, heads_k, causal): 192-row / 128-row tiles on 132 SMs
    for b, sq, sk, h, hk, causal in ((2, 512, 4097, 32, 8, False),  # 192 / 256 tiles: 2 waves each
                                     (1, 768, 3000, 32, 8, False),  # 128 (1 wave) / 192 (2): the 192-row tile
                                     (2, 250, 4001, 32, 8, True),  # 128 / 128; 4001 >= 8 x 250
                                     (2, 300, 700, 32, 8, True),  # 700 < 8 x 300: the 192-row tile
                                     (2, 100, 2000, 32, 4, False),  # packed: 40 / 56 tiles (24 / 16 positions)
                                     (8, 1, 3000, 32, 32, False)):  # MHA decode: 256 / 256
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = make_qkv(b, sq, sk, h, hk, 64, dtype, seed=sq + sk)
            out, lse = run(q, k, v, causal, (-1, -1))
            var = used[-1]
            t192 = core._tile_grid(b, sq, h, hk, 192, core.pack_gqa_rule(sq, h, hk, 192))[2]
            t128 = core._tile_grid(b, sq, h, hk, 128, core.pack_gqa_rule(sq, h, hk, 128))[2]
            want = 128 if -(-t128 // sms) <= -(-t192 // sms) and not (causal and sk < 8 * sq) else 192
            assert var.params["block_m"] == want, (b, sq, sk, h, hk, causal, var.name)
            if want == 128:
                assert bool(var.params.get("pack_gqa")) == core.pack_gqa_rule(sq, h, hk, 128), var.name
            check_fwd(q, k, v, causal, out, lse)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_one_warpgroup_decode_tile(used, monkeypatch, head_dim):
    """The one-warpgroup decode tile of head_dim 128 (64 x 128) and 256 (64 x 64; configs/fwd.yaml extra)
    against the reference: one to eight new tokens with groups 4 and 8, causal, a window, a sink, keys from 1 to
    5000, several tiles per CTA (batch 40); calls past 64 packed rows on the key's own tile (128 rows)."""
    if not _decode_tiles_built(head_dim):
        pytest.skip(f"MISSING-FWD-VARIANT: head_dim {head_dim}'s one-warpgroup decode tile not built")
    monkeypatch.setattr(core, "DECODE_WG1", True)
    forced(monkeypatch, True)
    for b, sq, sk, hk, causal, window, sink in ((2, 1, 1, 8, False, (-1, -1), False), (3, 1, 4999, 4, True, (-1, -1), True),
                                               (40, 2, 777, 8, False, (-1, -1), False), (2, 8, 1000, 4, True, (-1, -1), False),
                                               (2, 4, 3000, 8, False, (100, 0), True), (2, 9, 513, 4, True, (-1, -1), False)):
        q, k, v = make_qkv(b, sq, sk, 32, hk, head_dim, BF16, seed=sq + sk + hk)
        s = torch.randn(32, device="cuda", dtype=torch.float32) if sink else None
        out, lse = run(q, k, v, causal, window, s)
        var = used[-1]
        want = 64 if 32 // hk * sq <= 64 else 128
        assert var.params.get("pack_gqa") and var.params["block_m"] == want and var.params["head_dim"] == head_dim, \
            (b, sq, sk, var.name)
        check_fwd(q, k, v, causal, out, lse, window_size=window, sink=s)


def test_packed_is_deterministic(used, monkeypatch):
    """Many tiles per CTA with the causal tile counter: 20 runs bitwise equal (a race would move)."""
    c = (16, 200, 777, 16, 2, 128, BF16, True, (-1, -1))
    need_pack(c)
    b, sq, sk, h, hk, d, dt, causal, w = c
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=11)
    forced(monkeypatch, True)
    first, _ = run(q, k, v, causal, w)
    assert used[-1].params.get("pack_gqa")
    for _ in range(19):
        again, _ = run(q, k, v, causal, w)
        assert bitwise_equal(again, first)


def test_flash_attn_func_pack_gqa_hint(used):
    """FA3's pack_gqa hint through flash_attn_func: True packs a GQA call with a PackGQA variant
    (here one the rule would not pack: a prompt), False never packs (here a decode step the rule
    would pack), None leaves it to the rule; softcap has no PackGQA variant, so True runs unpacked.
    Every output against the reference."""
    need_pack((1, 1, 64, 32, 4, 128, BF16, False, (-1, -1)))
    interface._fwd_calls.clear()
    core._prepared_forwards.clear()
    for sq, hint, want in ((2048, True, True), (1, False, False), (1, None, True), (2048, None, False)):
        q, k, v = make_qkv(2, sq, 2048, 32, 4, 128, BF16, seed=sq + 1)
        b, h = q.shape[0], q.shape[2]
        poison_cached_blocks(q.element_size() * b * sq * h * 128 + 4 * b * h * sq)
        with torch.no_grad():
            out, lse = flashgen.flash_attn_func(q, k, v, causal=True, pack_gqa=hint, return_attn_probs=True)
        torch.cuda.synchronize()
        assert bool(used[-1].params.get("pack_gqa")) == want, (sq, hint, used[-1].name)
        check_fwd(q, k, v, True, out, lse)
    q, k, v = make_qkv(2, 1, 512, 32, 4, 128, BF16, seed=5)
    with torch.no_grad():
        out, lse = flashgen.flash_attn_func(q, k, v, softcap=15.0, pack_gqa=True, return_attn_probs=True)
    assert not used[-1].params.get("pack_gqa")
    check_fwd(q, k, v, False, out, lse, softcap=15.0, factor=3.0)


# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, causal, window, num_splits)
SPLIT_CASES = [
    (16, 1, 8192, 32, 4, 64, BF16, False, (-1, -1), 0),   # decode, group 8: the heuristic's splits
    (2, 1, 8192, 32, 4, 128, FP16, True, (-1, -1), 3),
    (3, 5, 1000, 16, 2, 128, BF16, True, (-1, -1), 4),    # causal rows: the last split's keys differ per row
    (2, 3, 777, 8, 8, 64, FP16, False, (-1, -1), 3),      # MHA, keys not a multiple of 128
    (2, 4, 700, 8, 2, 64, FP16, False, (-1, -1), 10),     # more splits than key blocks: empty shares (0 / -inf)
    (2, 2, 3000, 16, 2, 64, BF16, False, (500, 0), 3),    # a window (its 5 key blocks: the heuristic says 1)
    (1, 239, 200, 8, 2, 128, BF16, True, (-1, -1), 3),    # seqlen_q > seqlen_k: rows that see no key
]


@pytest.mark.parametrize("c", SPLIT_CASES, ids=lambda c: case_id(c[:9]) + f"-splits{c[9]}")
def test_flash_attn_func_num_splits(c, used):
    """FA3's num_splits through flash_attn_func: split-KV on the varlen kernel over the padded batch, the
    partials merged by the combine kernel (flashgen.split_kv). Against the reference, out, lse and the
    partial buffers (uninitialised: every split's tile writes every row) from NaN-poisoned blocks, with a sink on
    the first case; which kernel ran (the varlen variant when the call splits); 10 repeats bitwise equal (the
    merge's order is fixed); the DLPack entry's num_splits: the same bits, into a given out with padded rows."""
    need_pack(c, "varlen")
    b, sq, sk, h, hk, d, dt, causal, w, n = c
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dt, seed=sq + sk)
    sink = None
    if b == 16:  # (the first case)
        sink = 2.0 * torch.randn(h, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    interface._fwd_calls.clear()
    splits = split_kv.split_count(n, b, h, hk, sq, sk, q.device.index, causal, w, 2 * d * 2)  # flash_attn_func's
    workspace = -(-4 * splits * b * sq * h * d // 256) * 256 + 4 * splits * b * h * sq  # the partial O, then LSE
    first = None
    for _ in range(10):
        poison_cached_blocks(workspace)  # (and, smaller, out and lse)
        with torch.no_grad():
            out, lse = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=w, num_splits=n,
                                               learnable_sink=sink, return_attn_probs=True)
        torch.cuda.synchronize()
        assert bool(used[-1].params.get("varlen")) == (splits > 1), (splits, used[-1].name)
        if first is None:
            check_fwd(q, k, v, causal, out, lse, window_size=w, sink=sink)
            first = out
        else:
            assert bitwise_equal(out, first)
    assert splits > 1, "the case should split"
    # the DLPack entry (flashgen.split_kv, shared with flash_attn_func): the same launches, so the same bits, here
    # into a given out with padded rows (its padding untouched)
    poison_cached_blocks(workspace)
    padded = torch.full((b, sq, h, d + 8), float("nan"), dtype=dt, device="cuda")
    out2, lse2 = dlpack_api.flash_attn_forward(q, k, v, causal=causal, window_size=w, num_splits=n,
                                               learnable_sink=sink, out=padded[..., :d],
                                               stream=torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert bool(used[-1].params.get("varlen")), used[-1].name
    assert bitwise_equal(out2, first) and bitwise_equal(lse2, lse) and torch.isnan(padded[..., d:]).all()
