"""Rank 1 ends its program after one lookup both ranks make; rank 0 then
makes one more eager lookup, which can never complete. Rank 0 records
the error it gets."""

import time

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

table = sok.Variable(np.ones((20, 2)), dtype="float32", name="t")
ids = tf.constant([[1, 2], [3, -1]], tf.int64)
sok.lookup_sparse(table, ids).numpy()  # both ranks
if RANK == 0:
    time.sleep(1.0)  # rank 1's program has ended by now (it waits at exit)
    t0 = time.monotonic()
    try:
        sok.lookup_sparse(table, ids).numpy()
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test reads it
        result = {"type": type(e).__name__, "error": str(e)}
    result["elapsed"] = time.monotonic() - t0
    write_result(result)
