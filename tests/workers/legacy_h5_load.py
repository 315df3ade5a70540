"""Loads a legacy `.h5` file saved on one rank (whole tables) on this
job's ranks: `load_model` and `load_weights` (by order and by name); each
rank reports the tables read back whole and its slice's predictions."""

import sys

from _worker import RANK, write_result

import sok_keras as sok

sok.init()
import keras  # noqa: E402
import numpy as np  # noqa: E402

PATH, X = sys.argv[1], sys.argv[2]
x = np.load(X)
n = sok.num_ranks()


def report(model):
    tables = {v.path: v.read_global().tolist() for v in model.weights
              if hasattr(v, "global_shape")}
    mine = model.predict(x[RANK::n], verbose=0)
    return {"tables": tables,
            "predictions": sok.gather_predictions(mine, strided=True)
            .tolist() if n > 1 else mine.tolist()}


result = {"load_model": report(keras.saving.load_model(PATH, compile=False))}
for by_name in (False, True):
    fresh = keras.saving.load_model(PATH, compile=False)
    for v in fresh.weights:  # forget the file's values
        if hasattr(v, "global_shape"):
            v.assign_global(np.zeros(v.global_shape, "float32"))
    fresh.load_weights(PATH, by_name=by_name)
    result[f"load_weights_by_name_{by_name}"] = report(fresh)
if len(sys.argv) > 3:
    # A file whose 'dist' table has another size: on every rank the same
    # error, or (skip_mismatch) the same warning and nothing assigned
    # (before: its 5 rows fitted rank 0's shard of 9 rows and were
    # assigned there, while rank 1 raised).
    import warnings

    model = keras.saving.load_model(PATH, compile=False)
    shard = model.get_layer("dist").embeddings
    before = np.array(shard.numpy())
    try:
        model.load_weights(sys.argv[3], by_name=True)
        result["mismatch"] = "no error"
    except ValueError as e:
        result["mismatch"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(sys.argv[3], by_name=True, skip_mismatch=True)
    result["skip_warned"] = [str(w.message) for w in caught
                             if "dist" in str(w.message)]
    result["shard_unchanged"] = bool(
        np.array_equal(np.array(shard.numpy()), before))
write_result(result)
