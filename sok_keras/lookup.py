"""Sharded embedding lookups: `lookup_sparse` and `all2all_dense_embedding`.

The exchange of K >= 1 tables on N ranks is one pipeline of stages (see
docs/design.md and the functions after `_owned_rows`), shared by one table,
fused tables and pooling on the owner:

1. `_dedup`: dedup the ids of this rank and bucket them by owning rank
   (`SokDedupBucketize`);
2. `_agree_counts`: agree on the counts with one small all-gather (which
   also carries the first out-of-range id, so that every rank raises the
   same error instead of one raising and the others waiting);
3. `_exchange_parts`: all-to-all the unique ids to their owners (several
   tables packed into one all-to-all with `SokGatherBlocks`);
4. `_owner_rows`: the owner dedups what it received and gathers each row
   once;
5. `_rows_back`: all-to-all the rows back; pool at home
   (`SokSegmentCombine`), or pool on the owner and send partial sums.

The backward pass is the mirror image: `SokSegmentCombineGrad` reduces the
gradient per unique id at home, the rows' gradient travels back through the
reverse all-to-all, and the owner's `tf.gather` turns it into a
`tf.IndexedSlices` over unique local rows. No rank ever sees every key.
With one rank there is no exchange at all.
"""

import collections
import os
import sys
import threading

import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope

from sok_keras import consistency
from sok_keras import lookup_ops
from sok_keras import _gradients
from sok_keras import replicas
from sok_keras import shard_reads
from sok_keras import world
from sok_keras._ops import ops
from sok_keras._ops import register_gradient_once
from sok_keras.variable import Variable
from sok_keras.variable import aliasing_read
from sok_keras._ops import not_converted as _not_converted
from sok_keras.comm import TraceCounter

SUPPORTED_COMBINERS = ("sum", "mean", "sqrtn")

# Each lookup of a table in the function being traced (`_call_site_key`).
_CALL_SITES = TraceCounter()
_COUNTER_LOCK = threading.Lock()
# The attribute of a graph that lists the outputs of the lookups traced
# into it (`_mark_lookup`). On the graph itself, not in a dictionary keyed
# by graphs: the tensors refer to their graph, so a WeakKeyDictionary's
# entries never died and kept every traced graph alive for good.
_GRAPH_LOOKUPS = "_sok_keras_lookup_outputs"


def _mark_lookup(out):
    """Records, in a graph, the output of a lookup (a tensor, a composite
    or a list of them); returns `out`. See `lookups_before_update`."""
    if not tf.executing_eagerly():
        flat = [t for t in tf.nest.flatten(out, expand_composites=True)
                if isinstance(t, tf.Tensor)]
        graph = tf.compat.v1.get_default_graph()
        with _COUNTER_LOCK:
            _gradients.graph_list(graph, _GRAPH_LOOKUPS).extend(flat)
    return out


def lookups_before_update():
    """The outputs of every lookup traced so far into the current graph and
    the graphs around it (a `tf.cond` branch's), for an optimizer's update
    to wait for.

    A lookup validates its ids before its output exists, and a bad id must
    stop the whole step: an update that waits for every lookup's output
    runs only when every table's ids were valid. Without it, a table whose
    gradient does not depend on a failing lookup (two tables whose results
    are added, as in a wide model) would still be updated. Empty eagerly,
    where a failing lookup raises before the update is reached.
    """
    if tf.executing_eagerly():
        return []
    out = []
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        with _COUNTER_LOCK:
            out.extend(getattr(graph, _GRAPH_LOOKUPS, ()))
        graph = getattr(graph, "outer_graph", None)
    return out


def _call_site_key(table_key):
    """A key that is the same on every rank for the same call site.

    Inside a `tf.function` each lookup of a table gets its own index within
    the outermost function being traced (a layer called twice in one step
    makes two exchanges; so do a lookup in a nested `tf.function` and one
    beside it, which share the outer function's step); eagerly, calls run
    one after another and can share a key.
    """
    index = _CALL_SITES.next(table_key)
    return f"{table_key}#{index or 0}"


def _check_table(param):
    if not isinstance(param, Variable):
        raise TypeError(
            "sok_keras lookups need a sok_keras.Variable. Received: "
            f"{type(param).__name__} {getattr(param, 'name', '')!r}."
        )
    if not tf.executing_eagerly():
        from tensorflow.python.ops import control_flow_util

        if control_flow_util.GraphOrParentsInXlaContext(
                tf.compat.v1.get_default_graph()):
            # Else XLA fails later with "No registered 'Sok...' OpKernel
            # for XLA_..._JIT", naming no table.
            raise ValueError(
                f"sok_keras: table '{getattr(param, 'path', None) or param.name}' "
                "is looked up inside an "
                "XLA-compiled function (`tf.function(jit_compile=True)`): "
                "the op library's kernels have no XLA form. Compile the "
                "function without `jit_compile`, or only its dense part "
                "(`model.compile(jit_compile=True)` does this: Keras "
                "leaves models with sok layers uncompiled). A model that "
                "makes its sok layers in `build()` shows none to "
                "`compile` until it is built: build it before `compile` "
                "(call it on a batch, or `model.build(input_shape)`), or "
                "compile it with `jit_compile=False`.")


def _table_key(param):
    _check_table(param)
    return param.path or param.name


class _Ids:
    """Ids of one feature, flattened: values, their batch row, weights."""

    def __init__(self, values, segment_ids, batch_size, weights, layout,
                 problem=None, positions=None):
        self.values = values  # int64 [nnz], padding removed
        # int64 [nnz]: the position of each value in the flat input (with
        # its padding), for errors that name an id's position.
        self.positions = positions
        self.segment_ids = segment_ids  # int64 [nnz]
        self.batch_size = batch_size  # int64 scalar tensor
        self.weights = weights  # float [nnz] or None
        # How to rebuild an unpooled output: ("dense", keep_mask, shape) /
        # ("ragged", kept positions, row_splits) / ("sparse", indices,
        # dense_shape).
        self.layout = layout
        # int64 scalar: 0, or the index in _PROBLEMS of what is wrong with
        # the structure of this rank's input (see `normalize_ids`); None if
        # nothing can be.
        self.problem = problem


def _check_int(t, what):
    if not t.dtype.is_integer:
        hint = ""
        if t.dtype.is_floating:
            # Keras makes a model's inputs float32 unless told otherwise
            # (a Sequential with no Input, keras.Input without dtype).
            hint = (" Declare the ids' input as integers, e.g. "
                    "`keras.Input(shape=(n,), dtype=\"int64\")` as the "
                    "first layer of a Sequential: Keras makes inputs "
                    "float32 by default (a Sequential with no Input under "
                    "a mixed precision policy: its 16-bit compute dtype), "
                    "which holds ids exactly only up to 2**24 (16 bits: "
                    "2048 or 256).")
        raise TypeError(
            f"{what}: ids must be an integer tensor (int32 or int64). "
            f"Received: dtype={t.dtype.name}.{hint}"
        )
    if t.dtype == tf.uint64:
        # Looked up as int64, ids from 2**63 on would wrap to negative
        # ones (2**64 - 1 to -1, the padding).
        raise TypeError(
            f"{what}: uint64 ids are not supported: ids are int64 here, "
            "and those from 2**63 on have no int64 value. Cast them "
            "(`tf.cast(ids, tf.int64)`) once you know they are below "
            "2**63. Received: dtype=uint64.")


def _check_weights_dtype(w, what):
    if not (w.dtype.is_floating or w.dtype.is_integer) or w.dtype == tf.bool:
        raise TypeError(
            f"{what}: weights must be a float tensor. Received: "
            f"dtype={w.dtype.name}."
        )


# What can be wrong with the structure of one rank's input, beyond its ids'
# values. With several ranks these are not raised where they are found (the
# other ranks would wait in the exchange): the code travels in the counts'
# all-gather and every rank raises the same error (`_agree_counts`).
_PROBLEMS = (
    "",
    "ragged weights must have the row splits of the ids (one weight per id, "
    "sample by sample)",
    "the weights do not match the ids (one weight per id, with the ids' "
    "shape, row splits or sparse indices)",
    "an index of the SparseTensor ids lies outside its dense_shape",
    "the RaggedTensor ids' row_splits are inconsistent (they must rise from "
    "0 to the number of ids)",
)
_RAGGED_SPLITS, _WEIGHTS_MISMATCH, _SPARSE_INDEX, _BAD_SPLITS = 1, 2, 3, 4


def _same(a, b):
    """Whether two tensors have the same elements (any shapes), as a bool
    scalar tensor that never fails."""
    a, b = tf.reshape(a, [-1]), tf.reshape(tf.cast(b, a.dtype), [-1])
    return tf.cond(tf.equal(tf.size(a), tf.size(b)),
                   lambda: tf.reduce_all(tf.equal(a, b)),
                   lambda: tf.constant(False))


def _first_problem(checks):
    """The code of the first failed check of `[(ok, code)]`, or 0; None
    when there is nothing to check (dense ids without weights: nothing is
    added to the exchange)."""
    if not checks:
        return None
    problem = tf.constant(0, tf.int64)
    for ok, code in reversed(checks):
        problem = tf.where(ok, problem, tf.constant(code, tf.int64))
    return problem


def _flat_weights(w, ok, count):
    """`w` flattened, or ones where `ok` is False (the input is refused
    anyway, but nothing may fail before every rank knows it)."""
    w = tf.reshape(w, [-1])
    return tf.cond(ok, lambda: w, lambda: tf.ones(tf.reshape(count, [1]),
                                                   w.dtype))


def _assert(ok, message):
    """Raises `InvalidArgumentError(message)` unless `ok` (bool scalar
    tensors); returns the check op in a graph, None eagerly."""
    if tf.executing_eagerly():
        if not bool(ok):
            raise tf.errors.InvalidArgumentError(
                None, None, message.numpy().decode())
        return None
    return tf.debugging.Assert(ok, [message])


def _raise_problem_here(feat, name):
    """One rank: raises the feature's input problem now, if it has one."""
    if feat.problem is None:
        return feat
    texts = tf.constant([f"sok_keras: table '{name}': {t}"
                         for t in _PROBLEMS])
    check = _assert(tf.equal(feat.problem, 0),
                    tf.gather(texts, feat.problem))
    with tf.control_dependencies([check] if check is not None else []):
        feat.values = tf.identity(feat.values)
        feat.segment_ids = tf.identity(feat.segment_ids)
    return feat


def normalize_ids(ids, weights=None, name="lookup"):
    """Flattens dense (-1 padded), ragged or sparse ids of one feature.

    Checks the structure of the input: ragged weights must have the row
    splits of the ids, weights one entry per id, and SparseTensor indices
    must lie inside their dense_shape. With one rank a violation raises
    `InvalidArgumentError` here; with several, it is recorded in the
    result's `problem` and raised on every rank by the exchange.

    Args:
        ids: a `tf.SparseTensor` or `tf.RaggedTensor` of shape
            `[batch, None]`, or a dense tensor of shape `[batch]` or
            `[batch, n]` where `-1` marks padding.
        weights: optional per-id weights with the same structure.
        name: the layer or table name, for error messages.

    Returns:
        An `_Ids`.
    """
    feat = _normalize_ids(ids, weights, name)
    if world.num_ranks() == 1:
        _raise_problem_here(feat, name)
    return feat


def _ragged_2d(ids):
    """Whether RaggedTensor ids are `[batch, None]`: ragged_rank 1 over a
    vector of ids (not `[batch, None, k]`, whose values are a matrix)."""
    return ids.ragged_rank == 1 and ids.flat_values.shape.rank in (1, None)


def _normalize_ids(ids, weights, name):
    if weights is not None:
        _check_weights_dtype(
            weights.values if isinstance(
                weights, (tf.SparseTensor, tf.RaggedTensor))
            else tf.convert_to_tensor(weights), name)
    if isinstance(ids, tf.SparseTensor):
        _check_int(ids.values, name)
        if ids.indices.shape.rank is not None and ids.indices.shape[1] != 2:
            raise ValueError(
                f"{name}: SparseTensor ids must be 2-D [batch, n]. "
                f"Received: dense_shape rank {ids.indices.shape[1]}."
            )
        values = tf.cast(ids.values, tf.int64)
        inside = tf.reduce_all(
            (ids.indices >= 0) & (ids.indices < ids.dense_shape[None, :]))
        checks = [(inside, _SPARSE_INDEX)]
        # Rows outside the batch would be pooled into no sample (or another
        # rank's): clamp them; the check above refuses the input.
        segs = tf.clip_by_value(ids.indices[:, 0], 0,
                                tf.maximum(ids.dense_shape[0] - 1, 0))
        nnz = tf.size(values, out_type=tf.int64)
        w = None
        if weights is not None:
            if isinstance(weights, tf.SparseTensor):
                ok = _same(weights.indices, ids.indices)
                w = weights.values
            elif isinstance(weights, tf.RaggedTensor):
                raise TypeError(
                    f"{name}: the weights of SparseTensor ids must be a "
                    "SparseTensor with the ids' indices (or a dense vector "
                    "of one weight per id). Received: RaggedTensor weights.")
            else:
                w = tf.convert_to_tensor(weights)
                ok = tf.equal(tf.size(w, out_type=tf.int64), nnz)
            checks.append((ok, _WEIGHTS_MISMATCH))
            w = _flat_weights(w, ok, nnz)
        kept = _kept(values)
        values, segs = tf.gather(values, kept), tf.gather(segs, kept)
        if w is not None:
            w = tf.gather(w, kept)
        indices = tf.gather(ids.indices, kept)
        layout = ("sparse", indices, ids.dense_shape)
        return _Ids(values, segs, ids.dense_shape[0], w, layout,
                    _first_problem(checks), kept)
    if isinstance(ids, tf.RaggedTensor):
        _check_int(ids.flat_values, name)
        if not _ragged_2d(ids):
            raise ValueError(
                f"{name}: RaggedTensor ids must be 2-D [batch, None]. "
                f"Received: ragged_rank={ids.ragged_rank}, shape "
                f"{ids.shape}."
            )
        values = tf.cast(ids.values, tf.int64)
        nnz = tf.size(values, out_type=tf.int64)
        splits = tf.cast(ids.row_splits, tf.int64)
        # (QA: splits of a RaggedTensor made with validate=False were taken
        # as they were, and ids pooled into the wrong samples, silently.)
        checks = [(_splits_are_consistent(splits, nnz), _BAD_SPLITS)]
        nrows = tf.maximum(tf.size(splits, out_type=tf.int64) - 1, 0)
        # Rows outside the batch would be pooled into no sample (or another
        # rank's): clamp them; the check above refuses the input.
        segs = tf.clip_by_value(_row_ids(splits, values), 0,
                                tf.maximum(nrows - 1, 0))
        w = None
        if weights is not None:
            if isinstance(weights, tf.RaggedTensor):
                ok = _same(tf.cast(weights.row_splits, tf.int64),
                           ids.row_splits)
                checks.append((ok, _RAGGED_SPLITS))
                w = weights.flat_values
            else:
                w = tf.convert_to_tensor(
                    weights.values if isinstance(weights, tf.SparseTensor)
                    else weights)
                ok = tf.equal(tf.size(w, out_type=tf.int64), nnz)
                checks.append((ok, _WEIGHTS_MISMATCH))
            w = _flat_weights(w, ok, nnz)
        kept = _kept(values)
        values_k = tf.gather(values, kept)
        segs_k = tf.gather(segs, kept)
        if w is not None:
            w = tf.gather(w, kept)
        # The output keeps every position of the ids: a zero row for -1,
        # as dense and sparse ids have (rows line up with parallel ragged
        # features, positions, timestamps).
        layout = ("ragged", kept, splits)
        return _Ids(values_k, segs_k, nrows, w, layout,
                    _first_problem(checks), kept)
    ids = tf.convert_to_tensor(ids)
    _check_int(ids, name)
    if ids.shape.rank == 1:
        ids = ids[:, None]
        dense_shape = None
    elif ids.shape.rank == 2:
        dense_shape = tf.shape(ids, out_type=tf.int64)
    else:
        raise ValueError(
            f"{name}: dense ids must have shape [batch] or [batch, n]. "
            f"Received: shape={ids.shape}."
        )
    shape = tf.shape(ids, out_type=tf.int64)
    flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
    keep = tf.not_equal(flat, -1)
    kept = _kept(flat, keep)
    segs = tf.reshape(tf.broadcast_to(tf.range(shape[0])[:, None], shape),
                      [-1])
    checks = []
    w = None
    if weights is not None:
        if isinstance(weights, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                f"{name}: the weights of dense ids must be a dense tensor "
                "of the ids' shape. Received: "
                f"{type(weights).__name__} weights.")
        w = tf.convert_to_tensor(weights)
        if w.shape.rank == 1 and dense_shape is None:
            w = w[:, None]  # ids [batch]: weights [batch]
        if w.shape.rank is None:
            ok = tf.equal(tf.size(w, out_type=tf.int64),
                          tf.size(flat, out_type=tf.int64))
        elif w.shape.rank == 2:
            ok = _same(tf.shape(w, out_type=tf.int64), shape)
        else:
            ok = tf.constant(False)
        checks.append((ok, _WEIGHTS_MISMATCH))
        w = tf.gather(_flat_weights(w, ok, tf.size(
            flat, out_type=tf.int64)), kept)
    layout = ("dense", keep, dense_shape)
    return _Ids(
        tf.gather(flat, kept), tf.gather(segs, kept), shape[0],
        w, layout, _first_problem(checks), kept,
    )


def _kept(values, keep=None):
    """Positions of the non-padding (`!= -1`) entries of 1-D `values`.

    One `Where` for every array masked with it (`tf.boolean_mask` makes a
    `Where` and ~25 more ops per array: trace time, and on the GPU a host
    sync each).
    """
    if keep is None:
        keep = tf.not_equal(values, -1)
    return tf.reshape(tf.where(keep), [-1])


def _splits_are_consistent(splits, nnz):
    """Whether int64 row splits rise from 0 to `nnz` (what
    `tf.RaggedTensor.from_row_splits` validates unless told not to), as a
    bool scalar tensor that never fails."""
    return tf.logical_and(
        tf.reduce_all(tf.equal(splits[:1], 0))
        & tf.reduce_all(tf.equal(splits[-1:], nnz))
        & tf.greater(tf.size(splits), 0),
        tf.reduce_all(splits[1:] >= splits[:-1]))


def _row_ids(row_splits, values):
    """The row of each value of a ragged tensor, int64 (what
    `value_rowids()` gives, from one search instead of its ~70 ops)."""
    splits = tf.cast(row_splits, tf.int64)
    positions = tf.range(tf.size(values, out_type=tf.int64))
    rows = tf.raw_ops.UpperBound(sorted_inputs=splits[None, 1:],
                                 values=positions[None, :], out_type=tf.int64)
    return tf.reshape(rows, [-1])


def _check_no_local_replicas(name):
    """Refuses a lookup of a table that is not sharded over the replicas
    of the strategy in scope, inside one of its several local replicas:
    the table would be replicated, not sharded, and each replica's update
    applied on its own."""
    strategy = replicas.local_strategy()
    if strategy is None or not replicas.in_replica_context():
        return
    local = len(strategy.extended.worker_devices)
    if replicas.shards_tables(strategy):
        raise NotImplementedError(
            f"Table '{name}' is looked up inside `strategy.run` of a "
            f"{type(strategy).__name__} with {local} replicas, but it was "
            "not made in that strategy's scope, so it is not sharded over "
            "its replicas: create the table (or the model) inside "
            "`strategy.scope()`. See docs/recipes.md.")
    raise NotImplementedError(
        f"Table '{name}': sok_keras does not support "
        f"{type(strategy).__name__} with {local} replicas in one "
        "process of a multi-worker job (each replica would need its own "
        "shard). Run one process per device: `sokrun -np N python "
        "train.py` (no strategy), MultiWorkerMirroredStrategy with one "
        "device per worker, or MirroredStrategy in one process. See "
        "docs/recipes.md.")


# What traces a tf.data function that runs in the consumer's own thread, one
# element at a time: `Dataset.reduce`, and the scan autograph makes of a
# `for x in dataset:` loop in a `tf.function` (a custom training loop).
_IN_STEP = {("dataset_ops.py", "reduce"),
            ("dataset_autograph.py", "_general_purpose_scan")}
_DATA_DIR = os.path.join("tensorflow", "python", "data", "")
_GENERATOR = os.path.join(_DATA_DIR, "ops", "from_generator_op.py")
_WRAPPER = os.path.join(_DATA_DIR, "ops", "structured_function.py")


def _in_input_pipeline():
    """Whether the function being traced is a tf.data stage's (`map`,
    `interleave`, `filter`, ...), which tf.data runs in its own threads.

    tf.data traces every dataset function in a `StructuredFunctionWrapper`;
    the frames just outside it say what made it. `Dataset.reduce` and
    autograph's `for x in dataset:` loop run theirs in the caller's step,
    so a lookup there is a lookup of the step (also when the loop's
    dataset is itself made of stages that do no lookup).

    A `Dataset.from_generator` generator runs eagerly, in tf.data's
    threads too: a lookup below its `generator_py_func` is one of a stage.
    (Not found: eager code in a stage's `tf.py_function`, which looks as
    one in the step's.)
    """
    traced = tf.inside_function()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_GENERATOR):
            return True
        if (traced and frame.f_code.co_name == "__init__"
                and frame.f_code.co_filename.endswith(_WRAPPER)):
            maker, synchronous = frame.f_back, False
            for _ in range(4):
                if maker is None:
                    break
                where = maker.f_code.co_filename
                if _DATA_DIR in where and (os.path.basename(where),
                                          maker.f_code.co_name) in _IN_STEP:
                    synchronous = True
                    break
                maker = maker.f_back
            if not synchronous:
                return True
        frame = frame.f_back
    return False


def _check_not_in_input_pipeline(name, num_ranks):
    """Refuses a lookup on several ranks traced in a tf.data stage. The
    stage's function runs in tf.data's threads: several elements at once
    (`num_parallel_calls`, a parallel `interleave`), or ahead of training
    (`prefetch`) while the model looks the same table up. Its exchanges
    then run concurrently under the same keys, which TensorFlow aborts
    (and no collective of the process works again) or pairs with the
    wrong peer (wrong rows, no error)."""
    if _in_input_pipeline():
        raise ValueError(
            f"Table '{name}' is looked up on {num_ranks} ranks inside a "
            "tf.data stage (`map`, `interleave`, ...): tf.data runs it in "
            "its own threads, concurrently with other lookups of the table, "
            "and the exchanges between the ranks would meet the wrong "
            "partners. Look the table up in the model (call the layer in "
            "it), or in a custom loop's step (the body of a `for x in ds:` "
            "loop of a `tf.function`, a `ds.reduce` function); the dataset "
            "gives the ids.")


def _exchange_comm(param, name):
    """The communicator of a lookup of `param` (several ranks), or None
    where a table sharded over a strategy's replicas is looked up outside
    `strategy.run` (its shards are then read directly)."""
    if param._sok_shards:
        if replicas.replica_id(param.num_ranks) is None:
            if replicas.in_replica_context():
                raise NotImplementedError(
                    f"Table '{name}' is sharded over {param.num_ranks} "
                    "replicas but looked up in a replica context of "
                    f"{tf.distribute.get_replica_context().num_replicas_in_sync}"
                    " replicas.")
            return None
        _check_not_in_input_pipeline(name, param.num_ranks)
        return replicas.communicator(param.num_ranks)
    _check_no_local_replicas(name)
    _check_not_in_input_pipeline(name, param.num_ranks)
    return world.communicator()


def _rows_from_every_replica(param, ids, name, padding=True,
                             positions=None):
    """`gather_rows` of a replica-sharded table outside `strategy.run`:
    each distinct id's row read from its replica's shard."""
    d = _checked_dedup(param, ids, name, padding, positions)
    parts = tf.split(d.local_rows, d.counts, num=param.num_ranks)
    rows = tf.concat([gather_table_rows(shard, part) for shard, part in
                      zip(param._sok_shards, parts)], 0)
    return rows, d.inverse


def _check_world(param, name):
    """Raises unless `param` is a table sharded over the current world
    (or over the replicas of the current strategy)."""
    _check_table(param)
    if param._sok_shards:
        return  # (`_exchange_comm` checked the replica count)
    if param.num_ranks != world.num_ranks():
        raise RuntimeError(
            f"Table '{name}' was created for {param.num_ranks} ranks, but "
            f"the world now has {world.num_ranks()}.")


def _owned_rows(param, received_ids, name, padding=True, positions=None):
    """On the owner: each distinct received id's row, gathered once.

    Returns `(owned, inverse)` with `owned[inverse[i]]` the row of
    `received_ids[i]`; the gather makes `param`'s gradient a
    `tf.IndexedSlices` over distinct local rows. `positions`: as
    `_checked_dedup`'s.
    """
    d = _checked_dedup(param, received_ids, name, padding, positions)
    table = param.value
    # One rank, float32/float64: the pooled lookup reads the table densely
    # (`aliasing_read`), and a gather of the variable in the same step
    # would copy the whole table while that read lives, and turn
    # copy-on-read on (QA: a table looked up pooled and unpooled-ragged in
    # one step, 2M x 64: ~40 ms more per step).
    from_read = (param.num_ranks == 1
                 and table.dtype in (tf.float32, tf.float64))
    return gather_table_rows(table, d.local_rows, from_read), d.inverse


# Local rows from which `gather_table_rows` makes the gradient itself.
_WIDE_ROWS = 2 ** 31


def gather_table_rows(table, rows, from_read=False):
    """`tf.gather(table, rows)` for a table variable, whose gradient is a
    `tf.IndexedSlices` over `rows`.

    TensorFlow's own gradient of that gather (`ResourceGather`) writes
    the table's shape as int32: traced, a table of 2**31 local rows or
    more wrapped to a negative row count and the step failed while it was
    built (QA: "Invalid value in tensor used for shape: -2147483584").
    From that size on, the gradient is made here, with an int64 shape;
    below it, TensorFlow's (int32 shapes, as every other gather's, which a
    `tf.cond` branch's zero gradient must match).

    Args:
        table: a `tf.Variable` of statically known shape (the local
            shard), or any tensor (gathered by `tf.gather`).
        rows: int32 or int64 local rows of `table`.
        from_read: below 2**31 rows, gather from `aliasing_read(table)`
            (the dense read a pooled lookup of it makes) rather than from
            the variable.

    Returns:
        The rows, `[len(rows)] + table.shape[1:]`.
    """
    shape = table.shape
    if (not isinstance(table, tf.Variable) or not shape.is_fully_defined()
            or shape[0] < _WIDE_ROWS):
        return tf.gather(aliasing_read(table) if from_read else table, rows)
    dense_shape = tf.constant(shape.as_list(), tf.int64)

    @tf.custom_gradient
    def gather(rows):
        # (The gather reads the variable the way the tape watches.)
        def grad(dy, variables):
            del variables  # [table]
            # (dy is itself an IndexedSlices where the rows are gathered
            # again, by an inverse: summed per row here, as TensorFlow's.)
            return None, [tf.IndexedSlices(tf.convert_to_tensor(dy), rows,
                                           dense_shape)]
        return tf.gather(table, rows), grad

    return gather(rows)


def _checked_dedup(param, ids, name, padding, positions):
    """`dedup_bucketize` of `ids` that raises an invalid id here, naming its
    position in `positions` if given (QA: 16-bit tables named the position
    among the ids left after the padding was removed)."""
    return lookup_ops.dedup_bucketize(
        ids, num_ranks=param.num_ranks, vocab_size=param.vocabulary_size,
        owner=param.target_rank, table_name=name, raise_on_error=True,
        padding=padding, positions=positions)


# -- The exchange pipeline (several ranks) ------------------------------------
#
# One lookup of K >= 1 tables on N ranks runs these stages, each written once
# below and shared by `gather_rows` (K = 1), `gather_rows_fused` and
# `_pooled_exchange`; the communicator is an argument of every stage that
# talks to other ranks:
#
#   _dedup          ids -> distinct ids bucketed by owner, counts, error
#   _agree_counts   one all-gather of every table's counts and error, then
#                   SokCheckExchange: the same error on every rank, and the
#                   checked count matrices everything later depends on
#   _exchange_parts one all-to-all for the K tables' pieces (packed and
#                   unpacked with SokGatherBlocks); used for the ids out,
#                   the rows back and the owner path's occurrences/partials
#   _owner_rows     the owner gathers each distinct requested row once
#   _rows_back      the rows home, one all-to-all per row dtype
#   pool / _owner_pooled   the combine, at home or on the owner
#
# Nothing may depend on a rank's dedup counts before `_agree_counts` has
# checked every rank's error: a rank that saw an invalid id reports zero
# counts, and an exchange sized by them could start on one rank while the
# check raises on another, leaving that collective unpaired. Every exchange
# therefore takes its sizes from the checked matrices (a data dependency: a
# control dependency is not enough, grappler drops it).


def _dedup(tables, ids_list, padding=True, positions=None):
    """Stage 1: each table's ids deduplicated and bucketed by owner rank.

    Invalid ids are reported (in `error`), not raised: `_agree_counts`
    raises them on every rank at once.

    Args:
        tables: a list of `(param, name)`.
        ids_list: one int64 `[nnz_t]` id vector per table.
        padding: whether the callers' ids take `-1` as padding (for the
            error message).
        positions: optional, per table, the position of each id in the
            caller's input (`_Ids.positions`, or None): the error names it.

    Returns:
        One `dedup_bucketize` result per table.
    """
    positions = positions or [None] * len(tables)
    return [
        lookup_ops.dedup_bucketize(
            ids, num_ranks=p.num_ranks, vocab_size=p.vocabulary_size,
            owner=p.target_rank, table_name=name, raise_on_error=False,
            padding=padding, positions=pos)
        for (p, name), ids, pos in zip(tables, ids_list, positions)
    ]


def _check_problems(codes, names):
    """Raises, on every rank, the first input problem of `codes`.

    Args:
        codes: int64 `[N, K]`: rank r's `_Ids.problem` for table k.
        names: the K tables' names.

    Returns:
        The check (an op to make the exchange wait for).
    """
    k = len(names)
    flat = tf.reshape(codes, [-1])
    bad = tf.not_equal(flat, 0)
    first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
    code = tf.clip_by_value(tf.gather(flat, first), 0, len(_PROBLEMS) - 1)
    message = tf.strings.join([
        "sok_keras: table '", tf.gather(tf.constant(names), first % k),
        "': rank ", tf.strings.as_string(first // k), ": ",
        tf.gather(tf.constant(_PROBLEMS), code),
        " (every rank raises this error; nothing was looked up)"])
    return _assert(tf.logical_not(tf.reduce_any(bad)), message)


def _agree_counts(comm, tables, deduped, key, extra=None, problems=None,
                  padding=True):
    """Stage 2: every rank's counts and errors, checked on every rank.

    One all-gather carries, per table, this rank's distinct-id count per
    owner and its first invalid id (`[counts, error]`, N + 2 entries), then
    the int64 vector `extra` if given, then (if `problems` is given) each
    table's input problem (`_Ids.problem`); a problem on any rank raises on
    every rank (`_check_problems`), then `SokCheckExchange` raises the
    same error on every rank if any rank saw an invalid id.

    Args:
        comm: the communicator.
        tables: a list of `(param, name)`.
        deduped: `_dedup`'s results.
        key: the call site's key.
        extra: an optional int64 vector appended to this rank's header.
        problems: optional, per table, this rank's `_Ids.problem` (an int64
            scalar, or None for none).
        padding: whether the callers' ids take `-1` as padding (for the
            error message).

    Returns:
        `(counts, gathered)`: `counts[t]` the checked int64 `[N, N]` matrix
        of table t (`[i, j]`: distinct ids rank i sends to rank j);
        `gathered` the `[N, width]` headers of every rank (the `extra`
        columns start at `K * (N + 2)`).
    """
    n = comm.num_ranks
    header = [tf.concat([d.counts, d.error], 0) for d in deduped]
    if extra is not None:
        header.append(extra)
    if problems is not None:
        # Also when no input here can have a problem (dense ids without
        # weights): another rank's SparseTensor ids can, and every rank's
        # header must have the same width (else the all-gather never meets).
        header.append(tf.stack([
            tf.constant(0, tf.int64) if p is None else tf.cast(p, tf.int64)
            for p in problems]))
    gathered = comm.all_gather(tf.concat(header, 0)[None, :],
                               key=key + "/counts")
    if problems is not None:
        check = _check_problems(gathered[:, -len(tables):],
                                [name for _, name in tables])
        if check is not None:  # (eagerly it has raised or passed)
            with tf.control_dependencies([check]):
                gathered = tf.identity(gathered)
    width = n + 2
    counts = [
        lookup_ops.check_exchange(
            gathered[:, t * width:(t + 1) * width], p.vocabulary_size, name,
            padding=padding)
        for t, (p, name) in enumerate(tables)
    ]
    return counts, gathered


def _exchange_parts(comm, parts, counts, key):
    """Stages 3 and 5: K pieces, one per table, in one all-to-all.

    Piece t holds table t's rows for every rank, grouped by destination
    rank (`counts[t][rank, j]` rows for rank j). They travel grouped by
    destination rank, then by table, and come back out grouped by source
    rank per table. The packing and unpacking are `SokGatherBlocks`
    (differentiable; with one piece there is nothing to pack).

    Args:
        comm: the communicator.
        parts: K tensors `[S_t, ...]` of one dtype and trailing shape.
        counts: K int64 `[N, N]` matrices, identical on every rank.
        key: the collective's key.

    Returns:
        K tensors `[sum(counts[t][:, rank]), ...]`, grouped by source rank.
    """
    if len(parts) == 1:
        return [comm.exchange(parts[0], counts[0], key=key)]
    n, me, k = comm.num_ranks, comm.rank, len(parts)
    stacked = tf.stack(counts)  # [K, N, N]
    # Out: block (j, t) is piece t's rows for rank j.
    mine = stacked[:, me, :]  # [K, N]
    part_base = tf.cumsum(tf.reduce_sum(mine, 1), exclusive=True)  # [K]
    starts = part_base[:, None] + tf.cumsum(mine, axis=1, exclusive=True)
    packed = lookup_ops.gather_blocks(
        tf.concat(parts, 0), tf.reshape(tf.transpose(starts), [-1]),
        tf.reshape(tf.transpose(mine), [-1]), site=key)
    received = comm.exchange(packed, tf.reduce_sum(stacked, 0), key=key)
    # In: block (i, t) is piece t's rows from rank i.
    incoming = tf.transpose(stacked[:, :, me])  # [N(src), K]
    in_starts = tf.reshape(
        tf.cumsum(tf.reshape(incoming, [-1]), exclusive=True), [n, k])
    return [lookup_ops.gather_blocks(received, in_starts[:, t],
                                     incoming[:, t], site=key)
            for t in range(k)]


def _owner_rows(tables, received):
    """Stage 4: on the owner, the row of every received id (each distinct
    row gathered once, see `_owned_rows`), in the order received."""
    out = []
    for (p, name), ids in zip(tables, received):
        owned, recv_inverse = _owned_rows(p, ids, name)
        out.append(tf.gather(owned, recv_inverse))
    return out


def _rows_back(comm, tables, outgoing, counts, key):
    """Stage 5: the owners' rows home, one all-to-all per row dtype.

    Tables of one dtype and width travel as rows; tables of one dtype and
    different widths are flattened to scalars, so that they share the
    all-to-all.

    Args:
        comm: the communicator.
        tables: a list of `(param, name)`.
        outgoing: per table, the rows this rank owns for every requester,
            grouped by requesting rank (`_owner_rows`).
        counts: the checked count matrices of the ids (`_agree_counts`).
        key: the call site's key.

    Returns:
        Per table, `[U_t, dim_t]` rows in the order of its distinct ids.
    """
    by_dtype = {}
    for t, (p, _) in enumerate(tables):
        by_dtype.setdefault(p.value.dtype, []).append(t)
    results = [None] * len(tables)
    for dtype, group in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
        site = key + "/rows"
        if len(by_dtype) > 1:
            site += "/" + dtype.name
        dims = [tables[t][0].global_shape[1] for t in group]
        if len(set(dims)) == 1:
            parts = [outgoing[t] for t in group]
            sizes = [tf.transpose(counts[t]) for t in group]
        else:  # scalars: rank a sends b dim_t values per id of table t
            parts = [tf.reshape(outgoing[t], [-1])[:, None] for t in group]
            sizes = [tf.transpose(counts[t]) * d for t, d in zip(group, dims)]
        home = _exchange_parts(comm, parts, sizes, site)
        for t, d, rows in zip(group, dims, home):
            results[t] = tf.reshape(rows, [-1, d])
    return results


def _rows_home(comm, tables, deduped, counts, key):
    """Stages 3-5: distinct ids out, the owners' rows back (per table)."""
    received = _exchange_parts(comm, [d.unique_ids for d in deduped], counts,
                               key + "/ids")
    return _rows_back(comm, tables, _owner_rows(tables, received), counts,
                      key)


def _exchange_rows(comm, params, ids_list, names, problems=None,
                   padding=True, positions=None):
    """The rows of K >= 1 tables' ids from their owners, on several ranks:
    3 collectives forward (counts, ids, rows per dtype). Returns a list of
    `(rows, inverse)` as `gather_rows`."""
    tables = list(zip(params, names))
    for p, name in tables:
        _check_world(p, name)
    key = _call_site_key("+".join(_table_key(p) for p in params))
    deduped = _dedup(tables, ids_list, padding=padding, positions=positions)
    counts, _ = _agree_counts(comm, tables, deduped, key, problems=problems,
                              padding=padding)
    rows = _rows_home(comm, tables, deduped, counts, key)
    return [(r, d.inverse) for r, d in zip(rows, deduped)]


@shard_reads.reading(lambda param, *_, **__: param)
def gather_rows(param, ids, table_name=None, problem=None, padding=True,
                positions=None):
    """Looks up the rows of `ids` in a sharded table, deduplicated.

    Args:
        param: a `sok_keras.Variable`.
        ids: int64 `[nnz]` global ids, padding removed.
        table_name: the name used in error messages.
        problem: optional `_Ids.problem` of the input the ids come from,
            raised on every rank (several ranks; one rank raised it in
            `normalize_ids`).
        padding: whether the caller's ids take `-1` as padding (removed
            before this call); only an out-of-range error says so.
        positions: optional int64 `[nnz]`, each id's position in the
            caller's input (padding included), named by an out-of-range
            error (`_Ids.positions`); else its position in `ids`.

    Returns:
        `(rows, inverse)`: `rows` `[U, dim]` holds each distinct id's row once
        (differentiable, its gradient reaches `param` as a `tf.IndexedSlices`)
        and `inverse` `[nnz]` maps every id to its row in `rows`.
    """
    name = table_name or _table_key(param)
    if param.num_ranks == 1:
        # One rank: the owner is here; dedup and gather, no exchange.
        _check_no_local_replicas(name)
        return _owned_rows(param, ids, name, padding=padding,
                           positions=positions)
    comm = _exchange_comm(param, name)
    if comm is None:
        return _rows_from_every_replica(param, ids, name, padding=padding,
                                        positions=positions)
    return _exchange_rows(comm, [param], [ids], [name], [problem],
                          padding=padding, positions=[positions])[0]


@shard_reads.reading(lambda params, *_, **__: params)
def gather_rows_fused(params, ids_list, names, problems=None,
                      positions=None):
    """`gather_rows` for several tables with one exchange per direction.

    Every table's distinct ids travel in one all-to-all and its rows in one
    all-to-all per row dtype, so K tables cost 3 collectives forward and 2
    backward, not 4K. Tables may differ in size, width and mode.

    Args:
        params: a list of `sok_keras.Variable`.
        ids_list: one int64 `[nnz_t]` id vector per table (padding removed).
        names: the name of each table for error messages.
        problems: optional, each table's `_Ids.problem` (see
            `gather_rows`).
        positions: optional, each table's `_Ids.positions` (see
            `gather_rows`).

    Returns:
        A list of `(rows, inverse)`, one per table, as `gather_rows`.
    """
    problems = list(problems) if problems is not None else (
        [None] * len(params))
    positions = list(positions) if positions is not None else (
        [None] * len(params))
    comms = [None if p.num_ranks == 1 else _exchange_comm(p, name)
             for p, name in zip(params, names)]
    if len(params) == 1 or comms[0] is None or any(
            c is not comms[0] for c in comms):
        return _mark_lookup([
            gather_rows(p, ids, table_name=name, problem=pr, positions=pos)
            for p, ids, name, pr, pos in zip(params, ids_list, names,
                                             problems, positions)])
    return _mark_lookup(_exchange_rows(comms[0], list(params),
                                       list(ids_list), list(names),
                                       problems, positions=positions))


def pool(rows, inverse, feat, combiner):
    """Pools the looked-up rows of one feature per sample (`SokSegmentCombine`).

    Args:
        rows: `[U, dim]` distinct rows, from `gather_rows`.
        inverse: `[nnz]` row of each id in `rows`.
        feat: the feature's `_Ids` (from `normalize_ids`).
        combiner: `"sum"`, `"mean"` or `"sqrtn"`.

    Returns:
        `[batch, dim]`.
    """
    weights = feat.weights
    if weights is None:
        weights = tf.zeros([0], rows.dtype)
    else:
        weights = tf.cast(weights, rows.dtype)
    return lookup_ops.segment_combine(
        rows, inverse, feat.segment_ids, weights, feat.batch_size, combiner)


_HALF = (tf.float16, tf.bfloat16)


@_gradients.weak
@tf.custom_gradient
def _gather_half(rows, inverse):
    """`tf.gather(rows, inverse)` of 16-bit rows whose gradient sums an
    id's repeats in float32 and rounds once (TensorFlow's own sums them in
    the 16-bit dtype: a hot id's gradient then loses most of its bits)."""

    def grad(dy):
        total = tf.math.unsorted_segment_sum(
            tf.cast(dy, tf.float32), inverse, tf.shape(rows)[0])
        return tf.cast(total, rows.dtype), None

    return tf.gather(rows, inverse), grad


@_gradients.weak
@tf.custom_gradient
def _gather_half_weighted(rows, inverse, weights):
    """`_gather_half` times per-id weights (which have the table's dtype,
    as in the pooled lookups), computed in float32 and rounded once; the
    weights' gradient is summed over the dim in float32 too."""
    per_id = tf.gather(tf.cast(rows, tf.float32), inverse)
    w = tf.cast(tf.cast(weights, rows.dtype), tf.float32)[:, None]

    def grad(dy):
        dy = tf.cast(dy, tf.float32)
        total = tf.math.unsorted_segment_sum(dy * w, inverse,
                                             tf.shape(rows)[0])
        return (tf.cast(total, rows.dtype), None,
                tf.cast(tf.reduce_sum(dy * per_id, axis=1), weights.dtype))

    return tf.cast(per_id * w, rows.dtype), grad


def _per_id_rows(rows, inverse, weights):
    """`[nnz, dim]`: each id's row (times its weight). For 16-bit rows the
    products and the gradient's sums run in float32, as the pooled path's
    (docs/gpu.md, "Table dtypes")."""
    if rows.dtype in _HALF:
        if weights is None:
            return _gather_half(rows, inverse)
        return _gather_half_weighted(rows, inverse, weights)
    per_id = tf.gather(rows, inverse)
    if weights is not None:
        per_id = per_id * tf.cast(weights, per_id.dtype)[:, None]
    return per_id


def unpooled(rows, inverse, feat):
    """One row per id, shaped like the feature's ids (see `lookup_one`)."""
    per_id = _per_id_rows(rows, inverse, feat.weights)  # [nnz, dim]
    kind = feat.layout[0]
    dim = tf.shape(rows, out_type=tf.int64)[1]
    if kind == "dense":
        keep, dense_shape = feat.layout[1], feat.layout[2]
        positions = tf.where(keep)
        total = tf.shape(keep, out_type=tf.int64)[0]
        out = tf.scatter_nd(positions, per_id, tf.stack([total, dim]))
        if dense_shape is None:
            return tf.reshape(out, tf.stack([total, dim]))
        return tf.reshape(out, tf.concat([dense_shape, [dim]], 0))
    if kind == "ragged":
        kept, splits = feat.layout[1], feat.layout[2]
        out = tf.scatter_nd(kept[:, None], per_id,
                            tf.stack([splits[-1], dim]))
        return tf.RaggedTensor.from_row_splits(out, splits, validate=False)
    indices, dense_shape = feat.layout[1], feat.layout[2]
    # A SparseTensor of embeddings is awkward to consume; densify it to
    # [batch, n, dim] with zero rows where there is no id.
    return tf.scatter_nd(
        indices, per_id, tf.concat([dense_shape, [dim]], 0))


def _check_combiner(combiner, where):
    if combiner is not None and combiner not in SUPPORTED_COMBINERS:
        raise ValueError(
            f"{where}: `combiner` must be one of {SUPPORTED_COMBINERS} or "
            f"None. Received: combiner={combiner!r}."
        )


POOLING_MODES = ("auto", "home", "owner")


def check_pooling(pooling, owner):
    """Raises a ValueError naming `owner` unless `pooling` is a mode."""
    if pooling not in POOLING_MODES:
        raise ValueError(
            f"{owner}: `pooling` must be one of {POOLING_MODES}. Received: "
            f"pooling={pooling!r}.")


def _owner_pooled(comm, param, feat, combiner, name, key, order,
                  occ_matrix, batches):
    """Pooling on the owner: every occurrence (id, sample, weight) goes to
    its owner, which pools per requesting sample; one partial sum per
    sample comes home, where they are added (and divided for `mean` and
    `sqrtn`).

    Args:
        comm: the communicator.
        param, feat, combiner, name: as `lookup_one` (`feat` an `_Ids`).
        key: the call site's key.
        order: the occurrences sorted by owner rank (stable).
        occ_matrix: the checked `[N, N]` occurrence counts.
        batches: `[N]` every rank's batch size.

    Returns:
        `[batch, dim]`.
    """
    me = comm.rank
    dtype = param.value.dtype
    dim = param.global_shape[1]
    # Sample b of requester i is partial-sum row offsets[i] + b on every
    # owner: the requester adds its own offset before sending.
    offsets = tf.cumsum(batches, exclusive=True)
    ids_segs = tf.stack([tf.gather(feat.values, order),
                         tf.gather(feat.segment_ids, order) + offsets[me]], 1)
    # Stage 3: the occurrences (and weights) out.
    (received,) = _exchange_parts(comm, [ids_segs], [occ_matrix],
                                  key + "/occ")
    if feat.weights is None:
        w_in = tf.zeros([0], dtype)
    else:
        (w_in,) = _exchange_parts(
            comm, [tf.gather(tf.cast(feat.weights, dtype), order)[:, None]],
            [occ_matrix], key + "/weights")
        w_in = w_in[:, 0]
    # Stage 4: gather each distinct row once, pool per requesting sample.
    owned, recv_inverse = _owned_rows(param, received[:, 0], name)
    partial = lookup_ops.segment_combine(
        owned, recv_inverse, received[:, 1], w_in, tf.reduce_sum(batches),
        "sum")
    # Stage 5: an owner sends requester b its B_b partial sums if b asked it
    # anything.
    sends = _partials_matrix(occ_matrix, batches)
    partial = lookup_ops.gather_blocks(partial, offsets, sends[me],
                                       site=key + "/partials")
    (back,) = _exchange_parts(comm, [partial], [sends], key + "/partials")
    # Combine at home.
    summed = tf.reduce_sum(tf.reshape(back, [-1, feat.batch_size, dim]), 0)
    if combiner == "sum":
        return summed
    w = (tf.ones_like(feat.values, dtype) if feat.weights is None
         else tf.cast(feat.weights, dtype))
    if combiner == "sqrtn":
        w = w * w
    denom = tf.math.unsorted_segment_sum(w, feat.segment_ids,
                                         feat.batch_size)
    if combiner == "sqrtn":
        denom = tf.sqrt(denom)
    return tf.math.divide_no_nan(summed, denom[:, None])


def _partials_matrix(occ_matrix, batches):
    """M[a, b]: partial sums owner a sends rank b (B_b if b asked a)."""
    n = tf.shape(occ_matrix, out_type=tf.int64)[0]
    return tf.where(tf.transpose(occ_matrix) > 0,
                    tf.tile(batches[None, :], tf.stack([n, 1])),
                    tf.zeros_like(occ_matrix))


def _owner_of(param, ids):
    """The owning rank of each id (int32); any int for an invalid id."""
    if param.target_rank >= 0:
        return tf.fill(tf.shape(ids), tf.constant(param.target_rank, tf.int32))
    return tf.cast(tf.math.floormod(ids, param.num_ranks), tf.int32)


def _owner_is_cheaper(param, feat, counts_matrix, occ_matrix, batches):
    """Whether pooling on the owner moves fewer bytes than rows home.

    Home: each distinct id (8 bytes) out and its row back. Owner: each
    occurrence (id and sample, 16 bytes, and its weight) out and one partial
    sum per sample and owner back. Rows and weights are counted in the
    table's dtype. Every input is the same on every rank, so is the answer.
    """
    item = param.value.dtype.size
    row_bytes = item * param.global_shape[1]
    home_bytes = tf.reduce_sum(counts_matrix) * (8 + row_bytes)
    weights_bytes = 0 if feat.weights is None else item
    owner_bytes = (tf.reduce_sum(occ_matrix) * (16 + weights_bytes)
                   + tf.reduce_sum(_partials_matrix(occ_matrix, batches))
                   * row_bytes)
    return owner_bytes < home_bytes


def _pooled_exchange(comm, param, feat, combiner, name, pooling):
    """A pooled lookup on several ranks, on the owner or chosen per step.

    (`pooling="home"` never comes here: it is `gather_rows` + `pool`.)

    Rows home (`"home"`) sends each distinct id and its row once; pooling on
    the owner (`"owner"`) sends every occurrence and brings back one partial
    sum per sample and owner. `"auto"` compares the bytes both would move,
    from the counts every rank has after the first all-gather, so all ranks
    take the same branch in every step. Both branches are stages of the one
    pipeline (see `_dedup`).
    """
    n = comm.num_ranks
    tables = [(param, name)]
    key = _call_site_key(_table_key(param))
    (dedup,) = _dedup(tables, [feat.values], positions=[feat.positions])
    # Occurrences per owner (the owner branch sorts them by owner), from
    # the ids themselves: nothing here may depend on the dedup counts, which
    # are zero on a rank that saw an invalid id, until every rank has
    # checked every rank's error (SokCheckExchange in _agree_counts).
    occ_owner = _owner_of(param, feat.values)
    occ_counts = tf.math.bincount(occ_owner, minlength=n, maxlength=n,
                                  dtype=tf.int64)
    batch = tf.reshape(tf.cast(feat.batch_size, tf.int64), [1])
    (counts_matrix,), gathered = _agree_counts(
        comm, tables, [dedup], key, extra=tf.concat([occ_counts, batch], 0),
        problems=[feat.problem])
    # Everything after the check waits for it: the occurrence counts are
    # checked against every rank's error too, and are what the owner
    # branch's exchanges are sized by (a real data dependency).
    occ_matrix = lookup_ops.check_exchange(
        tf.concat([gathered[:, n + 2:2 * n + 2], gathered[:, n:n + 2]], 1),
        param.vocabulary_size, name)
    batches = gathered[:, 2 * n + 2]  # used only with occ_matrix

    def home():
        (rows,) = _rows_home(comm, tables, [dedup], [counts_matrix], key)
        return pool(rows, dedup.inverse, feat, combiner)

    def owner():
        order = tf.argsort(occ_owner, stable=True)
        return _owner_pooled(comm, param, feat, combiner, name, key, order,
                             occ_matrix, batches)

    if pooling == "owner":
        return owner()
    return tf.cond(_owner_is_cheaper(param, feat, counts_matrix, occ_matrix,
                                     batches), owner, home)


def _bags(ids, weights, name):
    """Dense (-1 padded) or ragged ids as (flat ids, row splits, weights,
    bag width), padding kept; None for a SparseTensor (whose order is not
    promised). Dense ids of a static width give that width and empty row
    splits: `SokPooledLookup` makes them on its device (`bag_width`), with
    no shape through the host; otherwise the width is -1."""
    if isinstance(ids, tf.SparseTensor):
        return None
    if weights is not None:
        _check_weights_dtype(
            weights.values if isinstance(
                weights, (tf.SparseTensor, tf.RaggedTensor))
            else tf.convert_to_tensor(weights), name)
        if isinstance(weights, tf.SparseTensor):
            return None  # normalize_ids checks and takes its values
    if isinstance(ids, tf.RaggedTensor):
        _check_int(ids.flat_values, name)
        if not _ragged_2d(ids):
            return None  # normalize_ids raises the error
        w = None
        if weights is not None:
            w = _ragged_weights(ids, weights, name)
        return ids.values, tf.cast(ids.row_splits, tf.int64), w, -1
    ids = tf.convert_to_tensor(ids)
    _check_int(ids, name)
    if ids.shape.rank not in (1, 2):
        return None
    static_width = 1 if ids.shape.rank == 1 else ids.shape[1]
    if static_width is not None and static_width >= 1:
        splits, bag_width = tf.zeros([0], tf.int64), static_width
    else:
        shape = tf.shape(ids, out_type=tf.int64)
        width = shape[1] if ids.shape.rank == 2 else tf.constant(1, tf.int64)
        splits = tf.range(shape[0] + 1, dtype=tf.int64) * width
        bag_width = -1
    w = None
    if weights is not None:
        if isinstance(weights, tf.RaggedTensor):
            return None  # normalize_ids raises the error
        w = tf.convert_to_tensor(weights)
        check_static_weights_shape(w, ids, name)
        w = tf.reshape(w, [-1])
    return tf.reshape(ids, [-1]), splits, w, bag_width


def check_static_weights_shape(w, ids, name):
    """Refuses dense weights whose known shape differs from the ids' (one
    rank: in a graph the gradient's trace would fail first, unnamed; eagerly,
    weights of another shape but as many entries would be taken in flat
    order, silently, where N ranks refuse them; a layer's ids of any rank,
    before it flattens them)."""
    wrong = not w.shape.is_compatible_with(ids.shape)
    if wrong:
        raise ValueError(
            f"sok_keras: table '{name}': the weights must have one entry "
            f"per id, with the ids' shape. Received: weights "
            f"shape={w.shape}, ids shape={ids.shape}.")


def _pooled_whole_table(param, ids, weights, combiner, name):
    """One rank: pools straight from the table (`SokPooledLookup`, no
    dedup in the forward); the backward dedups and reduces the gradient per
    distinct row, so the table's gradient is a `tf.IndexedSlices`. Returns
    None where this path does not apply (sparse ids, other dtypes)."""
    dtype = param.value.dtype
    if dtype not in (tf.float32, tf.float64):
        return None
    bags = _bags(ids, weights, name)
    if bags is None:
        return None
    values, splits, w, bag_width = bags
    if values.dtype not in (tf.int32, tf.int64):
        values = tf.cast(values, tf.int64)
    w = tf.zeros([0], dtype) if w is None else tf.cast(w, dtype)
    out = _whole_table_lookup(param, values, splits, w, combiner, name,
                              bag_width)
    out.set_shape([None, param.global_shape[1]])
    return out


def _tape_may_record():
    """Whether a gradient tape is recording here (TensorFlow's own test,
    `could_possibly_record`; False where that API is missing)."""
    try:
        from tensorflow.python.eager import record
    except ImportError:  # pragma: no cover - TensorFlow moved it
        return False
    return bool(record.could_possibly_record())


def _whole_table_lookup(param, values, splits, w, combiner, name, bag_width):
    """`SokPooledLookup` over the whole table. The table goes in as a read
    of the variable itself, so the gradient registered for SokPooledLookup
    reaches it as the tf.IndexedSlices it returns, never densified.

    In a traced training step (a tape records, the table's rows are
    static), the backward's `SokPooledGradPlan` is made here, before the
    lookup, which takes it as a control input and skips its own id check:
    the plan validates the same ids against the same rows (the same error,
    naming the table, id and position) before the lookup or anything after
    it runs, and the step keeps one blocking device-to-host copy instead of
    two. The gradient reuses this plan (`_pooled_lookup_grad`)."""
    rows = param.value.shape[0]
    if (tf.executing_eagerly() or rows is None
            or not getattr(param.value, "trainable", True)
            or not _tape_may_record()):
        return ops().sok_pooled_lookup(
            table=aliasing_read(param.value), ids=values,
            row_splits=splits, weights=w, combiner=combiner,
            table_name=name, bag_width=bag_width)
    plan = ops().sok_pooled_grad_plan(
        ids=values, row_splits=splits, weights=w, combiner=combiner,
        num_rows=rows, table_name=name, bag_width=bag_width)
    # Read before the block: an input made inside it would carry the
    # control input instead of the lookup (TensorFlow's pruning).
    table = aliasing_read(param.value)
    with tf.control_dependencies([plan.offsets.op]):
        return ops().sok_pooled_lookup(
            table=table, ids=values, row_splits=splits, weights=w,
            combiner=combiner, table_name=name, bag_width=bag_width,
            check_ids=False)



def _unpooled_whole_table(param, ids, weights, name):
    """One rank, no pooling, dense ids: every id's row (zeros for the -1
    padding), times its weight, from `SokPooledLookup` over one-id bags:
    one kernel and no dedup in the forward, and the same `tf.IndexedSlices`
    gradient over distinct rows as the pooled path. Returns None where this
    path does not apply (ragged or sparse ids, other dtypes)."""
    dtype = param.value.dtype
    if dtype not in (tf.float32, tf.float64):
        return None
    if isinstance(ids, (tf.SparseTensor, tf.RaggedTensor)):
        return None
    ids = tf.convert_to_tensor(ids)
    _check_int(ids, name)
    if ids.shape.rank not in (1, 2):
        return None  # normalize_ids raises the error
    if weights is not None:
        if isinstance(weights, (tf.SparseTensor, tf.RaggedTensor)):
            return None  # normalize_ids raises the error
        _check_weights_dtype(tf.convert_to_tensor(weights), name)
        check_static_weights_shape(tf.convert_to_tensor(weights), ids, name)
    flat = tf.reshape(ids, [-1])
    if flat.dtype not in (tf.int32, tf.int64):
        flat = tf.cast(flat, tf.int64)
    w = (tf.zeros([0], dtype) if weights is None
         else tf.cast(tf.reshape(tf.convert_to_tensor(weights), [-1]), dtype))
    # One-id bags: the op makes their row splits on its device.
    out = _whole_table_lookup(param, flat, tf.zeros([0], tf.int64), w, "sum",
                              name, 1)
    dim = param.global_shape[1]
    if ids.shape.is_fully_defined():
        out = tf.reshape(out, ids.shape.as_list() + [dim])
    elif ids.shape[1:].is_fully_defined() and ids.shape[1:].num_elements():
        # One Reshape, no shape ops (-1 is ambiguous for rows of 0 ids).
        out = tf.reshape(out, [-1] + ids.shape[1:].as_list() + [dim])
    else:
        out = tf.reshape(out, tf.concat(
            [tf.shape(ids, out_type=tf.int64), [dim]], 0))
    out.set_shape(ids.shape.concatenate([dim]))
    return out


_INT64_MAX = 2 ** 63 - 1


@register_gradient_once("SokPooledLookup")
def _pooled_lookup_grad(op, dy):
    """The table gradient as a `tf.IndexedSlices` over distinct rows, from
    two ops: `SokPooledGradPlan` (padding dropped, ids deduplicated and
    grouped by row) and `SokPooledGradCombine` (the pooled gradient spread
    back and summed per row), bit-identical to boolean-masking the padding,
    `SokDedupBucketize` and `SokSegmentCombineGrad`.

    The plan reads only the lookup's inputs: a traced training step makes
    it before the forward (`_whole_table_lookup`), which it validates, and
    it is reused here; otherwise it is made here, and is still ready when
    the forward is. On the GPU its one host sync (the row count that sizes
    the gradient) thus waits for little more than the forward's kernel,
    not for the dense layers' forward and backward, and the backward has no
    host sync left. Its `rows` are distinct, which the sparse optimizers
    use to skip their own dedup (`sparse_kernels.indices_are_unique`)."""
    table, values, splits, weights = op.inputs
    combiner = op.get_attr("combiner")
    if isinstance(combiner, bytes):
        combiner = combiner.decode()
    name = op.get_attr("table_name")
    if isinstance(name, bytes):
        name = name.decode()
    # The static shape (a table's shard shape is known) keeps the backward
    # from reading the table tensor, and keeps the sort keys short; the
    # forward validated every id.
    if table.shape.is_fully_defined():
        # int32 where it fits, as TensorFlow's own gather gradient
        # (`ResourceGather`): a `tf.cond` with the lookup in one branch
        # makes the other branch's zero gradient so, and their types must
        # match (QA: on one rank, a lookup inside `tf.cond` failed `fit`).
        rows = table.shape[0]
        dense_shape = tf.constant(
            table.shape.as_list(),
            tf.int32 if rows < 2 ** 31 and table.shape[1] < 2 ** 31
            else tf.int64)
    else:
        dense_shape = tf.shape(table, out_type=tf.int64)
        rows = _INT64_MAX
    plan = _forward_plan(op)
    forward = plan is not None
    if plan is None:
        plan = ops().sok_pooled_grad_plan(
            ids=values, row_splits=splits, weights=weights,
            combiner=combiner, num_rows=rows, table_name=name,
            bag_width=op.get_attr("bag_width"))
    rows_grad = ops().sok_pooled_grad_combine(
        grad=dy, offsets=plan.offsets, segments=plan.segments,
        sorted_weights=plan.sorted_weights, denominator=plan.denominator,
        table_name=name, check_plan=False)
    weights_grad = lookup_ops.weights_gradient_of(
        op, 3, weights, lambda: _pooled_lookup_weights_grad(op, dy, combiner))
    indices = plan.rows
    if forward and indices.graph is not tf.compat.v1.get_default_graph():
        # The forward's plan, and this gradient traced into a backward
        # function of its own (a tape around a `tf.function` call): an
        # output must be made in that function, which then captures the
        # forward's tensor (returned as is, it would name another graph).
        indices = tf.identity(indices)
    return [tf.IndexedSlices(rows_grad, indices, dense_shape), None,
            None, weights_grad]


def _pooled_lookup_weights_grad(op, dy, combiner):
    """`SokPooledLookup`'s gradient with respect to its weights (padding
    ids, -1, get zero), as `lookup_ops.weights_gradient`."""
    table, values, splits, weights = op.inputs
    valid = tf.not_equal(values, -1)
    # Padding reads row 0; its terms are masked out below (and its weight
    # out of the mean/sqrtn denominators).
    rows = tf.gather(table, tf.where(valid, values, tf.zeros_like(values)))
    out = op.outputs[0]
    num_bags = tf.shape(out, out_type=tf.int64)[0]
    bag_width = op.get_attr("bag_width")
    if bag_width > 0:
        segments = tf.range(tf.size(values, out_type=tf.int64)) // bag_width
    else:
        segments = tf.ragged.row_splits_to_segment_ids(splits,
                                                       out_type=tf.int64)
    w = tf.where(valid, weights, tf.zeros_like(weights))
    grad = lookup_ops.weights_gradient(rows, dy, out, segments, w, num_bags,
                                       combiner)
    return tf.where(valid, grad, tf.zeros_like(grad))


def _forward_plan(op):
    """The `SokPooledGradPlan` that `_whole_table_lookup` made for this
    lookup `op` (its control input, over the same ids, splits and weights),
    as the op's output list; None if there is none."""
    # A tape's gradient gets a stand-in for the op (`_MockOp`, no control
    # inputs); in a graph its output names the real op.
    try:
        control = op.outputs[0].op.control_inputs
    except AttributeError:  # eager tensors have no op
        return None
    for c in control:
        if (c.type == "SokPooledGradPlan"
                and [t.name for t in c.inputs] ==
                [t.name for t in op.inputs[1:]]):
            return _PlanOutputs(*c.outputs)
    return None


# `SokPooledGradPlan`'s outputs by name.
_PlanOutputs = collections.namedtuple(
    "_PlanOutputs", "rows offsets segments sorted_weights denominator")


def _ragged_weights(ids, weights, name):
    """The flat weights of ragged `ids`, which must share their row splits."""
    if not isinstance(weights, tf.RaggedTensor):
        return tf.reshape(tf.convert_to_tensor(weights), [-1])
    check = tf.debugging.assert_equal(
        tf.cast(weights.row_splits, tf.int64),
        tf.cast(ids.row_splits, tf.int64),
        message=(f"{name}: ragged weights must have the row splits of the "
                 "ids (one weight per id, sample by sample)"))
    with tf.control_dependencies([check]):
        return tf.identity(weights.values)


def _at_most_one_id_per_bag(ids):
    """Whether dense `ids` hold one id per sample at most (`[batch]` or
    `[batch, 1]`, known when traced)."""
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        return False
    shape = getattr(ids, "shape", None)
    if shape is None:
        shape = np.shape(ids)
    shape = tf.TensorShape(shape)
    return shape.rank == 1 or (shape.rank == 2 and shape[1] == 1)


def _backward_is_shared(param, feat):
    """Whether a `tf.cond` here would get one backward function that every
    `tape.gradient` call runs: inside a function, under a persistent tape or
    tapes nested, TensorFlow wraps control flow that such tapes watch in a
    function of its own, and two gradients through it run its exchanges
    twice in one step under the same keys (TensorFlow's collective runtime
    then aborts, or the runs take each other's rows). `"auto"` pools at
    home there: the same numbers, without the per-step `tf.cond`, and each
    gradient traces its own exchanges (`comm._grad_site`)."""
    if tf.executing_eagerly() or in_stateless_scope():
        return False  # Keras inferring shapes: nothing is differentiated
    from tensorflow.python.eager import tape as tape_lib
    from tensorflow.python.ops import gradients_util

    table = getattr(param, "_value", None)  # the tf.Variable, once made
    if not isinstance(table, tf.Variable):
        return False
    # The branches read the table: the tapes that watch what they access
    # watch it now rather than inside the branch, the same either way.
    tape_lib.variable_accessed(table)
    watched = [table.handle]
    if feat.weights is not None:
        watched.append(feat.weights)
    return (gradients_util.PossibleTapeGradientTypes(watched)
            == gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER)


@_not_converted
@shard_reads.reading(lambda param, *_, **__: param)
def lookup_one(param, ids, weights=None, combiner="sum", name=None,
               pooling="auto"):
    """Looks up (and pools) one feature in one table. See `lookup_sparse`.

    `pooling` (`"auto"`, `"home"` or `"owner"`) chooses, with several ranks,
    where pooled rows are summed: see `_pooled_exchange`.
    """
    _check_table(param)
    if (pooling == "auto" and combiner is not None and param.num_ranks > 1
            and consistency.recording() and _at_most_one_id_per_bag(ids)):
        # Pooling on the owner sends each id with its sample (16 bytes) and
        # brings back a row per id: never fewer bytes than one row per
        # distinct id home. So no per-step `tf.cond` of both ways to trace
        # (QA: it tripled the first step of models of many one-id tables).
        # Only in a Keras step's first trace, whose lookups (this mode
        # among them) the ranks compare before it runs: ranks whose ids
        # differ in shape would otherwise make different exchanges.
        pooling = "home"
    consistency.record_lookup(param, f"lookup_one[{combiner},{pooling}]")
    return _mark_lookup(_lookup_one(param, ids, weights, combiner, name,
                                    pooling))


def _lookup_one(param, ids, weights, combiner, name, pooling):
    name = name or _table_key(param)
    _check_combiner(combiner, name)
    check_pooling(pooling, name)
    if param.num_ranks == 1:
        _check_no_local_replicas(name)
        if combiner is None:
            whole = _unpooled_whole_table(param, ids, weights, name)
        else:
            whole = _pooled_whole_table(param, ids, weights, combiner, name)
        if whole is not None:
            return whole
    feat = normalize_ids(ids, weights, name)
    if param._sok_shards and pooling == "auto":
        # Between a strategy's replicas the collectives are merge_calls,
        # which cannot sit inside the per-step `tf.cond` of "auto".
        pooling = "home"
    if pooling == "auto" and _backward_is_shared(param, feat):
        pooling = "home"
    if combiner is not None and param.num_ranks > 1 and pooling != "home":
        comm = _exchange_comm(param, name)
        if comm is not None:
            _check_world(param, name)
            return _pooled_exchange(comm, param, feat, combiner, name,
                                    pooling)
    rows, inverse = gather_rows(param, feat.values, table_name=name,
                                problem=feat.problem,
                                positions=feat.positions)
    if combiner is None:
        return unpooled(rows, inverse, feat)
    return pool(rows, inverse, feat, combiner)


def _to_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _is_hotness(value, sp_ids):
    """Whether `value`, given as weights, is SOK's positional `hotness`:
    a bare int, or with a list of ids tensors a list of ints (one per
    table). No weights can be either: a table's weights have the shape of
    its ids, which are never scalars. (A list of ints for a single ids
    tensor, `[batch]`-shaped, may be weights: QA.)"""
    def whole(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
    if whole(value):
        return True
    return (isinstance(sp_ids, (list, tuple))
            and isinstance(value, (list, tuple)) and len(value) > 0
            and all(whole(x) for x in value))


@_not_converted
def lookup_sparse(params, sp_ids, sp_weights=None, combiners=None,
                  hotness=None, pooling="auto",
                  use_low_frequency_filter=False):
    """Looks up and pools sparse ids in several sharded tables at once.

    The result for each table equals `tf.nn.embedding_lookup_sparse` on the
    whole (unsharded) table.

    Args:
        params: a `sok_keras.Variable` or a list of them.
        sp_ids: ids for each table: `tf.SparseTensor`, `tf.RaggedTensor`
            (`[batch, None]`) or a dense `[batch, n]` tensor with `-1` as
            padding. One per table. `-1` is padding in every layout: it
            is skipped and not counted by `mean` / `sqrtn` (and its
            weight is ignored); any other id outside `[0, rows)` is an
            error.
        sp_weights: optional per-id weights, same structure as `sp_ids`
            (a list with `None` entries is allowed).
        combiners: `"sum"`, `"mean"` or `"sqrtn"` (one string for all
            tables, or one per table). Defaults to `"mean"`, as in SOK's
            `lookup_sparse` and `tf.nn.embedding_lookup_sparse`.
        hotness: optional maximum number of ids per sample for each table
            (SOK's argument). Only its length is checked (one entry per
            table); the ids are not checked against it, and the lookup does
            not need it. SOK's experimental positional form
            `lookup_sparse(params, sp_ids, hotness, combiners)` is accepted
            too: Python ints in the third place are `hotness`.
        pooling: with one table and several ranks, where rows are pooled
            (`"auto"`, `"home"` or `"owner"`; see `DistributedEmbedding`).
            Several tables are fused into one exchange and pooled at home.
        use_low_frequency_filter: SOK's argument (also its fifth
            positional one); only `False` is supported (SOK's filter of
            rare keys is for dynamic tables).

    Returns:
        A `[batch, dim]` tensor per table: a list if `sp_ids` is a list.

    Example:

    >>> v1 = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype="float32")
    >>> ids = tf.SparseTensor([[0, 0], [0, 1]], [1, 1], [1, 3])
    >>> sok.lookup_sparse([v1], [ids], combiners=["sum"])[0].numpy().tolist()
    [[6.0, 8.0, 10.0]]
    """
    if isinstance(hotness, bool):  # SOK's signature, positionally
        hotness, use_low_frequency_filter = None, hotness
    if _is_hotness(sp_weights, sp_ids):
        # SOK's experimental `lookup_sparse(params, sp_ids, hotness,
        # combiners)`: ints where weights (tensors) would be.
        if hotness is not None:
            raise TypeError(
                "sok_keras.lookup_sparse: the third argument "
                f"{sp_weights!r} looks like SOK's positional `hotness`, and "
                f"hotness={hotness!r} is given too: pass the weights as "
                "tensors (sp_weights=...) or give hotness once.")
        hotness, sp_weights = sp_weights, None
    if use_low_frequency_filter is not False:
        raise NotImplementedError(
            "sok_keras.lookup_sparse: use_low_frequency_filter="
            f"{use_low_frequency_filter!r} is not supported (SOK's filter "
            "of rare keys is for dynamic tables, which sok_keras does not "
            "have); pass False or leave it out.")
    for p in _to_list(params):
        _check_table(p)
    consistency.record_lookup(params, "lookup_sparse")
    is_list = isinstance(sp_ids, (list, tuple))
    params = _to_list(params)
    sp_ids = [_float_ids(ids) for ids in _to_list(sp_ids)]
    if len(params) != len(sp_ids):
        raise ValueError(
            "lookup_sparse needs one ids tensor per table. Received: "
            f"{len(params)} tables and {len(sp_ids)} ids."
        )
    if not params:
        raise ValueError(
            "lookup_sparse needs at least one table. Received: params=[].")
    check_pooling(pooling, "lookup_sparse")  # (unused by several tables)
    if sp_weights is None:
        sp_weights = [None] * len(params)
    sp_weights = _to_list(sp_weights)
    if combiners is None:
        combiners = "mean"  # SOK's default (and TensorFlow's)
    if isinstance(combiners, str):
        combiners = [combiners] * len(params)
    combiners = list(combiners)
    for what, value in (("sp_weights", sp_weights),
                        ("combiners", combiners)):
        if len(value) != len(params):
            raise ValueError(
                f"lookup_sparse: `{what}` must have one entry per table "
                f"({len(params)}). Received: {len(value)} entries."
            )
    if hotness is not None:
        hotness = _to_list(hotness)
        if len(hotness) != len(params):
            raise ValueError(
                f"lookup_sparse: `hotness` must have one entry per table "
                f"({len(params)}). Received: hotness={hotness}."
            )
    names = []
    for p, c in zip(params, combiners):
        names.append(_table_key(p))
        if c is None:
            raise ValueError(
                "lookup_sparse pools: `combiners` must be 'sum', 'mean' or "
                "'sqrtn'. Use all2all_dense_embedding for unpooled rows."
            )
        _check_combiner(c, names[-1])
    if len(params) == 1:  # one table: may pool on the owner (see lookup_one)
        out = lookup_one(params[0], sp_ids[0], sp_weights[0], combiners[0],
                         name=names[0], pooling=pooling)
        return [out] if is_list else out
    feats = [normalize_ids(ids, w, name)
             for ids, w, name in zip(sp_ids, sp_weights, names)]
    gathered = gather_rows_fused(params, [f.values for f in feats], names,
                                 [f.problem for f in feats],
                                 [f.positions for f in feats])
    outputs = [pool(rows, inverse, f, c)
               for (rows, inverse), f, c in zip(gathered, feats, combiners)]
    return outputs if is_list else outputs[0]


def _float_ids(ids):
    """`ids`, cast to int64 while Keras infers shapes without data: it
    builds a subclassed model that looks its tables up itself (SOK's way)
    by running `call` on float32 placeholders (`load_model`; before, the
    lookup refused them, the model stayed unbuilt and Keras loaded none of
    its other layers' weights). Float ids with values are still refused,
    as TensorFlow's lookups refuse them (docs/failures.md): a functional
    model on a float `keras.Input` is built, and refused at its first
    call."""
    from sok_keras.layers.base_embedding import as_int_ids

    return as_int_ids(ids, None)


@_not_converted
def all2all_dense_embedding(param, indices):
    """Looks up every id of a dense tensor, without pooling.

    Args:
        param: a `sok_keras.Variable`.
        indices: an integer tensor of any shape; every entry must be a valid
            id (no padding).

    Returns:
        A tensor of shape `indices.shape + [dim]`.

    Example:

    >>> v = sok.Variable(np.arange(7 * 5).reshape(7, 5), dtype="float32")
    >>> sok.all2all_dense_embedding(v, [[1, 2]]).shape
    TensorShape([1, 2, 5])
    """
    _check_table(param)
    consistency.record_lookup(param, "all2all_dense_embedding")
    name = _table_key(param)
    if isinstance(indices, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(
            f"sok_keras.all2all_dense_embedding: table '{name}': the ids "
            "must be a dense tensor, every entry a valid id (SOK's "
            "fixed-shape lookup); for ragged or sparse ids use "
            f"lookup_sparse. Received: {type(indices).__name__}.")
    indices = _float_ids(tf.convert_to_tensor(indices))
    _check_int(indices, name)
    flat = tf.reshape(tf.cast(indices, tf.int64), [-1])
    rows, inverse = gather_rows(param, flat, table_name=name, padding=False)
    out = _per_id_rows(rows, inverse, None)
    shape = tf.concat(
        [tf.shape(indices, out_type=tf.int64),
         tf.shape(rows, out_type=tf.int64)[1:]], 0)
    out = tf.reshape(out, shape)
    if indices.shape.rank is not None and param.global_shape[1] is not None:
        out.set_shape(indices.shape.concatenate([param.global_shape[1]]))
    return _mark_lookup(out)
