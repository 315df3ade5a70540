"""Optimizers for models with sharded `sok_keras.Variable` tables."""

from sok_keras.optimizers.scope import OptimizerScope
from sok_keras.optimizers.sparse_optimizers import SGD
from sok_keras.optimizers.sparse_optimizers import Adadelta
from sok_keras.optimizers.sparse_optimizers import Adagrad
from sok_keras.optimizers.sparse_optimizers import Adam
from sok_keras.optimizers.sparse_optimizers import Adamax
from sok_keras.optimizers.sparse_optimizers import AdamW
from sok_keras.optimizers.sparse_optimizers import Ftrl
from sok_keras.optimizers.sparse_optimizers import Lion
from sok_keras.optimizers.sparse_optimizers import Muon
from sok_keras.optimizers.sparse_optimizers import Nadam
from sok_keras.optimizers.sparse_optimizers import RMSprop
from sok_keras.optimizers.sparse_rules import SUPPORTED
from sok_keras.optimizers.wrapper import OptimizerWrapper
from sok_keras.optimizers.wrapper import broadcast_variables

__all__ = ["SGD", "SUPPORTED", "Adadelta", "Adagrad", "Adam", "Adamax",
           "AdamW", "Ftrl", "Lion", "Muon", "Nadam", "OptimizerScope",
           "OptimizerWrapper", "RMSprop", "broadcast_variables"]
