"""A Sequential with no keras.Input (Keras builds it at the first step),
int or float32 ids, trained with fit: each rank its slice of the global
batches (int ids: of a reshuffled dataset, through `sok.shard_batches`),
and its own random start (the optimizer's broadcast aligns the dense
weights)."""

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
if dtype == "int64":
    # A dataset reshuffled each epoch (seeded): the build before the first
    # step reads its shapes and pulls no batch, so epoch 1 trains on the
    # order one process trains on (a pulled batch made it the second).
    import tensorflow as tf  # noqa: E402

    # (A shuffle's order depends on the global seed too: the same on
    # every rank when the dataset is made, then this rank's again.)
    keras.utils.set_random_seed(0)
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).shuffle(
        32, seed=3).batch(8, drop_remainder=True)
    keras.utils.set_random_seed(RANK)
    model.fit(sok.shard_batches(ds), epochs=2, verbose=0)
else:
    model.fit(ids[RANK::N], y[RANK::N], batch_size=8 // N, epochs=2,
              shuffle=False, verbose=0)
write_result({"table": model.layers[0].embeddings.read_global().tolist(),
              "kernel": model.layers[1].kernel.numpy().tolist()})
