"""Rank 1 ends its program after one lookup both ranks make; rank 0 waits
until rank 1's process is gone (released: rank 0 had no collective in
flight), then makes one more eager lookup, which can never complete.
Rank 0 records the error it gets and whether rank 1 went first."""

import os
import time

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import OUT, RANK, write_result  # noqa: E402

table = sok.Variable(np.ones((20, 2)), dtype="float32", name="t")
ids = tf.constant([[1, 2], [3, -1]], tf.int64)
sok.lookup_sparse(table, ids).numpy()  # both ranks
marker = os.path.join(OUT, "rank1.pid")
if RANK == 1:
    with open(marker + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
if RANK == 0:
    # Rank 1's program has ended: no collective is in flight here, so
    # rank 1 is released and exits (within 30 s, or never: None).
    start = time.monotonic()
    while not os.path.exists(marker) and time.monotonic() - start < 30:
        time.sleep(0.02)
    with open(marker) as f:
        pid = int(f.read())
    gone_after = None
    while time.monotonic() - start < 30:
        if not os.path.exists(f"/proc/{pid}"):  # (reaped by its parent)
            gone_after = time.monotonic() - start
            break
        time.sleep(0.02)
    t0 = time.monotonic()
    try:
        sok.lookup_sparse(table, ids).numpy()
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test reads it
        result = {"type": type(e).__name__, "error": str(e)}
    result["elapsed"] = time.monotonic() - t0
    result["rank1_gone_before_lookup"] = gone_after is not None
    write_result(result)
