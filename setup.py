"""Only here to tag the wheel: flashgen ships sm_90a fatbins (Linux x86_64 drivers load them) and
pure Python, no host-compiled code. The tag is py3-none-manylinux_2_17_x86_64."""
from setuptools import setup

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # older setuptools: the `wheel` package provides it
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel


class bdist_wheel(_bdist_wheel):
    def get_tag(self):
        # Pure Python plus GPU binaries for Linux x86_64 drivers: any CPython 3, no ABI, but only
        # manylinux x86_64 (the fatbins are sm_90a SASS, loaded by the Linux CUDA driver).
        return "py3", "none", "manylinux_2_17_x86_64"


setup(
    cmdclass={"bdist_wheel": bdist_wheel},
    # keep setuptools' scratch space out of build/, which holds the kernel build outputs
    options={"build": {"build_base": ".whl/setuptools"}},
)
