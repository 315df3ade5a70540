"""`sparse_kernels.indices_are_unique`: when a sparse update may skip its
dedup (the `indices_are_unique` attr of the SokSparseApply* ops).

The attr is set only for indices whose producer proves them distinct and
in range at trace time; everything else keeps the dedup. On the CPU the
attr changes nothing (the update is checked equal either way); the GPU's
distinct path is compared with its dedup path in tests/test_gpu.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras import lookup_ops
from sok_keras._ops import ops
from sok_keras.optimizers import sparse_kernels


def _traced(fn, *args):
    """Runs fn inside a tf.function and returns what it returned at trace
    time (Python values)."""
    out = []

    @tf.function
    def f(*a):
        out.append(fn(*a))
        return tf.constant(0)

    f(*args)
    return out[0]


def _pooled_rows(ids, splits, num_rows):
    _, rows = ops().sok_pooled_lookup_grad(
        grad=tf.ones([tf.shape(splits)[0] - 1, 4]), ids=ids,
        row_splits=splits, weights=tf.zeros([0]), num_rows=num_rows)
    return rows


IDS = tf.constant([3, -1, 5, 3], tf.int64)
SPLITS = tf.constant([0, 2, 4], tf.int64)


def test_rows_of_the_fused_backward_are_unique():
    assert _traced(lambda i, s: sparse_kernels.indices_are_unique(
        _pooled_rows(i, s, 10), 10), IDS, SPLITS)
    # Validated against more rows than the table has: not proven.
    assert not _traced(lambda i, s: sparse_kernels.indices_are_unique(
        _pooled_rows(i, s, 11), 10), IDS, SPLITS)
    assert not _traced(lambda i, s: sparse_kernels.indices_are_unique(
        _pooled_rows(i, s, 10), None), IDS, SPLITS)


@pytest.mark.parametrize("num_ranks,owner,want", [
    (1, -1, True), (2, -1, False), (2, 1, True)])
def test_dedup_local_rows(num_ranks, owner, want):
    def f(ids):
        d = lookup_ops.dedup_bucketize(ids, num_ranks=num_ranks,
                                       vocab_size=10, owner=owner)
        return (sparse_kernels.indices_are_unique(d.local_rows, 10),
                sparse_kernels.indices_are_unique(d.unique_ids, 10))

    assert _traced(f, tf.constant([1, 2, 1], tf.int64)) == (want, False)


def test_other_indices_are_not_unique():
    def f(ids, splits):
        rows = _pooled_rows(ids, splits, 10)
        return [sparse_kernels.indices_are_unique(x, 10) for x in (
            tf.concat([rows, rows], 0),    # a table looked up twice
            tf.unique(ids)[0],             # distinct, not validated
            tf.identity(rows),             # not the producer's own output
            ids)]

    assert _traced(f, IDS, SPLITS) == [False] * 4
    # Eagerly there is no producer to inspect.
    assert not sparse_kernels.indices_are_unique(
        _pooled_rows(IDS, SPLITS, 10), 10)


@pytest.mark.parametrize("flag", [False, True])
def test_cpu_update_ignores_the_attr(flag):
    rng = np.random.default_rng(0)
    start = rng.normal(size=(6, 3)).astype(np.float32)
    var, m, v = (tf.Variable(start), tf.Variable(tf.zeros([6, 3])),
                 tf.Variable(tf.zeros([6, 3])))
    idx = tf.constant([4, 1, 2], tf.int64)
    grad = tf.constant(rng.normal(size=(3, 3)).astype(np.float32))
    ops().sok_sparse_apply_adam(
        var=var.handle, m=m.handle, v=v.handle, vhat=var.handle,
        indices=idx, grad=grad, lr=0.1, beta_1=0.9, beta_2=0.999,
        epsilon=1e-7, step=1.0, indices_are_unique=flag)
    ref = tf.Variable(start)
    m2, v2 = tf.Variable(tf.zeros([6, 3])), tf.Variable(tf.zeros([6, 3]))
    sparse_kernels.sparse_adam(ref, m2, v2, idx, grad, 0.1, 1.0)
    np.testing.assert_array_equal(var.numpy(), ref.numpy())
    np.testing.assert_array_equal(m.numpy(), m2.numpy())


def _apply_ops(model, x, y):
    """The `indices_are_unique` attr of every SokSparseApply* op of one
    traced train step (in the graph or the functions it calls)."""
    model.train_on_batch(x, y)  # builds the optimizer's slots
    fn = tf.function(lambda a, b: model.train_step((a, b)))
    g = fn.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    graph_def = g.as_graph_def()
    nodes = list(graph_def.node)
    for fdef in graph_def.library.function:
        nodes += list(fdef.node_def)
    return [bool(n.attr["indices_are_unique"].b) for n in nodes
            if n.op.startswith("SokSparseApply")]


@pytest.mark.parametrize("twice", [False, True])
def test_train_step_skips_the_dedup_only_when_proven(twice):
    """fit's step over one pooled sok lookup: Adam's update gets the attr;
    a table looked up twice (gradients concatenated) keeps the dedup."""
    vocab = 50
    emb = sok.layers.DistributedEmbedding(vocab, 4, combiner="sum")
    ids = keras.Input(shape=(3,), dtype="int64")
    out = emb(ids)
    if twice:
        out = out + emb(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(out))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(0.01)), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.integers(-1, vocab, (8, 3)).astype(np.int64)
    y = rng.normal(size=(8, 1)).astype(np.float32)
    assert _apply_ops(model, x, y) == [not twice]
