"""SOK's raw loop with a plain Keras optimizer on a localized table owned
by rank 0: rank 1 holds an empty `[0, dim]` shard, which every rule must
leave alone (Keras' Adadelta, Ftrl, RMSprop, Lion and Nadam failed on it:
Keras' `ops.add` takes a `[0, dim]` operand for a bias)."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

NAMES = ("SGD", "Adam", "Adamax", "Adadelta", "Adagrad", "Ftrl", "RMSprop",
         "AdamW", "Lion", "Nadam")
result = {}
for name in NAMES:
    table = sok.Variable(np.ones((11, 4), np.float32), mode="localized:0")
    dense = keras.Variable(np.ones((4, 1), np.float32))
    opt = getattr(keras.optimizers, name)(learning_rate=0.1)
    ids = tf.ragged.constant([[1, 2], [3]] if RANK == 0 else [[4], [1, 5]],
                             dtype=tf.int64)
    with tf.GradientTape() as tape:
        rows = sok.lookup_sparse([table], [ids], combiners=["sum"])[0]
        loss = tf.reduce_sum(tf.matmul(rows, dense))
    grads = tape.gradient(loss, [table, dense])
    error = None
    try:
        opt.apply_gradients(zip(grads, [table, dense]))
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    result[name] = {
        "error": error,
        "shard_shape": list(table.shape),
        "iterations": int(opt.iterations.numpy()),
        "table": table.numpy().tolist(),
        "dense_moved": bool(np.any(dense.numpy() != 1.0)),
        "u_product": (float(opt._u_product.numpy()) if name == "Nadam"
                      else None),
    }
    # Keep the ranks in step between optimizers (a failure on one rank
    # must not leave the other in a lookup of the next table).
    sok.global_views.gather_predictions(np.zeros((1, 1), np.float32))
# The table alone: on rank 1 Keras' `apply` is left nothing to update,
# and Nadam's schedule still moves there, as on rank 0.
table = sok.Variable(np.ones((11, 4), np.float32), mode="localized:0")
opt = keras.optimizers.Nadam(learning_rate=0.1)
for _ in range(2):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(
            [table], [tf.ragged.constant([[1, 2]], dtype=tf.int64)],
            combiners=["sum"])[0])
    opt.apply_gradients([(tape.gradient(loss, table), table)])
result["table_alone_nadam"] = {"iterations": int(opt.iterations.numpy()),
                               "u_product": float(opt._u_product.numpy())}
write_result(result)
