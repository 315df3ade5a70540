"""The embedding layers with float16 / bfloat16 tables (one process), and
the multi-rank fit of every layer with bfloat16 tables.

`dtype="bfloat16"` (a Keras dtype policy whose variable dtype is bfloat16)
stores the table in bfloat16 and returns bfloat16 outputs; the Keras
`"mixed_bfloat16"` policy keeps a float32 table and casts the outputs, as
Keras' own `Embedding` does. Slots of 16-bit tables are float32.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.layers_model import build_and_fit
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path

F32 = np.float32
HALF = ("bfloat16", "float16")


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _model(layer, ids_shape):
    ids = keras.Input(shape=ids_shape, dtype="int64")
    x = layer(ids)
    if len(x.shape) > 2:
        x = keras.layers.Flatten()(x)
    out = keras.layers.Dense(1)(x)  # float32: casts the 16-bit output
    return keras.Model(ids, out)


def _layers(dtype):
    return {
        "distributed": (sok.layers.DistributedEmbedding(
            40, 4, combiner="mean", dtype=dtype), (3,)),
        "localized": (sok.layers.LocalizedEmbedding(
            40, 4, combiner="sqrtn", rank=0, dtype=dtype), (3,)),
        "all2all": (sok.layers.All2AllDenseEmbedding(
            16, 4, slot_num=2, nnz_per_slot=2, vocabulary_size=40,
            dtype=dtype), (2, 2)),
    }


@pytest.mark.parametrize("dtype", HALF)
def test_variable_stores_rounded_to_nearest_even(dtype):
    np_dt = tf.as_dtype(dtype).as_numpy_dtype
    values = np.random.default_rng(0).normal(size=(7, 3)).astype(F32)
    v = sok.Variable(values, dtype=dtype)
    assert v.dtype == dtype and v.value.dtype == tf.as_dtype(dtype)
    np.testing.assert_array_equal(_bits(v.read_global()),
                                  _bits(values.astype(np_dt)))
    init = sok.Variable("uniform", shape=(7, 3), dtype=dtype)
    assert init.value.dtype == tf.as_dtype(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_distributed_embedding_forward_is_float32_pooling_rounded(dtype):
    np_dt = tf.as_dtype(dtype).as_numpy_dtype
    rng = np.random.default_rng(1)
    table = rng.normal(size=(30, 5)).astype(np_dt)
    layer = sok.layers.DistributedEmbedding(30, 5, combiner="mean",
                                            dtype=dtype)
    ids = np.array([[1, 2, 2, -1], [4, 9, 1, 3]], np.int64)
    layer.build()
    layer.embeddings.assign_global(table)
    out = layer(ids)
    assert out.dtype == tf.as_dtype(dtype)
    want = np.zeros((2, 5), F32)
    for b, row in enumerate(ids):
        valid = [i for i in row if i >= 0]
        acc = np.zeros(5, F32)
        for i in valid:  # ascending position order, in float32
            acc = acc + table[i].astype(F32)
        want[b] = acc / F32(len(valid))
    np.testing.assert_array_equal(_bits(out.numpy()),
                                  _bits(want.astype(np_dt)))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("path", ["all2all_dense_embedding", "unpooled",
                                  "unpooled_weighted"])
def test_unpooled_gradient_of_a_hot_id_is_summed_in_float32(dtype, path):
    """An id looked up 64 times, unpooled: its gradient row is the float32
    sum of the 64 upstream rows (times their weights), rounded once, as
    the pooled path's (before: TensorFlow's gather gradient summed them in
    the 16-bit dtype, up to 182 bfloat16 ulps off); the weights' gradient
    too."""
    np_dt = tf.as_dtype(dtype).as_numpy_dtype
    rng = np.random.default_rng(0)
    table = rng.normal(size=(10, 4)).astype(np_dt)
    dy = rng.normal(size=(64, 4)).astype(np_dt)
    # Weights have the table's dtype (docs/gpu.md).
    w = rng.uniform(0.5, 2.0, size=64).astype(np_dt).astype(F32)
    ids = tf.constant([[3]] * 64, tf.int64)
    weights = tf.constant(w[:, None]) if path == "unpooled_weighted" else None
    if path == "all2all_dense_embedding":
        var = sok.Variable(table, dtype=dtype)
        lookup = lambda: sok.all2all_dense_embedding(var, ids)  # noqa: E731
    else:
        layer = sok.layers.DistributedEmbedding(10, 4, combiner=None,
                                                dtype=dtype)
        layer.build()
        layer.embeddings.assign_global(table)
        var = layer.embeddings
        lookup = lambda: layer(ids, weights=weights)  # noqa: E731
    with tf.GradientTape() as tape:
        if weights is not None:
            tape.watch(weights)
        out = tf.reshape(lookup(), [64, 4])
        loss = tf.reduce_sum(tf.cast(out, tf.float32) * dy.astype(F32))
    grads = tape.gradient(loss, [var] + ([weights] if weights is not None
                                         else []))
    row = np.asarray(tf.convert_to_tensor(grads[0]))[3]
    scale = w[:, None] if weights is not None else np.ones((64, 1), F32)
    want = np.zeros(4, F32)
    for k in range(64):  # float32, rounded once at the end
        want = want + dy[k].astype(F32) * scale[k]
    np.testing.assert_array_equal(_bits(row), _bits(want.astype(np_dt)))
    expected_out = (table[3].astype(F32)[None, :] * scale).astype(np_dt)
    np.testing.assert_array_equal(_bits(out.numpy()), _bits(expected_out))
    if weights is not None:
        gw = np.asarray(grads[1]).ravel()
        want_w = (dy.astype(F32) * table[3].astype(F32)).sum(axis=1)
        np.testing.assert_allclose(gw, want_w, rtol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["distributed", "localized", "all2all",
                                  "collection"])
def test_fit_with_half_table(dtype, kind):
    keras.utils.set_random_seed(2)
    if kind == "collection":
        layer = sok.layers.EmbeddingCollection(
            tables={"t": {"vocabulary_size": 40, "embedding_dim": 4}},
            features={"f": {"table": "t", "combiner": "sum"}}, dtype=dtype)
        ids = keras.Input(shape=(3,), dtype="int64", name="f")
        out = keras.layers.Dense(1)(layer({"f": ids})["f"])
        model = keras.Model({"f": ids}, out)
        table = lambda: layer.embeddings["t"]  # noqa: E731
    else:
        layer, shape = _layers(dtype)[kind]
        model = _model(layer, shape)
        table = lambda: layer.embeddings  # noqa: E731
    rng = np.random.default_rng(3)
    x = rng.integers(0, 40, size=(256,) + tuple(model.inputs[0].shape[1:]))
    y = (x.reshape(len(x), -1)[:, :1] % 2).astype(F32)
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    feed = {"f": x} if kind == "collection" else x
    before = table().read_global().copy()
    h = model.fit(feed, y, batch_size=32, epochs=4, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0], h.history
    assert table().dtype == dtype
    assert not np.array_equal(_bits(table().read_global()), _bits(before))
    assert set(table().slots) == {"m", "v"}
    for name, slot in table().slots.items():
        assert slot.dtype == "float32", name


def test_mixed_bfloat16_policy_keeps_a_float32_table():
    layer = sok.layers.DistributedEmbedding(20, 3, combiner="sum",
                                            dtype="mixed_bfloat16")
    out = layer(np.array([[1, 2]], np.int64))
    assert layer.embeddings.dtype == "float32"
    assert out.dtype == tf.bfloat16


@pytest.mark.parametrize("dtype", HALF)
def test_save_and_load_round_trip_half_tables_exactly(dtype, tmp_path):
    keras.utils.set_random_seed(4)
    layer = sok.layers.DistributedEmbedding(50, 4, combiner="sum",
                                            dtype=dtype, name="emb")
    model = _model(layer, (2,))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    rng = np.random.default_rng(5)
    model.fit(rng.integers(0, 50, (64, 2)), rng.normal(size=(64, 1)),
              epochs=1, verbose=0)
    path = os.path.join(tmp_path, "half.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    table = loaded.get_layer("emb").embeddings
    assert table.dtype == dtype
    np.testing.assert_array_equal(_bits(table.read_global()),
                                  _bits(layer.embeddings.read_global()))
    saved = dict(layer.embeddings.slot_values_for_saving())
    restored = dict(table.slot_values_for_saving())
    assert set(saved) == set(restored) == {"accumulator"}
    np.testing.assert_array_equal(restored["accumulator"],
                                  saved["accumulator"])
    assert np.asarray(restored["accumulator"]).dtype == F32


STEPS, GLOBAL_BATCH = 12, 24


def test_all_layers_bfloat16_fit_on_two_ranks_matches_one_process():
    """Every layer with bfloat16 tables on 2 ranks and in one process: the
    same training up to the 16-bit roundings of partial sums, which the
    ranks do in another grouping (pooling on the owner, gradients summed
    after the exchange)."""
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)  # rank 0's seed in the workers
    ref = build_and_fit(STEPS, GLOBAL_BATCH, dtype="bfloat16")
    assert set(ref["table_dtypes"].values()) == {"bfloat16"}
    assert set(ref["slot_dtypes"].values()) == {"float32"}
    assert ref["slot_dtypes"]  # SGD with momentum: one slot per table
    results = run_workers(worker_path("layers_fit_halfprec"), 2,
                          args=[STEPS, GLOBAL_BATCH, "bfloat16"],
                          timeout=180)
    for r in results:
        assert r["table_dtypes"] == ref["table_dtypes"]
        assert r["slot_dtypes"] == ref["slot_dtypes"]
        # A few bfloat16 ulps apart at most (the same model with float32
        # tables ends 2e-2 to 8e-2 away), and mostly bit-identical.
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=2e-3)
        for name, table in ref["tables"].items():
            got, want = np.array(r["tables"][name]), np.array(table)
            np.testing.assert_allclose(got, want, rtol=0, atol=4e-3,
                                       err_msg=name)
            assert np.mean(got != want) < 0.1, name
    # Both ranks hold the same (broadcast, then identically updated) dense
    # weights.
    for a, b in zip(results[0]["dense"], results[1]["dense"]):
        np.testing.assert_array_equal(a, b)
