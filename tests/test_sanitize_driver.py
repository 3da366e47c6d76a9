"""scripts/sanitize_driver.py's case selection on the CPU (the cases themselves need a GPU).

SANITIZE_ONLY picks cases by name substring or by family name; a filter that selects no case fails the run, so a
sanitizer pass can never "pass" over nothing (session 2026-12-06 (11): SANITIZE_ONLY=varlen_prep matched no case
name, and memcheck reported 0 errors over 0 cases)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

DRIVER = Path(__file__).resolve().parent.parent / "scripts" / "sanitize_driver.py"


@pytest.fixture
def driver(monkeypatch):
    """The driver module over a fake manifest of families fwd and varlen_prep and cases that record their runs."""
    spec = importlib.util.spec_from_file_location("sanitize_driver_under_test", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ran = []
    case = lambda name: (name, lambda: ran.append(name))  # noqa: E731
    monkeypatch.setattr(mod, "CASES", {
        "fwd": lambda: (case("fwd bf16 d128 causal"), case("fwd varlen bf16 d64")),
        "varlen_prep": lambda: (case("varlen kvcache append rotary halves bf16 d128"),),
    })
    variants = [types.SimpleNamespace(family=f) for f in ("fwd", "varlen_prep")]
    monkeypatch.setattr(mod.flashgen, "load_manifest", lambda: types.SimpleNamespace(variants=variants))
    monkeypatch.setattr(mod.torch.cuda, "synchronize", lambda: None)
    return mod, ran


@pytest.mark.parametrize("only, want", [
    ("", ["fwd bf16 d128 causal", "fwd varlen bf16 d64", "varlen kvcache append rotary halves bf16 d128"]),
    ("varlen", ["fwd varlen bf16 d64", "varlen kvcache append rotary halves bf16 d128"]),  # a name substring
    ("varlen_prep", ["varlen kvcache append rotary halves bf16 d128"]),  # a family's name: its cases
    ("fwd", ["fwd bf16 d128 causal", "fwd varlen bf16 d64"]),
])
def test_sanitize_only_selects_by_name_or_family(driver, monkeypatch, capsys, only, want):
    mod, ran = driver
    monkeypatch.setenv("SANITIZE_ONLY", only)
    assert mod.main() == 0
    assert ran == want
    assert f"sanitize_driver: {len(want)} cases over families fwd, varlen_prep; 0 failures" in capsys.readouterr().out


def test_sanitize_only_that_selects_nothing_fails(driver, monkeypatch, capsys):
    mod, ran = driver
    monkeypatch.setenv("SANITIZE_ONLY", "varlen_prepare")  # (neither a case name's part nor a family)
    assert mod.main() == 1
    assert ran == []
    out = capsys.readouterr().out
    assert "FAIL SANITIZE_ONLY='varlen_prepare': no case's name contains it and no family is named so" in out
