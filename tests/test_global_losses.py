"""sok_keras.global_losses on one process: inert there, and the pieces the
N-rank behaviour rests on (tests/test_training_multirank.py runs it)."""

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as loss_module

import sok_keras  # noqa: F401 -- installs the patch
from sok_keras import global_losses


def test_installed_once_and_inert_on_one_rank():
    global_losses.install()  # idempotent
    assert loss_module.apply_mask is global_losses._apply_mask
    y = np.array([[0, 1, 2, 1]])
    pred = tf.nn.softmax(tf.constant(np.random.default_rng(0).normal(
        size=(1, 4, 3)), tf.float32))
    mask = tf.constant([[True, False, True, True]])
    pred._keras_mask = mask
    loss = keras.losses.SparseCategoricalCrossentropy()(y, pred)
    each = keras.losses.sparse_categorical_crossentropy(y, pred).numpy()
    np.testing.assert_allclose(loss, each[0, [0, 2, 3]].mean(), rtol=1e-6)


def test_keras_weighs_unmasked_positions_total_over_valid():
    """The rescaling multiplies Keras' weights by valid / mean(valid): it
    rests on Keras' `total / valid` weighting, checked here so that a
    Keras that changes it fails loudly."""
    mask = tf.constant([1.0, 0.0, 1.0, 1.0])
    weights = global_losses._ORIGINALS["apply_mask"](
        None, mask, "float32", "sum_over_batch_size")
    np.testing.assert_allclose(weights, [4 / 3, 0, 4 / 3, 4 / 3], rtol=1e-6)


def test_divisors_become_the_ranks_mean_count(monkeypatch):
    """With a step's flag set, a masked mean divides by the ranks' mean
    count and `mean_with_sample_weight` by the ranks' mean weight sum;
    the collective runs also for an empty batch (eagerly: a rank skipping
    it would leave its peers waiting)."""
    counts = []

    def global_mean(count):
        counts.append(float(count))
        return tf.constant(6.0, count.dtype)  # the ranks' mean count

    monkeypatch.setattr(global_losses, "_global_mean", global_mean)
    token = global_losses._GLOBAL.set(True)
    try:
        mask = tf.constant([1.0, 0.0, 1.0, 1.0])
        weights = global_losses._apply_mask(None, mask, "float32",
                                            "sum_over_batch_size")
        # total / 6 (not total / 3), so that the reduction's
        # sum(loss * w) / total = sum(loss over the valid) / 6
        np.testing.assert_allclose(weights, [4 / 6, 0, 4 / 6, 4 / 6],
                                   rtol=1e-6)
        values = tf.constant([1.0, 2.0, 3.0])
        sw = tf.constant([1.0, 1.0, 2.0])
        loss = global_losses._reduce_values(values * sw, sw,
                                            "mean_with_sample_weight")
        np.testing.assert_allclose(loss, (1 + 2 + 6) / 6, rtol=1e-6)
        empty = global_losses._reduce_values(
            tf.zeros([0]), tf.zeros([0]), "mean_with_sample_weight")
        assert empty.shape == (0,)
        assert counts == [3.0, 4.0, 0.0]
        # Other reductions and metrics' "sum" are Keras' own.
        global_losses._apply_mask(None, mask, "float32", "sum")
        global_losses._reduce_values(values, None, "sum_over_batch_size")
        assert len(counts) == 3
    finally:
        global_losses._GLOBAL.reset(token)


def test_no_collective_in_a_branch_of_the_step():
    seen = {}

    @tf.function
    def step(flag):
        token = global_losses._GLOBAL.set(tf.compat.v1.get_default_graph())
        try:
            seen["step"] = global_losses._in_a_branch()

            def branch():
                seen["branch"] = global_losses._in_a_branch()
                return tf.constant(1)

            return tf.cond(flag, branch, lambda: tf.constant(0))
        finally:
            global_losses._GLOBAL.reset(token)

    @tf.function
    def outer(flag):  # Keras runs the step in a cond branch itself
        return tf.cond(flag, lambda: step(flag), lambda: tf.constant(0))

    outer(tf.constant(True))
    assert seen == {"step": False, "branch": True}


def test_a_summed_loss_is_the_global_batchs_sum(monkeypatch):
    """`reduction="sum"`: the ranks' mean of their sums times N (the
    global sum); a scalar (a custom loss's own reduction) is left alone;
    nothing changes outside a step."""
    from sok_keras import world

    monkeypatch.setattr(world, "num_ranks", lambda: 3)
    values = tf.constant([1.0, 2.0, 4.0])
    assert float(global_losses._reduce_values(values, None, "sum")) == 7.0
    token = global_losses._GLOBAL.set(True)
    try:
        # Not a loss of `compile` (an add_loss penalty on weights, say).
        assert float(global_losses._reduce_values(values, None,
                                                  "sum")) == 7.0
        compiled = global_losses._COMPILED.set(True)
        assert float(global_losses._reduce_values(values, None,
                                                  "sum")) == 21.0
        assert float(global_losses._reduce_values(
            tf.constant(5.0), None, "sum")) == 5.0
        np.testing.assert_allclose(global_losses._reduce_values(
            values, None, "sum_over_batch_size"), 7.0 / 3, rtol=1e-6)
        global_losses._COMPILED.reset(compiled)
    finally:
        global_losses._GLOBAL.reset(token)
