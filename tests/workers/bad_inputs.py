"""The whole bad-input matrix (tests/bad_input_cases.py) on several ranks,
in one job: every cell eagerly and in a tf.function, each error caught and
reported with the table checksums before and after and whether a good
lookup right after gives the right rows; then a few `fit` cases (a rank
with only padding, NaN weights on one rank with skip_nonfinite, and last a
bad id on one rank, after which the ranks may no longer share a loop).

A value error (an id, a split, an index) is given to rank 1 only, so each
of those cells checks that every rank raises the same error.
"""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests import bad_input_cases as cases  # noqa: E402


def short(message):
    """The part of an error message that is ours (past TensorFlow's and
    Keras' prefixes), bounded."""
    i = message.find("sok_keras:")
    return message[i:i + 600] if i >= 0 else message[:1500]


wd = cases.World()
start_checksum = wd.checksum()
results = {}
for input_name, entry in cases.cells():
    bad = cases.INPUTS[input_name][2] or RANK == cases.BAD_RANK
    for mode in cases.multirank_modes(input_name):
        # Without AutoGraph: a third less tracing time; see run_cell.
        r = cases.run_cell(wd, input_name, entry, mode, bad, autograph=False)
        r["message"] = short(r["message"])
        results[f"{input_name}|{entry}|{mode}"] = r

# -- fit ----------------------------------------------------------------------
V, D = cases.V, cases.D


def model_with(skip_nonfinite=False):
    ids = keras.Input((2,), dtype="int64")
    w = keras.Input((2,), dtype="float32")
    emb = sok.layers.DistributedEmbedding(V, D, name="fit_emb")
    model = keras.Model([ids, w], keras.layers.Dense(1)(emb(ids, w)))
    opt = sok.OptimizerWrapper(keras.optimizers.Adagrad(0.1),
                               skip_nonfinite=skip_nonfinite)
    model.compile(optimizer=opt, loss="mse")
    return model, emb, opt


def state(model):
    return [np.array(v.numpy()) for v in model.weights]


def same(a, b):
    return all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


good = np.array([[1, 2], [3, -1]] * 2, np.int64)
ones = np.ones((4, 2), np.float32)
y = np.zeros((4, 1), np.float32)
fit = {}

# A rank whose batches are only padding trains with the others.
model, emb, opt = model_with(skip_nonfinite=True)
ids = good if RANK == 0 else np.full((4, 2), -1, np.int64)
model.fit([ids, ones], y, batch_size=2, epochs=1, verbose=0, shuffle=False)
fit["padding_only_rank_trained"] = bool(np.isfinite(
    emb.embeddings.numpy()).all())
fit["padding_only_table"] = emb.embeddings.read_global().tolist()

# NaN weights on rank 1 only, skip_nonfinite: every rank skips the step.
before = state(model)
w = ones.copy()
if RANK == cases.BAD_RANK:
    w[0, 1] = np.nan
model.fit([good, w], y, batch_size=4, epochs=1, verbose=0, shuffle=False)
fit["nan_skipped_unchanged"] = same(before, state(model))
fit["nan_skipped_steps"] = int(opt.skipped_steps.numpy())

# A bad id on rank 1 in fit: every rank raises, before the step changes
# anything on any rank.
before = state(model)
ids = good.copy()
if RANK == cases.BAD_RANK:
    ids[3, 0] = 40
try:
    model.fit([ids, ones], y, batch_size=4, epochs=1, verbose=0)
    fit["bad_id_error"] = None
except Exception as e:  # noqa: BLE001
    fit["bad_id_error"] = type(e).__name__
    fit["bad_id_message"] = short(str(e))
fit["bad_id_unchanged"] = same(before, state(model))
# Whether the ranks can still look up together (the failed fit has been
# reported on the side channel; see sok_keras/divergence.py).
try:
    out = cases.ENTRIES["lookup_sparse"][0](wd, tf.constant(cases.GOOD), None)
    fit["lookup_after_fit_error"] = bool(np.allclose(
        out.numpy(), cases.reference("pooled", cases.GOOD)))
except Exception as e:  # noqa: BLE001
    fit["lookup_after_fit_error"] = f"{type(e).__name__}: {short(str(e))}"

write_result({
    "cases": results,
    "unchanged_overall": wd.checksum() == start_checksum,
    "fit": fit,
})
