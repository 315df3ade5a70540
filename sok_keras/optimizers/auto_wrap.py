"""`model.compile(optimizer="adam")` on a model with sok tables: the plain
Keras optimizer is wrapped in `OptimizerWrapper`, with one log line.

A plain Keras optimizer would otherwise train a sok model wrongly and say
nothing: dense gradients are not averaged across ranks (the ranks' dense
weights drift apart) and the tables get Keras' dense, full-size slots and
updates. `sok_keras` routes `keras.Model.compile` through `compile_hook`
(installed when sok_keras is imported): when the model holds sok embedding
layers and the optimizer is a Keras optimizer (a string, a config or an
instance) that is not already sok-aware, it is replaced by
`OptimizerWrapper(optimizer)`. Everything else passes through unchanged.

With several ranks, `install_loop_hooks` (called by `sok_keras.init()`)
also routes `fit`, `evaluate` and `predict` through
`sok_keras.divergence.run_loop` (step tracking, fast failure when the ranks
diverge) and, for models with sok tables, makes the first traced step
compare the tables and the lookups across ranks
(`sok_keras.consistency`); `fit` and `evaluate` get a
`sok_keras.callbacks.GlobalMetrics` first among their callbacks, and
`evaluate` returns global values (`sok_keras.callbacks.with_global_metrics`;
off with `sok.init(global_metrics=False)` or `SOK_GLOBAL_METRICS=0`), so
that every callback decides from the same, global, logs on every rank.

Loss scaling. Under `mixed_float16` Keras wraps the compiled optimizer in
`keras.optimizers.LossScaleOptimizer` itself: a model with sok tables ends
up with `LossScaleOptimizer(OptimizerWrapper(inner))` (a given
`LossScaleOptimizer` around a plain optimizer is rebuilt that way).
`install` makes the finite check of a `LossScaleOptimizer` around a
sok-aware optimizer global when there are several ranks: a non-finite
gradient on any rank makes every rank skip the step and halve its scale
alike (a per-rank check would have one rank apply the step, and wait in
its gradient all-reduce, while another skips it). It also makes such a
`LossScaleOptimizer` scale the loss by `scale / N` on N ranks and its
gradients by N before it unscales them (in the variables' dtype,
float32): each rank's loss is a mean over its own `B / N` rows, so
without it the float16 gradients inside the backward pass are N times
one process's, and overflow (skipping steps one process applies) at a
scale one process keeps. With it the backward pass sees one process's
magnitudes, the way Keras' `tf.distribute` training scales each
replica's loss by 1 / replicas.
"""

import contextvars
import functools
import inspect
import logging

import keras

_ORIGINAL_COMPILE = None
_ORIGINAL_CHECK_FINITE = None
_ORIGINAL_LSO = {}
_ORIGINAL_BUILD = None
_ORIGINAL_FILTER = None
_ORIGINAL_LOOPS = {}
_STEPS = {"fit": (("train_step", "train_function"),),
          "evaluate": (("test_step", "test_function"),),
          "predict": (("predict_step", "predict_function"),)}
_ON_BATCH_LOOP = {"train_on_batch": "fit", "test_on_batch": "evaluate",
                  "predict_on_batch": "predict"}
_LOG = logging.getLogger("sok_keras")
# The loop (`fit`, `evaluate`, ...) whose hook is running (several ranks).
_LOOP_KIND = contextvars.ContextVar("sok_keras_loop_kind", default=None)


def has_sok_layers(model):
    """Whether `model` (built or not) holds a sok embedding layer, at any
    depth, or (once built) a `sok_keras.Variable` that a custom layer
    looks up itself."""
    from sok_keras.layers.base_embedding import BaseEmbedding
    from sok_keras.layers.embedding_collection import EmbeddingCollection
    from sok_keras.variable import is_sok_variable

    kinds = (BaseEmbedding, EmbeddingCollection)
    # Keras' own walk: a model's layers and the layers any layer keeps as
    # attributes (a sok layer inside a custom layer), at every depth.
    if any(isinstance(layer, kinds)
           for layer in model._flatten_layers(include_self=False)):
        return True
    return any(is_sok_variable(v) for v in model.variables)


def is_sok_aware(optimizer):
    from sok_keras.optimizers.sparse_optimizers import _TablesMixin
    from sok_keras.optimizers.wrapper import OptimizerWrapper

    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    return isinstance(optimizer, (OptimizerWrapper, _TablesMixin)) or (
        inner is not None and is_sok_aware(inner))


def wrap_for(model, optimizer):
    """`optimizer`, wrapped in `OptimizerWrapper` if `model` needs it."""
    if optimizer is None or not has_sok_layers(model):
        return optimizer
    opt = keras.optimizers.get(optimizer)
    if is_sok_aware(opt):
        return opt
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and not opt.built:
        # LossScaleOptimizer(plain) -> LossScaleOptimizer(OptimizerWrapper):
        # the loss scaling stays outermost, as Keras puts it.
        return keras.optimizers.LossScaleOptimizer(
            wrap_for(model, opt.inner_optimizer),
            initial_scale=opt.initial_scale,
            dynamic_growth_steps=opt.dynamic_growth_steps, name=opt.name)
    from sok_keras import world
    from sok_keras.consistency import model_tables
    from sok_keras.optimizers import sparse_rules
    from sok_keras.optimizers.wrapper import OptimizerWrapper
    from sok_keras.optimizers.wrapper import rule_for_table

    # The optimizer needs a sparse rule only for the tables it trains: not
    # for frozen ones (any optimizer may train a model whose tables are all
    # frozen, as with frozen keras.layers.Embedding tables), nor for those
    # with an optimizer of their own (a layer's `optimizer=`). Those it
    # trains are checked now, each error naming its table.
    tables = model_tables(model)
    for table in tables:
        if table.trainable and table.optimizer is None:
            rule_for_table(opt, table)
    try:
        sparse_rules.rule_for(opt)
        check = True
    except ValueError:
        check = not tables  # tables unknown yet (an unbuilt model): refuse
    if world.rank() == 0:
        _LOG.warning(
            "sok_keras: model '%s' holds sok embedding tables; its optimizer "
            "%s is wrapped in sok_keras.optimizers.OptimizerWrapper (sparse "
            "table updates, dense gradients averaged over ranks).",
            model.name, type(opt).__name__)
    return OptimizerWrapper(opt, check_sparse_rule=check)


def _install_global_finite_check():
    """Makes `LossScaleOptimizer.check_finite` global for sok-aware inner
    optimizers on several ranks (idempotent)."""
    global _ORIGINAL_CHECK_FINITE
    if _ORIGINAL_CHECK_FINITE is not None:
        return
    cls = keras.optimizers.LossScaleOptimizer
    _ORIGINAL_CHECK_FINITE = cls.check_finite

    @functools.wraps(_ORIGINAL_CHECK_FINITE)
    def check_finite(self, grads):
        from sok_keras import world

        if world.num_ranks() > 1 and is_sok_aware(self.inner_optimizer):
            from sok_keras.optimizers.wrapper import _all_finite

            return _all_finite(grads, key="sok_optimizer/loss_scale_finite")
        return _ORIGINAL_CHECK_FINITE(self, grads)

    cls.check_finite = check_finite


def _rank_share(lso):
    """N when `lso` (a `LossScaleOptimizer`) scales one rank's share of a
    loss on N ranks (a sok-aware inner optimizer, no `tf.distribute`
    strategy in charge), else 1."""
    from sok_keras import world
    from sok_keras.optimizers.wrapper import under_strategy

    n = world.num_ranks()
    if n > 1 and is_sok_aware(lso.inner_optimizer) and not under_strategy():
        return n
    return 1


def _install_rank_loss_scaling():
    """`LossScaleOptimizer.scale_loss` divides by N and `apply` multiplies
    the gradients by N on N ranks (see the module's docstring;
    idempotent)."""
    if _ORIGINAL_LSO:
        return
    import tensorflow as tf

    cls = keras.optimizers.LossScaleOptimizer
    _ORIGINAL_LSO.update(scale_loss=cls.scale_loss, apply=cls.apply)

    @functools.wraps(_ORIGINAL_LSO["scale_loss"])
    def scale_loss(self, loss):
        scaled = _ORIGINAL_LSO["scale_loss"](self, loss)
        n = _rank_share(self)
        return scaled if n == 1 else scaled / tf.cast(n, scaled.dtype)

    def _times(g, n):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * tf.cast(n, g.values.dtype),
                                    g.indices, g.dense_shape)
        return g * tf.cast(n, g.dtype)

    @functools.wraps(_ORIGINAL_LSO["apply"])
    def apply(self, grads, trainable_variables=None):
        n = _rank_share(self)
        variables = trainable_variables
        if variables is None and self.built:
            variables = self._trainable_variables
        if n > 1 and variables is not None:
            # (Keras leaves the gradients of overwrite_with_gradient
            # variables unscaled: they are values, not gradients.)
            grads = [g if g is None
                     or self._overwrite_variable_with_gradient(v)
                     else _times(g, n)
                     for g, v in zip(list(grads), variables)]
        return _ORIGINAL_LSO["apply"](self, grads, trainable_variables)

    cls.scale_loss = scale_loss
    cls.apply = apply


def _compiled_before_tables(optimizer):
    """The model (or None) that `optimizer` was compiled into while that
    model was unbuilt and showed no sok layers (see `install`)."""
    ref = getattr(optimizer, "_sok_compiled_unbuilt", None)
    return ref() if ref is not None else None


def _mark_compiled_before_tables(model):
    """Remembers, on each optimizer of `model`'s compiled chain, that
    `compile` could not see whether `model` has sok tables (it is not
    built and shows no sok layer yet: a subclassed model may make them in
    its `build()`)."""
    import weakref

    from sok_keras.optimizers.sparse_rules import optimizer_chain

    opt = getattr(model, "optimizer", None)
    if opt is None or model.built or has_sok_layers(model) or is_sok_aware(
            opt):
        return
    for o in optimizer_chain(opt):
        object.__setattr__(o, "_sok_compiled_unbuilt", weakref.ref(model))


def _refuse_if_compiled_before_tables(optimizer, variables):
    """A plain optimizer compiled into a model that made its sok tables
    only after `compile` (in its `build()`): `compile` could not wrap it,
    and it would train the tables with Keras' dense rule (and, on several
    ranks, leave the dense gradients unaveraged). Said clearly instead."""
    from sok_keras.variable import is_sok_variable

    model = _compiled_before_tables(optimizer)
    if model is None or is_sok_aware(optimizer) or isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer):
        return
    own = {id(v) for v in model.variables}
    # (Its own tables: the optimizer may serve a custom loop later.)
    tables = [v.path for v in variables
              if is_sok_variable(v) and id(v) in own]
    if not tables:
        return
    name = type(optimizer).__name__
    raise ValueError(
        f"sok_keras: model '{model.name}' made its sok table(s) {tables} "
        "after `compile` (in its `build()`), so `compile` could not wrap "
        f"its optimizer {name} in sok.OptimizerWrapper, and a plain Keras "
        "optimizer would update the tables with Keras' dense rule (and, on "
        "several ranks, not average the dense gradients). Build the model "
        "before `compile` (call it on a batch, or `model.build(input_"
        "shape)`; this one is built now, so compiling it again wraps the "
        "optimizer), or use sok.OptimizerWrapper(keras.optimizers."
        f"{name}(...)) or sok.optimizers.{name}(...). (`fit`, `evaluate` "
        "and `train_on_batch` build such a model from their first batch "
        "and wrap the optimizer themselves, where Keras can build it "
        "symbolically.)")


def _rewrap_compiled_optimizer(model):
    """`wrap_for` again, for an optimizer compiled while `model` was
    unbuilt, once the model is built and shows sok layers (before the
    optimizer is built)."""
    opt = getattr(model, "optimizer", None)
    if opt is None or opt.built or _compiled_before_tables(opt) is not model:
        return
    if not (model.built and has_sok_layers(model)):
        return
    from sok_keras.optimizers.sparse_rules import optimizer_chain

    for o in optimizer_chain(opt):
        object.__setattr__(o, "_sok_compiled_unbuilt", None)
    model.optimizer = wrap_for(model, opt)
    if model.jit_compile:
        # `compile` resolved it while no sok layer was visible (XLA on a
        # GPU); the op library has no XLA kernels (Keras' setter says so).
        model.jit_compile = False
    kind = _LOOP_KIND.get()
    if kind is not None:
        # A loop's hook (several ranks) saw no sok layer yet: the first
        # steps' comparison of the ranks, as for any model with tables.
        _check_first_steps(model, kind)


def _builds_own_layers(model):
    """Whether `model`'s class (not Keras') defines `build()`, where a
    subclassed model may make its sok layers."""
    for cls in type(model).__mro__:
        if "build" in cls.__dict__:
            return cls.__module__.split(".")[0] != "keras"
    return False


def _awaits_tables(model):
    """Whether `model` was compiled unbuilt with a plain optimizer, is
    still unbuilt, makes layers in its own `build()` (where sok layers
    may appear), and runs without a `tf.distribute` strategy (whose
    scope Keras builds it in): `_build_compiled_before_tables` builds it
    at the start of `fit` / `evaluate` / `train_on_batch`."""
    opt = getattr(model, "optimizer", None)
    return not (model.built or opt is None or opt.built
                or _compiled_before_tables(opt) is not model
                or model._distribute_strategy is not None
                or not _builds_own_layers(model))


def _batch_spec(iterator):
    """The structure of `iterator`'s batches as their `tf.TypeSpec`s (the
    dataset's `element_spec`: what Keras' `_symbolic_build` reads of a
    batch is its shape and dtype), or None where a spec's rank, or a
    dense component's size past the batch dimension, is unknown.

    Building from the spec pulls no batch: Keras' `fit` resets the
    iterator after the build, and over a dataset that reshuffles each
    iteration (`shuffle(n, seed=...)`'s default) a pulled batch would
    make the first epoch run the pipeline's second order, not the one
    a model built before `fit` (or built in its first step, as Keras
    does without a strategy) trains on."""
    import tensorflow as tf

    dataset = getattr(iterator, "_distributed_dataset", None)
    spec = getattr(dataset, "element_spec", None)
    if spec is None:
        return None
    leaves = tf.nest.flatten(spec)
    if not leaves or any(getattr(s, "shape", None) is None
                         or s.shape.rank is None
                         or getattr(s, "dtype", None) is None
                         for s in leaves):
        return None
    if any(isinstance(s, tf.TensorSpec) and None in s.shape[1:]
           for s in leaves):
        # (A dense batch's own shape is known where its spec's is not, a
        # `padded_batch`'s lengths: a model built from it, as Keras
        # builds one eagerly, may need them. Pull the batch, as before.)
        return None
    return spec


def _build_compiled_before_tables(model, iterator, data_batch):
    """Builds, from the first batch's shapes (`_batch_spec`), a model
    compiled unbuilt with a plain optimizer whose class makes layers in
    its own `build()` (as Keras does under a strategy, `_symbolic_build`),
    leaving the optimizer unbuilt.
    `_rewrap_compiled_optimizer` then wraps the optimizer for the tables
    it made, and a `jit_compile` that `compile` resolved while no sok
    layer was visible (XLA on a GPU) is turned off as Keras turns it off
    for layers without XLA kernels. Before, the first step refused the
    model (and on a GPU, XLA refused its lookup first). A model this
    cannot build is left to Keras, which builds it inside the first
    traced step, as without sok_keras (on several ranks, every rank
    fails alike: Keras' build is the same code on the same shapes)."""
    if not _awaits_tables(model):
        return
    opt = model.optimizer
    opt.built = True  # (`_symbolic_build` then builds the model only)
    if data_batch is None:
        data_batch = _batch_spec(iterator)
    try:
        model._symbolic_build(iterator=iterator, data_batch=data_batch)
    except Exception:  # noqa: BLE001 -- Keras builds it in the step
        _LOG.debug("sok_keras: model '%s' not built before its first "
                   "step", model.name, exc_info=True)
        return
    finally:
        opt.built = False


def _build_optimizer_before_the_step(model):
    """Builds the optimizer of a built model with sok tables (or a sok
    optimizer) before its first training step (`make_train_function`), as
    Keras does under a strategy.

    Without a strategy Keras builds the optimizer inside the first traced
    step; TensorFlow then traces that step a second time, since the first
    trace made variables (the slots). With sok lookups, whose exchanges
    make a step's trace long, that doubled the time to the first step
    (QA: 33 s of which about half the second trace, 40 tables, 2 ranks).
    A model with a layer still unbuilt (an RNN cell with no `build()`,
    whose weights the first step makes) is left to Keras: its optimizer
    must be built for those weights too."""
    opt = getattr(model, "optimizer", None)
    if (opt is None or getattr(opt, "built", True) or not model.built
            or model._distribute_strategy is not None
            or not (has_sok_layers(model) or is_sok_aware(opt))
            or not all(layer.built for layer in model._flatten_layers())):
        return
    from sok_keras.optimizers.wrapper import build_once

    # (In the optimizer's name scope, as Keras' `apply` builds it: the
    # variables' paths stay those of files saved before.)
    build_once(opt, model.trainable_variables)


def _install_symbolic_build_hook():
    """Keras' `_maybe_symbolic_build` (the start of `fit`, `evaluate`,
    `train_on_batch`, ...) wraps an optimizer compiled into a then-unbuilt
    model that has since been built with sok layers (or builds such a
    model first, `_build_compiled_before_tables`); and, on several
    ranks, builds a model with sok tables (or a sok optimizer) eagerly
    from the first batch (idempotent).

    Keras' TensorFlow trainer builds a model that is not built yet (a
    Sequential with no `keras.Input`, a subclassed model not called yet)
    and its optimizer inside the first traced step, when no strategy is
    set. There the optimizer's broadcast of the dense weights read
    variables made in that same trace, which have no value yet, and every
    rank failed at the first step. With sok tables on several ranks such a
    model is built from the first batch, as Keras does under a strategy
    (`_symbolic_build`)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer._maybe_symbolic_build
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        from sok_keras import world

        _build_compiled_before_tables(self, iterator, data_batch)
        _rewrap_compiled_optimizer(self)
        if (world.num_ranks() > 1 and self._distribute_strategy is None
                and not self.built and (has_sok_layers(self) or is_sok_aware(
                    getattr(self, "optimizer", None)))):
            if data_batch is None:
                data_batch = _batch_spec(iterator)
            return self._symbolic_build(iterator=iterator,
                                        data_batch=data_batch)
        return original(self, iterator=iterator, data_batch=data_batch)

    _maybe_symbolic_build._sok_keras = True
    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build

    # `fit` and `train_on_batch` make the train function after the build
    # above (and, in `fit`, before the callbacks begin: BackupAndRestore
    # restores into the built optimizer); `evaluate` makes none (review:
    # built there, the optimizer gave an evaluate-only job its slots, and
    # one built for other trainable weights than `fit`'s failed).
    make_train = TensorFlowTrainer.make_train_function

    @functools.wraps(make_train)
    def make_train_function(self, *args, **kwargs):
        _build_optimizer_before_the_step(self)
        return make_train(self, *args, **kwargs)

    make_train_function._sok_keras = True
    TensorFlowTrainer.make_train_function = make_train_function


def _install_jit_support_check():
    """Keras' XLA check (`model_supports_jit`: `compile`'s "auto", the
    `jit_compile` setter) asks each layer's `supports_jit`; sok layers say
    no. A model (or custom layer) that holds a `sok_keras.Variable` itself
    and looks it up with `sok.lookup_sparse` has no such layer: on a GPU
    "auto" compiled its step with XLA and the first lookup failed (H100
    run 29). The check now also answers no for it (idempotent)."""
    from keras.src.trainers import trainer

    original = trainer.model_supports_jit
    if getattr(original, "_sok_keras", False):
        return

    @functools.wraps(original)
    def model_supports_jit(model):
        return original(model) and not has_sok_layers(model)

    model_supports_jit._sok_keras = True
    trainer.model_supports_jit = model_supports_jit


def _install_plain_optimizer_check():
    """Makes a plain Keras optimizer built for sok tables and dense weights
    on several ranks say what it does (when it is built, on rank 0;
    idempotent).
    Outside `compile` (a custom training loop's `opt.apply_gradients`)
    nothing wraps it: it applies each rank's own dense gradients (the
    ranks' dense weights drift apart unless the loop averages them, as
    Horovod's `DistributedGradientTape` does) and SOK's summed table
    gradients with Keras' dense update. SOK's own recipes do that on
    purpose (and the seed's plain SGD on tables alone is SOK's semantics),
    so it is said, not refused."""
    global _ORIGINAL_BUILD
    from keras.src.optimizers import base_optimizer

    if _ORIGINAL_BUILD is not None:
        return
    cls = base_optimizer.BaseOptimizer
    original = _ORIGINAL_BUILD = cls.build

    @functools.wraps(original)
    def build(self, variables):
        from sok_keras import world
        from sok_keras.variable import is_sok_variable

        _refuse_if_compiled_before_tables(self, variables)
        # (A LossScaleOptimizer builds its inner optimizer, which says it.)
        if world.num_ranks() > 1 and not is_sok_aware(self) and (
                world.rank() == 0) and not isinstance(
                    self, keras.optimizers.LossScaleOptimizer):
            tables = [v for v in variables if is_sok_variable(v)]
            dense = len(variables) - len(tables)
            if tables and dense:
                name = type(self).__name__
                _LOG.warning(
                    "sok_keras: the plain Keras optimizer %s updates sok "
                    "table(s) %s and %d dense weight(s) on %d ranks. It "
                    "does not average the dense gradients across ranks (the "
                    "ranks' dense weights drift apart unless your loop "
                    "averages them, as Horovod's DistributedGradientTape "
                    "does), and it updates every row of the tables with "
                    "Keras' dense rule and SOK's summed (not averaged) "
                    "table gradients. For data-parallel training wrap it: "
                    "sok.OptimizerWrapper(keras.optimizers.%s(...)), or use "
                    "sok.optimizers.%s(...) (model.compile wraps it for "
                    "you).", name, ", ".join(repr(t.path) for t in tables),
                    dense, world.num_ranks(), name, name)
        return original(self, variables)

    cls.build = build


def _install_empty_shard_filter():
    """Makes a plain Keras optimizer leave out the sok tables whose shard
    on this rank is empty (a localized table owned by another rank: `[0,
    dim]`). There is nothing to update there, and several of Keras' rules
    (Adadelta, Ftrl, RMSprop, Lion, Nadam) fail on such a variable: Keras'
    `ops.add` takes a `[0, dim]` operand for a bias (idempotent)."""
    global _ORIGINAL_FILTER
    from keras.src.optimizers import base_optimizer

    if _ORIGINAL_FILTER is not None:
        return
    cls = base_optimizer.BaseOptimizer
    original = _ORIGINAL_FILTER = cls._filter_empty_gradients

    @functools.wraps(original)
    def _filter_empty_gradients(self, grads, variables):
        from sok_keras.variable import is_sok_variable

        grads, variables = original(self, grads, variables)
        keep = [i for i, v in enumerate(variables)
                if not (is_sok_variable(v) and 0 in tuple(v.shape))]
        if len(keep) == len(variables):
            return grads, variables
        if not keep:
            # Keras' `apply` then updates nothing but the step count: the
            # optimizer-wide state its update step would advance (Nadam's
            # schedule) moves too, as on the ranks with rows.
            from sok_keras.optimizers import sparse_rules

            sparse_rules.advance(self)
        return [grads[i] for i in keep], [variables[i] for i in keep]

    cls._filter_empty_gradients = _filter_empty_gradients


def install():
    """Routes `keras.Model.compile` through `wrap_for`, makes loss
    scaling's finite check global and its scale one rank's share, and
    makes plain Keras optimizers built for sok tables on several ranks say
    what they do (idempotent)."""
    global _ORIGINAL_COMPILE
    _install_global_finite_check()
    _install_rank_loss_scaling()
    _install_plain_optimizer_check()
    _install_empty_shard_filter()
    _install_symbolic_build_hook()
    _install_jit_support_check()
    if _ORIGINAL_COMPILE is not None:
        return
    # Patch the class that defines compile (Keras' Trainer), not
    # keras.Model: Keras skips compile_from_config on load when a model's
    # compile differs from Trainer.compile.
    owner = next(c for c in keras.Model.__mro__ if "compile" in c.__dict__)
    _ORIGINAL_COMPILE = owner.compile

    @functools.wraps(_ORIGINAL_COMPILE)
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        result = _ORIGINAL_COMPILE(self, wrap_for(self, optimizer), *args,
                                   **kwargs)
        _mark_compiled_before_tables(self)
        return result

    owner.compile = compile


def _check_first_steps(model, kind):
    """Wraps the model's step methods whose functions are not made yet, so
    that their first trace compares the ranks (models with sok tables)."""
    if not has_sok_layers(model):
        return
    from sok_keras import consistency

    tables = consistency.model_tables(model)
    if tables and not getattr(model, "_sok_tables_compared", False):
        # A built model: compare its tables now, before Keras builds the
        # optimizer (which broadcasts the dense weights).
        object.__setattr__(model, "_sok_tables_compared", True)
        consistency.compare(
            {"tables": [consistency.table_signature(
                t, getattr(model, "optimizer", None))
                        for t in tables],
             "dense": consistency.dense_signature(model)},
            "consistency/start",
            f"the start of {kind} of model '{model.name}'")
    optimizer = getattr(model, "optimizer", None)
    trained = optimizer is not None and optimizer.built
    if tables and model.built and not trained and not getattr(
            model, "_sok_dense_aligned", False):
        # Rank 0's dense weights everywhere, also for a `predict` or
        # `evaluate` before any training (each rank initialized its own:
        # the ranks would predict with N different models, and evaluate
        # would average their losses). Once the model is built (a
        # subclassed model that made its tables in __init__ builds its
        # other layers in its first step), and not once it trained: its
        # optimizer's build aligned the trainable ones, and each rank's
        # own statistics (BatchNormalization's) stay its own.
        from sok_keras.optimizers.wrapper import broadcast_variables

        object.__setattr__(model, "_sok_dense_aligned", True)
        # (broadcast_variables leaves the sharded tables out itself.)
        broadcast_variables(
            [v for v in model.weights
             if keras.backend.is_float_dtype(v.dtype)],
            key="consistency/align")
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.Normalization):
                # Its call reads tensors made from its variables by
                # `adapt`: made again from rank 0's (QA: each rank adapted
                # on its own slice and kept normalizing with its own).
                layer.finalize_state()
    for step, function in _STEPS[kind]:
        if getattr(model, function, None) is None:
            consistency.wrap_step(model, step, kind)


def _check_fit_batches(model, fit, args, kwargs):
    """`consistency.check_fit_batches` with `fit`'s `x` and `batch_size`."""
    from sok_keras import consistency

    try:
        bound = inspect.signature(fit).bind(model, *args, **kwargs)
    except TypeError:
        return  # Keras raises its own error
    consistency.check_fit_batches(model, bound.arguments.get("x"),
                                  bound.arguments.get("batch_size"))


def install_loop_hooks():
    """Routes `fit` / `evaluate` / `predict` of Keras' trainer through
    `sok_keras.divergence.run_loop`, and makes `train_on_batch` /
    `test_on_batch` return global logs (idempotent; several ranks only)."""
    from sok_keras import callbacks
    from sok_keras import divergence
    from sok_keras import global_views

    for kind in ("fit", "evaluate", "predict"):
        if kind in _ORIGINAL_LOOPS:
            continue
        owner = next(c for c in keras.Model.__mro__ if kind in c.__dict__)
        original = owner.__dict__[kind]
        _ORIGINAL_LOOPS[kind] = (owner, original)

        def hook(self, *args, _kind=kind, _original=original, **kwargs):
            # Only models whose steps run collectives on every rank (or
            # will, once built: `_awaits_tables`).
            if not (has_sok_layers(self) or is_sok_aware(
                    getattr(self, "optimizer", None)) or (
                        _kind != "predict" and _awaits_tables(self))):
                return _original(self, *args, **kwargs)
            divergence.before_loop()
            global_views.check_in(f"model.{_kind}", _kind)  # all ranks?
            _check_first_steps(self, _kind)
            if _kind == "fit":
                _check_fit_batches(self, _original, args, kwargs)
            call, args, kwargs = callbacks.with_global_metrics(
                _kind, _original, self, args, kwargs)
            token = _LOOP_KIND.set(_kind)
            try:
                return divergence.run_loop(_kind, call, self, args, kwargs)
            finally:
                _LOOP_KIND.reset(token)

        functools.update_wrapper(hook, original)
        setattr(owner, kind, hook)
    for kind in ("train_on_batch", "test_on_batch", "predict_on_batch"):
        if kind in _ORIGINAL_LOOPS:
            continue
        owner = next(c for c in keras.Model.__mro__ if kind in c.__dict__)
        original = owner.__dict__[kind]
        _ORIGINAL_LOOPS[kind] = (owner, original)

        def on_batch(self, *args, _kind=kind, _original=original,
                     **kwargs):
            # The first step traced is checked as the loops' are (the
            # ranks' tables and lookups; reads of a table other than by
            # lookups, `shard_reads`). QA: a tied-weights model trained
            # silently through `train_on_batch`, and a `fit` after it made
            # no new step function, so went unchecked too.
            loop = _ON_BATCH_LOOP[_kind]
            if getattr(self, _STEPS[loop][0][1], None) is None:
                _check_first_steps(self, loop)
            # As `fit` / `evaluate`: the global logs, so that decisions
            # taken on them are the same on every rank.
            if _kind == "predict_on_batch" or not (
                    callbacks.global_metrics_enabled() and (
                    has_sok_layers(self) or is_sok_aware(
                        getattr(self, "optimizer", None))
                    or _awaits_tables(self))):
                return _original(self, *args, **kwargs)
            bound = inspect.signature(_original).bind(self, *args, **kwargs)
            want_dict = bool(bound.arguments.get("return_dict", False))
            bound.arguments["return_dict"] = True
            logs = _original(*bound.args, **bound.kwargs)
            logs = callbacks.global_logs(self, logs,
                                         f"global_metrics/{_kind}")
            return logs if want_dict else self._flatten_metrics_in_order(
                logs)

        functools.update_wrapper(on_batch, original)
        setattr(owner, kind, on_batch)
