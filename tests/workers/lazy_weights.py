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
write_result({
    "cell_kernel": cell.dense.kernel.numpy().tolist(),
    "loss": history.history["loss"],
})
