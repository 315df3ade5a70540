"""The bad-input matrix on one rank: every public entry point x every kind
of bad input, eagerly and in a `tf.function`, plus `fit`, `sok.Variable`
and `OptimizerWrapper` cases (see tests/bad_input_cases.py; the 2-rank run
of the same matrix is tests/test_bad_inputs_multirank.py).

A bad input must raise a clear error naming the layer or table and the
value, change no shard and leave the next good lookup right; empty batches
and padding work.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests import bad_input_cases as cases


@pytest.fixture(autouse=True)
def _clear_session():
    # Overrides conftest's: the matrix shares one World (one set of tables
    # and layers), and keras.utils.clear_session() costs ~0.6 s a test.
    yield


@pytest.fixture(scope="module")
def world():
    return cases.World()


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("input_name,entry", cases.cells())
def test_matrix(world, input_name, entry, mode):
    result = cases.run_cell(world, input_name, entry, mode, bad=True)
    wrong = cases.check_cell(result, input_name, entry, rank=0, num_ranks=1,
                             bad_rank=0)
    assert not wrong, wrong


def test_matrix_covers_every_entry_point_and_input():
    got = cases.cells()
    assert {e for _, e in got} == set(cases.ENTRIES)
    assert {i for i, _ in got} == set(cases.INPUTS)
    assert len(got) > 150


def test_a_wrong_expectation_is_caught(world):
    """The checker itself can fail: a good lookup checked as an error and a
    wrong reference are both reported."""
    result = cases.run_cell(world, "ids_int8", "lookup_sparse", "eager",
                            bad=True)
    assert not cases.check_cell(result, "ids_int8", "lookup_sparse", 0, 1, 0)
    forged = dict(result, output=(np.asarray(result["output"]) + 1).tolist())
    assert cases.check_cell(forged, "ids_int8", "lookup_sparse", 0, 1, 0)
    assert cases.check_cell(result, "id_negative", "lookup_sparse", 0, 1, 0)


# -- fit: at least one case per kind of error ------------------------------


def _model(ids_shape=(2,), ids_dtype="int64", weighted=False,
           skip_nonfinite=False, name="emb"):
    ids = keras.Input(ids_shape, dtype=ids_dtype, name="ids")
    inputs = [ids]
    emb = sok.layers.DistributedEmbedding(cases.V, cases.D, name=name)
    if weighted:
        w = keras.Input(ids_shape, dtype="float32", name="w")
        inputs.append(w)
        x = emb(ids, w)
    else:
        x = emb(ids)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    opt = sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1),
                               skip_nonfinite=skip_nonfinite)
    model.compile(optimizer=opt, loss="mse")
    return model, emb, opt


def _fit(model, x, y):
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)


def _state(model):
    return [v.numpy().copy() for v in model.weights]


def _unchanged(model, state):
    return all(np.array_equal(a, b.numpy())
               for a, b in zip(state, model.weights))


Y = np.zeros((8, 1), np.float32)


def _good_ids(n=8):
    return np.array([[1, 2], [3, -1]] * (n // 2), np.int64)


@pytest.mark.parametrize("value", [40, -2, 2 ** 32 + 1])
def test_fit_bad_id_raises_and_changes_nothing(value):
    """A bad id in the second batch: the first batch trained, the second
    raised before any update (the table and the dense weights are as the
    first batch left them)."""
    model, emb, _ = _model()
    _fit(model, _good_ids(4), Y[:4])
    state = _state(model)
    x = _good_ids()
    x[5, 1] = value
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        _fit(model, x[4:], Y[4:])
    assert "emb" in str(e.value) and str(value) in str(e.value)
    assert _unchanged(model, state)
    _fit(model, _good_ids(4), Y[:4])  # still trains
    assert not _unchanged(model, state)


def test_fit_bad_id_in_one_of_two_added_tables_changes_nothing():
    """Two tables whose results are added (a wide model): a bad id in the
    second stops the step before any update, also of the first table,
    whose gradient does not depend on the failing lookup, and of the
    step counter; then both train."""
    ids = keras.Input((2,), dtype="int64")
    wide = sok.layers.LocalizedEmbedding(cases.V, 1, name="wide")
    deep = sok.layers.DistributedEmbedding(cases.V, 1, name="deep")
    model = keras.Model(ids, keras.layers.Add()([wide(ids), deep(ids + 1)]))
    opt = sok.OptimizerWrapper(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    _fit(model, _good_ids(4), Y[:4] + 1)
    state, steps = _state(model), int(opt.iterations)
    x = _good_ids()
    x[5, 1] = cases.V - 1  # valid for "wide", out of range for "deep"
    with pytest.raises(tf.errors.InvalidArgumentError, match="deep"):
        _fit(model, x[4:], Y[4:] + 1)
    assert _unchanged(model, state) and int(opt.iterations) == steps
    _fit(model, _good_ids(4), Y[:4] + 1)
    assert not _unchanged(model, state)


def test_fit_int32_ids_near_the_limit():
    model, _, _ = _model(ids_dtype="int32")
    state = _state(model)
    x = _good_ids().astype(np.int32)
    x[0, 0] = 2 ** 31 - 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="2147483647"):
        _fit(model, x, Y)
    assert _unchanged(model, state)


def _sequential(first):
    keras.utils.set_random_seed(3)
    return keras.Sequential(first + [
        sok.layers.DistributedEmbedding(cases.V, cases.D, name="emb"),
        keras.layers.Dense(1)])


def test_a_sequential_with_no_input_trains_as_with_int_ids():
    """Keras makes such a model's input float32 (as `keras.Input` without
    `dtype`): the layers take float32 ids as `keras.layers.Embedding` does,
    where the table's rows (at most 2**24) are all exact in float32."""
    rng = np.random.default_rng(0)
    x = rng.integers(-1, cases.V, size=(16, 2))
    y = rng.normal(size=(16, 1)).astype(np.float32)
    weights = []
    for first in ([], [keras.Input((2,), dtype="int64")]):
        model = _sequential(first)
        model.compile(optimizer=sok.OptimizerWrapper(
            keras.optimizers.Adagrad(0.1)), loss="mse")
        model.fit(x, y, batch_size=4, verbose=0, shuffle=False)
        weights.append([w.numpy() for w in model.weights])
    assert model.inputs[0].dtype == "int64"
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value,shown", [(16.7, "16.7"), (-0.5, "-0.5"),
                                         (np.nan, "nan"), (np.inf, "inf"),
                                         (1e30, "1e+30")])
def test_fit_float_id_that_is_no_integer_raises_and_changes_nothing(
        value, shown):
    """Float ids are taken where they are whole numbers (Keras makes
    inputs float32), but one that is not is refused naming the layer and
    the value (Keras' Embedding truncates it: 16.7 was row 16, -0.5 row 0,
    silently), before any update."""
    model, emb, _ = _model(ids_dtype="float32")
    x = _good_ids().astype(np.float32)
    _fit(model, x[:4], Y[:4])
    state = _state(model)
    x[5, 1] = value
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        _fit(model, x[4:], Y[4:])
    # (A graph's Assert escapes the quotes around the name.)
    assert "emb" in str(e.value) and f"float id {shown} " in str(e.value)
    assert _unchanged(model, state)
    _fit(model, x[:4], Y[:4])  # still trains
    assert not _unchanged(model, state)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("in_function", [False, True])
def test_empty_float_ids_look_up_nothing(dtype, in_function):
    """The float-id check on a batch with no ids (review: its message's
    argmax failed on the empty batch, eagerly and traced)."""
    pooled = sok.layers.DistributedEmbedding(cases.V, cases.D, name="emb")
    rows = sok.layers.DistributedEmbedding(cases.V, cases.D, combiner=None,
                                           name="rows")
    ragged = tf.RaggedTensor.from_row_lengths(tf.zeros([0], dtype), [0, 0])
    dense = tf.zeros([0, 3], dtype)

    def run(layer, ids):
        return (tf.function(layer) if in_function else layer)(ids).numpy()

    np.testing.assert_array_equal(run(pooled, ragged),
                                  np.zeros((2, cases.D), np.float32))
    assert run(pooled, dense).shape == (0, cases.D)
    assert run(rows, dense).shape == (0, 3, cases.D)


@pytest.mark.parametrize("rows,dtype", [(cases.V, "float16"),
                                        (2 ** 24 + 1, "float32")])
def test_float_ids_that_may_not_be_exact_raise_a_type_error(rows, dtype):
    """float16 ids (exact up to 2048), or float32 ids of a table of more
    than 2**24 rows: refused, naming the layer, before any lookup."""
    emb = sok.layers.DistributedEmbedding(rows, 1, name="emb")
    with pytest.raises(TypeError, match=rf"(?s)emb.*{dtype}.*2\*\*24"):
        emb(tf.constant([[1, 2]], dtype))


def test_fit_3d_ids_raise_a_value_error():
    # A model built on 3-D ids is refused when it is built, naming the
    # layer; ids of 3 dimensions fed to a 2-D model fail at the first
    # step, nothing changed.
    with pytest.raises(ValueError, match=r"(?s)'emb': a pooled lookup.*"
                       r"shape \(None, 2, 2\)"):
        _model(ids_shape=(2, 2))
    model, _, _ = _model(ids_shape=(2,))
    state = _state(model)
    with pytest.raises(ValueError, match=r"(?s)shape"):
        _fit(model, np.ones((8, 2, 2), np.int64), Y)
    assert _unchanged(model, state)


def test_fit_weights_of_another_shape():
    """Weights [batch, 3] for ids [batch, 2]: refused at the first step."""
    ids = keras.Input((2,), dtype="int64")
    w = keras.Input((3,), dtype="float32")
    emb = sok.layers.DistributedEmbedding(cases.V, cases.D, name="emb")
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match=r"(?s)emb.*weights"):
        out = emb(ids, w)
        model = keras.Model([ids, w], keras.layers.Dense(1)(out))
        model.compile(optimizer=sok.OptimizerWrapper(
            keras.optimizers.SGD(0.1)), loss="mse")
        _fit(model, [_good_ids(), np.ones((8, 3), np.float32)], Y)


def test_eager_weights_of_another_shape_name_both_shapes():
    """Before: the op's "one entry per id (6), got shape [8]"."""
    emb = sok.layers.DistributedEmbedding(cases.V, cases.D, name="emb")
    with pytest.raises(ValueError, match=r"'emb'.*weights shape=\(2, 4\), "
                       r"ids shape=\(2, 3\)"):
        emb(np.zeros((2, 3), np.int64), weights=np.ones((2, 4), np.float32))


def test_fit_padding_only_and_empty_batches_work():
    model, emb, _ = _model()
    before = emb.embeddings.numpy().copy()
    _fit(model, np.full((8, 2), -1, np.int64), Y)  # only padding
    # No id was looked up: the table has no gradient and stays.
    np.testing.assert_array_equal(emb.embeddings.numpy(), before)
    # (model.predict of 0 samples fails inside Keras: no batch to run.)
    out = model.predict_on_batch(np.zeros((0, 2), np.int64))
    assert out.shape == (0, 1)


@pytest.mark.parametrize("what", ["weights", "labels"])
def test_fit_nan_skips_the_step_with_skip_nonfinite(what):
    """NaN weights (or a NaN label, hence NaN gradients) with
    skip_nonfinite=True: the step is skipped, counted, nothing changes."""
    model, emb, opt = _model(weighted=True, skip_nonfinite=True)
    w = np.ones((8, 2), np.float32)
    _fit(model, [_good_ids(), w], Y)
    state = _state(model)
    y = Y.copy()
    if what == "weights":
        w[1, 0] = np.nan
    else:
        y[0, 0] = np.inf
    _fit(model, [_good_ids()[:4], w[:4]], y[:4])
    assert _unchanged(model, state)
    assert int(opt.skipped_steps.numpy()) == 1
    _fit(model, [_good_ids()[:4], np.ones((4, 2), np.float32)], Y[:4])
    assert not _unchanged(model, state)


def test_fit_nan_weights_without_the_option_reach_the_table():
    """Without skip_nonfinite the NaN reaches the rows it touches (what
    docs/failures.md says), and only those."""
    model, emb, opt = _model(weighted=True)
    w = np.ones((4, 2), np.float32)
    w[0, 1] = np.nan  # sample 0: ids 1 and 2
    _fit(model, [_good_ids(4), w], Y[:4])
    table = emb.embeddings.numpy()
    assert np.isnan(table[[1, 2]]).all()
    assert np.isfinite(np.delete(table, [1, 2], axis=0)).all()


# -- sok.Variable and OptimizerWrapper arguments ----------------------------


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(initial_value=np.zeros((2, 2, 2))), ValueError, ["'t'", "2-D"]),
    (dict(initial_value=np.zeros(3)), ValueError, ["'t'", "2-D"]),
    (dict(initial_value="uniform"), ValueError, ["'t'", "shape"]),
    (dict(initial_value="uniform", shape=(4,)), ValueError, ["'t'", "shape"]),
    (dict(initial_value=np.zeros((4, 2)), shape=(5, 2)), ValueError,
     ["'t'", "(5, 2)"]),
    (dict(initial_value=np.zeros((4, 2)), mode="localized:3"), ValueError,
     ["'t'", "rank 3"]),
    (dict(initial_value=np.zeros((4, 2)), mode="rows"), ValueError,
     ["'t'", "'rows'"]),
    (dict(initial_value=np.zeros((4, 2)), nonsense=1), TypeError,
     ["nonsense"]),
    (dict(initial_value=np.zeros((4, 2)), dtype="int32"), ValueError,
     ["'t'", "'int32'", "float32"]),
    (dict(initial_value="uniform", shape=(4, 2), dtype="string"),
     ValueError, ["'t'", "'string'"]),
    # Before: numpy's errors with no table name, or silent casts (the
    # imaginary part dropped, None made nan, "no" taken as True).
    (dict(initial_value=np.array([["a", "b"]])), TypeError,
     ["'t'", "real numbers", "<U1"]),
    (dict(initial_value=[[1.0, 2.0], [3.0]]), ValueError,
     ["'t'", "no array of numbers"]),
    (dict(initial_value=np.array([[1 + 2j, 3 + 4j]])), TypeError,
     ["'t'", "complex128"]),
    (dict(initial_value=np.array([[None, 1]], dtype=object)), TypeError,
     ["'t'", "object"]),
    (dict(initial_value=np.zeros((4, 2)), trainable="no"), TypeError,
     ["'t'", "trainable='no'"]),
])
def test_variable_arguments(kwargs, error, words):
    with pytest.raises(error) as e:
        sok.Variable(name="t", **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_variable_assign_global_of_another_shape_changes_nothing():
    v = sok.Variable(cases.TABLE, name="t")
    with pytest.raises(ValueError, match=r"'t'.*\(16, 3\)"):
        v.assign_global(np.zeros((16, 3), np.float32))
    np.testing.assert_array_equal(v.numpy(), cases.TABLE)


def test_variable_with_nan_rows_looks_them_up_as_nan():
    """A table is data: NaN rows are kept (no silent clamp) and looked up."""
    table = cases.TABLE.copy()
    table[2] = np.nan
    v = sok.Variable(table, name="t")
    out = sok.lookup_sparse(v, tf.constant([[1, 2], [3, -1]])).numpy()
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


def _slices(values, indices, rows=cases.V):
    values = tf.constant(values, tf.float32)
    return tf.IndexedSlices(values, tf.constant(indices, tf.int64),
                            tf.constant([rows, values.shape[1]], tf.int64))


@pytest.mark.parametrize("grad,error,words", [
    (lambda: _slices(np.ones((2, 3)), [1, 40]), tf.errors.InvalidArgumentError,
     ["40", "17"]),
    (lambda: _slices(np.ones((2, 3)), [1, -1]), tf.errors.InvalidArgumentError,
     ["-1", "17"]),
    (lambda: _slices(np.ones((2, 4)), [1, 2]), ValueError,
     ["'t'", "(2, 4)", "(3,)"]),
    (lambda: _slices(np.ones((3, 3)), [1, 2]), ValueError,
     ["'t'", "(3, 3)", "indices shape=(2,)"]),
    (lambda: tf.ones((16, 3)), ValueError, ["'t'", "(17, 3)", "(16, 3)"]),
])
@pytest.mark.parametrize("in_function", [False, True])
def test_optimizer_wrapper_bad_gradients_change_nothing(grad, error, words,
                                                        in_function):
    v = sok.Variable(cases.TABLE, name="t")
    opt = sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1))

    def step():
        opt.apply_gradients([(grad(), v)])

    with pytest.raises(error) as e:
        tf.function(step)() if in_function else step()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    np.testing.assert_array_equal(v.numpy(), cases.TABLE)


@pytest.mark.parametrize("skip", [False, True])
def test_optimizer_wrapper_nan_gradient(skip):
    """A NaN in a table's gradient: skipped and counted with
    skip_nonfinite (nothing changes), else applied to its row only."""
    v = sok.Variable(cases.TABLE, name="t")
    opt = sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1),
                               skip_nonfinite=skip)
    opt.apply_gradients([(_slices([[np.nan] * 3, [1.0] * 3], [1, 2]), v)])
    table = v.numpy()
    if skip:
        np.testing.assert_array_equal(table, cases.TABLE)
        assert int(opt.skipped_steps.numpy()) == 1
    else:
        assert np.isnan(table[1]).all() and not np.isnan(table[2]).any()
        np.testing.assert_array_equal(np.delete(table, [1, 2], 0),
                                      np.delete(cases.TABLE, [1, 2], 0))


def test_optimizer_wrapper_arguments():
    with pytest.raises(TypeError, match="skip_nonfinite"):
        sok.OptimizerWrapper(keras.optimizers.SGD(), skip_nonfinite="yes")
    with pytest.raises((TypeError, ValueError)):
        sok.OptimizerWrapper("not an optimizer")
