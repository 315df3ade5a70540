"""shard_batches with the global seed set on every rank and a `shuffle`
given no seed of its own. argv: "same" (every rank runs the same code
first) or "extra_op" (rank 0 makes one more random op first, so its
shuffle's second seed differs). Each rank writes its error (or None) and
the rows of its slice of the first global batch."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

keras.utils.set_random_seed(42)
if sys.argv[1] == "extra_op" and RANK == 0:
    tf.random.uniform([1])  # e.g. rank-0-only debugging code
ds = tf.data.Dataset.range(48).shuffle(48).batch(12, drop_remainder=True)
result = {"error": None, "rows": None}
try:
    local = sok.shard_batches(ds)
    result["rows"] = next(iter(local)).numpy().tolist()
except ValueError as e:
    result["error"] = str(e)
write_result(result)
