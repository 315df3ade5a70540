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
2. every rank gathers the tables and their slots (collectives, in the
   model's order); then rank 0 alone runs Keras' own save into a temporary
   file beside `path` (the others write nothing);
3. the ranks agree on the outcome: if any rank failed, every rank raises
   and the temporary file is removed, so an existing `path` is never
   damaged; otherwise rank 0 renames its file into place (`os.replace`,
   atomic on one file system) and every rank returns once it is there.

The file's layout does not depend on the number of ranks. This is the one
module that changes Keras' behaviour (it wraps `keras.Model.save`); its
test fails when Keras changes under it (`tests/test_saving.py`).
"""

import contextlib
import functools
import os

from sok_keras import global_views
from sok_keras import world
from sok_keras.variable import gathered_for_saving

_ORIGINAL_SAVE = None

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


def _has_sok_tables(model):
    return bool(_tables(model))


def _agree(what, value, timeout):
    """The sum over ranks of an int `value`, within `timeout` seconds."""
    return world.control_communicator().agree(what, value, timeout)


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
    original = _ORIGINAL_SAVE or type(model).save
    n = world.num_ranks()
    if n == 1 or not _has_sok_tables(model):
        return original(model, filepath, overwrite=overwrite, **kwargs)
    rank = world.rank()
    path = os.fspath(filepath)
    global_views.check_in(f"model.save('{path}') (rank 0 writes the file)",
                          "save")
    exists = int(rank == 0 and os.path.exists(path))
    if not overwrite and _agree("save/exists", exists, world.timeout()):
        raise FileExistsError(
            f"sok_keras: '{path}' exists and overwrite=False.")
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    stem, ext = os.path.splitext(base)
    target = os.path.join(folder, f".{stem}.sok-tmp-{os.getpid()}{ext}")
    error = None
    try:
        # Collectives first (every rank), then rank 0 writes alone.
        with gathered_for_saving(_tables(model)):
            if rank == 0:
                original(model, target, overwrite=True, **kwargs)
    except Exception as e:  # reported to every rank below
        error = e
    failed = _agree("save/done", int(error is not None), world.timeout())
    try:
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(
                f"sok_keras: model.save('{path}') failed on another rank "
                f"({failed} of {n}); its error is in that rank's output. "
                "The file was not changed.")
        if rank == 0:
            os.replace(target, path)
        _agree("save/renamed", 1, world.timeout())
    finally:
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
    return None


def install():
    """Routes `keras.Model.save` through `save_model` (idempotent)."""
    global _ORIGINAL_SAVE
    import keras

    if _ORIGINAL_SAVE is not None:
        return
    _ORIGINAL_SAVE = keras.Model.save

    @functools.wraps(_ORIGINAL_SAVE)
    def save(self, filepath, overwrite=True, **kwargs):
        return save_model(self, filepath, overwrite=overwrite, **kwargs)

    save._sok_keras = True
    keras.Model.save = save
