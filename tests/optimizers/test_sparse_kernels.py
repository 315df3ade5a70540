"""Tests of the sparse ("lazy") optimizer kernels (SokSparseApply* ops).

Reference semantics: duplicates in `indices` are summed first; every unique
row then gets one Keras-formula update; absent rows (and their slots) do not
change.

Note on Keras and duplicates: Keras' own optimizers, given a
`tf.IndexedSlices` with repeated indices, apply the non-linear parts per
entry (e.g. Adagrad adds g1^2 + g2^2 to the accumulator, not (g1 + g2)^2).
The Keras comparisons below therefore feed Keras the *deduplicated* slices
(duplicates summed with `tf.math.unsorted_segment_sum`), which is the
gradient the lazy kernels define.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from sok_keras.optimizers import sparse_kernels as sk  # noqa: E402

ROWS, DIM, K = 20, 4, 12
TOUCHABLE = 15  # rows >= TOUCHABLE are never touched
STEPS = 10
F32 = np.float32
_REF_DTYPE = [np.float32]  # dtype the NumPy references compute in


def _random_batches(seed, steps=STEPS):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        idx = rng.integers(0, TOUCHABLE, size=K).astype(np.int64)
        idx[1] = idx[0]  # at least one duplicate
        idx[5] = idx[3]
        g = rng.standard_normal((K, DIM)).astype(np.float32)
        out.append((idx, g))
    return out


def _dedup_np(idx, g):
    """First-occurrence unique rows, duplicates summed in position order."""
    uniq, first, inv = np.unique(idx, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    summed = np.zeros((len(uniq), g.shape[1]), g.dtype)
    np.add.at(summed, rank[inv.reshape(-1)], g)
    return uniq[order], summed


def _dedup_slices(idx, g):
    uniq, summed = _dedup_np(idx, g)
    return tf.IndexedSlices(
        tf.constant(summed), tf.constant(uniq), tf.constant([ROWS, DIM], tf.int64)
    )


# ---------------------------------------------------------------------------
# Rules: slots, kernel call, NumPy lazy reference, Keras optimizer.

HP = dict(
    lr=0.05,
    momentum=0.9,
    epsilon=1e-7,
    beta_1=0.85,
    beta_2=0.995,
    weight_decay=0.04,
    rho=0.8,
    init_acc=0.1,
    lr_power=-0.5,
    l1=0.01,
    l2=0.02,
    l2_shrinkage=0.01,
    beta=0.1,
)


class Rule:
    def __init__(self, name, slots, call, ref, keras_opt, keras_slots):
        self.name = name
        self.slots = slots  # list of (slot name, init value)
        self.call = call  # (var, slots dict, idx, g, step) -> op
        self.ref = ref  # (w, slots dict of rows, g, step) -> None, in place
        self.keras_opt = keras_opt  # () -> keras optimizer
        self.keras_slots = keras_slots  # (opt) -> dict name -> variable


def _f(x):
    return _REF_DTYPE[0](x)


def _ref_sgd(w, s, g, t):
    w -= g * _f(HP["lr"])


def _ref_momentum(nesterov):
    def ref(w, s, g, t):
        lr, mom = _f(HP["lr"]), _f(HP["momentum"])
        s["m"][...] = s["m"] * mom - g * lr
        if nesterov:
            w += s["m"] * mom - g * lr
        else:
            w += s["m"]

    return ref


def _ref_adagrad(w, s, g, t):
    s["acc"] += g * g
    w -= (_f(HP["lr"]) * g) / np.sqrt(s["acc"] + _f(HP["epsilon"]))


def _ref_adam(amsgrad, wd):
    def ref(w, s, g, t):
        lr, b1, b2 = _f(HP["lr"]), _f(HP["beta_1"]), _f(HP["beta_2"])
        if wd:
            w -= w * _f(HP["weight_decay"]) * lr
        b1p, b2p = b1 ** _f(t), b2 ** _f(t)
        alpha = lr * np.sqrt(_f(1) - b2p) / (_f(1) - b1p)
        s["m"] += (g - s["m"]) * (_f(1) - b1)
        s["v"] += (g * g - s["v"]) * (_f(1) - b2)
        u = s["v"]
        if amsgrad:
            s["vhat"][...] = np.maximum(s["vhat"], s["v"])
            u = s["vhat"]
        w -= (s["m"] * alpha) / (np.sqrt(u) + _f(HP["epsilon"]))

    return ref


def _ref_ftrl(w, s, g, t):
    lr, p = _f(HP["lr"]), _f(HP["lr_power"])
    l1, l2 = _f(HP["l1"]), _f(HP["l2"])
    l2_reg = l2 + _f(HP["beta"]) / (_f(2) * lr)
    g2 = g + _f(2) * _f(HP["l2_shrinkage"]) * w
    new_acc = s["acc"] + g * g
    s["lin"] += g2 - (new_acc ** -p - s["acc"] ** -p) / lr * w
    quad = new_acc ** -p / lr + _f(2) * l2_reg
    w[...] = (np.clip(s["lin"], -l1, l1) - s["lin"]) / quad
    s["acc"][...] = new_acc


def _ref_rmsprop(centered, use_mom):
    def ref(w, s, g, t):
        rho, lr = _f(HP["rho"]), _f(HP["lr"])
        s["vel"][...] = rho * s["vel"] + (_f(1) - rho) * (g * g)
        if centered:
            s["mg"][...] = rho * s["mg"] + (_f(1) - rho) * g
            denom = s["vel"] - s["mg"] ** 2 + _f(HP["epsilon"])
        else:
            denom = s["vel"] + _f(HP["epsilon"])
        inc = (lr * g) / np.sqrt(denom)
        if use_mom:
            s["mom"][...] = _f(HP["momentum"]) * s["mom"] + inc
            w -= s["mom"]
        else:
            w -= inc

    return ref


def _ref_adamax(w, s, g, t):
    b1, b2 = _f(HP["beta_1"]), _f(HP["beta_2"])
    s["m"] += (g - s["m"]) * (_f(1) - b1)
    s["u"][...] = np.maximum(b2 * s["u"], np.abs(g))
    w -= (_f(HP["lr"]) * s["m"]) / (
        (_f(1) - b1 ** _f(t)) * (s["u"] + _f(HP["epsilon"])))


def _ref_adadelta(w, s, g, t):
    rho, eps = _f(HP["rho"]), _f(HP["epsilon"])
    s["ag"][...] = rho * s["ag"] + (_f(1) - rho) * (g * g)
    delta = -(np.sqrt(s["ad"] + eps) * g) / np.sqrt(s["ag"] + eps)
    s["ad"][...] = rho * s["ad"] + (_f(1) - rho) * (delta * delta)
    w += _f(HP["lr"]) * delta


def _ref_lion(w, s, g, t):
    b1, b2 = _f(HP["beta_1"]), _f(HP["beta_2"])
    w -= _f(HP["lr"]) * np.sign(s["m"] * b1 + g * (_f(1) - b1))
    s["m"][...] = s["m"] * b2 + g * (_f(1) - b2)


def _nadam_schedule(t):
    """Keras Nadam's step-t schedule: (u_t, u_t_1, the product of the u's
    up to u_t, beta_2 ** t), in the order Keras computes them."""
    b1, b2, decay = _f(HP["beta_1"]), _f(HP["beta_2"]), _f(0.96)
    u_product = _f(1)
    for s in range(1, t + 1):
        u_product = u_product * b1 * (_f(1) - _f(0.5) * decay ** _f(s))
    u_t = b1 * (_f(1) - _f(0.5) * decay ** _f(t))
    u_t_1 = b1 * (_f(1) - _f(0.5) * decay ** _f(t + 1))
    return u_t, u_t_1, u_product, b2 ** _f(t)


def _ref_nadam(w, s, g, t):
    b1, b2 = _f(HP["beta_1"]), _f(HP["beta_2"])
    u_t, u_t_1, u_product, b2_power = _nadam_schedule(t)
    s["m"] += (g - s["m"]) * (_f(1) - b1)
    s["v"] += (g * g - s["v"]) * (_f(1) - b2)
    m_hat = (u_t_1 * s["m"]) / (_f(1) - u_product * u_t_1) + (
        (_f(1) - u_t) * g) / (_f(1) - u_product)
    v_hat = s["v"] / (_f(1) - b2_power)
    w -= (m_hat * _f(HP["lr"])) / (np.sqrt(v_hat) + _f(HP["epsilon"]))


def _adam_rule(name, amsgrad, wd):
    slots = [("m", 0.0), ("v", 0.0)] + ([("vhat", 0.0)] if amsgrad else [])

    def call(var, s, idx, g, t):
        kw = dict(
            learning_rate=HP["lr"],
            step=t,
            beta_1=HP["beta_1"],
            beta_2=HP["beta_2"],
            epsilon=HP["epsilon"],
            vhat=s.get("vhat"),
        )
        if wd:
            return sk.sparse_adamw(
                var, s["m"], s["v"], idx, g, weight_decay=HP["weight_decay"], **kw
            )
        return sk.sparse_adam(var, s["m"], s["v"], idx, g, **kw)

    def keras_opt():
        kw = dict(
            learning_rate=HP["lr"],
            beta_1=HP["beta_1"],
            beta_2=HP["beta_2"],
            epsilon=HP["epsilon"],
            amsgrad=amsgrad,
        )
        if wd:
            return keras.optimizers.AdamW(weight_decay=HP["weight_decay"], **kw)
        return keras.optimizers.Adam(**kw)

    def keras_slots(opt):
        d = {"m": opt._momentums[0], "v": opt._velocities[0]}
        if amsgrad:
            d["vhat"] = opt._velocity_hats[0]
        return d

    return Rule(name, slots, call, _ref_adam(amsgrad, wd), keras_opt, keras_slots)


def _rmsprop_rule(name, centered, use_mom):
    slots = [("vel", 0.0)]
    if use_mom:
        slots.append(("mom", 0.0))
    if centered:
        slots.append(("mg", 0.0))

    def call(var, s, idx, g, t):
        return sk.sparse_rmsprop(
            var,
            s["vel"],
            idx,
            g,
            learning_rate=HP["lr"],
            rho=HP["rho"],
            momentum=HP["momentum"] if use_mom else 0.0,
            epsilon=HP["epsilon"],
            momentum_slot=s.get("mom"),
            average_gradient=s.get("mg"),
        )

    def keras_opt():
        return keras.optimizers.RMSprop(
            learning_rate=HP["lr"],
            rho=HP["rho"],
            momentum=HP["momentum"] if use_mom else 0.0,
            epsilon=HP["epsilon"],
            centered=centered,
        )

    def keras_slots(opt):
        d = {"vel": opt._velocities[0]}
        if use_mom:
            d["mom"] = opt._momentums[0]
        if centered:
            d["mg"] = opt._average_gradients[0]
        return d

    return Rule(name, slots, call, _ref_rmsprop(centered, use_mom), keras_opt,
                keras_slots)


def _momentum_rule(name, nesterov):
    return Rule(
        name,
        [("m", 0.0)],
        lambda var, s, idx, g, t: sk.sparse_momentum(
            var, s["m"], idx, g, HP["lr"], HP["momentum"], nesterov=nesterov
        ),
        _ref_momentum(nesterov),
        lambda: keras.optimizers.SGD(
            learning_rate=HP["lr"], momentum=HP["momentum"], nesterov=nesterov
        ),
        lambda opt: {"m": opt.momentums[0]},
    )


RULES = {
    r.name: r
    for r in [
        Rule(
            "sgd",
            [],
            lambda var, s, idx, g, t: sk.sparse_sgd(var, idx, g, HP["lr"]),
            _ref_sgd,
            lambda: keras.optimizers.SGD(learning_rate=HP["lr"]),
            lambda opt: {},
        ),
        _momentum_rule("momentum", False),
        _momentum_rule("nesterov", True),
        Rule(
            "adagrad",
            [("acc", HP["init_acc"])],
            lambda var, s, idx, g, t: sk.sparse_adagrad(
                var, s["acc"], idx, g, HP["lr"], epsilon=HP["epsilon"]
            ),
            _ref_adagrad,
            lambda: keras.optimizers.Adagrad(
                learning_rate=HP["lr"],
                initial_accumulator_value=HP["init_acc"],
                epsilon=HP["epsilon"],
            ),
            lambda opt: {"acc": opt._accumulators[0]},
        ),
        _adam_rule("adam", False, False),
        _adam_rule("amsgrad", True, False),
        _adam_rule("adamw", False, True),
        _adam_rule("adamw_amsgrad", True, True),
        Rule(
            "ftrl",
            [("acc", HP["init_acc"]), ("lin", 0.0)],
            lambda var, s, idx, g, t: sk.sparse_ftrl(
                var,
                s["acc"],
                s["lin"],
                idx,
                g,
                HP["lr"],
                learning_rate_power=HP["lr_power"],
                l1_regularization_strength=HP["l1"],
                l2_regularization_strength=HP["l2"],
                l2_shrinkage_regularization_strength=HP["l2_shrinkage"],
                beta=HP["beta"],
            ),
            _ref_ftrl,
            lambda: keras.optimizers.Ftrl(
                learning_rate=HP["lr"],
                learning_rate_power=HP["lr_power"],
                initial_accumulator_value=HP["init_acc"],
                l1_regularization_strength=HP["l1"],
                l2_regularization_strength=HP["l2"],
                l2_shrinkage_regularization_strength=HP["l2_shrinkage"],
                beta=HP["beta"],
            ),
            lambda opt: {"acc": opt._accumulators[0], "lin": opt._linears[0]},
        ),
        _rmsprop_rule("rmsprop", False, False),
        _rmsprop_rule("rmsprop_momentum", False, True),
        _rmsprop_rule("rmsprop_centered", True, False),
        _rmsprop_rule("rmsprop_centered_momentum", True, True),
        Rule(
            "adamax",
            [("m", 0.0), ("u", 0.0)],
            lambda var, s, idx, g, t: sk.sparse_adamax(
                var, s["m"], s["u"], idx, g, HP["lr"], t,
                beta_1=HP["beta_1"], beta_2=HP["beta_2"],
                epsilon=HP["epsilon"]),
            _ref_adamax,
            lambda: keras.optimizers.Adamax(
                learning_rate=HP["lr"], beta_1=HP["beta_1"],
                beta_2=HP["beta_2"], epsilon=HP["epsilon"]),
            lambda opt: {"m": opt._m[0], "u": opt._u[0]},
        ),
        Rule(
            "adadelta",
            [("ag", 0.0), ("ad", 0.0)],
            lambda var, s, idx, g, t: sk.sparse_adadelta(
                var, s["ag"], s["ad"], idx, g, HP["lr"], rho=HP["rho"],
                epsilon=HP["epsilon"]),
            _ref_adadelta,
            lambda: keras.optimizers.Adadelta(
                learning_rate=HP["lr"], rho=HP["rho"], epsilon=HP["epsilon"]),
            lambda opt: {"ag": opt._accumulated_grads[0],
                         "ad": opt._accumulated_delta_vars[0]},
        ),
        Rule(
            "lion",
            [("m", 0.0)],
            lambda var, s, idx, g, t: sk.sparse_lion(
                var, s["m"], idx, g, HP["lr"], beta_1=HP["beta_1"],
                beta_2=HP["beta_2"]),
            _ref_lion,
            lambda: keras.optimizers.Lion(
                learning_rate=HP["lr"], beta_1=HP["beta_1"],
                beta_2=HP["beta_2"]),
            lambda opt: {"m": opt._momentums[0]},
        ),
        Rule(
            "nadam",
            [("m", 0.0), ("v", 0.0)],
            lambda var, s, idx, g, t: sk.sparse_nadam(
                var, s["m"], s["v"], idx, g, HP["lr"], *_nadam_schedule(t),
                beta_1=HP["beta_1"], beta_2=HP["beta_2"],
                epsilon=HP["epsilon"]),
            _ref_nadam,
            lambda: keras.optimizers.Nadam(
                learning_rate=HP["lr"], beta_1=HP["beta_1"],
                beta_2=HP["beta_2"], epsilon=HP["epsilon"]),
            lambda opt: {"m": opt._momentums[0], "v": opt._velocities[0]},
        ),
    ]
}


def _init_table(seed=0, rows=ROWS, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((rows, DIM)).astype(dtype)


def _make(rule, w0, keras_var=True):
    mk = keras.Variable if keras_var else tf.Variable
    var = mk(w0.copy())
    slots = {n: mk(np.full_like(w0, init)) for n, init in rule.slots}
    return var, slots


def _np(v):
    return np.asarray(v.numpy() if hasattr(v, "numpy") else v)


# ---------------------------------------------------------------------------
# Keras sparse comparison (SGD, Adagrad).


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_matches_keras_sparse(name):
    rule = RULES[name]
    w0 = _init_table(1)
    var, slots = _make(rule, w0)
    kvar = keras.Variable(w0.copy())
    opt = rule.keras_opt()
    opt.build([kvar])
    for t, (idx, g) in enumerate(_random_batches(2), start=1):
        rule.call(var, slots, idx, g, t)
        opt.apply_gradients([(_dedup_slices(idx, g), kvar)])
    np.testing.assert_allclose(_np(var), _np(kvar), rtol=1e-6, atol=1e-7)
    for n, kv in rule.keras_slots(opt).items():
        np.testing.assert_allclose(_np(slots[n]), _np(kv), rtol=1e-6, atol=1e-7)
    # Keras itself stayed sparse: never-touched rows (and slots) unchanged.
    np.testing.assert_array_equal(_np(kvar)[TOUCHABLE:], w0[TOUCHABLE:])
    for n, kv in rule.keras_slots(opt).items():
        init = dict(rule.slots)[n]
        np.testing.assert_array_equal(_np(kv)[TOUCHABLE:], F32(init))


# ---------------------------------------------------------------------------
# NumPy lazy reference, all rules.


@pytest.mark.parametrize("name", sorted(RULES))
def test_matches_numpy_lazy_reference(name):
    rule = RULES[name]
    w0 = _init_table(3)
    var, slots = _make(rule, w0, keras_var=(len(name) % 2 == 0))
    w_ref = w0.copy()
    s_ref = {n: np.full_like(w0, init) for n, init in rule.slots}
    for t, (idx, g) in enumerate(_random_batches(4), start=1):
        rule.call(var, slots, idx, g, t)
        rows, summed = _dedup_np(idx, g)
        w_rows = w_ref[rows]
        s_rows = {n: s[rows] for n, s in s_ref.items()}
        rule.ref(w_rows, s_rows, summed, t)
        w_ref[rows] = w_rows
        for n in s_ref:
            s_ref[n][rows] = s_rows[n]
    np.testing.assert_allclose(_np(var), w_ref, rtol=1e-5, atol=1e-6)
    for n in s_ref:
        np.testing.assert_allclose(_np(slots[n]), s_ref[n], rtol=1e-5, atol=1e-6)
    # Lazy: untouched rows are bit-identical.
    np.testing.assert_array_equal(_np(var)[TOUCHABLE:], w0[TOUCHABLE:])
    for n, init in rule.slots:
        np.testing.assert_array_equal(_np(slots[n])[TOUCHABLE:], F32(init))


# ---------------------------------------------------------------------------
# Every row touched every step == Keras' dense update.


@pytest.mark.parametrize("name", sorted(RULES))
def test_all_rows_touched_matches_keras_dense(name):
    rule = RULES[name]
    rows = 8
    w0 = _init_table(5, rows=rows)
    var, slots = _make(rule, w0)
    kvar = keras.Variable(w0.copy())
    opt = rule.keras_opt()
    opt.build([kvar])
    rng = np.random.default_rng(6)
    for t in range(1, STEPS + 1):
        g = rng.standard_normal((rows, DIM)).astype(np.float32)
        perm = rng.permutation(rows).astype(np.int64)
        rule.call(var, slots, perm, g[perm], t)
        opt.apply_gradients([(tf.constant(g), kvar)])
    np.testing.assert_allclose(_np(var), _np(kvar), rtol=1e-5, atol=1e-6)
    for n, kv in rule.keras_slots(opt).items():
        np.testing.assert_allclose(_np(slots[n]), _np(kv), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Semantics details.


def test_duplicates_are_summed_before_the_update():
    var = tf.Variable(np.zeros((3, 2), np.float32))
    acc = tf.Variable(np.full((3, 2), 0.1, np.float32))
    g = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, 0.5]], np.float32)
    sk.sparse_adagrad(var, acc, np.array([1, 2, 1]), g, 1.0, epsilon=0.0)
    s = g[0] + g[2]
    np.testing.assert_allclose(acc.numpy()[1], 0.1 + s * s, rtol=1e-6)
    np.testing.assert_allclose(acc.numpy()[2], 0.1 + g[1] ** 2, rtol=1e-6)
    np.testing.assert_array_equal(acc.numpy()[0], np.float32(0.1))
    np.testing.assert_allclose(
        var.numpy()[1], -s / np.sqrt(np.float32(0.1) + s * s), rtol=1e-6
    )


def test_out_of_range_index_raises_and_leaves_everything_untouched():
    rule = RULES["adam"]
    w0 = _init_table(7)
    var, slots = _make(rule, w0)
    rule.call(var, slots, np.array([0, 3]), np.ones((2, DIM), np.float32), 1)
    before = {n: _np(s).copy() for n, s in slots.items()}
    w_before = _np(var).copy()
    for bad in (ROWS, -1):
        idx = np.array([2, 3, bad, 4], np.int64)
        with pytest.raises(tf.errors.InvalidArgumentError) as e:
            rule.call(var, slots, idx, np.ones((4, DIM), np.float32), 2)
        msg = str(e.value)
        assert "SokSparseApplyAdam" in msg
        assert f"indices[2] = {bad}" in msg
        assert f"{ROWS} rows" in msg
        np.testing.assert_array_equal(_np(var), w_before)
        for n, s in slots.items():
            np.testing.assert_array_equal(_np(s), before[n])


def test_out_of_range_in_tf_function():
    var = tf.Variable(np.zeros((5, DIM), np.float32))

    @tf.function
    def step(idx):
        sk.sparse_sgd(var, idx, tf.ones((2, DIM)), 0.1)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 7"):
        step(tf.constant([1, 7], tf.int64))
    np.testing.assert_array_equal(var.numpy(), 0.0)


def test_shape_mismatches_raise_clearly():
    var = tf.Variable(np.zeros((5, DIM), np.float32))
    acc = tf.Variable(np.zeros((5, DIM), np.float32))
    bad_slot = tf.Variable(np.zeros((5, DIM + 1), np.float32))
    idx = np.array([0, 1], np.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not match var"):
        sk.sparse_sgd(var, idx, np.ones((2, DIM + 1), np.float32), 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="number of indices"):
        sk.sparse_sgd(var, idx, np.ones((3, DIM), np.float32), 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="slot 'accumulator'"):
        sk.sparse_adagrad(var, bad_slot, idx, np.ones((2, DIM), np.float32), 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="same variable"):
        sk.sparse_adagrad(var, var, idx, np.ones((2, DIM), np.float32), 0.1)
    with pytest.raises(ValueError, match="scalar"):
        sk.sparse_sgd(var, idx, np.ones((2, DIM), np.float32), [0.1, 0.2])
    np.testing.assert_array_equal(var.numpy(), 0.0)
    np.testing.assert_array_equal(acc.numpy(), 0.0)

    # Inside tf.function the shape function rejects it when tracing.
    @tf.function
    def f(g):
        sk.sparse_sgd(var, idx, g, 0.1)

    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        f(tf.ones((2, DIM + 1)))
    np.testing.assert_array_equal(var.numpy(), 0.0)


def test_tf_function_matches_eager_with_tensor_hyperparameters():
    w0 = _init_table(8)
    batches = _random_batches(9, steps=4)
    lr_sched = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)

    def run(use_function):
        var = keras.Variable(w0.copy())
        m = keras.Variable(np.zeros_like(w0))
        v = keras.Variable(np.zeros_like(w0))
        it = tf.Variable(0, dtype=tf.int64)

        def step(idx, g):
            lr = lr_sched(it)
            op = sk.sparse_adam(var, m, v, idx, g, lr, tf.cast(it + 1, tf.float32))
            with tf.control_dependencies([op] if op is not None else []):
                it.assign_add(1)

        fn = tf.function(step) if use_function else step
        for idx, g in batches:
            fn(tf.constant(idx), tf.constant(g))
        return var.numpy(), m.numpy(), v.numpy()

    for a, b in zip(run(False), run(True)):
        np.testing.assert_allclose(a, b, rtol=1e-6)

    # Eagerly the functions return None; in a graph, the tf.Operation.
    var = tf.Variable(w0.copy())
    assert sk.sparse_sgd(var, [0], tf.ones((1, DIM)), 0.1) is None
    seen = []

    @tf.function
    def graph_op():
        seen.append(sk.sparse_sgd(var, [0], tf.ones((1, DIM)), 0.1))

    graph_op()
    assert isinstance(seen[0], tf.Operation)
    assert seen[0].type == "SokSparseApplySgd"


def test_copy_on_write_keeps_earlier_reads():
    w0 = _init_table(10)
    for keras_var in (True, False):
        var = keras.Variable(w0.copy()) if keras_var else tf.Variable(w0.copy())
        tv = var.value if keras_var else var
        acc = tf.Variable(np.full_like(w0, 0.1))
        read = tv.read_value()
        acc_read = acc.read_value()
        sk.sparse_adagrad(var, acc, [1, 2], np.ones((2, DIM), np.float32), 0.5)
        np.testing.assert_array_equal(read.numpy(), w0)
        np.testing.assert_array_equal(acc_read.numpy(), np.float32(0.1))
        assert not np.array_equal(tv.numpy(), w0)
        np.testing.assert_array_equal(tv.numpy()[3:], w0[3:])

    # Same inside a tf.function: the read is ordered before the update.
    var = tf.Variable(w0.copy())

    @tf.function
    def f():
        r = var.read_value()
        sk.sparse_sgd(var, [0], tf.ones((1, DIM)), 1.0)
        return r, var.read_value()

    r, after = f()
    np.testing.assert_array_equal(r.numpy(), w0)
    np.testing.assert_allclose(after.numpy()[0], w0[0] - 1.0, rtol=1e-6)


def test_float64_and_int32_indices():
    rule = RULES["rmsprop_centered_momentum"]
    w0 = _init_table(11, dtype=np.float64)
    var, slots = _make(rule, w0, keras_var=False)
    idx, g = _random_batches(12, steps=1)[0]
    rule.call(var, slots, idx.astype(np.int32), g.astype(np.float64), 1)
    assert var.dtype == tf.float64
    rows, summed = _dedup_np(idx, g.astype(np.float64))
    w_rows = w0[rows].copy()
    s_rows = {n: np.full_like(w_rows, i) for n, i in rule.slots}
    _REF_DTYPE[0] = np.float64
    try:
        rule.ref(w_rows, s_rows, summed, 1)
    finally:
        _REF_DTYPE[0] = np.float32
    np.testing.assert_allclose(var.numpy()[rows], w_rows, rtol=1e-12)


def test_empty_indices_is_a_noop():
    w0 = _init_table(13)
    var = tf.Variable(w0.copy())
    sk.sparse_sgd(var, np.zeros([0], np.int64), np.zeros([0, DIM], np.float32), 0.1)
    np.testing.assert_array_equal(var.numpy(), w0)


def test_copy_on_write_is_counted_and_a_training_step_copies_nothing():
    """`build_info()["variable_copy_bytes"]` counts the bytes an update
    copies because the table's buffer is still shared with an earlier read
    (that read keeps its values); a compiled train step of a sok model
    copies nothing."""
    import sok_keras as sok
    from sok_keras import _ops

    var = tf.Variable(np.ones((6, 4), np.float32))
    before = _ops.build_info()["variable_copy_bytes"]
    held = tf.identity(var.read_value())  # shares the buffer
    sk.sparse_sgd(var, tf.constant([1]), tf.ones([1, 4]), 0.5)
    assert _ops.build_info()["variable_copy_bytes"] - before == 6 * 4 * 4
    np.testing.assert_array_equal(held.numpy(), np.ones((6, 4)))
    assert var.numpy()[1].tolist() == [0.5] * 4

    inp = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(100, 8, combiner="sum")(inp)
    model = keras.Model(inp, keras.layers.Dense(1)(emb))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(1e-2)), loss="mse")
    x = np.random.default_rng(0).integers(0, 100, (32, 3))
    y = np.zeros((32, 1), np.float32)
    model.train_on_batch(x, y)
    before = _ops.build_info()["variable_copy_bytes"]
    for _ in range(3):
        model.train_on_batch(x, y)
    assert _ops.build_info()["variable_copy_bytes"] == before
