"""flashgen.generator: YAML configs -> validated variants -> rendered CUDA -> cached nvcc fatbins -> manifest.

Public entry points (the CLI in flashgen.cli uses these):

- :func:`flashgen.generator.project.find_root` / :class:`Project` -- where configs/, templates/, build/ are
- :func:`flashgen.generator.config.load_variants` -- validate every config file, expand to variants
- :mod:`flashgen.generator.families` -- one module per kernel family (keys, feasibility, resources, kernels, dispatch key)
- :mod:`flashgen.generator.abi` -- params structs: one schema rendered into C++ and recorded in the manifest
- :func:`flashgen.generator.build.build` -- render, compile (content-addressed cache), write the manifest
- :mod:`flashgen.generator.sass` -- cuobjdump-based SASS checks
"""
from .errors import ConfigError, BuildError, ToolchainError, TuneTableWarning  # noqa: F401
