"""Shared checks for layer tests (serialization, saving)."""

import os

import keras
import numpy as np


def assert_config_round_trip(layer):
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    return clone


def assert_model_saving(model, inputs, tmp_path):
    """Saves to .keras, reloads, and checks identical predictions."""
    expected = model.predict(inputs, verbose=0)
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    keras.utils.clear_session()
    loaded = keras.models.load_model(path)
    got = loaded.predict(inputs, verbose=0)
    np.testing.assert_array_equal(got, expected)
    return loaded
