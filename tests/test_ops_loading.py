"""Loading the op library: version check, gradients registered once."""

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

    assert _build_info.TF_VERSION == tf.__version__
    _ops._check_versions()


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
