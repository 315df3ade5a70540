"""One process gets SIGTERM in the middle of `model.save` ("save") or of
`keras.models.load_model` ("load"), or rank 0 of a job of several in
the middle of `model.save` ("save-ranks"), sent from inside the layer's own
save/load of its table, when Keras' temporary weights file (save) or
extracted weights folder (load) exists; "load-extract": while Keras
extracts the weights file (STOP_SIGNAL: SIGTERM, SIGINT; or SIGKILL in
"save" and "load", which leaves the temporary files behind); "export":
model.export, SIGTERM when its temporary folder is complete. "save-ranks-stream": rank 0 gets
it right after telling the others to send a table's rows (they are inside
that collective); "save-ranks-zip": while Keras copies its weights file
into the zip, in a `finally` block that the signal cuts short. The folder
argument holds the `.keras` file; the test checks that nothing else is
left in it."""

import os
import signal
import sys

import keras
import numpy as np

import sok_keras as sok

mode, folder = sys.argv[1], sys.argv[2]
sok.init()
path = os.path.join(folder, "model.keras")
ids = keras.Input((2,), dtype="int64")
model = keras.Model(ids, keras.layers.Dense(1)(
    sok.layers.DistributedEmbedding(1000, 8, name="emb")(ids)))
model.predict(np.array([[1, 2]]), verbose=0)


def _signal_this_thread():
    # (`raise_signal`: to this thread, at this point of the load.)
    signal.raise_signal(getattr(signal, os.environ.get("STOP_SIGNAL",
                                                       "SIGTERM")))


# Ctrl-C as a program started from a terminal gets it: a test suite run in
# the background (`nohup make test &`) passes SIGINT on ignored, and Python
# then leaves it ignored, so the load went on, signal or not.
signal.signal(signal.SIGINT, signal.default_int_handler)


def terminate(original):
    def hook(self, store):
        if sok.rank() == 0:
            # Keras' temporary file or folder exists now, beside `path`.
            print("during:", sorted(os.listdir(folder)), flush=True)
            _signal_this_thread()
        return original(self, store)

    return hook


def stop_rank_0():
    print("during:", sorted(os.listdir(folder)), flush=True)
    _signal_this_thread()


cls = sok.layers.DistributedEmbedding
if mode == "save-ranks-stream":
    from sok_keras import saving

    announce = saving._Stream.announce

    def announce_then_stop(self, entry):
        announce(self, entry)
        stop_rank_0()

    saving._Stream.announce = announce_then_stop
    model.save(path)
elif mode == "save-ranks-zip":
    import zipfile

    write = zipfile.ZipFile.write

    def stopped_write(self, filename, arcname=None, *args, **kwargs):
        if sok.rank() == 0 and arcname == "model.weights.h5":
            stop_rank_0()
        return write(self, filename, arcname, *args, **kwargs)

    zipfile.ZipFile.write = stopped_write
    model.save(path)
elif mode == "export":
    # A folder left by an export killed earlier (a pid that is gone), then
    # SIGTERM once the export's temporary folder is complete.
    from sok_keras import serving

    # (its lock file, of this kernel, which no live process holds:
    # `_leftovers`)
    import json

    from sok_keras import _leftovers

    os.makedirs(os.path.join(folder, ".served.sok-tmp-0123456789ab", "x"))
    with open(os.path.join(folder, ".sok-tmp-0123456789ab.lock"), "w") as f:
        json.dump({"kernel": _leftovers._kernel(), "pid": 1}, f)
    replace = serving._replace_dir

    def stopped_replace(tmp, target):
        stop_rank_0()
        return replace(tmp, target)

    serving._replace_dir = stopped_replace
    model.export(os.path.join(folder, "served"))
elif mode == "load-extract":
    # The signal while Keras extracts the weights file beside the model
    # (its bare `except:` would fall back to reading the zip).
    import zipfile

    model.save(path)
    extract = zipfile.ZipFile.extract
    signalled = []

    def stopped_extract(self, member, *args, **kwargs):
        if member == "model.weights.h5" and not signalled:
            signalled.append(True)
            stop_rank_0()
        return extract(self, member, *args, **kwargs)

    load = cls.load_own_variables

    def reported_load(self, store):
        if signalled:
            print("a table loaded after the signal", flush=True)
        return load(self, store)

    zipfile.ZipFile.extract = stopped_extract
    cls.load_own_variables = reported_load
    keras.models.load_model(path)
elif mode.startswith("save"):
    cls.save_own_variables = terminate(cls.save_own_variables)
    model.save(path)
else:
    model.save(path)
    cls.load_own_variables = terminate(cls.load_own_variables)
    keras.models.load_model(path)
print("not terminated", flush=True)
