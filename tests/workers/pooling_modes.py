"""Pooling at home vs on the owner vs auto: same values and gradients."""

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from sok_keras.lookup import lookup_one  # noqa: E402

rng = np.random.default_rng(0)
tables = {
    "dist": sok.Variable(rng.normal(size=(3000, 5)).astype("float32"),
                         name="dist"),
    "loc": sok.Variable(rng.normal(size=(300, 3)).astype("float32"),
                        name="loc", mode="localized:1"),
}
full = {k: v.read_global() for k, v in tables.items()}


def batch(seed, vocab, many):
    r = np.random.default_rng(seed + 10 * RANK)
    if many:  # few samples, many distinct ids each: owner pooling is cheap
        rows = [list(r.integers(0, vocab, size=r.integers(50, 120)))
                for _ in range(3)]
    else:  # many samples, few ids from a small range: rows home is cheap
        rows = [list(r.integers(0, 20, size=r.integers(0, 3)))
                for _ in range(64)]
    ids = tf.ragged.constant(rows, tf.int64, ragged_rank=1)
    w = tf.ragged.constant([list(r.uniform(0.2, 2.0, size=len(x)))
                            for x in rows], tf.float32, ragged_rank=1)
    return rows, ids, w


def reference(rows, w_rows, table, combiner):
    out = np.zeros((len(rows), table.shape[1]))
    for b, (ids, w) in enumerate(zip(rows, w_rows)):
        if not ids:
            continue
        w = np.asarray(w if w is not None else np.ones(len(ids)))
        s = (w[:, None] * table[ids]).sum(0)
        d = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}
        out[b] = s / d[combiner]
    return out


def make_run(var):
    # The table is captured, not passed: a tf.function argument would turn
    # it into a tensor. Traced in graph mode without AutoGraph: converting
    # the lookup code made each of the 36 traces ~1.5x slower and cost ~20 s
    # once per rank. The product code has no tensor-dependent Python control
    # flow (that would fail to trace here), so the graph is the same; the
    # AutoGraph path is traced by every multi-rank Keras fit test.
    # With weights (`wv`, the flat values of ragged weights), also the
    # gradient with respect to them, and tf.nn.embedding_lookup_sparse's on
    # the whole table for the same loss (this rank's batch).
    whole = tf.constant(full[var.name])

    @tf.function(autograph=False)
    def run(ids, wv, combiner, pooling):
        # One non-persistent tape per loss: under a persistent tape (or two
        # tapes watching one tensor) TensorFlow wraps every tf.cond of the
        # lookup in a function and builds its gradient eagerly at trace
        # time, which made each trace ~2x slower. Keras' train_step uses
        # one non-persistent tape, as here.
        with tf.GradientTape() as tape:
            w = None
            if wv is not None:
                tape.watch(wv)
                w = tf.RaggedTensor.from_row_splits(wv, ids.row_splits)
            out = lookup_one(var, ids, w, combiner, pooling=pooling)
            loss = tf.reduce_sum(out * out)
        if wv is None:
            g = tape.gradient(loss, var)
            return out, tf.convert_to_tensor(g), None, None
        # One backward of the lookup (its collectives' keys are per call
        # site; a second `gradient` call would run them twice in a step).
        g, wg = tape.gradient(loss, [var, wv])
        wv_ref = tf.identity(wv)
        with tf.GradientTape() as ref_tape:
            ref_tape.watch(wv_ref)
            w_ref = tf.RaggedTensor.from_row_splits(wv_ref, ids.row_splits)
            ref = tf.nn.embedding_lookup_sparse(
                whole, ids.to_sparse(), w_ref.to_sparse(), combiner=combiner)
            ref = tf.pad(ref, [[0, ids.nrows(out_type=tf.int32) - tf.shape(ref)[0]],
                               [0, 0]])
            ref_loss = tf.reduce_sum(ref * ref)
        return (out, tf.convert_to_tensor(g), tf.convert_to_tensor(wg),
                tf.convert_to_tensor(ref_tape.gradient(ref_loss, wv_ref)))

    return run


runs = {name: make_run(var) for name, var in tables.items()}


# argv[1] "few" / "many": only the batch of few samples with many ids each
# (where pooling on the owner pays) / of many samples with few ids each;
# both without an argument.
import sys  # noqa: E402

SETS = {"few": ((1, True),), "many": ((2, False),)}.get(
    sys.argv[1] if len(sys.argv) > 1 else "", ((1, True), (2, False)))
# argv[2] (optional): the combiners, comma-separated (default all three).
COMBINERS = (sys.argv[2].split(",") if len(sys.argv) > 2
             else ("sum", "mean", "sqrtn"))
max_err, max_grad_diff, max_wgrad_err, cases = 0.0, 0.0, 0.0, 0
for seed, many in SETS:
    for name, var in tables.items():
        rows, ids, w = batch(seed, var.global_shape[0], many)
        for weighted in (False, True):
            for combiner in COMBINERS:
                wt = w.flat_values if weighted else None
                ref = reference(rows, w.to_list() if weighted else
                                [None] * len(rows), full[name], combiner)
                grads = []
                for pooling in ("home", "owner", "auto"):
                    out, g, wg, wg_ref = runs[name](ids, wt, combiner,
                                                    pooling)
                    if weighted:
                        max_wgrad_err = max(max_wgrad_err, float(np.abs(
                            wg.numpy() - wg_ref.numpy()).max(initial=0.0)))
                    max_err = max(max_err,
                                  float(np.abs(out.numpy() - ref).max()))
                    grads.append(g.numpy())
                    cases += 1
                for g in grads[1:]:
                    max_grad_diff = max(
                        max_grad_diff, float(np.abs(g - grads[0]).max(initial=0.0)))

# In a Keras step, "auto" traces its per-step tf.cond of both ways only
# where pooling on the owner can move fewer bytes: not for dense ids of one
# id per sample. (A custom tf.function keeps it: its lookups are not
# compared across ranks before it runs.)
import keras  # noqa: E402

from sok_keras import lookup  # noqa: E402

both_ways = []
_pooled = lookup._pooled_exchange


def _counted(comm, param, *args):
    both_ways.append(param.path)
    return _pooled(comm, param, *args)


lookup._pooled_exchange = _counted
inp = keras.Input((4,), dtype="int64")
one = sok.layers.DistributedEmbedding(50, 4, name="one")(inp[:, :1])
three = sok.layers.DistributedEmbedding(50, 4, name="three")(inp[:, 1:])
model = keras.Model(inp, keras.layers.Dense(1)(
    keras.layers.Concatenate()([one, three])))
model.compile(optimizer="adam", loss="mse")
x = np.random.default_rng(5 + RANK).integers(0, 50, (4, 4))
model.fit(x, np.ones((4, 1), np.float32), batch_size=2, verbose=0)
in_fit = sorted(set(both_ways))
both_ways.clear()
tf.function(lambda i: model.get_layer("one")(i))(tf.constant(x[:, :1]))
lookup._pooled_exchange = _pooled

write_result({"max_err": max_err, "max_grad_diff": max_grad_diff,
              "max_wgrad_err": max_wgrad_err, "cases": cases,
              "both_ways": {"fit": in_fit, "function": both_ways}})
