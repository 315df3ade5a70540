"""Models built, trained one epoch and dropped, again and again, on N
ranks: the memory their tables and slots took comes back (before: the
exchange's `tf.custom_gradient` kept every traced step, and so each
model's shard and slots, for the life of the process)."""

import gc

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import NUM_RANKS, RANK, write_result  # noqa: E402

ROWS, DIM = 200_000, 64
DEVICE = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def fit_and_drop():
    keras.utils.clear_session()
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(ROWS, DIM, combiner="sum")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x = np.random.default_rng(0).integers(0, ROWS, (32, 3))
    model.fit(x[RANK::NUM_RANKS], np.ones((16, 1), "float32"), batch_size=8,
              verbose=0)


def memory():
    gc.collect()
    return tf.config.experimental.get_memory_info(DEVICE)["current"]


fit_and_drop()
before = memory()
for _ in range(2):
    fit_and_drop()
write_result({"grown": memory() - before,
              "shard_bytes": 3 * (ROWS // NUM_RANKS) * DIM * 4})
