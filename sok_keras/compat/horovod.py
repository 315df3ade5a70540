"""A `horovod.tensorflow`-compatible module over sok_keras's runtime.

SparseOperationKit's recipes train with Horovod: `hvd.init()`,
`hvd.allreduce` of the dense gradients, `hvd.broadcast_variables`,
`hvd.DistributedGradientTape`, launched by `horovodrun -np 8`. Horovod has
no release that builds against TensorFlow 2.21 and Keras 3 (see
`docs/recipes.md`), so this module provides the part of its API those
recipes use, on top of sok_keras's own collectives (the communicator that
`sok_keras.init()` creates: TensorFlow collective ops on CPU, NCCL on GPU).
Change only the import:

```python
import sok_keras.compat.horovod as hvd   # was: import horovod.tensorflow
import sok_keras as sok

hvd.init()                  # = sok.init(): ranks from sokrun, mpirun, ...
...
grads = [hvd.allreduce(g) for g in grads]        # mean over the ranks
hvd.broadcast_variables(model.variables, root_rank=0)
```

and launch with `sokrun -np 2 python train.py` (or `mpirun` /
`horovodrun`-style environments with `MASTER_ADDR`/`MASTER_PORT` or
`SOK_WORKER_ADDRS`; see `sok_keras.world`).

Every collective must be called by every rank in the same order, as with
Horovod. Collectives are matched across ranks by name: give `name=` where
the order of calls could differ between ranks. Without a name, calls
inside one `tf.function` are numbered in tracing order (the same on every
rank), and eager calls of one kind share one name (they run one after the
other).

`allreduce` (Average, Sum), `allgather` and `broadcast` have Horovod's
gradients (each rank gets the gradient of every rank's loss with respect
to its input), so in-batch negatives gathered from every rank train as
on one process (docs/recipes.md).

Gradients of sharded tables (`sok_keras.Variable`) are never reduced here:
each rank owns its rows, and the lookup's backward pass already summed
every rank's contribution on the owner. `allreduce`, `allgather` and
`broadcast` of such a table's value refuse it (its shards differ in shape).

Attributes:
    Average, Sum, Min, Max: reduction ops for `allreduce(op=...)`.
    Adasum, Product: Horovod's other ops; refused with a clear error.
    Compression, compression, mpi_ops: Horovod's names for them
        (`hvd.Compression.none`, `hvd.compression.NoneCompressor`,
        `hvd.mpi_ops.Sum`).
"""

import types

import tensorflow as tf

from sok_keras import _gradients
from sok_keras import world as _world
from sok_keras.variable import is_sok_variable

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Adasum = "adasum"
Product = "product"

_OPS = {Average: "mean", Sum: "sum", Min: "min", Max: "max"}


class NoneCompressor:
    """Horovod's compressor that sends tensors as they are (the only kind
    here: `compression=` is accepted and ignored)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        del ctx
        return tensor


class Compression:
    """Horovod's `hvd.Compression.none` (sok_keras sends every tensor
    uncompressed; there is no `fp16`)."""

    none = NoneCompressor


# Horovod's submodules as scripts name them: `hvd.compression.NoneCompressor`,
# `hvd.mpi_ops.Sum`.
compression = types.SimpleNamespace(
    Compression=Compression, NoneCompressor=NoneCompressor)
mpi_ops = types.SimpleNamespace(
    Average=Average, Sum=Sum, Min=Min, Max=Max, Adasum=Adasum,
    Product=Product)



def _key(kind, name):
    """The collective key of one call (see the module docstring): `name`'s,
    else one per call site, numbered within a `tf.function`'s graph as the
    lookups' exchanges are (`sok_keras.lookup._call_site_key`)."""
    if name is not None:
        return f"hvd/{kind}/{name}"
    from sok_keras.lookup import _call_site_key

    return _call_site_key(f"hvd/{kind}")


_state = {"init": False}


def _comm():
    if not (_state["init"] or _world.is_initialized()):
        raise ValueError(
            "sok_keras.compat.horovod has not been initialized; use "
            "hvd.init() (Horovod's message for the same mistake).")
    if not _world.is_initialized():
        _world.init()
    return _world.communicator()


def _refuse_table(x, what):
    if is_sok_variable(x):
        raise ValueError(
            f"hvd.{what}: {getattr(x, 'name', '')!r} is a sharded "
            "sok_keras.Variable; every rank holds different rows of it, so "
            "it cannot be reduced, gathered or broadcast. Pass dense tensors "
            "and variables only (sok.split_embedding_variable_from_others "
            "separates them).")


# -- the world ---------------------------------------------------------


def init(comm=None, process_sets=None):
    """Reads the world from the launcher; the runtime starts lazily.

    Horovod programs configure their GPUs right after `hvd.init()`
    (`set_memory_growth`, `set_visible_devices(gpus[hvd.local_rank()])`),
    which TensorFlow refuses once its runtime runs. So `init` only reads
    and checks the world (rank, size, addresses); `sok.init()` / `sok.Init`
    (which SOK's recipes call next) or the first collective of this module
    starts it. Before that, run no TensorFlow op in a multi-rank job.

    Args:
        comm: Horovod's MPI communicator argument; only `None` (the whole
            job) is supported.
        process_sets: only `None` is supported.

    Returns:
        None, as Horovod's `init`.

    Example:

    >>> import sok_keras.compat.horovod as hvd
    >>> hvd.init()
    >>> hvd.rank(), hvd.size()
    (0, 1)
    """
    if comm is not None and comm != []:
        raise ValueError(
            "hvd.init(comm=...): sok_keras.compat.horovod runs on the whole "
            f"job only; got comm={comm!r}.")
    if process_sets is not None:
        raise ValueError(
            "hvd.init(process_sets=...): process sets are not supported by "
            "sok_keras.compat.horovod.")
    _world.world_from_env()  # raises on inconsistent launcher variables
    _state["init"] = True


def is_initialized():
    """Whether `init()` (or `sok_keras.init()`) has run."""
    return _state["init"] or _world.is_initialized()


def shutdown():
    """Does nothing: sok_keras's runtime lives as long as the process."""


def rank():
    """This process's rank (`sok_keras.rank()`)."""
    return _world.rank()


def size():
    """The number of ranks (`sok_keras.num_ranks()`)."""
    return _world.num_ranks()


def _hosts():
    w = _world.world()
    if w.num_ranks == 1 or not w.worker_addrs:
        return ["localhost"] * w.num_ranks
    return [a.rsplit(":", 1)[0] for a in w.worker_addrs]


def local_rank():
    """This process's rank on its host.

    From the launcher (`SOK_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    `HOROVOD_LOCAL_RANK`, `SLURM_LOCALID`, `LOCAL_RANK`, ...), else counted
    from the ranks' addresses.
    """
    import os

    local = _world._local_rank(os.environ)
    if local is not None:
        return local
    hosts = _hosts()
    me = rank()
    return sum(1 for h in hosts[:me] if h == hosts[me])


def local_size():
    """The number of ranks on this host (from the launcher, else counted
    from the ranks' addresses)."""
    import os

    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE",
                 "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        if not (value.isascii() and value.isdigit() and int(value) > 0):
            # (QA: passed over silently, and 0 returned as is.)
            raise RuntimeError(
                f"sok_keras: environment variable {name} must be the "
                f"number of ranks on this host (1, 2, ...), got "
                f"{os.environ[name]!r}.")
        return int(value)
    hosts = _hosts()
    return hosts.count(hosts[rank()])


def cross_rank():
    """The index of this rank's host among the job's hosts."""
    hosts = _hosts()
    order = list(dict.fromkeys(hosts))
    return order.index(hosts[rank()])


def cross_size():
    """The number of hosts of the job."""
    return len(set(_hosts()))


def mpi_threads_supported():
    """False: there is no MPI underneath."""
    return False


def mpi_enabled():
    """False: there is no MPI underneath."""
    return False


def mpi_built():
    """False: there is no MPI underneath."""
    return False


def gloo_enabled():
    """False: there is no Gloo underneath."""
    return False


def gloo_built():
    """False: there is no Gloo underneath."""
    return False


def nccl_built():
    """Whether sok_keras's op library was built with NCCL (CUDA) support."""
    from sok_keras import _ops

    return bool(_ops.build_info()["with_cuda"])


def cuda_built():
    """Whether sok_keras's op library has CUDA kernels."""
    return nccl_built()


def rocm_built():
    """False."""
    return False


# -- collectives -------------------------------------------------------


def _check_op(op, average, what):
    if average is not None:
        if op is not None:
            raise ValueError(
                f"hvd.{what}: give `op` or the deprecated `average`, not "
                "both.")
        op = Average if average else Sum
    op = Average if op is None else op
    if op in (Adasum, Product):
        raise ValueError(
            f"hvd.{what}: op={op!r} is not supported by "
            "sok_keras.compat.horovod; use hvd.Average, hvd.Sum, hvd.Min or "
            "hvd.Max.")
    if op not in _OPS:
        raise ValueError(
            f"hvd.{what}: unknown op {op!r}; use hvd.Average, hvd.Sum, "
            "hvd.Min or hvd.Max.")
    return op


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=None,
              ignore_name_scope=False):
    """Reduces `tensor` over all ranks; the mean by default, as Horovod.

    Args:
        tensor: a dense tensor (same shape and dtype on every rank) or a
            `tf.IndexedSlices` (gathered from every rank, as Horovod does;
            its values divided by the number of ranks for `Average`).
        average: deprecated Horovod flag: True is `op=Average`, False
            `op=Sum`.
        device_dense, device_sparse, compression: accepted and ignored
            (sok_keras chooses devices; no compression).
        op: `hvd.Average` (default), `hvd.Sum`, `hvd.Min` or `hvd.Max`.
        prescale_factor: multiplies `tensor` before the reduction.
        postscale_factor: multiplies the result.
        name: the collective's name (see the module docstring).
        process_set: only `None` (the whole job).
        ignore_name_scope: accepted and ignored.

    Returns:
        The reduced tensor (an `IndexedSlices` for one).

    Example:

    ```python
    grads = [hvd.allreduce(g) for g in grads]
    ```
    """
    del device_dense, device_sparse, compression, ignore_name_scope
    _no_process_set(process_set, "allreduce")
    op = _check_op(op, average, "allreduce")
    _refuse_table(tensor, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Average, Sum):
            raise ValueError(
                f"hvd.allreduce of a tf.IndexedSlices supports Average and "
                f"Sum only; got op={op!r}.")
        key = _key("allreduce_sparse", name)
        values = allgather(tensor.values * prescale_factor,
                           name=key + "/values")
        indices = allgather(tensor.indices, name=key + "/indices")
        if op == Average:
            values = values / tf.cast(size(), values.dtype)
        if postscale_factor != 1.0:
            values = values * postscale_factor
        return tf.IndexedSlices(values, indices, tensor.dense_shape)
    x = tf.convert_to_tensor(tensor)
    if prescale_factor != 1.0:
        x = x * tf.cast(prescale_factor, x.dtype)
    key = _key("allreduce", name)
    comm = _comm()

    def forward(x):
        return comm.all_reduce(x, key, op=_OPS[op])

    def backward(dy):
        # Horovod's rule: the same reduction of the ranks' gradients (the
        # gradient of the ranks' summed losses with respect to this
        # rank's input).
        if op not in (Average, Sum):
            raise ValueError(
                f"hvd.allreduce with op={op!r} has no gradient (as in "
                "Horovod); use hvd.Average or hvd.Sum inside a "
                "GradientTape.")
        return comm.all_reduce(dy, key + "/grad", op=_OPS[op])

    y = _differentiable(forward, backward, x)
    if postscale_factor != 1.0:
        y = y * tf.cast(postscale_factor, y.dtype)
    return y


def _differentiable(forward, backward, x):
    """`forward(x)` whose gradient is `backward(dy)` (a collective every
    rank runs in its backward pass, as in Horovod) for floating-point `x`;
    other dtypes have no gradient."""
    if not (x.dtype.is_floating or x.dtype.is_complex):
        return forward(x)

    @tf.custom_gradient
    def op(x):
        # (A gradient may come as IndexedSlices: a gather of the output.)
        return forward(x), lambda dy: backward(tf.convert_to_tensor(dy))

    return _gradients.weak(op)(x)


def grouped_allreduce(tensors, average=None, op=None, name=None, **kwargs):
    """`allreduce` of each tensor of a list (Horovod's grouped form)."""
    base = _key("grouped_allreduce", name)
    return [allreduce(t, average=average, op=op, name=f"{base}/{i}",
                      **kwargs) for i, t in enumerate(tensors)]


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Concatenates `tensor` of every rank along dimension 0, rank order.

    The first dimension may differ between ranks (as in Horovod); the
    others must be equal.

    Args:
        tensor: a tensor of rank >= 1.
        name: the collective's name (see the module docstring).
        ignore_name_scope: accepted and ignored.
        process_set: only `None`.

    Returns:
        A tensor `[sum of every rank's first dimension, ...]`.
    """
    del ignore_name_scope
    _no_process_set(process_set, "allgather")
    _refuse_table(tensor, "allgather")
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank == 0:
        raise ValueError(
            f"hvd.allgather needs a tensor of rank >= 1; got shape "
            f"{x.shape}.")
    comm = _comm()
    if comm.num_ranks == 1:
        return tf.identity(x)
    key = _key("allgather", name)
    rows = tf.shape(x, out_type=tf.int64)[:1]
    counts = comm.all_gather(rows, key + "/rows")  # [N]

    def forward(x):
        most = tf.reduce_max(counts)
        padded = tf.pad(x, tf.concat(
            [[[0, most - rows[0]]],
             tf.zeros([x.shape.rank - 1, 2], tf.int64)], 0))
        # The padded shape is the same on every rank (mod dynamic dims).
        gathered = comm.all_gather(padded, key + "/data")
        keep = tf.reshape(
            tf.range(most)[tf.newaxis, :] < counts[:, tf.newaxis], [-1])
        out = tf.boolean_mask(gathered, keep)
        if x.shape[1:].is_fully_defined():
            out = tf.ensure_shape(out, [None] + x.shape[1:].as_list())
        return out

    def backward(dy):
        # Horovod's rule: every rank's gradient of the gathered tensor
        # summed, then this rank's rows of it.
        total = comm.all_reduce(dy, key + "/grad", op="sum")
        start = tf.reduce_sum(counts[:comm.rank])
        return tf.reshape(total[start:start + rows[0]], tf.shape(x))

    return _differentiable(forward, backward, x)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=None):
    """Returns the `tensor` of rank `root_rank` on every rank.

    Args:
        tensor: a tensor, same shape and dtype on every rank.
        root_rank: the rank whose value is sent.
        name: the collective's name (see the module docstring).
        ignore_name_scope: accepted and ignored.
        process_set: only `None`.

    Returns:
        `root_rank`'s tensor.
    """
    del ignore_name_scope
    _no_process_set(process_set, "broadcast")
    _refuse_table(tensor, "broadcast")
    if not isinstance(root_rank, int) or not 0 <= root_rank < size():
        raise ValueError(
            f"hvd.broadcast: root_rank must be a rank in [0, {size()}); got "
            f"{root_rank!r}.")
    comm = _comm()
    key = _key("broadcast", name)

    def forward(x):
        return comm.broadcast(x, key, root=root_rank)

    def backward(dy):
        # Horovod's rule: the ranks' gradients summed on the root, zeros
        # elsewhere (only the root's value reached the output).
        total = comm.all_reduce(dy, key + "/grad", op="sum")
        return total if comm.rank == root_rank else tf.zeros_like(total)

    return _differentiable(forward, backward, tf.convert_to_tensor(tensor))


def broadcast_variables(variables, root_rank, process_set=None,
                        inplace=False):
    """Assigns every variable the value it has on `root_rank`.

    Sharded tables (`sok_keras.Variable`) in the list are skipped: each
    rank holds its own rows. Works eagerly and inside `tf.function`.

    Args:
        variables: a list of variables (Keras or TensorFlow).
        root_rank: the rank whose values win.
        process_set: only `None`.
        inplace: accepted and ignored.

    Returns:
        A list of the assign ops (eagerly: the assigned values).

    Example:

    ```python
    hvd.broadcast_variables(model.variables, root_rank=0)
    ```
    """
    del inplace
    _no_process_set(process_set, "broadcast_variables")
    if not isinstance(root_rank, int) or not 0 <= root_rank < size():
        raise ValueError(
            "hvd.broadcast_variables: root_rank must be a rank in "
            f"[0, {size()}); got {root_rank!r}.")
    base = _key("broadcast_variables", None)
    comm = _comm()
    out = []
    for i, v in enumerate(variables):
        if is_sok_variable(v):
            continue
        # (`value` is a property of a keras.Variable, a method of a
        # tf.Variable: read either through convert_to_tensor.)
        value = tf.convert_to_tensor(v)
        value = comm.broadcast(value, f"{base}/{i}", root=root_rank)
        out.append(v.assign(value))
    return out


def _no_process_set(process_set, what):
    if process_set is not None:
        raise ValueError(
            f"hvd.{what}: process sets are not supported by "
            "sok_keras.compat.horovod; got process_set="
            f"{process_set!r}.")


# -- training helpers --------------------------------------------------


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`: `gradient` averages over the ranks.

    Dense gradients are all-reduced (`op`, the mean by default), sparse
    ones (`tf.IndexedSlices` of ordinary variables) gathered as in
    `allreduce`, or densified first with `sparse_as_dense=True`. Gradients
    of sharded tables (`sok_keras.Variable`) are returned as they are (see
    the module docstring): sok_keras's optimizers average them.

    Args:
        gradtape: a `tf.GradientTape`.
        device_dense, device_sparse, compression: ignored.
        sparse_as_dense: convert `IndexedSlices` of ordinary variables to
            dense tensors before reducing.
        op: `hvd.Average` (default) or `hvd.Sum`, `hvd.Min`, `hvd.Max`.
        **kwargs: Horovod's other arguments (`gradient_predivide_factor`,
            `num_groups`, ...) are accepted only at their defaults.

    Example:

    ```python
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    ```
    """

    _DEFAULTS = {"gradient_predivide_factor": 1.0, "num_groups": 0,
                 "groups": None, "process_set": None,
                 "scale_local_gradients": True, "persistent": False}

    def __init__(self, gradtape, device_dense="", device_sparse="",
                 compression=None, sparse_as_dense=False, op=None,
                 **kwargs):
        del device_dense, device_sparse, compression
        for k, v in kwargs.items():
            if k not in self._DEFAULTS:
                raise TypeError(
                    "DistributedGradientTape got an unexpected keyword "
                    f"argument {k!r}")
            if v != self._DEFAULTS[k]:
                raise ValueError(
                    f"DistributedGradientTape: {k}={v!r} is not supported "
                    "by sok_keras.compat.horovod (only its default, "
                    f"{self._DEFAULTS[k]!r}).")
        self._tape = gradtape
        self._op = _check_op(op, None, "DistributedGradientTape")
        self._sparse_as_dense = bool(sparse_as_dense)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """`tf.GradientTape.gradient`, then the reduction over ranks."""
        grads = self._tape.gradient(target, sources, output_gradients,
                                    **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        base = _key("tape", None)
        out = []
        for i, (g, s) in enumerate(zip(flat_grads, flat_sources)):
            if g is None or is_sok_variable(s):
                out.append(g)
                continue
            if isinstance(g, tf.IndexedSlices) and self._sparse_as_dense:
                g = tf.convert_to_tensor(g)
            out.append(allreduce(g, op=self._op, name=f"{base}/{i}"))
        return tf.nest.pack_sequence_as(grads, out)


def DistributedOptimizer(optimizer, name=None, **kwargs):
    """Horovod's optimizer wrapper: here `sok.optimizers.OptimizerWrapper`.

    The wrapper already averages dense gradients over the ranks and trains
    sharded tables sparsely; a `sok.optimizers` class or an
    `OptimizerWrapper` is returned unchanged (it averages already).

    Args:
        optimizer: a Keras optimizer.
        name: optional name of the wrapper.
        **kwargs: Horovod's other arguments (`compression`,
            `backward_passes_per_step`, ...) are accepted and ignored when
            at their defaults.

    Returns:
        A Keras optimizer that averages over the ranks.
    """
    from sok_keras.optimizers import OptimizerWrapper
    from sok_keras.optimizers import sparse_optimizers

    for k, v in kwargs.items():
        if k == "backward_passes_per_step" and v != 1:
            raise ValueError(
                "hvd.DistributedOptimizer: backward_passes_per_step > 1 is "
                f"not supported; got {v!r}.")
        if k == "op" and v not in (None, Average):
            raise ValueError(
                "hvd.DistributedOptimizer: only op=hvd.Average is "
                f"supported; got {v!r}.")
    if isinstance(optimizer, OptimizerWrapper) or isinstance(
            optimizer, sparse_optimizers._TablesMixin):
        return optimizer
    return OptimizerWrapper(optimizer, name=name)


# Horovod names this module does not have, and what to do instead.
_NOT_HERE = {
    "join": "uneven numbers of steps per rank are not supported: every "
            "rank runs the same steps (sok_keras' lookups are collectives "
            "of every rank)",
    "barrier": "every collective already waits for every rank; for a "
               "barrier of its own, hvd.allreduce(tf.constant(0.0), "
               "name='barrier') on every rank",
    "broadcast_object": "broadcast a tensor with hvd.broadcast(tensor, "
                        "root_rank)",
    "allgather_object": "gather tensors with hvd.allgather(tensor), or "
                        "predictions with sok.gather_predictions",
    "alltoall": "sok_keras' lookups do their own all-to-all; no public "
                "alltoall is provided",
    "elastic": "elastic training is not supported (a fixed number of "
               "ranks; sok.dump / sok.load re-shard at another number)",
}


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    provided = sorted(
        n for n, v in globals().items()
        if not n.startswith("_") and (callable(v) or n[0].isupper())
        and getattr(v, "__module__", __name__) == __name__
        and n not in ("Adasum", "Product"))  # (names only: refused)
    hint = _NOT_HERE.get(name)
    raise AttributeError(
        f"module 'sok_keras.compat.horovod' has no attribute {name!r}: "
        + (f"{hint}. " if hint else "")
        + "It provides the part of Horovod's API that SOK's recipes use: "
        + ", ".join(provided) + " (docs/recipes.md).")
