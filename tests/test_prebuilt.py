"""scripts/prebuilt.py's stamp: a build carried to the device (device_check.sh) is used only where its stamp is the
device tree's, so the stamp must move with every input of `flashgen build` (templates, configs, generator code, the
build arguments, nvcc's release) and with nothing else."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "prebuilt.py"


@pytest.fixture
def prebuilt(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("prebuilt_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for top in mod.INPUTS:  # a copy of the inputs, to edit
        shutil.copytree(mod.ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "interface.py").write_text("x = 1\n")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    from flashgen.generator import toolchain
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: type("N", (), {"version": "13.0, V13.0.88"})())
    return mod, tmp_path, toolchain, monkeypatch


def test_stamp_follows_every_build_input_and_nothing_else(prebuilt):
    mod, root, toolchain, monkeypatch = prebuilt
    base = mod.stamp([])
    assert base == mod.stamp([]) and len(base) == 64
    assert mod.stamp(["--all"]) != base and mod.stamp(["--filter", "fwd_bf16*"]) != mod.stamp(["--filter", "fwd_fp16*"])
    (root / "runtime" / "interface.py").write_text("x = 2\n")  # not a build input
    (root / "generator" / "__pycache__").mkdir(exist_ok=True)
    (root / "generator" / "__pycache__" / "junk.pyc").write_bytes(b"\0")
    assert mod.stamp([]) == base
    seen = {base}
    for rel in ("templates/fwd.cu.j2", "configs/fwd.yaml", "generator/build.py"):
        f = root / rel
        text = f.read_text()
        f.write_text(text + "\n")
        s = mod.stamp([])
        assert s not in seen, rel
        seen.add(s)
        f.write_text(text)
    assert mod.stamp([]) == base
    (root / "templates" / "include" / "new_header.cuh").write_text("// new\n")  # a new file counts
    assert mod.stamp([]) not in seen
    (root / "templates" / "include" / "new_header.cuh").unlink()
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: type("N", (), {"version": "13.1, V13.1.0"})())
    assert mod.stamp([]) != base


def test_pack_lists_what_the_device_build_would():
    """pack keeps the variants ``flashgen build ARGS`` selects: a build here also lists every configured variant
    already in build/cache (after an --all build, the tune candidates), which a device build would not have."""
    spec = importlib.util.spec_from_file_location("prebuilt_names", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from flashgen.generator.config import load_variants, select
    from flashgen.generator.project import Project

    variants = load_variants(Project.locate(mod.ROOT))
    default, every = mod.selected_names([]), mod.selected_names(["--all"])
    assert default == {v.name for v in select(variants)} and default < every
    assert any(not v.default_build for v in variants if v.name in every - default)
    some = mod.selected_names(["--filter", "fwd_bf16_hd64*"])
    assert some and some <= default and all(n.startswith("fwd_bf16_hd64") for n in some)
    assert mod.selected_names(["--all", "--filter", "fwd_bf16_hd64*"]) >= some
