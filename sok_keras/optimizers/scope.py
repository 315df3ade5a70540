"""`OptimizerScope`: SOK's way of asking for sparse updates of tables."""

import threading

import keras

from sok_keras.variable import is_sok_variable

_LOCK = threading.RLock()
_NAMES = ("SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop")


class OptimizerScope:
    """Keras optimizers created inside this scope update tables sparsely.

    Inside the `with` block, `keras.optimizers.Adam` (also reached as
    `tf.keras.optimizers.Adam`) and the other supported names resolve to
    `sok_keras.optimizers.Adam` etc.: Keras optimizers whose update of a
    `sok_keras.Variable` is the lazy sparse rule. Outside the block nothing
    changes. This keeps SOK's training loops running unchanged; new code can
    use `sok.optimizers.Adam(...)` or `OptimizerWrapper(...)` directly.

    Args:
        variables: the sharded tables the optimizers will train (checked to
            be `sok_keras.Variable`s).

    Example:

    >>> with sok.OptimizerScope(emb_vars):
    ...     emb_opt = tf.keras.optimizers.Adam(learning_rate=0.1)
    >>> emb_opt.apply_gradients(zip(emb_grads, emb_vars))
    """

    def __init__(self, variables):
        variables = list(variables)
        for v in variables:
            if not is_sok_variable(v):
                raise TypeError(
                    "OptimizerScope takes sok_keras.Variable tables. "
                    f"Received: {type(v).__name__} "
                    f"{getattr(v, 'name', '')!r}."
                )
        self.variables = variables
        self._saved = []  # a stack: the same scope may be entered nested

    def __enter__(self):
        from sok_keras.optimizers import sparse_optimizers

        _LOCK.acquire()
        self._saved.append(
            {n: getattr(keras.optimizers, n) for n in _NAMES})
        for n in _NAMES:
            setattr(keras.optimizers, n, getattr(sparse_optimizers, n))
        return self

    def __exit__(self, *exc):
        try:
            for n, cls in self._saved.pop().items():
                setattr(keras.optimizers, n, cls)
        finally:
            _LOCK.release()
        return False
