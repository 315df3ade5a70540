"""Keras 3 `model.fit` under `MultiWorkerMirroredStrategy`, for sok models.

Upstream bug (keras-team/keras#20585, open since Keras 3.0 / TF 2.16):
before the first step, the TensorFlow trainer's `_maybe_symbolic_build`
takes the first batch of the distributed dataset and, when it holds
`PerReplica` values, calls `strategy.reduce("MEAN", batch, axis=None)` to
get one batch to build the model symbolically from. Under a multi-worker
strategy that reduction fails (`ValueError: Attempt to convert a value
(PerReplica:{...}) with an unsupported type`), so `fit`, `evaluate` and
`predict` never start. Averaging the *data* is meaningless anyway (the
symbolic build needs only shapes and dtypes; a mean of ids is not an id).

A second failure follows once that is out of the way: each step's logs
(scalars) are reduced with `strategy.reduce("MEAN", v, axis=0)` under a
multi-worker strategy, which raises for a scalar ("Invalid reduction
dimension 0 for input with 0 dimensions").

The fixes, as narrow as they go: for models that hold sok embedding layers,
under a `MultiWorkerMirroredStrategy` in multi-worker mode, this worker's
first local replica batch is used for the symbolic build instead of the
cross-worker mean; and a scalar log under a multi-worker strategy is
averaged over the replicas with `axis=None` (the case that raises; other
values, reductions and strategies go to Keras unchanged). Everything else
in Keras is unchanged (other models, other strategies, the training step
itself). `sok_keras.init()` installs
it when it adopts the program's own strategy.

`tests/test_recipes_strategy.py` checks that the upstream bug is still
there (a plain Keras model under the same strategy); when that check
fails, Keras has fixed it and this module can go.
"""

import functools

_ORIGINAL = None
_ORIGINAL_REDUCE = None


def _multi_worker(strategy):
    import tensorflow as tf

    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and strategy.extended._in_multi_worker_mode())


def _first_local(strategy, batch):
    import tensorflow as tf
    from keras.src import tree

    def local(x):
        if isinstance(x, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(x)[0]
        return x

    return tree.map_structure(local, batch)


def install():
    """Routes `_maybe_symbolic_build` of Keras' TensorFlow trainer through
    the fix (idempotent)."""
    global _ORIGINAL, _ORIGINAL_REDUCE
    from keras.src.backend.tensorflow import trainer as trainer_module
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    if _ORIGINAL is not None:
        return
    _ORIGINAL_REDUCE = trainer_module.reduce_per_replica

    @functools.wraps(_ORIGINAL_REDUCE)
    def reduce_per_replica(values, strategy, reduction):
        import tensorflow as tf
        from keras.src import tree

        if reduction not in ("auto", "mean") or not _multi_worker(strategy):
            return _ORIGINAL_REDUCE(values, strategy, reduction)

        def one(v):
            if (isinstance(v, (tf.distribute.DistributedValues, tf.Tensor))
                    and v.shape.rank == 0):
                return strategy.reduce("MEAN", v, axis=None)
            return _ORIGINAL_REDUCE(v, strategy, reduction)

        return tree.map_structure(one, values)

    trainer_module.reduce_per_replica = reduce_per_replica
    _ORIGINAL = TensorFlowTrainer._maybe_symbolic_build

    @functools.wraps(_ORIGINAL)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        from sok_keras.optimizers.auto_wrap import has_sok_layers

        strategy = getattr(self, "_distribute_strategy", None)
        if (iterator is None or data_batch is not None or strategy is None
                or not _multi_worker(strategy) or not has_sok_layers(self)):
            return _ORIGINAL(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            data_batch = _first_local(strategy, next(it))
            break
        if data_batch is None:  # an empty dataset: Keras' own message
            return _ORIGINAL(self, iterator=iterator)
        return _ORIGINAL(self, iterator=None, data_batch=data_batch)

    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


def uninstall():
    """Restores Keras' own `_maybe_symbolic_build`."""
    global _ORIGINAL, _ORIGINAL_REDUCE
    from keras.src.backend.tensorflow import trainer as trainer_module
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    if _ORIGINAL is not None:
        TensorFlowTrainer._maybe_symbolic_build = _ORIGINAL
        trainer_module.reduce_per_replica = _ORIGINAL_REDUCE
        _ORIGINAL = _ORIGINAL_REDUCE = None
