"""Callbacks given on some ranks only, and `model.set_weights` of whole
tables, on 2 ranks (tests/test_tensorboard.py).

1. A model without sok layers, trained on rank 1 only with a CSVLogger
   and a TensorBoard: rank 0 alone writes (every rank passes one path),
   and rank 1 says once per callback that its logs are not written
   (before: nothing said).
2. `model.set_weights` with a whole table for a sharded one: the layers'
   message naming the table.
3. Last (a failed fit ends the job's training): TensorBoard with
   histograms given on rank 0 only, for a model with a sok table, under
   SOK_SAVE_TIMEOUT=5: each rank raises within seconds (before: rank 0
   waited SOK_COMM_TIMEOUT, 300 s, in the histogram's all-reduce).
argv[1]: a folder for the logs.
"""

import logging
import os
import sys
import time

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

out = sys.argv[1]
result = {}
warned = []


class Record(logging.Handler):
    def emit(self, record):
        warned.append(record.getMessage())


logging.getLogger("sok_keras").addHandler(Record(logging.WARNING))
rng = np.random.default_rng(0)

# 1. A plain model on rank 1 only.
if RANK == 1:
    x = rng.normal(size=(16, 4)).astype("float32")
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    plain.compile("sgd", "mse")
    plain.fit(x, x.sum(1, keepdims=True), epochs=2, verbose=0, callbacks=[
        keras.callbacks.CSVLogger(os.path.join(out, "plain.csv")),
        keras.callbacks.TensorBoard(os.path.join(out, "plain_tb"))])
result["files"] = sorted(
    os.path.relpath(os.path.join(d, f), out)
    for d, _, files in os.walk(out) for f in files)
result["warnings"] = list(warned)

# 2. model.set_weights of whole tables.
ids = keras.Input((3,), dtype="int64")
emb = sok.layers.DistributedEmbedding(100, 4, name="emb")
model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
whole = [np.ones((100, 4), "float32")] + [
    w.numpy() for w in model.weights[1:]]
try:
    model.set_weights(whole)
    result["set_weights"] = "no error"
except ValueError as e:
    result["set_weights"] = str(e)

# 3. TensorBoard(histogram_freq=1) on rank 0 only.
model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.01)),
              loss="mse")
callbacks = ([keras.callbacks.TensorBoard(os.path.join(out, "tb"),
                                          histogram_freq=1)]
             if RANK == 0 else [])
x = rng.integers(0, 100, (32, 3))
start = time.monotonic()
try:
    model.fit(x[RANK::2], np.zeros((16, 1)), batch_size=4, epochs=2,
              verbose=0, callbacks=callbacks)
    result["fit"] = "no error"
except Exception as e:  # noqa: BLE001 - the test reads which
    result["fit"] = f"{type(e).__name__}: {e}"
result["fit_seconds"] = time.monotonic() - start
write_result(result)
