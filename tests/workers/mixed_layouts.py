"""Ranks whose ids come in different layouts in one lookup: dense
(-1-padded) on rank 0, a tf.SparseTensor or a tf.RaggedTensor of the same
ids on the others, pooled at home, on the owner or "auto", eagerly and in
a tf.function, with and without weights. The exchange's header is as wide
on every rank (it was one entry wider with SparseTensor ids: the ranks'
all-gathers never met, and both waited for SOK_COMM_TIMEOUT)."""

import numpy as np

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

table = np.arange(24, dtype="float32").reshape(12, 2)
dense = tf.constant([[1, 2], [3, -1]], tf.int64)
w_dense = tf.constant([[0.5, 2.0], [3.0, 0.0]])
ragged = tf.ragged.constant([[1, 2], [3]], tf.int64)
w_ragged = tf.ragged.constant([[0.5, 2.0], [3.0]])
result = {}
for pooling in ("home", "owner", "auto"):
    emb = sok.layers.DistributedEmbedding(
        12, 2, combiner="sum", weights=table, pooling=pooling,
        name=f"emb_{pooling}")
    traced = tf.function(lambda i, w, emb=emb: emb(i, w))
    for other in ("sparse", "ragged"):
        for weighted in (False, True):
            if RANK == 0:
                ids, w = dense, (w_dense if weighted else None)
            elif other == "sparse":
                ids = ragged.to_sparse()
                w = w_ragged.to_sparse() if weighted else None
            else:
                ids, w = ragged, (w_ragged if weighted else None)
            for mode, call in (("eager", emb), ("function", traced)):
                out = call(ids, w)
                result[f"{pooling}/{other}/{weighted}/{mode}"] = (
                    out.numpy().tolist())
write_result(result)
