"""compile(optimizer="adam") on 2 ranks: the dense weights stay equal. And
a custom loop's plain Keras optimizer is refused for the sok table, where
the same loop with `OptimizerWrapper` trains (dense weights equal)."""

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


try:
    custom_loop(keras.optimizers.Adam(0.05))
    plain_error = None
except ValueError as e:
    plain_error = str(e)
write_result({
    "wrapped": isinstance(model.optimizer, sok.optimizers.OptimizerWrapper),
    "kernel": model.layers[-1].kernel.numpy().tolist(),
    "plain_error": plain_error,
    "loop_kernel": custom_loop(
        sok.OptimizerWrapper(keras.optimizers.Adam(0.05))),
})
