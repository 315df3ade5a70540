"""Global views on several ranks: global parameter counts, gathered
predictions, and a fast error when only some ranks make a collective call.

- `model.summary()`, `model.count_params()` and `layer.count_params()`
  count a sok table with its global shape (the whole table, not this
  rank's shard), and the summary ends with one line per sharded table
  giving the shard this rank holds. (Keras counts `variable.shape`; `install`
  makes its counting function count sok tables by `global_shape`.)
- `gather_predictions(y)` concatenates every rank's predictions in rank
  order (any number of rows per rank), as NumPy, on every rank.
- `check_in(what)`: a barrier with a short deadline (`SOK_SAVE_TIMEOUT`,
  default 60 s) that every collective entry point passes first
  (`model.save`, `fit` / `evaluate` / `predict` of a model with sok
  tables, `keras.saving.load_model` of a file holding sok layers,
  `model.load_weights`): a call made on some ranks only (`if sok.rank() ==
  0: model.predict(x)`) raises a clear error within that time instead of
  waiting for the communication timeout.
"""

import functools
import json
import os
import threading
import zipfile
import zlib

import numpy as np
import tensorflow as tf

from sok_keras import world

_DEFAULT_ENTER_TIMEOUT = 60.0
_INSTALLED = {}


def enter_timeout():
    """Seconds a rank waits for the others at a `check_in`
    (`SOK_SAVE_TIMEOUT`, default 60)."""
    # (As SOK_COMM_TIMEOUT's: at most a year. QA: `inf` was taken, and
    # each agreement's deadline thread then died of an OverflowError.)
    return world._float_env("SOK_SAVE_TIMEOUT", _DEFAULT_ENTER_TIMEOUT,
                            os.environ)


class RankMismatchError(RuntimeError):
    """A collective call was made on some ranks only (or differently)."""


def check_in(what, key=None):
    """Waits until every rank has called `check_in` for `what`.

    Every rank must make the same collective calls in the same order; this
    makes a call that only some ranks make fail fast and clearly.

    Args:
        what: the call, as the user wrote it (e.g. `"model.predict"`); the
            error names it.
        key: the agreement's key (defaults to `what`); the same on every
            rank.

    Raises:
        RankMismatchError: if some rank did not call it within
            `SOK_SAVE_TIMEOUT` seconds.

    Example:

    >>> sok.global_views.check_in("my_eval")  # on every rank
    """
    n = world.num_ranks()
    if n == 1:
        return
    timeout = enter_timeout()
    try:
        world.control_communicator().agree(
            f"enter/{key or what}", 1, timeout)
    except tf.errors.OpError as e:
        if "timed out" in str(e):
            why = (f"not all of them called it within {timeout:g} s "
                   f"(SOK_SAVE_TIMEOUT): a rank skipped it, or is more than "
                   f"{timeout:g} s late (its own work before the call, a "
                   "long callback: raise SOK_SAVE_TIMEOUT for that)")
        elif isinstance(e, tf.errors.UnavailableError):
            # A rank that exited (its script ended without the call) or
            # crashed: TensorFlow reports its tasks unreachable.
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = ("another rank is gone (it exited or crashed before "
                   f"calling it; TensorFlow: {first[:300]})")
        else:
            raise  # aborted for another reason (a failed peer): as it is
        raise RankMismatchError(
            f"sok_keras: rank {world.rank()}: {what} must be called on "
            f"every rank ({n} ranks), but {why}. Call it on every rank "
            "(e.g. not under `if sok.rank() == 0:`), before any rank "
            "exits; to use a result on one rank only, compute it "
            "everywhere and keep it where needed.") from e


# -- gathered predictions ---------------------------------------------------
def _signature(leaves):
    text = ";".join(f"{a.dtype.str}{list(a.shape[1:])}" for a in leaves)
    return zlib.crc32(text.encode("utf-8"))


def gather_predictions(predictions, batch_size=None, strided=False):
    """Every rank's predictions, concatenated in rank order.

    `model.predict` returns the predictions of this rank's examples; call
    this on every rank with its result to get those of every rank (rank
    0's rows first). Ranks may hold different numbers of rows. A
    collective: every rank must call it.

    Args:
        predictions: this rank's predictions: an array (rows first), or a
            list / tuple / dict of arrays (a multi-output model).
        batch_size: optional, the rows of each rank's slice of a global
            batch (`sok.shard_batches(ds)` over global batches of `B`
            gives each rank `B // N`). The rows then come back in the
            global batches' order, as one process would have predicted
            them: batch 0's rows of rank 0, rank 1, ..., then batch 1's.
            Every rank must hold the same number of rows, a multiple of
            `batch_size`.
        strided: if True, rank `r` predicted rows `x[r::N]` of arrays
            `x` (the README's NumPy recipe): the rows come back in the
            order of `x`, row `i` of rank `r` as row `i * N + r`. Rank `r`
            must hold `ceil((len(x) - r) / N)` rows. Not with `batch_size`.
            (`predict` itself must run as many steps on every rank: pick
            its `batch_size` so that the slices make as many batches.)

    Returns:
        The same structure of NumPy arrays holding every rank's rows in
        rank order (in batch order with `batch_size`, in the arrays' order
        with `strided=True`), on every rank.

    Raises:
        RankMismatchError: if not every rank calls it, or the ranks'
            predictions differ in structure, dtype or trailing shape.
        ValueError: with `batch_size`, if the ranks' row counts differ or
            are not a multiple of it; with `strided=True`, if they are not
            those of a strided split (on every rank alike).

    Example:

    ```python
    y = sok.gather_predictions(model.predict(x_of_this_rank))
    y = sok.gather_predictions(model.predict(sok.shard_batches(ds)),
                               batch_size=global_batch // sok.num_ranks())
    r, n = sok.rank(), sok.num_ranks()
    y = sok.gather_predictions(model.predict(x[r::n]), strided=True)
    ```
    """
    if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int)
            or batch_size < 1):
        raise ValueError(
            "sok_keras.gather_predictions: `batch_size` must be a positive "
            f"integer or None. Received: batch_size={batch_size!r}.")
    if not isinstance(strided, bool):
        raise TypeError(
            "sok_keras.gather_predictions: `strided` must be True or "
            f"False. Received: strided={strided!r}.")
    if strided and batch_size is not None:
        raise ValueError(
            "sok_keras.gather_predictions: pass `batch_size` (rows of "
            "sok.shard_batches' global batches) or `strided=True` (rows "
            "x[rank::N]), not both.")
    import keras

    leaves = [np.asarray(keras.ops.convert_to_numpy(x))
              for x in tf.nest.flatten(predictions)]
    for a in leaves:
        if a.ndim == 0:
            raise ValueError(
                "sok_keras.gather_predictions: every prediction needs a "
                f"rows dimension; got a scalar ({a!r}).")
    n = world.num_ranks()
    if n == 1:
        if batch_size is not None:
            _check_batches([a.shape[0] for a in leaves], batch_size)
        return tf.nest.pack_sequence_as(predictions, leaves)
    check_in("sok_keras.gather_predictions", "gather_predictions")
    comm = world.control_communicator()
    head = np.array([[len(leaves), _signature(leaves)]
                     + [a.shape[0] for a in leaves]], np.int64)
    sig = comm.all_gather(
        tf.constant(head[:, :2]), "gather_predictions/signature").numpy()
    if len({tuple(row) for row in sig}) != 1:
        raise RankMismatchError(
            f"sok_keras.gather_predictions: rank {world.rank()}: the ranks' "
            "predictions differ in structure, dtype or shape after the "
            f"rows dimension (rank {world.rank()}: "
            f"{[(a.dtype.name, a.shape[1:]) for a in leaves]}).")
    counts = comm.all_gather(
        tf.constant(head[:, 2:]), "gather_predictions/rows").numpy()
    if batch_size is not None:
        _check_batches(counts.ravel().tolist(), batch_size)
    if strided:
        _check_strided(counts)
    out = []
    for i, a in enumerate(leaves):
        rows = counts[:, i]
        most = int(rows.max())
        flat = a.reshape(a.shape[0], -1)
        padded = np.zeros((most, flat.shape[1]), a.dtype)
        padded[:a.shape[0]] = flat
        got = comm.all_gather(
            tf.convert_to_tensor(padded), "gather_predictions/values").numpy()
        got = got.reshape(n, most, flat.shape[1])
        if strided:
            whole = np.empty((int(rows.sum()), flat.shape[1]), a.dtype)
            for r in range(n):
                whole[r::n] = got[r, :rows[r]]
        elif batch_size is None:
            whole = np.concatenate([got[r, :rows[r]] for r in range(n)])
        else:  # [rank, batch, row] -> [batch, rank, row]
            whole = got.reshape(n, most // batch_size, batch_size, -1)
            whole = whole.transpose(1, 0, 2, 3)
        out.append(whole.reshape((-1,) + a.shape[1:]))
    return tf.nest.pack_sequence_as(predictions, out)


def _check_batches(counts, batch_size):
    """Every rank (and output) holds the same rows, whole batches of
    `batch_size`: else the same ValueError on every rank."""
    if len(set(counts)) != 1 or counts[0] % batch_size:
        raise ValueError(
            "sok_keras.gather_predictions: with batch_size="
            f"{batch_size}, every rank must hold the same number of rows, "
            f"a multiple of it. Received: rows per rank and output "
            f"{counts}.")


def _check_strided(counts):
    """`counts[r, i]`, rows of output `i` on rank `r`, are those of
    `x[r::N]` for one `len(x)` per output: else the same ValueError on
    every rank."""
    n = counts.shape[0]
    for rows in counts.T:
        total = int(rows.sum())
        want = [-(-(total - r) // n) for r in range(n)]
        if rows.tolist() != want:
            raise ValueError(
                "sok_keras.gather_predictions: with strided=True, rank r "
                "must hold the rows x[r::N] of one array x: for "
                f"{total} rows in all, {want} rows per rank. Received: "
                f"{rows.tolist()}.")


# -- global parameter counts ------------------------------------------------
def _shape(v):
    from sok_keras.variable import Variable

    return v.global_shape if isinstance(v, Variable) else v.shape


def _tables_of(model):
    from sok_keras import consistency

    try:
        return consistency.model_tables(model)
    except Exception:  # an unbuilt model
        return []


def _shard_note(model):
    """The lines the summary ends with: each table's shard on this rank."""
    tables = _tables_of(model)
    if not tables or world.num_ranks() == 1:
        return []
    rank, n = world.rank(), world.num_ranks()
    lines = [f" Sharded tables (params: global counts; rank {rank} of {n} "
             "holds):"]
    for t in tables:
        rows, dim = t.global_shape
        lines.append(
            f"   {t.path}: {rows * dim:,} params ({rows:,} x {dim}), "
            f"{int(np.prod(t.shape)):,} on this rank ({t.shape[0]:,} rows, "
            f"{t.mode})")
    return lines


# While `Model.summary` runs: (ids of the optimizer's own variables, the
# slots its sparse rules keep on the model's tables).
_SUMMARY = threading.local()


def _optimizer_and_slots(model):
    """What `summary` adds to Keras' "Optimizer params": the tables' slots
    (Adam's m and v of a table live on the table, not in
    `optimizer.variables`), at their global shapes."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not getattr(optimizer, "built", False):
        return None
    from sok_keras.optimizers.sparse_rules import slot_owner

    slots = [s for t in _tables_of(model)
             for _, s in sorted(t.slots_of(slot_owner(optimizer, t)).items())]
    if not slots:
        return None
    return frozenset(id(v) for v in optimizer.variables), slots


def _with_table_slots(weights):
    """`weights`, plus the tables' slots when they are the optimizer's
    variables that `summary` is counting."""
    current = getattr(_SUMMARY, "optimizer", None)
    if current is None:
        return weights
    ids, slots = current
    weights = list(weights)
    if {id(w) for w in weights} != ids:
        return weights
    return weights + slots


def install():
    """Makes Keras count sok tables by their global shape (and the slots
    on them as optimizer params), and adds the shard note to
    `Model.summary` (idempotent)."""
    if "summary" in _INSTALLED:
        return
    import math

    import keras
    from keras.src.utils import summary_utils

    original_count = summary_utils.count_params
    original_size = summary_utils.weight_memory_size

    @functools.wraps(original_count)
    def count_params(weights):
        weights = _with_table_slots(weights)
        return int(sum(math.prod(_shape(v)) for v in weights))

    @functools.wraps(original_size)
    def weight_memory_size(weights):
        from sok_keras.variable import Variable

        unique = {id(w): w for w in _with_table_slots(weights)}.values()
        total = 0
        for w in unique:
            total += summary_utils._compute_memory_size(
                tuple(_shape(w)) if isinstance(w, Variable) else w.shape,
                w.dtype)
        return total / 8

    count_params._sok_keras = weight_memory_size._sok_keras = True
    summary_utils.count_params = count_params
    summary_utils.weight_memory_size = weight_memory_size
    owner = next(c for c in keras.Model.__mro__ if "summary" in c.__dict__)
    original_summary = owner.summary

    @functools.wraps(original_summary)
    def summary(self, *args, **kwargs):
        _SUMMARY.optimizer = _optimizer_and_slots(self)
        try:
            result = original_summary(self, *args, **kwargs)
        finally:
            _SUMMARY.optimizer = None
        lines = _shard_note(self)
        if lines:
            print_fn = kwargs.get("print_fn")
            if print_fn is None and len(args) >= 3:
                print_fn = args[2]
            (print_fn or print)("\n".join(lines))
        return result

    owner.summary = summary
    _INSTALLED["summary"] = (summary_utils, original_count, original_size,
                             owner, original_summary)
    _install_set_weights()


def _install_set_weights():
    """`set_weights` of any layer or model refuses whole tables given for
    this rank's shards, naming the table, the shapes and `assign_global`
    (Keras' own error names the layer or model only)."""
    import keras

    from sok_keras.layers.base_embedding import check_shard_weights

    owner = next(c for c in keras.Model.__mro__
                 if "set_weights" in c.__dict__)
    original = owner.set_weights

    @functools.wraps(original)
    def set_weights(self, weights):
        check_shard_weights(self, weights)
        return original(self, weights)

    set_weights._sok_keras = True
    owner.set_weights = set_weights


# -- loads made on some ranks only -----------------------------------------
def _file_has_sok_layers(filepath):
    """Whether a `.keras` file's config names a sok_keras class."""
    try:
        with zipfile.ZipFile(filepath) as z:
            config = z.read("config.json").decode("utf-8")
    except (OSError, KeyError, zipfile.BadZipFile, TypeError):
        return False
    try:
        json.loads(config)
    except ValueError:
        return False
    return "sok_keras" in config


def file_fingerprint(path):
    """A number (1 to 2**31 - 1) that tells files apart: from the file's
    size and the CRC32 of its last 64 KiB (a `.keras` file's zip
    directory, which holds every member's CRC32); 0 for a path this
    process cannot read."""
    try:
        path = os.fspath(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - 65536))
            tail = f.read()
    except (OSError, TypeError):  # (TypeError: a file object)
        return 0
    return (zlib.crc32(tail, zlib.crc32(str(size).encode()))
            & 0x7FFFFFFF) or 1


def check_same_file(what, key, fingerprint, path,
                    unseen="one this rank cannot read"):
    """Raises `RankMismatchError` on every rank unless every rank's
    `fingerprint` of its `path` is the same: the ranks named different
    files (each rank would read its rows of its own), or one that some
    rank does not see (`unseen` says so in the message). Every rank must
    call it (one agreement)."""
    n = world.num_ranks()
    if n == 1:
        return
    total = world.control_communicator().agree(
        f"same_file/{key}", int(fingerprint), enter_timeout())
    if total != n * int(fingerprint):
        seen = (unseen if not fingerprint else
                f"fingerprint {fingerprint:#010x}, not every rank's")
        raise RankMismatchError(
            f"sok_keras: rank {world.rank()}: {what}: the ranks were not "
            f"given the same file: this rank's '{path}' is {seen}. Every "
            "rank must pass the same path, on a file system every rank "
            "shares (rank 0 writes; each rank reads its own rows).")


def install_load_checks():
    """Routes Keras' `.keras` loading through `check_in` when the file or
    model holds sok layers (several ranks; idempotent)."""
    if "load" in _INSTALLED:
        return
    from keras.src.saving import saving_lib

    from sok_keras.optimizers.auto_wrap import has_sok_layers

    original_load = saving_lib.load_model
    original_weights = saving_lib.load_weights_only

    @functools.wraps(original_load)
    def load_model(filepath, *args, **kwargs):
        if _file_has_sok_layers(filepath):
            what = f"keras.saving.load_model('{filepath}')"
            check_in(what, "load_model")
            check_same_file(what, "load_model", file_fingerprint(
                filepath), filepath)
        return original_load(filepath, *args, **kwargs)

    @functools.wraps(original_weights)
    def load_weights_only(model, filepath, *args, **kwargs):
        if has_sok_layers(model):
            what = f"model.load_weights('{filepath}')"
            check_in(what, "load_weights")
            check_same_file(what, "load_weights", file_fingerprint(
                filepath), filepath)
        return original_weights(model, filepath, *args, **kwargs)

    saving_lib.load_model = load_model
    saving_lib.load_weights_only = load_weights_only
    _INSTALLED["load"] = (saving_lib, original_load, original_weights)
