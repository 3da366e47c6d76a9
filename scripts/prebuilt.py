"""Kernels built here, carried to the device machine, so that a cold device call skips its build.

A device call's time is the session's scarcest resource (1,800 s, charged from the machine's start); the default
build there is 48-81 s of every cold call. The kernels do not depend on the GPU: a fatbin compiled here with the
same nvcc release is the one the device would compile. So:

    python3 scripts/prebuilt.py pack [BUILD ARGS]    # here: flashgen build ARGS, the SASS check, then .prebuilt/
    (device tool: carry [".prebuilt"]; scripts/device_check.sh uses it when its stamp matches)
    python3 scripts/prebuilt.py stamp [BUILD ARGS]   # the stamp of this tree, these build arguments, this nvcc

``.prebuilt/`` holds manifest.json, the fatbins it lists (fatbin/) and ``stamp``; pack runs the SASS check before
it writes them, so the device skips that check for a carried build. The stamp is a sha256 over the build
arguments, the nvcc release that ``flashgen build`` would use (generator.toolchain.find_nvcc) and every file the build reads (templates/,
configs/, generator/: paths and contents), so a carried build is used only for the tree and arguments it was made
from: device_check.sh compares it with its own ``stamp`` and builds as before on any difference. BUILD ARGS are
``flashgen build``'s own (``--all``, ``--filter PATTERN``), given in the same form as device_check.sh passes them
(BUILD_ALL=0: none; BUILD_FILTER: ``--filter 'fwd_bf16*'``).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ("templates", "configs", "generator")  # what `flashgen build` reads, besides nvcc
OUT = ROOT / ".prebuilt"


def stamp(args: list[str]) -> str:
    """sha256 hex of the build arguments, nvcc's release and every input file (path and content)."""
    from flashgen.generator.toolchain import find_nvcc

    h = hashlib.sha256()
    h.update(json.dumps(args).encode() + b"\0" + find_nvcc().version.encode() + b"\0")
    for top in INPUTS:
        for p in sorted((ROOT / top).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def selected_names(args: list[str]) -> set:
    """The variants that ``flashgen build ARGS`` selects (the default set, ``--all``, ``--filter``): all that a
    build on the device lists, since its cache starts empty. A build here lists every configured variant whose
    cache entry is intact (generator/build.py write_outputs), so after an ``--all`` build here a default build's
    manifest holds the tune candidates too (session 17: 431 variants instead of 350)."""
    from flashgen.generator.config import load_variants, select
    from flashgen.generator.project import Project

    pattern = args[args.index("--filter") + 1] if "--filter" in args else None
    variants = load_variants(Project.locate(ROOT))
    return {v.name for v in select(variants, pattern, "--all" in args)}


def pack(args: list[str]) -> int:
    """Build with ``args`` into a fresh build directory (sharing build/cache, so unchanged variants are not
    recompiled; a fresh directory, because a build over build/ keeps earlier fatbins of configured variants it
    did not build, marked stale, which a device build would not have), check the SASS, copy the manifest and
    its fatbins to .prebuilt/."""
    import os
    import tempfile

    before = stamp(args)
    (ROOT / "build" / "cache").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashgen-prebuilt-") as tmp:
        build = Path(tmp)
        (build / "cache").symlink_to(ROOT / "build" / "cache")
        subprocess.run(["flashgen", "build", *args], cwd=ROOT, check=True,
                       env={**os.environ, "FLASHGEN_BUILD_DIR": str(build)})
        manifest = build / "manifest.json"
        data = json.loads(manifest.read_text())
        assert not any(v.get("stale") for v in data["variants"]), "a fresh build directory has no stale variants"
        names = selected_names(args)
        data["variants"] = [v for v in data["variants"] if v["name"] in names]  # what the device's build would list
        if {v["name"] for v in data["variants"]} != names:
            print("prebuilt: the build did not list every selected variant; not packed", file=sys.stderr)
            return 1
        manifest.write_text(json.dumps(data, indent=1) + "\n")  # (the SASS check reads only what is carried)
        subprocess.run([sys.executable, "-m", "flashgen.generator.sass", str(manifest)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        if stamp(args) != before:
            print("prebuilt: the tree changed during the build; not packed", file=sys.stderr)
            return 1
        shutil.rmtree(OUT, ignore_errors=True)
        (OUT / "fatbin").mkdir(parents=True)
        for v in data["variants"]:
            shutil.copy2(build / v["fatbin"], OUT / v["fatbin"])
        shutil.copy2(manifest, OUT / "manifest.json")
    (OUT / "stamp").write_text(before + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"prebuilt: {len(data['variants'])} variants, {size / 2**20:.1f} MiB in {OUT.relative_to(ROOT)}/ "
          f"(carry it: the device tool's carry limit is 64 MiB in all)")
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("pack", "stamp"):
        print(__doc__)
        return 2
    if argv[0] == "stamp":
        print(stamp(argv[1:]))
        return 0
    return pack(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
