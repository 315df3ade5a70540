"""The one place where sok_keras relies on Keras' saving internals.

Keras' public saving API hands a layer's `save_own_variables` /
`load_own_variables` a store that takes and returns whole NumPy arrays, and
`keras.saving.save_model` / `load_model` keep the whole `model.weights.h5`
in memory when `is_memory_sufficient(model)` says so. For sharded tables
that means every table whole on every rank. So, for models with sok
tables, sok_keras:

1. makes `keras.src.saving.saving_lib.is_memory_sufficient` answer False,
   which selects Keras' own on-disk paths: the writer builds the weights in
   a temporary file beside the `.keras` file and copies it into the zip,
   and a reader extracts the weights to a temporary folder beside the file
   and opens them with h5py (bounded memory, at the cost of a temporary
   copy on disk);
2. reaches the `h5py` group behind an `H5IOStore` entry
   (`_h5_entry_group`, `_create_h5_group`, `safe_get_h5_dataset`) to
   create a table's dataset at its full size and fill it chunk by chunk,
   and to read only this rank's rows of it.

The datasets are the ones Keras writes itself (contiguous, the table's
dtype; bfloat16 as Keras stores it: 2-byte opaque data with a `dtype`
attribute), so files load with plain Keras code. Any other store (npz,
sharded `save_weights`, a dict) falls back to whole arrays.
`tests/test_keras_h5.py` fails loudly when Keras changes any of this.
"""

import contextlib
import functools
import os
import threading
import warnings
import weakref

_INSTALLED = False
# The first error of each sok layer in the Keras load in progress on this
# thread (`load_scope`, `first_load_error`): {id(layer): (store, error)}.
_LOADING = threading.local()


def _saving_lib():
    from keras.src.saving import saving_lib

    return saving_lib


def _has_sok_tables(model):
    from sok_keras.variable import Variable

    try:
        return any(isinstance(v, Variable) for v in model.variables)
    except Exception:  # not a model we know; let Keras decide
        return False


@contextlib.contextmanager
def load_scope():
    """One Keras load (`load_model`, `load_weights`): what
    `first_load_error` remembers lives as long as it."""
    outer = getattr(_LOADING, "errors", None)
    _LOADING.errors = {}
    try:
        yield
    finally:
        _LOADING.errors = outer


def _in_load_scope(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with load_scope():
            return fn(*args, **kwargs)

    return call


def first_load_error(load):
    """Makes a `load_own_variables` raise its first error of a Keras load
    again where Keras tries the layer once more under another path of the
    model (a subclassed model's `layers` list), whose entry is empty:
    Keras reports the last error, and "no 'embeddings' entry ... Found:
    []" hid the cause (QA: a table of 55 rows loading a file of 50).
    Nothing is kept once the load ends (`load_scope`)."""

    @functools.wraps(load)
    def load_own_variables(self, store, *args):
        errors = getattr(_LOADING, "errors", None)
        if errors is None:  # not inside Keras' load
            return load(self, store, *args)
        failed = errors.get(id(self))
        if failed is not None and failed[0] is store and not list(
                store.keys()):
            raise failed[1]
        try:
            return load(self, store, *args)
        except Exception as e:
            errors[id(self)] = (store, e)
            raise

    return load_own_variables


def install():
    """Makes Keras save and load models with sok tables through files on
    disk, not whole in memory (idempotent)."""
    global _INSTALLED
    lib = _saving_lib()
    original = lib.is_memory_sufficient
    if getattr(original, "_sok_keras", False):
        _INSTALLED = True
        return

    @functools.wraps(original)
    def is_memory_sufficient(model):
        if _has_sok_tables(model):
            return False
        return original(model)

    is_memory_sufficient._sok_keras = True
    is_memory_sufficient._sok_original = original
    lib.is_memory_sufficient = is_memory_sufficient
    # A SIGTERM mid-save or mid-load removes the temporary weights file or
    # folder these paths make before the process dies (`_terminate`).
    from sok_keras._terminate import guarded

    lib.tempfile = _TrackedTempfiles(lib.tempfile)
    lib.save_model = guarded(_temporaries_removed(
        _model_optimizer_state(lib.save_model)))
    lib.save_weights_only = _model_optimizer_state(lib.save_weights_only)
    lib.load_model = guarded(_in_load_scope(
        _no_optimizer_state_without_compile(lib.load_model)))
    lib.load_weights_only = _in_load_scope(lib.load_weights_only)
    _keep_optimizer_state_whole()
    # (The tracker first: the interruption check's own wrapper must be the
    # outer one, which Keras' frame calls.)
    _track_written_stores()
    _interruptions_end_the_fallback()
    _legacy_h5_loads_masks()
    _legacy_h5_loads_whole_tables()
    _INSTALLED = True


def _legacy_h5_loads_masks():
    """Keras' legacy `.h5` loader finds a model's layers by class name
    among Keras' layers, and a functional model can hold one operation
    that is not a layer: the `ids != -1` (`NotEqual`) that computes an
    unpooled sok layer's mask, which Keras records in the graph when a
    mask-aware layer takes the mask. Such a file saved, but did not load:
    "Unknown layer: 'NotEqual'" (QA; plain Keras' `Embedding(...,
    mask_zero=True)` fails the same way). The loader is given the class,
    unless the caller's `custom_objects` name another."""
    from keras.src.legacy.saving import legacy_h5_format

    original = legacy_h5_format.load_model_from_hdf5
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def load_model_from_hdf5(filepath, custom_objects=None, *args,
                             **kwargs):
        from keras.src.ops.numpy import NotEqual

        objects = {"NotEqual": NotEqual}
        objects.update(custom_objects or {})
        return original(filepath, objects, *args, **kwargs)

    load_model_from_hdf5._sok_keras = True
    legacy_h5_format.load_model_from_hdf5 = load_model_from_hdf5


def _legacy_h5_loads_whole_tables():
    """A legacy `.h5` file holds each layer's `get_weights()`, and sok
    saves one only on one rank: its tables are whole. Keras' loader
    (`load_model`, `load_weights`, by order or by name) compares each
    saved array's shape with its variable's and assigns it whole, so on N
    ranks, where a table is this rank's shard, the file did not load:
    "Shape mismatch in layer #0 (named emb)for weight emb/embeddings.
    Weight expects shape (4, 4). Received saved weight with shape (8, 4)"
    (QA). A whole table saved for a sok table is now read as
    `Variable.assign_global` reads it (this rank's rows), after Keras has
    checked and assigned the layer's other weights. Any other shape is a
    mismatch against the whole table on every rank (a shard's shape
    differs between ranks: an array that happened to fit one rank's
    shard was assigned there while the other rank raised, review);
    the other weights are Keras' to check."""
    from keras.src.legacy.saving import legacy_h5_format

    original = legacy_h5_format._set_weights
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def _set_weights(instance, symbolic_weights, weight_values, name,
                     skip_mismatch=False):
        from sok_keras.variable import is_sok_variable

        keras_vars, keras_values, whole_tables = [], [], []
        for v, value in zip(symbolic_weights, weight_values):
            if not is_sok_variable(v):
                keras_vars.append(v)
                keras_values.append(value)
                continue
            shape = tuple(getattr(value, "shape", ()))
            if shape == tuple(v.global_shape):
                whole_tables.append((v, value))
                continue
            message = (
                f"Shape mismatch in {name} for table {v.path}: the table "
                f"is {tuple(v.global_shape)}, the saved weight {shape} (a "
                "legacy .h5 file holds whole tables)")
            if not skip_mismatch:
                raise ValueError(f"sok_keras: {message}.")
            warnings.warn(f"sok_keras: skipping loading weights: "
                          f"{message}.", stacklevel=2)
        original(instance, keras_vars, keras_values, name,
                 skip_mismatch=skip_mismatch)
        for v, value in whole_tables:
            v.assign_global(value, f"{name}, '{v.path}'")

    _set_weights._sok_keras = True
    legacy_h5_format._set_weights = _set_weights


class _TrackedTempfiles:
    """`saving_lib`'s `tempfile`: the weights file Keras' on-disk save
    makes beside the `.keras` file is named for sok_keras
    (`.sok-tmp-<token>-weights-*` in sok's save, `_leftovers`) and
    remembered (per thread), so that
    `_temporaries_removed` removes it when the save ends. Keras closes
    (deletes) it after `weights_store.close()`, which raises on a full
    disk: the file, as large as the weights, then stayed until garbage
    collection, and the next save in that process found no space (QA)."""

    def __init__(self, module):
        import threading

        self._module = getattr(module, "_module", module)
        self._local = threading.local()

    def __getattr__(self, name):
        return getattr(self._module, name)

    def opened(self):
        if not hasattr(self._local, "files"):
            self._local.files = []
        return self._local.files

    def NamedTemporaryFile(self, *args, **kwargs):  # noqa: N802 - tempfile's
        from sok_keras import _leftovers

        # Inside sok's save (a claim on the folder): the save's token, so
        # that a SIGKILL's leftover goes at the next save (`_leftovers`).
        token = _leftovers.active_token(kwargs.get("dir"))
        kwargs.setdefault("prefix", f".{_leftovers.MARK}{token}-weights-"
                          if token else f".{_leftovers.MARK}weights-")
        f = self._module.NamedTemporaryFile(*args, **kwargs)
        self.opened().append(f)
        return f

    def mkdtemp(self, *args, **kwargs):
        """Keras' assets folder of a save (`get_temp_dir`), removed when
        the save ends: Keras removes it in `asset_store.close()`, which
        its `finally` does not reach when the weights' close raised (a
        full disk; QA: one `$TMPDIR/tmp*/assets` left per failed save).
        Only inside a save (`_temporaries_removed`)."""
        path = self._module.mkdtemp(*args, **kwargs)
        if getattr(self._local, "saving", 0):
            self.opened().append(_RemovedFolder(path))
        return path

    def TemporaryDirectory(self, *args, **kwargs):  # noqa: N802 - tempfile's
        if kwargs.get("dir") is None or args:
            return self._module.TemporaryDirectory(*args, **kwargs)
        return _ClaimedDirectory(self._module, kwargs)


class _RemovedFolder:
    """A folder `close()` removes (what `_temporaries_removed` calls)."""

    def __init__(self, path):
        self.path = path

    def close(self):
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)


class _ClaimedDirectory:
    """The folder into which a loading rank extracts the weights beside the
    model's file (`TemporaryDirectory(dir=...)`, a full copy each): named
    `.sok-tmp-<token>-load-*` and claimed while it exists, so that one a
    SIGKILL left goes at the next save or load there (`_leftovers`)."""

    def __init__(self, module, kwargs):
        from sok_keras import _leftovers

        self._claim = _leftovers.Claim(os.fspath(kwargs["dir"]))
        kwargs.setdefault(
            "prefix", f".{_leftovers.MARK}{self._claim.token}-load-")
        try:
            self._dir = module.TemporaryDirectory(**kwargs)
        except BaseException:
            self._claim.release()
            raise
        self.name = self._dir.name

    def cleanup(self):
        try:
            self._dir.cleanup()
        finally:
            self._claim.release()

    def __enter__(self):
        return self.name

    def __exit__(self, *exc):
        self.cleanup()


def _temporaries_removed(fn):
    """`fn` (Keras' `save_model`) removing the temporary files it made
    through `_TrackedTempfiles`, also when it fails."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        tracked = _saving_lib().tempfile
        mine = isinstance(tracked, _TrackedTempfiles)
        files = tracked.opened() if mine else []
        before = len(files)
        if mine:
            tracked._local.saving = getattr(tracked._local, "saving", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            if mine:
                tracked._local.saving -= 1
            while len(files) > before:
                f = files.pop()
                try:
                    f.close()
                except OSError:
                    pass

    return call


def _interruptions_end_the_fallback():
    """Keras' save and load open the weights file on disk in a `try`
    whose bare `except:` falls back to the zip archive: a Ctrl-C or
    SIGTERM (`_terminate`) during the extraction was swallowed, and the
    ranks read the whole file from the zip, slowly (35 s at full CPU for
    768 MB), before they stopped; sokrun's SIGKILL after its grace then
    left each rank's extracted copy on disk. An `H5IOStore` made while its
    caller handles such an interruption raised in that same frame raises
    it again: Keras' `finally` removes the copy, and the process stops.
    An interruption the program caught itself (`except KeyboardInterrupt:
    model.save(...)`) was raised elsewhere and is left alone."""
    import sys

    from sok_keras._terminate import _Terminated

    store = _saving_lib().H5IOStore
    original = store.__init__
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        handled = sys.exc_info()[1]
        if (isinstance(handled, (KeyboardInterrupt, SystemExit, _Terminated))
                and handled.__traceback__ is not None
                and handled.__traceback__.tb_frame is sys._getframe(1)):
            raise handled
        original(self, *args, **kwargs)

    __init__._sok_keras = True
    store.__init__ = __init__


_WRITTEN_STORES = weakref.WeakSet()


def _track_written_stores():
    """Remembers the weights stores Keras opens for writing on disk, for
    `close_written_stores_under` (idempotent)."""
    lib = _saving_lib()
    for store in (lib.H5IOStore, lib.ShardedH5IOStore):
        original = store.__init__
        if getattr(original, "_sok_tracked", False):
            continue

        def __init__(self, *args, _original=original, **kwargs):
            _original(self, *args, **kwargs)
            if getattr(self, "mode", None) == "w":
                _WRITTEN_STORES.add(self)

        functools.update_wrapper(__init__, original)
        __init__._sok_tracked = True
        store.__init__ = __init__


def close_written_stores_under(path):
    """Closes the weights files that Keras' stores still hold open for
    writing at or under `path` (a file, or a folder). Keras' save leaves
    its store open when a write fails (a full disk): h5py's handles then
    failed again when Python freed them, and the process died of SIGSEGV
    at exit, after the save's own clear error (QA). (Enumerating h5py's
    open files instead crashed on a `.keras` save's in-memory one.)"""
    path = os.path.abspath(path)
    for store in list(_WRITTEN_STORES):
        where = getattr(store, "path", None) or getattr(
            store, "path_or_io", None)
        if (not isinstance(where, (str, os.PathLike))
                or getattr(store, "archive", None) is not None):
            continue  # in memory (io.BytesIO), or an entry of a zip
        where = os.path.abspath(where)
        if where != path and not where.startswith(path + os.sep):
            continue
        h5_file = getattr(store, "h5_file", None)
        if h5_file is not None:
            # (Its last write fails again, as the save did.)
            with contextlib.suppress(Exception):
                h5_file.close()
        _WRITTEN_STORES.discard(store)


def _model_optimizer_state(original):
    """Keras' `save_model` / `save_weights_only` writing the tables' slots
    of the model's optimizer (`saving._model_optimizer_slots`)."""

    @functools.wraps(original)
    def save(model, *args, **kwargs):
        from sok_keras.saving import _model_optimizer_slots

        _model_optimizer_slots(model)
        return original(model, *args, **kwargs)

    return save


def _no_optimizer_state_without_compile(original):
    """`load_model(..., compile=False)`: Keras restores no optimizer
    state, and a new optimizer starts fresh; the tables' slots, which the
    layers load with their tables and keep for the first optimizer to make
    them, are dropped too."""

    @functools.wraps(original)
    def load_model(filepath, custom_objects=None, compile=True,
                   *args, **kwargs):
        import keras

        model = original(filepath, custom_objects, compile, *args, **kwargs)
        if not compile and isinstance(model, keras.Model):
            from sok_keras.saving import _tables

            for table in _tables(model):
                table._sok_pending_slots.clear()
        return model

    return load_model


def _keep_optimizer_state_whole():
    """`model.load_weights` into a model whose optimizer is not built:
    Keras skips the file's optimizer state (it warns), but the tables'
    slots, which the layers load with their tables, would be kept and
    applied when the optimizer is built: half an optimizer state. They are
    dropped too, so the optimizer starts fresh as Keras' does (build it
    first, `model.optimizer.build(model.trainable_variables)`, to restore
    it all)."""
    import logging

    import keras

    original = keras.Model.load_weights
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def load_weights(self, filepath, *args, **kwargs):
        from sok_keras.saving import _model_optimizer_slots
        from sok_keras.saving import _tables

        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            # Into the model's optimizer's slots (another optimizer may
            # have trained a table last: a layer shared by two models).
            _model_optimizer_slots(self)
            return original(self, filepath, *args, **kwargs)

        tables = _tables(self)
        before = {id(t): set(t._sok_pending_slots) for t in tables}
        out = original(self, filepath, *args, **kwargs)
        dropped = []
        for t in tables:
            for name in set(t._sok_pending_slots) - before[id(t)]:
                del t._sok_pending_slots[name]
                dropped.append(f"{t.path}:{name}")
        if dropped and optimizer is not None:
            # (With no optimizer, an uncompiled model, Keras skips its
            # variables silently, and so do the tables' slots.)
            logging.getLogger("sok_keras").warning(
                "sok_keras: load_weights: the model's optimizer is not "
                "built, so (as Keras skips its variables) the tables' "
                "optimizer slots in the file are not restored either: %s. "
                "Build it first, `model.optimizer.build("
                "model.trainable_variables)`, to restore its state.",
                ", ".join(sorted(dropped)))
        return out

    load_weights._sok_keras = True
    keras.Model.load_weights = load_weights


def _is_h5_store(store):
    # Exactly H5IOStore: ShardedH5IOStore accounts the bytes it writes in
    # its own __setitem__, so it gets whole arrays.
    return type(store) is _saving_lib().H5IOStore


def create_dataset(store, key, shape, dtype):
    """Creates `key` in the store's current entry at its full `shape`.

    Returns:
        The `h5py.Dataset` to fill (`ds[a:b] = rows`), or None when `store`
        is not Keras' H5 store in write mode (then the caller assigns the
        whole array, `store[key] = array`).
    """
    if not _is_h5_store(store) or store.mode != "w":
        return None
    from sok_keras.variable import _np_dtype

    if not store._h5_entry_initialized:
        store._create_h5_group(store._h5_entry_path)
    group = store._h5_entry_group
    ds = group.create_dataset(key, shape=tuple(shape),
                              dtype=_np_dtype(dtype))
    if str(dtype) == "bfloat16":
        ds.attrs["dtype"] = "bfloat16"  # as H5IOStore.__setitem__ does
    return ds


def dataset(store, key):
    """The `h5py.Dataset` behind `store[key]`, unread (Keras' own checks
    for links, external and virtual datasets, shape bombs applied), or None
    when `store` is not Keras' H5 store."""
    if not _is_h5_store(store):
        return None
    group = store._h5_entry_group
    if isinstance(group, dict):  # the entry has no group
        return None
    return _saving_lib().safe_get_h5_dataset(group, key)


def check_keras_internals():
    """Raises AssertionError naming what changed in Keras, if anything
    sok_keras relies on is gone (see the module docstring)."""
    import inspect

    lib = _saving_lib()
    missing = [name for name in (
        "is_memory_sufficient", "H5IOStore", "safe_get_h5_dataset",
        "_save_model_to_fileobj", "_load_model_from_fileobj",
        "save_model", "load_model")
        if not hasattr(lib, name)]
    assert not missing, f"keras saving_lib lacks {missing}"
    for fn in (lib._save_model_to_fileobj, lib._load_model_from_fileobj):
        assert "is_memory_sufficient" in fn.__code__.co_names, (
            f"{fn.__name__} no longer asks is_memory_sufficient")
    store_attrs = ("_h5_entry_group", "_h5_entry_path",
                   "_h5_entry_initialized", "_create_h5_group", "mode")
    source = inspect.getsource(lib.H5IOStore)
    gone = [a for a in store_attrs if a not in source]
    assert not gone, f"H5IOStore lacks {gone}"
    params = list(inspect.signature(lib.safe_get_h5_dataset).parameters)
    assert params == ["group", "name"], params
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.ops import numpy as ops_numpy

    params = list(inspect.signature(getattr(
        legacy_h5_format.load_model_from_hdf5, "__wrapped__",
        legacy_h5_format.load_model_from_hdf5)).parameters)
    assert params[:2] == ["filepath", "custom_objects"], params
    params = list(inspect.signature(getattr(
        legacy_h5_format._set_weights, "__wrapped__",
        legacy_h5_format._set_weights)).parameters)
    assert params == ["instance", "symbolic_weights", "weight_values",
                      "name", "skip_mismatch"], params
    for fn in ("load_weights_from_hdf5_group",
               "load_weights_from_hdf5_group_by_name"):
        assert "_set_weights" in getattr(
            legacy_h5_format, fn).__code__.co_names, (
            f"{fn} no longer assigns through _set_weights")
    assert hasattr(ops_numpy, "NotEqual"), "keras.src.ops.numpy.NotEqual"
