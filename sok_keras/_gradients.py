"""`tf.custom_gradient` that lets go of the graphs it was traced into.

Inside a `tf.function`, `tf.custom_gradient` registers each call's gradient
function under a new name ("CustomGradient-<uid>") in TensorFlow's global
gradient registry, and never removes it. The function's closure holds
tensors of the traced graph, and the graph holds the variables it captured:
every model a process dropped kept its tables and slots in memory (on N
ranks through the exchange's gradient; on one, through the all-reduce that
Keras' optimizer runs on the dense gradients).

Inside `held_by_graph()`, each gradient function registered meanwhile is
held weakly by the registry and strongly by the graph being traced: it
lives exactly as long as that graph (which anything that builds the
gradient later, an outer tape or a function's backward, keeps alive), and
its registry entry goes with it. `weak(fn)` runs a `tf.custom_gradient`
function inside it. Eagerly, nothing is registered and nothing changes.
"""

import contextlib
import functools
import weakref

import tensorflow as tf
from tensorflow.python.framework import ops

_PREFIX = "CustomGradient-"
# The graph's attribute holding the gradient functions registered in it.
_KEEP = "_sok_keras_gradient_functions"


def graph_list(graph, name):
    """The list kept on `graph` as attribute `name` (made on first use):
    state that lives and dies with the graph."""
    if not hasattr(graph, name):  # (graphs have no `__dict__`)
        setattr(graph, name, [])
    return getattr(graph, name)


def _weakly_registered(name, graph):
    registry = ops._gradient_registry._registry
    entry = registry.get(name)
    if entry is None or getattr(entry["type"], "_sok_keras_weak", False):
        return  # (gone, or another thread's, traced into the same graph)
    grad_fn = entry["type"]
    graph_list(graph, _KEEP).append(grad_fn)
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


@contextlib.contextmanager
def held_by_graph():
    """Gradient functions registered inside the block are held by the
    graph being traced, not for good by the registry (see the module)."""
    if tf.executing_eagerly():
        yield
        return
    registry = ops._gradient_registry._registry
    before = set(registry)
    try:
        yield
    finally:
        graph = tf.compat.v1.get_default_graph()
        for name in [k for k in registry
                     if k.startswith(_PREFIX) and k not in before]:
            _weakly_registered(name, graph)


def weak(fn):
    """Wraps `fn`, a `tf.custom_gradient` function, to run it inside
    `held_by_graph()`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with held_by_graph():
            return fn(*args, **kwargs)

    return wrapper
