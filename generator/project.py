"""Locating the project: the folder that holds configs/ and templates/.

Order: ``$FLASHGEN_ROOT``; else the first folder, walking up from the current directory, that has
both configs/ and templates/; else the folder above this package's own location (an editable
install or a source checkout). Outputs go to ``<root>/build`` unless ``$FLASHGEN_BUILD_DIR`` is set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _is_root(path: Path) -> bool:
    return (path / "configs").is_dir() and (path / "templates").is_dir()


def find_root(cwd: str | os.PathLike | None = None) -> Path | None:
    """Return the project root, or None when there is none (e.g. an installed wheel)."""
    env = os.environ.get("FLASHGEN_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(cwd or os.getcwd()).resolve()
    for cand in (here, *here.parents):
        if _is_root(cand):
            return cand
    pkg_parent = Path(__file__).resolve().parent.parent
    if _is_root(pkg_parent):
        return pkg_parent
    return None


@dataclass(frozen=True)
class Project:
    root: Path
    build_override: Path | None = None  # build outputs here instead of $FLASHGEN_BUILD_DIR / <root>/build

    @classmethod
    def locate(cls, cwd=None) -> "Project":
        root = find_root(cwd)
        if root is None:
            from .errors import ConfigError

            raise ConfigError([
                "no flashgen project found: set FLASHGEN_ROOT or run inside a checkout "
                "(a folder with configs/ and templates/)"
            ])
        return cls(root)

    @property
    def configs_dir(self) -> Path:
        return self.root / "configs"

    @property
    def templates_dir(self) -> Path:
        return self.root / "templates"

    @property
    def include_dir(self) -> Path:
        return self.root / "templates" / "include"

    @property
    def build_dir(self) -> Path:
        if self.build_override is not None:
            return Path(self.build_override)
        env = os.environ.get("FLASHGEN_BUILD_DIR")
        return Path(env).resolve() if env else self.root / "build"

    @property
    def src_dir(self) -> Path:
        return self.build_dir / "src"

    @property
    def fatbin_dir(self) -> Path:
        return self.build_dir / "fatbin"

    @property
    def cache_dir(self) -> Path:
        return self.build_dir / "cache"

    @property
    def manifest_path(self) -> Path:
        return self.build_dir / "manifest.json"

    def rel(self, path: Path) -> str:
        """Path relative to the root where possible (for messages)."""
        try:
            return str(Path(path).resolve().relative_to(self.root))
        except ValueError:
            return str(path)
