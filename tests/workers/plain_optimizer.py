"""compile(optimizer="adam") on 2 ranks: the dense weights stay equal. And
a custom loop's plain Keras optimizer says (on rank 0) what it does with
the sok table; the same loop with `OptimizerWrapper` keeps the dense
weights equal."""

import logging

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

keras.utils.set_random_seed(RANK)  # different starts: the broadcast aligns
ids = keras.Input((3,), dtype="int64")
emb = sok.layers.DistributedEmbedding(500, 4, combiner="sum")
model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
model.compile(optimizer="adam", loss="mse")
# Before any training: every rank predicts with rank 0's dense weights.
probe = np.arange(12).reshape(4, 3)
first_predictions = model.predict(probe, verbose=0).tolist()
first_kernel = model.layers[-1].kernel.numpy().tolist()
rng = np.random.default_rng(100 + RANK)  # each rank its own data
x = rng.integers(0, 500, (128, 3))
y = rng.normal(size=(128, 1)).astype(np.float32)
model.fit(x, y, batch_size=32, epochs=2, verbose=0)


def custom_loop(optimizer):
    """Keras' custom training loop on a fresh model; returns its Dense
    kernel after 3 steps."""
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(500, 4, combiner="sum")
    loop_model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((loop_model(xb) - yb) ** 2)
        variables = loop_model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables),
                                      variables))

    for k in range(3):
        step(x[k * 32:(k + 1) * 32], y[k * 32:(k + 1) * 32])
    return loop_model.layers[-1].kernel.numpy().tolist()


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


records = Records()
logging.getLogger("sok_keras").addHandler(records)
plain_kernel = custom_loop(keras.optimizers.Adam(0.05))
wrapped_kernel = custom_loop(sok.OptimizerWrapper(keras.optimizers.Adam(0.05)))
write_result({
    "wrapped": isinstance(model.optimizer, sok.optimizers.OptimizerWrapper),
    "kernel": model.layers[-1].kernel.numpy().tolist(),
    "first_predictions": first_predictions,
    "first_kernel": first_kernel,
    "plain_warnings": [m for m in records.messages if "plain Keras" in m],
    "plain_kernel": plain_kernel,
    "loop_kernel": wrapped_kernel,
})
