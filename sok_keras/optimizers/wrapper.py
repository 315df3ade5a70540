"""`OptimizerWrapper`: any Keras optimizer, for models with sharded tables."""

import keras
import tensorflow as tf

from sok_keras import world
from sok_keras.variable import is_sok_variable

_UNSUPPORTED_BASE_ARGS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _pack_allreduce_mean(grads, comm, key):
    """All-reduces a list of dense tensors as one buffer per dtype."""
    by_dtype = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    out = list(grads)
    for dtype, idx in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in idx], 0)
        reduced = comm.all_reduce(flat, key=f"{key}/{dtype.name}", op="mean")
        sizes = [tf.size(grads[i]) for i in idx]
        for i, part in zip(idx, tf.split(reduced, sizes)):
            out[i] = tf.reshape(part, tf.shape(grads[i]))
    return out


def broadcast_variables(variables, root=0, key="broadcast_variables"):
    """Copies the values of `variables` on rank `root` to every rank.

    Every rank must call it with the same variables in the same order.
    With one rank it does nothing.

    Args:
        variables: a list of (Keras or TF) variables, not sharded tables.
        root: the rank whose values win. Defaults to 0.
        key: a name for the collective, the same on every rank.
    """
    if world.num_ranks() == 1:
        return
    comm = world.communicator()
    with tf.init_scope():
        for i, v in enumerate(variables):
            if is_sok_variable(v):
                continue
            value = comm.broadcast(
                tf.convert_to_tensor(v.value if hasattr(v, "value") else v),
                key=f"{key}/{i}", root=root)
            v.assign(value)


@keras.saving.register_keras_serializable(package="sok_keras")
class OptimizerWrapper(keras.optimizers.Optimizer):
    """Makes a Keras optimizer train models with sharded tables.

    Wrap the optimizer you would use anyway; the wrapper
    - averages the gradients of dense (replicated) weights across ranks
      (one all-reduce per dtype per step) and starts them identical on every
      rank (broadcast from rank 0 when the optimizer is built);
    - averages the gradients of `sok_keras.Variable` shards the same way
      (each rank's loss is a mean over its own batch) but never all-reduces
      them: each shard is updated by the rank that owns it;
    - delegates every update to the inner optimizer.

    With one rank it only delegates.

    Args:
        inner_optimizer: a `keras.optimizers.Optimizer` instance.
        name: optional name.

    Example:

    >>> model.compile(
    ...     optimizer=sok.optimizers.OptimizerWrapper(
    ...         keras.optimizers.SGD(0.1)),
    ...     loss="binary_crossentropy")
    """

    def __init__(self, inner_optimizer, name=None, **kwargs):
        for arg, default in _UNSUPPORTED_BASE_ARGS.items():
            if arg in kwargs:
                value = kwargs.pop(arg)
                if value != default:
                    raise ValueError(
                        f"OptimizerWrapper does not take `{arg}`. Instead, "
                        f"set `{arg}` on the inner optimizer. Received: "
                        f"{arg}={value!r}."
                    )
        if kwargs:
            raise ValueError(
                "OptimizerWrapper does not take arguments: "
                f"{sorted(kwargs)}."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "OptimizerWrapper wraps a keras.optimizers.Optimizer. "
                f"Received: {type(inner_optimizer).__name__}."
            )
        if isinstance(inner_optimizer, OptimizerWrapper):
            raise ValueError("OptimizerWrapper cannot wrap another one.")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        broadcast_variables(
            [v for v in var_list if not is_sok_variable(v)],
            key="optimizer_wrapper/broadcast")

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def _reduce(self, grads, variables):
        n = world.num_ranks()
        if n == 1:
            return list(grads)
        comm = world.communicator()
        dense_idx, out = [], list(grads)
        for i, (g, v) in enumerate(zip(grads, variables)):
            if g is None:
                continue
            if is_sok_variable(v):
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(
                        g.values / n, g.indices, g.dense_shape)
                else:
                    out[i] = g / n
            else:
                dense_idx.append(i)
        if dense_idx:
            reduced = _pack_allreduce_mean(
                [tf.convert_to_tensor(grads[i]) for i in dense_idx], comm,
                key="optimizer_wrapper/allreduce")
            for i, r in zip(dense_idx, reduced):
                out[i] = r
        return out

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = trainable_variables or self._trainable_variables
        grads = self._reduce(list(grads), variables)
        self.inner_optimizer.apply(grads, trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "OptimizerWrapper runs on the TensorFlow backend with stateful "
            "variables; stateless_apply is not supported."
        )

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = config.copy()
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
