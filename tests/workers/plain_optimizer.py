"""compile(optimizer="adam") on 2 ranks: the dense weights stay equal."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
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
write_result({
    "wrapped": isinstance(model.optimizer, sok.optimizers.OptimizerWrapper),
    "kernel": model.layers[-1].kernel.numpy().tolist(),
})
