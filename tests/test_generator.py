"""Generator pieces: naming, resources, rendering, header scan, ptxas parsing, manifest, discovery."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, compiles, fake_cuda, make_project, read_manifest  # noqa: E402

from flashgen.generator import ptxas  # noqa: E402
from flashgen.generator.build import build, default_jobs  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.errors import BuildError, ToolchainError  # noqa: E402
from flashgen.generator.families.fwd import FAMILY as FWD, SMEM_LIMIT, smem_layout  # noqa: E402
from flashgen.generator.naming import canonical_params, params_hash, symbol_for, variant_name  # noqa: E402
from flashgen.generator.project import Project, find_root  # noqa: E402
from flashgen.generator.render import local_headers, render  # noqa: E402
from flashgen.generator.toolchain import find_nvcc  # noqa: E402

BASE = dict(family="fwd", dtype="bf16", head_dim=128, head_dim_v=128, causal=True, block_m=128, block_n=128,
            stages=2, q_stages=1, consumer_wgs=2, pingpong=True, overlap=True, persistent=True, late_pv_wait=True,
            exp_turns=False, rowsum_mma=False, vt_global=False)
NAME_RE = re.compile(r"^fwd_(bf16|fp16|e4m3)_hd\d+(v\d+)?_(causal|noncausal|local)_(softcap_)?(packgqa_)?(varlen_)?m\d+n\d+_s\d_(q2_)?wg\d_(no)?pp_(no)?ov_(no)?ps_(ew_)?(xt_)?(rsm_)?(vtg_)?[0-9a-f]{8}$")
COMBINE_NAME_RE = re.compile(r"^combine_(fp32|bf16|fp16)_m\d+_t\d+_[0-9a-f]{8}$")
BWD_NAME_RE = re.compile(r"^bwd_(bf16|fp16)_hd\d+_(causal|noncausal|local)_(softcap_)?(varlen_)?m\d+n\d+_sl\d+_s\d_(nosteps_)?[0-9a-f]{8}$")
QUANT_NAME_RE = re.compile(r"^quant_(bf16|fp16)_b\d_[0-9a-f]{8}$")
PREP_NAME_RE = re.compile(r"^varlen_prep_t(128|256)_[0-9a-f]{8}$")
ROLES = {"fwd": ["main"], "combine": ["main"], "bwd": ["pre", "main", "post"], "quant": ["amax", "quant"],
         "varlen_prep": ["main", "kvcache"]}

# ------------------------------------------------------------------------------------- naming


def test_name_spells_every_parameter():
    n = variant_name(BASE)
    assert n.startswith("fwd_bf16_hd128_causal_m128n128_s2_wg2_pp_ov_ps_") and NAME_RE.match(n)
    off = variant_name({**BASE, "causal": False, "pingpong": False, "overlap": False, "persistent": False})
    assert "_noncausal_" in off and off.endswith(off[-8:]) and "_nopp_noov_nops_" in off
    assert "_ps_ew_" in variant_name({**BASE, "late_pv_wait": False}) and "_ew_" not in n
    assert "_ps_xt_" in variant_name({**BASE, "exp_turns": True}) and "_xt_" not in n
    assert "_ps_rsm_" in variant_name({**BASE, "rowsum_mma": True}) and "_rsm_" not in n
    assert "_ps_vtg_" in variant_name({**BASE, "dtype": "e4m3", "vt_global": True}) and "_vtg_" not in n
    assert "_s2_q2_wg2_" in variant_name({**BASE, "q_stages": 2}) and "_q2_" not in n
    assert "hd192v128" in variant_name({**BASE, "head_dim": 192, "head_dim_v": 128})


def test_name_canonical_and_hash_covers_every_key():
    shuffled = dict(reversed(list(BASE.items())))
    assert variant_name(shuffled) == variant_name(BASE)
    assert variant_name({**BASE, "head_dim": 128.0 if False else 128}) == variant_name(BASE)
    hashes = {params_hash(BASE)}
    changes = dict(dtype="fp16", head_dim=64, head_dim_v=64, causal=False, local=True, softcap=True, pack_gqa=True,
                   block_m=192, block_n=112, stages=3, q_stages=2, consumer_wgs=3, pingpong=False, overlap=False, persistent=False,
                   late_pv_wait=False, exp_turns=True, rowsum_mma=True, vt_global=True)
    for k, v in changes.items():
        hashes.add(params_hash({**BASE, k: v}))
    assert len(hashes) == len(changes) + 1  # every key changes the hash
    assert set(canonical_params({**BASE, "extra": 1})) == set(BASE) | {"softcap", "local", "pack_gqa", "varlen"}  # axis defaults fill in
    assert canonical_params(BASE)["softcap"] is False and params_hash(BASE) == params_hash({**BASE, "softcap": False})


def test_names_unique_and_symbols_are_c_identifiers():
    vs = load_variants(Project(REPO))
    names = [v.name for v in vs]
    assert len(names) == len(set(names))
    assert {v.family for v in vs} == {"fwd", "combine", "bwd", "quant", "varlen_prep"}
    for v in vs:
        assert {"fwd": NAME_RE, "combine": COMBINE_NAME_RE, "bwd": BWD_NAME_RE, "quant": QUANT_NAME_RE,
                "varlen_prep": PREP_NAME_RE}[v.family].match(v.name), v.name
        roles = ["vt", "main"] if v.params.get("vt_global") else ROLES[v.family]  # vt_global: the V^T preprocess first
        assert [k.role for k in v.kernels] == roles
        for role in roles:
            assert v.symbol(role) == symbol_for(v.name, role) == "flashgen_" + v.name + "_" + role
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v.symbol(role))
        assert v.symbols == [v.symbol(r) for r in roles]
        assert v.name.endswith(params_hash(v.params)[:8])


# ---------------------------------------------------------------------------------- resources


def test_fwd_resources_formula():
    r = FWD.resources({**BASE, "causal": False, "block_n": 176})
    base = 128 * 128 * 2 + 2 * 2 * 176 * 128 * 2 + 2048  # Q + K/V stages + barriers + slack = 215040
    o_bytes = 128 * 128 * 2  # a separate O staging buffer, added by the kernel's layout only if it fits
    assert r["smem_bytes"] == base + (o_bytes if r.get("separate_o") else 0) <= SMEM_LIMIT
    assert {k: r[k] for k in ("threads", "producer_regs", "consumer_regs", "head_dim_padded", "head_dim_v_padded")} == \
        dict(threads=384, producer_regs=24, consumer_regs=240, head_dim_padded=128, head_dim_v_padded=128)
    r3 = FWD.resources({**BASE, "head_dim": 64, "head_dim_v": 64, "block_m": 192, "consumer_wgs": 3})
    assert (r3["threads"], r3["producer_regs"], r3["consumer_regs"], r3["head_dim_padded"]) == (512, 32, 160, 64)
    r96 = FWD.resources({**BASE, "head_dim": 96, "head_dim_v": 96})
    assert r96["head_dim_padded"] == 128 and r96["smem_bytes"] == FWD.resources(BASE)["smem_bytes"]
    assert FWD.resources({**BASE, "head_dim": 256, "head_dim_v": 256, "block_n": 80})["smem_bytes"] == 231424 <= SMEM_LIMIT
    assert FWD.resources({**BASE, "block_n": 176, "stages": 3})["smem_bytes"] == 305152  # infeasible, reported as is


def test_fwd_problems():
    assert FWD.problems(BASE) == []
    keys = {k for k, _, _ in FWD.problems({**BASE, "block_n": 176, "stages": 3})}
    assert keys == {"smem_bytes"}
    assert {k for k, _, _ in FWD.problems({**BASE, "block_m": 192})} == {"block_m"}
    assert {k for k, _, _ in FWD.problems({**BASE, "head_dim": 256, "head_dim_v": 256, "block_n": 128, "stages": 1})} == {"block_n"}


# ---------------------------------------------------------------------------------- rendering


def test_render_passes_params_derived_name_symbol(tmp_path):
    proj = make_project(tmp_path)
    v = [v for v in load_variants(proj) if v.params["causal"] and v.params["head_dim"] == 64][0]
    src = render(v, proj.templates_dir)
    assert f"{v.symbol('main')}(" in src and f"({v.name})" in src
    assert "const flashgen::FwdParams p" in src and "struct FwdParams {" in src  # kernels.main + params_decls
    assert f"smem + {v.resources['smem']['bars']['offset']})" in src  # the smem layout
    assert f"__launch_bounds__({v.resources['threads']}, 1)" in src
    assert f"smem_bytes={v.resources['smem_bytes']}" in src and "head_dim_padded=64" in src
    assert "setmaxnreg_dec<32>" in src and "setmaxnreg_inc<160>" in src
    assert '#include "flashgen/fx_mask.cuh"' in src


def test_render_strict_undefined(tmp_path):
    proj = make_project(tmp_path)
    (proj.templates_dir / "fwd.cu.j2").write_text("int x = {{ block_m }} + {{ no_such_variable }};\n")
    v = load_variants(proj)[0]
    with pytest.raises(BuildError) as ei:
        render(v, proj.templates_dir)
    assert v.name in str(ei.value) and "no_such_variable" in str(ei.value)


@pytest.mark.parametrize("family", ["fwd", "combine"])
def test_real_template_renders_every_variant(family):
    proj = Project(REPO)
    if not (proj.templates_dir / f"{family}.cu.j2").exists():
        pytest.skip(f"templates/{family}.cu.j2 not written yet")
    vs = [v for v in load_variants(proj) if v.family == family]
    assert vs
    for v in vs:
        src = render(v, proj.templates_dir)
        assert v.symbol("main") in src and 'extern "C"' in src
        for k in v.kernels:  # the params struct the host packs is the one the kernel declares
            assert f"struct {k.params.name} {{" in src and re.search(rf"const (flashgen::)?{k.params.name} p\)", src)


def test_local_headers_recursive_and_scoped(tmp_path):
    inc = tmp_path / "include"
    (inc / "flashgen").mkdir(parents=True)
    (inc / "flashgen" / "a.cuh").write_text('#include "b.cuh"\n#include <cuda.h>\n')
    (inc / "flashgen" / "b.cuh").write_text('#pragma once\n  #  include "flashgen/c.cuh"\n')
    (inc / "flashgen" / "c.cuh").write_text("// leaf\n")
    (inc / "flashgen" / "unused.cuh").write_text("// not included\n")
    src = '#include "flashgen/a.cuh"\n#include <cuda/ptx>\n'
    got = [p.name for p in local_headers(src, inc)]
    assert got == ["a.cuh", "b.cuh", "c.cuh"]


# ------------------------------------------------------------------------------------- ptxas

PTXAS_OK = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flashgen_k' for 'sm_90a'
ptxas info    : Function properties for flashgen_k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compile time = 247.337 ms
"""


def test_ptxas_parse_ok():
    r = ptxas.parse(PTXAS_OK)
    assert (r["registers"], r["spill_bytes"], r["stack_bytes"], r["entries"]) == (168, 0, 0, ["flashgen_k"])
    assert r["functions"]["flashgen_k"]["barriers"] == 16
    assert ptxas.problems(r, "flashgen_k") == []
    assert ptxas.problems(r, "flashgen_other")  # wrong symbol is caught


def test_ptxas_spills_and_advisories_fail():
    spill = PTXAS_OK.replace("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                             "16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads")
    r = ptxas.parse(spill)
    assert (r["spill_bytes"], r["stack_bytes"]) == (20, 16)
    assert any("spill" in p for p in ptxas.problems(r, "flashgen_k"))
    for code in ("C7515", "C7511", "C7512", "C7517", "C7519", "C7508"):
        text = PTXAS_OK + f"ptxas info    : ({code}) Potential Performance Loss: something in 'flashgen_k'\n"
        probs = ptxas.problems(ptxas.parse(text), "flashgen_k")
        assert len(probs) == 1 and code in probs[0]
    # ptxas 13.0's text for the register case (a bwd tile hit it); any code saying "serialized" fails
    for code in ("C7512", "C7599"):
        text = PTXAS_OK + (f"ptxas info    : ({code}) Potential Performance Loss: wgmma.mma_async instructions are "
                           "serialized due to insufficient register resources for the function 'flashgen_k'\n")
        probs = ptxas.problems(ptxas.parse(text), "flashgen_k")
        assert len(probs) == 1 and code in probs[0] and "serialized" in probs[0]
    benign = PTXAS_OK + "ptxas info    : (C7510) Potential Performance Loss: harmless\n"
    assert ptxas.problems(ptxas.parse(benign), "flashgen_k") == []


# ---------------------------------------------------------------------- manifest (fake nvcc)


def test_manifest_contents(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    vs = load_variants(proj)
    res = build(proj, select(vs), all_variants=vs, jobs=2, log=lambda s: None)
    assert not res.failed and len(res.compiled) == 8 == len(compiles(log))
    m = read_manifest(proj)
    assert m["schema"] == 2 and m["arch"] == "sm_90a"
    assert m["nvcc"]["path"].endswith("fakecuda/bin/nvcc") and m["nvcc"]["version"].startswith("13.0")
    assert len(m["variants"]) == 8  # more.yaml is not in the default set and was not built
    want = {"name", "key", "family", "params", "dispatch", "default", "fatbin", "sha256", "kernels"}
    want_kernel = {"role", "symbol", "threads", "cluster", "smem_bytes", "registers", "spill_bytes", "stack_bytes",
                   "tensor_maps", "sass", "pdl", "params"}
    import hashlib

    for e in m["variants"]:
        assert set(e) == want
        v = next(v for v in vs if v.name == e["name"])
        assert e["params"] == v.params and e["family"] == "fwd" and e["default"] is True
        assert e["dispatch"] == {k: v.params[k] for k in ("dtype", "head_dim", "head_dim_v", "causal", "local", "softcap",
                                                          "pack_gqa", "varlen")}
        assert e["fatbin"] == f"fatbin/{v.name}.fatbin"
        (k,) = e["kernels"]
        assert set(k) == want_kernel
        assert k["role"] == "main" and k["symbol"] == v.symbol("main") and k["pdl"] is False  # the forward: one kernel
        data = (proj.manifest_path.parent / e["fatbin"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert data.startswith(b"FATBIN:" + v.symbol("main").encode())
        assert (k["threads"], k["smem_bytes"]) == (v.resources["threads"], v.resources["smem_bytes"])
        assert (k["registers"], k["spill_bytes"], k["stack_bytes"], k["cluster"]) == (168, 0, 0, [1, 1, 1])
        assert k["tensor_maps"] == ["q", "k", "v", "o"] and set(k["sass"]) >= {"HGMMA", "UTMALDG", "USETMAXREG"}
        assert k["params"] == FWD.kernels(v.params, v.resources)[0].params.layout()
        assert k["params"]["struct"] == "FwdParams" and [f[0] for f in k["params"]["fields"]][:2] == ["lse", "seqlen_q"]
        assert len(e["key"]) == 64
    assert not list(proj.build_dir.rglob("*.tmp")) and not list(proj.cache_dir.glob(".tmp-*"))
    # building the rest later keeps what was built before
    more = [v for v in vs if not v.default_build]
    build(proj, more, all_variants=vs, log=lambda s: None)
    m2 = read_manifest(proj)
    assert len(m2["variants"]) == 9 and [e for e in m2["variants"] if e["name"] == more[0].name][0]["default"] is False


def test_failures_name_variant_and_first_error(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_NVCC_FAIL", "fp16_hd64_causal")
    vs = load_variants(proj)
    lines = []
    res = build(proj, select(vs), all_variants=vs, jobs=2, log=lines.append)
    assert len(res.failed) == 1
    name, msg = res.failed[0]
    assert "fp16_hd64_causal" in name and 'identifier "oops" is undefined' in msg and "logs/" in msg
    assert any("FAIL" in ln and name in ln for ln in lines)
    assert len(read_manifest(proj)["variants"]) == 7  # the rest still land in the manifest


@pytest.mark.parametrize("env,needle", [({"FAKE_NVCC_SPILL": "1"}, "register spills"),
                                        ({"FAKE_NVCC_ADVISORY": "C7515"}, "C7515")])
def test_slow_kernels_fail_the_build(tmp_path, monkeypatch, env, needle):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    vs = load_variants(proj)[:1]
    res = build(proj, vs, log=lambda s: None)
    assert len(res.failed) == 1 and needle in res.failed[0][1]
    assert read_manifest(proj)["variants"] == [] and not list(proj.cache_dir.glob("[0-9a-f]*"))


# ---------------------------------------------------------------------------------- discovery


def test_find_root_order(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    sub = proj.root / "configs"
    monkeypatch.delenv("FLASHGEN_ROOT", raising=False)
    assert find_root(sub) == proj.root  # walking up from the cwd
    assert find_root(tmp_path) == REPO  # else the package's own checkout
    monkeypatch.setenv("FLASHGEN_ROOT", str(tmp_path / "elsewhere"))
    assert find_root(sub) == (tmp_path / "elsewhere").resolve()
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(tmp_path / "out"))
    assert Project(proj.root).manifest_path == (tmp_path / "out" / "manifest.json").resolve()


def test_nvcc_discovery_order(tmp_path, monkeypatch):
    home, _ = fake_cuda(tmp_path, monkeypatch)
    nv = find_nvcc()
    assert nv.path == str(home / "bin" / "nvcc") and nv.source == "$CUDA_HOME" and nv.release.startswith("13.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nope"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(home / "bin"))
    assert find_nvcc().source == "PATH"


def test_nvcc_missing_is_a_clear_error(tmp_path, monkeypatch):
    import flashgen.generator.toolchain as tc

    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nope"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(tc, "_candidates", lambda: iter([(tmp_path / "nope" / "bin" / "nvcc", "$CUDA_HOME")]))
    with pytest.raises(ToolchainError) as ei:
        find_nvcc()
    assert "nvcc not found" in str(ei.value) and "flashgen[nvcc]" in str(ei.value)


def test_default_jobs_bounded():
    import os

    j = default_jobs()
    assert 1 <= j <= len(os.sched_getaffinity(0))


def test_manifest_schema_readable_by_runtime(tmp_path, monkeypatch):
    """The runtime's own manifest reader accepts what the generator writes."""
    manifest_mod = pytest.importorskip("flashgen.manifest")
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    vs = load_variants(proj)
    build(proj, select(vs), all_variants=vs, log=lambda s: None)
    m = manifest_mod.parse_manifest(proj.manifest_path)
    assert len(m.variants) == 8 and all(v.default for v in m.variants)
    assert json.loads(proj.manifest_path.read_text())["variants"][0]["name"] == sorted(v.name for v in m.variants)[0]


def test_sass_check_manifest_runs_variants_in_parallel_and_reports_every_failure(tmp_path, monkeypatch):
    """check_manifest runs cuobjdump for several fatbins at once (generator/sass.py): the report keeps the
    manifest's order and every failing variant is named, not only the first one a worker finished."""
    import json
    import threading
    import time

    from flashgen.generator import sass

    names = [f"v{i}" for i in range(6)]
    (tmp_path / "manifest.json").write_text(json.dumps({"variants": [
        {"fatbin": f"{n}.fatbin", "kernels": [{"symbol": f"k_{n}", "sass": ["HGMMA"]}]} for n in names]}))
    running, most = [0], [0]
    lock = threading.Lock()

    def fake_check(fatbin, required):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05 if fatbin.endswith("v0.fatbin") else 0.01)  # the first one finishes last
        with lock:
            running[0] -= 1
        if fatbin.endswith(("v1.fatbin", "v4.fatbin")):
            raise AssertionError(f"{fatbin}: SASS lacks HGMMA")
        return {sym: ["HGMMA"] for sym in required}

    monkeypatch.setattr(sass, "check", fake_check)
    with pytest.raises(AssertionError) as e:
        sass.check_manifest(str(tmp_path / "manifest.json"), jobs=4)
    msg = str(e.value)
    assert "v0" not in msg and 0 <= msg.find("v1.fatbin") < msg.find("v4.fatbin")
    assert most[0] > 1
    monkeypatch.setattr(sass, "check", lambda f, r: time.sleep(0.05 * f.endswith("v0.fatbin")) or
                        {s: ["HGMMA"] for s in r})
    assert list(sass.check_manifest(str(tmp_path / "manifest.json"))) == [f"k_{n}" for n in names]
