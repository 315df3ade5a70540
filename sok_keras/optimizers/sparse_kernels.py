"""Sparse ("lazy") optimizer updates on whole embedding tables.

Each function here updates a table variable and its optimizer slots in place
with one compiled op (``SokSparseApply*``), touching only the rows named in
``indices``:

* ``indices`` is an int64 (or int32) vector ``[k]`` of local row ids; the
  same id may appear several times.
* ``grad`` is ``[k] + var.shape[1:]`` (usually ``[k, D]``); it is cast to the
  variable's dtype (float16, bfloat16, float32 or float64).
* Precision: a float32/float64 table computes in its own dtype. A float16 or
  bfloat16 table has float32 slots (``slot_dtype``), and its update runs in
  float32: the gradient is loaded (duplicates summed) in float32, the rule
  computes in float32 and the new row is rounded once, to nearest even, when
  it is stored.
* Duplicate ids are summed first (deterministically, in order of position),
  then every unique row gets exactly one update with its summed gradient
  ``g``. Rows not present in ``indices`` -- and their slot entries -- are not
  read or written (the "lazy" rule; for SGD/Adagrad this is exactly Keras'
  sparse update, for the other rules Keras would also decay the slots of
  absent rows).
* The formulas match Keras 3's optimizers (``keras/src/optimizers``)
  element by element.

Variables may be ``keras.Variable`` (its ``.value`` is used) or
``tf.Variable`` (resource variables). Hyperparameters may be Python numbers
or scalar tensors/variables (e.g. a learning rate from a schedule); they are
cast to the slot dtype (``slot_dtype(var.dtype)``).

Every index is checked against ``[0, rows)`` and all shapes are checked
before anything is written; a bad index raises ``InvalidArgumentError``
naming the op, the index and the row count, and leaves everything unchanged.
If a tensor read from a variable earlier still shares its buffer, the op
copies the buffer before updating it, so that tensor keeps its old value.

Each function returns the op: ``None`` when executing eagerly, the
``tf.Operation`` inside a ``tf.function`` / graph.
"""

import tensorflow as tf

from sok_keras._ops import ops
from sok_keras.variable import TABLE_DTYPES

__all__ = [
    "slot_dtype",
    "sparse_sgd",
    "sparse_momentum",
    "sparse_adagrad",
    "sparse_adam",
    "sparse_adamw",
    "sparse_ftrl",
    "sparse_rmsprop",
    "sparse_adamax",
    "sparse_adadelta",
    "sparse_lion",
]


def _tf_var(v, what):
    """Returns the tf.Variable behind a keras.Variable or tf.Variable."""
    inner = getattr(v, "value", None)
    if isinstance(v, tf.Variable):
        inner = v
    elif not isinstance(inner, tf.Variable):
        raise TypeError(
            f"`{what}` must be a keras.Variable or a tf.Variable, got "
            f"{type(v).__name__}."
        )
    if not hasattr(inner, "handle"):
        raise TypeError(f"`{what}` must be a resource variable.")
    return inner


def table_variable(var):
    """The `tf.Variable` holding a table's local rows (of a
    `keras.Variable`, a `sok_keras.Variable` or a `tf.Variable`)."""
    return _tf_var(var, "var")


def _scalar(x, dtype, what):
    if hasattr(x, "value") and isinstance(getattr(x, "value"), tf.Variable):
        x = x.value  # keras.Variable
    if isinstance(x, (tf.Tensor, tf.Variable)) or tf.is_tensor(x):
        x = tf.cast(x, dtype)
    else:
        # A constant: made on the host, where the update ops read their
        # hyperparameters (HostMemory on the GPU), so that no device-to-host
        # copy of it runs in each step.
        with tf.device("/device:CPU:0"):
            x = tf.convert_to_tensor(x, dtype=dtype)
    if x.shape.rank is not None and x.shape.rank != 0:
        raise ValueError(f"`{what}` must be a scalar, got shape {x.shape}.")
    return x


_HALF_DTYPES = (tf.float16, tf.bfloat16)
_TABLE_DTYPES = tuple(tf.as_dtype(d) for d in TABLE_DTYPES)


def slot_dtype(table_dtype):
    """The dtype of a table's optimizer slots and of the update's arithmetic.

    Args:
        table_dtype: the table's dtype (anything `tf.as_dtype` accepts).

    Returns:
        `tf.float32` for a float16 or bfloat16 table, else the table's own
        dtype.

    Example:

    >>> slot_dtype("bfloat16")
    tf.float32
    """
    dtype = tf.as_dtype(table_dtype)
    return tf.float32 if dtype in _HALF_DTYPES else dtype


def indices_are_unique(indices, num_rows):
    """Whether `indices` are provably distinct rows in `[0, num_rows)`, from
    the op that made them (at trace time; never from a user's promise).

    True for the `rows` output of `SokPooledGradPlan` or
    `SokPooledLookupGrad` (the gradient of a one-rank pooled or unpooled sok
    lookup) and the `local_rows` output of a
    `SokDedupBucketize` with one rank or one owner (local row = id), when
    that op validated its ids against at most `num_rows` rows. False for
    anything else: eager tensors, a concatenation of several lookups'
    gradients (Keras' aggregation of a table used twice), `tf.unique`'s
    output (distinct but unvalidated), unknown `num_rows`.

    Args:
      indices: the indices tensor of a table's `tf.IndexedSlices` gradient.
      num_rows: the table's (static) number of rows, or None.

    Returns:
      A Python bool: whether the sparse update may skip its dedup.
    """
    if num_rows is None or tf.executing_eagerly():
        return False
    if not isinstance(indices, tf.Tensor):
        return False
    try:
        op = indices.op
    except AttributeError:
        return False
    if (op.type == "SokPooledGradPlan" and indices.value_index == 0) or (
            op.type == "SokPooledLookupGrad" and indices.value_index == 1):
        bound = op.get_attr("num_rows")
    elif op.type == "SokDedupBucketize" and indices.value_index == 1 and (
            op.get_attr("num_ranks") == 1 or op.get_attr("owner") >= 0):
        bound = op.get_attr("vocab_size")
    else:
        return False
    return 0 <= int(bound) <= int(num_rows)


def _prep(var, indices, grad):
    """Returns `(var, slot dtype, indices, grad, unique)`, grad cast to the
    table's dtype (the scalars are cast to the slot dtype); `unique`: the
    indices are provably distinct (`indices_are_unique`)."""
    var = _tf_var(var, "var")
    dtype = var.dtype
    if dtype not in _TABLE_DTYPES:
        raise TypeError(
            f"sok_keras sparse update of '{var.name}': the table's dtype must "
            f"be one of float16, bfloat16, float32, float64. Received: "
            f"dtype={dtype.name}.")
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in (tf.int32, tf.int64):
        indices = tf.cast(indices, tf.int64)
    rows = var.shape[0] if var.shape.rank else None
    unique = indices_are_unique(indices, rows)
    grad = tf.convert_to_tensor(grad)
    if grad.dtype != dtype:
        grad = tf.cast(grad, dtype)
    return var, slot_dtype(dtype), indices, grad, unique


def _apply(op, var, indices, grad, slots=(), scalars=(), **attrs):
    """Runs the update op `op` (a name in the op library) on `var`.

    Args:
      op: e.g. "sok_sparse_apply_lion".
      var, indices, grad: as the public functions take them.
      slots: `(input name, slot variable, argument name)` triples.
      scalars: `(input name, value, argument name)` triples: hyperparameters,
        cast to the slot dtype (the argument name is the one errors use).
      **attrs: the op's other attributes (flags).

    Returns:
      The op (`None` when eager).
    """
    v, dt, indices, grad, unique = _prep(var, indices, grad)
    kwargs = {name: _tf_var(slot, what).handle for name, slot, what in slots}
    kwargs.update({name: _scalar(value, dt, what)
                   for name, value, what in scalars})
    return getattr(ops(), op)(var=v.handle, indices=indices,
                              indices_are_unique=unique, grad=grad,
                              **kwargs, **attrs)


def sparse_sgd(var, indices, grad, learning_rate):
    """Lazy SGD (Keras ``SGD`` with ``momentum=0``).

    For each unique row ``r`` in ``indices`` with summed gradient ``g``::

        var[r] -= learning_rate * g

    Args:
      var: the table, ``keras.Variable`` or ``tf.Variable`` ``[rows, D]``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients, one per entry of ``indices``.
      learning_rate: float or scalar tensor.

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_sgd", var, indices, grad,
                  scalars=[("lr", learning_rate, "learning_rate")])


def sparse_momentum(
    var, momentum_slot, indices, grad, learning_rate, momentum, nesterov=False
):
    """Lazy SGD with momentum (Keras ``SGD(momentum=..., nesterov=...)``).

    For each unique row ``r`` with summed gradient ``g``::

        m[r] = momentum * m[r] - learning_rate * g
        nesterov:  var[r] += momentum * m[r] - learning_rate * g   (new m)
        otherwise: var[r] += m[r]

    Args:
      var: the table ``[rows, D]``.
      momentum_slot: the momentum slot ``m``, same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate: float or scalar tensor.
      momentum: float or scalar tensor.
      nesterov: Python bool.

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_momentum", var, indices, grad,
                  slots=[("m", momentum_slot, "momentum_slot")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("momentum", momentum, "momentum")],
                  nesterov=bool(nesterov))


def sparse_adagrad(var, accumulator, indices, grad, learning_rate, epsilon=1e-7):
    """Lazy Adagrad (Keras ``Adagrad``).

    For each unique row ``r`` with summed gradient ``g``::

        acc[r] += g ** 2
        var[r] -= learning_rate * g / sqrt(acc[r] + epsilon)

    Args:
      var: the table ``[rows, D]``.
      accumulator: the accumulator slot (Keras initializes it to
        ``initial_accumulator_value``, 0.1 by default), same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate: float or scalar tensor.
      epsilon: float or scalar tensor (inside the square root, as Keras).

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_adagrad", var, indices, grad,
                  slots=[("accumulator", accumulator, "accumulator")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("epsilon", epsilon, "epsilon")])


def _adam(var, m, v, indices, grad, learning_rate, step, beta_1, beta_2,
          epsilon, vhat, weight_decay):
    amsgrad = vhat is not None
    scalars = [("lr", learning_rate, "learning_rate"),
               ("beta_1", beta_1, "beta_1"), ("beta_2", beta_2, "beta_2"),
               ("epsilon", epsilon, "epsilon"), ("step", step, "step")]
    if weight_decay is not None:
        scalars.append(("weight_decay", weight_decay, "weight_decay"))
    return _apply(
        "sok_sparse_apply_adam" if weight_decay is None
        else "sok_sparse_apply_adam_w", var, indices, grad,
        # (vhat is ignored unless amsgrad: `var` stands in for it.)
        slots=[("m", m, "m"), ("v", v, "v"),
               ("vhat", vhat if amsgrad else var, "vhat")],
        scalars=scalars, amsgrad=amsgrad)


def sparse_adam(
    var,
    m,
    v,
    indices,
    grad,
    learning_rate,
    step,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    vhat=None,
):
    """Lazy Adam (Keras ``Adam``; AMSGrad when ``vhat`` is given).

    With ``t = step`` (the global step, Keras' ``iterations + 1``)::

        alpha = learning_rate * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)

    and for each unique row ``r`` with summed gradient ``g``::

        m[r] += (g - m[r]) * (1 - beta_1)
        v[r] += (g ** 2 - v[r]) * (1 - beta_2)
        amsgrad: vhat[r] = max(vhat[r], v[r]);  u = vhat[r]
        else:    u = v[r]
        var[r] -= m[r] * alpha / (sqrt(u) + epsilon)

    Rows not in ``indices`` keep their ``m``/``v`` (no decay), while the bias
    correction uses the global step.

    Args:
      var: the table ``[rows, D]``.
      m: first-moment slot, same shape as ``var``.
      v: second-moment slot, same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate: float or scalar tensor.
      step: float or scalar tensor, the 1-based global step
        (``optimizer.iterations + 1``).
      beta_1, beta_2, epsilon: floats or scalar tensors.
      vhat: optional ``velocity_hat`` slot; given means AMSGrad.

    Returns:
      The update op (``None`` when eager).
    """
    return _adam(var, m, v, indices, grad, learning_rate, step, beta_1,
                 beta_2, epsilon, vhat, None)


def sparse_adamw(
    var,
    m,
    v,
    indices,
    grad,
    learning_rate,
    step,
    weight_decay=0.004,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-7,
    vhat=None,
):
    """Lazy AdamW (Keras ``AdamW``; AMSGrad when ``vhat`` is given).

    For each unique row ``r`` (only those rows: the decay is lazy too)::

        var[r] -= var[r] * weight_decay * learning_rate

    followed by exactly the :func:`sparse_adam` update of that row.

    Args:
      var, m, v, indices, grad, learning_rate, step, beta_1, beta_2, epsilon,
        vhat: as in :func:`sparse_adam`.
      weight_decay: float or scalar tensor.

    Returns:
      The update op (``None`` when eager).
    """
    return _adam(var, m, v, indices, grad, learning_rate, step, beta_1,
                 beta_2, epsilon, vhat, weight_decay)


def sparse_ftrl(
    var,
    accumulator,
    linear,
    indices,
    grad,
    learning_rate,
    learning_rate_power=-0.5,
    l1_regularization_strength=0.0,
    l2_regularization_strength=0.0,
    l2_shrinkage_regularization_strength=0.0,
    beta=0.0,
):
    """Lazy FTRL (Keras ``Ftrl``).

    With ``p = learning_rate_power``, ``lr = learning_rate``,
    ``l2_reg = l2 + beta / (2 * lr)``, for each unique row ``r`` with summed
    gradient ``g`` (element-wise; ``w = var[r]``, ``a = acc[r]``,
    ``n = linear[r]``)::

        g2 = g + 2 * l2_shrinkage * w
        a_new = a + g ** 2
        n += g2 - (a_new ** -p - a ** -p) / lr * w
        quadratic = a_new ** -p / lr + 2 * l2_reg
        w = (clip(n, -l1, l1) - n) / quadratic
        a = a_new

    Args:
      var: the table ``[rows, D]``.
      accumulator: accumulator slot (Keras initializes it to
        ``initial_accumulator_value``, 0.1 by default).
      linear: linear slot (zeros initially).
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate: float or scalar tensor.
      learning_rate_power, l1_regularization_strength,
        l2_regularization_strength, l2_shrinkage_regularization_strength,
        beta: floats or scalar tensors, as in Keras.

    Returns:
      The update op (``None`` when eager).
    """
    return _apply(
        "sok_sparse_apply_ftrl", var, indices, grad,
        slots=[("accumulator", accumulator, "accumulator"),
               ("linear", linear, "linear")],
        scalars=[("lr", learning_rate, "learning_rate"),
                 ("lr_power", learning_rate_power, "learning_rate_power"),
                 ("l1", l1_regularization_strength,
                  "l1_regularization_strength"),
                 ("l2", l2_regularization_strength,
                  "l2_regularization_strength"),
                 ("l2_shrinkage", l2_shrinkage_regularization_strength,
                  "l2_shrinkage_regularization_strength"),
                 ("beta", beta, "beta")])


def sparse_rmsprop(
    var,
    velocity,
    indices,
    grad,
    learning_rate,
    rho=0.9,
    momentum=0.0,
    epsilon=1e-7,
    momentum_slot=None,
    average_gradient=None,
):
    """Lazy RMSprop (Keras ``RMSprop``).

    Centered iff ``average_gradient`` is given; with momentum iff
    ``momentum_slot`` is given (Keras creates it when ``momentum > 0``).
    For each unique row ``r`` with summed gradient ``g``::

        vel[r] = rho * vel[r] + (1 - rho) * g ** 2
        centered: avg[r] = rho * avg[r] + (1 - rho) * g
                  denom = vel[r] - avg[r] ** 2 + epsilon
        else:     denom = vel[r] + epsilon
        inc = learning_rate * g / sqrt(denom)
        momentum slot: mom[r] = momentum * mom[r] + inc;  var[r] -= mom[r]
        else:          var[r] -= inc

    Args:
      var: the table ``[rows, D]``.
      velocity: velocity slot, same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate, rho, momentum, epsilon: floats or scalar tensors.
      momentum_slot: optional momentum slot.
      average_gradient: optional average-gradient slot (centered RMSprop).

    Returns:
      The update op (``None`` when eager).
    """
    centered = average_gradient is not None
    use_momentum = momentum_slot is not None
    return _apply(
        "sok_sparse_apply_rmsprop", var, indices, grad,
        # (Unused slots are ignored by the op: `var` stands in for them.)
        slots=[("velocity", velocity, "velocity"),
               ("mom", momentum_slot if use_momentum else var,
                "momentum_slot"),
               ("mg", average_gradient if centered else var,
                "average_gradient")],
        scalars=[("lr", learning_rate, "learning_rate"), ("rho", rho, "rho"),
                 ("momentum", momentum, "momentum"),
                 ("epsilon", epsilon, "epsilon")],
        centered=centered, use_momentum=use_momentum)


def sparse_adamax(var, m, u, indices, grad, learning_rate, step, beta_1=0.9,
                  beta_2=0.999, epsilon=1e-7):
    """Lazy Adamax (Keras ``Adamax``).

    For each unique row ``r`` with summed gradient ``g``, at 1-based step
    ``step``::

        m[r] += (g - m[r]) * (1 - beta_1)
        u[r] = max(beta_2 * u[r], |g|)
        var[r] -= learning_rate * m[r] / ((1 - beta_1 ** step) * (u[r] + epsilon))

    Args:
      var: the table ``[rows, D]``.
      m: the first-moment slot, same shape as ``var``.
      u: the exponentially weighted infinity norm slot, same shape.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate, beta_1, beta_2, epsilon: floats or scalar tensors.
      step: the 1-based step count (float or scalar tensor).

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_adamax", var, indices, grad,
                  slots=[("m", m, "m"), ("u", u, "u")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("beta_1", beta_1, "beta_1"),
                           ("beta_2", beta_2, "beta_2"),
                           ("epsilon", epsilon, "epsilon"),
                           ("step", step, "step")])


def sparse_nadam(var, m, v, indices, grad, learning_rate, u_t, u_t_1,
                 u_product, beta_2_power, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7):
    """Lazy Nadam (Keras ``Nadam``).

    For each unique row ``r`` with summed gradient ``g``, with the step's
    momentum schedule as Keras' Nadam computes it (``u_t``, ``u_t_1``,
    ``u_product``: the product of the schedule up to ``u_t``, and
    ``beta_2_power = beta_2 ** step``)::

        m[r] += (g - m[r]) * (1 - beta_1)
        v[r] += (g * g - v[r]) * (1 - beta_2)
        m_hat = (u_t_1 * m[r]) / (1 - u_product * u_t_1)
                + ((1 - u_t) * g) / (1 - u_product)
        var[r] -= (m_hat * learning_rate) / (
            sqrt(v[r] / (1 - beta_2_power)) + epsilon)

    Args:
      var: the table ``[rows, D]``.
      m: the first-moment slot, same shape as ``var``.
      v: the second-moment slot, same shape.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate, beta_1, beta_2, epsilon: floats or scalar tensors.
      u_t, u_t_1, u_product, beta_2_power: the step's schedule (floats or
        scalar tensors).

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_nadam", var, indices, grad,
                  slots=[("m", m, "m"), ("v", v, "v")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("beta_1", beta_1, "beta_1"),
                           ("beta_2", beta_2, "beta_2"),
                           ("epsilon", epsilon, "epsilon"),
                           ("u_t", u_t, "u_t"),
                           ("u_t_1", u_t_1, "u_t_1"),
                           ("u_product", u_product, "u_product"),
                           ("beta_2_power", beta_2_power, "beta_2_power")])


def sparse_adadelta(var, accumulated_grad, accumulated_delta_var, indices,
                    grad, learning_rate, rho=0.95, epsilon=1e-7):
    """Lazy Adadelta (Keras ``Adadelta``).

    For each unique row ``r`` with summed gradient ``g``::

        ag[r] = rho * ag[r] + (1 - rho) * g ** 2
        delta = -sqrt(ad[r] + epsilon) * g / sqrt(ag[r] + epsilon)
        ad[r] = rho * ad[r] + (1 - rho) * delta ** 2
        var[r] += learning_rate * delta

    Args:
      var: the table ``[rows, D]``.
      accumulated_grad: the slot ``ag``, same shape as ``var``.
      accumulated_delta_var: the slot ``ad``, same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate, rho, epsilon: floats or scalar tensors.

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_adadelta", var, indices, grad,
                  slots=[("accumulated_grad", accumulated_grad,
                          "accumulated_grad"),
                         ("accumulated_delta_var", accumulated_delta_var,
                          "accumulated_delta_var")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("rho", rho, "rho"),
                           ("epsilon", epsilon, "epsilon")])


def sparse_lion(var, m, indices, grad, learning_rate, beta_1=0.9,
                beta_2=0.99):
    """Lazy Lion (Keras ``Lion``).

    For each unique row ``r`` with summed gradient ``g``::

        var[r] -= learning_rate * sign(beta_1 * m[r] + (1 - beta_1) * g)
        m[r] = beta_2 * m[r] + (1 - beta_2) * g

    Args:
      var: the table ``[rows, D]``.
      m: the momentum slot, same shape as ``var``.
      indices: int64/int32 ``[k]`` local row ids, duplicates allowed.
      grad: ``[k, D]`` gradients.
      learning_rate, beta_1, beta_2: floats or scalar tensors.

    Returns:
      The update op (``None`` when eager).
    """
    return _apply("sok_sparse_apply_lion", var, indices, grad,
                  slots=[("m", m, "m")],
                  scalars=[("lr", learning_rate, "learning_rate"),
                           ("beta_1", beta_1, "beta_1"),
                           ("beta_2", beta_2, "beta_2")])
