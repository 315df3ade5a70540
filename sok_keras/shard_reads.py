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
updates mark the ops they make that read a table (`own`); any other op
of the step that reads a table's values (`ReadVariableOp`, a gather) is
refused before the step runs, naming the model, the table and the op.
"""

import contextlib
import functools
import threading

import tensorflow as tf
from tensorflow.python.framework import func_graph

_LOCAL = threading.local()

# Ops that read a variable's values: what converting a table to a tensor
# (`keras.ops.matmul(h, table)`, `tf.transpose(table)`) or
# `tf.gather(table, ids)` makes. Function calls and control flow (their
# bodies are other graphs) and shape reads are left alone.
_VALUE_READS = frozenset({"ReadVariableOp", "ResourceGather",
                          "ResourceGatherNd"})


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


def refuse_other_reads(model, tables, ours, num_ranks):
    """Raises ValueError if the step being traced (the current graph) reads
    one of `tables` (sharded over `num_ranks` > 1) other than through the
    ops in `ours`."""
    graph = tf.compat.v1.get_default_graph()
    for table in tables:
        if getattr(table, "num_ranks", 1) < 2 or getattr(
                table, "_sok_shards", None):
            continue  # a whole table, or per-replica copies of it
        other = sorted(op.name for op in _readers(graph, [table]) - ours
                       if op.type in _VALUE_READS)
        if other:
            local = int(table.shape[0])
            rows = int(table.global_shape[0])
            raise ValueError(
                f"sok_keras: model '{model.name}' reads table "
                f"'{table.path}' other than by looking ids up (op "
                f"'{other[0]}'), e.g. tied output weights (`h @ "
                "layer.embeddings`): on "
                f"{num_ranks} ranks the table's variable holds this rank's "
                f"rows only ({local} of its {rows} rows), so the model "
                "would compute with one rank's shard. Read the table only "
                "through its sok layer (or `sok.lookup_sparse`); for an "
                "output layer use a `keras.layers.Dense` of its own, or "
                "keep a table that every rank must read whole in a "
                "`keras.layers.Embedding` (docs/failures.md).")


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
    captures = graph.captures
    for external, internal in captures:
        if external is handle:
            return internal
    outer = getattr(graph, "outer_graph", None)
    if isinstance(outer, func_graph.FuncGraph):
        outer_handle = _captured(outer, handle)
        if outer_handle is not None:
            for external, internal in captures:
                if external is outer_handle:
                    return internal
    return None
