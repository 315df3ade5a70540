"""keras.callbacks.TensorBoard(histogram_freq=1) on N ranks
(sok_keras/tensorboard.py): a 40 x 4 distributed table and a Dense head
and a 7 x 2 table localized on rank 1 (rank 0's shard is empty) fitted
for 2 epochs, with validation, into one log_dir (argv[1]); every rank
records the whole tables at each epoch's end, for the test to compare with
the histograms rank 0 wrote. A CSVLogger(argv[1] + ".csv", append=True)
on every rank writes one file."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

log_dir = sys.argv[1]
keras.utils.set_random_seed(0)
ids = keras.Input((3,), dtype="int64")
emb = sok.layers.DistributedEmbedding(40, 4, combiner="sum", name="emb")
loc = sok.layers.LocalizedEmbedding(7, 2, rank=1, name="loc")
both = keras.layers.Concatenate()([emb(ids), loc(ids % 7)])
out = keras.layers.Dense(2, name="head")(both)
model = keras.Model(ids, out)
model.compile(optimizer="adam", loss="mse")

tables = []


class Record(keras.callbacks.Callback):
    """The whole table after each epoch (a collective on every rank)."""

    def on_epoch_end(self, epoch, logs=None):
        tables.append({t.path: t.read_global().tolist()
                       for t in (emb.embeddings, loc.embeddings)})


rng = np.random.default_rng(RANK)
x = rng.integers(0, 40, (32, 3))
y = rng.normal(size=(32, 2)).astype("float32")
board = keras.callbacks.TensorBoard(log_dir, histogram_freq=1)
# One CSV file for every rank, appended to: rank 0 alone writes it.
csv = keras.callbacks.CSVLogger(log_dir + ".csv", append=True)
model.fit(x, y, batch_size=8, epochs=2, verbose=0,
          validation_data=(x[:16], y[:16]), callbacks=[board, Record(), csv])
write_result({
    "tables": tables,
    "local_shapes": {t.path: list(t.shape)
                     for t in (emb.embeddings, loc.embeddings)},
    "kernel_path": model.get_layer("head").kernel.path,
})
