"""Lookups of a 2-rank table inside tf.data stages, one case after the
other in one process: "parallel" (`map(layer, num_parallel_calls=4)`),
"autotune" (`AUTOTUNE`), "sequential" (`map(layer)` then `prefetch`),
"one" (`num_parallel_calls=1`), "interleave" (a parallel `interleave`
whose datasets look up), "experimental_interleave"
(`tf.data.experimental.parallel_interleave`), "scan" (a stage,
unlike autograph's scan of a loop), "filter" and "generator" (a
`from_generator` generator, eager in tf.data's threads: the error comes
while iterating, wrapped in an `InvalidArgumentError`). Each rank writes,
per case, the error raised (or None) and whether a direct lookup
afterwards gives the rows it gave before.

Then the lookups of a step that tf.data traces but runs in the step
itself, which work: "for_loop" (`for x in ds:` in a `tf.function`, which
autograph makes a scan and a reduce; with a `break`: "for_break") and
"reduce" (`ds.reduce`); each writes its rows' sum and the direct
lookup's ("sums")."""

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

X = np.random.default_rng(0).integers(0, 20, size=(64, 3))
layer = sok.layers.DistributedEmbedding(20, 3, combiner="mean", name="emb")
expected = layer(X).numpy()
batches = tf.data.Dataset.from_tensor_slices(X).batch(8)


def lookups(i):
    return tf.data.Dataset.from_tensors(layer(tf.gather(X.reshape(8, 8, 3),
                                                        i)))


def dataset(case):
    if case == "interleave":
        return tf.data.Dataset.range(8).interleave(
            lookups, cycle_length=2, num_parallel_calls=2)
    if case == "experimental_interleave":
        return tf.data.Dataset.range(8).apply(
            tf.data.experimental.parallel_interleave(lookups, cycle_length=2))
    if case == "scan":
        return batches.scan(
            tf.constant(0.0),
            lambda s, x: (s, s + tf.reduce_sum(layer(x)))).prefetch(4)
    if case == "filter":
        return batches.filter(
            lambda x: tf.reduce_sum(layer(x)) > -1.0).prefetch(4)
    if case == "generator":
        return tf.data.Dataset.from_generator(
            lambda: (layer(x).numpy() for x in X.reshape(8, 8, 3)),
            output_signature=tf.TensorSpec([8, 3], tf.float32)).prefetch(4)
    calls = {"parallel": 4, "autotune": tf.data.AUTOTUNE, "one": 1,
             "sequential": None}[case]
    return batches.map(layer, num_parallel_calls=calls).prefetch(4)


results = {}
for case in ("parallel", "autotune", "sequential", "one", "interleave",
             "experimental_interleave", "scan", "filter",
             "generator"):
    result = {"error": None}
    try:
        for _ in dataset(case):
            pass
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        result["error"] = str(e)
    result["after"] = bool(np.array_equal(layer(X).numpy(), expected))
    results[case] = result


# The step's own loops over a dataset (a custom training loop).
ids = tf.data.Dataset.from_tensor_slices(X).batch(8).prefetch(2)


@tf.function
def for_loop():
    total = tf.constant(0.0)
    for x in ids:
        total += tf.reduce_sum(layer(x))
    return total


@tf.function
def for_break():
    total = tf.constant(0.0)
    for x in ids:
        if tf.reduce_sum(x) < 0:  # never: the loop has a take_while
            break
        total += tf.reduce_sum(layer(x))
    return total


@tf.function
def reduce():
    return ids.reduce(tf.constant(0.0),
                      lambda total, x: total + tf.reduce_sum(layer(x)))


sums = {"direct": float(np.sum(expected, dtype=np.float32))}
for name, fn in (("for_loop", for_loop), ("for_break", for_break),
                 ("reduce", reduce)):
    sums[name] = float(fn())
results["sums"] = sums
write_result(results)
