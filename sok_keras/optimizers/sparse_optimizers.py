"""Keras optimizers that update sharded tables sparsely, directly.

`sok.optimizers.Adam(1e-3)` is a `keras.optimizers.Adam` whose update of a
`sok_keras.Variable` is the lazy sparse rule (only looked-up rows and their
slots change), with the same multi-rank averaging as `OptimizerWrapper`.
Use whichever reads better; `OptimizerWrapper(keras.optimizers.Adam(1e-3))`
behaves the same.
"""

import keras
import tensorflow as tf

from sok_keras.optimizers import sparse_rules
from sok_keras.optimizers import tf_slots
from sok_keras.optimizers.wrapper import _check_supported
from sok_keras.optimizers.wrapper import apply_with_tables
from sok_keras.optimizers.wrapper import broadcast_variables
from sok_keras.optimizers.wrapper import build_once
from sok_keras.optimizers.wrapper import check_jit_compile
from sok_keras.optimizers.wrapper import sync_lazy_variables
from sok_keras.optimizers.wrapper import create_table_slots
from sok_keras.optimizers.wrapper import tf2_keras_arguments
from sok_keras.variable import is_sok_variable
from sok_keras._ops import not_converted as _not_converted


class _TablesMixin(tf_slots.TableSlots):
    """Routes `sok_keras.Variable`s to the sparse rule of the Keras base
    (and gives SOK's and TF's slot methods, `tf_slots.TableSlots`)."""

    def __init__(self, *args, jit_compile="auto", **kwargs):
        super().__init__(*args, **kwargs)
        # As OptimizerWrapper's: whether the dense weights' update runs as
        # one XLA computation (see wrapper.compiles_dense_update).
        self.jit_compile = check_jit_compile(type(self).__name__, jit_compile)
        # Fail early, as OptimizerWrapper does: a rule this class has no
        # sparse form of, `use_ema` and `loss_scale_factor` (which would
        # apply to the dense weights only), and gradient accumulation
        # together with clipping (wrapper._check_supported).
        sparse_rules.rule_for(self)
        _check_supported(self)

    def build(self, var_list):
        dense = [v for v in var_list if not is_sok_variable(v)]
        super().build(dense)
        create_table_slots(self, var_list)
        broadcast_variables(dense, key="sok_optimizer/broadcast",
                            owner=self)

    @_not_converted
    def apply(self, grads, trainable_variables=None):
        build_once(self, trainable_variables)
        variables = trainable_variables or self._trainable_variables
        with tf.control_dependencies(sync_lazy_variables(self, grads)):
            apply_with_tables(self, grads, variables, super().apply,
                              jit_compile=self.jit_compile)

    def apply_gradients(self, grads_and_vars, **kwargs):
        # (SOK's seed: `experimental_aggregate_gradients=False` for tables.)
        return super().apply_gradients(tf2_keras_arguments(
            type(self).__name__, grads_and_vars, kwargs))

    def get_config(self):
        return {**super().get_config(), "jit_compile": self.jit_compile}


def _make(keras_class):
    cls = type(
        keras_class.__name__,
        (_TablesMixin, keras_class),
        {
            "_sok_keras_class": keras_class,
            "__module__": __name__,
            "__doc__": (
                f"`keras.optimizers.{keras_class.__name__}` with a lazy "
                "sparse update for `sok_keras.Variable` tables.\n\n"
                f"Takes the arguments of `keras.optimizers."
                f"{keras_class.__name__}`, and `jit_compile` (\"auto\", "
                "True or False) as `OptimizerWrapper`'s.\n"
            ),
        },
    )
    return keras.saving.register_keras_serializable(package="sok_keras")(cls)


SGD = _make(keras.optimizers.SGD)
Adagrad = _make(keras.optimizers.Adagrad)
Adam = _make(keras.optimizers.Adam)
AdamW = _make(keras.optimizers.AdamW)
Ftrl = _make(keras.optimizers.Ftrl)
RMSprop = _make(keras.optimizers.RMSprop)
Adamax = _make(keras.optimizers.Adamax)
Adadelta = _make(keras.optimizers.Adadelta)
Lion = _make(keras.optimizers.Lion)
Nadam = _make(keras.optimizers.Nadam)
Muon = _make(keras.optimizers.Muon)
