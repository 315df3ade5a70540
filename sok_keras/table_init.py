"""Initial values of sharded tables that do not depend on the number of
ranks.

A table made from a Keras initializer is, on any number of ranks, the
table the initializer gives for the table's *global* shape: fans
(`glorot_*`, `he_*`, `lecun_*`, `VarianceScaling`) come from the global
shape, and row `i` holds the values it would hold in
`initializer(shape=(rows, dim))`, so the same seed gives bit-identical
global tables on 1, 2 or 3 ranks, in distributed and localized mode, and
the same table as a `keras.layers.Embedding` with that initializer.

How (see docs/design.md, "Initialization"):

- Random Keras initializers (`RandomUniform`, `RandomNormal`,
  `TruncatedNormal`, `VarianceScaling` and its `glorot_*` / `he_*` /
  `lecun_*` subclasses) draw from TensorFlow's stateless Philox generator,
  which is positional: output group `g` (4 values in 16/32 bits, 2 in
  float64) comes from counter `counter0 + g * skip`. A rank generates the
  global table in blocks of consecutive rows, each block starting the
  generator at the block's counter, and writes its own rows of the block
  into its shard in place: extra memory is one block (about 4 MB), never
  the table. Distributed shards take every N-th row, so each rank still
  draws the whole table once (on a GPU this is milliseconds; on a CPU about
  as long as a one-rank run); a localized table is drawn by its rank only.
- `Zeros`, `Ones`, `Constant` (scalar or one row) do not depend on the
  shape: the shard is filled directly. `Identity` is computed per row.
- Anything else (`Orthogonal`, `STFT`, a subclass that overrides
  `__call__`, a plain callable) is called once with the global shape on
  every rank that holds rows, which keeps rows taken from it only,
  and needs the whole table in memory (a warning says so above
  `_FALLBACK_WARN_BYTES`).

Seeds: each rank uses the seed Keras gives the initializer (an integer
seed as given; an unseeded Keras initializer draws one from Python's
`random` when it is made; a `SeedGenerator` advances once per table), and
no rank communicates while a table is made: a collective there would pair
with a different one on a rank that builds a different model, and hang
instead of letting the start-of-fit comparison name the difference
(`sok_keras.consistency`). So a seeded initializer, or
`keras.utils.set_random_seed(s)` on every rank (Keras' reproducibility
recipe), gives the one-rank table bit for bit; fully unseeded, each rank
takes its rows from its own draw of the global table (the right
distribution and fans, not reproducible, as in Keras).
"""

import logging
import math

import keras
import numpy as np
import tensorflow as tf

# Rows per block are chosen so that a block holds about this many values.
_BLOCK_ELEMENTS = 1 << 20
_FALLBACK_WARN_BYTES = 1 << 30
# TensorFlow's `alg` for AUTO_SELECT (Philox on CPU and GPU), what
# tf.random.stateless_* and so Keras use.
_AUTO_SELECT = 3
_INT32_MAX = 2**31 - 1
_LOG = logging.getLogger("sok_keras")


def _is_exactly(init, cls):
    """Whether `init` behaves as the Keras class `cls` (same `__call__`)."""
    return isinstance(init, cls) and type(init).__call__ is cls.__call__


def compute_fans(shape, input_axes=None, output_axes=None):
    """Keras' fans of a weight shape (`fan_in`, `fan_out`) for a 2-D table.

    Args:
        shape: the global `(rows, dim)`.
        input_axes: the axes counted in `fan_in`, or None.
        output_axes: the axes counted in `fan_out`, or None.

    Returns:
        `(fan_in, fan_out)` as ints.
    """
    shape = tuple(shape)
    if input_axes is not None and output_axes is not None:
        fan_in = int(np.prod([shape[a] for a in input_axes]))
        fan_out = int(np.prod([shape[a] for a in output_axes]))
        return fan_in, fan_out
    return int(shape[0]), int(shape[1])


def _distribution(init):
    """`(kind, params)` of a Keras random initializer, or None.

    kind is "uniform" (params: minval, maxval), "normal" or
    "truncated_normal" (params: mean, stddev), or "variance_scaling"
    (params: the initializer, resolved against the global shape later).
    """
    inits = keras.initializers
    if _is_exactly(init, inits.RandomUniform):
        return "uniform", (init.minval, init.maxval)
    if _is_exactly(init, inits.RandomNormal):
        return "normal", (init.mean, init.stddev)
    if _is_exactly(init, inits.TruncatedNormal):
        return "truncated_normal", (init.mean, init.stddev)
    if _is_exactly(init, inits.VarianceScaling):
        return "variance_scaling", (init,)
    return None


def _resolve_variance_scaling(init, global_shape):
    """What `VarianceScaling.__call__` draws for the global shape."""
    fan_in, fan_out = compute_fans(global_shape, init.input_axes,
                                   init.output_axes)
    scale = init.scale
    if init.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif init.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    if init.distribution == "truncated_normal":
        return "truncated_normal", (0.0, math.sqrt(scale) / .87962566103423978)
    if init.distribution == "untruncated_normal":
        return "normal", (0.0, math.sqrt(scale))
    limit = math.sqrt(3.0 * scale)
    return "uniform", (-limit, limit)


def _seed_pair(init):
    """Keras' seed pair for one call of `init` (a SeedGenerator advances)."""
    from keras.random import SeedGenerator

    seed = init.seed
    if isinstance(seed, SeedGenerator):
        return [int(s) for s in keras.ops.convert_to_numpy(seed.next())]
    return [int(seed), 0]


def _key_counter(pair):
    """Philox key and 128-bit counter of a Keras seed pair, as Keras' TF
    backend derives them (`floormod(seed, int32.max - 1)`)."""
    seed = tf.constant([p % (_INT32_MAX - 1) for p in pair], tf.int32)
    with tf.device("/CPU:0"):
        key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    c = [int(x) for x in counter.numpy().astype(np.uint64)]
    return key, c[0] | (c[1] << 64)


def _counter(base, skip):
    c = (base + skip) % (1 << 128)
    return tf.constant(
        np.array([c & (2**64 - 1), c >> 64], dtype=np.uint64))


def _group(kind, dtype):
    """(values per Philox group, counter steps per group) of TF's kernels
    (random_op_cpu.h / random_op_gpu.h)."""
    size = 2 if dtype == tf.float64 else 4
    if kind == "truncated_normal":
        # Variable samples per output: 256 samples reserved per value.
        return size, size * 256 // 4
    return size, 1


class _Blocks:
    """Generates rows `[i0, i1)` of the global table of one initializer."""

    def __init__(self, init, global_shape, dtype, name):
        self.rows, self.dim = global_shape
        self.dtype = tf.dtypes.as_dtype(dtype)
        self.name = name
        self.kind = None
        dist = _distribution(init)
        if dist is not None:
            kind, params = dist
            if kind == "variance_scaling":
                kind, params = _resolve_variance_scaling(init, global_shape)
            pair = _seed_pair(init)
            self.key, self.base = _key_counter(pair)
            self.kind, self.params = kind, params
            self.group, self.skip = _group(kind, self.dtype)
        elif _is_exactly(init, keras.initializers.Identity):
            self.kind, self.params = "identity", (init.gain,)
        # Rows per block: a multiple of 4, so every block starts on a
        # Philox group boundary.
        self.block_rows = max(4, (_BLOCK_ELEMENTS // max(1, self.dim))
                              // 4 * 4)

    @property
    def supported(self):
        return self.kind is not None

    def block(self, i0, i1):
        """The global rows `[i0, i1)` (`i0` a multiple of `block_rows`)."""
        shape = [i1 - i0, self.dim]
        if self.kind == "identity":
            ids = tf.range(i0, i1, dtype=tf.int64)
            (gain,) = self.params
            return gain * tf.one_hot(ids, self.dim, dtype=self.dtype)
        ops = {"uniform": tf.raw_ops.StatelessRandomUniformV2,
               "normal": tf.raw_ops.StatelessRandomNormalV2,
               "truncated_normal": tf.raw_ops.StatelessTruncatedNormalV2}
        start = i0 * self.dim
        counter = _counter(self.base, start // self.group * self.skip)
        rnd = ops[self.kind](shape=shape, key=self.key, counter=counter,
                             dtype=self.dtype, alg=_AUTO_SELECT)
        # The arithmetic of tf.random.stateless_* (what Keras calls).
        if self.kind == "uniform":
            lo, hi = (tf.cast(v, self.dtype) for v in self.params)
            return rnd * (hi - lo) + lo
        mean, stddev = (tf.convert_to_tensor(v, self.dtype)
                        for v in self.params)
        return rnd * stddev + mean


def _row_independent(init):
    """Whether `init` gives every row the same values (fill directly)."""
    inits = keras.initializers
    if _is_exactly(init, inits.Zeros) or _is_exactly(init, inits.Ones):
        return True
    return _is_exactly(init, inits.Constant) and np.ndim(init.value) <= 1


class TablePlan:
    """How one rank initializes its shard of a table from an initializer.

    Args:
        init: a Keras initializer instance or a callable `(shape, dtype)`.
        global_shape: the table's `(rows, dim)`.
        dtype: the table's dtype name.
        rows: the global ids of this rank's rows, in local order (an
            arithmetic progression: `rank::N`, all, or none).
        step: the step of `rows` (N for distributed shards, 1 otherwise).
        name: the table's name, for messages.

    `initial_value()` is what the variable is created with (the shard, or
    zeros when `fill` writes it afterwards); `fill(tf_variable)` writes the
    shard in place, block by block.
    """

    def __init__(self, init, global_shape, dtype, rows, step, name):
        self.init = init
        self.global_shape = tuple(int(s) for s in global_shape)
        self.dtype = keras.backend.standardize_dtype(dtype)
        self.first = int(rows[0]) if len(rows) else 0
        self.count = len(rows)
        self.step = step
        self.name = name
        self.local_shape = (self.count, self.global_shape[1])
        self._blocks = None
        if _row_independent(init):
            self.how = "direct"
        else:
            self._blocks = _Blocks(init, self.global_shape, self.dtype, name)
            self.how = "blocks" if self._blocks.supported else "global"

    def initial_value(self):
        if self.how == "direct":
            if _is_exactly(self.init, keras.initializers.Constant):
                # Keras' Constant multiplies by a tensor of ones: a
                # temporary the size of the shard (optimizer slots are
                # Constants). The same values, broadcast once.
                return tf.broadcast_to(
                    keras.ops.cast(self.init.value, self.dtype),
                    self.local_shape)
            return self.init(shape=self.local_shape, dtype=self.dtype)
        if self.how == "blocks" or self.count == 0:
            return tf.zeros(self.local_shape, self.dtype)
        return self._global_call()

    def _global_call(self):
        rows, dim = self.global_shape
        nbytes = rows * dim * np.dtype(
            "float32" if "bfloat" in self.dtype else self.dtype).itemsize
        if nbytes > _FALLBACK_WARN_BYTES:
            _LOG.warning(
                "sok_keras: table '%s': the initializer %s is called with "
                "the whole table's shape %s on every rank (%.1f GB); use "
                "a built-in Keras initializer (generated in blocks) or "
                "assign_global to avoid it.", self.name,
                type(self.init).__name__, self.global_shape, nbytes / 1e9)
        try:
            value = tf.convert_to_tensor(
                self.init(shape=self.global_shape, dtype=self.dtype))
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
            # (A `Constant` of another shape fails in its broadcast.)
            raise ValueError(
                f"sok_keras.Variable '{self.name}': the initializer "
                f"{self.init!r} failed for shape={self.global_shape}, "
                f"dtype={self.dtype}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}") from e
        if tuple(value.shape) != self.global_shape:
            raise ValueError(
                f"sok_keras.Variable '{self.name}': the initializer "
                f"{self.init!r} returned shape {tuple(value.shape)} for "
                f"shape={self.global_shape}.")
        value = tf.cast(value, self.dtype)
        end = self.first + self.step * self.count
        return value[self.first:end:self.step]

    def local_value(self, initial):
        """The whole shard as one tensor, from `initial_value()`'s result
        (for a variable that cannot be written in place yet)."""
        if self.how != "blocks" or self.count == 0:
            return initial
        pieces = list(self._pieces())
        return tf.concat([piece for _, piece in pieces], 0)

    def fill(self, variable):
        """Writes the shard into `variable` (a `tf.Variable`), in place."""
        if self.how != "blocks" or self.count == 0:
            return
        for l0, piece in self._pieces():
            # The raw op: `variable[a:b].assign` reads the variable first,
            # and the read makes the assignment copy the whole buffer.
            # int64 bounds: given as lists, a block from below local row
            # 2**31 to above it would have an int32 `begin` (the op's
            # index type) and an `end` that wraps, and write nothing.
            tf.raw_ops.ResourceStridedSliceAssign(
                ref=variable.handle,
                begin=tf.constant([l0, 0], tf.int64),
                end=tf.constant([l0 + int(piece.shape[0]),
                                 self.global_shape[1]], tf.int64),
                strides=tf.constant([1, 1], tf.int64), value=piece)

    def _pieces(self):
        """`(first local row, rows)` of this shard, block by block."""
        blocks, rows = self._blocks, self.global_shape[0]
        last = self.first + self.step * (self.count - 1)
        start = self.first // blocks.block_rows * blocks.block_rows
        for i0 in range(start, last + 1, blocks.block_rows):
            i1 = min(rows, i0 + blocks.block_rows)
            # This rank's first row in [i0, i1), and its local index.
            g0 = self.first + -(-(i0 - self.first) // self.step) * self.step
            g0 = max(g0, self.first)
            if g0 >= i1:
                continue
            piece = blocks.block(i0, i1)[g0 - i0::self.step]
            yield (g0 - self.first) // self.step, piece
