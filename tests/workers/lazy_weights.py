"""A layer whose weights are made inside the traced train step (an RNN
cell with no `build()`, which Keras allows with a warning), on ranks
seeded differently: the optimizer's first step makes them equal."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

V, D = 20, 4


class Cell(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.state_size = D
        self.output_size = D
        self.dense = keras.layers.Dense(D, activation="tanh")

    def call(self, inputs, states):
        h = self.dense(keras.ops.concatenate([inputs, states[0]], -1))
        return h, [h]


keras.utils.set_random_seed(100 + RANK)  # each rank its own initial values
rng = np.random.default_rng(4)
ids = rng.integers(0, V, (16, 4, 2)).astype("int64")
y = (rng.random((16, 1)) < 0.5).astype("float32")
i = keras.Input((4, 2), dtype="int64")
emb = keras.layers.TimeDistributed(
    sok.layers.DistributedEmbedding(V, D, combiner="sum", name="emb"))(i)
cell = Cell()
out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.RNN(cell)(emb))
model = keras.Model(i, out)
model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy")
n = sok.num_ranks()
history = model.fit(ids[RANK::n], y[RANK::n], batch_size=8 // n,
                    shuffle=False, epochs=2, verbose=0)

# Two optimizers in one traced step, each for weights the step makes
# (review: both broadcasts ran under the same keys, and TensorFlow failed
# with "ProvideBuf already called").
import tensorflow as tf  # noqa: E402


class Lazy(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(D)

    def build(self, input_shape):  # builds nothing: made at the first call
        pass

    def call(self, x):
        return self.dense(x)


table = sok.layers.DistributedEmbedding(V, D, combiner="sum")
first, second = Lazy(), Lazy()
opt_a = sok.OptimizerWrapper(keras.optimizers.SGD(0.1))
opt_b = sok.OptimizerWrapper(keras.optimizers.SGD(0.1))


@tf.function
def step(batch):
    with tf.GradientTape(persistent=True) as tape:
        h = first(table(batch))
        loss = tf.reduce_mean(second(h) ** 2)
    va = table.trainable_variables + first.trainable_variables
    vb = second.trainable_variables
    opt_a.apply(tape.gradient(loss, va), va)
    opt_b.apply(tape.gradient(loss, vb), vb)
    return loss


for _ in range(2):
    step(tf.constant(ids[RANK::n, 0, :]))
write_result({
    "cell_kernel": cell.dense.kernel.numpy().tolist(),
    "loss": history.history["loss"],
    "two_optimizers": [first.dense.kernel.numpy().tolist(),
                       second.dense.kernel.numpy().tolist()],
})
