"""Trains the keras-rs DLRM and DCN-v2 (tests/workers/keras_rs_models.py)
with sok's EmbeddingCollection on N ranks (see tests/layers/test_keras_rs.py).

argv: weights.npz steps global_batch
The .npz holds each model's initial weights, keyed "<model>:<key>" (taken
from keras-rs' own model by the test).
"""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

import keras_rs_models as models  # noqa: E402

# Plain float32 matmuls on a GPU, as in the test's reference (TF32 would
# round the two models apart).
tf.config.experimental.enable_tensor_float_32_execution(False)
path, steps, global_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
saved = np.load(path)
results = {}
for kind in models.MODELS:
    keras.utils.clear_session()
    model = models.make_model(kind, sok.layers.EmbeddingCollection,
                              global_batch)
    prefix = f"{kind}:"
    models.assign_weights(model, {k[len(prefix):]: saved[k] for k in saved
                                  if k.startswith(prefix)})
    # A plain Keras optimizer, as a keras-rs user writes it (sok wraps it).
    model.compile(optimizer=keras.optimizers.SGD(models.LEARNING_RATE[kind]),
                  loss=models.loss_for(kind))
    x, y = models.make_data(kind, steps, global_batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        global_batch, drop_remainder=True)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    model.fit(sok.shard_batches(ds), epochs=1, verbose=0,
              callbacks=[sok.callbacks.GlobalMetrics(), record])
    emb = model.get_layer("emb")
    results[kind] = {
        "losses": losses,
        "weights": {k: np.asarray(v).tolist()
                    for k, v in models.model_weights(model).items()},
        "local_rows": {t: int(v.shape[0]) for t, v in emb.embeddings.items()},
    }
write_result(results)
