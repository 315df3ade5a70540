"""Keras callbacks for multi-rank training."""

import os
import re

import keras
import numpy as np
import tensorflow as tf

from sok_keras import world


def average_logs(logs, key):
    """Averages the numeric entries of a Keras `logs` dict across ranks.

    Every rank must call it with the same keys. Returns a new dict.
    """
    if not logs or world.num_ranks() == 1:
        return logs
    names = sorted(k for k, v in logs.items() if _is_number(v))
    if not names:
        return logs
    values = tf.constant([float(logs[k]) for k in names], tf.float64)
    mean = world.communicator().all_reduce(
        values, key=f"{key}/{len(names)}", op="mean").numpy()
    out = dict(logs)
    out.update({k: float(v) for k, v in zip(names, mean)})
    return out


def _is_number(v):
    if isinstance(v, (int, float, np.number)):
        return True
    return hasattr(v, "shape") and tuple(v.shape) == ()


class GlobalMetrics(keras.callbacks.Callback):
    """Shows global (rank-averaged) loss and metrics in Keras' logs.

    Each rank computes its loss and metrics on its own slice of the global
    batch. This callback replaces them, in place, by their mean over ranks
    after every batch and epoch, so the progress bar of rank 0, `History`
    and later callbacks report the global values. Losses and mean-type
    metrics averaged this way are exact when every rank has the same batch
    size; metrics that are not means of per-example values (AUC, say) are
    averaged per rank, an approximation.

    Put it in `callbacks=[...]` on every rank; it does nothing with one rank.

    Example:

    >>> model.fit(ds, epochs=2, callbacks=[sok.callbacks.GlobalMetrics()],
    ...           verbose=1 if sok.rank() == 0 else 0)
    """

    def _average(self, logs, key):
        if logs:
            logs.update(average_logs(logs, key))

    def on_train_batch_end(self, batch, logs=None):
        self._average(logs, "global_metrics/train_batch")

    def on_test_batch_end(self, batch, logs=None):
        self._average(logs, "global_metrics/test_batch")

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, "global_metrics/epoch")

    def on_test_end(self, logs=None):
        self._average(logs, "global_metrics/test_end")


_CKPT_RE = re.compile(r"^ckpt-(\d{10})$")


class ShardedCheckpoint(keras.callbacks.Callback):
    """Sharded checkpoints during `model.fit`, keeping the last `keep`.

    Every `every_n_steps` training steps and/or every `every_n_epochs`
    epochs, writes `sok_keras.dump(directory/ckpt-<step>, model)` (each
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

    >>> ckpt = sok.callbacks.ShardedCheckpoint("/shared/run1",
    ...                                        every_n_steps=1000, keep=2)
    >>> meta = ckpt.restore_latest(model)  # None on a fresh start
    >>> model.fit(ds, callbacks=[ckpt])
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
        checkpoint.dump(self._path(step), self.model, metadata={
            "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch})
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
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps and self._step() % self.every_n_steps == 0:
            steps = (self.params or {}).get("steps")
            if steps and batch + 1 >= steps:  # the epoch's last step
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, batch + 1)

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
            The checkpoint's metadata (`step`, `epoch`, `batch_in_epoch`),
            or None if there is no complete checkpoint (nothing is loaded).
        """
        from sok_keras import checkpoint

        model = model or self.model
        if model is None:
            raise ValueError(
                "ShardedCheckpoint.restore_latest needs a model (none given "
                "and the callback is not attached to one).")
        steps = self.checkpoints() if world.rank() == 0 else []
        # Every rank takes rank 0's choice (1 + step; 0: none).
        chosen = world.control_communicator().agree(
            "sharded_checkpoint/latest", 1 + steps[-1] if steps else 0,
            world.timeout())
        if not chosen:
            return None
        manifest = checkpoint.load(self._path(chosen - 1), model)
        self._last_saved = chosen - 1
        return manifest.get("metadata")
