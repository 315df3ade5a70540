"""`OptimizerWrapper`: any Keras optimizer, for models with sharded tables."""

import contextlib
import copy

import keras
import numpy as np
import tensorflow as tf

from sok_keras import _gradients
from sok_keras import lookup
from sok_keras import shard_reads
from sok_keras import world
from sok_keras.optimizers import sparse_kernels, sparse_rules, tf_slots
from sok_keras.variable import is_sok_variable
from sok_keras._ops import not_converted as _not_converted

_UNSUPPORTED_BASE_ARGS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _pack_allreduce_mean(grads, comm, key):
    """All-reduces a list of dense tensors as one buffer per dtype."""
    by_dtype = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    out = list(grads)
    for dtype, idx in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
        flat = tf.concat([tf.reshape(grads[i], [-1]) for i in idx], 0)
        reduced = comm.all_reduce(flat, key=f"{key}/{dtype.name}", op="mean")
        sizes = [tf.size(grads[i]) for i in idx]
        for i, part in zip(idx, tf.split(reduced, sizes)):
            out[i] = tf.reshape(part, tf.shape(grads[i]))
    return out


def under_strategy():
    """Whether a `tf.distribute` strategy with several replicas is in
    charge (its scope or replica context): it then owns the convention,
    as in SOK's strategy recipes and Keras' `fit` under a strategy: the
    loss is divided by the global batch size (by the number of replicas in
    `fit`), Keras' optimizer sums dense gradients over the replicas, and a
    table's gradient is the sum the exchange already formed on its owner;
    mirrored variables start equal."""
    return (tf.distribute.has_strategy()
            and tf.distribute.get_strategy().num_replicas_in_sync > 1)


def keras2_hint(optimizer):
    """What to do instead of a Keras 2 (`tf_keras`) optimizer, as a
    sentence for an error message; "" for anything else."""
    module = type(optimizer).__module__ or ""
    if not (module.startswith("tf_keras") or ".legacy" in module):
        return ""
    return (f" {type(optimizer).__module__}.{type(optimizer).__name__} is a "
            "Keras 2 (tf_keras) optimizer, which SOK asked for on "
            "TensorFlow >= 2.17; sok_keras works with Keras 3: use "
            f"keras.optimizers.{type(optimizer).__name__}(...) (the "
            "same hyperparameters).")


def broadcast_variables(variables, root=0, key="broadcast_variables",
                        owner=None):
    """Copies the values of `variables` on rank `root` to every rank.

    Every rank must call it with the same variables in the same order.
    With one rank it does nothing.

    Args:
        variables: a list of (Keras or TF) variables, not sharded tables.
        root: the rank whose values win. Defaults to 0.
        key: a name for the collective, the same on every rank.
        owner: the optimizer building for them, if any: variables that
            the step being traced made (not initialized yet on some rank)
            are broadcast by its first update instead
            (`sync_lazy_variables`).
    """
    if world.num_ranks() == 1 or under_strategy():
        return
    comm = world.communicator()
    dense = [(i, v) for i, v in enumerate(variables)
             if not is_sok_variable(v)]
    with tf.init_scope():
        # Whether each is initialized, agreed by every rank (one rank may
        # have run the model before, the others not: review).
        ready = [1.0 if _initialized(v) else 0.0 for _, v in dense]
        if ready:
            ready = comm.all_reduce(
                tf.constant(ready, tf.float32), key=f"{key}/initialized",
                op="min").numpy().tolist()
        lazy = []
        for (i, v), r in zip(dense, ready):
            if r < 1.0:
                lazy.append((i, v))
                continue
            # (A Keras variable's `value` is a property, a tf.Variable's a
            # method: convert_to_tensor reads either.)
            value = comm.broadcast(tf.convert_to_tensor(v),
                                   key=f"{key}/{i}", root=root)
            v.assign(value)
        if lazy and owner is not None:
            global _LAZY_COUNT
            _LAZY_COUNT += 1
            done = tf.Variable(False, trainable=False,
                               name="sok_lazy_broadcast_done")
            owner.__dict__.setdefault("_sok_lazy", []).append(
                (lazy, f"{key}/lazy{_LAZY_COUNT}", root, done))


def _initialized(v):
    """Whether `v` holds a value now. A variable first made inside a traced
    step (a layer built at its first call there: an RNN cell with no
    `build()`, which Keras allows) is initialized when TensorFlow runs
    that function, not before (QA: its broadcast read an empty value)."""
    inner = getattr(v, "_value", v)
    check = getattr(inner, "is_initialized", None)
    if check is None:
        return True
    try:
        return bool(check())
    except Exception:  # not a resource variable's check
        return True


# Registrations of `broadcast_variables`' later broadcasts: the same count
# on every rank (builds happen in the same order), so that the keys match.
_LAZY_COUNT = 0


def sync_lazy_variables(owner, grads):
    """Broadcasts, at the first run of the step being traced, the variables
    that step made (see `broadcast_variables`; TensorFlow traces a step
    that made variables again before it runs it, and the optimizer's
    `build` runs in the first trace only, so each trace of `owner`'s update
    emits them). From then on every rank holds rank 0's values (the first
    step's gradients were each rank's own values'). Every rank runs the
    same step, so every rank takes the same branch.

    Returns:
        What the update must wait for: after the step's gradients (so after
        its exchanges), before its all-reduce, so that the broadcast keeps
        the collectives' program order (NCCL needs it).
    """
    pending = owner.__dict__.get("_sok_lazy")
    if not pending:
        return []
    with tf.init_scope():  # those done (on every rank: a step ago) go
        pending[:] = [e for e in pending if not bool(e[3].numpy())]
    if not pending:
        return []
    comm = world.communicator()
    after = [t for g in grads if g is not None for t in (
        (g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
    for lazy, key, root, done in list(pending):
        def sync(lazy=lazy, key=key, root=root, done=done):
            for i, v in lazy:
                v.assign(comm.broadcast(tf.convert_to_tensor(v),
                                        key=f"{key}/{i}", root=root))
            done.assign(True)
            return tf.constant(True)

        with tf.control_dependencies(after):
            out = tf.cond(done.read_value(), lambda: tf.constant(True),
                          sync)
        after = [out]
    return [] if tf.executing_eagerly() else after


def reduce_across_ranks(grads, variables):
    """Averages gradients over the ranks (data-parallel mean).

    Dense gradients are all-reduced (one packed buffer per dtype). A
    `sok_keras.Variable`'s gradient is only divided by the number of ranks:
    the exchange already summed every rank's contribution on the owner.
    Under a `tf.distribute` strategy with several replicas the gradients
    are returned unchanged (see `under_strategy`).
    """
    n = world.num_ranks()
    if n == 1 or under_strategy():
        return list(grads)
    out, dense_idx = list(grads), []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if is_sok_variable(v):
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / n, g.indices,
                                          g.dense_shape)
            else:
                out[i] = g / n
        else:
            dense_idx.append(i)
    if dense_idx:
        reduced = _pack_allreduce_mean(
            [tf.convert_to_tensor(grads[i]) for i in dense_idx],
            world.communicator(), key="sok_optimizer/allreduce")
        for i, r in zip(dense_idx, reduced):
            out[i] = r
    return out


def _all_finite(grads, key="sok_optimizer/finite"):
    """Whether every gradient of every rank is finite (a bool tensor, the
    same on every rank; `key` names the collective)."""
    flags = []
    for g in grads:
        if g is None:
            continue
        values = tf.convert_to_tensor(
            g.values if isinstance(g, tf.IndexedSlices) else g)
        if values.dtype.is_floating:  # (integers are always finite)
            flags.append(tf.reduce_all(tf.math.is_finite(values)))
    finite = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
    comm = _tables_communicator()
    if comm is not None:
        votes = comm.all_reduce(
            tf.reshape(tf.cast(finite, tf.int32), [1]),
            key=key, op="min")
        finite = tf.equal(votes[0], 1)
    return finite


def _as_slices(g, v):
    if isinstance(g, tf.IndexedSlices):
        values, indices = g.values.shape, g.indices.shape
        if values.rank is not None and (
                not values[1:].is_compatible_with(v.shape[1:])
                or not values[:1].is_compatible_with(indices[:1])):
            raise ValueError(
                f"OptimizerWrapper: the gradient of table '{v.path}' "
                "(IndexedSlices) must have one row of the table's width "
                f"{tuple(v.shape[1:])} per index. Received: values "
                f"shape={tuple(values)}, indices shape={tuple(indices)}.")
        return g
    g = tf.convert_to_tensor(g)
    if not g.shape.is_compatible_with(v.shape):
        # (applied as rows 0..n-1, it would change the wrong rows silently)
        raise ValueError(
            f"OptimizerWrapper: the dense gradient of table '{v.path}' must "
            f"have the shape of its shard, {tuple(v.shape)}. Received: "
            f"shape={tuple(g.shape)}.")
    rows = tf.shape(g, out_type=tf.int64)[0]
    return tf.IndexedSlices(g, tf.range(rows), tf.shape(g, out_type=tf.int64))


def _wide(values):
    """16-bit gradient values as float32 (sums, squares and products of
    16-bit tables' gradients run in float32 and round once); others as
    they are."""
    if values.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(values, tf.float32)
    return values


def _sparse_sq_norms(slices):
    """Squared norms of the tables' gradients, summed over all ranks."""
    sq = [tf.reduce_sum(tf.square(_wide(s.values))) for s in slices]
    if len({t.dtype for t in sq}) > 1:
        sq = [tf.cast(t, tf.float32) for t in sq]
    sq = tf.stack(sq)
    comm = _tables_communicator()
    if comm is not None:
        sq = comm.all_reduce(
            sq, key=f"sok_optimizer/sq_norms/{len(slices)}", op="sum")
    return sq


def _tables_communicator():
    """Who shares the tables' shards: the ranks' communicator, or the
    replicas' inside `strategy.run` of a single-process MirroredStrategy
    (`sok_keras.replicas`); None for one rank."""
    from sok_keras import replicas

    if world.num_ranks() > 1:
        return world.communicator()
    if replicas.in_replica_context():
        ctx = tf.distribute.get_replica_context()
        return replicas.communicator(ctx.num_replicas_in_sync)
    return None


def _combine_duplicates(s):
    """The per-row gradient: each id once, duplicates summed (the gradient
    the sparse rules apply; a lookup's gradient already is one)."""
    unique, position = tf.unique(s.indices)
    values = tf.math.unsorted_segment_sum(
        _wide(s.values), position, tf.shape(unique)[0])
    return tf.IndexedSlices(tf.cast(values, s.values.dtype), unique,
                            s.dense_shape)


def _rescaled(s, fn):
    """`s` with values `fn(values)`, computed on `_wide` values and cast
    back once."""
    return tf.IndexedSlices(tf.cast(fn(_wide(s.values)), s.values.dtype),
                            s.indices, s.dense_shape)


def _scale_slices(s, scale):
    return _rescaled(s, lambda w: w * tf.cast(scale, w.dtype))


def clip_gradients(opt, dense, slices):
    """Keras' clipping (`clipnorm`, else `global_clipnorm`, else
    `clipvalue`), extended to sharded tables.

    A table's gradient is its per-row gradient (each id once: duplicate ids
    in a `tf.IndexedSlices` are summed first), so:
    `clipnorm` clips each table by the norm of its whole gradient (summed
    over every rank's shard); `global_clipnorm` uses the norm over every
    dense gradient and every table; `clipvalue` clips elementwise.
    Dense gradients are clipped exactly as Keras clips them (with no tables,
    the result is Keras' own, bit for bit).
    """
    clipnorm = opt.clipnorm and opt.clipnorm > 0
    global_clipnorm = opt.global_clipnorm and opt.global_clipnorm > 0
    clipvalue = opt.clipvalue and opt.clipvalue > 0
    if slices and (clipnorm or global_clipnorm or clipvalue):
        slices = [_combine_duplicates(s) for s in slices]
    if clipnorm:
        c = opt.clipnorm
        dense = [tf.clip_by_norm(g, c) for g in dense]
        if slices:
            norms = tf.sqrt(_sparse_sq_norms(slices))
            # As tf.clip_by_norm: (g * c) / max(norm, c).
            slices = [_rescaled(s, lambda w, n=norms[i]: w * tf.cast(
                c, w.dtype) / tf.cast(tf.maximum(n, c), w.dtype))
                for i, s in enumerate(slices)]
    elif global_clipnorm:
        c = opt.global_clipnorm
        # Keras' clip_by_global_norm, with each table's squared norm (over
        # every rank's shard) among the squared norms.
        sq = [tf.reduce_sum(tf.square(g)) for g in dense]
        if slices:
            table_sq = _sparse_sq_norms(slices)
            sq += [table_sq[i] for i in range(len(slices))]
        dtypes = {t.dtype for t in sq}
        if len(dtypes) > 1:
            sq = [tf.cast(t, tf.float32) for t in sq]
        norm = tf.sqrt(tf.reduce_sum(tf.stack(sq)))
        scale = c * tf.minimum(1.0 / norm, 1.0 / c)
        scale = scale + (norm - norm)  # NaN for a non-finite norm, as Keras
        dense = [g * tf.cast(scale, g.dtype) for g in dense]
        slices = [_scale_slices(s, scale) for s in slices]
    elif clipvalue:
        c = opt.clipvalue
        dense = [tf.clip_by_value(g, -c, c) for g in dense]
        slices = [tf.IndexedSlices(tf.clip_by_value(s.values, -c, c),
                                   s.indices, s.dense_shape) for s in slices]
    return dense, slices


@contextlib.contextmanager
def _clipping_off(opt):
    saved = (opt.clipnorm, opt.global_clipnorm, opt.clipvalue)
    opt.clipnorm = opt.global_clipnorm = opt.clipvalue = None
    try:
        yield
    finally:
        opt.clipnorm, opt.global_clipnorm, opt.clipvalue = saved


_INSTEAD = {
    "loss_scale_factor": " Wrap the optimizer in "
    "`keras.optimizers.LossScaleOptimizer` instead.",
    "use_ema": " Keras' EMA keeps a table-sized average of every table and "
    "rewrites all its rows at each step, which lazy sparse updates exist "
    "to avoid (and `keras.callbacks.SwapEMAWeights` would swap shards). "
    "Leave use_ema off.",
}


def _check_supported(opt):
    for arg in ("use_ema", "loss_scale_factor"):
        if getattr(opt, arg, None):
            raise ValueError(
                f"sok_keras: `{arg}` on {type(opt).__name__} is not supported "
                f"with sharded tables. Received: {arg}="
                f"{getattr(opt, arg)!r}.{_INSTEAD.get(arg, '')}"
            )
    steps = getattr(opt, "gradient_accumulation_steps", None)
    clipping = [a for a in ("clipnorm", "global_clipnorm", "clipvalue")
                if getattr(opt, a, None)]
    if steps and clipping:
        raise ValueError(
            f"sok_keras: `gradient_accumulation_steps` with `{clipping[0]}` "
            f"on {type(opt).__name__} is not supported with sharded tables "
            "(Keras clips the mean of the accumulated gradients at the "
            "update step). Received: gradient_accumulation_steps="
            f"{steps!r}, {clipping[0]}={getattr(opt, clipping[0])!r}. "
            "Accumulate in a custom loop (docs/recipes.md, \"Gradient "
            "accumulation\") and apply the sums with an optimizer that "
            f"clips ({clipping[0]} without gradient_accumulation_steps), "
            "or leave one of them out. (Not `tf.clip_by_global_norm` by "
            "hand: on N ranks each rank's gradients are its own slice's.)")


def tf2_keras_arguments(owner, grads_and_vars, kwargs):
    """`grads_and_vars` as a list, after `apply_gradients`' other keyword
    arguments: TF2 Keras' `experimental_aggregate_gradients` (SOK's seed
    passes False for its tables' update) means nothing for tables, whose
    gradients sok_keras never all-reduces, so it is taken there; with dense
    variables it is refused (their gradients are averaged over the ranks
    here: docs/recipes.md, difference 1)."""
    grads_and_vars = list(grads_and_vars)
    if "experimental_aggregate_gradients" in kwargs:
        value = kwargs.pop("experimental_aggregate_gradients")
        dense = [v for _, v in grads_and_vars if not is_sok_variable(v)]
        if dense:
            raise ValueError(
                f"{owner}.apply_gradients: `experimental_aggregate_gradients`"
                " (TF2 Keras') is taken for tables only; here the dense "
                "variables' gradients are averaged over the ranks by the "
                f"optimizer ('{getattr(dense[0], 'path', dense[0].name)}', "
                "...). Drop the argument (docs/recipes.md, difference 1). "
                f"Received: experimental_aggregate_gradients={value!r}.")
    if kwargs:
        raise TypeError(
            f"{owner}.apply_gradients() got unexpected keyword arguments "
            f"{sorted(kwargs)}.")
    return grads_and_vars


def table_optimizer(opt, table):
    """The optimizer that rules `table`: its own (a layer's `optimizer=`
    argument) if it has one, else the model's `opt`."""
    return table.optimizer if table.optimizer is not None else opt


def rule_for_table(opt, table):
    """`sparse_rules.rule_for(opt)`, its error naming the table."""
    try:
        rule = sparse_rules.rule_for(opt)
        rule.check_table(opt, table)
        return rule
    except ValueError as e:
        own = table.optimizer is not None
        whose = "its own" if own else "the model's"
        raise ValueError(
            f"sok_keras: table '{table.path}' is trained by {whose} "
            f"optimizer {type(opt).__name__}: {e}"
            + ("" if own else " (Or give the table's layer an optimizer "
               "of its own, `optimizer=` of the sok layer: the model's "
               "optimizer then trains only the other weights.)")) from e


def create_table_slots(opt, variables):
    """Creates the slot tables of every sharded table in `variables` (and,
    once `opt` is built, hands it state a checkpoint restored before,
    `sparse_rules.after_build`)."""
    sparse_rules.after_build(opt)
    # (The tables `opt` was built for: an update step zeroes their
    # accumulators also when a step passes them no gradient.)
    object.__setattr__(opt, "_sok_built_tables",
                       [v for v in variables if is_sok_variable(v)])
    for table in variables:
        if is_sok_variable(table):
            topt = table_optimizer(opt, table)
            sparse_rules.ensure_slots(
                rule_for_table(topt, table), topt, table)


def build_once(optimizer, variables):
    """Builds `optimizer` for `variables` unless it is built (as Keras'
    `Optimizer.apply` does)."""
    if not optimizer.built:
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True


def check_jit_compile(owner, jit_compile):
    """`jit_compile` as given to an optimizer, or a clear error."""
    if not (jit_compile is True or jit_compile is False
            or (isinstance(jit_compile, str) and jit_compile == "auto")):
        raise ValueError(
            f"{owner}: `jit_compile` must be 'auto', True or False. "
            f"Received: jit_compile={jit_compile!r}.")
    return jit_compile


def _device_of(v):
    handle = getattr(v, "handle", None)
    return getattr(handle if handle is not None else v, "device", "") or ""


def compiles_dense_update(jit_compile, opt, dense_variables):
    """Whether the dense weights' update runs as one XLA computation.

    On a GPU, Keras compiles a whole training step with XLA by default
    (`model.compile(jit_compile="auto")`). A model with sok layers cannot
    be compiled whole (the op library has no XLA kernels), so Keras turns
    XLA off, and the optimizer's update of the dense weights then runs op
    by op: for Adam, some 25 small ops per weight, each its own kernel
    launch and host dispatch. `jit_compile="auto"` gives that update, and
    only it, back the compilation Keras' "auto" would have chosen: in a
    traced step (not eagerly), with no `tf.distribute` strategy in charge
    and op determinism off (where Keras' "auto" turns XLA off too), when
    every variable it touches (the weights and the optimizer's own) is on
    a GPU. `True` compiles it wherever it runs; `False` never.
    """
    if jit_compile is False or not dense_variables:
        return False
    if jit_compile is True:
        return True
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return False
    from tensorflow.python.framework import config as tf_config

    if tf_config.is_op_determinism_enabled():
        return False
    return all("GPU" in _device_of(v).upper()
               for v in list(dense_variables) + list(opt.variables))


def _apply_dense_compiled(opt, apply_dense, grads, variables):
    """`apply_dense(grads, variables)`, traced into one tf.function with
    `jit_compile=True` (one per optimizer and list of variables, kept on
    the optimizer past TensorFlow's attribute tracking, so that saving
    does not see it)."""
    fns = opt.__dict__.get("_sok_compiled_dense")
    if fns is None:
        fns = {}
        object.__setattr__(opt, "_sok_compiled_dense", fns)
    key = tuple(id(v) for v in variables)
    if key not in fns:
        def update(*g):
            apply_dense(list(g), variables)

        fns[key] = tf.function(update, jit_compile=True, autograph=False)
    fns[key](*grads)


@shard_reads.reading(lambda opt, grads, variables, *_, **__: [
    v for v in variables if is_sok_variable(v)])
def apply_with_tables(opt, grads, variables, apply_dense,
                      jit_compile=False):
    """One training step for a mix of dense weights and sharded tables.

    Args:
        opt: the Keras optimizer whose hyperparameters rule the update.
        grads: gradients, one per variable (None allowed).
        variables: the variables.
        apply_dense: `fn(grads, variables)` applying `opt`'s own update to
            the dense variables, called with clipping already done. When
            there are none, `opt.iterations` is incremented instead, so the
            step is counted either way.
        jit_compile: "auto", True or False: whether `apply_dense` runs as
            one XLA computation (see `compiles_dense_update`).
    """
    grads = list(grads)
    _check_gradients(grads, variables)
    grads = reduce_across_ranks(grads, variables)
    # Nothing is updated (tables, dense weights, step counters) before
    # every lookup of the step has checked its ids: a bad id in one table
    # leaves every variable as it was (`lookup.lookups_before_update`).
    with tf.control_dependencies(lookup.lookups_before_update()):
        _apply_reduced(opt, grads, variables, apply_dense, jit_compile)


def _check_gradients(grads, variables):
    """One gradient per variable, each dense weight's of its (static)
    shape: checked before anything is updated, naming the variable (else
    the tables would be updated and the step fail later, at the dense
    weight, with TensorFlow's bare shape error)."""
    variables = list(variables)
    if len(grads) != len(variables):
        raise ValueError(
            f"sok_keras: {len(grads)} gradients for {len(variables)} "
            "variables; give one gradient (or None) per variable.")
    for g, v in zip(grads, variables):
        if g is None or is_sok_variable(v):
            continue  # (a table's gradient: `_as_slices` checks it)
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        shape = getattr(values, "shape", None)
        if shape is None or tf.TensorShape(shape).rank is None:
            continue
        shape = tf.TensorShape(shape)
        want = tf.TensorShape(v.shape)
        if isinstance(g, tf.IndexedSlices):  # rows: [k] + the row shape
            ok = shape.rank == want.rank and shape[1:].is_compatible_with(
                want[1:])
        else:
            ok = shape.is_compatible_with(want)
        if not ok:
            raise ValueError(
                f"sok_keras: the gradient of '{v.path}' has shape "
                f"{shape.as_list()}, but the variable has shape "
                f"{list(v.shape)}; nothing was updated.")


def _table_update(rule, opt, table, slots, indices, values, step):
    """The ops of `rule`'s update of rows `indices` of `table` (`[]` when
    eager): Keras' decoupled weight decay, then the rule."""
    ops = [rule.decay(opt, table, indices, opt.learning_rate),
           rule.apply(opt, table, slots, indices, values, opt.learning_rate,
                      step)]
    return [op for op in ops if op is not None]


def _update_due(opt):
    """None if `opt` updates at every step; else whether this step is an
    update step of its gradient accumulation (Keras' `(_iterations + 1) %
    k == 0`, read before the step counts itself)."""
    k = getattr(opt, "gradient_accumulation_steps", None)
    return tf.equal((opt._iterations + 1) % k, 0) if k else None


def _branch(due, then, otherwise=lambda: None):
    """`then()` if `due` (None: always) else `otherwise()`: eagerly, or as
    a `tf.cond` in a traced step (returns the op, or None)."""
    if due is None:
        then()
        return None
    if tf.executing_eagerly():
        then() if bool(due) else otherwise()
        return None
    return tf.cond(due, lambda: then() or tf.constant(True),
                   lambda: otherwise() or tf.constant(False))


def _reset_accumulators(opt, tables, reset_dense):
    """Zeroes `opt`'s accumulators of `tables` (those it trains), and its
    dense ones (Keras' `_backend_reset_gradient_accumulators`) if
    `reset_dense` (a step in which Keras' own `apply` does not run)."""
    for table in tables:
        if table_optimizer(opt, table) is not opt:
            continue
        slots = sparse_rules.ensure_slots(rule_for_table(opt, table), opt,
                                          table)
        acc = sparse_kernels.table_variable(slots[sparse_rules.ACCUMULATOR])
        acc.assign(tf.zeros_like(acc))
    if reset_dense and getattr(opt, "_accumulated_gradients", None):
        opt._backend_reset_gradient_accumulators()


def _accumulated_update(rule, opt, table, slots, s, step, due):
    """Keras' `gradient_accumulation_steps` for a table, lazily: each step
    adds its gradient rows to the table's `gradient_accumulator` slot
    (this rank's rows); every k-th step (Keras' `(iterations + 1) % k ==
    0`, `iterations` counting every step) updates the rows whose
    accumulated gradient is not zero with the mean over the k steps,
    through the rule (weight decay included, as Keras decays at update
    steps only), then zeroes them (Keras' `iterations` there is
    `_iterations`, counting every step). The update step scans the rank's
    accumulator for those rows: O(rows x dim) every k steps."""
    k = opt.gradient_accumulation_steps
    acc = sparse_kernels.table_variable(slots[sparse_rules.ACCUMULATOR])
    values = tf.convert_to_tensor(s.values)
    indices = tf.convert_to_tensor(s.indices)

    def add():
        acc.scatter_add(tf.IndexedSlices(tf.cast(values, acc.dtype),
                                         indices))

    def update():
        add()
        total = tf.convert_to_tensor(acc)
        rows = tf.reshape(tf.where(tf.reduce_any(
            tf.not_equal(total, 0), axis=1)), [-1])
        mean = tf.cast(tf.gather(total, rows) / k, values.dtype)
        with tf.control_dependencies(_table_update(
                rule, opt, table, slots, rows, mean, step)):
            acc.scatter_update(tf.IndexedSlices(
                tf.zeros([tf.size(rows), acc.shape[1]], acc.dtype), rows))

    return _branch(due, update, add)


def _apply_reduced(opt, grads, variables, apply_dense, jit_compile):
    """`apply_with_tables` after the all-reduce of the dense gradients."""
    _check_supported(opt)  # (clipping may have been set since)
    dense_g, dense_v, slices, tables = [], [], [], []
    idle = []  # tables without a gradient in this step
    for g, v in zip(grads, variables):
        if g is None:
            if is_sok_variable(v):
                idle.append(v)
            continue
        if is_sok_variable(v):
            slices.append(_as_slices(g, v))
            tables.append(v)
        else:
            dense_g.append(g)
            dense_v.append(v)
    dense_g, slices = clip_gradients(
        opt, [tf.convert_to_tensor(g) for g in dense_g], slices)
    due = _update_due(opt)
    own_steps = []  # tables' own optimizers: each counts its steps
    table_updates = []  # their ops, in a traced step
    for s, table in zip(slices, tables):
        topt = table_optimizer(opt, table)
        rule = rule_for_table(topt, table)
        # In the slot dtype: float32 for a 16-bit table (exact steps).
        step = tf.cast(topt.iterations + 1,
                       sparse_kernels.slot_dtype(table.dtype))
        slots = sparse_rules.ensure_slots(rule, topt, table)
        if topt is opt and due is not None:
            table_updates.append(_accumulated_update(rule, topt, table,
                                                     slots, s, step, due))
        else:
            table_updates += _table_update(rule, topt, table, slots,
                                           s.indices, s.values, step)
        if topt is not opt and all(topt is not o for o in own_steps):
            own_steps.append(topt)
    at_update = []  # what `opt`'s update steps do besides the tables'
    if due is not None:
        # Keras zeroes every accumulator at an update step, also those of
        # variables without a gradient in it (their sums are dropped).
        have = {id(t) for t in tables}
        for t in opt.__dict__.get("_sok_built_tables", ()):
            if id(t) not in have and all(t is not i for i in idle):
                idle.append(t)
        at_update.append(lambda: _reset_accumulators(
            opt, idle, reset_dense=not dense_v))
    if not dense_v:
        # The optimizer-wide state Keras' `apply` would advance (Nadam's
        # schedule), at update steps only, as in Keras.
        at_update.append(lambda: sparse_rules.advance(opt))
    if at_update:
        def update_step():
            for fn in at_update:
                fn()

        _branch(due, update_step)
    # A step Keras' own `apply` does not count: its counter, and the
    # optimizer's state that `apply` would advance (Nadam's schedule).
    for topt in own_steps:
        sparse_rules.advance(topt)
        topt.iterations.assign_add(1)
    if not dense_v:
        opt._iterations.assign_add(1)  # (`iterations` // k if accumulating)
        return
    # (Keras' all-reduce of the dense gradients, even over one replica, is
    # a `tf.custom_gradient`: held by the graph, not for good.)
    with _clipping_off(opt), _gradients.held_by_graph():
        if compiles_dense_update(jit_compile, opt, dense_v):
            # Issued after the tables' updates: on a GPU, whose stream runs
            # kernels in the order they are issued, the tables' gradient
            # sums and updates are the step's longest GPU work, and they
            # then run while the host launches the compiled update (a few
            # fused kernels) instead of after it.
            with tf.control_dependencies(table_updates):
                _apply_dense_compiled(opt, apply_dense, dense_g, dense_v)
        else:
            apply_dense(dense_g, dense_v)


def _earlier_layout(store, variables):
    """Whether `store` holds `variables` in an earlier version's layout:
    two scalars (the wrapper's own step count and learning rate) first,
    then entries of the variables' shapes. A file of another optimizer
    (or of an optimizer not yet built) whose count is only two more is
    none: Keras skips it with its warning (QA: its slots were read into
    the step count, and loading failed)."""
    n = len(variables)
    if len(store.keys()) != n + 2:
        return False

    def shape(i):  # (Keras' H5 store reads the entry whole: once)
        value = store[str(i)]
        return tuple(value.shape if hasattr(value, "shape") else
                     np.shape(value))

    return shape(0) == () and shape(1) == () and all(
        shape(i + 2) == tuple(v.shape) for i, v in enumerate(variables))


def _inner_option(name):
    """A property of the wrapper that is the inner optimizer's `name`
    (Keras' base class sets its defaults, None, before there is one): a
    Keras user's `model.optimizer.clipnorm = 1.0` after `compile` wrapped
    the optimizer (QA: it was kept on the wrapper, which never reads it)."""

    def get(self):
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or self.__dict__.get("_sok_own_build"):
            return None  # (the base class' build: no accumulators of its own)
        return getattr(inner, name)

    def set(self, value):
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            if value is not None:
                raise ValueError(
                    f"OptimizerWrapper does not take `{name}`. Instead, set "
                    f"`{name}` on the inner optimizer. Received: "
                    f"{name}={value!r}.")
            return
        before = getattr(inner, name)
        if name == "gradient_accumulation_steps" and value != before and (
                inner.built):
            raise ValueError(
                f"OptimizerWrapper '{self.name}': set "
                "`gradient_accumulation_steps` before the first step (its "
                f"optimizer {type(inner).__name__} is built, without "
                f"accumulators). Received: {name}={value!r}.")
        setattr(inner, name, value)
        try:
            _check_supported(inner)
        except ValueError:
            setattr(inner, name, before)
            raise

    return property(get, set, doc=f"The inner optimizer's `{name}`.")


@keras.saving.register_keras_serializable(package="sok_keras")
class OptimizerWrapper(tf_slots.TableSlots, keras.optimizers.Optimizer):
    """Makes any supported Keras optimizer train sharded tables, sparsely.

    Keras' own optimizers update a whole table (and every slot) on each step
    once momentum or Adam-style slots are involved. The wrapper
    - applies the inner optimizer's rule lazily to `sok_keras.Variable`
      tables: only the rows looked up in the step change (and their slot
      rows), with the inner optimizer's hyperparameters and learning rate
      schedule, on the rank that owns the rows. Slots live beside the table
      rows (`table.slots`) and are saved with the table;
    - hands every other variable to the inner optimizer, with its dense
      gradient (an `IndexedSlices` gradient, such as a plain
      `keras.layers.Embedding`'s, is summed per row first: the update is
      the dense gradient's on any number of ranks, where Keras alone
      applies Adam, Adagrad, RMSprop, Ftrl and norm clipping entry by
      entry, which moves a row repeated in a batch differently);
    - with several ranks, averages dense gradients across ranks (one packed
      all-reduce per dtype) and starts dense weights identical on every
      rank (broadcast from rank 0 when built); table gradients are never
      all-reduced, only divided by the number of ranks (data-parallel mean).

    Supported inner optimizers: SGD (with momentum / Nesterov), Adagrad,
    Adam (with amsgrad), AdamW, Ftrl, RMSprop (centered, with momentum),
    Adamax, Adadelta, Lion, Nadam, Muon (tables take Muon's AdamW step,
    as Keras' Muon gives embeddings).
    Clipping set on the inner optimizer (`clipnorm`, `global_clipnorm`,
    `clipvalue`) covers tables too: see `clip_gradients`.

    Lazy rules differ from Keras' dense ones where rows are absent or
    repeated: a row absent from a step keeps its slots and its value
    (Keras decays every row's momentum / moments each step, AdamW's
    `weight_decay` shrinks every row, and Keras' Ftrl moves unused rows at
    its first step); an id repeated within a batch has its gradients
    summed before the rule sees them (the dense gradient's update, where
    Keras given `IndexedSlices` squares or clips each duplicate first).
    Adam's bias correction uses the global step. docs/design.md,
    "Optimizers", has the details.

    Args:
        inner_optimizer: a `keras.optimizers.Optimizer` instance.
        name: optional name.
        skip_nonfinite: bool, default False. If True, a step in which any
            gradient (a table's or a dense weight's, on any rank) is NaN or
            infinite is skipped on every rank: tables, slots and dense
            weights stay as they were, and `skipped_steps` counts it (as
            `LossScaleOptimizer` skips overflowing steps).
        jit_compile: "auto" (default), True or False. Whether the update of
            the dense weights (the inner optimizer's own) runs as one XLA
            computation. "auto" compiles it where Keras'
            `model.compile(jit_compile="auto")` would have compiled the
            whole step had the model no sok layers: in a traced step on a
            GPU, without a `tf.distribute` strategy or op determinism (see
            `compiles_dense_update`). The tables' updates are sok's own ops
            either way.
        check_sparse_rule: bool, default True: an inner optimizer with no
            sparse rule for tables is refused here. False defers that to
            the first table it is built to update (`compile` sets it for
            a model whose tables are all frozen, which any Keras optimizer
            may train).

    Example:

    ```python
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adam(1e-3)),
        loss="binary_crossentropy")
    ```
    """

    def __init__(self, inner_optimizer, name=None, skip_nonfinite=False,
                 jit_compile="auto", check_sparse_rule=True, **kwargs):
        for arg, default in _UNSUPPORTED_BASE_ARGS.items():
            if arg in kwargs:
                value = kwargs.pop(arg)
                if value != default:
                    raise ValueError(
                        f"OptimizerWrapper does not take `{arg}`. Instead, "
                        f"set `{arg}` on the inner optimizer. Received: "
                        f"{arg}={value!r}."
                    )
        if kwargs:
            raise ValueError(
                "OptimizerWrapper does not take arguments: "
                f"{sorted(kwargs)}."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "OptimizerWrapper wraps a keras.optimizers.Optimizer. "
                f"Received: {type(inner_optimizer).__name__}."
                f"{keras2_hint(inner_optimizer)}"
            )
        if isinstance(inner_optimizer, OptimizerWrapper):
            raise ValueError("OptimizerWrapper cannot wrap another one.")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            inner = type(inner_optimizer.inner_optimizer).__name__
            raise ValueError(
                "OptimizerWrapper cannot wrap a LossScaleOptimizer: wrap "
                "the other way round, "
                "`keras.optimizers.LossScaleOptimizer(sok.OptimizerWrapper("
                "keras.optimizers.Adam(...)))` (the loss scale then covers "
                "the tables' gradients too). Received: "
                f"LossScaleOptimizer({inner}).")
        if check_sparse_rule:
            sparse_rules.rule_for(inner_optimizer)  # fail early
        _check_supported(inner_optimizer)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                "`skip_nonfinite` must be a bool. Received: "
                f"skip_nonfinite={skip_nonfinite!r}.")
        check_jit_compile("OptimizerWrapper", jit_compile)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.skip_nonfinite = skip_nonfinite
        self.jit_compile = jit_compile
        self.check_sparse_rule = bool(check_sparse_rule)

    def build(self, var_list):
        dense = [v for v in var_list if not is_sok_variable(v)]
        self.inner_optimizer.build(dense)
        create_table_slots(self.inner_optimizer, var_list)
        self._sok_own_build = True
        try:
            super().build(var_list)
        finally:
            self._sok_own_build = False
        if self.skip_nonfinite:  # (so that older files still load)
            self.skipped_steps = self.add_variable(
                shape=(), dtype="int64", initializer="zeros",
                name="skipped_steps")
        broadcast_variables(dense, key="sok_optimizer/broadcast",
                            owner=self)

    @property
    def variables(self):
        # Not the step count and learning rate Keras' base class made for
        # the wrapper itself (`iterations` and `learning_rate` are the
        # inner optimizer's): they never change, and `model.summary()`
        # and `optimizer.variables` would show them beside Keras' own.
        own = [v for v in self._variables
               if v is not self._iterations and v is not self._learning_rate]
        return own + self.inner_optimizer.variables

    def load_own_variables(self, store):
        variables = self.variables
        if _earlier_layout(store, variables):
            # A file of an earlier version, which saved the wrapper's own
            # (unused) step count and learning rate first.
            store = {str(i): store[str(i + 2)]
                     for i in range(len(variables))}
        super().load_own_variables(store)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def apply_gradients(self, grads_and_vars, global_step=None, name=None,
                        **kwargs):
        """Keras' `apply_gradients`, with SOK's signature.

        Args:
            grads_and_vars: `(gradient, variable)` pairs; tables take
                `tf.IndexedSlices` gradients.
            global_step: optional, SOK's (TF1 optimizers') step counter:
                a variable incremented by one after the update.
            name: ignored (SOK's op name).

        Returns:
            The optimizer's `iterations`.
        """
        del name
        grads_and_vars = tf2_keras_arguments(
            "OptimizerWrapper", grads_and_vars, kwargs)
        super().apply_gradients(grads_and_vars)
        if global_step is not None:
            global_step.assign_add(tf.cast(1, global_step.dtype))
        return self.iterations

    @property
    def lr(self):
        """SOK's (and Keras 2's) name for `learning_rate`."""
        return self.learning_rate

    clipnorm = _inner_option("clipnorm")
    global_clipnorm = _inner_option("global_clipnorm")
    clipvalue = _inner_option("clipvalue")
    weight_decay = _inner_option("weight_decay")
    # (Review: these two were kept on the wrapper too: the loss was scaled
    # and never unscaled, and accumulation was ignored.)
    loss_scale_factor = _inner_option("loss_scale_factor")
    gradient_accumulation_steps = _inner_option("gradient_accumulation_steps")

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """The inner optimizer's `exclude_from_weight_decay` (tables
        included)."""
        self.inner_optimizer.exclude_from_weight_decay(
            var_list=var_list, var_names=var_names)

    @_not_converted
    def apply(self, grads, trainable_variables=None):
        build_once(self, trainable_variables)
        with tf.control_dependencies(sync_lazy_variables(self, grads)):
            self._apply_built(grads, trainable_variables)

    def _apply_built(self, grads, trainable_variables):
        variables = trainable_variables or self._trainable_variables

        def update():
            apply_with_tables(self.inner_optimizer, grads, variables,
                              self.inner_optimizer.apply,
                              jit_compile=self.jit_compile)

        if not self.skip_nonfinite:
            update()
            return
        from sok_keras import replicas

        if replicas.in_replica_context() and not tf.executing_eagerly():
            raise NotImplementedError(
                f"OptimizerWrapper '{self.name}': `skip_nonfinite=True` is "
                "not supported inside `strategy.run` of a strategy with "
                "several replicas in one process (the skipped branch would "
                "hold the strategy's gradient all-reduce). Use it with "
                "`sokrun` ranks, or leave it off.")
        finite = _all_finite(grads)

        def skip():
            self.skipped_steps.assign_add(1)

        if tf.executing_eagerly():
            update() if bool(finite) else skip()
        else:
            tf.cond(finite, lambda: update() or tf.constant(True),
                    lambda: skip() or tf.constant(False))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "OptimizerWrapper runs on the TensorFlow backend with stateful "
            "variables; stateless_apply is not supported."
        )

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(
            [v for v in var_list if not is_sok_variable(v)])

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer),
            "skip_nonfinite": self.skip_nonfinite,
            "jit_compile": self.jit_compile,
            # (Only when off: the configs of earlier files stay as they were.)
            **({} if self.check_sparse_rule else {"check_sparse_rule": False}),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # A deep copy: deserializing the inner optimizer rewrites its config
        # in place (e.g. a learning rate schedule's dict becomes the object).
        config = copy.deepcopy(config)
        if "inner_optimizer" not in config:
            raise ValueError(
                "OptimizerWrapper wraps an optimizer: its config needs "
                "`inner_optimizer` (write "
                "`sok.OptimizerWrapper(keras.optimizers.Adam(...))`, or use "
                "`sok.optimizers.Adam(...)`, whose name "
                "'sok_keras>Adam' also works in `compile`). Received: "
                f"config={config!r}.")
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
