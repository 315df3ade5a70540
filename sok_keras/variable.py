"""`sok_keras.Variable`: an embedding table sharded across the ranks."""

import contextlib
import re

import keras
import numpy as np
import tensorflow as tf

from sok_keras import world

DISTRIBUTED = "distributed"
LOCALIZED = "localized"
_LOCALIZED_RE = re.compile(r"^localized:(\d+)$")


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
    where = f" of table '{name}'" if name else ""
    if mode is None or mode == DISTRIBUTED:
        return DISTRIBUTED, -1
    if isinstance(mode, str):
        m = _LOCALIZED_RE.match(mode)
        if m:
            target = int(m.group(1))
            if target >= num_ranks:
                raise ValueError(
                    f"`mode`{where} places the table on rank {target}, but "
                    f"there are only {num_ranks} rank(s). Received: "
                    f"mode={mode!r}."
                )
            return LOCALIZED, target
    raise ValueError(
        f"`mode`{where} must be 'distributed' or 'localized:<rank>'. "
        f"Received: mode={mode!r}."
    )


def shard_rows(global_rows, kind, target_rank, rank, num_ranks):
    """Returns the number of rows the given rank holds."""
    if kind == DISTRIBUTED:
        return max(0, (global_rows - rank + num_ranks - 1) // num_ranks)
    return global_rows if rank == target_rank else 0


def global_to_local(global_rows, kind, rank, num_ranks):
    """Returns the global ids of the rows the given rank holds, in order."""
    if kind == DISTRIBUTED:
        return np.arange(rank, global_rows, num_ranks, dtype=np.int64)
    return np.arange(global_rows, dtype=np.int64)


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
    to a `tf.IndexedSlices` gradient over the local shard.

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
        if kwargs:
            raise TypeError(
                f"Unexpected keyword argument(s) for sok_keras.Variable: "
                f"{sorted(kwargs)}."
            )
        num_ranks, rank = world.num_ranks(), world.rank()
        kind, target = parse_mode(mode, num_ranks, name)
        if initial_value is None:
            raise ValueError(
                f"sok_keras.Variable '{name}' needs an `initial_value` "
                "(an array, or an initializer with `shape`)."
            )
        plan = None
        if _is_initializer(initial_value):
            if shape is None or len(tuple(shape)) != 2:
                raise ValueError(
                    f"sok_keras.Variable '{name}': an initializer needs "
                    f"`shape=(rows, dim)`. Received: shape={shape}."
                )
            global_shape = tuple(int(s) for s in shape)
            dtype = dtype or "float32"
            from sok_keras import table_init

            rows = global_to_local(global_shape[0], kind, rank, num_ranks)
            if kind == LOCALIZED and rank != target:
                rows = rows[:0]
            # Eagerly, even when the table is built inside a trace (a
            # subclassed model's first call): the seed agreement and the
            # block writes must not become part of the traced step.
            tracing = not tf.executing_eagerly()
            with tf.init_scope():
                plan = table_init.TablePlan(
                    keras.initializers.get(initial_value), global_shape,
                    dtype, rows, num_ranks if kind == DISTRIBUTED else 1,
                    name)
                value = plan.initial_value()
                if tracing:
                    # Made inside a trace, the variable is initialized when
                    # the function first runs: it cannot be written now, so
                    # it starts from the whole shard.
                    value, plan = plan.local_value(value), None
        else:
            array = np.asarray(
                keras.ops.convert_to_numpy(initial_value)
                if not isinstance(initial_value, np.ndarray)
                else initial_value
            )
            if array.ndim != 2:
                raise ValueError(
                    f"sok_keras.Variable '{name}' must be 2-D "
                    f"[rows, dim]. Received: shape={array.shape}."
                )
            if shape is not None and tuple(shape) != array.shape:
                raise ValueError(
                    f"sok_keras.Variable '{name}': `shape` {tuple(shape)} "
                    f"does not match the initial value's {array.shape}."
                )
            if dtype is None:
                dtype = (
                    array.dtype.name
                    if np.issubdtype(array.dtype, np.floating)
                    else "float32"
                )
            global_shape = array.shape
            rows = global_to_local(global_shape[0], kind, rank, num_ranks)
            if kind == "localized" and rank != target:
                rows = rows[:0]
            value = array[rows].astype(keras.backend.standardize_dtype(dtype))
        self._sok_kind = kind
        self._sok_target = target
        self._sok_rank = rank
        self._sok_num_ranks = num_ranks
        self._sok_global_shape = tuple(int(s) for s in global_shape)
        self._sok_slots = {}
        self._sok_pending_slots = {}
        self._sok_optimizer = None
        super().__init__(
            value, dtype=dtype, trainable=trainable, name=name, autocast=False
        )
        # No reference to the initial tensor may outlive this point: a
        # slice assignment copies a variable's whole buffer while another
        # tensor shares it.
        del value
        if plan is not None:
            with tf.init_scope():
                plan.fill(self._value)  # block by block, in place

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

    @property
    def rank(self):
        """The rank of this process when the table was created."""
        return self._sok_rank

    @property
    def global_shape(self):
        """The whole table's shape `(rows, dim)`."""
        return self._sok_global_shape

    @property
    def vocabulary_size(self):
        """The whole table's number of rows."""
        return self._sok_global_shape[0]

    @property
    def slots(self):
        """Optimizer slot tables kept beside this table, by slot name.

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

        If the optimizer has not created the slot yet, the value is kept and
        applied when it does (`add_slot`).
        """
        if name in self._sok_slots:
            self._sok_slots[name].assign_global(table, f"{self.path}:{name}")
        else:
            self._sok_pending_slots[name] = np.asarray(table[:])

    def slot_values_for_saving(self):
        """`(name, whole table)` of every slot, in name order.

        Includes slots restored from a file whose optimizer has not created
        them yet, so saving such a model keeps them. A collective with
        several ranks: every rank must call it.
        """
        names = sorted(set(self._sok_slots) | set(self._sok_pending_slots))
        for name in names:
            if name in self._sok_slots:
                yield name, self._sok_slots[name].read_global()
            else:
                yield name, self._sok_pending_slots[name]

    def add_slot(self, name, slot):
        """Registers `slot` (a `Variable` shaped like this table) as `name`."""
        if tuple(slot.global_shape) != self._sok_global_shape:
            raise ValueError(
                f"Slot '{name}' of '{self.path}' must have shape "
                f"{self._sok_global_shape}. Received: {slot.global_shape}."
            )
        self._sok_slots[name] = slot
        pending = self._sok_pending_slots.pop(name, None)
        if pending is not None:
            slot.assign_global(pending, f"{self.path}:{name}")
        return slot

    def local_ids(self):
        """Returns the global ids of this shard's rows, as NumPy int64."""
        if self._sok_kind == LOCALIZED and self._sok_rank != self._sok_target:
            return np.zeros([0], np.int64)
        return global_to_local(
            self.vocabulary_size, self._sok_kind, self._sok_rank,
            self._sok_num_ranks,
        )

    def read_global(self):
        """Returns the whole table, in global row order, as a NumPy array.

        With several ranks this is a collective: every rank must call it.
        """
        if getattr(self, "_sok_gathered", None) is not None:
            return self._sok_gathered  # see gathered_for_saving
        if self._sok_num_ranks == 1:
            return keras.ops.convert_to_numpy(self.value)
        comm = world.communicator()
        rows, dim = self._sok_global_shape
        n = self._sok_num_ranks
        key = f"read_global/{self.path}"
        if self._sok_kind == LOCALIZED:
            local = self.value if self._sok_rank == self._sok_target else (
                tf.zeros([rows, dim], self.dtype))
            return comm.broadcast(
                tf.convert_to_tensor(local), key=key, root=self._sok_target
            ).numpy()
        per_rank = -(-rows // n)
        shard = tf.convert_to_tensor(self.value)
        shard = tf.pad(shard, [[0, per_rank - int(shard.shape[0])], [0, 0]])
        everything = comm.all_gather(shard, key=key).numpy()
        interleaved = everything.reshape(n, per_rank, dim).transpose(1, 0, 2)
        return interleaved.reshape(n * per_rank, dim)[:rows]

    def assign_global(self, table, name=None):
        """Sets this shard from the whole table (rows in global order).

        Only this rank's rows of `table` are read, so an `h5py.Dataset` or a
        memory-mapped array never has to be loaded whole.

        Args:
            table: array-like `[rows, dim]` (NumPy, h5py, memmap).
            name: the owner's name for error messages (defaults to the path).
        """
        shape = tuple(int(s) for s in table.shape)
        if shape != self._sok_global_shape:
            raise ValueError(
                f"'{name or self.path}': the table has shape {shape}, but "
                f"the variable's whole table has shape "
                f"{self._sok_global_shape}."
            )
        if self._sok_kind == DISTRIBUTED:
            local = np.asarray(table[self._sok_rank::self._sok_num_ranks])
        elif self._sok_rank == self._sok_target:
            local = np.asarray(table[:])
        else:
            local = np.zeros((0, shape[1]))
        self.assign(local.astype(keras.backend.standardize_dtype(self.dtype)))

    def __repr__(self):
        return (
            f"<sok_keras.Variable path={self.path}, shape={self.shape}, "
            f"global_shape={self.global_shape}, mode={self.mode}, "
            f"rank={self.rank}/{self.num_ranks}>"
        )


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
        variables: an iterable of variables (e.g. `model.trainable_variables`).

    Returns:
        `(sok_variables, other_variables)`, two lists in the input order.

    Example:

    >>> sok_vars, dense_vars = sok.filter_variables(model.trainable_variables)
    """
    sok_vars, others = [], []
    for v in variables:
        (sok_vars if is_sok_variable(v) else others).append(v)
    return sok_vars, others


# The seed's name.
split_embedding_variable_from_others = filter_variables


@contextlib.contextmanager
def gathered_for_saving(tables):
    """Gathers every table in `tables` and each of its slots once (a
    collective: every rank, same order), and makes `read_global` return
    those arrays inside the block, so that writing a file afterwards needs
    no communication (one rank can write while the others wait, and a
    write that fails cannot leave a peer inside a collective)."""
    done = []
    try:
        for table in tables:
            for var in [table] + [table._sok_slots[k]
                                  for k in sorted(table._sok_slots)]:
                var._sok_gathered = var.read_global()
                done.append(var)
        yield
    finally:
        for var in done:
            var._sok_gathered = None
