"""sok.export_for_serving: a SavedModel of plain TF ops that loads where
sok_keras is not installed and predicts what the Keras model predicts."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.multiprocess import REPO

CHECK = os.path.join(REPO, "tests", "serving_check.py")


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """On a GPU TensorFlow multiplies float32 in TF32 by default, which
    rounds the inputs to 10 bits: a last-bit difference between sok's and
    the export's lookups then shows as ~1e-4 in a Dense output. Both sides
    of the comparison run in plain float32 (serving_check.py does the
    same)."""
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    # (As it was: modules that turn TF32 off at import keep it off.)
    tf.config.experimental.enable_tensor_float_32_execution(was)


def serve_without_sok(saved_model, probe, tmp_path):
    """Predictions of `saved_model` on `probe`, from a Python in which
    `import sok_keras` fails."""
    inputs = os.path.join(tmp_path, "probe.npz")
    np.savez(inputs, **{f"probe_{k}": v for k, v in probe.items()})
    out = os.path.join(tmp_path, "served.npy")
    # Without the checkout on the path (serving_check.py also blocks
    # `import sok_keras`); other entries stay (TensorFlow may live there).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != REPO)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    proc = subprocess.run(
        [sys.executable, CHECK, saved_model, inputs, out], env=env,
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return np.load(out)


def saved_ops(path):
    """The op types of the SavedModel at `path` (its graph and functions)."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    return {n.op for n in graph.node} | {
        n.op for fn in graph.library.function for n in fn.node_def}


def _model():
    keras.utils.set_random_seed(3)
    ids = keras.Input((3,), dtype="int64", name="ids")
    w = keras.Input((3,), dtype="float32", name="w")
    seq = keras.Input((4,), dtype="int64", name="seq")
    grid = keras.Input((2, 3), dtype="int64", name="grid")
    pooled = sok.layers.DistributedEmbedding(
        60, 4, combiner="mean", name="pooled")(ids, w)
    summed = sok.layers.LocalizedEmbedding(
        40, 3, combiner="sqrtn", name="loc")(ids % 40, w)
    unpooled = sok.layers.DistributedEmbedding(
        50, 4, combiner=None, name="unpooled")(seq)
    unpooled = keras.layers.GlobalAveragePooling1D()(unpooled)  # mask
    dense = sok.layers.All2AllDenseEmbedding(
        max_vocabulary_size_per_gpu=20, embedding_vec_size=2, slot_num=2,
        nnz_per_slot=3, name="a2a")(grid)
    dense = keras.layers.Flatten()(dense)
    col = sok.layers.EmbeddingCollection(
        tables={"t": {"vocabulary_size": 30, "embedding_dim": 2},
                "u": {"vocabulary_size": 10, "embedding_dim": 3}},
        features={"f": {"table": "t", "combiner": "sum"},
                  "g": {"table": "t", "combiner": None},
                  "h": {"table": "u", "combiner": "mean"}},
        name="col")({"f": ids % 30, "g": ids % 30, "h": seq % 10})
    x = keras.layers.Concatenate()(
        [pooled, summed, unpooled, dense, col["f"],
         keras.layers.Flatten()(col["g"]), col["h"]])
    out = keras.layers.Dense(2, name="head")(x)
    model = keras.Model({"ids": ids, "w": w, "seq": seq, "grid": grid}, out)
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(0.05)), loss="mse")
    return model


def _data(seed, batch):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(-1, 60, (batch, 3)),
            "w": rng.random((batch, 3)).astype("float32"),
            "seq": rng.integers(-1, 50, (batch, 4)),
            "grid": rng.integers(0, 20, (batch, 2, 3))}


def test_export_serves_the_same_predictions_without_sok_keras(tmp_path):
    """Pooled (weights, mean / sqrtn) and unpooled layers (a mask-aware
    pooling after one), All2AllDenseEmbedding and an EmbeddingCollection,
    trained a little: the SavedModel predicts what the model does, in a
    Python where sok_keras cannot be imported."""
    model = _model()
    model.fit(_data(0, 64), np.random.default_rng(1).normal(
        size=(64, 2)).astype("float32"), batch_size=32, verbose=0)
    probe = _data(5, 16)
    expected = model.predict(probe, verbose=0)
    path = os.path.join(tmp_path, "serving")
    sok.export_for_serving(model, path)
    assert os.path.isfile(os.path.join(path, "saved_model.pb"))
    assert [n for n in os.listdir(tmp_path) if "sok-tmp" in n] == []
    np.testing.assert_allclose(serve_without_sok(path, probe, tmp_path),
                               expected, rtol=1e-6, atol=1e-6)
    # The graph holds only TensorFlow's own ops.
    ops = saved_ops(path)
    assert {"GatherV2", "UnsortedSegmentSum"} <= ops, sorted(ops)
    assert not [o for o in ops if o.startswith("Sok")], sorted(ops)


def test_export_replaces_an_existing_export_only_when_complete(tmp_path):
    model = _model()
    path = os.path.join(tmp_path, "serving")
    sok.export_for_serving(model, path)
    before = sorted(os.listdir(path))
    from sok_keras import serving as export

    original = keras.Model.export

    def failing(self, filepath, *args, **kwargs):
        os.makedirs(filepath, exist_ok=True)
        with open(os.path.join(filepath, "saved_model.pb"), "wb") as f:
            f.write(b"partial")
        raise OSError("disk full (injected)")

    keras.Model.export = failing
    try:
        with pytest.raises(OSError, match="disk full"):
            export.export_for_serving(model, path)
    finally:
        keras.Model.export = original
    assert sorted(os.listdir(path)) == before
    assert tf.saved_model.load(path) is not None
    assert [n for n in os.listdir(tmp_path) if "sok-tmp" in n] == []


def test_export_refuses_a_file_or_a_folder_of_other_files(tmp_path):
    """Only a new path, an empty folder or an earlier export is replaced
    (before: a file, or a project folder and everything in it, was
    silently replaced by the SavedModel)."""
    model = _model()
    afile = tmp_path / "train.py"
    afile.write_text("print('mine')\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("keep me")
    for target, what in ((afile, "is not a folder"),
                         (project, "holds other files")):
        with pytest.raises(FileExistsError, match=what):
            sok.export_for_serving(model, str(target))
    assert afile.read_text() == "print('mine')\n"
    assert sorted(os.listdir(project)) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["project", "train.py"]
    empty = tmp_path / "empty"
    empty.mkdir()
    sok.export_for_serving(model, str(empty))
    assert os.path.isfile(empty / "saved_model.pb")
    # A "latest" link to an earlier export: refused, saying it is a link
    # (before: "exists and is not a folder").
    (tmp_path / "latest").symlink_to(empty)
    with pytest.raises(FileExistsError, match=r"'.*latest' is a symbolic "
                       r"link \(to '.*empty'\).*point the link there"):
        sok.export_for_serving(model, str(tmp_path / "latest"))
    assert os.readlink(tmp_path / "latest") == str(empty)
    # (Before: a bare "expected str, bytes or os.PathLike object".)
    with pytest.raises(TypeError, match=r"export_for_serving: `path` must "
                       r"be a str.*Received: path=None"):
        sok.export_for_serving(model, None)


def test_export_of_a_sequential_with_no_input(tmp_path):
    """Its input is float32 (Keras' default): the serving model takes the
    float ids as the sok layer does, and serves without sok_keras."""
    rng = np.random.default_rng(4)
    x = rng.integers(-1, 30, size=(16, 3))
    model = keras.Sequential([
        sok.layers.DistributedEmbedding(30, 4, combiner=None, name="emb"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, rng.normal(size=(16, 1)), verbose=0)
    assert model.inputs[0].dtype == "float32"
    path = str(tmp_path / "served")
    sok.export_for_serving(model, path)
    served = serve_without_sok(path, {"": x.astype(np.float32)}, tmp_path)
    np.testing.assert_allclose(served, model.predict(x, verbose=0),
                               rtol=1e-6, atol=1e-6)


def test_export_of_unpooled_ids_of_rank_3(tmp_path):
    """Unpooled [batch, 2, 3] ids (`DistributedEmbedding` and an
    `EmbeddingCollection` feature): the export serves them (before: it
    refused the ids, saying the model could not be cloned)."""
    ids = keras.Input((2, 3), dtype="int64", name="ids")
    one = sok.layers.DistributedEmbedding(30, 4, combiner=None, name="one")
    col = sok.layers.EmbeddingCollection(
        {"t": {"vocabulary_size": 30, "embedding_dim": 4}},
        {"g": {"table": "t", "combiner": None}}, name="col")
    pooled = [keras.layers.GlobalAveragePooling1D()(
        keras.layers.Reshape((6, 4))(x))
        for x in (one(ids), col({"g": ids})["g"])]
    model = keras.Model(
        {"ids": ids}, keras.layers.Dense(1)(keras.layers.Concatenate()(
            [keras.layers.Flatten()(one(ids))] + pooled)))
    probe = {"ids": np.random.default_rng(6).integers(-1, 30, (8, 2, 3))}
    path = str(tmp_path / "rank3")
    sok.export_for_serving(model, path)
    served = serve_without_sok(path, probe, tmp_path)
    np.testing.assert_allclose(served, model.predict(probe, verbose=0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_export_of_a_16_bit_table_with_weights(dtype, tmp_path):
    """Weighted pooled lookups of a 16-bit table: the serving layers round
    the weights to the table's dtype first, as the sok layer does (before:
    they kept them in float32, and up to 43% of the outputs differed)."""
    ids = keras.Input((5,), dtype="int64", name="ids")
    w = keras.Input((5,), dtype="float32", name="w")
    outs = [sok.layers.DistributedEmbedding(
        40, 8, combiner=c, dtype=dtype, name=f"emb_{c}",
        embeddings_initializer=keras.initializers.RandomNormal(seed=i))(
            ids, w) for i, c in enumerate(("sum", "mean", "sqrtn"))]
    model = keras.Model({"ids": ids, "w": w},
                        keras.layers.Concatenate()(outs))
    rng = np.random.default_rng(7)
    probe = {"ids": rng.integers(-1, 40, (16, 5)),
             "w": rng.random((16, 5)).astype(np.float32)}
    path = str(tmp_path / "served")
    sok.export_for_serving(model, path)
    served = serve_without_sok(path, probe, tmp_path)
    _assert_same_16_bit(served, model.predict(probe, verbose=0), dtype)


def test_keras_model_export_writes_the_serving_export(tmp_path):
    """Keras' own `model.export` of a model with sok tables writes
    `export_for_serving`'s SavedModel (before: one of sok's ops, which
    failed to load without sok_keras); other formats are refused."""
    model = _model()
    probe = _data(5, 8)
    path = str(tmp_path / "keras_export")
    model.export(path, verbose=False)
    served = serve_without_sok(path, probe, tmp_path)
    np.testing.assert_allclose(served, model.predict(probe, verbose=0),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"(?s)sok embedding tables.*onnx"):
        model.export(str(tmp_path / "onnx"), format="onnx")
    assert not os.path.exists(tmp_path / "onnx")


class ServedTower(keras.layers.Layer):
    """A custom layer holding a sok layer (which cloning cannot reach)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = sok.layers.DistributedEmbedding(40, 3, combiner="sum",
                                                   name="tower_emb")
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(self.emb(x))


class ServedRanker(keras.Model):
    """A subclassed model: a pooled and an unpooled lookup (with its
    padding mask), an EmbeddingCollection (whose `call` takes
    `training`), a custom layer holding a sok layer, a weight of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = sok.layers.DistributedEmbedding(60, 4, combiner="mean",
                                                   name="emb")
        self.seq = sok.layers.LocalizedEmbedding(50, 4, combiner=None,
                                                 name="seq")
        self.avg = keras.layers.GlobalAveragePooling1D()
        self.col = sok.layers.EmbeddingCollection(
            tables={"t": {"vocabulary_size": 30, "embedding_dim": 2}},
            features={"f": {"table": "t", "combiner": "sum"}}, name="col")
        self.tower = ServedTower(name="tower")
        self.head = keras.layers.Dense(2, name="head")

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(2,), initializer="ones",
                                     name="scale")
        super().build(input_shape)

    def call(self, ids):
        x = keras.ops.concatenate([
            self.emb(ids), self.avg(self.seq(ids)),
            self.col({"f": ids % 30})["f"], self.tower(ids % 40)], axis=-1)
        return self.head(x) * self.scale


@pytest.mark.parametrize("how", ["export_for_serving", "model.export"])
def test_export_of_a_subclassed_model(how, tmp_path):
    """A subclassed model (and a layer of its own holding a sok layer),
    which cloning cannot swap: its own `call` is traced with its sok
    layers' lookups redirected to serving layers. The SavedModel serves
    the model's predictions without sok_keras, holds no Sok op and none of
    the sharded tables, and the model is unchanged afterwards (before:
    refused, "only functional and Sequential models")."""
    keras.utils.set_random_seed(5)
    model = ServedRanker()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(2)
    x = rng.integers(-1, 50, (64, 5))
    model.fit(x, rng.normal(size=(64, 2)).astype("float32"), batch_size=32,
              verbose=0)
    probe = {"": rng.integers(-1, 50, (16, 5))}
    expected = model.predict(probe[""], verbose=0)
    path = os.path.join(tmp_path, "serving")
    if how == "model.export":
        model.export(path)
    else:
        sok.export_for_serving(model, path)
    assert [n for n in os.listdir(tmp_path) if "sok-tmp" in n] == []
    np.testing.assert_allclose(serve_without_sok(path, probe, tmp_path),
                               expected, rtol=1e-6, atol=1e-6)
    ops = saved_ops(path)
    assert not [o for o in ops if o.startswith("Sok")], sorted(ops)
    # The model's own lookups are back, and it still trains.
    for layer in (model.emb, model.seq, model.col, model.tower.emb):
        assert "call" not in layer.__dict__
    np.testing.assert_array_equal(model.predict(probe[""], verbose=0),
                                  expected)
    model.fit(x, rng.normal(size=(64, 2)).astype("float32"), verbose=0)


@pytest.mark.parametrize("how", ["export_for_serving", "model.export"])
def test_export_of_towers_nested_as_functional_models(how, tmp_path):
    """A two-tower model whose towers are functional models holding sok
    layers (Sequential too), one table shared by both: every nested sok
    layer is swapped and the export serves the model's predictions without
    sok_keras (before: the nested layers were kept, and the clone's export
    recursed until a RecursionError; on N ranks rank 0 waited alone in a
    collective)."""
    keras.utils.set_random_seed(4)
    items = sok.layers.DistributedEmbedding(50, 4, combiner="mean",
                                            name="items")
    user_in = keras.Input((3,), dtype="int64", name="u")
    user = keras.Model(user_in, keras.layers.Dense(4)(
        sok.layers.LocalizedEmbedding(30, 4, combiner="sum",
                                      name="users")(user_in)), name="user")
    item_in = keras.Input((2,), dtype="int64", name="i")
    item = keras.Model(item_in, keras.layers.Dense(4)(items(item_in)),
                       name="item")
    hist = keras.Sequential([keras.Input((5,), dtype="int64"), items,
                             keras.layers.Dense(4)], name="history")
    u_in = keras.Input((3,), dtype="int64", name="user_ids")
    i_in = keras.Input((2,), dtype="int64", name="item_ids")
    h_in = keras.Input((5,), dtype="int64", name="history_ids")
    score = keras.layers.Dot(axes=1)(
        [keras.layers.Add()([user(u_in), hist(h_in)]), item(i_in)])
    model = keras.Model({"user_ids": u_in, "item_ids": i_in,
                         "history_ids": h_in}, score)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)

    def data(batch):
        return {"user_ids": rng.integers(-1, 30, (batch, 3)),
                "item_ids": rng.integers(0, 50, (batch, 2)),
                "history_ids": rng.integers(-1, 50, (batch, 5))}

    model.fit(data(64), rng.normal(size=(64, 1)).astype("float32"),
              batch_size=32, verbose=0)
    probe = data(16)
    expected = model.predict(probe, verbose=0)
    path = os.path.join(tmp_path, "serving")
    if how == "model.export":
        model.export(path)
    else:
        sok.export_for_serving(model, path)
    np.testing.assert_allclose(serve_without_sok(path, probe, tmp_path),
                               expected, rtol=1e-6, atol=1e-6)


def test_traced_export_keeps_resources_and_refuses_tied_tables(tmp_path):
    """The traced export tracks the layers holding no sharded table, with
    their resources (a StringLookup's hash table; before: "untracked
    resource"); takes an `input_signature` (Keras infers float32 inputs
    for a subclassed model: int64 or string ids need one); and refuses a
    model that reads a table other than through a lookup (tied output
    weights: the export would hold one rank's shard), naming the table."""
    class WithLookup(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
            self.emb = sok.layers.DistributedEmbedding(5, 4, name="emb")
            self.head = keras.layers.Dense(1)

        def call(self, s):
            return self.head(self.emb(self.lookup(s)))

    class Tied(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.emb = sok.layers.DistributedEmbedding(20, 4, name="emb")

        def call(self, ids):
            return keras.ops.matmul(self.emb(ids), keras.ops.transpose(
                self.emb.embeddings))

    keras.utils.set_random_seed(2)
    model = WithLookup()
    words = tf.constant([["a", "b"], ["b", "zz"]])
    expected = model(words).numpy()
    path = os.path.join(tmp_path, "lookup")
    sok.export_for_serving(model, path, input_signature=[
        tf.TensorSpec((None, 2), tf.string)])
    served = tf.saved_model.load(path)
    np.testing.assert_allclose(served.serve(words).numpy(), expected,
                               rtol=1e-6)
    model = Tied()
    model(np.array([[1, 2]]))
    path = os.path.join(tmp_path, "tied")
    with pytest.raises(ValueError, match=r"reads the sharded table\(s\) "
                       r"\['tied/emb/embeddings'\] other than by looking"):
        sok.export_for_serving(model, path, input_signature=[
            tf.TensorSpec((None, 2), tf.int64)])
    assert not os.path.exists(path)
    assert "call" not in model.emb.__dict__


def test_export_of_a_custom_layer_holding_a_sok_layer(tmp_path):
    """A sok layer inside a custom layer of a functional model is swapped
    too (the traced export; before: refused, and earlier a RecursionError).
    A sharded table looked up outside sok layers (a custom layer's own
    `sok.Variable`) is refused at once, on every rank before any
    collective, naming it."""
    class OwnTable(keras.layers.Layer):
        def build(self, shape):
            self.table = sok.Variable(np.zeros((10, 2), np.float32),
                                      name="own")

        def call(self, x):
            return sok.lookup_sparse(self.table, x, combiners="sum")

    keras.utils.set_random_seed(6)
    x = keras.Input((3,), dtype="int64", name="ids")
    model = keras.Model(x, ServedTower(name="tower")(x))
    probe = {"": np.random.default_rng(1).integers(-1, 40, (8, 3))}
    expected = model.predict(probe[""], verbose=0)
    path = os.path.join(tmp_path, "tower")
    sok.export_for_serving(model, path)
    np.testing.assert_allclose(serve_without_sok(path, probe, tmp_path),
                               expected, rtol=1e-6, atol=1e-6)
    path = os.path.join(tmp_path, "never-written")
    model = keras.Model(x, OwnTable(name="own_table")(x))
    with pytest.raises(ValueError, match=r"looks up the sharded table\(s\) "
                       r"\['own_table/own'\] outside sok layers"):
        model.export(path)
    assert not os.path.exists(path)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_export_under_a_mixed_policy_sums_before_it_rounds(policy, tmp_path):
    """Under a mixed policy the float32 table's rows are summed in float32
    and the sum rounded once, by the sok layer and by the export alike (an
    autocast table read would round every row first)."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        ids = keras.Input((6,), dtype="int64", name="ids")
        seq = keras.Input((6,), dtype="int64", name="seq")
        pooled = sok.layers.DistributedEmbedding(
            100, 8, combiner="sum", name="emb")(ids)
        col = sok.layers.EmbeddingCollection(
            tables={"t": {"vocabulary_size": 100, "embedding_dim": 8}},
            features={"f": {"table": "t", "combiner": "sqrtn"}},
            name="col")({"f": seq})
        model = keras.Model({"ids": ids, "seq": seq}, [pooled, col["f"]])
        rng = np.random.default_rng(0)
        model.get_layer("emb").set_weights(
            [rng.normal(size=(100, 8)).astype("float32")])
        probe = {"ids": rng.integers(0, 100, (256, 6)),
                 "seq": rng.integers(-1, 100, (256, 6))}
        expected = model.predict(probe, verbose=0)
        path = os.path.join(tmp_path, "serving")
        sok.export_for_serving(model, path)
        loaded = tf.saved_model.load(path)
        served = loaded.serve({k: tf.constant(v) for k, v in probe.items()})
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for want, got in zip(expected, served):
        assert got.dtype == want.dtype
        _assert_same_16_bit(got, want, policy[len("mixed_"):])


def _assert_same_16_bit(got, want, dtype):
    """Equal on the CPU. On a GPU the two float32 sums run in different
    orders (the export's segment sum with atomics): a sum near a rounding
    boundary may round to the neighbouring 16-bit value, in under 1% of
    the values (rounding every row first made 42% differ, GPU run 13)."""
    want, got = np.asarray(want, "float32"), np.asarray(got, "float32")
    if not tf.config.list_physical_devices("GPU"):
        np.testing.assert_array_equal(got, want)
        return
    assert np.mean(got != want) < 0.01, np.mean(got != want)
    ulp = 2.0 ** (-10 if dtype == "float16" else -7)
    np.testing.assert_allclose(got, want, rtol=ulp, atol=1e-6)


@keras.saving.register_keras_serializable(package="tests")
class WithSpareLayers(keras.Model):
    """Holds sok layers its `call` never uses (an optional feature): they
    stay unbuilt, with no table."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.used = sok.layers.DistributedEmbedding(
            50, 4, combiner="mean", name="used")
        self.spare = sok.layers.DistributedEmbedding(50, 4, name="spare")
        self.spare_col = sok.layers.EmbeddingCollection(
            tables={"t": {"vocabulary_size": 9, "embedding_dim": 2}},
            features={"f": {"table": "t"}}, name="spare_col")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, ids):
        return self.head(self.used(ids))


def test_unbuilt_sok_layers_save_load_and_export(tmp_path):
    """As Keras' own layers: a sok layer never called saves nothing and
    loads as it was, and the export leaves it out (QA: AttributeError
    'embeddings' in model.save, save_weights and the export)."""
    keras.utils.set_random_seed(4)
    model = WithSpareLayers()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (16, 3))
    model.fit(x, np.ones((16, 1), np.float32), verbose=0)
    assert not model.spare.built and not model.spare_col.built
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
    assert not loaded.spare.built
    weights = str(tmp_path / "m.weights.h5")
    model.save_weights(weights)
    other = WithSpareLayers()
    other(x)
    other.load_weights(weights)
    np.testing.assert_array_equal(other.predict(x, verbose=0), expected)
    serving = str(tmp_path / "serving")
    sok.export_for_serving(model, serving)
    np.testing.assert_allclose(serve_without_sok(serving, {"": x}, tmp_path),
                               expected, rtol=1e-6, atol=1e-6)
