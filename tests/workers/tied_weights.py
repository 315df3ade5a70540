"""Tied output weights (`logits = h @ table^T`) read a sok table other
than by looking ids up. On N ranks the table's variable is this rank's
shard: `fit`, `evaluate`, `predict` and the `*_on_batch` methods refuse
such a model, naming the table and the reading op; on one rank they run
(the variable is the whole table). A model that only looks its tables up
runs on any number of ranks, and so does one that reads the shard
elementwise: a penalty on it times the number of ranks (docs/design.md).

argv: MODEL KIND[/CALL]... MODEL: "tied", "gather" (rows picked from the
variable by id), "dense", or "penalty" ("dense" with that penalty). KIND:
"distributed", "localized" or "collection". CALL: "predict", "evaluate",
"fit" or one of the `*_on_batch` methods; all if left out. Reports, per
case, the error (class and message) or None; the first error ends the
run (after a failed loop the job's collectives are aborted:
`sok_keras.divergence`)."""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _worker import write_result  # noqa: E402

V, D = 12, 4


class Tied(keras.layers.Layer):
    """Scores every item: the hidden state times the table, transposed."""

    def __init__(self, table_of, **kwargs):
        super().__init__(**kwargs)
        self.table_of = table_of

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.table_of()))


class Gather(keras.layers.Layer):
    """Picks rows from the table's variable by id, as tf.nn.embedding_lookup
    on a whole table would."""

    def __init__(self, table_of, **kwargs):
        super().__init__(**kwargs)
        self.table_of = table_of

    def call(self, h, ids):
        import tensorflow as tf

        rows = tf.gather(self.table_of(), ids[:, 0])
        return h + rows


class Penalty(keras.layers.Layer):
    """An L2 penalty on the table's shard times the number of ranks: the
    ranks' mean of it is the whole table's (docs/design.md)."""

    def __init__(self, table_of, **kwargs):
        super().__init__(**kwargs)
        self.table_of = table_of

    def call(self, h):
        self.add_loss(sok.num_ranks() * 1e-3 * keras.ops.sum(
            keras.ops.square(self.table_of())))
        return h


def model_of(kind, what):
    ids = keras.Input((3,), dtype="int64", name="ids")
    if kind == "collection":
        emb = sok.layers.EmbeddingCollection(
            {"t": {"vocabulary_size": V, "embedding_dim": D}},
            {"ids": {"table": "t", "combiner": "mean"}}, name="items")
        h = emb({"ids": ids})["ids"]
        table_of = lambda: emb.embeddings["t"]  # noqa: E731
    else:
        layer = {"distributed": sok.layers.DistributedEmbedding,
                 "localized": sok.layers.LocalizedEmbedding}[kind]
        emb = layer(V, D, combiner="mean", name="items")
        h = emb(ids)
        table_of = lambda: emb.embeddings  # noqa: E731
    if what == "tied":
        out = Tied(table_of)(h)
    elif what == "gather":
        out = keras.layers.Dense(V)(Gather(table_of)(h, ids))
    elif what == "penalty":
        out = keras.layers.Dense(V)(Penalty(table_of)(h))
    else:
        out = keras.layers.Dense(V)(h)
    model = keras.Model(ids, out, name=f"{kind}_{what}")
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    return model


x = np.arange(24).reshape(8, 3) % V
y = np.arange(8) % V
calls = {
    "predict": lambda m: m.predict(x, batch_size=4, verbose=0),
    "evaluate": lambda m: m.evaluate(x, y, batch_size=4, verbose=0),
    "fit": lambda m: m.fit(x, y, batch_size=4, epochs=1, verbose=0),
    "train_on_batch": lambda m: m.train_on_batch(x[:4], y[:4]),
    "test_on_batch": lambda m: m.test_on_batch(x[:4], y[:4]),
    "predict_on_batch": lambda m: m.predict_on_batch(x[:4]),
}
result = {}
what = sys.argv[1]
for case in sys.argv[2:]:
    kind, _, only = case.partition("/")
    for call, fn in calls.items():
        if only and call != only:
            continue
        try:
            fn(model_of(kind, what))
            error = None
        except Exception as e:  # noqa: BLE001 -- reported
            error = [type(e).__name__, str(e)]
        result[f"{kind}/{call}"] = error
        if error:
            break
    if error:
        break
write_result(result)
