"""Reads of a sharded table other than through sok's lookups, refused in a
Keras step on several ranks.

On N ranks a table's variable (`layer.embeddings`, `layer.weights[0]`,
`EmbeddingCollection.embeddings[name]`) holds this rank's rows only. A
model that reads it whole, e.g. tied output weights (`logits = h @
emb.embeddings^T`), computed with one rank's shard: `predict` returned
logits over a part of the vocabulary, `fit` trained each rank against
other items than the labels name, silently where the shapes fit (QA).
On one rank the variable is the whole table, and such reads are right.

While a Keras step (`train_step`, `test_step`, `predict_step`) is traced
on several ranks (`consistency.wrap_step`), sok's lookups and optimizer
updates mark the ops they make that read a table (`own`). Any other read
of a table's rows by id (a gather) is refused before the step runs,
naming the model, the table and the op; so is a read of its values that
reaches a matrix product or a gather (the table used as a weight matrix:
tied output weights, a `Dense` kernel set to it), through ops that keep
the values' layout (casts, transposes, reshapes, elementwise arithmetic).
Elementwise work on the shard is left alone: a penalty on the shard
times the number of ranks (docs/design.md), a plain optimizer's weight
decay in a custom `train_step`.

Not seen: reads inside a function the step calls (a nested
`tf.function`, a `tf.cond` branch), `run_eagerly=True`, and custom loops.
"""

import contextlib
import functools
import threading

import tensorflow as tf
from tensorflow.python.framework import func_graph

_LOCAL = threading.local()

# Reads of rows by id of a table's variable: this rank's local rows by a
# global id, always wrong on several ranks.
_ROW_READS = frozenset({"ResourceGather", "ResourceGatherNd"})
# What converting a table to a tensor makes (`keras.ops.matmul(h, table)`).
_VALUE_READ = "ReadVariableOp"
# Ops whose output is their input's values, rearranged or elementwise: a
# read's value is followed through them.
_PASS_THROUGH = frozenset({
    "Identity", "Cast", "Transpose", "ConjugateTranspose", "Reshape",
    "ExpandDims", "Squeeze", "Neg", "Mul", "RealDiv", "AddV2", "Add", "Sub",
    "Maximum", "Minimum", "StopGradient", "IdentityN", "L2Normalize",
    "Rsqrt", "Sqrt", "Tanh", "Sigmoid"})
# Ops that use a value as a matrix or as rows to pick from.
_MATRIX_USES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "GatherV2", "Gather", "GatherNd", "SparseMatMul", "SparseTensorDenseMatMul",
    "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN"})
_FOLLOW_LIMIT = 256  # ops visited per read (a bound on odd graphs)


@contextlib.contextmanager
def watching():
    """While a Keras step is traced: yields the set that `own` fills with
    the ops sok's lookups and updates make that read a table."""
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    ours = set()
    _LOCAL.stack.append(ours)
    try:
        yield ours
    finally:
        _LOCAL.stack.pop()


@contextlib.contextmanager
def own(tables):
    """Marks the ops made inside that read `tables` (a `sok_keras.Variable`
    or a list of them) as sok's own (a lookup, an optimizer's update), in a
    step traced under `watching`. Does nothing otherwise."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack or tf.executing_eagerly():
        yield
        return
    tables = tables if isinstance(tables, (list, tuple)) else [tables]
    graph = tf.compat.v1.get_default_graph()
    before = _readers(graph, tables)
    try:
        yield
    finally:
        stack[-1].update(_readers(graph, tables) - before)


def reading(tables_of):
    """Decorator: the ops the function makes that read the tables
    `tables_of(*args, **kwargs)` returns are sok's own (`own`)."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with own(tables_of(*args, **kwargs)):
                return fn(*args, **kwargs)
        return wrapped
    return decorate


def refuse_other_reads(model, tables, ours):
    """Raises ValueError if the step being traced (the current graph) reads
    one of `tables` (those sharded over several ranks) other than through
    the ops in `ours`."""
    graph = tf.compat.v1.get_default_graph()
    for table in tables:
        if getattr(table, "num_ranks", 1) < 2 or getattr(
                table, "_sok_shards", None):
            continue  # a whole table, or per-replica copies of it
        other = sorted(op.name for op in _readers(graph, [table]) - ours
                       if op.type in _ROW_READS
                       or (op.type == _VALUE_READ and _used_as_matrix(op)))
        if other:
            local = int(table.shape[0])
            rows = int(table.global_shape[0])
            raise ValueError(
                f"sok_keras: model '{model.name}' reads table "
                f"'{table.path}' other than by looking ids up (op "
                f"'{other[0]}'), e.g. tied output weights (`h @ "
                "layer.embeddings`): on "
                f"{table.num_ranks} ranks the table is split over the ranks and "
                f"its variable holds this rank's part ({local} of its "
                f"{rows} rows), so each rank would compute with other "
                "rows, none with the whole table. Read the table only "
                "through its sok layer (or `sok.lookup_sparse`); for an "
                "output layer use a `keras.layers.Dense` of its own, or "
                "keep a table that every rank must read whole in a "
                "`keras.layers.Embedding` (docs/failures.md).")


def _used_as_matrix(read):
    """Whether the value `read` (a ReadVariableOp) gives reaches a matrix
    product or a gather through ops that keep its layout."""
    todo, seen = [read], set()
    while todo and len(seen) < _FOLLOW_LIMIT:
        op = todo.pop()
        for out in op.outputs:
            for user in out.consumers():
                if user in seen or _is_gradient(user):
                    continue
                seen.add(user)
                if user.type in _MATRIX_USES:
                    return True
                if user.type in _PASS_THROUGH:
                    todo.append(user)
    return False


def _is_gradient(op):
    """A backward op (`tf.GradientTape` names them `gradient_tape/...`): a
    penalty's gradient is the shard's own, and it reaches the optimizer,
    not the model's forward."""
    return op.name.startswith("gradient_tape/") or (
        "/gradient_tape/" in op.name)


def _readers(graph, tables):
    """The ops of `graph` that take one of `tables`' handles as input."""
    found = set()
    for table in tables:
        variable = getattr(table, "_value", None)  # the tf.Variable
        if not isinstance(variable, tf.Variable):
            continue
        placeholder = _captured(graph, variable.handle)
        if placeholder is not None:
            found.update(placeholder.consumers())
    return found


def _captured(graph, handle):
    """`handle` (an eager resource tensor) as captured into `graph`, directly
    or through the function graphs it is nested in; None if not captured."""
    outer = getattr(graph, "outer_graph", None)
    via = (_captured(outer, handle)
           if isinstance(outer, func_graph.FuncGraph) else None)
    for external, internal in graph.captures:
        if external is handle or (via is not None and external is via):
            return internal
    return None
