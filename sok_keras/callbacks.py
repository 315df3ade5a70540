"""Keras callbacks for multi-rank training."""

import keras
import numpy as np
import tensorflow as tf

from sok_keras import world


def average_logs(logs, key):
    """Averages the numeric entries of a Keras `logs` dict across ranks.

    Every rank must call it with the same keys. Returns a new dict.
    """
    if not logs or world.num_ranks() == 1:
        return logs
    names = sorted(k for k, v in logs.items() if _is_number(v))
    if not names:
        return logs
    values = tf.constant([float(logs[k]) for k in names], tf.float64)
    mean = world.communicator().all_reduce(
        values, key=f"{key}/{len(names)}", op="mean").numpy()
    out = dict(logs)
    out.update({k: float(v) for k, v in zip(names, mean)})
    return out


def _is_number(v):
    if isinstance(v, (int, float, np.number)):
        return True
    return hasattr(v, "shape") and tuple(v.shape) == ()


class GlobalMetrics(keras.callbacks.Callback):
    """Shows global (rank-averaged) loss and metrics in Keras' logs.

    Each rank computes its loss and metrics on its own slice of the global
    batch. This callback replaces them, in place, by their mean over ranks
    after every batch and epoch, so the progress bar of rank 0, `History`
    and later callbacks report the global values. Losses and mean-type
    metrics averaged this way are exact when every rank has the same batch
    size; metrics that are not means of per-example values (AUC, say) are
    averaged per rank, an approximation.

    Put it in `callbacks=[...]` on every rank; it does nothing with one rank.

    Example:

    >>> model.fit(ds, epochs=2, callbacks=[sok.callbacks.GlobalMetrics()],
    ...           verbose=1 if sok.rank() == 0 else 0)
    """

    def _average(self, logs, key):
        if logs:
            logs.update(average_logs(logs, key))

    def on_train_batch_end(self, batch, logs=None):
        self._average(logs, "global_metrics/train_batch")

    def on_test_batch_end(self, batch, logs=None):
        self._average(logs, "global_metrics/test_batch")

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, "global_metrics/epoch")

    def on_test_end(self, logs=None):
        self._average(logs, "global_metrics/test_end")
