"""Finding nvcc and cuobjdump.

nvcc: ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else ``nvcc`` on PATH, else /usr/local/cuda,
else the PyPI toolkit (``pip install 'flashgen[nvcc]'``: nvidia-cuda-nvcc with nvidia-cuda-crt,
nvidia-nvvm, nvidia-cuda-cccl and nvidia-cuda-runtime, all under site-packages/nvidia/cu13/).
cuobjdump: PATH, then next to nvcc, then the PyPI package nvidia-cuda-cuobjdump
(site-packages/nvidia/cu13/bin/cuobjdump).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .errors import ToolchainError


def _pypi_cuda_roots() -> list[Path]:
    """site-packages/nvidia/cu13 (and cu12) folders of installed NVIDIA PyPI wheels."""
    roots = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations if spec and spec.submodule_search_locations else []):
        for sub in ("cu13", "cu12"):
            p = Path(base) / sub
            if p.is_dir():
                roots.append(p)
    return roots


@dataclass(frozen=True)
class Nvcc:
    path: str
    version: str  # full `nvcc --version` output
    source: str  # how it was found

    @property
    def release(self) -> str:
        """The short version, e.g. '13.0, V13.0.88'."""
        for line in self.version.splitlines():
            if "release" in line:
                return line.split("release", 1)[1].strip()
        return self.version.strip().splitlines()[-1] if self.version.strip() else "?"

    @property
    def cuda_root(self) -> Path:
        return Path(self.path).resolve().parent.parent


def _candidates():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield Path(os.environ[var]) / "bin" / "nvcc", f"${var}"
    w = shutil.which("nvcc")
    if w:
        yield Path(w), "PATH"
    yield Path("/usr/local/cuda/bin/nvcc"), "/usr/local/cuda"
    for root in _pypi_cuda_roots():
        yield root / "bin" / "nvcc", f"PyPI toolkit ({root})"


@functools.lru_cache(maxsize=None)
def _version_of(path: str) -> str:
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise ToolchainError(f"{path} --version failed: {(r.stderr or r.stdout).strip()[:400]}")
    return r.stdout.strip()


def find_nvcc() -> Nvcc:
    """The nvcc to use, with its version. Raises ToolchainError with what was tried."""
    tried = []
    for path, source in _candidates():
        if path.is_file() and os.access(path, os.X_OK):
            return Nvcc(str(path), _version_of(str(path)), source)
        tried.append(f"{path} ({source})")
    raise ToolchainError(
        "nvcc not found; tried: " + "; ".join(tried) + ". Install the CUDA toolkit (12.8+) and set "
        "CUDA_HOME, or `pip install 'flashgen[nvcc]'` for NVIDIA's PyPI toolkit.")


def find_cuobjdump() -> str:
    """Path of cuobjdump. Raises ToolchainError when there is none."""
    w = shutil.which("cuobjdump")
    if w:
        return w
    cands = []
    try:
        cands.append(Path(find_nvcc().path).parent / "cuobjdump")
    except ToolchainError:
        pass
    cands += [root / "bin" / "cuobjdump" for root in _pypi_cuda_roots()]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise ToolchainError("cuobjdump not found (PATH, next to nvcc, or the PyPI package "
                         "nvidia-cuda-cuobjdump: `pip install nvidia-cuda-cuobjdump`)")
