"""An EmbeddingCollection whose `features` dict is built in another order
on each rank (from a set, say): the ranks train together.

argv: none. Rank 1 lists the features in reverse order.
"""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

names = ["bought", "clicked", "liked", "shared", "viewed"]
order = names if RANK == 0 else names[::-1]
features = {f: {"table": "item" if f < "l" else "user"} for f in order}
tables = {"item": {"vocabulary_size": 40, "embedding_dim": 4,
                   "initializer": "ones"},
          "user": {"vocabulary_size": 30, "embedding_dim": 4,
                   "initializer": "ones"}}
inputs = {f: keras.Input(shape=(2,), dtype="int64", name=f) for f in names}
out = sok.layers.EmbeddingCollection(tables, features, name="ec")(inputs)
x = keras.layers.Concatenate()([out[f] for f in names])
model = keras.Model(inputs, keras.layers.Dense(
    1, kernel_initializer="ones")(x))
model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
rng = np.random.default_rng(RANK)
data = {f: rng.integers(0, 30, size=(16, 2)) for f in names}
y = rng.normal(size=(16, 1)).astype(np.float32)
result = {"error": None, "order": list(model.get_layer("ec").features)}
try:
    history = model.fit(data, y, batch_size=8, epochs=1, verbose=0)
    result["losses"] = history.history["loss"]
    result["tables"] = {t: v.read_global().tolist() for t, v in
                        model.get_layer("ec").embeddings.items()}
except Exception as e:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(e).__name__}: {e}"
write_result(result)
