"""Ranks that run different numbers of steps in model.fit, raise, or exit.

argv: STEPS0 STEPS1 EXTRA [EPOCHS]. Rank r gets STEPS<r> batches per
epoch. EXTRA: "none"; "metrics" (GlobalMetrics); "save" (model.save after
fit); "validate" (validation data, GlobalMetrics); "raise" (rank 1 raises
in a callback at step 5); "exit" (rank 1 calls os._exit(0) at step 5);
"raise_uncaught" (as "raise", and rank 1 lets the error end the program);
"raise_poisoned" (as "raise", after strangers sent rank 0's side channel
lines that are not a rank's: `null`, `[]`, `1`, a hello with a wrong or no
token, a long line without a newline; one stays connected);
"stop" (rank 1 stops training after its first epoch); "stop_batch" (rank
1 stops training after step 2); "unknown" (data and
validation data of unknown length, through `.filter`, and GlobalMetrics:
Keras then begins one more step per epoch, which finds the data empty);
"lr_rank0" (a LearningRateScheduler on rank 0 only);
"callback_list" (the callbacks given as a `keras.callbacks.CallbackList`);
"spe" (steps_per_execution=3: Keras reports one step per execution);
"stall" (rank 1 sleeps 15 s before step 5: a stalled rank; "stall0":
rank 0 does);
"spe_validate" (the same, with validation data of 1 batch on rank 0 and
2 on rank 1: both inside one execution); "op_error" (a TensorFlow op of
the model fails in rank 1's step 5: an assertion on the ids).
Each rank writes what fit (and save) raised.
"""

import os
import sys
import time

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import OUT, RANK, write_result  # noqa: E402

steps = int(sys.argv[1 + RANK])
EXTRA = sys.argv[3]
EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 1
BATCH = 4


def data(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 31, size=(n * BATCH, 2)).astype(np.int64)
    if EXTRA == "op_error" and RANK == 1:
        ids[4 * BATCH:5 * BATCH] = 31  # step 5's batch
    y = rng.normal(size=(n * BATCH, 1)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)
    if EXTRA == "unknown":
        ds = ds.filter(lambda a, b: True)
    return ds


class Trouble(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if RANK == 1 and EXTRA == "stop":  # a rank-local early stop
            self.model.stop_training = True

    def on_train_batch_end(self, batch, logs=None):
        if RANK == 1 and EXTRA == "stop_batch" and batch == 1:
            self.model.stop_training = True  # e.g. a stop file on rank 1

    def on_train_batch_begin(self, batch, logs=None):
        if RANK == 0 and batch == 4 and EXTRA == "stall0":
            time.sleep(15)
        if RANK == 1 and batch == 4:
            if EXTRA.startswith("raise"):
                raise RuntimeError("rank 1 fails on purpose at step 5")
            if EXTRA == "exit":
                os._exit(0)
            if EXTRA == "stall":  # alive, but stuck (reports nothing)
                time.sleep(15)


def checked(ids):
    check = tf.debugging.assert_less(
        ids, tf.constant(31, ids.dtype), message="op_error: id 31 seen")
    with tf.control_dependencies([check]):
        return tf.identity(ids)


inputs = keras.Input(shape=(2,), dtype="int64")
ids = (keras.layers.Lambda(checked, output_shape=(2,))(inputs)
       if EXTRA == "op_error" else inputs)
emb = sok.layers.DistributedEmbedding(32, 4, name="emb")(ids)
model = keras.Model(inputs, keras.layers.Dense(1, name="head")(emb))
model.compile(optimizer=sok.optimizers.OptimizerWrapper(
    keras.optimizers.SGD(0.1)), loss="mse",
    steps_per_execution=3 if EXTRA.startswith("spe") else 1)
callbacks = [Trouble()]
if EXTRA in ("metrics", "validate", "unknown"):
    callbacks.append(sok.callbacks.GlobalMetrics())
if EXTRA == "lr_rank0" and RANK == 0:  # Horovod's habit
    callbacks.append(keras.callbacks.LearningRateScheduler(
        lambda epoch, rate: rate * 0.1))
if EXTRA == "callback_list":  # Keras runs a given CallbackList as it is
    callbacks = keras.callbacks.CallbackList(
        callbacks, add_history=True, model=model)
kwargs = {}
if EXTRA in ("validate", "unknown"):
    kwargs["validation_data"] = data(3, 7 + RANK)
if EXTRA == "spe_validate":
    kwargs["validation_data"] = data(1 + RANK, 7 + RANK)
if EXTRA == "raise_poisoned" and RANK == 0:
    import socket

    from sok_keras import divergence

    port = divergence.channel()._server.getsockname()[1]
    strangers = []
    for junk in (b"null\n", b"[]\n", b"1\n",
                 b'{"t": "hello", "token": "guess", "rank": 1}\n',
                 b'{"t": "hello", "rank": 1}\n', b"x" * 300000):
        stranger = socket.create_connection(("127.0.0.1", port))
        try:
            stranger.sendall(junk)
        except OSError:  # dropped while sending: what should happen
            pass
        strangers.append(stranger)
result = {"error": None, "type": None}
start = time.monotonic()
try:
    history = model.fit(data(steps, RANK), epochs=EPOCHS, verbose=0,
                        callbacks=callbacks, **kwargs)
    result["losses"] = history.history["loss"]
    if EXTRA == "save":
        model.save(os.path.join(OUT, "model.keras"))
        result["saved"] = True
except Exception as e:  # noqa: BLE001 - reported to the test
    if EXTRA == "raise_uncaught" and RANK == 1:
        raise
    result.update(error=str(e), type=type(e).__name__)
result["elapsed"] = time.monotonic() - start
write_result(result)
print(f"rank {RANK}: {result}", flush=True)
