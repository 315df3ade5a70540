"""The DLRM-style model on sok layers trains like the Keras reference."""

import keras
import numpy as np
import tensorflow as tf

from sok_keras.examples.dlrm import build_dlrm
from sok_keras.examples.synthetic import make_dataset
from sok_keras.optimizers import OptimizerWrapper

VOCAB = (50, 20, 300, 7, 120, 33, 64, 5, 200, 90, 11, 40, 60, 25, 80, 9, 150,
         30, 45, 6, 70, 12, 18, 100, 40, 22)


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _train(embedding, x, y, table=None, wrap=False, steps_per_execution=1):
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    model = build_dlrm(VOCAB, embedding_dim=8, bottom=(16, 8), top=(16,),
                       embedding=embedding)
    emb = model.get_layer("embedding")
    if table is None:
        table = emb.embeddings.numpy()
    emb.embeddings.assign(table)
    opt = keras.optimizers.SGD(0.05)
    model.compile(optimizer=OptimizerWrapper(opt) if wrap else opt,
                  loss="binary_crossentropy",
                  steps_per_execution=steps_per_execution)
    cb = _BatchLosses()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb])
    return cb.losses, emb.embeddings.numpy(), table


def test_dlrm_fit_matches_keras_embedding():
    x, y = make_dataset(64 * 25, VOCAB, seed=3)
    ref_losses, ref_table, table = _train("keras", x, y)
    losses, got_table, _ = _train("sok", x, y, table=table)
    assert len(losses) == 25
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # On a GPU, Keras' own gradient sums (atomics) run in no fixed order.
    atol = 1e-6 if tf.config.list_physical_devices("GPU") else 1e-7
    np.testing.assert_allclose(got_table, ref_table, rtol=1e-5, atol=atol)
    # Training moved the table: the comparison is not between two copies
    # of the initial values.
    assert np.abs(got_table - table).max() > 1e-4
    wrapped, _, _ = _train("sok", x, y, table=table, wrap=True,
                           steps_per_execution=5)
    assert len(wrapped) == 5
    np.testing.assert_allclose(wrapped, ref_losses[4::5], rtol=1e-5)


def test_synthetic_data_has_signal():
    x, y = make_dataset(5000, seed=0)
    assert x["dense"].shape == (5000, 13) and x["sparse"].shape == (5000, 26)
    assert 0.2 < y.mean() < 0.8
    # Hot ids dominate (Zipf): the most frequent id of a big feature is far
    # more common than uniform.
    counts = np.bincount(x["sparse"][:, 2])
    assert counts.max() > 50 * 5000 / 20000
    assert tf.reduce_all(x["sparse"] >= 0)
