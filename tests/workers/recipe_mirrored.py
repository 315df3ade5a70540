"""MirroredStrategy over 2 and 4 logical CPU devices in one process:
`comm.ReplicaCommunicator` collectives between the replicas (eager and in
`tf.function`). The tables and layers on top of it:
recipe_mirrored_train.py."""

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

import sok_keras as sok  # noqa: E402
from sok_keras import comm as comm_lib  # noqa: E402
from _worker import write_result  # noqa: E402

sok.init()
result = {}


def scenario(n):
    strategy = tf.distribute.MirroredStrategy(
        [f"/CPU:{i}" for i in range(n)])
    comm = comm_lib.ReplicaCommunicator(n)
    # Replica i sends C[i, j] = i + j + 1 rows to replica j, each row
    # [i, j, k] (k = its index within the block).
    counts = np.array([[i + j + 1 for j in range(n)] for i in range(n)])

    def per_replica():
        r = comm.rank
        x = tf.constant([float(r + 1), 10.0 * (r + 1)])
        rows = tf.constant(
            [[r, j, k] for j in range(n) for k in range(counts[r, j])],
            tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(rows)
            got = comm.exchange(rows, tf.constant(counts), "rows")
            weight = tf.cast(tf.range(tf.shape(got)[0]) + 1, tf.float32)
            loss = tf.reduce_sum(got * weight[:, None])
        grad = tape.gradient(loss, rows)
        return {
            "rank": tf.constant(r),
            "sum": comm.all_reduce(x, "x", op="sum"),
            "mean": comm.all_reduce(x, "x2", op="mean"),
            "max": comm.all_reduce(x, "x3", op="max"),
            "gather": comm.all_gather(x[tf.newaxis], "g"),
            "bcast": comm.broadcast(x, "b", root=n - 1),
            "got": got,
            "back": comm.exchange_back(got, tf.constant(counts), "back"),
            "rows": rows,
            "grad": grad,
        }

    out = {}
    for how, fn in (("eager", per_replica),
                    ("function", tf.function(per_replica))):
        res = strategy.run(fn)
        out[how] = [
            {k: np.asarray(v).tolist() for k, v in zip(
                res.keys(), [strategy.experimental_local_results(t)[i]
                             for t in res.values()])}
            for i in range(n)]

    return out


for n in (2, 4):
    result[str(n)] = scenario(n)
write_result(result)
