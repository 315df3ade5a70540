"""A Sequential with no keras.Input (Keras builds it at the first step),
int or float32 ids, trained with fit: each rank its slice of the global
batches, and its own random start (the optimizer's broadcast aligns the
dense weights)."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

N = sok.num_ranks()
dtype = sys.argv[1]
keras.utils.set_random_seed(RANK)
model = keras.Sequential([
    sok.layers.DistributedEmbedding(
        100, 8, combiner="mean",
        embeddings_initializer=keras.initializers.RandomUniform(seed=1)),
    keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
rng = np.random.default_rng(0)
ids = rng.integers(-1, 100, size=(32, 4)).astype(dtype)
y = rng.normal(size=(32, 1)).astype(np.float32)
model.fit(ids[RANK::N], y[RANK::N], batch_size=8 // N, epochs=2,
          shuffle=False, verbose=0)
write_result({"table": model.layers[0].embeddings.read_global().tolist(),
              "kernel": model.layers[1].kernel.numpy().tolist()})
