"""Trains the DLRM-style model with model.fit on N ranks (see test_training).

argv: steps global_batch optimizer [optimizer ...]
"""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

from tests.training_setup import make_model_and_data  # noqa: E402

steps, global_batch = int(sys.argv[1]), int(sys.argv[2])
results = {}
for opt_name in sys.argv[3:]:
    keras.utils.clear_session()
    model, optimizer, (x, y) = make_model_and_data(
        "sok", opt_name, steps, global_batch)
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(optimizer),
                  loss="binary_crossentropy")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        global_batch, drop_remainder=True)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    model.fit(sok.shard_batches(ds), epochs=1, verbose=0,
              callbacks=[sok.callbacks.GlobalMetrics(), record])
    table = model.get_layer("embedding").embeddings
    results[opt_name] = {
        "losses": losses,
        "table": table.read_global().tolist(),
        "local_rows": int(table.shape[0]),
        "dense": [np.asarray(w).ravel().tolist()
                  for w in model.get_layer("click").get_weights()],
    }
write_result(results)
