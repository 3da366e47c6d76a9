"""Content-addressed cache: hits, invalidation (header edit, flags, nvcc version, template),
atomicity under a killed build, and two concurrent builds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import spawn_build, compiles, fake_cuda, make_project, read_manifest  # noqa: E402

from flashgen.generator.build import NVCC_FLAGS, build  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402

QUIET = dict(log=lambda s: None)


def _build(proj, **kw):
    vs = load_variants(proj)
    return build(proj, select(vs), all_variants=vs, **{**QUIET, **kw})


def test_second_build_compiles_nothing(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    r1 = _build(proj)
    assert len(r1.compiled) == 8 and r1.cached == []
    before = proj.manifest_path.read_bytes()
    r2 = _build(proj)
    assert r2.compiled == [] and len(r2.cached) == 8
    assert len(compiles(log)) == 8  # nvcc ran 8 times in total
    assert proj.manifest_path.read_bytes() == before


def test_cache_ignores_mtimes(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    for p in [*proj.templates_dir.rglob("*"), *proj.configs_dir.glob("*")]:
        os.utime(p, (time.time() + 100, time.time() + 100))
    assert _build(proj).compiled == [] and len(compiles(log)) == 8


def test_header_edit_rebuilds_exactly_its_includers(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    mask = proj.include_dir / "flashgen" / "fx_mask.cuh"  # included by the causal variants only
    mask.write_text(mask.read_text() + "// edited\n")
    r = _build(proj)
    assert sorted(r.compiled) == sorted(v.name for v in load_variants(proj) if v.params["causal"] and v.default_build)
    assert len(r.compiled) == 4 and len(r.cached) == 4
    common = proj.include_dir / "flashgen" / "fx_common.cuh"  # included by everything
    common.write_text(common.read_text() + "// edited\n")
    assert len(_build(proj).compiled) == 8
    unused = proj.include_dir / "flashgen" / "not_included.cuh"
    unused.write_text("// nobody includes me\n")
    assert _build(proj).compiled == []
    assert len(compiles(log)) == 20


def test_flag_change_and_nvcc_version_invalidate(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    flags = tuple(f for f in NVCC_FLAGS if f != "-lineinfo")
    assert len(_build(proj, flags=flags).compiled) == 8
    assert _build(proj, flags=flags).compiled == []
    monkeypatch.setenv("FAKE_NVCC_RELEASE", "13.1")
    from flashgen.generator import toolchain

    toolchain._version_of.cache_clear()
    r = _build(proj)
    assert len(r.compiled) == 8 and read_manifest(proj)["nvcc"]["version"].startswith("13.1")
    toolchain._version_of.cache_clear()


def test_template_and_config_edits(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    t = proj.templates_dir / "fwd.cu.j2"
    t.write_text(t.read_text().replace("NOT flash attention", "NOT flash attention (v2)"))
    assert len(_build(proj).compiled) == 8
    # a Jinja-only change that renders to the same source rebuilds nothing
    t.write_text("{# a comment #}" + t.read_text())
    assert _build(proj).compiled == []
    cfg = proj.configs_dir / "fwd.yaml"
    cfg.write_text(cfg.read_text().replace("block_n: 128, consumer_wgs: 2", "block_n: 112, consumer_wgs: 2"))
    r = _build(proj)
    assert len(r.compiled) == 4 and all("m128n112" in n for n in r.compiled)
    m = read_manifest(proj)
    assert len(m["variants"]) == 8 and not any("m128n128" in e["name"] for e in m["variants"])
    assert len(list(proj.fatbin_dir.glob("*.fatbin"))) == 8  # stale fatbins removed


def test_killed_build_leaves_no_corrupt_artifact(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    home, log = fake_cuda(tmp_path, monkeypatch)
    env = {"CUDA_HOME": str(home), "FAKE_NVCC_LOG": str(log), "FAKE_NVCC_SLEEP": "30"}
    p = spawn_build(proj, env, tmp_path / "killed.out")
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not (log.exists() and log.read_text().count("start") >= 1):
            time.sleep(0.05)
        assert log.exists(), "fake nvcc never started"
        time.sleep(0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the build and its nvcc children (a process group we made)
        p.wait()
    # nothing half-written was published
    assert not proj.manifest_path.exists()
    assert not list(proj.cache_dir.glob("[0-9a-f]*")), "no cache entry may exist for an unfinished compile"
    assert not proj.fatbin_dir.exists() or not list(proj.fatbin_dir.iterdir())
    partial = list(proj.cache_dir.glob(".tmp-*/kernel.fatbin"))
    assert partial and all(f.read_bytes() == b"PARTIAL" for f in partial)  # the kill hit mid-compile
    # the next build does the work, cleans the dead build's temp folders, and is complete
    monkeypatch.delenv("FAKE_NVCC_SLEEP", raising=False)
    r = _build(proj)
    assert len(r.compiled) == 8 and not r.failed
    assert not list(proj.cache_dir.glob(".tmp-*"))
    m = read_manifest(proj)
    assert len(m["variants"]) == 8
    assert all((proj.build_dir / e["fatbin"]).read_bytes().startswith(b"FATBIN:") for e in m["variants"])


def test_two_concurrent_builds(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    home, log = fake_cuda(tmp_path, monkeypatch)
    env = {"CUDA_HOME": str(home), "FAKE_NVCC_LOG": str(log), "FAKE_NVCC_SLEEP": "0.4"}
    procs = [spawn_build(proj, env, tmp_path / f"b{i}.out") for i in range(2)]
    rcs = [p.wait(timeout=120) for p in procs]
    outs = [(tmp_path / f"b{i}.out").read_text() for i in range(2)]
    assert rcs == [0, 0], outs
    assert sorted(compiles(log)) == sorted(set(compiles(log))) and len(compiles(log)) == 8, outs  # each once
    assert any("built by a concurrent build" in o for o in outs), outs
    m = read_manifest(proj)  # valid JSON, complete
    assert len(m["variants"]) == 8
    import hashlib

    for e in m["variants"]:
        data = (proj.build_dir / e["fatbin"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"] and data.startswith(b"FATBIN:")
        entry = proj.cache_dir / e["key"]
        assert (entry / "kernel.fatbin").read_bytes() == data
        assert json.loads((entry / "report.json").read_text())["name"] == e["name"]
    assert not list(proj.cache_dir.glob(".tmp-*"))
    # and a third build finds everything cached
    monkeypatch.delenv("FAKE_NVCC_SLEEP", raising=False)
    assert _build(proj).compiled == []
