"""Tests of the lookup-path ops against NumPy and TensorFlow references."""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import lookup_ops
from sok_keras._ops import ops

COMBINERS = ("sum", "mean", "sqrtn")


# ----------------------------------------------------------------------------
# Helpers.


def _reference_dedup(ids, num_ranks, owner=-1):
    """NumPy reference of dedup_bucketize's outputs for valid ids."""
    ids = np.asarray(ids, np.int64)
    distinct = np.unique(ids)
    if owner < 0:
        ranks = distinct % num_ranks
        rows = distinct // num_ranks
    else:
        ranks = np.full_like(distinct, owner)
        rows = distinct.copy()
    order = np.lexsort((distinct, ranks))  # by rank, then by id
    unique_ids = distinct[order]
    local_rows = rows[order]
    counts = np.bincount(ranks, minlength=num_ranks).astype(np.int64)
    index = {int(u): k for k, u in enumerate(unique_ids)}
    inverse = np.array([index[int(i)] for i in ids], np.int32)
    return unique_ids, local_rows, inverse, counts


def _random_batch(
    rng, batch, vocab, max_len, dtype, weighted, shuffle=True, signed=True
):
    """A ragged batch: some rows empty; returns positions-level arrays.

    Signed weights suit "sum" only: "mean" and "sqrtn" divide by the sum of a
    row's weights, which signed weights can bring near zero, and then any two
    correct summation orders differ by far more than 1e-6. Mean/sqrtn get
    positive weights, as real per-id weights are.
    """
    lengths = rng.integers(0, max_len + 1, size=batch)
    lengths[batch // 2] = 0  # at least one empty segment
    lengths[-1] = max(lengths[-1], 1)  # TF's output has max_segment + 1 rows
    segment_ids = np.repeat(np.arange(batch), lengths)
    ids = rng.integers(0, vocab, size=segment_ids.size)
    # Force duplicates within and across segments.
    if ids.size > 4:
        ids[1] = ids[0]
        ids[-1] = ids[0]
    weights = None
    if weighted:
        low = -1.0 if signed else 0.25
        weights = rng.uniform(low, 2.0, size=ids.size).astype(dtype)
    perm = rng.permutation(ids.size) if shuffle else np.arange(ids.size)
    return segment_ids, ids, weights, perm, lengths


def _tf_reference(table, segment_ids, ids, weights, lengths, combiner):
    """tf.nn.embedding_lookup_sparse over the (sorted) positions."""
    batch = lengths.size
    col = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    indices = np.stack([segment_ids.astype(np.int64), col], axis=1)
    dense_shape = [batch, max(int(lengths.max()), 1)]
    sp_ids = tf.SparseTensor(indices, tf.constant(ids, tf.int64), dense_shape)
    sp_weights = None
    if weights is not None:
        sp_weights = tf.SparseTensor(indices, tf.constant(weights), dense_shape)
    return tf.nn.embedding_lookup_sparse(
        table, sp_ids, sp_weights, combiner=combiner
    )


def _numpy_combine(rows, inverse, segment_ids, weights, batch, combiner):
    """Float64 NumPy reference of segment_combine."""
    rows = np.asarray(rows, np.float64)
    w = np.ones(len(inverse)) if weights is None else np.asarray(weights, np.float64)
    out = np.zeros((batch, rows.shape[1]))
    wsum = np.zeros(batch)
    wsq = np.zeros(batch)
    for i, (u, b) in enumerate(zip(inverse, segment_ids)):
        out[b] += w[i] * rows[u]
        wsum[b] += w[i]
        wsq[b] += w[i] ** 2
    if combiner == "sum":
        return out
    den = wsum if combiner == "mean" else np.sqrt(wsq)
    safe = np.where(den == 0, 1.0, den)
    return np.where(den[:, None] == 0, 0.0, out / safe[:, None])


def _tolerances(dtype):
    if dtype == np.float32:
        return dict(rtol=1e-6, atol=1e-5)
    return dict(rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------
# SokDedupBucketize.


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
def test_dedup_distributed_matches_reference(num_ranks, id_dtype):
    rng = np.random.default_rng(num_ranks)
    ids = rng.integers(0, 50, size=200)
    unique_ids, local_rows, inverse, counts, error = (
        lookup_ops.dedup_bucketize(
            tf.constant(ids, id_dtype), num_ranks=num_ranks, vocab_size=50
        )
    )
    ref = _reference_dedup(ids, num_ranks)
    np.testing.assert_array_equal(unique_ids.numpy(), ref[0])
    np.testing.assert_array_equal(local_rows.numpy(), ref[1])
    np.testing.assert_array_equal(inverse.numpy(), ref[2])
    np.testing.assert_array_equal(counts.numpy(), ref[3])
    np.testing.assert_array_equal(error.numpy(), [-1, 0])
    assert unique_ids.dtype == tf.int64 and inverse.dtype == tf.int32
    # Grouping: the owner rank is non-decreasing along unique_ids.
    assert np.all(np.diff(unique_ids.numpy() % num_ranks) >= 0)
    np.testing.assert_array_equal(unique_ids.numpy()[inverse.numpy()], ids)


def test_dedup_small_example():
    out = lookup_ops.dedup_bucketize(
        tf.constant([5, 3, 5, 0, 7, 4], tf.int64), num_ranks=3, vocab_size=10
    )
    np.testing.assert_array_equal(out.unique_ids, [0, 3, 4, 7, 5])
    np.testing.assert_array_equal(out.local_rows, [0, 1, 1, 2, 1])
    np.testing.assert_array_equal(out.inverse, [4, 1, 4, 0, 3, 2])
    np.testing.assert_array_equal(out.counts, [2, 2, 1])


@pytest.mark.parametrize("owner", [0, 2])
def test_dedup_localized(owner):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 30, size=100)
    out = lookup_ops.dedup_bucketize(
        tf.constant(ids), num_ranks=3, vocab_size=30, owner=owner
    )
    ref = _reference_dedup(ids, 3, owner=owner)
    np.testing.assert_array_equal(out.unique_ids, ref[0])
    np.testing.assert_array_equal(out.local_rows, ref[1])
    np.testing.assert_array_equal(out.inverse, ref[2])
    np.testing.assert_array_equal(out.counts, ref[3])
    assert out.counts.numpy()[owner] == len(np.unique(ids))


@pytest.mark.parametrize("num_ranks,owner", [(1, -1), (3, -1), (4, 1)])
def test_dedup_large_sparse_vocab(num_ranks, owner):
    # A huge vocabulary takes the hash-table path (and a parallel dedup).
    rng = np.random.default_rng(11)
    vocab = 10**12
    ids = rng.integers(0, vocab, size=150_000)
    ids[::3] = ids[0]  # many duplicates
    ids[1::7] = ids[5]
    out = lookup_ops.dedup_bucketize(
        tf.constant(ids), num_ranks=num_ranks, vocab_size=vocab, owner=owner
    )
    distinct = np.unique(ids)
    ranks = distinct % num_ranks if owner < 0 else np.full_like(distinct, owner)
    order = np.lexsort((distinct, ranks))
    np.testing.assert_array_equal(out.unique_ids, distinct[order])
    expected_rows = distinct // num_ranks if owner < 0 else distinct
    np.testing.assert_array_equal(out.local_rows, expected_rows[order])
    np.testing.assert_array_equal(out.unique_ids.numpy()[out.inverse.numpy()], ids)
    np.testing.assert_array_equal(
        out.counts, np.bincount(ranks, minlength=num_ranks)
    )


def test_dedup_large_dense_vocab_is_deterministic():
    rng = np.random.default_rng(3)
    ids = tf.constant(rng.integers(0, 100_000, size=300_000))
    first = lookup_ops.dedup_bucketize(ids, num_ranks=2, vocab_size=100_000)
    second = lookup_ops.dedup_bucketize(ids, num_ranks=2, vocab_size=100_000)
    ref = _reference_dedup(ids.numpy(), 2)
    for a, b, r in zip(first[:4], second[:4], ref):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, r)


def test_dedup_extreme_int64_ids():
    big = np.iinfo(np.int64).max - 1
    ids = np.array([big, 0, big - 1, big, 1], np.int64)
    out = lookup_ops.dedup_bucketize(
        tf.constant(ids), num_ranks=3, vocab_size=big + 1
    )
    ref = _reference_dedup(ids, 3)
    np.testing.assert_array_equal(out.unique_ids, ref[0])
    np.testing.assert_array_equal(out.local_rows, ref[1])
    np.testing.assert_array_equal(out.inverse, ref[2])


def test_dedup_empty():
    out = lookup_ops.dedup_bucketize(
        tf.zeros([0], tf.int64), num_ranks=2, vocab_size=10
    )
    assert out.unique_ids.shape == (0,) and out.inverse.shape == (0,)
    np.testing.assert_array_equal(out.counts, [0, 0])
    np.testing.assert_array_equal(out.error, [-1, 0])


@pytest.mark.parametrize("bad", [10, 123, -1, -7])
def test_dedup_invalid_id_raises(bad):
    ids = tf.constant([1, 2, bad, 3, 99], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.dedup_bucketize(
            ids, num_ranks=2, vocab_size=10, table_name="user_table"
        )
    message = str(info.value)
    assert "user_table" in message
    assert f"id {bad} at position 2" in message
    assert "[0, 10)" in message


def test_dedup_invalid_id_raises_in_tf_function():
    @tf.function
    def lookup(ids):
        return lookup_ops.dedup_bucketize(
            ids, num_ranks=2, vocab_size=10, table_name="fn_table"
        ).unique_ids

    assert lookup(tf.constant([1, 2], tf.int32)).shape == (2,)
    with pytest.raises(tf.errors.InvalidArgumentError, match="fn_table.*id 12"):
        lookup(tf.constant([1, 12], tf.int32))


def test_dedup_no_raise_reports_first_error():
    ids = tf.constant([4, 3, 4, 11, -2, 12, 0], tf.int64)
    out = lookup_ops.dedup_bucketize(
        ids, num_ranks=3, vocab_size=10, table_name="t", raise_on_error=False
    )
    assert out.unique_ids.shape == (0,) and out.local_rows.shape == (0,)
    np.testing.assert_array_equal(out.inverse, np.zeros(7))
    np.testing.assert_array_equal(out.counts, [0, 0, 0])
    np.testing.assert_array_equal(out.error, [3, 11])


def test_dedup_bad_owner_raises():
    with pytest.raises(tf.errors.InvalidArgumentError, match="owner"):
        lookup_ops.dedup_bucketize(
            tf.constant([1]), num_ranks=2, vocab_size=10, owner=2
        )


def test_dedup_static_shapes():
    @tf.function
    def fn(ids):
        out = lookup_ops.dedup_bucketize(ids, num_ranks=4, vocab_size=10)
        assert out.counts.shape == (4,)
        assert out.error.shape == (2,)
        assert out.inverse.shape.as_list() == [6]
        assert out.unique_ids.shape.as_list() == [None]
        return out.counts

    fn(tf.constant([1, 2, 3, 4, 5, 6]))


# ----------------------------------------------------------------------------
# SokCheckExchange.


def test_check_exchange_happy_path():
    counts = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int64)
    errors = np.array([[-1, 0]] * 3, np.int64)
    gathered = np.concatenate([counts, errors], axis=1)
    out = lookup_ops.check_exchange(gathered, vocab_size=10, table_name="t")
    np.testing.assert_array_equal(out, counts)


def test_check_exchange_names_first_bad_rank():
    gathered = np.array(
        [
            [1, 2, 3, -1, 0],
            [0, 0, 0, 5, 42],
            [0, 0, 0, 1, -3],
        ],
        np.int64,
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.check_exchange(gathered, vocab_size=10, table_name="items")
    message = str(info.value)
    assert "table 'items'" in message
    assert "rank 1 looked up id 42 (position 5)" in message
    assert "[0, 10)" in message


def test_check_exchange_bad_shape():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lookup_ops.check_exchange(
            np.zeros([2, 3], np.int64), vocab_size=10, table_name="t"
        )


def test_dedup_then_check_exchange_round_trip():
    # Two simulated ranks; rank 1 sees an invalid id and does not raise.
    good = lookup_ops.dedup_bucketize(
        tf.constant([0, 1, 3]), num_ranks=2, vocab_size=4, raise_on_error=False
    )
    bad = lookup_ops.dedup_bucketize(
        tf.constant([0, 9]), num_ranks=2, vocab_size=4, raise_on_error=False
    )
    gathered = tf.stack(
        [tf.concat([good.counts, good.error], 0), tf.concat([bad.counts, bad.error], 0)]
    )
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="rank 1 looked up id 9 .position 1."
    ):
        lookup_ops.check_exchange(gathered, vocab_size=4, table_name="t")


# ----------------------------------------------------------------------------
# SokSegmentCombine.


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seg_dtype", [tf.int32, tf.int64])
def test_segment_combine_matches_tf(combiner, weighted, dtype, seg_dtype):
    # A seed that is the same in every process (hash() of a str is not).
    rng = np.random.default_rng(101 + 2 * COMBINERS.index(combiner) + weighted)
    batch, vocab, dim = 17, 40, 5
    table = rng.normal(size=(vocab, dim)).astype(dtype)
    segment_ids, ids, weights, perm, lengths = _random_batch(
        rng, batch, vocab, 6, dtype, weighted, signed=combiner == "sum"
    )
    expected = _tf_reference(
        tf.constant(table), segment_ids, ids, weights, lengths, combiner
    )
    assert expected.shape == (batch, dim)
    dedup = lookup_ops.dedup_bucketize(
        tf.constant(ids[perm]), num_ranks=1, vocab_size=vocab
    )
    rows = tf.gather(tf.constant(table), dedup.unique_ids)
    out = lookup_ops.segment_combine(
        rows,
        dedup.inverse,
        tf.constant(segment_ids[perm], seg_dtype),
        None if weights is None else tf.constant(weights[perm]),
        batch,
        combiner,
    )
    assert out.dtype == dtype and out.shape == (batch, dim)
    np.testing.assert_allclose(out, expected, **_tolerances(dtype))
    np.testing.assert_allclose(
        out,
        _numpy_combine(
            rows, dedup.inverse.numpy(), segment_ids[perm],
            None if weights is None else weights[perm], batch, combiner,
        ),
        rtol=1e-5 if dtype == np.float32 else 1e-12,
        atol=1e-5 if dtype == np.float32 else 1e-12,
    )
    assert np.all(out.numpy()[lengths == 0] == 0)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_segment_combine_zero_weight_sum_gives_zero(combiner):
    rows = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    inverse = tf.constant([0, 1, 0], tf.int32)
    segment_ids = tf.constant([0, 0, 1])
    weights = tf.constant([1.0, -1.0, 0.0])
    out = lookup_ops.segment_combine(rows, inverse, segment_ids, weights, 3, combiner)
    if combiner == "mean":
        expected = [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]  # Σw == 0
    elif combiner == "sqrtn":
        s = np.sqrt(2.0)
        expected = [[-2.0 / s, -2.0 / s], [0.0, 0.0], [0.0, 0.0]]
    else:
        expected = [[-2.0, -2.0], [0.0, 0.0], [0.0, 0.0]]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert not np.any(np.isnan(out.numpy()))


def test_segment_combine_all_empty_and_zero_batch():
    rows = tf.ones([3, 4])
    empty = tf.zeros([0], tf.int32)
    out = lookup_ops.segment_combine(rows, empty, empty, None, 5, "mean")
    np.testing.assert_array_equal(out, np.zeros([5, 4]))
    out = lookup_ops.segment_combine(rows, empty, empty, None, 0, "sum")
    assert out.shape == (0, 4)


def test_segment_combine_validation():
    rows = tf.ones([3, 2])
    inv = tf.constant([0, 1, 2], tf.int32)
    seg = tf.constant([0, 1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"inverse\[1\] = 3"):
        lookup_ops.segment_combine(rows, tf.constant([0, 3, 1]), seg, None, 2, "sum")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"segment_ids\[2\] = 2"):
        lookup_ops.segment_combine(rows, inv, tf.constant([0, 1, 2]), None, 2, "sum")
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment_ids"):
        lookup_ops.segment_combine(rows, inv, tf.constant([0, -1, 1]), None, 2, "sum")
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights"):
        lookup_ops.segment_combine(rows, inv, seg, tf.ones([2]), 2, "sum")
    with pytest.raises(tf.errors.InvalidArgumentError, match="num_segments"):
        lookup_ops.segment_combine(rows, inv, seg, None, -1, "sum")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lookup_ops.segment_combine(rows, inv, tf.constant([0, 1]), None, 2, "sum")
    with pytest.raises(ValueError, match="combiner"):
        lookup_ops.segment_combine(rows, inv, seg, None, 2, "max")


def test_segment_combine_static_shape_in_tf_function():
    @tf.function
    def fn(rows, inverse, segment_ids):
        out = lookup_ops.segment_combine(rows, inverse, segment_ids, None, 7, "sum")
        assert out.shape.as_list() == [7, 3]
        return out

    out = fn(tf.ones([2, 3]), tf.constant([0, 1, 1], tf.int32), tf.constant([6, 0, 6]))
    np.testing.assert_array_equal(out.numpy()[6], [2.0, 2.0, 2.0])


def test_segment_combine_large_parallel_matches_unsorted_segment_sum():
    rng = np.random.default_rng(5)
    nnz, batch, num_rows, dim = 200_000, 3000, 5000, 16
    rows = tf.constant(rng.normal(size=(num_rows, dim)))
    inverse = tf.constant(rng.integers(0, num_rows, nnz), tf.int32)
    segment_ids = tf.constant(rng.integers(0, batch, nnz), tf.int64)
    weights = tf.constant(rng.uniform(size=nnz))
    out = lookup_ops.segment_combine(rows, inverse, segment_ids, weights, batch, "sum")
    expected = tf.math.unsorted_segment_sum(
        tf.gather(rows, inverse) * weights[:, None], segment_ids, batch
    )
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10)
    again = lookup_ops.segment_combine(rows, inverse, segment_ids, weights, batch, "sum")
    np.testing.assert_array_equal(out, again)  # deterministic, bit for bit


# ----------------------------------------------------------------------------
# SokSegmentCombineGrad and end-to-end gradients.


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_combine_grad_op_matches_numpy(combiner, weighted):
    rng = np.random.default_rng(1 + weighted)
    nnz, batch, num_rows, dim = 60, 9, 12, 3
    inverse = rng.integers(0, num_rows, nnz).astype(np.int32)
    segment_ids = rng.integers(0, batch - 1, nnz)  # last segment empty
    weights = rng.uniform(0.1, 2.0, nnz) if weighted else None
    grad = rng.normal(size=(batch, dim))
    # Reference: the Jacobian-transpose of the NumPy forward, via linearity.
    expected = np.zeros((num_rows, dim))
    for u in range(num_rows):
        for d in range(dim):
            basis = np.zeros((num_rows, dim))
            basis[u, d] = 1.0
            forward = _numpy_combine(basis, inverse, segment_ids, weights, batch, combiner)
            expected[u, d] = np.sum(forward * grad)
    out = ops().sok_segment_combine_grad(
        grad=tf.constant(grad),
        inverse=tf.constant(inverse),
        segment_ids=tf.constant(segment_ids),
        weights=tf.constant(weights if weighted else np.zeros(0)),
        num_unique=tf.constant(num_rows, tf.int64),
        combiner=combiner,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def _end_to_end_grads(table, segment_ids, ids, weights, perm, lengths, combiner):
    batch = lengths.size
    cotangent = tf.constant(
        np.random.default_rng(0).normal(size=(batch, table.shape[1])),
        table.dtype,
    )
    table_var = tf.Variable(table)

    def sok_loss():
        dedup = lookup_ops.dedup_bucketize(
            tf.constant(ids[perm]), num_ranks=1, vocab_size=table.shape[0]
        )
        rows = tf.gather(table_var, dedup.unique_ids)
        out = lookup_ops.segment_combine(
            rows,
            dedup.inverse,
            tf.constant(segment_ids[perm]),
            None if weights is None else tf.constant(weights[perm]),
            batch,
            combiner,
        )
        return tf.reduce_sum(out * cotangent)

    def tf_loss():
        out = _tf_reference(table_var, segment_ids, ids, weights, lengths, combiner)
        return tf.reduce_sum(out * cotangent)

    def grad_of(loss_fn):
        with tf.GradientTape() as tape:
            loss = loss_fn()
        return loss, tf.convert_to_tensor(tape.gradient(loss, table_var))

    return grad_of(sok_loss), grad_of(tf_loss), tf.function(lambda: grad_of(sok_loss))()


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_matches_embedding_lookup_sparse(combiner, weighted, dtype):
    rng = np.random.default_rng(17 + weighted)
    batch, vocab, dim = 13, 25, 4
    table = rng.normal(size=(vocab, dim)).astype(dtype)
    segment_ids, ids, weights, perm, lengths = _random_batch(
        rng, batch, vocab, 7, dtype, weighted, signed=combiner == "sum"
    )
    (sok_loss, sok_grad), (tf_loss, tf_grad), (fn_loss, fn_grad) = (
        _end_to_end_grads(table, segment_ids, ids, weights, perm, lengths, combiner)
    )
    tol = _tolerances(dtype)
    np.testing.assert_allclose(sok_loss, tf_loss, **tol)
    assert np.any(tf_grad.numpy() != 0)
    np.testing.assert_allclose(sok_grad, tf_grad, **tol)
    np.testing.assert_allclose(fn_loss, tf_loss, **tol)
    np.testing.assert_allclose(fn_grad, tf_grad, **tol)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_gradient_for_weights(combiner):
    """d out / d w_i through the numerator and the mean/sqrtn denominator,
    as tf.nn.embedding_lookup_sparse's (rows and weights made by hand)."""
    rows = tf.constant([[1.0, 2.0, 0.5], [-1.0, 0.0, 3.0]])
    weights = tf.constant([1.0, 2.0, 0.5])
    inverse = tf.constant([0, 1, 1], tf.int32)
    segments = tf.constant([0, 0, 1])
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([rows, weights])
        out = lookup_ops.segment_combine(rows, inverse, segments, weights, 2,
                                         combiner)
        per_id = tf.gather(rows, inverse) * weights[:, None]
        num = tf.math.unsorted_segment_sum(per_id, segments, 2)
        den = {"sum": tf.ones([2]),
               "mean": tf.math.unsorted_segment_sum(weights, segments, 2),
               "sqrtn": tf.sqrt(tf.math.unsorted_segment_sum(
                   weights * weights, segments, 2))}[combiner]
        want = num / den[:, None]
        up = tf.constant([[0.3, -1.0, 2.0], [1.5, 0.5, -0.25]])
        loss, loss_want = tf.reduce_sum(out * up), tf.reduce_sum(want * up)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    rows_grad, weights_grad = tape.gradient(loss, [rows, weights])
    rows_want, weights_want = tape.gradient(loss_want, [rows, weights])
    np.testing.assert_allclose(rows_grad, tf.convert_to_tensor(rows_want),
                               rtol=1e-6)
    np.testing.assert_allclose(weights_grad, weights_want, rtol=1e-6)


def test_reimport_does_not_reregister():
    import importlib

    importlib.reload(lookup_ops)
    out = lookup_ops.segment_combine(
        tf.ones([1, 2]), tf.constant([0], tf.int32), tf.constant([0]), None, 1, "sum"
    )
    np.testing.assert_array_equal(out, [[1.0, 1.0]])


def _tree_sum(terms, chunk=64):
    """The kGradChunk order of core/lookup.h, in float32: left-to-right
    sums of chunks of `chunk` terms, level after level."""
    def left_to_right(xs):
        acc = np.zeros(xs.shape[1:], np.float32)
        for x in xs:
            acc = np.float32(acc + x)
        return acc

    level = terms
    if len(level) <= chunk:
        return left_to_right(level)
    while len(level) > 1:
        level = np.stack([left_to_right(level[j:j + chunk])
                          for j in range(0, len(level), chunk)])
    return level[0]


def test_segment_combine_grad_sums_hot_rows_in_the_chunked_order():
    """A row with more than 64 (and more than 64**2) terms is summed in the
    documented tree order, the order the GPU kernel uses too; a row of at
    most 64 terms left to right."""
    rng = np.random.default_rng(3)
    dim, batch = 3, 400
    inverse = np.concatenate([np.zeros(5000, np.int32),
                              np.ones(64, np.int32),
                              np.full(65, 2, np.int32)])
    rng.shuffle(inverse)
    segs = rng.integers(0, batch, inverse.size)
    grad = (rng.normal(size=(batch, dim)) * 1e3).astype(np.float32)
    out = ops().sok_segment_combine_grad(
        grad=grad, inverse=inverse, segment_ids=segs, weights=tf.zeros([0]),
        num_unique=tf.constant(3, tf.int64), combiner="sum").numpy()
    for u in range(3):
        terms = grad[segs[inverse == u]]  # ascending position order
        np.testing.assert_array_equal(out[u], _tree_sum(terms))
    # The tree order differs from a plain left-to-right sum here (so the
    # check above can tell them apart).
    plain = np.zeros(dim, np.float32)
    for x in grad[segs[inverse == 0]]:
        plain = np.float32(plain + x)
    assert not np.array_equal(plain, _tree_sum(grad[segs[inverse == 0]]))
