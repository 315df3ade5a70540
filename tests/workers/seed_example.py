"""The seed's example on N ranks (distributed and localized modes)."""

import sys

import numpy as np

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "distributed"
modes = ("distributed", "distributed") if mode == "distributed" else (
    "localized:0", "localized:1")
v1 = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype=tf.float32,
                  mode=modes[0])
v2 = sok.Variable(np.arange(7 * 5).reshape(7, 5), dtype=tf.float32,
                  mode=modes[1])
indices1 = tf.SparseTensor(
    indices=[[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]], values=[1, 1, 3, 4, 5],
    dense_shape=[2, 3])
indices2 = tf.SparseTensor(
    indices=[[0, 0], [1, 0], [1, 1]], values=[1, 2, 3], dense_shape=[2, 2])
with tf.GradientTape() as tape:
    embeddings = sok.lookup_sparse(
        [v1, v2], [indices1, indices2], hotness=[3, 2],
        combiners=["sum", "sum"])
    loss = 0.0
    for embedding in embeddings:
        loss += tf.reduce_sum(embedding)
grads = tape.gradient(loss, [v1, v2])
before = [v1.read_global(), v2.read_global()]
optimizer = tf.keras.optimizers.SGD(learning_rate=1.0)
optimizer.apply_gradients(zip(grads, [v1, v2]))
after = [v1.read_global(), v2.read_global()]


# The same lookup inside a tf.function, twice (keys reused across calls).
@tf.function
def step(a, b):
    return sok.lookup_sparse([v1, v2], [a, b], combiners=["mean", "sum"])


fn_out = [step(indices1, indices2), step(indices1, indices2)]
write_result({
    "shapes": [list(v1.shape), list(v2.shape)],
    "emb": [e.numpy().tolist() for e in embeddings],
    "grad_rows": [0 if g is None else int(g.values.shape[0]) for g in grads],
    "grad_indices": [[] if g is None else sorted(g.indices.numpy().tolist())
                     for g in grads],
    "delta": [(b - a).tolist() for a, b in zip(after, before)],
    "fn": [[t.numpy().tolist() for t in o] for o in fn_out],
})
