"""Rank 1 raises in the middle of model.fit; the others are in collectives."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.training_setup import make_model_and_data  # noqa: E402


class Boom(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if sok.rank() == 1 and batch == 4:
            raise RuntimeError("rank 1 fails on purpose at batch 4")


model, optimizer, (x, y) = make_model_and_data("sok", "sgd", 400, 16)
model.compile(optimizer=sok.optimizers.OptimizerWrapper(optimizer),
              loss="binary_crossentropy")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
model.fit(sok.shard_batches(ds), epochs=1, verbose=0,
          callbacks=[sok.callbacks.GlobalMetrics(), Boom()])
