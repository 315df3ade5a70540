"""A save whose file hits the disk's limit (RLIMIT_FSIZE standing in for
a full disk): every rank gets the error, no file is left, and the process
ends normally (before: h5py's handles of Keras' unclosed weights store
failed again when freed, and the process died of SIGSEGV at exit).
argv: FOLDER."""

import gc
import os
import resource
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

folder = sys.argv[1]
ids = keras.Input((2,), dtype="int64")
emb = sok.layers.DistributedEmbedding(3000, 8, combiner="sum", name="emb")
model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
model.compile(optimizer="adam", loss="mse")
x = np.arange(24).reshape(12, 2) % 37
model.fit(x, np.ones((12, 1)), batch_size=6, verbose=0)
# (Python ignores SIGXFSZ: a write past the limit fails with EFBIG.)
resource.setrlimit(resource.RLIMIT_FSIZE, (40 << 10, resource.RLIM_INFINITY))
errors = {}
for what, call in (
        ("save_weights", lambda: model.save_weights(
            os.path.join(folder, "w.weights.h5"))),
        ("save", lambda: model.save(os.path.join(folder, "m.keras")))):
    try:
        call()
        errors[what] = None
    except Exception as e:  # noqa: BLE001 -- reported
        errors[what] = f"{type(e).__name__}: {e}"
gc.collect()
write_result({"errors": errors, "left": sorted(os.listdir(folder)),
              "rank": RANK})
