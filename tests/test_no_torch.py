"""flashgen without torch (torch is the optional extra ``flashgen[torch]``).

Each test runs a fresh interpreter in which torch cannot be imported -- as if it were not
installed (a meta path finder refusing it, the "No module named 'torch'" error pip users
see), or blocked with ``sys.modules['torch'] = None`` -- and checks that:

* the torch API (``from flashgen import flash_attn_func``, ``flashgen.flash_attn_combine``,
  ``import flashgen.interface``) raises an ImportError that says how to get torch
  (``pip install flashgen[torch]``) and names the DLPack API that works without it, with the
  original ModuleNotFoundError chained as its cause;
* ``import flashgen`` and the DLPack API (``flashgen.flash_attn_forward``,
  ``flashgen.flash_attn_combine_dlpack``) keep working, up to their argument checks;
* a torch that is installed but broken keeps its own error (no misleading install hint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: Preludes that make torch unimportable in the child interpreter.
NO_TORCH = {
    "not-installed": textwrap.dedent("""\
        import importlib.abc, sys

        class _NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, _NoTorch())
        """),
    "blocked": "import sys\nsys.modules['torch'] = None\n",
}

#: Child code: each way of reaching the torch API, reported as JSON.
_ATTEMPTS = textwrap.dedent("""\
    import json

    def attempt(code):
        try:
            exec(code, {})
        except BaseException as e:
            cause = e.__cause__
            return {"type": type(e).__name__, "msg": str(e),
                    "cause": type(cause).__name__ if cause else None, "cause_name": getattr(cause, "name", None)}
        return {"type": None}

    print(json.dumps({
        "from flashgen import flash_attn_func": attempt("from flashgen import flash_attn_func"),
        "flashgen.flash_attn_combine": attempt("import flashgen; flashgen.flash_attn_combine"),
        "flashgen.flash_attn_func": attempt("import flashgen; flashgen.flash_attn_func"),
        "import flashgen.interface": attempt("import flashgen.interface"),
    }))
    """)


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("how", sorted(NO_TORCH))
def test_torch_api_without_torch_says_how_to_install_it(how):
    r = _run(NO_TORCH[how] + _ATTEMPTS)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    for what, res in results.items():
        assert res["type"] == "ImportError", (what, res)  # not a raw ModuleNotFoundError
        assert "pip install flashgen[torch]" in res["msg"], (what, res["msg"])
        assert "flashgen.flash_attn_forward" in res["msg"] and "flashgen.flash_attn_combine_dlpack" in res["msg"]
        assert res["cause"] == "ModuleNotFoundError" and res["cause_name"] == "torch", (what, res)


@pytest.mark.parametrize("how", sorted(NO_TORCH))
def test_package_and_dlpack_api_work_without_torch(how):
    pytest.importorskip("numpy")
    code = NO_TORCH[how] + textwrap.dedent("""\
        import numpy as np
        import flashgen

        assert callable(flashgen.flash_attn_forward) and callable(flashgen.flash_attn_combine_dlpack)
        assert issubclass(flashgen.InputError, ValueError) and issubclass(flashgen.InputError, TypeError)
        q = np.zeros((1, 4, 2, 64), np.float16)  # host memory: refused by the checks, before any GPU work
        try:
            flashgen.flash_attn_forward(q, q, q)
        except ValueError as e:
            assert "q must be a CUDA tensor/array" in str(e), e
        else:
            raise AssertionError("host arrays were accepted")
        try:
            flashgen.flash_attn_combine_dlpack(np.zeros((2, 1, 4, 2, 64), np.float32), np.zeros((2, 1, 4, 2), np.float32))
        except ValueError as e:
            assert "out_partial must be a CUDA tensor/array" in str(e), e
        else:
            raise AssertionError("host arrays were accepted")
        assert sys.modules.get("torch") is None, "flashgen imported torch"
        print("ok")
        """)
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_broken_torch_keeps_its_own_error(tmp_path):
    """A torch that is there but fails to import (a missing dependency of its own) is not
    reported as "not installed": its error comes through unchanged."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import flashgen_test_missing_dependency_of_torch\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = _run(_ATTEMPTS, env=env)
    assert r.returncode == 0, r.stderr
    for what, res in json.loads(r.stdout).items():
        assert res["type"] == "ModuleNotFoundError", (what, res)
        assert "flashgen_test_missing_dependency_of_torch" in res["msg"] and "pip install" not in res["msg"]
