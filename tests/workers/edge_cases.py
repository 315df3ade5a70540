"""Lookups where one rank has only padding, an empty batch, mixed precision."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

v = sok.Variable(np.arange(20 * 2).reshape(20, 2), dtype=tf.float32)
w = sok.Variable(np.arange(9 * 3).reshape(9, 3), dtype=tf.float32,
                 mode=f"localized:{sok.num_ranks() - 1}")
# Rank 0 has ids; every other rank has a batch made only of padding.
ids = tf.constant([[1, 2], [3, -1]]) if RANK == 0 else tf.constant(
    [[-1, -1], [-1, -1]])
with tf.GradientTape() as tape:
    a, b = sok.lookup_sparse([v, w], [ids, ids], combiners=["sum", "mean"])
    loss = tf.reduce_sum(a) + tf.reduce_sum(b)
grads = tape.gradient(loss, [v, w])
empty = sok.lookup_sparse(v, tf.zeros([0, 3], tf.int64))
# A plain tf.Variable is named as such on several ranks too (it failed in
# the cross-rank table check first, with an AttributeError).
plain = {}
for what, call in (
        ("lookup_sparse", lambda: sok.lookup_sparse(tf.Variable(
            np.zeros((5, 2))), tf.constant([[1]]))),
        ("all2all", lambda: sok.all2all_dense_embedding(
            tf.Variable(np.zeros((5, 2))), tf.constant([[1]])))):
    try:
        call()
        plain[what] = "no error"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        plain[what] = f"{type(e).__name__}: {e}"
keras.mixed_precision.set_global_policy("mixed_float16")
layer = sok.layers.DistributedEmbedding(20, 4)
mixed = layer(np.array([[1, 2]]))
write_result({
    "a": a.numpy().tolist(), "b": b.numpy().tolist(),
    "grad_rows": [int(g.values.shape[0]) for g in grads],
    "grad_sums": [float(tf.reduce_sum(g.values)) for g in grads],
    "empty_shape": list(empty.shape),
    "mixed": [mixed.dtype.name, layer.embeddings.dtype],
    "plain_variable": plain,
})
