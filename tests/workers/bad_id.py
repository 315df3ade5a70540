"""An invalid id on one rank: every rank raises the same error, for every
pooling mode, the fused multi-table lookup and the unpooled lookup, eagerly
and in a tf.function, and the ranks stay in step (a valid lookup afterwards
gives the right rows)."""

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

table = np.arange(17 * 3, dtype=np.float32).reshape(17, 3)
v = sok.Variable(table, name="tbl")
before = v.value.numpy().copy()
good = tf.constant([[1, 2], [3, -1]], tf.int64)
# Rank 1 looks up id 40 in a 17-row table.
bad = tf.constant([[1, 40], [3, -1]] if RANK == 1 else [[1, 2], [3, -1]],
                  tf.int64)

cases = {}


def run(name, fn):
    try:
        fn(bad)
        cases[name] = "no error"
    except tf.errors.InvalidArgumentError as e:
        cases[name] = e.message
    # The ranks are still in step: a valid lookup gives the right rows.
    out = fn(good).numpy()
    cases[name + "/after"] = out.tolist()


for pooling in ("auto", "owner", "home"):
    def pooled(ids, pooling=pooling):
        return sok.lookup_sparse(v, ids, combiners="sum", pooling=pooling)

    run(f"eager/{pooling}", pooled)
    run(f"function/{pooling}", tf.function(pooled))


# The fused exchange of several tables: the bad id is in the second table,
# whose check must stop every rank before the first table's ids travel.
other = sok.Variable(np.ones((9, 2), np.float32), name="other",
                     mode="localized:0")
other_ids = tf.constant([[0, 8], [4, -1]], tf.int64)


def fused(ids):
    outs = sok.lookup_sparse([other, v], [other_ids, ids], combiners="sum")
    return outs[1]


run("eager/fused", fused)
run("function/fused", tf.function(fused))


def unpooled(ids):
    return sok.all2all_dense_embedding(v, tf.maximum(ids, 0))


run("eager/unpooled", unpooled)
layer = sok.layers.DistributedEmbedding(17, 3, combiner=None, name="emb")
layer.build((None, 2))
layer.embeddings.assign(v.value)
run("layer/unpooled", tf.function(lambda ids: layer(ids)))
write_result({
    "cases": cases,
    "unchanged": bool(np.array_equal(before, v.value.numpy())),
})
