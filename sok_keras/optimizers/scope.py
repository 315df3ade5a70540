"""`OptimizerScope`: SOK's way of asking for sparse updates of tables."""

import threading

import keras

from sok_keras.variable import is_sok_variable

_LOCK = threading.RLock()
_NAMES = ("SGD", "Adagrad", "Adam", "AdamW", "Ftrl", "RMSprop", "Adamax",
          "Adadelta", "Lion", "Nadam", "Muon")


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

    ```python
    with sok.OptimizerScope(emb_vars):
        emb_opt = tf.keras.optimizers.Adam(learning_rate=0.1)
    emb_opt.apply_gradients(zip(emb_grads, emb_vars))
    ```
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
        base = keras.optimizers.Optimizer
        self._saved.append(
            ({n: getattr(keras.optimizers, n) for n in _NAMES},
             base.__dict__.get("apply_gradients")))
        for n in _NAMES:
            setattr(keras.optimizers, n, getattr(sparse_optimizers, n))
        base.apply_gradients = _refusing_plain_updates(base.apply_gradients)
        return self

    def __exit__(self, *exc):
        try:
            names, apply_gradients = self._saved.pop()
            for n, cls in names.items():
                setattr(keras.optimizers, n, cls)
            base = keras.optimizers.Optimizer
            if apply_gradients is None:
                del base.apply_gradients
            else:
                base.apply_gradients = apply_gradients
        finally:
            _LOCK.release()
        return False


def _refusing_plain_updates(apply_gradients):
    """`apply_gradients` that refuses, inside the scope, an optimizer made
    outside it applied to tables: SOK 1 put the scope around the update, but
    here the scope acts on the optimizer's creation. A plain Keras optimizer
    would update the tables densely, with gradients summed over the ranks
    (N times the step, silently)."""

    def checked(self, grads_and_vars, *args, **kwargs):
        from sok_keras.optimizers.auto_wrap import is_sok_aware

        grads_and_vars = list(grads_and_vars)
        tables = [v for _, v in grads_and_vars if is_sok_variable(v)]
        if tables and not is_sok_aware(self):
            raise ValueError(
                f"sok.OptimizerScope: optimizer '{self.name}' "
                f"({type(self).__name__}) was made outside the scope and "
                f"applies gradients to tables ('{tables[0].path}', ...) "
                "inside it. Here the scope goes around the optimizer's "
                "creation, not around `apply_gradients` (SOK 1's place): "
                "`with sok.OptimizerScope(tables): opt = "
                "tf.keras.optimizers.Adam(...)`, then `opt.apply_gradients("
                "...)` anywhere (docs/recipes.md, difference 2). A plain "
                "Keras optimizer would update the tables densely, with "
                "their gradients summed over the ranks.")
        return apply_gradients(self, grads_and_vars, *args, **kwargs)

    return checked
