"""Only here to tag the wheel: flashgen ships sm_90a fatbins (Linux x86_64 drivers load them) and
pure Python, no host-compiled code. The tag is py3-none-manylinux_2_17_x86_64."""
from setuptools import setup

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # older setuptools: the `wheel` package provides it
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel


class bdist_wheel(_bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False  # platform wheel: it carries GPU binaries for Linux x86_64

    def get_tag(self):
        return "py3", "none", "manylinux_2_17_x86_64"


setup(
    cmdclass={"bdist_wheel": bdist_wheel},
    # keep setuptools' scratch space out of build/, which holds the kernel build outputs
    options={"build": {"build_base": ".whl/setuptools"}},
)
