"""Markers that record which collectives are in flight, for the watchdog.

Every collective issued by `sok_keras.comm` is bracketed by `begin` and
`end`. Both pass their tensor through unchanged, so inside a `tf.function`
the data dependency `x -> begin -> collective -> end` keeps them in order.
`snapshot()` lists what is in flight and for how long; the watchdog in
`sok_keras.comm` aborts the process's collectives when an entry is older
than the communication timeout.

The registry lives in the compiled op library (`csrc/core/inflight.cc`), so
it sees collectives running inside graphs as well as eager ones.
"""

import tensorflow as tf

from sok_keras._ops import ops


def begin(x, key):
    """Records `key` as in flight and passes `x` through.

    Args:
        x: a tensor; returned unchanged (same buffer).
        key: a string naming the call site, shown in the watchdog's error.

    Returns:
        A tuple `(x, token)` where `token` is a scalar int64 tensor for `end`.

    Example:

    ```python
    y, token = begin(x, "lookup/ids")
    z = end(collective(y), token)
    ```
    """
    # Inside a graph, a failing step must not leave its entry behind: the
    # kernel then registers a clean-up on the step's cancellation manager.
    in_graph = not tf.executing_eagerly()
    return ops().sok_inflight_begin(x, key=key, cleanup_on_cancel=in_graph)


def end(x, token):
    """Ends the in-flight entry `token` and passes `x` through.

    Args:
        x: a tensor; returned unchanged.
        token: the token returned by `begin`.

    Returns:
        `x`.
    """
    return ops().sok_inflight_end(x, token)


def snapshot():
    """Returns the entries in flight as a list of `(key, seconds)`, oldest
    first."""
    keys, seconds = ops().sok_inflight_snapshot()
    return [
        (k.decode("utf-8", "replace"), float(s))
        for k, s in zip(keys.numpy(), seconds.numpy())
    ]
