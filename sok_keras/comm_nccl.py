"""The NCCL communicator: collectives between GPU ranks, one GPU per rank.

`sok_keras.init(backend="auto" | "nccl" | "collective")` chooses it: "auto"
takes NCCL when this library has CUDA kernels, NCCL loads, and every rank
has its own GPU (ranks that share a GPU, which NCCL refuses, go through
TensorFlow's collectives instead).

The communicator is created once per process: rank 0 makes NCCL's unique
id, TensorFlow's collective runtime (already started by `init`) broadcasts
it, and every rank joins on its GPU. Every collective is enqueued on the
TensorFlow op's own CUDA stream, in program order (the ops are stateful).
A watchdog thread in the op library polls NCCL's asynchronous errors and
the age of every collective in flight; past the communication timeout it
aborts the communicator (`ncclCommAbort`), so that a dead or stalled peer
ends in an error naming the rank and the collective, not a hang.

NCCL itself is loaded with `dlopen` when the communicator is created, from
`SOK_NCCL_LIBRARY`, else from the `nvidia-nccl-cu12` wheel, else the
system's `libnccl.so.2`: a CPU build never needs it.
"""

import os

import tensorflow as tf

from sok_keras._ops import ops
from sok_keras._ops import register_gradient_once
from sok_keras.comm import Communicator
from sok_keras.comm import _OPS

_NCCL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32,
                tf.int64)


def nccl_library_path():
    """Where NCCL is loaded from: `SOK_NCCL_LIBRARY`, the nvidia-nccl-cu12
    wheel, or the system's `libnccl.so.2` (found by the dynamic loader)."""
    path = os.environ.get("SOK_NCCL_LIBRARY")
    if path:
        return path
    try:
        import nvidia.nccl

        for base in nvidia.nccl.__path__:
            candidate = os.path.join(base, "lib", "libnccl.so.2")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    return "libnccl.so.2"


class NcclCommunicator(Communicator):
    """Collectives over NCCL on this process's GPU.

    Args:
        rank: this process's rank.
        num_ranks: the number of ranks (each on its own GPU).
        unique_id: NCCL's unique id (a uint8 tensor `[128]`), the same on
            every rank; rank 0 makes it with `new_unique_id()`.
        timeout: seconds a collective may run before the communicator is
            aborted with an error.
        library: the NCCL shared library (see `nccl_library_path`).

    Example:

    ```python
    comm = NcclCommunicator(0, 1, NcclCommunicator.new_unique_id())
    comm.all_reduce(tf.ones([4]), "k")
    ```
    """

    def __init__(self, rank, num_ranks, unique_id, timeout=600.0,
                 library=None):
        super().__init__(rank, num_ranks)
        self.library = library or nccl_library_path()
        self.timeout = timeout
        gpus = tf.config.list_logical_devices("GPU")
        if not gpus:
            raise RuntimeError(
                "sok_keras: the NCCL backend needs a GPU, but TensorFlow "
                "sees none. Use sok_keras.init(backend='collective').")
        self.device = gpus[0].name
        with tf.device(self.device):
            self._handle = int(ops().sok_nccl_init(
                id=tf.convert_to_tensor(unique_id, tf.uint8), rank=rank,
                num_ranks=num_ranks, library=self.library,
                timeout_seconds=float(timeout if timeout else 0.0)))

    @staticmethod
    def new_unique_id(library=None):
        """A new NCCL unique id (uint8 `[128]`), made on this rank."""
        with tf.device("/CPU:0"):
            return ops().sok_nccl_unique_id(
                library=library or nccl_library_path())

    def health(self):
        """The error that aborted the communicator, or "" when healthy."""
        with tf.device("/CPU:0"):
            msg = ops().sok_nccl_health(handle=self._handle)
        return msg.numpy().decode() if hasattr(msg, "numpy") else msg

    def abort(self, reason):
        """Aborts the communicator: no collective starts after this, and
        those in flight fail with `reason` instead of waiting (NCCL's
        `ncclCommAbort`, from the op library's watchdog). For when another
        rank has failed (`sok_keras.divergence`); the process's NCCL
        collectives cannot be used again.

        Args:
            reason: the message the failing collectives raise with.
        """
        with tf.device("/CPU:0"):
            ops().sok_nccl_abort(handle=self._handle, reason=str(reason))

    def _h(self):
        return tf.constant(self._handle, tf.int64)

    @staticmethod
    def _wire(x):
        """x in a dtype NCCL carries, and the cast back."""
        dt = x.dtype
        if dt in _NCCL_DTYPES:
            return x, lambda y: y
        if dt.is_integer or dt == tf.bool:
            return tf.cast(x, tf.int64), lambda y: tf.cast(y, dt)
        raise TypeError(
            f"sok_keras's NCCL collectives do not support dtype {dt.name}.")

    def all_reduce(self, x, key, op="sum"):
        if op not in _OPS:
            raise ValueError(f"`op` must be one of {_OPS}, got {op!r}")
        x, back = self._wire(tf.convert_to_tensor(x))
        reduction = "sum" if op == "mean" else op
        with tf.device(self.device):
            y = ops().sok_nccl_all_reduce(x=x, handle=self._h(),
                                          reduction=reduction)
            if op == "mean":
                y = (y / self._num_ranks if y.dtype.is_floating
                     else y // self._num_ranks)
        return back(y)

    def all_gather(self, x, key):
        x = tf.convert_to_tensor(x)
        if x.shape.rank == 0:
            raise ValueError(
                f"all_gather needs a tensor of rank >= 1, got shape {x.shape}")
        x, back = self._wire(x)
        with tf.device(self.device):
            return back(ops().sok_nccl_all_gather(
                x=x, handle=self._h(), num_ranks=self._num_ranks, key=key))

    def broadcast(self, x, key, root=0):
        if not 0 <= root < self._num_ranks:
            raise ValueError(
                f"`root` must be a rank in [0, {self._num_ranks}), got {root}")
        x, back = self._wire(tf.convert_to_tensor(x))
        with tf.device(self.device):
            return back(ops().sok_nccl_broadcast(x=x, handle=self._h(),
                                                 root=root))

    def _exchange(self, x, counts_matrix, site):
        x, back = self._wire(x)
        c = tf.cast(counts_matrix, tf.int64)
        with tf.device(self.device):
            y = ops().sok_nccl_all_to_all(
                x=x, send_counts=c[self._rank, :], recv_counts=c[:, self._rank],
                handle=self._h())
        return back(y)


@register_gradient_once("SokNcclAllReduce")
def _all_reduce_grad(op, dy):
    """A sum's gradient is the sum of the gradients (max/min: none)."""
    reduction = op.get_attr("reduction")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction != "sum":
        raise LookupError(
            f"sok_keras: NCCL all_reduce '{reduction}' has no gradient.")
    return [ops().sok_nccl_all_reduce(x=dy, handle=op.inputs[1],
                                      reduction="sum"), None]


@register_gradient_once("SokNcclAllGather")
def _all_gather_grad(op, dy):
    """Each rank's slice of the summed gradient (a reduce-scatter)."""
    x = op.inputs[0]
    summed = ops().sok_nccl_all_reduce(x=dy, handle=op.inputs[1],
                                       reduction="sum")
    k = tf.shape(x)[0]
    from sok_keras import world

    me = world.rank()
    return [summed[me * k:(me + 1) * k], None]
