"""Ranks given different files (each would read its own rows of its own
file, a model mixed from two): every rank refuses, then a save and load
with one path on every rank still work.

argv: FOLDER
"""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

folder = sys.argv[1]
ids = keras.Input((2,), dtype="int64")
model = keras.Model(ids, keras.layers.Dense(1)(
    sok.layers.DistributedEmbedding(20, 3, name="emb")(ids)))
model.compile(optimizer="adam", loss="mse")
x = np.arange(16, dtype=np.int64).reshape(8, 2) % 20
y = np.ones((8, 1), np.float32)
paths = {}
for name in ("a", "b"):  # two different states, each saved by every rank
    model.fit(x, y, batch_size=4, verbose=0)
    paths[name] = os.path.join(folder, f"{name}.keras")
    model.save(paths[name])
    sok.dump(os.path.join(folder, f"c{name}"), model)
mine = "a" if RANK == 0 else "b"
result = {}


def attempt(key, fn):
    try:
        fn()
        result[key] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is checked
        result[key] = f"{type(e).__name__}: {e}"


attempt("load_model", lambda: keras.saving.load_model(paths[mine]))
attempt("load_weights", lambda: model.load_weights(paths[mine]))
attempt("sok_load", lambda: sok.load(os.path.join(folder, f"c{mine}"), model))
# Saves to another path on each rank, over existing files: refused, and
# the files are as they were (no rank's file replaced, no temporary left).
for name in (f"w{RANK}.weights.h5", f"s{RANK}.keras"):
    with open(os.path.join(folder, name), "w") as f:
        f.write("OLD")
attempt("save_weights", lambda: model.save_weights(
    os.path.join(folder, f"w{RANK}.weights.h5")))
attempt("save", lambda: model.save(os.path.join(folder, f"s{RANK}.keras")))
if RANK == 0:  # (rank 1 may list rank 0's temporary before it goes)
    result["written"] = {
        n: open(os.path.join(folder, n), "rb").read(3).decode("latin-1")
        for n in sorted(os.listdir(folder))
        if "weights" in n or n.startswith(("s", ".s"))}
# sok.dump into another folder on each rank: refused, nothing left.
own = os.path.join(folder, f"d{RANK}")
attempt("sok_dump", lambda: sok.dump(own, model))
result["dump_leftovers"] = sorted(
    os.path.join(d, f) for d, _, files in os.walk(own) for f in files)
before = model.get_layer("emb").embeddings.numpy().copy()
loaded = keras.saving.load_model(paths["a"])  # one path: fine
result["same_path_loads"] = bool(np.array_equal(
    loaded.get_layer("emb").embeddings.numpy().shape, before.shape))
write_result(result)
