"""Exceptions of the generator. The CLI turns each into a clean message and an exit status."""


class ConfigError(Exception):
    """One or more problems in the config files. ``problems`` holds one line per problem
    (file, key, value, what is allowed); the CLI prints them and exits with status 2."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ToolchainError(Exception):
    """nvcc (or cuobjdump) could not be found or run."""


class BuildError(Exception):
    """One or more variants failed to compile or failed a post-compile check."""

    def __init__(self, failures):
        self.failures = list(failures)  # [(variant name, message)]
        super().__init__("\n".join(f"{n}: {m}" for n, m in self.failures))


class TuneTableWarning(UserWarning):
    """A tune table (configs/tune/*.yaml) the default build set cannot fully follow: the table is
    invalid, or it names a tile no config makes (generator/config.py, "The default build set")."""
