"""A layer's own table optimizer (`optimizer=` on the embedding layers)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok


def _model(table_optimizer, trainable_head=True):
    ids = keras.Input(shape=(3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(
        40, 4, combiner="sum", name="emb", optimizer=table_optimizer,
        embeddings_initializer=keras.initializers.RandomNormal(seed=1))
    head = keras.layers.Dense(
        1, name="head", trainable=trainable_head,
        kernel_initializer=keras.initializers.GlorotUniform(seed=2))
    return keras.Model(ids, head(emb(ids)))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 40, size=(64, 3)), rng.normal(size=(64, 1))


def test_table_optimizer_rules_the_table_model_optimizer_the_rest():
    x, y = _data()
    # With a frozen head, only the table trains: its trajectory under the
    # table's Adagrad equals a model whose optimizer is that Adagrad.
    a = _model(keras.optimizers.Adagrad(0.2), trainable_head=False)
    a.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.SGD(0.05)), loss="mse")
    a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    b = _model(None, trainable_head=False)
    b.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adagrad(0.2)), loss="mse")
    b.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ta = a.get_layer("emb").embeddings
    np.testing.assert_allclose(ta.numpy(), b.get_layer("emb").embeddings
                               .numpy(), rtol=1e-6)
    assert sorted(ta.slots) == ["accumulator"]
    # The table optimizer counts its own steps (8 batches).
    assert int(a.get_layer("emb").table_optimizer.iterations.numpy()) == 8
    # And the dense head follows the model's SGD: one step from the same
    # start equals plain SGD on the dense gradient.
    c = _model(keras.optimizers.Adagrad(0.2))
    c.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.SGD(0.05)), loss="mse")
    w0 = c.get_layer("head").kernel.numpy().copy()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y[:16], c(x[:16]))
    g = tape.gradient(loss, c.get_layer("head").kernel)
    c.train_on_batch(x[:16], y[:16])
    np.testing.assert_allclose(c.get_layer("head").kernel.numpy(),
                               w0 - 0.05 * g.numpy(), rtol=1e-5, atol=1e-7)


def test_config_and_save_round_trip(tmp_path):
    x, y = _data(1)
    model = _model(keras.optimizers.Adam(0.01))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    layer = model.get_layer("emb")
    config = layer.get_config()
    assert config["optimizer"]["class_name"] == "Adam"
    clone = sok.layers.DistributedEmbedding.from_config(config)
    assert isinstance(clone.table_optimizer, keras.optimizers.Adam)
    path = os.path.join(str(tmp_path), "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lt = loaded.get_layer("emb")
    # The table optimizer's step count and the slots come back.
    assert int(lt.table_optimizer.iterations.numpy()) == 4
    np.testing.assert_array_equal(lt.embeddings.slots["m"].numpy(),
                                  layer.embeddings.slots["m"].numpy())
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_allclose(lt.embeddings.numpy(),
                               layer.embeddings.numpy(), rtol=1e-6)


def _shared_optimizer_model(form, opt):
    """Two tables trained by one optimizer instance: two layers, or two
    tables of one EmbeddingCollection."""
    ids = keras.Input(shape=(3,), dtype="int64")
    init = keras.initializers.RandomNormal(seed=1)
    if form == "layers":
        a, b = (sok.layers.DistributedEmbedding(
            40, 4, name=n, optimizer=opt, embeddings_initializer=init)
            for n in ("ea", "eb"))
        x = keras.layers.Add()([a(ids), b(ids)])
    else:
        coll = sok.layers.EmbeddingCollection(
            tables={t: {"vocabulary_size": 40, "embedding_dim": 4,
                        "optimizer": opt} for t in ("ta", "tb")},
            features={"fa": {"table": "ta"}, "fb": {"table": "tb"}},
            name="coll")
        out = coll({"fa": ids, "fb": ids})
        x = keras.layers.Add()([out["fa"], out["fb"]])
    head = keras.layers.Dense(
        1, name="head", kernel_initializer=keras.initializers.GlorotUniform(
            seed=2))
    return keras.Model(ids, head(x))


def _table_optimizers(model, form):
    if form == "layers":
        return [model.get_layer(n).table_optimizer for n in ("ea", "eb")]
    coll = model.get_layer("coll")
    return [coll._table_optimizers[t] for t in ("ta", "tb")]


@pytest.mark.parametrize("form", ["layers", "collection"])
def test_tables_sharing_one_optimizer_share_it_again_when_loaded(
        tmp_path, form):
    """(QA) One optimizer instance given to two tables counts one step per
    step; `model.save` writes its state once. The loaded tables shared two
    optimizers, only one of them restored (the other's step count back at
    0, Adam's bias correction restarted, with only Keras' 'Skipping
    variable loading' warning): now they share one again."""
    x, y = _data(2)
    model = _shared_optimizer_model(form, keras.optimizers.Adam(0.05))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    opts = _table_optimizers(model, form)
    assert opts[0] is opts[1] and int(opts[0].iterations.numpy()) == 4
    path = os.path.join(str(tmp_path), "m.keras")
    model.save(path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skipping variable loading"
        loaded = keras.models.load_model(path)
    lopts = _table_optimizers(loaded, form)
    assert lopts[0] is lopts[1]
    assert int(lopts[0].iterations.numpy()) == 4
    saved = model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    again = loaded.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_allclose(again.history["loss"],
                               saved.history["loss"], rtol=1e-6)
    # Outside a save, a config stays a plain config (no sharing marks),
    # and a layer made from it has an optimizer of its own.
    if form == "layers":
        config = model.get_layer("ea").get_config()
        assert "shared_object_id" not in config["optimizer"]
        clone = sok.layers.DistributedEmbedding.from_config(config)
        assert clone.table_optimizer is not opts[0]


def test_a_table_nadam_keeps_its_schedule_and_saves_it(tmp_path):
    """Nadam's momentum schedule (`_u_product`, which Keras makes in
    `build` and advances in `apply`) is kept by a table's own Nadam, which
    is never built: its table follows the same trajectory as under a
    model's Nadam (whose Keras `apply` does not run with the head frozen),
    and the schedule is saved with the layer, so a loaded model continues
    exactly."""
    x, y = _data(2)
    a = _model("nadam", trainable_head=False)
    a.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.SGD(0.05)), loss="mse")
    a.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    b = _model(None, trainable_head=False)
    b.compile(optimizer=sok.optimizers.Nadam(), loss="mse")
    b.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    ta, tb = a.get_layer("emb").embeddings, b.get_layer("emb").embeddings
    np.testing.assert_array_equal(ta.numpy(), tb.numpy())
    assert sorted(ta.slots) == ["momentum", "velocity"]
    own = a.get_layer("emb").table_optimizer
    assert int(own.iterations.numpy()) == 8
    assert float(own._u_product.numpy()) == float(
        b.optimizer._u_product.numpy()) < 0.5
    path = os.path.join(str(tmp_path), "nadam.keras")
    a.save(path)
    loaded = keras.models.load_model(path)
    lt = loaded.get_layer("emb")
    assert float(lt.table_optimizer._u_product.numpy()) == float(
        own._u_product.numpy())
    a.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_array_equal(lt.embeddings.numpy(), ta.numpy())


@pytest.mark.parametrize("table_opt", ["adam", "nadam"])
def test_sharded_checkpoint_keeps_the_table_optimizers_step(tmp_path,
                                                            table_opt):
    """`sok.dump` / `sok.load` (and so ShardedCheckpoint) restore a table
    optimizer's step count: Adam's bias correction and schedules read it
    (before: 0 after a load, and the resumed table moved off by ~0.03);
    and a table Nadam's schedule (before: 1.0 after a load, 1.4e-3 off).
    Loading some of the tables (a list) leaves the others' optimizers
    out (before: "table_optimizer variables do not match")."""
    x, y = _data(1)

    def compiled():
        opt = (keras.optimizers.Adam(0.05) if table_opt == "adam"
               else keras.optimizers.Nadam(0.05))
        model = _model(opt)
        model.compile(optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.SGD(0.05)), loss="mse")
        return model

    model = compiled()
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    path = os.path.join(str(tmp_path), "ck")
    sok.dump(path, model)
    loaded = compiled()
    sok.load(path, loaded)
    assert int(loaded.get_layer("emb").table_optimizer.iterations.numpy()) \
        == int(model.get_layer("emb").table_optimizer.iterations.numpy()) \
        == 4
    if table_opt == "nadam":
        assert float(loaded.get_layer("emb").table_optimizer._u_product
                     .numpy()) == float(model.get_layer("emb")
                                        .table_optimizer._u_product.numpy())
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_allclose(loaded.get_layer("emb").embeddings.numpy(),
                               model.get_layer("emb").embeddings.numpy(),
                               rtol=1e-6, atol=1e-7)
    # Two tables with their own optimizers; a list with one of them.
    t1 = sok.Variable(np.ones((6, 2), np.float32), name="t1")
    t2 = sok.Variable(np.ones((6, 2), np.float32), name="t2")
    t1.optimizer = keras.optimizers.get(table_opt)
    t2.optimizer = keras.optimizers.get(table_opt)
    both = os.path.join(str(tmp_path), "both")
    sok.dump(both, [t1, t2])
    again = sok.Variable(np.zeros((6, 2), np.float32), name="t2")
    again.optimizer = keras.optimizers.get(table_opt)
    sok.load(both, [again])
    np.testing.assert_array_equal(again.numpy(), t2.numpy())


def test_a_checkpoint_without_the_table_optimizers_says_so(tmp_path):
    """A dump written before table optimizers were saved (its manifest has
    no `table_optimizers`) loads the tables and says that their optimizers
    keep their state (before: silently, and Adam's bias correction
    restarted)."""
    import json

    from sok_keras import checkpoint

    x, y = _data(2)
    model = _model(keras.optimizers.Adam(0.05))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    path = os.path.join(str(tmp_path), "old")
    sok.dump(path, model)
    manifest = os.path.join(path, "manifest.json")
    with open(manifest) as f:
        m = json.load(f)
    del m["table_optimizers"]
    m["manifest_crc32"] = checkpoint._manifest_crc(m)
    with open(manifest, "w") as f:
        json.dump(m, f)
    loaded = _model(keras.optimizers.Adam(0.05))
    loaded.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="older sok_keras.*emb"):
        sok.load(path, loaded)
    np.testing.assert_array_equal(loaded.get_layer("emb").embeddings.numpy(),
                                  model.get_layer("emb").embeddings.numpy())
    assert int(loaded.get_layer("emb").table_optimizer.iterations.numpy()) \
        == 0
    saved = model.get_layer("emb").embedding_variable.slots
    slots = loaded.get_layer("emb").embedding_variable.slots
    assert sorted(slots) == sorted(saved) and slots
    for k in saved:
        np.testing.assert_array_equal(slots[k].read_global(),
                                      saved[k].read_global(), err_msg=k)


def test_bad_table_optimizers():
    with pytest.raises(ValueError, match="Supported optimizers"):
        sok.layers.DistributedEmbedding(10, 2, optimizer="adafactor")
    with pytest.raises(ValueError, match="clipnorm"):
        sok.layers.LocalizedEmbedding(
            10, 2, optimizer=keras.optimizers.SGD(0.1, clipnorm=1.0))
