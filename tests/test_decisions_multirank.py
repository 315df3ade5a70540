"""Per-step and per-epoch decisions are the same on every rank and come
from global values (issue 10, item 2).

One job on 2 ranks and one on 1 rank (the reference, on the global data)
run every scenario of tests/workers/decisions.py. Before the fix each of
them failed on 2 ranks: EarlyStopping stopped rank 1 only (the other
failed with RankDivergedError), ModelCheckpoint(save_best_only=True) saved
on one rank only (the other waited in model.save), ReduceLROnPlateau left
the ranks with different learning rates, TerminateOnNaN stopped one rank,
evaluate returned each rank's own values, and mixed_float16 hung when only
one rank's gradients overflowed.
"""

import numpy as np
import pytest

from tests.multiprocess import run_workers
from tests.multiprocess import worker_path

PATIENCE_ES, PATIENCE_LR, MIN_DELTA, LR = 2, 1, 1e-4, 0.3
# A collective that one rank never joins fails within this, not 300 s.
ENV = {"SOK_COMM_TIMEOUT": "120", "SOK_SAVE_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def runs():
    two = run_workers(worker_path("decisions"), 2, timeout=600, env=ENV)
    (one,) = run_workers(worker_path("decisions"), 1, timeout=300, env=ENV)
    return two, one


# Keras' rules (mode "min"), to show that each rank's own values would
# have decided differently.
def _early_stop(values):
    best, wait = None, 0
    for epoch, value in enumerate(values):
        wait += 1
        if best is None or value + MIN_DELTA < best:
            best, wait = value, 0
        elif wait >= PATIENCE_ES and epoch > 0:
            return epoch
    return None


def _learning_rates(values):
    lr, out, best, wait = LR, [], None, 0
    for value in values:
        out.append(lr)
        if best is None or value + MIN_DELTA < best:
            best, wait = value, 0
        else:
            wait += 1
            if wait >= PATIENCE_LR:
                lr, wait = lr * 0.5, 0
    return np.float32(out)


def _best_saves(values):
    best, out = None, []
    for epoch, value in enumerate(values):
        if best is None or value < best:
            best = value
            out.append(f"e{epoch + 1:02d}.keras")
    return out


def test_plateau_callbacks_decide_alike_from_global_val_loss(runs):
    (r0, r1), one = runs
    a, b, ref = r0["plateau"], r1["plateau"], one["plateau"]
    # The ranks' own val_loss would have decided differently.
    mine = a["val_loss_local"], b["val_loss_local"]
    assert _early_stop(mine[0]) != _early_stop(mine[1])
    assert _best_saves(mine[0]) != _best_saves(mine[1])
    assert not np.array_equal(_learning_rates(mine[0]),
                              _learning_rates(mine[1]))
    # Both ranks saw the same global values, equal to one process's on
    # the global data, and took the decisions those values call for.
    assert a["val_loss"] == b["val_loss"] == a["history_val_loss"]
    np.testing.assert_allclose(a["val_loss"], ref["val_loss"], rtol=1e-5)
    assert a["epochs"] == b["epochs"] == ref["epochs"]
    assert _early_stop(a["val_loss"]) == a["epochs"] - 1  # stopped early
    assert a["epochs"] < 12
    assert a["lr"] == b["lr"] == ref["lr"]
    np.testing.assert_allclose(a["lr"], _learning_rates(a["val_loss"]))
    assert len(set(a["lr"])) > 1  # the learning rate was reduced
    assert a["saved"] == b["saved"] == ref["saved"]
    assert a["saved"] == _best_saves(a["val_loss"])
    # The same model at the end.
    assert a["dense"] == b["dense"]
    for x, y in zip(a["dense"], ref["dense"]):
        np.testing.assert_allclose(x, y, atol=1e-5)
    np.testing.assert_allclose(a["table"], ref["table"], atol=1e-5)
    assert a["wrapped"] == "OptimizerWrapper"
    # on_train_end gets the last epoch's global logs too (before: the
    # ranks' own training loss and metrics beside global val_ entries).
    for r in (a, b):
        end, last = r["train_end_logs"], r["last_epoch_logs"]
        assert {"loss", "mae", "val_loss", "val_mae"} <= set(end), end
        assert {k: last[k] for k in end} == end, (end, last)
    assert a["train_end_logs"] == b["train_end_logs"]


def test_terminate_on_nan_on_one_rank_stops_every_rank(runs):
    (r0, r1), one = runs
    a, b, ref = r0["nan"], r1["nan"], one["nan"]
    # Only rank 1's own loss is NaN at batch 3.
    assert np.isfinite(a["loss_local"]).all()
    assert np.isnan(b["loss_local"][2])
    assert a["batches"] == b["batches"] == ref["batches"] == 3
    assert a["stop_training"] and b["stop_training"]
    assert np.isnan(a["loss"][2]) and np.isnan(b["loss"][2])
    np.testing.assert_allclose(a["loss"][:2], ref["loss"][:2], rtol=1e-6)


def test_evaluate_returns_global_values(runs):
    (r0, r1), one = runs
    a, b, ref = r0["evaluate"], r1["evaluate"], one["evaluate"]
    # test_on_batch / train_on_batch too (before: each rank's own values,
    # so a loop deciding on them diverged).
    for kind in ("test_on_batch", "train_on_batch"):
        assert a[kind] == b[kind], kind
        for k in ("loss", "mae", "r2"):
            np.testing.assert_allclose(a[kind][k], ref[kind][k], rtol=1e-5,
                                       err_msg=f"{kind} {k}")
    assert a["test_on_batch_list"] == [a["test_on_batch"][k]
                                       for k in ("loss", "mae", "r2")]
    assert (a["samples"], b["samples"], ref["samples"]) == (24, 12, 36)
    assert a["dict"] == b["dict"]
    assert a["list"] == b["list"] == [a["dict"][k]
                                      for k in ("loss", "mae", "r2")]
    for k in ("loss", "mae", "r2"):
        np.testing.assert_allclose(a["dict"][k], ref["dict"][k], rtol=1e-5)
        # Each rank's own value differs, and so does their plain mean
        # (unequal batch sizes; R2 is not a mean at all).
        assert abs(a["local"][k] - b["local"][k]) > 1e-2
        plain = (a["local"][k] + b["local"][k]) / 2
        assert abs(plain - ref["dict"][k]) > 1e-3
    np.testing.assert_allclose(a["list"], ref["list"], rtol=1e-5)


def test_mixed_float16_overflow_on_one_rank_is_skipped_everywhere(runs):
    (r0, r1), one = runs
    a, b, ref = r0["mixed"], r1["mixed"], one["mixed"]
    assert a["nesting"] == ["LossScaleOptimizer", "OptimizerWrapper", "Adam"]
    # Only rank 1's gradients overflow on batch 2.
    assert a["own_finite"] and not b["own_finite"]
    # Every rank skipped that step (3 of 4 applied), halved its scale
    # once, and trained on.
    for r in (a, b, ref):
        assert r["iterations"] == 3
        assert r["scale"] == 2.0 ** 14
        assert r["table_moved"]
    assert a["dense"] == b["dense"]
    assert a["table"] == b["table"]
    for x, y in zip(a["dense"], ref["dense"]):
        np.testing.assert_allclose(x, y, atol=1e-4)
    np.testing.assert_allclose(a["table"], ref["table"], atol=1e-4)


def test_mixed_float16_scales_each_ranks_share_of_the_loss(runs):
    """A rank's loss is a mean over its half of the batch: at one
    process's loss scale its float16 gradients are twice one process's.
    Before, the 2 ranks overflowed on a batch one process trains on (the
    step skipped, the scale halved, other weights); now the scale is the
    rank's share, and the 2 ranks train as one process."""
    (r0, r1), one = runs
    a, b, ref = r0["share"], r1["share"], one["share"]
    # Rank 0's own loss at the full scale overflows; one process's not.
    assert not a["own_finite"] and ref["own_finite"]
    for r in (a, b, ref):
        assert r["iterations"] == 3
        assert r["scale"] == 2.0 ** 15
    assert a["dense"] == b["dense"]
    assert a["table"] == b["table"]
    for x, y in zip(a["dense"], ref["dense"]):
        np.testing.assert_allclose(x, y, atol=1e-4)
    np.testing.assert_allclose(a["table"], ref["table"], atol=1e-4)


def test_batch_norm_statistics_are_averaged_over_the_ranks():
    """Each rank updates BatchNormalization's moving statistics from its own
    slice (before: the ranks drifted apart silently, and `model.save` kept
    rank 0's). After `fit` (with validation) and after `evaluate` every
    rank holds the same; the moving means of a BN on the raw inputs equal
    one process's on the whole batches (a moving average is linear, and
    the slices' means average to the batch's mean)."""
    script = worker_path("batch_norm")
    two = run_workers(script, 2, timeout=240)
    (one,) = run_workers(script, 1, timeout=240)
    for when in ("after_fit", "after_evaluate"):
        assert two[0][when] == two[1][when], when
        np.testing.assert_allclose(
            two[0][when]["bn_raw.moving_mean"],
            one[when]["bn_raw.moving_mean"], rtol=1e-5, atol=1e-6)
    # (The variances are not compared: with the slices shifted apart, a
    # batch's variance exceeds its slices' mean variance; BN here is not
    # synchronized, as under a tf.distribute strategy.)
    assert two[0]["evaluate_loss"] == two[1]["evaluate_loss"]
