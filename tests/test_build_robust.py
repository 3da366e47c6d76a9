"""A build never loses kernels or publishes a bad one: failed renders and compiles keep the previous
build, corrupt cache entries are rebuilt, concurrent builds compile each key once, and a killed
build takes its nvcc process groups with it (issue 8: build robustness). Two concurrent builds
compiling each variant once: tests/test_cache.py::test_two_concurrent_builds."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import spawn_build, cli, compiles, fake_cuda, make_project, read_manifest  # noqa: E402

from flashgen.generator.build import build  # noqa: E402
from flashgen.generator.config import load_variants, select  # noqa: E402

QUIET = dict(log=lambda s: None)


def _build(proj, **kw):
    vs = load_variants(proj)
    return build(proj, select(vs), all_variants=vs, **{**QUIET, **kw})


def _intact(proj, m) -> list[str]:
    """Names of manifest entries whose fatbin exists and matches the recorded sha256."""
    ok = []
    for e in m["variants"]:
        f = proj.build_dir / e["fatbin"]
        if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() == e["sha256"]:
            ok.append(e["name"])
    return ok


def test_missing_template_keeps_every_built_kernel(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    before = read_manifest(proj)
    assert len(before["variants"]) == 8
    (proj.templates_dir / "fwd.cu.j2").unlink()
    r = cli(["build"], root=proj.root)
    assert r.exit_code == 1, r.output
    out = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert "nothing to compile" not in out
    assert "fwd.cu.j2 not found" in out and "8 variant(s) failed" in out
    m = read_manifest(proj)
    names = sorted(e["name"] for e in m["variants"])
    assert names == sorted(e["name"] for e in before["variants"])
    assert _intact(proj, m) == names and all(e["stale"] for e in m["variants"])


def test_broken_header_with_filter_keeps_every_built_kernel(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    good = {e["name"]: e["sha256"] for e in read_manifest(proj)["variants"]}
    common = proj.include_dir / "flashgen" / "fx_common.cuh"  # every variant includes it: all keys change
    common.write_text(common.read_text() + "this does not compile;\n")
    monkeypatch.setenv("FAKE_NVCC_FAIL", "flashgen_")
    r = cli(["build", "--filter", "hd64"], root=proj.root)
    assert r.exit_code == 1
    m = read_manifest(proj)
    assert {e["name"]: e["sha256"] for e in m["variants"]} == good  # all 8, the earlier builds
    assert sorted(_intact(proj, m)) == sorted(good)
    # fixing the header rebuilds; the manifest then holds current builds only
    common.write_text(common.read_text().replace("this does not compile;\n", ""))
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    assert not _build(proj).failed
    assert not any(e.get("stale") for e in read_manifest(proj)["variants"])


def test_corrupt_cache_entry_is_rebuilt_not_published(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    e = read_manifest(proj)["variants"][0]
    good = (proj.build_dir / e["fatbin"]).read_bytes()
    entry = proj.cache_dir / e["key"] / "kernel.fatbin"
    entry.write_bytes(entry.read_bytes()[:10])  # truncated
    (proj.build_dir / e["fatbin"]).unlink()
    lines = []
    r = _build(proj, log=lines.append)
    assert r.compiled == [e["name"]] and not r.failed
    said = [ln for ln in lines if "is corrupt" in ln]
    assert len(said) == 1 and e["name"] in said[0], lines
    assert len(compiles(log)) == 9
    m = {x["name"]: x for x in read_manifest(proj)["variants"]}
    assert (proj.build_dir / e["fatbin"]).read_bytes() == good
    assert m[e["name"]]["sha256"] == hashlib.sha256(good).hexdigest()


def test_cache_entry_without_checksum_is_not_trusted(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    _build(proj)
    key = read_manifest(proj)["variants"][0]["key"]
    rep = proj.cache_dir / key / "report.json"
    data = json.loads(rep.read_text())
    del data["fatbin_sha256"]
    rep.write_text(json.dumps(data))
    assert len(_build(proj).compiled) == 1


def _alive(marker: str) -> list[str]:
    r = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return r.stdout.split()


def test_kill_9_of_a_build_kills_its_nvcc_children(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    home, log = fake_cuda(tmp_path, monkeypatch)
    marker = f"{40 + os.getpid() % 1000}.{int(time.time() * 1000) % 997}"  # an unlikely sleep length
    env = {"CUDA_HOME": str(home), "FAKE_NVCC_LOG": str(log), "FAKE_NVCC_SLEEP": marker}
    p = spawn_build(proj, env, tmp_path / "killed.out")
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(_alive(f"sleep {marker}")) < 2:
            time.sleep(0.05)
        assert len(_alive(f"sleep {marker}")) == 2, "the fake nvcc jobs never started"
        os.kill(p.pid, signal.SIGKILL)  # the build process alone: it can clean nothing up
        p.wait()
        deadline = time.time() + 10
        while time.time() < deadline and _alive(f"sleep {marker}"):
            time.sleep(0.05)
        assert _alive(f"sleep {marker}") == [], "nvcc children outlived the killed build"
    finally:
        for pid in _alive(f"sleep {marker}"):
            os.kill(int(pid), signal.SIGKILL)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
