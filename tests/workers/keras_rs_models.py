"""A DLRM and a DCN-v2 written for keras-rs, for tests/layers/test_keras_rs.py
and the worker tests/workers/keras_rs_fit.py.

Each model is written once, as a keras-rs user writes it (`TableConfig`,
`FeatureConfig`, `keras_rs.layers.DotInteraction` / `FeatureCross`); the
embedding class is the only argument: `keras_rs.layers.DistributedEmbedding`
(the reference) or `sok.layers.EmbeddingCollection`.
"""

import keras
import keras_rs
import numpy as np

MODELS = ("dlrm", "dcn")
LEARNING_RATE = {"dlrm": 0.1, "dcn": 0.05}
DENSE_DIM = {"dlrm": 8, "dcn": 4}


def dlrm_feature_configs(batch):
    lr = LEARNING_RATE["dlrm"]
    opt = keras.optimizers.SGD(lr)  # keras-rs on CPU: the model's optimizer
    user = keras_rs.layers.TableConfig(
        name="user", vocabulary_size=40, embedding_dim=8, optimizer=opt)
    item = keras_rs.layers.TableConfig(
        name="item", vocabulary_size=60, embedding_dim=8, combiner="sum",
        optimizer=opt)
    tag = keras_rs.layers.TableConfig(
        name="tag", vocabulary_size=25, embedding_dim=8, combiner="sqrtn",
        optimizer=opt,
        initializer=keras.initializers.RandomUniform(-0.2, 0.2))
    fc = keras_rs.layers.FeatureConfig
    return {
        "user_id": fc(name="user_id", table=user, input_shape=(batch,),
                      output_shape=(batch, 8)),
        "item_id": fc(name="item_id", table=item, input_shape=(batch,),
                      output_shape=(batch, 8)),
        "history": fc(name="history", table=item, input_shape=(batch, 4),
                      output_shape=(batch, 8)),
        "tags": fc(name="tags", table=tag, input_shape=(batch, 3),
                   output_shape=(batch, 8)),
    }


def dcn_feature_configs(batch):
    opt = keras.optimizers.SGD(LEARNING_RATE["dcn"])
    movie = keras_rs.layers.TableConfig(
        name="movie", vocabulary_size=50, embedding_dim=6, optimizer=opt)
    user = keras_rs.layers.TableConfig(
        name="user", vocabulary_size=30, embedding_dim=4, combiner="sum",
        optimizer=opt)
    genre = keras_rs.layers.TableConfig(
        name="genre", vocabulary_size=12, embedding_dim=3, optimizer=opt)
    fc = keras_rs.layers.FeatureConfig
    # Nested, as keras-rs allows: a list and a dict inside a dict.
    return {
        "ids": [
            fc(name="movie_id", table=movie, input_shape=(batch,),
               output_shape=(batch, 6)),
            fc(name="user_id", table=user, input_shape=(batch,),
               output_shape=(batch, 4)),
        ],
        "bags": {
            "genres": fc(name="genres", table=genre, input_shape=(batch, 3),
                         output_shape=(batch, 3)),
            "watched": fc(name="watched", table=movie,
                          input_shape=(batch, 5), output_shape=(batch, 6)),
        },
    }


def make_model(kind, embedding_class, batch):
    """The model `kind`, its embeddings made by `embedding_class`."""
    dense = keras.Input(shape=(DENSE_DIM[kind],), name="dense")
    if kind == "dlrm":
        ids = {
            "user_id": keras.Input(shape=(), dtype="int64", name="user_id"),
            "item_id": keras.Input(shape=(), dtype="int64", name="item_id"),
            "history": keras.Input(shape=(4,), dtype="int64",
                                   name="history"),
            "tags": keras.Input(shape=(3,), dtype="int64", name="tags"),
        }
        emb = embedding_class(dlrm_feature_configs(batch), name="emb")(ids)
        bottom = keras.layers.Dense(16, activation="relu", name="bot0")(
            dense)
        bottom = keras.layers.Dense(8, activation="relu", name="bot1")(
            bottom)
        inter = keras_rs.layers.DotInteraction(name="inter")(
            [bottom] + [emb[k] for k in sorted(emb)])
        x = keras.layers.Concatenate(name="cat")([bottom, inter])
        x = keras.layers.Dense(16, activation="relu", name="top0")(x)
        out = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
        return keras.Model({"dense": dense, **ids}, out, name="dlrm")
    flat = {
        "movie_id": keras.Input(shape=(), dtype="int64", name="movie_id"),
        "user_id": keras.Input(shape=(), dtype="int64", name="user_id"),
        "genres": keras.Input(shape=(3,), dtype="int64", name="genres"),
        "watched": keras.Input(shape=(5,), dtype="int64", name="watched"),
    }
    nested = {"ids": [flat["movie_id"], flat["user_id"]],
              "bags": {"genres": flat["genres"], "watched": flat["watched"]}}
    emb = embedding_class(dcn_feature_configs(batch), name="emb")(nested)
    x0 = keras.layers.Concatenate(name="cat")(
        [dense, emb["ids"][0], emb["ids"][1], emb["bags"]["genres"],
         emb["bags"]["watched"]])
    x1 = keras_rs.layers.FeatureCross(name="cross0")(x0)
    x2 = keras_rs.layers.FeatureCross(projection_dim=4, name="cross1")(x0, x1)
    x = keras.layers.Dense(16, activation="relu", name="deep0")(x2)
    out = keras.layers.Dense(1, name="logit")(x)
    return keras.Model({"dense": dense, **flat}, out, name="dcn")


def make_data(kind, steps, batch, seed=0):
    """`(x, y)`: `steps * batch` rows of inputs (a dict) and 0/1 labels."""
    rng = np.random.default_rng(seed + (0 if kind == "dlrm" else 1))
    n = steps * batch
    x = {"dense": rng.normal(size=(n, DENSE_DIM[kind])).astype("float32")}
    if kind == "dlrm":
        x["user_id"] = rng.integers(0, 40, size=(n,))
        x["item_id"] = rng.integers(0, 60, size=(n,))
        x["history"] = rng.integers(0, 60, size=(n, 4))
        x["tags"] = rng.integers(0, 25, size=(n, 3))
    else:
        x["movie_id"] = rng.integers(0, 50, size=(n,))
        x["user_id"] = rng.integers(0, 30, size=(n,))
        x["genres"] = rng.integers(0, 12, size=(n, 3))
        x["watched"] = rng.integers(0, 50, size=(n, 5))
    y = rng.integers(0, 2, size=(n, 1)).astype("float32")
    return x, y


def loss_for(kind):
    return keras.losses.BinaryCrossentropy(from_logits=(kind == "dcn"))


def model_weights(model):
    """`{key: array}`: every table (whole, by name) and every other
    layer's weights, keyed so that `assign_weights` finds them."""
    out = {}
    for name, table in model.get_layer("emb").get_embedding_tables().items():
        out[f"table/{name}"] = np.asarray(keras.ops.convert_to_numpy(table))
    for layer in model.layers:
        if layer.name == "emb":
            continue
        for i, w in enumerate(layer.get_weights()):
            out[f"layer/{layer.name}/{i}"] = w
    return out


def assign_weights(model, weights):
    """Loads `model_weights` output into a model with sok embeddings."""
    emb = model.get_layer("emb")
    for key, value in weights.items():
        kind, rest = key.split("/", 1)
        if kind == "table":
            emb.embeddings[rest].assign_global(np.asarray(value), rest)
    for layer in model.layers:
        n = len(layer.get_weights()) if layer.name != "emb" else 0
        if n:
            layer.set_weights(
                [weights[f"layer/{layer.name}/{i}"] for i in range(n)])
