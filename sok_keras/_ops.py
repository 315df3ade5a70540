"""Loads the compiled op library once, with a clear error on a mismatch.

Everything that calls a compiled op goes through `ops()`, which loads
`_sok_ops*.so` on first use. Modules that wrap ops register their
gradients with `register_gradient_once` so that re-importing a module
never raises TensorFlow's "gradient registered twice" KeyError.
"""

import os
import threading

import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()
_LIB = None
_GRADIENTS = set()


def library_path():
    """Returns the path of the compiled op library, or None: the one built
    for this Python (`_sources.built_library`)."""
    from sok_keras import _sources

    return _sources.built_library(_HERE, "_sok_ops")


def _minor_release(version):
    """'2.21.0' -> (2, 21): TensorFlow keeps a custom op library's ABI
    within a minor release (extension packages pin major.minor alone)."""
    return tuple(version.split("+")[0].split(".")[:2])


def _tensorflow_distribution():
    """The pip distribution that installed TensorFlow: its name is the one
    to reinstall (`tensorflow-cpu` and `tensorflow` provide one module)."""
    from importlib import metadata

    for name in ("tensorflow-cpu", "tensorflow", "tf-nightly"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return "tensorflow"


def _rebuild_advice():
    return ("Rebuild sok_keras against the installed TensorFlow (in the "
            "sok_keras checkout: `pip install --no-build-isolation "
            "--force-reinstall --no-deps .`, or `make build`)")


def _check_versions():
    try:
        from sok_keras import _build_info
    except ImportError:
        return  # built by hand; the load below still reports symbols
    _check_sources(getattr(_build_info, "SOURCES_SHA256", None),
                   getattr(_build_info, "LIBRARY", None))
    if (_minor_release(_build_info.TF_VERSION)
            != _minor_release(tf.__version__)):
        raise ImportError(
            "sok_keras's op library was built against TensorFlow "
            f"{_build_info.TF_VERSION}, but TensorFlow {tf.__version__} is "
            f"installed. {_rebuild_advice()} or install TensorFlow "
            f"{_build_info.TF_VERSION} (`pip install "
            f"{_tensorflow_distribution()}=={_build_info.TF_VERSION}`)."
        )


def _check_sources(built, library):
    """In a source checkout, the library must be built from its csrc/ as
    it is now (`built`: the digest the build recorded, for `library`; None
    from a build before it did). (QA: after a `git pull` over an editable
    install, the old library loaded, and the first step failed on a
    missing op.) Where the info describes another library (another
    Python's build in the same checkout) or csrc/ cannot be read, there
    is nothing to compare: `_Library` still names a missing op."""
    root = os.path.dirname(_HERE)
    path = library_path()
    if (built is None or path is None
            or (library is not None and os.path.basename(path) != library)
            or not (os.path.isdir(os.path.join(root, "csrc"))
                    and os.path.exists(os.path.join(root, "setup.py")))):
        return
    from sok_keras import _sources

    try:
        now = _sources.digest(root)
    except OSError:
        return
    if now != built:
        raise ImportError(
            "sok_keras's op library was built from other sources than this "
            f"checkout's csrc/ ({root}): they changed since it was built (a "
            "`git pull`, or an edit). Rebuild it: `make build`, or `pip "
            "install --no-build-isolation --no-deps -e .` again.")


class _Library:
    """The loaded op library: its ops as attributes, and an op it lacks
    named as what it is, a library built from other sources (instead of
    TensorFlow's "module '1bfc...' has no attribute")."""

    def __init__(self, module, path):
        self._module, self._path = module, path

    def __getattr__(self, name):
        module = vars(self).get("_module")
        if module is None or name.startswith("__"):
            raise AttributeError(name)  # (copy, pickle: no such protocol)
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"sok_keras's op library at {self._path} has no op "
                f"'{name}': it was built from other sources than this "
                f"sok_keras. {_rebuild_advice()}.") from None
        setattr(self, name, value)  # found once; then a plain attribute
        return value


def _missing_library_message():
    message = (f"sok_keras's op library (_sok_ops*.so) is missing from "
               f"{_HERE}.")
    if os.path.exists(os.path.join(os.path.dirname(_HERE), "setup.py")):
        # A source checkout, imported because it is the working directory
        # or on PYTHONPATH (an installed sok_keras is shadowed by it).
        return message + (
            " That is a source checkout: build it in place "
            "(`python setup.py build_ext --inplace`, or `make build`), or "
            "run from another directory to import an installed sok_keras.")
    return message + (
        " Reinstall the package (from a sok_keras checkout: `pip install "
        "--no-build-isolation .`).")


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
            raise ImportError(_missing_library_message())
        _check_versions()
        try:
            _LIB = _Library(tf.load_op_library(path), path)
        except (tf.errors.NotFoundError, OSError) as e:
            try:
                from sok_keras import _build_info

                built = _build_info.TF_VERSION
            except ImportError:
                built = "an unknown version"
            raise ImportError(
                f"sok_keras's op library at {path} (built against "
                f"TensorFlow {built}) does not load into TensorFlow "
                f"{tf.__version__}: {e}. {_rebuild_advice()}."
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
