"""Loading the op library: version check, gradients registered once."""

import importlib
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


def test_matching_build_info_passes():
    from sok_keras import _build_info

    assert _build_info.TF_VERSION == tf.__version__
    _ops._check_versions()


def test_reimporting_wrappers_does_not_register_gradients_twice():
    import sok_keras.lookup_ops as lookup_ops

    importlib.reload(lookup_ops)
    importlib.reload(lookup_ops)
    assert _ops.ops() is _ops.ops()  # loaded once
