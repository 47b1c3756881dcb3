"""Builds libgpupool.so into the wheel (the Python package itself is
declared in pyproject.toml).

The shared library is a plain cdylib with a C ABI, loaded by ctypes: it has
no Python extension module and links no Python or CUDA library (CUDA is
opened at run time). So the wheel is tagged py3-none-<platform>: one wheel
for every Python 3 and every CUDA version.
"""

from setuptools import setup
from setuptools_rust import Binding, RustExtension

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    """A platform wheel (it holds a native library) for any Python 3."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    rust_extensions=[
        RustExtension(
            # Installed as gpupool/_libgpupool<EXT_SUFFIX>; found by
            # gpupool._lib.library_path().
            "gpupool._libgpupool",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            py_limited_api=False,
        )
    ],
    cmdclass={"bdist_wheel": PlatformWheel},
)
