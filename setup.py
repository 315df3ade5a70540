"""Build script: compiles csrc/ into sok_keras's op library.

The library is a TensorFlow custom-op library, so it is compiled with the
compile and link flags of the TensorFlow found at build time, and that
version is recorded in `sok_keras/_build_info.py` so that importing the
package against another TensorFlow fails with a clear message.
"""

import glob
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

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


def _sources(cuda=False):
    files = glob.glob(os.path.join("csrc", "core", "*.cc"))
    files += glob.glob(os.path.join("csrc", "comm", "*.cc"))
    files += glob.glob(os.path.join("csrc", "tf", "*.cc"))
    return sorted(f for f in files if f.endswith(".cu.cc") == cuda)


def _nvcc():
    """The nvcc to build the CUDA kernels with, or None (a CPU-only build).

    `SOK_CUDA=0` forces a CPU-only build; otherwise nvcc is looked for in
    `$CUDA_HOME/bin`, then /usr/local/cuda/bin, then on PATH.
    """
    if os.environ.get("SOK_CUDA", "") == "0":
        return None
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(on_path)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    if os.environ.get("SOK_CUDA", "") == "1":
        raise RuntimeError("SOK_CUDA=1 but no nvcc was found (set CUDA_HOME).")
    return None


def _gencode_flags(nvcc):
    """-gencode for sm_80 and sm_90, and newer architectures nvcc knows
    (`SOK_CUDA_ARCHS`, e.g. "90", builds for the listed ones alone)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True,
                         text=True, check=False).stdout
    known = {int(m) for m in re.findall(r"compute_(\d+)", out)}
    wanted = [a for a in (80, 90, 100, 120) if not known or a in known]
    only = os.environ.get("SOK_CUDA_ARCHS", "").strip()
    if only:  # e.g. "90" or "80,90": a faster build for those GPUs alone
        wanted = sorted({int(a) for a in only.split(",") if a.strip()})
    flags = []
    for arch in wanted:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    newest = wanted[-1]  # PTX of the newest for GPUs newer than all of these
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def _sources_module():
    """`sok_keras/_sources.py` (loaded by path: importing the package would
    load the library being built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_sok_sources", os.path.join(HERE, "sok_keras", "_sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _csrc_files():
    """Every file of csrc/ a build reads: the extension depends on them
    all (headers, CUDA sources), not only on its C++ sources."""
    return sorted(_sources_module().files(HERE))


class BuildTfOps(build_ext):
    """Adds TensorFlow's flags and compiles the sources in parallel.

    A build in a folder that holds an earlier one (`build/`, which `pip
    install .` leaves in the checkout) recompiles everything when what
    the objects were compiled for changed: the TensorFlow version, its
    flags, the CUDA compiler and targets (`_stamp`); distutils alone
    looked at the sources' times only, and relabelled the old library
    with the new TensorFlow's version.
    """

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = max(1, os.cpu_count() or 1)

    def _stamp(self, key):
        """Writes `key` (what the objects are compiled for) to a file in
        the build folder when it differs from the last build's, and then
        forces every object to be compiled again; returns the file, on
        which the extension and the CUDA objects depend."""
        import json

        os.makedirs(self.build_temp, exist_ok=True)
        path = os.path.join(self.build_temp, "sok_build_key.json")
        text = json.dumps(key, sort_keys=True)
        try:
            with open(path) as f:
                same = f.read() == text
        except OSError:
            same = False
        if not same:
            with open(path, "w") as f:
                f.write(text)
            self.force = True
        return path

    def _build_cuda(self, nvcc, abi_flags, gencode, depends):
        """Compiles csrc/**/*.cu.cc with nvcc (each also depending on
        `depends`: the headers and the stamp); returns the object files."""
        cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        jobs = []
        for src in _sources(cuda=True):
            obj = os.path.join(out_dir, src.replace(os.sep, "_") + ".o")
            deps = [src] + depends
            fresh = not self.force and os.path.exists(obj) and all(
                os.path.getmtime(obj) >= os.path.getmtime(d) for d in deps)
            cmd = [nvcc, "-x", "cu", "-std=c++17", "-O3", "-c", src, "-o", obj,
                   "-I", os.path.join(HERE, "csrc"), "-DSOK_WITH_CUDA=1",
                   "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
                   "-Xcompiler", "-fvisibility=hidden"] + abi_flags + gencode
            jobs.append((os.path.getsize(src), obj, None if fresh else cmd))

        def run(cmd):
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)

        # Queued on the shared pool (biggest first), where the C++ sources
        # join them (`_compile_in_pool`): both compilers keep every core
        # busy, and the link waits for all.
        jobs.sort(reverse=True)
        self._cuda_futures = [self._pool.submit(run, cmd)
                              for _, _, cmd in jobs if cmd is not None]
        objects = [obj for _, obj, _ in jobs]
        lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib")]
        lib_dirs += glob.glob(os.path.join(cuda_home, "targets", "*", "lib"))
        lib_dirs = [d for d in lib_dirs
                    if os.path.exists(os.path.join(d, "libcudart_static.a"))]
        if not lib_dirs:
            raise RuntimeError(f"no libcudart_static.a under {cuda_home}")
        return objects, ["-L" + lib_dirs[0], "-l:libcudart_static.a", "-ldl",
                         "-lrt", "-lpthread"]

    def _compile_in_pool(self, sources, output_dir=None, macros=None,
                         include_dirs=None, debug=0, extra_preargs=None,
                         extra_postargs=None, depends=None):
        """`CCompiler.compile`, each source on the shared pool (distutils
        compiles an extension's sources one by one); returns when they and
        the CUDA objects are built."""
        compiler = self.compiler
        macros, objects, extra_postargs, pp_opts, build = (
            compiler._setup_compile(output_dir, macros, include_dirs,
                                    sources, depends, extra_postargs))
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        futures = [
            self._pool.submit(compiler._compile, obj, build[obj][0],
                              build[obj][1], cc_args, extra_postargs,
                              pp_opts)
            for obj in objects if obj in build]
        for f in futures + self._cuda_futures:
            f.result()
        return objects

    def build_extensions(self):
        self._pool = ThreadPoolExecutor(max(1, os.cpu_count() or 1))
        self._cuda_futures = []
        self.compiler.compile = self._compile_in_pool
        try:
            self._build_extensions()
        finally:
            self._pool.shutdown(wait=True)

    def _build_extensions(self):
        tf = _tf()
        cflags = list(tf.sysconfig.get_compile_flags())
        lflags = list(tf.sysconfig.get_link_flags())
        nvcc = _nvcc()
        gencode = _gencode_flags(nvcc) if nvcc is not None else None
        stamp = self._stamp({
            "tensorflow": tf.__version__, "cflags": cflags,
            "lflags": lflags, "nvcc": nvcc and os.path.realpath(nvcc),
            "gencode": gencode})
        csrc = _csrc_files()
        cuda_objects, cuda_libs = [], []
        if nvcc is not None:
            abi = [f for f in cflags if f.startswith("-D_GLIBCXX_USE_CXX11_ABI")]
            headers = [f for f in csrc if f.endswith((".h", ".cuh"))]
            cuda_objects, cuda_libs = self._build_cuda(
                nvcc, abi, gencode, headers + [stamp])
            cflags.append("-DSOK_WITH_CUDA=1")
        for ext in self.extensions:
            # Any header or CUDA source newer than the library, or another
            # TensorFlow (the stamp), rebuilds it.
            ext.depends = csrc + [stamp]
            if ext.name == "sok_keras._sok_bind_guard":
                ext.extra_compile_args = ["-O2", "-g0", "-fPIC",
                                          "-fvisibility=hidden"]
                ext.extra_link_args = ["-g0", "-ldl"]
                continue
            ext.extra_objects = list(cuda_objects)
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
            ext.extra_link_args = lflags + cuda_libs + [
                "-g0", "-Wl,--no-undefined"]
        # Drop -Wstrict-prototypes etc. that distutils adds for C.
        for flag in ("-Wstrict-prototypes",):
            if flag in self.compiler.compiler_so:
                self.compiler.compiler_so.remove(flag)
        super().build_extensions()
        library = os.path.basename(self.get_ext_filename("sok_keras._sok_ops"))
        text = ("# Written by setup.py when the op library was built.\n"
                f"TF_VERSION = {tf.__version__!r}\n"
                f"TF_CXX11_ABI = {tf.sysconfig.CXX11_ABI_FLAG!r}\n"
                f"WITH_CUDA = {nvcc is not None!r}\n"
                f"SOURCES_SHA256 = {_sources_module().digest(HERE)!r}\n"
                f"LIBRARY = {library!r}\n")
        # Beside the library it describes: the build's, and the checkout's
        # only for a build in place (an editable install, `--inplace`), not
        # for a wheel or a build elsewhere (QA: they rewrote the info of
        # the checkout's own library).
        folders = [os.path.join(self.build_lib, "sok_keras")]
        if self._sok_in_place:
            folders.append(os.path.join(HERE, "sok_keras"))
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            info = os.path.join(folder, "_build_info.py")
            with open(info + ".tmp", "w") as f:
                f.write(text)
            os.replace(info + ".tmp", info)

    def run(self):
        # (setuptools' `run` clears `inplace` while it builds, and copies
        # the library into the checkout afterwards.)
        self._sok_in_place = bool(self.inplace)
        super().run()

    def get_export_symbols(self, ext):
        return []  # a TF op library, not a Python extension module


setup(
    ext_modules=[
        Extension(
            "sok_keras._sok_ops",
            sources=_sources(),
            include_dirs=[os.path.join(HERE, "csrc")],
            language="c++",
        ),
        # LD_PRELOADed into ranks: keeps TensorFlow's gRPC servers off the
        # wildcard address (see csrc/runtime/bind_guard.c).
        Extension(
            "sok_keras._sok_bind_guard",
            sources=[os.path.join("csrc", "runtime", "bind_guard.c")],
            language="c",
        ),
    ],
    cmdclass={"build_ext": BuildTfOps},
)
