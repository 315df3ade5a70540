"""Several tables (distributed and localized) looked up in one step.

argv: "same" (every rank builds the lookups in one order) or "reversed"
(odd ranks build them in the opposite order: unsupported, the watchdog must
turn the resulting wait into an error).
"""

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

rng = np.random.default_rng(0)
tables = {
    "a": sok.Variable(rng.normal(size=(101, 4)).astype("float32"), name="a"),
    "b": sok.Variable(rng.normal(size=(37, 3)).astype("float32"), name="b",
                      mode="localized:0"),
    "c": sok.Variable(rng.normal(size=(500, 2)).astype("float32"), name="c",
                      mode=f"localized:{sok.num_ranks() - 1}"),
}
import sys  # noqa: E402

reverse = sys.argv[1] == "reversed" and RANK % 2 == 1
order = ["c", "b", "a"] if reverse else ["a", "b", "c"]


# Traced without AutoGraph (nothing here needs it): converting the lookup
# code took about half of this job's CPU time.
@tf.function(autograph=False)
def step(ids):
    # TensorFlow's automatic control dependencies run the collectives of a
    # tf.function in program order, so every rank must build the lookups in
    # the same order (the same model code does).
    outs = {}
    with tf.GradientTape() as tape:
        for name in order:
            outs[name] = sok.lookup_sparse(tables[name], ids[name],
                                           combiners="sum")
        loss = tf.add_n([tf.reduce_sum(o * o) for o in outs.values()])
    grads = tape.gradient(loss, [tables[n] for n in "abc"])
    # The same three lookups fused into one exchange per direction.
    with tf.GradientTape() as tape:
        fused = sok.lookup_sparse([tables[n] for n in order],
                                  [ids[n] for n in order], combiners="sum")
        fused_loss = tf.add_n([tf.reduce_sum(o * o) for o in fused])
    fused_grads = tape.gradient(fused_loss, [tables[n] for n in "abc"])
    fused = dict(zip(order, fused))
    diffs = [tf.reduce_max(tf.abs(fused[n] - outs[n])) for n in "abc"]
    diffs += [tf.reduce_max(tf.abs(tf.convert_to_tensor(g) -
                                   tf.convert_to_tensor(f)))
              for g, f in zip(grads, fused_grads)]
    return outs, tf.stack(diffs)


sums, fused_diffs = [], []
for i in range(20):
    r = np.random.default_rng(100 + i)  # same ids on every rank
    ids = {
        "a": tf.constant(r.integers(-1, 101, size=(8, 3))),
        "b": tf.constant(r.integers(0, 37, size=(8, 2))),
        "c": tf.constant(r.integers(-1, 500, size=(8, 4))),
    }
    outs, diffs = step(ids)
    fused_diffs.append(float(tf.reduce_max(diffs)))
    sums.append([float(outs[n].numpy().sum()) for n in "abc"])
full = {n: tables[n].read_global() for n in "abc"}
expected = []
for i in range(20):
    r = np.random.default_rng(100 + i)
    ids = [r.integers(-1, 101, size=(8, 3)), r.integers(0, 37, size=(8, 2)),
           r.integers(-1, 500, size=(8, 4))]
    row = []
    for n, x in zip("abc", ids):
        t = np.concatenate([full[n], np.zeros((1, full[n].shape[1]))])
        row.append(float(t[np.where(x < 0, len(t) - 1, x)].sum()))
    expected.append(row)
write_result({"sums": sums, "expected": expected,
              "fused_max_diff": max(fused_diffs)})
