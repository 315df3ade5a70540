"""model.compile with a plain Keras optimizer on a model with sok tables
wraps it in OptimizerWrapper (sok_keras/optimizers/auto_wrap.py)."""

import logging

import keras
import numpy as np
import tensorflow as tf

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


class _Tower(keras.layers.Layer):
    """A custom layer that keeps a sok layer as an attribute (no `.layers`)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.emb = sok.layers.DistributedEmbedding(500, 4, combiner="sum")
        self.dense = keras.layers.Dense(4)

    def build(self, input_shape):
        self.emb.build(input_shape)
        self.dense.build((None, 4))

    def call(self, x):
        return self.dense(self.emb(x))


def test_sok_layers_inside_custom_layers_are_found():
    x = np.random.default_rng(0).integers(0, 500, (64, 3))
    y = np.ones((64, 1), np.float32)
    ids = keras.Input((3,), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(_Tower()(ids)))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    assert isinstance(model.optimizer, sok.optimizers.OptimizerWrapper)
    model.fit(x, y, epochs=1, verbose=0)
    full = [v for v in model.optimizer.variables
            if tuple(v.shape) == (500, 4) and not is_sok_variable(v)]
    assert full == []


class _OwnLookup(keras.Model):
    """A subclassed model that holds a sok.Variable and looks it up itself."""

    def build(self, input_shape):
        self.table = sok.Variable(np.zeros((50, 4), np.float32))
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        ids = tf.RaggedTensor.from_tensor(x)
        return self.dense(
            sok.lookup_sparse([self.table], [ids], combiners=["sum"])[0])


def test_a_table_looked_up_by_a_custom_model_is_found():
    model = _OwnLookup()
    model(np.zeros((2, 3), np.int64))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    assert isinstance(model.optimizer, sok.optimizers.OptimizerWrapper)


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
    """compile(optimizer="adam") wraps it (before: the ranks' Dense kernels
    drifted apart, 2.9406 vs 3.0154). Outside compile nothing wraps a
    plain Keras optimizer: a custom loop's says on rank 0, once, what it
    does with the sok table (its dense gradients are not averaged: the
    ranks' kernels drift apart, as the test shows) and how to wrap it
    (before: not a word); the same loop with OptimizerWrapper keeps them
    equal."""
    r0, r1 = run_workers(worker_path("plain_optimizer"), 2, timeout=120)
    assert r0["wrapped"] and r1["wrapped"]
    np.testing.assert_array_equal(r0["kernel"], r1["kernel"])
    # A predict before any training uses rank 0's dense weights on every
    # rank (each rank initialized its own from another seed; before: the
    # ranks predicted with 2 different models).
    np.testing.assert_array_equal(r0["first_kernel"], r1["first_kernel"])
    np.testing.assert_array_equal(r0["first_predictions"],
                                  r1["first_predictions"])
    assert len(r0["plain_warnings"]) == 1 and r1["plain_warnings"] == []
    warning = r0["plain_warnings"][0]
    assert ("plain Keras optimizer Adam updates sok table(s) "
            "'distributed_embedding_1/embeddings' and 2 dense weight(s) on "
            "2 ranks") in warning
    assert "sok.OptimizerWrapper(keras.optimizers.Adam(...))" in warning
    assert not np.allclose(r0["plain_kernel"], r1["plain_kernel"])
    np.testing.assert_array_equal(r0["loop_kernel"], r1["loop_kernel"])


def test_plain_optimizers_leave_an_empty_localized_shard_alone():
    """SOK's raw loop with a plain Keras optimizer on a localized table
    owned by rank 0: rank 1's shard is `[0, dim]`, and every rule steps
    without touching it (before: Adadelta, Ftrl, RMSprop, Lion and Nadam
    failed there, "Biases must be 1D: [0,4]", and the other rank then
    timed out). The owner's rows and the dense weight move on both."""
    r0, r1 = run_workers(worker_path("plain_optimizer_localized"), 2,
                         timeout=180)
    del r0["pid"], r1["pid"]
    alone0, alone1 = r0.pop("table_alone_nadam"), r1.pop("table_alone_nadam")
    assert alone0 == alone1 and alone0["iterations"] == 2
    assert alone0["u_product"] < 0.5
    assert sorted(r0) == sorted(r1) and len(r0) == 10
    # Nadam's schedule moves on the rank with nothing to update too.
    assert r0["Nadam"]["u_product"] == r1["Nadam"]["u_product"] < 0.5
    for name, res in r1.items():
        assert res["error"] is None, (name, res["error"])
        assert res["shard_shape"] == [0, 4] and res["table"] == []
        assert res["iterations"] == 1 and res["dense_moved"], name
    for name, res in r0.items():
        assert res["error"] is None, (name, res["error"])
        assert res["shard_shape"] == [11, 4] and res["iterations"] == 1
        # Rows 1-5 were looked up (by one rank or the other). (Keras'
        # dense rules may move the others too: AdamW decays every row,
        # Ftrl recomputes every row from its linear slot.)
        table = np.asarray(res["table"])
        assert np.all(np.any(table[1:6] != 1.0, axis=1)), name


class TablesInBuild(keras.Model):
    """A subclassed model that makes its layers in `build()`."""

    def build(self, input_shape):
        self.emb = sok.layers.DistributedEmbedding(50, 4, combiner="mean",
                                                   name="emb")
        self.emb.build(input_shape)
        self.head = keras.layers.Dense(1)
        self.head.build((None, 4))

    def call(self, ids):
        return self.head(self.emb(ids))


class TablesInInit(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = sok.layers.DistributedEmbedding(50, 4, combiner="mean",
                                                   name="emb")
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(self.emb(ids))


class DenseInBuild(keras.Model):
    """A Keras-only subclassed model that makes its layers in `build()`."""

    def build(self, input_shape):
        self.emb = keras.layers.Embedding(50, 4, name="emb")
        self.emb.build(input_shape)
        self.head = keras.layers.Dense(1)
        self.head.build((None, 3, 4))

    def call(self, ids):
        return keras.ops.sum(self.head(self.emb(ids)), axis=1)


def test_an_early_build_pulls_no_batch_of_a_reshuffled_dataset():
    """The build of a model that makes its tables in `build()` reads the
    dataset's shapes, not a batch: Keras resets the iterator after it,
    and a seeded `shuffle` reshuffles each iteration, so a pulled batch
    made the first epoch train on the pipeline's second order (found by
    QA: the model trained on other batches than the same model made in
    `__init__`, and on N ranks than on one process)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 3))
    y = rng.random((64, 1)).astype(np.float32)
    tables = {}
    for case, cls in (("init", TablesInInit), ("build", TablesInBuild)):
        keras.utils.set_random_seed(1)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            64, seed=7).batch(16, drop_remainder=True)
        model = cls()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.fit(ds, epochs=2, verbose=0)
        tables[case] = model.emb.embeddings.numpy()
    np.testing.assert_allclose(tables["build"], tables["init"], rtol=1e-6,
                               atol=1e-7)


def test_tables_made_in_build_after_compile():
    """`compile` of an unbuilt model that makes its sok layers in
    `build()` sees no table, so it cannot wrap the optimizer. Before,
    `fit` trained the table with Keras' dense Adam (full-size slots in
    `optimizer.variables`, 0.148 off the same model made in `__init__`; on
    2 ranks, the ranks silently trained different models); then it
    refused the model; and on a GPU, where `compile` turns XLA on for a
    model it sees no sok layer in, XLA refused the lookup. Now `fit` (and
    `evaluate`, `train_on_batch`) builds such a model from the first
    batch, wraps its optimizer and turns XLA off: it trains as the
    `__init__` model (bit for bit on a CPU), whether built before `fit`
    or not. A
    custom loop stepping the compiled optimizer on the tables is still
    refused, saying how to build first."""
    import pytest

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 3))
    y = rng.random((64, 1)).astype(np.float32)
    tables = {}
    for case in ("init", "build", "build_called_first", "build_jit"):
        keras.utils.set_random_seed(1)
        model = TablesInInit() if case == "init" else TablesInBuild()
        # (jit_compile=True: what "auto" resolves to on a GPU for a model
        # that shows no layer without XLA kernels.)
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse",
                      jit_compile=case in ("build_jit", "build_called_first"))
        if case == "build_called_first":
            model(x[:2])  # built after compile, before fit
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        assert isinstance(model.optimizer, sok.OptimizerWrapper), case
        assert model.jit_compile is False, case
        assert not [v for v in model.optimizer.variables
                    if "emb" in v.path]
        assert sorted(model.emb.embeddings.slots) == ["m", "v"]
        tables[case] = model.emb.embeddings.numpy()
    # Equal on a CPU; on a GPU the sums' order (and XLA's autotuned
    # kernels, chosen anew by each compilation) may differ by a rounding
    # (6e-8 in GPU run 23, 1.7e-8 for the Keras-only model below in run 24;
    # Keras' dense Adam was 0.148 off).
    gpu = bool(tf.config.list_physical_devices("GPU"))

    def assert_same(a, b):
        if gpu:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)

    for case in ("build", "build_called_first", "build_jit"):
        assert_same(tables[case], tables["init"])
    # A custom loop with the compiled (unwrapped) optimizer is refused.
    keras.utils.set_random_seed(1)
    model = TablesInBuild()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x[:16]) - y[:16]) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(ValueError, match=(
            r"model '(tables_in_build_\d+)' made its sok table\(s\) "
            r"\['\1/emb/embeddings'\] after `compile`.*Build the model "
            r"before `compile`.*compiling it again wraps the optimizer.*"
            r"sok.OptimizerWrapper\(keras.optimizers.Adam\(...\)\)")):
        model.optimizer.apply_gradients(zip(grads,
                                            model.trainable_variables))
    # ... and compiling it again, now that it is built, wraps it.
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    assert isinstance(model.optimizer, sok.OptimizerWrapper)
    model.fit(x, y, batch_size=16, verbose=0)
    # A Keras-only model that makes its layers in build() trains as it
    # does built before fit (the early build changes nothing for it).
    weights = []
    for call_first in (False, True):
        keras.utils.set_random_seed(1)
        model = DenseInBuild()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse",
                      jit_compile=True)
        if call_first:
            model(x[:2])
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        assert model.jit_compile is True
        assert not isinstance(model.optimizer, sok.OptimizerWrapper)
        weights.append([w.numpy() for w in model.weights])
    for a, b in zip(*weights):
        assert_same(a, b)
    # ... also under a strategy, whose scope Keras builds it in (the early
    # build stays out of its way: before, a one-replica MirroredStrategy
    # failed in the optimizer's update).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = DenseInBuild()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    assert isinstance(model.head.kernel.value,
                      tf.distribute.DistributedValues)
    # An optimizer once compiled into another unbuilt model, then used in
    # a custom loop on a table (as SOK's raw loop does), is not refused:
    # the tables are not that model's.
    opt = keras.optimizers.SGD(0.1)
    keras.Sequential([keras.layers.Dense(1)]).compile(opt, "mse")
    table = sok.Variable(np.ones((8, 2), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(
            [table], [tf.ragged.constant([[1]], dtype=tf.int64)])[0])
    opt.apply_gradients([(tape.gradient(loss, table), table)])
    np.testing.assert_allclose(table.numpy()[1], [0.9, 0.9])


def test_tables_made_in_build_after_compile_on_two_ranks():
    """The first `fit` of such a model on 2 ranks is every rank's, as for
    the model made in `__init__`: global logs, the same on both ranks (and
    equal to the `__init__` model's), the first steps compared, the
    optimizer wrapped (before: each rank logged its own loss)."""
    r0, r1 = run_workers(worker_path("tables_in_build"), 2, timeout=120)
    for r in (r0, r1):
        for name in ("TablesInInit", "TablesInBuild"):
            assert r[name]["optimizer"] == "OptimizerWrapper", (name, r)
        np.testing.assert_allclose(r["TablesInBuild"]["loss"],
                                   r["TablesInInit"]["loss"], rtol=1e-6)
        np.testing.assert_allclose(r["TablesInBuild"]["kernel"],
                                   r["TablesInInit"]["kernel"], rtol=1e-6)
    assert r0["TablesInBuild"]["loss"] == r1["TablesInBuild"]["loss"]


def test_one_rank_keeps_plain_optimizers_for_tables():
    """One process: a plain Keras optimizer may update a sok table (Keras'
    own dense update, as for a keras.layers.Embedding)."""
    table = sok.Variable(np.ones((4, 2), np.float32), name="t")
    opt = keras.optimizers.Adam(0.1)
    opt.apply_gradients([(tf.ones((4, 2)), table)])
    assert np.all(table.numpy() < 1)


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


def _mixed_model():
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(50, 4, combiner="sum")
    hidden = keras.layers.Dense(4, activation="relu")(emb(ids))
    return keras.Model(ids, keras.layers.Dense(1, dtype="float32")(hidden))


def _nesting(opt):
    out = []
    while opt is not None:
        out.append(type(opt).__name__)
        opt = getattr(opt, "inner_optimizer", None)
    return out


def test_mixed_float16_scales_the_loss_outside_the_wrapper():
    """Keras wraps the compiled optimizer in LossScaleOptimizer: it must
    sit outside OptimizerWrapper (whose sparse table updates then get the
    unscaled gradients), also when the user passes a LossScaleOptimizer
    around a plain optimizer. An overflowing step is skipped."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _mixed_model()
        model.compile(optimizer="adam", loss="mse")
        assert _nesting(model.optimizer) == [
            "LossScaleOptimizer", "OptimizerWrapper", "Adam"]
        model = _mixed_model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=64.0,
            dynamic_growth_steps=7, name="lso"), loss="mse")
        opt = model.optimizer
        assert _nesting(opt) == ["LossScaleOptimizer", "OptimizerWrapper",
                                 "SGD"]
        assert (opt.initial_scale, opt.dynamic_growth_steps, opt.name) == (
            64.0, 7, "lso")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 50, (8, 3))
        y = np.full((8, 1), 0.1, np.float32)
        model.train_on_batch(x, y)
        assert int(opt.iterations.numpy()) == 1
        table = model.layers[1].embeddings.numpy().copy()
        huge = np.ones(8, np.float32)
        huge[0] = 1e30  # the scaled gradients overflow float16
        model.train_on_batch(x, y, sample_weight=huge)
        assert int(opt.iterations.numpy()) == 1  # skipped
        assert float(opt.dynamic_scale.numpy()) == 32.0
        np.testing.assert_array_equal(table,
                                      model.layers[1].embeddings.numpy())
        model.train_on_batch(x, y)
        assert int(opt.iterations.numpy()) == 2
        assert not np.array_equal(table, model.layers[1].embeddings.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_loss_scale_finite_check_of_plain_optimizers_is_keras_own():
    import tensorflow as tf

    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert bool(opt.check_finite([tf.ones([2]), None]))
    assert not bool(opt.check_finite([tf.constant([1.0, np.inf])]))
    wrapped = keras.optimizers.LossScaleOptimizer(
        sok.optimizers.OptimizerWrapper(keras.optimizers.SGD()))
    slices = tf.IndexedSlices(tf.constant([[np.nan]]), tf.constant([0]),
                              tf.constant([3, 1]))
    assert not bool(wrapped.check_finite([slices]))
    assert bool(wrapped.check_finite([tf.IndexedSlices(
        tf.constant([[1.0]]), tf.constant([0]), tf.constant([3, 1]))]))


def test_a_model_whose_tables_are_all_frozen_trains_with_any_optimizer(
        tmp_path):
    """As with a frozen `keras.layers.Embedding`: no table is updated, so
    an optimizer with no sparse rule (Lamb) trains the dense weights,
    exactly as Keras does, and the model saves and loads (before: compile
    refused it). Unfrozen and compiled again, the table needs a sparse
    rule, and says so."""
    import pytest

    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (32, 4))
    y = rng.random((32, 1)).astype(np.float32)
    table = rng.normal(size=(50, 4)).astype(np.float32)
    weights = []
    for kind in ("keras", "sok"):
        keras.utils.set_random_seed(1)
        emb = (keras.layers.Embedding(50, 4, trainable=False, name="emb")
               if kind == "keras" else sok.layers.DistributedEmbedding(
                   50, 4, combiner=None, trainable=False, name="emb"))
        ids = keras.Input((4,), dtype="int64")
        model = keras.Model(ids, keras.layers.Dense(1, name="out")(
            keras.layers.Flatten()(emb(ids))))
        emb.embeddings.assign(table)
        model.compile(keras.optimizers.Lamb(0.01), "mse")
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        weights.append([np.asarray(w) for w in model.get_weights()])
    for ours, ref in zip(*weights):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(emb.embeddings.numpy(), table)
    path = str(tmp_path / "frozen.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert not loaded.optimizer.check_sparse_rule
    loaded.fit(x, y, batch_size=8, verbose=0)
    emb.trainable = True
    with pytest.raises(ValueError, match="no sparse update rule for Lamb"):
        model.compile(keras.optimizers.Lamb(0.01), "mse")


def test_tables_with_their_own_optimizers_free_the_model_optimizer(
        tmp_path):
    """Each table trained by its own optimizer (a layer's `optimizer=`, a
    keras-rs `TableConfig.optimizer`): the model's optimizer trains only
    the dense weights, so one with no sparse rule (Lamb, Adafactor) is taken,
    and the model saves, loads and trains on (before: compile refused it).
    A table the model's optimizer would train is still refused, by name."""
    import pytest

    rng = np.random.default_rng(0)
    x = rng.integers(0, 48, (32, 3))
    y = rng.random((32, 1)).astype(np.float32)

    def model(table_optimizer):
        ids = keras.Input((3,), dtype="int64")
        emb = sok.layers.DistributedEmbedding(48, 4, name="user_table",
                                              optimizer=table_optimizer)
        return keras.Model(ids, keras.layers.Dense(1)(emb(ids)))

    for opt in (keras.optimizers.Lamb(0.01), keras.optimizers.Adafactor()):
        m = model(keras.optimizers.Adagrad(0.1))
        table0 = m.get_layer("user_table").embeddings.numpy()
        m.compile(opt, "mse")
        m.fit(x, y, batch_size=8, verbose=0)
        table = m.get_layer("user_table").embeddings
        assert sorted(table.slots) == ["accumulator"]  # Adagrad's
        assert not np.array_equal(table.numpy(), table0)
    path = str(tmp_path / "own.keras")
    m.save(path)
    loaded = keras.saving.load_model(path)
    loaded.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=(
            r"table 'user_table/embeddings' is trained by the model's "
            r"optimizer Lamb: .*no sparse update rule for Lamb.*"
            r"optimizer of its own")):
        model(None).compile(keras.optimizers.Lamb(0.01), "mse")


def test_sgd_weight_decay_with_excluded_tables_saves_and_loads(tmp_path):
    """SGD's `weight_decay` decays the tables lazily (before: refused), and
    `exclude_from_weight_decay` leaves them out: one step moves the table
    as with no decay (the dense weights decay; a second step would see
    them). The model saves and loads (Keras
    does not save the exclusions: the loaded optimizer decays the table
    too, as Keras' own would), and trains on."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 500, (32, 3))
    y = rng.random((32, 1)).astype(np.float32)
    tables = {}
    for kind in ("excluded", "none", "decayed"):
        keras.utils.set_random_seed(2)
        model = _model()
        opt = keras.optimizers.SGD(0.1, weight_decay=(
            0.0 if kind == "none" else 0.5))
        if kind == "excluded":
            opt.exclude_from_weight_decay(var_names=["embeddings"])
        model.compile(opt, "mse")
        model.fit(x, y, batch_size=32, verbose=0, shuffle=False)  # 1 step
        tables[kind] = model.layers[1].embeddings.numpy()
        if kind == "excluded":
            path = str(tmp_path / "wd.keras")
            model.save(path)
            loaded = keras.saving.load_model(path)
            loaded.fit(x, y, batch_size=8, verbose=0)
    np.testing.assert_array_equal(tables["excluded"], tables["none"])
    assert not np.allclose(tables["decayed"], tables["none"])


def test_the_plain_optimizer_warning_is_said_once_per_build(monkeypatch,
                                                            caplog):
    """(As if on rank 0 of 2.) A LossScaleOptimizer around a plain one
    warns once, for the inner optimizer (before: twice, the second telling
    to wrap the LossScaleOptimizer, which OptimizerWrapper refuses); a
    table alone (SOK's seed: plain SGD on tables) and a wrapped optimizer
    say nothing."""
    from sok_keras import world

    monkeypatch.setattr(world, "num_ranks", lambda: 2)
    monkeypatch.setattr(world, "rank", lambda: 0)
    table = sok.Variable(np.ones((4, 2), np.float32), name="t")
    dense = keras.Variable(np.ones((2,), np.float32), name="d")
    with caplog.at_level(logging.WARNING, logger="sok_keras"):
        keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam()).build([table, dense])
        keras.optimizers.SGD().build([table])
        sok.OptimizerWrapper(keras.optimizers.Adam()).inner_optimizer.build(
            [dense])
    said = [r.getMessage() for r in caplog.records
            if "plain Keras optimizer" in r.getMessage()]
    assert len(said) == 1 and "optimizer Adam updates sok table(s) 't'" in (
        said[0]), said


def test_the_first_step_is_traced_once():
    """The optimizer of a built model with sok tables is built before the
    first step (as Keras does under a strategy): before, Keras built it
    inside the first traced step, and TensorFlow traced the step again
    because that trace made variables (QA: about half the time to the
    first step of a model of 40 tables on 2 ranks). A model with a layer
    not built yet is still left to Keras, which builds the optimizer for
    the weights that layer makes in the step."""
    x = np.random.default_rng(0).integers(0, 500, (16, 3))
    y = np.zeros((16, 1), np.float32)
    for optimizer in ("adam", sok.OptimizerWrapper(keras.optimizers.Adam())):
        model = _model()
        model.compile(optimizer=optimizer, loss="mse")
        traces = []
        step = model.train_step

        def counted(data, step=step):
            traces.append(1)
            return step(data)

        model.train_step = counted
        model.fit(x, y, batch_size=8, verbose=0)
        assert len(traces) == 1, optimizer
        assert len(model.optimizer.variables) > 2  # (Adam's slots)

    # `evaluate` builds no optimizer (review: an evaluate-only job got the
    # tables' slots, and `fit` after a change of the trainable weights
    # failed with "Unknown variable").
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    model.layers[-1].trainable = False
    model.evaluate(x, y, verbose=0)
    assert not model.optimizer.built
    model.layers[-1].trainable = True
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.optimizer.built

    class Cell(keras.layers.Layer):  # no build(): weights made in a step
        def __init__(self):
            super().__init__()
            self.state_size = self.output_size = 2
            self.dense = keras.layers.Dense(2)

        def call(self, inputs, states):
            h = self.dense(keras.ops.concatenate([inputs, states[0]], -1))
            return h, [h]

    ids = keras.Input((2, 3), dtype="int64")
    cell = Cell()
    emb = keras.layers.TimeDistributed(
        sok.layers.DistributedEmbedding(500, 4, combiner="sum"))(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.RNN(cell)(
        emb)))
    model.compile(optimizer="adam", loss="mse")
    assert not cell.dense.built
    model.fit(np.stack([x, x], 1), y, batch_size=8, verbose=0)
    assert any(cell.dense.kernel is v
               for v in model.optimizer.inner_optimizer._trainable_variables)
