"""2 ranks: the first `fit` of a subclassed model that makes its sok layers
in `build()`, compiled unbuilt with a plain optimizer, and of the same model
made in `__init__`, each rank with data of its own. Writes each model's
loss history (global logs: the same on every rank) and its dense kernel.
"""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.optimizers.test_auto_wrap import TablesInBuild  # noqa: E402
from tests.optimizers.test_auto_wrap import TablesInInit  # noqa: E402


rng = np.random.default_rng(100 + RANK)
x = rng.integers(0, 50, (64, 3))
y = rng.normal(size=(64, 1)).astype(np.float32)
result = {}
for cls in (TablesInInit, TablesInBuild):
    keras.utils.set_random_seed(RANK)  # rank 0's dense weights win
    model = cls()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    result[cls.__name__] = {
        "loss": history.history["loss"],
        "optimizer": type(model.optimizer).__name__,
        "kernel": model.head.kernel.numpy().ravel().tolist()}
write_result(result)
