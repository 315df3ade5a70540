"""Masked and weight-normalised Keras losses divided by global counts on N
ranks.

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

With padding or weights spread unevenly over the ranks, each rank divided
by its own count and N ranks trained another model than one process on
the same global batches (QA: a masked sequence tagger was 0.13 off after
three steps). Inside the train and test steps of a model with sok tables
on several ranks (`fit`, `evaluate`, `train_on_batch`, `test_on_batch`;
every rank runs them, in one program order), those two divisors are now
the ranks' mean count (one scalar all-reduce per such loss and step), so
the mean of the ranks' losses is the loss of the global batch, and so are
the averaged gradients and the logged loss. Everything else (other
reductions, losses in metrics, one rank, `tf.distribute` strategies,
whose convention Keras owns, and a custom `train_step` calling
`compute_loss` itself) is Keras' own.
"""

import contextvars
import functools

import tensorflow as tf

# Whether the loss being computed is one of a step every rank runs.
_GLOBAL = contextvars.ContextVar("sok_keras_global_losses", default=False)
_ORIGINALS = {}


_KEYS = []  # [TraceCounter], made at the first use


def _key():
    """This call site's key: one per loss within a traced step."""
    if not _KEYS:
        from sok_keras.comm import TraceCounter

        _KEYS.append(TraceCounter())
    n = _KEYS[0].next("sok_loss/count")
    return "sok_loss/count" + (str(n) if n else "")


def _global_mean(count):
    """The ranks' mean of the scalar `count` (every rank calls it, in the
    same order: one key per call within a traced step)."""
    from sok_keras import world

    x = tf.reshape(tf.stop_gradient(tf.cast(count, tf.float32)), [1])
    mean = world.communicator().all_reduce(x, key=_key(), op="mean")
    return tf.cast(mean[0], count.dtype)


def _rescaled(value, local):
    """`value` (divided by this rank's `local` count) divided by the
    ranks' mean count instead."""
    ratio = tf.math.divide_no_nan(local, _global_mean(local))
    return value * tf.cast(ratio, value.dtype)


def _apply_mask(sample_weight, mask, dtype, reduction):
    out = _ORIGINALS["apply_mask"](sample_weight, mask, dtype, reduction)
    if (mask is None or reduction not in ("mean", "sum_over_batch_size")
            or not _GLOBAL.get()):
        return out
    local = tf.reduce_sum(tf.cast(mask, dtype))
    return _rescaled(out, local)


def _reduce_values(values, sample_weight=None,
                   reduction="sum_over_batch_size"):
    out = _ORIGINALS["reduce_values"](values, sample_weight, reduction)
    if (reduction != "mean_with_sample_weight" or sample_weight is None
            or not _GLOBAL.get() or values.shape.rank in (None, 0)
            or tuple(values.shape) == (0,)):
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


def install():
    """Routes Keras' mask and `mean_with_sample_weight` divisors through
    the ranks' mean count inside Keras' train and test steps of models
    with sok tables on several ranks (idempotent; see the module
    docstring)."""
    if _ORIGINALS:
        return
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.trainer import Trainer

    _ORIGINALS.update(apply_mask=loss_module.apply_mask,
                      reduce_values=loss_module.reduce_values,
                      compute_loss=Trainer._compute_loss)
    loss_module.apply_mask = _apply_mask
    loss_module.reduce_values = _reduce_values

    @functools.wraps(_ORIGINALS["compute_loss"])
    def _compute_loss(self, *args, **kwargs):
        if not _in_ranks_step(self):
            return _ORIGINALS["compute_loss"](self, *args, **kwargs)
        token = _GLOBAL.set(True)
        try:
            return _ORIGINALS["compute_loss"](self, *args, **kwargs)
        finally:
            _GLOBAL.reset(token)

    Trainer._compute_loss = _compute_loss
