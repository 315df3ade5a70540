"""Which sparse update rule serves which Keras optimizer, and its slots.

A rule reads the hyperparameters of a Keras optimizer instance (so learning
rate schedules and later changes are honoured), names the slot tables it
needs with their initial values, and applies the compiled lazy update
(`sparse_kernels`) to one table shard.

Slots are `sok_keras.Variable`s with the table's sharding: slot row `i`
sits on the same rank as table row `i`. A float16 or bfloat16 table gets
float32 slots (`sparse_kernels.slot_dtype`): its update runs in float32 and
only the table row is rounded, once, when it is stored. They hang off the table
(`table.slots`), so the layer that owns the table saves and restores them
with it, in global row order.
"""

import keras
import tensorflow as tf

from sok_keras.optimizers import sparse_kernels as k


class SparseRule:
    """One optimizer family's lazy update."""

    name = None
    keras_class = None
    # Adam's kernel applies the decoupled weight decay itself.
    fused_weight_decay = False

    def slots(self, opt):
        """Returns `[(slot_name, initial_value)]` for `opt`."""
        raise NotImplementedError

    def apply(self, opt, var, slots, indices, grad, lr, step):
        """Applies the update to rows `indices` of `var`."""
        raise NotImplementedError

    def prepare(self, opt):
        """Creates the optimizer-wide state the rule reads that Keras makes
        only in `build`, for a table's own optimizer (never built)."""

    def prepare_unbuilt(self, opt, outer=None):
        """Creates that state for a model's optimizer that a checkpoint
        restores before its first step builds it (`sok.load` of tables
        alone), as Keras' `build` names it when `outer` (`opt`, or the
        wrapper around it) is built; `after_build` carries its value into
        the state `build` makes."""

    def after_build(self, opt):
        """See `prepare_unbuilt` (called once `opt` is built)."""

    def advance(self, opt):
        """Advances that state by one step where Keras' own `apply` does
        not run for `opt` in the step (no dense weights)."""

    def check_table(self, opt, table):
        """Raises ValueError when `opt` would give `table` an update this
        rule does not make (the message is completed with the table's
        name)."""

    @staticmethod
    def weight_decay(opt, var):
        if opt.weight_decay is None or not opt._use_weight_decay(var):
            return 0.0
        return opt.weight_decay

    def decay(self, opt, var, indices, lr):
        """Keras' decoupled weight decay, lazily: `w -= w * weight_decay *
        lr` once on each distinct row of `indices`, before the rule's
        update (Keras applies it to every weight before its update step).

        Returns:
            The op (None when eager, or when no decay applies).
        """
        wd = self.weight_decay(opt, var)
        if self.fused_weight_decay or not wd:
            return None
        rows = tf.unique(tf.reshape(tf.convert_to_tensor(indices), [-1]))[0]
        values = tf.gather(k.table_variable(var), rows)
        # sparse_sgd's w - g * lr with g = w * weight_decay: Keras'
        # `w - w * weight_decay * lr`, operation for operation.
        return k.sparse_sgd(var, rows, values * tf.cast(wd, values.dtype),
                            lr)


class _Sgd(SparseRule):
    name, keras_class = "SGD", keras.optimizers.SGD

    def slots(self, opt):
        return [("momentum", 0.0)] if opt.momentum else []

    def apply(self, opt, var, slots, indices, grad, lr, step):
        if not opt.momentum:
            return k.sparse_sgd(var, indices, grad, lr)
        return k.sparse_momentum(
            var, slots["momentum"], indices, grad, lr, opt.momentum,
            nesterov=opt.nesterov)


class _Adagrad(SparseRule):
    name, keras_class = "Adagrad", keras.optimizers.Adagrad

    def slots(self, opt):
        return [("accumulator", opt.initial_accumulator_value)]

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_adagrad(var, slots["accumulator"], indices, grad, lr,
                                epsilon=opt.epsilon)


class _Adam(SparseRule):
    name, keras_class = "Adam", keras.optimizers.Adam
    fused_weight_decay = True

    def slots(self, opt):
        names = [("m", 0.0), ("v", 0.0)]
        return names + ([("vhat", 0.0)] if opt.amsgrad else [])

    def apply(self, opt, var, slots, indices, grad, lr, step):
        wd = self.weight_decay(opt, var)
        common = dict(beta_1=opt.beta_1, beta_2=opt.beta_2,
                      epsilon=opt.epsilon, vhat=slots.get("vhat"))
        if wd:
            return k.sparse_adamw(var, slots["m"], slots["v"], indices, grad,
                                  lr, step, weight_decay=wd, **common)
        return k.sparse_adam(var, slots["m"], slots["v"], indices, grad, lr,
                             step, **common)


class _AdamW(_Adam):
    name, keras_class = "AdamW", keras.optimizers.AdamW


class _Ftrl(SparseRule):
    name, keras_class = "Ftrl", keras.optimizers.Ftrl

    def slots(self, opt):
        return [("accumulator", opt.initial_accumulator_value),
                ("linear", 0.0)]

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_ftrl(
            var, slots["accumulator"], slots["linear"], indices, grad, lr,
            learning_rate_power=opt.learning_rate_power,
            l1_regularization_strength=opt.l1_regularization_strength,
            l2_regularization_strength=opt.l2_regularization_strength,
            l2_shrinkage_regularization_strength=(
                opt.l2_shrinkage_regularization_strength),
            beta=opt.beta)


class _RMSprop(SparseRule):
    name, keras_class = "RMSprop", keras.optimizers.RMSprop

    def slots(self, opt):
        names = [("velocity", 0.0)]
        if opt.momentum > 0:
            names.append(("momentum", 0.0))
        if opt.centered:
            names.append(("average_gradient", 0.0))
        return names

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_rmsprop(
            var, slots["velocity"], indices, grad, lr, rho=opt.rho,
            momentum=opt.momentum, epsilon=opt.epsilon,
            momentum_slot=slots.get("momentum"),
            average_gradient=slots.get("average_gradient"))


class _Adamax(SparseRule):
    name, keras_class = "Adamax", keras.optimizers.Adamax

    def slots(self, opt):
        return [("momentum", 0.0), ("norm", 0.0)]

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_adamax(
            var, slots["momentum"], slots["norm"], indices, grad, lr, step,
            beta_1=opt.beta_1, beta_2=opt.beta_2, epsilon=opt.epsilon)


class _Adadelta(SparseRule):
    name, keras_class = "Adadelta", keras.optimizers.Adadelta

    def slots(self, opt):
        return [("accumulated_grad", 0.0), ("accumulated_delta_var", 0.0)]

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_adadelta(
            var, slots["accumulated_grad"], slots["accumulated_delta_var"],
            indices, grad, lr, rho=opt.rho, epsilon=opt.epsilon)


class _Lion(SparseRule):
    name, keras_class = "Lion", keras.optimizers.Lion

    def slots(self, opt):
        return [("momentum", 0.0)]

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_lion(var, slots["momentum"], indices, grad, lr,
                             beta_1=opt.beta_1, beta_2=opt.beta_2)


class _Nadam(SparseRule):
    name, keras_class = "Nadam", keras.optimizers.Nadam

    def slots(self, opt):
        return [("momentum", 0.0), ("velocity", 0.0)]

    def prepare(self, opt):
        if getattr(opt, "_u_product", None) is None:
            with tf.init_scope():
                # As Nadam.build makes it with no variables.
                opt._u_product = keras.Variable(
                    1.0, dtype=keras.config.floatx(), trainable=False,
                    name="u_product")

    def prepare_unbuilt(self, opt, outer=None):
        if opt.built or getattr(opt, "_u_product", None) is not None:
            return
        outer = opt if outer is None else outer
        # (Keras builds the inner optimizer of a wrapper in the wrapper's
        # name scope.)
        with tf.init_scope(), keras.name_scope(outer.name, caller=outer):
            # Named as Nadam.build names it (`<optimizer>/variable`).
            opt._u_product = keras.Variable(1.0,
                                            dtype=keras.config.floatx())
        object.__setattr__(opt, "_sok_pending_u_product", opt._u_product)

    def after_build(self, opt):
        pending = opt.__dict__.get("_sok_pending_u_product")
        if pending is None or not opt.built or opt._u_product is pending:
            return
        # Nadam.build made its own: it takes the restored value, and the
        # stand-in leaves the optimizer's variables.
        with tf.init_scope():
            opt._u_product.assign(
                tf.cast(pending.value, opt._u_product.dtype))
        for i, v in enumerate(opt._variables):
            if v is pending:
                del opt._variables[i]
                break
        object.__setattr__(opt, "_sok_pending_u_product", None)

    @staticmethod
    def _u_product(opt):
        """The optimizer's momentum-schedule product after this step's
        factor: Keras' `Nadam._backend_update_step` expression."""
        ops = keras.ops
        dtype = opt._u_product.dtype
        return (opt._u_product * opt.beta_1
                * (1.0 - 0.5 * ops.power(
                    0.96, ops.cast(opt.iterations + 1, dtype))))

    def advance(self, opt):
        opt._u_product.assign(self._u_product(opt))

    def apply(self, opt, var, slots, indices, grad, lr, step):
        # The schedule in the slots' dtype, as Nadam.update_step computes
        # it in the variable's; the moments take the same cast betas as
        # the schedule (QA: in float64, the exact betas beside a
        # schedule of float32-rounded ones left a 6e-6 relative error).
        ops = keras.ops
        dtype = k.slot_dtype(var.dtype)
        local_step = ops.cast(opt.iterations + 1, dtype)
        next_step = ops.cast(opt.iterations + 2, dtype)
        decay = ops.cast(0.96, dtype)
        beta_1 = ops.cast(opt.beta_1, dtype)
        beta_2 = ops.cast(opt.beta_2, dtype)
        u_t = beta_1 * (1.0 - 0.5 * (ops.power(decay, local_step)))
        u_t_1 = beta_1 * (1.0 - 0.5 * (ops.power(decay, next_step)))
        u_product = ops.cast(self._u_product(opt), dtype)
        beta_2_power = ops.power(beta_2, local_step)
        return k.sparse_nadam(
            var, slots["momentum"], slots["velocity"], indices, grad, lr,
            u_t, u_t_1, u_product, beta_2_power, beta_1=beta_1,
            beta_2=beta_2, epsilon=opt.epsilon)


class _Muon(SparseRule):
    """Keras' Muon gives embeddings its AdamW step (`exclude_embeddings`,
    on by default): a table takes that step, lazily, with Muon's
    `adam_beta_1`, `adam_beta_2`, `epsilon`, `learning_rate *
    adam_lr_ratio` and `adam_weight_decay` (decayed with the unscaled
    learning rate, as Muon's `_apply_weight_decay` does). Its
    Newton-Schulz step orthogonalizes a whole matrix's gradient, which
    has no row-wise (sparse, sharded) form: a table Muon would give it is
    refused."""

    name, keras_class = "Muon", keras.optimizers.Muon

    def check_table(self, opt, table):
        if opt.exclude_embeddings or opt._should_use_adamw(table):
            return
        raise ValueError(
            "Muon with exclude_embeddings=False gives this table its "
            "Newton-Schulz step, which orthogonalizes the whole table's "
            "gradient and has no sparse (row-wise, sharded) form. Use "
            "exclude_embeddings=True (Keras' default: embeddings take "
            "Muon's AdamW step) or name the table's layer in "
            "exclude_layers.")

    def slots(self, opt):
        # Keras' names for the AdamW step's slots.
        return [("momentum", 0.0), ("velocity", 0.0)]

    @staticmethod
    def weight_decay(opt, var):
        if opt.adam_weight_decay is None or not opt._use_weight_decay(var):
            return 0.0
        return opt.adam_weight_decay

    def apply(self, opt, var, slots, indices, grad, lr, step):
        return k.sparse_adam(
            var, slots["momentum"], slots["velocity"], indices, grad,
            lr * opt.adam_lr_ratio, step, beta_1=opt.adam_beta_1,
            beta_2=opt.adam_beta_2, epsilon=opt.epsilon)


# Subclasses first: AdamW is an Adam.
_RULES = (_AdamW(), _Adam(), _Adagrad(), _Ftrl(), _RMSprop(), _Sgd(),
          _Adamax(), _Adadelta(), _Lion(), _Nadam(), _Muon())
SUPPORTED = tuple(r.name for r in _RULES)


def rule_for(optimizer):
    """Returns the `SparseRule` of a Keras optimizer, or raises ValueError.

    The match is on the exact class (a user's subclass may change the update,
    so it has no sparse rule); sok_keras' own sparse optimizers name the Keras
    class they implement in `_sok_keras_class`. Every rule takes Keras'
    `weight_decay` (applied lazily, to the rows a step updates).
    """
    rule = _rule_or_none(optimizer)
    if rule is None:
        raise ValueError(
            "sok_keras has no sparse update rule for "
            f"{type(optimizer).__name__}. Supported optimizers: "
            f"{', '.join(SUPPORTED)}."
        )
    return rule


def _rule_or_none(optimizer):
    cls = getattr(type(optimizer), "_sok_keras_class", type(optimizer))
    for rule in _RULES:
        if cls is rule.keras_class:
            return rule
    return None


def _for_rule_of(method):
    """A module-level `method(optimizer, ...)`: the `SparseRule` method of
    `optimizer`'s rule, if it has one (else nothing)."""

    def call(optimizer, *args):
        rule = _rule_or_none(optimizer)
        if rule is not None:
            getattr(rule, method)(optimizer, *args)

    call.__name__ = method
    call.__doc__ = f"`SparseRule.{method}` of `optimizer`'s rule, if any."
    return call


advance = _for_rule_of("advance")
prepare_unbuilt = _for_rule_of("prepare_unbuilt")
after_build = _for_rule_of("after_build")


def optimizer_chain(optimizer):
    """`[optimizer, the optimizer it wraps, ...]`: through
    `LossScaleOptimizer` and `OptimizerWrapper` (`inner_optimizer`)."""
    chain = []
    while optimizer is not None:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def slot_owner(optimizer, table):
    """The optimizer whose slots of `table` a step of `optimizer` updates:
    the table's own optimizer (a layer's `optimizer=`) if it has one, else
    the innermost of `optimizer`'s wrappers (`LossScaleOptimizer`,
    `OptimizerWrapper`): the one whose rule `ensure_slots` is given."""
    if table.optimizer is not None:
        return table.optimizer
    return optimizer_chain(optimizer)[-1]


def ensure_slots(rule, optimizer, table):
    """Creates (once) the slot tables `rule` needs beside `table`, for
    `optimizer`: each optimizer has its own slots of a table, and those of
    the one updating it are the current ones (`Variable.claim_slots`).

    Returns:
        A dict `{slot_name: sok_keras.Variable}`.
    """
    from sok_keras.variable import Variable

    if table.optimizer is optimizer:  # a table's own: never built
        rule.prepare(optimizer)
    table.claim_slots(optimizer)
    have = table.slots
    wanted = rule.slots(optimizer) + accumulator_slots(optimizer)
    with tf.init_scope():
        for slot, initial in wanted:
            if slot in have:
                continue
            table.add_slot(slot, Variable(
                keras.initializers.Constant(initial),
                shape=table.global_shape,
                mode=table.mode,
                dtype=k.slot_dtype(table.dtype).name,
                trainable=False,
                name=f"{table.path.replace('/', '.')}.{slot}",
            ))
    return {name: have[name] for name, _ in wanted}


ACCUMULATOR = "gradient_accumulator"  # Keras' name for it


def accumulator_slots(optimizer):
    """`[(name, initial)]` of the slot summing a table's gradients between
    updates, for an optimizer with `gradient_accumulation_steps`."""
    if getattr(optimizer, "gradient_accumulation_steps", None):
        return [(ACCUMULATOR, 0.0)]
    return []
