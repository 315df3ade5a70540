"""`OptimizerWrapper` (`sok_keras/optimizers/wrapper.py`): hyperparameters
and learning-rate schedules of the inner optimizer, delegation of dense
weights, clipping, errors, serialization and `model.save`."""

import io
import os
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.optimizers.test_sparse_kernels import RULES
from tests.optimizers.test_sparse_rules import initial_values
from tests.optimizers.test_sparse_rules import keras_dense
from tests.optimizers.test_sparse_rules import lazy_reference
from tests.optimizers.test_sparse_rules import make_steps
from tests.optimizers.test_sparse_rules import run_sok
from tests.optimizers.test_sparse_rules import slices
from tests.testing import assert_model_saving

Wrapper = sok.OptimizerWrapper


def _np(v):
    return keras.ops.convert_to_numpy(v)


# ---------------------------------------------------------------------------
# Dense weights: exactly the inner optimizer's update.


def _dense_fit(make_opt, wrap, x, y):
    # On the CPU, where two runs of one Keras model are bitwise equal (on a
    # GPU, cuBLAS may round two runs of the same model apart in the last
    # bit, so "exactly Keras' update" can only be checked here).
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    with tf.device("/CPU:0"):
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1)])
        inner = make_opt()
        model.compile(optimizer=Wrapper(inner) if wrap else inner,
                      loss="mse", run_eagerly=True)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return [_np(w) for w in model.weights], int(model.optimizer.iterations)


@pytest.mark.parametrize("clip", [{}, {"clipnorm": 0.5},
                                  {"global_clipnorm": 0.1},
                                  {"clipvalue": 0.05}],
                         ids=["none", "clipnorm", "global_clipnorm",
                              "clipvalue"])
@pytest.mark.parametrize("opt", ["sgd", "adam", "rmsprop"])
def test_dense_model_trains_exactly_like_keras(opt, clip):
    make = {
        "sgd": lambda: keras.optimizers.SGD(0.01, **clip),
        "adam": lambda: keras.optimizers.Adam(0.05, **clip),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.05, centered=True,
                                                    **clip),
    }[opt]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 5)) * 10).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    ours, it = _dense_fit(make, True, x, y)
    ref, ref_it = _dense_fit(make, False, x, y)
    assert it == ref_it == 4
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_dense_layer_beside_a_table_gets_exactly_keras_update():
    """A Dense layer's kernel and bias, trained in the same step as a table,
    get the inner optimizer's own update, bit for bit."""
    w0, _ = initial_values(0)
    rng = np.random.default_rng(1)
    layers = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        layer = keras.layers.Dense(3)
        layer.build((None, 4))
        layers.append(layer)
    table = sok.Variable(w0, name="table")
    opt = Wrapper(keras.optimizers.RMSprop(0.01, momentum=0.5))
    ref = keras.optimizers.RMSprop(0.01, momentum=0.5)
    for _ in range(5):
        gk = tf.constant(rng.standard_normal((4, 3)).astype(np.float32))
        gb = tf.constant(rng.standard_normal((3,)).astype(np.float32))
        idx = rng.permutation(10)[:4].astype(np.int64)
        gt = slices(idx, rng.standard_normal((4, 4)).astype(np.float32))
        opt.apply_gradients([(gt, table), (gk, layers[0].kernel),
                             (gb, layers[0].bias)])
        ref.apply_gradients([(gk, layers[1].kernel), (gb, layers[1].bias)])
    np.testing.assert_array_equal(_np(layers[0].kernel),
                                  _np(layers[1].kernel))
    np.testing.assert_array_equal(_np(layers[0].bias), _np(layers[1].bias))
    assert np.abs(_np(layers[0].kernel) - _np(layers[1].kernel)).max() == 0
    assert not np.array_equal(_np(table), w0)


# ---------------------------------------------------------------------------
# Compiling again: a new optimizer starts afresh, the same one goes on.

_V, _NID, _B = 48, 3, 16  # each batch looks every row up once


def _twin(kind):
    """A table (sok or Keras), Flatten, Dense(1): the same initial values."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(0, 0.5, size=(_V, 4)).astype(np.float32)
    ids = keras.Input(shape=(_NID,), dtype="int64")
    emb = (sok.layers.DistributedEmbedding(_V, 4, combiner=None, name="emb")
           if kind == "sok" else keras.layers.Embedding(_V, 4, name="emb"))
    x = keras.layers.Flatten()(emb(ids))
    dense = keras.layers.Dense(1, name="dense")
    model = keras.Model(ids, dense(x))
    emb.embeddings.assign(w0)
    dense.set_weights([rng.normal(0, 0.3, size=(_NID * 4, 1)).astype(
        np.float32), np.full([1], 0.1, np.float32)])
    return model


def _two_phases(kind, first, second, same_object):
    """Fits 2 steps with `first()`, compiles again (with the same optimizer
    object or with `second()`), fits 2 more: the table and dense weights."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.permutation(_V).reshape(_B, _NID)
                        for _ in range(4)]).astype(np.int64)
    y = rng.normal(size=(4 * _B, 1)).astype(np.float32)
    model = _twin(kind)
    opt = first()
    wrap = Wrapper if kind == "sok" else (lambda o: o)
    model.compile(optimizer=wrap(opt), loss="mse")
    model.fit(x[:2 * _B], y[:2 * _B], batch_size=_B, shuffle=False,
              verbose=0)
    model.compile(optimizer=wrap(opt if same_object else second()),
                  loss="mse")
    model.fit(x[2 * _B:], y[2 * _B:], batch_size=_B, shuffle=False,
              verbose=0)
    return [_np(w) for w in model.weights]


@pytest.mark.parametrize("first,second", [
    ("adam", "adam"), ("adagrad", "adagrad"), ("adagrad", "ftrl"),
    ("momentum", "rmsprop"), ("momentum", "lion"), ("adamax", "adadelta"),
    ("nadam", "nadam"), ("adam", "nadam"), ("muon", "muon"),
    ("adam", "muon")])
def test_compiling_again_with_a_new_optimizer_starts_it_afresh(first,
                                                               second):
    """As a new Keras optimizer does: its slots start at their initial
    values (before: the table kept the old optimizer's moments, and a new
    Ftrl took over Adagrad's accumulator of the same name)."""
    make = {
        "adam": lambda: keras.optimizers.Adam(0.05),
        "adagrad": lambda: keras.optimizers.Adagrad(
            0.3, initial_accumulator_value=0.1),
        "ftrl": lambda: keras.optimizers.Ftrl(0.2),
        "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.05, momentum=0.5),
        "lion": lambda: keras.optimizers.Lion(0.01),
        "adamax": lambda: keras.optimizers.Adamax(0.05),
        "adadelta": lambda: keras.optimizers.Adadelta(1.0),
        "nadam": lambda: keras.optimizers.Nadam(0.05),
        "muon": lambda: keras.optimizers.Muon(0.05, adam_lr_ratio=0.5),
    }
    ours = _two_phases("sok", make[first], make[second], False)
    ref = _two_phases("keras", make[first], make[second], False)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_recipe():
    """docs/recipes.md: two micro-batches' gradients, the tables'
    IndexedSlices concatenated, applied once, equal one step on the whole
    batch (ids repeat across the micro-batches)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 10, size=(8, _NID)).astype(np.int64)
    y = rng.normal(size=(8, 1)).astype(np.float32)

    def add(total, g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.concat([total.values, g.values], 0),
                                    tf.concat([total.indices, g.indices], 0),
                                    g.dense_shape)
        return total + g

    weights = []
    for k in (1, 2):
        model = _twin("sok")
        opt = Wrapper(keras.optimizers.Adam(0.05))
        total = None
        for part in np.split(np.arange(8), k):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    (model(x[part]) - y[part]) ** 2) / k
            grads = tape.gradient(loss, model.trainable_variables)
            total = grads if total is None else [
                add(t, g) for t, g in zip(total, grads)]
        opt.apply_gradients(zip(total, model.trainable_variables))
        weights.append([_np(w) for w in model.weights])
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # (Keras' own `gradient_accumulation_steps` works, but not with
    # clipping, which the recipe can do.)
    with pytest.raises(ValueError, match="Gradient accumulation"):
        Wrapper(keras.optimizers.Adam(gradient_accumulation_steps=2,
                                      clipnorm=1.0))


def test_compiling_a_b_then_a_again_resumes_a():
    """As Keras: each optimizer keeps its own slots of a table, so the
    first one, compiled again, goes on from its own momentum."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.permutation(_V).reshape(_B, _NID)
                        for _ in range(3)]).astype(np.int64)
    y = rng.normal(size=(3 * _B, 1)).astype(np.float32)
    weights = []
    for kind in ("sok", "keras"):
        model = _twin(kind)
        a, b = (keras.optimizers.SGD(0.1, momentum=0.9) for _ in range(2))
        for i, opt in enumerate((a, b, a)):
            model.compile(optimizer=opt, loss="mse")
            model.fit(x[i * _B:(i + 1) * _B], y[i * _B:(i + 1) * _B],
                      batch_size=_B, shuffle=False, verbose=0)
        weights.append([_np(w) for w in model.weights])
    for ours, ref in zip(*weights):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_opt", [
    lambda: keras.optimizers.Adagrad(0.1),
    lambda: sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1)),
    lambda: keras.optimizers.LossScaleOptimizer(
        sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1)))],
    ids=["compile_wraps", "wrapper", "loss_scale"])
def test_slots_of_the_model_optimizer_are_the_wrapped_optimizers(make_opt):
    """`table.slots_of(model.optimizer)` names the slots of the optimizer
    a wrapper holds (before: `{}` for a wrapper, while `table.slots` and
    `model.optimizer.get_slot` found them)."""
    model = _twin("sok")
    model.compile(optimizer=make_opt(), loss="mse")
    x = np.arange(_B * _NID, dtype=np.int64).reshape(_B, _NID) % _V
    model.fit(x, np.zeros((_B, 1), np.float32), batch_size=_B, verbose=0)
    table = model.get_layer("emb").embeddings
    slots = table.slots_of(model.optimizer)
    assert list(slots) == ["accumulator"]
    assert slots["accumulator"] is table.slots["accumulator"]
    assert table.slots_of(keras.optimizers.Adagrad(0.1)) == {}


def _towers(kind):
    """Two models sharing one table and one Dense: `two` looks up two ids,
    `one` the first of them."""
    keras.utils.set_random_seed(1)
    a = keras.Input((1,), dtype="int64")
    b = keras.Input((1,), dtype="int64")
    if kind == "sok":
        emb = sok.layers.DistributedEmbedding(8, 4, combiner="sum",
                                              name="emb")
        ea, eb = emb(a), emb(b)
    else:
        emb, flat = keras.layers.Embedding(8, 4, name="emb"), (
            keras.layers.Flatten())
        ea, eb = flat(emb(a)), flat(emb(b))
    head = keras.layers.Dense(1, name="dense")
    two = keras.Model([a, b], keras.layers.Add()([head(ea), head(eb)]))
    return two, keras.Model(a, head(ea))


@pytest.mark.parametrize("run_eagerly", [True, False])
def test_two_models_sharing_a_table_keep_their_optimizers(run_eagerly,
                                                          tmp_path):
    """Fits alternating between the two models (each its own momentum
    SGD), then saves and loads `two`: its file holds its optimizer's slots
    (before: each switch reset the momentum eagerly, and the file held
    whichever optimizer had trained the table last)."""
    rng = np.random.default_rng(0)
    xa, xb = (np.concatenate([rng.permutation(8) for _ in range(4)])[
        :, None] for _ in range(2))
    y = rng.normal(size=(32, 1)).astype(np.float32)
    state = {}
    for kind in ("sok", "keras"):
        two, one = _towers(kind)
        if kind == "keras":
            two.set_weights(state["sok_initial"])
        else:
            state["sok_initial"] = two.get_weights()
        for m in (two, one):
            m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="mse", run_eagerly=run_eagerly)
        for _ in range(2):
            two.fit([xa, xb], y, batch_size=8, shuffle=False, verbose=0)
            one.fit(xa, y, batch_size=8, shuffle=False, verbose=0)
        path = str(tmp_path / f"{kind}.keras")
        two.save(path)
        loaded = keras.models.load_model(path)
        for m in (two, loaded):
            m.fit([xa, xb], y, batch_size=8, shuffle=False, verbose=0)
        state[kind] = [_np(w) for w in two.weights]
        state[f"{kind}_loaded"] = [_np(w) for w in loaded.weights]
    for key in ("sok", "sok_loaded", "keras_loaded"):
        for ours, ref in zip(state[key], state["keras"]):
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6,
                                       err_msg=key)


def test_two_models_sharing_a_table_restore_their_own_checkpoints(
        tmp_path):
    """Each model's `tf.train.Checkpoint` (model and optimizer), restored
    into new models before their first step: each optimizer gets its own
    slots back (before: the restored slots waited on the table by name,
    and the first optimizer to make them took them)."""
    rng = np.random.default_rng(1)
    xa, xb = (np.concatenate([rng.permutation(8) for _ in range(2)])[
        :, None] for _ in range(2))
    y = rng.normal(size=(16, 1)).astype(np.float32)
    result = []
    for restored in (False, True):
        keras.utils.clear_session()
        two, one = _towers("sok")
        for m in (two, one):
            m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss="mse")
        if restored:
            for m, name in ((two, "two"), (one, "one")):
                tf.train.Checkpoint(model=m, optimizer=m.optimizer).restore(
                    str(tmp_path / f"{name}-1")).expect_partial()
        else:
            two.fit([xa, xb], y, batch_size=8, shuffle=False, verbose=0)
            one.fit(xb, y, batch_size=8, shuffle=False, verbose=0)
            for m, name in ((two, "two"), (one, "one")):
                tf.train.Checkpoint(model=m, optimizer=m.optimizer).save(
                    str(tmp_path / name))
        two.fit([xa, xb], y, batch_size=8, shuffle=False, verbose=0)
        result.append([_np(w) for w in two.weights])
    for a, b in zip(*result):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_frozen_table_saves_no_stale_slots(tmp_path):
    """Trained with Adam, frozen, compiled with a new Adam (built for the
    dense weights only): the file holds no table slots, as Keras' holds
    none for a frozen Embedding, so a loaded model unfrozen with another
    new Adam trains as the in-memory one (before: it took the first
    Adam's moments from the file)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.permutation(_V).reshape(_B, _NID)
                        for _ in range(2)]).astype(np.int64)
    y = rng.normal(size=(2 * _B, 1)).astype(np.float32)
    model = _twin("sok")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=_B, verbose=0)
    model.get_layer("emb").trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=_B, verbose=0)
    path = str(tmp_path / "frozen.keras")
    model.save(path)
    assert sorted(saved_table_entries(path)) == ["embeddings"]
    loaded = keras.models.load_model(path)
    for m in (model, loaded):
        m.get_layer("emb").trainable = True
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(x, y, batch_size=_B, shuffle=False, verbose=0)
    for ours, ref in zip(loaded.weights, model.weights):
        np.testing.assert_allclose(_np(ours), _np(ref), rtol=1e-6,
                                   atol=1e-7)


def test_compiling_again_with_the_same_optimizer_keeps_its_state():
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    ours = _two_phases("sok", make, None, True)
    ref = _two_phases("keras", make, None, True)
    fresh = _two_phases("keras", make, make, False)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert np.abs(ours[0] - fresh[0]).max() > 1e-3  # the two cases differ


# ---------------------------------------------------------------------------
# Hyperparameters, learning rate schedule, iterations.


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_learning_rate_schedule(name):
    rule = RULES[name]
    schedule = keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=2, decay_rate=0.5)

    def make():
        opt = rule.keras_opt()
        cfg = opt.get_config()
        cfg["learning_rate"] = schedule
        return type(opt).from_config(cfg)

    steps = make_steps(seed=21)
    w0, d0 = initial_values(5)
    opt = Wrapper(make())
    assert isinstance(opt.inner_optimizer._learning_rate,
                      keras.optimizers.schedules.ExponentialDecay)
    table, dense = run_sok(opt, steps, w0, d0)
    lrs = [np.float32(0.1 * 0.5 ** ((t - 1) / 2))
           for t in range(1, len(steps) + 1)]
    w_ref, _ = lazy_reference(rule, steps, w0, lrs=lrs)
    np.testing.assert_allclose(_np(table), w_ref, rtol=1e-5, atol=1e-6)
    # With the constant HP learning rate the table would be elsewhere.
    w_const, _ = lazy_reference(rule, steps, w0)
    assert np.abs(w_const - w_ref).max() > 1e-3
    _, kdense, kopt = keras_dense(make(), steps, w0, d0)
    np.testing.assert_array_equal(_np(dense), _np(kdense))
    np.testing.assert_allclose(float(opt.learning_rate),
                               float(kopt.learning_rate), rtol=1e-7)
    np.testing.assert_allclose(float(opt.learning_rate),
                               0.1 * 0.5 ** (len(steps) / 2), rtol=1e-6)


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.25)
    opt = Wrapper(inner)
    table = sok.Variable(np.zeros((6, 2), np.float32), name="table")
    g = np.array([[1.0, 2.0]], np.float32)
    opt.apply_gradients([(slices(np.array([3]), g, rows=6), table)])
    np.testing.assert_array_equal(_np(table)[3], -0.25 * g[0])
    # Table-only steps count as steps.
    assert int(opt.iterations) == int(inner.iterations) == 1
    opt.learning_rate = 0.5  # e.g. a LearningRateScheduler callback
    assert float(inner.learning_rate) == 0.5
    opt.apply_gradients([(slices(np.array([3]), g, rows=6), table)])
    np.testing.assert_array_equal(_np(table)[3], -0.75 * g[0])
    inner.learning_rate = 0.1
    assert float(opt.learning_rate) == pytest.approx(0.1)
    assert int(opt.iterations) == 2
    # Hyperparameters are read from the inner optimizer when applied.
    mom_inner = keras.optimizers.SGD(1.0, momentum=0.5)
    mom = Wrapper(mom_inner)
    t2 = sok.Variable(np.zeros((6, 2), np.float32), name="t2")
    mom.apply_gradients([(slices(np.array([0]), g, rows=6), t2)])
    mom_inner.momentum = 0.25
    mom.apply_gradients([(slices(np.array([0]), g, rows=6), t2)])
    # m1 = -g, m2 = 0.25 * m1 - g; w = m1 + m2
    np.testing.assert_allclose(_np(t2)[0], -g[0] + (-0.25 * g[0] - g[0]))


def test_the_optimizer_variables_are_keras_own(tmp_path):
    """`model.optimizer.variables` (and so `model.summary()`'s optimizer
    params) are the inner optimizer's, as with the plain optimizer
    (before: two more, the wrapper's own never-used step count and a
    learning rate of 0.0); files and dumps of the earlier layout load."""
    def model_with(optimizer, sok_table):
        ids = keras.Input(shape=(2,), dtype="int64")
        emb = (sok.layers.DistributedEmbedding(16, 4, combiner=None)
               if sok_table else keras.layers.Embedding(16, 4))
        out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))
        model = keras.Model(ids, out)
        model.compile(optimizer=optimizer, loss="mse")
        x = np.arange(16, dtype=np.int64).reshape(8, 2)
        model.fit(x, np.ones((8, 1), np.float32), epochs=2, verbose=0)
        return model

    plain = model_with(keras.optimizers.Adam(0.01), False)
    model = model_with(Wrapper(keras.optimizers.Adam(0.01)), True)
    wrapper = model.optimizer
    def optimizer_params(m):
        lines = []
        m.summary(print_fn=lambda line, **_: lines.append(line))
        return [ln.strip() for ln in "\n".join(lines).splitlines()
                if "Optimizer params" in ln]

    assert optimizer_params(model) == optimizer_params(plain)
    assert optimizer_params(plain) != []
    # The dense weights' slots (the table's are the table's slots).
    assert len(wrapper.variables) == len(plain.optimizer.variables) - 2
    assert [v.path.rsplit("/", 1)[-1] for v in wrapper.variables[:2]] == [
        "iteration", "learning_rate"]
    assert float(wrapper.variables[1].numpy()) == pytest.approx(0.01)
    # A `.keras` / `.weights.h5` of the earlier layout: the wrapper's own
    # step count and learning rate first.
    values = [np.array(v.numpy()) for v in wrapper.variables]
    old = {str(i): a for i, a in enumerate(
        [np.array(0, np.int64), np.array(0.0, np.float32)] + values)}
    for v in wrapper.variables:
        v.assign(tf.zeros_like(v))
    wrapper.load_own_variables(old)
    for v, a in zip(wrapper.variables, values):
        np.testing.assert_array_equal(v.numpy(), a)
    # Two more entries than the wrapper has, of other shapes: another
    # optimizer's file, skipped with Keras' warning (QA: read shifted).
    other = {str(i): a for i, a in enumerate(
        [np.array(3, np.int64), np.array(0.5, np.float32)]
        + [np.ones((5, 2), np.float32)] * len(values))}
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        wrapper.load_own_variables(other)
    for v, a in zip(wrapper.variables, values):
        np.testing.assert_array_equal(v.numpy(), a)
    # A sok.dump of the earlier layout.
    from sok_keras import checkpoint

    saved = [{"name": "optimizer_wrapper/iteration"},
             {"name": "optimizer_wrapper/learning_rate"},
             {"name": "adam/iteration"}, {"name": "adam/learning_rate"}]
    assert checkpoint._without_wrapper_own(wrapper, saved) == saved[2:]
    assert checkpoint._without_wrapper_own(wrapper, saved[2:]) == saved[2:]
    assert checkpoint._without_wrapper_own(
        plain.optimizer, saved) == saved


# ---------------------------------------------------------------------------
# Clipping, against a hand computation.


def _clip_case(clip, lr=1.0):
    """Two tables (one with a duplicate id) and a dense weight, one SGD
    step; returns (table_1, table_2, dense) deltas and the gradients."""
    g1 = np.array([[3.0, 0.0], [0.0, 4.0], [1.0, -2.0]], np.float32)
    i1 = np.array([1, 4, 1], np.int64)  # row 1 twice: [4, -2]
    g2 = np.array([[0.1, 0.2]], np.float32)
    i2 = np.array([2], np.int64)
    gd = np.array([[6.0, 8.0]], np.float32)
    t1 = sok.Variable(np.zeros((6, 2), np.float32), name="t1")
    t2 = sok.Variable(np.zeros((6, 2), np.float32), name="t2")
    d = keras.Variable(np.zeros((1, 2), np.float32), name="d")
    opt = Wrapper(keras.optimizers.SGD(lr, **clip))
    opt.apply_gradients([(slices(i1, g1, rows=6), t1),
                         (slices(i2, g2, rows=6), t2), (tf.constant(gd), d)])
    # Per-row gradients.
    r1 = np.zeros((6, 2), np.float32)
    np.add.at(r1, i1, g1)
    r2 = np.zeros((6, 2), np.float32)
    np.add.at(r2, i2, g2)
    return (-_np(t1), -_np(t2), -_np(d)), (r1, r2, gd)


def test_clipnorm_clips_each_table_by_its_norm():
    (u1, u2, ud), (r1, r2, gd) = _clip_case({"clipnorm": 1.0})
    n1 = np.sqrt((r1 ** 2).sum())
    assert n1 == 6.0  # of the per-row gradient; g1's entries: sqrt(30)
    np.testing.assert_allclose(u1, r1 / n1, rtol=1e-6)
    np.testing.assert_allclose(u2, r2, rtol=1e-6)  # norm < 1: unchanged
    np.testing.assert_allclose(ud, gd / 10.0, rtol=1e-6)


def test_global_clipnorm_uses_every_gradient():
    (u1, u2, ud), (r1, r2, gd) = _clip_case({"global_clipnorm": 2.0})
    norm = np.sqrt((r1 ** 2).sum() + (r2 ** 2).sum() + (gd ** 2).sum())
    for u, r in ((u1, r1), (u2, r2), (ud, gd)):
        np.testing.assert_allclose(u, r * 2.0 / norm, rtol=1e-6)


def test_clipvalue_clips_per_row_gradients_elementwise():
    (u1, u2, ud), (r1, r2, gd) = _clip_case({"clipvalue": 3.5})
    np.testing.assert_allclose(u1, np.clip(r1, -3.5, 3.5), rtol=1e-6)
    assert u1[1, 0] == pytest.approx(3.5)  # the summed duplicate, clipped
    np.testing.assert_allclose(u2, r2, rtol=1e-6)
    np.testing.assert_allclose(ud, [[3.5, 3.5]], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("clip", ["clipnorm", "global_clipnorm"])
def test_clipping_16_bit_tables_computes_in_float32(dtype, clip):
    """A 16-bit table's gradient norm, its duplicates' sums and the clipped
    values are computed in float32 and rounded once (before: squared and
    summed in the 16-bit dtype, so `global_clipnorm` scaled even a float32
    weight by a norm off by up to 0.4%)."""
    np_dt = tf.as_dtype(dtype).as_numpy_dtype
    rng = np.random.default_rng(3)
    rows = 400
    table = sok.Variable(np.zeros((rows, 4), np.float32), dtype=dtype,
                         name="t16")
    dense = keras.Variable(np.zeros((1, 4), np.float32), name="d32")
    idx = np.concatenate([np.arange(rows), np.arange(50)]).astype(np.int64)
    g = rng.normal(size=(len(idx), 4)).astype(np_dt)
    gd = rng.normal(size=(1, 4)).astype(np.float32)
    opt = Wrapper(keras.optimizers.SGD(1.0, **{clip: 1.0}))
    opt.apply_gradients([
        (tf.IndexedSlices(tf.constant(g), tf.constant(idx),
                          tf.constant([rows, 4], tf.int64)), table),
        (tf.constant(gd), dense)])
    # Reference: duplicates summed in float32 and rounded once, the norm
    # in float64.
    per_row = np.zeros((rows, 4), np.float32)
    np.add.at(per_row, idx, g.astype(np.float32))
    per_row = per_row.astype(np_dt).astype(np.float64)
    table_sq = (per_row ** 2).sum()
    if clip == "clipnorm":
        scale_t = 1.0 / max(np.sqrt(table_sq), 1.0)
        scale_d = 1.0 / max(np.linalg.norm(gd.astype(np.float64)), 1.0)
    else:
        norm = np.sqrt(table_sq + (gd.astype(np.float64) ** 2).sum())
        scale_t = scale_d = 1.0 / max(norm, 1.0)
    np.testing.assert_allclose(-_np(dense), gd * scale_d, rtol=2e-6)
    want = (per_row * scale_t).astype(np_dt).astype(np.float64)
    got = -np.asarray(table.read_global(), np.float64)
    # One rounding of the clipped gradient, one of the update.
    ulp = np.abs(np.spacing(want.astype(np_dt))).astype(np.float64)
    assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / ulp)


@pytest.mark.parametrize("clip", [{"clipnorm": 0.5}, {"global_clipnorm": 0.5},
                                  {"clipvalue": 0.2}])
def test_clipping_a_lone_table_equals_keras_sparse(clip):
    w0, _ = initial_values(6)
    rng = np.random.default_rng(7)
    table, kvar = sok.Variable(w0, name="t"), keras.Variable(w0)
    opt = Wrapper(keras.optimizers.Adagrad(0.1, **clip))
    ref = keras.optimizers.Adagrad(0.1, **clip)
    for _ in range(4):
        idx = rng.permutation(12)[:5].astype(np.int64)
        g = rng.standard_normal((5, 4)).astype(np.float32)
        opt.apply_gradients([(slices(idx, g), table)])
        ref.apply_gradients([(slices(idx, g), kvar)])
    np.testing.assert_allclose(_np(table), _np(kvar), rtol=1e-6)


# ---------------------------------------------------------------------------
# Through sok.lookup_sparse in a tf.function.


def test_lookup_sparse_training_loop_equals_keras_adagrad():
    rows, dim, batch = 30, 4, 8
    w0 = np.random.default_rng(8).standard_normal((rows, dim)).astype(
        np.float32)
    table, kvar = sok.Variable(w0, name="t"), keras.Variable(w0)
    opt = Wrapper(keras.optimizers.Adagrad(0.2))
    ref = keras.optimizers.Adagrad(0.2)
    target = tf.constant(np.random.default_rng(9).standard_normal(
        (batch, dim)).astype(np.float32))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse([table], [ids], combiners=["mean"])[0]
            loss = tf.reduce_sum(tf.square(out - target))
        grads = tape.gradient(loss, [table])
        opt.apply_gradients(zip(grads, [table]))
        with tf.GradientTape() as tape:
            out = tf.nn.embedding_lookup_sparse(kvar.value, ids, None,
                                                combiner="mean")
            loss = tf.reduce_sum(tf.square(out - target))
        (g,) = tape.gradient(loss, [kvar.value])
        # Keras squares each IndexedSlices entry: give it the row sums.
        ref.apply_gradients([(tf.convert_to_tensor(g), kvar)])

    rng = np.random.default_rng(10)
    for _ in range(10):
        ids = rng.integers(0, 20, size=(batch, 3)).astype(np.int64)
        sp = tf.sparse.from_dense(ids + 1)  # every entry kept
        step(sp.with_values(sp.values - 1))
    np.testing.assert_allclose(_np(table), _np(kvar), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_np(table.slots["accumulator"]),
                               _np(ref._accumulators[0]), rtol=1e-6)
    np.testing.assert_array_equal(_np(table)[20:], w0[20:])
    assert int(opt.iterations) == 10


# ---------------------------------------------------------------------------
# Errors.


def test_constructor_errors():
    with pytest.raises(TypeError, match="wraps a keras.optimizers.Optimizer"):
        Wrapper("adam")
    with pytest.raises(ValueError, match="cannot wrap another"):
        Wrapper(Wrapper(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match=(
            r"LossScaleOptimizer\(sok\.OptimizerWrapper\(.*"
            r"Received: LossScaleOptimizer\(SGD\)")):
        Wrapper(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="set `clipnorm` on the inner"):
        Wrapper(keras.optimizers.SGD(), clipnorm=1.0)
    with pytest.raises(ValueError, match="does not take arguments"):
        Wrapper(keras.optimizers.SGD(), foo=1)
    Wrapper(keras.optimizers.SGD(), clipnorm=None, use_ema=False)  # defaults
    for arg in ({"use_ema": True},
                {"gradient_accumulation_steps": 2, "clipvalue": 1.0},
                {"loss_scale_factor": 128.0}):
        with pytest.raises(ValueError, match=next(iter(arg))):
            Wrapper(keras.optimizers.Adam(**arg))


@pytest.mark.parametrize("inner", [keras.optimizers.Lamb(),
                                   keras.optimizers.Adafactor()],
                         ids=["Lamb", "Adafactor"])
def test_unsupported_inner_optimizer_lists_supported(inner):
    with pytest.raises(ValueError) as e:
        Wrapper(inner)
    msg = str(e.value)
    assert type(inner).__name__ in msg and "Supported optimizers" in msg
    for name in ("SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop"):
        assert name in msg


def test_stateless_apply_is_refused():
    with pytest.raises(NotImplementedError, match="stateless_apply"):
        Wrapper(keras.optimizers.SGD()).stateless_apply([], [], [])


# ---------------------------------------------------------------------------
# Serialization and model.save.


def test_get_config_from_config_round_trip():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.7)
    opt = Wrapper(keras.optimizers.RMSprop(schedule, rho=0.8, momentum=0.3,
                                           centered=True, clipnorm=2.0),
                  name="wrapped")
    config = opt.get_config()
    clone = Wrapper.from_config(config)
    assert clone.get_config() == config
    assert clone.name == "wrapped"
    inner = clone.inner_optimizer
    assert type(inner) is keras.optimizers.RMSprop
    assert (inner.rho, inner.momentum, inner.centered, inner.clipnorm) == (
        0.8, 0.3, True, 2.0)
    assert inner._learning_rate.get_config() == schedule.get_config()
    # Through Keras' registry too.
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is Wrapper and again.get_config() == config


def build_model(vocab=30, dim=4):
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(3,), dtype="int64")
    x = sok.layers.DistributedEmbedding(vocab, dim, name="emb")(ids)
    out = keras.layers.Dense(1, name="dense")(x)
    return keras.Model(ids, out)


def fit_data(vocab=30, n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab - 8, size=(n, 3)).astype(np.int64)
    y = rng.standard_normal((n, 1)).astype(np.float32)
    return x, y


def saved_table_entries(path):
    """The entries of the (one) embedding layer in a .keras file."""
    with zipfile.ZipFile(path) as z:
        data = z.read("model.weights.h5")
    with h5py.File(io.BytesIO(data), "r") as h5:
        groups = [h5[f"layers/{k}/vars"] for k in h5["layers"]
                  if "embeddings" in h5[f"layers/{k}/vars"]]
        assert len(groups) == 1, list(h5["layers"])
        return {k: np.asarray(groups[0][k]) for k in groups[0]}


def check_save_load_continue(model, optimizer, tmp_path, expected_slots):
    """Fits, saves to .keras, loads, and checks that continuing training on
    the loaded model is identical to continuing the original."""
    x, y = fit_data()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    table = model.get_layer("emb").embeddings
    assert sorted(table.slots) == sorted(expected_slots)
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    entries = saved_table_entries(path)
    assert sorted(entries) == sorted(
        ["embeddings"] + [f"slot.{n}" for n in expected_slots])
    np.testing.assert_array_equal(entries["embeddings"], table.read_global())
    for n in expected_slots:
        np.testing.assert_array_equal(entries[f"slot.{n}"],
                                      table.slots[n].read_global())
        assert np.abs(entries[f"slot.{n}"]).max() > 0  # trained state

    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(optimizer)
    assert loaded.optimizer.get_config() == optimizer.get_config()
    assert int(loaded.optimizer.iterations) == int(optimizer.iterations) == 4
    ltable = loaded.get_layer("emb").embeddings
    for n in expected_slots:
        np.testing.assert_array_equal(_np(ltable.slots[n]),
                                      _np(table.slots[n]))
    x2, y2 = fit_data(seed=1)
    for m in (model, loaded):
        m.fit(x2, y2, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations) == 8
    np.testing.assert_array_equal(_np(ltable), _np(table))
    for n in expected_slots:
        np.testing.assert_array_equal(_np(ltable.slots[n]),
                                      _np(table.slots[n]))
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(_np(a), _np(b))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))
    return loaded


def test_model_save_round_trip_continues_identically(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5)
    model = build_model()
    check_save_load_continue(
        model, Wrapper(keras.optimizers.Adam(schedule, amsgrad=True)),
        tmp_path, ["m", "v", "vhat"])


def test_saved_ftrl_model_predicts_the_same_and_keeps_slots(tmp_path):
    model = build_model()
    x, y = fit_data()
    model.compile(optimizer=Wrapper(keras.optimizers.Ftrl(0.1)), loss="mse")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    loaded = assert_model_saving(model, x, tmp_path)
    assert isinstance(loaded.optimizer, Wrapper)
    assert sorted(loaded.get_layer("emb").embeddings.slots) == [
        "accumulator", "linear"]


@pytest.mark.parametrize("clip", [{"clipnorm": 1.0}, {"global_clipnorm": 1.0}])
def test_clipping_mixed_dtypes(clip):
    t64 = sok.Variable(np.zeros((4, 2), np.float64), name="t64")
    t32 = sok.Variable(np.zeros((4, 2), np.float32), name="t32")
    d = keras.Variable(np.zeros((2,), np.float32), name="d")
    g = np.array([[3.0, 4.0]])
    opt = Wrapper(keras.optimizers.SGD(1.0, **clip))
    opt.apply_gradients([(slices(np.array([1]), g), t64),
                         (slices(np.array([2]), g.astype(np.float32)), t32),
                         (tf.constant([3.0, 4.0]), d)])
    scale = 1 / 5.0 if "clipnorm" in clip else 1 / np.sqrt(75.0)
    for v, row in ((t64, 1), (t32, 2)):
        np.testing.assert_allclose(_np(v)[row], -g[0] * scale, rtol=1e-6)
    np.testing.assert_allclose(_np(d), [-3.0 * scale, -4.0 * scale],
                               rtol=1e-6)
    assert _np(t64).dtype == np.float64


def test_skip_nonfinite_leaves_tables_slots_and_weights_untouched():
    import keras as _keras

    ids = _keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(50, 4, combiner="sum")
    model = _keras.Model(ids, _keras.layers.Dense(1)(emb(ids)))
    opt = sok.optimizers.OptimizerWrapper(_keras.optimizers.Adam(0.01),
                                          skip_nonfinite=True)
    model.compile(optimizer=opt, loss="mse")
    x = np.array([[1, 2, 3], [4, 5, 6]])
    y = np.ones((2, 1), np.float32)
    model.train_on_batch(x, y)
    before = [np.array(v.numpy()) for v in
              [emb.embeddings] + list(emb.embeddings.slots.values())
              + model.layers[-1].weights]
    model.train_on_batch(x, np.full((2, 1), np.inf, np.float32))
    after = [np.array(v.numpy()) for v in
             [emb.embeddings] + list(emb.embeddings.slots.values())
             + model.layers[-1].weights]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(opt.skipped_steps.numpy()) == 1
    assert opt.get_config()["skip_nonfinite"] is True
    clone = sok.optimizers.OptimizerWrapper.from_config(opt.get_config())
    assert clone.skip_nonfinite is True
    with pytest.raises(TypeError, match="skip_nonfinite"):
        sok.optimizers.OptimizerWrapper(_keras.optimizers.SGD(),
                                        skip_nonfinite="yes")


def test_skip_nonfinite_on_two_ranks_skips_everywhere():
    from tests.multiprocess import run_workers
    from tests.multiprocess import worker_path

    for r in run_workers(worker_path("skip_nonfinite"), 2, timeout=120):
        assert r == {**r, "unchanged": True, "skipped": 1, "moved": True}


# ---------------------------------------------------------------------------
# jit_compile: the dense weights' update as one XLA computation.


def _xla_calls(graph):
    """The function calls in `graph` that TensorFlow must compile with
    XLA."""
    found = []
    for op in graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            try:
                if op.get_attr("_XlaMustCompile"):
                    found.append(op)
            except ValueError:  # no such attribute: not compiled
                pass
    return found


def _jit_step_run(make_opt, steps=4):
    """Traced steps of a table and two dense weights with `make_opt()`;
    returns the final values and the step's graph."""
    w0, _ = initial_values(3)
    rng = np.random.default_rng(5)
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    table = sok.Variable(w0, name="table")
    opt = make_opt()

    @tf.function
    def step(idx, gt, gk, gb):
        opt.apply_gradients([(slices(idx, gt), table), (gk, layer.kernel),
                             (gb, layer.bias)])

    graph = None
    for _ in range(steps):
        args = (tf.constant(rng.permutation(10)[:4].astype(np.int64)),
                tf.constant(rng.standard_normal((4, 4)).astype(np.float32)),
                tf.constant(rng.standard_normal((4, 3)).astype(np.float32)),
                tf.constant(rng.standard_normal((3,)).astype(np.float32)))
        step(*args)
        graph = graph or step.get_concrete_function(*args).graph
    assert int(opt.iterations) == steps
    return [_np(table), _np(layer.kernel), _np(layer.bias)], graph


@pytest.mark.parametrize("make", [
    lambda jit: Wrapper(keras.optimizers.Adam(0.05), jit_compile=jit),
    lambda jit: Wrapper(keras.optimizers.RMSprop(0.05, momentum=0.5,
                                                 clipnorm=0.5),
                        jit_compile=jit),
    lambda jit: sok.optimizers.Adam(0.05, jit_compile=jit),
], ids=["wrapper_adam", "wrapper_rmsprop_clipnorm", "sok_adam"])
def test_jit_compile_true_compiles_the_dense_update_to_the_same_values(make):
    """jit_compile=True: the traced step holds one XLA-compiled call (the
    dense update), and gives the op-by-op step's values (the table's are
    sok's own ops either way, so bit for bit)."""
    ours, graph = _jit_step_run(lambda: make(True))
    ref, ref_graph = _jit_step_run(lambda: make(False))
    assert len(_xla_calls(graph)) == 1
    assert _xla_calls(ref_graph) == []
    np.testing.assert_array_equal(ours[0], ref[0])
    for a, b in zip(ours[1:], ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not np.array_equal(a, _np(keras.ops.zeros_like(a)))


def test_jit_compile_auto_compiles_where_keras_auto_would():
    """"auto" compiles only a traced update whose variables are all on a
    GPU, with no tf.distribute strategy; eagerly, on the CPU or under a
    strategy it runs op by op, as Keras' own "auto" would."""
    from sok_keras.optimizers.wrapper import compiles_dense_update

    inner = keras.optimizers.Adam()
    kernel = keras.Variable(np.zeros((2, 2), np.float32))
    inner.build([kernel])
    assert not compiles_dense_update("auto", inner, [kernel])  # eagerly
    assert compiles_dense_update(True, inner, [kernel])
    assert not compiles_dense_update(False, inner, [kernel])
    assert not compiles_dense_update(True, inner, [])  # nothing to update
    decided = []

    @tf.function
    def traced():
        decided.append(compiles_dense_update("auto", inner, [kernel]))
        with tf.distribute.OneDeviceStrategy("/CPU:0").scope():
            decided.append(compiles_dense_update("auto", inner, [kernel]))
        return tf.constant(0)

    traced()
    on_gpu = "GPU" in kernel.value.device and all(
        "GPU" in v.value.device for v in inner.variables)
    assert decided == [on_gpu, False]
    # CPU variables, even with a GPU visible: op by op.
    with tf.device("/CPU:0"):
        cpu_kernel = keras.Variable(np.zeros((2, 2), np.float32))
        cpu_inner = keras.optimizers.Adam()
        cpu_inner.build([cpu_kernel])
    assert not tf.function(lambda: tf.constant(compiles_dense_update(
        "auto", cpu_inner, [cpu_kernel])))().numpy()


@pytest.mark.parametrize("bad", ["yes", 1, None, "Auto"])
def test_jit_compile_must_be_auto_true_or_false(bad):
    with pytest.raises(ValueError, match=r"OptimizerWrapper: `jit_compile` "
                       r"must be 'auto', True or False\. Received: "
                       rf"jit_compile={bad!r}"):
        Wrapper(keras.optimizers.SGD(), jit_compile=bad)
    with pytest.raises(ValueError, match=r"Adam: `jit_compile`"):
        sok.optimizers.Adam(jit_compile=bad)


@pytest.mark.parametrize("jit", ["auto", True, False])
def test_jit_compile_survives_get_config(jit):
    opt = Wrapper(keras.optimizers.Adam(0.1), jit_compile=jit)
    clone = Wrapper.from_config(opt.get_config())
    assert clone.jit_compile == jit and type(clone.jit_compile) is type(jit)
    sok_opt = sok.optimizers.Adam(0.1, jit_compile=jit)
    clone = sok.optimizers.Adam.from_config(sok_opt.get_config())
    assert clone.jit_compile == jit and type(clone.jit_compile) is type(jit)
    # A file written before the argument existed loads with the default.
    config = opt.get_config()
    del config["jit_compile"]
    assert Wrapper.from_config(config).jit_compile == "auto"


def test_sok_s_optimizer_wrapper_api():
    """SOK's `OptimizerWrapper` calls: `apply_gradients(grads_and_vars,
    global_step=None, name=None)`, `get_slot_names()`,
    `get_slot(var, name)`, `lr` (before: TypeError / AttributeError)."""
    table = sok.Variable(np.ones((6, 2)), dtype="float32", name="t")
    opt = Wrapper(keras.optimizers.Adam(0.1))
    step = tf.Variable(0, dtype=tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(table, tf.constant([[1, 2]])))
    grads = tape.gradient(loss, [table])
    iterations = opt.apply_gradients(zip(grads, [table]), global_step=step,
                                     name="update")
    assert int(step.numpy()) == 1 and int(iterations.numpy()) == 1
    assert opt.get_slot_names() == ["m", "v"]
    m = opt.get_slot(table, "m")
    assert isinstance(m, sok.Variable) and m.shape == (6, 2)
    assert np.count_nonzero(m.numpy().any(axis=1)) == 2  # rows 1 and 2
    with pytest.raises(KeyError, match=r"no slot 'velocity'.*\['m', 'v'\]"):
        opt.get_slot(table, "velocity")
    with pytest.raises(TypeError, match="takes a table"):
        opt.get_slot(tf.Variable(1.0), "m")
    assert float(opt.lr) == pytest.approx(0.1)
    assert Wrapper(keras.optimizers.SGD(0.1)).get_slot_names() == []


def test_the_wrapper_by_name_alone_says_it_needs_an_inner_optimizer():
    """`keras.optimizers.get("sok_keras>OptimizerWrapper")` (before: a bare
    KeyError 'inner_optimizer')."""
    with pytest.raises(ValueError, match="needs `inner_optimizer`"):
        keras.optimizers.get("sok_keras>OptimizerWrapper")
    assert isinstance(keras.optimizers.get("sok_keras>Adam"),
                      sok.optimizers.Adam)


def test_a_gradient_of_the_wrong_shape_updates_nothing():
    """A dense gradient of another shape, or fewer gradients than
    variables: an error naming the variable before any update (before: the
    table and its Adam slots were updated, then TensorFlow's bare
    "Incompatible shapes" came at the dense weight)."""
    t = sok.Variable(np.ones((6, 2), "float32"), name="t")
    d = keras.Variable(np.ones((2,), "float32"), name="d")
    opt = sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.1))
    g_t = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 2], tf.int64),
                           tf.constant([6, 2], tf.int64))
    with pytest.raises(ValueError, match=r"gradient of 'd' has shape \[3\], "
                       r"but the variable has shape \[2\]; nothing was "
                       "updated"):
        opt.apply_gradients([(g_t, t), (tf.ones([3]), d)])
    np.testing.assert_array_equal(t.numpy(), np.ones((6, 2)))
    assert all(not np.any(s.numpy()) for s in t.slots.values())
    assert int(opt.iterations.numpy()) == 0
    bad_rows = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([1, 2],
                                                             tf.int64))
    with pytest.raises(ValueError, match=r"'t'.*\(2, 3\)"):
        opt.apply_gradients([(bad_rows, t), (tf.ones([2]), d)])
    np.testing.assert_array_equal(d.numpy(), np.ones(2))
    with pytest.raises(ValueError, match="1 gradients for 2 variables"):
        opt.apply([tf.ones([2])], [d, t])
    opt.apply_gradients([(g_t, t), (tf.ones([2]), d)])  # then a good step
    assert int(opt.iterations.numpy()) == 1
    assert not np.array_equal(t.numpy()[1], [1.0, 1.0])


@pytest.mark.parametrize("make", [
    lambda: keras.optimizers.Adam(0.05, gradient_accumulation_steps=3),
    lambda: sok.optimizers.Adam(0.05, gradient_accumulation_steps=3)],
    ids=["compile_adam", "sok_adam"])
def test_fit_with_gradient_accumulation(make, tmp_path):
    """`model.fit` with Keras' `gradient_accumulation_steps`: the table and
    the dense weights equal `keras.layers.Embedding`'s model trained with
    the same optimizer (every row looked up in every batch, so the lazy
    rule is Keras' dense one); saved half-way through an accumulation
    (the `gradient_accumulator` slot with the table), loaded and continued,
    the model goes on exactly as the original."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.permutation(_V).reshape(_B, _NID)
                        for _ in range(5)]).astype(np.int64)
    y = rng.normal(size=(5 * _B, 1)).astype(np.float32)
    weights = {}
    for kind in ("sok", "keras"):
        model = _twin(kind)
        opt = make() if kind == "sok" else keras.optimizers.Adam(
            0.05, gradient_accumulation_steps=3)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=_B, shuffle=False, verbose=0)
        weights[kind] = [_np(w) for w in model.weights]
        if kind == "sok":
            sok_model = model
    for a, b in zip(weights["sok"], weights["keras"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(sok_model.optimizer.iterations) == 1  # 5 steps // 3
    table = sok_model.get_layer("emb").embeddings
    assert np.abs(_np(table.slots["gradient_accumulator"])).max() > 0
    path = str(tmp_path / "m.keras")
    sok_model.save(path)
    loaded = keras.models.load_model(path)
    for m in (sok_model, loaded):
        m.fit(x[:4 * _B], y[:4 * _B], batch_size=_B, shuffle=False,
              verbose=0)
    assert int(loaded.optimizer.iterations) == 3  # 9 steps // 3
    for a, b in zip(loaded.weights, sok_model.weights):
        np.testing.assert_array_equal(_np(a), _np(b))


@pytest.mark.parametrize("wrap", [True, False])
def test_a_dropped_model_frees_its_tables_and_slots(wrap):
    """After `fit`, a model the program drops frees its tables and slots.
    Before, Keras' all-reduce of the dense gradients over the (default)
    replica context went through `tf.custom_gradient`, whose global
    registry kept the traced step, and with it the handles of the model's
    variables, for the life of the process: a 2M x 64 table with Adam
    kept 1.5 GB per model built again (a notebook cell run twice).
    Keras' own `Embedding` gradients take another path; the dense ones
    the wrapper passes did not."""
    import gc

    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    rows, dim = 200_000, 64
    table_bytes = 3 * rows * dim * 4  # the table and Adam's two slots

    def fit_and_drop():
        keras.utils.clear_session()
        ids = keras.Input((3,), dtype="int64")
        emb = sok.layers.DistributedEmbedding(rows, dim, combiner="sum")
        model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
        opt = keras.optimizers.Adam(1e-2)
        model.compile(optimizer=sok.optimizers.OptimizerWrapper(opt)
                      if wrap else opt, loss="mse")
        x = np.random.default_rng(0).integers(0, rows, (16, 3))
        model.fit(x, np.ones((16, 1), "float32"), batch_size=8, verbose=0)
        assert sorted(emb.embeddings.slots) == ["m", "v"]

    fit_and_drop()  # (first traces, caches)
    gc.collect()
    before = tf.config.experimental.get_memory_info(device)["current"]
    for _ in range(2):
        fit_and_drop()
    gc.collect()
    grown = tf.config.experimental.get_memory_info(device)["current"] - before
    assert grown < table_bytes // 2, (grown, table_bytes)


def test_a_dropped_model_frees_its_shards_on_two_ranks():
    """The same on 2 ranks, where the exchange's gradient held them."""
    from tests.multiprocess import run_workers
    from tests.multiprocess import worker_path

    for r in run_workers(worker_path("dropped_models"), 2, timeout=180):
        assert r["grown"] < r["shard_bytes"] // 2, r


def test_load_weights_into_a_model_whose_optimizer_is_not_built(tmp_path):
    """As Keras: the weights load and the optimizer's state is skipped with
    a warning (QA: a file with two more entries than the unbuilt wrapper
    was read as an earlier layout, and loading failed)."""
    def make():
        keras.utils.clear_session()
        ids = keras.Input((1,), dtype="int64")
        emb = sok.layers.DistributedEmbedding(10, 4, combiner=None)(ids)
        out = keras.layers.Dense(1)(keras.layers.Flatten()(emb))
        model = keras.Model(ids, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="mse")
        return model

    x = np.arange(8).reshape(8, 1) % 10
    model = make()
    model.fit(x, np.ones((8, 1), np.float32), verbose=0)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    fresh = make()
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        fresh.load_weights(path)
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("option,value", [
    ("clipnorm", 0.01), ("global_clipnorm", 0.01), ("clipvalue", 0.001),
    ("weight_decay", 0.9), ("exclude", None),
    ("gradient_accumulation_steps", 2)])
def test_options_set_on_the_wrapper_after_compile_apply(option, value):
    """`compile` wraps the optimizer; Keras' options a user then sets on
    `model.optimizer` are the inner optimizer's, as if set before (QA:
    they were kept on the wrapper, which never reads them)."""
    x = np.arange(16).reshape(8, 2) % 10
    y = np.full((8, 1), 5.0, np.float32)

    def run(before):
        keras.utils.clear_session()
        ids = keras.Input((2,), dtype="int64")
        emb = sok.layers.DistributedEmbedding(10, 4, combiner=None,
                                              name="emb")
        dense = keras.layers.Dense(1, use_bias=False,
                                   kernel_initializer="ones", name="head")
        model = keras.Model(ids, dense(keras.layers.Flatten()(emb(ids))))
        emb.embeddings.assign_global(np.full((10, 4), 0.1, np.float32))
        weight_decay = 0.5 if option == "exclude" else None
        inner = keras.optimizers.SGD(0.5, weight_decay=weight_decay)
        model.compile(optimizer=inner, loss="mse")
        target = inner if before else model.optimizer
        assert before or isinstance(target, sok.OptimizerWrapper)
        if option == "exclude":
            target.exclude_from_weight_decay(var_names=["emb"])
        else:
            setattr(target, option, value)
            assert getattr(model.optimizer, option) == value
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        return [emb.embeddings.read_global(), dense.kernel.numpy()]

    for a, b in zip(run(before=True), run(before=False)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clipping_set_on_the_wrapper_keeps_the_accumulation_check():
    wrapper = sok.OptimizerWrapper(keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        wrapper.clipnorm = 1.0
    assert wrapper.clipnorm is None
    assert wrapper.inner_optimizer.clipnorm is None
    # The wrapper's own build makes no accumulators (the inner one does).
    table = sok.Variable(np.zeros((6, 2), np.float32))
    dense = keras.Variable(np.zeros((3,), np.float32))
    wrapper.build([table, dense])
    assert wrapper.gradient_accumulation_steps == 2
    assert not getattr(wrapper, "_accumulated_gradients", None)
    assert [tuple(a.shape) for a in
            wrapper.inner_optimizer._accumulated_gradients] == [(3,)]
    # Once built, accumulation is not turned on or off any more.
    with pytest.raises(ValueError, match="before the first step"):
        wrapper.gradient_accumulation_steps = 4


def test_loss_scale_factor_set_on_the_wrapper_is_refused():
    """(Review: kept on the wrapper, it scaled the loss, and nothing
    unscaled the gradients.)"""
    wrapper = sok.OptimizerWrapper(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="`loss_scale_factor` on SGD is not "
                       "supported with sharded tables"):
        wrapper.loss_scale_factor = 128.0
    assert wrapper.loss_scale_factor is None
    assert wrapper.inner_optimizer.loss_scale_factor is None
    assert float(wrapper.scale_loss(2.0)) == 2.0
