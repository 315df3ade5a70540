"""A SOK-style custom loop whose dense weight is a plain `tf.Variable`:
OptimizerWrapper(Adam) on a table and the tf.Variable (each rank starts
it differently: the wrapper's broadcast aligns them), then `sok.dump` /
`sok.load` of both with the optimizer's state."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

N = sok.num_ranks()
folder = sys.argv[1]
table = sok.Variable(np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
                     / 100.0, name="t")
w = tf.Variable(np.full((4, 1), 0.5 + RANK, np.float32), name="w")
opt = sok.OptimizerWrapper(keras.optimizers.Adam(0.05))
rng = np.random.default_rng(0)
ids = rng.integers(-1, 40, size=(6, 8, 3))  # 6 global batches of 8
y = rng.normal(size=(6, 8, 1)).astype(np.float32)


@tf.function
def step(x, target):
    with tf.GradientTape() as tape:
        out = sok.lookup_sparse(table, x, combiners="sum") @ w
        loss = tf.reduce_mean((out - target) ** 2)
    grads = tape.gradient(loss, [table, w])
    opt.apply_gradients(zip(grads, [table, w]))


def train(batches):
    for b in batches:
        step(tf.constant(ids[b, RANK::N]), tf.constant(y[b, RANK::N]))


train(range(3))
sok.dump(folder, [table, w], opt)
train(range(3, 6))
final = [table.read_global().tolist(), w.numpy().tolist()]
table.assign_global(np.zeros((40, 4), np.float32))  # load undoes these
w.assign(tf.zeros_like(w))
sok.load(folder, [table, w], opt)
train(range(3, 6))
write_result({"final": final,
              "resumed": [table.read_global().tolist(), w.numpy().tolist()]})
