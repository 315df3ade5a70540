"""Compatibility modules for code written for other runtimes.

- `sok_keras.compat.horovod`: a small `horovod.tensorflow`-compatible
  module over sok_keras's runtime, so that SparseOperationKit's Horovod
  recipes run with only `import horovod.tensorflow as hvd` changed to
  `import sok_keras.compat.horovod as hvd`.
"""
