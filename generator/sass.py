"""SASS checks with cuobjdump: a warp-specialized Hopper kernel must show HGMMA (QGMMA for fp8),
UTMALDG (TMA loads) and USETMAXREG (register reallocation). A kernel with only HMMA is on the slow path.

    python -m flashgen.generator.sass build/manifest.json
"""
from __future__ import annotations

import re
import subprocess
import sys

from .errors import ToolchainError
from .toolchain import find_cuobjdump

_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)", re.M)


def dump(fatbin: str) -> str:
    """``cuobjdump -sass`` text of a fatbin (compressed fatbins are fine)."""
    exe = find_cuobjdump()
    r = subprocess.run([exe, "-sass", str(fatbin)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise ToolchainError(f"{exe} -sass {fatbin} failed: {(r.stderr or r.stdout).strip()[:500]}")
    return r.stdout


def functions(sass_text: str) -> dict[str, str]:
    """Split cuobjdump output into {function name: its SASS}."""
    out = {}
    marks = list(_FUNC.finditer(sass_text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(sass_text)
        out[m.group(1)] = sass_text[m.end():end]
    return out


def softmax_under_pv(body: str) -> bool:
    """Whether a forward kernel's SASS keeps the intra-warpgroup overlap (FA3, arXiv 2407.08608,
    Algorithm 2): after each wait for a block's S GEMM with the previous P V GEMM still pending
    (``WARPGROUP.DEPBAR.LE gsb0, 0x1``), the softmax's MUFU.EX2 come before the wait for that
    P V GEMM (``gsb0, 0x0``). ptxas moved that wait above the softmax when it shared the softmax's
    basic block (softmax.cuh: OnlineSoftmax::rescale_after). False also when no such wait exists."""
    pending = False
    seen = False
    for wait, mufu in re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)|(MUFU\.EX2)", body):
        if mufu:
            pending = False
        elif int(wait, 16) == 1:
            pending, seen = True, True
        elif pending:  # the P V wait before any exponential of the block
            return False
    return seen


def _exp_runs(body: str, gap: int, least: int) -> tuple[list[str], list[list[int]]]:
    """(the listing's instructions, the exponential phases as lists of their MUFU.EX2 indices): runs of
    at least ``least`` MUFU.EX2 with at most ``gap`` other instructions between neighbours."""
    ins = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", body)]
    mufu = [i for i, t in enumerate(ins) if t.startswith("MUFU.EX2")]
    runs, cur = [], []
    for i in mufu:
        if cur and i - cur[-1] > gap + 1:
            runs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        runs.append(cur)
    return ins, [r for r in runs if len(r) >= least]


def exp_phase_counts(body: str, opcode: str, gap: int = 24, least: int = 16) -> list[tuple[int, int]]:
    """(MUFU.EX2, ``opcode`` instructions) counted from each exponential phase's first exponential to
    its last (phases as :func:`exp_phases`): e.g. the row sums' FADDs, which rowsum_mma (fwd.py) takes
    out of the phase."""
    ins, runs = _exp_runs(body, gap, least)
    return [(len(r), sum(t.startswith(opcode) for t in ins[r[0]:r[-1] + 1])) for r in runs]


def exp_phases(body: str, gap: int = 24, least: int = 16) -> list[tuple[str, str]]:
    """The softmax exponential phases of a forward kernel's SASS, each as (the barrier instruction
    nearest before its first MUFU.EX2, the one nearest after its last): "SYNC+LDS" for a BAR.SYNC
    followed by a shared load before the first exponential, else the opcode ("BAR.SYNC", "BAR.ARV",
    "none"). A phase is a run of at least ``least`` unpredicated MUFU.EX2 with at most ``gap`` other
    instructions between neighbours. With exp_turns (fwd.cu.j2 kExpTurns, pipeline.cuh FencedTurns)
    each turn's phase reads ("SYNC+LDS", "BAR.ARV"): the turn's wait, its fencing load, the
    exponentials, its pass."""
    ins, runs = _exp_runs(body, gap, least)
    out = []
    for r in runs:
        before = next((k for k in range(r[0] - 1, -1, -1) if ins[k].startswith("BAR.")), None)
        after = next((k for k in range(r[-1] + 1, len(ins)) if ins[k].startswith("BAR.")), None)
        if before is None:
            b = "none"
        elif ins[before].startswith("BAR.SYNC") and any(t.startswith("LDS") for t in ins[before:r[0]]):
            b = "SYNC+LDS"
        else:
            b = ins[before].split()[0]
        out.append((b, "none" if after is None else ins[after].split()[0]))
    return out


def schedule(body: str) -> list[tuple[int, str, int]]:
    """The static schedule of a cuobjdump listing: (address, instruction, stall cycles) per
    instruction, where the stall count is the one ptxas encodes in the instruction's control bits
    (bits 41-44 of its second 64-bit word, sm_70 and later: the cycles before the warp may issue its
    next instruction). Variable-latency waits (scoreboards: MUFU results, shuffles, memory,
    barriers) and the other warps are not in it, so a sum of stalls is a lower bound on a path's
    issue time. Used to read where a loop spends its fixed latencies (docs/PERF.md: MUFU.EX2 8 cycles
    apart, FMNMX 2, in the softmax)."""
    out = []
    lines = body.splitlines()
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x[0-9a-f]{16} \*/", line)
        hi = re.match(r"\s*/\* (0x[0-9a-f]{16}) \*/\s*$", lines[i + 1])
        if m and hi:
            out.append((int(m.group(1), 16), m.group(2), (int(hi.group(1), 16) >> 41) & 0xF))
    return out


def opcodes(body: str) -> set[str]:
    """Opcode base names (e.g. HGMMA, UTMALDG) found in a SASS listing."""
    return set(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", body))


def check(fatbin: str, required: dict) -> dict:
    """Check the kernels of a fatbin: ``required`` maps each kernel symbol to the opcodes its SASS
    must contain (the family module's ``KernelSpec.sass``, recorded in the manifest). Returns
    {function: sorted opcode list}; raises AssertionError naming the kernel and what is missing."""
    funcs = functions(dump(fatbin))
    if not funcs:
        raise AssertionError(f"{fatbin}: cuobjdump found no kernels")
    report, problems = {}, []
    for name, need in required.items():
        if name not in funcs:
            problems.append(f"{name}: not in {fatbin} (has {', '.join(funcs)})")
            continue
        ops = opcodes(funcs[name])
        report[name] = sorted(ops)
        missing = [op for op in need if op not in ops]
        if missing:
            slow = " (only HMMA: slow path)" if "HMMA" in ops and "HGMMA" in missing else ""
            problems.append(f"{name}: SASS lacks {', '.join(missing)}{slow}")
    if problems:
        raise AssertionError("; ".join(problems))
    return report


def check_manifest(path: str, jobs: int | None = None) -> dict:
    """Check every kernel of every variant a manifest lists against its recorded ``sass``
    requirement. Returns {symbol: opcodes}, in the manifest's order; AssertionError listing every
    failing kernel. The time is cuobjdump's (about 0.4 s per fatbin), so ``jobs`` of them run at once
    (default: one per CPU; a 16-core machine checks 350 variants in seconds, not minutes)."""
    import json
    import os
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    data = json.loads(Path(path).read_text())

    def one(v):
        try:
            return check(str(Path(path).parent / v["fatbin"]), {k["symbol"]: k["sass"] for k in v["kernels"]}), None
        except AssertionError as e:
            return {}, str(e)

    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        results = list(pool.map(one, data["variants"]))
    report, problems = {}, []
    for found, problem in results:
        report.update(found)
        if problem:
            problems.append(problem)
    if problems:
        raise AssertionError("; ".join(problems))
    return report


def main(argv=None) -> int:
    """``python -m flashgen.generator.sass [build/manifest.json ...]``: exit 1 on any failing kernel."""
    argv = (sys.argv[1:] if argv is None else argv) or ["build/manifest.json"]
    rc = 0
    for path in argv:
        try:
            for name, ops in check_manifest(path).items():
                print(f"ok {name}: {len(ops)} distinct opcodes, "
                      f"{', '.join(o for o in ops if o in ('HGMMA', 'QGMMA', 'UTMALDG', 'USETMAXREG'))}")
        except (AssertionError, ToolchainError, OSError, ValueError, KeyError) as e:
            print(f"FAIL {path}: {e}")
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
