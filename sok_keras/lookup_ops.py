"""Python wrappers of the compiled embedding-lookup ops.

The lookup of a sharded table runs in three steps:

1. `dedup_bucketize` deduplicates the ids of a batch and groups the distinct
   ids by the rank that owns them (and reports invalid ids).
2. In the multi-rank path, every rank gathers the `counts` and `error` of all
   ranks and calls `check_exchange`, so that every rank raises the same
   error for an invalid id instead of one rank raising and the others
   hanging in a collective.
3. `segment_combine` pools the looked-up unique rows per batch row. Its
   gradient with respect to the rows is reduced per unique row (by
   `SokSegmentCombineGrad`) before it is sent anywhere.
"""

import tensorflow as tf

from sok_keras._ops import ops
from sok_keras._ops import register_gradient_once

_COMBINERS = ("sum", "mean", "sqrtn")


def dedup_bucketize(
    ids, num_ranks, vocab_size, owner=-1, table_name="", raise_on_error=True,
    padding=True, positions=None,
):
    """Deduplicates ids and groups the distinct ids by owner rank.

    With `owner=-1` the table is distributed: id `i` lives on rank
    `i % num_ranks` at local row `i // num_ranks`. With `owner >= 0` the whole
    table lives on rank `owner`, and id `i` at local row `i`.

    Args:
        ids: int32 or int64 tensor of shape `[nnz]`, the ids to look up, with
            padding already removed.
        num_ranks: int >= 1, the number of ranks the table is sharded over.
        vocab_size: int >= 0, the number of rows of the whole table. Ids must
            be in `[0, vocab_size)`.
        owner: -1 for a distributed table, else the rank holding the table
            (must be less than `num_ranks`).
        table_name: the table's name, used in error messages.
        raise_on_error: if True, an invalid id raises
            `tf.errors.InvalidArgumentError`. If False, the op does not fail:
            it returns no unique ids, a zero `inverse` and zero `counts`, and
            reports the first invalid id in `error`, so that the caller can
            raise collectively (see `check_exchange`).
        padding: whether the caller's ids take `-1` as padding (removed
            before this op); only the error message says so.
        positions: optional int64 `[nnz]`, each id's position in the
            caller's input (padding included): an invalid id's error (and
            `error`) names it; by default its position in `ids`.

    Returns:
        A namedtuple `(unique_ids, local_rows, inverse, counts, error)`:
        `unique_ids` (int64 `[U]`) the distinct ids, grouped by owner rank in
        ascending rank order and ascending within a rank; `local_rows` (int64
        `[U]`) the row of each unique id on its owner; `inverse` (int32
        `[nnz]`) with `unique_ids[inverse[i]] == ids[i]`; `counts` (int64
        `[num_ranks]`) the number of unique ids per owner rank; `error` (int64
        `[2]`) the position and value of the first invalid id, or `(-1, 0)`.
    """
    ids = tf.convert_to_tensor(ids)
    if not ids.dtype.is_integer:
        raise TypeError(f"ids must be an integer tensor, got {ids.dtype.name}.")
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int64)
    positions = ([] if positions is None
                 else [tf.cast(positions, tf.int64)])
    return ops().sok_dedup_bucketize(
        ids=ids,
        positions=positions,
        num_ranks=int(num_ranks),
        owner=int(owner),
        vocab_size=int(vocab_size),
        table_name=str(table_name),
        raise_on_error=bool(raise_on_error),
        padding=bool(padding),
    )


def check_exchange(gathered, vocab_size, table_name, padding=True):
    """Checks the per-rank lookup summaries gathered from every rank.

    Args:
        gathered: int64 tensor of shape `[num_ranks, num_ranks + 2]`; row `r`
            is rank `r`'s `concat([counts, error])` from `dedup_bucketize`.
        vocab_size: the number of rows of the whole table (for messages).
        table_name: the table's name (for messages).
        padding: whether the caller's ids take `-1` as padding (for
            messages).

    Returns:
        int64 tensor `[num_ranks, num_ranks]`: row `r` holds how many unique
        ids rank `r` sends to each rank.

    Raises:
        tf.errors.InvalidArgumentError: if any rank saw an invalid id; the
            message names the table, the first such rank, the id and its
            position.
    """
    gathered = tf.cast(tf.convert_to_tensor(gathered), tf.int64)
    return ops().sok_check_exchange(
        gathered=gathered, table_name=str(table_name),
        vocab_size=int(vocab_size), padding=bool(padding),
    )


def segment_combine(
    rows, inverse, segment_ids, weights=None, num_segments=None, combiner="sum"
):
    """Pools looked-up rows per segment (the forward of a sparse lookup).

    For each segment `b`, over the positions `i` with `segment_ids[i] == b`:
    `sum` gives `sum_i w_i * rows[inverse[i]]`, `mean` divides that by
    `sum_i w_i`, and `sqrtn` divides it by `sqrt(sum_i w_i**2)`. A zero
    denominator gives zeros, and so do empty segments. This matches
    `tf.nn.embedding_lookup_sparse`.

    The gradient with respect to `rows` is computed by
    `SokSegmentCombineGrad` and reduced per unique row; the gradient with
    respect to `weights` is `tf.nn.embedding_lookup_sparse`'s (through the
    numerator and, for `mean` and `sqrtn`, the denominator;
    `weights_gradient`). The integer inputs have none.

    Args:
        rows: float16, bfloat16, float32 or float64 tensor `[U, D]`, the
            unique rows. For float16/bfloat16 the pooling runs in float32
            and each output element is rounded once (to nearest even).
        inverse: int32 tensor `[nnz]`, the row of each position.
        segment_ids: int32 or int64 tensor `[nnz]`, the output row of each
            position, in any order.
        weights: tensor `[nnz]` of the dtype of `rows`, or None (or an empty
            tensor) for all-one weights.
        num_segments: the number of output rows (the batch size), a Python
            int or an integer scalar tensor.
        combiner: one of `"sum"`, `"mean"` or `"sqrtn"`.

    Returns:
        A tensor `[num_segments, D]` of the dtype of `rows`.
    """
    if combiner not in _COMBINERS:
        raise ValueError(
            f"combiner must be one of {_COMBINERS}, got {combiner!r}."
        )
    if num_segments is None:
        raise ValueError("segment_combine needs num_segments (the batch size).")
    rows = tf.convert_to_tensor(rows)
    inverse = tf.cast(inverse, tf.int32)
    segment_ids = tf.convert_to_tensor(segment_ids)
    if segment_ids.dtype not in (tf.int32, tf.int64):
        segment_ids = tf.cast(segment_ids, tf.int64)
    if weights is None:
        weights = tf.zeros([0], dtype=rows.dtype)
    else:
        weights = tf.cast(weights, rows.dtype)
    num_segments = tf.cast(num_segments, tf.int64)
    return ops().sok_segment_combine(
        rows=rows,
        inverse=inverse,
        segment_ids=segment_ids,
        weights=weights,
        num_segments=num_segments,
        combiner=combiner,
    )


def weights_gradient(rows_per_id, dy, out, segment_ids, weights,
                     num_segments, combiner):
    """The gradient of a weighted pooling with respect to its weights.

    With `r_i` the row of position `i`, `b = segment_ids[i]`, `g = dy[b]`
    and `y = out[b]`: `sum` gives `<r_i, g>`; `mean` (`y = sum w r / S`,
    `S = sum w`) gives `<r_i - y, g> / S`; `sqrtn` (`y = sum w r / sqrt(Q)`,
    `Q = sum w**2`) gives `<r_i, g> / sqrt(Q) - w_i <y, g> / Q`. A zero
    denominator (whose output is zeros) gives zeros. Computed in float32
    (float64 for float64 rows), returned in the weights' dtype.

    Args:
        rows_per_id: `[nnz, D]`, the row of every position (zeros where a
            position does not count, e.g. padding).
        dy: `[B, D]`, the gradient of the pooled output.
        out: `[B, D]`, the pooled output.
        segment_ids: `[nnz]`, each position's output row.
        weights: `[nnz]`, the weights (zero where a position does not
            count).
        num_segments: `B`.
        combiner: `"sum"`, `"mean"` or `"sqrtn"`.

    Returns:
        `[nnz]` in the dtype of `weights`.
    """
    compute = tf.float64 if rows_per_id.dtype == tf.float64 else tf.float32
    g = tf.cast(dy, compute)
    dot = tf.reduce_sum(tf.cast(rows_per_id, compute) *
                        tf.gather(g, segment_ids), 1)
    if combiner == "sum":
        return tf.cast(dot, weights.dtype)
    w = tf.cast(weights, compute)
    y_dot_g = tf.gather(tf.reduce_sum(tf.cast(out, compute) * g, 1),
                        segment_ids)
    if combiner == "mean":
        s = tf.gather(tf.math.unsorted_segment_sum(w, segment_ids,
                                                   num_segments), segment_ids)
        dw = tf.math.divide_no_nan(dot - y_dot_g, s)
    else:
        q = tf.gather(tf.math.unsorted_segment_sum(w * w, segment_ids,
                                                   num_segments), segment_ids)
        dw = (tf.math.divide_no_nan(dot, tf.sqrt(q))
              - tf.math.divide_no_nan(w * y_dot_g, q))
    return tf.cast(dw, weights.dtype)


def weights_gradient_of(op, index, weights, compute):
    """A gradient function's gradient for its weights input `index`:
    `compute()`; None where the tape says the input needs none
    (`skip_input_indices`, eagerly); zeros for an empty weights vector
    (unweighted, or the weights of no id). Not None there: the weights of
    no id may come from an exchange (a rank that owns no requested row
    receives none), whose reverse every rank must run (QA: eagerly, on 2
    ranks, such a rank skipped it, its weights' gradient lost a term or
    was None, and the other rank waited in the exchange)."""
    if index in (getattr(op, "skip_input_indices", None) or ()):
        return None
    if weights.shape.rank == 1 and weights.shape[0] == 0:
        return tf.zeros_like(weights)
    return compute()


@register_gradient_once("SokSegmentCombine")
def _segment_combine_grad(op, grad):
    """Gradient of SokSegmentCombine with respect to `rows` (reduced per
    unique row, `SokSegmentCombineGrad`) and `weights`."""
    rows, inverse, segment_ids, weights, num_segments = op.inputs
    num_unique = tf.shape(rows, out_type=tf.int64)[0]
    combiner = op.get_attr("combiner")
    if isinstance(combiner, bytes):
        combiner = combiner.decode()
    rows_grad = ops().sok_segment_combine_grad(
        grad=grad,
        inverse=inverse,
        segment_ids=segment_ids,
        weights=weights,
        num_unique=num_unique,
        combiner=combiner,
    )
    weights_grad = weights_gradient_of(op, 3, weights, lambda: (
        weights_gradient(tf.gather(rows, inverse), grad, op.outputs[0],
                         segment_ids, weights, num_segments, combiner)))
    return [rows_grad, None, None, weights_grad, None]


def gather_blocks(values, starts, lengths, site=""):
    """Concatenates consecutive blocks of rows (`SokGatherBlocks`).

    `concat([values[s:s + l] for s, l in zip(starts, lengths)])` as one
    compiled op: the packing and unpacking of the fused exchange's buckets.
    `starts` and `lengths` are small (one entry per rank and table) and live
    in host memory; on a GPU the rows move with device-to-device copies.
    Differentiable with respect to `values` (the gradient is
    `scatter_blocks`, which needs disjoint blocks).

    Args:
        values: a tensor `[n, ...]` of any plain-old-data dtype.
        starts: int `[m]`, the first row of each block.
        lengths: int `[m]`, the rows of each block (`>= 0`, and
            `starts[i] + lengths[i] <= n`).
        site: a name for error messages.

    Returns:
        A tensor `[sum(lengths), ...]`.

    Raises:
        tf.errors.InvalidArgumentError: if a block is out of range (the
            message names it).

    Example:

    >>> gather_blocks(tf.range(10), [6, 1], [2, 3]).numpy().tolist()
    [6, 7, 1, 2, 3]
    """
    return ops().sok_gather_blocks(
        values=values, starts=tf.cast(starts, tf.int64),
        lengths=tf.cast(lengths, tf.int64), site=str(site))


def scatter_blocks(grad, starts, lengths, num_rows, site=""):
    """Writes blocks of rows back into zeros (`SokScatterBlocks`).

    The inverse layout of `gather_blocks`: `out[starts[i] + p]` is row
    `sum(lengths[:i]) + p` of `grad`, every other row of `out` is zero.
    It is `gather_blocks`' gradient.

    Args:
        grad: a tensor `[sum(lengths), ...]`.
        starts: int `[m]`, where each block goes.
        lengths: int `[m]`, the rows of each block; the blocks must be
            disjoint.
        num_rows: the rows of the result (an int or int scalar tensor).
        site: a name for error messages.

    Returns:
        A tensor `[num_rows, ...]` of the dtype of `grad`.

    Raises:
        tf.errors.InvalidArgumentError: if a block is out of range, two
            blocks overlap or `grad` does not have `sum(lengths)` rows.
    """
    return ops().sok_scatter_blocks(
        grad=grad, starts=tf.cast(starts, tf.int64),
        lengths=tf.cast(lengths, tf.int64),
        num_rows=tf.cast(num_rows, tf.int64), site=str(site))


@register_gradient_once("SokGatherBlocks")
def _gather_blocks_grad(op, grad):
    values, starts, lengths = op.inputs
    site = op.get_attr("site")
    if isinstance(site, bytes):
        site = site.decode()
    num_rows = tf.shape(values, out_type=tf.int64)[0]
    return [scatter_blocks(grad, starts, lengths, num_rows, site), None, None]


@register_gradient_once("SokScatterBlocks")
def _scatter_blocks_grad(op, grad):
    _, starts, lengths, _ = op.inputs
    site = op.get_attr("site")
    if isinstance(site, bytes):
        site = site.decode()
    return [gather_blocks(grad, starts, lengths, site), None, None, None]


def _no_gradient(op_type):
    try:
        tf.no_gradient(op_type)
    except (KeyError, LookupError):
        pass  # registered by an earlier import of this module


_no_gradient("SokDedupBucketize")
_no_gradient("SokCheckExchange")


def _no_second_order(op, *grads):
    """The gradient of the ops that make a table's gradient: refused, not
    zero (QA: `tf.no_gradient` made a penalty on d loss / d table silently
    lose its term, and an op without one raised a bare LookupError)."""
    name = ""
    try:
        name = op.get_attr("table_name")
        name = name.decode() if isinstance(name, bytes) else name
    except (ValueError, tf.errors.OpError):
        pass  # (SokSegmentCombineGrad has no table name)
    table = f"table '{name}': " if name else ""
    raise NotImplementedError(
        f"sok_keras: {table}a second-order gradient through a table's "
        f"gradient is not supported (the gradient of {op.type}, e.g. of a "
        "penalty on d loss / d table). First-order gradients are, and so "
        "are the gradients of d loss / d weights (the ids' weights).")


for _op_type in ("SokSegmentCombineGrad", "SokPooledGradPlan",
                 "SokPooledGradCombine", "SokPooledLookupGrad"):
    register_gradient_once(_op_type)(_no_second_order)
