"""A subclassed model holding a `sok.Variable` itself (SOK's way, no sok
layer), trained with Adam, saved with `model.save` at N ranks ("save") and
loaded at M ("load"). argv: MODE PATH. Reports the whole table, its slots
and the predictions of a fixed probe (the same on every rank)."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.layers_model import RawTableRanker  # noqa: E402

mode, path = sys.argv[1], sys.argv[2]
probe = np.arange(60).reshape(20, 3) % 41
if mode == "save":
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(10 + RANK)
    x = rng.integers(0, 41, size=(32, 3))
    y = rng.normal(size=(32, 1)).astype(np.float32)
    model = RawTableRanker()
    model.compile(optimizer=sok.OptimizerWrapper(
        keras.optimizers.Adam(0.05)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    model.save(path)
else:
    model = keras.models.load_model(path)
table = model.table
write_result({
    "table": table.read_global().tolist(),
    "slots": {k: s.read_global().tolist()
              for k, s in sorted(table.slots.items())},
    "predictions": model.predict(probe, verbose=0).ravel().tolist(),
    "shard_rows": int(table.shape[0]),
})
