"""model.save streamed in bounded chunks, load_model reading only this
rank's rows, and the serving export, on N ranks (one job, several checks).

argv: save FOLDER | load FOLDER

save (2 ranks): a model with a distributed table, a localized table on the
last rank and an EmbeddingCollection, trained one step with Adam, saved
with a tiny chunk size (many chunks per table). Checks: the file holds
every table and slot whole; no chunk rank 0 received was larger than the
limit; a write that fails half-way through a table raises on every rank
and leaves the file as it was; the model loads back (each rank reading
only its rows); `export_for_serving` writes one SavedModel (rank 0). The
whole tables and the predictions go to FOLDER/expected.npz.
load (any N): load_model at N ranks, counting the rows each rank reads
from each dataset; the loaded shards must equal the saved tables' rows.
"""

import os
import sys
import time

T0 = time.monotonic()


def stage(what):
    print(f"[stage] {what} at {time.monotonic() - T0:.1f} s", flush=True)

import sok_keras as sok

sok.init()

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from sok_keras import _keras_h5  # noqa: E402
from sok_keras import variable as sok_variable  # noqa: E402

action, folder = sys.argv[1], sys.argv[2]
path = os.path.join(folder, "model.keras")
N = sok.num_ranks()
sok_variable.CHUNK_BYTES = 4096  # 4 KiB: many chunks per table


def build():
    keras.utils.set_random_seed(7)
    ids = keras.Input((3,), dtype="int64", name="ids")
    w = keras.Input((3,), dtype="float32", name="w")
    seq = keras.Input((4,), dtype="int64", name="seq")
    a = sok.layers.DistributedEmbedding(
        301, 8, combiner="mean", name="dist")(ids, w)
    b = sok.layers.LocalizedEmbedding(
        97, 5, combiner=None, rank=N - 1, name="loc")(seq)
    b = keras.layers.GlobalAveragePooling1D()(b)  # uses the -1 mask
    col = sok.layers.EmbeddingCollection(
        tables={"t": {"vocabulary_size": 50, "embedding_dim": 3}},
        features={"f": {"table": "t", "combiner": "sqrtn"},
                  "g": {"table": "t", "combiner": "sum"}},
        name="col")({"f": ids % 50, "g": seq % 50})
    x = keras.layers.Concatenate()([a, b, col["f"], col["g"]])
    model = keras.Model({"ids": ids, "w": w, "seq": seq},
                        keras.layers.Dense(1, name="head")(x))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(0.05)), loss="mse")
    return model


def data(seed, batch):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(-1, 301, (batch, 3)),
            "w": rng.random((batch, 3)).astype("float32"),
            "seq": rng.integers(-1, 97, (batch, 4))}


def tables(model):
    out = {}
    for layer, names in (("dist", None), ("loc", None), ("col", ["t"])):
        lay = model.get_layer(layer)
        vs = ({n: lay.embeddings[n] for n in names} if names
              else {"": lay.embeddings})
        for n, v in vs.items():
            key = f"{layer}{'.' + n if n else ''}"
            out[key] = v
    return out


class CountingDataset:
    """Wraps an h5py dataset; counts the rows each read returns."""

    reads = {}

    def __init__(self, ds, key):
        self.ds, self.key = ds, key
        self.shape, self.dtype, self.attrs = ds.shape, ds.dtype, ds.attrs

    def __getitem__(self, sel):
        out = self.ds[sel]
        CountingDataset.reads[self.key] = (
            CountingDataset.reads.get(self.key, 0) + len(out))
        return out


original_dataset = _keras_h5.dataset


def counting_dataset(store, key):
    ds = original_dataset(store, key)
    if ds is None:
        return None
    return CountingDataset(ds, f"{store._h5_entry_path}/{key}")


_keras_h5.dataset = counting_dataset
probe = data(99, 16)

if action == "save":
    model = build()
    model.fit(data(RANK, 32), np.random.default_rng(RANK).normal(
        size=(32, 1)).astype("float32"), batch_size=32, verbose=0)
    # The largest block of rows rank 0 receives at once.
    received = []
    original_stream = sok_variable.stream_entry

    def recording(entry, sink, writer_only, key="save/stream"):
        def wrapped(first, rows):
            received.append(rows.nbytes)
            return sink(first, rows)
        return original_stream(entry, wrapped if sink else None,
                               writer_only, key)

    sok_variable.stream_entry = recording
    import sok_keras.saving as sok_saving  # noqa: E402

    sok_saving.stream_entry = recording
    stage("fit done")
    model.save(path)
    stage("saved")
    # `read_global` moves bounded chunks too: the largest tensor any
    # communicator sends while the tables and slots are read whole.
    from sok_keras import world as sok_world  # noqa: E402

    sent, patched = [], []
    for c in {id(c): c for c in (sok_world.communicator(),
                                 sok_world.control_communicator())}.values():
        for op in ("all_gather", "broadcast"):
            def sending(x, *args, _send=getattr(c, op), **kwargs):
                sent.append(int(np.prod(x.shape)) * x.dtype.size)
                return _send(x, *args, **kwargs)
            setattr(c, op, sending)
            patched.append((c, op))
    whole = {k: v.read_global() for k, v in tables(model).items()}
    for k, v in tables(model).items():
        for s in sorted(v.slots):
            whole[f"{k}:{s}"] = v.slots[s].read_global()
    for c, op in patched:
        delattr(c, op)
    in_file = {}
    if RANK == 0:
        import io
        import zipfile

        with zipfile.ZipFile(path) as z:
            f = h5py.File(io.BytesIO(z.read("model.weights.h5")), "r")
            g = f["layers"]
            for k, name in (("dist", "distributed_embedding"),
                            ("loc", "localized_embedding"),
                            ("col.t", "embedding_collection")):
                prefix = "table.t" if k == "col.t" else "embeddings"
                slot = "table.t.slot." if k == "col.t" else "slot."
                vars_ = g[name]["vars"]
                in_file[k] = bool(np.array_equal(vars_[prefix][:], whole[k]))
                for s in ("m", "v"):
                    in_file[f"{k}:{s}"] = bool(np.array_equal(
                        vars_[slot + s][:], whole[f"{k}:{s}"]))

    # A write that fails half-way through a table (rank 0, third chunk).
    before = open(path, "rb").read() if RANK == 0 else None
    original_create = _keras_h5.create_dataset

    class FailingDataset:
        def __init__(self, ds):
            self.ds, self.writes = ds, 0

        def __setitem__(self, sel, rows):
            self.writes += 1
            if self.writes == 3:
                raise OSError("disk full (injected)")
            self.ds[sel] = rows

    def failing_create(*args, **kwargs):
        ds = original_create(*args, **kwargs)
        return None if ds is None else FailingDataset(ds)

    _keras_h5.create_dataset = failing_create
    try:
        model.save(path)
        failure = "no error"
    except Exception as e:  # noqa: BLE001 - the message is checked
        failure = f"{type(e).__name__}: {e}"
    _keras_h5.create_dataset = original_create
    unchanged = RANK != 0 or open(path, "rb").read() == before
    leftovers = sorted(n for n in os.listdir(folder) if "sok-tmp" in n)

    stage("failing save done")
    expected = model.predict(probe, verbose=0)
    stage("predicted")
    sok.export_for_serving(model, os.path.join(folder, "serving"))
    # Keras' own export writes the same (it ran sok's ops and collectives,
    # and its `serve` waited for peers for ever).
    model.export(os.path.join(folder, "serving_keras"), verbose=False)
    # The model nested in another functional model (its sok layers one
    # level down: rank 0 recursed, alone in a collective, until the
    # communicator's timeout).
    inputs = {k: keras.Input(t.shape[1:], dtype=t.dtype, name=k)
              for k, t in model.input.items()}
    nested = keras.Model(inputs, model(inputs))
    sok.export_for_serving(nested, os.path.join(folder, "serving_nested"))

    class Subclassed(keras.Model):
        def __init__(self, layer):
            super().__init__(name="subclassed")
            self.layer = layer

        def call(self, x):
            return self.layer(x)

    subclassed = Subclassed(model.get_layer("dist"))
    subclassed(probe["ids"])
    # (Traced on rank 0 with serving lookups: no collective there.)
    sok.export_for_serving(subclassed,
                           os.path.join(folder, "serving_subclassed"))
    subclassed_expected = subclassed.predict(probe["ids"], verbose=0)
    stage("exported")
    if RANK == 0:
        np.savez(os.path.join(folder, "expected.npz"), predictions=expected,
                 subclassed_predictions=subclassed_expected,
                 **{k.replace(":", "__"): v for k, v in whole.items()},
                 **{f"probe_{k}": v for k, v in probe.items()})
    write_result({"in_file": in_file, "max_received": max(received or [0]),
                  "max_sent_reading_whole": max(sent or [0]),
                  "chunk_bytes": sok_variable.CHUNK_BYTES,
                  "failure": failure, "unchanged": unchanged,
                  "leftovers": leftovers,
                  "subclassed": subclassed_expected.ravel().tolist(),
                  "predictions": expected.ravel().tolist()})
    sys.exit(0)

# load
saved = np.load(os.path.join(folder, "expected.npz"))
CountingDataset.reads.clear()
model = keras.models.load_model(path)
same, local_rows = {}, {}
for k, v in tables(model).items():
    mine = v.local_ids()
    for s in [None] + sorted(v.slots):
        name = k if s is None else f"{k}:{s}"
        var = v if s is None else v.slots[s]
        got = keras.ops.convert_to_numpy(var.value)
        same[name] = bool(np.array_equal(
            got, saved[name.replace(":", "__")][mine]))
        local_rows[name] = int(got.shape[0])
LAYERS = {"distributed_embedding": "dist", "localized_embedding": "loc",
          "embedding_collection": "col.t"}


def entry_name(h5_key):
    """'layers/distributed_embedding/slot.m' -> 'dist:m'."""
    layer, key = h5_key.split("/")[-2:]
    table = LAYERS[layer]
    slot = key.rpartition("slot.")[2] if "slot." in key else None
    return table if slot is None else f"{table}:{slot}"


reads = {entry_name(k): n for k, n in CountingDataset.reads.items()}
write_result({
    "same": same, "local_rows": local_rows, "reads": reads,
    "predictions": model.predict(
        {k: saved[f"probe_{k}"] for k in ("ids", "w", "seq")},
        verbose=0).ravel().tolist(),
})
