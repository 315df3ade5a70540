"""`model.save` on several ranks: one writer, atomic, the same outcome on
every rank.

Every rank calls `model.save(path)` (the README's pattern, and what
`keras.callbacks.ModelCheckpoint` does on every rank). With sok tables and
more than one rank, `sok_keras.init()` routes `keras.Model.save` through
`save_model` here:

1. every rank checks in (a barrier with a short deadline,
   `SOK_SAVE_TIMEOUT`, default 60 s): a rank that does not join — the
   `if sok.rank() == 0: model.save(...)` mistake — gets a clear error
   instead of waiting for the communication timeout;
2. rank 0 alone runs Keras' own save into a temporary file beside `path`;
   the other ranks serve it their rows: each time rank 0's layers save a
   table or slot, rank 0 names it (a small broadcast) and every rank sends
   its rows in bounded chunks (`sok_keras.variable.CHUNK_BYTES`, 8 MiB, over all
   ranks), which rank 0 writes into the H5 dataset as they arrive
   (`sok_keras.variable.save_entry`). No rank holds a whole table; when
   Keras' save ends (or fails) rank 0 tells the others to stop serving;
3. the ranks agree on the outcome: if any rank failed, every rank raises
   and the temporary file is removed, so an existing `path` is never
   damaged; otherwise rank 0 renames its file into place (`os.replace`,
   atomic on one file system) and every rank returns once it is there.

`model.save_weights` follows the same protocol (so do
`keras.callbacks.BackupAndRestore` and `ModelCheckpoint`, which call it on
every rank), and `BackupAndRestore` deletes its shared folder at the end of
training from rank 0 only. The file's layout does not depend on the number
of ranks. On one rank a model with sok tables is saved by Keras into the
same kind of hidden file, renamed onto `path` (Keras alone writes in
place: a save killed half-way destroyed the previous file). This module
wraps `keras.Model.save` and `save_weights`; its test
fails when Keras changes under it (`tests/test_saving.py`).
"""

import contextlib
import functools
import os
import shutil
import threading

import numpy as np
import tensorflow as tf

from sok_keras import _leftovers
from sok_keras import _keras_h5
from sok_keras._keras_h5 import first_load_error
from sok_keras import _terminate
from sok_keras import global_views
from sok_keras import world
from sok_keras.variable import stream_entry
from sok_keras.variable import table_entries

_ORIGINAL = {"save": None, "save_weights": None}  # Keras' own
_STREAM = None  # the _Stream of the model.save in progress (rank 0)
_DONE, _SEND = 0, 1


def active_stream():
    """The rows stream of the `model.save` in progress on this rank (rank 0
    of several), or None."""
    return _STREAM


class _Stream:
    """Rank 0 of a `model.save` names each table or slot its layers save;
    the other ranks, in `serve`, send their rows of it.

    Every rank lists the same entries (the model's tables and their slots,
    in the model's order), so one int names one.
    """

    def __init__(self, tables):
        self.entries = [e for t in tables for e in table_entries(t)]
        self.index = {(id(e.table), e.slot): i
                      for i, e in enumerate(self.entries)}
        self.comm = world.control_communicator()

    def _command(self, op=0, entry=0):
        x = tf.constant([op, entry], tf.int64)
        got = self.comm.broadcast(x, key="save/stream/command", root=0)
        return [int(v) for v in np.asarray(got)]

    def announce(self, entry):
        """Rank 0: the peers start sending `entry`'s rows."""
        i = self.index.get((id(entry.table), entry.slot))
        if i is None:
            raise RuntimeError(
                f"sok_keras: model.save: '{entry.name}' is not one of the "
                "model's tables or slots; a layer saved a table the model "
                "does not track.")
        self._command(_SEND, i)

    def finish(self):
        """Rank 0: the peers stop serving."""
        self._command(_DONE, 0)

    def serve(self):
        """The other ranks: send rows until rank 0 is done."""
        error = None
        while True:
            op, i = self._command()
            if op == _DONE:
                break
            try:
                stream_entry(self.entries[i], None, writer_only=True)
            except Exception as e:  # reported once rank 0 is done
                error = error or e
        if error is not None:
            raise error


# The deadline of the entry check-in (SOK_SAVE_TIMEOUT), shared with every
# collective entry point (sok_keras.global_views.check_in).
save_timeout = global_views.enter_timeout


def _tables(model):
    """The model's sok tables (not their slots), in the model's order."""
    from sok_keras.variable import Variable

    slots = set()
    tables = [v for v in model.variables if isinstance(v, Variable)]
    for t in tables:
        slots |= {id(s) for s in t._sok_slots.values()}
    return [t for t in tables if id(t) not in slots]


def _model_optimizer_slots(model):
    """Makes the slots of `model.optimizer` its tables' current ones, which
    the layers save, as Keras saves the model's optimizer's state: not
    those of another optimizer that trained a table last (an earlier
    compile, a model sharing the layer), nor those of one that made none
    (a frozen table). A model without an optimizer saves what its tables
    hold (a custom loop's optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    from sok_keras.optimizers.sparse_rules import slot_owner

    for table in _tables(model):
        table.claim_slots(slot_owner(optimizer, table))


def _has_sok_tables(model):
    return bool(_tables(model))


def _agree(what, value, timeout):
    """The sum over ranks of an int `value`, within `timeout` seconds."""
    return world.control_communicator().agree(what, value, timeout)


def _temporary_path(path, token):
    """A hidden name beside `path` that keeps its full suffix (Keras
    checks `.keras` and `.weights.h5`): `.model.sok-tmp-<token>.keras`
    (`token`: the writer's operation's, `_leftovers`)."""
    folder = os.path.dirname(os.path.abspath(path))
    stem, dot, rest = os.path.basename(path).partition(".")
    return os.path.join(folder,
                        f".{stem}.{_leftovers.MARK}{token}{dot}{rest}")


class _Staging:
    """Where rank 0 writes before the result is moved into place.

    One file (`model.save`, `save_weights`): a hidden file beside `path`,
    renamed onto it. Sharded weights (`save_weights(max_shard_size=...)`:
    Keras writes `<name>.weights.json` and `<name>_00000.weights.h5`, ...,
    which the json names): a hidden folder beside `path`, written under
    the final names, whose shards are moved into place before the json.
    """

    def __init__(self, path, sharded, token=None):
        self.folder = None
        if os.path.islink(path):
            # A link to the file: the file is replaced, the link kept (as
            # Keras writes through it).
            path = os.path.realpath(path)
        # The writer's claim (`claim`) marks its temporaries as alive, and
        # removes what killed operations left (`_leftovers`).
        self._claim = None
        self.token = token or _leftovers.new_token()
        if sharded:
            self.folder = _temporary_path(path, self.token) + ".d"
            self.target = os.path.join(self.folder, os.path.basename(path))
        else:
            self.target = _temporary_path(path, self.token)
        self.path = path

    def claim(self):
        """The writer's: claims the folder for this save's temporaries."""
        if self._claim is None:
            self._claim = _leftovers.Claim(
                os.path.dirname(os.path.abspath(self.path)), self.token)

    def prepare(self):
        self.claim()
        if self.folder is not None:
            os.makedirs(self.folder, exist_ok=True)

    def publish(self):
        """Moves the temporary file or folder into place; the claim on the
        folder ends with it (no temporaries remain)."""
        self._publish()
        self._release()

    def _release(self):
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    def _publish(self):
        if self.folder is None and os.path.isdir(self.target):
            # `zipped=False`: Keras wrote a folder. An existing one is
            # moved aside first (a folder is not replaced in one step).
            aside = None
            if os.path.isdir(self.path):
                aside = self.target + ".old"
                os.replace(self.path, aside)
            os.replace(self.target, self.path)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            return
        if self.folder is None:
            if os.path.exists(self.path):
                # The replaced file's permission bits (Keras' in-place
                # write kept them).
                with contextlib.suppress(OSError):
                    shutil.copymode(self.path, self.target)
            os.replace(self.target, self.path)
            return
        into = os.path.dirname(os.path.abspath(self.path))
        names = sorted(os.listdir(self.folder),
                       key=lambda n: (n.endswith(".json"), n))
        for name in names:  # the json (which names the shards) last
            os.replace(os.path.join(self.folder, name),
                       os.path.join(into, name))
        os.rmdir(self.folder)

    def remove(self):
        _keras_h5.close_written_stores_under(self.folder or self.target)
        try:
            if self.folder is not None or os.path.isdir(self.target):
                shutil.rmtree(self.folder or self.target, ignore_errors=True)
                return
            with contextlib.suppress(OSError):
                os.remove(self.target)
        finally:
            self._release()


def save_model(model, filepath, overwrite=True, **kwargs):
    """Saves `model` from every rank into one file written by rank 0.

    Args:
        model: a Keras model (called on every rank).
        filepath: the destination (a local path); rank 0's is written.
        overwrite: whether an existing file may be replaced.
        **kwargs: passed to Keras' own `Model.save`.

    Raises:
        RuntimeError: if another rank did not join within
            `SOK_SAVE_TIMEOUT`, or failed to save (the rank is named).
        FileExistsError: if `overwrite=False` and the file exists.
    """
    original = _ORIGINAL["save"] or type(model).save
    path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) \
        else None
    if (path and _has_sok_tables(model) and world.is_initialized()
            and world.num_ranks() > 1
            and (path.endswith((".h5", ".hdf5"))
                 or kwargs.get("save_format") == "h5")):
        # (Every rank raises: the same path and model on every rank.)
        raise ValueError(
            f"sok_keras: model.save('{path}'): Keras' legacy HDF5 format "
            "writes each layer's `get_weights()`, which on "
            f"{world.num_ranks()} ranks is this rank's shard of each table: "
            "the file would hold part of the tables. Save to a `.keras` "
            "file (one file, loaded at any number of ranks), or "
            "`model.save_weights('....weights.h5')`.")
    with _compile_config_kept(model):
        return _save_on_every_rank(
            model, filepath, overwrite, "model.save",
            lambda target: original(model, target, overwrite=True,
                                    **kwargs),
            lambda: original(model, filepath, overwrite=overwrite, **kwargs),
            unzipped=kwargs.get("zipped") is False)


@contextlib.contextmanager
def _compile_config_kept(model):
    """Keras' legacy `.h5` save pops "optimizer" from the model's compile
    config itself (`legacy/saving/saving_utils.py`), so a `.keras` file
    saved after it named no optimizer: plain Keras then loads it with
    RMSprop, and a model with sok tables failed to load (review). Restored
    after a save of a model with sok tables."""
    config = getattr(getattr(model, "_compile_config", None), "config",
                     None)
    kept = (dict(config) if isinstance(config, dict)
            and _has_sok_tables(model) else None)
    try:
        yield
    finally:
        if kept is not None:
            config.clear()
            config.update(kept)


def save_weights(model, filepath, overwrite=True, **kwargs):
    """`model.save_weights` from every rank: one file, written by rank 0.

    The same protocol as `save_model` (`keras.callbacks.BackupAndRestore`
    and `ModelCheckpoint(save_weights_only=True)` call it on every rank).

    Args:
        model: a Keras model (called on every rank).
        filepath: the destination, ending in `.weights.h5`.
        overwrite: whether an existing file may be replaced.
        **kwargs: passed to Keras' own `Model.save_weights`; others than
            `max_shard_size` (`objects_to_skip`, which the function
            `keras.saving.save_weights` takes) to that function.
    """
    original = _ORIGINAL["save_weights"] or type(model).save_weights
    if set(kwargs) - {"max_shard_size"}:
        from keras.src.saving import saving_api

        original = saving_api.save_weights
    return _save_on_every_rank(model, filepath, overwrite,
                               "model.save_weights",
                               lambda target: original(
                                   model, target, overwrite=True, **kwargs),
                               lambda: original(model, filepath,
                                                overwrite=overwrite,
                                                **kwargs),
                               sharded=kwargs.get("max_shard_size")
                               is not None)


def _save_on_every_rank(model, filepath, overwrite, what, write, plain,
                        sharded=False, unzipped=False):
    """One writer (rank 0, `write(temporary_path)`), the others serving
    their rows; atomic rename; the same outcome on every rank. `plain()`
    is Keras' own save, for a model without sok tables (one rank:
    `_save_alone`); `sharded`: Keras writes several files (`_Staging`);
    `unzipped`: Keras writes a folder (`zipped=False`)."""
    if not _has_sok_tables(model):  # Keras' own, untouched
        return plain()
    # On every rank: the others serve rank 0 the rows of the slots it
    # writes (Keras' save, on rank 0, claims them too: _keras_h5).
    _model_optimizer_slots(model)
    # (Before `sok.init()`, each process is a world of its own.)
    n = world.num_ranks() if world.is_initialized() else 1
    if n == 1:
        return _save_alone(filepath, overwrite, write, plain, sharded,
                           unzipped)
    rank = world.rank()
    path = os.fspath(filepath)
    global_views.check_in(f"{what}('{path}') (rank 0 writes the file)",
                          "save")
    exists = int(rank == 0 and os.path.exists(path))
    if not overwrite and _agree("save/exists", exists, world.timeout()):
        raise FileExistsError(
            f"sok_keras: '{path}' exists and overwrite=False.")
    # Every rank names rank 0's temporary file, to check before the
    # rename that its path is rank 0's. Rank 0 claims the folder first
    # (removing what killed operations left there) while no rank waits
    # inside the save's streams.
    staging = _Staging(path, sharded) if rank == 0 else None
    try:
        if staging is not None:
            staging.claim()
        token = _agree("save/writer",
                       int(staging.token, 16) if rank == 0 else 0,
                       world.timeout())
    except BaseException:
        if staging is not None:
            staging.remove()
        raise
    staging = staging or _Staging(path, sharded, f"{token:012x}")
    # Also when a SIGTERM stops the save: rank 0's temporary file goes.
    with _terminate.on_sigterm_clean_up(), _keras_skipsets_made_together():
        try:
            _write_on_rank_0(model, path, staging, rank, n, what, write)
        finally:
            if rank == 0:
                staging.remove()
    return None


def _save_alone(filepath, overwrite, write, plain, sharded, unzipped):
    """One rank: Keras' own save, into a hidden file beside `filepath`
    renamed onto it, so that a save stopped half-way (SIGKILL, a full
    disk) leaves the previous file as it was (QA: Keras writes in place,
    and a killed save of a 768 MB model left 3 KB that did not load).
    Remote paths (`gs://`...), unzipped saves and `overwrite=False` on an
    existing file (Keras asks) stay Keras' own."""
    path = (os.fspath(filepath)
            if isinstance(filepath, (str, os.PathLike)) else None)
    if (path is None or "://" in path or unzipped
            or (not overwrite and os.path.exists(path))
            or not os.access(os.path.dirname(os.path.abspath(path)) or ".",
                             os.W_OK)):
        # (A folder where only the file may be written: in place.)
        return plain()
    staging = _Staging(path, sharded)
    with _terminate.on_sigterm_clean_up():
        try:
            staging.prepare()
            write(staging.target)
            staging.publish()
        except Exception as e:
            clear = _in_user_terms(e, staging.target, path)
            if clear is e:
                raise
            raise clear from e
        finally:
            staging.remove()
    return None


_SKIPSET_TYPES = ("Operation", "Layer", "Functional", "Sequential",
                  "Metric", "Optimizer", "Loss", "Cross", "Feature")
_SKIPSETS = {}


@contextlib.contextmanager
def _keras_skipsets_made_together():
    """Keras' saving builds throwaway objects to learn which attributes to
    skip (`saving_lib.get_attr_skipset`, not cached: its cache key is
    misspelt), an `Optimizer(1.0)` among them, whose variables a
    `MultiWorkerMirroredStrategy` scope makes with a collective broadcast.
    Rank 0 alone writes, so that broadcast waited for the other ranks for
    ever. Every rank builds them once, together, here; the write uses
    them."""
    from keras.src.saving import saving_lib

    original = saving_lib.get_attr_skipset
    if not _SKIPSETS:
        for obj_type in _SKIPSET_TYPES:
            try:
                _SKIPSETS[obj_type] = original(obj_type)
            except Exception:  # noqa: BLE001 - a type this Keras lacks
                pass

    def get_attr_skipset(obj_type):
        if obj_type in _SKIPSETS:
            return set(_SKIPSETS[obj_type])
        return original(obj_type)

    saving_lib.get_attr_skipset = get_attr_skipset
    try:
        yield
    finally:
        saving_lib.get_attr_skipset = original


def _write_on_rank_0(model, path, staging, rank, n, what, write):
    """Rank 0 writes `staging.target`, which the others serve rows to,
    then moves it into place; every rank raises if any failed."""
    global _STREAM
    error = None
    try:
        stream = _Stream(_tables(model))
        count = len(stream.entries)
        if _agree("save/entries", count, world.timeout()) != n * count:
            raise RuntimeError(
                f"sok_keras: rank {rank}: {what}('{path}'): the ranks "
                "do not hold the same tables and slots (this rank has "
                f"{count}).")
        if rank == 0:
            _STREAM = stream
            interrupted = True
            try:
                staging.prepare()
                write(staging.target)
                interrupted = False
            except Exception:
                interrupted = False
                raise
            finally:
                _STREAM = None
                # A signal (SIGTERM, Ctrl-C) ends this process: no
                # collective then, the peers may be inside one of the
                # stream's, and learn that this rank is gone instead.
                if not interrupted:
                    stream.finish()
        else:
            stream.serve()
    except Exception as e:  # reported to every rank below
        error = e
    _fail_together("save/done", error, what, path, staging, rank, n)
    # Every rank's path names the file rank 0 wrote, checked on its
    # temporary file before the rename (else a rank given another path,
    # or one on a disk rank 0 does not write, was told its file was saved,
    # and rank 0's existing file was replaced by a save that failed).
    global_views.check_same_file(
        f"{what}('{path}') (nothing was written)", "save",
        global_views.file_fingerprint(staging.target), path,
        unseen="not where rank 0 writes it")
    if rank == 0:
        try:
            staging.publish()
        except OSError as e:  # (a folder at `path`, say)
            error = e
    _fail_together("save/renamed", error, what, path, staging, rank, n)


def _fail_together(stage, error, what, path, staging, rank, n):
    """Every rank raises if `error` happened on any (this rank's error, or
    one naming the rank's failure), once rank 0's temporary file is gone."""
    failed = _failed_ranks(stage, error is not None, rank, n)
    if not failed:
        return
    if rank == 0:
        staging.remove()
    try:
        _agree(f"{stage}/cleaned", 1, world.timeout())
    except tf.errors.OpError:
        # A peer that got the result first raised and exited, and its exit
        # aborted this rank's side of the agreement: this rank's own error
        # (rank 0's "No space left on device") is still the one to raise.
        if error is None:
            raise
    if error is not None:
        raise _in_user_terms(error, staging.target, path)
    raise RuntimeError(
        f"sok_keras: rank {rank}: {what}('{path}') failed on {failed} "
        f"(of {n} ranks); the error is in that rank's output. The file "
        "was not changed.")


def _failed_ranks(stage, failed_here, rank, n):
    """Which ranks failed (a sentence fragment, '' if none): one agreement
    of a bit per rank (a count beyond 62 ranks)."""
    if n > 62:
        count = _agree(stage, int(failed_here), world.timeout())
        return f"{count} other rank(s)" if count else ""
    mask = _agree(stage, (1 << rank) if failed_here else 0, world.timeout())
    ranks = [r for r in range(n) if mask >> r & 1]
    if not ranks:
        return ""
    return (f"rank {ranks[0]}" if len(ranks) == 1
            else f"ranks {ranks}")


def _in_user_terms(error, target, path):
    """`error` with rank 0's temporary file named as the user's `path`
    (Keras checks the temporary name's suffix, and an OSError names it)."""
    if target not in str(error):
        return error
    text = str(error).replace(target, path)
    if isinstance(error, OSError) and error.errno is not None:
        new = type(error)(error.errno, error.strerror, path)
    else:
        try:
            new = type(error)(text)
        except Exception:  # noqa: BLE001 - an exception class of its own
            return error
    new.__cause__ = error
    return new


def _backup_on_train_end(original):
    """`BackupAndRestore.on_train_end` on several ranks: the ranks share one
    backup folder, so rank 0 alone deletes it (two ranks removing the same
    tree race, and one fails with FileNotFoundError), once every rank has
    got there: a rank still writing its last backup's
    `training_metadata.json` would find the folder gone (GPU run 10)."""

    @functools.wraps(original)
    def on_train_end(self, logs=None):
        if world.num_ranks() > 1:
            _agree("backup/train_end", 1, world.timeout())
            if world.rank() != 0:
                return None
        return original(self, logs)

    on_train_end._sok_keras = True
    return on_train_end


def _own_variables(layer):
    """The variables Keras' `Layer.save_own_variables` saves (in its
    order), and whether a `sok_keras.Variable` is among them."""
    from sok_keras.variable import Variable

    own = list(layer._trainable_variables) + list(
        layer._non_trainable_variables)
    return own, any(isinstance(v, Variable) for v in own)


def _layer_saving(original_save, original_load):
    """Keras' `Layer.save_own_variables` / `load_own_variables` for layers
    and models that hold a `sok_keras.Variable` themselves (SOK's way: a
    subclassed model or custom layer owning the table, looked up with
    `sok.lookup_sparse`). Such a table is saved whole, in global row
    order, with its optimizer slots (`"<i>.slot.<name>"`), and each rank
    loads its rows, as the sok layers' tables are. Before (QA), Keras
    wrote `store["<i>"] = table`: this rank's shard (on N ranks, rank 0's
    rows only) and no slots. Other layers keep Keras' methods."""
    from sok_keras.variable import Variable

    def save_own_variables(self, store):
        own, has_tables = _own_variables(self)
        if not has_tables:
            return original_save(self, store)
        from sok_keras.layers.base_embedding import save_table

        for i, v in enumerate(own):
            if isinstance(v, Variable):
                save_table(store, f"{i}", f"{i}.slot.", v)
            else:
                store[f"{i}"] = v

    def load_own_variables(self, store):
        own, has_tables = _own_variables(self)
        if not has_tables:
            return original_load(self, store)
        return load_with_tables(self, store, own)

    @first_load_error
    def load_with_tables(self, store, own):
        from sok_keras import consistency
        from sok_keras.layers.base_embedding import load_table

        keys = [k for k in store.keys() if ".slot." not in k]
        if len(keys) != len(own):
            raise ValueError(
                f"Layer '{self.name}' expected {len(own)} variables, but "
                f"received {len(keys)} variables during loading. Expected: "
                f"{[v.name for v in own]}")
        for i, v in enumerate(own):
            if isinstance(v, Variable):
                consistency.check_table(v, "load")
                load_table(store, f"{i}", f"{i}.slot.", v,
                           f"Layer '{self.name}'")
            else:
                v.assign(store[f"{i}"])

    save_own_variables.__wrapped__ = original_save
    load_own_variables.__wrapped__ = original_load
    return save_own_variables, load_own_variables


def install():
    """Routes `keras.Model.save` and `save_weights` through `save_model`
    and `save_weights`, makes `keras.callbacks.BackupAndRestore` delete its
    shared folder from rank 0 only, and saves tables that layers hold
    themselves whole (`_layer_saving`) (idempotent)."""
    import keras

    if _ORIGINAL["save"] is not None:
        return
    layer = keras.layers.Layer
    layer.save_own_variables, layer.load_own_variables = _layer_saving(
        layer.save_own_variables, layer.load_own_variables)
    _ORIGINAL["save"] = keras.Model.save
    _ORIGINAL["save_weights"] = keras.Model.save_weights

    # Keras' own positional parameters (review: `save(path, True, False)`
    # failed with a TypeError).
    @functools.wraps(_ORIGINAL["save"])
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        return save_model(self, filepath, overwrite=overwrite,
                          zipped=zipped, **kwargs)

    @functools.wraps(_ORIGINAL["save_weights"])
    def save_weights_(self, filepath, overwrite=True, max_shard_size=None,
                      **kwargs):
        return save_weights(self, filepath, overwrite=overwrite,
                            max_shard_size=max_shard_size, **kwargs)

    save._sok_keras = True
    save_weights_._sok_keras = True
    keras.Model.save = save
    keras.Model.save_weights = save_weights_
    backup = keras.callbacks.BackupAndRestore
    backup.on_train_end = _backup_on_train_end(backup.on_train_end)
    _route_public_functions()


def _route_public_functions():
    """`keras.saving.save_model(model, ...)` (also `keras.models.
    save_model`) and `keras.saving.save_weights(model, ...)` through the
    model's `save` / `save_weights`, as Keras' methods call them the other
    way round. Before, these functions bypassed the methods sok_keras
    routes: on N ranks every rank ran Keras' own save into the same path
    (QA: `zipped=False` raced for the HDF5 file's lock, failed on every
    rank and left a half-written folder). Replaced where Keras exports
    them, not in `keras.src.saving.saving_api`, which the methods call."""
    import keras

    api = {"save_model": "save", "save_weights": "save_weights"}
    for module in (keras.saving, keras.models):
        for name, method in api.items():
            original = getattr(module, name, None)
            if original is None or getattr(original, "_sok_keras", False):
                continue
            setattr(module, name, _through_method(original, method))


_ROUTING = threading.local()


def _through_method(original, method):
    @functools.wraps(original)
    def routed(model, filepath, *args, **kwargs):
        import keras

        # A class's own `save` that calls this function gets Keras' (a
        # guard, not a test of the method: one that calls `super().save`
        # is routed; review: a flag copied by `functools.wraps` recursed).
        if not isinstance(model, keras.Model) or getattr(
                _ROUTING, "active", False):
            return original(model, filepath, *args, **kwargs)
        _ROUTING.active = True
        try:
            return getattr(model, method)(filepath, *args, **kwargs)
        finally:
            _ROUTING.active = False

    routed._sok_keras = True
    return routed
