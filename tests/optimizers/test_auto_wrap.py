"""model.compile with a plain Keras optimizer on a model with sok tables
wraps it in OptimizerWrapper (sok_keras/optimizers/auto_wrap.py)."""

import logging

import keras
import numpy as np

import sok_keras as sok
from sok_keras.variable import is_sok_variable
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


def _model(vocab=500):
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(vocab, 4, combiner="sum")
    return keras.Model(ids, keras.layers.Dense(1)(emb(ids)))


def test_string_and_instance_optimizers_are_wrapped(caplog):
    x = np.random.default_rng(0).integers(0, 500, (64, 3))
    y = np.ones((64, 1), np.float32)
    for opt in ("adam", keras.optimizers.Adam(0.01)):
        model = _model()
        with caplog.at_level(logging.WARNING, logger="sok_keras"):
            model.compile(optimizer=opt, loss="mse")
        assert isinstance(model.optimizer, sok.optimizers.OptimizerWrapper)
        assert "wrapped in sok_keras.optimizers.OptimizerWrapper" in (
            caplog.text)
        model.fit(x, y, epochs=1, verbose=0)
        # No dense, full-size Keras slots for the table.
        full = [v for v in model.optimizer.variables
                if tuple(v.shape) == (500, 4) and not is_sok_variable(v)]
        assert full == []


def test_sok_optimizers_and_plain_models_are_left_alone():
    model = _model()
    wrapper = sok.optimizers.OptimizerWrapper(keras.optimizers.SGD(0.1))
    model.compile(optimizer=wrapper, loss="mse")
    assert model.optimizer is wrapper
    model = _model()
    direct = sok.optimizers.Adam(0.01)
    model.compile(optimizer=direct, loss="mse")
    assert model.optimizer is direct
    ids = keras.Input((3,), dtype="int64")
    plain = keras.Model(ids, keras.layers.Embedding(10, 2)(ids))
    plain.compile(optimizer="adam", loss="mse")
    assert isinstance(plain.optimizer, keras.optimizers.Adam)


def test_plain_adam_on_two_ranks_keeps_dense_weights_equal():
    """Before: the ranks' Dense kernels drifted apart (2.9406 vs 3.0154)."""
    r0, r1 = run_workers(worker_path("plain_optimizer"), 2, timeout=120)
    assert r0["wrapped"] and r1["wrapped"]
    np.testing.assert_array_equal(r0["kernel"], r1["kernel"])


def test_keras_still_compiles_loaded_models_after_the_hook(tmp_path):
    """Keras compiles a loaded model only if its compile is Trainer's: the
    hook must sit on that class (fails loudly if Keras moves compile)."""
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.compiled and loaded.loss == "mse"
    assert isinstance(loaded.optimizer, sok.optimizers.OptimizerWrapper)
