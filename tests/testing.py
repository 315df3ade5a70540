"""Shared checks for layer tests (serialization, saving) and for N-rank
vs one-process parity under Adam."""

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


def assert_adam_parity(actual, desired, atol, rtol=1e-5, outlier_atol=1e-3,
                       max_outlier_fraction=1e-4):
    """Weights trained on N ranks vs in one process, under Adam with a
    large learning rate (the seed recipes' Adam(0.1)).

    Adam's step `lr * m / sqrt(v)` does not shrink with the gradient: in a
    component whose gradient is near zero, two correct summation orders
    (one process's batch sum vs an all-reduce of per-rank sums) round the
    gradient apart by far more than its relative size, and move that one
    weight by much more than elsewhere. Which component that is depends on
    the CPU's kernels (seen: 1 element of 98,304 off by 1.4e-4 on one host
    and not on another). So every element must agree to `outlier_atol`,
    and all but `max_outlier_fraction` of them (at least one) to
    `atol + rtol * |desired|`. A wrong shard, or a missing or doubled
    all-reduce, moves thousands of elements by about `lr` and still fails.
    """
    a = np.asarray(actual, np.float64)
    c = np.asarray(desired, np.float64)
    assert a.shape == c.shape, (a.shape, c.shape)
    np.testing.assert_allclose(a, c, rtol=0, atol=outlier_atol)
    bad = np.abs(a - c) > atol + rtol * np.abs(c)
    allowed = max(1, int(max_outlier_fraction * a.size))
    assert int(bad.sum()) <= allowed, (
        f"{int(bad.sum())} of {a.size} elements differ by more than "
        f"{atol} (+{rtol} relative), more than the {allowed} allowed; "
        f"largest difference {np.abs(a - c).max():.3g}")
