"""sok_keras: sharded embedding tables for Keras 3 (TensorFlow backend).

`import sok_keras as sok`, call `sok.init()` first thing, then build an
ordinary Keras model with `sok.layers.DistributedEmbedding` /
`LocalizedEmbedding`, compile it with
`sok.optimizers.OptimizerWrapper(keras_optimizer)` and call `model.fit`.
Run it as N processes with `sokrun -np N python train.py`.
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _e:
    raise ImportError(
        "sok_keras needs TensorFlow 2.21, which is not installed (the "
        "package leaves the choice of build to an extra). Install it: "
        "`pip install tensorflow-cpu~=2.21.0`, or for GPUs `pip install "
        "'tensorflow[and-cuda]~=2.21.0' nvidia-nccl-cu12`; or install "
        "sok_keras with it, from its checkout: `pip install '.[cpu]'` or "
        "`pip install '.[gpu]'`.") from _e

from sok_keras import _ops  # noqa: E402
from sok_keras import callbacks
from sok_keras import checkpoint
from sok_keras import data
from sok_keras import layers
from sok_keras import optimizers
from sok_keras._version import __version__
from sok_keras.checkpoint import CheckpointError
from sok_keras.checkpoint import dump
from sok_keras.checkpoint import load
from sok_keras.consistency import InconsistentRanksError
from sok_keras.divergence import RankDivergedError
from sok_keras.serving import export_for_serving
from sok_keras.global_views import RankMismatchError
from sok_keras.global_views import gather_predictions
from sok_keras.data import shard_batches
from sok_keras.layers import All2AllDenseEmbedding
from sok_keras.layers import DistributedEmbedding
from sok_keras.layers import EmbeddingCollection
from sok_keras.layers import LocalizedEmbedding
from sok_keras.lookup import all2all_dense_embedding
from sok_keras.lookup import lookup_sparse
from sok_keras.optimizers import OptimizerScope
from sok_keras.optimizers import OptimizerWrapper
from sok_keras.variable import Variable
from sok_keras.variable import filter_variables
from sok_keras.variable import split_embedding_variable_from_others
from sok_keras.world import init
from sok_keras.world import num_ranks
from sok_keras.world import rank


def Init(global_batch_size=None, **kwargs):
    """SOK's name for `init()`; `global_batch_size` is accepted and unused.

    Args:
        global_batch_size: ignored (SOK needed it; sok_keras does not).
        **kwargs: passed to `init()`.

    Returns:
        What `init()` returns.
    """
    del global_batch_size
    return init(**kwargs)


# Load the op library now: a library built for another TensorFlow fails
# at import with a clear ImportError rather than at the first lookup.
_ops.ops()

# model.compile(optimizer="adam") on a model with sok tables wraps the
# optimizer in OptimizerWrapper (with a log line) instead of training wrongly.
from sok_keras.optimizers import auto_wrap as _auto_wrap  # noqa: E402

_auto_wrap.install()
# summary() / count_params() count sok tables by their global shape.
from sok_keras import global_views as _global_views  # noqa: E402

_global_views.install()

# model.save / load_model of models with sok tables go through files on
# disk rather than whole in memory (sok_keras/_keras_h5.py).
from sok_keras import _keras_h5 as _keras_h5  # noqa: E402

_keras_h5.install()
# model.save / save_weights of models with sok tables: atomic on one rank,
# one writer on several (sok_keras/saving.py).
from sok_keras import saving as _saving  # noqa: E402

_saving.install()

# tf.saved_model.save of a model whose optimizer has made tables' slots
# writes them as plain variables, which tf.saved_model.load can read.
from sok_keras.optimizers import tf_slots as _tf_slots  # noqa: E402

_tf_slots.install()

# model.export of a model with sok tables writes export_for_serving's
# SavedModel, which serves without sok_keras.
from sok_keras import tensorboard as _tensorboard  # noqa: E402

_tensorboard.install_histograms()
from sok_keras import serving as _serving  # noqa: E402

_serving.install()

# On N ranks a masked (or mean_with_sample_weight) loss divides by the
# ranks' mean count, so N ranks train as one process on the global batch.
from sok_keras import global_losses as _global_losses  # noqa: E402

_global_losses.install()

# SOK names sok_keras does not have, and what to use instead: a ported
# script gets this, not a bare AttributeError.
_NOT_IN_SOK_KERAS = {
    "DynamicVariable": "dynamic (hash-table) embeddings are not supported: "
                       "use sok.Variable with a vocabulary size and map raw "
                       "keys to ids in [0, V) first (keras.layers.Hashing or "
                       "IntegerLookup)",
    "DistributedVariable": "use sok.Variable(..., mode='distributed')",
    "LocalizedVariable": "use sok.Variable(..., mode='localized:<rank>')",
    "raw_ops": "the op library's ops are internal; use sok.lookup_sparse / "
               "sok.all2all_dense_embedding",
    "SGD": "use sok.optimizers.SGD or "
           "sok.OptimizerWrapper(keras.optimizers.SGD(...))",
    "assign": "use table.assign(value) (the local shard) or "
              "table.assign_global(whole_table)",
    "sparse_read_and_evict": "dynamic tables are not supported",
    "export": "SOK's export(var) reads a dynamic table's keys and values, "
              "and dynamic tables are not supported: a table's whole "
              "value is table.read_global() (every rank calls it), this "
              "rank's shard table.numpy(); for serving, "
              "sok.export_for_serving(model, path)",
    "incremental_model_dump": "use sok.dump / sok.load (sharded "
                              "checkpoints) or model.save",
    "set_comm_tool": "sok_keras picks its communicator at sok.init("
                     "backend=...)",
    # SOK 1.x
    "tf": "SOK 1's sok.tf.keras.optimizers.Adam is sok.optimizers.Adam (or "
          "tf.keras.optimizers.Adam made inside sok.OptimizerScope)",
    "Saver": "use sok.dump / sok.load (sharded checkpoints, any number of "
             "ranks) or model.save / keras.models.load_model",
}


def __getattr__(name):
    if name == "tf_version":  # SOK's: `if sok.tf_version[0] == 2: ...`
        import tensorflow as tf

        return [int(v) for v in tf.__version__.split("+")[0].split(".")[:3]
                if v.isdigit()]
    if name in _NOT_IN_SOK_KERAS:
        raise AttributeError(
            f"sok_keras has no {name!r} (a SparseOperationKit name): "
            f"{_NOT_IN_SOK_KERAS[name]}. See docs/recipes.md.")
    raise AttributeError(f"module 'sok_keras' has no attribute {name!r}")


__all__ = [
    "__version__",
    "All2AllDenseEmbedding", "CheckpointError", "DistributedEmbedding",
    "EmbeddingCollection", "InconsistentRanksError",
    "Init",
    "LocalizedEmbedding", "OptimizerScope", "OptimizerWrapper",
    "RankDivergedError", "RankMismatchError", "Variable",
    "all2all_dense_embedding", "callbacks", "checkpoint", "data", "dump",
    "export_for_serving",
    "filter_variables", "gather_predictions",
    "init", "layers", "load", "lookup_sparse", "num_ranks", "optimizers",
    "rank",
    "shard_batches", "split_embedding_variable_from_others",
]
