"""Global views on N ranks (sok_keras/global_views.py): parameter counts,
summary, gathered predictions, and calls made on rank 0 only, which must
fail within SOK_SAVE_TIMEOUT (set small by the test)."""

import os
import sys
import time

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

folder = sys.argv[1]
last = sys.argv[2]  # the call rank 0 makes alone at the end
wait = float(os.environ["SOK_SAVE_TIMEOUT"]) + 4
keras.utils.set_random_seed(0)
ids = keras.Input((3,), dtype="int64")
emb = sok.layers.DistributedEmbedding(1001, 8, combiner="sum", name="emb")
out = keras.layers.Dense(2, name="head")(emb(ids))
model = keras.Model(ids, out)
model.compile(optimizer="adam", loss="mse")
lines = []
model.summary(print_fn=lambda text, **kw: lines.append(text))
result = {
    "count_params": model.count_params(),
    "layer_count": emb.count_params(),
    "local_rows": int(emb.embeddings.shape[0]),
    "summary": "\n".join(lines),
}

# Predictions: rank r predicts 5 - 2r rows; every rank gets all of them.
rng = np.random.default_rng(RANK)
x = rng.integers(0, 1001, (5 - 2 * RANK, 3))
# A whole table given to set_weights (this rank's shard is wanted).
try:
    emb.set_weights([np.zeros((1001, 8), np.float32)])
    result["set_whole"] = "no error"
except ValueError as e:
    result["set_whole"] = str(e)
emb.set_weights(emb.get_weights())  # the shard: accepted
# Another layer's shard: a table placed on rank 0 into one placed on rank 1
# (its whole table on one rank, no rows on the other).
placed = [sok.layers.LocalizedEmbedding(50, 4, rank=r, name=f"placed{r}")
          for r in (0, 1)]
for layer in placed:
    layer.build((None, 3))
try:
    placed[1].set_weights(placed[0].get_weights())
    result["set_other"] = "no error"
except ValueError as e:
    result["set_other"] = str(e)
mine = model.predict(x, verbose=0)
result["mine"] = mine.tolist()
result["gathered"] = sok.gather_predictions(mine).tolist()
nested = sok.gather_predictions({"a": mine, "b": [np.full((len(x),), RANK)]})
result["nested_b"] = nested["b"][0].tolist()
result["nested_a_equal"] = bool(np.array_equal(nested["a"],
                                               result["gathered"]))
# batch_size: back in the global batches' order (2 batches of 2 rows each).
result["batched"] = sok.gather_predictions(
    np.arange(4)[:, None] + 10 * RANK, batch_size=2).ravel().tolist()
try:
    sok.gather_predictions(mine, batch_size=2)  # 5 and 3 rows
    result["batched_uneven"] = "no error"
except ValueError as e:
    result["batched_uneven"] = str(e)
# strided: rank r predicted x[r::N]; back in the order of x (7 rows).
result["strided"] = sok.gather_predictions(
    {"y": np.arange(7)[RANK::2, None] * 1.5}, strided=True)["y"].ravel(
    ).tolist()
try:
    sok.gather_predictions(mine, strided=True)  # 5 and 3 rows
    result["strided_uneven"] = "no error"
except ValueError as e:
    result["strided_uneven"] = str(e)

# Saving and loading on every rank still work.
path = os.path.join(folder, "m.keras")
model.save(path)
loaded = keras.saving.load_model(path)
result["loaded_count"] = loaded.count_params()
plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
plain_path = os.path.join(folder, "plain.keras")
if RANK == 0:
    plain.save(plain_path)


def sync(key):
    """Every rank meets (a long deadline: one rank may have waited)."""
    sok.world.control_communicator().agree(key, 1, 120)


sync("sync0")
# On every rank: the whole table.
result["whole_shape"] = list(emb.embeddings.read_global().shape)


def rank0_only(name, fn):
    """rank 0 calls fn alone while the others wait."""
    if RANK == 0:
        t0 = time.monotonic()
        try:
            fn()
            result[name] = "no error"
        except RuntimeError as e:
            result[name] = f"{type(e).__name__}: {e}"
        result[name + "_s"] = time.monotonic() - t0
    else:
        time.sleep(wait)


# A plain Keras model (no sok layers) may be loaded on one rank.
rank0_only("plain_load", lambda: keras.saving.load_model(plain_path))
sync("sync1")
# A timed-out check-in aborts the process's collectives (TensorFlow), so
# one such call per job, last.
calls = {"predict": lambda: model.predict(x, verbose=0),
         "load": lambda: keras.saving.load_model(path),
         "gather": lambda: sok.gather_predictions(mine),
         "restore": lambda: sok.callbacks.ShardedCheckpoint(
             os.path.join(folder, "ckpts")).restore_latest(model),
         "export": lambda: model.export(os.path.join(folder, "served")),
         "read_global": lambda: emb.embeddings.read_global()}
rank0_only(last, calls[last])
write_result(result)
