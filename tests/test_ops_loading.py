"""Loading the op library: version check, gradients registered once."""

import glob
import importlib
import os
import sys
import types

import pytest
import tensorflow as tf

from sok_keras import _ops


def test_library_built_for_another_tensorflow_gives_clear_import_error(
        monkeypatch):
    fake = types.ModuleType("sok_keras._build_info")
    fake.TF_VERSION = "2.99.0"
    monkeypatch.setitem(sys.modules, "sok_keras._build_info", fake)
    monkeypatch.setattr(sys.modules["sok_keras"], "_build_info", fake,
                        raising=False)
    with pytest.raises(ImportError) as info:
        _ops._check_versions()
    message = str(info.value)
    assert "2.99.0" in message and tf.__version__ in message
    # The distribution that is installed (QA: tensorflow-cpu was advised
    # to users of tensorflow, two distributions of one module).
    assert f"pip install {_ops._tensorflow_distribution()}==2.99.0" in (
        message)
    # Another patch release of the same minor one loads (QA: pip's build
    # isolation builds against the newest 2.21.x, whatever is installed).
    major, minor = tf.__version__.split(".")[:2]
    fake.TF_VERSION = f"{major}.{minor}.99"
    _ops._check_versions()


def test_a_missing_library_says_where_it_looked(monkeypatch, tmp_path):
    """QA: in a checkout, after a non-editable install, Python imports the
    checkout's sok_keras (no library) and the error advised the install
    just made. It names the folder, and for a checkout how to build it in
    place or to run from elsewhere."""
    monkeypatch.setattr(_ops, "library_path", lambda: None)
    monkeypatch.setattr(_ops, "_LIB", None)
    checkout = tmp_path / "checkout"
    (checkout / "sok_keras").mkdir(parents=True)
    (checkout / "setup.py").write_text("")
    for here, says in ((checkout / "sok_keras", "source checkout"),
                       (tmp_path / "site" / "sok_keras", "Reinstall")):
        monkeypatch.setattr(_ops, "_HERE", str(here))
        with pytest.raises(ImportError, match=says) as info:
            _ops.ops()
        assert str(here) in str(info.value)


def test_matching_build_info_passes():
    from sok_keras import _build_info
    from sok_keras import _sources

    assert _build_info.TF_VERSION == tf.__version__
    # The build recorded the digest of the sources it was built from.
    root = os.path.dirname(os.path.dirname(os.path.abspath(_ops.__file__)))
    assert _build_info.SOURCES_SHA256 == _sources.digest(root)
    _ops._check_versions()


def test_a_library_built_from_other_sources_gives_clear_import_error(
        monkeypatch, tmp_path):
    """QA: after a `git pull` over an editable install, the old library
    loaded and the first training step failed on "module '1bfc...' has no
    attribute 'sok_sparse_apply_nadam'". A checkout whose csrc/ changed
    since the build is named at import; an op the library lacks is named
    as one."""
    fake = types.ModuleType("sok_keras._build_info")
    fake.TF_VERSION = tf.__version__
    fake.SOURCES_SHA256 = "0" * 64
    monkeypatch.setitem(sys.modules, "sok_keras._build_info", fake)
    monkeypatch.setattr(sys.modules["sok_keras"], "_build_info", fake,
                        raising=False)
    with pytest.raises(ImportError, match=r"built from other sources than "
                       r"this checkout's csrc/.*make build"):
        _ops._check_versions()
    # An installed package (no csrc/ beside it) has nothing to compare.
    monkeypatch.setattr(_ops, "_HERE", str(tmp_path / "site" / "sok_keras"))
    _ops._check_versions()
    with pytest.raises(AttributeError, match=r"has no op 'sok_no_such_op': "
                       r"it was built from other sources.*Rebuild"):
        _ops.ops().sok_no_such_op
    assert _ops.ops().sok_build_info is _ops.ops().sok_build_info
    import copy

    copy.copy(_ops.ops())  # (review: a RecursionError)


def test_the_sources_digest_skips_what_the_build_does_not_read(
        tmp_path, monkeypatch):
    """Review: an editor's lock file in csrc/ (`.#lookup.cc`, a dangling
    link) made `import sok_keras` fail with a FileNotFoundError. The
    digest reads what setup.py's build reads; info that describes another
    Python's library is not compared."""
    from sok_keras import _sources

    core = tmp_path / "csrc" / "core"
    core.mkdir(parents=True)
    (core / "lookup.cc").write_text("int x;\n")
    before = _sources.digest(str(tmp_path))
    os.symlink(str(tmp_path / "nowhere"), str(core / ".#lookup.cc"))
    (core / "notes.txt").write_text("")
    assert _sources.digest(str(tmp_path)) == before
    (core / "lookup.cc").write_text("int y;\n")
    assert _sources.digest(str(tmp_path)) != before
    # Another Python's library is described: nothing to compare.
    _ops._check_sources("0" * 64, "_sok_ops.cpython-300-x86_64-linux-gnu.so")
    with pytest.raises(ImportError, match="other sources"):
        _ops._check_sources("0" * 64, os.path.basename(_ops.library_path()))


def test_the_library_built_for_this_python_is_loaded(tmp_path):
    """QA: a checkout built for two Pythons loaded the first name in order
    (cpython-310's under 3.11); sokrun's bind guard likewise."""
    import importlib.machinery

    from sok_keras import _sources

    ours = tmp_path / ("_sok_ops" + importlib.machinery.EXTENSION_SUFFIXES[0])
    other = tmp_path / "_sok_ops.cpython-300-x86_64-linux-gnu.so"
    assert _sources.built_library(str(tmp_path), "_sok_ops") is None
    other.write_text("")
    assert _sources.built_library(str(tmp_path), "_sok_ops") == str(other)
    ours.write_text("")
    assert _sources.built_library(str(tmp_path), "_sok_ops") == str(ours)
    # This checkout: its build for this Python where it has one (the GPU
    # machine runs Python 3.12 on a library built here under 3.11, which
    # TensorFlow loads alike: the name's tag is not its ABI).
    here = os.path.dirname(_ops.library_path())
    own = os.path.join(here,
                       "_sok_ops" + importlib.machinery.EXTENSION_SUFFIXES[0])
    builds = sorted(glob.glob(os.path.join(here, "_sok_ops*.so")))
    assert _ops.library_path() == (own if os.path.exists(own) else builds[0])


def test_reimporting_wrappers_does_not_register_gradients_twice():
    import sok_keras.lookup_ops as lookup_ops

    importlib.reload(lookup_ops)
    importlib.reload(lookup_ops)
    assert _ops.ops() is _ops.ops()  # loaded once


# Host-side bookkeeping ops that never touch a table: they run on the CPU
# whatever the device (their inputs and outputs are scalars and strings).
HOST_ONLY_OPS = {"SokBuildInfo", "SokInflightSnapshot", "SokNcclUniqueId",
                 "SokNcclHealth", "SokNcclAbort"}


def test_every_op_has_a_gpu_kernel_when_built_with_cuda():
    from tensorflow.python.framework import kernels

    from sok_keras import _ops

    if not _ops.build_info()["with_cuda"]:
        pytest.skip("op library built without CUDA (no nvcc at build time)")
    import glob
    import re

    csrc = os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "csrc")
    names = set()
    for path in glob.glob(os.path.join(csrc, "tf", "*.cc")):
        with open(path) as f:
            names |= set(re.findall(r'REGISTER_OP\("(\w+)"\)', f.read()))
    assert len(names) >= 25, names
    missing = []
    for name in names:
        devices = {k.device_type
                   for k in kernels.get_registered_kernels_for_op(name).kernel}
        if not name.startswith("SokNccl"):  # NCCL needs a GPU
            assert "CPU" in devices, name
        if name not in HOST_ONLY_OPS and "GPU" not in devices:
            missing.append(name)
    assert not missing, f"ops without a GPU kernel: {missing}"


def test_missing_tensorflow_names_the_extras():
    """`pip install .` installs no TensorFlow (it comes from an extra):
    importing sok_keras then says how to get it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "try:\n    import sok_keras\n"
            "except ImportError as e:\n    print(e)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=repo,
                         capture_output=True, text=True, timeout=60).stdout
    assert "'.[cpu]'" in out and "'.[gpu]'" in out, out
    assert "tensorflow-cpu~=2.21.0" in out, out
