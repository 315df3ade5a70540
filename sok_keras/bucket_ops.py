"""Padding of the ragged exchange: thin wrappers of the compiled ops.

A ragged all-to-all between N ranks (rank i sends `C[i, j]` rows to rank j,
`C` identical on every rank) travels as a dense all-to-all of N blocks of
`bucket = 2**exponent` rows, the next power of two `>= max(C)` (>= 1):

```python
padded, e = bucket_pad(x, C, rank=r)       # [N * 2**e, ...]
got = <all-to-all of padded>
y = bucket_unpad(got, C, e, rank=r)        # [sum(C[:, r]), ...]
```

Both ops run on the host (CPU kernels), carry any plain-old-data dtype and
trailing shape (rows are copied as bytes) and are pure, so TensorFlow does
not chain them with automatic control dependencies. Differentiable: the
gradient of a pad is the unpad with `C` transposed, and vice versa.
"""

import tensorflow as tf

from sok_keras._ops import ops
from sok_keras._ops import register_gradient_once


def bucket_pad(x, counts_matrix, rank, site=""):
    """Pads rank `rank`'s rows into N power-of-two blocks.

    Args:
        x: a tensor `[S, ...]`, the rows grouped by destination rank in rank
            order, `S == sum(counts_matrix[rank, :])`.
        counts_matrix: an int64 tensor `[N, N]` (entries >= 0).
        rank: this rank (a Python int).
        site: a name for error messages.

    Returns:
        `(padded, exponent)`: `padded` `[N * 2**exponent, ...]` (block j
        holds the rows for rank j, then zeros), `exponent` an int64 scalar.

    Raises:
        tf.errors.InvalidArgumentError: if `S != sum(counts_matrix[rank, :])`,
            a count is negative, or the shapes are wrong.
    """
    return ops().sok_bucket_pad(
        x=x, counts_matrix=tf.cast(counts_matrix, tf.int64), rank=int(rank),
        site=site)


def bucket_unpad(received, counts_matrix, exponent, rank, site=""):
    """Takes the rows received from every rank out of padded blocks.

    Args:
        received: a tensor `[N * 2**exponent, ...]`; block j holds
            `counts_matrix[j, rank]` rows from rank j, then padding.
        counts_matrix: the int64 `[N, N]` matrix given to `bucket_pad`.
        exponent: the int64 scalar `bucket_pad` returned.
        rank: this rank (a Python int).
        site: a name for error messages.

    Returns:
        A tensor `[sum(counts_matrix[:, rank]), ...]`, grouped by source rank.
    """
    return ops().sok_bucket_unpad(
        received=received, counts_matrix=tf.cast(counts_matrix, tf.int64),
        exponent=tf.cast(exponent, tf.int64), rank=int(rank), site=site)


@register_gradient_once("SokBucketPad")
def _bucket_pad_grad(op, grad, _):
    rank = op.get_attr("rank")
    site = op.get_attr("site").decode("utf-8")
    c = op.inputs[1]
    dx = bucket_unpad(grad, tf.transpose(c), op.outputs[1], rank, site)
    return [dx, None]


@register_gradient_once("SokBucketUnpad")
def _bucket_unpad_grad(op, grad):
    rank = op.get_attr("rank")
    site = op.get_attr("site").decode("utf-8")
    c = op.inputs[1]
    # Pad with C^T sends sum(C[:, rank]) rows; max(C^T) == max(C), so the
    # exponent is the same as the forward one.
    dreceived, _ = bucket_pad(grad, tf.transpose(c), rank, site)
    return [dreceived, None, None]
