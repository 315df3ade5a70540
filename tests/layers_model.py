"""A model using DistributedEmbedding, LocalizedEmbedding,
All2AllDenseEmbedding and EmbeddingCollection together, for the multi-rank
layer tests."""

import keras
import numpy as np
import tensorflow as tf

import sok_keras as sok

# Parity at 1e-5 between different batch splits needs full-precision
# matmuls: TensorFloat-32 (TensorFlow's default on a GPU) rounds the
# Dense layers differently for every batch shape.
tf.config.experimental.enable_tensor_float_32_execution(False)

VOCABS = {"dist": 211, "loc": 57, "a2a": 96, "t1": 64, "t2": 32}


def _data(n, seed=7):
    rng = np.random.default_rng(seed)
    dist = rng.integers(-1, VOCABS["dist"], size=(n, 4))  # -1 = padding
    loc = rng.integers(0, VOCABS["loc"], size=(n, 3))
    a2a = rng.integers(0, VOCABS["a2a"], size=(n, 2, 2))
    ca = rng.integers(-1, VOCABS["t1"], size=(n, 2))
    cb = rng.integers(0, VOCABS["t2"], size=(n, 3))
    cc = rng.integers(0, VOCABS["t1"], size=(n, 2))
    y = rng.normal(size=(n, 1)).astype("float32")
    return {"dist": dist, "loc": loc, "a2a": a2a, "ca": ca, "cb": cb,
            "cc": cc}, y


def build_model(dtype=None):
    """`dtype`: the layers' dtype (policy) for every table, or None."""
    kw = {} if dtype is None else {"dtype": dtype}
    dist_in = keras.Input(shape=(4,), dtype="int64", name="dist")
    loc_in = keras.Input(shape=(3,), dtype="int64", name="loc")
    a2a_in = keras.Input(shape=(2, 2), dtype="int64", name="a2a")
    d = sok.layers.DistributedEmbedding(VOCABS["dist"], 4, combiner="mean",
                                        name="dist_emb", **kw)(dist_in)
    lo = sok.layers.LocalizedEmbedding(
        VOCABS["loc"], 3, combiner="sqrtn", rank=sok.num_ranks() - 1,
        pooling="owner",
        name="loc_emb", **kw)(loc_in)
    a = sok.layers.All2AllDenseEmbedding(
        48, 2, slot_num=2, nnz_per_slot=2, vocabulary_size=VOCABS["a2a"],
        name="a2a_emb", **kw)(a2a_in)
    coll_in = {
        "ca": keras.Input(shape=(2,), dtype="int64", name="ca"),
        "cb": keras.Input(shape=(3,), dtype="int64", name="cb"),
        "cc": keras.Input(shape=(2,), dtype="int64", name="cc"),
    }
    coll = sok.layers.EmbeddingCollection(
        tables={
            "t1": {"vocabulary_size": VOCABS["t1"], "embedding_dim": 3},
            "t2": {"vocabulary_size": VOCABS["t2"], "embedding_dim": 2,
                   "mode": "localized:0"},
        },
        features={"ca": {"table": "t1"},
                  "cb": {"table": "t2", "combiner": "mean"},
                  "cc": {"table": "t1", "combiner": None}},
        name="coll", **kw)(coll_in)
    x = keras.layers.Concatenate()([
        d, lo, keras.layers.Flatten()(a), coll["ca"], coll["cb"],
        keras.layers.Flatten()(coll["cc"])])
    x = keras.layers.Dense(8, activation="tanh", name="hidden")(x)
    out = keras.layers.Dense(1, name="out")(x)
    return keras.Model(
        {"dist": dist_in, "loc": loc_in, "a2a": a2a_in, **coll_in}, out)


def _tables(model):
    tables = {n: model.get_layer(n).embeddings
              for n in ("dist_emb", "loc_emb", "a2a_emb")}
    for t, var in model.get_layer("coll").embeddings.items():
        tables[f"coll.{t}"] = var
    return tables


def build_and_fit(steps, global_batch, num_ranks=None, dtype=None):
    """Builds, initializes tables from a fixed seed, trains; returns
    per-step losses, the whole tables (as float32) and the dense weights.
    `dtype`: the tables' layers' dtype (e.g. "bfloat16"), or None."""
    model = build_model(dtype)
    rng = np.random.default_rng(3)
    for _, table in sorted(_tables(model).items()):
        table.assign_global(rng.normal(
            0, 0.3, size=table.global_shape).astype("float32"))
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.SGD(0.1, momentum=0.5)),
        loss="mse")
    x, y = _data(steps * global_batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        global_batch, drop_remainder=True)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    model.fit(sok.shard_batches(ds), epochs=1, verbose=0, shuffle=False,
              callbacks=[sok.callbacks.GlobalMetrics(), record])
    tables = _tables(model)
    return {
        "losses": losses,
        "tables": {n: t.read_global().astype("float32").tolist()
                   for n, t in sorted(tables.items())},
        "table_dtypes": {n: str(t.dtype) for n, t in tables.items()},
        "slot_dtypes": {f"{n}.{k}": str(s.dtype)
                        for n, t in tables.items()
                        for k, s in t.slots.items()},
        "local_rows": {n: int(t.shape[0]) for n, t in tables.items()},
        "dense": [w.tolist() for w in model.get_layer("hidden").get_weights()],
    }


@keras.saving.register_keras_serializable(package="sok_keras_tests")
class SubclassedRanker(keras.Model):
    """A subclassed model: `load_model` rebuilds it by running `call` on
    placeholders inside Keras' StatelessScope, where its table is made."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emb = sok.layers.DistributedEmbedding(101, 4, combiner="sum")
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(self.emb(ids))


@keras.saving.register_keras_serializable(package="sok_keras_tests")
class RawTableRanker(keras.Model):
    """SOK's way: a subclassed model that holds a `sok.Variable` itself and
    looks it up with `sok.lookup_sparse` (no sok layer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = sok.Variable(
            keras.initializers.RandomUniform(seed=5), shape=(41, 4),
            name="raw_table")
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        return self.head(sok.lookup_sparse(self.table, ids,
                                           combiners="sum"))

