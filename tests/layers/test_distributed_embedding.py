"""`DistributedEmbedding` in one process: correctness and Keras behaviour."""

import io
import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.layers_model import SubclassedRanker
from tests.testing import assert_config_round_trip
from tests.testing import assert_model_saving


def _layer_with_table(table, **kwargs):
    layer = sok.layers.DistributedEmbedding(
        table.shape[0], table.shape[1], **kwargs)
    layer.build()
    layer.embeddings.assign(table)
    return layer


def test_unpooled_equals_keras_embedding_forward_and_grad():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(40, 8)).astype(np.float32)
    ids = rng.integers(0, 40, size=(16, 5))
    layer = _layer_with_table(table, combiner=None)
    ref = keras.layers.Embedding(40, 8)
    ref.build()
    ref.embeddings.assign(table)
    upstream = rng.normal(size=(16, 5, 8)).astype(np.float32)
    with tf.GradientTape(persistent=True) as tape:
        out = layer(ids)
        ref_out = ref(ids)
        loss = tf.reduce_sum(out * upstream)
        ref_loss = tf.reduce_sum(ref_out * upstream)
    np.testing.assert_allclose(out.numpy(), ref_out.numpy(), rtol=1e-6)
    g = tape.gradient(loss, layer.embeddings)
    g_ref = tape.gradient(ref_loss, ref.embeddings)
    np.testing.assert_allclose(
        tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(g_ref).numpy(),
        rtol=1e-6, atol=1e-6)


def test_unpooled_padding_and_ragged():
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    layer = _layer_with_table(table, combiner=None)
    out = layer(np.array([[1, -1], [3, 4]]))
    np.testing.assert_array_equal(
        out.numpy(), [[table[1], [0, 0]], [table[3], table[4]]])
    ragged = layer(tf.ragged.constant([[1], [3, 4, 5]], tf.int64))
    assert isinstance(ragged, tf.RaggedTensor)
    np.testing.assert_array_equal(ragged[1].numpy(), table[[3, 4, 5]])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_with_weights_equals_tf(combiner):
    rng = np.random.default_rng(1)
    table = rng.normal(size=(25, 4)).astype(np.float32)
    layer = _layer_with_table(table, combiner=combiner)
    ids = tf.ragged.constant([[1, 1, 2], [], [24], [3, 7, 7, 7]], tf.int64)
    w = tf.ragged.constant([[0.5, 2.0, 1.0], [], [3.0], [1.0, 1, 1, 0.25]])
    out = layer(ids, weights=w)
    ref = tf.nn.embedding_lookup_sparse(
        tf.constant(table), ids.to_sparse(), w.to_sparse(),
        combiner=combiner)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-6,
                               atol=1e-6)


def test_bad_ids_raise_and_name_the_layer():
    layer = _layer_with_table(np.zeros((17, 3), np.float32),
                              name="user_table")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"user_table.*id 99\b"):
        layer(np.array([[1, 99]]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"user_table.*id -5\b"):
        layer(np.array([[-5, 1]]))
    with pytest.raises(TypeError, match="integer"):
        layer(np.array([[1.0, 2.0]], np.float16))


def test_failed_fit_step_leaves_table_untouched():
    model = keras.Sequential([
        keras.Input(shape=(2,), dtype="int64"),
        sok.layers.DistributedEmbedding(10, 3, name="emb"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    before = model.get_layer("emb").embeddings.numpy().copy()
    x = np.array([[1, 2], [3, 10]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="emb.*10"):
        model.fit(x, np.zeros((2, 1)), verbose=0)
    np.testing.assert_array_equal(
        model.get_layer("emb").embeddings.numpy(), before)


def test_argument_validation():
    with pytest.raises(ValueError, match="vocabulary_size.*-3"):
        sok.layers.DistributedEmbedding(-3, 4)
    with pytest.raises(ValueError, match="embedding_dim.*2.5"):
        sok.layers.DistributedEmbedding(3, 2.5)
    # Each names the layer, one of a model's many (QA: the class only).
    for layer, kwargs, says in (
            (sok.layers.DistributedEmbedding, {"combiner": "max"},
             "combiner='max'"),
            (sok.layers.LocalizedEmbedding, {"pooling": "nowhere"},
             "pooling='nowhere'"),
            (sok.layers.DistributedEmbedding, {"optimizer": "bogus_opt"},
             "`optimizer`.*bogus_opt"),
            (sok.layers.LocalizedEmbedding,
             {"embeddings_initializer": "bogus_init"},
             "initializer='bogus_init'"),
            (sok.layers.DistributedEmbedding, {"input_dim": 3},
             "input_dim=3"),
            (sok.layers.DistributedEmbedding, {"mask_zero": True},
             "mask_zero=True")):
        with pytest.raises(ValueError, match=rf"^{layer.__name__} "
                           rf"'user_emb'.*{says}"):
            layer(3, 4, name="user_emb", **kwargs)
    with pytest.raises(ValueError, match=r"All2AllDenseEmbedding 'a2a': "
                       r"`slot_num`.*slot_num=0"):
        sok.layers.All2AllDenseEmbedding(3, 4, 0, 1, name="a2a")
    # Before: "BaseEmbedding.__init__() missing 2 required positional
    # arguments".
    with pytest.raises(ValueError, match=r"DistributedEmbedding '\w+': "
                       r"`vocabulary_size` must be a positive integer"):
        sok.layers.DistributedEmbedding(embedding_dim=4)
    # A number as a string is no SOK 1 combiner (before: the SOK 1 text).
    with pytest.raises(ValueError, match=r"`vocabulary_size` must be a "
                       r"positive integer. Received: vocabulary_size='10'"):
        sok.layers.DistributedEmbedding("10", 4)
    # Keras' own errors, which named neither the layer nor the argument.
    for dtype in ("foo", "float8"):
        with pytest.raises(ValueError, match=rf"DistributedEmbedding 'emb': "
                           rf"`dtype` must be.*Received: dtype='{dtype}'"):
            sok.layers.DistributedEmbedding(3, 4, dtype=dtype, name="emb")
    # Named by the layer when it is made: an integer dtype Keras takes
    # (QA: refused at build by the table, as "'embeddings'" only), and a
    # quantized policy (QA: taken, then Keras' "does not have a
    # `_int8_call` method" at the first call).
    for dtype, message in (
            ("int32", r"the tables' dtype must be one of.*"
                      r"Received: dtype='int32'"),
            ("int8_from_float32", r"sok tables take no quantized dtype "
                                  r"policy \('int8'\).*Received: "
                                  r"dtype='int8_from_float32'")):
        for cls in (sok.layers.DistributedEmbedding,
                    sok.layers.LocalizedEmbedding):
            with pytest.raises(ValueError,
                               match=rf"{cls.__name__} 'q': {message}"):
                cls(3, 4, dtype=dtype, name="q")
    for dtype, message in (("int64", r"the tables' dtype.*dtype='int64'"),
                           ("float8_from_float32",
                            "sok tables take no quantized")):
        with pytest.raises(ValueError,
                           match=rf"EmbeddingCollection 'c': {message}"):
            sok.layers.EmbeddingCollection(
                {"t": {"vocabulary_size": 3, "embedding_dim": 2}},
                {"f": {"table": "t"}}, dtype=dtype, name="c")
    for ok in ("float64", "bfloat16", "mixed_float16"):
        sok.layers.DistributedEmbedding(3, 4, dtype=ok)
    with pytest.raises(ValueError, match=r"LocalizedEmbedding 'emb': bad "
                       r"`initializer`.*initializer='nonsense'"):
        sok.layers.LocalizedEmbedding(3, 4, embeddings_initializer="nonsense",
                                      name="emb")


def test_sok1_distributed_embedding_arguments_say_what_to_write():
    """SOK 1's `DistributedEmbedding(combiner, max_vocabulary_size_per_gpu,
    embedding_vec_size, slot_num, max_nnz)` (before: Keras' bare
    "Unrecognized keyword arguments")."""
    with pytest.raises(ValueError, match=r"SOK 1's.*vocabulary_size="
                       r"max_vocabulary_size_per_gpu \* sok.num_ranks\(\)"
                       r".*embedding_dim=embedding_vec_size.*slot_num=3"):
        sok.DistributedEmbedding(combiner="mean",
                                 max_vocabulary_size_per_gpu=100,
                                 embedding_vec_size=8, slot_num=3, max_nnz=2)
    # Positionally, as SOK 1's examples write it (before: "Could not
    # interpret optimizer identifier: 2").
    with pytest.raises(ValueError, match=r"SOK 1's.*vocabulary_size="
                       r"max_vocabulary_size_per_gpu.*Received: "
                       r"vocabulary_size='mean'"):
        sok.DistributedEmbedding("mean", 100, 8, 3, 2)


def test_keras_embedding_argument_names():
    """Keras' `input_dim` / `output_dim` name the table's shape; Keras'
    other Embedding arguments are refused with what to do instead
    (before: "Unrecognized keyword arguments")."""
    for cls in (sok.layers.DistributedEmbedding,
                sok.layers.LocalizedEmbedding):
        layer = cls(input_dim=30, output_dim=4, combiner=None)
        assert (layer.vocabulary_size, layer.embedding_dim) == (30, 4)
        assert (layer.input_dim, layer.output_dim) == (30, 4)
        assert layer(np.array([[1, 2]])).shape == (1, 2, 4)
        assert cls(30, 4, mask_zero=False).vocabulary_size == 30
        # Keras' names, no combiner: unpooled, as keras.layers.Embedding
        # (before: summed, (1, 4), and a Flatten after it hid that).
        keras_like = cls(input_dim=30, output_dim=4)
        assert keras_like.combiner is None
        assert keras_like(np.array([[1, 2]])).shape == (1, 2, 4)
        assert cls.from_config(keras_like.get_config()).combiner is None
        # sok's names: SOK's default, pooled.
        assert cls(30, 4).combiner == "sum"
        assert cls(30, 4)(np.array([[1, 2]])).shape == (1, 4)
        assert cls(input_dim=30, output_dim=4, combiner="mean").combiner == (
            "mean")
        # One Keras name is enough (`Embedding(30, output_dim=4)` is
        # Keras' style too; before: summed, (1, 4)).
        assert cls(30, output_dim=4).combiner is None
        assert cls(30, output_dim=4)(np.array([[1, 2]])).shape == (1, 2, 4)
        assert cls(input_dim=30, embedding_dim=4).combiner is None
        assert cls(30, output_dim=4, combiner="sum").combiner == "sum"
    with pytest.raises(ValueError, match="not both"):
        sok.layers.DistributedEmbedding(30, 4, input_dim=30)
    with pytest.raises(ValueError, match=r"`mask_zero`.*-1 as padding"):
        sok.layers.DistributedEmbedding(30, 4, mask_zero=True)
    with pytest.raises(ValueError, match=r"`embeddings_regularizer`.*"
                       r"mean over the batch.*times sok.num_ranks\(\).*"
                       r"Received: embeddings_regularizer='l2'"):
        sok.layers.DistributedEmbedding(30, 4, embeddings_regularizer="l2")
    with pytest.raises(ValueError, match=r"`quantization_config`.*"
                       r"quantized.*not supported"):
        sok.layers.DistributedEmbedding(30, 4, quantization_config="int8")


def test_keras_embedding_attributes_of_an_unbuilt_layer_and_lora():
    """(QA) `.embeddings` before the layer is built, and Keras'
    `enable_lora`, say what is wrong (before: bare AttributeErrors)."""
    for cls in (sok.layers.DistributedEmbedding,
                sok.layers.LocalizedEmbedding):
        layer = cls(30, 4, name="user_emb")
        with pytest.raises(AttributeError,
                           match="'user_emb' has no table yet.*built"):
            layer.embeddings
        assert not hasattr(layer, "embeddings")
        with pytest.raises(AttributeError, match="no attribute 'nothing'"):
            layer.nothing
        # Keras' own properties keep their messages (review).
        with pytest.raises(AttributeError, match="never been called"):
            layer.input
        with pytest.raises(ValueError, match=r"'user_emb' has no "
                           r"`enable_lora`.*LoRA is not supported.*"
                           r"Received: rank=4"):
            layer.enable_lora(4)
        layer.build()
        assert layer.embeddings.shape == (30, 4)


def test_a_keras_embedding_config_makes_a_sok_layer():
    """The config of a `keras.layers.Embedding` (every key Keras 3 writes,
    `quantization_config` included) makes a sok layer of the same table
    shape and initializer (before: "Unrecognized keyword arguments:
    {'quantization_config': None}")."""
    config = keras.layers.Embedding(30, 4, name="e").get_config()
    for cls in (sok.layers.DistributedEmbedding,
                sok.layers.LocalizedEmbedding):
        layer = cls.from_config(dict(config, combiner=None))
        assert (layer.vocabulary_size, layer.embedding_dim) == (30, 4)
        assert layer(np.array([[1, 2]])).shape == (1, 2, 4)


def test_keras_embedding_weights_argument():
    """Keras Embedding's `weights=` (the whole initial table, or a list of
    it) sets the table when the layer is built, every sok layer alike; a
    wrong shape is refused at once, naming the table (before: Keras'
    "Unrecognized keyword arguments" with the array printed)."""
    table = np.arange(60, dtype="float32").reshape(15, 4)
    for layer in (sok.layers.DistributedEmbedding(15, 4, weights=[table],
                                                  combiner=None),
                  sok.layers.LocalizedEmbedding(15, 4, weights=table,
                                                combiner=None),
                  sok.layers.All2AllDenseEmbedding(
                      15, 4, slot_num=1, nnz_per_slot=2, weights=table)):
        ids = np.array([[3, 14]])
        a2a = isinstance(layer, sok.layers.All2AllDenseEmbedding)
        got = layer(ids[:, None] if a2a else ids)
        np.testing.assert_array_equal(np.reshape(got, (2, 4)), table[[3, 14]])
        np.testing.assert_array_equal(layer.get_weights()[0], table)
        assert "weights" not in layer.get_config()
    keras_layer = keras.layers.Embedding(15, 4, weights=table)
    np.testing.assert_array_equal(keras_layer(ids), layer(ids[:, None])[:, 0])
    with pytest.raises(ValueError, match=r"'bad/embeddings'.*shape \(4, 15\)"
                       r".*whole table has shape \(15, 4\)"):
        sok.layers.DistributedEmbedding(15, 4, weights=table.T, name="bad")
    with pytest.raises(ValueError, match="a list of 2 arrays"):
        sok.layers.DistributedEmbedding(15, 4, weights=[table, table])


def test_weights_argument_in_a_subclassed_model():
    """`weights=` in a layer that Keras builds while it infers shapes (a
    subclassed model's first call, through fit or eagerly) is the initial
    table (before: the initializer's table, silently)."""

    class Model(keras.Model):
        def __init__(self, layer):
            super().__init__()
            self.emb = layer

        def call(self, x):
            return self.emb(x)

    table = np.arange(40, dtype="float32").reshape(10, 4)
    ids = np.array([[1, 2], [3, 9]])
    for make in (sok.layers.DistributedEmbedding,
                 sok.layers.LocalizedEmbedding):
        model = Model(make(10, 4, combiner=None, weights=table))
        np.testing.assert_array_equal(model(ids), table[ids])
        np.testing.assert_array_equal(model.emb.get_weights()[0], table)
    model = Model(sok.layers.DistributedEmbedding(
        10, 4, combiner="sum", weights=table))
    model.compile(optimizer="sgd", loss="mse")
    np.testing.assert_array_equal(model.predict(ids, verbose=0),
                                  table[ids].sum(axis=1))


def test_a_subclassed_model_whose_build_skips_its_layers_loads(tmp_path):
    """A subclassed model whose `build()` only calls `super().build()`:
    Keras loads weights into sok layers it never built; they build then
    and load the saved table (before: "'DistributedEmbedding' object has
    no attribute 'embeddings'")."""

    @keras.saving.register_keras_serializable("sok_test")
    class Skips(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = sok.layers.DistributedEmbedding(12, 3, combiner="sum")

        def build(self, input_shape):
            super().build(input_shape)

        def call(self, x):
            return self.emb(x)

    model = Skips()
    ids = np.array([[1, 11], [4, 4]])
    want = model(ids)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded.emb.get_weights()[0],
                                  model.emb.get_weights()[0])
    np.testing.assert_array_equal(loaded(ids), want)


def test_config_round_trip_with_non_defaults():
    layer = sok.layers.DistributedEmbedding(
        123, 7, combiner="sqrtn",
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.3),
        name="tbl", dtype="float64", pooling="owner")
    clone = assert_config_round_trip(layer)
    assert clone.combiner == "sqrtn" and clone.vocabulary_size == 123
    assert clone.pooling == "owner"
    assert clone.dtype_policy.name == "float64"


def _functional():
    ids = keras.Input(shape=(4,), dtype="int64", name="ids")
    x = sok.layers.DistributedEmbedding(50, 6, combiner="mean")(ids)
    out = keras.layers.Dense(1)(x)
    return keras.Model(ids, out)


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_models_train_with_fit_and_jit_auto(kind):
    rng = np.random.default_rng(5)
    if kind == "functional":
        model = _functional()
    elif kind == "sequential":
        model = keras.Sequential([
            keras.Input(shape=(4,), dtype="int64"),
            sok.layers.DistributedEmbedding(50, 6),
            keras.layers.Dense(1),
        ])
    else:
        model = SubclassedRanker()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  jit_compile="auto")
    x = rng.integers(-1, 50, size=(64, 4))
    y = rng.normal(size=(64, 1)).astype(np.float32)
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_summary_counts_table_parameters():
    model = _functional()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        model.summary()
    assert "300" in buf.getvalue()  # 50 x 6 table
    assert model.count_params() == 50 * 6 + 6 + 1


def test_model_save_and_load(tmp_path):
    rng = np.random.default_rng(6)
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = rng.integers(0, 50, size=(32, 4))
    model.fit(x, rng.normal(size=(32, 1)), verbose=0)
    loaded = assert_model_saving(model, x, tmp_path)
    assert isinstance(loaded.layers[1], sok.layers.DistributedEmbedding)


def test_a_model_loaded_without_compile_holds_no_optimizer_state(tmp_path):
    """As Keras: `load_model(..., compile=False)` restores no optimizer
    state, so a new optimizer starts fresh, and saving that model again
    writes none (before: the tables kept the file's slots and handed them
    to the next optimizer)."""
    rng = np.random.default_rng(9)
    model = _functional()
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adagrad(0.1)), loss="mse")
    x = rng.integers(0, 50, size=(16, 4))
    model.fit(x, rng.normal(size=(16, 1)), verbose=0)
    assert (model.layers[1].embeddings.slots["accumulator"].numpy()
            > 0.1).any()
    first = str(tmp_path / "a.keras")
    model.save(first)
    keras.utils.clear_session()
    loaded = keras.models.load_model(first, compile=False)
    table = loaded.layers[1].embeddings
    assert table.slots == {} and table.saved_slot_names() == []
    second = str(tmp_path / "b.keras")
    loaded.save(second)
    keras.utils.clear_session()
    for path in (first, second):
        again = keras.models.load_model(path, compile=False)
        again.compile(optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adagrad(0.1)), loss="mse")
        again.optimizer.build(again.trainable_variables)
        np.testing.assert_array_equal(
            again.layers[1].embeddings.slots["accumulator"].numpy(),
            np.float32(0.1))


def test_models_with_sok_layers_never_use_xla():
    # The same check Keras' jit_compile="auto" makes on an accelerator.
    model = _functional()
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert model.jit_compile is False
    coll = sok.layers.EmbeddingCollection(
        {"t": {"vocabulary_size": 5, "embedding_dim": 2}},
        {"f": {"table": "t"}})
    assert coll.supports_jit is False


def test_models_holding_a_sok_variable_themselves_never_use_xla():
    """SOK's way, a model holding a `sok.Variable` and looking it up with
    `sok.lookup_sparse` (no sok layer), gets the same answer from Keras'
    XLA check as a model with sok layers. Before, Keras saw no layer
    without XLA kernels: on a GPU, `jit_compile="auto"` compiled the step
    and `fit` failed at the lookup (H100 run 29); here `jit_compile=True`
    does the same on the CPU."""
    from tests.layers_model import RawTableRanker

    rng = np.random.default_rng(0)
    x = rng.integers(0, 41, size=(16, 3))
    y = rng.normal(size=(16, 1)).astype(np.float32)
    model = RawTableRanker()
    with pytest.warns(UserWarning, match="doesn't support `jit_compile=True`"):
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert model.jit_compile is False
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(model.predict(x, verbose=0)).all()
    # An uncompiled model resolves "auto" through the same check.
    from keras.src.trainers.trainer import model_supports_jit

    assert model_supports_jit(RawTableRanker()) is False
    assert model_supports_jit(_functional()) is False
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert model_supports_jit(plain) is True


@pytest.mark.parametrize("combiner", [None, "sum"])
def test_a_lookup_inside_tf_cond_trains(combiner):
    """A subclassed model looking up in one branch of a `tf.cond`: the other
    branch's zero gradient of the table is TensorFlow's (int32 shape), and
    the lookup's must match it (QA: `fit` failed with "true_fn and
    false_fn ... must have the same ... structure" on one rank)."""

    class Branchy(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = sok.layers.DistributedEmbedding(20, 4,
                                                       combiner=combiner)
            self.out = keras.layers.Dense(1)

        def call(self, ids):
            shape = [tf.shape(ids)[0], 3, 4] if combiner is None else [
                tf.shape(ids)[0], 4]
            h = tf.cond(tf.shape(ids)[0] > 0, lambda: self.emb(ids),
                        lambda: tf.zeros(shape))
            return self.out(tf.reshape(h, [tf.shape(ids)[0], -1]))

    model = Branchy()
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(24).reshape(8, 3) % 20
    model(x[:1])
    before = model.emb.embeddings.numpy().copy()
    model.fit(x, np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    changed = np.any(model.emb.embeddings.numpy() != before, axis=1)
    np.testing.assert_array_equal(np.flatnonzero(changed), np.unique(x))


def test_unpooled_lookup_masks_padding_for_mask_aware_layers():
    table = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    ids = np.array([[1, 2, -1], [3, -1, -1]])
    inp = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(10, 2, combiner=None)
    out = keras.layers.GlobalAveragePooling1D()(emb(inp))
    model = keras.Model(inp, out)
    emb.embeddings.assign(table)
    got = model.predict(ids, verbose=0)
    np.testing.assert_allclose(got, [(table[1] + table[2]) / 2, table[3]])
    mask = emb.compute_mask(tf.constant(ids))
    assert mask.numpy().tolist() == [[True, True, False],
                                     [True, False, False]]
    pooled = sok.layers.DistributedEmbedding(10, 2, combiner="sum")
    assert pooled.compute_mask(tf.constant(ids)) is None


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
@pytest.mark.parametrize("layer", ["distributed", "collection"])
def test_unpooled_lookup_of_ragged_or_sparse_model_inputs(kind, layer):
    """`keras.Input(ragged=True)` / `(sparse=True)` into an unpooled
    lookup in a functional model: no mask (as for ragged or sparse
    tensors), and ragged ids give a ragged output spec. Before, the layer
    gave the placeholder the dense `ids != -1` mask: `predict` failed with
    "Failed to convert elements of SparseTensor" (sparse) or in
    GlobalAveragePooling1D's reshape (ragged)."""
    table = np.arange(10 * 2, dtype=np.float32).reshape(10, 2)
    rows = [[1, 2], [3], [4, 5, 6]]
    ids = tf.ragged.constant(rows, dtype=tf.int64)
    if kind == "sparse":
        ids = ids.to_sparse()
    inp = keras.Input((None,), dtype="int64", name="g",
                      **{kind: True})
    if layer == "distributed":
        emb = sok.layers.DistributedEmbedding(10, 2, combiner=None)
        out, x, var = emb(inp), ids, lambda: emb.embeddings
    else:
        emb = sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 10, "embedding_dim": 2}},
            {"g": {"table": "t", "combiner": None}})
        out, x = emb({"g": inp})["g"], {"g": ids}
        inp, var = {"g": inp}, lambda: emb.embeddings["t"]
    assert getattr(out, "_keras_mask", None) is None
    assert out.ragged == (kind == "ragged")
    var().assign(table)
    summed = keras.Model(inp, keras.layers.Lambda(
        lambda t: keras.ops.sum(t, axis=1), output_shape=(2,))(out))
    np.testing.assert_allclose(summed.predict(x, verbose=0),
                               [table[r].sum(0) for r in rows])
    avg = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(out))
    got = avg.predict(x, verbose=0)
    if kind == "ragged":  # the rows of each example
        want = [table[r].mean(0) for r in rows]
    else:  # the sparse ids' dense rows: zeros where there is no id
        want = [table[r].sum(0) / 3 for r in rows]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    avg.compile(optimizer="sgd", loss="mse")
    avg.fit(x, np.ones((3, 2), np.float32), verbose=0)
    assert not np.array_equal(var().numpy(), table)


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
@pytest.mark.parametrize("layer", ["distributed", "collection"])
def test_unpooled_lookup_of_ids_from_a_lookup_layer(kind, layer):
    """Ragged or sparse strings through `StringLookup` (and `Hashing`)
    inside the model: Keras marks those layers' outputs dense, but they
    are ragged (sparse) at run time. The lookup gives them no mask and a
    ragged output, as `keras.layers.Embedding` (QA: the layer's `ids != -1`
    mask became a ragged mask at run time, and GlobalAveragePooling1D
    failed, "Input to reshape is a tensor with 1 values")."""
    words = tf.ragged.constant([["a", "b"], ["c", "zz", "a"], ["b"]])
    x = words if kind == "ragged" else words.to_sparse()
    inp = keras.Input((None,), dtype="string", **{kind: True})
    ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"])(inp)
    rows = [[1, 2], [3, 0, 1], [2]]  # (0: out of vocabulary)
    table = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
    if layer == "distributed":
        emb = sok.layers.DistributedEmbedding(4, 2, combiner=None)
        out, var = emb(ids), lambda: emb.embeddings
    else:
        emb = sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 4, "embedding_dim": 2}},
            {"g": {"table": "t", "combiner": None}})
        out, var = emb({"g": ids})["g"], lambda: emb.embeddings["t"]
    assert getattr(out, "_keras_mask", None) is None
    assert out.ragged == (kind == "ragged")
    var().assign(table)
    avg = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(out))
    got = avg.predict(x, verbose=0)
    if kind == "ragged":
        want = [table[r].mean(0) for r in rows]
    else:  # zeros where the dense rows have no id
        want = [table[r].sum(0) / 3 for r in rows]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    avg.compile(optimizer="sgd", loss="mse")
    avg.fit(x, np.ones((3, 2), np.float32), verbose=0)
    assert not np.array_equal(var().numpy(), table)
    # Through a chain of lookup layers too.
    hashed = keras.layers.Hashing(4)(keras.layers.StringLookup(
        vocabulary=["a"], output_mode="int")(inp))
    assert sok.layers.DistributedEmbedding(4, 2, combiner=None)(
        hashed).ragged == (kind == "ragged")
    # Not a lookup's ids: counts, dense at run time (and masked).
    counts = keras.layers.Hashing(4, output_mode="count")(inp)
    out = sok.layers.DistributedEmbedding(4, 2, combiner=None)(counts)
    assert not out.ragged and out._keras_mask is not None


def test_a_subclassed_model_saves_and_loads_with_its_trained_state(
        tmp_path):
    """Before: load_model failed with "'DistributedEmbedding' object has
    no attribute 'embeddings'" (the table could not be made inside Keras'
    StatelessScope)."""
    rng = np.random.default_rng(11)
    x = rng.integers(0, 50, size=(32, 4))
    model = SubclassedRanker()
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.1)),
                  loss="mse")
    model.fit(x, rng.normal(size=(32, 1)), batch_size=8, verbose=0)
    loaded = assert_model_saving(model, x, tmp_path)
    np.testing.assert_array_equal(loaded.emb.embeddings.numpy(),
                                  model.emb.embeddings.numpy())
    np.testing.assert_array_equal(loaded.emb.embeddings.slots["m"].numpy(),
                                  model.emb.embeddings.slots["m"].numpy())


def test_a_custom_layer_without_build_makes_its_table_on_a_keras_input():
    """A custom layer with no `build()` builds its sublayers by running
    `call` symbolically (Keras' StatelessScope): the table is made when
    the scope exits, seeded as an eager build would make it."""

    class Twice(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = sok.layers.DistributedEmbedding(
                40, 3, embeddings_initializer=keras.initializers.RandomNormal(
                    seed=5))

        def call(self, ids):
            return 2.0 * self.emb(ids)

    ids = keras.Input((2,), dtype="int64")
    layer = Twice()
    model = keras.Model(ids, layer(ids))
    assert model.output.shape == (None, 3)
    table = layer.emb.embeddings
    assert isinstance(table, sok.Variable) and table.shape == (40, 3)
    expected = keras.initializers.RandomNormal(seed=5)((40, 3)).numpy()
    np.testing.assert_array_equal(table.numpy(), expected)
    x = np.array([[1, 2], [3, -1]])
    np.testing.assert_allclose(
        model.predict(x, verbose=0),
        2.0 * np.stack([expected[1] + expected[2], expected[3]]), rtol=1e-6)


def test_a_sequential_without_an_int_input_names_the_fix():
    """Keras gives a Sequential with no Input float32 inputs, which the
    layers take where they are exact (tables of at most 2**24 rows,
    tests/test_bad_inputs.py); for a larger table the error names the
    layer and says how to declare int ids."""
    model = keras.Sequential([sok.layers.DistributedEmbedding(2 ** 24 + 1, 1,
                                                              name="emb"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match=r"(?s)emb.*float32.*keras\.Input"):
        model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)


@pytest.mark.parametrize("kind", ["distributed", "collection"])
def test_trainable_false_in_the_constructor_freezes_the_table(kind, tmp_path):
    """As with `keras.layers.Embedding(trainable=False)`: the table is not
    trained, also after load_model and clone_model, and
    `layer.trainable = True` thaws it. Before: the table trained."""
    rng = np.random.default_rng(12)
    x = rng.integers(0, 50, size=(32, 3))
    y = rng.normal(size=(32, 1))
    ids = keras.Input((3,), dtype="int64", name="ids")
    if kind == "distributed":
        layer = sok.layers.DistributedEmbedding(50, 4, trainable=False,
                                                name="emb")
        out = layer(ids)
    else:
        layer = sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": 50, "embedding_dim": 4}},
            {"ids": {"table": "t"}}, trainable=False, name="emb")
        out = layer({"ids": ids})["ids"]
    model = keras.Model(ids, keras.layers.Dense(1)(out))

    def table(m):
        emb = m.get_layer("emb").embeddings
        return emb if kind == "distributed" else emb["t"]

    def fit_changes_table(m):
        m.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.SGD(0.5)),
                  loss="mse")
        before = table(m).numpy().copy()
        m.fit(x, y, batch_size=8, verbose=0)
        return not np.array_equal(table(m).numpy(), before)

    assert len(model.trainable_weights) == 2  # the Dense layer's
    assert not fit_changes_table(model)
    path = str(tmp_path / "frozen.keras")
    model.save(path)
    for again in (keras.models.load_model(path),
                  keras.models.clone_model(model)):
        assert not again.get_layer("emb").trainable
        assert not fit_changes_table(again)
    layer.trainable = True
    assert fit_changes_table(model)


def test_unpooled_ids_of_any_rank_like_keras_embedding():
    """`keras.layers.Embedding` takes ids [batch, a, b]: so does an
    unpooled sok layer, with the mask `ids != -1` of the ids' shape
    (before: "dense ids must have shape [batch] or [batch, n]")."""
    rng = np.random.default_rng(13)
    ids = rng.integers(-1, 50, size=(4, 3, 2))
    table = rng.normal(size=(50, 5)).astype(np.float32)
    layer = _layer_with_table(table, combiner=None)
    want = table[np.maximum(ids, 0)] * (ids >= 0)[..., None]
    np.testing.assert_array_equal(layer(ids).numpy(), want)
    np.testing.assert_array_equal(
        layer.compute_mask(tf.constant(ids)).numpy(), ids != -1)
    w = rng.uniform(0.5, 2.0, size=ids.shape).astype(np.float32)
    np.testing.assert_allclose(layer(ids, w).numpy(), want * w[..., None],
                               rtol=1e-6)
    inp = keras.Input((3, 2), dtype="int64")
    out = layer(inp)
    assert out.shape == (None, 3, 2, 5)
    model = keras.Model(inp, keras.layers.Dense(1)(
        keras.layers.Reshape((30,))(out)))
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.SGD(0.1)),
                  loss="mse")
    model.fit(ids, np.ones((4, 1)), verbose=0)
    assert not np.array_equal(layer.embeddings.numpy(), table)
    pooled = _layer_with_table(table)
    with pytest.raises(ValueError, match=r"shape \[batch\] or \[batch, n\]"):
        pooled(ids)


def test_weights_of_a_keras_embedding_model_say_how_to_move_them(tmp_path):
    """A `.weights.h5` of the same model on `keras.layers.Embedding` holds
    nothing under the sok layer's key: the error says why and what to do
    (before: "Found: []" alone)."""

    def build(emb):
        ids = keras.Input((3,), dtype="int64", name="ids")
        return keras.Model(ids, keras.layers.Dense(1, name="dense")(
            keras.layers.Flatten()(emb(ids))))

    plain = build(keras.layers.Embedding(50, 4, name="emb"))
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    ours = build(sok.layers.DistributedEmbedding(50, 4, combiner=None,
                                                 name="emb"))
    with pytest.raises(ValueError, match=r"(?s)emb.*Found: \[\].*"
                       r"get_weights\(\)` / `set_weights\(\)"):
        ours.load_weights(path)
    ours.set_weights(plain.get_weights())
    x = np.array([[1, 2, 3]])
    np.testing.assert_allclose(ours.predict(x, verbose=0),
                               plain.predict(x, verbose=0), rtol=1e-6)


def test_unpooled_ids_with_no_columns_give_an_empty_output_like_keras():
    """Dense ids of shape [2, 0] (before, on one rank: "shape (1, 0, 2) is
    not compatible with (2, 0, 2)")."""
    layer = sok.layers.DistributedEmbedding(10, 2, combiner=None)
    ids = tf.zeros([2, 0], tf.int64)
    assert layer(ids).shape == keras.layers.Embedding(10, 2)(ids).shape
    assert layer(ids).shape == (2, 0, 2)
    traced = tf.function(layer, input_signature=[
        tf.TensorSpec([None, 0], tf.int64)])
    assert traced(ids).shape == (2, 0, 2)


def test_pooled_layer_refuses_3d_ids_when_the_model_is_built():
    """A pooled layer's output is [batch, dim] from ids [batch, n]: ids of
    more dimensions are refused when the model is built, naming the layer
    (before: the output shape said (None, 4) and `fit` failed at its first
    batch). Unpooled, any shape is taken."""
    ids = keras.Input((3, 5), dtype="int64")
    with pytest.raises(ValueError, match=r"'pooled3d': a pooled lookup "
                       r"\(combiner='sum'\).*shape \(None, 3, 5\)"):
        sok.layers.DistributedEmbedding(10, 4, combiner="sum",
                                        name="pooled3d")(ids)
    out = sok.layers.DistributedEmbedding(10, 4, combiner=None)(ids)
    assert tuple(out.shape) == (None, 3, 5, 4)



def test_a_layer_shared_by_two_nested_models_says_how_to_save_it(tmp_path):
    """Keras saves a layer shared by two nested models once, under the
    first, and `load_model` looks for its weights under each
    (`keras.layers.Embedding` fails alike). The error said only that the
    file came from another layer class (QA); it names this case and its
    ways out now, and `save_weights` / `load_weights` into the model the
    code makes works."""
    import pytest

    shared = sok.layers.DistributedEmbedding(40, 4, combiner=None, name="it")
    towers = []
    for n, name in ((3, "tower_a"), (4, "tower_b")):
        ids = keras.Input((n,), dtype="int64")
        towers.append(keras.Model(
            ids, keras.layers.GlobalAveragePooling1D()(shared(ids)),
            name=name))
    inputs = [keras.Input((3,), dtype="int64"),
              keras.Input((4,), dtype="int64")]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(
        [t(i) for t, i in zip(towers, inputs)]))
    model = keras.Model(inputs, out)
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 40, (8, 3)), rng.integers(0, 40, (8, 4))]
    expected = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    with pytest.raises(ValueError, match=(
            r"Layer 'it': no 'embeddings' entry.*shared by two nested "
            r"models.*save_weights")):
        keras.saving.load_model(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    for w in model.weights:
        w.assign(w * 0)
    model.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
