"""Sparse optimizer kernels on float16 / bfloat16 tables (CPU).

A 16-bit table has float32 slots; the update loads the row into float32,
sums duplicate gradients in float32, runs the float32 rule and rounds the
new row once (to nearest even) when it stores it. The references here are
the float32 NumPy rules of test_sparse_kernels.py run on the loaded rows,
rounded to the storage type after every step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from sok_keras.optimizers import sparse_kernels as sk  # noqa: E402
from tests.optimizers.test_sparse_kernels import (  # noqa: E402
    HP,
    RULES,
    TOUCHABLE,
    _dedup_np,
    _init_table,
    _random_batches,
)

F32 = np.float32
HALF_DTYPES = (tf.float16, tf.bfloat16)
# Rules whose float32 NumPy reference is bit-exact with the kernel (only
# +, -, *, /, sqrt, each correctly rounded): checked bit for bit.
EXACT_RULES = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop",
               "rmsprop_momentum", "rmsprop_centered",
               "rmsprop_centered_momentum", "adadelta", "lion", "nadam")


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _half_batches(seed, dtype):
    """Random batches whose gradients are exactly representable in dtype."""
    np_dt = dtype.as_numpy_dtype
    return [(idx, g.astype(np_dt)) for idx, g in _random_batches(seed)]


def _run(name, dtype, seed):
    """Runs rule `name` on a `dtype` table and its float32 reference.

    Returns (table, slots, reference table, reference slots, w0)."""
    rule = RULES[name]
    np_dt = dtype.as_numpy_dtype
    w0 = _init_table(seed).astype(np_dt)
    var = tf.Variable(w0.copy())
    slots = {n: tf.Variable(np.full(w0.shape, init, F32))
             for n, init in rule.slots}
    w_ref = w0.copy()
    s_ref = {n: np.full(w0.shape, init, F32) for n, init in rule.slots}
    for t, (idx, g) in enumerate(_half_batches(seed + 1, dtype), start=1):
        rule.call(var, slots, idx, g, t)
        # Duplicates summed in float32, in position order.
        rows, summed = _dedup_np(idx, g.astype(F32))
        w_rows = w_ref[rows].astype(F32)
        s_rows = {n: s[rows] for n, s in s_ref.items()}
        rule.ref(w_rows, s_rows, summed, t)
        w_ref[rows] = w_rows.astype(np_dt)  # the one rounding per step
        for n in s_ref:
            s_ref[n][rows] = s_rows[n]
    return var, slots, w_ref, s_ref, w0


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", EXACT_RULES)
def test_half_table_matches_float32_reference_bitwise(dtype, name):
    var, slots, w_ref, s_ref, w0 = _run(name, dtype, 3)
    assert var.dtype == dtype
    np.testing.assert_array_equal(_bits(var.numpy()), _bits(w_ref))
    for n in s_ref:
        assert slots[n].dtype == tf.float32
        np.testing.assert_array_equal(slots[n].numpy(), s_ref[n])
    # Lazy: untouched rows keep their bits.
    np.testing.assert_array_equal(_bits(var.numpy()[TOUCHABLE:]),
                                  _bits(w0[TOUCHABLE:]))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(RULES))
def test_half_table_matches_float32_reference(dtype, name):
    """Every rule (Adam and Ftrl use pow, which NumPy and libm may round
    differently by an ulp of float32): within a 16-bit ulp or two."""
    var, slots, w_ref, s_ref, _ = _run(name, dtype, 7)
    eps = 2.0 ** (-7 if dtype == tf.bfloat16 else -10)  # the ulp at 1
    rtol = 2 * eps
    np.testing.assert_allclose(var.numpy().astype(F32), w_ref.astype(F32),
                               rtol=rtol, atol=rtol * 1e-2)
    for n in s_ref:
        np.testing.assert_allclose(slots[n].numpy(), s_ref[n], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_update_runs_in_float32_not_in_the_storage_type(dtype):
    # Momentum slot in float32: 0.9 * m - lr * g with lr = 1e-3 keeps
    # digits a 16-bit slot would lose; and the hyperparameters are read in
    # float32 (1e-3 is not a bfloat16/float16 value).
    np_dt = dtype.as_numpy_dtype
    w0 = np.ones((2, 2), np_dt)
    var = tf.Variable(w0)
    m = tf.Variable(np.zeros((2, 2), F32))
    g = np.full((1, 2), 3.0, np_dt)
    sk.sparse_momentum(var, m, [0], g, 1e-3, 0.9)
    np.testing.assert_array_equal(m.numpy()[0], F32(0) * F32(0.9)
                                  - F32(3) * F32(1e-3))
    expected_w = (F32(1) + m.numpy()[0]).astype(np_dt)
    np.testing.assert_array_equal(_bits(var.numpy()[0]), _bits(expected_w))
    np.testing.assert_array_equal(_bits(var.numpy()[1]), _bits(w0[1]))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_duplicate_gradients_sum_in_float32(dtype):
    # g = 1 once, then 1 / small copies of `small`, a quarter of the 16-bit
    # ulp at 1: the float32 sum is exactly 2, a 16-bit running sum stays 1.
    np_dt = dtype.as_numpy_dtype
    small = 2.0 ** (-9 if dtype == tf.bfloat16 else -12)
    k = 1 + int(1 / small)
    g = np.full((k, 1), small, np_dt)
    g[0] = 1.0
    var = tf.Variable(np.zeros((1, 1), np_dt))
    sk.sparse_sgd(var, np.zeros(k, np.int64), g, 1.0)
    np.testing.assert_array_equal(var.numpy().astype(F32), [[-2.0]])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_half_table_needs_float32_slots(dtype):
    var = tf.Variable(np.zeros((3, 2), dtype.as_numpy_dtype))
    m = tf.Variable(np.zeros((3, 2), dtype.as_numpy_dtype))
    tf_name = {"float16": "half"}.get(dtype.name, dtype.name)  # TF's name
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"slot 'm' has dtype {tf_name} but a table "
                             rf"of dtype {tf_name} needs float slots"):
        sk.sparse_momentum(var, m, [0], np.ones((1, 2)), 0.1, 0.9)
    np.testing.assert_array_equal(var.numpy().astype(F32), 0)


def test_slot_dtype():
    assert sk.slot_dtype("bfloat16") == tf.float32
    assert sk.slot_dtype(tf.float16) == tf.float32
    assert sk.slot_dtype("float32") == tf.float32
    assert sk.slot_dtype("float64") == tf.float64


def test_integer_table_is_rejected_with_its_name():
    var = tf.Variable(np.zeros((3, 2), np.int32), name="int_table")
    with pytest.raises(TypeError, match="int_table.*Received: dtype=int32"):
        sk.sparse_sgd(var, [0], np.ones((1, 2)), 0.1)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_step_and_hyperparameters_are_not_rounded_to_the_table_dtype(dtype):
    # Adam's bias correction at step 257: bfloat16 would read 256.
    np_dt = dtype.as_numpy_dtype
    var = tf.Variable(np.ones((1, 1), np_dt))
    m = tf.Variable(np.zeros((1, 1), F32))
    v = tf.Variable(np.zeros((1, 1), F32))
    g = np.ones((1, 1), np_dt)
    sk.sparse_adam(var, m, v, [0], g, HP["lr"], 257, beta_1=0.5, beta_2=0.5)
    w = np.ones((1, 1), F32)
    s = {"m": np.zeros((1, 1), F32), "v": np.zeros((1, 1), F32)}
    saved = dict(HP)
    try:
        HP.update(beta_1=0.5, beta_2=0.5)
        RULES["adam"].ref(w, s, g.astype(F32), 257)
    finally:
        HP.clear()
        HP.update(saved)
    np.testing.assert_array_equal(m.numpy(), s["m"])
    np.testing.assert_array_equal(v.numpy(), s["v"])
