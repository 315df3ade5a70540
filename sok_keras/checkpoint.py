"""Sharded checkpoints: `sok.dump` / `sok.load`, loadable at any number of
ranks.

A checkpoint is a folder (any `tf.io.gfile` path, shared by every rank):

```
path/
  manifest.json        the commit point, written last by rank 0
  data-<token>/        one folder per successful dump
    t<i>-r<r>.bin      table i's rows held by saving rank r (+ its slots)
    dense.bin          replicated weights and optimizer variables (rank 0)
```

Every `.bin` file is a 32-byte header (magic, format version, block size,
payload size, header CRC) followed by the payload: raw little-endian rows
in the rank's local order (row `k` of rank `r` of a distributed table is
global id `r + k * N`), one entry after the other. The manifest lists, per
file, its payload size, its block size and one CRC-32 per block (1 MiB),
so a loader that reads some rows verifies exactly the blocks it reads.

Dump: every rank checks in, writes its own shards (in 4 MiB chunks; a
table never has to be gathered), rank 0 writes `dense.bin`; the ranks agree
on the outcome; only then rank 0 writes `manifest.json` (temporary name,
then a rename) and removes the folder the previous manifest named and
leftovers of failed dumps (not folders changed in the 10 minutes before
the dump started: another job's dump in progress). A dump that fails or
is killed leaves the previous manifest, and the folder it names,
untouched; the new folder has no manifest and is never read.

Load: every rank reads and checks the manifest (format, version, paths,
tables / shapes / dtypes / slots / dense weights against the model, file
sizes and headers) before allocating, then reads only the blocks holding
rows it will own (in bounded chunks) into staging arrays, verifying their
CRCs. The ranks agree; only if every rank succeeded is anything assigned
(chunk by chunk), so either every rank loads everything or every rank
raises and nothing changed. Nothing from a checkpoint is executed (JSON and
raw arrays only), and manifest file names are plain names inside the
folder. See docs/checkpoints.md.
"""

import json
import logging
import os
import re
import secrets
import struct
import sys
import time
import warnings
import zlib

import numpy as np
import tensorflow as tf

from sok_keras import world
from sok_keras.variable import DISTRIBUTED
from sok_keras.variable import Variable
from sok_keras.variable import dense_reads
from sok_keras.variable import parse_mode
from sok_keras.variable import shard_rows
from sok_keras.variable import slice_rows

FORMAT = "sok_keras.checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BLOCK_BYTES = 1 << 20
CHUNK_BYTES = 4 << 20
MAX_MANIFEST_BYTES = 256 << 20
_MAGIC = b"SOKCKPT1"
_HEADER = struct.Struct("<8sIIQ")  # magic, version, block bytes, payload
_HEADER_BYTES = 32  # _HEADER + its CRC-32, zero-padded
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_DATA_RE = re.compile(r"^data-[0-9a-f]{1,32}$")
_TMP_RE = re.compile(r"^manifest\.json\.tmp-[0-9a-f]{12}$")
# An unnamed data folder changed within this long before a dump started
# may be another job's dump in progress; the dump does not remove it.
_IN_PROGRESS_S = 600.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked (the message
    names the file, the table and what was expected)."""


# -- small helpers ----------------------------------------------------------
def _join(folder, name):
    return folder.rstrip("/") + "/" + name


def _is_local(path):
    return "://" not in path


def _dtype(name, where):
    """The NumPy dtype of a dtype name from a manifest (no object types)."""
    if not isinstance(name, str):
        raise CheckpointError(f"{where}: dtype {name!r} is not a name.")
    try:
        dt = tf.dtypes.as_dtype(name)
        np_dt = np.dtype(dt.as_numpy_dtype)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: unknown dtype {name!r}.") from None
    if np_dt.hasobject or np_dt.itemsize == 0:
        raise CheckpointError(f"{where}: unsupported dtype {name!r}.")
    return np_dt


def _std_dtype(var):
    return tf.dtypes.as_dtype(var.dtype).name


def _agree(what, value, timeout=None):
    return world.control_communicator().agree(
        what, value, world.timeout() if timeout is None else timeout)


def _failed_ranks(what, error):
    """Every rank learns which ranks failed (an empty list if none)."""
    n, rank = world.num_ranks(), world.rank()
    if n <= 62:
        mask = _agree(what, (1 << rank) if error is not None else 0)
        return [r for r in range(n) if mask >> r & 1]
    count = _agree(what, int(error is not None))
    return ["?"] * count


def _outcome(what, error, message):
    """Raises on every rank if any rank failed: its own error where it
    failed, `message` naming the failed ranks elsewhere."""
    failed = _failed_ranks(what, error)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"{message} failed on rank(s) {failed} (the error is in that "
            "rank's output).")


def checked_path(path, what):
    """`os.fspath(path)`, or a TypeError naming `what` and the value."""
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(
            f"{what}: `path` must be a str or an os.PathLike (a folder). "
            f"Received: path={path!r}.") from None


def _enter(what, path):
    from sok_keras import saving

    n = world.num_ranks()
    try:
        _agree(f"ckpt/{what}/enter", 1, saving.save_timeout())
    except tf.errors.OpError as e:
        raise CheckpointError(
            f"sok_keras.{what}('{path}') must be called on every rank ({n} "
            f"ranks), but not all of them called it within "
            f"{saving.save_timeout():g} s (SOK_SAVE_TIMEOUT): a rank "
            "skipped it, or is that late (raise SOK_SAVE_TIMEOUT if ranks "
            "reach it minutes apart).") from e


# -- what to save: tables, slots, dense weights, optimizer variables --------
def _collect(model_or_variables, optimizer, fn):
    """`(tables, dense, optimizer)`: sok tables (not slots) and the other
    variables by path, in order."""
    import keras

    if isinstance(model_or_variables, keras.Model):
        variables = list(model_or_variables.variables)
        compiled = getattr(model_or_variables, "optimizer", None)
        if optimizer is None or optimizer is getattr(
                compiled, "inner_optimizer", None):
            # The plain optimizer `compile` wrapped stands for its wrapper,
            # which holds the model's optimizer state.
            optimizer = compiled
    elif isinstance(model_or_variables, (list, tuple)):
        variables = list(model_or_variables)
    else:
        raise TypeError(
            f"sok_keras.{fn}: `model_or_variables` must be a keras.Model or "
            "a list of variables. Received: "
            f"{type(model_or_variables).__name__}.")
    if optimizer is not None and not isinstance(
            optimizer, keras.optimizers.Optimizer):
        from sok_keras.optimizers.wrapper import keras2_hint

        raise TypeError(
            f"sok_keras.{fn}: `optimizer` must be a keras optimizer or None. "
            f"Received: {type(optimizer).__name__}.{keras2_hint(optimizer)}")
    slot_ids = set()
    for v in variables:
        if isinstance(v, Variable):
            slot_ids |= {id(s) for s in v.slots.values()}
    tables, dense, seen = [], [], set()
    for v in variables:
        if id(v) in slot_ids or id(v) in seen:
            continue
        seen.add(id(v))
        (tables if isinstance(v, Variable) else dense).append(v)
    _check_unique([t.path for t in tables], "table", fn)
    _check_unique([_name(v) for v in dense], "variable", fn)
    for t in tables:
        if t.replica_shards is not None:
            raise NotImplementedError(
                f"sok_keras.{fn}: table '{t.path}' is sharded over the "
                f"{t.num_ranks} replicas of a MirroredStrategy; sharded "
                "checkpoints hold one file per process rank. Use "
                "`model.save` / `keras.models.load_model` (or "
                "`save_weights` / `load_weights`) under the strategy.")
    return tables, dense, optimizer


def _is_variable(v):
    import keras

    return isinstance(v, (tf.Variable, keras.Variable))


def _name(v):
    """A variable's name in a checkpoint: a Keras variable's path, a plain
    `tf.Variable`'s name (less `:0`)."""
    path = getattr(v, "path", None)
    if path is not None:
        return path
    name = v.name
    return name[:-2] if name.endswith(":0") else name


def _slot_prefix(v):
    """The start of the names Keras gives `v`'s optimizer slots
    (`add_variable_from_reference`)."""
    path = getattr(v, "path", None)
    if path is not None:
        return path.replace("/", "_") + "_"
    return str(v.name).replace("/", "_").replace(":", "_") + "_"


def _check_unique(names, what, fn):
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CheckpointError(
            f"sok_keras.{fn}: several {what}s share the path(s) {dup}; a "
            "checkpoint keys them by path (give the layers distinct names).")


# An optimizer's own step count and learning rate (nobody's slots).
_STEP_VARIABLES = ("iteration", "learning_rate")
# A table's own optimizer's state: those, and Nadam's momentum schedule
# (`sparse_rules._Nadam.prepare`).
_TABLE_OPTIMIZER_STATE = _STEP_VARIABLES + ("u_product",)


def _optimizer_variables(optimizer, other=None, unbuilt=False):
    """The optimizer's own variables (not a table's slots) to save or load.
    With `other` (`_others_slots`: `dump(path, [vars], optimizer)`), the
    slots of variables it trains that are not in the list are left out, as
    those variables are: the same list then loads into a fresh optimizer
    built for it alone. Keras' own slots of a table (a plain optimizer's)
    are the table's slots (`_keras_table_slots`), not replicated state. An
    optimizer not built yet has none but its step count and learning rate
    (taken with `unbuilt`: `load` of tables alone, `_prepare`)."""
    if optimizer is None or not (optimizer.built or unbuilt):
        return []
    tables = _keras_table_slots(optimizer)
    out = [v for v in optimizer.variables
           if not isinstance(v, Variable) and id(v) not in tables]
    if other is not None:
        out = [v for v in out if not other(v.path)]
    _check_unique([_optimizer_key(optimizer, v.path) for v in out],
                  "optimizer variable", "dump")
    return out


def _others_slots(optimizer, model_or_variables):
    """With a list of variables, `_slot_of_other_variable` for it; None for
    a model (all of its variables are saved)."""
    import keras

    if optimizer is None or isinstance(model_or_variables, keras.Model):
        return None
    return _slot_of_other_variable(optimizer, list(model_or_variables))


def _slot_of_other_variable(optimizer, given):
    """A predicate on an optimizer variable's path: whether it is the slot
    of a variable the optimizer trains that is not in `given`. Keras names
    a slot after its variable (`add_variable_from_reference`:
    `<optimizer>/<variable path, '/' as '_'>_<slot>`); the longest such
    prefix names the slot's variable. The step count and learning rate
    are nobody's slots."""
    from sok_keras.optimizers.sparse_rules import optimizer_chain

    refs = []
    for opt in optimizer_chain(optimizer):
        refs += list(getattr(opt, "_trainable_variables", None) or [])
    kept = {id(v) for v in given}
    prefixes = sorted(((_slot_prefix(v), id(v) in kept) for v in refs),
                      key=lambda p: -len(p[0]))

    def other(path):
        leaf = path.rsplit("/", 1)[-1]
        if leaf in _STEP_VARIABLES:
            return False
        for prefix, is_kept in prefixes:
            if leaf.startswith(prefix):
                return not is_kept
        return False

    return other


def _table_optimizer_variables(tables):
    """`(key, variable)`: the step count and learning rate (and Nadam's
    schedule) of each table's own optimizer (a layer's `optimizer=`),
    keyed by the table's path. They are neither the model's variables nor
    its optimizer's, and Adam's bias correction and learning-rate
    schedules read the step count."""
    out, seen = [], set()
    for t in tables:
        opt = t.optimizer
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        for v in opt.variables:
            leaf = v.path.rsplit("/", 1)[-1]
            if not isinstance(v, Variable) and leaf in _TABLE_OPTIMIZER_STATE:
                out.append((f"{t.path}:{leaf}", v))
    return out


def _without_wrapper_own(optimizer, saved):
    """`saved` (a manifest's optimizer variables) less the step count and
    learning rate an `OptimizerWrapper` of an earlier version saved for
    itself (first, under its own name), which it no longer has. Only for
    an `OptimizerWrapper`: other wrappers (Keras' `LossScaleOptimizer`,
    under `mixed_float16`) have their own step count and learning rate
    (QA: a dump of such a model did not load into it)."""
    from sok_keras.optimizers.wrapper import OptimizerWrapper

    inner = getattr(optimizer, "inner_optimizer", None)
    if (not isinstance(optimizer, OptimizerWrapper) or inner is None
            or len(saved) < 2):
        return saved
    heads = [d["name"].split("/") for d in saved[:2]]
    if ([h[-1] for h in heads] == ["iteration", "learning_rate"]
            and all(len(h) == 2 and h[0] == heads[0][0]
                    and _unnumbered(h[0]) != _unnumbered(inner.name)
                    for h in heads)):
        return saved[2:]
    return saved


def _optimizer_key(optimizer, path):
    """The name a checkpoint keys an optimizer variable by: its path, less
    the `OptimizerWrapper`'s name before the wrapped optimizer's own
    (`optimizer_wrapper/adam/d_kernel_momentum` -> `adam/...`). Keras
    builds the wrapped optimizer's slots under the wrapper's name in a
    model's first step, but under its own when a loaded model restores them
    (`load_model`), so the same model would otherwise key them two ways."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        # Under any wrapper's name: the optimizer compiled again is wrapped
        # anew (`optimizer_wrapper_2`), its slots keep the first's.
        parts = path.split("/")
        if len(parts) > 2 and parts[1] == inner.name:
            return "/".join(parts[1:])
    return path


def _unnumbered(path):
    """`path` without Keras' uniquifying `_<n>` suffixes
    (`adam_1/dense_2_kernel_momentum` -> `adam/dense_kernel_momentum`)."""
    return re.sub(r"_\d+(?=[/_]|$)", "", path)


def _match_names(saved, current, subset=False):
    """Which saved name each current variable loads from, or None.

    By name when the names are the same (or, with `subset`, when every
    current name is saved: a list of variables given to `load` may hold
    some of the checkpoint's, as SOK's `load` reads each by its name);
    else by position when the two lists differ only in Keras' numbering
    (the same model built again in one process:
    `distributed_embedding_1`, `optimizer_wrapper_1`, ...), as Keras' own
    `load_weights` matches by structure. Shapes and dtypes are checked
    after.
    """
    unique = len(set(saved)) == len(saved)
    if sorted(saved) == sorted(current) and unique:
        return {name: name for name in current}
    if subset and unique and set(current) <= set(saved):
        return {name: name for name in current}
    if len(saved) == len(current) and (
            [_unnumbered(s) for s in saved]
            == [_unnumbered(c) for c in current]):
        return dict(zip(current, saved))
    return None


def _slots_of(table, optimizer):
    """`optimizer`'s slots of the table, by name (none when there is no
    optimizer): the sok slots its sparse rule updates, else Keras' own
    slots of the table (a plain Keras optimizer, SOK's raw-loop way)."""
    if optimizer is None:
        return {}
    from sok_keras.optimizers.sparse_rules import slot_owner

    slots = table.slots_of(slot_owner(optimizer, table))
    if not slots:
        slots = {name: s for s, t, name in
                 _keras_table_slots(optimizer).values() if t is table}
    return {k: slots[k] for k in sorted(slots)}


def _keras_table_slots(optimizer):
    """`{id(slot): (slot, table, slot name)}`: the variables a Keras
    optimizer (or one it wraps) made for a sok table it trains as a dense
    variable (`add_variable_from_reference`: `<table path, '/' as
    '_'>_<slot>`, the table's local shape). Each rank's hold the rows of
    its own shard, so they are saved and re-sharded with the table, as
    sok's slots are."""
    from sok_keras.optimizers.sparse_rules import optimizer_chain

    out = {}
    for opt in optimizer_chain(optimizer):
        refs = list(getattr(opt, "_trainable_variables", None) or [])
        prefixes = sorted(((_slot_prefix(v), v) for v in refs),
                          key=lambda p: -len(p[0]))
        for s in getattr(opt, "_variables", None) or []:
            if isinstance(s, Variable):
                continue
            leaf = s.path.rsplit("/", 1)[-1]
            for prefix, ref in prefixes:
                if leaf.startswith(prefix) and len(leaf) > len(prefix):
                    if (isinstance(ref, Variable)
                            and tuple(s.shape) == tuple(ref.shape)):
                        out[id(s)] = (s, ref, leaf[len(prefix):])
                    break
    return out


# -- writing ----------------------------------------------------------------
class _BlockWriter:
    """Writes a `.bin` file: header, then payload with a CRC per block."""

    def __init__(self, path, payload_bytes, block_bytes):
        self.path, self.tmp = path, path + ".tmp"
        self.block, self.expected = block_bytes, payload_bytes
        self.crcs, self.crc, self.filled, self.written = [], 0, 0, 0
        self.f = tf.io.gfile.GFile(self.tmp, "wb")
        head = _HEADER.pack(_MAGIC, FORMAT_VERSION, block_bytes,
                            payload_bytes)
        head += struct.pack("<I", zlib.crc32(head))
        self.f.write(head.ljust(_HEADER_BYTES, b"\0"))

    def write(self, array):
        data = np.ascontiguousarray(array).tobytes()  # GFile takes bytes
        self.f.write(data)
        data = memoryview(data)
        self.written += len(data)
        pos = 0
        while pos < len(data):
            take = min(len(data) - pos, self.block - self.filled)
            self.crc = zlib.crc32(data[pos:pos + take], self.crc)
            self.filled += take
            pos += take
            if self.filled == self.block:
                self.crcs.append(self.crc)
                self.crc, self.filled = 0, 0

    def close(self):
        if self.filled:
            self.crcs.append(self.crc)
        self.f.close()
        if self.written != self.expected:
            raise CheckpointError(
                f"'{self.path}': wrote {self.written} bytes, expected "
                f"{self.expected}.")
        tf.io.gfile.rename(self.tmp, self.path, overwrite=True)
        return {"payload_bytes": self.written, "block_bytes": self.block,
                "block_crc32": self.crcs}


def _rows_per_chunk(row_bytes):
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def _write_shard_file(path, variables):
    """Writes `[(entry, variable)]`'s local values (in chunks of rows)."""
    entries, offset = {}, 0
    for name, var in variables:
        shape = [int(s) for s in var.shape]
        dt = np.dtype(tf.dtypes.as_dtype(var.dtype).as_numpy_dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        entries[name] = {"offset": offset, "nbytes": nbytes,
                         "dtype": _std_dtype(var), "shape": shape}
        offset += nbytes
    w = _BlockWriter(path, offset, BLOCK_BYTES)
    try:
        for name, var in variables:
            # (A Keras variable's `value` is a property, a tf.Variable's a
            # method; the tf.Variable slices itself.)
            value = var if isinstance(var, tf.Variable) else var.value
            shape = entries[name]["shape"]
            if len(shape) >= 1 and shape[0] > 0:
                row_bytes = entries[name]["nbytes"] // shape[0]
                step = _rows_per_chunk(row_bytes)
                for a in range(0, shape[0], step):
                    w.write(np.asarray(slice_rows(
                        value, a, min(a + step, shape[0])).numpy()))
            elif entries[name]["nbytes"]:
                w.write(np.asarray(tf.convert_to_tensor(value).numpy()))
        record = w.close()
    except BaseException:
        w.f.close()
        if tf.io.gfile.exists(w.tmp):
            tf.io.gfile.remove(w.tmp)
        raise
    record["entries"] = entries
    return record


def dump(path, model_or_variables, optimizer=None, metadata=None):
    """Writes a sharded checkpoint of a model or of variables.

    Every rank must call it. Each rank writes the rows of every table (and
    of its optimizer slots) that it holds, in bounded chunks; rank 0
    writes the replicated weights and the optimizer's own variables (step
    counts included) and, once every rank has succeeded, `manifest.json`
    (atomically, last). A dump that fails on any rank raises on every rank
    and leaves an earlier checkpoint at `path` as it was. The checkpoint
    loads at any number of ranks with `sok_keras.load`. `path` is a folder
    reachable by every rank (any `tf.io.gfile` path).

    Args:
        path: the checkpoint folder (created if needed).
        model_or_variables: a `keras.Model` (its sok tables, their slots and
            its other variables), a list of variables or one variable.
        optimizer: the optimizer whose state to save. Defaults to
            `model.optimizer` for a model (the plain optimizer given to
            `compile`, which wrapped it, stands for `model.optimizer` too);
            optimizer state is saved only if
            the optimizer is built. With a list of variables, the state
            saved is the listed variables' (and the step count): the slots
            of other variables the optimizer trains are left out, as
            those variables are.
        metadata: optional JSON-serializable dict stored in the manifest
            (`manifest["metadata"]`; rank 0's is kept), e.g. the epoch.

    Returns:
        The manifest (a dict).

    Example:

    ```python
    sok.dump("/ckpt/step_1000", model)   # on every rank
    sok.load("/ckpt/step_1000", model)   # at any number of ranks
    ```
    """
    path = checked_path(path, "sok_keras.dump")
    if _is_variable(model_or_variables):  # SOK: "a single or a list"
        model_or_variables = [model_or_variables]
    tables, dense, optimizer = _collect(model_or_variables, optimizer, "dump")
    opt_vars = _optimizer_variables(
        optimizer, _others_slots(optimizer, model_or_variables))
    table_opt_vars = _table_optimizer_variables(tables)
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(
                "sok_keras.dump: `metadata` must be a dict or None. "
                f"Received: {type(metadata).__name__}.")
        metadata = json.loads(json.dumps(metadata))  # JSON only
    n, rank = world.num_ranks(), world.rank()
    _enter("dump", path)
    started = time.time()
    # Every rank must describe the same tables.
    sig = zlib.crc32(json.dumps(
        [[t.path, list(t.global_shape), t.mode, _std_dtype(t),
          sorted(_slots_of(t, optimizer))] for t in tables]).encode())
    total = _agree("ckpt/dump/tables", sig)
    token = _agree("ckpt/dump/token",
                   secrets.randbits(48) if rank == 0 else 0)
    data_name = f"data-{token:012x}"
    data_dir = _join(path, data_name)
    error, record = None, {"rank": rank, "files": {}}
    try:
        if total != n * sig:
            raise CheckpointError(
                f"sok_keras.dump('{path}'): the ranks hold different tables "
                "(paths, shapes, modes, dtypes or slots differ).")
        tf.io.gfile.makedirs(data_dir)
        for i, t in enumerate(tables):
            if int(t.shape[0]) == 0:
                continue
            name = f"t{i}-r{rank}.bin"
            entries = [("value", t)] + [
                (f"slot/{k}", s) for k, s in _slots_of(t, optimizer).items()]
            record["files"][name] = _write_shard_file(
                _join(data_dir, name), entries)
        if rank == 0 and (dense or opt_vars or table_opt_vars):
            entries = [(f"model/{_name(v)}", v) for v in dense]
            entries += [(f"optimizer/{_optimizer_key(optimizer, v.path)}", v)
                        for v in opt_vars]
            entries += [(f"table_optimizer/{k}", v)
                        for k, v in table_opt_vars]
            record["files"]["dense.bin"] = _write_shard_file(
                _join(data_dir, "dense.bin"), entries)
        _write_json(_join(data_dir, f"rank-{rank}.json"), record)
    except Exception as e:  # reported to every rank below
        error = e
    try:
        _outcome("ckpt/dump/written", error, f"sok_keras.dump('{path}')")
    except BaseException:
        _remove_own(data_dir, rank, record)
        raise
    error, manifest = None, None
    if rank == 0:
        try:
            manifest = _commit(path, data_dir, data_name, tables, dense,
                               opt_vars, optimizer, n, metadata,
                               table_opt_vars, started)
        except Exception as e:
            error = e
    try:
        _outcome("ckpt/dump/committed", error,
                 f"sok_keras.dump('{path}'): writing the manifest")
    except BaseException:
        _remove_own(data_dir, rank, record)
        raise
    if manifest is None:
        manifest = _read_manifest(path)
    return manifest


def _write_json(path, obj):
    # A name of its own: two jobs may write one folder's manifest at once.
    tmp = f"{path}.tmp-{secrets.token_hex(6)}"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(json.dumps(obj, sort_keys=True))
    tf.io.gfile.rename(tmp, path, overwrite=True)


def _remove_tree(folder):
    try:
        if tf.io.gfile.exists(folder):
            tf.io.gfile.rmtree(folder)
    except tf.errors.OpError:
        pass


def _remove_own(data_dir, rank, record):
    """After a failed dump: rank 0 removes the new data folder; every rank
    removes the files it wrote itself (a rank whose folder rank 0 does not
    see keeps none), and its folder if that is then empty."""
    if rank == 0:
        _remove_tree(data_dir)
        return
    for name in list(record["files"]) + [f"rank-{rank}.json"]:
        try:
            if tf.io.gfile.exists(_join(data_dir, name)):
                tf.io.gfile.remove(_join(data_dir, name))
        except tf.errors.OpError:
            pass
    try:
        if (tf.io.gfile.exists(data_dir)
                and not tf.io.gfile.listdir(data_dir)):
            tf.io.gfile.rmtree(data_dir)  # (empty)
    except tf.errors.OpError:
        pass


def _commit(path, data_dir, data_name, tables, dense, opt_vars, optimizer,
            n, metadata=None, table_opt_vars=(), started=None):
    """Rank 0: the manifest from every rank's record, written last; then
    the removal of older data folders (`_remove_older`)."""
    files = {}
    if not tf.io.gfile.exists(data_dir):
        raise CheckpointError(
            f"sok_keras.dump('{path}'): this dump's data folder "
            f"'{data_dir}' was removed while the ranks wrote it: another job "
            "dumping into the same folder at the same time? Give each job "
            "its own folder.")
    for r in range(n):
        rec_path = _join(data_dir, f"rank-{r}.json")
        if not tf.io.gfile.exists(rec_path):
            raise CheckpointError(
                f"sok_keras.dump('{path}'): rank {r} wrote its rows, but "
                f"its record '{rec_path}' is not in rank 0's folder: the "
                "ranks were given different folders, or one on a file "
                "system rank 0 does not share. Every rank must pass the "
                "same folder, on a file system every rank shares.")
        with tf.io.gfile.GFile(rec_path, "r") as f:
            rec = json.loads(f.read())
        files.update(rec["files"])
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "byteorder": sys.byteorder,
        "world_size": n,
        "data": data_name,
        "tables": [{
            "name": t.path,
            "shape": list(t.global_shape),
            "dtype": _std_dtype(t),
            "mode": t.mode,
            "slots": sorted(_slots_of(t, optimizer)),
            "files": [f"t{i}-r{r}.bin" if f"t{i}-r{r}.bin" in files else None
                      for r in range(n)],
        } for i, t in enumerate(tables)],
        "dense": [{"name": _name(v), "shape": [int(s) for s in v.shape],
                   "dtype": _std_dtype(v)} for v in dense],
        "optimizer": None if not opt_vars else {
            "class": type(optimizer).__name__,
            "iterations": int(optimizer.iterations.numpy()),
            "variables": [{"name": _optimizer_key(optimizer, v.path),
                           "shape": [int(s) for s in v.shape],
                           "dtype": _std_dtype(v)} for v in opt_vars],
        },
        "table_optimizers": [{"name": k,
                              "shape": [int(d) for d in v.shape],
                              "dtype": _std_dtype(v)}
                             for k, v in table_opt_vars],
        "files": files,
        "metadata": metadata,
    }
    manifest["manifest_crc32"] = _manifest_crc(manifest)
    tf.io.gfile.makedirs(path)
    previous = _previous_data(path)
    _write_json(_join(path, MANIFEST), manifest)  # the commit point
    # Committed: from here on, cleaning up is best effort (a failure must
    # not remove the folder the new manifest names).
    try:
        _remove_older(path, data_name, previous, started)
        for r in range(n):
            tf.io.gfile.remove(_join(data_dir, f"rank-{r}.json"))
    except tf.errors.OpError as e:
        logging.getLogger("sok_keras").warning(
            "sok_keras.dump('%s'): the checkpoint is complete, but removing "
            "older files failed: %s", path, e)
    return manifest


def _previous_data(path):
    """The data folder the manifest at `path` names (None if there is no
    readable manifest)."""
    try:
        with tf.io.gfile.GFile(_join(path, MANIFEST), "r") as f:
            name = json.loads(f.read()).get("data")
        return name if isinstance(name, str) else None
    except Exception:  # noqa: BLE001 - no manifest, or a damaged one
        return None


def _newest_change(folder):
    """The latest modification time (seconds) of `folder` and its files."""
    newest = tf.io.gfile.stat(folder).mtime_nsec
    for name in tf.io.gfile.listdir(folder):
        try:
            newest = max(newest, tf.io.gfile.stat(
                _join(folder, name.rstrip("/"))).mtime_nsec)
        except tf.errors.NotFoundError:
            pass
    return newest / 1e9


def _remove_older(path, data_name, previous, started):
    """After the commit: removes the data folder the previous manifest
    named, and any other `data-*` folder left by a dump that failed or was
    killed. A folder in which something changed less than `_IN_PROGRESS_S`
    before this dump started may be another job's dump in progress (two
    jobs dumping into one folder): it stays (a later dump removes it once
    it is old), since removing it would leave that job's manifest naming
    missing files."""
    cutoff = (time.time() if started is None else started) - _IN_PROGRESS_S
    for name in tf.io.gfile.listdir(path):
        name = name.rstrip("/")
        if _TMP_RE.match(name):  # a manifest a killed dump did not rename
            try:
                if tf.io.gfile.stat(_join(path, name)).mtime_nsec / 1e9 < (
                        cutoff):
                    tf.io.gfile.remove(_join(path, name))
            except tf.errors.NotFoundError:
                pass
            continue
        if not _DATA_RE.match(name) or name == data_name:
            continue
        folder = _join(path, name)
        try:
            if name == previous or _newest_change(folder) < cutoff:
                _remove_tree(folder)
        except tf.errors.NotFoundError:
            pass


def _manifest_crc(manifest):
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


# -- reading and checking ----------------------------------------------------
def _read_manifest(path):
    mpath = _join(path, MANIFEST)
    if not tf.io.gfile.exists(mpath):
        raise CheckpointError(
            f"'{mpath}': no checkpoint manifest (not a sok_keras checkpoint, "
            "or its dump did not finish).")
    size = tf.io.gfile.stat(mpath).length
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"'{mpath}': {size} bytes, larger than a manifest may be "
            f"({MAX_MANIFEST_BYTES}).")
    with tf.io.gfile.GFile(mpath, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"'{mpath}': not valid JSON ({e}).") from None
    _check_manifest(manifest, mpath)
    return manifest


def _need(cond, mpath, what):
    if not cond:
        raise CheckpointError(f"'{mpath}': malformed manifest: {what}.")


def _is_int(x, low=0):
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check_name(name, mpath, what):
    if not (isinstance(name, str) and _NAME_RE.match(name)
            and name not in (".", "..")):
        raise CheckpointError(
            f"'{mpath}': {what} {name!r} is not a plain file name inside the "
            "checkpoint folder (no '/', '..' or absolute paths); refusing to "
            "read it.")


def _check_manifest(m, mpath):
    _need(isinstance(m, dict), mpath, "not an object")
    _need(m.get("format") == FORMAT, mpath,
          f"'format' is {m.get('format')!r}, expected {FORMAT!r}")
    version = m.get("format_version")
    _need(_is_int(version, 1), mpath, "'format_version' is not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"'{mpath}': format version {version} is newer than this "
            f"sok_keras reads (expected at most {FORMAT_VERSION}); upgrade "
            "sok_keras to load it.")
    _need(m.get("manifest_crc32") == _manifest_crc(m), mpath,
          "its checksum does not match its content ('manifest_crc32')")
    if m.get("byteorder") != sys.byteorder:
        raise CheckpointError(
            f"'{mpath}': written on a {m.get('byteorder')}-endian machine; "
            f"this one is {sys.byteorder}-endian.")
    _need(_is_int(m.get("world_size"), 1), mpath, "'world_size'")
    n = m["world_size"]
    data = m.get("data")
    if not (isinstance(data, str) and _DATA_RE.match(data)):
        _check_name(data, mpath, "data folder")
        raise CheckpointError(
            f"'{mpath}': data folder {data!r} is not of the form data-<hex>.")
    files = m.get("files")
    _need(isinstance(files, dict), mpath, "'files' is not an object")
    for fname, rec in files.items():
        _check_name(fname, mpath, "file")
        where = f"file '{fname}'"
        _need(isinstance(rec, dict), mpath, where)
        _need(_is_int(rec.get("payload_bytes")), mpath,
              f"{where}: 'payload_bytes'")
        _need(_is_int(rec.get("block_bytes"), 1), mpath,
              f"{where}: 'block_bytes'")
        crcs = rec.get("block_crc32")
        blocks = -(-rec["payload_bytes"] // rec["block_bytes"])
        _need(isinstance(crcs, list) and len(crcs) == blocks
              and all(_is_int(c) for c in crcs), mpath,
              f"{where}: 'block_crc32' must hold {blocks} CRCs")
        entries = rec.get("entries")
        _need(isinstance(entries, dict), mpath, f"{where}: 'entries'")
        for ename, e in entries.items():
            w = f"{where}, entry '{ename}'"
            _need(isinstance(e, dict) and _is_int(e.get("offset"))
                  and _is_int(e.get("nbytes"))
                  and isinstance(e.get("shape"), list)
                  and all(_is_int(s) for s in e["shape"]), mpath, w)
            dt = _dtype(e.get("dtype"), f"'{mpath}', {w}")
            _need(int(np.prod(e["shape"], dtype=object)) * dt.itemsize
                  == e["nbytes"], mpath, f"{w}: nbytes does not match shape")
            _need(e["offset"] + e["nbytes"] <= rec["payload_bytes"], mpath,
                  f"{w}: reaches past the payload")
    tables = m.get("tables")
    _need(isinstance(tables, list), mpath, "'tables'")
    for t in tables:
        _need(isinstance(t, dict) and isinstance(t.get("name"), str), mpath,
              "a table without a name")
        w = f"table '{t['name']}'"
        _need(isinstance(t.get("shape"), list) and len(t["shape"]) == 2
              and all(_is_int(s) for s in t["shape"]), mpath, f"{w}: shape")
        _dtype(t.get("dtype"), f"'{mpath}', {w}")
        try:
            parse_mode(t.get("mode"), n, t["name"])
        except ValueError as e:
            raise CheckpointError(f"'{mpath}', {w}: {e}") from None
        _need(isinstance(t.get("slots"), list)
              and all(isinstance(s, str) for s in t["slots"]), mpath,
              f"{w}: slots")
        _need(isinstance(t.get("files"), list) and len(t["files"]) == n,
              mpath, f"{w}: 'files' must list {n} entries (one per rank)")
        for f in t["files"]:
            if f is not None:
                _check_name(f, mpath, f"{w}: file")
                _need(f in files, mpath, f"{w}: file '{f}' not in 'files'")
    for key in ("dense",):
        _need(isinstance(m.get(key), list), mpath, f"'{key}'")
    opt = m.get("optimizer")
    _need(opt is None or (isinstance(opt, dict)
                          and isinstance(opt.get("variables"), list)),
          mpath, "'optimizer'")
    table_opts = m.get("table_optimizers")  # (absent in older checkpoints)
    _need(table_opts is None or (isinstance(table_opts, list) and all(
        isinstance(d, dict) and isinstance(d.get("name"), str)
        for d in table_opts)), mpath, "'table_optimizers'")


class _FileReader:
    """Reads verified byte ranges of one `.bin` file."""

    def __init__(self, folder, name, rec, table):
        self.path = _join(folder, name)
        self.rec, self.table = rec, table
        self.f = None

    def where(self):
        kind = "variable" if self.path.endswith("dense.bin") else "table"
        return f"'{self.path}' ({kind} '{self.table}')"

    def check(self, root):
        """Existence, no symlink escape, size and header: before any
        allocation."""
        if not tf.io.gfile.exists(self.path):
            raise CheckpointError(
                f"{self.where()}: shard file missing; expected "
                f"{_HEADER_BYTES + self.rec['payload_bytes']} bytes.")
        if _is_local(self.path):
            real = os.path.realpath(self.path)
            if os.path.commonpath([real, root]) != root:
                raise CheckpointError(
                    f"{self.where()}: resolves to '{real}', outside the "
                    "checkpoint folder; refusing to read it.")
        size = tf.io.gfile.stat(self.path).length
        expected = _HEADER_BYTES + self.rec["payload_bytes"]
        if size != expected:
            raise CheckpointError(
                f"{self.where()}: {size} bytes on disk, expected {expected} "
                "(truncated or overwritten).")
        self.f = tf.io.gfile.GFile(self.path, "rb")
        head = self.f.read(_HEADER_BYTES)
        magic, version, block, payload = _HEADER.unpack_from(head)
        (crc,) = struct.unpack_from("<I", head, _HEADER.size)
        if magic != _MAGIC or crc != zlib.crc32(head[:_HEADER.size]):
            raise CheckpointError(
                f"{self.where()}: not a sok_keras shard file, or its header "
                "is corrupted.")
        if version > FORMAT_VERSION:
            raise CheckpointError(
                f"{self.where()}: format version {version} is newer than "
                f"this sok_keras reads (expected at most {FORMAT_VERSION}).")
        if (block, payload) != (self.rec["block_bytes"],
                                self.rec["payload_bytes"]):
            raise CheckpointError(
                f"{self.where()}: its header says {payload} payload bytes in "
                f"blocks of {block}, the manifest {self.rec['payload_bytes']}"
                f" in blocks of {self.rec['block_bytes']}.")

    def read(self, start, end):
        """Payload bytes `[start, end)`, every block they touch verified."""
        block = self.rec["block_bytes"]
        payload = self.rec["payload_bytes"]
        b0, b1 = start // block, -(-end // block)
        self.f.seek(_HEADER_BYTES + b0 * block)
        data = self.f.read(min(b1 * block, payload) - b0 * block)
        view = memoryview(data)
        for b in range(b0, b1):
            lo = (b - b0) * block
            got = zlib.crc32(view[lo:lo + block])
            if got != self.rec["block_crc32"][b]:
                raise CheckpointError(
                    f"{self.where()}: checksum mismatch in block {b} (bytes "
                    f"{b * block}..{min((b + 1) * block, payload)} of the "
                    f"payload): CRC-32 {got:#010x}, expected "
                    f"{self.rec['block_crc32'][b]:#010x}.")
        return view[start - b0 * block:end - b0 * block]

    def close(self):
        if self.f is not None:
            self.f.close()


def _old_ids(kind, n_old, r_old, lo, hi):
    local = np.arange(lo, hi, dtype=np.int64)
    return r_old + n_old * local if kind == DISTRIBUTED else local


def _new_local(kind, target, n_new, r_new, ids):
    """`(mask, local rows)` of the ids that this rank will own."""
    if kind == DISTRIBUTED:
        mask = ids % n_new == r_new
        return mask, ids[mask] // n_new
    if r_new != target:
        return np.zeros(ids.shape, bool), ids[:0]
    return np.ones(ids.shape, bool), ids


class _Plan:
    """One variable's destination: where its staged rows come from."""

    def __init__(self, var, entry, dtype, sources, rows, dim):
        self.var, self.entry, self.dtype = var, entry, dtype
        self.sources, self.rows, self.dim = sources, rows, dim
        self.staged = None


def _fail(mpath, what):
    raise CheckpointError(f"'{mpath}': {what}")


def _plan(path, manifest, tables, dense, optimizer, opt_vars, other=None,
          subset=False):
    """Checks the checkpoint against what is being loaded; returns the
    plans (nothing is allocated or read yet). `subset`: the tables and
    weights given may be some of the checkpoint's (a list of variables)."""
    mpath = _join(path, MANIFEST)
    n_old, n_new, r_new = manifest["world_size"], world.num_ranks(), \
        world.rank()
    folder = _join(path, manifest["data"])
    root = os.path.realpath(folder) if _is_local(folder) else None
    if root is not None and os.path.commonpath(
            [root, os.path.realpath(path)]) != os.path.realpath(path):
        _fail(mpath, f"data folder '{folder}' resolves outside the "
              "checkpoint folder; refusing to read it.")
    files = manifest["files"]
    readers = {}

    def reader(fname, table):
        if fname not in readers:
            readers[fname] = _FileReader(folder, fname, files[fname], table)
        return readers[fname]

    saved_names = [t["name"] for t in manifest["tables"]]
    names = [t.path for t in tables]
    saved_of = _match_names(saved_names, names, subset)
    if saved_of is None:
        absent = [nm for nm in names if nm not in saved_names]
        left = [nm for nm in saved_names if nm not in names]
        _fail(mpath, f"tables do not match: the checkpoint has "
              f"{sorted(saved_names)}, and {sorted(names)} were given "
              f"(not in the checkpoint: {absent}; in the checkpoint but not "
              f"given: {left}). "
              + ("A list of variables may hold some of the checkpoint's "
                 "tables, by name." if subset else
                 "A model loads all of its tables; to load some, give "
                 "`load` a list of those variables."))
    by_name = {t["name"]: t for t in manifest["tables"]}
    plans = []
    for t in tables:
        m = by_name[saved_of[t.path]]
        w = f"table '{t.path}'"
        if saved_of[t.path] != t.path:
            w += f" (saved as '{saved_of[t.path]}')"
        if tuple(m["shape"]) != tuple(t.global_shape):
            _fail(mpath, f"{w} has shape {tuple(m['shape'])} (vocabulary "
                  f"size, dim) in the checkpoint, expected "
                  f"{tuple(t.global_shape)}.")
        if m["dtype"] != _std_dtype(t):
            _fail(mpath, f"{w} has dtype {m['dtype']} in the checkpoint, "
                  f"expected {_std_dtype(t)}.")
        slots = _slots_of(t, optimizer)
        if optimizer is not None and sorted(slots) != sorted(m["slots"]):
            _fail(mpath, f"{w} has optimizer slots {sorted(m['slots'])} in "
                  f"the checkpoint, the optimizer {sorted(slots)}.")
        kind_old, target_old = parse_mode(m["mode"], n_old, t.path)
        rows, dim = int(t.shape[0]), int(t.global_shape[1])
        expected = shard_rows(t.global_shape[0], t.sharding, t.target_rank,
                              r_new, n_new)
        if rows != expected:
            _fail(mpath, f"{w}: this rank holds {rows} rows, expected "
                  f"{expected}.")
        dst = [("value", t)] + [(f"slot/{k}", s) for k, s in slots.items()]
        for ename, var in dst:
            # Slots keep their own dtype (float32 for a 16-bit table).
            want = m["dtype"] if ename == "value" else _std_dtype(var)
            dt = _dtype(want, f"'{mpath}', {w}")
            sources = []
            for r_old in range(n_old):
                old_rows = shard_rows(m["shape"][0], kind_old, target_old,
                                      r_old, n_old)
                fname = m["files"][r_old]
                if old_rows == 0:
                    continue
                if fname is None:
                    _fail(mpath, f"{w}: no file for rank {r_old}, which held "
                          f"{old_rows} rows.")
                e = files[fname]["entries"].get(ename)
                if e is None:
                    _fail(mpath, f"{w}: file '{fname}' has no entry "
                          f"'{ename}'.")
                if e["shape"] != [old_rows, dim] or e["dtype"] != want:
                    _fail(mpath, f"{w}: file '{fname}' entry '{ename}' is "
                          f"{e['dtype']}{e['shape']}, expected "
                          f"{want}{[old_rows, dim]}.")
                sources.append((reader(fname, t.path), e, kind_old, r_old))
            plans.append(_Plan(var, ename, dt, sources, rows, dim))
        for p in plans[-1 - len(slots):]:
            p.layout = (t.sharding, t.target_rank)
            p.old = (kind_old, target_old, n_old)
    dense_files = [f for f in files if f == "dense.bin"]

    def dense_plan(kind, want, have, key=lambda path: path, names=None,
                   subset=False):
        # Keyed by `key` on both sides (a checkpoint of an older version may
        # hold an optimizer variable under the wrapper's prefix), or by
        # `names` given for `want`.
        saved = [key(d["name"]) for d in have]
        have = dict(zip(saved, have))
        if names is None:
            names = [key(_name(v)) for v in want]
        saved_of = _match_names(saved, names, subset)
        if saved_of is None:
            absent = [nm for nm in names if nm not in have]
            left = [nm for nm in have if nm not in names]
            _fail(mpath, f"{kind} variables do not match: not in the "
                  f"checkpoint: {absent}; in the checkpoint but not "
                  f"given: {left}.")
        for v, name in zip(want, names):
            d = have[saved_of[name]]
            shape = [int(s) for s in v.shape]
            if d["shape"] != shape or d["dtype"] != _std_dtype(v):
                _fail(mpath, f"{kind} variable '{name}' is {d['dtype']}"
                      f"{d['shape']} in the checkpoint, expected "
                      f"{_std_dtype(v)}{shape}.")
            ename = f"{kind}/{d['name']}"
            e = files["dense.bin"]["entries"].get(ename) if dense_files \
                else None
            if e is None or e["shape"] != shape or e["dtype"] != d["dtype"]:
                _fail(mpath, f"'dense.bin' has no entry {ename!r} of "
                      f"{d['dtype']}{shape}.")
            p = _Plan(v, ename, _dtype(d["dtype"], mpath),
                      [(reader("dense.bin", _name(v)), e, None, 0)], None,
                      None)
            plans.append(p)

    dense_plan("model", dense, manifest["dense"], subset=subset)
    if optimizer is not None:
        if manifest["optimizer"] is None:
            if opt_vars:
                _fail(mpath, "holds no optimizer state, but an optimizer "
                      f"({type(optimizer).__name__}) was given.")
        else:
            saved = manifest["optimizer"]["variables"]
            if other is not None:  # (an older dump kept them)
                saved = [d for d in saved if not other(d["name"])]
            saved = _without_wrapper_own(optimizer, saved)
            dense_plan("optimizer", opt_vars, saved,
                       lambda path: _optimizer_key(optimizer, path))
    table_opt_vars = _table_optimizer_variables(tables)
    older = table_opt_vars and manifest.get("table_optimizers") is None
    if table_opt_vars and not older:
        dense_plan("table_optimizer", [v for _, v in table_opt_vars],
                   manifest["table_optimizers"],
                   names=[k for k, _ in table_opt_vars], subset=subset)
    if older:
        # A checkpoint written before they were saved has no such list:
        # said (once the rest is checked), not silent (QA: Adam's bias
        # correction restarted).
        warnings.warn(
            f"sok_keras: the checkpoint {path} was written by an older "
            "sok_keras and holds no step count or learning rate of the "
            "tables' own optimizers "
            f"({sorted({k.split(':')[0] for k, _ in table_opt_vars})}): they "
            "keep their current ones (a new optimizer's: step 0); the "
            "tables' slots are loaded.", stacklevel=3)
    return plans, readers, root


def _stage(plan, r_new, n_new):
    """Reads this rank's rows of `plan` into a new array (verified)."""
    if plan.rows is None:  # a replicated variable: the whole entry
        (rd, e, _, _), = plan.sources
        buf = rd.read(e["offset"], e["offset"] + e["nbytes"])
        plan.staged = np.frombuffer(buf, plan.dtype).reshape(
            e["shape"]).copy()
        return
    kind_new, target_new = plan.layout
    out = np.empty((plan.rows, plan.dim), plan.dtype)
    filled = 0
    row_bytes = plan.dim * plan.dtype.itemsize
    step = _rows_per_chunk(row_bytes)
    if plan.rows:
        for rd, e, kind_old, r_old in plan.sources:
            n_old = plan.old[2]
            for lo in range(0, e["shape"][0], step):
                hi = min(lo + step, e["shape"][0])
                ids = _old_ids(kind_old, n_old, r_old, lo, hi)
                mask, dst = _new_local(kind_new, target_new, n_new, r_new,
                                       ids)
                if not len(dst):
                    continue
                src = np.nonzero(mask)[0]
                first, last = int(src[0]), int(src[-1]) + 1
                buf = rd.read(e["offset"] + (lo + first) * row_bytes,
                              e["offset"] + (lo + last) * row_bytes)
                rows = np.frombuffer(buf, plan.dtype).reshape(-1, plan.dim)
                out[dst] = rows[src - first]
                filled += len(dst)
    if filled != plan.rows:
        raise CheckpointError(
            f"table '{_name(plan.var)}' ({plan.entry}): found {filled} of the "
            f"{plan.rows} rows this rank owns in the checkpoint.")
    plan.staged = out


def _assign(plan):
    var, value = plan.var, plan.staged
    if plan.rows is None or not plan.rows:
        var.assign(value)
        return
    target = var.value
    if not hasattr(target, "scatter_update"):
        var.assign(value)
        return
    # In place, chunk by chunk. (`target[a:b].assign` would copy the whole
    # variable every time: the slice's read shares its buffer.)
    step = _rows_per_chunk(plan.dim * plan.dtype.itemsize)
    for a in range(0, plan.rows, step):
        b = min(a + step, plan.rows)
        target.scatter_update(tf.IndexedSlices(
            value[a:b], tf.range(a, b, dtype=tf.int64)))
    dense_reads(target)


def _prepare(optimizer, model_or_variables):
    """Makes the state of an optimizer not built yet exist, to load into.

    For a model or a list with weights other than tables, the optimizer is
    built for its trainable variables (or the listed ones), as Keras' first
    `apply` does. For a list of tables alone with an optimizer of sok's
    sparse rules (SOK's `load(path, sok_vars, optimizer)`), only the
    tables' slots are made: the first step builds the optimizer for what
    it trains then (tables and dense weights). Returns whether the
    optimizer was left unbuilt.
    """
    import keras

    from sok_keras.optimizers import sparse_rules
    from sok_keras.optimizers.auto_wrap import is_sok_aware
    from sok_keras.optimizers.sparse_rules import optimizer_chain
    from sok_keras.optimizers.wrapper import build_once
    from sok_keras.optimizers.wrapper import create_table_slots

    if optimizer is None or optimizer.built:
        return False
    if isinstance(model_or_variables, keras.Model):
        variables = model_or_variables.trainable_variables
    else:
        variables = [v for v in model_or_variables if v.trainable]
    chain = optimizer_chain(optimizer)
    if (not isinstance(model_or_variables, keras.Model)
            and is_sok_aware(optimizer)
            and variables and all(isinstance(v, Variable) for v in variables)
            and not any(getattr(o, "skip_nonfinite", False) for o in chain)):
        create_table_slots(chain[-1], variables)
        # Optimizer-wide state the rule reads (Nadam's schedule), to load.
        sparse_rules.prepare_unbuilt(chain[-1], chain[0])
        return True
    build_once(optimizer, variables)  # as Keras' first `apply` does
    return False


def load(path, model_or_variables, optimizer=None):
    """Loads a checkpoint written by `sok_keras.dump`, at any number of ranks.

    Every rank must call it. Each rank reads only the rows it owns under
    the current sharding (re-sharding a checkpoint written at another
    number of ranks), verifying the checksum of every block it reads.
    Everything is checked on every rank — format version, file names,
    tables, shapes, dtypes, slots and dense weights against the model, file
    sizes (before anything is allocated) and checksums — and the ranks agree
    before any variable is assigned: either every rank loads everything, or
    every rank raises and nothing changed.

    Args:
        path: the checkpoint folder.
        model_or_variables: a `keras.Model` or a list of variables (or one
            variable), as given to `dump` (same table paths, shapes and
            dtypes). A list may hold some of the checkpoint's variables:
            each loads from the entry of its name (a model loads all).
        optimizer: the optimizer to restore. Defaults to `model.optimizer`
            for a model (the plain optimizer given to `compile` stands for
            it). An optimizer that is not built yet is built first
            (for the model's trainable variables, or the listed ones), so
            its slots exist; with a list, the slots of variables not in it
            are left as they are.

    Returns:
        The manifest (a dict).

    Raises:
        CheckpointError: naming the file, the table and what was expected,
            on a missing shard, a checksum mismatch, a newer format version,
            a mismatch with the model, or a malformed manifest.

    Example:

    ```python
    sok.dump("/ckpt/step_1000", model)   # e.g. on 2 ranks
    sok.load("/ckpt/step_1000", model)   # e.g. on 3 ranks
    ```
    """
    import keras

    path = checked_path(path, "sok_keras.load")
    if _is_variable(model_or_variables):  # SOK: "a single or a list"
        model_or_variables = [model_or_variables]
    tables, dense, optimizer = _collect(model_or_variables, optimizer, "load")
    _enter("load", path)
    unbuilt = _prepare(optimizer, model_or_variables)
    other = _others_slots(optimizer, model_or_variables)
    opt_vars = _optimizer_variables(optimizer, other, unbuilt)
    n_new, r_new = world.num_ranks(), world.rank()
    error, plans, readers = None, [], {}
    try:
        manifest = _read_manifest(path)
        plans, readers, root = _plan(
            path, manifest, tables, dense, optimizer, opt_vars, other,
            subset=not isinstance(model_or_variables, keras.Model))
        for rd in readers.values():  # sizes and headers, before allocating
            rd.check(root)
        for p in plans:
            _stage(p, r_new, n_new)
    except Exception as e:  # reported to every rank below
        error = e
    finally:
        for rd in readers.values():
            rd.close()
    _outcome("ckpt/load/read", error,
             f"sok_keras.load('{path}'): nothing was loaded; loading")
    # The same checkpoint on every rank (each reads its own rows of it).
    from sok_keras import global_views

    try:
        global_views.check_same_file(
            f"sok_keras.load('{path}')", "ckpt/load",
            (_manifest_crc(manifest) & 0x7FFFFFFF) or 1, path)
    except global_views.RankMismatchError as e:
        raise CheckpointError(f"{e} Nothing was loaded.") from None
    error = None
    try:
        for p in plans:
            _assign(p)
            p.staged = None
    except Exception as e:
        error = e
    _outcome("ckpt/load/assigned", error, f"sok_keras.load('{path}')")
    return manifest
