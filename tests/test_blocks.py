"""SokGatherBlocks / SokScatterBlocks (the fused exchange's packing) on the
CPU, against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import lookup_ops

DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.float16,
          tf.bfloat16.as_numpy_dtype, np.float32, np.float64, np.complex64]


def _reference_gather(values, starts, lengths):
    parts = [values[s:s + n] for s, n in zip(starts, lengths)]
    if not parts:
        return values[:0]
    return np.concatenate(parts, 0)


def _reference_scatter(grad, starts, lengths, num_rows):
    out = np.zeros((num_rows,) + grad.shape[1:], grad.dtype)
    pos = 0
    for s, n in zip(starts, lengths):
        out[s:s + n] = grad[pos:pos + n]
        pos += n
    return out


def _blocks(rng, n, m, disjoint):
    """m random blocks over n rows, some empty; disjoint ones shuffled."""
    if disjoint:
        cuts = np.sort(rng.integers(0, n + 1, size=2 * m))
        starts, ends = cuts[0::2], cuts[1::2]
        order = rng.permutation(m)
        return starts[order], (ends - starts)[order]
    starts = rng.integers(0, n + 1, size=m)
    lengths = np.array([rng.integers(0, n - s + 1) for s in starts])
    return starts, lengths


def _values(rng, shape, dtype):
    return (rng.normal(size=shape) * 10).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rest", [(), (3,), (2, 5)])
def test_gather_matches_numpy(dtype, rest):
    rng = np.random.default_rng(1)
    for n, m in ((0, 0), (0, 3), (1, 1), (17, 6), (300, 40)):
        values = _values(rng, (n,) + rest, dtype)
        starts, lengths = _blocks(rng, n, m, disjoint=False)
        got = lookup_ops.gather_blocks(values, starts, lengths).numpy()
        want = _reference_gather(values, starts, lengths)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_numpy(dtype):
    rng = np.random.default_rng(2)
    for n, m in ((0, 0), (5, 0), (1, 1), (17, 6), (300, 40)):
        starts, lengths = _blocks(rng, n, m, disjoint=True)
        grad = _values(rng, (int(lengths.sum()), 3), dtype)
        got = lookup_ops.scatter_blocks(grad, starts, lengths, n).numpy()
        np.testing.assert_array_equal(
            got, _reference_scatter(grad, starts, lengths, n))


def test_contiguous_and_adjacent_blocks():
    """Adjacent blocks (the common case in the exchange) and a block that
    covers everything."""
    x = np.arange(12, dtype=np.int64).reshape(6, 2)
    got = lookup_ops.gather_blocks(x, [0, 2, 4, 0], [2, 2, 2, 6]).numpy()
    np.testing.assert_array_equal(got, np.concatenate([x, x]))
    got = lookup_ops.gather_blocks(x, [4, 0, 2], [2, 2, 0]).numpy()
    np.testing.assert_array_equal(got, x[[4, 5, 0, 1]])


def test_gradient_is_scatter_and_scatter_gradient_is_gather():
    rng = np.random.default_rng(3)
    x = tf.Variable(rng.normal(size=(20, 3)))
    starts, lengths = [12, 0, 5, 20], [4, 3, 2, 0]
    up = tf.constant(rng.normal(size=(9, 3)))
    with tf.GradientTape() as tape:
        y = lookup_ops.gather_blocks(x, starts, lengths)
        loss = tf.reduce_sum(y * up)
    g = tape.gradient(loss, x).numpy()
    np.testing.assert_array_equal(
        g, _reference_scatter(up.numpy(), starts, lengths, 20))
    # ...and against TensorFlow's own gradient of the same gather.
    index = np.concatenate([np.arange(s, s + n)
                            for s, n in zip(starts, lengths)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(x, index) * up)
    np.testing.assert_array_equal(g, tf.convert_to_tensor(
        tape.gradient(loss, x)).numpy())
    grad = tf.Variable(rng.normal(size=(9, 3)))
    down = tf.constant(rng.normal(size=(20, 3)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(
            lookup_ops.scatter_blocks(grad, starts, lengths, 20) * down)
    np.testing.assert_array_equal(
        tape.gradient(loss, grad).numpy(),
        _reference_gather(down.numpy(), starts, lengths))


def test_in_tf_function_with_unknown_shapes():
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32),
                                  tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([None], tf.int64)])
    def f(x, s, n):
        y = lookup_ops.gather_blocks(x, s, n)
        assert y.shape.as_list() == [None, 2]
        return y

    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    np.testing.assert_array_equal(f(x, [3, 1], [2, 1]).numpy(), x[[3, 4, 1]])


@pytest.mark.parametrize("starts,lengths,what", [
    ([4], [3], "block 0 (start 4, length 3) is out of range for 5 rows"),
    ([0, 6], [1, 0], "block 1 (start 6, length 0) is out of range"),
    ([-1], [1], "block 0 (start -1, length 1) is out of range"),
    ([1], [-2], "block 0 (start 1, length -2) is out of range"),
])
def test_gather_bad_blocks_raise_naming_the_block(starts, lengths, what):
    x = np.zeros((5, 2), np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.gather_blocks(x, starts, lengths, site="emb#0/ids")
    assert what in str(info.value)
    assert "SokGatherBlocks 'emb#0/ids'" in str(info.value)


def test_gather_needs_matching_vectors():
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as info:
        lookup_ops.gather_blocks(np.zeros((5,)), [0, 1], [1])
    assert "starts" in str(info.value) or "Dimension" in str(info.value)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        lookup_ops.gather_blocks(np.float32(1.0), [0], [1])


def test_scatter_rejects_overlap_and_wrong_sizes():
    # Adjacent blocks are fine; overlapping ones are not (a row written
    # twice would need a sum, which the gradient never needs).
    lookup_ops.scatter_blocks(np.ones((4, 2)), [0, 2], [2, 2], 6)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.scatter_blocks(np.ones((5, 2)), [2, 0], [2, 3], 6)
    assert ("block 0 (start 2, length 2) and block 1 (start 0, length 3) "
            "overlap") in str(info.value)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.scatter_blocks(np.ones((3, 2)), [0], [2], 6)
    assert "grad must have sum(lengths) = 2 rows" in str(info.value)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.scatter_blocks(np.ones((2, 2)), [5], [2], 6)
    assert "out of range for 6 rows" in str(info.value)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        lookup_ops.scatter_blocks(np.ones((0, 2)), [], [], -1)
    assert "num_rows must be >= 0" in str(info.value)
