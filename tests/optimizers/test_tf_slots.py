"""Tables' optimizer slots in TensorFlow's object-based checkpoints
(`sok_keras/optimizers/tf_slots.py`): `tf.train.Checkpoint`,
`CheckpointManager` and `tf.saved_model.save` of a model compiled with a sok
optimizer save and restore the tables' slots, as Keras' own optimizers'
state is saved and restored."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 50, size=(48, 3)),
            rng.normal(size=(48, 1)).astype("float32"))


def _model(table_optimizer=None):
    ids = keras.Input(shape=(3,), dtype="int64")
    a = sok.layers.DistributedEmbedding(
        50, 4, combiner="sum", name="a",
        embeddings_initializer=keras.initializers.RandomNormal(seed=1))
    b = sok.layers.DistributedEmbedding(
        50, 4, combiner="mean", name="b", optimizer=table_optimizer,
        embeddings_initializer=keras.initializers.RandomNormal(seed=2))
    x = keras.layers.Concatenate()([a(ids), b(ids)])
    out = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(seed=3))(x)
    return keras.Model(ids, out)


OPTIMIZERS = {
    "wrapper_adam": lambda: sok.OptimizerWrapper(keras.optimizers.Adam(0.05)),
    "sok_adam": lambda: sok.optimizers.Adam(0.05),
    "wrapper_ftrl": lambda: sok.OptimizerWrapper(keras.optimizers.Ftrl(0.1)),
    # The model's Adam, and table b's own Adagrad (its slot name differs).
    "table_optimizer": lambda: sok.OptimizerWrapper(
        keras.optimizers.Adam(0.05)),
}


def _compiled(name):
    model = _model(keras.optimizers.Adagrad(0.2)
                   if name == "table_optimizer" else None)
    model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
    return model


def _state(model):
    """Every table's rows and slots, and the dense weights."""
    out = {}
    for layer in ("a", "b"):
        table = model.get_layer(layer).embeddings
        out[layer] = table.numpy().copy()
        for slot, var in table.slots.items():
            out[f"{layer}.{slot}"] = var.numpy().copy()
    for i, w in enumerate(model.layers[-1].weights):
        out[f"dense{i}"] = w.numpy().copy()
    return out


def _assert_same(actual, desired):
    assert sorted(actual) == sorted(desired)
    for key in desired:
        np.testing.assert_array_equal(actual[key], desired[key], err_msg=key)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_checkpoint_restores_the_tables_slots(name, tmp_path):
    x, y = _data()
    model = _compiled(name)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = ckpt.save(str(tmp_path / "ck"))
    saved = _state(model)
    slots = [k for k in saved if "." in k]
    assert len(slots) >= 2, saved.keys()
    if name == "table_optimizer":
        assert "b.accumulator" in slots and "a.m" in slots, slots
    # Every slot is in the checkpoint, beside its table.
    keys = [k for k, _ in tf.train.list_variables(path)]
    assert sum(".OPTIMIZER_SLOT" in k and "VARIABLE_VALUE" in k
               for k in keys) == len(slots), keys
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    moved = _state(model)
    assert any(not np.array_equal(moved[k], saved[k]) for k in slots)
    ckpt.restore(path).assert_consumed()
    _assert_same(_state(model), saved)


@pytest.mark.parametrize("name", ["wrapper_adam", "sok_adam",
                                  "table_optimizer"])
def test_a_checkpoint_restored_before_the_first_step_continues_training(
        name, tmp_path):
    """Restored into a new model whose optimizer has no slots yet: the rows
    are kept and applied when the optimizer makes them, so training goes on
    as if it had not stopped."""
    x, y = _data()
    model = _compiled(name)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ck"))
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    expected = _state(model)

    keras.utils.clear_session()
    fresh = _compiled(name)
    assert not fresh.get_layer("a").embeddings.slots
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    fresh.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    _assert_same(_state(fresh), expected)


def test_a_checkpoint_restored_into_a_new_optimizer_of_a_trained_model(
        tmp_path):
    """The model compiled again with a new optimizer, then restored from a
    checkpoint before its first step: the checkpoint's slots go to the new
    optimizer (not into the old one's, which it drops when it makes its
    own), so training goes on as from a fresh model restored alike."""
    x, y = _data()
    model = _compiled("wrapper_adam")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ck"))
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.compile(optimizer=OPTIMIZERS["wrapper_adam"](), loss="mse")
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)

    keras.utils.clear_session()
    fresh = _compiled("wrapper_adam")
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    fresh.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    _assert_same(_state(model), _state(fresh))


def test_slots_restored_for_one_optimizer_wait_for_that_optimizer(
        tmp_path):
    """A checkpoint restored into an optimizer before its first step, then
    the model compiled with a new optimizer: the new one starts from fresh
    slots, as in Keras (before: it took the restored ones, which waited on
    the table under their name only); the first, compiled again, gets
    them."""
    x, y = _data()
    model = _compiled("wrapper_adam")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    saved = _state(model)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ck"))
    keras.utils.clear_session()
    fresh = _compiled("wrapper_adam")
    first = fresh.optimizer
    tf.train.Checkpoint(model=fresh, optimizer=first).restore(path)
    table = fresh.get_layer("a").embeddings
    fresh.compile(optimizer=OPTIMIZERS["wrapper_adam"](), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    for name in ("m", "v"):
        np.testing.assert_array_equal(table.slots[name].numpy(), 0.0)
    fresh.compile(optimizer=first, loss="mse")
    first.build(fresh.trainable_variables)
    for name in ("m", "v"):
        np.testing.assert_array_equal(table.slots[name].numpy(),
                                      saved[f"a.{name}"])


@pytest.mark.parametrize("kind", ["wrapper_adam", "sok_adam"])
def test_a_checkpoint_manager_and_saved_model_take_the_model(tmp_path,
                                                              kind):
    """(QA: with `sok.optimizers.Adam` the SavedModel held none of the
    tables' slots, which checkpoints.md promises.)"""
    x, y = _data()
    model = _compiled(kind)
    model.fit(x, y, batch_size=16, verbose=0)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer),
        str(tmp_path / "m"), max_to_keep=2)
    manager.save()
    saved = _state(model)
    model.fit(x, y, batch_size=16, verbose=0)
    manager.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    _assert_same(_state(model), saved)
    tf.saved_model.save(model, str(tmp_path / "sm"))
    # It loads (before: the loader made the slots through the optimizer's
    # `add_slot`, which the revived optimizer lacks), serves, and holds the
    # tables' slots as plain variables.
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    served = loaded.signatures["serving_default"](tf.constant(x[:5]))
    np.testing.assert_allclose(list(served.values())[0].numpy(),
                               model.predict(x[:5], verbose=0), rtol=1e-6)
    names = [k for k, _ in tf.train.list_variables(
        str(tmp_path / "sm" / "variables" / "variables"))]
    assert sum("sok_slot." in k and "VARIABLE_VALUE" in k
               for k in names) == 4, names  # 2 tables x (m, v)
    # A checkpoint after it still saves them as slot variables.
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "after"))
    assert sum(".OPTIMIZER_SLOT" in k and "VARIABLE_VALUE" in k
               for k, _ in tf.train.list_variables(path)) == 4


def test_a_slot_of_another_shape_is_refused_and_nothing_changes(tmp_path):
    x, y = _data()
    model = _compiled("wrapper_adam")
    model.fit(x, y, batch_size=16, verbose=0)
    # A table of the same name but 60 rows: its slots do not fit.
    ids = keras.Input(shape=(3,), dtype="int64")
    other = keras.Model(ids, keras.layers.Dense(1)(
        sok.layers.DistributedEmbedding(60, 4, name="a")(ids)))
    other.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam()),
                  loss="mse")
    path = tf.train.Checkpoint(
        model=other, optimizer=other.optimizer).save(str(tmp_path / "ck"))
    before = _state(model)
    # The table itself is refused first, as a mismatched variable is.
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        tf.train.Checkpoint(
            model=model, optimizer=model.optimizer).restore(path)
    assert model.get_layer("a").embeddings.numpy().shape == (50, 4)
    np.testing.assert_array_equal(
        model.get_layer("b").embeddings.numpy(), before["b"])


def test_get_slot_of_a_dense_variable_is_a_clear_type_error():
    model = _compiled("wrapper_adam")
    model.optimizer.build(model.trainable_variables)
    kernel = model.layers[-1].kernel
    with pytest.raises(TypeError, match="takes a table"):
        model.optimizer.get_slot(kernel, "m")
    table = model.get_layer("a").embeddings
    assert model.optimizer.get_slot(table, "m") is table.slots["m"]
    with pytest.raises(KeyError, match="has no slot 'momentum'"):
        model.optimizer.get_slot(table, "momentum")
    assert model.optimizer.get_slot_names() == ["m", "v"]


def test_load_weights_restores_the_optimizer_whole_or_not_at_all(
        tmp_path, caplog):
    """`load_weights` into a model whose optimizer is not built: Keras skips
    the optimizer's state, and the tables' slots are skipped with it
    (before: they alone were restored, a mixed state that matched neither a
    fresh nor the saved optimizer), with a warning. Built first,
    everything is restored. An uncompiled model (no optimizer) loads its
    weights without the warning, whose advice it could not follow."""
    x, y = _data()
    model = _compiled("wrapper_adam")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)
    saved = _state(model)

    uncompiled = _model()
    with caplog.at_level("WARNING", logger="sok_keras"):
        uncompiled.load_weights(path)
    assert "not restored" not in caplog.text
    _assert_same({k: v for k, v in _state(uncompiled).items()
                  if "." not in k},
                 {k: v for k, v in saved.items() if "." not in k})

    unbuilt = _compiled("wrapper_adam")
    with caplog.at_level("WARNING", logger="sok_keras"):
        unbuilt.load_weights(path)
    assert "slots in the file are not restored" in caplog.text
    unbuilt.optimizer.build(unbuilt.trainable_variables)
    table = unbuilt.get_layer("a").embeddings
    assert int(unbuilt.optimizer.iterations.numpy()) == 0
    assert not np.asarray(table.slots["m"].numpy()).any()

    built = _compiled("wrapper_adam")
    built.optimizer.build(built.trainable_variables)
    built.load_weights(path)
    assert int(built.optimizer.iterations.numpy()) == 3
    _assert_same(_state(built), saved)
