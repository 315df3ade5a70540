"""`sok.OptimizerScope` (`sok_keras/optimizers/scope.py`): SOK's seed code
creates its optimizers inside the scope and gets lazy table updates."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras.optimizers import sparse_optimizers
from tests.optimizers.test_sparse_kernels import RULES
from tests.optimizers.test_sparse_rules import initial_values
from tests.optimizers.test_sparse_rules import keras_dense
from tests.optimizers.test_sparse_rules import lazy_reference
from tests.optimizers.test_sparse_rules import make_steps
from tests.optimizers.test_sparse_rules import run_sok

NAMES = ("SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop", "Adamax",
         "Adadelta", "Lion", "Nadam", "Muon")
KERAS = {n: getattr(keras.optimizers, n) for n in NAMES}


def _np(v):
    return keras.ops.convert_to_numpy(v)


def _table():
    return sok.Variable(np.zeros((4, 2), np.float32), name="t")


def test_names_resolve_to_sparse_optimizers_only_inside():
    with sok.OptimizerScope([_table()]) as scope:
        assert isinstance(scope, sok.OptimizerScope)
        for n in NAMES:
            assert keras.optimizers.__dict__[n] is getattr(sparse_optimizers,
                                                           n)
            assert getattr(tf.keras.optimizers, n) is getattr(
                sparse_optimizers, n)
    for n in NAMES:
        assert getattr(keras.optimizers, n) is KERAS[n]
        assert getattr(tf.keras.optimizers, n) is KERAS[n]


def test_restored_after_an_exception_and_when_nested():
    with pytest.raises(RuntimeError, match="boom"):
        with sok.OptimizerScope([_table()]):
            raise RuntimeError("boom")
    assert keras.optimizers.Adam is KERAS["Adam"]
    with sok.OptimizerScope([]):
        with sok.OptimizerScope([]):
            assert keras.optimizers.Adam is sparse_optimizers.Adam
        assert keras.optimizers.Adam is sparse_optimizers.Adam
    assert keras.optimizers.Adam is KERAS["Adam"]


def test_only_tables_are_accepted():
    with pytest.raises(TypeError, match="sok_keras.Variable"):
        sok.OptimizerScope([_table(), keras.Variable(np.zeros(3))])
    assert keras.optimizers.Adam is KERAS["Adam"]


def test_seed_usage_lazy_tables_and_keras_dense():
    """`with sok.OptimizerScope(emb_vars): opt = tf.keras.optimizers.Adam()`
    then `opt.apply_gradients(zip(grads, vars))`."""
    rule = RULES["adam"]
    hp = dict(learning_rate=0.05, beta_1=0.85, beta_2=0.995, epsilon=1e-7)
    steps = make_steps(seed=41)
    w0, d0 = initial_values(8)
    with sok.OptimizerScope([_table()]):
        opt = tf.keras.optimizers.Adam(**hp)
    assert type(opt) is sparse_optimizers.Adam
    assert isinstance(opt, KERAS["Adam"])
    table, dense = run_sok(opt, steps, w0, d0, tf_function=True)
    w_ref, s_ref = lazy_reference(rule, steps, w0)
    np.testing.assert_allclose(_np(table), w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_np(table.slots["m"]), s_ref["m"], rtol=1e-5,
                               atol=1e-6)
    kvar, kdense, _ = keras_dense(keras.optimizers.Adam(**hp), steps, w0, d0)
    if tf.config.list_logical_devices("GPU"):
        # There the traced step's dense update is XLA-compiled
        # (jit_compile="auto"), Keras' eager one is not: an ulp apart.
        np.testing.assert_allclose(_np(dense), _np(kdense), rtol=1e-6,
                                   atol=1e-7)
    else:
        np.testing.assert_array_equal(_np(dense), _np(kdense))
    # Keras' own Adam would have moved rows that were not looked up.
    assert not np.allclose(_np(kvar), w_ref, rtol=1e-5, atol=1e-6)


def test_seed_usage_separate_optimizers_with_lookup():
    """The seed's pattern: an embedding optimizer made in the scope for the
    tables, a plain Keras one for the dense weights."""
    w0 = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)
    table = sok.Variable(w0, name="emb")
    dense = keras.Variable(np.ones((3, 1), np.float32), name="w")
    with sok.OptimizerScope([table]):
        emb_opt = tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    dense_opt = tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    ref_dense = keras.Variable(np.ones((3, 1), np.float32))
    ref_opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    ids = tf.ragged.constant([[0, 2], [2, 5]], dtype=tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse([table], [ids], combiners=["sum"])[0]
            loss = tf.reduce_sum(tf.matmul(out, dense))
        emb_grads, dense_grads = tape.gradient(loss, [[table], [dense]])
        emb_opt.apply_gradients(zip(emb_grads, [table]))
        dense_opt.apply_gradients(zip(dense_grads, [dense]))
        ref_opt.apply_gradients(zip(dense_grads, [ref_dense]))

    for _ in range(3):
        step()
    assert sorted(table.slots) == ["momentum"]
    # Rows 0, 2, 5 move (row 2 twice as fast); the others keep their values.
    moved = np.abs(_np(table) - w0).sum(axis=1) > 0
    np.testing.assert_array_equal(np.flatnonzero(moved), [0, 2, 5])
    assert int(emb_opt.iterations) == 3
    np.testing.assert_array_equal(_np(dense), _np(ref_dense))


def test_optimizer_from_the_scope_deserializes_outside():
    with sok.OptimizerScope([]):
        opt = keras.optimizers.Ftrl(0.2, beta=0.1)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is sparse_optimizers.Ftrl
    assert again.get_config() == opt.get_config()


def test_same_scope_entered_twice_nested_restores_keras():
    import keras

    import sok_keras as sok

    original = keras.optimizers.Adam
    scope = sok.OptimizerScope([])
    with scope:
        with scope:
            assert keras.optimizers.Adam is sok.optimizers.Adam
        assert keras.optimizers.Adam is sok.optimizers.Adam
    assert keras.optimizers.Adam is original


def test_an_optimizer_made_outside_applied_inside_is_refused():
    """SOK 1 put the scope around `apply_gradients`; here it goes around the
    optimizer's creation. A plain Keras optimizer applied to tables inside
    the scope is refused, saying where the scope goes (before: a dense
    update with the ranks' summed gradients, N times the step on N ranks,
    silently). Dense variables, and optimizers made inside, still apply."""
    base_apply = keras.optimizers.Optimizer.__dict__.get("apply_gradients")
    table = _table()
    dense = keras.Variable(np.zeros(2, np.float32))
    grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]),
                            tf.constant([4, 2]))
    outside = keras.optimizers.SGD(1.0)
    with sok.OptimizerScope([table]):
        inside = keras.optimizers.SGD(1.0)
        with pytest.raises(ValueError, match=r"made outside the scope.*'t'"
                           r".*difference 2"):
            outside.apply_gradients([(grad, table)])
        KERAS["SGD"](1.0).apply_gradients([(tf.ones(2), dense)])
        inside.apply_gradients([(grad, table)])
    np.testing.assert_array_equal(_np(table.value)[1], [-1.0, -1.0])
    np.testing.assert_array_equal(_np(dense.value), [-1.0, -1.0])
    assert keras.optimizers.Optimizer.__dict__.get(
        "apply_gradients") is base_apply
    outside.apply_gradients([(grad, table)])  # outside: as before


def test_tf2_keras_aggregate_argument_is_taken_for_tables_only():
    """SOK's seed: `emb_opt.apply_gradients(..., experimental_aggregate_
    gradients=False)` on tables (before: Keras 3's bare TypeError). With
    dense variables it is refused: their gradients are averaged here."""
    table = _table()
    grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]),
                            tf.constant([4, 2]))
    for opt in (sok.optimizers.SGD(1.0),
                sok.OptimizerWrapper(keras.optimizers.SGD(1.0))):
        table.assign(np.zeros((4, 2), np.float32))
        opt.apply_gradients([(grad, table)],
                            experimental_aggregate_gradients=False)
        np.testing.assert_array_equal(_np(table.value)[2], [-1.0, -1.0])
        dense = keras.Variable(np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="tables only.*difference 1"):
            opt.apply_gradients([(tf.ones(2), dense)],
                                experimental_aggregate_gradients=False)
        with pytest.raises(TypeError, match=r"unexpected.*\['bogus'\]"):
            opt.apply_gradients([(grad, table)], bogus=1)
