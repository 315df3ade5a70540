"""Watchdog: rank 1 stalls (sleeps instead of joining an exchange); rank 0
must get an error naming its rank and the key within the timeout."""

import os
import sys
import time

from _worker import OUT, RANK, write_result

import sok_keras.world as world

TIMEOUT = float(sys.argv[1])
STALL = float(sys.argv[2])
# Joining takes the default timeout (a rank importing TensorFlow on a
# loaded machine can take more than TIMEOUT to start); the collectives
# below take TIMEOUT (a later init() applies a new timeout).
world.init()
world.init(timeout=TIMEOUT)

import tensorflow as tf  # noqa: E402

comm = world.communicator()
N = comm.num_ranks
# Everyone is connected and collectives work.
warm = comm.all_reduce(tf.constant([1.0]), "warm").numpy().tolist()


@tf.function
def step(x, c):
    return comm.exchange(x, c, "stall/ids")


result = {"warm": warm}
if RANK == 1:
    # A stalled peer: alive, never joins; leaves once rank 0 has reported
    # (or after STALL seconds).
    deadline = time.time() + STALL
    while time.time() < deadline and not os.path.exists(
        os.path.join(OUT, "rank0.json")
    ):
        time.sleep(0.1)
else:
    c = tf.ones([N, N], tf.int64)
    start = time.time()
    try:
        step(tf.ones([N, 4]), c)
        result["error"] = None
    except tf.errors.DeadlineExceededError as e:
        result["error"] = e.message
    result["elapsed"] = time.time() - start
    # Later collectives fail at once with the same message.
    start = time.time()
    try:
        comm.all_reduce(tf.constant([1.0]), "after")
        result["after"] = None
    except tf.errors.OpError as e:
        result["after"] = e.message
    result["after_elapsed"] = time.time() - start
write_result(result)
print(f"rank {RANK} done: {result}", flush=True)
