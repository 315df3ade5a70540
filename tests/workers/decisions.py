"""Per-step and per-epoch decisions taken alike on every rank (issue 10,
item 2), in one job: run on 2 ranks, and on 1 rank for the reference on
the global data.

The data is made for two slices per global batch: on 2 ranks rank r gets
slice r of every batch, on 1 rank the whole batch (both slices, in rank
order), so the one process sees exactly the global data of the two ranks.

Scenarios (argv[1], comma-separated; default all, "mixed" last):
- "plateau": fit with validation data that differs on rank 1 (its targets
  are -0.5 x the true ones, so its own val_loss rises while rank 0's
  falls), under EarlyStopping, ReduceLROnPlateau and
  ModelCheckpoint(save_best_only=True), all on val_loss;
- "nan": TerminateOnNaN, with a NaN target in rank 1's slice of batch 3;
- "evaluate": evaluate (dict and list forms) with unequal per-rank batch
  sizes (8 and 4 samples) and a metric that is not a mean (R2Score), then
  test_on_batch and train_on_batch on the first global batch;
- "mixed": mixed_float16 (Keras wraps the optimizer in a
  LossScaleOptimizer), one sample of rank 1's slice of batch 2 with weight
  1e6 so that only rank 1's gradients overflow;
- "share": mixed_float16, one sample of batch 0 whose float16 gradient is
  3/4 of float16's largest at one process's scale: a rank's loss, a mean
  over its half of the batch, would double it (an overflow, a skipped
  step) unless the scale is the rank's share.
Each records the global values it saw and, beside them, this rank's own
(from its metrics' state, which the global logs leave as it is).
"""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import NUM_RANKS, OUT, RANK, write_result  # noqa: E402

ALL = ("plateau", "nan", "evaluate", "mixed", "share")
SCENARIOS = sys.argv[1].split(",") if len(sys.argv) > 1 else ALL
VOCAB, DIM = 40, 4
PATIENCE_ES, PATIENCE_LR = 2, 1
MIN_DELTA = 1e-4


def local(array, steps, sizes):
    """This rank's rows of `array` (`steps` batches of `sum(sizes)` rows,
    slice r of each batch has `sizes[r]` rows) and its batch size; on one
    rank, everything."""
    if NUM_RANKS == 1:
        return array, sum(sizes)
    start = sum(sizes[:RANK])
    batches = array.reshape((steps, sum(sizes)) + array.shape[1:])
    mine = batches[:, start:start + sizes[RANK]]
    return mine.reshape((-1,) + array.shape[1:]), sizes[RANK]


def build(hidden=None, seed=0):
    """A small model with the same initial weights at any number of ranks
    (the table is set whole, the dense weights from a seeded generator)."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((2,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(VOCAB, DIM, combiner="sum",
                                          name="emb")
    h = emb(ids)
    if hidden:
        h = keras.layers.Dense(hidden, activation="relu", name="hidden")(h)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(ids, out)
    rng = np.random.default_rng(seed + 1)
    emb.embeddings.assign_global(
        rng.normal(0, 0.3, (VOCAB, DIM)).astype(np.float32))
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.kernel.assign(rng.normal(
                0, 0.3, layer.kernel.shape).astype(np.float32))
            layer.bias.assign(np.zeros(layer.bias.shape, np.float32))
    return model, emb


def task(n, seed):
    """`n` samples: two ids in [0, VOCAB), a target from a fixed table."""
    rng = np.random.default_rng(seed)
    truth = rng.normal(0, 1.0, VOCAB).astype(np.float32)
    ids = rng.integers(0, VOCAB, (n, 2)).astype(np.int64)
    y = (truth[ids].sum(1, keepdims=True) / 2).astype(np.float32)
    return ids, y


def local_metrics(model):
    """This rank's own values: its metrics' state (left local)."""
    return {k: float(v) for k, v in model.get_metrics_result().items()}


def dense_weights(model):
    return [w.numpy().tolist() for w in model.weights
            if not isinstance(w, sok.Variable)]


class Recorder(keras.callbacks.Callback):
    """Global logs as the callbacks saw them, and this rank's own."""

    def __init__(self):
        super().__init__()
        self.record = {"lr": [], "val_loss": [], "val_loss_local": [],
                       "loss": [], "loss_local": [], "batches": 0}

    def on_epoch_begin(self, epoch, logs=None):
        self.record["lr"].append(float(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch, logs=None):
        self.record["batches"] += 1
        self.record["loss"].append(logs["loss"])
        self.record["loss_local"].append(local_metrics(self.model)["loss"])

    def on_test_end(self, logs=None):
        self.record["val_loss_local"].append(
            local_metrics(self.model)["loss"])

    def on_epoch_end(self, epoch, logs=None):
        if "val_loss" in logs:
            self.record["val_loss"].append(logs["val_loss"])
        self.record["last_epoch_logs"] = dict(logs)

    def on_train_end(self, logs=None):
        self.record["train_end_logs"] = dict(logs or {})


def plateau():
    steps, b = 4, 8
    ids, y = task(steps * 2 * b, seed=10)
    vids, vy = task(2 * 2 * b, seed=11)
    # Rank 1's validation slice: targets -0.5 x the true ones.
    vy = vy.reshape(2, 2, b, 1)
    vy[:, 1] *= -0.5
    vy = vy.reshape(-1, 1)
    x, batch = local(ids, steps, (b, b))
    y, _ = local(y, steps, (b, b))
    vx, _ = local(vids, 2, (b, b))
    vy, _ = local(vy, 2, (b, b))
    model, emb = build()
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse",
                  metrics=["mae"])
    folder = os.path.join(OUT, "ckpt")
    rec = Recorder()
    callbacks = [
        keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=PATIENCE_ES, min_delta=MIN_DELTA),
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=PATIENCE_LR,
            min_delta=MIN_DELTA),
        keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "e{epoch:02d}.keras"), monitor="val_loss",
            save_best_only=True),
        rec,
    ]
    history = model.fit(x, y, batch_size=batch, epochs=12, shuffle=False,
                        validation_data=(vx, vy), callbacks=callbacks,
                        verbose=0)
    return dict(
        rec.record, epochs=len(history.history["loss"]),
        history_val_loss=history.history["val_loss"],
        saved=sorted(os.listdir(folder)),
        wrapped=type(model.optimizer).__name__,
        dense=dense_weights(model), table=emb.embeddings.read_global().tolist())


def nan():
    steps, b = 6, 4
    ids, y = task(steps * 2 * b, seed=20)
    y = y.reshape(steps, 2, b, 1)
    y[2, 1, 0, 0] = np.nan  # rank 1's slice of batch 3
    y = y.reshape(-1, 1)
    x, batch = local(ids, steps, (b, b))
    y, _ = local(y, steps, (b, b))
    model, _ = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rec = Recorder()
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.TerminateOnNaN(), rec])
    return dict(rec.record, stop_training=bool(model.stop_training))


class _Local(keras.callbacks.Callback):
    def on_test_end(self, logs=None):
        self.values = local_metrics(self.model)


def evaluate():
    steps, sizes = 3, (8, 4)  # unequal per-rank batch sizes
    ids, y = task(steps * sum(sizes), seed=30)
    x, batch = local(ids, steps, sizes)
    y, _ = local(y, steps, sizes)
    model, _ = build()
    model.compile(optimizer="sgd", loss="mse",
                  metrics=["mae", keras.metrics.R2Score(name="r2")])
    mine = _Local()
    as_dict = model.evaluate(x, y, batch_size=batch, return_dict=True,
                             verbose=0, callbacks=[mine])
    as_list = model.evaluate(x, y, batch_size=batch, verbose=0)
    # The *_on_batch forms on the first global batch (train last: it
    # changes the weights).
    tested = model.test_on_batch(x[:batch], y[:batch], return_dict=True)
    tested_list = model.test_on_batch(x[:batch], y[:batch])
    trained = model.train_on_batch(x[:batch], y[:batch], return_dict=True)
    return {"dict": {k: float(v) for k, v in as_dict.items()},
            "list": [float(v) for v in as_list], "local": mine.values,
            "samples": int(len(x)),
            "test_on_batch": {k: float(v) for k, v in tested.items()},
            "test_on_batch_list": [float(v) for v in tested_list],
            "train_on_batch": {k: float(v) for k, v in trained.items()}}


def under_mixed_float16(scenario):
    """`scenario` run under Keras' mixed_float16 policy."""
    def run():
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            return scenario()
        finally:
            keras.mixed_precision.set_global_policy("float32")

    return run


def own_grads_finite(model, x, y, w=None):
    """This rank's own finite check of its gradients on (x, y) at the
    initial loss scale, as Keras' LossScaleOptimizer computes it from this
    rank's loss (before any all-reduce)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=pred, sample_weight=w)
        scaled = loss * 2.0 ** 15
    grads = tape.gradient(scaled, model.trainable_variables)
    return all(
        bool(np.all(np.isfinite(
            (g.values if isinstance(g, tf.IndexedSlices) else g).numpy())))
        for g in grads if g is not None)


@under_mixed_float16
def mixed():
    steps, b = 4, 8
    ids, y = task(steps * 2 * b, seed=40)
    y = y * 0.1
    weights = np.ones((steps, 2, b), np.float32)
    # One sample of rank 1's slice of batch 2: weight 1e6, odd ids only
    # (their rows live on rank 1 of 2), so rank 0's own gradients stay
    # finite.
    weights[1, 1, 0] = 1e6
    ids = ids.reshape(steps, 2, b, 2)
    ids[1, 1, 0] = [3, 5]
    ids = ids.reshape(-1, 2)
    x, batch = local(ids, steps, (b, b))
    y, _ = local(y, steps, (b, b))
    w, _ = local(weights.reshape(-1), steps, (b, b))
    model, emb = build(hidden=8)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    nesting, opt = [], model.optimizer
    while opt is not None:
        nesting.append(type(opt).__name__)
        opt = getattr(opt, "inner_optimizer", None)
    # This rank's own finite check on the overflowing batch.
    sl = slice(batch, 2 * batch)
    own_finite = own_grads_finite(model, x[sl], y[sl], w[sl])
    table0 = emb.embeddings.read_global()
    model.fit(x, y, sample_weight=w, batch_size=batch, epochs=1,
              shuffle=False, verbose=0)
    table = emb.embeddings.read_global()
    return {
        "nesting": nesting, "own_finite": own_finite,
        "iterations": int(model.optimizer.iterations.numpy()),
        "scale": float(model.optimizer.dynamic_scale.numpy()),
        "dense": dense_weights(model), "table": table.tolist(),
        "table_moved": bool(not np.array_equal(table0, table)),
    }


@under_mixed_float16
def share():
    steps, b = 3, 8
    ids, y = task(steps * 2 * b, seed=50)
    model, emb = build()
    table0 = emb.embeddings.read_global()
    kernel = model.get_layer("head").kernel.numpy()[:, 0]
    # Sample 0 of batch 0 (rank 0's slice): an error e whose gradient
    # into the float16 embedding output, 2 e / 16 x kernel x 2**15, is
    # 0.75 x 65504 at its largest.
    pred = table0[ids[0]].sum(0) @ kernel
    e = 0.75 * 65504 * (2 * b) / (2 * 2.0 ** 15 * np.abs(kernel).max())
    y[0, 0] = pred + e
    x, batch = local(ids, steps, (b, b))
    yl, _ = local(y, steps, (b, b))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # This rank's own gradients on batch 0 at the full scale.
    own_finite = own_grads_finite(model, x[:batch], yl[:batch])
    model.fit(x, yl, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return {
        "own_finite": own_finite,
        "iterations": int(model.optimizer.iterations.numpy()),
        "scale": float(model.optimizer.dynamic_scale.numpy()),
        "dense": dense_weights(model),
        "table": emb.embeddings.read_global().tolist(),
    }


result = {}
for name in SCENARIOS:
    result[name] = globals()[name]()
    print(f"rank {RANK}: {name} done", flush=True)
write_result(result)
