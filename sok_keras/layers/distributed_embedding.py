"""`DistributedEmbedding`: a table row-sharded over every rank."""

import keras

from sok_keras.layers.base_embedding import BaseEmbedding


@keras.saving.register_keras_serializable(package="sok_keras")
class DistributedEmbedding(BaseEmbedding):
    """An embedding table whose rows are spread over all ranks.

    Row `id` lives on rank `id % N`. A lookup sends each distinct id of the
    batch to its owner once and brings its row back; the result equals
    `keras.layers.Embedding` (unpooled) or `tf.nn.embedding_lookup_sparse`
    (pooled) on the whole table. With one rank, it is a fast local lookup.

    Args:
        vocabulary_size: int, the number of rows of the whole table.
        embedding_dim: int, the width of each row. Keras' names
            `input_dim` / `output_dim` are accepted for these two (and
            readable as attributes).
        combiner: `"sum"`, `"mean"`, `"sqrtn"`, or `None` to return the
            rows unpooled (`[batch, n, dim]` for dense `[batch, n]` input,
            a ragged `[batch, None, dim]` for ragged input). Defaults to
            `"sum"` (SOK's pooled lookup), or to `None` when a size is
            given by one of Keras' names `input_dim` / `output_dim`
            (`DistributedEmbedding(1000, output_dim=64)`: a drop-in
            `keras.layers.Embedding`, whose output is unpooled).
        embeddings_initializer: initializer of the table. Defaults to
            `"uniform"`. Each rank initializes only its own rows.
        pooling: where pooled rows are summed with several ranks: `"auto"`
            (default) compares, every step, the bytes of bringing one row
            per distinct id home with sending every id to its owner and
            bringing one partial sum per sample home, and takes the cheaper
            (all ranks agree); `"home"` or `"owner"` pin one way: no
            per-step comparison, and no `tf.cond` of both ways to trace,
            which shortens the first step of models with many separate
            tables of several ids per sample (`bench/pooling_modes.py`,
            26 tables of 3 ids on 2 CPU ranks: 4.3 s to the first step
            with `"home"`, 13.3 s with `"auto"`; or use one
            `EmbeddingCollection`), but the bytes moved are no longer the
            fewer of the two. In a Keras step, `"auto"` pools dense ids of
            one id per sample at home, with no `tf.cond` (the owner way
            never moves fewer bytes there; 26 one-id tables: 4.4 s, as
            `"home"`). Ignored with one rank
            and for unpooled lookups. Inside a `tf.function` under a
            persistent `GradientTape` (or tapes nested), `"auto"` pools at
            home, so that several `tape.gradient` calls work.
        optimizer: optional Keras optimizer (instance, name or config) for
            this table only, e.g. `keras.optimizers.Adagrad(0.05)`. It wins
            over the model's optimizer for this table: its rule,
            hyperparameters, learning-rate schedule and own step count are
            used (applied lazily, like `OptimizerWrapper`); clipping and the
            cross-rank averaging still come from the model's optimizer,
            which must be an `OptimizerWrapper` or a `sok.optimizers` class.
            Callbacks that set the model's learning rate
            (`ReduceLROnPlateau`, `LearningRateScheduler`) leave this
            one's alone: give it a schedule. One instance may serve
            several tables (one step count); `model.save` keeps them
            sharing it.
            Defaults to `None` (the model's optimizer rules the table).
        **kwargs: base layer arguments (`name`, `dtype`, ...), and
            `keras.layers.Embedding`'s `weights`: the whole initial table
            `[rows, dim]` (or a list of it), of which each rank keeps its
            rows when the layer is built; not saved in the config.

    Call arguments:
        inputs: ids, as a dense int tensor `[batch]` or `[batch, n]` (`-1`
            is padding), a `tf.RaggedTensor` or a `tf.SparseTensor`.
            Unpooled (`combiner=None`), a `tf.SparseTensor`'s positions
            without an id are padding too: zero rows, with no gradient
            (`keras.layers.Embedding` looks up row 0 there).
        weights: optional per-id weights with the structure of `inputs`.

    Example:

    >>> ids = keras.Input(shape=(3,), dtype="int64")
    >>> x = sok.layers.DistributedEmbedding(1000, 16, combiner="mean")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    """

    def _table_mode(self):
        return "distributed"
