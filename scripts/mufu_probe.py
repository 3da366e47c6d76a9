"""Render, build and run scripts/mufu_probe.cu.j2: issue 10's exponential-phase probes (the FP8 softmax's
MUFU.EX2 phase alone, beside row-max warps and beside FP8 WGMMAs; docs/results/mufu_probe/). The template
takes its WGMMA wrappers from the project's macro (templates/macros/wgmma.j2). Needs nvcc and, to run, a
Hopper GPU; ``--build-only`` compiles and prints ptxas's register and spill lines (no GPU needed).

Usage: python scripts/mufu_probe.py [--out DIR] [--build-only]"""

import argparse
import subprocess
import sys
from pathlib import Path

import jinja2

from flashgen.generator.build import NVCC_FLAGS, nvcc_command
from flashgen.generator.toolchain import find_nvcc

ROOT = Path(__file__).resolve().parent.parent
# The kernels' own nvcc flags (arch, fast math, ptxas -v), for an executable instead of a fatbin
FLAGS = [f for f in NVCC_FLAGS if f not in ("-fatbin", "-Xfatbin=-compress-all")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/mufu_probe_build", help="folder for the rendered source and the binary")
    ap.add_argument("--build-only", action="store_true", help="compile only")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(ROOT / "templates"), str(ROOT / "scripts")]),
                             undefined=jinja2.StrictUndefined)
    src = out / "mufu_probe.cu"
    src.write_text(env.get_template("mufu_probe.cu.j2").render())
    exe = out / "mufu_probe"
    subprocess.run(nvcc_command(find_nvcc().path, ROOT / "templates" / "include", src, exe, FLAGS), check=True)
    if a.build_only:
        return 0
    return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())
