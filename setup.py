"""Build hooks (everything else is in pyproject.toml).

1. Kernels: every non-editable way of making the package (`pip install .`, `pip wheel .`,
   `python -m build`, `make wheel`) runs the generator here, from this source tree, and ships
   the compiled set as flashgen/_kernels/ (manifest.json + fatbin/). The set is
   $FLASHGEN_VARIANTS: `default` (unset), `all`, or name globs (generator/package.py). A missing
   nvcc or a failed variant fails the build: no package without kernels is ever made. Editable
   installs (`pip install -e .`, `make install`) compile nothing here; the runtime reads the
   checkout's build/ (`make build`).
2. The wheel tag: pure Python plus sm_90a fatbins for Linux x86_64 drivers, so
   py3-none-manylinux_2_17_x86_64.
"""
import importlib
import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel  # setuptools >= 70.1
from setuptools.command.build_py import build_py as _build_py

ROOT = Path(__file__).resolve().parent


def _generator():
    """This tree's generator/ (the package flashgen.generator), imported without installing it."""
    name = "_flashgen_generator_src"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "generator" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "generator")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"{name}.package"), sys.modules[name]


class build_py(_build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        package, gen = _generator()
        dest = Path(self.build_lib) / "flashgen" / "_kernels"
        try:
            package.package_kernels(ROOT, dest, log=lambda s: print(s, flush=True))
        except (gen.ConfigError, gen.BuildError, gen.ToolchainError) as e:
            lines = getattr(e, "problems", None) or [f"{n}: {m}" for n, m in getattr(e, "failures", [])] or [str(e)]
            raise SystemExit("flashgen: cannot make a package with its kernels:\n  " + "\n  ".join(lines)
                             + "\n(the package is never made without kernels; fix the above, or choose "
                             "another set with FLASHGEN_VARIANTS)")


class bdist_wheel(_bdist_wheel):
    def get_tag(self):
        # Pure Python plus GPU binaries for Linux x86_64 drivers: any CPython 3, no ABI, but only
        # manylinux x86_64 (the fatbins are sm_90a SASS, loaded by the Linux CUDA driver).
        return "py3", "none", "manylinux_2_17_x86_64"


setup(
    cmdclass={"build_py": build_py, "bdist_wheel": bdist_wheel},
    # keep setuptools' scratch space out of build/, which holds the kernel build outputs
    options={"build": {"build_base": ".whl/setuptools"}},
)
