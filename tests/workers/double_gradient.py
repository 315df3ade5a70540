"""Two `tape.gradient` calls over one lookup in a `tf.function` (a
persistent tape), every pooling mode and unpooled, against the same computed
eagerly. Before the fix, TensorFlow's collective runtime aborted ("ProvideBuf
already called") or hung: both gradients' exchanges had one key."""

import numpy as np

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

v = sok.Variable(np.arange(40 * 4).reshape(40, 4) / 10.0, dtype=tf.float32)
ids = tf.ragged.constant([[1 + RANK, 2, 3], [5, 7 + RANK], [9]], tf.int64)
dense_ids = tf.constant([[[1 + RANK], [4]], [[6], [11 + RANK]]], tf.int64)


def embed(pooling):
    if pooling == "unpooled":
        return sok.all2all_dense_embedding(v, dense_ids)
    return sok.lookup_sparse(v, ids, combiners="sum", pooling=pooling)


def two_gradients(pooling):
    with tf.GradientTape(persistent=True) as tape:
        e = embed(pooling)
        l1 = tf.reduce_sum(e)
        l2 = tf.reduce_sum(e * e)
    g1 = tf.convert_to_tensor(tape.gradient(l1, v))
    g2 = tf.convert_to_tensor(tape.gradient(l2, v))
    return g1, g2


def separately(pooling):
    out = []
    for f in (tf.reduce_sum, lambda e: tf.reduce_sum(e * e)):
        with tf.GradientTape() as tape:
            loss = f(embed(pooling))
        out.append(tf.convert_to_tensor(tape.gradient(loss, v)))
    return out


def one_gradient(pooling):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(embed(pooling))
    return tape.gradient(loss, v)


errors = {}
for pooling in ("auto", "home", "owner", "unpooled"):
    want = [g.numpy() for g in separately(pooling)]
    assert float(np.abs(want[1]).sum()) > 0
    fn = tf.function(lambda p=pooling: two_gradients(p))
    single = tf.function(lambda p=pooling: one_gradient(p))
    errors[pooling] = 0.0
    # Steps in a row, and after single-gradient steps of the same lookup:
    # the gradients must not take each other's rows (a fix that counted
    # each collective's runs in the process made the two gradients of one
    # shared backward function swap rows on some ranks).
    for prelude in (None, single, None, single, None):
        if prelude is not None:
            prelude()
        got = [g.numpy() for g in fn()]
        errors[pooling] = max([errors[pooling]] + [
            float(np.abs(a - b).max()) for a, b in zip(got, want)])
# Lookups of one table in nested functions and beside them, in one outer
# step: each has its own key in the outer function (before, each function
# counted its own lookups, so two of them had one key and TensorFlow
# aborted). (One concrete function called twice in one step is still not
# supported: docs/failures.md.)
inner_a = tf.function(lambda x: sok.lookup_sparse(v, x, combiners="sum"))
inner_b = tf.function(lambda x: sok.lookup_sparse(v, x, combiners="mean"))
short = ids[:2]


def nested_cases(nest):
    def sum_mean(x):
        return nest(inner_a)(x), nest(inner_b)(x)

    with tf.GradientTape() as tape:
        a, b = sum_mean(ids)
        c = nest(inner_a)(short)  # another shape: another trace of inner_a
        d = sok.lookup_sparse(v, ids, combiners="sqrtn")  # beside them
        loss = (tf.reduce_sum(a) + 2.0 * tf.reduce_sum(b)
                + 3.0 * tf.reduce_sum(c) + 4.0 * tf.reduce_sum(d * d))
    return loss, tf.convert_to_tensor(tape.gradient(loss, v))


want_loss, want_grad = nested_cases(lambda f: f.python_function)
nested = tf.function(lambda: nested_cases(lambda f: f))
errors["nested"] = 0.0
for _ in range(2):
    loss, grad = nested()
    errors["nested"] = max(
        errors["nested"], abs(float(loss - want_loss)),
        float(np.abs(grad.numpy() - want_grad.numpy()).max()))
write_result({"errors": errors})
