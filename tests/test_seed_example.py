"""The seed's example, unchanged apart from the import (one process)."""

import numpy as np
import tensorflow as tf

import sok_keras as sok


def test_seed_example_lookup_and_sgd():
    sok.init()
    v1 = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype=tf.float32)
    v2 = sok.Variable(np.arange(7 * 5).reshape(7, 5), dtype=tf.float32)
    indices1 = tf.SparseTensor(
        indices=[[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]],
        values=[1, 1, 3, 4, 5], dense_shape=[2, 3])
    indices2 = tf.SparseTensor(
        indices=[[0, 0], [1, 0], [1, 1]], values=[1, 2, 3],
        dense_shape=[2, 2])
    with tf.GradientTape() as tape:
        embeddings = sok.lookup_sparse(
            [v1, v2], [indices1, indices2], hotness=[3, 2],
            combiners=["sum", "sum"])
        loss = 0.0
        for embedding in embeddings:
            loss += tf.reduce_sum(embedding)
    np.testing.assert_array_equal(
        embeddings[0].numpy(), [[6, 8, 10], [36, 39, 42]])
    np.testing.assert_array_equal(
        embeddings[1].numpy(), [[5, 6, 7, 8, 9], [25, 27, 29, 31, 33]])
    grads = tape.gradient(loss, [v1, v2])
    assert isinstance(grads[0], tf.IndexedSlices)
    # One process: every distinct id is one gradient row.
    assert grads[0].values.shape == (4, 3)
    assert grads[1].values.shape == (3, 5)
    before1, before2 = v1.numpy().copy(), v2.numpy().copy()
    optimizer = tf.keras.optimizers.SGD(learning_rate=1.0)
    optimizer.apply_gradients(zip(grads, [v1, v2]))
    d1 = before1 - v1.numpy()
    d2 = before2 - v2.numpy()
    # Id 1 appears twice in the first sample: its row moves by 2.
    expected1 = np.zeros((17, 3))
    expected1[1] = 2
    expected1[[3, 4, 5]] = 1
    expected2 = np.zeros((7, 5))
    expected2[[1, 2, 3]] = 1
    np.testing.assert_array_equal(d1, expected1)
    np.testing.assert_array_equal(d2, expected2)
