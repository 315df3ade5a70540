"""The sparse rules (`sok_keras.optimizers.sparse_rules`) as the optimizers
use them: which Keras optimizer gets which lazy rule, its slots, and the
update of a `sok_keras.Variable` over 10 steps through `OptimizerWrapper`.

References:
- the NumPy lazy rules of `test_sparse_kernels.py` (only rows present in a
  step change; duplicates summed first; bias correction from the global
  step, which also counts a step where the table got no gradient);
- Keras' own optimizer on a plain variable: sparse (unique rows) for SGD and
  Adagrad, dense for a row touched on every step (every rule).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras.optimizers import sparse_rules
from tests.optimizers.test_sparse_kernels import DIM
from tests.optimizers.test_sparse_kernels import HP
from tests.optimizers.test_sparse_kernels import ROWS
from tests.optimizers.test_sparse_kernels import RULES
from tests.optimizers.test_sparse_kernels import TOUCHABLE
from tests.optimizers.test_sparse_kernels import _dedup_np

STEPS, K = 10, 9
NONE_STEP = 4  # the table gets no gradient: only the global step moves
DENSE_SHAPE = (3, 2)

# Kernel-test slot names -> the slot names the rules give `table.slots`.
_SLOT_NAMES = {"acc": "accumulator", "lin": "linear", "vel": "velocity",
               "mom": "momentum", "mg": "average_gradient", "m": "m",
               "v": "v", "vhat": "vhat"}
# ... where a rule names them otherwise (Keras' names).
_RULE_SLOT_NAMES = {
    "momentum": {"m": "momentum"}, "nesterov": {"m": "momentum"},
    "adamax": {"m": "momentum", "u": "norm"},
    "adadelta": {"ag": "accumulated_grad", "ad": "accumulated_delta_var"},
    "lion": {"m": "momentum"},
    "nadam": {"m": "momentum", "v": "velocity"}}


def slot_name(rule_name, kernel_slot):
    own = _RULE_SLOT_NAMES.get(rule_name, {})
    return own.get(kernel_slot) or _SLOT_NAMES[kernel_slot]


def make_steps(seed, steps=STEPS, none_step=NONE_STEP):
    """`[(idx, g, dense_g)]`: row 0 in every step, a duplicate id in every
    step, rows >= TOUCHABLE never; `idx` is None at `none_step`."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, steps + 1):
        dg = rng.standard_normal(DENSE_SHAPE).astype(np.float32)
        if t == none_step:
            out.append((None, None, dg))
            continue
        idx = rng.integers(1, TOUCHABLE, size=K).astype(np.int64)
        idx[0] = 0
        idx[3] = idx[1]
        g = rng.standard_normal((K, DIM)).astype(np.float32)
        out.append((idx, g, dg))
    return out


def initial_values(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((ROWS, DIM)).astype(np.float32),
            rng.standard_normal(DENSE_SHAPE).astype(np.float32))


def slices(idx, g, rows=ROWS):
    return tf.IndexedSlices(tf.convert_to_tensor(g),
                            tf.convert_to_tensor(idx),
                            tf.constant([rows, g.shape[1]], tf.int64))


def run_sok(opt, steps, w0, d0, tf_function=False):
    """Trains a table and a dense variable with `opt` (a wrapper or a sok
    optimizer); returns `(table, dense)`."""
    table = sok.Variable(w0, name="table")
    dense = keras.Variable(d0, name="dense")

    def step(idx, g, dg):
        tg = None if idx is None else slices(idx, g)
        opt.apply_gradients([(tg, table), (tf.convert_to_tensor(dg), dense)])

    fn = tf.function(step, autograph=False) if tf_function else step
    for idx, g, dg in steps:
        if tf_function and idx is None:
            step(idx, g, dg)  # another signature; run it eagerly
        else:
            fn(idx, g, dg)
    return table, dense


def lazy_reference(rule, steps, w0, lrs=None):
    """NumPy lazy rule; `lrs[t - 1]` overrides HP['lr'] at step t."""
    w = w0.copy()
    s = {n: np.full_like(w0, init) for n, init in rule.slots}
    for t, (idx, g, _) in enumerate(steps, start=1):
        if idx is None:
            continue
        rows, summed = _dedup_np(idx, g)
        w_rows, s_rows = w[rows], {n: v[rows] for n, v in s.items()}
        saved = HP["lr"]
        if lrs is not None:
            HP["lr"] = lrs[t - 1]
        try:
            rule.ref(w_rows, s_rows, summed, t)
        finally:
            HP["lr"] = saved
        w[rows] = w_rows
        for n in s:
            s[n][rows] = s_rows[n]
    return w, s


def keras_dense(opt, steps, w0, d0):
    """Keras' own optimizer on plain variables, dense table gradients."""
    kvar, dense = keras.Variable(w0), keras.Variable(d0)
    opt.build([kvar, dense])
    for idx, g, dg in steps:
        if idx is None:
            opt.apply_gradients([(tf.constant(dg), dense)])
            continue
        full = np.zeros_like(w0)
        np.add.at(full, idx, g)
        opt.apply_gradients([(tf.constant(full), kvar),
                             (tf.constant(dg), dense)])
    return kvar, dense, opt


def _np(v):
    return keras.ops.convert_to_numpy(v)


# ---------------------------------------------------------------------------
# Every rule through OptimizerWrapper.


@pytest.mark.parametrize("name", sorted(RULES))
def test_wrapper_rule_matches_lazy_reference_and_keras(name):
    rule = RULES[name]
    steps = make_steps(seed=len(name))
    w0, d0 = initial_values(1)
    opt = sok.OptimizerWrapper(rule.keras_opt())
    table, dense = run_sok(opt, steps, w0, d0)

    # The slots the rule made, and their names.
    expected_slots = {slot_name(name, n): n for n, _ in rule.slots}
    assert sorted(table.slots) == sorted(expected_slots)
    for s in table.slots.values():
        assert isinstance(s, sok.Variable) and not s.trainable
        assert s.global_shape == table.global_shape and s.mode == table.mode

    # The NumPy lazy rule with the global step.
    w_ref, s_ref = lazy_reference(rule, steps, w0)
    np.testing.assert_allclose(_np(table), w_ref, rtol=1e-5, atol=1e-6)
    for ours, theirs in expected_slots.items():
        np.testing.assert_allclose(_np(table.slots[ours]), s_ref[theirs],
                                   rtol=1e-5, atol=1e-6)
    # Lazy: rows never looked up, and their slots, did not change at all.
    np.testing.assert_array_equal(_np(table)[TOUCHABLE:], w0[TOUCHABLE:])
    for ours, theirs in expected_slots.items():
        init = dict(rule.slots)[theirs]
        np.testing.assert_array_equal(
            _np(table.slots[ours])[TOUCHABLE:], np.float32(init))
    assert int(opt.iterations) == STEPS

    # Keras' dense update on a plain variable: row 0 (present in every step
    # the table got a gradient) is the same; the dense weight is exactly
    # Keras' update.
    kvar, kdense, kopt = keras_dense(rule.keras_opt(), steps, w0, d0)
    np.testing.assert_array_equal(_np(dense), _np(kdense))
    np.testing.assert_allclose(_np(table)[0], _np(kvar)[0], rtol=1e-5,
                               atol=1e-6)
    kslots = {slot_name(name, n): _np(v)
              for n, v in rule.keras_slots(kopt).items()}
    for n, v in kslots.items():
        np.testing.assert_allclose(_np(table.slots[n])[0], v[0], rtol=1e-5,
                                   atol=1e-6)
    # ... while rows missing from some steps differ from Keras' dense rule
    # wherever the rule decays slots (the test can tell lazy from dense).
    lazy_state = [_np(table)] + [_np(table.slots[n]) for n in kslots]
    dense_state = [_np(kvar)] + [kslots[n] for n in kslots]
    same = all(np.allclose(a, b, rtol=1e-5, atol=1e-6)
               for a, b in zip(lazy_state, dense_state))
    assert same == (name in ("sgd", "adagrad"))


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sgd_and_adagrad_equal_keras_sparse_update(name):
    """Unique rows per step: Keras' own sparse update, table and slots."""
    rule = RULES[name]
    w0, _ = initial_values(2)
    rng = np.random.default_rng(3)
    table = sok.Variable(w0, name="table")
    kvar = keras.Variable(w0)
    opt = sok.OptimizerWrapper(rule.keras_opt())
    kopt = rule.keras_opt()
    kopt.build([kvar])
    for _ in range(STEPS):
        idx = rng.permutation(TOUCHABLE)[:6].astype(np.int64)
        g = rng.standard_normal((6, DIM)).astype(np.float32)
        opt.apply_gradients([(slices(idx, g), table)])
        kopt.apply_gradients([(slices(idx, g), kvar)])
    np.testing.assert_allclose(_np(table), _np(kvar), rtol=1e-6)
    assert np.abs(_np(table) - w0).max() > 1e-3
    for n, v in rule.keras_slots(kopt).items():
        np.testing.assert_allclose(_np(table.slots[slot_name(name, n)]),
                                   _np(v), rtol=1e-6)


def test_nadam_on_a_float64_table_is_float64_accurate():
    """(QA) Every row in every step (lazy == dense): a float64 table under
    Nadam follows Keras' Nadam on a float64 variable. The moments took the
    exact betas beside a schedule of float32-rounded ones (Keras casts
    them once, for both): a 6e-6 relative error, float32's, in float64.
    (What is left, ~3e-9: the schedule's product is kept in float32.)"""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal((4, 3))
    table = sok.Variable(w0, name="table")
    kvar = keras.Variable(w0)
    hp = dict(learning_rate=0.5, beta_1=0.5, beta_2=0.999)
    opt = sok.OptimizerWrapper(keras.optimizers.Nadam(**hp))
    kopt = keras.optimizers.Nadam(**hp)
    kopt.build([kvar])
    idx = np.arange(4, dtype=np.int64)
    for _ in range(3):
        g = rng.standard_normal((4, 3))
        opt.apply_gradients([(slices(idx, g), table)])
        kopt.apply_gradients([(tf.constant(g), kvar)])
    assert table.dtype == tf.float64
    np.testing.assert_allclose(_np(table), _np(kvar), rtol=1e-7, atol=2e-8)


def test_rule_in_tf_function_equals_eager():
    rule = RULES["adam"]
    steps = make_steps(seed=11)
    w0, d0 = initial_values(4)
    eager, _ = run_sok(sok.OptimizerWrapper(rule.keras_opt()), steps, w0, d0)
    keras.utils.clear_session()
    graph, _ = run_sok(sok.OptimizerWrapper(rule.keras_opt()), steps, w0, d0,
                       tf_function=True)
    np.testing.assert_allclose(_np(graph), _np(eager), rtol=1e-6, atol=1e-7)
    for n in ("m", "v"):
        np.testing.assert_allclose(_np(graph.slots[n]), _np(eager.slots[n]),
                                   rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# rule_for / ensure_slots.


@pytest.mark.parametrize("opt,rule", [
    (keras.optimizers.SGD(), "SGD"),
    (keras.optimizers.SGD(momentum=0.5, nesterov=True), "SGD"),
    (keras.optimizers.Adagrad(), "Adagrad"),
    (keras.optimizers.Adam(amsgrad=True), "Adam"),
    (keras.optimizers.AdamW(), "AdamW"),
    (keras.optimizers.Ftrl(), "Ftrl"),
    (keras.optimizers.RMSprop(centered=True), "RMSprop"),
    (keras.optimizers.Adamax(), "Adamax"),
    (keras.optimizers.Adadelta(), "Adadelta"),
    (keras.optimizers.Lion(), "Lion"),
    (keras.optimizers.Nadam(), "Nadam"),
    (keras.optimizers.Muon(), "Muon"),
    (sok.optimizers.Adam(), "Adam"),
    (sok.optimizers.Nadam(), "Nadam"),
    (sok.optimizers.Lion(), "Lion"),
    (sok.optimizers.AdamW(), "AdamW"),
    (sok.optimizers.Muon(), "Muon"),
])
def test_rule_for_supported(opt, rule):
    assert sparse_rules.rule_for(opt).name == rule


class _MyAdam(keras.optimizers.Adam):
    pass


@pytest.mark.parametrize("opt", [keras.optimizers.Lamb(),
                                 keras.optimizers.Adafactor(),
                                 _MyAdam()],
                         ids=["Lamb", "Adafactor", "subclass"])
def test_rule_for_unsupported_lists_supported(opt):
    with pytest.raises(ValueError) as e:
        sparse_rules.rule_for(opt)
    msg = str(e.value)
    assert type(opt).__name__ in msg
    for name in ("SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop",
                 "Adamax", "Adadelta", "Lion", "Nadam", "Muon"):
        assert name in msg
    assert sorted(sparse_rules.SUPPORTED) == sorted(
        ["SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop", "Adamax",
         "Adadelta", "Lion", "Nadam", "Muon"])


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "ftrl",
                                  "rmsprop", "adamax", "adadelta", "lion",
                                  "nadam"])
def test_weight_decay_of_every_rule_is_lazy_and_keras_own(name):
    """Keras' decoupled `weight_decay` on any rule (before: refused for all
    but Adam and AdamW): a row present in every step equals Keras' dense
    update with the decay; a row never looked up is not decayed; a table
    excluded with `exclude_from_weight_decay` is not decayed at all."""
    rule = RULES[name]
    steps = make_steps(seed=5, none_step=None)
    w0, d0 = initial_values(3)

    def with_decay(exclude=False):
        opt = rule.keras_opt()
        opt.weight_decay = 0.2
        if exclude:
            opt.exclude_from_weight_decay(var_names=["table"])
        return opt

    opt = sok.OptimizerWrapper(with_decay())
    table, _ = run_sok(opt, steps, w0, d0)
    kvar, _, _ = keras_dense(with_decay(), steps, w0, d0)
    np.testing.assert_allclose(_np(table)[0], _np(kvar)[0], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(_np(table)[TOUCHABLE:], w0[TOUCHABLE:])
    # Without the decay row 0 ends elsewhere (the test sees the decay).
    plain, _ = run_sok(sok.OptimizerWrapper(rule.keras_opt()), steps, w0,
                       d0)
    assert not np.allclose(_np(plain)[0], _np(table)[0], rtol=1e-5,
                           atol=1e-6)
    excluded, _ = run_sok(sok.OptimizerWrapper(with_decay(exclude=True)),
                          steps, w0, d0)
    np.testing.assert_array_equal(_np(excluded), _np(plain))


def test_adam_weight_decay_is_lazy_and_honours_exclusions():
    """Adam(weight_decay=...) decays the rows it updates, like AdamW, and
    not a table excluded with `exclude_from_weight_decay`."""
    idx = np.array([0, 2], np.int64)
    g = np.ones((2, DIM), np.float32)
    w0 = np.full((ROWS, DIM), 2.0, np.float32)
    results = {}
    for kind in ("plain", "decay", "adamw", "excluded"):
        keras.utils.clear_session()
        table = sok.Variable(w0, name=f"table_{kind}")
        if kind == "plain":
            inner = keras.optimizers.Adam(0.1)
        elif kind == "adamw":
            inner = keras.optimizers.AdamW(0.1, weight_decay=0.5)
        else:
            inner = keras.optimizers.Adam(0.1, weight_decay=0.5)
        if kind == "excluded":
            inner.exclude_from_weight_decay(var_names=["table_excluded"])
        sok.OptimizerWrapper(inner).apply_gradients([(slices(idx, g), table)])
        results[kind] = _np(table)
    # Adam step of size lr on rows 0 and 2; decay w * wd * lr = 0.1 first.
    np.testing.assert_allclose(results["plain"][idx], 2.0 - 0.1, rtol=1e-5)
    np.testing.assert_allclose(results["decay"][idx], 2.0 - 0.1 - 0.1,
                               rtol=1e-5)
    np.testing.assert_array_equal(results["adamw"], results["decay"])
    np.testing.assert_array_equal(results["excluded"], results["plain"])
    for r in results.values():  # untouched rows are not decayed
        np.testing.assert_array_equal(r[1], w0[1])


def test_ensure_slots_initial_values_once_and_sharding():
    opt = keras.optimizers.Ftrl(initial_accumulator_value=0.3)
    rule = sparse_rules.rule_for(opt)
    table = sok.Variable(np.zeros((7, 3), np.float64), mode="localized:0",
                         name="t64")
    slots = sparse_rules.ensure_slots(rule, opt, table)
    assert sorted(slots) == ["accumulator", "linear"]
    # Keras makes its float64 slots from the float32 constant, too.
    np.testing.assert_array_equal(_np(slots["accumulator"]), np.float32(0.3))
    np.testing.assert_array_equal(_np(slots["linear"]), 0.0)
    for s in slots.values():
        assert s.dtype == "float64" and s.mode == "localized:0"
        assert s.global_shape == (7, 3)
    again = sparse_rules.ensure_slots(rule, opt, table)
    assert all(again[n] is slots[n] for n in slots)
    assert table.slots == slots


@pytest.mark.parametrize("opt,names", [
    (keras.optimizers.SGD(), []),
    (keras.optimizers.SGD(momentum=0.9), ["momentum"]),
    (keras.optimizers.Adam(), ["m", "v"]),
    (keras.optimizers.Adam(amsgrad=True), ["m", "v", "vhat"]),
    (keras.optimizers.RMSprop(), ["velocity"]),
    (keras.optimizers.RMSprop(momentum=0.5, centered=True),
     ["average_gradient", "momentum", "velocity"]),
    (keras.optimizers.Adamax(), ["momentum", "norm"]),
    (keras.optimizers.Adadelta(),
     ["accumulated_delta_var", "accumulated_grad"]),
    (keras.optimizers.Lion(), ["momentum"]),
    (keras.optimizers.Nadam(), ["momentum", "velocity"]),
    (keras.optimizers.Muon(), ["momentum", "velocity"]),
])
def test_slot_names(opt, names):
    rule = sparse_rules.rule_for(opt)
    assert sorted(n for n, _ in rule.slots(opt)) == names


# ---------------------------------------------------------------------------
# Muon: a table takes the AdamW step Keras' Muon gives embeddings.


def _muon(**kw):
    args = dict(learning_rate=0.05, adam_lr_ratio=0.5, adam_beta_1=0.8,
                adam_beta_2=0.99, epsilon=1e-6, adam_weight_decay=0.1,
                weight_decay=0.01)
    args.update(kw)
    return keras.optimizers.Muon(**args)


def test_muon_gives_a_table_its_adamw_step():
    """Row 0 (looked up in every step) equals Keras' Muon on a plain
    `embeddings` variable: its AdamW step with `learning_rate *
    adam_lr_ratio`, `adam_beta_*`, and `adam_weight_decay` decayed with the
    unscaled rate; the 2-D dense weight gets Muon's own Newton-Schulz step,
    exactly Keras'; rows never looked up keep their values."""
    steps = make_steps(seed=21, none_step=None)
    w0, d0 = initial_values(5)
    opt = sok.OptimizerWrapper(_muon())
    table, dense = run_sok(opt, steps, w0, d0)
    assert sorted(table.slots) == ["momentum", "velocity"]
    kvar = keras.Variable(w0, name="embeddings")
    kdense = keras.Variable(d0, name="dense")
    kopt = _muon()
    kopt.build([kvar, kdense])
    assert kopt._should_use_adamw(kvar)
    assert not kopt._should_use_adamw(kdense)
    for idx, g, dg in steps:
        full = np.zeros_like(w0)
        np.add.at(full, idx, g)
        kopt.apply_gradients([(tf.constant(full), kvar),
                              (tf.constant(dg), kdense)])
    np.testing.assert_array_equal(_np(dense), _np(kdense))
    np.testing.assert_allclose(_np(table)[0], _np(kvar)[0], rtol=1e-5,
                               atol=1e-6)
    i = kopt._get_variable_index(kvar)
    np.testing.assert_allclose(_np(table.slots["momentum"])[0],
                               _np(kopt.momentums[i])[0], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(_np(table.slots["velocity"])[0],
                               _np(kopt.adam_velocities[i])[0], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_array_equal(_np(table)[TOUCHABLE:], w0[TOUCHABLE:])
    # The test sees each hyperparameter: another ratio, another decay.
    for kw in ({"adam_lr_ratio": 1.0}, {"adam_weight_decay": None},
               {"adam_beta_1": 0.9}):
        keras.utils.clear_session()
        other, _ = run_sok(sok.OptimizerWrapper(_muon(**kw)), steps, w0, d0)
        assert not np.allclose(_np(other)[0], _np(table)[0], rtol=1e-5,
                               atol=1e-6), kw


def test_muon_refuses_a_table_it_would_orthogonalize():
    """With `exclude_embeddings=False`, Keras' Muon gives an embedding its
    Newton-Schulz step (a whole-matrix operation with no sparse form): the
    table is refused by name, unless `exclude_layers` names it."""
    steps = make_steps(seed=2, none_step=None)[:1]
    w0, d0 = initial_values(6)
    with pytest.raises(ValueError) as e:
        run_sok(sok.OptimizerWrapper(_muon(exclude_embeddings=False)),
                steps, w0, d0)
    msg = str(e.value)
    assert "table 'table'" in msg and "exclude_embeddings=True" in msg
    keras.utils.clear_session()
    table, _ = run_sok(sok.OptimizerWrapper(
        _muon(exclude_embeddings=False, exclude_layers=["table"])),
        steps, w0, d0)
    assert not np.array_equal(_np(table), w0)


# ---------------------------------------------------------------------------
# Keras' gradient_accumulation_steps.


@pytest.mark.parametrize("tf_function", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name,make", [
    ("adamw", lambda: keras.optimizers.AdamW(
        0.05, weight_decay=0.1, gradient_accumulation_steps=3)),
    ("nadam", lambda: keras.optimizers.Nadam(
        0.05, gradient_accumulation_steps=2)),
    ("momentum", lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=4)),
    ("ftrl", lambda: keras.optimizers.Ftrl(
        0.1, gradient_accumulation_steps=2)),
])
def test_gradient_accumulation_matches_keras(name, make, tf_function):
    """Keras' `gradient_accumulation_steps` (before: refused): the table's
    gradient rows are summed in its `gradient_accumulator` slot, and every
    k-th step updates the rows looked up since with their mean (weight
    decay then too). Row 0, looked up in every step, equals Keras'
    accumulated update of a plain variable, and the dense weight Keras'
    (exactly, eagerly); rows never looked up keep their values; `iterations` counts
    updates, as Keras'. Without the dense weight (no Keras `apply` in the
    step), Nadam's schedule still moves at update steps only."""
    steps = make_steps(seed=4, none_step=None)
    w0, d0 = initial_values(2)
    for with_dense in (True, False):
        keras.utils.clear_session()
        opt = sok.OptimizerWrapper(make())
        if with_dense:
            table, dense = run_sok(opt, steps, w0, d0,
                                   tf_function=tf_function)
        else:
            table = sok.Variable(w0, name="table")
            step = (tf.function(opt.apply_gradients, autograph=False)
                    if tf_function else opt.apply_gradients)
            for idx, g, _ in steps:
                step([(slices(idx, g), table)])
        assert sparse_rules.ACCUMULATOR in table.slots
        kvar, kdense = keras.Variable(w0, name="t"), keras.Variable(d0)
        kopt = make()
        kopt.build([kvar, kdense] if with_dense else [kvar])
        for idx, g, dg in steps:
            full = np.zeros_like(w0)
            np.add.at(full, idx, g)
            pairs = [(tf.constant(full), kvar)]
            if with_dense:
                pairs.append((tf.constant(dg), kdense))
            kopt.apply_gradients(pairs)
        np.testing.assert_allclose(_np(table)[0], _np(kvar)[0], rtol=1e-5,
                                   atol=1e-6)
        if with_dense:  # (traced: an ulp from Keras' eager arithmetic)
            np.testing.assert_allclose(_np(dense), _np(kdense),
                                       rtol=1e-6 if tf_function else 0)
        np.testing.assert_array_equal(_np(table)[TOUCHABLE:],
                                      w0[TOUCHABLE:])
        assert int(opt.iterations) == int(kopt.iterations) == (
            STEPS // make().gradient_accumulation_steps)
    # Updating every step instead ends elsewhere (the test sees it).
    keras.utils.clear_session()
    plain = make()
    plain.gradient_accumulation_steps = None
    every, _ = run_sok(sok.OptimizerWrapper(plain), steps, w0, d0)
    assert not np.allclose(_np(every)[0], _np(table)[0], rtol=1e-4)


@pytest.mark.parametrize("tf_function", [False, True], ids=["eager", "graph"])
def test_gradient_accumulation_drops_sums_without_a_gradient_at_the_update(
        tf_function):
    """As Keras: a variable without a gradient in an update step is not
    updated, and its accumulated sum is dropped (Keras zeroes every
    accumulator there). Before, a table's (and, in a step with no dense
    gradient, the dense weights') sum was carried into the next window
    and applied 1.5x too strongly."""
    w0 = np.ones((4, 2), np.float32)
    d0 = np.ones((2,), np.float32)
    row = tf.IndexedSlices(tf.constant([[1.0, 2.0]]),
                           tf.constant([0], tf.int64),
                           tf.constant([4, 2], tf.int64))
    full = np.zeros_like(w0)
    full[0] = [1.0, 2.0]
    # Which variables get a gradient in steps 1-4 (k=2: steps 2 and 4
    # update): the table misses step 2, the dense weight step 4... and 3.
    plan = [(True, True), (False, True), (True, False), (True, False)]
    opt = sok.OptimizerWrapper(keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=2))
    table, dense = sok.Variable(w0, name="table"), keras.Variable(d0)
    kopt = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    ktable, kdense = keras.Variable(w0), keras.Variable(d0)
    kopt.build([ktable, kdense])
    def step(has_table, has_dense):
        pairs = [(row, table)] if has_table else []
        if has_dense:
            pairs.append((tf.ones([2]), dense))
        opt.apply_gradients(pairs)

    # (Python flags: one trace per combination.)
    apply = tf.function(step, autograph=False) if tf_function else step
    for has_table, has_dense in plan:
        apply(has_table, has_dense)
        kpairs = [(tf.constant(full), ktable)] if has_table else []
        if has_dense:
            kpairs.append((tf.ones([2]), kdense))
        kopt.apply_gradients(kpairs)
        np.testing.assert_allclose(_np(table), _np(ktable), rtol=1e-6)
        np.testing.assert_allclose(_np(dense), _np(kdense), rtol=1e-6)
    assert int(opt.iterations) == int(kopt.iterations) == 2
    np.testing.assert_allclose(_np(table)[0], [0.9, 0.8], rtol=1e-6)


def test_gradient_accumulation_with_clipping_is_refused():
    with pytest.raises(ValueError, match=(
            r"`gradient_accumulation_steps` with `clipnorm` on Adam is not "
            r"supported with sharded tables")):
        sok.OptimizerWrapper(keras.optimizers.Adam(
            clipnorm=1.0, gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="global_clipnorm"):
        sok.optimizers.Adam(global_clipnorm=1.0,
                            gradient_accumulation_steps=2)
