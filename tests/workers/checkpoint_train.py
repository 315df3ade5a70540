"""sok.dump at N ranks, sok.load at M ranks, then more training.

argv: ACTION MODEL PATH OUT [LOC_RANK]

ACTION:
  dump        train 4 steps, sok.dump(PATH), record the state (OUT/saved.npz
              from rank 0), then train 5 more steps (the uninterrupted run);
  load        build a fresh model, sok.load(PATH), record the state
              (OUT/loaded<M>.npz) and a lookup of every id, train 5 steps;
  load_error  build a fresh model, try sok.load(PATH) (which must fail),
              record the error and whether anything changed;
  crash_dump  train 4 steps, sok.dump(PATH) (good), train 2 more steps, then
              sok.dump(PATH) again, where rank 1 dies (os._exit) after
              writing its first shard file.
MODEL: "dlrm" (a distributed table) or "localized" (a LocalizedEmbedding on
rank LOC_RANK and a distributed table, each with Adam slots).
"""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.training_setup import make_model_and_data  # noqa: E402

action, kind, path, out = sys.argv[1:5]
loc_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 0
STEPS_BEFORE, STEPS_AFTER, GLOBAL_BATCH = 4, 5, 48


def localized_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(2,), dtype="int64", name="ids")
    loc = sok.LocalizedEmbedding(37, 4, combiner="sum", rank=loc_rank,
                                 name="loc")(ids)
    dist = sok.DistributedEmbedding(29, 4, combiner="mean", name="dist")(ids)
    z = keras.layers.Concatenate()([loc, dist])
    out_ = keras.layers.Dense(
        1, activation="sigmoid", name="click",
        kernel_initializer=keras.initializers.GlorotUniform(7))(z)
    model = keras.Model(ids, out_)
    rng = np.random.default_rng(11)
    for name, rows in (("loc", 37), ("dist", 29)):
        model.get_layer(name).embeddings.assign_global(
            rng.normal(0, 0.1, size=(rows, 4)).astype(np.float32))
    n = (STEPS_BEFORE + STEPS_AFTER) * GLOBAL_BATCH
    x = rng.integers(0, 29, size=(n, 2)).astype(np.int64)
    y = (rng.random((n, 1)) < 0.5).astype(np.float32)
    return model, keras.optimizers.Adam(0.01, epsilon=1e-3), (x, y)


def build():
    if kind == "dlrm":
        model, opt, data = make_model_and_data(
            "sok", "adam", STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH)
        names = ["embedding"]
    else:
        model, opt, data = localized_model()
        names = ["loc", "dist"]
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(opt),
                  loss="binary_crossentropy")
    return model, data, names


def batches(data, first, count):
    x, y = data
    lo, hi = first * GLOBAL_BATCH, (first + count) * GLOBAL_BATCH
    if isinstance(x, dict):
        x = {k: v[lo:hi] for k, v in x.items()}
    else:
        x = x[lo:hi]
    ds = tf.data.Dataset.from_tensor_slices((x, y[lo:hi])).batch(
        GLOBAL_BATCH, drop_remainder=True)
    return sok.shard_batches(ds)


def fit(model, data, first, count):
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    model.fit(batches(data, first, count), epochs=1, verbose=0,
              callbacks=[sok.callbacks.GlobalMetrics(), record])
    return losses


def state(model, names):
    """Every table and slot in global order (a collective), the dense
    weights and the optimizer's variables."""
    out = {}
    for name in names:
        t = model.get_layer(name).embeddings
        out[f"{name}/table"] = t.read_global()
        for k in sorted(t.slots):
            out[f"{name}/slot/{k}"] = t.slots[k].read_global()
    for v in model.variables:
        if not isinstance(v, sok.Variable):
            out[f"dense/{v.path}"] = np.asarray(v.numpy())
    for v in model.optimizer.variables:
        if not isinstance(v, sok.Variable):
            out[f"opt/{v.path}"] = np.asarray(v.numpy())
    return out


def save_state(st, name):
    if RANK == 0:
        np.savez(os.path.join(out, name), **st)


def local_rows(model, names):
    return {n: int(model.get_layer(n).embeddings.shape[0]) for n in names}


model, data, names = build()
result = {}
if action in ("dump", "crash_dump"):
    fit(model, data, 0, STEPS_BEFORE)
    sok.dump(path, model)
    save_state(state(model, names), "saved.npz")
    if action == "dump":
        result["losses_after"] = fit(model, data, STEPS_BEFORE, STEPS_AFTER)
    else:
        fit(model, data, STEPS_BEFORE, 2)
        from sok_keras import checkpoint

        original = checkpoint._write_shard_file

        def dying(file_path, entries):
            record = original(file_path, entries)
            if RANK == 1:
                os._exit(17)  # killed mid-dump, after one shard file
            return record

        checkpoint._write_shard_file = dying
        sok.dump(path, model)
        result["second_dump_returned"] = True
elif action == "load":
    manifest = sok.load(path, model)
    st = state(model, names)
    # A lookup of every id through the layers (the exchange included).
    for name in names:
        layer = model.get_layer(name)
        ids = tf.range(layer.vocabulary_size, dtype=tf.int64)[:, None]
        looked = layer(ids)
        st[f"{name}/lookup"] = np.asarray(looked).reshape(
            layer.vocabulary_size, -1)
    save_state(st, f"loaded{sok.num_ranks()}.npz")
    result["saved_world_size"] = manifest["world_size"]
    result["local_rows"] = local_rows(model, names)
    result["iterations"] = int(model.optimizer.iterations.numpy())
    result["losses_after"] = fit(model, data, STEPS_BEFORE, STEPS_AFTER)
elif action == "load_error":
    from sok_keras.optimizers.wrapper import build_once

    build_once(model.optimizer, model.trainable_variables)
    before = state(model, names)
    try:
        sok.load(path, model)
        result["error"] = None
    except sok.CheckpointError as e:
        result["error"] = str(e)
    after = state(model, names)
    result["unchanged"] = all(np.array_equal(before[k], after[k])
                              for k in before)
    result["local_rows"] = local_rows(model, names)
else:
    raise SystemExit(f"unknown action {action!r}")
write_result(result)
