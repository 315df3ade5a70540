"""Optimizers for models with sharded `sok_keras.Variable` tables."""

from sok_keras.optimizers.wrapper import OptimizerWrapper
from sok_keras.optimizers.wrapper import broadcast_variables

__all__ = ["OptimizerWrapper", "broadcast_variables"]
