"""model.fit with sok.callbacks.ShardedCheckpoint, killed and resumed.

argv: ACTION DIR OUT

ACTION:
  uninterrupted  fit 2 epochs of 6 steps; OUT/final.npz (rank 0);
  killed         the same with ShardedCheckpoint(DIR, every_n_steps=2,
                 keep=2); rank 1 dies (os._exit) before the 4th step of the
                 second epoch (global step 10);
  resume         ShardedCheckpoint(DIR, ...).restore_latest(model), then
                 fit what is left (the rest of the interrupted epoch, then
                 the remaining epochs) with the callback on; OUT/final.npz;
  resume-killed  `resume`, with rank 1 dying again before global step 11;
  backup-killed  fit with keras.callbacks.BackupAndRestore(DIR) (a backup
                 at each epoch's end, through model.save_weights on every
                 rank); rank 1 dies in the second epoch, as in `killed`;
  backup-resume  the same fit command again: BackupAndRestore restores the
                 last backup, fit runs from the interrupted epoch, and the
                 folder is deleted at the end; OUT/final_backup-resume.npz.
"""

import os
import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.training_setup import make_model_and_data  # noqa: E402

action, directory, out = sys.argv[1:4]
STEPS, EPOCHS, GLOBAL_BATCH = 6, 2, 48

model, optimizer, (x, y) = make_model_and_data("sok", "adam", STEPS,
                                               GLOBAL_BATCH)
model.compile(optimizer=sok.optimizers.OptimizerWrapper(optimizer),
              loss="binary_crossentropy")
epoch_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
    GLOBAL_BATCH, drop_remainder=True)


def fit(ds, epochs, callbacks, initial_epoch=0):
    model.fit(sok.shard_batches(ds), epochs=epochs, verbose=0,
              initial_epoch=initial_epoch, callbacks=callbacks)


def final_state():
    table = model.get_layer("embedding").embeddings
    st = {"table": table.read_global()}
    for k in sorted(table.slots):
        st[f"slot/{k}"] = table.slots[k].read_global()
    for v in model.variables + model.optimizer.variables:
        if not isinstance(v, sok.Variable):
            st[v.path] = np.asarray(v.numpy())
    if RANK == 0:
        np.savez(os.path.join(out, f"final_{action}.npz"), **st)


class Die(keras.callbacks.Callback):
    """Kills rank 1 before global step `step` (10: the 4th step of the
    second epoch)."""

    def __init__(self, step=10):
        super().__init__()
        self.step = step

    def on_train_batch_begin(self, batch, logs=None):
        done = int(self.model.optimizer.iterations.numpy())
        if RANK == 1 and done == self.step - 1:
            os._exit(9)  # killed mid-epoch


result = {}
ckpt = sok.callbacks.ShardedCheckpoint(directory, every_n_steps=2, keep=2)
if action == "uninterrupted":
    fit(epoch_ds, EPOCHS, [])
elif action == "killed":
    fit(epoch_ds, EPOCHS, [ckpt, Die()])
elif action in ("backup-killed", "backup-resume"):
    backup = keras.callbacks.BackupAndRestore(directory)
    callbacks = [backup]
    if action == "backup-killed":
        callbacks.append(Die())
    else:
        # Rank 1 writes each backup's training_metadata.json late: rank 0
        # must not delete the folder (at the fit's end) before every rank
        # has written its last one (a FileNotFoundError on rank 1 in GPU
        # run 10).
        if RANK == 1:
            import time

            from keras.src.utils import file_utils

            opened = file_utils.File

            def late_metadata(path, mode="r"):
                if "w" in mode and str(path).endswith(
                        "training_metadata.json"):
                    time.sleep(1.0)
                return opened(path, mode)

            file_utils.File = late_metadata

        class Begin(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):  # after the restore
                result["iterations"] = int(
                    model.optimizer.iterations.numpy())

        callbacks.append(Begin())
    fit(epoch_ds, EPOCHS, callbacks)
    result["backup_left"] = os.path.exists(directory)
elif action in ("resume", "resume-killed"):
    callbacks = [ckpt] + ([Die(11)] if action == "resume-killed" else [])
    meta = ckpt.restore_latest(model)
    result["meta"] = meta
    result["iterations"] = int(model.optimizer.iterations.numpy())
    epoch, done = meta["epoch"], meta["batch_in_epoch"]
    if done:  # the rest of the interrupted epoch
        fit(epoch_ds.skip(done), epoch + 1, callbacks, initial_epoch=epoch)
        epoch += 1
    if epoch < EPOCHS:
        fit(epoch_ds, EPOCHS, callbacks, initial_epoch=epoch)
    result["checkpoints"] = ckpt.checkpoints()
else:
    raise SystemExit(f"unknown action {action!r}")
final_state()
write_result(result)
