"""Ranks that build different tables, or look them up in another order.

argv: FIELD [STAGE]. FIELD is what rank 1 does differently: "none",
"vocabulary_size", "embedding_dim", "dtype", "mode", "optimizer",
"table_optimizer", "order", "count", "dense" (a Dense of another
width), "metrics" (compiled with AUC, rank 1 also with MAE),
"metric_args" (AUC with another number of thresholds), "vocabulary" (an
IntegerLookup of another vocabulary before the tables), "normalization"
(a Normalization adapted on each rank's own data: rank 0's everywhere),
"batch" (fit on global batches of 8 on rank 0 and 4 on rank 1, through
`sok.shard_batches`). STAGE: "fit" (default), "evaluate",
"predict", "eager" (the model called on a batch before fit), "function"
(a custom training step in a `tf.function`, SOK's way) or "load"
(`load_weights` into the differing model).
"""

import os
import sys
import time

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import OUT, RANK, write_result  # noqa: E402

FIELD = sys.argv[1]
STAGE = sys.argv[2] if len(sys.argv) > 2 else "fit"
odd = RANK == 1
rng = np.random.default_rng(RANK)
ids = rng.integers(0, 16, size=(8, 2)).astype(np.int64)
y = rng.normal(size=(8, 1)).astype(np.float32)


def two_tables(field):
    """A functional model of tables a and b (and c); rank 1 differs in
    `field`. Functional: built symbolically, nothing is looked up before
    the first step."""
    differs = field if odd else None
    vocab = 17 if differs == "vocabulary_size" else 16
    dim = 5 if differs == "embedding_dim" else 4
    dtype = "float64" if differs == "dtype" else "float32"
    kind = (sok.layers.LocalizedEmbedding if differs == "mode"
            else sok.layers.DistributedEmbedding)
    own = "adagrad" if differs == "table_optimizer" else None
    layers = {"a": kind(vocab, dim, dtype=dtype, optimizer=own, name="a"),
              "b": sok.layers.DistributedEmbedding(16, 4, name="b")}
    ids = keras.Input(shape=(2,), dtype="int64", name="ids")
    raw = ids
    if field == "vocabulary":  # rank 1's lookup maps the ids otherwise
        terms = list(range(1, 16))
        ids = keras.layers.IntegerLookup(
            vocabulary=terms[::-1] if odd else terms, name="lookup")(ids)
    order = ("b", "a") if differs == "order" else ("a", "b")
    outs = {n: keras.ops.cast(layers[n](ids[:, i:i + 1]), "float32")
            for i, n in enumerate(order)}
    feats = {n: keras.layers.Flatten()(outs[n]) for n in ("a", "b")}
    # Keras runs the deepest nodes first: the first lookup gets the longer
    # path to the output.
    for _ in range(3):
        feats[order[0]] = keras.layers.Identity()(feats[order[0]])
    feats = [feats["a"], feats["b"]]
    if differs == "count":
        c = sok.layers.DistributedEmbedding(16, 4, name="c")
        feats.append(keras.layers.Flatten()(c(ids[:, :1])))
    if field == "normalization":  # adapted on each rank's own ids
        norm = keras.layers.Normalization(name="norm")
        norm.adapt(globals()["ids"].astype("float32"))  # this rank's data
        feats.append(norm(keras.ops.cast(ids, "float32")))
    x = keras.layers.Concatenate()(feats)
    if field == "dense":  # a weight outside the tables differs
        x = keras.layers.Dense(3 if odd else 2, name="hidden")(x)
    head = keras.layers.Dense(1, name="head")(x)
    return keras.Model(raw, head, name="two_tables")


def compiled(field):
    model = two_tables(field)
    inner = (keras.optimizers.Adam(0.01) if odd and field == "optimizer"
             else keras.optimizers.SGD(0.1))
    metrics = ([keras.metrics.AUC(num_thresholds=20 if odd else 10,
                                  name="auc")]
               if field == "metric_args" else ["auc"])
    if odd and field == "metrics":
        metrics.append("mae")
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(inner),
                  loss="mse", metrics=metrics)
    return model


result = {"error": None, "type": None}
start = time.monotonic()
try:
    if STAGE == "load":
        first = compiled("none")
        # Every rank saves (one file, written by rank 0), then loads it.
        path = os.path.join(OUT, "weights.weights.h5")
        first.save_weights(path)
        model = compiled(FIELD)
        model.load_weights(path)
    else:
        model = compiled(FIELD)
        if STAGE == "eager":  # lookups before any step
            model(ids[:1])
        if STAGE == "function":
            import tensorflow as tf

            @tf.function
            def train_step(x, target):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        (model(x, training=True) - target) ** 2)
                variables = model.trainable_variables
                model.optimizer.apply_gradients(
                    zip(tape.gradient(loss, variables), variables))
                return loss

            for i in range(2):
                train_step(ids[4 * i:4 * i + 4], y[4 * i:4 * i + 4])
        elif FIELD == "batch":
            import tensorflow as tf

            data = tf.data.Dataset.from_tensor_slices((ids, y)).repeat()
            model.fit(sok.shard_batches(data.batch(
                4 if odd else 8, drop_remainder=True)), steps_per_epoch=2,
                      epochs=1, verbose=0)
        elif STAGE in ("fit", "eager"):
            model.fit(ids, y, batch_size=4, epochs=1, verbose=0)
        elif STAGE == "evaluate":
            model.evaluate(ids, y, batch_size=4, verbose=0)
        else:
            model.predict(ids, batch_size=4, verbose=0)
    if FIELD == "normalization":  # what the layer normalizes with
        result["mean"] = model.get_layer("norm").mean.numpy().ravel().tolist()
except Exception as e:  # noqa: BLE001 - reported to the test
    result = {"error": str(e), "type": type(e).__name__}
result["elapsed"] = time.monotonic() - start
write_result(result)
print(f"rank {RANK}: {result}", flush=True)
