"""Single-process tests of SokBucketPad / SokBucketUnpad (sok_keras.bucket_ops)."""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import bucket_ops


def _ref_exponent(c):
    m = max(int(np.max(c)), 1)
    e = 0
    while (1 << e) < m:
        e += 1
    return e


def _ref_pad(x, c, rank):
    n = c.shape[0]
    bucket = 1 << _ref_exponent(c)
    out = np.zeros((n * bucket,) + x.shape[1:], x.dtype)
    off = 0
    for j in range(n):
        k = int(c[rank, j])
        out[j * bucket:j * bucket + k] = x[off:off + k]
        off += k
    return out


def _ref_unpad(got, c, rank):
    n = c.shape[0]
    bucket = got.shape[0] // n
    return np.concatenate(
        [got[j * bucket:j * bucket + int(c[j, rank])] for j in range(n)], 0)


def _rows(n, rest, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 100, size=(n,) + tuple(rest))
    if dtype == "bool":
        return (a % 2).astype(bool)
    return a.astype(dtype)


COUNTS = [
    np.array([[3]]),
    np.array([[0]]),
    np.array([[2, 1], [0, 5]]),
    np.array([[0, 0], [0, 0]]),
    np.array([[4, 4], [4, 4]]),  # exact power of two
    np.array([[1, 1], [1, 1]]),  # bucket 1
    np.array([[8, 0, 3], [0, 0, 7], [5, 9, 0]]),
    np.array([[16, 2, 0], [1, 0, 0], [0, 0, 16]]),  # max exactly 2^4
    np.array([[17, 2, 0], [1, 0, 0], [0, 0, 3]]),  # just above 2^4
]


@pytest.mark.parametrize("ci", range(len(COUNTS)))
@pytest.mark.parametrize("rest", [(), (3,), (2, 5)])
def test_pad_unpad_round_trip(ci, rest):
    c = COUNTS[ci]
    n = c.shape[0]
    for rank in range(n):
        x = _rows(int(c[rank].sum()), rest, np.float32, seed=rank)
        padded, e = bucket_ops.bucket_pad(x, c, rank)
        assert int(e) == _ref_exponent(c)
        np.testing.assert_array_equal(padded.numpy(), _ref_pad(x, c, rank))
        # Unpad with C^T takes back exactly what this rank padded.
        back = bucket_ops.bucket_unpad(padded, c.T, e, rank)
        np.testing.assert_array_equal(back.numpy(), x)


@pytest.mark.parametrize("ci", range(len(COUNTS)))
def test_simulated_all_to_all(ci):
    """Pad on every rank, transpose the blocks, unpad: the ragged exchange."""
    c = COUNTS[ci]
    n = c.shape[0]
    xs = [_rows(int(c[r].sum()), (2,), np.int64, seed=r) for r in range(n)]
    pads = []
    for r in range(n):
        p, e = bucket_ops.bucket_pad(xs[r], c, r)
        pads.append(p.numpy().reshape(n, -1, 2))
    for r in range(n):
        got = np.concatenate([pads[j][r] for j in range(n)], 0)
        y = bucket_ops.bucket_unpad(got, c, e, r).numpy()
        want = []
        for j in range(n):
            off = int(c[j, :r].sum())
            want.append(xs[j][off:off + int(c[j, r])])
        want = np.concatenate(want, 0)
        assert y.shape == (int(c[:, r].sum()), 2)
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(y, _ref_unpad(got, c, r))


@pytest.mark.parametrize("dtype", [
    tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64,
    tf.int8, tf.uint8, tf.int16, tf.uint16, tf.uint32, tf.uint64, tf.bool,
    tf.complex64, tf.complex128])
def test_dtypes(dtype):
    c = np.array([[2, 3], [1, 0]])
    x = tf.cast(tf.constant(_rows(5, (3,), np.int64)), dtype)
    padded, e = bucket_ops.bucket_pad(x, c, 0)
    assert padded.dtype == dtype and padded.shape == (8, 3)
    np.testing.assert_array_equal(
        padded.numpy(), _ref_pad(x.numpy(), c, 0))
    back = bucket_ops.bucket_unpad(padded, c.T, e, 0)
    np.testing.assert_array_equal(back.numpy(), x.numpy())


@pytest.mark.parametrize("maxc,exp", [
    (0, 0), (1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (1023, 10), (1024, 10),
    (1025, 11)])
def test_exponent_exact(maxc, exp):
    c = np.array([[maxc, 0], [0, 0]])
    x = np.zeros([maxc], np.int32)
    padded, e = bucket_ops.bucket_pad(x, c, 0)
    assert int(e) == exp
    assert padded.shape[0] == 2 << exp


def test_exponent_large_counts_only_in_other_rows():
    # The bucket depends on the whole matrix, not only this rank's row.
    c = np.array([[1, 0], [0, 1000]], np.int64)
    padded, e = bucket_ops.bucket_pad(np.ones([1, 2], np.float32), c, 0)
    assert int(e) == 10 and padded.shape == (2048, 2)
    np.testing.assert_array_equal(padded.numpy()[0], [1, 1])
    assert not padded.numpy()[1:].any()


def test_mismatched_rows_error():
    c = np.array([[2, 1], [0, 5]])
    x = np.zeros([4, 3], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        bucket_ops.bucket_pad(x, c, 0, site="exchange:k")
    msg = str(info.value)
    assert "sok_keras: exchange 'exchange:k' on rank 0" in msg
    assert "the rows of x must equal sum(counts_matrix[rank, :])" in msg
    assert "x has 4 rows" in msg and "sum(counts_matrix[0, :]) = 3" in msg


def test_count_too_large_error():
    c = np.array([[1, 0], [0, (1 << 62) + 1]], np.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="exceeds"):
        bucket_ops.bucket_pad(np.zeros([1], np.float32), c, 0)


def test_negative_count_error():
    c = np.array([[2, -1], [0, 5]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
        bucket_ops.bucket_pad(np.zeros([1], np.float32), c, 0)


def test_bad_shapes():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        bucket_ops.bucket_pad(np.zeros([1], np.float32), np.ones([2, 3]), 0)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        bucket_ops.bucket_pad(np.zeros([1], np.float32), np.ones([1, 1]), 1)
    c = np.array([[2, 1], [0, 5]])
    # received must have N * 2^e rows.
    with pytest.raises(tf.errors.InvalidArgumentError, match="expected"):
        bucket_ops.bucket_unpad(np.zeros([15], np.float32), c, 3, 0)
    # a count larger than the bucket.
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        bucket_ops.bucket_unpad(np.zeros([4], np.float32), c, 1, 1)


def test_in_tf_function_and_not_stateful():
    c = tf.constant([[2, 1], [0, 5]], tf.int64)
    v = tf.Variable(0.0)

    @tf.function
    def f(x, c):
        v.assign_add(1.0)  # stateful: would chain stateful ops after it
        p, e = bucket_ops.bucket_pad(x, c, 0, site="s")
        return bucket_ops.bucket_unpad(p, tf.transpose(c), e, 0, site="s"), p

    spec = tf.TensorSpec([None, 4], tf.float32)
    g = f.get_concrete_function(spec, tf.TensorSpec([2, 2], tf.int64))
    types = {op.type: op for op in g.graph.get_operations()}
    for name in ("SokBucketPad", "SokBucketUnpad"):
        assert name in types
        assert not types[name].op_def.is_stateful
        # Pure ops get no automatic control inputs.
        assert not types[name].control_inputs
    x = tf.reshape(tf.range(12, dtype=tf.float32), [3, 4])
    y, p = f(x, c)
    assert p.shape == (16, 4)  # bucket 8 (max count 5), 2 ranks
    assert g.outputs[0].shape.as_list() == [None, 4]
    np.testing.assert_array_equal(y.numpy(), x.numpy())


def test_gradients():
    c = tf.constant([[2, 1], [3, 0]], tf.int64)
    x = tf.Variable(tf.reshape(tf.range(6, dtype=tf.float32), [3, 2]))
    w = tf.random.stateless_normal([8, 2], seed=[1, 2])
    with tf.GradientTape() as tape:
        p, e = bucket_ops.bucket_pad(x, c, 0)
        loss = tf.reduce_sum(p * w)
    g = tape.gradient(loss, x)
    np.testing.assert_allclose(g.numpy(), w.numpy()[[0, 1, 4]])

    got = tf.Variable(tf.reshape(tf.range(16, dtype=tf.float32), [8, 2]))
    with tf.GradientTape() as tape:
        y = bucket_ops.bucket_unpad(got, c, e, 0)  # rows 0, 1 and 4, 5, 6
        w2 = tf.random.stateless_normal([5, 2], seed=[3, 4])
        loss = tf.reduce_sum(y * w2)
    g = tape.gradient(loss, got).numpy()
    want = np.zeros([8, 2], np.float32)
    want[[0, 1, 4, 5, 6]] = w2.numpy()
    np.testing.assert_allclose(g, want)
