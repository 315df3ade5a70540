"""The table gradient of `SokPooledLookup`: `SokPooledGradPlan` +
`SokPooledGradCombine` (what the registered gradient uses) and the same two
halves in one op, `SokPooledLookupGrad`.

Checked on the CPU against the chain they replace (padding dropped with
boolean masks, `SokDedupBucketize`, `SokSegmentCombineGrad`), bit for bit,
and against a NumPy reference; bad input raises naming the table. The
CUDA kernels are compared with these CPU kernels in tests/test_gpu.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import lookup_ops
from sok_keras._ops import ops


def _bags(rng, batch, max_len, vocab, id_dtype, pad_frac=0.2, hot=5):
    lengths = rng.integers(0, max_len + 1, batch)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    nnz = int(splits[-1])
    ids = np.where(rng.random(nnz) < 0.5, rng.integers(0, hot, nnz),
                   rng.integers(0, vocab, nnz))
    ids = np.where(rng.random(nnz) < pad_frac, -1, ids).astype(id_dtype)
    return ids, splits


def _chain(dy, ids, splits, weights, combiner, vocab):
    """The unfused backward (what lookup._pooled_lookup_grad did before)."""
    segments = tf.ragged.row_splits_to_segment_ids(splits)
    keep = tf.not_equal(ids, -1)
    kept = tf.boolean_mask(ids, keep)
    segments = tf.boolean_mask(segments, keep)
    w = (tf.zeros([0], dy.dtype) if weights.shape[0] == 0
         else tf.boolean_mask(weights, keep))
    d = lookup_ops.dedup_bucketize(kept, num_ranks=1, vocab_size=vocab,
                                   table_name="t")
    g = ops().sok_segment_combine_grad(
        grad=dy, inverse=d.inverse, segment_ids=segments, weights=w,
        num_unique=tf.shape(d.local_rows, out_type=tf.int64)[0],
        combiner=combiner)
    return g.numpy(), d.local_rows.numpy()


def _fused(dy, ids, splits, weights, combiner, vocab, name="t"):
    g, rows = ops().sok_pooled_lookup_grad(
        grad=dy, ids=ids, row_splits=splits, weights=weights,
        combiner=combiner, num_rows=vocab, table_name=name)
    return g.numpy(), rows.numpy()


def _split(dy, ids, splits, weights, combiner, vocab, name="t",
           bag_width=-1):
    """The two ops the registered gradient uses: plan, then combine."""
    plan = ops().sok_pooled_grad_plan(
        ids=ids, row_splits=splits, weights=weights, combiner=combiner,
        num_rows=vocab, table_name=name, bag_width=bag_width)
    g = ops().sok_pooled_grad_combine(
        grad=dy, offsets=plan.offsets, segments=plan.segments,
        sorted_weights=plan.sorted_weights, denominator=plan.denominator,
        table_name=name)
    return g.numpy(), plan.rows.numpy()


def _reference(dy, ids, splits, weights, combiner, vocab):
    """NumPy: the dense table gradient, in float64."""
    dy = np.asarray(dy, np.float64)
    out = np.zeros([vocab, dy.shape[1]])
    for b in range(len(splits) - 1):
        lo, hi = splits[b], splits[b + 1]
        w = (np.ones(hi - lo) if weights.size == 0
             else np.asarray(weights[lo:hi], np.float64))
        keep = ids[lo:hi] != -1
        if combiner == "mean":
            den = w[keep].sum()
        elif combiner == "sqrtn":
            den = np.sqrt((w[keep] ** 2).sum())
        else:
            den = 1.0
        for i in np.nonzero(keep)[0]:
            if den != 0:
                out[ids[lo + i]] += w[i] * dy[b] / den
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_unfused_chain_bitwise(dtype, id_dtype, combiner, weighted):
    rng = np.random.default_rng(7)
    vocab, dim = 300, 12
    ids, splits = _bags(rng, 97, 9, vocab, id_dtype)
    nnz = ids.size
    dy = tf.constant(rng.standard_normal([97, dim]).astype(dtype))
    weights = tf.constant(
        rng.uniform(0.1, 2.0, nnz).astype(dtype) if weighted
        else np.zeros([0], dtype))
    ids_t, splits_t = tf.constant(ids), tf.constant(splits)
    g, rows = _fused(dy, ids_t, splits_t, weights, combiner, vocab)
    g0, rows0 = _chain(dy, ids_t, splits_t, weights, combiner, vocab)
    np.testing.assert_array_equal(rows, rows0)
    np.testing.assert_array_equal(g, g0)
    g1, rows1 = _split(dy, ids_t, splits_t, weights, combiner, vocab)
    np.testing.assert_array_equal(rows1, rows0)
    np.testing.assert_array_equal(g1, g0)
    # Distinct, ascending rows; the dense gradient matches NumPy.
    assert np.all(np.diff(rows) > 0)
    np.testing.assert_array_equal(rows, np.unique(ids[ids != -1]))
    dense = np.zeros([vocab, dim])
    dense[rows] = g
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(
        dense, _reference(dy.numpy(), ids, splits, weights.numpy(), combiner,
                          vocab), rtol=rtol, atol=rtol)


def test_hot_row_over_many_chunks_matches_chain():
    # One row seen far more than kGradChunk (64) times: the chunk tree.
    rng = np.random.default_rng(3)
    ids = np.where(rng.random(5000) < 0.7, 4, rng.integers(0, 50, 5000))
    ids = np.where(rng.random(5000) < 0.1, -1, ids).astype(np.int64)
    splits = np.arange(0, 5001, 5, dtype=np.int64)
    dy = tf.constant(rng.standard_normal([1000, 8]).astype(np.float32))
    w = tf.zeros([0], tf.float32)
    args = (dy, tf.constant(ids), tf.constant(splits), w, "mean", 50)
    chain = _chain(*args)
    for a, b in zip(_fused(*args), chain):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_split(*args), chain):
        np.testing.assert_array_equal(a, b)


def test_empty_and_all_padding():
    dy = tf.ones([3, 4])
    w = tf.zeros([0])
    g, rows = _fused(dy, tf.constant([-1, -1], tf.int64),
                     tf.constant([0, 1, 1, 2], tf.int64), w, "sum", 10)
    assert g.shape == (0, 4) and rows.shape == (0,)
    g, rows = _fused(tf.ones([2, 4]), tf.zeros([0], tf.int64),
                     tf.constant([0, 0, 0], tf.int64), w, "mean", 10)
    assert g.shape == (0, 4) and rows.shape == (0,)
    g, rows = _fused(tf.ones([0, 4]), tf.zeros([0], tf.int32),
                     tf.constant([0], tf.int64), w, "sum", 10)
    assert g.shape == (0, 4) and rows.shape == (0,)
    for combiner in ("sum", "mean", "sqrtn"):
        g, rows = _split(dy, tf.constant([-1, -1], tf.int64),
                         tf.constant([0, 1, 1, 2], tf.int64), w, combiner, 10)
        assert g.shape == (0, 4) and rows.shape == (0,)
        plan = ops().sok_pooled_grad_plan(
            ids=tf.zeros([0], tf.int64), row_splits=tf.constant([0, 0, 0],
                                                                tf.int64),
            weights=w, combiner=combiner, num_rows=10)
        assert plan.offsets.numpy().tolist() == [0]
        assert plan.segments.shape == (0,)
        assert plan.denominator.numpy().tolist() == (
            [] if combiner == "sum" else [0.0, 0.0])


@pytest.mark.parametrize("fn", [_fused, _split])
def test_invalid_id_names_table_and_position(fn):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 'emb'.*id 12 at position 2 .*\[0, 10\)"):
        fn(tf.ones([2, 4]), tf.constant([1, -1, 12, 3], tf.int64),
           tf.constant([0, 2, 4], tf.int64), tf.zeros([0]), "sum", 10,
           name="emb")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 'emb'.*id -2 at position 0"):
        fn(tf.ones([1, 4]), tf.constant([-2], tf.int64),
           tf.constant([0, 1], tf.int64), tf.zeros([0]), "sum", 10,
           name="emb")


@pytest.mark.parametrize("fn", [_fused, _split])
@pytest.mark.parametrize("splits", [[0, 3, 2, 4], [1, 2, 3, 4], [0, 1, 2, 3]])
def test_bad_splits(splits, fn):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="table 'emb'.*row_splits are inconsistent"):
        fn(tf.ones([3, 4]), tf.constant([1, 2, 3, 4], tf.int64),
           tf.constant(splits, tf.int64), tf.zeros([0]), "sum", 10,
           name="emb")


def test_plan_layout():
    """The plan's tensors, as documented: distinct rows ascending; each
    row's terms (kept positions, ascending) with their bags and weights;
    the bags' denominators."""
    rng = np.random.default_rng(2)
    vocab = 25
    ids, splits = _bags(rng, 30, 7, vocab, np.int64)
    w = rng.uniform(0.5, 2.0, ids.size).astype(np.float32)
    plan = ops().sok_pooled_grad_plan(
        ids=tf.constant(ids), row_splits=tf.constant(splits),
        weights=tf.constant(w), combiner="sqrtn", num_rows=vocab,
        table_name="t")
    rows, offsets = plan.rows.numpy(), plan.offsets.numpy()
    np.testing.assert_array_equal(rows, np.unique(ids[ids != -1]))
    bag = np.repeat(np.arange(30), np.diff(splits))
    expect_seg, expect_w = [], []
    for r in rows:
        (pos,) = np.nonzero(ids == r)
        expect_seg += bag[pos].tolist()
        expect_w += w[pos].tolist()
    assert offsets[0] == 0 and offsets[-1] == len(expect_seg)
    assert np.all(np.diff(offsets) >= 1)
    np.testing.assert_array_equal(plan.segments.numpy(), expect_seg)
    np.testing.assert_array_equal(plan.sorted_weights.numpy(),
                                  np.float32(expect_w))
    den = [np.sqrt(np.float32((w[splits[b]:splits[b + 1]][
        ids[splits[b]:splits[b + 1]] != -1] ** 2).sum()))
        for b in range(30)]
    np.testing.assert_allclose(plan.denominator.numpy(), den, rtol=1e-6)
    plain = ops().sok_pooled_grad_plan(
        ids=tf.constant(ids), row_splits=tf.constant(splits),
        weights=tf.zeros([0]), combiner="sum", num_rows=vocab)
    assert plain.sorted_weights.shape == (0,)
    assert plain.denominator.shape == (0,)


def test_combine_rejects_a_foreign_plan():
    plan = ops().sok_pooled_grad_plan(
        ids=tf.constant([1, 2, 3], tf.int64),
        row_splits=tf.constant([0, 1, 3], tf.int64), weights=tf.zeros([0]),
        combiner="mean", num_rows=10, table_name="emb")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="table 'emb'.*SokPooledGradPlan's outputs"):
        ops().sok_pooled_grad_combine(
            grad=tf.ones([3, 4]), offsets=plan.offsets,
            segments=plan.segments, sorted_weights=plan.sorted_weights,
            denominator=plan.denominator, table_name="emb")


def test_bad_shapes():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="row_splits must have one entry more"):
        _fused(tf.ones([3, 4]), tf.constant([1, 2], tf.int64),
               tf.constant([0, 2], tf.int64), tf.zeros([0]), "sum", 10)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="weights must be empty or have one entry"):
        _fused(tf.ones([1, 4]), tf.constant([1, 2], tf.int64),
               tf.constant([0, 2], tf.int64), tf.ones([3]), "sum", 10)


def test_lookup_gradient_is_plan_and_combine():
    """The registered gradient of SokPooledLookup is SokPooledGradPlan's
    rows and SokPooledGradCombine's sums, and gives the same dense gradient
    as tf.nn.embedding_lookup_sparse."""
    rng = np.random.default_rng(11)
    vocab, dim = 40, 6
    ids, splits = _bags(rng, 20, 6, vocab, np.int64)
    table = tf.Variable(rng.standard_normal([vocab, dim]).astype(np.float32))
    w = rng.uniform(0.5, 1.5, ids.size).astype(np.float32)

    seen = []

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            out = ops().sok_pooled_lookup(
                table=table, ids=tf.constant(ids),
                row_splits=tf.constant(splits), weights=tf.constant(w),
                combiner="sqrtn", table_name="t")
            loss = tf.reduce_sum(out * out)
        g = tape.gradient(loss, table)
        seen.append(g.indices.op.type)
        seen.append(g.values.op.type)
        return g

    g = grads()
    assert isinstance(g, tf.IndexedSlices)
    assert seen == ["SokPooledGradPlan", "SokPooledGradCombine"]
    keep = ids != -1
    seg = np.repeat(np.arange(20), np.diff(splits))[keep]
    sp = tf.SparseTensor(
        np.stack([seg, np.arange(keep.sum())], 1).astype(np.int64),
        ids[keep], [20, int(keep.sum())])
    spw = tf.SparseTensor(sp.indices, w[keep], sp.dense_shape)
    with tf.GradientTape() as tape:
        ref = tf.nn.embedding_lookup_sparse(table, sp, spw, combiner="sqrtn")
        loss = tf.reduce_sum(ref * ref)
    g_ref = tape.gradient(loss, table)
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                               tf.convert_to_tensor(g_ref).numpy(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_uniform_bags_equal_explicit_row_splits(combiner, weighted):
    """`bag_width` (dense ids; the op makes the row splits itself) gives the
    forward and the fused gradient of the same bags given as row splits,
    bit for bit."""
    rng = np.random.default_rng(5)
    vocab, dim, batch, width = 30, 8, 12, 4
    ids = rng.integers(0, vocab, batch * width)
    ids[rng.random(ids.size) < 0.2] = -1
    ids = tf.constant(ids, tf.int64)
    splits = tf.range(batch + 1, dtype=tf.int64) * width
    table = tf.constant(rng.standard_normal([vocab, dim]), tf.float32)
    w = (tf.constant(rng.uniform(0.5, 2, ids.shape[0]), tf.float32)
         if weighted else tf.zeros([0]))
    given = ops().sok_pooled_lookup(
        table=table, ids=ids, row_splits=splits, weights=w,
        combiner=combiner, table_name="t")
    made = ops().sok_pooled_lookup(
        table=table, ids=ids, row_splits=tf.zeros([0], tf.int64), weights=w,
        combiner=combiner, table_name="t", bag_width=width)
    np.testing.assert_array_equal(made.numpy(), given.numpy())
    dy = tf.constant(rng.standard_normal([batch, dim]), tf.float32)
    g1, r1 = ops().sok_pooled_lookup_grad(
        grad=dy, ids=ids, row_splits=splits, weights=w, combiner=combiner,
        num_rows=vocab, table_name="t")
    g2, r2 = ops().sok_pooled_lookup_grad(
        grad=dy, ids=ids, row_splits=tf.zeros([0], tf.int64), weights=w,
        combiner=combiner, num_rows=vocab, table_name="t", bag_width=width)
    np.testing.assert_array_equal(r2.numpy(), r1.numpy())
    np.testing.assert_array_equal(g2.numpy(), g1.numpy())
    g3, r3 = _split(dy, ids, tf.zeros([0], tf.int64), w, combiner, vocab,
                    bag_width=width)
    np.testing.assert_array_equal(r3, r1.numpy())
    np.testing.assert_array_equal(g3, g1.numpy())


def test_uniform_bags_need_a_multiple_of_the_width():
    for fn in (
        lambda: ops().sok_pooled_lookup(
            table=tf.ones([10, 4]), ids=tf.constant([1, 2, 3], tf.int64),
            row_splits=tf.zeros([0], tf.int64), weights=tf.zeros([0]),
            table_name="emb", bag_width=2),
        lambda: ops().sok_pooled_lookup_grad(
            grad=tf.ones([1, 4]), ids=tf.constant([1, 2, 3], tf.int64),
            row_splits=tf.zeros([0], tf.int64), weights=tf.zeros([0]),
            num_rows=10, table_name="emb", bag_width=2),
    ):
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                           match="table 'emb'.*3 ids do not make bags of 2"):
            fn()



def _step_graph(fn):
    """The ops of `fn` traced as a training step's function."""
    return tf.function(fn).get_concrete_function().graph.get_operations()


@pytest.mark.parametrize("pooled", [True, False])
def test_training_step_plans_before_the_lookup(pooled):
    """In a traced step whose tape records, the lookup (sok_keras.lookup
    path) takes the backward's SokPooledGradPlan as a control input and
    skips its own id check (one host sync on the GPU, docs/gpu.md); the
    gradient reuses that plan (one plan in the graph), and results equal
    the eager ones bit for bit. Without a tape the lookup checks its ids
    and makes no plan."""
    import keras

    import sok_keras as sok

    rng = np.random.default_rng(4)
    layer = sok.layers.DistributedEmbedding(
        50, 8, combiner="mean" if pooled else None, name="emb")
    ids = tf.constant(rng.integers(-1, 50, (16, 3)), tf.int64)
    layer.build(ids.shape)

    def step():
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(out * out)
        return out, tape.gradient(loss, layer.trainable_variables)[0]

    ops_ = _step_graph(step)
    types = [op.type for op in ops_]
    assert types.count("SokPooledGradPlan") == 1
    (look,) = [op for op in ops_ if op.type == "SokPooledLookup"]
    assert look.get_attr("check_ids") is False
    assert [c.type for c in look.control_inputs] == ["SokPooledGradPlan"]
    out_f, g_f = tf.function(step)()
    out_e, g_e = step()
    np.testing.assert_array_equal(out_f.numpy(), out_e.numpy())
    np.testing.assert_array_equal(g_f.indices.numpy(), g_e.indices.numpy())
    np.testing.assert_array_equal(g_f.values.numpy(), g_e.values.numpy())

    infer = _step_graph(lambda: layer(ids))
    assert "SokPooledGradPlan" not in [op.type for op in infer]
    (look,) = [op for op in infer if op.type == "SokPooledLookup"]
    assert look.get_attr("check_ids") is True
    del keras


def test_training_step_bad_id_fails_in_the_plan_naming_the_table():
    """With the check moved into the plan, a bad id in a traced training
    step still raises InvalidArgumentError naming the table, the id and its
    position, before the lookup runs."""
    import sok_keras as sok

    layer = sok.layers.DistributedEmbedding(10, 4, combiner="sum",
                                            name="emb")
    layer.build((None, 2))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids))
        return tape.gradient(loss, layer.trainable_variables)[0].values

    step(tf.constant([[1, 2]], tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 'emb'.*id 12 at position 3"):
        step(tf.constant([[1, 2], [-1, 12]], tf.int64))
