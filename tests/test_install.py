"""One install story (issue 8): every standard way of making the package yields one whose runtime
finds its kernels, or fails loudly; the CLI and the runtime read the same manifest.

The packaging runs for real (pip / python -m build over a copy of this checkout) with the fake
nvcc of tests/fixtures, so it is quick and needs no GPU."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import REPO, cli, fake_cuda, make_project  # noqa: E402

from flashgen.generator.config import load_variants, select  # noqa: E402
from flashgen.generator.project import Project  # noqa: E402

_ENV_DROP = ("FLASHGEN_ROOT", "FLASHGEN_BUILD_DIR", "FLASHGEN_KERNEL_DIR", "FLASHGEN_VARIANTS", "PYTHONPATH")


def _checkout_copy(tmp_path: Path) -> Path:
    """The checkout's files (tracked and untracked-not-ignored), as a fresh clone would have them."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    dst = tmp_path / "src"
    for f in files:
        if f and (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            (dst / f).write_bytes((REPO / f).read_bytes())
    return dst


def _env(tmp_path: Path, **extra) -> dict:
    home, _ = fake_cuda(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROP}
    return {**env, "CUDA_HOME": str(home), **extra}


def _pip_wheel(src: Path, out: Path, env: dict, target: str = ".") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                           target], cwd=src, env=env, capture_output=True, text=True)


def _wheel_kernels(whl: Path) -> tuple[dict, dict]:
    """(manifest, {fatbin path in the wheel: bytes}) of a wheel."""
    with zipfile.ZipFile(whl) as z:
        manifest = json.loads(z.read("flashgen/_kernels/manifest.json"))
        fatbins = {n: z.read(n) for n in z.namelist() if n.startswith("flashgen/_kernels/fatbin/")}
    return manifest, fatbins


def _check_complete(manifest: dict, fatbins: dict, names: set) -> None:
    assert {e["name"] for e in manifest["variants"]} == names
    for e in manifest["variants"]:
        data = fatbins[f"flashgen/_kernels/{e['fatbin']}"]
        assert hashlib.sha256(data).hexdigest() == e["sha256"] and data.startswith(b"FATBIN:")
        assert not e.get("stale")


def _default_names(src: Path, everything: bool = False) -> set:
    return {v.name for v in select(load_variants(Project(src)), None, everything)}


def test_pip_wheel_ships_the_default_kernels_and_the_runtime_finds_them(tmp_path):
    src = _checkout_copy(tmp_path)
    env = _env(tmp_path)
    r = _pip_wheel(src, tmp_path / "dist", env)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("flashgen-*.whl")
    manifest, fatbins = _wheel_kernels(whl)
    _check_complete(manifest, fatbins, _default_names(src))
    # installed (not editable) and used from a folder that is not a checkout: the runtime and the CLI
    # both name the package's own manifest
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)],
                   check=True, env=env)
    run_env = {**env, "PYTHONPATH": str(site)}
    code = ("import flashgen.manifest as m; p, s = m.find_manifest(with_source=True); "
            "print(p, '|', s, '|', len(m.load_manifest(p).variants))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path, source, n = (x.strip() for x in out.stdout.split("|"))
    assert Path(path) == site / "flashgen" / "_kernels" / "manifest.json" and source == "installed package"
    assert int(n) == len(manifest["variants"])
    info = subprocess.run([sys.executable, "-m", "flashgen.cli", "info"], cwd=tmp_path, env=run_env,
                          capture_output=True, text=True)
    assert f"manifest:  {path} (from installed package" in info.stdout, info.stdout + info.stderr


def test_a_failed_variant_fails_the_package(tmp_path):
    src = _checkout_copy(tmp_path)
    r = _pip_wheel(src, tmp_path / "dist", _env(tmp_path, FAKE_NVCC_FAIL="hd128"))
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "cannot make a package with its kernels" in out and "hd128" in out
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_flashgen_variants_chooses_the_set(tmp_path):
    src = _checkout_copy(tmp_path)
    r = _pip_wheel(src, tmp_path / "dist", _env(tmp_path, FLASHGEN_VARIANTS="combine_*"))
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("*.whl")
    manifest, fatbins = _wheel_kernels(whl)
    names = {n for n in _default_names(src, everything=True) if n.startswith("combine_")}
    assert names
    _check_complete(manifest, fatbins, names)
    bad = _pip_wheel(src, tmp_path / "dist2", _env(tmp_path, FLASHGEN_VARIANTS="no_such_variant*"))
    assert bad.returncode != 0 and "selects no variant" in bad.stdout + bad.stderr


def test_sdist_then_wheel_ships_the_kernels(tmp_path):
    pytest.importorskip("build")
    src = _checkout_copy(tmp_path)
    env = _env(tmp_path)
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path / "sd")],
                       cwd=src, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (sdist,) = (tmp_path / "sd").glob("flashgen-*.tar.gz")
    with tarfile.open(sdist) as t:
        t.extractall(tmp_path / "unpacked", filter="data")
    (root,) = (tmp_path / "unpacked").iterdir()
    assert (root / "configs").is_dir() and (root / "templates" / "include").is_dir()
    w = _pip_wheel(root, tmp_path / "dist", env)
    assert w.returncode == 0, w.stdout + w.stderr
    (whl,) = (tmp_path / "dist").glob("*.whl")
    _check_complete(*_wheel_kernels(whl), _default_names(src))


def test_runtime_reads_flashgen_build_dir_like_the_build(tmp_path, monkeypatch):
    from flashgen.manifest import find_manifest

    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    for var in _ENV_DROP:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHGEN_BUILD_DIR", str(tmp_path / "out"))
    r = cli(["build"], root=proj.root)
    assert r.exit_code == 0, r.output
    monkeypatch.delenv("FLASHGEN_ROOT", raising=False)
    path, source = find_manifest(with_source=True)
    assert path == tmp_path / "out" / "manifest.json" and source == "$FLASHGEN_BUILD_DIR"
    info = cli(["info"], root=proj.root)
    assert f"manifest:  {path} (from $FLASHGEN_BUILD_DIR" in info.output


def test_build_says_when_the_runtime_loads_another_manifest(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    for var in _ENV_DROP:
        monkeypatch.delenv(var, raising=False)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"schema": 2, "variants": []}))
    r = cli(["build"], root=proj.root, env={"FLASHGEN_KERNEL_DIR": str(other)})
    assert r.exit_code == 0
    assert f"note: the runtime loads {other / 'manifest.json'}" in r.output + r.stderr
