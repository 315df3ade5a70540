"""Build script: compiles csrc/ into sok_keras's op library.

The library is a TensorFlow custom-op library, so it is compiled with the
compile and link flags of the TensorFlow found at build time, and that
version is recorded in `sok_keras/_build_info.py` so that importing the
package against another TensorFlow fails with a clear message.
"""

import glob
import os

from setuptools import Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _tf():
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - build-time message
        raise RuntimeError(
            "Building sok_keras needs TensorFlow installed in the build "
            "environment (pip install tensorflow-cpu~=2.21.0, then "
            "pip install --no-build-isolation .)."
        ) from e
    return tf


def _sources():
    files = glob.glob(os.path.join("csrc", "core", "*.cc"))
    files += glob.glob(os.path.join("csrc", "comm", "*.cc"))
    files += glob.glob(os.path.join("csrc", "tf", "*.cc"))
    return sorted(f for f in files if not f.endswith(".cu.cc"))


class BuildTfOps(build_ext):
    """Adds TensorFlow's flags and compiles the sources in parallel."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = max(1, os.cpu_count() or 1)

    def build_extensions(self):
        tf = _tf()
        cflags = list(tf.sysconfig.get_compile_flags())
        lflags = list(tf.sysconfig.get_link_flags())
        for ext in self.extensions:
            ext.extra_compile_args = cflags + [
                "-O3",
                "-g0",
                "-fPIC",
                "-fvisibility=hidden",
                "-Wno-deprecated-declarations",
                "-Wno-sign-compare",
                "-Wno-interference-size",
                f'-DSOK_TF_VERSION="{tf.__version__}"',
            ]
            ext.extra_link_args = lflags + ["-g0", "-Wl,--no-undefined"]
        # Drop -Wstrict-prototypes etc. that distutils adds for C.
        for flag in ("-Wstrict-prototypes",):
            if flag in self.compiler.compiler_so:
                self.compiler.compiler_so.remove(flag)
        super().build_extensions()
        info = os.path.join(HERE, "sok_keras", "_build_info.py")
        with open(info + ".tmp", "w") as f:
            f.write(
                "# Written by setup.py when the op library was built.\n"
                f"TF_VERSION = {tf.__version__!r}\n"
                f"TF_CXX11_ABI = {tf.sysconfig.CXX11_ABI_FLAG!r}\n"
            )
        os.replace(info + ".tmp", info)
        if not self.inplace:
            target = os.path.join(self.build_lib, "sok_keras", "_build_info.py")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(info) as src, open(target, "w") as dst:
                dst.write(src.read())

    def get_export_symbols(self, ext):
        return []  # a TF op library, not a Python extension module


setup(
    ext_modules=[
        Extension(
            "sok_keras._sok_ops",
            sources=_sources(),
            include_dirs=[os.path.join(HERE, "csrc")],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildTfOps},
)
