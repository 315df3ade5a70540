"""SOK's experimental namespace, for `from sparse_operation_kit import
experiment as sok` written `from sok_keras import experiment as sok`.

SOK 2 kept its `sok.Variable` / `lookup_sparse` API under `experiment`;
in sok_keras that API is the package itself. This module gives the same
names, so a ported script changes only the package name.

Example:

>>> import sok_keras
>>> from sok_keras import experiment as sok
>>> sok.lookup_sparse is sok_keras.lookup_sparse
True
"""

import sok_keras as _sok
from sok_keras import Init
from sok_keras import OptimizerScope
from sok_keras import OptimizerWrapper
from sok_keras import Variable
from sok_keras import all2all_dense_embedding
from sok_keras import dump
from sok_keras import filter_variables
from sok_keras import init
from sok_keras import load
from sok_keras import lookup_sparse
from sok_keras import num_ranks
from sok_keras import rank
from sok_keras import split_embedding_variable_from_others

__all__ = [
    "Init", "OptimizerScope", "OptimizerWrapper", "Variable",
    "all2all_dense_embedding", "dump", "filter_variables", "init", "load",
    "lookup_sparse", "num_ranks", "rank",
    "split_embedding_variable_from_others",
]


def __getattr__(name):
    # SOK names sok_keras lacks (`DynamicVariable`, ...): the package's
    # own explanation.
    return getattr(_sok, name)
