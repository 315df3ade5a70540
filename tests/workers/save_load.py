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
# What was saved (or loaded): the whole slots.
slots_at_save = {k: emb.slots[k].read_global().ravel().tolist()
                 for k in sorted(emb.slots)}
# Continue training 5 more steps from the saved (or loaded) state: the
# saving job is the uninterrupted run. After each step, the loss of one
# fixed global batch (the same on every rank).
_, _, (more_x, more_y) = make_model_and_data("sok", "adam", 5, 48)
probe_y = y[:96]
losses = []
for step in range(5):
    part = {k: v[step * 48:(step + 1) * 48] for k, v in more_x.items()}
    model.fit(sok.shard_batches(tf.data.Dataset.from_tensor_slices(
        (part, more_y[step * 48:(step + 1) * 48])).batch(
            48, drop_remainder=True)), epochs=1, verbose=0)
    losses.append(float(model.test_on_batch(probe, probe_y)))
write_result({
    "predictions": model.predict(probe, verbose=0).ravel().tolist(),
    "local_rows": int(emb.shape[0]),
    "slots": sorted(emb.slots),
    "slots_at_save": slots_at_save,
    "losses": losses,
    "table": emb.read_global().ravel().tolist(),
})
