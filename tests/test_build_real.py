"""Real nvcc: compile the fixture and a representative subset of the real template (one variant per
head dim 64/128/256), check ptxas (0 spills, registers recorded) and SASS (HGMMA, UTMALDG,
USETMAXREG), cache timing, and the wheel (installs in a fresh venv without nvcc, lists variants).

These run in `make test` and CI (marked slow: seconds to a minute each)."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, make_project, read_manifest  # noqa: E402

from flashgen.generator import sass  # noqa: E402
from flashgen.generator.build import build, nvcc_command  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.errors import ToolchainError  # noqa: E402
from flashgen.generator.project import Project  # noqa: E402
from flashgen.generator.toolchain import find_cuobjdump, find_nvcc  # noqa: E402

pytestmark = pytest.mark.slow


def _toolchain():
    try:
        return find_nvcc(), find_cuobjdump()
    except ToolchainError as e:  # CI and dev machines have both; say so loudly if not
        pytest.fail(f"real-compile tests need nvcc and cuobjdump: {e}")


@pytest.fixture(scope="module")
def real_subset(tmp_path_factory):
    """The real template's bf16 hd64 non-causal, fp16 hd128 causal, bf16 hd256 causal, bf16 hd256
    causal softcap and fp16 hd192/head_dim_v 128 variants, built into a temporary build dir.
    Returns (project, result, variants)."""
    _toolchain()
    if not (REPO / "templates" / "fwd.cu.j2").exists():
        pytest.skip("templates/fwd.cu.j2 not written yet")
    out = tmp_path_factory.mktemp("realbuild")
    proj = Project(REPO, build_override=out)
    vs = load_variants(proj)
    pick = [v for v in select(vs, "fwd_bf16_hd64_noncausal_m192*,fwd_fp16_hd128_causal_m*,fwd_bf16_hd256_causal_m*,"
                                  "fwd_bf16_hd256_causal_softcap_m*,fwd_fp16_hd192v128_noncausal_m*")
            if not v.tuned]  # the configs' tiles, not those the tune tables add to the default set
    assert len(pick) == 5
    lines = []
    t0 = time.monotonic()
    res = build(proj, pick, jobs=2, log=lines.append)
    res.wall = time.monotonic() - t0
    res.lines = lines
    return proj, res, pick


def test_real_template_compiles_without_spills(real_subset):
    proj, res, pick = real_subset
    assert res.failed == [], res.failed
    m = read_manifest(proj)
    assert {e["name"] for e in m["variants"]} == {v.name for v in pick}
    for e in m["variants"]:
        (k,) = e["kernels"]
        assert k["spill_bytes"] == 0 and k["stack_bytes"] == 0
        assert 0 < k["registers"] <= 65536 // k["threads"]
        report = json.loads((proj.cache_dir / e["key"] / "report.json").read_text())
        assert report["ptxas"]["entries"] == [k["symbol"]] and report["ptxas"]["bad_advisories"] == []
        assert report["compile_seconds"] < 30  # the per-variant budget on a 2-core machine


def test_real_template_sass(real_subset):
    proj, res, pick = real_subset
    for v in pick:
        need = {v.symbol(k.role): k.sass for k in v.kernels}
        assert all({"HGMMA", "UTMALDG", "USETMAXREG"} <= set(ops) for ops in need.values())
        ops = sass.check(str(proj.fatbin_dir / f"{v.name}.fatbin"), need)
        assert {"HGMMA", "UTMALDG", "USETMAXREG"} <= set(ops[v.symbol("main")])
    # the same requirements, read back from the manifest (what `python -m flashgen.generator.sass` checks)
    report = sass.check_manifest(str(proj.manifest_path))
    assert set(report) == {v.symbol("main") for v in pick}


def test_real_template_softmax_runs_under_the_pv_gemm(real_subset):
    """Every subset variant (all with intra-warpgroup overlap) waits for the P V GEMM only after the
    softmax's exponentials (generator/sass.py softmax_under_pv); a wait hoisted above them fails."""
    proj, res, pick = real_subset
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        assert sass.softmax_under_pv(body), v.name
    hoisted = "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\nWARPGROUP.DEPBAR.LE gsb0, 0x0 ;\nMUFU.EX2 R0, R1 ;"
    assert not sass.softmax_under_pv(hoisted) and not sass.softmax_under_pv("MUFU.EX2 R0, R1 ;")


def test_real_template_spec_max_where_the_rule_says(real_subset):
    """fwd.py spec_max (16-bit, no softcap, head dims <= 128) is what the kernels do: those variants
    carry the warpgroup vote of the speculative softmax (bar.red.and: BAR.RED in SASS); the hd256,
    softcap and hd192 variants do not."""
    from generator.families.fwd import spec_max

    proj, res, pick = real_subset
    seen = set()
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        on = spec_max(v.params)
        seen.add(on)
        assert ("BAR.RED.AND" in body) == on, v.name
    assert seen == {True, False}
    base = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "softcap": False}
    assert spec_max(base) and spec_max({**base, "dtype": "fp16", "head_dim": 64, "head_dim_v": 64})
    assert not any(spec_max({**base, **d}) for d in (
        {"dtype": "e4m3"}, {"softcap": True}, {"head_dim": 256, "head_dim_v": 256}, {"head_dim": 192}))


def test_real_template_half_first_where_the_rule_says(real_subset):
    """fwd.py half_first (causal, two consumer warpgroups, block_n >= 64, not local, PackGQA or FP8
    softcap) is what the rendered kernels compile: kHalfFirst true in the causal subset variants and
    false in the others (the GPU test test_half_first_block_variants checks the results)."""
    from generator.families.fwd import half_first

    proj, res, pick = real_subset
    seen = set()
    for v in pick:
        src = (proj.src_dir / f"{v.name}.cu").read_text()
        on = half_first(v.params)
        seen.add(on)
        assert f"constexpr bool kHalfFirst = {'true' if on else 'false'};" in src, v.name
    assert seen == {True, False}
    base = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "local": False, "softcap": False,
            "pack_gqa": False, "block_m": 128, "block_n": 128, "consumer_wgs": 2}
    assert half_first(base) and half_first({**base, "dtype": "e4m3"})
    assert not any(half_first({**base, **d}) for d in (
        {"causal": False}, {"local": True, "causal": False}, {"pack_gqa": True}, {"consumer_wgs": 3, "block_m": 192},
        {"block_n": 48}, {"dtype": "e4m3", "softcap": True}))


def test_real_template_half_first_gemm_where_the_rule_says(real_subset):
    """fwd.py half_first_gemm is what the kernels do: the variants it names carry the half-width S GEMM
    (HGMMA.64x{block_n / 2}: fp16 hd128 causal 128x128 in the subset), the others do not (bf16 hd256
    causal 128x80, where ptxas serialized the WGMMAs with it); where block_n / 2 is also the P V GEMM's
    N (hd64 at block_n 128) SASS cannot tell, so the rule alone is checked there."""
    from generator.families.fwd import half_first_gemm

    proj, res, pick = real_subset
    seen = set()
    for v in pick:
        p = v.params
        half_n = p["block_n"] // 2
        if half_n == p["head_dim_v"]:
            continue
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        on = half_first_gemm(p)
        seen.add(on)
        assert (f"HGMMA.64x{half_n}x16" in body) == on, v.name
    assert seen == {True, False}
    base = {"dtype": "bf16", "head_dim": 128, "head_dim_v": 128, "causal": True, "local": False, "softcap": False,
            "pack_gqa": False, "block_m": 128, "block_n": 128, "consumer_wgs": 2, "stages": 2}
    assert half_first_gemm(base) and half_first_gemm({**base, "head_dim": 64, "head_dim_v": 64, "exp_turns": True,
                                                      "stages": 4, "q_stages": 2})
    assert not any(half_first_gemm({**base, **d}) for d in (
        {"dtype": "e4m3"}, {"softcap": True}, {"causal": False}, {"block_n": 176},
        {"head_dim": 256, "head_dim_v": 256, "block_n": 80}, {"exp_turns": True}))


def test_real_template_exponentials_are_8_cycles_apart(real_subset):
    """The premise of spec_max (docs/PERF.md): ptxas spaces the softmax's MUFU.EX2 8 cycles apart
    (16 results per clock per SM) and issues FMNMX every 2 cycles, so the max reduction before the
    exponentials is a serial phase of its own. Read from the static schedule (sass.schedule) of the
    bf16 hd64 non-causal kernel; a toolchain that schedules otherwise fails here."""
    proj, res, pick = real_subset
    v = next(v for v in pick if v.params["head_dim"] == 64)
    sched = sass.schedule(sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")])
    assert len(sched) > 1000 and all(0 <= s <= 15 for _, _, s in sched)
    mufu = [k for k, (_, t, _) in enumerate(sched) if t.startswith("MUFU.EX2")]
    gaps = sorted(sum(s for _, _, s in sched[a:b]) for a, b in zip(mufu, mufu[1:]) if b - a < 8)
    assert len(gaps) >= 60 and gaps[len(gaps) // 2] == 8, gaps
    fmnmx = [s for _, t, s in sched if t.startswith("FMNMX")]
    assert sorted(fmnmx)[len(fmnmx) // 2] == 2


def test_real_template_exp_turns_fence_the_exponentials(real_subset, tmp_path):
    """exp_turns (fwd.cu.j2 kExpTurns, pipeline.cuh FencedTurns) is in the SASS: every exponential
    phase of the bf16 hd64 causal 128x128 exp_turns variants (one and two Q buffers, 2 to 4 K/V
    stages: tiles the tune tables name) sits between its turn's BAR.SYNC with the fencing shared
    load and its BAR.ARV (sass.exp_phases), except the spec_max refusal's plain update, which
    follows the warpgroup vote (BAR.RED) and takes no turn; without the knob (the subset's variants)
    no phase is fenced. ptxas moved the exponentials across a bare ring's barriers (docs/PERF.md),
    which this catches."""
    proj, res, pick = real_subset
    turns = [v for v in select(load_variants(proj), "fwd_bf16_hd64_causal_m128n128_*") if v.params.get("exp_turns")]
    assert {v.params["q_stages"] for v in turns} == {1, 2}  # one and two Q buffers: both in the tables
    p2 = Project(REPO, build_override=tmp_path)
    r = build(p2, turns, jobs=2, log=lambda s: None)
    assert r.failed == []
    for v in turns:
        phases = sass.exp_phases(sass.functions(sass.dump(str(p2.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")])
        fenced = [x for x in phases if x == ("SYNC+LDS", "BAR.ARV")]
        assert len(fenced) >= 2 and all(x in fenced or x[0].startswith("BAR.RED") for x in phases), (v.name, phases)
        assert sum(x[0].startswith("BAR.RED") for x in phases) <= 1, (v.name, phases)
    for w in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{w.name}.fatbin")))[w.symbol("main")]
        assert not w.params.get("exp_turns") and ("SYNC+LDS", "BAR.ARV") not in sass.exp_phases(body), w.name


def test_real_template_fp8_exp_turns_fence_the_exponentials(tmp_path):
    """The same for the e4m3 exp_turns tile the H200 table names (hd128 128x256 no-overlap, vt_global,
    non-causal and causal): every exponential phase runs from its turn's BAR.SYNC and fencing load to its
    BAR.ARV, and its FADDs are the fp32 row sums (one per exponential, which the pass waits on). With
    rowsum_mma on this tile (refused since: fwd.py) ptxas issued the pass before 120 of the 130
    exponentials and the tile ran 11 % slower (H200, docs/PERF.md); this catches such a schedule."""
    proj = Project(REPO, build_override=tmp_path)
    vs = select(load_variants(proj), "fwd_e4m3_hd128_*_m128n256_s2_wg2_pp_noov_ps_xt_vtg_*", all_=True)
    assert {v.params["causal"] for v in vs} == {False, True}
    r = build(proj, vs, jobs=2, log=lambda s: None)
    assert r.failed == []
    for v in vs:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        phases = sass.exp_phases(body)
        assert len(phases) >= 2 and all(x == ("SYNC+LDS", "BAR.ARV") for x in phases), (v.name, phases)
        assert all(f >= e - 4 for e, f in sass.exp_phase_counts(body, "FADD")), v.name


def test_real_template_rowsum_mma_takes_the_sums_out_of_the_exponentials(tmp_path):
    """rowsum_mma (fwd.py; fwd.cu.j2 kRowsumMma) is in the SASS: the e4m3 hd64 192x128 wg3 rowsum_mma
    variants (plain and vt_global, the tune candidates) issue m64n8 QGMMAs (the row sums of P against the
    ones tile) and their exponential phases hold no FADD, where the same tiles without the knob add one per
    exponential (the fp32 row sums); 0 spill bytes."""
    proj = Project(REPO, build_override=tmp_path)
    vs = [v for v in select(load_variants(proj), "fwd_e4m3_hd64_noncausal_m192n128_s2_wg3_pp_ov_ps_*", all_=True)
          if not v.params.get("exp_turns")]
    on = [v for v in vs if v.params.get("rowsum_mma")]
    off = [v for v in vs if not v.params.get("rowsum_mma")]
    assert {v.params["vt_global"] for v in on} == {True, False} and len(off) >= 2
    r = build(proj, on + off, jobs=2, log=lambda s: None)
    assert r.failed == []
    for v in on + off:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        counts = sass.exp_phase_counts(body, "FADD")
        assert len(counts) >= 2, (v.name, counts)
        if v.params.get("rowsum_mma"):
            assert "QGMMA.64x8x32" in body and all(f <= 2 for _, f in counts), (v.name, counts)
        else:
            assert "QGMMA.64x8x32" not in body and all(f >= e // 2 for e, f in counts), (v.name, counts)
    assert all(k["spill_bytes"] == 0 for e in read_manifest(proj)["variants"] for k in e["kernels"])


def test_real_template_consumers_read_the_decoded_tile(real_subset):
    """The consumers take each work tile decoded from its tile slot (scheduler.cuh WorkTile): their
    branch of the kernel (from the setmaxnreg raise to the producer's lowering, where ptxas lays the
    producer out) has no integer division (I2F.RP: the reciprocal of a runtime division), while the
    producer, which runs the scheduler, has its divisions. Before the slot held the decoded tile every
    consumer thread repeated three runtime divisions per tile (8 % of the stall samples at head_dim
    64 causal 512, H100). The subset's variants are 16-bit and not PackGQA, whose consumers need no
    K/V head; e4m3 consumers still divide the head by the group size, and PackGQA consumers their
    rows into query heads (fwd.cu.j2)."""
    proj, res, pick = real_subset
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        up, down = body.find("USETMAXREG.TRY_ALLOC"), body.find("USETMAXREG.DEALLOC")
        assert 0 < up < down, v.name
        consumers, producer = body[up:down], body[down:]
        assert "HGMMA" in consumers and "UTMALDG" in producer, v.name
        assert not re.search(r"I2F(\.U32)?\.RP", consumers), v.name
        assert re.search(r"I2F(\.U32)?\.RP", producer), v.name


def test_real_rebuild_is_cached_and_fast(real_subset):
    proj, res, pick = real_subset
    t0 = time.monotonic()
    r2 = build(proj, pick, log=lambda s: None)
    assert r2.compiled == [] and sorted(r2.cached) == sorted(v.name for v in pick)
    assert time.monotonic() - t0 < 5


def test_fixture_real_compile_and_sass(tmp_path):
    _toolchain()
    proj = make_project(tmp_path)
    vs = load_variants(proj)
    pick = select(vs, "fwd_bf16_hd64_causal_*,fwd_fp16_hd128_noncausal_*")
    res = build(proj, pick, jobs=2, log=lambda s: None)
    assert res.failed == [] and len(res.compiled) == 2
    for e in read_manifest(proj)["variants"]:
        (k,) = e["kernels"]
        assert k["spill_bytes"] == 0 and k["registers"] > 0
        ops = sass.check(str(proj.build_dir / e["fatbin"]), {k["symbol"]: k["sass"]})
        assert "HGMMA" in ops[k["symbol"]]


def test_sass_check_rejects_a_plain_kernel(tmp_path):
    nv, _ = _toolchain()
    src = tmp_path / "plain.cu"
    src.write_text('extern "C" __global__ void flashgen_plain(float* x) { x[threadIdx.x] *= 2.f; }\n')
    out = tmp_path / "plain.fatbin"
    r = subprocess.run(nvcc_command(nv.path, tmp_path, src, out), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(AssertionError) as ei:
        sass.check(str(out), {"flashgen_plain": ("HGMMA", "UTMALDG", "USETMAXREG")})
    msg = str(ei.value)
    assert "flashgen_plain" in msg and "HGMMA" in msg and "UTMALDG" in msg and "USETMAXREG" in msg


def test_wheel_installs_without_nvcc_and_lists_variants(real_subset, tmp_path):
    """`pip wheel .` on a copy of the checkout (its build backend packaging the subset through the
    subset's build cache: real fatbins, nothing recompiled), installed into a fresh venv, then
    `flashgen list` where no nvcc and no checkout can be seen."""
    proj, res, pick = real_subset
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in files:
        if f and (REPO / f).is_file() and not f.startswith("tests/"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / f, src / f)
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHGEN_ROOT", "FLASHGEN_KERNEL_DIR", "PYTHONPATH")}
    env.update(FLASHGEN_BUILD_DIR=str(proj.build_dir), FLASHGEN_VARIANTS=",".join(v.name for v in pick))
    entries = sorted(proj.cache_dir.glob("[0-9a-f]*"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                        str(dist), str(src)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(proj.cache_dir.glob("[0-9a-f]*")) == entries  # served by the cache: nothing recompiled
    (whl,) = dist.glob("*.whl")
    assert whl.name == "flashgen-0.1.0-py3-none-manylinux_2_17_x86_64.whl"
    assert whl.stat().st_size < 100 * 2**20
    import zipfile

    names = zipfile.ZipFile(whl).namelist()
    assert "flashgen/_kernels/manifest.json" in names and "flashgen/generator/build.py" in names
    assert sum(n.endswith(".fatbin") for n in names) == len(pick)
    assert not any(n.endswith((".so", ".pyd")) or n.startswith(("runtime/", "generator/", "build/")) for n in names)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(whl)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR", "FLASHGEN_KERNEL_DIR",
                                                            "CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    env["PATH"] = f"{env_dir / 'bin'}:/usr/bin:/bin"
    r = subprocess.run([str(env_dir / "bin" / "flashgen"), "list"], capture_output=True, text=True, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for v in pick:
        assert v.name in r.stdout
    assert f"{len(pick)} variants ({len(pick)} built) from manifest" in r.stdout


@pytest.fixture(scope="module")
def real_bwd(tmp_path_factory):
    """Two backward variants of the real template (both tile shapes, one causal, both dtypes), built
    into a temporary build dir. Returns (project, result, variants)."""
    _toolchain()
    out = tmp_path_factory.mktemp("realbwd")
    proj = Project(REPO, build_override=out)
    pick = select(load_variants(proj), "bwd_bf16_hd64_noncausal_m*,bwd_fp16_hd256_causal_softcap_*,bwd_bf16_hd192_local_m*")
    assert len(pick) == 3
    return proj, build(proj, pick, jobs=2, log=lambda s: None), pick


def test_real_bwd_compiles_without_spills_and_uses_wgmma_and_tma(real_bwd):
    """Each bwd variant: three kernels, 0 spill bytes, under the 30 s budget, and its main kernel's
    SASS has HGMMA, UTMALDG and USETMAXREG (the fast path, not a fallback), and the PDL instructions."""
    proj, res, pick = real_bwd
    assert res.failed == [], res.failed
    for e in read_manifest(proj)["variants"]:
        assert [k["role"] for k in e["kernels"]] == ["pre", "main", "post"]
        for k in e["kernels"]:
            assert k["spill_bytes"] == 0 and k["stack_bytes"] == 0, k
        report = json.loads((proj.cache_dir / e["key"] / "report.json").read_text())
        assert report["compile_seconds"] < 30
    for v in pick:
        ops = sass.check(str(proj.fatbin_dir / f"{v.name}.fatbin"), {v.symbol(k.role): k.sass for k in v.kernels})
        assert {"HGMMA", "UTMALDG", "USETMAXREG"} <= set(ops[v.symbol("main")])
        # PDL (bwd.py): pre and main let their dependents launch (PREEXIT), main and post wait (ACQBULK)
        assert "PREEXIT" in ops[v.symbol("pre")] and {"PREEXIT", "ACQBULK"} <= set(ops[v.symbol("main")])
        assert "ACQBULK" in ops[v.symbol("post")]


def test_real_bwd_first_loads_issued_before_the_cta_barrier(real_bwd):
    """The block_n 128 tiles issue K, V and the first Q / dO in the prologue (templates/bwd.cu.j2
    issue_kv: thread 0, right after their barriers' init), so the main kernel's first UTMALDG comes
    before its CTA barrier (BAR.SYNC 0x0) and before any USETMAXREG: issued by the producer after
    those, they left about 1 us after a CTA's entry (H200, docs/results/bwd_prologue_issue). The role
    tiles (block_n 64) issue them in the producer, after the barrier."""
    proj, res, pick = real_bwd
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        first_load = body.index("UTMALDG")
        barrier = re.search(r"BAR\.SYNC(?:\.DEFER_BLOCKING)? 0x0 ;", body).start()
        assert (first_load < barrier and first_load < body.index("USETMAXREG")) == (v.params["block_n"] == 128), v.name


def test_real_bwd_role_tiles_bulk_reduce_dq(real_bwd):
    """The role tiles (head_dim 192 and 256) stage each consumer's dQ half for the reducer warp's
    bulk reductions: the main kernel has no fp32 vector reductions (REDG ...F32x4, the consumers'
    old path at head_dim 192), and head_dim 192's halves of 96 columns are computed as 64- and
    32-column pieces inside K's swizzle chunks (HGMMA.64x64 and 64x32 for dQ, none 64x128)."""
    proj, res, pick = real_bwd
    roles = [v for v in pick if v.params["block_n"] == 64]
    assert {v.params["head_dim"] for v in roles} == {192, 256}
    for v in roles:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        assert "UBLKRED.G.S.ADD.F32" in body and not re.search(r"REDG\.E\.ADD\.F32x4", body), v.name
        assert ("HGMMA.64x32x16.F32" in body) == (v.params["head_dim"] == 192), v.name
        assert "HGMMA.64x128x16.F32" not in body, v.name


def test_real_bwd_role_tiles_hold_k_and_v_steps_in_registers(real_bwd):
    """kv_reg_steps (templates/bwd.cu.j2 kKRegSteps / kVRegSteps): the role tiles' consumers load K's and
    V's first k-steps once (one LDSM per k-step and thread) and issue those k-steps of S^T = K Q^T and
    dP^T = V dO^T with A from registers (HGMMA.64x64x16 R.., R..: the RS form) after the first block,
    whose GEMMs stay SS (their A chunks wait on TMA). The block_n 128 tiles load nothing so."""
    from flashgen.generator.families.bwd import kv_reg_steps

    proj, res, pick = real_bwd
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        k_steps, v_steps = kv_reg_steps(v.params)
        assert len(re.findall(r"\bLDSM\.16\.M88\.4\b", body)) == k_steps + v_steps, v.name
        assert (k_steps > 0) == (v.params["block_n"] == 64), v.name
        if k_steps:  # (at block_n 128 the RS dV / dK GEMMs of a 64-column slice are 64x64 too)
            rs = re.findall(r"HGMMA\.64x64x16\.F32(?:\.BF16)? R\d+, R\d+, gdesc", body)
            assert len(rs) == k_steps + v_steps, (v.name, len(rs))


def test_real_bwd_dkv_steps_interleave_the_exponentials(real_bwd):
    """dkv_steps (templates/bwd.cu.j2 kDkvSteps): the block_n 128 tiles issue each 16-row k-step of dV += P^T dO
    and dK += dS^T Q (RS-HGMMA: A from registers) once its P^T / dS^T quads are packed, so the exponentials of
    the next k-steps (8 MUFU.EX2 per k-step and thread) lie between a block's first and last RS-HGMMA. The
    role tiles keep their dV / dK GEMMs after all of them (dkv_steps lost 1-4 % at head_dim 256 on an H200)."""
    proj, res, pick = real_bwd
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        lines = body.splitlines()
        n = v.params["slice"]  # dV / dK: N = the slice (the role tiles' K / V register steps are N = 64 RS too)
        rs = [i for i, line in enumerate(lines) if re.search(rf"HGMMA\.64x{n}x16\.F32(?:\.BF16)? R\d+, R\d+, gdesc", line)]
        steps = v.params["block_m"] // 16
        between = sum("MUFU.EX2" in line for line in lines[rs[0]:rs[2 * steps - 1]]) if len(rs) >= 2 * steps else 0
        if v.params["block_n"] == 128:
            assert between == 8 * (steps - 1), (v.name, between)
        else:
            assert between == 0, (v.name, between)


def test_real_bwd_deterministic_hand_off(real_bwd):
    """The deterministic dQ hand-off of both staged tile kinds (templates/bwd.cu.j2: wait_turn,
    bulk_put, publish_landed): the first share in the order is a bulk store (UBLKCP shared ->
    global) beside the bulk additions, which is what lets the preprocess skip zeroing the
    accumulator; and each signal (red.release.gpu) carries one GPU-scope fence, its own release,
    with no fence.sc on top (the two changes together made the deterministic backward 1.05-1.26x
    faster on an H100, docs/PERF.md). A split tail's ticket (bwd.py split_tail: ptx.cuh take_ticket,
    one atom.acq_rel.gpu) carries one fence too, and no fence.sc either."""
    proj, res, pick = real_bwd
    for v in pick:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        assert "UBLKCP.G.S " in body and "UBLKRED.G.S.ADD.F32" in body, v.name
        assert "MEMBAR.SC.GPU" not in body, v.name
        signals = len(re.findall(r"REDG\.E\.ADD\.S32\.STRONG\.GPU", body))
        tickets = len(re.findall(r"ATOMG\.E\.ADD\.S32\.STRONG\.GPU", body))
        assert tickets == (1 if v.resources["split_tail"] else 0), v.name
        assert signals >= 1 and len(re.findall(r"MEMBAR\.ALL\.GPU", body)) == signals + tickets, v.name


def test_mufu_probe_paces_the_exponentials_as_the_kernel_does(tmp_path):
    """scripts/mufu_probe.py (the FP8 exponential-phase probes, docs/results/mufu_probe/) builds with the
    project's WGMMA macro and 0 spill bytes, and ptxas schedules each probe kernel's exponential phase as it
    does the e4m3 tiles' (128 MUFU.EX2 per round, 7.5-8.5 static cycles each, generator/sass.py schedule), so
    that its timings stand for the kernel's phase: one phase in each of the 11 kernels (probe_side's 4 modes,
    probe_gemm's 7 instantiations). probe_gemm's QGMMAs are asynchronous (one scoreboard per 4+ k-steps)."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "mufu_probe.py"), "--build-only", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill", r.stdout + r.stderr)
    assert len(spills) == 2 * 11 and set(spills) == {"0"}, spills
    funcs = sass.functions(sass.dump(str(tmp_path / "mufu_probe")))
    assert len(funcs) == 11, sorted(funcs)
    for name, body in funcs.items():
        ins, runs = sass._exp_runs(body, 24, 16)
        sched = sass.schedule(body)
        assert [len(run) for run in runs] == [128], (name, [len(run) for run in runs])
        stall = sum(s for _, _, s in sched[runs[0][0]:runs[0][-1] + 1])
        assert 7.5 <= stall / 128 <= 8.5, (name, stall / 128)
        qgmma = [x for x in ins if x.startswith("QGMMA")]
        assert len(qgmma) >= 4 * sum("gsb0" in x for x in qgmma), name
        gemm = re.search(r"probe_gemmILi(\d)E", name)  # the Gemm template argument: 0 = no GEMM
        assert bool(gemm and gemm.group(1) != "0") == bool(qgmma), name


def test_real_split_forward_lets_the_combine_launch_early(tmp_path):
    """Split-KV's two launches overlap (PDL, docs/CONTRACTS.md §4 and the combine section): a varlen forward variant
    runs griddepcontrol.launch_dependents (PREEXIT) before its first TMA load, and the combine, a programmatic
    dependent, waits (ACQBULK) before its first global load (the partials); a non-varlen forward has no trigger (its
    SASS, and so its timing, as before)."""
    proj = Project(REPO, build_override=tmp_path)
    vs = select(load_variants(proj), "combine_bf16_*,fwd_bf16_hd64_noncausal_packgqa_varlen_m128*,fwd_bf16_hd64_noncausal_m192*")
    vs = [v for v in vs if not v.tuned]
    assert {v.family for v in vs} == {"combine", "fwd"} and len(vs) == 3, [v.name for v in vs]
    r = build(proj, vs, jobs=2, log=lambda s: None)
    assert r.failed == []
    for v in vs:
        body = sass.functions(sass.dump(str(proj.fatbin_dir / f"{v.name}.fatbin")))[v.symbol("main")]
        if v.family == "combine":
            assert -1 < body.find("ACQBULK") < body.find("LDG"), v.name
        elif v.params.get("varlen"):
            assert -1 < body.find("PREEXIT") < body.find("UTMALDG"), v.name
        else:
            assert "PREEXIT" not in body and "ACQBULK" not in body, v.name
