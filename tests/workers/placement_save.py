"""Tables placed on one rank (LocalizedEmbedding with an explicit rank and
round-robin, EmbeddingCollection "localized:1"), saved at 2 ranks: the
file must load at 1 rank (tests/test_save_load_multirank.py), and
`keras.models.clone_model` + `set_weights` must give the same model here
(the clone's tables where the original's are)."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import write_result  # noqa: E402

path = sys.argv[1]
keras.utils.set_random_seed(4)
ins = {k: keras.Input((2,), dtype="int64", name=k)
       for k in ("a", "b", "c", "d")}
pinned = sok.layers.LocalizedEmbedding(40, 3, rank=1, name="pinned")
auto1 = sok.layers.LocalizedEmbedding(30, 2, name="auto1")
auto2 = sok.layers.LocalizedEmbedding(30, 2, name="auto2")
coll = sok.layers.EmbeddingCollection(
    tables={"t": {"vocabulary_size": 25, "embedding_dim": 2,
                  "mode": "localized:1"}},
    features={"d": {"table": "t"}}, name="coll")
x = keras.layers.Concatenate()([
    pinned(ins["a"]), auto1(ins["b"]), auto2(ins["c"]),
    coll({"d": ins["d"]})["d"]])
model = keras.Model(ins, keras.layers.Dense(1, name="out")(x))
model.compile(optimizer=sok.optimizers.OptimizerWrapper(
    keras.optimizers.Adam(0.05)), loss="mse")
rng = np.random.default_rng(0)  # the same batch on every rank
data = {k: rng.integers(0, 25, (16, 2)) for k in ins}
model.fit(data, rng.normal(size=(16, 1)), batch_size=16, epochs=2,
          verbose=0)
model.save(path)
predictions = model.predict(data, verbose=0)

clone = keras.models.clone_model(model)
clone.set_weights(model.get_weights())
write_result({
    "placed": {n: model.get_layer(n)._placed_rank
               for n in ("pinned", "auto1", "auto2")},
    "clone_placed": {n: clone.get_layer(n)._placed_rank
                     for n in ("pinned", "auto1", "auto2")},
    "predictions": predictions.ravel().tolist(),
    "clone_predictions": clone.predict(data, verbose=0).ravel().tolist(),
    "tables": {n: model.get_layer(n).embeddings.read_global().tolist()
               for n in ("pinned", "auto1", "auto2")},
})
