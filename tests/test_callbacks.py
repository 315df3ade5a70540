"""sok_keras.callbacks: global logs (GlobalMetrics, global_logs) and the
loop plumbing of multi-rank fit / evaluate, in one process. The 2-rank
behaviour is tested in tests/test_decisions_multirank.py."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras import callbacks as cb


@pytest.fixture(autouse=True)
def _default_setting():
    cb.set_global_metrics(None)
    yield
    cb.set_global_metrics(None)


def test_setting_env_and_errors(monkeypatch):
    monkeypatch.delenv(cb.ENV_VAR, raising=False)
    assert cb.global_metrics_enabled()
    for raw, want in (("0", False), ("off", False), ("False", False),
                      ("1", True), (" yes ", True)):
        monkeypatch.setenv(cb.ENV_VAR, raw)
        assert cb.global_metrics_enabled() is want
    monkeypatch.setenv(cb.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="SOK_GLOBAL_METRICS.*'sometimes'"):
        cb.global_metrics_enabled()
    cb.set_global_metrics(True)  # an explicit setting wins
    assert cb.global_metrics_enabled()
    cb.set_global_metrics(False)
    monkeypatch.setenv(cb.ENV_VAR, "1")
    assert not cb.global_metrics_enabled()
    with pytest.raises(TypeError, match="global_metrics='yes'"):
        cb.set_global_metrics("yes")
    with pytest.raises(TypeError, match="global_metrics=1"):
        sok.init(global_metrics=1)
    assert not cb.global_metrics_enabled()  # unchanged by the bad call
    sok.init(global_metrics=True)
    assert cb.global_metrics_enabled()


def _model():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse",
                  metrics=["mae", keras.metrics.R2Score(name="r2")])
    return model


def _data(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 3)).astype(np.float32),
            rng.normal(size=(n, 1)).astype(np.float32))


def _callbacks_of(call, args, kwargs, model, kind="fit"):
    import inspect

    original = getattr(keras.Model, kind)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    return bound.arguments.get("callbacks")


def test_global_metrics_goes_first():
    model = _model()
    stop = keras.callbacks.EarlyStopping()
    call, a, k = cb.with_global_metrics(
        "fit", keras.Model.fit, model, (), {"callbacks": [stop]})
    assert call is keras.Model.fit
    got = _callbacks_of(call, a, k, model)
    assert isinstance(got[0], cb.GlobalMetrics) and got[1:] == [stop]
    # Positional callbacks (fit's 6th argument), and a given GlobalMetrics
    # is moved first rather than doubled.
    mine = cb.GlobalMetrics()
    call, a, k = cb.with_global_metrics(
        "fit", keras.Model.fit, model, (None, None, None, 1, 0, [stop, mine]),
        {})
    assert _callbacks_of(call, a, k, model) == [mine, stop]
    # Off: the list is left as it is.
    cb.set_global_metrics(False)
    call, a, k = cb.with_global_metrics(
        "fit", keras.Model.fit, model, (), {"callbacks": [stop]})
    assert _callbacks_of(call, a, k, model) == [stop]
    # A CallbackList (Keras runs it as it is) gets one for the loop only,
    # with the model set.
    cb.set_global_metrics(True)
    listed = keras.callbacks.CallbackList([stop])
    seen = []

    @functools.wraps(keras.Model.fit)
    def fit(model, *args, **kwargs):
        seen.append(list(kwargs["callbacks"].callbacks))

    call, a, k = cb.with_global_metrics(
        "fit", fit, model, (), {"callbacks": listed})
    assert _callbacks_of(call, a, k, model) is listed
    call(model, *a, **k)
    assert isinstance(seen[0][0], cb.GlobalMetrics) and seen[0][1:] == [stop]
    assert seen[0][0].model is model
    assert listed.callbacks == [stop]
    # ... unless it has one, which is moved first for the loop (review:
    # the callbacks before it saw each rank's own values); predict is not
    # touched.
    listed = keras.callbacks.CallbackList([stop, mine])
    call, a, k = cb.with_global_metrics(
        "fit", fit, model, (), {"callbacks": listed})
    call(model, *a, **k)
    assert seen[1] == [mine, stop] and listed.callbacks == [stop, mine]
    assert cb.with_global_metrics(
        "predict", keras.Model.predict, model, (1,), {"callbacks": [stop]}
    ) == (keras.Model.predict, (1,), {"callbacks": [stop]})


def test_checkpoint_folders_are_made_first(tmp_path):
    model = _model()
    folder = tmp_path / "a" / "b"
    ckpt = keras.callbacks.ModelCheckpoint(str(folder / "m.keras"))
    cb.with_global_metrics("fit", keras.Model.fit, model, (),
                           {"callbacks": [ckpt]})
    assert folder.is_dir()
    # Once more (the folder exists: no error). A templated folder is made
    # when the callback decides to save, with exist_ok on every rank,
    # before Keras' check-then-create (QA: on 2 ranks, FileExistsError in 3
    # runs of 4).
    templated = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "e{epoch:02d}" / "m.keras"), save_best_only=True,
        mode="min")
    templated._set_monitor_op()
    cb.with_global_metrics("fit", keras.Model.fit, model, (),
                           {"callbacks": [ckpt, templated]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    path = templated._get_file_path(0, None, {"val_loss": 1.0})
    assert templated._should_save_model(0, None, {"val_loss": 1.0}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "e01"]
    # Not for an epoch it does not save (not better).
    path = templated._get_file_path(1, None, {"val_loss": 2.0})
    assert not templated._should_save_model(1, None, {"val_loss": 2.0},
                                            path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "e01"]


def test_evaluate_keeps_keras_return_forms_on_one_rank():
    model = _model()
    x, y = _data(20, 0)
    want_list = model.evaluate(x, y, batch_size=5, verbose=0)
    want_dict = model.evaluate(x, y, batch_size=5, verbose=0,
                               return_dict=True)
    for kwargs, want in (({}, want_list), ({"return_dict": True}, want_dict)):
        call, a, k = cb.with_global_metrics(
            "evaluate", keras.Model.evaluate, model, (x, y),
            dict(kwargs, batch_size=5, verbose=0))
        assert call(model, *a, **k) == want


class _Peer:
    """A stand-in for rank 1: adds the vector it recorded for its own
    logs to ours (rank 0), as a sum all-reduce over 2 ranks does."""

    def __init__(self):
        self.sent = {}
        self.peer = None

    def all_reduce(self, x, key, op="sum"):
        assert op == "sum"
        self.sent[key] = x.numpy()
        if self.peer is None:
            return x
        return x + tf.constant(self.peer[key])


@pytest.mark.parametrize("keys,other", [
    (None, None), (("r2",), None), (("mae", "r2", "lr"), None),
    (("loss", "r2"), "loss")])
def test_global_logs_equal_one_process_on_all_samples(monkeypatch, keys,
                                                      other):
    """Two ranks with 12 and 5 samples: the global loss, mean metric and
    R2 (not a mean) equal those of the 17 samples together; also when the
    logs hold only some of the results, and other entries (QA: a custom
    `train_step` returning AUC alone had it averaged). A key of a result
    that holds another value (a custom step's batch loss as "loss") is
    averaged, not replaced by the metric's (review: 0.0, from a loss
    tracker the step never updated)."""
    model = _model()
    (xa, ya), (xb, yb) = _data(12, 1), _data(5, 2)
    # The peer's targets are far from this rank's: the local values
    # differ from the global ones whatever the Dense's random weights.
    yb = yb + 3.0
    peer = _Peer()
    monkeypatch.setattr(cb.world, "num_ranks", lambda: 2)
    monkeypatch.setattr(cb.world, "control_communicator", lambda: peer)

    def logs_after(x, y):
        # batch_size: every sample in one step, so that the logs the
        # callbacks would see are the metrics' results.
        model.evaluate(x, y, batch_size=len(x), verbose=0)
        logs = cb._pythonify(model.get_metrics_result())
        if keys is not None:
            logs = {k: logs.get(k, 1e-3) for k in keys}
        if other is not None:
            logs[other] = 123.0
        return logs

    monkeypatch.setattr(cb.world, "rank", lambda: 1)
    cb.global_logs(model, logs_after(xb, yb), "k")
    peer.peer = dict(peer.sent)
    monkeypatch.setattr(cb.world, "rank", lambda: 0)
    mine = logs_after(xa, ya)
    state = [v.numpy().copy() for m in model.metrics for v in m.variables]
    got = cb.global_logs(model, mine, "k")
    # This rank's metric state is untouched.
    after = [v.numpy() for m in model.metrics for v in m.variables]
    assert all(np.array_equal(s, t) for s, t in zip(state, after))
    monkeypatch.setattr(cb.world, "num_ranks", lambda: 1)
    want = model.evaluate(np.concatenate([xa, xb]), np.concatenate([ya, yb]),
                          verbose=0, return_dict=True)
    assert sorted(got) == sorted(mine)
    if other is not None:
        assert got[other] == pytest.approx(123.0)
    for k in ("loss", "mae", "r2"):
        if k not in got or k == other:
            continue
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5)
        assert abs(mine[k] - want[k]) > 1e-3  # the local value differs
    if keys is not None and "lr" in keys:
        assert got["lr"] == pytest.approx(1e-3)  # averaged: the same


def test_custom_logs_are_averaged_by_sample_count(monkeypatch):
    """Logs that are not the metrics' results: a mean weighted by each
    rank's sample count (12 and 4 here), or a plain mean without counts."""
    peer = _Peer()
    monkeypatch.setattr(cb.world, "num_ranks", lambda: 2)
    monkeypatch.setattr(cb.world, "rank", lambda: 0)
    monkeypatch.setattr(cb.world, "control_communicator", lambda: peer)
    cb.global_logs(None, {"a": 1.0, "b": "text"}, "k", weight=4.0)
    peer.peer = dict(peer.sent)
    got = cb.global_logs(None, {"a": 3.0, "b": "text"}, "k", weight=12.0)
    assert got == {"a": (3.0 * 12 + 1.0 * 4) / 16, "b": "text"}
    peer.peer = None
    cb.global_logs(None, {"a": 1.0}, "k", weight=0.0)
    peer.peer = dict(peer.sent)
    assert cb.global_logs(None, {"a": 3.0}, "k", weight=0.0) == {"a": 2.0}
    # NaN on one rank is NaN everywhere (TerminateOnNaN stops every rank).
    assert np.isnan(cb.global_logs(None, {"a": np.nan}, "k", weight=0.0)[
        "a"])


def test_global_metrics_leave_one_rank_alone():
    gm = cb.GlobalMetrics()
    gm.set_model(_model())
    logs = {"loss": 1.5, "mae": 0.5}
    gm.on_train_batch_end(0, logs)
    gm.on_epoch_end(0, logs)
    gm.on_test_end(logs)
    assert logs == {"loss": 1.5, "mae": 0.5}
    assert cb.global_logs(None, logs, "k") is logs


def test_learning_rates_are_compared_nan_included(monkeypatch):
    """The same rate on every rank passes, a nan or inf one included
    (review: nan was taken for a difference); another rate raises."""
    model = _model()
    monkeypatch.setattr(cb.world, "num_ranks", lambda: 2)
    monkeypatch.setattr(cb.world, "rank", lambda: 0)
    for rate in (0.01, float("nan"), float("inf")):
        model.optimizer.learning_rate = rate
        monkeypatch.setattr(cb, "_all_reduce_sum",
                            lambda values, key: np.full(2, values[0][0]))
        cb.check_learning_rates(model, "after epoch 1")
        monkeypatch.setattr(cb, "_all_reduce_sum",
                            lambda values, key: np.array([values[0][0], 0.5]))
        with pytest.raises(RuntimeError, match=(
                rf"after epoch 1, the learning rate of the model's optimizer "
                rf"SGD differs between the ranks \(rank 0: {rate:g}, "
                rf"rank 1: 0.5\)")):
            cb.check_learning_rates(model, "after epoch 1")
