"""Parsing ``ptxas -v`` output (with ``nvcc -fatbin`` it arrives on stderr) and judging it.

A build fails on any spill byte and on the ptxas advisories that mean a slow Hopper kernel:
C7511/C7512/C7515/C7517/C7519, and any other advisory saying that wgmma.mma_async instructions
are serialized (C7512: "due to insufficient register resources", which a bwd tile at head_dim 256
hit unnoticed), and C7508 (setmaxnreg ignored).
"""
from __future__ import annotations

import re

BAD_CODES = {
    "C7508": "setmaxnreg ignored",
    "C7511": "wgmma serialized",
    "C7512": "wgmma serialized (insufficient register resources)",
    "C7515": "wgmma serialized",
    "C7517": "wgmma serialized",
    "C7519": "wgmma serialized",
}

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARS = re.compile(r"used (\d+) barriers")
_CODE = re.compile(r"\((C\d{4})\)")
_SERIALIZED = "wgmma.mma_async instructions are serialized"


def parse(text: str) -> dict:
    """``{"functions": {name: {...}}, "registers", "spill_bytes", "stack_bytes", "advisories",
    "bad_advisories"}`` from ptxas -v text. Totals: max registers over entries, spill stores +
    loads and stack frames summed over every function listed."""
    funcs: dict[str, dict] = {}
    entries: list[str] = []
    current = None
    advisories, bad = [], []
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            entries.append(current)
            funcs.setdefault(current, {})["entry"] = True
            continue
        if m := _PROPS.search(line):
            current = m.group(1)
            funcs.setdefault(current, {}).setdefault("entry", current in entries)
            continue
        if m := _FRAME.search(line):
            if current is not None:
                f = funcs.setdefault(current, {})
                f["stack_bytes"], f["spill_store_bytes"], f["spill_load_bytes"] = map(int, m.groups())
            continue
        if m := _USED.search(line):
            if current is not None:
                f = funcs.setdefault(current, {})
                f["registers"] = int(m.group(1))
                if s := _SMEM.search(line):
                    f["static_smem_bytes"] = int(s.group(1))
                if b := _BARS.search(line):
                    f["barriers"] = int(b.group(1))
            continue
        if ("ptxas" in line and ("warning" in line or "(C" in line)) or _CODE.search(line):
            advisories.append(line.strip())
            if (c := _CODE.search(line)) and (c.group(1) in BAD_CODES or _SERIALIZED in line):
                bad.append(line.strip())
    regs = [f.get("registers", 0) for n, f in funcs.items() if f.get("entry")]
    return {
        "functions": funcs,
        "entries": entries,
        "registers": max(regs) if regs else 0,
        "spill_bytes": sum(f.get("spill_store_bytes", 0) + f.get("spill_load_bytes", 0) for f in funcs.values()),
        "stack_bytes": sum(f.get("stack_bytes", 0) for f in funcs.values()),
        "advisories": advisories,
        "bad_advisories": bad,
    }


def problems(report: dict, symbol: str | None = None) -> list[str]:
    """Why this ptxas report fails the build (empty list: it passes)."""
    out = []
    if symbol is not None and symbol not in report["entries"]:
        out.append(f"entry function {symbol} not found in the ptxas report (entries: {report['entries'] or 'none'})")
    if report["spill_bytes"]:
        detail = ", ".join(f"{n}: {f.get('spill_store_bytes', 0)} B stores / {f.get('spill_load_bytes', 0)} B loads"
                           for n, f in report["functions"].items()
                           if f.get("spill_store_bytes") or f.get("spill_load_bytes"))
        out.append(f"register spills ({report['spill_bytes']} bytes: {detail})")
    for line in report["bad_advisories"]:
        code = _CODE.search(line).group(1)
        out.append(f"ptxas {code} ({BAD_CODES.get(code, 'wgmma serialized')}): {line}")
    return out
