"""`EmbeddingCollection`: several tables and features in one lookup."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.testing import assert_config_round_trip
from tests.testing import assert_model_saving

TABLES = {
    "user": {"vocabulary_size": 30, "embedding_dim": 4},
    "item": {"vocabulary_size": 50, "embedding_dim": 6,
             "mode": "localized:0",
             "initializer": {"class_name": "RandomNormal",
                             "config": {"stddev": 0.2, "seed": 3}}},
}
FEATURES = {
    "user_id": {"table": "user"},
    "clicked": {"table": "item", "combiner": "mean"},
    "history": {"table": "item", "combiner": None},
}


def _inputs(rng, batch=8):
    return {
        "user_id": rng.integers(0, 30, size=(batch,)),
        "clicked": tf.ragged.constant(
            [list(rng.integers(0, 50, size=rng.integers(0, 4)))
             for _ in range(batch)], tf.int64),
        "history": rng.integers(-1, 50, size=(batch, 3)),
    }


def test_outputs_equal_the_tables():
    rng = np.random.default_rng(0)
    layer = sok.layers.EmbeddingCollection(TABLES, FEATURES)
    x = _inputs(rng)
    out = layer(x)
    user = layer.embeddings["user"].numpy()
    item = layer.embeddings["item"].numpy()
    np.testing.assert_allclose(out["user_id"].numpy(), user[x["user_id"]],
                               rtol=1e-6)
    for b, ids in enumerate(x["clicked"].to_list()):
        want = item[ids].mean(0) if ids else np.zeros(6)
        np.testing.assert_allclose(out["clicked"][b].numpy(), want,
                                   rtol=1e-6, atol=1e-7)
    hist = x["history"]
    want = np.where(hist[..., None] >= 0, item[np.maximum(hist, 0)], 0.0)
    np.testing.assert_allclose(out["history"].numpy(), want, rtol=1e-6)
    assert layer.embeddings["item"].mode == "localized:0"
    assert layer.embeddings["item"].numpy().std() > 0.1  # its initializer


def test_unpooled_features_mask_padding_for_mask_aware_layers():
    """An unpooled feature's output carries `ids != -1` as its Keras mask
    (GlobalAveragePooling1D averages only real ids); pooled ones none."""
    layer = sok.layers.EmbeddingCollection(TABLES, FEATURES)
    inputs = {"user_id": keras.Input((), dtype="int64", name="user_id"),
              "clicked": keras.Input((None,), dtype="int64", name="clicked"),
              "history": keras.Input((3,), dtype="int64", name="history")}
    out = layer(inputs)
    avg = keras.layers.GlobalAveragePooling1D()(out["history"])
    model = keras.Model(inputs, [avg, out["user_id"]])
    item = layer.embeddings["item"].numpy()
    hist = np.array([[1, 2, -1], [3, -1, -1]])
    x = {"user_id": np.array([0, 1]), "clicked": np.array([[4, 5], [6, 7]]),
         "history": hist}
    got, _ = model.predict(x, verbose=0)
    np.testing.assert_allclose(got, [(item[1] + item[2]) / 2, item[3]],
                               rtol=1e-6)
    masks = layer.compute_mask({k: tf.constant(v) for k, v in x.items()})
    assert masks["user_id"] is None and masks["clicked"] is None
    assert masks["history"].numpy().tolist() == [[True, True, False],
                                                 [True, False, False]]
    pooled_only = sok.layers.EmbeddingCollection(
        TABLES, {"clicked": {"table": "item", "combiner": "mean"}})
    assert pooled_only.compute_mask({"clicked": tf.constant(hist)}) is None


def test_unpooled_ids_of_any_rank_as_distributed_embedding():
    """[batch, 2, 3] ids of an unpooled feature: rows [batch, 2, 3, dim]
    and the mask `ids != -1`, as `DistributedEmbedding(combiner=None)`
    gives (before: the model built, then the lookup refused the ids)."""
    rng = np.random.default_rng(5)
    table = rng.normal(size=(40, 4)).astype(np.float32)
    ids = rng.integers(-1, 40, size=(6, 2, 3))
    w = rng.random((6, 2, 3)).astype(np.float32)
    col = sok.layers.EmbeddingCollection(
        {"t": {"vocabulary_size": 40, "embedding_dim": 4}},
        {"g": {"table": "t", "combiner": None}})
    col.build(None)
    col.embeddings["t"].assign(table)
    single = sok.layers.DistributedEmbedding(40, 4, combiner=None)
    single.build((None, 2, 3))
    single.embeddings.assign(table)
    want = np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0)
    for weights in (None, w):
        got = col({"g": ids}, None if weights is None else {"g": weights})
        ref = single(ids, weights)
        np.testing.assert_array_equal(got["g"].numpy(), ref.numpy())
    np.testing.assert_array_equal(col({"g": ids})["g"].numpy(), want)
    np.testing.assert_array_equal(
        col.compute_mask({"g": tf.constant(ids)})["g"].numpy(), ids != -1)
    inp = keras.Input((2, 3), dtype="int64")
    out = keras.layers.Flatten()(col({"g": inp})["g"])
    model = keras.Model(inp, keras.layers.Dense(1)(out))
    model.compile(optimizer=sok.OptimizerWrapper(
        keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(ids, rng.normal(size=(6, 1)), verbose=0)  # trains
    assert not np.array_equal(col.embeddings["t"].numpy(), table)


def test_gradients_reach_each_table_once_per_distinct_id():
    layer = sok.layers.EmbeddingCollection(TABLES, FEATURES)
    x = {"user_id": np.array([1, 1, 2]),
         "clicked": tf.ragged.constant([[4], [4, 5], []], tf.int64),
         "history": np.array([[5, -1, -1], [6, 6, 7], [-1, -1, -1]])}
    with tf.GradientTape() as tape:
        out = layer(x)
        loss = tf.add_n([tf.reduce_sum(v) for v in out.values()])
    g_user, g_item = tape.gradient(
        loss, [layer.embeddings["user"], layer.embeddings["item"]])
    assert sorted(g_user.indices.numpy()) == [1, 2]
    dense = tf.convert_to_tensor(g_item).numpy()
    # clicked: mean over [4] and [4, 5]; history: 5 once, 6 twice, 7 once.
    np.testing.assert_allclose(dense[[4, 5, 6, 7], 0], [1.5, 1.5, 2.0, 1.0])


def test_config_round_trip_and_errors():
    layer = sok.layers.EmbeddingCollection(
        {**TABLES, "ads": {"vocabulary_size": 9, "embedding_dim": 2,
                           "optimizer": keras.optimizers.Adagrad(0.3)}},
        {**FEATURES, "ad": {"table": "ads", "combiner": "sqrtn"}},
        name="coll")
    clone = assert_config_round_trip(layer)
    assert isinstance(clone._table_optimizers["ads"],
                      keras.optimizers.Adagrad)
    with pytest.raises(ValueError, match="refers to table 'nope'"):
        sok.layers.EmbeddingCollection(TABLES, {"f": {"table": "nope"}})
    # (Before: "dictionary update sequence element #0 has length 1".)
    with pytest.raises(TypeError, match="feature 'f' must be a dict.*'t'"):
        sok.layers.EmbeddingCollection(TABLES, {"f": "t"})
    with pytest.raises(ValueError, match=r"unknown keys \['dim'\]"):
        sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 3, "dim": 2}}, {"f": {"table": "t"}})
    with pytest.raises(ValueError, match="vocabulary_size.*-1"):
        sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": -1, "embedding_dim": 2}},
            {"f": {"table": "t"}})
    with pytest.raises(ValueError, match=r"table 't': bad `initializer`.*"
                       r"initializer='nope'"):
        sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 3, "embedding_dim": 2,
                   "initializer": "nope"}}, {"f": {"table": "t"}})
    with pytest.raises(ValueError, match=r"EmbeddingCollection 'c': `dtype` "
                       r"must be.*dtype='foo'"):
        sok.layers.EmbeddingCollection(TABLES, FEATURES, dtype="foo",
                                       name="c")
    # keras.layers.Embedding's arguments a sharded table cannot honor:
    # refused with what to do, as the single-table layers refuse them
    # (before: Keras' "Unrecognized keyword arguments").
    with pytest.raises(ValueError, match=r"EmbeddingCollection 'c' does not "
                       r"take `embeddings_regularizer`.*penalty"):
        sok.layers.EmbeddingCollection(
            TABLES, FEATURES, name="c",
            embeddings_regularizer=keras.regularizers.L2(0.1))
    with pytest.raises(ValueError, match=r"does not take `mask_zero`.*-1"):
        sok.layers.EmbeddingCollection(TABLES, FEATURES, mask_zero=True)
    sok.layers.EmbeddingCollection(TABLES, FEATURES, mask_zero=False)
    # A misspelt mode is refused when the layer is made, not at its first
    # call (a localized rank is checked at build, against the world then).
    with pytest.raises(ValueError, match="table 't' must be 'distributed'.*"
                       "'localised:0'"):
        sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 3, "embedding_dim": 2,
                   "mode": "localised:0"}}, {"f": {"table": "t"}})
    # Table names whose saved entries would clash are refused when the
    # layer is made (QA: h5py's "name already exists" at the first save).
    with pytest.raises(ValueError, match=r"tables 't' and 't.slot.m' cannot "
                       r"be saved together.*Rename table 't.slot.m'"):
        sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 3, "embedding_dim": 2},
             "t.slot.m": {"vocabulary_size": 4, "embedding_dim": 2}},
            {"f": {"table": "t"}, "g": {"table": "t.slot.m"}})
    with pytest.raises(ValueError, match="'t.slot.m' cannot be saved"):
        import keras_rs

        TC = keras_rs.layers.TableConfig
        FC = keras_rs.layers.FeatureConfig
        sok.layers.EmbeddingCollection({
            "x": FC("x", TC(name="t", vocabulary_size=8, embedding_dim=2),
                    (4,), (4, 2)),
            "y": FC("y", TC(name="t.slot.m", vocabulary_size=9,
                            embedding_dim=2), (4,), (4, 2))})
    sok.layers.EmbeddingCollection(  # a dot alone is fine
        {"t": {"vocabulary_size": 3, "embedding_dim": 2},
         "t.v2": {"vocabulary_size": 4, "embedding_dim": 2}},
        {"f": {"table": "t"}, "g": {"table": "t.v2"}})
    with pytest.raises(ValueError, match=r"no ids for features \['history'"):
        sok.layers.EmbeddingCollection(TABLES, FEATURES)(
            {"user_id": np.array([1]), "clicked": np.array([[1]])})
    # A misspelt feature in the weights (or the inputs) is an error, not an
    # unweighted lookup; inputs that are not a dict are named as such.
    ids = {"user_id": np.array([1]), "clicked": np.array([[1]]),
           "history": np.array([[2, -1, 3]])}
    coll = sok.layers.EmbeddingCollection(TABLES, FEATURES, name="typo")
    with pytest.raises(ValueError,
                       match=r"'typo'.*`weights` has keys \['click'\]"):
        coll(ids, {"click": np.array([[2.0]], np.float32)})
    with pytest.raises(ValueError, match=r"`inputs` has keys \['views'\]"):
        coll({**ids, "views": np.array([[1]])})
    with pytest.raises(TypeError, match="`inputs` must be a dict"):
        coll([ids["user_id"]])
    # A bad id names the feature as well as the table it shares.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 'typo/item \(feature history\)': id 50"):
        coll({**ids, "history": np.array([[2, 50, 3]])})


def test_functional_model_fit_and_save(tmp_path):
    rng = np.random.default_rng(1)
    inputs = {
        "user_id": keras.Input(shape=(), dtype="int64", name="user_id"),
        "clicked": keras.Input(shape=(4,), dtype="int64", name="clicked"),
        "history": keras.Input(shape=(3,), dtype="int64", name="history"),
    }
    emb = sok.layers.EmbeddingCollection(TABLES, FEATURES, name="coll")(
        inputs)
    x = keras.layers.Concatenate()([
        emb["user_id"], emb["clicked"], keras.layers.Flatten()(
            emb["history"])])
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(0.05)), loss="mse")
    data = {"user_id": rng.integers(0, 30, size=(64,)),
            "clicked": rng.integers(-1, 50, size=(64, 4)),
            "history": rng.integers(-1, 50, size=(64, 3))}
    y = rng.normal(size=(64, 1))
    history = model.fit(data, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    tables = model.get_layer("coll").embeddings
    assert sorted(tables["item"].slots) == ["m", "v"]
    loaded = assert_model_saving(model, data, tmp_path)
    np.testing.assert_array_equal(
        loaded.get_layer("coll").embeddings["item"].slots["v"].numpy(),
        tables["item"].slots["v"].numpy())


@keras.saving.register_keras_serializable(package="sok_keras_tests")
class Tower(keras.Model):
    """A subclassed model over an EmbeddingCollection (rebuilt by
    `load_model` inside Keras' StatelessScope)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.coll = sok.layers.EmbeddingCollection(
            {"user": {"vocabulary_size": 30, "embedding_dim": 4}},
            {"user_id": {"table": "user"}, "friends": {"table": "user"}})
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        out = self.coll(inputs)
        return self.head(keras.ops.concatenate(
            [out["user_id"], out["friends"]], axis=-1))


def test_a_subclassed_model_with_a_collection_saves_and_loads(tmp_path):
    rng = np.random.default_rng(4)
    data = {"user_id": rng.integers(0, 30, size=(16, 1)),
            "friends": rng.integers(-1, 30, size=(16, 3))}
    model = Tower()
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.1)),
                  loss="mse")
    model.fit(data, rng.normal(size=(16, 1)), batch_size=8, verbose=0)
    loaded = assert_model_saving(model, data, tmp_path)
    np.testing.assert_array_equal(
        loaded.coll.embeddings["user"].numpy(),
        model.coll.embeddings["user"].numpy())


def test_ranks_whose_feature_dicts_differ_in_order_train_together():
    """Features listed in another order on rank 1 (a dict built from a set:
    string hashing differs per process): the lookups run in name order,
    so the ranks' exchanges meet (before: they waited for each other
    until SOK_COMM_TIMEOUT)."""
    from tests.multiprocess import run_workers
    from tests.multiprocess import worker_path

    r0, r1 = run_workers(worker_path("ec_feature_order"), 2, timeout=240,
                         env={"SOK_COMM_TIMEOUT": "60"})
    assert r0["order"] != r1["order"]
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["losses"] == r1["losses"]
    assert r0["tables"] == r1["tables"]


def test_the_outputs_keep_the_features_order():
    features = {"z": {"table": "user"}, "a": {"table": "user"}}
    layer = sok.layers.EmbeddingCollection(
        {"user": {"vocabulary_size": 30, "embedding_dim": 4}}, features)
    out = layer({"z": np.array([1, 2]), "a": np.array([3, 4])})
    assert list(out) == ["z", "a"]


def test_pooled_feature_refuses_3d_ids_when_the_model_is_built():
    """As the layers: a pooled feature's ids of more than 2 dimensions are
    refused when the model is built, naming the collection and feature."""
    layer = sok.layers.EmbeddingCollection(
        {"t": {"vocabulary_size": 10, "embedding_dim": 4}},
        {"f": {"table": "t", "combiner": "sum"}}, name="coll")
    with pytest.raises(ValueError, match=r"EmbeddingCollection 'coll', "
                       r"feature 'f': a pooled lookup"):
        layer({"f": keras.Input((3, 5), dtype="int64")})


def test_tf_train_checkpoint_restores_the_tables_before_the_first_step(
        tmp_path):
    """`tf.train.Checkpoint(model=..., optimizer=...)` restored into a new
    model before its first step (its optimizer not built yet): the
    collection's tables come back, as other sok tables do (before: they
    were only in the checkpoint through the optimizer, and kept their
    initial values, with no error); a frozen table is in the checkpoint."""
    def make(seed, trainable=True):
        keras.utils.set_random_seed(seed)
        ids = keras.Input((2,), dtype="int64")
        col = sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 30, "embedding_dim": 2},
             "u": {"vocabulary_size": 10, "embedding_dim": 3}},
            {"f": {"table": "t", "combiner": "sum"},
             "h": {"table": "u", "combiner": "mean"}}, name="col",
            trainable=trainable)
        out = col({"f": ids, "h": ids % 10})
        model = keras.Model(ids, keras.layers.Dense(1)(
            keras.layers.Concatenate()([out["f"], out["h"]])))
        model.compile(optimizer=sok.OptimizerWrapper(
            keras.optimizers.Adam(0.05)), loss="mse")
        return model, col

    x = np.arange(16, dtype=np.int64).reshape(8, 2)
    y = np.ones((8, 1), np.float32)
    model, col = make(1)
    model.fit(x, y, batch_size=4, verbose=0)
    saved = {t: v.numpy() for t, v in col.embeddings.items()}
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ck"))
    fresh, fresh_col = make(2)
    assert not np.array_equal(fresh_col.embeddings["t"].numpy(), saved["t"])
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        path).expect_partial()
    for t, value in saved.items():
        np.testing.assert_array_equal(fresh_col.embeddings[t].numpy(), value)
    frozen, frozen_col = make(3, trainable=False)
    frozen_path = tf.train.Checkpoint(model=frozen).save(
        str(tmp_path / "frozen"))
    shapes = [s for _, s in tf.train.list_variables(frozen_path)]
    assert [30, 2] in shapes and [10, 3] in shapes, shapes
