"""Keras callbacks for multi-rank training.

Global logs. Each rank computes its loss and metrics on its own slice of
the global batch; anything that decides from them (`EarlyStopping`,
`ReduceLROnPlateau`, `ModelCheckpoint(save_best_only=True)`,
`TerminateOnNaN`, a progress bar) must see the global values, or the ranks
decide differently (one stops, the other waits in its next collective). With
more than one rank, `fit` and `evaluate` of a model with sok tables
therefore run with a `GlobalMetrics` callback first in their callback list
(inserted by the loop hooks of `sok_keras.optimizers.auto_wrap`), and
`evaluate` returns the global values. Turn this off with
`sok.init(global_metrics=False)`, `sok.callbacks.set_global_metrics(False)`
or `SOK_GLOBAL_METRICS=0` (then logs and `evaluate` are rank-local, as in
plain Keras; a `GlobalMetrics` you pass yourself still works).
"""

import functools
import inspect
import os
import re

import keras
import numpy as np
import tensorflow as tf

from sok_keras import world

ENV_VAR = "SOK_GLOBAL_METRICS"
_SETTING = None  # set_global_metrics(); None: the environment decides
_ON = ("", "1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
# How tf.distribute combines a metric variable over replicas; metrics
# declare it (Keras' own metrics: "sum").
_AGGREGATIONS = ("sum", "mean", "only_first_replica")


def set_global_metrics(enabled):
    """Turns the default global logs of multi-rank `fit`/`evaluate` on or
    off for this process.

    Args:
        enabled: True (the default behaviour), False (rank-local logs and
            `evaluate` results, as in plain Keras), or None (back to the
            `SOK_GLOBAL_METRICS` environment variable, default on).

    Example:

    >>> sok.callbacks.set_global_metrics(False)
    >>> sok.callbacks.global_metrics_enabled()
    False
    >>> sok.callbacks.set_global_metrics(None)  # the environment decides
    """
    global _SETTING
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            "sok_keras: `global_metrics` must be True, False or None. "
            f"Received: global_metrics={enabled!r}.")
    _SETTING = enabled


def global_metrics_enabled():
    """Whether multi-rank `fit` / `evaluate` insert `GlobalMetrics` and
    return global values (`set_global_metrics`, else `SOK_GLOBAL_METRICS`,
    else True)."""
    if _SETTING is not None:
        return _SETTING
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"sok_keras: {ENV_VAR} must be 1/true/on or 0/false/off. "
        f"Received: {ENV_VAR}={raw!r}.")


def _is_number(v):
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float, np.number)):
        return True
    return hasattr(v, "shape") and tuple(v.shape) == ()


def _pythonify(logs):
    """Keras' `pythonify_logs`: nested dicts flattened, scalars as floats."""
    out = {}
    for k, v in sorted((logs or {}).items()):
        if isinstance(v, dict):
            out.update(_pythonify(v))
            continue
        if hasattr(v, "numpy"):
            v = v.numpy()
        try:
            v = float(v)
        except (TypeError, ValueError):
            pass
        out[k] = v
    return out


def _same(a, b):
    """Equality with NaN equal to NaN (the flags must agree on every rank)."""
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b),
                                   equal_nan=True))
    except TypeError:  # non-numeric values
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - arbitrary objects in logs
            return False


def _metric_variables(model):
    """The state variables of the model's metrics, or None if one of them
    cannot be combined across ranks (an aggregation other than sum, mean
    or only_first_replica, or a non-numeric dtype)."""
    out, seen = [], set()
    for metric in getattr(model, "metrics", None) or ():
        for v in metric.variables:
            if id(v) in seen:
                continue
            seen.add(id(v))
            aggregation = getattr(v, "aggregation", "sum")
            dtype = keras.backend.standardize_dtype(v.dtype)
            if aggregation not in _AGGREGATIONS or not (
                    "float" in dtype or "int" in dtype):
                return None
            out.append((v, aggregation))
    return out


def sample_count(model):
    """The samples this rank's loss tracker has seen since it was reset
    (0.0 if the model has none)."""
    for metric in getattr(model, "metrics", None) or ():
        count = getattr(metric, "count", None)
        if metric.name == "loss" and count is not None:
            return float(keras.ops.convert_to_numpy(count))
    return 0.0


def _all_reduce_sum(parts, key):
    flat = np.concatenate(
        [np.asarray(p, np.float64).ravel() for p in parts]
        or [np.zeros([0])])
    if flat.size == 0:
        return flat
    out = world.control_communicator().all_reduce(
        tf.constant(flat, tf.float64), key=f"{key}/{flat.size}", op="sum")
    return out.numpy()


def global_logs(model, logs, key, weight=None):
    """The global (all-rank) version of this rank's Keras `logs`.

    Every rank must call it at the same point with the same keys (one
    collective). Two ways, in this order:

    - entries that are metric results (under a key of
      `model.get_metrics_result()` with its value on every rank; all of
      them or some, beside other entries such as a custom `train_step`'s
      learning rate) are computed from the metrics' state variables
      summed over the ranks (as `tf.distribute` combines them: by each
      variable's `aggregation`). This is exact for any batch sizes and
      for metrics that are not means (AUC, R2Score): the value a single
      process would compute on all ranks' samples. This rank's metric
      state is left as it is;
    - any other numeric scalar entry is averaged over the ranks, weighted by
      `weight` (default: the number of samples this rank's loss tracker has
      seen), which is exact for means of per-sample values at any batch
      sizes; with no weights on any rank, a plain mean.

    Non-numeric entries, and array-valued ones that are not metric results,
    stay as they are.

    Args:
        model: the Keras model whose logs these are (may be None).
        logs: a dict of logs.
        key: names the call site (the same on every rank).
        weight: this rank's weight for the averaged entries.

    Returns:
        A new dict (`logs` itself with one rank).
    """
    if not logs or world.num_ranks() == 1:
        return logs
    n, rank = world.num_ranks(), world.rank()
    variables = _metric_variables(model) if model is not None else None
    local = _pythonify(model.get_metrics_result()) if variables else {}
    # The entries that may be metric results (all or some of them: a
    # custom `train_step` returning `{"auc": self.auc.result()}` alone, QA)
    # are taken from the summed state where every rank logged its own
    # result under that key; a key whose value is something else on some
    # rank (a custom step returning the batch loss as "loss", whose loss
    # tracker never ran: review) is averaged. The keys decide whether the
    # state is summed, the same on every rank; the flags ride in the same
    # all-reduce, so the choice per key is every rank's too.
    candidates = sorted(set(local) & set(logs))
    from_state = bool(candidates)
    parts = []
    if from_state:
        for v, aggregation in variables:
            a = np.asarray(keras.ops.convert_to_numpy(v), np.float64)
            if aggregation == "mean":
                a = a / n
            elif aggregation == "only_first_replica" and rank != 0:
                a = np.zeros_like(a)
            parts.append(a)
        parts.append([1.0 if _same_value(logs[k], local[k]) else 0.0
                      for k in candidates])
    scalars = sorted(k for k, v in logs.items() if _is_number(v))
    w = sample_count(model) if weight is None else float(weight)
    values = np.array([float(logs[k]) for k in scalars], np.float64)
    parts += [values * w, [w], values]
    total = _all_reduce_sum(parts, key)
    m = len(scalars)
    tail = total[total.size - (2 * m + 1):]
    averaged = tail[:m] / tail[m] if tail[m] > 0 else tail[m + 1:] / n
    out = dict(logs)
    out.update({k: float(a) for k, a in zip(scalars, averaged)})
    if from_state:
        mapping, offset = [], 0
        for v, _ in variables:
            size = int(np.prod(v.shape, dtype=np.int64))
            value = total[offset:offset + size].reshape(tuple(v.shape))
            offset += size
            dtype = keras.backend.standardize_dtype(v.dtype)
            if "int" in dtype:
                value = np.rint(value)
            mapping.append((v, tf.constant(value.astype(dtype))))
        agreed = total[offset:offset + len(candidates)]
        with keras.StatelessScope(state_mapping=mapping):
            results = _pythonify(model.get_metrics_result())
        out.update({k: results[k] for k, f in zip(candidates, agreed)
                    if f > n - 0.5})
    return out


def _same_value(logged, result):
    """Whether a logged entry is the metric result `result` (a number or
    an array), to float32 rounding."""
    try:
        a = np.asarray(keras.ops.convert_to_numpy(logged), np.float64)
        b = np.asarray(result, np.float64)
    except (TypeError, ValueError):
        return False
    return a.shape == b.shape and bool(
        np.allclose(a, b, rtol=1e-6, atol=1e-12, equal_nan=True))


def average_logs(logs, key):
    """Averages the numeric entries of a Keras `logs` dict across ranks
    (a plain mean: every rank weighs the same).

    Every rank must call it with the same keys. Returns a new dict.
    """
    return global_logs(None, logs, key, weight=1.0)


def _dense_weights(model, trainable):
    """The model's trainable (or non-trainable floating) weights but the
    sharded tables."""
    from sok_keras.variable import Variable

    if trainable:
        return [v for v in model.trainable_weights
                if not isinstance(v, Variable)]
    return [v for v in model.non_trainable_weights
            if not isinstance(v, Variable)
            and "float" in keras.backend.standardize_dtype(v.dtype)]


def _values(weights):
    return [np.asarray(keras.ops.convert_to_numpy(v), np.float64)
            for v in weights]


def _differing(values, key):
    """Indices of `values` (each weight's, as float64 arrays) that differ
    between the ranks (the same on every rank): two all-reduces of a
    fingerprint per weight (its sum and its sum of magnitudes)."""
    prints = []
    for a in values:
        prints += [a.sum(), np.abs(a).sum()]
    prints = np.array(prints, np.float64)
    mean = _all_reduce_sum([prints], key) / world.num_ranks()
    off = np.abs(prints - mean) > 1e-6 * (1.0 + np.abs(mean))
    off = _all_reduce_sum([off.astype(np.float64)], f"{key}_off") > 0
    return sorted({i // 2 for i in np.nonzero(off)[0]})


def _path(v):
    return getattr(v, "path", v.name)


def check_replicated_weights(model, when):
    """Raises on every rank if the model's dense trainable weights (every
    trainable weight but the sharded tables) differ between the ranks.

    Each rank holds the whole of each dense weight, and they must stay
    equal: the model's compiled optimizer (an `OptimizerWrapper`) averages
    their gradients over the ranks. A custom `train_step` that applies
    them with another optimizer, unaveraged, lets every rank drift its own
    way while the global logs look like one model's. Two all-reduces of a
    fingerprint per weight (its sum and its sum of magnitudes).

    Args:
        model: the Keras model.
        when: words for the message, e.g. `"after epoch 3"`.

    Raises:
        RuntimeError: naming the weights that differ, on every rank.
    """
    if model is None or world.num_ranks() == 1:
        return
    weights = _dense_weights(model, trainable=True)
    if not weights:
        return
    names = sorted({_path(weights[i]) for i in _differing(
        _values(weights), "global_metrics/replicated")})
    if names:
        raise RuntimeError(
            f"sok_keras: {when}, the dense weights {names} differ between "
            "the ranks; every rank must hold the same. Apply their "
            "gradients with the model's compiled optimizer (an "
            "`OptimizerWrapper`, which averages them over the ranks), or "
            "average them yourself before another optimizer applies them: "
            "a plain Keras optimizer kept apart from `compile` (in a custom "
            "`train_step`) updates each rank's copy with that rank's own "
            "gradients. See docs/design.md, \"Data parallelism and "
            "averaging\".")


def check_learning_rates(model, when):
    """Raises on every rank if the learning rate of the model's optimizer
    differs between the ranks (one all-reduce of one value per rank).

    A callback that sets it (`LearningRateScheduler`, `ReduceLROnPlateau`)
    given on rank 0 only, as Horovod's recipes do, trains each rank's rows
    at its own rate (QA: a model of tables only trained on without a
    word; with dense weights, the error blamed their averaging).

    Args:
        model: the Keras model.
        when: words for the message, e.g. `"after epoch 3"`.

    Raises:
        RuntimeError: naming each rank's learning rate, on every rank.
    """
    opt = getattr(model, "optimizer", None)
    if opt is None or world.num_ranks() == 1:
        return
    try:
        rate = float(np.asarray(keras.ops.convert_to_numpy(
            opt.learning_rate)))
    except (TypeError, ValueError, AttributeError):
        return  # (no single number: nothing to compare)
    n = world.num_ranks()
    mine = np.zeros([n], np.float64)
    mine[world.rank()] = rate
    rates = _all_reduce_sum([mine], "global_metrics/learning_rate")
    close = np.isclose(rates, rates[0], rtol=1e-7, atol=0.0, equal_nan=True)
    if np.all(close):
        return
    each = ", ".join(f"rank {r}: {v:g}" for r, v in enumerate(rates))
    raise RuntimeError(
        f"sok_keras: {when}, the learning rate of the model's optimizer "
        f"{type(opt).__name__} differs between the ranks ({each}); every "
        "rank must train at the same rate. Give a callback that sets it "
        "(`LearningRateScheduler`, `ReduceLROnPlateau`) to `fit` on every "
        "rank, not on rank 0 only: it sees the global logs there, so it "
        "decides the same everywhere.")


def average_rank_statistics(model):
    """Averages over the ranks the model's non-trainable floating weights
    that differ between them, so every rank holds the same.

    Such weights are statistics each rank updates from its own slice of the
    batch: `BatchNormalization`'s moving mean and variance. Each is a moving
    average, linear in its updates, so their mean over the ranks is what a
    `tf.distribute` strategy keeps (it averages every replica's update, the
    variables' "mean" aggregation). `GlobalMetrics` calls this before each
    evaluation (validation included), at the end of each epoch (before
    `ModelCheckpoint` saves) and at the end of `fit`. Weights the same on
    every rank (a frozen layer's) are left untouched.

    Args:
        model: the Keras model.

    Returns:
        The paths of the weights averaged.
    """
    if model is None or world.num_ranks() == 1:
        return []
    weights = _dense_weights(model, trainable=False)
    if not weights:
        return []
    values = _values(weights)
    which = _differing(values, "global_metrics/statistics")
    if not which:
        return []
    values = [values[i] for i in which]
    total = _all_reduce_sum(values, "global_metrics/statistics_mean")
    mean, start = total / world.num_ranks(), 0
    for i, value in zip(which, values):
        v = weights[i]
        v.assign(mean[start:start + value.size].reshape(value.shape).astype(
            keras.backend.standardize_dtype(v.dtype)))
        start += value.size
    return [_path(weights[i]) for i in which]


class GlobalMetrics(keras.callbacks.Callback):
    """Makes Keras' logs global: the values of all ranks together.

    Each rank computes its loss and metrics on its own slice of the global
    batch. After every batch, evaluation and epoch, this callback replaces
    them in place by their global values (`global_logs`: the metrics'
    states summed over ranks, so means are weighted by sample count and
    metrics like AUC are exact), so the progress bar, `History` and every
    later callback (`EarlyStopping`, `ReduceLROnPlateau`,
    `ModelCheckpoint`, `TerminateOnNaN`) see the same values, and decide
    the same, on every rank.

    With more than one rank, `fit` and `evaluate` of a model with sok
    tables put one first in their callback list by themselves (a
    `GlobalMetrics` you pass is moved first instead), and `evaluate`
    returns its global values; `sok.init(global_metrics=False)` or
    `SOK_GLOBAL_METRICS=0` turns that off. It does nothing with one rank.

    At the end of an epoch, the training entries take the global values of
    the epoch's last batch and the `val_` entries those of the validation
    run (Keras resets the metrics' state for validation); other numeric
    entries are averaged, weighted by each rank's sample count. Then the
    statistics each rank keeps from its own slice (`BatchNormalization`'s
    moving mean and variance) are averaged over the ranks
    (`average_rank_statistics`; also before each evaluation and at the end
    of `fit`), and the optimizer's learning rate and the dense weights are
    checked equal on every rank (`check_learning_rates`,
    `check_replicated_weights`).

    Example:

    ```python
    model.fit(ds, epochs=2, verbose=1 if sok.rank() == 0 else 0)
    # or, explicitly (with sok.init(global_metrics=False)):
    model.fit(ds, epochs=2, callbacks=[sok.callbacks.GlobalMetrics()])
    ```
    """

    def __init__(self):
        super().__init__()
        self._train, self._train_count = {}, 0.0
        self._test, self._test_count = {}, 0.0
        self.last_test_logs = None

    def _globalize(self, logs, key):
        """Updates `logs` in place; returns `{k: (local, global)}`."""
        if not logs or world.num_ranks() == 1:
            return {}
        local = dict(logs)
        logs.update(global_logs(self.model, logs, key))
        return {k: (local[k], logs[k]) for k in logs}

    def on_epoch_begin(self, epoch, logs=None):
        self._train, self._train_count = {}, 0.0
        self._test, self._test_count = {}, 0.0

    def on_train_batch_end(self, batch, logs=None):
        count = sample_count(self.model)
        pairs = self._globalize(logs, "global_metrics/train_batch")
        if pairs:
            self._train, self._train_count = pairs, count

    def on_test_begin(self, logs=None):
        self.last_test_logs = None
        average_rank_statistics(self.model)

    def on_test_batch_end(self, batch, logs=None):
        self._globalize(logs, "global_metrics/test_batch")

    def on_test_end(self, logs=None):
        count = sample_count(self.model)
        pairs = self._globalize(logs, "global_metrics/test_end")
        if pairs:
            self._test, self._test_count = pairs, count
        self.last_test_logs = dict(logs) if logs is not None else None

    def on_epoch_end(self, epoch, logs=None):
        if not logs or world.num_ranks() == 1:
            return
        known, weights = {}, {}
        for k, pair in self._train.items():
            known[k], weights[k] = pair, self._train_count
        for k, pair in self._test.items():
            known[f"val_{k}"], weights[f"val_{k}"] = pair, self._test_count
        keys = sorted(logs)
        # 1 where this rank's entry is the one seen at the last batch /
        # validation (local or already global): it takes that global
        # value if every rank says so.
        flags = [float(k in known and (_same(logs[k], known[k][0]) or
                                       _same(logs[k], known[k][1])))
                 for k in keys]
        scalars = [k for k in keys if _is_number(logs[k])]
        w = np.array([weights.get(k, 1.0) for k in scalars], np.float64)
        values = np.array([float(logs[k]) for k in scalars], np.float64)
        total = _all_reduce_sum([flags, values * w, w, values],
                                "global_metrics/epoch")
        n, m = world.num_ranks(), len(scalars)
        agreed = total[:len(keys)]
        wv = total[len(keys):len(keys) + m]
        ws = total[len(keys) + m:len(keys) + 2 * m]
        plain = total[len(keys) + 2 * m:] / n
        for i, k in enumerate(scalars):
            logs[k] = float(wv[i] / ws[i] if ws[i] > 0 else plain[i])
        for i, k in enumerate(keys):
            if agreed[i] == n:
                logs[k] = known[k][1]
        average_rank_statistics(self.model)
        check_learning_rates(self.model, f"after epoch {epoch + 1}")
        check_replicated_weights(self.model, f"after epoch {epoch + 1}")
        self._last_epoch_logs = dict(logs)

    def on_train_begin(self, logs=None):
        self._last_epoch_logs = None

    def on_train_end(self, logs=None):
        # Keras hands `on_train_end` its own copy of the last epoch's logs
        # (each callback hook gets a fresh dict): the global values of
        # that epoch go in, for the callbacks after this one.
        last = getattr(self, "_last_epoch_logs", None)
        if logs is not None and last:
            logs.update({k: v for k, v in last.items() if k in logs})
        average_rank_statistics(self.model)


def _make_checkpoint_folders(callbacks):
    """Creates the folders of `ModelCheckpoint` and `BackupAndRestore`
    callbacks now, on every rank: Keras checks that the folder exists and
    then creates it without `exist_ok`, so ranks saving together race (one
    fails with FileExistsError)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for cb in keras.tree.flatten(callbacks) if callbacks else ():
        if isinstance(cb, keras.callbacks.ModelCheckpoint):
            folder = os.path.dirname(os.fspath(cb.filepath))
            if "{" in folder:
                _folder_made_when_saving(cb)
                continue
        elif isinstance(cb, keras.callbacks.BackupAndRestore):
            folder = os.fspath(cb.backup_dir)
        else:
            continue
        if folder and "://" not in folder:
            os.makedirs(folder, exist_ok=True)


def _folder_made_when_saving(checkpoint):
    """A `ModelCheckpoint` whose folder is a template (`ck/epoch{epoch:02d}/
    model.keras`) makes that epoch's folder with `exist_ok` once it decides
    to save, on every rank, before Keras' own check-then-create (QA: the
    ranks raced, FileExistsError in 3 runs of 4)."""
    should_save = checkpoint._should_save_model
    if getattr(should_save, "_sok_keras", False):
        return

    def should_save_model(epoch, batch, logs, filepath):
        yes = should_save(epoch, batch, logs, filepath)
        folder = os.path.dirname(os.fspath(filepath))
        if yes and folder and "://" not in folder:
            os.makedirs(folder, exist_ok=True)
        return yes

    should_save_model._sok_keras = True
    checkpoint._should_save_model = should_save_model


def joining(callback_list, extra, loop):
    """`loop` (Keras' `fit` / `evaluate` / `predict`, called as
    `loop(model, ...)`) run with the callbacks `extra` first in a
    `keras.callbacks.CallbackList` (after those of sok's that must come
    first, `sok_first`; moved there if the list holds them), then the list
    as it was. Keras runs a given `CallbackList` as it is, without setting
    its model and parameters, so `extra` gets them here."""

    @functools.wraps(loop)
    def run(model, *args, **kwargs):
        before = list(callback_list.callbacks)
        rest = [c for c in before if not any(c is e for e in extra)]
        first = 0
        while first < len(rest) and getattr(rest[first], "sok_first", False):
            first += 1
        for c in extra:
            c.set_model(model)
            c.set_params(dict(callback_list.params or {}))
        callback_list.callbacks[:] = rest[:first] + list(extra) + rest[first:]
        try:
            return loop(model, *args, **kwargs)
        finally:
            callback_list.callbacks[:] = before

    return run


def with_global_metrics(kind, original, model, args, kwargs):
    """How the multi-rank loop hooks call Keras' `fit` / `evaluate`.

    Returns `(call, args, kwargs)`: with global metrics on, `callbacks`
    gets a `GlobalMetrics` first (a given one is moved first); `evaluate`
    returns global values (in the form asked for: a dict with
    `return_dict=True`, else Keras' list or scalar). `predict` is left as
    it is. A `callbacks` that is a `keras.callbacks.CallbackList` (yours,
    or the fit's list that validation inside `fit` passes) gets a
    `GlobalMetrics` first for this loop only, unless it has one (QA: a
    user's list saw each rank's own values). The folders of
    `ModelCheckpoint` callbacks are created first, on every rank.
    """
    if kind not in ("fit", "evaluate"):
        return original, args, kwargs
    enabled = global_metrics_enabled()
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    _make_checkpoint_folders(callbacks)
    call = original
    if isinstance(callbacks, keras.callbacks.CallbackList):
        found = [c for c in callbacks.callbacks
                 if isinstance(c, GlobalMetrics)]
        if enabled or found:
            # A given one is moved first for this loop too (review: the
            # callbacks before it saw each rank's own values).
            found = found[:1] or [GlobalMetrics()]
            call = joining(callbacks, found, original)
    else:
        callbacks = keras.tree.flatten(callbacks) if callbacks else []
        found = [c for c in callbacks if isinstance(c, GlobalMetrics)]
        if enabled:
            rest = [c for c in callbacks if not isinstance(c, GlobalMetrics)]
            found = found or [GlobalMetrics()]
            bound.arguments["callbacks"] = found + rest
    if kind == "fit" or not (enabled or found):
        return call, bound.args[1:], bound.kwargs
    gm = found[0] if found else None
    want_dict = bool(bound.arguments.get("return_dict", False))
    bound.arguments["return_dict"] = True

    @functools.wraps(original)
    def evaluate(model, *a, **k):
        if gm is not None:
            gm.last_test_logs = None
        logs = call(model, *a, **k)
        if gm is not None and gm.last_test_logs is not None:
            logs = gm.last_test_logs
        else:
            logs = global_logs(model, logs, "global_metrics/evaluate")
        return logs if want_dict else model._flatten_metrics_in_order(logs)

    return evaluate, bound.args[1:], bound.kwargs


_CKPT_RE = re.compile(r"^ckpt-(\d{10})$")


class ShardedCheckpoint(keras.callbacks.Callback):
    """Sharded checkpoints during `model.fit`, keeping the last `keep`.

    Every `every_n_steps` training steps and/or every `every_n_epochs`
    epochs, writes `sok_keras.dump(directory/ckpt-<step:010d>, model)` (each
    rank its own rows; the manifest last, so an interrupted checkpoint is
    never taken for a complete one), then removes all but the newest
    `keep` complete checkpoints and any incomplete one. `<step>` is the
    optimizer's step count. Each checkpoint records in its manifest's
    `metadata` the `step`, the `epoch` being trained and `batch_in_epoch`,
    the batches of that epoch already done.

    `restore_latest(model)` loads the newest complete checkpoint (at any
    number of ranks) and returns that metadata, so a restarted job can skip
    what was done: `ds.skip(meta["batch_in_epoch"])` for the epoch
    `meta["epoch"]`, then `initial_epoch=meta["epoch"] + 1` for the rest.
    The callback counts that shortened epoch's batches from
    `batch_in_epoch`, so a job interrupted again resumes right too (an
    epoch trained whole again, with as many steps as the checkpoint's
    `steps_in_epoch`, counts from 0).

    Put it in `callbacks=[...]` on every rank, with the same arguments.

    Args:
        directory: the folder holding the checkpoints (shared by every rank,
            any `tf.io.gfile` path).
        every_n_steps: int or None; checkpoint after every that many
            training steps (counted by the optimizer).
        every_n_epochs: int or None; checkpoint at the end of every that
            many epochs. Defaults to 1 when `every_n_steps` is None too.
        keep: int or None; how many complete checkpoints to keep (None:
            all). Defaults to 3.

    Example:

    ```python
    ckpt = sok.callbacks.ShardedCheckpoint("/shared/run1",
                                           every_n_steps=1000, keep=2)
    meta = ckpt.restore_latest(model)  # None on a fresh start
    model.fit(ds, callbacks=[ckpt])
    ```
    """

    def __init__(self, directory, every_n_steps=None, every_n_epochs=None,
                 keep=3):
        super().__init__()
        for arg, value in (("every_n_steps", every_n_steps),
                           ("every_n_epochs", every_n_epochs),
                           ("keep", keep)):
            if value is not None and (isinstance(value, bool) or not
                                      isinstance(value, int) or value < 1):
                raise ValueError(
                    f"ShardedCheckpoint: `{arg}` must be None or a positive "
                    f"integer. Received: {arg}={value!r}.")
        if every_n_steps is None and every_n_epochs is None:
            every_n_epochs = 1
        self.directory = os.fspath(directory).rstrip("/")
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep = keep
        self._epoch = 0
        self._offset = 0  # batches of this epoch skipped by a resume
        self._resumed = None  # metadata of the checkpoint restored
        self._last_saved = None

    # -- listing ------------------------------------------------------------
    def _path(self, step):
        return f"{self.directory}/ckpt-{step:010d}"

    def _listing(self):
        """`[(step, complete)]` of the checkpoint folders, oldest first."""
        if not tf.io.gfile.isdir(self.directory):
            return []
        out = []
        for name in tf.io.gfile.listdir(self.directory):
            m = _CKPT_RE.match(name.rstrip("/"))
            if m:
                step = int(m.group(1))
                done = tf.io.gfile.exists(f"{self._path(step)}/manifest.json")
                out.append((step, done))
        return sorted(out)

    def checkpoints(self):
        """The steps of the complete checkpoints, oldest first."""
        return [step for step, done in self._listing() if done]

    # -- saving -------------------------------------------------------------
    def _step(self):
        return int(self.model.optimizer.iterations.numpy())

    def _save(self, epoch, batch_in_epoch):
        from sok_keras import checkpoint

        step = self._step()
        if step == self._last_saved:
            return
        steps = (self.params or {}).get("steps")
        checkpoint.dump(self._path(step), self.model, metadata={
            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
            "steps_in_epoch": None if not steps else self._offset + steps})
        self._last_saved = step
        if world.rank() == 0:
            self._prune(step)

    def _prune(self, newest):
        listing = self._listing()
        complete = [s for s, done in listing if done]
        doomed = [s for s, done in listing if not done and s != newest]
        if self.keep is not None:
            doomed += complete[:-self.keep]
        for step in doomed:
            try:
                tf.io.gfile.rmtree(self._path(step))
            except tf.errors.NotFoundError:
                pass

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._offset = epoch, 0
        resumed, self._resumed = self._resumed, None
        if resumed and epoch == resumed.get("epoch") and resumed.get(
                "batch_in_epoch"):
            # The first epoch after `restore_latest`: the recipe's `fit(ds.
            # skip(done), initial_epoch=epoch)` trains only its rest, unless
            # it has as many steps as the whole epoch had.
            steps = (self.params or {}).get("steps")
            whole = resumed.get("steps_in_epoch")
            if not (steps and whole and steps == whole):
                self._offset = int(resumed["batch_in_epoch"])

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and self._step() % self.every_n_steps == 0:
            steps = (self.params or {}).get("steps")
            if steps and batch + 1 >= steps:  # the epoch's last step
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, self._offset + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._save(epoch + 1, 0)

    # -- resuming -----------------------------------------------------------
    def restore_latest(self, model=None):
        """Loads the newest complete checkpoint into `model`.

        Every rank must call it; they all load the checkpoint rank 0 found.

        Args:
            model: the model (defaults to the callback's model).

        Returns:
            The checkpoint's metadata (`step`, `epoch`, `batch_in_epoch`,
            `steps_in_epoch`: the epoch's steps, None if unknown), or None
            if there is no complete checkpoint (nothing is loaded).

        Raises:
            sok_keras.RankMismatchError: if not every rank calls it within
                `SOK_SAVE_TIMEOUT` seconds.
        """
        from sok_keras import checkpoint

        model = model or self.model
        if model is None:
            raise ValueError(
                "ShardedCheckpoint.restore_latest needs a model (none given "
                "and the callback is not attached to one).")
        from sok_keras import global_views

        # A call on some ranks only fails within SOK_SAVE_TIMEOUT, naming
        # it (RankMismatchError), not at the collectives' timeout.
        global_views.check_in(
            f"ShardedCheckpoint('{self.directory}').restore_latest()",
            key="sharded_checkpoint/restore")
        steps = self.checkpoints() if world.rank() == 0 else []
        # Every rank takes rank 0's choice (1 + step; 0: none).
        chosen = world.control_communicator().agree(
            "sharded_checkpoint/latest", 1 + steps[-1] if steps else 0,
            world.timeout())
        if not chosen:
            return None
        path = self._path(chosen - 1)
        try:
            manifest = checkpoint.load(path, model)
        except checkpoint.CheckpointError as e:
            # (The newest complete checkpoint is damaged: the operator
            # decides whether to fall back to an older one.)
            raise checkpoint.CheckpointError(
                f"{e} ShardedCheckpoint.restore_latest: the newest "
                f"checkpoint, '{path}', could not be loaded; to resume from "
                "the one before it, move that folder out of "
                f"'{self.directory}' and restart.") from e
        self._last_saved = chosen - 1
        meta = manifest.get("metadata")
        self._resumed = dict(meta) if isinstance(meta, dict) else None
        return meta
