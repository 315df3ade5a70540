"""The README's save pattern: every rank calls model.save on one path,
repeatedly; rank 0 checks each file (a valid zip, the right rows). Then a
save that fails on one rank: every rank raises, the file is unchanged.
With the argument "rank0-only", only rank 0 saves (the common mistake);
with "rank0-only-exit", the other rank exits at once (the usual script).
With "killed", rank 0 is killed (SIGKILL) half-way through writing a
table during the second save; the first file must stay loadable."""

import os
import sys
import time
import zipfile

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

mode = sys.argv[1]
folder = sys.argv[2]
path = os.path.join(folder, "model.keras")
keras.utils.set_random_seed(0)
ids = keras.Input((4,), dtype="int64")
emb = sok.layers.DistributedEmbedding(20_000, 16, combiner="sum", name="emb")
out = keras.layers.Dense(1)(emb(ids))
model = keras.Model(ids, out)
model.compile(
    optimizer=sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.01)),
    loss="mse")
rng = np.random.default_rng(RANK)
x = rng.integers(0, 20_000, (64, 4))
y = rng.normal(size=(64, 1)).astype(np.float32)
result = {}
if mode == "rank0-only-exit" and RANK != 0:
    sys.exit(0)
if mode.startswith("rank0-only"):
    if RANK == 0:
        t0 = time.monotonic()
        try:
            model.save(path)
            result["error"] = None
        except Exception as e:  # noqa: BLE001 - the test reads which
            result["error"] = f"{type(e).__name__}: {e}"
        result["elapsed"] = time.monotonic() - t0
    else:
        time.sleep(float(os.environ["SOK_SAVE_TIMEOUT"]) + 10)
    write_result(result)
    sys.exit(0)

if mode == "killed":
    import signal

    from sok_keras import _keras_h5

    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(path)
    np.save(os.path.join(folder, "first.npy"), emb.embeddings.read_global())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    original_create = _keras_h5.create_dataset

    class Dying:
        def __init__(self, ds):
            self.ds, self.writes = ds, 0

        def __setitem__(self, sel, rows):
            self.ds[sel] = rows
            self.writes += 1
            if self.writes == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    def dying_create(*args, **kwargs):
        ds = original_create(*args, **kwargs)
        return None if ds is None else Dying(ds)

    import sok_keras.variable as sok_variable

    sok_variable.CHUNK_BYTES = 4096
    _keras_h5.create_dataset = dying_create
    model.save(path)  # rank 0 dies in here; rank 1 is stopped by sokrun
    write_result({"error": "the save was not killed"})
    sys.exit(0)

checks = []
for i in range(int(os.environ.get("SAVES", "10"))):
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    table = emb.embeddings.read_global()
    model.save(path)
    bad = None
    if RANK == 0:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    # Every rank loads (its own rows) and compares them with what it saved.
    loaded = keras.saving.load_model(path, compile=False)
    got = keras.ops.convert_to_numpy(loaded.get_layer("emb").embeddings.value)
    checks.append(bad is None and bool(
        np.array_equal(got, table[RANK::sok.num_ranks()])))
# (Once every rank has loaded: each one's extracted weights are in the
# folder while it loads.)
sok.world.control_communicator().agree("loaded", 1, 120)
leftovers = [n for n in os.listdir(folder) if "sok-tmp" in n]

# Keras' sharded weights (`max_shard_size`, in GB): a json naming shard
# files, all written under their final names (before: the json named
# rank 0's temporary shards, which were never moved into place).
shards = os.path.join(folder, "shards")
os.makedirs(shards, exist_ok=True)
saved = emb.embeddings.read_global()
model.save_weights(os.path.join(shards, "w.weights.json"),
                   max_shard_size=0.002)  # GB: one table a shard
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
model.load_weights(os.path.join(shards, "w.weights.json"))
sharded = {
    "files": sorted(os.listdir(shards)),
    "loaded": bool(np.array_equal(emb.embeddings.read_global(), saved)),
}

# `zipped=False` (a folder) saved twice: the second replaces the first
# (review: "Directory not empty", and rank 0's hidden copy stayed).
unzipped = os.path.join(folder, "unzipped")
os.makedirs(unzipped, exist_ok=True)
for _ in range(2):
    model.save(os.path.join(unzipped, "m"), zipped=False)
unzipped = sorted(os.listdir(unzipped))

# Keras' public functions save as the methods do (before: they bypassed
# sok_keras, and every rank ran Keras' own save into the same path:
# `zipped=False` failed on every rank and left a half-written folder).
public = os.path.join(folder, "public")
os.makedirs(public, exist_ok=True)
saved = emb.embeddings.read_global()
keras.saving.save_model(model, os.path.join(public, "f.keras"))
keras.models.save_model(model, os.path.join(public, "g"), zipped=False)
keras.saving.save_weights(model, os.path.join(public, "w.weights.h5"))
functions = {}
for name in ("f.keras", "g"):
    again = keras.saving.load_model(os.path.join(public, name))
    functions[name] = bool(np.array_equal(
        again.get_layer("emb").embeddings.read_global(), saved))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
keras.saving.load_weights(model, os.path.join(public, "w.weights.h5"))
functions["w.weights.h5"] = bool(np.array_equal(
    emb.embeddings.read_global(), saved))
# A class with a `save` of its own that calls Keras' (review: it kept
# Keras' function, every rank writing the file), and the function's own
# argument `objects_to_skip` (review: refused by the routing).


class OwnSave(keras.Model):
    def save(self, *args, **kwargs):
        return super().save(*args, **kwargs)


keras.saving.save_model(OwnSave(ids, out), os.path.join(public, "own.keras"))
again = keras.saving.load_model(os.path.join(public, "own.keras"),
                                custom_objects={"OwnSave": OwnSave})
functions["own.keras"] = bool(np.array_equal(
    again.get_layer("emb").embeddings.read_global(), saved))
keras.saving.save_weights(model, os.path.join(public, "skip.weights.h5"),
                          objects_to_skip=[model.layers[-1]])
functions["files"] = sorted(os.listdir(public))

# A failing save: the writer (rank 0) fails half-way; nothing may change.
before = open(path, "rb").read() if RANK == 0 else None
from sok_keras import saving  # noqa: E402

original = saving._ORIGINAL["save"]


def failing(self, filepath, *args, **kwargs):
    with open(filepath, "wb") as f:  # a partial file, then the failure
        f.write(b"PK partial")
    raise OSError("disk full (injected)")


saving._ORIGINAL["save"] = failing
try:
    model.save(path)
    failure = "no error"
except Exception as e:  # noqa: BLE001 - the message is checked
    failure = f"{type(e).__name__}: {e}"
saving._ORIGINAL["save"] = original
unchanged = RANK != 0 or open(path, "rb").read() == before


def outcome(call):
    """What `call` raised on this rank, and how long it took."""
    start = time.monotonic()
    try:
        call()
        said = "no error"
    except Exception as e:  # noqa: BLE001 - the message is checked
        said = f"{type(e).__name__}: {e}"
    return said, time.monotonic() - start


# Failures of rank 0's own file system calls reach every rank at once, and
# the next save works (before: rank 1 waited SOK_SAVE_TIMEOUT, then every
# later save failed): a folder where the file goes (the final rename), a
# file where a folder should be (the temporary file).
if RANK == 0:
    os.makedirs(os.path.join(folder, "a_folder.keras"), exist_ok=True)
    open(os.path.join(folder, "a_file"), "w").close()
more = {
    "folder": outcome(lambda: model.save(
        os.path.join(folder, "a_folder.keras"))),
    "under_file": outcome(lambda: model.save(
        os.path.join(folder, "a_file", "m.keras"))),
    # Keras' legacy HDF5 would hold this rank's shards: refused on every
    # rank (before: a file with half of each table, loaded wrong).
    "h5": outcome(lambda: model.save(os.path.join(folder, "m.h5"))),
    # Keras' suffix check names the user's path, not the temporary one.
    "suffix": outcome(lambda: model.save_weights(
        os.path.join(folder, "w.h5"))),
    "then": outcome(lambda: model.save(path)),
}
write_result({"checks": checks, "leftovers": leftovers, "failure": failure,
              "sharded": sharded, "unzipped": unzipped,
              "functions": functions,
              "unchanged": unchanged, "more": more,
              "after": [n for n in os.listdir(folder) if "sok-tmp" in n]})
