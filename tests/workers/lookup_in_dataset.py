"""Lookups of a 2-rank table inside tf.data stages, one case after the
other in one process: "parallel" (`map(layer, num_parallel_calls=4)`),
"autotune" (`AUTOTUNE`), "interleave" (a parallel `interleave` whose
datasets look up), "sequential" (`map(layer)` then `prefetch`, while
this thread looks up another table) and "one" (`num_parallel_calls=1`).
Each rank writes, per case, the error raised (or None), whether its rows
equal the direct lookup's, and whether a direct lookup afterwards still
gives them."""

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

X = np.random.default_rng(0).integers(0, 20, size=(64, 3))
layer = sok.layers.DistributedEmbedding(20, 3, combiner="mean", name="emb")
other = sok.layers.DistributedEmbedding(20, 3, name="other")
expected = layer(X).numpy()
batches = tf.data.Dataset.from_tensor_slices(X).batch(8)


def dataset(case):
    if case == "interleave":
        return tf.data.Dataset.range(8).interleave(
            lambda i: tf.data.Dataset.from_tensors(
                layer(tf.gather(X.reshape(8, 8, 3), i))),
            cycle_length=2, num_parallel_calls=2)
    calls = {"parallel": 4, "autotune": tf.data.AUTOTUNE, "one": 1,
             "sequential": None}[case]
    return batches.map(layer, num_parallel_calls=calls).prefetch(4)


results = {}
for case in ("parallel", "autotune", "interleave", "sequential", "one"):
    result = {"error": None, "same": None}
    try:
        got = []
        for y in dataset(case):
            got.append(y.numpy())
            other(X[:8])  # this thread's lookups meanwhile
        result["same"] = bool(np.array_equal(np.concatenate(got), expected))
    except ValueError as e:
        result["error"] = str(e)
    result["after"] = bool(np.array_equal(layer(X).numpy(), expected))
    results[case] = result
write_result(results)
