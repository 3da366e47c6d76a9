"""Render, build and run scripts/mufu_probe_gemm.cu.j2 (the MUFU.EX2 phase beside FP8 WGMMAs) and
scripts/mufu_probe.cu (the phase alone and beside row-max warps): issue 10's exponential-phase
probes (docs/PERF.md). Needs nvcc and a Hopper GPU; ``--build-only`` compiles and prints ptxas's
register and spill lines (no GPU)."""

import argparse
import subprocess
import sys
from pathlib import Path

import jinja2

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="/tmp/mufu_probe_build", help="folder for the rendered source and binaries")
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(ROOT / "templates"), str(ROOT / "scripts")]),
                             undefined=jinja2.StrictUndefined)
    (out / "mufu_probe_gemm.cu").write_text(env.get_template("mufu_probe_gemm.cu.j2").render())
    bins = []
    for src in (out / "mufu_probe_gemm.cu", ROOT / "scripts" / "mufu_probe.cu"):
        exe = out / src.stem
        subprocess.run(["nvcc", "-gencode", "arch=compute_90a,code=sm_90a", "-O3", "-use_fast_math", "-Xptxas", "-v", "-o", str(exe), str(src)],
                       check=True)
        bins.append(exe)
    if a.build_only:
        return 0
    rc = 0
    for exe in bins:
        rc |= subprocess.run([str(exe)]).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
