"""`All2AllDenseEmbedding`: SOK's unpooled, fixed-shape embedding layer."""

import keras
import tensorflow as tf

from sok_keras import replicas
from sok_keras.layers.base_embedding import BaseEmbedding
from sok_keras.layers.base_embedding import as_int_ids
from sok_keras.layers.base_embedding import check_positive_int
from sok_keras.layers.base_embedding import layer_name
from sok_keras._ops import not_converted as _not_converted


@keras.saving.register_keras_serializable(package="sok_keras")
class All2AllDenseEmbedding(BaseEmbedding):
    """SOK's dense (unpooled) embedding: one row per id, fixed shape.

    The table is row-sharded like `DistributedEmbedding`; its size is
    `max_vocabulary_size_per_gpu * num_ranks` rows unless `vocabulary_size`
    is given (SOK's meaning of the per-GPU capacity).

    Args:
        max_vocabulary_size_per_gpu: int, rows per rank.
        embedding_vec_size: int, the width of each row.
        slot_num: int, the number of feature slots per sample.
        nnz_per_slot: int, the number of ids in each slot.
        embeddings_initializer: initializer. Defaults to `"uniform"`.
        vocabulary_size: optional int, the whole table's rows; overrides
            `max_vocabulary_size_per_gpu * num_ranks`. The layer's config
            records the table's rows either way, so a saved model loads at
            any number of ranks with the table it was trained with.
        optimizer: optional Keras optimizer (instance, name or config) for
            this table only, e.g. `keras.optimizers.Adagrad(0.05)`. It wins
            over the model's optimizer for this table: its rule,
            hyperparameters, learning-rate schedule and own step count are
            used (applied lazily, like `OptimizerWrapper`); clipping and the
            cross-rank averaging still come from the model's optimizer,
            which must be an `OptimizerWrapper` or a `sok.optimizers` class.
            Callbacks that set the model's learning rate
            (`ReduceLROnPlateau`, `LearningRateScheduler`) leave this
            one's alone: give it a schedule.
            Defaults to `None` (the model's optimizer rules the table).
        **kwargs: base layer arguments (`name`, `dtype`, ...), and
            `keras.layers.Embedding`'s `weights`: the whole initial table
            `[rows, dim]` (or a list of it), of which each rank keeps its
            rows when the layer is built; not saved in the config.

    Call arguments:
        inputs: int tensor `[batch, slot_num, nnz_per_slot]`; every entry
            must be a valid id.

    Returns:
        `[batch, slot_num, nnz_per_slot, embedding_vec_size]`.

    Example:

    >>> emb = sok.layers.All2AllDenseEmbedding(100, 4, slot_num=3,
    ...                                         nnz_per_slot=2)
    >>> emb(np.zeros([8, 3, 2], "int64")).shape
    TensorShape([8, 3, 2, 4])
    """

    def __init__(self, max_vocabulary_size_per_gpu, embedding_vec_size,
                 slot_num, nnz_per_slot, embeddings_initializer="uniform",
                 vocabulary_size=None, optimizer=None, **kwargs):
        cls = layer_name("All2AllDenseEmbedding", kwargs.get("name"))
        for key in ("dynamic_input", "use_hashtable", "key_dtype",
                    "embedding_initializer"):
            if key in kwargs:
                value = kwargs.pop(key)
                if key == "embedding_initializer":
                    embeddings_initializer = value
                elif key == "use_hashtable" and value:
                    raise ValueError(
                        f"{cls}: `use_hashtable=True` is not "
                        "supported; ids index the table directly."
                    )
                elif key == "dynamic_input" and value:
                    raise ValueError(
                        f"{cls}: `dynamic_input=True` (SOK "
                        "1's ids of any length) is not supported: this "
                        "layer takes [batch, slot_num, nnz_per_slot] ids. "
                        "For unpooled ids of any shape use "
                        "`DistributedEmbedding(..., combiner=None)`.")
        # SOK 1's positional order goes on with dynamic_input,
        # use_hashtable (bools) and key_dtype; here those places are
        # embeddings_initializer, vocabulary_size and optimizer.
        sok1 = [f"{name}={value!r}" for name, value in (
            ("embeddings_initializer", embeddings_initializer),
            ("vocabulary_size", vocabulary_size), ("optimizer", optimizer))
            if isinstance(value, (bool, tf.dtypes.DType))]
        if sok1:
            raise ValueError(
                f"{cls}: after `nnz_per_slot` this layer's arguments are "
                "`embeddings_initializer`, `vocabulary_size` and "
                "`optimizer`, not SOK 1's `dynamic_input`, "
                "`use_hashtable` and `key_dtype`: give those by name "
                "(`dynamic_input=False`, `use_hashtable=False`; the ids' "
                "dtype is taken from the ids) or leave them out. Received: "
                f"{', '.join(sok1)}.")
        if kwargs.get("combiner") is not None:
            raise ValueError(
                f"{cls}: every id gets its own row (no pooling), so there "
                "is no `combiner`; pool with DistributedEmbedding("
                f"combiner=...). Received: combiner={kwargs['combiner']!r}.")
        kwargs.pop("combiner", None)
        self.max_vocabulary_size_per_gpu = check_positive_int(
            max_vocabulary_size_per_gpu, "max_vocabulary_size_per_gpu", cls)
        self.slot_num = check_positive_int(slot_num, "slot_num", cls)
        self.nnz_per_slot = check_positive_int(
            nnz_per_slot, "nnz_per_slot", cls)
        rows = vocabulary_size if vocabulary_size is not None else (
            self.max_vocabulary_size_per_gpu * replicas.table_ranks())
        super().__init__(
            rows, embedding_vec_size, combiner=None,
            embeddings_initializer=embeddings_initializer,
            optimizer=optimizer, **kwargs)
        self.embedding_vec_size = self.embedding_dim

    def _table_mode(self):
        return "distributed"

    @_not_converted
    def call(self, inputs):
        from sok_keras.lookup import all2all_dense_embedding

        if isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                f"Layer '{self.name}' (All2AllDenseEmbedding) takes dense ids "
                f"of shape [batch, {self.slot_num}, {self.nnz_per_slot}], "
                "every entry a valid id (SOK's fixed-shape layer). For "
                "ragged or sparse ids, or -1 padding, use "
                "DistributedEmbedding. Received: "
                f"{type(inputs).__name__}.")
        inputs = as_int_ids(tf.convert_to_tensor(inputs),
                            self.vocabulary_size, self.name)
        if inputs.shape.rank != 3 or (
            inputs.shape[1] is not None and inputs.shape[1] != self.slot_num
        ) or (
            inputs.shape[2] is not None
            and inputs.shape[2] != self.nnz_per_slot
        ):
            raise ValueError(
                f"Layer '{self.name}' expects ids of shape "
                f"[batch, {self.slot_num}, {self.nnz_per_slot}]. "
                f"Received: shape={inputs.shape}."
            )
        out = all2all_dense_embedding(self.embeddings, inputs)
        return tf.cast(out, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.embedding_dim,)

    def compute_mask(self, inputs, mask=None):
        # Every id is a row (no padding): no mask, as SOK's layer, so that
        # Flatten and friends take the output without Keras' warning.
        return None

    def load_own_variables(self, store):
        try:
            super().load_own_variables(store)
        except ValueError as e:
            if "the value given has shape" not in str(e):
                raise
            # A file of an earlier version, whose config left the rows to
            # max_vocabulary_size_per_gpu x the loading job's ranks.
            raise ValueError(
                f"{e} The file was saved at another number of ranks by a "
                "sok_keras whose All2AllDenseEmbedding config did not "
                "record the table's rows: build the model with "
                "`vocabulary_size=` set to the saved table's rows and load "
                "the weights into it (`load_weights`).") from e

    def get_config(self):
        config = super().get_config()
        for key in ("vocabulary_size", "embedding_dim", "combiner"):
            config.pop(key)
        config.update(
            {
                "max_vocabulary_size_per_gpu":
                    self.max_vocabulary_size_per_gpu,
                "embedding_vec_size": self.embedding_dim,
                "slot_num": self.slot_num,
                "nnz_per_slot": self.nnz_per_slot,
                # The whole table's rows, not the per-rank capacity
                # times this job's ranks: the same table at any N.
                "vocabulary_size": self.vocabulary_size,
            }
        )
        return config
