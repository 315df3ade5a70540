"""SOK's raw loop with a plain Keras optimizer (no wrapper: Keras' own
slots of each table, one shard per rank), checkpointed SOK's way:
`sok.dump(path, tables, optimizer)` at N ranks, `sok.load` at M.

argv: ACTION CKPT

ACTION:
  dump  for each optimizer: train 3 steps, sok.dump(CKPT/<kind>), record
        the whole tables and this rank's slot rows, train 3 more steps and
        record the whole tables (the uninterrupted run);
  load  for each optimizer: fresh tables and optimizer (not built),
        sok.load(CKPT/<kind>), record this rank's slot rows and the step
        count, train 3 steps, record the whole tables.

The loss is a sum over the rank's rows: a plain optimizer sums the ranks'
table gradients (SOK's semantics), so the steps equal 1 rank's at any N.
"""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import NUM_RANKS, RANK, write_result  # noqa: E402

action, ckpt = sys.argv[1:3]
VOCAB, LOC_VOCAB, DIM, GLOBAL_BATCH = 23, 11, 3, 12
KINDS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adam": lambda: keras.optimizers.Adam(0.05),
}


def make_tables(kind):
    rng = np.random.default_rng(5)
    dist = sok.Variable(rng.normal(size=(VOCAB, DIM)).astype(np.float32),
                        name=f"{kind}_dist")
    # On the last rank: another rank than at the dump when N changes.
    loc = sok.Variable(rng.normal(size=(LOC_VOCAB, DIM)).astype(np.float32),
                       mode=f"localized:{NUM_RANKS - 1}", name=f"{kind}_loc")
    return [dist, loc]


def batch(step):
    rng = np.random.default_rng(100 + step)
    d = rng.integers(0, VOCAB, (GLOBAL_BATCH, 2))
    loc = rng.integers(0, LOC_VOCAB, (GLOBAL_BATCH, 1))
    y = rng.normal(size=(GLOBAL_BATCH,)).astype(np.float32)
    per = GLOBAL_BATCH // NUM_RANKS
    mine = slice(RANK * per, (RANK + 1) * per)
    return d[mine], loc[mine], y[mine]


W_DIST = tf.constant([0.5, -1.0, 2.0])
W_LOC = tf.constant([1.5, 0.25, -0.75])


def train(tables, opt, steps):
    for step in steps:
        d, loc, y = batch(step)
        with tf.GradientTape() as tape:
            e_d, e_l = sok.lookup_sparse(
                tables, [tf.RaggedTensor.from_tensor(tf.constant(d)),
                         tf.RaggedTensor.from_tensor(tf.constant(loc))],
                combiners=["sum", "mean"])
            out = (tf.reduce_sum(e_d * W_DIST, -1)
                   + tf.reduce_sum(e_l * W_LOC, -1))
            loss = tf.reduce_sum(tf.square(out - y))
        grads = tape.gradient(loss, tables)
        opt.apply_gradients(zip(grads, tables))


def slot_rows(opt, tables):
    """This rank's rows of Keras' slots of each table, by name."""
    out = {}
    for t in tables:
        prefix = t.path.replace("/", "_") + "_"
        for v in opt.variables:
            leaf = v.path.rsplit("/", 1)[-1]
            if leaf.startswith(prefix):
                out[f"{t.name}/{leaf[len(prefix):]}"] = v.numpy().tolist()
    return out


result = {}
for kind, make_opt in KINDS.items():
    tables, opt = make_tables(kind), make_opt()
    path = os.path.join(ckpt, kind)
    if action == "dump":
        train(tables, opt, range(3))
        sok.dump(path, tables, opt)
        at_dump = {t.name: t.read_global().tolist() for t in tables}
        slots = slot_rows(opt, tables)
        train(tables, opt, range(3, 6))
    else:
        sok.load(path, tables, opt)
        at_dump = None
        slots = slot_rows(opt, tables)
        iterations = int(opt.iterations.numpy())
        train(tables, opt, range(3, 6))
    result[kind] = {
        "at_dump": at_dump,
        "slots": slots,
        "iterations": int(opt.iterations.numpy()) if at_dump else iterations,
        "after": {t.name: t.read_global().tolist() for t in tables},
    }
write_result(result)
