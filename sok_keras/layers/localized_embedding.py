"""`LocalizedEmbedding`: a whole table placed on one rank."""

import itertools
import logging
import threading

import keras
from keras.src.backend.common import global_state

from sok_keras import replicas
from sok_keras.layers.base_embedding import DEFAULT_COMBINER
from sok_keras.layers.base_embedding import BaseEmbedding

_ROUND_ROBIN = itertools.count()
_ROUND_ROBIN_LOCK = threading.Lock()
_SESSION_KEY = "sok_keras_localized_round_robin"
_LOG = logging.getLogger("sok_keras")


def _next_rank():
    """The next rank of the round-robin. It starts again in a new Keras
    session (`keras.utils.clear_session()`), as Keras' layer names do: the
    same model code run twice in one process, with a `clear_session` in
    between, places its tables alike (QA: the second model's table went to
    rank 1, and restoring the first model's per-rank checkpoint into it
    failed). Only the main thread's session counts (Keras keeps one per
    thread; a strategy's replica threads must not restart it)."""
    global _ROUND_ROBIN
    with _ROUND_ROBIN_LOCK:
        if (threading.current_thread() is threading.main_thread()
                and global_state.get_global_attribute(_SESSION_KEY) is None):
            _ROUND_ROBIN = itertools.count()
            global_state.set_global_attribute(_SESSION_KEY, True)
        return next(_ROUND_ROBIN) % replicas.table_ranks()


@keras.saving.register_keras_serializable(package="sok_keras")
class LocalizedEmbedding(BaseEmbedding):
    """An embedding table held whole by one rank (model parallelism by table).

    Every rank sends the distinct ids of its batch to the owning rank and
    gets the rows back, so the output equals a local lookup of the whole
    table. Good for small, hot tables: one owner, no row split.

    Args:
        vocabulary_size: int, the number of rows.
        embedding_dim: int, the width of each row. Keras' names
            `input_dim` / `output_dim` are accepted for these two.
        combiner: `"sum"`, `"mean"`, `"sqrtn"` or `None`; the default is
            `DistributedEmbedding`'s (`"sum"`, or `None` with one of
            Keras' names `input_dim` / `output_dim`).
        embeddings_initializer: initializer. Defaults to `"uniform"`.
        rank: int or `None`, the rank that holds the table. `None` (default)
            places localized tables round-robin over the ranks in the order
            they are built (the same order on every rank), starting again
            at rank 0 after `keras.utils.clear_session()`. An explicit rank
            must be smaller than the number of ranks.
        pooling: where pooled rows are summed with several ranks:
            `"auto"` (default), `"home"` or `"owner"`, as
            `DistributedEmbedding`'s `pooling` (which says what each costs,
            measured in `bench/pooling_modes.py`). Ignored with one rank
            and for unpooled lookups.
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
        inputs: ids, dense (`-1` padding), ragged or sparse; unpooled,
            a sparse tensor's positions without an id are zero rows, as
            for `DistributedEmbedding`.
        weights: optional per-id weights.

    Example:

    >>> emb = sok.layers.LocalizedEmbedding(100, 8, rank=0)
    >>> emb(np.array([[1, 2], [3, -1]])).shape
    TensorShape([2, 8])
    """

    def __init__(self, vocabulary_size=None, embedding_dim=None,
                 combiner=DEFAULT_COMBINER, embeddings_initializer="uniform",
                 rank=None,
                 pooling="auto", optimizer=None, **kwargs):
        super().__init__(
            vocabulary_size, embedding_dim, combiner=combiner,
            embeddings_initializer=embeddings_initializer,
            optimizer=optimizer, pooling=pooling, **kwargs)
        if rank is not None and (
            isinstance(rank, bool) or not isinstance(rank, int) or rank < 0
        ):
            raise ValueError(
                "LocalizedEmbedding: `rank` must be None or a non-negative "
                f"integer. Received: rank={rank!r}."
            )
        self.rank = rank
        self._placed_rank = None

    def _table_mode(self):
        if self._placed_rank is None:
            self._placed_rank = self.rank if self.rank is not None else (
                _next_rank())
        if self._placed_rank >= replicas.table_ranks():
            raise ValueError(
                f"LocalizedEmbedding '{self.name}': rank={self._placed_rank} "
                f"but there are only {replicas.table_ranks()} rank(s)."
            )
        return f"localized:{self._placed_rank}"

    def get_config(self):
        config = super().get_config()
        config["rank"] = self.rank
        if self.rank is None and self._placed_rank is not None:
            # Where the round-robin put it: a clone (`clone_model`) or a
            # loaded model places the table where it was.
            config["placed_rank"] = self._placed_rank
        return config

    @classmethod
    def from_config(cls, config):
        """Rebuilds the layer (`load_model`, `clone_model`) on the rank it
        was placed on; a file from a job of more ranks, whose rank does not
        exist here, places the table on `rank % num_ranks` (with a log
        line), so that it loads at any number of ranks."""
        config = dict(config)
        placed = config.pop("placed_rank", None)
        n = replicas.table_ranks()
        rank = config.get("rank")
        was = rank if rank is not None else placed
        if was is not None and was >= n:
            _LOG.warning(
                "sok_keras: LocalizedEmbedding '%s' was on rank %d; this job "
                "has %d rank(s): placing it on rank %d.",
                config.get("name"), was, n, was % n)
        if rank is not None:
            config["rank"] = rank % n
        layer = super().from_config(config)
        if rank is None and placed is not None:
            layer._placed_rank = placed % n
        return layer
