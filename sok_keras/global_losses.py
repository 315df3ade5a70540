"""Masked, weight-normalised and summed Keras losses divided by global
counts on N ranks.

Each rank's loss is a mean over its own slice of the global batch, and the
ranks' gradients are averaged (docs/design.md, "Data parallelism and
averaging"). That is the single-process mean only when every rank divides
by the same count. Two of Keras' reductions divide by a count that depends
on the data:

- a loss on a masked output (an unpooled sok lookup puts `ids != -1` on
  its output, and `Dense`, RNNs with `return_sequences=True`,
  `TimeDistributed` carry it to the loss) with `"sum_over_batch_size"`
  (Keras' default) divides by the number of unmasked positions
  (`keras.src.losses.loss.apply_mask`);
- `reduction="mean_with_sample_weight"` divides by the sum of the sample
  weights (`reduce_values`).

And `reduction="sum"` divides by nothing: the ranks' mean of their sums
is 1/N of the global batch's sum (QA: the loss and every gradient were
halved on 2 ranks). Inside those steps such a loss is multiplied by the
number of ranks (no collective): those of `compile`'s loss, the batch's
outputs' (a sum-reduced penalty on weights in `add_loss` is the same on
every rank and left alone). A custom loss function returning a
scalar is left as it is: Keras cannot tell a sum from a mean there, and
it is averaged over the ranks as a mean (README, custom `train_step`).

With padding or weights spread unevenly over the ranks, each rank divided
by its own count and N ranks trained another model than one process on
the same global batches (QA: a masked sequence tagger was 0.13 off after
three steps). Inside the train and test steps of a model with sok
tables on several ranks (those of `fit`, `evaluate`, `train_on_batch`,
`test_on_batch`: every rank runs them, in one program order; a custom
`train_step` or `compute_loss` included), those two divisors are now the
ranks' mean count (one scalar all-reduce per such loss and step), so the
mean of the ranks' losses is the loss of the global batch, and so are the
averaged gradients and, with equal per-rank batch sizes, the logged loss
(Keras' loss tracker weighs each rank's loss by its batch size). Not in a
`tf.cond` branch of the step (which may run on some ranks only: there the
rank's own count divides, as before), nor on one rank, nor under a
`tf.distribute` strategy, whose convention Keras owns (each replica's
mean). A data-dependent Python `if` around a loss in an eagerly run step
(`run_eagerly=True`) that differs between ranks would leave one rank in
the all-reduce until `SOK_COMM_TIMEOUT`.
"""

import contextvars
import functools

import tensorflow as tf
from tensorflow.python.ops.control_flow_v2_func_graphs import (
    CondBranchFuncGraph)

from sok_keras.comm import TraceCounter

# While a step that every rank runs is traced (or runs eagerly): the graph
# it is traced in (True eagerly); None otherwise.
_GLOBAL = contextvars.ContextVar("sok_keras_global_losses", default=None)
# While `compile`'s loss (Keras' `CompileLoss`) runs: the losses of the
# batch's outputs. A sum-reduced loss elsewhere (`add_loss` of a penalty
# on weights, the same on every rank) is no sum over the batch.
_COMPILED = contextvars.ContextVar("sok_keras_compiled_loss", default=False)
_ORIGINALS = {}
_KEYS = TraceCounter()


def _in_a_branch():
    """Whether the graph being traced is a branch of a `tf.cond` (or
    `switch_case`) inside the step (the graph `_GLOBAL` holds), at any
    depth: a branch may run on some ranks only, so no collective may be
    added there. (Keras runs the step itself in a `tf.cond` branch with
    `steps_per_execution` > 1: that one every rank takes alike.)"""
    if tf.executing_eagerly():
        return False
    step = _GLOBAL.get()
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph is not step:
        if isinstance(graph, CondBranchFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _global_mean(count):
    """The ranks' mean of the scalar `count` (every rank calls it, in the
    same order: one key per call within a traced step)."""
    from sok_keras import world

    n = _KEYS.next("sok_loss/count")
    x = tf.reshape(tf.stop_gradient(tf.cast(count, tf.float32)), [1])
    mean = world.communicator().all_reduce(
        x, key="sok_loss/count" + (str(n) if n else ""), op="mean")
    return tf.cast(mean[0], count.dtype)


def _rescaled(value, local):
    """`value` (divided by this rank's `local` count) divided by the
    ranks' mean count instead."""
    ratio = tf.math.divide_no_nan(local, _global_mean(local))
    return value * tf.cast(ratio, value.dtype)


def _active():
    return _GLOBAL.get() is not None and not _in_a_branch()


def _apply_mask(sample_weight, mask, dtype, reduction):
    # Keras weighs each unmasked position total / valid (its count here).
    out = _ORIGINALS["apply_mask"](sample_weight, mask, dtype, reduction)
    if (mask is None or reduction not in ("mean", "sum_over_batch_size")
            or not _active()):
        return out
    local = tf.reduce_sum(tf.cast(mask, dtype))
    return _rescaled(out, local)


def _reduce_values(values, sample_weight=None,
                   reduction="sum_over_batch_size"):
    # Keras divides the sum by the weights' sum (its sum here); a scalar
    # is returned as it is. The collective never depends on the data (an
    # empty batch on one rank still takes part).
    out = _ORIGINALS["reduce_values"](values, sample_weight, reduction)
    shape = getattr(values, "shape", ())
    if getattr(shape, "rank", None if shape is None else len(shape)) == 0:
        return out
    if (reduction == "sum" and _GLOBAL.get() is not None
            and _COMPILED.get()):
        # The global batch's sum is the ranks' sum: N times their mean
        # (no collective, so in a `tf.cond` branch as well).
        from sok_keras import world

        return out * tf.cast(world.num_ranks(), out.dtype)
    if (reduction != "mean_with_sample_weight" or sample_weight is None
            or not _active()):
        return out
    local = tf.cast(tf.reduce_sum(sample_weight), out.dtype)
    return _rescaled(out, local)


def _in_ranks_step(model):
    from sok_keras import world
    from sok_keras.optimizers.auto_wrap import has_sok_layers
    from sok_keras.optimizers.auto_wrap import is_sok_aware
    from sok_keras.optimizers.wrapper import under_strategy

    return (world.num_ranks() > 1 and not under_strategy()
            and (has_sok_layers(model)
                 or is_sok_aware(getattr(model, "optimizer", None))))


def _globally_divided(step_function):
    """`step_function` (a train or test step) with `_GLOBAL` set while it
    is traced or runs eagerly."""

    @functools.wraps(step_function)
    def step(*args, **kwargs):
        token = _GLOBAL.set(True if tf.executing_eagerly()
                            else tf.compat.v1.get_default_graph())
        try:
            return step_function(*args, **kwargs)
        finally:
            _GLOBAL.reset(token)

    return step


def install():
    """Routes Keras' mask and `mean_with_sample_weight` divisors through
    the ranks' mean count inside the train and test steps of models with
    sok tables on several ranks (idempotent; see the module docstring)."""
    if _ORIGINALS:
        return
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.compile_utils import CompileLoss

    _ORIGINALS.update(apply_mask=loss_module.apply_mask,
                      reduce_values=loss_module.reduce_values,
                      make_function=TensorFlowTrainer._make_function,
                      compile_loss=CompileLoss.__call__)
    loss_module.apply_mask = _apply_mask
    loss_module.reduce_values = _reduce_values

    @functools.wraps(_ORIGINALS["compile_loss"])
    def compile_loss(self, *args, **kwargs):
        token = _COMPILED.set(True)
        try:
            return _ORIGINALS["compile_loss"](self, *args, **kwargs)
        finally:
            _COMPILED.reset(token)

    CompileLoss.__call__ = compile_loss

    @functools.wraps(_ORIGINALS["make_function"])
    def _make_function(self, step_function):
        # (The train and test steps; `predict_step` computes no loss.)
        if step_function != self.predict_step and _in_ranks_step(self):
            step_function = _globally_divided(step_function)
        return _ORIGINALS["make_function"](self, step_function)

    TensorFlowTrainer._make_function = _make_function
