"""`sok_keras.Variable`: an embedding table sharded across the ranks."""

import os
import re
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from tensorflow.core.function.trace_type import default_types as trace_types

from sok_keras import world

DISTRIBUTED = "distributed"
LOCALIZED = "localized"
_LOCALIZED_RE = re.compile(r"^localized:(\d+)$")


# The dtypes a table can have (float32 arithmetic for the 16-bit ones).
TABLE_DTYPES = ("float32", "float64", "float16", "bfloat16")


def parse_mode(mode, num_ranks, name=None):
    """Parses a sharding mode string.

    Args:
        mode: `"distributed"` (row `id` on rank `id % N`) or
            `"localized:<rank>"` (the whole table on one rank).
        num_ranks: the number of ranks.
        name: the table's name, for error messages.

    Returns:
        `(kind, target_rank)` with `kind` in `("distributed", "localized")`
        and `target_rank` `-1` for distributed tables.
    """
    target = check_mode_form(mode, name)
    if target < 0:
        return DISTRIBUTED, -1
    if target >= num_ranks:
        where = f" of table '{name}'" if name else ""
        raise ValueError(
            f"`mode`{where} places the table on rank {target}, but "
            f"there are only {num_ranks} rank(s). Received: mode={mode!r}."
        )
    return LOCALIZED, target


def check_mode_form(mode, name=None):
    """Checks the form of a sharding mode, whatever the number of ranks.

    Args:
        mode: `None`, `"distributed"` or `"localized:<rank>"`.
        name: the table's name, for error messages.

    Returns:
        The target rank of a localized table, `-1` for a distributed one.

    Raises:
        ValueError: for any other value.
    """
    if mode is None or mode == DISTRIBUTED:
        return -1
    m = _LOCALIZED_RE.match(mode) if isinstance(mode, str) else None
    if m is None:
        where = f" of table '{name}'" if name else ""
        hint = ("" if not isinstance(mode, bool) else
                " sok.Variable's second argument is `mode`; SOK's passed "
                "its positional arguments on to tf.Variable (`trainable` "
                "second): give `trainable=` by name.")
        raise ValueError(
            f"`mode`{where} must be 'distributed' or 'localized:<rank>'. "
            f"Received: mode={mode!r}.{hint}"
        )
    return int(m.group(1))


def mode_for_world(mode, num_ranks):
    """`mode` in a job of `num_ranks` ranks, for a table rebuilt from a
    saved config: `"localized:<r>"` with `r >= num_ranks` (a file from a
    job of more ranks) becomes `"localized:<r % num_ranks>"`; any other
    mode is returned unchanged (and checked later, by `parse_mode`)."""
    m = _LOCALIZED_RE.match(mode) if isinstance(mode, str) else None
    if m and int(m.group(1)) >= num_ranks:
        return f"{LOCALIZED}:{int(m.group(1)) % num_ranks}"
    return mode


def owned_rows(global_rows, kind, target_rank, rank, num_ranks):
    """The global ids of the rows `rank` holds of a table, in local order,
    as a `range` (not an array: a shard of a billion rows would need 8 GB
    for its ids). The one sharding rule: distributed, `rank::num_ranks`;
    localized, every row on `target_rank` and none elsewhere."""
    if kind == DISTRIBUTED:
        return range(rank, global_rows, num_ranks)
    return range(global_rows) if rank == target_rank else range(0)


def shard_rows(global_rows, kind, target_rank, rank, num_ranks):
    """Returns the number of rows the given rank holds."""
    return len(owned_rows(global_rows, kind, target_rank, rank, num_ranks))


def global_to_local(global_rows, kind, rank, num_ranks):
    """Returns the global ids of the rows the given rank holds, in order
    (a localized table's rows as the rank that holds it)."""
    rows = owned_rows(global_rows, kind, rank, rank, num_ranks)
    return np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)



def _shown(name):
    """A table's name in an error, before Keras names it: `'name'`, or
    `(no name)` where none was given."""
    return f"'{name}'" if name else "(no name)"


class Variable(keras.Variable):
    """An embedding table whose rows are sharded across the ranks.

    Each rank holds one shard. In `"distributed"` mode row `id` lives on
    rank `id % N` at local row `id // N` (17 rows on 2 ranks give shards of
    9 and 8 rows). In `"localized:<r>"` mode the whole table lives on rank
    `r` and the other ranks hold an empty `[0, dim]` shard. `shape` is the
    local shard's shape; `global_shape` is the table's.

    A `Variable` is a `keras.Variable`: a layer that assigns one to an
    attribute owns it, `model.summary()` counts it, and a
    `tf.GradientTape` differentiates through `sok_keras.lookup_sparse`
    to a `tf.IndexedSlices` gradient over the local shard. Made inside
    Keras' `StatelessScope` (Keras building a layer by running it on
    placeholders), it is initialized when that scope exits, as a
    `keras.Variable` made from an initializer is.

    Args:
        initial_value: the whole table, as an array of shape
            `[rows, dim]` (every rank keeps its own rows of it), or a Keras
            initializer (a name such as `"uniform"`, an instance, or a
            callable `(shape, dtype)`) used with `shape`. The initializer
            sees the global shape: each rank holds its rows of
            `initializer(shape)`, so the table does not depend on the
            number of ranks for a seeded initializer, or after
            `keras.utils.set_random_seed` on every rank
            (`sok_keras.table_init`).
        mode: `"distributed"` (default) or `"localized:<rank>"`.
        dtype: the table's dtype: `"float32"`, `"float64"`, `"float16"` or
            `"bfloat16"` (stored in 16 bits, an initial array rounded to
            nearest even; lookups and sparse updates compute in float32 and
            its optimizer slots are float32). Defaults to the dtype of
            `initial_value` when it is floating point, else `"float32"`.
        name: the table's name.
        shape: `(rows, dim)`, required when `initial_value` is an
            initializer.
        trainable: whether the table is trained. Defaults to `True`.

    Example:

    >>> import numpy as np
    >>> import sok_keras as sok
    >>> v = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype="float32")
    >>> v.global_shape
    (17, 3)
    """

    def __init__(
        self,
        initial_value=None,
        mode=DISTRIBUTED,
        dtype=None,
        name=None,
        shape=None,
        trainable=True,
        **kwargs,
    ):
        if initial_value is None:
            initial_value = kwargs.pop("initializer", None)
        # SOK's (tf.Variable's) argument: a table's shape is always checked.
        kwargs.pop("validate_shape", None)
        dynamic = sorted(set(kwargs) & {"dimension", "var_type", "key_type"})
        if dynamic:
            raise TypeError(
                f"sok_keras.Variable {_shown(name)}: {dynamic} are "
                "arguments of "
                "SOK's DynamicVariable (hash-table embeddings), which "
                "sok_keras does not have: give a table of fixed rows, "
                "`sok.Variable(initializer, shape=(vocabulary_size, "
                "dimension))`, and map raw keys to ids in [0, "
                "vocabulary_size) first (keras.layers.Hashing or "
                "IntegerLookup).")
        if kwargs:
            raise TypeError(
                f"Unexpected keyword argument(s) for sok_keras.Variable: "
                f"{sorted(kwargs)}."
            )
        if not isinstance(trainable, (bool, np.bool_)):
            raise TypeError(
                f"sok_keras.Variable {_shown(name)}: `trainable` must be a "
                f"bool. Received: trainable={trainable!r}.")
        from sok_keras import replicas

        strategy = replicas.table_strategy(name)
        if strategy is not None:  # sharded over this process's replicas
            num_ranks, rank = strategy.num_replicas_in_sync, 0
            owners = range(num_ranks)
        else:
            num_ranks, rank = world.num_ranks(), world.rank()
            owners = (rank,)
        kind, target = parse_mode(mode, num_ranks, name)
        if dtype is not None:
            try:
                dtype_name = keras.backend.standardize_dtype(dtype)
            except (ValueError, TypeError, AttributeError):
                dtype_name = None
            if dtype_name not in TABLE_DTYPES:
                raise ValueError(
                    f"sok_keras.Variable {_shown(name)}: the table's dtype "
                    "must be "
                    f"one of {list(TABLE_DTYPES)}. Received: dtype={dtype!r}.")
        if initial_value is None:
            raise ValueError(
                f"sok_keras.Variable {_shown(name)} needs an `initial_value` "
                "(an array, or an initializer with `shape`)."
            )
        if _is_initializer(initial_value):
            if shape is None or len(tuple(shape)) != 2:
                raise ValueError(
                    f"sok_keras.Variable {_shown(name)}: an initializer needs "
                    f"`shape=(rows, dim)`. Received: shape={shape}."
                )
            global_shape = _checked_shape(shape, name)
            dtype = dtype or "float32"
            _check_fits(name, global_shape, dtype,
                        max(shard_rows(global_shape[0], kind, target, r,
                                       num_ranks) for r in owners))
            initializer = keras.initializers.get(initial_value)

            def make_values():
                return _initializer_values(
                    initializer, global_shape, dtype, kind, target, owners,
                    num_ranks, strategy is not None, name)
        else:
            try:
                array = np.asarray(
                    keras.ops.convert_to_numpy(initial_value)
                    if not isinstance(initial_value, np.ndarray)
                    else initial_value
                )
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"sok_keras.Variable {_shown(name)}: the initial value is "
                    f"no array of numbers [rows, dim] ({e})") from None
            # (ml_dtypes' bfloat16 is of kind "V", as a structured dtype.)
            if array.dtype.kind in "bcOUSMm" or array.dtype.names:
                raise TypeError(
                    f"sok_keras.Variable {_shown(name)}: the initial value "
                    "must hold real numbers (ints or floats). Received: an "
                    f"array of dtype {array.dtype}.")
            if array.ndim != 2:
                raise ValueError(
                    f"sok_keras.Variable {_shown(name)} must be 2-D "
                    f"[rows, dim]. Received: shape={array.shape}."
                )
            if shape is not None and tuple(shape) != array.shape:
                raise ValueError(
                    f"sok_keras.Variable {_shown(name)}: `shape` "
                    f"{tuple(shape)} "
                    f"does not match the initial value's {array.shape}."
                )
            if dtype is None:
                # (Keras' name for it: ml_dtypes' bfloat16, of NumPy kind
                # "V", is no np.floating; QA: it made a float32 table.)
                value_dtype = keras.backend.standardize_dtype(array.dtype)
                dtype = (value_dtype if value_dtype in TABLE_DTYPES
                         else "float32")
            global_shape = _checked_shape(array.shape, name)

            def make_values():
                np_dtype = keras.backend.standardize_dtype(dtype)
                shards = (owned_rows(global_shape[0], kind, target, r,
                                      num_ranks) for r in owners)
                return [array[rows.start:rows.stop:rows.step].astype(np_dtype)
                        for rows in shards], None
        self._sok_replica_devices = (
            list(strategy.extended.worker_devices) if strategy is not None
            else None)
        self._sok_replica_values = None
        self._sok_shards = None
        self._sok_kind = kind
        self._sok_target = target
        self._sok_rank = rank
        self._sok_num_ranks = num_ranks
        self._sok_global_shape = tuple(int(s) for s in global_shape)
        self._sok_slots = {}
        self._sok_pending_slots = {}
        # `_sok_slots` are the optimizer `_sok_slot_owner` (a weakref)
        # made; other live optimizers' slots wait in `_sok_other_slots`
        # (`claim_slots`).
        self._sok_slot_owner = None
        self._sok_other_slots = {}
        # Slots restored for a given optimizer before it made them (a TF
        # checkpoint restored before its first step): id -> (weakref,
        # {name: rows}); `_sok_pending_slots` are those of no optimizer in
        # particular (a file loaded with the model), for the first to make
        # them.
        self._sok_pending_for = {}
        self._sok_optimizer = None
        self._sok_make_values = None
        if in_stateless_scope():
            # As `keras.Variable` does with an initializer: the table is
            # made when the outermost `StatelessScope` exits (Keras then
            # calls `_deferred_initialize`). Until then a read gives a
            # symbolic placeholder of the shard's shape. This is how a
            # layer built while Keras infers shapes (a subclassed model
            # rebuilt by `load_model`, a custom layer with no `build()`
            # called on a `keras.Input`) gets its table.
            self._sok_make_values = make_values
            local = (shard_rows(global_shape[0], kind, target, owners[0],
                                num_ranks), global_shape[1])
            super().__init__(
                initializer=_placeholder, shape=local, dtype=dtype,
                trainable=trainable, name=name, autocast=False)
            return
        values, plan = _made(make_values, name, global_shape, dtype)
        value = self._take_values(values, strategy is not None)
        del values
        super().__init__(
            value, dtype=dtype, trainable=trainable, name=name, autocast=False
        )
        # No reference to the initial tensor may outlive this point: a
        # slice assignment copies a variable's whole buffer while another
        # tensor shares it.
        del value
        self._fill(plan)

    def _take_values(self, values, replicated):
        # Replica shards (`sok_keras.replicas`): made by `_initialize`.
        self._sok_replica_values = values if replicated else None
        return values[0]

    def _fill(self, plan):
        if plan is not None:
            with tf.init_scope():
                plan.fill(self._value)  # block by block, in place
                dense_reads(self._value)

    def _deferred_initialize(self):
        make = self.__dict__.get("_sok_make_values")
        if make is None:
            return super()._deferred_initialize()
        if in_stateless_scope():
            raise ValueError(
                f"sok_keras.Variable '{self.name}' cannot be initialized "
                "inside a stateless scope. Build the layer (or call the "
                "model once) before using it statelessly.")
        self._sok_make_values = None
        self._initializer = None
        with tf.init_scope():  # as Keras' own deferred variables
            values, plan = _made(make, self.name, self._sok_global_shape,
                                 self.dtype)
            value = self._take_values(values, self._sok_replica_devices
                                      is not None)
            del values
            self._initialize(value)
            del value
            self._fill(plan)

    def _initialize(self, value):
        if self._sok_replica_values is not None:
            self._initialize_replica_shards()
            return
        # A shard belongs to this rank alone: under a tf.distribute
        # strategy's scope it must not become a mirrored variable (the
        # strategy would copy rank 0's rows to every replica, or fail on
        # shards of other shapes). A ResourceVariable built directly skips
        # the strategy's variable creator.
        # Placed as outside a strategy (the GPU when one is visible): a
        # strategy's scope names only this worker's job and task, which
        # would leave the shard on its CPU while the optimizer's slots,
        # made in the replica context, go to the worker's GPU.
        if not isinstance(value, tf.Variable) and tf.distribute.has_strategy():
            from tensorflow.python.ops import resource_variable_ops

            device = ("/device:GPU:0" if tf.config.list_logical_devices("GPU")
                      else "/device:CPU:0")
            with tf.device(device):
                self._value = resource_variable_ops.ResourceVariable(
                    value, dtype=self._dtype, trainable=self.trainable,
                    name=self.name)
            return
        super()._initialize(value)

    def _initialize_replica_shards(self):
        """One variable per replica of the strategy, on its device (see
        `sok_keras.replicas`); shard 0 stands for the table outside
        `strategy.run`."""
        from tensorflow.python.ops import resource_variable_ops

        values, self._sok_replica_values = self._sok_replica_values, None
        shards = []
        with tf.init_scope():
            for r, (device, value) in enumerate(
                    zip(self._sok_replica_devices, values)):
                with tf.device(device):
                    shards.append(resource_variable_ops.ResourceVariable(
                        value, dtype=self._dtype, trainable=self.trainable,
                        name=f"{self.name}_replica_{r}"))
        self._sok_shards = shards
        self._value = shards[0]

    @property
    def _value(self):
        # Inside `strategy.run` a replica-sharded table is the current
        # replica's shard: reads, gradients and sparse updates all reach it.
        shards = self.__dict__.get("_sok_shards")
        if shards:
            from sok_keras import replicas

            r = replicas.replica_id(len(shards))
            if r is not None:
                return shards[r]
        return self.__dict__.get("_sok_value")

    @_value.setter
    def _value(self, value):
        self.__dict__["_sok_value"] = value

    @property
    def shape(self):
        shards = self.__dict__.get("_sok_shards")
        if shards:
            from sok_keras import replicas

            r = replicas.replica_id(len(shards))
            if r is not None:
                return shards[r].shape
        return super().shape

    def __tf_tracing_type__(self, context):
        # A `tf.function` argument that is a table stays the table (as a
        # `tf.Variable` argument stays a variable, and SOK's own tables,
        # ResourceVariables, do): the function is traced once per table
        # and reads it through its captured handle. A `keras.Variable`
        # argument would arrive as a tensor, which a lookup cannot
        # shard or differentiate to an `IndexedSlices`.
        del context
        return _TableType(self)

    @property
    def replica_shards(self):
        """The per-replica shard variables of a table sharded over the
        replicas of a `MirroredStrategy` (`sok_keras.replicas`), else
        None."""
        return None if not self._sok_shards else list(self._sok_shards)

    # -- sharding facts ---------------------------------------------------
    @property
    def mode(self):
        """`"distributed"` or `"localized:<rank>"`."""
        if self._sok_kind == DISTRIBUTED:
            return DISTRIBUTED
        return f"{LOCALIZED}:{self._sok_target}"

    @property
    def sharding(self):
        """`"distributed"` or `"localized"`."""
        return self._sok_kind

    @property
    def target_rank(self):
        """The rank holding a localized table; -1 for distributed ones."""
        return self._sok_target

    # SOK's name for `target_rank`.
    target_gpu = target_rank

    @property
    def num_ranks(self):
        """The number of ranks the table is sharded over."""
        return self._sok_num_ranks

    # SOK's name for `num_ranks`.
    num_gpus = num_ranks

    @property
    def rank(self):
        """The rank of this process when the table was created (for a
        table sharded over a strategy's replicas, the current replica's
        id inside `strategy.run`, else 0)."""
        return self._current_rank()

    # SOK's name for `rank` (one GPU per rank).
    global_gpu_id = rank

    def _current_rank(self):
        if self._sok_shards:
            from sok_keras import replicas

            r = replicas.replica_id(len(self._sok_shards))
            if r is not None:
                return r
        return self._sok_rank

    @property
    def global_shape(self):
        """The whole table's shape `(rows, dim)`."""
        return self._sok_global_shape

    # -- tf.train.Checkpoint / SavedModel ----------------------------------
    # A TF checkpoint of a table holds this rank's shard. Each shard is
    # written with who held it (rank, ranks, global rows, dim, owner), and a
    # restore refuses a shard that another rank, world size or placement
    # wrote: ranks saving to one path overwrite each other's shards, and
    # restoring one would silently load another rank's rows.
    _SHARD_KEY = "SOK_SHARD"

    def _shard_identity(self):
        rows, dim = self._sok_global_shape
        return [self._sok_rank, self._sok_num_ranks, rows, dim,
                self._sok_target]

    # A table sharded over a strategy's replicas (one process) saves every
    # replica's shard: VARIABLE_VALUE is replica 0's, SOK_REPLICA_<r> the
    # others'.
    _REPLICA_KEY = "SOK_REPLICA_"

    def _serialize_to_tensors(self):
        tensors = dict(super()._serialize_to_tensors())
        for r, shard in enumerate((self._sok_shards or [])[1:], 1):
            tensors[f"{self._REPLICA_KEY}{r}"] = shard.read_value()
        tensors[self._SHARD_KEY] = tf.constant(self._shard_identity(),
                                               tf.int64)
        return tensors

    def _restore_from_tensors(self, restored_tensors):
        restored = dict(restored_tensors)
        self._check_saved_shard(restored.pop(self._SHARD_KEY, None), "")
        ops = [shard.assign(restored.pop(f"{self._REPLICA_KEY}{r}"))
               for r, shard in enumerate((self._sok_shards or [])[1:], 1)]
        result = super()._restore_from_tensors(restored)
        return tf.group([result, *ops]) if ops else result

    def _check_saved_shard(self, saved, what):
        """Raises unless `saved` (a checkpoint's SOK_SHARD, or None) names
        this rank's shard of this table; `what` names a slot, if one."""
        if saved is None or not tf.executing_eagerly():
            return
        saved = [int(x) for x in np.asarray(saved).ravel()]
        mine = self._shard_identity()

        def placed(owner):
            return "distributed" if owner < 0 else f"on rank {owner}"

        if saved != mine:
            raise ValueError(
                f"sok_keras.Variable '{self.path}'{what}: this TF checkpoint "
                f"holds the shard of rank {saved[0]} of {saved[1]} "
                f"(table {saved[2]} x {saved[3]}, {placed(saved[4])}), but "
                f"this is rank {mine[0]} of {mine[1]} (table {mine[2]} x "
                f"{mine[3]}, {placed(mine[4])}). "
                "tf.train.Checkpoint saves each rank's own shard: give "
                "each rank its own path and restore at the same number "
                "of ranks, or use sok.dump / sok.load (or model.save), "
                "which write one checkpoint for any number of ranks.")

    def restore_slot_shard(self, name, restored_tensors, optimizer):
        """Restores `optimizer`'s slot `name`, which it has not created yet,
        from a TF checkpoint's tensors of it (this rank's shard, as
        `tf.train.Checkpoint` saved the slot variable): the rows are kept
        and applied when it does (`add_slot`), not when another optimizer
        makes a slot of that name. (A slot that exists is restored by
        TensorFlow itself: `tf_slots`.)"""
        restored = dict(restored_tensors)
        self._check_saved_shard(restored.pop(self._SHARD_KEY, None),
                                f" (slot {name!r})")
        if self._sok_shards:
            raise NotImplementedError(
                f"sok_keras.Variable '{self.path}': a TF checkpoint's slot "
                f"{name!r} of a table sharded over a strategy's replicas "
                "restores only into an optimizer that has made its slots: "
                "build the optimizer first "
                "(`optimizer.build(model.trainable_variables)`), or use "
                "model.save / keras.models.load_model.")
        value = np.asarray(restored.pop("VARIABLE_VALUE"))
        local = tuple(int(d) for d in self.shape)
        if tuple(value.shape) != local:
            raise ValueError(
                f"sok_keras.Variable '{self.path}': the TF checkpoint's "
                f"slot {name!r} has shape {tuple(value.shape)}, but this "
                f"rank's shard of the table has shape {local}.")
        ref, pending = self._sok_pending_for.get(id(optimizer), (None, None))
        if ref is None or ref() is not optimizer:
            pending = {}
            self._sok_pending_for[id(optimizer)] = (weakref.ref(optimizer),
                                                    pending)
        pending[name] = value

    def _pending_of_owner(self):
        """The current optimizer's restored slots not made yet."""
        owner = self._slot_owner()
        ref, pending = self._sok_pending_for.get(id(owner), (None, {}))
        return pending if ref is not None and ref() is owner else {}

    @property
    def vocabulary_size(self):
        """The whole table's number of rows."""
        return self._sok_global_shape[0]

    @property
    def slots(self):
        """Optimizer slot tables kept beside this table, by slot name: the
        current optimizer's (the last to build or trace an update of it, or
        the model's being saved or loaded: `claim_slots`; a given
        optimizer's are `slots_of(optimizer)`).

        Each slot is a `Variable` with this table's sharding; the layer that
        owns the table saves and restores them with it.
        """
        return self._sok_slots

    @property
    def optimizer(self):
        """This table's own Keras optimizer, or None (the model's rules)."""
        return self._sok_optimizer

    @optimizer.setter
    def optimizer(self, value):
        self._sok_optimizer = value

    def restore_slot(self, name, table):
        """Restores slot `name` from its whole table (global row order).

        Only this rank's rows of `table` are read (an `h5py.Dataset` is
        read chunk by chunk). If the optimizer has not created the slot yet,
        this rank's rows are kept and applied when it does (`add_slot`).
        """
        where = f"{self.path}:{name}"
        if name in self._sok_slots:
            self._sok_slots[name].assign_global(table, where)
        elif self._sok_shards:
            # Every replica's rows: kept whole (one process holds them all).
            _check_global_shape(table, self._sok_global_shape, where)
            self._sok_pending_slots[name] = _as_rows(table[:], "float32")
        else:
            _check_global_shape(table, self._sok_global_shape, where)
            self._sok_pending_slots[name] = read_local_rows(
                table, self._sok_kind, self._sok_target, self._sok_rank,
                self._sok_num_ranks, "float32")

    def slot_values_for_saving(self):
        """`(name, whole table)` of every slot, in name order.

        Includes slots restored from a file whose optimizer has not created
        them yet. A collective with several ranks: every rank must call it.
        Each rank gets every slot whole; `model.save` streams them instead
        (`save_entry`).
        """
        for name in self.saved_slot_names():
            yield name, _gather_whole(slot_entry(self, name))

    def saved_slot_names(self):
        """The slot names that saving this table writes, in name order:
        the optimizer's slots and those restored but not created yet."""
        return sorted(set(self._sok_slots) | set(self._sok_pending_slots)
                      | set(self._pending_of_owner()))

    def claim_slots(self, optimizer):
        """Makes `optimizer`'s slots this table's current ones (`slots`,
        what updates and saving use), as each Keras optimizer keeps its
        own slots: a new optimizer starts from its initial state (it makes
        its slots; slots restored but not made yet are kept for it,
        `add_slot`), and one that made slots before gets them back (a
        model compiled A, B, then A again; two models sharing a layer,
        each with its optimizer). The slots of optimizers that no longer
        exist are dropped."""
        if self.slots_owned_by(optimizer):
            return
        owner = self._slot_owner()
        others = {k: (ref, slots)
                  for k, (ref, slots) in self._sok_other_slots.items()
                  if ref() is not None}
        self._sok_pending_for = {
            k: (ref, pending)
            for k, (ref, pending) in self._sok_pending_for.items()
            if ref() is not None}
        if owner is not None and self._sok_slots:
            others[id(owner)] = (self._sok_slot_owner, self._sok_slots)
        ref, slots = others.pop(id(optimizer), (None, {}))
        self._sok_other_slots = others
        self._sok_slots = slots if ref is not None and (
            ref() is optimizer) else {}
        self._sok_slot_owner = weakref.ref(optimizer)

    def _slot_owner(self):
        ref = self._sok_slot_owner
        return None if ref is None else ref()

    def slots_owned_by(self, optimizer):
        """Whether this table's current slots are `optimizer`'s."""
        return self._slot_owner() is optimizer is not None

    def slots_of(self, optimizer):
        """`optimizer`'s slots of this table, by name (empty if it made
        none), whether or not they are the current ones. A wrapper
        (`OptimizerWrapper`, `LossScaleOptimizer`; `model.optimizer`)
        answers for the optimizer it wraps, which holds them."""
        from sok_keras.optimizers.sparse_rules import optimizer_chain

        for opt in optimizer_chain(optimizer):
            if self.slots_owned_by(opt):
                return self._sok_slots
            ref, slots = self._sok_other_slots.get(id(opt), (None, {}))
            if ref is not None and ref() is opt:
                return slots
        return {}

    def add_slot(self, name, slot):
        """Registers `slot` (a `Variable` shaped like this table) as `name`."""
        if tuple(slot.global_shape) != self._sok_global_shape:
            raise ValueError(
                f"Slot '{name}' of '{self.path}' must have shape "
                f"{self._sok_global_shape}. Received: {slot.global_shape}."
            )
        self._sok_slots[name] = slot
        pending = self._pending_of_owner().pop(name, None)
        if pending is None:
            pending = self._sok_pending_slots.pop(name, None)
        if pending is not None and self._sok_shards:  # the whole slot
            slot.assign_global(pending)
        elif pending is not None:  # this rank's rows, restored from a file
            _assign_local(slot, pending)
        return slot

    def local_ids(self):
        """Returns the global ids of this shard's rows, as NumPy int64."""
        rank = self._current_rank()
        if self._sok_kind == LOCALIZED and rank != self._sok_target:
            return np.zeros([0], np.int64)
        return global_to_local(
            self.vocabulary_size, self._sok_kind, rank, self._sok_num_ranks,
        )

    def read_value(self):
        """This rank's shard as a tensor (`tf.Variable.read_value`); see
        `read_global` for the whole table."""
        return tf.convert_to_tensor(self.value)

    def read_global(self):
        """Returns the whole table, in global row order, as a NumPy array.

        With several ranks this is a collective: every rank must call it.
        """
        if self._sok_num_ranks == 1:
            return keras.ops.convert_to_numpy(self.value)
        if self._sok_shards:
            return self._read_replica_shards()
        # A call on some ranks only (`if sok.rank() == 0:` in a callback)
        # fails within SOK_SAVE_TIMEOUT naming it, as `model.predict` does
        # (QA: it waited SOK_COMM_TIMEOUT, then named a gather's key). The
        # key leaves the path out: Keras' automatic names may differ
        # between the ranks.
        from sok_keras import global_views

        global_views.check_in(f"table '{self.path}'.read_global()",
                              key="read_global")
        # In chunks of about `CHUNK_BYTES`, as `model.save` streams a table:
        # a whole shard in one collective could pass the transport's 2 GiB
        # message limit (gRPC), and gathering every padded shard at once
        # held the table three times over.
        return _gather_whole(SavedEntry(self))

    def assign_global(self, table, name=None):
        """Sets this shard from the whole table (rows in global order).

        Only this rank's rows of `table` are read, in bounded chunks, so an
        `h5py.Dataset` or a memory-mapped array is never loaded whole. The
        shape is checked before anything is read.

        Args:
            table: array-like `[rows, dim]` (NumPy, h5py, memmap, nested
                lists).
            name: the owner's name for error messages (defaults to the path).
        """
        if not hasattr(table, "shape"):  # nested lists, as `assign` takes
            table = np.asarray(table)
        _check_global_shape(table, self._sok_global_shape,
                            name or self.path)
        if self._sok_shards:
            self._assign_replica_shards(table)
            return
        n, rank = self._sok_num_ranks, self._sok_rank
        local_rows = int(self.shape[0])
        dtype = keras.backend.standardize_dtype(self.dtype)
        target = self.value
        if not hasattr(target, "scatter_update") or local_rows == 0:
            self.assign(read_local_rows(
                table, self._sok_kind, self._sok_target, rank, n, dtype))
            return
        # In place, chunk by chunk (`target[a:b].assign` would copy the whole
        # variable each time).
        step = rows_per_chunk(int(self.shape[1]) * _itemsize(dtype))
        for a in range(0, local_rows, step):
            b = min(a + step, local_rows)
            rows = _read_rows(table, self._sok_kind, rank, n, a, b, dtype)
            target.scatter_update(tf.IndexedSlices(
                tf.convert_to_tensor(rows), tf.range(a, b, dtype=tf.int64)))
        dense_reads(target)

    def _read_replica_shards(self):
        """The whole table from every replica's shard (one process)."""
        shards = [keras.ops.convert_to_numpy(tf.convert_to_tensor(v))
                  for v in self._sok_shards]
        if self._sok_kind == LOCALIZED:
            return shards[self._sok_target]
        rows, dim = self._sok_global_shape
        out = np.empty((rows, dim), shards[0].dtype)
        for r, shard in enumerate(shards):
            out[r::len(shards)] = shard
        return out

    def _assign_replica_shards(self, table):
        """Sets every replica's shard from the whole `table`."""
        dtype = keras.backend.standardize_dtype(self.dtype)
        n = self._sok_num_ranks
        for r, shard in enumerate(self._sok_shards):
            shard.assign(read_local_rows(
                table, self._sok_kind, self._sok_target, r, n, dtype))

    def __repr__(self):
        return (
            f"<sok_keras.Variable path={self.path}, shape={self.shape}, "
            f"global_shape={self.global_shape}, mode={self.mode}, "
            f"rank={self.rank}/{self.num_ranks}>"
        )


def dense_reads(var):
    """Takes `var` (a `tf.Variable`) out of TensorFlow's copy-on-read mode.

    A sparse write (`scatter_update`, `ResourceStridedSliceAssign`: the
    in-place block and chunk writes of initialization and loading) puts a
    variable in that mode for good, and from then on every dense read of
    it, such as a lookup's `table.value`, copies the whole table first
    (measured: a 2M x 64 lookup 10x slower on the CPU; a 10M x 128 pooled
    lookup 0.97 -> 3.7 ms on the H200). Nothing else holds the buffer once
    the writes are done, so reads may alias it again.
    """
    try:
        with tf.init_scope():
            tf.raw_ops.DisableCopyOnRead(resource=var.handle)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError,
            AttributeError) as e:  # (an op this TensorFlow lacks)
        import logging

        logging.getLogger("sok_keras").warning(
            "sok_keras: could not turn off copy-on-read for '%s' (%s): its "
            "reads copy the table.", getattr(var, "name", var), e)


def aliasing_read(var):
    """`var`'s value as a tensor that shares its buffer: a dense read with
    TensorFlow's copy-on-read mode turned off first.

    Any sparse access of a `tf.Variable` (a user's `tf.gather(
    layer.embeddings, ids)` or `scatter_update`, the gathers of 16-bit and
    unpooled ragged lookups) turns that mode on for good, and from then on
    every dense read copies the whole table (measured: one gather of a
    2M x 64 table made each later pooled step 19x slower, 3.4 -> 65 ms).
    Turning it off is always safe: a sparse write while such a read lives
    copies the buffer first (copy-on-write).

    Args:
        var: a `tf.Variable` (else it is converted as it is).

    Returns:
        The value, a tensor (traced: a read ordered after the mode change).
    """
    if not isinstance(var, tf.Variable):
        return tf.convert_to_tensor(var)
    off = tf.raw_ops.DisableCopyOnRead(resource=var.handle)
    if off is None:  # eager: done
        return tf.convert_to_tensor(var)
    with tf.control_dependencies([off]):
        return tf.convert_to_tensor(var)


class _TableType(trace_types.Weakref):
    """The `tf.function` trace type of a table argument: the table itself,
    by identity (TensorFlow's `Weakref` type, but a `keras.Variable` has
    no hash, and its `==` is elementwise)."""

    def __init__(self, table):  # noqa: D107 - TensorFlow's API
        self._ref = weakref.ref(table)
        self._ref_hash = id(table)

    def __eq__(self, other):
        if not isinstance(other, _TableType):
            return False
        mine = self._ref()
        return mine is not None and mine is other._ref()

    def __hash__(self):
        return self._ref_hash

    def cast(self, value, _):
        if value is self._ref():
            return value
        raise ValueError(f"Can not cast {value!r} to {self!r}")


def _placeholder(shape, dtype=None):
    # What a read of a table still to be made gives inside Keras'
    # `StatelessScope` (shape inference on symbolic inputs only).
    return tf.zeros(shape, dtype)


def _initializer_values(initializer, global_shape, dtype, kind, target,
                        owners, num_ranks, replicated, name):
    """Each owner's initial rows of an initializer-made table, and the
    plan that fills the first in place (None when it comes whole)."""
    from sok_keras import table_init

    # Eagerly, even when the table is built inside a trace (a subclassed
    # model's first call): the seed agreement and the block writes must
    # not become part of the traced step.
    tracing = not tf.executing_eagerly()
    values, plan = [], None
    from keras.src.backend.common.name_scope import current_path

    # The table's path ('emb/embeddings' in a layer), for messages.
    where = "/".join(p for p in (current_path(), name) if p)
    for r in owners:
        rows = owned_rows(global_shape[0], kind, target, r, num_ranks)
        with tf.init_scope():
            plan = table_init.TablePlan(
                initializer, global_shape, dtype, rows,
                num_ranks if kind == DISTRIBUTED else 1, where)
            value = plan.initial_value()
            if tracing or replicated:
                # Made inside a trace, the variable is initialized when the
                # function first runs: it cannot be written now, so it
                # starts from the whole shard (as does each replica's).
                value, plan = plan.local_value(value), None
        values.append(value)
    return values, plan


def _is_initializer(value):
    if isinstance(value, (str, dict)):
        return True
    if isinstance(value, keras.initializers.Initializer):
        return True
    return callable(value) and not hasattr(value, "__array__")


def is_sok_variable(v):
    """True if `v` is a `sok_keras.Variable`."""
    return isinstance(v, Variable)


def filter_variables(variables):
    """Splits variables into sok tables and everything else.

    Args:
        variables: an iterable of variables (e.g. `model.trainable_variables`),
            or one variable.

    Returns:
        `(sok_variables, other_variables)`, two lists in the input order.

    Example:

    ```python
    sok_vars, dense_vars = sok.filter_variables(model.trainable_variables)
    ```
    """
    if isinstance(variables, (tf.Variable, keras.Variable)):
        variables = [variables]  # (iterating one would give its rows)
    sok_vars, others = [], []
    for v in variables:
        (sok_vars if is_sok_variable(v) else others).append(v)
    return sok_vars, others


# The seed's name.
split_embedding_variable_from_others = filter_variables




# -- saving helpers: whole tables in bounded chunks ------------------------
#
# `model.save` writes each table and slot whole, in global row order, so the
# file does not depend on the number of ranks. Nothing here holds a whole
# table: rows travel in chunks of about `CHUNK_BYTES` (over all ranks), are
# written into the H5 dataset chunk by chunk, and loading reads only this
# rank's rows of the dataset, a chunk at a time.

CHUNK_BYTES = 8 << 20
"""Bytes of rows in one chunk of a streamed save (all ranks together) or
load (one rank)."""


def rows_per_chunk(row_bytes, ranks=1):
    """Rows per rank in one chunk of `CHUNK_BYTES` over `ranks` ranks."""
    return max(1, CHUNK_BYTES // max(1, int(row_bytes) * int(ranks)))


def slice_rows(value, a, b):
    """Rows `[a, b)` of a `tf.Variable` or tensor, with int64 indices.

    TensorFlow's Python slicing (`value[a:b]`) killed the process (a
    segfault) where `a >= 2**31` (QA: `sok.dump` of a shard of 2**31 + 64
    rows; in TF 2.21 as plain as `tf.Variable(...)[2**31:2**31 + 64]`).
    A variable's rows are gathered, not read whole: in TensorFlow's
    copy-on-read mode (where any sparse access leaves a variable) a whole
    read copied all of it once per chunk of a save (a 4 GiB table's dump,
    load and save: about 9 minutes, bench/wide_table.py). The gather
    itself turns that mode on; `dense_reads` turns it off again, as after
    every in-place write.

    Args:
        value: a `tf.Variable` or tensor of rank >= 1.
        a: the first row.
        b: one past the last row (at most the number of rows).

    Returns:
        A tensor, `[b - a] + value.shape[1:]`.
    """
    if isinstance(value, tf.Variable):
        rows = tf.gather(value, tf.range(a, b, dtype=tf.int64))
        dense_reads(value)
        return rows
    rank = value.shape.rank
    return tf.slice(value, tf.constant([a] + [0] * (rank - 1), tf.int64),
                    tf.constant([b - a] + [-1] * (rank - 1), tf.int64))


def _np_dtype(dtype):
    name = keras.backend.standardize_dtype(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _itemsize(dtype):
    return _np_dtype(dtype).itemsize


# The most rows a table may have: ids are int64, and a shard's row count
# and the row of an id are computed in int64 too.
MAX_ROWS = 2 ** 62


def _checked_shape(shape, name):
    """`(rows, dim)` as ints: each a positive integer (rows at most
    `MAX_ROWS`), else a ValueError naming the table and the shape."""
    shape = tuple(shape)
    ok = len(shape) == 2 and all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool)
        and s > 0 for s in shape) and shape[0] <= MAX_ROWS
    if not ok:
        raise ValueError(
            f"sok_keras.Variable {_shown(name)}: the table's shape must be "
            "two "
            f"positive integers (rows, dim), rows at most 2**62. Received: "
            f"shape={shape}.")
    return tuple(int(s) for s in shape)


def _check_fits(name, global_shape, dtype, local_rows):
    """A MemoryError naming the table when this rank's shard cannot fit in
    the machine's memory: where the system overcommits memory, the
    allocation would succeed and the kernel kill the process while the rows
    are filled."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = local_rows * global_shape[1] * _itemsize(dtype)
    if need > physical:
        raise _too_big(
            name, global_shape, dtype,
            f"this rank's shard ({local_rows:,} rows) needs "
            f"{need / 2 ** 30:,.1f} GiB, more than this machine's "
            f"{physical / 2 ** 30:,.1f} GiB of memory. Use more ranks or a "
            "smaller table.")


def _made(make_values, name, global_shape, dtype):
    """`make_values()`, with an allocation failure named."""
    try:
        return make_values()
    except (MemoryError, tf.errors.ResourceExhaustedError) as e:
        rows, dim = global_shape
        whole = rows * dim * _itemsize(dtype) / 2 ** 30
        raise _too_big(name, global_shape, dtype,
                       f"{whole:,.1f} GiB in all, this rank's shard of it: "
                       f"{e}") from e


def _too_big(name, global_shape, dtype, detail):
    rows, dim = global_shape
    return MemoryError(
        f"sok_keras.Variable {_shown(name)}: cannot allocate the table "
        f"{rows:,} x "
        f"{dim} {dtype}: {detail}")


def _check_global_shape(table, expected, where):
    """Raises unless array-like `table` has the whole table's shape (checked
    before anything is read or allocated)."""
    shape = tuple(int(s) for s in getattr(table, "shape", ()))
    if shape != tuple(expected):
        raise ValueError(
            f"'{where}': the value given has shape {shape}, but the "
            f"whole table has shape {tuple(expected)}.")


def _as_rows(rows, dtype):
    rows = np.asarray(rows)
    if rows.dtype.kind == "V" and rows.dtype.itemsize == 2:
        import ml_dtypes  # Keras stores bfloat16 as 2-byte opaque data

        rows = rows.view(ml_dtypes.bfloat16)
    return rows.astype(_np_dtype(dtype), copy=False)


def _read_rows(table, kind, rank, num_ranks, a, b, dtype):
    """Local rows `[a, b)` of this rank, read from the whole `table` (a
    ranged or strided read: only those rows)."""
    if b <= a:
        return np.zeros((0, int(table.shape[1])), _np_dtype(dtype))
    if kind == DISTRIBUTED and num_ranks > 1:
        start = rank + a * num_ranks
        rows = table[start:start + (b - a - 1) * num_ranks + 1:num_ranks]
    else:
        rows = table[a:b]
    return _as_rows(rows, dtype)


def read_local_rows(table, kind, target, rank, num_ranks, dtype):
    """This rank's shard of the whole `table`, read chunk by chunk into one
    array of the shard's size."""
    rows, dim = (int(s) for s in table.shape)
    local = shard_rows(rows, kind, target, rank, num_ranks)
    out = np.empty((local, dim), _np_dtype(dtype))
    step = rows_per_chunk(dim * out.itemsize)
    for a in range(0, local, step):
        b = min(a + step, local)
        out[a:b] = _read_rows(table, kind, rank, num_ranks, a, b, dtype)
    return out


def _assign_local(var, local):
    """Assigns this rank's rows `local` to `var`, chunk by chunk in place."""
    local = np.asarray(local)
    target = var.value
    rows = int(local.shape[0])
    if not hasattr(target, "scatter_update") or rows == 0:
        var.assign(local)
        return
    step = rows_per_chunk(int(local.shape[1]) * local.itemsize)
    for a in range(0, rows, step):
        b = min(a + step, rows)
        target.scatter_update(tf.IndexedSlices(
            tf.convert_to_tensor(local[a:b]),
            tf.range(a, b, dtype=tf.int64)))
    dense_reads(target)


class SavedEntry:
    """One table or one of its slots, as saved: the sharding and a reader
    of this rank's rows.

    Args:
        table: the `Variable` (a table, not a slot).
        slot: None for the table, else the slot's name (a created slot or
            one restored from a file and not created yet).
    """

    def __init__(self, table, slot=None):
        self.table = table
        self.slot = slot
        self.kind, self.target = table._sok_kind, table._sok_target
        self.rank, self.num_ranks = table._sok_rank, table._sok_num_ranks
        self.rows, self.dim = table._sok_global_shape
        self._whole = None
        if table._sok_shards:
            # Sharded over one process's replicas: saved as the whole table
            # of a single rank, read from every shard.
            self.kind, self.target = DISTRIBUTED, -1
            self.rank, self.num_ranks = 0, 1
        if slot is None:
            source = table
        elif slot in table._sok_slots:
            source = table._sok_slots[slot]
        elif slot in table._pending_of_owner():
            source = table._pending_of_owner()[slot]
        elif slot in table._sok_pending_slots:
            source = table._sok_pending_slots[slot]
        else:
            raise KeyError(f"table '{table.path}' has no slot '{slot}'")
        self._source = source
        self.dtype = keras.backend.standardize_dtype(source.dtype)
        self.local_rows = int(source.shape[0])
        if table._sok_shards:
            self.local_rows = self.rows
            if not isinstance(source, np.ndarray):  # (a pending slot is whole)
                self._whole = source

    def read(self, a, b):
        """This rank's local rows `[a, b)` as a NumPy array."""
        if self._whole is not None:  # replica shards: read them once
            self._whole, self._source = None, self._whole.read_global()
        if isinstance(self._source, np.ndarray):
            return self._source[a:b]
        return keras.ops.convert_to_numpy(
            slice_rows(self._source.value, a, b))

    @property
    def name(self):
        return self.table.path + ("" if self.slot is None
                                  else f":{self.slot}")


def table_entries(table):
    """`SavedEntry`s of `table` and of each slot it saves, in save order."""
    return [SavedEntry(table)] + [
        SavedEntry(table, s) for s in table.saved_slot_names()]


def slot_entry(table, name):
    return SavedEntry(table, name)


def stream_entry(entry, sink, writer_only, key="save/stream"):
    """Sends a table (or slot) whole, in global row order and bounded
    chunks, to rank 0 (`writer_only`) or to every rank.

    A collective: every rank calls it with the same entry. `sink(first_row,
    rows)` is called, on the ranks that receive, with consecutive global
    rows. A failure to read local rows or in `sink` does not stop the
    exchange (a peer would be left inside a collective): the chunks keep
    flowing and the first error is raised once the exchange is complete.
    """
    n, rank = entry.num_ranks, entry.rank
    comm = world.control_communicator() if n > 1 else None
    dtype = _np_dtype(entry.dtype)
    receives = rank == 0 or not writer_only
    errors = []

    def guarded(fn, *args):
        if errors:
            return None
        try:
            return fn(*args)
        except Exception as e:  # raised after the exchange
            errors.append(e)
            return None

    def padded(a, b, step):
        rows = guarded(entry.read, a, b) if b > a else None
        out = np.zeros((step, entry.dim), dtype)
        if rows is not None:
            out[:b - a] = rows
        return out

    row_bytes = entry.dim * dtype.itemsize
    if entry.kind == DISTRIBUTED:
        per_rank = -(-entry.rows // n)
        step = max(1, min(rows_per_chunk(row_bytes, n), per_rank))
        for a in range(0, per_rank, step):
            b = min(a + step, per_rank)
            mine = padded(a, min(b, entry.local_rows), step)
            if comm is None:
                got = mine
            else:
                got = comm.all_gather(tf.convert_to_tensor(mine),
                                      key=key).numpy()
                got = got.reshape(n, step, entry.dim).transpose(1, 0, 2)
                got = got.reshape(n * step, entry.dim)
            first = a * n
            count = min(n * (b - a), entry.rows - first)
            if receives:
                guarded(sink, first, got[:count])
    else:
        t = entry.target
        if writer_only and t == 0 and rank != 0:
            return  # rank 0 holds it all: nothing to send
        step = max(1, min(rows_per_chunk(row_bytes), entry.rows))
        for a in range(0, entry.rows, step):
            b = min(a + step, entry.rows)
            mine = padded(a, b, step) if rank == t else np.zeros(
                (step, entry.dim), dtype)
            if comm is None or (writer_only and t == 0):
                got = mine
            else:
                got = comm.broadcast(tf.convert_to_tensor(mine), key=key,
                                     root=t).numpy()
            if receives:
                guarded(sink, a, got[:b - a])
    if errors:
        raise errors[0]


def _gather_whole(entry):
    """The whole table of `entry` on every rank (a collective)."""
    out = np.empty((entry.rows, entry.dim), _np_dtype(entry.dtype))

    def sink(first, rows):
        out[first:first + len(rows)] = rows

    stream_entry(entry, sink, writer_only=False, key="gather_whole")
    return out


def save_entry(store, key, entry):
    """Writes `entry` (a `SavedEntry`) whole to `store[key]`.

    With an H5 weights store (`model.save`, `save_weights`) the dataset is
    created at its full size and filled chunk by chunk as the rows arrive,
    so no rank ever holds the whole table; other stores get the whole
    array. Inside `model.save` on several ranks only rank 0 runs this (the
    others serve its chunks, `sok_keras.saving`); otherwise every rank must
    call it (each writes its own store).
    """
    from sok_keras import _keras_h5
    from sok_keras import saving

    stream = saving.active_stream()
    if stream is not None:
        stream.announce(entry)  # the other ranks start sending
    failure = []
    dataset, whole = None, None
    try:
        dataset = _keras_h5.create_dataset(
            store, key, (entry.rows, entry.dim), entry.dtype)
        if dataset is None:
            whole = np.empty((entry.rows, entry.dim),
                             _np_dtype(entry.dtype))
    except Exception as e:  # raised once the peers are done sending
        failure.append(e)

    def sink(first, rows):
        if failure:
            return
        target = dataset if dataset is not None else whole
        target[first:first + len(rows)] = rows

    stream_entry(entry, sink, writer_only=stream is not None)
    if failure:
        raise failure[0]
    if whole is not None:
        store[key] = whole


# Why a layer finds nothing of its own in a weights file.
NOTHING_SAVED_HINT = (
    " Keras files key each layer's weights by the layer's class (and "
    "place), so a file saved from another layer class, e.g. "
    "keras.layers.Embedding, holds nothing for this one: copy such a "
    "table in with `layer.embeddings.assign_global(array)` on every rank "
    "(on N ranks `get_weights()` / `set_weights()` hold each rank's shard "
    "of a table, not the whole table). Or the layer is shared by two "
    "nested models: Keras saves its weights once, under the first, and "
    "looks for them under each (keras.layers.Embedding fails alike); "
    "call the layer from the outer model, or save the weights "
    "(`save_weights` or `sok.dump`) and load them into the model your "
    "code makes.")


def saved_array(store, key, where):
    """`store[key]` without reading it: the h5py dataset when `store` is
    Keras' H5 store, else the stored array."""
    from sok_keras import _keras_h5

    keys = list(store.keys())
    if key not in keys:
        raise ValueError(
            f"{where}: no '{key}' entry in the saved weights. Found: "
            f"{keys}.{NOTHING_SAVED_HINT if not keys else ''}")
    dataset = _keras_h5.dataset(store, key)
    return dataset if dataset is not None else store[key]
