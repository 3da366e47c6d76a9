"""Config schema validation (exit status 2, one line per problem naming file/key/value/allowed),
expansion counts, the tile table's default flags and the real configs/."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, SMALL_FWD, cli, cli_subprocess, make_project  # noqa: E402

from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.errors import ConfigError  # noqa: E402
from flashgen.generator.project import Project  # noqa: E402


def problems_of(tmp_path, text, name="bad.yaml"):
    proj = make_project(tmp_path, {name: text})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    return proj, ei.value.problems


def check_cli_rejects(proj, *needles):
    """`flashgen build` and `flashgen list` exit 2, print every needle, no traceback, build nothing."""
    for cmd in (["build"], ["list"]):
        r = cli(cmd, proj.root)
        assert r.exit_code == 2, (cmd, r.output)
        for n in needles:
            assert n in r.stderr, (n, r.stderr)
        assert "Traceback" not in r.output
    assert not proj.build_dir.exists(), "nothing may be built from an invalid config"


# ------------------------------------------------------------------------------- invalid inputs


def test_unknown_top_level_key(tmp_path):
    proj, probs = problems_of(tmp_path, SMALL_FWD + "colour: blue\n")
    assert len(probs) == 1
    assert "configs/bad.yaml" in probs[0] and "colour" in probs[0] and "'blue'" in probs[0]
    assert "allowed keys" in probs[0] and "tiles" in probs[0]
    check_cli_rejects(proj, "configs/bad.yaml", "colour")


def test_unknown_key_in_tile_row(tmp_path):
    text = SMALL_FWD.replace("{head_dim: 64, block_m: 192", "{head_dim: 64, blockm: 3, block_m: 192")
    proj, probs = problems_of(tmp_path, text)
    assert any("tiles[0].blockm" in p and "unknown key" in p and "block_m" in p for p in probs), probs
    check_cli_rejects(proj, "tiles[0].blockm")


def test_wrong_type(tmp_path):
    text = SMALL_FWD.replace("causal: [false, true]", "causal: [false, 'yes']")
    proj, probs = problems_of(tmp_path, text)
    assert probs == [p for p in probs if "matrix.causal[1]" in p] and len(probs) == 1, probs
    assert "'yes'" in probs[0] and "wrong type string" in probs[0] and "boolean" in probs[0]
    check_cli_rejects(proj, "matrix.causal[1]", "boolean")


def test_bool_is_not_an_int(tmp_path):
    text = SMALL_FWD.replace("block_n: 128, consumer_wgs: 2", "block_n: true, consumer_wgs: 2")
    _, probs = problems_of(tmp_path, text)
    assert any("tiles[1].block_n = true" in p and "integer" in p for p in probs), probs


def test_bad_head_dim(tmp_path):
    text = SMALL_FWD.replace("head_dim: [64, 128]", "head_dim: [64, 100]")
    proj, probs = problems_of(tmp_path, text)
    assert any("matrix.head_dim[1] = 100" in p and "64, 96, 128, 192, 256" in p for p in probs), probs
    check_cli_rejects(proj, "matrix.head_dim[1] = 100", "64, 96, 128, 192, 256")


@pytest.mark.parametrize("bn", [72, 8, 272])
def test_bad_block_n(tmp_path, bn):
    text = SMALL_FWD.replace("block_n: 128, consumer_wgs: 2", f"block_n: {bn}, consumer_wgs: 2")
    proj, probs = problems_of(tmp_path, text)
    assert any(f"tiles[1].block_n = {bn}" in p and "multiple of 16 in [16, 256]" in p for p in probs), probs
    check_cli_rejects(proj, f"tiles[1].block_n = {bn}")


@pytest.mark.parametrize("bn, ok", [(224, True), (160, True), (208, False), (80, False)])
def test_e4m3_block_n_multiple_of_32(tmp_path, bn, ok):
    """e4m3 block_n: a multiple of 32 (the P V GEMM's k32 steps; K descales per 32 or 64 columns),
    so FA3's 128 x 224 is accepted and 208 (a multiple of 16 only) is refused."""
    text = SMALL_FWD.replace("dtype: [bf16, fp16]", "dtype: [e4m3]").replace(
        "{head_dim: 128, block_m: 128, block_n: 128, consumer_wgs: 2}",
        f"{{head_dim: 128, block_m: 128, block_n: {bn}, consumer_wgs: 2, vt_global: true}}")
    if ok:
        vs = load_variants(make_project(tmp_path, {"ok.yaml": text}))
        assert sum(v.params["block_n"] == bn for v in vs) == 2  # causal and not
        return
    _, probs = problems_of(tmp_path, text)
    hit = [p for p in probs if f"block_n = {bn}" in p and "multiple of 32 with dtype e4m3" in p]
    assert len(hit) == 2, probs


def test_block_m_consumer_wgs_mismatch(tmp_path):
    text = SMALL_FWD.replace("{head_dim: 64, block_m: 192, block_n: 128, consumer_wgs: 3}",
                             "{head_dim: 64, block_m: 128, block_n: 128, consumer_wgs: 3}")
    proj, probs = problems_of(tmp_path, text)
    hit = [p for p in probs if "tiles[0].block_m" in p and "block_m = 128" in p and "64 * consumer_wgs = 192" in p]
    assert hit, probs
    check_cli_rejects(proj, "tiles[0].block_m", "64 * consumer_wgs = 192")


def test_consumer_wgs_and_stages_ranges(tmp_path):
    text = SMALL_FWD.replace("block_n: 128, consumer_wgs: 2}", "block_n: 128, consumer_wgs: 4, stages: 5}")
    _, probs = problems_of(tmp_path, text)
    assert any("tiles[1].consumer_wgs = 4" in p and "2, 3" in p for p in probs), probs
    assert any("tiles[1].stages = 5" in p and "1, 2, 3, 4" in p for p in probs), probs


def test_smem_over_limit(tmp_path):
    # hd128, 128x176, 3 stages: 32768 + 3*176*128*2*2 + 2048 = 305152 bytes > 232448
    text = SMALL_FWD.replace("{head_dim: 128, block_m: 128, block_n: 128, consumer_wgs: 2}",
                             "{head_dim: 128, block_m: 128, block_n: 176, consumer_wgs: 2, stages: 3}")
    proj, probs = problems_of(tmp_path, text)
    hit = [p for p in probs if "smem_bytes = 305152" in p]
    assert len(hit) == 4, probs  # bf16/fp16 x causal/non-causal at head_dim 128
    assert all("configs/bad.yaml" in p and "232448" in p and "tiles[1]" in p for p in hit)
    check_cli_rejects(proj, "smem_bytes = 305152", "at most 232448")


def test_register_budget_three_wgs(tmp_path):
    text = SMALL_FWD.replace("{head_dim: 128, block_m: 128, block_n: 128, consumer_wgs: 2}",
                             "{head_dim: 128, block_m: 192, block_n: 144, consumer_wgs: 3}")
    _, probs = problems_of(tmp_path, text)
    assert any("block_n = 144" in p and "3 consumer warpgroups" in p for p in probs), probs


def test_all_problems_collected_across_files(tmp_path):
    proj = make_project(tmp_path, {
        "a.yaml": SMALL_FWD.replace("head_dim: [64, 128]", "head_dim: [64, 100]") + "bogus: 1\n",
        "b.yaml": "family: fwd\nextra:\n  - {dtype: fp8, head_dim: 128, causal: false, block_m: 128, block_n: 20, consumer_wgs: 2}\n",
    })
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    probs = ei.value.problems
    assert any(p.startswith("configs/a.yaml") and "bogus" in p for p in probs)
    assert any(p.startswith("configs/a.yaml") and "head_dim[1] = 100" in p for p in probs)
    assert any(p.startswith("configs/b.yaml") and "extra[0].dtype = 'fp8'" in p for p in probs)
    assert any(p.startswith("configs/b.yaml") and "extra[0].block_n = 20" in p for p in probs)
    r = cli_subprocess(["build"], proj.root)
    assert r.returncode == 2
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]) == len(probs) >= 4
    assert "Traceback" not in r.stderr + r.stdout


def test_yaml_syntax_and_duplicate_keys(tmp_path):
    proj = make_project(tmp_path, {"a.yaml": SMALL_FWD + "tiles: []\n", "b.yaml": "family: [fwd\n"})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    probs = ei.value.problems
    assert any("configs/a.yaml" in p and "duplicate key 'tiles'" in p for p in probs), probs
    assert any("configs/b.yaml" in p and "invalid YAML" in p and "line" in p for p in probs), probs
    r = cli_subprocess(["list"], proj.root)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_missing_tile_row(tmp_path):
    text = SMALL_FWD.replace("head_dim: [64, 128]", "head_dim: [64, 128, 256]")
    _, probs = problems_of(tmp_path, text)
    assert len(probs) == 4 and all("no tiles row matches" in p and "head_dim=256" in p for p in probs), probs


def test_conflicting_default_tiles_across_files(tmp_path):
    other = SMALL_FWD.replace("block_n: 128, consumer_wgs: 2", "block_n: 112, consumer_wgs: 2")
    proj = make_project(tmp_path, {"a.yaml": SMALL_FWD, "b.yaml": other})
    with pytest.raises(ConfigError) as ei:
        load_variants(proj)
    assert len(ei.value.problems) == 4 and all("two default tiles" in p for p in ei.value.problems)


# ------------------------------------------------------------------------------------ expansion


def test_expansion_counts_exclude_and_extra(tmp_path):
    text = SMALL_FWD + "exclude:\n  - {dtype: fp16, head_dim: 64}\n  - {causal: true, head_dim: [128]}\n"
    text += "extra:\n  - {dtype: bf16, head_dim: 128, causal: true, block_n: 96}\n"
    proj = make_project(tmp_path, {"fwd.yaml": text})
    vs = load_variants(proj)
    # 8 matrix points - 2 (fp16 hd64) - 2 (causal hd128) + 1 extra
    assert len(vs) == 5
    extra = [v for v in vs if v.params["block_n"] == 96]
    assert len(extra) == 1 and extra[0].default is False and extra[0].params["block_m"] == 128
    assert sum(v.default for v in vs) == 4


def test_tile_table_most_specific_row_wins(tmp_path):
    text = SMALL_FWD.replace("tiles:\n", "tiles:\n  - {head_dim: 128, causal: true, block_m: 128, block_n: 96, consumer_wgs: 2, stages: 3}\n")
    proj = make_project(tmp_path, {"fwd.yaml": text})
    vs = load_variants(proj)
    hd128 = {(v.params["dtype"], v.params["causal"]): v for v in vs if v.params["head_dim"] == 128}
    assert hd128[("bf16", True)].params["block_n"] == 96 and hd128[("bf16", True)].params["stages"] == 3
    assert hd128[("bf16", False)].params["block_n"] == 128 and hd128[("bf16", False)].params["stages"] == 2


def test_real_configs():
    proj = Project(REPO)
    vs = load_variants(proj)
    assert {v.family for v in vs} == {"fwd", "bwd", "combine", "quant", "varlen_prep"}
    assert [v.params["threads"] for v in vs if v.family == "varlen_prep"] == [256]  # one variant, empty dispatch key
    combine = [v for v in vs if v.family == "combine"]
    assert {v.params["dtype"] for v in combine} == {"fp32", "bf16", "fp16"} and all(v.default for v in combine)
    quant = [v for v in vs if v.family == "quant"]
    assert {v.params["dtype"] for v in quant} == {"bf16", "fp16"} and all(v.default for v in quant)
    # fwd and bwd: {dtype} x {head_dim} x {none, causal, local} x {softcap}; fwd also head_dim 192 / head_dim_v 128,
    # PackGQA for {dtype} x {head_dim} x {none, causal, local} without softcap (30),
    # and e4m3 x {64, 128, 256} x {none, causal, local} x {softcap} (configs/fwd_fp8.yaml); plus the tiles the
    # shipped tune tables name (configs/tune/; tests/test_tune.py checks those), left out here
    tuned = [v for v in vs if v.tuned]
    assert all(v.default_build and not v.default for v in tuned)
    # + bwd's block_m 80 extras (non-causal hd128, bf16 / fp16: not dispatch defaults; core.DQ_SWAP_MIN_SEQLEN_Q)
    swap = [v for v in vs if v.family == "bwd" and v.params["block_m"] == 80 and v.default_build and v.params["dkv_steps"]]
    # + bwd's dkv_steps-off twins (block_n 128, never dispatch defaults): head_dim 128's in the default build
    # (deterministic calls run on them: core.DET_NOSTEPS_HEAD_DIMS), head_dim 64's A/B twins
    # (configs/bwd_ablation.yaml) built by --all only
    twins = [v for v in vs if v.family == "bwd" and not v.params["dkv_steps"]]
    assert twins and not any(v.default or v.params["block_n"] != 128 for v in twins)
    built_twins = [v for v in twins if v.default_build]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["block_m"]) for v in built_twins) == \
        sorted((d, 128, c, bm) for d in ("bf16", "fp16") for c, bm in ((False, 64), (True, 64), (False, 80)))
    assert all(v.params["head_dim"] == 64 for v in twins if not v.default_build)
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["softcap"],
                   v.default) for v in swap) == [(d, 128, False, False, False, False) for d in ("bf16", "fp16")]
    # + bwd's varlen variants (bwd.py varlen): {dtype} x {head_dim} x {none, causal, local}, without softcap (30)
    # + fwd's varlen softcap variants: {dtype} x {head_dim} x {none, causal, local}, unpacked (30)
    # + varlen_prep's one variant
    # + fwd's PackGQA decode tiles (head_dim 64, {dtype} x {none, causal, local}: not dispatch defaults;
    # core.PACK_GQA_DECODE_MAX_SEQLEN_Q)
    # + fwd's one-warpgroup PackGQA decode tiles (64 x 128 at head_dims 64 and 128, 64 x 64 at 256, {dtype} x
    # {none, causal, local} x {varlen}: not dispatch defaults; core.DECODE_WG1)
    wg1 = [v for v in vs if v.family == "fwd" and v.params["consumer_wgs"] == 1]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["varlen"],
                   v.params["pack_gqa"], v.params["block_m"], v.params["pingpong"], v.default, v.default_build)
                  for v in wg1) == \
        sorted((d, h, c, lo, vl, True, 64, False, False, True) for d in ("bf16", "fp16") for h in (64, 128, 256)
               for c, lo in ((False, False), (True, False), (False, True)) for vl in (False, True))
    decode = [v for v in vs if v.family == "fwd" and v.params.get("pack_gqa") and not v.params.get("varlen")
              and not v.default and not v.tuned and v not in wg1]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["block_m"],
                   v.params["consumer_wgs"], v.default_build) for v in decode) == \
        sorted((d, 64, c, lo, 128, 2, True) for d in ("bf16", "fp16") for c, lo in ((False, False), (True, False),
                                                                                   (False, True)))
    # + fwd's few tiles (head_dim 64, unpacked non-causal 128 x 128 wg2, {dtype}: not dispatch defaults; core.FEW_TILE)
    few = [v for v in vs if v.family == "fwd" and not v.params.get("pack_gqa") and not v.params.get("varlen")
           and not v.default and not v.tuned and v.default_build and v.params["dtype"] != "e4m3"
           and v.params["head_dim_v"] == v.params["head_dim"]]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["softcap"],
                   v.params["block_m"], v.params["block_n"], v.params["consumer_wgs"]) for v in few) == \
        sorted((d, 64, False, False, False, 128, 128, 2) for d in ("bf16", "fp16"))
    # + their varlen twins (head_dim 64, unpacked 128 x 128 wg2 varlen, {dtype} x {causal}: core.FEW_TILE_VARLEN)
    few_varlen = [v for v in vs if v.family == "fwd" and not v.params.get("pack_gqa") and v.params.get("varlen")
                  and not v.default and v.default_build]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["softcap"],
                   v.params["block_m"], v.params["block_n"], v.params["consumer_wgs"]) for v in few_varlen) == \
        sorted((d, 64, c, False, False, 128, 128, 2) for d in ("bf16", "fp16") for c in (False, True))
    few += few_varlen
    assert len(select(vs)) == 60 + 12 + 30 + 60 + 18 + 60 + 30 + 30 + 3 + 2 + 1 + len(swap) + len(built_twins) + \
        len(decode) + len(wg1) + len(few) + len(tuned)
    packed = [v for v in select(vs) if v.params.get("pack_gqa") and not v.params.get("varlen") and v.default]
    assert len(packed) == 30 and not any(v.params["softcap"] or v.params["dtype"] == "e4m3" for v in packed)
    # + varlen (fwd.py varlen) for {dtype} x {head_dim} x {none, causal, local} x {PackGQA}, without softcap (60)
    bwd_varlen = [v for v in select(vs) if v.family == "bwd" and v.params.get("varlen")]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["block_m"])
                  for v in bwd_varlen) == \
        sorted((d, h, c, lo, 128 if h == 64 else 64) for d in ("bf16", "fp16") for h in (64, 96, 128, 192, 256)
               for c, lo in ((False, False), (True, False), (False, True)))
    assert not any(v.params["softcap"] or not v.default or not v.params["dkv_steps"] for v in bwd_varlen)
    varlen = [v for v in select(vs) if v.family == "fwd" and v.params.get("varlen") and v not in wg1 + few_varlen]
    assert sorted((v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["pack_gqa"],
                   v.params["softcap"]) for v in varlen) == \
        sorted((d, h, c, lo, pk, sc) for d in ("bf16", "fp16") for h in (64, 96, 128, 192, 256)
               for c, lo in ((False, False), (True, False), (False, True)) for pk, sc in
               ((False, False), (True, False), (False, True)))
    assert all(v.default for v in varlen)
    # (softcap's tiles: hd64 192 x 112, hd256 128 x 64, as the softcap variants without varlen)
    assert {(v.params["head_dim"], v.params["block_m"], v.params["block_n"]) for v in varlen if v.params["softcap"]
            and v.params["head_dim"] in (64, 256)} == {(64, 192, 112), (256, 128, 64)}
    all_vs, vs = vs, [v for v in vs if not v.tuned]
    fp8 = [v for v in select(vs) if v.params.get("dtype") == "e4m3"]
    assert {(v.params["head_dim"], v.params["causal"]) for v in fp8} == {(h, c) for h in (64, 128, 256)
                                                                         for c in (False, True)}
    assert all(v.default and v.params["block_n"] % 64 == 0 for v in fp8)
    keys = {(d, h, c, lo, sc) for d in ("bf16", "fp16") for h in (64, 96, 128, 192, 256)
            for c, lo in ((False, False), (True, False), (False, True)) for sc in (False, True)}
    for family in ("fwd", "bwd"):  # a backward for every forward the default build makes
        fam = [v for v in select(vs) if v.family == family and v.params["head_dim_v" if family == "fwd" else "head_dim"]
               == v.params["head_dim"] and v.params["dtype"] != "e4m3" and v not in swap + twins + decode + wg1 + few]  # FP8 has no backward
        assert all(v.default for v in fam)
        assert {(v.params["dtype"], v.params["head_dim"], v.params["causal"], v.params["local"], v.params["softcap"])
                for v in fam} == keys
    mla = [v for v in select(vs) if v.family == "fwd" and v.params["head_dim_v"] != v.params["head_dim"]]
    assert {(v.params["dtype"], v.params["head_dim"], v.params["head_dim_v"], v.params["causal"], v.params["local"],
             v.params["softcap"]) for v in mla} == {(d, 192, 128, c, lo, sc) for d in ("bf16", "fp16")
                                                   for c, lo in ((False, False), (True, False), (False, True))
                                                   for sc in (False, True)}
    default_set = [v for v in select(vs) if v.family == "fwd" and v not in decode + wg1 + few]
    # every default variant takes block_m/block_n/consumer_wgs from its tile-table row (the most
    # specific one), whatever the tuned values are
    import yaml

    rows = yaml.safe_load((REPO / "configs" / "fwd.yaml").read_text())["tiles"]
    for v in default_set:
        p = v.params
        if p["dtype"] == "e4m3":  # configs/fwd_fp8.yaml's own tiles
            continue
        match = [r for r in rows if r["head_dim"] == p["head_dim"] and r.get("dtype", p["dtype"]) == p["dtype"]
                 and r.get("causal", p["causal"]) == p["causal"] and r.get("softcap", p["softcap"]) == p["softcap"]
                 and r.get("pack_gqa", p["pack_gqa"]) == p["pack_gqa"] and r.get("varlen", p["varlen"]) == p["varlen"]]
        best = max(match, key=lambda r: ("dtype" in r) + ("causal" in r) + ("softcap" in r) + ("pack_gqa" in r)
                   + ("varlen" in r))
        assert (p["block_m"], p["block_n"], p["consumer_wgs"]) == (best["block_m"], best["block_n"], best["consumer_wgs"])
    assert {r["head_dim"] for r in rows} >= {64, 96, 128, 192, 256}
    abl = [v for v in all_vs if "configs/ablation.yaml" in " ".join(v.sources)]
    knobs = {(v.params["pingpong"], v.params["overlap"], v.params["persistent"], v.params["stages"], v.params["causal"])
             for v in abl if v.params["head_dim"] == 128 and v.params["dtype"] == "bf16"}
    # the paper's ablation: full, no overlap, no pingpong + no overlap, non-persistent, 3 stages; + causal
    assert {(True, True, True, 2, False), (True, False, True, 2, False), (False, False, True, 2, False),
            (True, True, False, 2, False), (True, True, True, 3, False), (True, True, True, 2, True)} <= knobs
    assert all(not v.default_build for v in abl if not v.default and not v.tuned)  # not in the default set
    full = [v for v in vs if v.default and v.family == "fwd" and v.params["dtype"] == "bf16"
            and v.params["head_dim"] == 128 and not v.params["causal"] and not v.params["local"]
            and not v.params["softcap"]][0]
    assert any("ablation" in s for s in full.sources)  # the "full" point is the default variant itself
    tune = [v for v in vs if "configs/fwd_tune.yaml" in " ".join(v.sources)  # tile candidates
            or "configs/fwd_fp8_tune.yaml" in " ".join(v.sources)]
    assert tune and not any(v.default or (v.default_build and v not in few) for v in tune)  # (the few tiles: candidates too)
    assert len(vs) + len(tuned) == (60 + 12 + 30 + 60 + 18 + 60 + 30 + 30 + 3 + 2 + 1 + len(swap) + len(twins) + len(decode) + len(wg1)
                                    + len({v.name for v in abl + tune + tuned + few if not v.default}))
    assert len(select(vs, all_=True)) == len(vs)


def test_head_dims_96_192_are_one_line_away(tmp_path):
    proj = make_project(tmp_path, {"fwd.yaml": (REPO / "configs" / "fwd.yaml").read_text().replace(
        "head_dim: [64, 128, 256]", "head_dim: [64, 96, 128, 192, 256]")})
    vs = load_variants(proj)
    base = [v for v in vs if v.params["head_dim_v"] == v.params["head_dim"] and not v.params["pack_gqa"]
            and not v.params["varlen"] and v.default]  # (not the few tiles of configs/fwd.yaml extra)
    assert len(base) == 60  # {dtype} x {head_dim} x {none, causal, local} x {softcap}
    assert {v.params["head_dim"] for v in base} == {64, 96, 128, 192, 256} and all(v.default for v in base)


def test_register_budget_rejects_hd96_on_three_wgs(tmp_path):
    text = SMALL_FWD.replace("head_dim: [64, 128]", "head_dim: [64, 96]").replace(
        "{head_dim: 128, block_m: 128", "{head_dim: 96, block_m: 192").replace("block_n: 128, consumer_wgs: 2", "block_n: 128, consumer_wgs: 3")
    _, probs = problems_of(tmp_path, text)
    assert probs and all("tiles[1].block_n" in p and "= 160 registers > 128" in p for p in probs), probs


def test_select_filter():
    vs = [v for v in load_variants(Project(REPO)) if not v.tuned]  # the shipped tune tables' tiles: test_tune.py
    # {bf16, fp16} x ({none, causal, local} x {softcap} + PackGQA {none, causal, local} x {its tile, the decode
    # tile} + varlen {none, causal, local} x {PackGQA, softcap} + the one-warpgroup decode tiles {none, causal, local}
    # x {varlen}); e4m3 x {none, causal, local} x {softcap}
    assert len(select(vs, "fwd_*hd64*")) == 66  # + the few tiles (configs/fwd.yaml extra: 2, and 4 varlen)
    assert len(select(vs, "*hd64*")) == 84  # fwd and bwd (bwd: {bf16, fp16} x {none, causal, local} x {softcap} + varlen)
    assert len(select(vs, "fwd_bf16_hd128_noncausal_m")) == 1  # substring, default set only
    assert len(select(vs, "hd128_noncausal", all_=True)) == len([v for v in vs if "hd128_noncausal" in v.name]) > 4
    # 6 + 6 packed + 9 varlen + 6 one-warpgroup decode tiles; causal, causal_softcap, packed, 3 varlen, 2 one-warpgroup
    assert len(select(vs, "fwd_bf16_hd64*,fwd_fp16_hd256_causal*")) == 38  # (+ 3 few tiles: 1 unpacked, 2 varlen)
