"""Communicators: collectives between the ranks of a sok_keras job.

`sok_keras.world.communicator()` returns the process's communicator:

- `LocalCommunicator` in a world of one: every method is an identity.
- `CollectiveCommunicator` with more than one rank: TensorFlow's collective
  ops (`all_reduce_v2`, `all_gather_v2`, `all_to_all_v2`, broadcast) over the
  gRPC runtime that `sok_keras.init()` starts, in their own collective group.

Every method works eagerly and inside `tf.function`, and must be called by
every rank, in the same order, with the same `key` and tensors of the same
dtype (and, except for `exchange`, the same shape).

Keys. `key` is a string naming the call site, chosen by the caller, for
example `"emb/user/ids"`. It selects the collective's instance key (a crc32
of the key, the operation and the dtype, combined with the tensor's shape or
its power-of-two size bucket), so:

- every rank must use the same key for the same call;
- each call site within one step must have its own key (two collectives of
  one step with the same key and shape would share an instance key);
- the same key may (and should) be reused by the same call site in every
  step: instance keys are stable, nothing grows per step.

Watchdog. Every collective is recorded as "in flight" while it runs
(`sok_keras.inflight`). A daemon thread checks the records; when one is
older than the communication timeout (`SOK_COMM_TIMEOUT`, default 300 s, or
`sok_keras.init(timeout=...)`), it aborts the process's collectives, so the
waiting op fails with `tf.errors.DeadlineExceededError` naming the rank and
the key instead of hanging. After that the collective runtime of the
process is unusable (a TensorFlow limitation): the job must restart.
"""

import functools
import threading
import time
import weakref
import zlib

import tensorflow as tf

from sok_keras import _gradients
from sok_keras import bucket_ops

GROUP_KEY = 0x50C000
# The group of HostCollectiveCommunicator: host-side agreements.
HOST_GROUP_KEY = GROUP_KEY + 1
"""The collective group key of sok_keras's communicator (all ranks)."""

_OPS = ("sum", "mean", "max", "min")
# Instance keys are `base * 64 + exponent` in an int32: bases 1 .. 2**25 - 1.
_BASES = 2 ** 25 - 1


class TraceCounter:
    """Numbers the uses of each key within the outermost function being
    traced: 0, 1, 2, ... (nested functions and `tf.cond` branches are
    traced in graphs of their own, but run in the outer function's step,
    so they share its numbering). Every rank traces the same program, so
    the numbers agree. Eagerly, `next` gives None."""

    def __init__(self):
        self._counts = weakref.WeakKeyDictionary()  # outermost graph ->
        self._lock = threading.Lock()

    def next(self, key):
        if tf.executing_eagerly():
            return None
        from tensorflow.python.framework.func_graph import FuncGraph

        graph = tf.compat.v1.get_default_graph()
        while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
            graph = graph.outer_graph
        with self._lock:
            counts = self._counts.setdefault(graph, {})
            n = counts.get(key, 0)
            counts[key] = n + 1
        return n


# Two `tape.gradient` calls over one lookup (a persistent tape) trace the
# backward exchange twice into one function; the second needs keys of its
# own, or TensorFlow's collective runtime aborts ("ProvideBuf already
# called") or hangs.
_GRAD_TRACES = TraceCounter()


def _grad_site(site):
    """The call-site key of the gradient of the exchange at `site`:
    `site|grad` for the first gradient traced into a function (and for
    every eager one: eager collectives run one after the other),
    `site|grad<n>` for the n-th after it."""
    n = _GRAD_TRACES.next(site)
    return site + "|grad" + (str(n) if n else "")


def _next_pow2_exponent(m):
    """ceil(log2(max(m, 1))) of an int64 scalar tensor, exactly."""
    m = tf.maximum(tf.cast(m, tf.int64), 1)
    log2 = tf.math.log(tf.cast(m, tf.float64)) / 0.6931471805599453
    e = tf.maximum(tf.cast(tf.math.ceil(log2), tf.int64), 0)
    # Fix float rounding near exact powers of two.
    one = tf.constant(1, tf.int64)
    e = tf.where(tf.bitwise.left_shift(one, e) < m, e + 1, e)
    below = tf.bitwise.left_shift(one, tf.maximum(e - 1, 0))
    return tf.where((e > 0) & (below >= m), e - 1, e)


_NATIVE = (tf.float32, tf.float64, tf.float16, tf.int32, tf.int64)
_WIDEN = {
    tf.bool: tf.int32,
    tf.int8: tf.int32,
    tf.int16: tf.int32,
    tf.uint8: tf.int32,
    tf.uint16: tf.int32,
    tf.uint32: tf.int64,
}


def _to_wire(x, what, op="sum"):
    """Converts `x` to a dtype TF's CPU collectives carry.

    Returns `(wire, back)`, `back` converting a result to `x`'s dtype.
    Natively: float16/32/64, int32, int64 (and bfloat16 for all_reduce and
    exchange). Narrow integers and bool travel as int32 (all_reduce results
    are cast back and may wrap), uint32 as int64, bfloat16 as float32 where
    needed, uint64 and complex values bit-cast to int64 / floats (sum and
    mean only for all_reduce).
    """
    dt = x.dtype
    if dt in _NATIVE:
        return x, lambda y: y
    if dt == tf.bfloat16:
        if what in ("all_reduce", "exchange"):
            return x, lambda y: y
        return tf.cast(x, tf.float32), lambda y: tf.cast(y, dt)
    if dt in _WIDEN:
        return tf.cast(x, _WIDEN[dt]), lambda y: tf.cast(y, dt)
    if dt == tf.uint64 or dt.is_complex:
        if what == "all_reduce" and op not in ("sum", "mean"):
            raise TypeError(
                f"all_reduce op={op!r} is not supported for dtype {dt.name}"
            )
        if dt == tf.uint64:
            if what == "all_reduce" and op == "mean":
                raise TypeError("all_reduce op='mean' does not support uint64")
            return tf.bitcast(x, tf.int64), lambda y: tf.bitcast(y, dt)
        real = dt.real_dtype
        # [...] complex -> [..., 2] real; reductions stay elementwise.
        return tf.bitcast(x, real), lambda y: tf.bitcast(y, dt)
    raise TypeError(
        f"sok_keras collectives do not support dtype {dt.name} "
        f"(in {what}); supported: floating, complex, integer and bool."
    )




class Communicator:
    """Base class: collectives between the `num_ranks` ranks of the job.

    Subclasses implement `all_reduce`, `all_gather`, `broadcast` and
    `_exchange`; `exchange` and `exchange_back` (with their gradients) are
    built on `_exchange`.
    """

    def __init__(self, rank, num_ranks):
        self._rank = rank
        self._num_ranks = num_ranks

    @property
    def rank(self):
        """This process's rank."""
        return self._rank

    @property
    def num_ranks(self):
        """The number of ranks."""
        return self._num_ranks

    def all_reduce(self, x, key, op="sum"):
        """Reduces `x` elementwise over all ranks.

        Args:
            x: a tensor, same shape and dtype on every rank.
            key: the call site's key (see the module docstring).
            op: `"sum"`, `"mean"` (integer dtypes divide with truncation),
                `"max"` or `"min"`.

        Returns:
            The reduced tensor, identical on every rank.

        Example:

        ```python
        total = comm.all_reduce(loss, "train/loss", op="mean")
        ```
        """
        raise NotImplementedError

    def all_gather(self, x, key):
        """Concatenates `x` of every rank along dimension 0, in rank order.

        Args:
            x: a tensor of rank >= 1, same shape and dtype on every rank.
            key: the call site's key.

        Returns:
            A tensor of shape `[num_ranks * x.shape[0], ...]`.

        Example:

        ```python
        counts = comm.all_gather(tf.reshape(my_counts, [1, -1]), "cnt")
        ```
        """
        raise NotImplementedError

    def broadcast(self, x, key, root=0):
        """Returns the `x` of rank `root` on every rank.

        Args:
            x: a tensor, same shape and dtype on every rank (its value only
                matters on `root`).
            key: the call site's key.
            root: the rank whose value is sent.

        Returns:
            A tensor equal to `root`'s `x`.
        """
        raise NotImplementedError

    def _exchange(self, x, counts_matrix, site):
        raise NotImplementedError

    def agree(self, what, value, timeout):
        """Eagerly sums the int `value` of every rank within `timeout` s.

        A barrier with a deadline, for decisions every rank must take
        alike (has every rank entered `model.save`? did any fail?).

        Args:
            what: names the agreement (same on every rank).
            value: a Python int.
            timeout: seconds to wait for every rank.

        Returns:
            The sum over ranks, as a Python int.

        Raises:
            tf.errors.DeadlineExceededError: if a rank did not take part
                in time.
        """
        raise NotImplementedError

    def _check_counts(self, counts_matrix):
        c = tf.cast(tf.convert_to_tensor(counts_matrix), tf.int64)
        n = self._num_ranks
        if c.shape.rank is not None and c.shape.rank != 2:
            raise ValueError(
                f"`counts_matrix` must be a [{n}, {n}] int tensor, got shape "
                f"{c.shape}"
            )
        for d in c.shape:
            if d is not None and d != n:
                raise ValueError(
                    f"`counts_matrix` must be a [{n}, {n}] int tensor "
                    f"(num_ranks={n}), got shape {c.shape}"
                )
        return c

    def _ragged(self, x, c, site, transpose):
        """Exchange with C (or its transpose); gradient is the reverse."""
        x = tf.convert_to_tensor(x)
        differentiable = x.dtype.is_floating or x.dtype.is_complex
        if differentiable and not tf.executing_eagerly():
            # The gradient uses `c`: made here, it is of this graph (a
            # tf.cond branch's gradient may only use that branch's tensors;
            # a matrix from outside the branch would be the outer graph's).
            c = tf.identity(c)
        ct = tf.transpose(c) if transpose else c
        if not differentiable:
            return self._exchange(x, ct, site)

        @tf.custom_gradient
        def _fn(x):
            y = self._exchange(x, ct, site)

            def grad(dy):
                dy = tf.convert_to_tensor(dy)
                return self._ragged(dy, c, _grad_site(site), not transpose)

            return y, grad

        return _gradients.weak(_fn)(x)

    def exchange(self, x, counts_matrix, key):
        """Ragged all-to-all: sends row groups of `x` to their ranks.

        Rank i sends `C[i, j]` rows to rank j, where `C = counts_matrix` is
        the same `[N, N]` matrix on every rank (typically agreed with one
        `all_gather` of each rank's send counts). The rows of `x` are grouped
        by destination rank, in rank order. The result holds the rows
        received, grouped by source rank, in rank order. Differentiable: the
        gradient w.r.t. `x` is the reverse exchange of the upstream gradient.

        Rows are padded to a common bucket, the next power of two
        `>= max(C)`, so a call site uses at most ~64 instance keys whatever
        its shapes.

        Args:
            x: a tensor `[S, ...]` with `S == sum(C[rank, :])`; trailing
                dimensions must be the same on every rank (and static inside
                a `tf.function`).
            counts_matrix: an int tensor `[N, N]`, identical on every rank.
            key: the call site's key.

        Returns:
            A tensor `[sum(C[:, rank]), ...]`.

        Example:

        ```python
        send = tf.constant([2, 1], tf.int64)   # on rank 0 of 2
        C = comm.all_gather(send[tf.newaxis], "ids/counts")
        ids_in = comm.exchange(ids_by_owner, C, "ids")
        ```
        """
        c = self._check_counts(counts_matrix)
        return self._ragged(x, c, f"exchange:{key}", transpose=False)

    def exchange_back(self, y, counts_matrix, key):
        """The reverse of `exchange(x, counts_matrix, key)`.

        Sends rows back along the same routes: `y` has
        `sum(C[:, rank])` rows grouped by the rank they came from, the result
        has `sum(C[rank, :])` rows grouped by the rank they go back to.
        Differentiable (gradient: the forward exchange).

        Args:
            y: a tensor `[sum(C[:, rank]), ...]`.
            counts_matrix: the `[N, N]` matrix of the forward `exchange`
                (not transposed).
            key: the call site's key (may be the forward call's key).

        Returns:
            A tensor `[sum(C[rank, :]), ...]`.

        Example:

        ```python
        rows = lookup(comm.exchange(ids, C, "ids"))
        mine = comm.exchange_back(rows, C, "rows")
        ```
        """
        c = self._check_counts(counts_matrix)
        return self._ragged(y, c, f"exchange_back:{key}", transpose=True)


class LocalCommunicator(Communicator):
    """The communicator of a world of one: every collective is an identity.

    Example:

    >>> comm = LocalCommunicator()
    >>> comm.all_reduce(tf.constant([1.0]), "k")
    <tf.Tensor: shape=(1,), dtype=float32, numpy=array([1.], dtype=float32)>
    """

    def __init__(self):
        super().__init__(0, 1)

    def all_reduce(self, x, key, op="sum"):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}, got {op!r}")
        return tf.identity(x)

    def all_gather(self, x, key):
        return tf.identity(x)

    def broadcast(self, x, key, root=0):
        if root != 0:
            raise ValueError(f"`root` must be 0 in a world of one, got {root}")
        return tf.identity(x)

    def _exchange(self, x, counts_matrix, site):
        return tf.identity(x)

    def agree(self, what, value, timeout):
        return int(value)


class CollectiveCommunicator(Communicator):
    """Collectives over TensorFlow's collective ops (CPU, gRPC).

    Created by `sok_keras.init()` once TensorFlow's collective runtime is
    configured; use `sok_keras.world.communicator()`.

    Args:
        rank: this process's rank.
        num_ranks: the number of ranks (> 1).
        timeout: seconds a collective may wait before the watchdog aborts
            the process's collectives. `None` disables the watchdog.
        group_key: the collective group key (same on every rank).
    """

    def __init__(self, rank, num_ranks, timeout=300.0, group_key=GROUP_KEY,
                 device=None):
        super().__init__(rank, num_ranks)
        self.timeout = timeout
        self.group_key = group_key
        # A collective group has one device type, fixed by its first
        # collective: every collective of this group runs on `device`
        # (where the tables live), whatever the caller's device scope (a
        # strategy's cross-replica scope names only the worker's host, and
        # would leave a small header's collective on the CPU).
        self.device = device if device is not None else _tables_device()
        self._sites = {}  # instance-key base -> site string
        self._sites_lock = threading.Lock()
        self.aborted = None  # the abort message once the watchdog fired
        self._watchdog = None
        if timeout is not None:
            self._watchdog = threading.Thread(
                target=self._watch, name="sok_keras-comm-watchdog", daemon=True
            )
            self._watchdog.start()

    # -- instance keys ---------------------------------------------------

    def _base(self, site):
        """A stable 25-bit key for `site` (its instance keys, `base * 64 +
        exponent`, then fill the int32 range); refuses collisions."""
        base = zlib.crc32(site.encode("utf-8")) % _BASES + 1
        with self._sites_lock:
            other = self._sites.setdefault(base, site)
        if other != site:
            raise ValueError(
                f"sok_keras: the collective keys {other!r} and {site!r} map "
                "to the same instance key (a hash of the key: a chance of "
                f"one in {_BASES:,} for each pair of keys, and each table "
                "makes about 14). The keys are made from the names of the "
                "layers and tables: rename one of the two (the layer's "
                "`name=`, or the table's in an EmbeddingCollection), on "
                "every rank. In a process that builds many models, "
                "`keras.utils.clear_session()` between them keeps their "
                "names, and so their keys, from piling up.")
        return base

    def _instance_key(self, site, exponent=None):
        base = self._base(site)
        if exponent is None:
            return base * 64
        return tf.cast(base * 64 + exponent, tf.int32)

    # -- watchdog --------------------------------------------------------

    def _guarded(self, what, x, fn):
        """Runs fn(x) between in-flight markers named `what`."""
        if self.aborted is not None:
            raise tf.errors.DeadlineExceededError(None, None, self.aborted)
        from sok_keras import inflight

        if self._watchdog is None:
            return fn(x)
        x, token = inflight.begin(x, what)
        if tf.executing_eagerly():
            try:
                y = fn(x)
            except tf.errors.OpError as e:
                from sok_keras import divergence

                clear = divergence.explain_failed_collective(e, what)
                if clear is e:
                    raise
                raise clear from e
            finally:
                inflight.end(tf.zeros([0]), token)
            return y
        return inflight.end(fn(x), token)

    def _watch(self):
        from tensorflow.python.eager import context

        from sok_keras import inflight

        while True:
            timeout = self.timeout
            if timeout is None:
                time.sleep(1.0)
                continue
            time.sleep(min(1.0, max(0.05, timeout / 20.0)))
            try:
                entries = inflight.snapshot()
            except Exception:  # interpreter shutting down
                return
            late = [(k, s) for k, s in entries if s > timeout]
            if not late:
                continue
            what, seconds = late[0]
            op, _, key = what.partition(":")
            self.aborted = (
                f"sok_keras: rank {self._rank}: {op} '{key}' got no answer "
                f"from its peers within {timeout:g} s (SOK_COMM_TIMEOUT or "
                "sok_keras.init(timeout=...)). A peer is stalled or dead, "
                "runs a different number of steps, or called collectives "
                "with different keys or in a different order. The "
                "collectives of this process are aborted; restart the job."
            )
            context.context().abort_collective_ops(
                tf.errors.DEADLINE_EXCEEDED, self.aborted
            )
            return

    # -- collectives -----------------------------------------------------

    def _flat_bucket(self, x, site):
        """For shapes unknown at trace time: flattens and pads `x` to a
        power-of-two size. Returns (padded, instance_key, size)."""
        flat = tf.reshape(x, [-1])
        size = tf.size(flat, out_type=tf.int64)
        e = _next_pow2_exponent(size)
        bucket = tf.bitwise.left_shift(tf.constant(1, tf.int64), e)
        padded = tf.pad(flat, [[0, bucket - size]])
        return padded, self._instance_key(site + "|dyn", e), size

    def _site(self, op, key, x):
        shape = x.shape.as_list() if x.shape.is_fully_defined() else None
        return f"{op}:{key}|{x.dtype.name}|{shape}"

    def all_reduce(self, x, key, op="sum"):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}, got {op!r}")
        x = tf.convert_to_tensor(x)
        x, back = _to_wire(x, "all_reduce", op)
        if x.dtype == tf.int32:
            # TF's collective all-reduce refuses int32 on a GPU device
            # ("does not support datatype DT_INT32 on DEVICE_GPU"): reduce
            # as int64 on every device (the same values; back to int32).
            return back(tf.cast(
                self._all_reduce(tf.cast(x, tf.int64), key, op), tf.int32))
        return back(self._all_reduce(x, key, op))

    def _all_reduce(self, x, key, op):
        merge = {"sum": "Add", "mean": "Add", "max": "Max", "min": "Min"}[op]
        final = "Div" if op == "mean" else "Id"
        site = self._site("all_reduce", key, x)
        n = self._num_ranks

        def run(t, ik):
            return tf.raw_ops.CollectiveReduceV2(
                input=t, group_size=n, group_key=self.group_key,
                instance_key=ik, ordering_token=[], merge_op=merge,
                final_op=final, communication_hint="auto", timeout_seconds=0,
            )

        if x.shape.is_fully_defined():
            ik = self._instance_key(site)
            return self._guarded(f"all_reduce:{key}", x, lambda t: run(t, ik))
        padded, ik, size = self._flat_bucket(x, site)
        out = self._guarded(f"all_reduce:{key}", padded, lambda t: run(t, ik))
        return tf.reshape(out[:size], tf.shape(x))

    def all_gather(self, x, key):
        x = tf.convert_to_tensor(x)
        if x.shape.rank == 0:
            raise ValueError(
                f"all_gather needs a tensor of rank >= 1, got shape {x.shape}"
            )
        x, back = _to_wire(x, "all_gather")
        return back(self._all_gather(x, key))

    def _all_gather(self, x, key):
        site = self._site("all_gather", key, x)
        n = self._num_ranks

        def run(t, ik):
            return tf.raw_ops.CollectiveGatherV2(
                input=t, group_size=n, group_key=self.group_key,
                instance_key=ik, ordering_token=[],
                communication_hint="auto", timeout_seconds=0,
            )

        if x.shape.is_fully_defined():
            ik = self._instance_key(site)
            return self._guarded(f"all_gather:{key}", x, lambda t: run(t, ik))
        padded, ik, size = self._flat_bucket(x, site)
        out = self._guarded(f"all_gather:{key}", padded, lambda t: run(t, ik))
        out = tf.reshape(out, [n, -1])[:, :size]
        shape = tf.shape(x, out_type=tf.int64)
        return tf.reshape(out, tf.concat([[n * shape[0]], shape[1:]], 0))

    def broadcast(self, x, key, root=0):
        if not 0 <= root < self._num_ranks:
            raise ValueError(
                f"`root` must be a rank in [0, {self._num_ranks}), got {root}"
            )
        x = tf.convert_to_tensor(x)
        x, back = _to_wire(x, "broadcast")
        return back(self._broadcast(x, key, root))

    def _broadcast(self, x, key, root):
        site = self._site("broadcast", key, x) + f"|root={root}"
        n = self._num_ranks

        def run(t, ik):
            if self._rank == root:
                return tf.raw_ops.CollectiveBcastSendV2(
                    input=t, group_size=n, group_key=self.group_key,
                    instance_key=ik, communication_hint="auto",
                    timeout_seconds=0,
                )
            return tf.raw_ops.CollectiveBcastRecvV2(
                group_size=n, group_key=self.group_key, instance_key=ik,
                shape=tf.shape(t), T=t.dtype, communication_hint="auto",
                timeout_seconds=0,
            )  # tf.shape(t) orders it after the in-flight marker

        if x.shape.is_fully_defined():
            ik = self._instance_key(site)
            return self._guarded(f"broadcast:{key}", x, lambda t: run(t, ik))
        padded, ik, size = self._flat_bucket(x, site)
        out = self._guarded(f"broadcast:{key}", padded, lambda t: run(t, ik))
        return tf.reshape(out[:size], tf.shape(x))

    def agree(self, what, value, timeout):
        if self.aborted is not None:
            raise tf.errors.DeadlineExceededError(None, None, self.aborted)
        ik = self._instance_key(f"agree:{what}")
        # The deadline is a timer of ours, not the op's `timeout_seconds`:
        # TensorFlow gives each collective with a timeout a thread that
        # sleeps for the whole timeout, done or not, so a job that saves
        # or enters `fit` often on N ranks piled up hundreds of threads.
        # Past it, both abort the process's collectives alike.
        with _deadline(timeout, f"agree '{what}'"):
            with tf.device("/CPU:0"):
                out = tf.raw_ops.CollectiveReduceV2(
                    input=tf.constant([int(value)], tf.int64),
                    group_size=self._num_ranks, group_key=self.group_key,
                    instance_key=ik, ordering_token=[], merge_op="Add",
                    final_op="Id", communication_hint="auto",
                    timeout_seconds=0)
            return int(out.numpy()[0])

    def _exchange(self, x, c, site):
        x, back = _to_wire(x, "exchange")
        return back(self._exchange_wire(x, c, site))

    def _exchange_wire(self, x, c, site):
        n = self._num_ranks
        r = self._rank
        rest = x.shape[1:]
        if not rest.is_fully_defined():
            raise ValueError(
                f"exchange {site!r}: the dimensions after the first must be "
                f"static, got shape {x.shape}"
            )
        rest = rest.as_list()
        # Pad (one compiled op): checks that x has sum(C[rank, :]) rows,
        # computes the bucket exponent e (bucket = 2^e, the next power of
        # two >= max(C)) and puts the rows for rank j in block j.
        padded, e = bucket_ops.bucket_pad(x, c, r, site=site)
        ik = self._instance_key(f"{site}|{x.dtype.name}|{rest}", e)

        def run(t):
            return tf.raw_ops.CollectiveAllToAllV2(
                input=t, group_size=n, group_key=self.group_key,
                instance_key=ik, ordering_token=[],
                communication_hint="auto", timeout_seconds=0,
            )

        # TF's all-to-all wants dim 0 == group size: one row per peer.
        padded = tf.reshape(padded, [n, -1])
        what = site.partition("|")[0]
        got = tf.reshape(self._guarded(what, padded, run), [-1] + rest)
        # Unpad: rows from source j sit at j * bucket + [0, C[j, rank]).
        return bucket_ops.bucket_unpad(got, c, e, r, site=site)


def _tables_device():
    """The device sok tables are placed on: the first GPU when one is
    visible, else the CPU."""
    if tf.config.list_logical_devices("GPU"):
        return "/device:GPU:0"
    return "/device:CPU:0"


def _on_device(name):
    """`CollectiveCommunicator.<name>`, run under `tf.device(self.device)`."""
    method = getattr(CollectiveCommunicator, name)

    @functools.wraps(method)
    def placed(self, *args, **kwargs):
        with tf.device(self.device):
            return method(self, *args, **kwargs)

    return placed


# (`_exchange` carries the exchange and its gradient, the reverse one.)
for _name in ("all_reduce", "all_gather", "broadcast", "_exchange"):
    setattr(CollectiveCommunicator, _name, _on_device(_name))
del _name


class _deadline:
    """Aborts the process's collectives (as TensorFlow's own collective
    timeout does) if the block is still running after `seconds`: the
    waiting op fails with `DeadlineExceededError` "Collective has timed
    out ...". One timer thread per block, gone when the block ends."""

    def __init__(self, seconds, what):
        self.seconds, self.what = float(seconds), what
        self._done = False
        self._lock = threading.Lock()
        self._timer = None

    def _expire(self):
        from tensorflow.python.eager import context

        with self._lock:
            if self._done:
                return
            self._done = True
        context.context().abort_collective_ops(
            tf.errors.DEADLINE_EXCEEDED,
            f"Collective has timed out: sok_keras {self.what} got no "
            f"answer from every rank within {self.seconds:g} s.")

    def __enter__(self):
        if self.seconds > 0:  # (else no deadline, as `timeout_seconds=0`)
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.daemon = True
            self._timer.name = "sok_keras-agree-deadline"
            self._timer.start()
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._done = True
        if self._timer is not None:
            self._timer.cancel()
        return False


class HostCollectiveCommunicator(CollectiveCommunicator):
    """`CollectiveCommunicator` pinned to the CPU, in a group of its own.

    For small host-side agreements (`agree`, the cross-rank consistency
    checks, checkpoint bookkeeping): a TensorFlow collective group has one
    device type, fixed by the first collective that uses it, so host-side
    collectives must not share the data's group, which lives on the GPU
    when the tables do (a CPU collective joining it fails with "joining a
    group with incompatible device type GPU"). Get it with
    `sok_keras.world.control_communicator()`.
    """

    def __init__(self, rank, num_ranks, timeout=300.0,
                 group_key=HOST_GROUP_KEY):
        super().__init__(rank, num_ranks, timeout=timeout,
                         group_key=group_key, device="/device:CPU:0")


# Its device is the CPU; `exchange` and `agree` also run whole under it (the
# data group places only the collectives of an exchange).
for _name in ("exchange", "agree"):
    setattr(HostCollectiveCommunicator, _name, _on_device(_name))
del _name


class ReplicaCommunicator(Communicator):
    """Collectives between the replicas of one process (no gRPC).

    The exchange layer for strategies whose replicas live in one process
    (`tf.distribute.MirroredStrategy` over several local devices, logical
    CPUs included): each replica is a rank, its rank the replica id of the
    current replica context (`replica_id_in_sync_group`), not the process's
    `sok_keras.rank()`. Every collective is one `merge_call` of the
    replica context: the cross-replica function sees every replica's
    tensor and routes them with ordinary ops, each result placed on its
    replica's device. That works eagerly (where MirroredStrategy runs the
    replicas' threads one at a time, so blocking collective ops between
    them would deadlock) and inside `tf.function`. Call every method inside
    `strategy.run`, from every replica, in the same order.

    sok tables made in the scope of such a strategy are sharded over its
    replicas and exchange through it (`sok_keras.replicas`,
    docs/recipes.md).

    Args:
        num_replicas: the strategy's `num_replicas_in_sync` (> 1).

    Example:

    ```python
    comm = ReplicaCommunicator(strategy.num_replicas_in_sync)
    strategy.run(lambda: comm.all_reduce(tf.ones([2]), "ones"))
    ```
    """

    def __init__(self, num_replicas):
        if not isinstance(num_replicas, int) or num_replicas < 2:
            raise ValueError(
                "ReplicaCommunicator needs `num_replicas` >= 2 (an int); "
                f"got {num_replicas!r}.")
        super().__init__(0, num_replicas)

    def _context(self):
        ctx = tf.distribute.get_replica_context()
        strategy = tf.distribute.get_strategy()
        if ctx is None or ctx.num_replicas_in_sync != self._num_ranks or (
                len(strategy.extended.worker_devices) != self._num_ranks):
            found = "none" if ctx is None else (
                f"{ctx.num_replicas_in_sync} replicas")
            raise RuntimeError(
                "ReplicaCommunicator: call it inside `strategy.run` of a "
                f"strategy with {self._num_ranks} replicas in this process "
                f"(replica context found: {found}).")
        return ctx

    @property
    def rank(self):
        """The current replica's id."""
        rid = tf.get_static_value(self._context().replica_id_in_sync_group)
        if rid is None:
            raise RuntimeError(
                "ReplicaCommunicator: the replica id is not known when "
                "tracing (strategies whose replicas share one trace, e.g. "
                "TPUStrategy, are not supported).")
        return int(rid)

    def _merge(self, fn, *tensors):
        """fn(list of every replica's tensor per argument) -> one result
        per replica; returns this replica's."""
        from tensorflow.python.distribute import values as values_lib

        def merge_fn(strategy, *per_replica):
            local = [list(strategy.experimental_local_results(p))
                     for p in per_replica]
            outs = fn(*local)
            devices = strategy.extended.worker_devices
            placed = []
            for d, o in zip(devices, outs):
                with tf.device(d):
                    placed.append(tf.identity(o))
            return values_lib.PerReplica(tuple(placed))

        return self._context().merge_call(
            merge_fn, args=tuple(tf.convert_to_tensor(t) for t in tensors))

    def all_reduce(self, x, key, op="sum"):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}, got {op!r}")
        n = self._num_ranks

        def reduce(xs):
            stacked = tf.stack(xs)
            if op == "sum":
                y = tf.reduce_sum(stacked, 0)
            elif op == "max":
                y = tf.reduce_max(stacked, 0)
            elif op == "min":
                y = tf.reduce_min(stacked, 0)
            elif stacked.dtype.is_integer:
                y = tf.math.truncatediv(tf.reduce_sum(stacked, 0),
                                        tf.cast(n, stacked.dtype))
            else:
                y = tf.reduce_sum(stacked, 0) / tf.cast(n, stacked.dtype)
            return [y] * n

        return self._merge(reduce, x)

    def all_gather(self, x, key):
        x = tf.convert_to_tensor(x)
        if x.shape.rank == 0:
            raise ValueError(
                f"all_gather needs a tensor of rank >= 1, got shape {x.shape}"
            )
        return self._merge(lambda xs: [tf.concat(xs, 0)] * len(xs), x)

    def broadcast(self, x, key, root=0):
        if not 0 <= root < self._num_ranks:
            raise ValueError(
                f"`root` must be a rank in [0, {self._num_ranks}), got {root}"
            )
        return self._merge(lambda xs: [xs[root]] * len(xs), x)

    def _exchange(self, x, counts_matrix, site):
        n = self._num_ranks

        def route(xs, cs):
            c = tf.cast(cs[0], tf.int64)
            blocks = [tf.split(xs[i], c[i], num=n) for i in range(n)]
            return [tf.concat([blocks[i][j] for i in range(n)], 0)
                    for j in range(n)]

        return self._merge(route, x, counts_matrix)

    def agree(self, what, value, timeout):
        raise NotImplementedError(
            "ReplicaCommunicator has no host-side agreement; the replicas "
            "of one process share its state.")
