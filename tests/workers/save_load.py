"""Save a trained model at N ranks / load it at M ranks (re-sharding).

argv: save PATH | load PATH
"""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

from tests.training_setup import make_model_and_data  # noqa: E402

action, path = sys.argv[1], sys.argv[2]
_, _, (x, y) = make_model_and_data("sok", "adam", 8, 48)
probe = {k: v[:96] for k, v in x.items()}
if action == "save":
    model, optimizer, _ = make_model_and_data("sok", "adam", 8, 48)
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(optimizer),
                  loss="binary_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        48, drop_remainder=True)
    model.fit(sok.shard_batches(ds), epochs=1, verbose=0)
    # Every rank saves (the table is gathered collectively); rank 0's file
    # is the one kept.
    model.save(path)
else:
    model = keras.models.load_model(path)
emb = model.get_layer("embedding").embeddings
# Continue training one more step from the loaded state: this checks that
# the optimizer slots came back with the table.
more_x = {k: v[:48] for k, v in x.items()}
model.fit(sok.shard_batches(tf.data.Dataset.from_tensor_slices(
    (more_x, y[:48])).batch(48, drop_remainder=True)), epochs=1, verbose=0)
write_result({
    "predictions": model.predict(probe, verbose=0).ravel().tolist(),
    "local_rows": int(emb.shape[0]),
    "slots": sorted(emb.slots),
    "table": emb.read_global().ravel().tolist(),
})
