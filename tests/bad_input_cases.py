"""The matrix of bad inputs for every public lookup entry point.

Shared by `tests/test_bad_inputs.py` (one process, one pytest case per
cell) and `tests/workers/bad_inputs.py` (the whole matrix in one 2-rank
job). A cell is an entry point (`ENTRIES`) times an input (`INPUTS`); the
input says what must happen:

- `("raise", error types, words)`: that error, whose message contains
  every word (the layer or table, the value; `{rank}` stands for the rank
  that had the bad input); no shard changed.
- `("works", ref)`: no error and the output equals the NumPy reference
  `ref(kind, entry, bad)`; `("nan", ref)`: the same where the reference is
  NaN/Inf too (non-finite weights propagate, nothing else changes).

Every cell also checks that no shard changed (a checksum of every table
before and after) and that a good lookup of the same entry point right
after gives the right rows (`run_cell`, `check_cell`).

With several ranks a value error (an id, a split, ...) is given to one rank
only (`BAD_RANK`), the others get good ids: every rank must raise the same
error. Static errors (dtype, rank of the ids, structure) are given to every
rank, since they are properties of the program, not of the data.
"""

import hashlib

import numpy as np
import tensorflow as tf

import sok_keras as sok

V, D = 17, 3  # the table: V rows of width D
TABLE = (np.arange(V * D, dtype=np.float32).reshape(V, D) / 8.0)
V2, D2 = 9, 2  # a second (localized) table, for fused lookups
TABLE2 = np.arange(V2 * D2, dtype=np.float32).reshape(V2, D2) + 100.0
GOOD = [[1, 2], [3, -1]]
GOOD2 = [[0, 8], [4, -1]]  # the second table's ids in fused calls
BAD_RANK = 1


class World:
    """Every entry point's table or layer, built once per process."""

    def __init__(self):
        n = sok.num_ranks()
        self.rank, self.num_ranks = sok.rank(), n
        self.v = sok.Variable(TABLE, name="tbl")
        self.w = sok.Variable(TABLE2, name="other", mode=f"localized:{n - 1}")
        self.de = sok.layers.DistributedEmbedding(V, D, name="de")
        self.de_rows = sok.layers.DistributedEmbedding(
            V, D, combiner=None, name="de_rows")
        self.le = sok.layers.LocalizedEmbedding(V, D, rank=n - 1, name="le")
        self.a2a = sok.layers.All2AllDenseEmbedding(
            V, D, slot_num=2, nnz_per_slot=1, vocabulary_size=V, name="a2a")
        self.ec = sok.layers.EmbeddingCollection(
            tables={"t1": {"vocabulary_size": V, "embedding_dim": D},
                    "t2": {"vocabulary_size": V2, "embedding_dim": D2,
                           "mode": f"localized:{n - 1}"}},
            features={"f1": {"table": "t1"},
                      "f2": {"table": "t2", "combiner": "mean"}},
            name="ec")
        for layer in (self.de, self.de_rows, self.le):
            layer.build((None, 2))
            layer.embeddings.assign_global(TABLE)
        self.a2a.build((None, 2, 1))
        self.a2a.embeddings.assign_global(TABLE)
        self.ec.build(None)
        self.ec.embeddings["t1"].assign_global(TABLE)
        self.ec.embeddings["t2"].assign_global(TABLE2)

    def tables(self):
        return [self.v, self.w, self.de.embeddings, self.de_rows.embeddings,
                self.le.embeddings, self.a2a.embeddings,
                self.ec.embeddings["t1"], self.ec.embeddings["t2"]]

    def checksum(self):
        """A digest of this rank's shards of every table."""
        h = hashlib.sha1()
        for t in self.tables():
            h.update(np.ascontiguousarray(t.value.numpy()).tobytes())
        return h.hexdigest()


# -- entry points: (name, call(world, ids, weights), accepts weights,
#    names in messages, kind) --------------------------------------------
# kind "pooled": ids [batch, n] -> [batch, D]; "rows": one row per id;
# "a2a": ids [batch, 2, 1] -> [batch, 2, 1, D] (no padding).


def _fused(wd, ids, weights):
    outs = sok.lookup_sparse([wd.w, wd.v], [tf.constant(GOOD2), ids],
                             [None, weights], combiners="sum")
    return outs[1]


def _collection(wd, ids, weights):
    out = wd.ec({"f1": ids, "f2": tf.constant(GOOD2)},
                None if weights is None else {"f1": weights})
    return out["f1"]


ENTRIES = {
    "lookup_sparse": (
        lambda wd, ids, w: sok.lookup_sparse(wd.v, ids, w, combiners="sum"),
        "tbl", "pooled"),
    "lookup_sparse_mean_owner": (
        lambda wd, ids, w: sok.lookup_sparse(wd.v, ids, w, combiners="mean",
                                             pooling="owner"),
        "tbl", "pooled"),
    "lookup_sparse_fused": (_fused, "tbl", "pooled"),
    "all2all_dense_embedding": (
        lambda wd, ids, w: sok.all2all_dense_embedding(wd.v, ids),
        "tbl", "rows_nopad"),
    "DistributedEmbedding": (lambda wd, ids, w: wd.de(ids, w), "de",
                             "pooled"),
    "DistributedEmbedding_unpooled": (lambda wd, ids, w: wd.de_rows(ids, w),
                                      "de_rows", "rows"),
    "LocalizedEmbedding": (lambda wd, ids, w: wd.le(ids, w), "le", "pooled"),
    "All2AllDenseEmbedding": (lambda wd, ids, w: wd.a2a(ids), "a2a", "a2a"),
    "EmbeddingCollection": (_collection, "ec", "pooled"),
}


def reference(kind, ids, weights=None, combiner="sum"):
    """NumPy result of a good dense lookup (`-1` padding) of `TABLE`."""
    ids = np.asarray(ids)
    if kind in ("rows", "rows_nopad", "a2a"):
        rows = np.where((ids >= 0)[..., None], TABLE[np.maximum(ids, 0)], 0.0)
        if weights is not None:
            rows = rows * np.asarray(weights)[..., None]
        return rows
    ids = ids.reshape(ids.shape[0], -1)
    w = (np.ones(ids.shape, np.float64) if weights is None
         else np.asarray(weights, np.float64).reshape(ids.shape))
    w = np.where(ids >= 0, w, 0.0)
    summed = np.einsum("bn,bnd->bd", w, TABLE[np.maximum(ids, 0)])
    if combiner == "mean":
        summed = summed / np.maximum(w.sum(1, keepdims=True), 1e-30)
        summed[w.sum(1) == 0] = 0.0
    return summed


# -- inputs -----------------------------------------------------------------
# Each input: make(kind, bad) -> (ids, weights), its expectation, and
# whether a multi-rank run gives it to every rank (True) or to BAD_RANK only
# (False; `bad` is False on the other ranks, which get good ids).
# An expectation is ("raise", types, words), ("works", ref(kind, entry,
# bad)) or ("nan", ref(kind, entry, bad)): rows whose reference is NaN are
# NaN, the others equal it.

IAE = tf.errors.InvalidArgumentError
ID_WORDS = ["{name}", "rank {rank}"]  # with several ranks


def _good(kind):
    if kind == "a2a":
        return tf.constant([[[1], [2]], [[3], [4]]], tf.int64)
    if kind == "rows_nopad":
        return tf.constant([[1, 2], [3, 4]], tf.int64)
    return tf.constant(GOOD, tf.int64)


def _combiner(entry):
    return "mean" if "mean" in entry else "sum"


def good_reference(kind, entry, bad=True):
    return reference(kind, _good(kind).numpy(), combiner=_combiner(entry))


def _with_id(kind, bad, value, dtype=tf.int64):
    """The good ids with one replaced by `value` (on the bad rank)."""
    ids = _good(kind).numpy().astype(np.int64)
    if bad:
        ids.reshape(-1)[1] = value
    return tf.constant(ids, dtype), None


def _bad_id(value, dtype=tf.int64, words=()):
    return (lambda kind, bad: _with_id(kind, bad, value, dtype),
            ("raise", (IAE,), ["{name}", str(value), "(-1 is padding)",
                               *words]), False)


def _float_ids(value):
    """float32 ids, the good ones with one replaced by `value` (on the bad
    rank): no integer, so refused by every entry point (the layers, which
    take float32 ids of whole numbers, name the layer and the value on one
    rank; on several, every rank raises the exchange's error)."""
    def make(kind, bad):
        ids = _good(kind).numpy().astype(np.float32)
        if bad:
            ids.reshape(-1)[1] = value
        return tf.constant(ids), None
    return (make, ("raise", (TypeError,), ["{name}", "float32"]), False)


def _ragged_2d_values(dtype):
    """Ragged ids `[2, None, 2]`: ragged_rank 1 over a matrix of ids."""
    return (lambda kind, bad: (tf.RaggedTensor.from_row_splits(
                tf.constant([[1, 2], [3, 4], [5, 6]], dtype), [0, 2, 3]),
                None),
            ("raise", (ValueError,), ["{name}", "2-D [batch, None]",
                                      "shape (2, None, 2)"]), True)


def _empty(kind, bad):
    shape = {"a2a": [0, 2, 1], "rows": [0, 2], "rows_nopad": [0, 2]}
    return tf.zeros(shape.get(kind, [0, 2]), tf.int64), None


def _empty_reference(kind, entry, bad=True):
    shape = {"a2a": [0, 2, 1, D], "rows": [0, 2, D], "rows_nopad": [0, 2, D]}
    return np.zeros(shape.get(kind, [0, D]), np.float32)


PADDING = [[-1, -1], [-1, -1]]

INPUTS = {
    # ids out of range (the table has 17 rows) and negative ids.
    "id_out_of_range": _bad_id(40),
    "id_negative": _bad_id(-2),
    # The position named is the id's in the flat input, padding included
    # (QA: the paths that dedup named it among the ids left without it).
    "id_out_of_range_after_padding": (
        lambda kind, bad: (tf.constant(
            [[1, -1], [40 if bad else 3, 2]], tf.int64), None),
        ("raise", (IAE,), ["{name}", "40", "position 2"]), False),
    # int32 overflow: 2^32 + 1 must not wrap to row 1, nor 2^31 - 1 to -1.
    "id_int64_above_2_32": _bad_id(2 ** 32 + 1),
    "id_int32_max": _bad_id(2 ** 31 - 1, tf.int32),
    # (also what the layers make of a float id that is no integer: the
    # message says it may be either)
    "id_int64_min": _bad_id(-2 ** 63, words=["int64's minimum"]),
    # -1 where no id is padding (the entry points that take no padding).
    "id_minus_one_without_padding": _bad_id(-1),
    # wrong dtype
    "ids_float": (
        lambda kind, bad: (tf.cast(_good(kind), tf.float32), None),
        ("raise", (TypeError,), ["{name}", "float32"]), True),
    # float32 ids that are no integer: Keras' Embedding would truncate
    # them (1.5 to row 1, -0.5 to row 0) and cast nan to some row.
    "ids_float_fraction": _float_ids(1.5),
    "ids_float_negative_fraction": _float_ids(-0.5),
    "ids_float_nan": _float_ids(np.nan),
    "ids_float_inf": _float_ids(np.inf),
    "ids_float_beyond_int64": _float_ids(1e30),
    # float16 holds ids exactly only up to 2048: refused by every entry
    # point (float32 ids: the layers take them, `expectation`).
    "ids_float16": (
        lambda kind, bad: (tf.cast(_good(kind), tf.float16), None),
        ("raise", (TypeError,), ["{name}", "float16"]), True),
    "ids_string": (
        lambda kind, bad: (tf.strings.as_string(_good(kind)), None),
        ("raise", (TypeError,), ["{name}", "string"]), True),
    # uint64 ids from 2**63 on have no int64 value (2**64 - 1 became -1,
    # the padding, silently): refused by dtype.
    "ids_uint64": (
        lambda kind, bad: (tf.cast(tf.maximum(_good(kind), 0), tf.uint64),
                           None),
        ("raise", (TypeError,), ["{name}", "uint64"]), True),
    "ids_int8": (
        lambda kind, bad: (tf.cast(_good(kind), tf.int8), None),
        ("works", good_reference), True),
    "ids_uint8_int16": (
        lambda kind, bad: (tf.cast(tf.maximum(_good(kind), 0),
                                   tf.uint8 if bad else tf.int16), None),
        ("works", lambda kind, entry, bad=True: reference(
            kind, np.maximum(_good(kind).numpy(), 0),
            combiner=_combiner(entry))), False),
    # wrong rank of the ids
    "ids_scalar": (
        lambda kind, bad: (tf.constant(3, tf.int64), None),
        ("raise", (ValueError,), ["{name}", "shape"]), True),
    "ids_3d": (
        lambda kind, bad: (tf.zeros([2, 2, 2], tf.int64), None),
        ("raise", (ValueError,), ["{name}", "shape"]), True),
    # empty batches and padding only: must work.
    "empty_batch": (_empty, ("works", _empty_reference), True),
    "empty_batch_one_rank": (
        lambda kind, bad: _empty(kind, bad) if bad else (_good(kind), None),
        ("works", lambda kind, entry, bad=True: (
            _empty_reference(kind, entry) if bad
            else good_reference(kind, entry))), False),
    "padding_only": (
        lambda kind, bad: (tf.constant(PADDING if bad else GOOD, tf.int64),
                           None),
        ("works", lambda kind, entry, bad=True: reference(
            kind, PADDING if bad else GOOD, combiner=_combiner(entry))),
        False),
    # ragged / sparse structure
    "ragged_ids_ragged_rank_2": (
        lambda kind, bad: (tf.ragged.constant([[[1], [2]], [[3]]], tf.int64),
                           None),
        ("raise", (ValueError,), ["{name}", "ragged_rank"]), True),
    # ragged_rank 1 over 2-D values: [batch, None, 2] (not a low-level
    # op's shape error); also in float32, which the Keras layers take
    "ragged_ids_2d_values": _ragged_2d_values(tf.int64),
    "ragged_float_ids_2d_values": _ragged_2d_values(tf.float32),
    "sparse_ids_3d": (
        lambda kind, bad: (tf.SparseTensor(
            [[0, 0, 0]], tf.constant([1], tf.int64), [2, 2, 2]), None),
        ("raise", (ValueError,), ["{name}", "2-D"]), True),
    "sparse_index_outside_dense_shape": (
        lambda kind, bad: (tf.SparseTensor(
            [[0, 0], [5 if bad else 1, 0]], tf.constant([1, 2], tf.int64),
            [2, 2]), None),
        ("raise", (IAE,), ["{name}", "dense_shape"]), False),
    # (QA: splits made with validate=False were taken as they were on the
    # paths that dedup first, and ids pooled into the wrong samples)
    "ragged_splits_inconsistent": (
        lambda kind, bad: (tf.RaggedTensor.from_row_splits(
            tf.constant([1, 2, 3], tf.int64),
            tf.constant([0, 4, 3] if bad else [0, 2, 3], tf.int64),
            validate=False), None),
        ("raise", (IAE,), ["{name}", "row_splits are inconsistent"]), False),
    "empty_ragged_batch": (
        lambda kind, bad: (tf.RaggedTensor.from_row_splits(
            tf.zeros([0], tf.int64), tf.zeros([1], tf.int64)), None),
        ("works", lambda kind, entry, bad=True: np.zeros([0, D],
                                                         np.float32)), True),
    # weights that do not match the ids, and non-finite weights
    "ragged_weights_other_splits": (
        lambda kind, bad: (
            tf.ragged.constant([[1, 2], [3]], tf.int64),
            tf.ragged.constant([[1.0], [2.0, 3.0]] if bad
                               else [[1.0, 2.0], [3.0]])),
        ("raise", (IAE,), ["{name}", "row splits"]), False),
    "dense_weights_other_shape": (
        lambda kind, bad: (tf.constant(GOOD, tf.int64), tf.ones(
            [2, 3] if bad else [2, 2])),
        # (one rank: the static shapes differ, a ValueError at call time)
        ("raise", (IAE, ValueError), ["{name}", "weights"]), False),
    "sparse_weights_other_indices": (
        lambda kind, bad: (
            tf.SparseTensor([[0, 0], [0, 1], [1, 0]],
                            tf.constant([1, 2, 3], tf.int64), [2, 2]),
            tf.SparseTensor([[0, 0], [0, 1]] if bad
                            else [[0, 0], [0, 1], [1, 0]],
                            tf.ones([2 if bad else 3]), [2, 2])),
        ("raise", (IAE,), ["{name}", "weights"]), False),
    "weights_string": (
        lambda kind, bad: (tf.constant(GOOD, tf.int64),
                           tf.constant([["a", "b"], ["c", "d"]])),
        ("raise", (TypeError,), ["{name}", "string"]), True),
    "weights_float64_for_float32_table": (
        lambda kind, bad: (tf.constant(GOOD, tf.int64),
                           tf.constant([[0.5, 2.0], [3.0, 9.0]], tf.float64)),
        ("works", lambda kind, entry, bad=True: reference(
            kind, GOOD, [[0.5, 2.0], [3.0, 9.0]], combiner=_combiner(entry))),
        True),
    "weights_nan_inf": (
        lambda kind, bad: (tf.constant(GOOD, tf.int64), tf.constant(
            [[1.0, np.nan], [np.inf, 1.0]] if bad else [[1.0, 1.0],
                                                      [1.0, 1.0]])),
        ("nan", lambda kind, entry, bad=True: reference(
            kind, GOOD, [[1.0, np.nan], [np.inf, 1.0]] if bad
            else [[1.0, 1.0], [1.0, 1.0]], combiner=_combiner(entry))),
        False),
}

_NO_INTEGER = {"ids_float_fraction", "ids_float_negative_fraction",
               "ids_float_nan", "ids_float_inf", "ids_float_beyond_int64"}

# Inputs made of padded, ragged or sparse ids, or weights: not for the
# entry points that take dense ids without padding or weights.
_PADDED_ONLY = {
    "padding_only", "ragged_ids_ragged_rank_2", "ragged_ids_2d_values",
    "ragged_float_ids_2d_values",
    "sparse_ids_3d",
    "sparse_index_outside_dense_shape", "empty_ragged_batch",
    "ragged_splits_inconsistent", "id_out_of_range_after_padding",
    "ragged_weights_other_splits", "dense_weights_other_shape",
    "sparse_weights_other_indices", "weights_string",
    "weights_float64_for_float32_table", "weights_nan_inf",
}
# Pooled outputs only (an unpooled ragged output has another structure).
_POOLED_ONLY = {"empty_ragged_batch"}
# The entry points that take no padding, and the inputs only for them.
_NO_PADDING = ("rows_nopad", "a2a")
_NO_PADDING_ONLY = {"id_minus_one_without_padding"}


# The Keras layers, which take float32 ids as `keras.layers.Embedding` does
# (Keras makes inputs float32 unless told otherwise) where the table's rows
# are at most 2**24; the lookup functions, as TensorFlow's, refuse them.
LAYERS = ("DistributedEmbedding", "DistributedEmbedding_unpooled",
          "LocalizedEmbedding", "All2AllDenseEmbedding",
          "EmbeddingCollection")


def expectation(input_name, entry):
    """The expectation of a cell, with the entry point's own rules."""
    kind = ENTRIES[entry][2]
    exp = INPUTS[input_name][1]
    if input_name == "ids_float" and entry in LAYERS:
        return ("works", lambda kind, entry, bad=True: reference(
            kind, _good(kind).numpy()))
    if input_name in _NO_INTEGER and entry in LAYERS:
        return ("raise", (IAE,), ["{name}", "no integer"])
    if input_name == "ragged_float_ids_2d_values" and entry not in LAYERS:
        return INPUTS["ids_float"][1]  # the functions refuse float ids
    if kind in _NO_PADDING and exp[0] == "raise" and "(-1 is padding)" in (
            exp[2]):
        # Where -1 is no padding the message must not call it padding
        # (the 4th entry: words the message must not hold).
        return ("raise", exp[1], [w for w in exp[2] if w != "(-1 is padding)"]
                + ["out of range [0, "], ["padding"])
    if kind == "rows_nopad" and input_name in ("ids_scalar", "ids_3d"):
        # all2all_dense_embedding takes ids of any shape.
        return ("works", lambda kind, entry, bad=True: reference(
            kind, np.zeros([2, 2, 2], np.int64)
            if input_name == "ids_3d" else np.array(3)))
    if kind == "rows" and input_name == "ids_3d":
        # An unpooled layer takes ids of any rank >= 1, as
        # keras.layers.Embedding does.
        return ("works", lambda kind, entry, bad=True: reference(
            kind, np.zeros([2, 2, 2], np.int64)))
    return exp


# In the 2-rank job (CI time), these inputs also run in a tf.function:
# the errors found at run time on one rank (static ones are raised in
# Python on every rank, eagerly or while tracing alike) and the inputs that
# must work. The 1-rank test runs every cell in both modes.
FUNCTION_ON_SEVERAL_RANKS = (
    "id_out_of_range", "id_int64_above_2_32", "empty_batch_one_rank",
    "ids_float_fraction",
    "padding_only", "sparse_index_outside_dense_shape",
    "ragged_weights_other_splits", "dense_weights_other_shape",
    "sparse_weights_other_indices", "weights_nan_inf",
)


def multirank_modes(input_name):
    if input_name in FUNCTION_ON_SEVERAL_RANKS:
        return ("eager", "function")
    return ("eager",)


def cells():
    """Every `(input, entry)` pair of the matrix."""
    out = []
    for i in INPUTS:
        for e, (_, _, kind) in ENTRIES.items():
            if i in _PADDED_ONLY and kind in _NO_PADDING:
                continue
            if i in _NO_PADDING_ONLY and kind not in _NO_PADDING:
                continue
            if i in _POOLED_ONLY and kind != "pooled":
                continue
            out.append((i, e))
    return out


def _to_numpy(out):
    if isinstance(out, tf.RaggedTensor):
        out = out.to_tensor()
    return np.asarray(out.numpy() if hasattr(out, "numpy") else out)


def run_cell(wd, input_name, entry, mode, bad, autograph=True):
    """Runs one cell; returns what happened as a JSON-able dict.

    Args:
        wd: the `World`.
        input_name, entry: the cell.
        mode: `"eager"` or `"function"`.
        bad: whether this rank gets the bad input (see INPUTS).
        autograph: in mode `"function"`, whether the `tf.function`
            converts the code with AutoGraph (the 1-rank matrix, whose
            errors raised while tracing pass through AutoGraph's error
            rewriting, does; the multi-rank job, whose function cells are
            errors at run time and inputs that work, need not).

    Returns:
        `{"error": type name or None, "message": str, "output": list or
        None, "changed": bool, "after_ok": bool}`; `after_ok` says whether
        a good lookup of the same entry point right after gives the right
        rows (the ranks are still in step).
    """
    call, _, kind = ENTRIES[entry]
    make = INPUTS[input_name][0]
    before = wd.checksum()
    result = {"error": None, "message": "", "output": None}
    try:
        ids, weights = make(kind, bad)
        fn = (lambda i, w: call(wd, i, w))
        if mode == "function":
            fn = tf.function(fn, autograph=autograph)
        out = _to_numpy(fn(ids, weights))
        result["output"] = out.tolist()
        result["shape"] = list(out.shape)
    except Exception as e:  # noqa: BLE001 - the matrix records every error
        result["error"] = type(e).__name__
        result["message"] = str(e)
    result["changed"] = wd.checksum() != before
    after = _to_numpy(call(wd, _good(kind), None))
    result["after_ok"] = bool(np.allclose(
        after, reference(kind, _good(kind).numpy(),
                         combiner=_combiner(entry)), atol=1e-5))
    return result


def check_cell(result, input_name, entry, rank, num_ranks, bad_rank):
    """What is wrong with `result` (from `run_cell` on `rank`), as a list of
    strings (empty: the cell behaved as it must)."""
    _, name, kind = ENTRIES[entry]
    exp = expectation(input_name, entry)
    every = INPUTS[input_name][2]
    bad = every or rank == bad_rank or num_ranks == 1
    wrong = []
    if result["changed"]:
        wrong.append("a shard changed")
    if not result["after_ok"]:
        wrong.append("a good lookup afterwards gave wrong rows")
    if exp[0] == "raise":
        types = [t.__name__ for t in exp[1]]
        if result["error"] not in types:
            wrong.append(f"expected {types}, got {result['error']}: "
                         f"{result['message'][:300]} {result['output']}")
            return wrong
        words = [w.format(name=name, rank=bad_rank) for w in exp[2]]
        if num_ranks > 1 and not every and IAE in exp[1]:
            # A value error found at run time names the rank that had it
            # (a dtype error, raised on every rank while tracing, does not).
            words += [w.format(name=name, rank=bad_rank) for w in ID_WORDS]
        missing = [w for w in words if w not in result["message"]]
        if missing:
            wrong.append(f"message lacks {missing}: {result['message']}")
        unwanted = [w for w in (exp[3] if len(exp) > 3 else ())
                    if w in result["message"]]
        if unwanted:
            wrong.append(f"message holds {unwanted}: {result['message']}")
        return wrong
    if result["error"] is not None:
        wrong.append(f"raised {result['error']}: {result['message'][:400]}")
        return wrong
    want = np.asarray(exp[1](kind, entry, bad), np.float64)
    got = np.asarray(result["output"], np.float64).reshape(result["shape"])
    if got.shape != want.shape:
        wrong.append(f"shape {got.shape}, expected {want.shape}")
    elif exp[0] == "nan":
        if not np.array_equal(np.isnan(got), np.isnan(want)) or not (
                np.allclose(np.nan_to_num(got), np.nan_to_num(want))):
            wrong.append(f"got {got.tolist()}, expected {want.tolist()}")
    elif not np.allclose(got, want, atol=1e-5):
        wrong.append(f"got {got.tolist()}, expected {want.tolist()}")
    return wrong
