"""The tables of the initialization tests (tests/test_init_global.py),
shared by the multi-rank worker (init_tables.py) and the one-process test.

`build()` makes every table on this rank and returns, per table, its
SHA-256 over the global table (`read_global`, a collective) and whether it
equals the Keras initializer's own output for the global shape.
"""

import hashlib
import random

import keras
import numpy as np
import tensorflow as tf

import sok_keras as sok
from sok_keras import table_init

I = keras.initializers


def _ramp(shape, dtype=None):
    """A custom callable: depends on the global shape (the fallback)."""
    rows, dim = shape
    return tf.cast(tf.reshape(tf.range(rows * dim), shape), dtype) / (
        rows * dim)


class Scaled(I.Initializer):
    """A custom Initializer subclass (the fallback path)."""

    def __call__(self, shape, dtype=None):
        return 0.5 * I.GlorotUniform(seed=21)(shape, dtype)


# (name, factory, shape, mode, dtype); factories give a fresh initializer.
SPECS = [
    ("uniform", lambda: I.RandomUniform(-0.3, 0.2, seed=3), (101, 7),
     "distributed", "float32"),
    ("normal", lambda: I.RandomNormal(0.1, 2.0, seed=4), (50, 12),
     "distributed", "float64"),
    ("truncated", lambda: I.TruncatedNormal(seed=5), (77, 8),
     "distributed", "float32"),
    ("glorot_uniform", lambda: I.GlorotUniform(seed=1), (1000, 8),
     "distributed", "float32"),
    ("glorot_normal", lambda: I.GlorotNormal(seed=2), (64, 5),
     "localized:1", "float32"),
    ("he_normal", lambda: I.HeNormal(seed=6), (90, 4), "distributed",
     "bfloat16"),
    ("he_uniform", lambda: I.HeUniform(seed=7), (33, 16), "distributed",
     "float16"),
    ("lecun_normal", lambda: I.LecunNormal(seed=8), (40, 6),
     "distributed", "float32"),
    ("lecun_uniform", lambda: I.LecunUniform(seed=9), (41, 6),
     "localized:0", "float32"),
    ("variance_scaling", lambda: I.VarianceScaling(
        2.0, "fan_avg", "untruncated_normal", seed=10), (59, 3),
     "distributed", "float32"),
    ("zeros", I.Zeros, (10, 3), "distributed", "float32"),
    ("ones", I.Ones, (10, 3), "distributed", "float32"),
    ("constant", lambda: I.Constant(0.25), (10, 3), "distributed",
     "float32"),
    # (Broadcast, not Keras' value * ones: the same values in every dtype.)
    ("constant_inexact", lambda: I.Constant(0.1), (9, 4), "distributed",
     "bfloat16"),
    ("constant_half", lambda: I.Constant(-1 / 3), (9, 4), "distributed",
     "float16"),
    ("constant_double", lambda: I.Constant(0.1), (9, 4), "localized:0",
     "float64"),
    ("constant_row", lambda: I.Constant([0.1, -2.5, 1 / 3]), (8, 3),
     "distributed", "float32"),
    ("identity", lambda: I.Identity(3.0), (11, 6), "distributed",
     "float32"),
    ("orthogonal", lambda: I.Orthogonal(seed=11), (30, 5), "distributed",
     "float32"),
    ("seed_generator", lambda: I.RandomNormal(
        seed=keras.random.SeedGenerator(12)), (25, 4), "distributed",
     "float32"),
    ("callable", lambda: _ramp, (23, 3), "distributed", "float32"),
    ("subclass", Scaled, (26, 3), "distributed", "float32"),
    ("one_row", lambda: I.GlorotUniform(seed=13), (1, 9), "distributed",
     "float32"),
]


def digest(table):
    return hashlib.sha256(np.ascontiguousarray(table).tobytes()).hexdigest()


def build(rank=0):
    """Builds the tables; small blocks, so that tables span many (the block
    size is restored afterwards: test_init_global.py calls this in the
    pytest process, whose later tables would otherwise be made in blocks of
    64 values, ~35 s of CPU for test_blocks_bound's 300,000 x 8 table)."""
    blocks = table_init._BLOCK_ELEMENTS
    table_init._BLOCK_ELEMENTS = 64
    try:
        return _build(rank)
    finally:
        table_init._BLOCK_ELEMENTS = blocks


def _build(rank):
    out = {}
    for name, factory, shape, mode, dtype in SPECS:
        if mode == "localized:1" and sok.num_ranks() < 2:
            mode = "localized:0"
        v = sok.Variable(factory(), shape=shape, mode=mode, dtype=dtype,
                         name=name)
        table = v.read_global()
        want = keras.ops.convert_to_numpy(factory()(shape=shape, dtype=dtype))
        out[name] = {"sha": digest(table),
                     "keras_equal": table.tobytes() == want.tobytes(),
                     "max_abs": float(np.max(np.abs(
                         table.astype(np.float64))))}
    # A layer's table, unseeded, with keras.utils.set_random_seed on every
    # rank: the one-rank table.
    keras.utils.set_random_seed(77)
    layer = sok.layers.DistributedEmbedding(
        500, 6, embeddings_initializer="glorot_uniform", name="layer")
    layer.build()
    out["layer_seeded"] = {"sha": digest(layer.embeddings.read_global())}
    # Unseeded, and each rank's Python random differs: each rank holds its
    # rows of its own draw of the global table (no communication while a
    # table is made).
    random.seed(1000 + rank)
    init = I.RandomUniform()
    v = sok.Variable(init, shape=(45, 5), name="unseeded")
    mine = keras.ops.convert_to_numpy(init(shape=(45, 5)))
    out["unseeded"] = {"seed": init.seed, "own_rows": bool(np.array_equal(
        keras.ops.convert_to_numpy(v.value), mine[v.local_ids()]))}
    v.read_global()  # the collectives of every case: same order
    return out
