"""flashgen.generator: YAML configs -> validated variants -> rendered CUDA -> cached nvcc fatbins -> manifest.

Public entry points (the CLI in flashgen.cli uses these):

- :func:`flashgen.generator.project.find_root` / :class:`Project` -- where configs/, templates/, build/ are
- :func:`flashgen.generator.config.load_variants` -- validate every config file, expand to variants
- :func:`flashgen.generator.feasibility.fwd_resources` -- threads, shared memory, register split
- :func:`flashgen.generator.build.build` -- render, compile (content-addressed cache), write the manifest
- :mod:`flashgen.generator.sass` -- cuobjdump-based SASS checks
"""
from .errors import ConfigError, BuildError, ToolchainError  # noqa: F401
