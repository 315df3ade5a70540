"""fit of a `sok.shard_batches` dataset made with the global seed set on
every rank and a `shuffle` given no seed of its own. argv: "same" (every
rank runs the same code first), "extra_op" (rank 0 makes one more random
op first, so its shuffle's second seed differs), "global" (each rank sets
another global seed; the shuffle has its own seed) or "peek" (as "same",
and rank 0 alone calls `shard_batches` once more first, to look at its
slice). Each rank writes the error of fit (or None), the rows of its slice
of the first global batch and its loss."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

CASE = sys.argv[1]
keras.utils.set_random_seed(42 + (RANK if CASE == "global" else 0))
if CASE == "extra_op" and RANK == 0:
    tf.random.uniform([1])  # e.g. rank-0-only debugging code


def dataset():
    rows = tf.data.Dataset.range(48)
    rows = rows.shuffle(48, seed=7) if CASE == "global" else rows.shuffle(48)
    return sok.shard_batches(
        rows.map(lambda i: (tf.reshape(i % 16, [1]), tf.cast(i, tf.float32)))
        .batch(12, drop_remainder=True)).prefetch(1)


if CASE == "peek" and RANK == 0:
    next(iter(sok.shard_batches(
        tf.data.Dataset.range(8).batch(4, drop_remainder=True))))
ds = dataset()
inputs = keras.Input((1,), dtype="int64")
emb = sok.layers.DistributedEmbedding(16, 4, name="emb")(inputs)
model = keras.Model(inputs, keras.layers.Dense(1)(emb))
model.compile(optimizer="sgd", loss="mse")
result = {"error": None, "rows": None, "loss": None}
try:
    result["rows"] = np.asarray(next(iter(ds))[1]).tolist()
    history = model.fit(ds, epochs=1, verbose=0)
    result["loss"] = history.history["loss"]
except ValueError as e:
    result["error"] = str(e)
write_result(result)
