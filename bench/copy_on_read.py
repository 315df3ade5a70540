"""A pooled lookup of a table that TensorFlow's copy-on-read mode holds,
with and without the lookup turning the mode off (the regression fixed in
`sok_keras.variable.dense_reads` and `aliasing_read`).

A sparse access (`scatter_update`, `ResourceStridedSliceAssign`, a
`tf.gather` of the variable) puts a `tf.Variable` in copy-on-read mode for
good, and every dense read copies the whole table. sok_keras turns the mode
off after its own in-place writes, and its pooled lookup's read turns it
off first. This script times the same pooled lookup on (a) a table made by
`sok.Variable` (block-initialized, mode off), then, after a plain
`scatter_update` of one row (mode on), (b) the same op given a plain dense
read (baseline: what every pooled lookup did after a sparse access before
the fix) and (c) `sok.lookup_sparse`. Baseline and fix in one run.

    python bench/copy_on_read.py [--rows 2000000 --dim 64]
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--hotness", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=os.path.join(_common.RESULTS,
                                                 "copy_on_read.json"))
    args = p.parse_args()
    t0 = time.perf_counter()
    import keras
    import tensorflow as tf

    import sok_keras as sok

    table = sok.Variable(keras.initializers.RandomUniform(-0.05, 0.05,
                                                          seed=3),
                         shape=(args.rows, args.dim), name="table")
    ids = tf.constant(np.random.default_rng(0).integers(
        0, args.rows, size=(args.batch, args.hotness)), tf.int64)
    fwd = tf.function(lambda: sok.lookup_sparse(table, ids, combiners="sum"))

    def ms(fn):
        fn().numpy()
        times = []
        for _ in range(args.steps):
            s = time.perf_counter()
            fn().numpy()
            times.append((time.perf_counter() - s) * 1e3)
        return float(np.median(times))

    result = {"machine": _common.machine_info(),
              "command": _common.command_line(), "config": vars(args),
              "device": table.value.device}
    result["sok_table_ms"] = ms(fwd)
    # A sparse access turns the mode on for good (here a scatter_update;
    # a user's tf.gather of the table does the same).
    table.value.scatter_update(tf.IndexedSlices(
        tf.zeros([1, args.dim]), tf.constant([0], tf.int64)))
    # Baseline, what every pooled lookup did from then on before the
    # lookup's read turned the mode off: the same op on a plain read.
    from sok_keras._ops import ops

    flat = tf.reshape(ids, [-1])
    splits = tf.range(0, args.batch * args.hotness + 1, args.hotness,
                      dtype=tf.int64)
    plain = tf.function(lambda: ops().sok_pooled_lookup(
        table=tf.convert_to_tensor(table.value), ids=flat,
        row_splits=splits, weights=tf.zeros([0]), combiner="sum",
        table_name="table"))
    result["copy_on_read_ms"] = ms(plain)
    result["after_sparse_access_ms"] = ms(fwd)
    result["slowdown_with_copy_on_read"] = round(
        result["copy_on_read_ms"] / result["after_sparse_access_ms"], 2)
    _common.finish(args.out, result, t0)
    for k in ("sok_table_ms", "copy_on_read_ms", "after_sparse_access_ms",
              "slowdown_with_copy_on_read"):
        print(f"{k:28s} {result[k]}")


if __name__ == "__main__":
    main()
