"""`model.compile(optimizer="adam")` on a model with sok tables: the plain
Keras optimizer is wrapped in `OptimizerWrapper`, with one log line.

A plain Keras optimizer would otherwise train a sok model wrongly and say
nothing: dense gradients are not averaged across ranks (the ranks' dense
weights drift apart) and the tables get Keras' dense, full-size slots and
updates. `sok_keras` routes `keras.Model.compile` through `compile_hook`
(installed when sok_keras is imported): when the model holds sok embedding
layers and the optimizer is a Keras optimizer (a string, a config or an
instance) that is not already sok-aware, it is replaced by
`OptimizerWrapper(optimizer)`. Everything else passes through unchanged.
"""

import functools
import logging

import keras

_ORIGINAL_COMPILE = None
_LOG = logging.getLogger("sok_keras")


def _sublayers(layer, seen):
    for sub in getattr(layer, "layers", None) or ():
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        yield sub
        yield from _sublayers(sub, seen)


def has_sok_layers(model):
    """Whether `model` (built or not) holds a sok embedding layer."""
    from sok_keras.layers.base_embedding import BaseEmbedding
    from sok_keras.layers.embedding_collection import EmbeddingCollection

    kinds = (BaseEmbedding, EmbeddingCollection)
    return any(isinstance(layer, kinds)
               for layer in _sublayers(model, {id(model)}))


def is_sok_aware(optimizer):
    from sok_keras.optimizers.sparse_optimizers import _TablesMixin
    from sok_keras.optimizers.wrapper import OptimizerWrapper

    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    return isinstance(optimizer, (OptimizerWrapper, _TablesMixin)) or (
        inner is not None and is_sok_aware(inner))


def wrap_for(model, optimizer):
    """`optimizer`, wrapped in `OptimizerWrapper` if `model` needs it."""
    if optimizer is None or not has_sok_layers(model):
        return optimizer
    opt = keras.optimizers.get(optimizer)
    if is_sok_aware(opt):
        return opt
    from sok_keras.optimizers.wrapper import OptimizerWrapper

    _LOG.warning(
        "sok_keras: model '%s' holds sok embedding tables; its optimizer %s "
        "is wrapped in sok_keras.optimizers.OptimizerWrapper (sparse table "
        "updates, dense gradients averaged over ranks).", model.name,
        type(opt).__name__)
    return OptimizerWrapper(opt)


def install():
    """Routes `keras.Model.compile` through `wrap_for` (idempotent)."""
    global _ORIGINAL_COMPILE
    if _ORIGINAL_COMPILE is not None:
        return
    # Patch the class that defines compile (Keras' Trainer), not
    # keras.Model: Keras skips compile_from_config on load when a model's
    # compile differs from Trainer.compile.
    owner = next(c for c in keras.Model.__mro__ if "compile" in c.__dict__)
    _ORIGINAL_COMPILE = owner.compile

    @functools.wraps(_ORIGINAL_COMPILE)
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        return _ORIGINAL_COMPILE(self, wrap_for(self, optimizer), *args,
                                 **kwargs)

    owner.compile = compile
