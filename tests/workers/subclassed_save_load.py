"""A subclassed model (Keras rebuilds it in `load_model` by running `call`
inside its StatelessScope, where the sok table is made deferred) trained
on N ranks, saved, and loaded back on the same ranks: the loaded model
predicts as the trained one. argv: FOLDER; rank 0 also writes the
predictions of a fixed probe (probe.npy, expected.npy) for a load at
another number of ranks."""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.layers_model import SubclassedRanker  # noqa: E402

folder = sys.argv[1]
path = os.path.join(folder, "ranker.keras")
keras.utils.set_random_seed(3)
rng = np.random.default_rng(10 + RANK)
x = rng.integers(0, 101, size=(32, 3))
y = rng.normal(size=(32, 1)).astype(np.float32)
model = SubclassedRanker()
model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.05)),
              loss="mse")
model.fit(x, y, batch_size=8, epochs=2, verbose=0)
probe = np.arange(60).reshape(20, 3)
expected = model.predict(probe, verbose=0)
model.save(path)
loaded = keras.models.load_model(path)
got = loaded.predict(probe, verbose=0)
same_table = bool(np.array_equal(loaded.emb.embeddings.numpy(),
                                 model.emb.embeddings.numpy()))
if RANK == 0:
    np.save(os.path.join(folder, "probe.npy"), probe)
    np.save(os.path.join(folder, "expected.npy"), expected)
write_result({"max_diff": float(np.max(np.abs(got - expected))),
              "same_table": same_table,
              "shard_rows": int(loaded.emb.embeddings.shape[0])})
