"""`pooling="auto"` with one id per sample (dense `[batch, 1]` ids) pools
at home without tracing the per-step `tf.cond` between home and owner
pooling; a rank whose ids are of another shape (ragged here, with many
ids per sample, for which pooling on the owner alone would move fewer
bytes) takes home too, so the ranks' exchanges still meet. Values and
gradients against NumPy."""

import numpy as np

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from sok_keras.lookup import lookup_one  # noqa: E402

VOCAB, DIM = 3000, 4
full = np.random.default_rng(0).normal(size=(VOCAB, DIM)).astype("float32")
var = sok.Variable(full, name="one_id")


def conds(fn, *args):
    """The number of tf.cond (If) operations in fn's graph for args."""
    graph = fn.get_concrete_function(*args).graph
    return sum(op.type in ("If", "StatelessIf")
               for op in graph.get_operations())


@tf.function(autograph=False)
def run(ids):
    with tf.GradientTape() as tape:
        out = lookup_one(var, ids, None, "sum", pooling="auto")
        loss = tf.reduce_sum(out * out)
    return out, tf.convert_to_tensor(tape.gradient(loss, var))


r = np.random.default_rng(7)
one_id = tf.constant(r.integers(0, VOCAB, size=(3, 1)), tf.int64)
three_ids = tf.constant(r.integers(0, VOCAB, size=(3, 3)), tf.int64)
# Every rank traces the same shapes here (same collectives in the same
# order on every rank).
result = {"conds_one_id": conds(run, one_id),
          "conds_three_ids": conds(run, three_ids)}
out, _ = run(three_ids)  # run the traced cond once as well

# Rank 0: one id per sample; rank 1: 3 samples of 50-120 distinct ids each
# (alone, "auto" would pool those on the owner).
if RANK == 0:
    rows = [[int(i)] for i in r.integers(0, VOCAB, size=4)]
    ids = tf.constant(rows, tf.int64)
else:
    rows = [list(r.choice(VOCAB, size=r.integers(50, 120), replace=False))
            for _ in range(3)]
    ids = tf.ragged.constant(rows, tf.int64, ragged_rank=1)
out, grad = run(ids)
want = np.stack([full[b].sum(0) for b in rows])
result.update({
    "max_err": float(np.abs(out.numpy() - want).max()),
    "grad_shard": grad.numpy().tolist(),  # this rank's rows, id % 2 == RANK
    "rows": [[int(i) for i in b] for b in rows],
})
write_result(result)
