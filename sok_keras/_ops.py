"""Loads the compiled op library once, with a clear error on a mismatch.

Everything that calls a compiled op goes through `ops()`, which loads
`_sok_ops*.so` on first use. Modules that wrap ops register their
gradients with `register_gradient_once` so that re-importing a module
never raises TensorFlow's "gradient registered twice" KeyError.
"""

import glob
import os
import threading

import tensorflow as tf

_LOCK = threading.Lock()
_LIB = None
_GRADIENTS = set()


def library_path():
    """Returns the path of the compiled op library, or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_sok_ops*.so")))
    return found[0] if found else None


def _check_versions():
    try:
        from sok_keras import _build_info
    except ImportError:
        return  # built by hand; the load below still reports symbols
    if _build_info.TF_VERSION != tf.__version__:
        raise ImportError(
            "sok_keras's op library was built against TensorFlow "
            f"{_build_info.TF_VERSION}, but TensorFlow {tf.__version__} is "
            "installed. Rebuild sok_keras against the installed TensorFlow "
            "(in the sok_keras checkout: `pip install --no-build-isolation "
            "--force-reinstall .`, or `make build`) or install TensorFlow "
            f"{_build_info.TF_VERSION} (`pip install "
            f"tensorflow-cpu=={_build_info.TF_VERSION}`)."
        )


def ops():
    """Returns the loaded op library module (loading it on first call)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    with _LOCK:
        if _LIB is not None:
            return _LIB
        path = library_path()
        if path is None:
            raise ImportError(
                "sok_keras's op library (_sok_ops*.so) is missing. Install "
                "the package with `pip install --no-build-isolation .` or "
                "build it in place with `python setup.py build_ext --inplace`."
            )
        _check_versions()
        try:
            _LIB = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            try:
                from sok_keras import _build_info

                built = _build_info.TF_VERSION
            except ImportError:
                built = "an unknown version"
            raise ImportError(
                f"sok_keras's op library at {path} (built against "
                f"TensorFlow {built}) does not load into TensorFlow "
                f"{tf.__version__}: {e}. Rebuild sok_keras against the "
                "installed TensorFlow."
            ) from None
        return _LIB


def register_gradient_once(op_type):
    """Decorator: `tf.RegisterGradient(op_type)` at most once per process."""

    def decorator(fn):
        if op_type not in _GRADIENTS:
            try:
                tf.RegisterGradient(op_type)(fn)
            except KeyError:
                pass  # registered by an earlier import of this module
            _GRADIENTS.add(op_type)
        return fn

    return decorator


def build_info():
    """What the loaded op library holds.

    Returns:
        A dict: `with_cuda` (whether it has CUDA kernels),
        `gpu_host_syncs` (blocking device-to-host copies its GPU kernels
        have made in this process so far; docs/design.md lists them) and
        `variable_copy_bytes` (bytes the sparse optimizer updates copied
        because a table's or slot's buffer was still shared with an earlier
        read: copy-on-write; 0 in a well-formed training step).
    """
    with_cuda, syncs, copies = ops().sok_build_info()
    return {"with_cuda": bool(with_cuda), "gpu_host_syncs": int(syncs),
            "variable_copy_bytes": int(copies)}


def not_converted(fn):
    """`tf.autograph.experimental.do_not_convert`: sok_keras' entry points
    (lookups, layer calls, optimizer steps) use TensorFlow control flow
    explicitly, so AutoGraph need not rewrite them when a `tf.function`
    (Keras' train step included) calls them. Converting their call tree
    cost about 5-20 CPU-seconds per process at the first trace and made
    every trace slower."""
    return tf.autograph.experimental.do_not_convert(fn)
