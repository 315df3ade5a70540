"""A subclassed model with its own `train_step` on N ranks (argv[1]):

- "extra": the step returns its metrics plus the learning rate; the logged
  AUC must be the global one, as without the extra entry (before, one
  extra key made every entry a mean of the ranks' values).
- "plain": the step applies the dense gradients with a plain Keras Adam
  kept as an attribute (unaveraged): `fit` must stop with an error naming
  the dense weights that differ between ranks (before, the ranks drifted
  apart silently while the global logs looked like one model's).
"""

import sys

import numpy as np

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402


class Ranker(keras.Model):
    def __init__(self, extra=False, plain=None):
        super().__init__()
        self.emb = sok.layers.DistributedEmbedding(40, 4, combiner="sum")
        self.out = keras.layers.Dense(1, activation="sigmoid")
        self.extra, self.plain = extra, plain
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.auc = keras.metrics.AUC(name="auc")

    def call(self, x):
        return self.out(self.emb(x))

    @property
    def metrics(self):
        return [self.loss_tracker, self.auc]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            p = self(x, training=True)
            loss = keras.losses.binary_crossentropy(y, p)
            loss = tf.reduce_mean(loss)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        if self.plain is None:
            self.optimizer.apply_gradients(zip(grads, variables))
        else:
            table = [(g, v) for g, v in zip(grads, variables)
                     if isinstance(v, sok.Variable)]
            dense = [(g, v) for g, v in zip(grads, variables)
                     if not isinstance(v, sok.Variable)]
            self.optimizer.apply_gradients(table)
            self.plain.apply_gradients(dense)
        self.loss_tracker.update_state(loss)
        self.auc.update_state(y, p)
        out = {m.name: m.result() for m in self.metrics}
        if self.extra:
            out["lr"] = self.optimizer.learning_rate
        return out


def fit(**kwargs):
    keras.utils.set_random_seed(7)
    model = Ranker(**kwargs)
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.05)))
    rng = np.random.default_rng(20 + RANK)  # each rank its own data
    x = rng.integers(0, 40, (64, 3))
    y = (rng.random((64, 1)) < 0.5).astype(np.float32)
    return model.fit(x, y, batch_size=16, epochs=2, verbose=0).history


if sys.argv[1:] == ["extra"]:
    write_result({"plain": fit(), "extra": fit(extra=True)})
else:  # "drift": last in its job (a failed fit leaves the runtime aborted)
    try:
        fit(plain=keras.optimizers.Adam(0.05))
        drift_error = "no error"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        # The rank that raises first reports it, and the other's
        # collectives end with its message (a TensorFlow error).
        drift_error = f"{type(e).__name__}: {e}"
    write_result({"drift_error": drift_error})
