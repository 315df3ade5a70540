"""OptimizerWrapper(skip_nonfinite=True): a NaN on one rank only makes
every rank skip the step; the next finite step trains."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

ids = keras.Input((3,), dtype="int64")
emb = sok.layers.DistributedEmbedding(100, 4, combiner="sum")
model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
opt = sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.01),
                                      skip_nonfinite=True)
model.compile(optimizer=opt, loss="mse")
rng = np.random.default_rng(RANK)
x = rng.integers(0, 100, (16, 3))
y = rng.normal(size=(16, 1)).astype(np.float32)
model.train_on_batch(x, y)  # builds; one real step
table = emb.embeddings.numpy().copy()
kernel = model.layers[-1].kernel.numpy().copy()
bad_y = y.copy()
if RANK == 1:
    bad_y[0, 0] = np.nan
model.train_on_batch(x, bad_y)
unchanged = bool(np.array_equal(table, emb.embeddings.numpy()) and
                 np.array_equal(kernel, model.layers[-1].kernel.numpy()))
skipped = int(opt.skipped_steps.numpy())
model.train_on_batch(x, y)
moved = not np.array_equal(table, emb.embeddings.numpy())
write_result({"unchanged": unchanged, "skipped": skipped, "moved": moved})
