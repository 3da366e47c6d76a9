"""The click CLI: list, build, add-variant, info, bench, --help."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from fgutil import cli, cli_subprocess, compiles, fake_cuda, make_project, read_manifest  # noqa: E402

from flashgen.generator.config import load_variants  # noqa: E402


@pytest.mark.parametrize("cmd", [[], ["list"], ["build"], ["add-variant"], ["add-variant", "fwd"],
                                 ["add-variant", "combine"], ["info"], ["bench"]])
def test_help(cmd):
    r = cli([*cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output
    if cmd:
        assert len(r.output.splitlines()) > 4  # a docstring, not just the usage line


def test_list_and_build_flags(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    r = cli(["list"], proj.root)
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.output.splitlines() if ln.startswith("fwd_")]
    assert len(rows) == 8 and all(ln.split()[-1] == "no" for ln in rows)
    assert len([ln for ln in cli(["list", "--all"], proj.root).output.splitlines() if ln.startswith("fwd_")]) == 9
    r = cli(["build", "--filter", "*hd64_causal*", "-j", "1"], proj.root)
    assert r.exit_code == 0, r.output
    assert "nvcc: " + str(tmp_path / "fakecuda" / "bin" / "nvcc") in r.output  # which nvcc it used
    assert "[2/2]" in r.output and len(compiles(log)) == 2
    data = json.loads(cli(["list", "--json"], proj.root).output)
    built = {d["name"] for d in data if d["built"] == "yes"}
    assert len(built) == 2 and all("hd64_causal" in n for n in built)
    assert all(d["default"] for d in data)
    # a header edit makes them stale
    mask = proj.include_dir / "flashgen" / "fx_mask.cuh"
    mask.write_text(mask.read_text() + "// edit\n")
    data = json.loads(cli(["list", "--json"], proj.root).output)
    assert {d["name"] for d in data if d["built"] == "stale"} == built


def test_build_filter_outside_default_set_needs_all(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    r = cli(["build", "--filter", "hd256"], proj.root)
    assert r.exit_code == 2 and "--all" in r.stderr
    r = cli(["build", "--all", "--filter", "hd256"], proj.root)
    assert r.exit_code == 0 and len(read_manifest(proj)["variants"]) == 1


def test_build_failure_exit_1_names_variant(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_NVCC_FAIL", "bf16_hd128_noncausal")
    r = cli(["build"], proj.root)
    assert r.exit_code == 1
    assert "bf16_hd128_noncausal" in r.stderr and 'identifier "oops" is undefined' in r.stderr


def test_missing_nvcc_exit_3(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    import flashgen.generator.toolchain as tc

    monkeypatch.setattr(tc, "_candidates", lambda: iter([]))
    r = cli(["build"], proj.root)
    assert r.exit_code == 3 and "nvcc not found" in r.stderr


ADD = ["add-variant", "fwd", "--dtype", "bf16", "--head-dim", "128", "--causal", "--block-m", "128", "--consumer-wgs", "2",
       "--block-n", "112"]


def test_add_variant_writes_builds_and_updates_manifest(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    cli(["build"], proj.root)
    n0 = len(read_manifest(proj)["variants"])
    r = cli([*ADD, "--no-pingpong"], proj.root)
    assert r.exit_code == 0, r.output
    extra = proj.configs_dir / "fwd_extra.yaml"
    assert extra.exists()
    name = next(v.name for v in load_variants(proj) if v.params["block_n"] == 112)
    assert "m128n112_s2_wg2_nopp_ov_ps" in name and name in r.output
    m = read_manifest(proj)
    assert len(m["variants"]) == n0 + 1
    e = next(e for e in m["variants"] if e["name"] == name)
    assert e["params"]["causal"] is True and e["params"]["pingpong"] is False and e["default"] is False
    assert compiles(log)[-1] == "flashgen_" + name + "_main" and len(compiles(log)) == n0 + 1  # built only it
    # the runtime sees it at once
    manifest_mod = pytest.importorskip("flashgen.manifest")
    assert name in {v.name for v in manifest_mod.parse_manifest(proj.manifest_path).variants}
    # a second, different point is appended to the same file, keeping its comment header
    r = cli([*ADD[:-1], "96", "--stages", "3"], proj.root)
    assert r.exit_code == 0, r.output
    text = extra.read_text()
    assert text.startswith("# Variants added by") and text.count("block_n: ") == 2
    # adding the same point again does not duplicate it
    assert cli([*ADD, "--no-pingpong", "--no-build"], proj.root).exit_code == 0
    assert extra.read_text() == text


def test_add_variant_appends_to_existing_file_keeping_comments(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    more = proj.configs_dir / "more.yaml"
    more.write_text("# my notes\n" + more.read_text())
    r = cli([*ADD, "--config", "configs/more.yaml", "--no-build"], proj.root)
    assert r.exit_code == 0, r.output
    text = more.read_text()
    assert text.startswith("# my notes\n") and text.count("- {") == 2
    assert len(load_variants(proj)) == 10


def test_add_variant_refuses_a_config_outside_configs(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    outside = tmp_path / "mine.yaml"
    for cfg in (str(outside), "templates/x.yaml", "configs/notes.txt"):
        r = cli([*ADD, "--config", cfg], proj.root)
        assert r.exit_code == 2, r.output
        assert "reads only configs/*.yaml" in r.output + r.stderr
        assert "can dispatch" not in r.output
    assert not outside.exists() and not (proj.root / "templates" / "x.yaml").exists()
    assert not proj.manifest_path.exists()  # nothing was built either


def test_add_variant_does_not_append_an_already_configured_point(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    # exactly the matrix's bf16 hd128 causal point with its tile: fwd.yaml already makes it
    r = cli(["add-variant", "fwd", "--dtype", "bf16", "--head-dim", "128", "--causal", "--block-m", "128",
             "--block-n", "128", "--consumer-wgs", "2"], proj.root)
    assert r.exit_code == 0, r.output
    assert "not added" in r.output and "already configured" in r.output and "configs/fwd.yaml" in r.output
    assert not (proj.configs_dir / "fwd_extra.yaml").exists()


@pytest.mark.parametrize("args,needles", [
    (["--block-n", "120"], ["block_n = 120", "multiple of 16"]),
    (["--block-m", "192", "--consumer-wgs", "2"], ["block_m = 192", "64 * consumer_wgs = 128"]),
    (["--block-n", "176", "--stages", "3"], ["smem_bytes = 305152", "232448"]),
    (["--head-dim", "100"], ["head_dim = 100"]),
])
def test_add_variant_invalid_leaves_file_unchanged(tmp_path, monkeypatch, args, needles):
    proj = make_project(tmp_path)
    _, log = fake_cuda(tmp_path, monkeypatch)
    more = proj.configs_dir / "more.yaml"
    before = more.read_text()
    base = ["add-variant", "fwd", "--dtype", "bf16", "--head-dim", "128", "--block-m", "128", "--consumer-wgs", "2",
            "--block-n", "112"]
    r = cli([*base, *args, "--config", "configs/more.yaml"], proj.root)
    assert r.exit_code == 2, r.output
    for n in needles:
        assert n in r.stderr, r.stderr
    assert "configs/more.yaml" in r.stderr and "Traceback" not in r.output
    assert more.read_text() == before and not (proj.configs_dir / "fwd_extra.yaml").exists()
    assert compiles(log) == [] and not proj.manifest_path.exists()


@pytest.mark.parametrize("block_m,wgs", [(128, 2), (192, 3)])
def test_add_variant_consumer_wgs_defaults_to_block_m_over_64(tmp_path, monkeypatch, block_m, wgs):
    """`--consumer-wgs` is optional (README: `[--consumer-wgs 2]`); before the families refactor it
    defaulted to block_m / 64 (each consumer warpgroup owns 64 rows)."""
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    r = cli(["add-variant", "fwd", "--dtype", "bf16", "--head-dim", "64", "--block-m", str(block_m),
             "--block-n", "112", "--no-build"], proj.root)
    assert r.exit_code == 0, r.output
    (v,) = [v for v in load_variants(proj) if v.params["block_n"] == 112]
    assert (v.params["block_m"], v.params["consumer_wgs"]) == (block_m, wgs)


def test_info_without_gpu_does_not_crash(tmp_path, monkeypatch):
    proj = make_project(tmp_path)
    fake_cuda(tmp_path, monkeypatch)
    cli(["build"], proj.root)
    r = cli_subprocess(["info"], proj.root, env={"CUDA_HOME": str(tmp_path / "fakecuda"),
                                                  "FLASHGEN_KERNEL_DIR": str(proj.build_dir)})
    assert r.returncode == 0, r.stderr
    assert f"nvcc:      {tmp_path / 'fakecuda' / 'bin' / 'nvcc'} (release 13.0" in r.stdout
    assert "gpu:" in r.stdout and "8 built, 8 default tiles" in r.stdout
    kernel_lines = [ln for ln in r.stdout.splitlines() if " [main]  regs=168 " in ln]  # one line per kernel
    assert len(kernel_lines) == 8 and all("spill=0 (fwd: dtype=" in ln for ln in kernel_lines), r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_bench_forwards_options(monkeypatch):
    seen = {}
    fake = types.ModuleType("flashgen.bench")

    def main(argv):
        seen["argv"] = argv
        return 0

    fake.main = main
    import flashgen

    monkeypatch.setitem(sys.modules, "flashgen.bench", fake)
    monkeypatch.setattr(flashgen, "bench", fake, raising=False)
    r = cli(["bench", "--head-dim", "128", "--causal", "--seqlens", "512,1024"])
    assert r.exit_code == 0, r.output
    assert seen["argv"] == ["--head-dim", "128", "--causal", "--seqlens", "512,1024"]
    fake.main = lambda argv: 7
    assert cli(["bench", "-x"]).exit_code == 7


def test_entry_point_installed():
    import shutil

    exe = shutil.which("flashgen")
    if exe is None:
        pytest.skip("package not installed with its console script")
    import subprocess

    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("flashgen ")
