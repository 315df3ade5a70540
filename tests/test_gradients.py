"""`sok_keras._gradients.weak`: custom gradients that free their graphs."""

import gc

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.framework.func_graph import FuncGraph

from sok_keras import _gradients


def _custom(x):
    @tf.custom_gradient
    def fn(x):
        return x * 2.0, lambda dy: dy * 3.0  # a gradient unlike the op's

    return fn


def _graphs():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, FuncGraph))


def _registered():
    gc.collect()
    return sum(1 for k in ops._gradient_registry._registry
               if k.startswith("CustomGradient-"))


def test_a_dropped_function_frees_its_graph_its_variable_and_its_entry():
    """With `tf.custom_gradient` alone, each traced call stays in
    TensorFlow's gradient registry for good, and with it the graph and the
    variables it captured (a table and its slots per model on N ranks)."""
    x = tf.constant([1.0, 2.0])
    graphs, entries = _graphs(), _registered()

    def memory():
        gc.collect()
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    for weak in (True, False):
        before = memory()
        with tf.device("/CPU:0"):
            v = tf.Variable(tf.ones([1 << 20]))  # 4 MiB

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                fn = _custom(x)
                y = (_gradients.weak(fn) if weak else fn)(x) * v[:2]
            return tape.gradient(y, x)

        np.testing.assert_allclose(step().numpy(), [3.0, 3.0])
        step = v = None
        if weak:
            assert _graphs() == graphs and _registered() == entries
            assert memory() - before < 1 << 20
        else:  # what `weak` prevents, on this TensorFlow
            assert _graphs() > graphs and _registered() > entries
            assert memory() - before >= 4 << 20


def test_gradients_built_later_and_in_branches_still_work():
    """The gradient is found while its graph lives: an eager tape over a
    `tf.function` call builds the function's backward after tracing, and
    a `tf.cond` branch's op lives in the branch's graph."""
    x = tf.constant([1.0, 2.0])

    @tf.function
    def forward(x, flag):
        fn = _gradients.weak(_custom(x))
        return tf.cond(flag, lambda: fn(x), lambda: fn(x) * 10.0)

    for flag, want in ((True, 3.0), (False, 30.0)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = forward(x, tf.constant(flag))
        gc.collect()
        np.testing.assert_allclose(tape.gradient(y, x).numpy(), [want] * 2)
    # Eagerly nothing is registered: the function runs as it is.
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = _gradients.weak(_custom(x))(x)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [3.0, 3.0])
