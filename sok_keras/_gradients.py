"""`tf.custom_gradient` that lets go of the graphs it was traced into.

Inside a `tf.function`, `tf.custom_gradient` registers each call's gradient
function under a new name ("CustomGradient-<uid>") in TensorFlow's global
gradient registry, and never removes it. The function's closure holds
tensors of the traced graph, and the graph holds the variables it captured:
every model a process dropped kept its tables and slots in memory (on N
ranks, the exchange's gradient; a shard with Adam's slots per model built
again).

`weak(fn)` wraps a `tf.custom_gradient` function so that, after each traced
call, the registry holds the new gradient function weakly and the graph the
call was traced into holds it strongly: it lives exactly as long as that
graph (which anything that builds the gradient later, an outer tape or a
function's backward, keeps alive), and its registry entry goes with it.
Eagerly, nothing is registered and `fn` runs as it is.
"""

import functools
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops

_PREFIX = "CustomGradient-"
# The graph's attribute holding the gradient functions registered in it.
_KEEP = "_sok_keras_gradient_functions"


def _weakly_registered(name, graph):
    registry = ops._gradient_registry._registry
    entry = registry.get(name)
    if entry is None:
        return
    grad_fn = entry["type"]
    if getattr(grad_fn, "_sok_keras_weak", False):
        return  # (another thread's call, traced into the same graph)
    if not hasattr(graph, _KEEP):
        setattr(graph, _KEEP, [])
    getattr(graph, _KEEP).append(grad_fn)
    ref = weakref.ref(grad_fn)

    def weak_grad_fn(op, *grads):
        fn = ref()
        if fn is None:  # (its graph is gone: nothing can reach this op)
            raise LookupError(f"sok_keras: the graph of gradient {name!r} "
                              "was freed")
        return fn(op, *grads)

    weak_grad_fn._sok_keras_weak = True
    entry["type"] = weak_grad_fn
    weakref.finalize(grad_fn, registry.pop, name, None)


def weak(fn):
    """Wraps `fn`, a `tf.custom_gradient` function (see the module)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if tf.executing_eagerly():
            return fn(*args, **kwargs)
        registry = ops._gradient_registry._registry
        before = set(registry)
        out = fn(*args, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        for name in [k for k in registry
                     if k.startswith(_PREFIX) and k not in before]:
            _weakly_registered(name, graph)
        return out

    return wrapper
