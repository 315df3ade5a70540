"""A table of more than 2**31 local rows, end to end on one rank.

Builds a float16 `DistributedEmbedding` of 2**31 + 64 rows x 1 (4 GiB),
plants marker rows around row 2**31, then checks, where int32 indices
would wrap:
  - the pooled forward of ids past 2**31;
  - one `model.fit` step (traced): exactly the looked-up rows move, by
    -lr * count;
  - `sok.dump` and `sok.load` into a fresh table: the marker rows back,
    and its unpooled forward;
  - `model.save` to a .keras file and `keras.models.load_model`.
Prints one line per check and exits non-zero on the first failure.
Needs ~14 GB of memory and ~10 GB of disk; minutes on 2 cores. Not part
of the test suite for that reason (tests/test_lookup.py checks the same
gradient path on a small table with the threshold lowered).

    python bench/wide_table.py [--out FILE.json] [--dir TMPDIR]
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

V = 2 ** 31 + 64
T0 = time.time()
MARKED = [0, 1, 2 ** 31 - 2, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, V - 2, V - 1]


def _check(results, name, ok, detail=""):
    results.append({"check": name, "ok": bool(ok), "detail": detail,
                    "at_s": round(time.time() - T0, 1)})
    print(f"{time.time() - T0:6.1f} s  " + ("ok   " if ok else "FAIL ")
          + name + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        raise SystemExit(1)


def _rows(table, rows):
    return tf.gather(table.value, tf.constant(rows, tf.int64)).numpy()[:, 0]


def _plant(table):
    values = np.arange(1, len(MARKED) + 1, dtype=np.float16)
    table.value.scatter_update(tf.IndexedSlices(
        tf.constant(values[:, None]), tf.constant(MARKED, tf.int64)))
    return values


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(dir=args.dir, prefix="sok_wide_")
    results = []
    try:
        ids = keras.Input(shape=(2,), dtype="int64", name="ids")
        emb = sok.layers.DistributedEmbedding(
            V, 1, combiner="sum", dtype="float16",
            embeddings_initializer="zeros", name="wide")
        out = keras.layers.Lambda(lambda t: tf.cast(t, tf.float32),
                                  output_shape=(1,))(emb(ids))
        model = keras.Model(ids, out)
        table = emb.embeddings
        marks = _plant(table)
        x = np.array([[2 ** 31, 2 ** 31 + 1], [V - 1, -1]], np.int64)
        got = model.predict(x, verbose=0)[:, 0]
        _check(results, "pooled forward past 2**31",
               np.array_equal(got, [marks[4] + marks[5], marks[7]]),
               str(got.tolist()))
        # d loss / d out = 1 for every sample: each looked-up row moves
        # by -lr per occurrence.
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=lambda y, p: tf.reduce_sum(p))
        x = np.array([[2 ** 31 - 1, 2 ** 31], [2 ** 31, V - 1]], np.int64)
        model.fit(x, np.zeros((2, 1), np.float32), batch_size=2,
                  epochs=1, verbose=0)
        got = _rows(table, MARKED)
        want = marks.copy()
        want[3] -= 0.5
        want[4] -= 1.0
        want[7] -= 0.5
        _check(results, "fit step (traced) moves exactly the rows looked up",
               np.array_equal(got, want), str(got.tolist()))

        ckpt = os.path.join(work, "ckpt")
        sok.dump(ckpt, [table])
        fresh = sok.layers.DistributedEmbedding(
            V, 1, combiner=None, dtype="float16",
            embeddings_initializer="zeros", name="wide")
        fresh.build((None, 2))
        sok.load(ckpt, [fresh.embeddings])
        _check(results, "sok.dump / sok.load keep rows past 2**31",
               np.array_equal(_rows(fresh.embeddings, MARKED), want))
        got = fresh(tf.constant(x)).numpy()[..., 0]
        _check(results, "unpooled forward past 2**31",
               np.array_equal(got, [[want[3], want[4]], [want[4], want[7]]]),
               str(got.tolist()))
        del fresh
        shutil.rmtree(ckpt)

        path = os.path.join(work, "wide.keras")
        model.save(path)
        print(f"{time.time() - T0:6.1f} s  saved "
              f"{os.path.getsize(path) / 2 ** 30:.2f} GiB", flush=True)
        del model, emb, table
        keras.utils.clear_session()
        loaded = keras.models.load_model(path, compile=False, safe_mode=False)
        _check(results, "model.save / load_model keep rows past 2**31",
               np.array_equal(
                   _rows(loaded.get_layer("wide").embeddings, MARKED), want))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"rows": V, "dtype": "float16", "dim": 1,
                           "seconds": round(time.time() - T0, 1),
                           "checks": results}, f, indent=1)


if __name__ == "__main__":
    main()
