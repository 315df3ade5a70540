"""Shared machinery of the sok_keras embedding layers."""

import copy

import keras
import numpy as np
import tensorflow as tf

from sok_keras import consistency
from sok_keras._keras_h5 import first_load_error
from sok_keras.lookup import SUPPORTED_COMBINERS
from sok_keras.variable import TABLE_DTYPES
from sok_keras.variable import Variable
from sok_keras.variable import save_entry
from sok_keras.variable import saved_array
from sok_keras.variable import table_entries
from sok_keras._ops import not_converted as _not_converted
from keras.src.backend.common import global_state
from keras.src.saving import serialization_lib
from keras.src.backend.common.symbolic_scope import in_symbolic_scope


def check_positive_int(value, arg, layer):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value <= 0
    ):
        raise ValueError(
            f"{layer}: `{arg}` must be a positive integer. "
            f"Received: {arg}={value!r} (of type {type(value).__name__})."
        )
    return int(value)


def get_initializer(initializer, where):
    """`keras.initializers.get(initializer)`, its error naming `where` (the
    layer or table) and the value."""
    if isinstance(initializer, dict):
        initializer = copy.deepcopy(initializer)  # Keras edits configs
    try:
        return keras.initializers.get(initializer)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{where}: bad `initializer`: {e} Received: "
            f"initializer={initializer!r}.") from None


def layer_name(cls, name):
    """How errors name a layer: `DistributedEmbedding 'user_emb'` (the class
    alone while it has no name yet)."""
    return f"{cls} '{name}'" if name else cls


def init_keras_layer(init, cls, kwargs):
    """Runs `keras.layers.Layer.__init__` (`init`, bound) with `kwargs`;
    a `dtype` Keras cannot read is refused naming the layer and value."""
    who = layer_name(cls, kwargs.get("name"))
    try:
        init(**kwargs)
    except ValueError as e:
        if "dtype" not in kwargs or "olicy" not in str(e):
            raise
        raise ValueError(
            f"{who}: `dtype` must be a float "
            "dtype or a Keras dtype policy ('float32', 'mixed_float16', "
            f"'mixed_bfloat16', ...). Received: dtype={kwargs['dtype']!r} "
            f"({e})") from None
    layer = getattr(init, "__self__", None)
    mode = getattr(getattr(layer, "dtype_policy", None), "quantization_mode",
                   None)
    if mode is not None:
        # (QA: taken, and the first call failed inside Keras, "does not
        # have a `_int8_call` method".)
        raise ValueError(
            f"{who}: sok tables take no "
            f"quantized dtype policy ({mode!r}); give a float dtype or "
            "policy ('float32', 'mixed_bfloat16', ...). "
            "`model.quantize(...)` quantizes the model's other layers and "
            f"leaves sok layers as they are. Received: "
            f"dtype={kwargs.get('dtype')!r}.")
    table_dtype = getattr(layer, "variable_dtype", None)
    if "dtype" in kwargs and table_dtype not in TABLE_DTYPES:
        # (QA: an int dtype was refused at build, by the table, naming
        # only 'embeddings'.)
        raise ValueError(
            f"{who}: the tables' dtype must "
            f"be one of {list(TABLE_DTYPES)} (or a policy such as "
            f"'mixed_float16'). Received: dtype={kwargs['dtype']!r}.")


def get_table_optimizer(optimizer, layer):
    """Validates a layer's own table optimizer (None, name, config or
    instance) and returns a Keras optimizer instance or None."""
    if optimizer is None:
        return None
    from sok_keras.optimizers import sparse_rules

    shared = None
    if isinstance(optimizer, dict):
        # Keras' deserialization edits the config it is given: never let it
        # touch the caller's (e.g. a layer config being round-tripped).
        optimizer = copy.deepcopy(optimizer)
        # One optimizer that several tables shared when saved (a mark
        # `serialize_table_optimizer` made, which `keras.optimizers.get`
        # drops): made once while Keras loads the model.
        shared = optimizer.pop("shared_object_id", None)
        if shared is not None:
            opt = serialization_lib.get_shared_object(shared)
            if opt is not None:
                return opt
    try:
        opt = keras.optimizers.get(optimizer)
        # (Raises, listing the supported ones.) The state Keras makes in
        # `build` is made now: it is saved with the layer.
        sparse_rules.rule_for(opt).prepare(opt)
    except ValueError as e:
        raise ValueError(f"{layer}: the table's `optimizer`: {e}") from e
    for arg in ("clipnorm", "global_clipnorm", "clipvalue", "use_ema",
                "gradient_accumulation_steps", "loss_scale_factor"):
        if getattr(opt, arg, None):
            raise ValueError(
                f"{layer}: the table's optimizer may not set `{arg}`; "
                "clipping and the other step-wide options come from the "
                f"model's optimizer. Received: {arg}={getattr(opt, arg)!r}."
            )
    if shared is not None:
        serialization_lib.record_object_after_deserialization(opt, shared)
    return opt


def serialize_table_optimizer(opt):
    """The config of a table's own optimizer (None: None).

    Inside a Keras save (its `ObjectSharingScope`), the config carries
    Keras' `shared_object_id`, so that tables that shared one optimizer
    instance share one again when the model is loaded: the save writes
    that optimizer's state (its step count) once, under the first table
    that holds it. (Keras marks a shared object itself, but only in the
    config it sees second: the first layer's config is copied before
    then, so it loaded two optimizers, one of them restored.)"""
    if opt is None:
        return None
    config = keras.saving.serialize_keras_object(opt)
    if global_state.get_global_attribute(
            "shared_objects/id_to_config_map") is not None:
        config["shared_object_id"] = id(opt)
    return config


def check_combiner(combiner, layer):
    if combiner is not None and combiner not in SUPPORTED_COMBINERS:
        raise ValueError(
            f"{layer}: `combiner` must be one of {SUPPORTED_COMBINERS} or "
            f"None. Received: combiner={combiner!r}."
        )
    return combiner


def save_table(store, key, slot_prefix, table):
    """Saves `table` as `store[key]` and each slot as
    `store[slot_prefix + name]`, whole and in global row order, streamed
    in bounded chunks."""
    for entry in table_entries(table):
        name = key if entry.slot is None else slot_prefix + entry.slot
        save_entry(store, name, entry)


def load_table(store, key, slot_prefix, table, where):
    """Loads `table` and its slots from what `save_table` wrote, reading
    only this rank's rows. Every entry's shape is checked before any is
    assigned."""
    value = saved_array(store, key, where)
    slots = {k[len(slot_prefix):]: saved_array(store, k, where)
             for k in list(store.keys()) if k.startswith(slot_prefix)}
    owner = f"{where}, '{key}'"
    from sok_keras.variable import _check_global_shape

    _check_global_shape(value, table.global_shape, owner)
    for name, array in slots.items():
        _check_global_shape(array, table.global_shape,
                            f"{where}, '{slot_prefix}{name}'")
    table.assign_global(value, owner)
    for name, array in sorted(slots.items()):
        table.restore_slot(name, array)


# `keras.layers.Embedding` arguments a sharded table does not have, and
# what to do instead.
_KERAS_ONLY = {
    "mask_zero": "the sok layers take -1 as padding and mask it "
                 "(`compute_mask`: ids != -1); shift ids by one, or map 0 to -1",
    "embeddings_regularizer": "a regularizer would need the whole table on "
                              "every step; add a penalty on the looked-up "
                              "rows to the loss as a mean over the batch, "
                              "or one on the table's shard times "
                              "sok.num_ranks() (docs/design.md, 'Data "
                              "parallelism and averaging')",
    "embeddings_constraint": "a constraint would rewrite the whole table on "
                             "every step",
    "input_length": "Keras 3 deprecated it and ignores it; give the ids' "
                    "shape to `keras.Input`",
    "sparse": "the gradient of a table is always sparse (IndexedSlices over "
              "the looked-up rows)",
    "lora_rank": "LoRA is not supported for sharded tables",
    "lora_alpha": "LoRA is not supported for sharded tables",
    "quantization_config": "quantized (int8/int4) tables are not "
                           "supported; keep a float32 table, or a 16-bit "
                           "one (dtype='bfloat16' or 'float16')",
}


# SOK 1's DistributedEmbedding arguments (see _keras_embedding_arguments).
_SOK1_ARGUMENTS = ("max_vocabulary_size_per_gpu", "embedding_vec_size",
                   "slot_num", "max_nnz", "max_feature_num")


# The default combiner: "sum" (SOK's), or None (unpooled, as
# keras.layers.Embedding) when a size is given by one of Keras' names.
DEFAULT_COMBINER = "default"


def _keras_embedding_arguments(cls, vocabulary_size, embedding_dim, kwargs):
    """`(vocabulary_size, embedding_dim)`, also from Keras' names
    `input_dim` / `output_dim`; refuses Keras' other Embedding arguments
    with what to do instead (popped from `kwargs`)."""
    who = layer_name(cls, kwargs.get("name"))
    for ours, keras_name, value in (("vocabulary_size", "input_dim",
                                     vocabulary_size),
                                    ("embedding_dim", "output_dim",
                                     embedding_dim)):
        if keras_name in kwargs:
            if value is not None:
                raise ValueError(
                    f"{who}: give `{ours}` or Keras' `{keras_name}`, not "
                    f"both. Received: {ours}={value!r}, "
                    f"{keras_name}={kwargs[keras_name]!r}.")
    vocabulary_size = kwargs.pop("input_dim", vocabulary_size)
    embedding_dim = kwargs.pop("output_dim", embedding_dim)
    sok1 = sorted(set(kwargs) & set(_SOK1_ARGUMENTS))
    # SOK 1's first positional argument was the combiner.
    positional = (isinstance(vocabulary_size, str)
                  and vocabulary_size in ("sum", "mean", "sqrtn"))
    if sok1 or positional:
        received = (f"vocabulary_size={vocabulary_size!r} (SOK 1's "
                    "combiner, its first positional argument)"
                    if positional else
                    ", ".join(f"{k}={kwargs[k]!r}" for k in sok1))
        raise ValueError(
            f"{who} does not take SOK 1's arguments. SOK 1's "
            "`DistributedEmbedding(combiner, max_vocabulary_size_per_gpu, "
            "embedding_vec_size, slot_num, max_nnz)` is here "
            f"`{cls}(vocabulary_size=max_vocabulary_size_per_gpu * "
            "sok.num_ranks(), embedding_dim=embedding_vec_size, "
            "combiner=...)`, which pools each sample's ids of one feature, "
            "`[batch, max_nnz]` (-1 pads), into `[batch, embedding_dim]`: "
            "call it once per slot, or use `sok.layers.EmbeddingCollection` "
            f"with one feature per slot sharing a table. Received: "
            f"{received}.")
    refuse_keras_only_arguments(who, kwargs)
    return vocabulary_size, embedding_dim


def refuse_keras_only_arguments(who, kwargs):
    """Refuses `keras.layers.Embedding`'s arguments that a sharded table
    cannot honor (`_KERAS_ONLY`), with what to do instead; pops those left
    at Keras' defaults from `kwargs`. `who` names the layer."""
    for name, why in _KERAS_ONLY.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if name in ("mask_zero", "sparse") and not value:
                continue  # Keras' default: nothing to refuse
            if value is None:
                continue
            raise ValueError(
                f"{who} does not take `{name}` (an argument of "
                f"keras.layers.Embedding): {why}. Received: "
                f"{name}={value!r}.")


# Keras layers that return ragged (sparse) ids for ragged (sparse) inputs,
# though their output's KerasTensor is not marked so.
_KEEPS_RAGGED = ("StringLookup", "IntegerLookup", "Hashing")


def is_ragged_or_sparse(ids):
    """Ragged or sparse ids: tensors, or the `keras.Input(ragged=True)` /
    `keras.Input(sparse=True)` placeholders of a functional model, or what a
    lookup layer (`StringLookup`, `IntegerLookup`, `Hashing`) makes of
    those: Keras marks its output dense, but at run time it is ragged
    (sparse) as its input."""
    return ragged_origin(ids) is not None


def ragged_origin(ids):
    """`"ragged"` or `"sparse"` where `ids` are ragged or sparse (see
    `is_ragged_or_sparse`), else None."""
    for _ in range(16):  # (a chain of lookup layers, at most)
        if isinstance(ids, tf.RaggedTensor) or getattr(ids, "ragged", False):
            return "ragged"
        if isinstance(ids, tf.SparseTensor) or getattr(ids, "sparse", False):
            return "sparse"
        history = getattr(ids, "_keras_history", None)
        op = getattr(history, "operation", None)
        if (type(op).__name__ not in _KEEPS_RAGGED
                or getattr(op, "output_mode", "int") != "int"):
            return None  # (multi_hot, count, ...: dense at run time)
        try:
            node = op._inbound_nodes[history.node_index]
            ids = node.arguments.keras_tensors[0]
        except (AttributeError, IndexError):
            return None
    return None


def padding_mask(ids, combiner):
    """Keras' mask of a lookup: `ids != -1` for an unpooled lookup of
    dense ids of rank >= 2, so that mask-aware layers skip padding; None
    for pooled lookups and for ragged or sparse ids."""
    if (combiner is not None or ids is None or is_ragged_or_sparse(ids)
            or len(getattr(ids, "shape", ())) < 2):
        return None
    return keras.ops.not_equal(ids, -1)


def ragged_spec(spec, ids, combiner):
    """`spec` (a KerasTensor) marked ragged where an unpooled lookup of
    ragged ids returns ragged rows."""
    if combiner is None and ragged_origin(ids) == "ragged":
        return keras.KerasTensor(spec.shape, spec.dtype, ragged=True)
    return spec


def check_pooled_rank(shape, combiner, where):
    """Refuses ids of more than 2 dimensions for a pooled lookup when the
    model is built (the lookup would refuse them at the first batch)."""
    if len(shape) > 2:
        raise ValueError(
            f"{where}: a pooled lookup (combiner={combiner!r}) takes ids "
            "of shape [batch] or [batch, n] (ragged or sparse: [batch, "
            f"None]). Received: ids of shape {shape}. Reshape them to "
            "[batch, n] (one bag per row), or give combiner=None for the "
            "unpooled rows of ids of any shape.")


def _initial_table(weights, shape, where):
    """Keras Embedding's `weights=`: the whole table `[rows, dim]`, or a
    list of it, as an array (shape-checked now); None if not given. Like
    Keras, it is not part of the layer's config."""
    if weights is None:
        return None
    if isinstance(weights, (list, tuple)):
        if len(weights) != 1:
            raise ValueError(
                f"'{where}': `weights` is the whole table or a list of it "
                f"(one array). Received: a list of {len(weights)} arrays.")
        weights = weights[0]
    weights = np.asarray(keras.ops.convert_to_numpy(weights))
    if weights.dtype.kind not in "fiu":
        raise TypeError(
            f"'{where}': `weights` must be a numeric array. Received: "
            f"dtype {weights.dtype}.")
    from sok_keras.variable import _check_global_shape

    _check_global_shape(weights, shape, where)
    return weights


# The largest table whose every id a float type holds exactly.
_EXACT_FLOAT_IDS = {tf.float32: 2 ** 24, tf.float64: 2 ** 53}
# What a float id that is no whole number (a fraction, nan, inf) becomes
# with several ranks: an id every lookup refuses, on every rank at once.
NOT_A_WHOLE_ID = -2 ** 63


def as_int_ids(ids, rows, name=None, local=False):
    """`ids`, with float ids cast to int64 where that is exact, as
    `keras.layers.Embedding` casts them:

    - while Keras infers shapes without data (its `SymbolicScope`): it
      builds a subclassed model, or a layer with no `build()`, by running
      its `call` on float32 placeholders of the recorded input shapes
      (`load_model`, a first call on a `keras.Input`); no id value exists
      there to be truncated;
    - float32 ids into tables of at most 2**24 rows (float64: 2**53), which
      hold every id exactly: Keras makes a model's inputs float32 unless
      told otherwise (a Sequential with no `keras.Input`, `keras.Input`
      without dtype).

    Unlike Keras, which truncates them, float ids that are no integer
    (1.5, nan, inf, 1e30) are refused: with one rank (or `local`) here, by an
    error naming `name` and the value; with several, they become
    `NOT_A_WHOLE_ID`, which the lookup refuses on every rank alike (a
    rank-local error here would leave the other ranks waiting in the
    exchange). Other float ids are left to the lookup, which refuses them
    (naming the layer and what to declare instead). `rows`: the number of
    rows of the table the ids are looked up in; None casts in Keras' shape
    inference only (a structure that holds weights too).
    """
    symbolic = in_symbolic_scope()

    def cast(t):  # dense, ragged and sparse tensors alike
        dtype = getattr(t, "dtype", None)
        if dtype is None:
            return t
        dtype = tf.as_dtype(dtype)
        if not dtype.is_floating:
            return t
        if symbolic:
            return tf.cast(t, tf.int64)
        if rows is not None and rows <= _EXACT_FLOAT_IDS.get(dtype, 0):
            return _whole_ids(t, name, local)
        return t

    # (keras.tree: also dicts whose keys mix types, which tf.nest refuses.)
    return keras.tree.map_structure(cast, ids)


def _whole_ids(t, name, local):
    """Float ids `t` (dense, ragged or sparse) as int64, each one that is
    no whole number refused (see `as_int_ids`)."""
    from sok_keras import world
    from sok_keras.lookup import _assert

    if isinstance(t, tf.RaggedTensor):
        # (flat: `[batch, None, k]` ids reach normalize_ids' error)
        values = tf.reshape(t.flat_values, [-1])
    elif isinstance(t, tf.SparseTensor):
        values = t.values
    else:
        t = tf.convert_to_tensor(t)
        values = tf.reshape(t, [-1])
    # (Beyond 2**62 a cast would overflow; no table has that many rows.)
    whole = (tf.math.is_finite(values) & tf.equal(values, tf.floor(values))
             & (tf.abs(values) < 2.0 ** 62))
    ints = tf.where(whole, tf.cast(values, tf.int64),
                    tf.constant(NOT_A_WHOLE_ID, tf.int64))
    if local or world.num_ranks() == 1:
        ok = tf.reduce_all(whole)
        # (A last entry that is "bad" keeps argmax and gather defined on
        # an empty batch; the message is shown only when `ok` is False.)
        bad = tf.concat([tf.logical_not(whole), [True]], 0)
        first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
        message = tf.strings.join([
            f"sok_keras: '{name or 'embedding'}': the float id ",
            tf.strings.as_string(
                tf.gather(tf.concat([values, [0]], 0), first),
                shortest=True),
            " at position ", tf.strings.as_string(first),
            " is no integer id (a fraction, nan, inf, or beyond int64). "
            "Float ids are cast to int64 only where that is exact "
            "(keras.layers.Embedding would truncate them); "
            "declare the ids' input as integers, e.g. "
            '`keras.Input(shape=(n,), dtype="int64")`.'])
        check = _assert(ok, message)
        if check is not None:
            with tf.control_dependencies([check]):
                ints = tf.identity(ints)
    if isinstance(t, tf.RaggedTensor):
        return t.with_flat_values(tf.reshape(ints, tf.shape(t.flat_values)))
    if isinstance(t, tf.SparseTensor):
        return tf.SparseTensor(t.indices, ints, t.dense_shape)
    return tf.reshape(ints, tf.shape(t))


def flatten_deep_ids(ids, weights, where):
    """Unpooled dense ids of rank > 2, as `keras.layers.Embedding` takes
    them: `(ids as [batch, n], weights alike, the ids' shape)`, to look
    them up as [batch, n] and give the rows back that shape (+ [dim]);
    `(ids, weights, None)` for other ids."""
    if (not tf.is_tensor(ids)
            or isinstance(ids, (tf.RaggedTensor, tf.SparseTensor))
            or ids.shape.rank is None or ids.shape.rank <= 2):
        return ids, weights, None
    from sok_keras.lookup import check_static_weights_shape

    shape = tf.shape(ids)
    if weights is not None and not isinstance(
            weights, (tf.RaggedTensor, tf.SparseTensor)):
        weights = tf.convert_to_tensor(weights)
        # Before flattening: as many weights in another layout would pass
        # the flat check.
        check_static_weights_shape(weights, ids, where)
        weights = tf.reshape(weights, [shape[0], -1])
    return tf.reshape(ids, [shape[0], -1]), weights, shape


def check_shard_weights(layer, weights):
    """`set_weights` on N ranks takes each table's local shard: a whole
    table, or another layer's shard, given instead is refused with what to
    do, on every rank (Keras' own error only compares shapes)."""
    from sok_keras.variable import is_sok_variable

    for v, w in zip(layer.weights, weights):
        shape = tuple(np.shape(w))
        if (is_sok_variable(v) and shape != tuple(v.shape)
                and v.num_ranks > 1):
            # (QA: another layer's shard, such as a LocalizedEmbedding's
            # placed on another rank, got Keras' bare shape message.)
            received = ("the whole table" if shape == tuple(v.global_shape)
                        else "an array of shape")
            raise ValueError(
                f"{layer_name(type(layer).__name__, layer.name)}: "
                "set_weights takes "
                f"this rank's shard of table '{v.path}', {tuple(v.shape)} "
                f"on rank {v.rank} of {v.num_ranks}; received {received} "
                f"{shape}. Copy a whole table in with "
                "`layer.embeddings.assign_global(table)` (every rank calls "
                "it; `read_global()` reads one).")


class BaseEmbedding(keras.layers.Layer):
    """Base class: one sharded table, looked up with a combiner.

    Subclasses set the sharding through `_table_mode()`.
    """

    def __init__(
        self,
        vocabulary_size=None,
        embedding_dim=None,
        combiner=DEFAULT_COMBINER,
        embeddings_initializer="uniform",
        optimizer=None,
        pooling="auto",
        **kwargs,
    ):
        cls = type(self).__name__
        if combiner == DEFAULT_COMBINER:
            # A Keras name (`Embedding(1000, output_dim=64)` is Keras'
            # style too): Keras' semantics, one row per id.
            keras_names = "input_dim" in kwargs or "output_dim" in kwargs
            combiner = None if keras_names else "sum"
        vocabulary_size, embedding_dim = _keras_embedding_arguments(
            cls, vocabulary_size, embedding_dim, kwargs)
        initial = kwargs.pop("weights", None)
        init_keras_layer(super().__init__, cls, kwargs)
        from sok_keras.lookup import check_pooling

        # (QA: a model of many tables needs the one at fault named.)
        who = layer_name(cls, self.name)
        check_pooling(pooling, who)
        self.pooling = pooling
        # Keras saves this optimizer's own variables (its step count) with
        # the layer, since it is an attribute of the layer.
        self.table_optimizer = get_table_optimizer(optimizer, who)
        self.vocabulary_size = check_positive_int(
            vocabulary_size, "vocabulary_size", who)
        self.embedding_dim = check_positive_int(
            embedding_dim, "embedding_dim", who)
        self.combiner = check_combiner(combiner, who)
        self.embeddings_initializer = get_initializer(
            embeddings_initializer, who)
        self._initial_table = _initial_table(
            initial, (self.vocabulary_size, self.embedding_dim),
            f"{self.name}/embeddings")
        self.supports_jit = False  # custom ops have no XLA kernels
        # Ids are never cast to the compute dtype (float64 ids would become
        # float32, float32 ones float16 under a mixed policy): `as_int_ids`
        # decides, as `keras.layers.Embedding` does not cast them either.
        self.autocast = False

    def _table_mode(self):
        raise NotImplementedError

    @property
    def input_dim(self):
        """Keras' name for `vocabulary_size` (`keras.layers.Embedding`)."""
        return self.vocabulary_size

    @property
    def output_dim(self):
        """Keras' name for `embedding_dim` (`keras.layers.Embedding`)."""
        return self.embedding_dim

    @property
    def embedding_variable(self):
        """SOK 1's name for `embeddings`: the table, a `sok.Variable`
        (made when the layer is built)."""
        if not self.built:
            raise AttributeError(self._no_table_yet())
        return self.embeddings

    def _no_table_yet(self):
        return (f"Layer '{vars(self).get('name')}' has no table yet: it is "
                "made when the layer is built (called on ids, or "
                "`layer.build()`).")

    def __getattr__(self, name):
        # Only reached when the attribute is not there: `embeddings` before
        # the layer is built (QA: a bare AttributeError, where Keras'
        # Embedding says to build the layer first). A property that raises
        # AttributeError (`embedding_variable`) ends here too.
        if name in ("embeddings", "embedding_variable"):
            raise AttributeError(self._no_table_yet())
        # Anything else: the error Python would give without this method
        # (a property's own, e.g. Keras' `input` of a layer never called).
        return object.__getattribute__(self, name)

    def enable_lora(self, rank, *args, **kwargs):
        """`keras.layers.Embedding.enable_lora`: refused, with the reason
        (a sok table is trained by sparse row updates, not low-rank
        factors)."""
        raise ValueError(
            f"{layer_name(type(self).__name__, self.name)} has no "
            "`enable_lora` (a method of keras.layers.Embedding): "
            f"{_KERAS_ONLY['lora_rank']}. Received: rank={rank!r}.")

    def build(self, input_shape=None):
        if self.built:
            return
        # Keras' `weights=` (each rank keeps its rows of the whole table)
        # is the table's initial value, not an assignment after it is
        # made: a table built while Keras infers shapes (a subclassed
        # model's first call) is only made when that scope exits, and an
        # assignment before then would be lost.
        initial = self._initial_table
        self.embeddings = Variable(
            self.embeddings_initializer if initial is None else initial,
            shape=(self.vocabulary_size, self.embedding_dim),
            mode=self._table_mode(),
            dtype=self.variable_dtype,
            name="embeddings",
        )
        self._initial_table = None
        self.embeddings.optimizer = self.table_optimizer
        if not self.trainable:
            # As Keras' add_weight does: the table stays among the layer's
            # trainable variables (so that `layer.trainable = True` thaws
            # it) but is frozen with the layer (`trainable=False` given to
            # the constructor, or restored from a saved config).
            self.embeddings.trainable = False
        self.built = True

    @_not_converted
    def call(self, inputs, weights=None):
        from sok_keras.lookup import lookup_one

        inputs = as_int_ids(inputs, self.vocabulary_size, self.name)
        shape = None
        if self.combiner is None:
            inputs, weights, shape = flatten_deep_ids(inputs, weights,
                                                      self.name)
        out = lookup_one(
            self.embeddings, inputs, weights, self.combiner, name=self.name,
            pooling=self.pooling)
        if shape is not None:
            out = tf.reshape(out, tf.concat(
                [shape, [self.embedding_dim]], axis=0))
        return tf.cast(out, self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        """Unpooled lookups of dense ids: `ids != -1`, so that mask-aware
        layers (`GlobalAveragePooling1D`, attention, RNNs) skip padding.
        Pooled outputs, and ragged or sparse ids, have no mask."""
        return padding_mask(inputs, self.combiner)

    def compute_output_spec(self, inputs, *args, **kwargs):
        spec = super().compute_output_spec(inputs, *args, **kwargs)
        return ragged_spec(spec, inputs, self.combiner)

    def compute_output_shape(self, inputs_shape=None, weights_shape=None,
                             **kwargs):
        # Keras' `summary` of a layer built outside a functional model
        # passes `build`'s argument name, `input_shape`.
        if inputs_shape is None:
            inputs_shape = kwargs.pop("input_shape")
        input_shape = tuple(inputs_shape)
        if self.combiner is not None:
            check_pooled_rank(input_shape, self.combiner, f"'{self.name}'")
            return (input_shape[0], self.embedding_dim)
        if len(input_shape) == 1:
            return (input_shape[0], self.embedding_dim)
        return input_shape + (self.embedding_dim,)

    # -- saving: the table (and its optimizer slots) are stored whole, in
    # global row order, so that they load at any number of ranks. Rows are
    # streamed in bounded chunks (no rank holds a whole table) and loading
    # reads only this rank's rows (sok_keras/variable.py, _keras_h5.py).
    def save_own_variables(self, store):
        if not self.built:
            # Never called (a layer a subclassed model holds but does not
            # use, or a model saved before its first call): no table yet,
            # nothing saved, as Keras' own layers (QA: AttributeError).
            return
        save_table(store, "embeddings", "slot.", self.embeddings)

    @first_load_error
    def load_own_variables(self, store):
        if not self.built and not list(store.keys()):
            return  # saved unbuilt: stays unbuilt, as Keras' layers
        if not self.built:
            # A subclassed model whose `build()` does not build its layers
            # (Keras loads weights into layers it never called).
            self.build()
        consistency.check_table(self.embeddings, "load")
        load_table(store, "embeddings", "slot.", self.embeddings,
                   f"Layer '{self.name}'")

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "embedding_dim": self.embedding_dim,
                "combiner": self.combiner,
                "pooling": self.pooling,
                "embeddings_initializer": keras.initializers.serialize(
                    self.embeddings_initializer),
                "optimizer": serialize_table_optimizer(
                    self.table_optimizer),
            }
        )
        return config
