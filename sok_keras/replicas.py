"""Tables sharded over the replicas of one process (`MirroredStrategy`).

Under `tf.distribute.MirroredStrategy` with R > 1 local devices, a
`sok_keras.Variable` made in `strategy.scope()` is sharded over the R
replicas instead of the processes: replica `r` is rank `r` and holds shard
`r` (row `id` on replica `id % R` in `"distributed"` mode), each shard a
variable on that replica's device. Inside `strategy.run` a table's `value`
is the current replica's shard, a lookup exchanges ids and rows between
the replicas with `sok_keras.comm.ReplicaCommunicator` (no gRPC server:
every collective is one `merge_call`, routed by ordinary ops), and the
sparse optimizers update each replica's own shard and slots. Outside
`strategy.run` (the strategy's cross-replica context) a lookup reads the
rows from every shard directly.

This module holds what that needs: which strategy shards new tables, the
current replica, and the one communicator per replica count.

Example:

>>> strategy = tf.distribute.MirroredStrategy(["/GPU:0", "/GPU:1"])
>>> with strategy.scope():
...     table = sok.Variable(np.arange(17 * 3).reshape(17, 3),
...                          dtype="float32")
>>> table.num_ranks  # shards of 9 and 8 rows, one per replica
2
"""

import threading

import tensorflow as tf

_COMMS = {}
_LOCK = threading.Lock()


def local_strategy():
    """The strategy in scope whose several replicas live in this process,
    or None.

    Returns:
        A `tf.distribute.Strategy` with more than one local device (its
        scope or one of its replica contexts is active), else None.
    """
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if len(strategy.extended.worker_devices) <= 1:
        return None
    return strategy


def shards_tables(strategy):
    """Whether sok tables made under `strategy` are sharded over its
    replicas (a single-process `MirroredStrategy`)."""
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return False
    hosts = {(spec.job, spec.task) for spec in (
        tf.DeviceSpec.from_string(d)
        for d in strategy.extended.worker_devices)}
    return len(hosts) == 1


def table_strategy(name):
    """The strategy a new table is sharded over, or None for the ranks.

    Args:
        name: the table's name, for error messages.

    Raises:
        NotImplementedError: a strategy with several local replicas that
            sok tables cannot be sharded over (several workers with several
            devices each), or a table made inside `strategy.run`.
    """
    from sok_keras import world

    strategy = local_strategy()
    if strategy is None:
        return None
    if not shards_tables(strategy) or world.num_ranks() > 1:
        raise NotImplementedError(
            f"Table '{name}': sok_keras shards tables over the replicas of "
            "one process (MirroredStrategy in a single process) or over "
            "processes with one device each, not both: found "
            f"{type(strategy).__name__} with "
            f"{len(strategy.extended.worker_devices)} local replicas in a "
            f"world of {world.num_ranks()} ranks. Run one process per "
            "device (`sokrun -np N`, or MultiWorkerMirroredStrategy with "
            "one device per worker). See docs/recipes.md.")
    return strategy


def replica_id(num_replicas):
    """The current replica's id inside `strategy.run` of a strategy with
    `num_replicas` replicas, else None (cross-replica context, or no such
    strategy)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync != num_replicas:
        return None
    rid = tf.get_static_value(ctx.replica_id_in_sync_group)
    if rid is None:
        raise RuntimeError(
            "sok_keras: the replica id is not known while tracing (a "
            "strategy whose replicas share one trace, e.g. TPUStrategy, "
            "cannot hold sok tables).")
    return int(rid)


def in_replica_context():
    """Whether a replica context of a strategy with several local replicas
    is active (inside `strategy.run`)."""
    ctx = tf.distribute.get_replica_context()
    return ctx is not None and local_strategy() is not None and (
        ctx.num_replicas_in_sync > 1)


def communicator(num_replicas):
    """The `ReplicaCommunicator` for `num_replicas` replicas (one per
    count, made on first use)."""
    from sok_keras.comm import ReplicaCommunicator

    with _LOCK:
        comm = _COMMS.get(num_replicas)
        if comm is None:
            comm = _COMMS[num_replicas] = ReplicaCommunicator(num_replicas)
    return comm


def table_ranks():
    """The number of ranks a table made now is sharded over: the local
    replicas under a `MirroredStrategy` scope, else the world's ranks."""
    from sok_keras import world

    strategy = local_strategy()
    if strategy is not None and shards_tables(strategy):
        return strategy.num_replicas_in_sync
    return world.num_ranks()
