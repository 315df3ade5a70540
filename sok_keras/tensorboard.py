"""`keras.callbacks.TensorBoard` on N ranks: one run, global tables.

With more than one rank, `sok_keras.init()` calls `install()`, which makes
every `keras.callbacks.TensorBoard` (and subclass) behave as follows:

- Only rank 0 writes: the other ranks' train and validation writers are
  `tf.summary.create_noop_writer()`, so the log directory holds one run
  (scalars, histograms, the model graph), not one copy per rank. For a
  model with sok layers the logged metrics are already global
  (`sok_keras.callbacks.GlobalMetrics` runs first by default). Rank 0
  alone writes `projector_config.pbtxt` and runs the profiler
  (`profile_batch`). The callback may be given on rank 0 only (Horovod's
  habit) unless `histogram_freq` is set: the tables' histograms are
  computed by every rank together, and a rank that has no callback makes
  the others raise `RankMismatchError` within `SOK_SAVE_TIMEOUT` (not
  wait for `SOK_COMM_TIMEOUT`). A callback given on other ranks only
  writes nothing: give it on rank 0 (or every rank).
- `keras.callbacks.CSVLogger` writes from rank 0 only too
  (`install_csv_logger`): its rows are the global logs.
- A model without sok layers (its logs are each rank's own): rank 0
  writes too, and another rank logs a warning, once per callback and
  model, that its logs are not written (every rank passing one path would
  garble one file).
- Weight histograms (`histogram_freq`) of sok tables describe the whole
  table, not rank 0's shard: the ranks all-reduce the global min and max on
  the control communicator, count their own rows into the buckets that
  `tf.summary.histogram` would use for the whole table (the same formula:
  30 equal buckets from min to max, the last edge exactly max, values at
  max in the last bucket; one value repeated: every edge is that value and
  the last bucket holds every element), all-reduce the counts, and rank 0
  writes the summary under the tag Keras would use. Every rank must
  therefore log the same epochs (they do: `fit` runs them together).
  Dense weights are the same on every rank: rank 0 writes them as Keras.
  `write_images` is skipped for sok tables (an image of a shard would be
  misleading).

In a world of one only the histograms of sok tables change: they are
counted in chunks as above (the same buckets), since TensorFlow's own
histogram makes a one-hot of `[values, 30]` float64 (about 30 GB for a
2M x 64 table: QA, out of memory). The Keras
internals relied on (`_train_writer`, `_val_writer`, `_log_weights`,
`_configure_embeddings`, `_start_profiler`) are all in this module;
tests/test_tensorboard.py fails if Keras changes them.
"""

import functools

import numpy as np

_INSTALLED = []
_HISTOGRAMS = []
DEFAULT_BUCKET_COUNT = 30  # tensorboard's summary_v2.DEFAULT_BUCKET_COUNT
# Rows are counted in chunks of about this many values (a float64 copy of
# a chunk, not of the whole shard, is made).
_CHUNK_ELEMENTS = 1 << 22


def _rank():
    from sok_keras import world

    return world.rank()


def _writes_here(callback):
    """Whether this rank writes `callback`'s files: rank 0 only, since
    every rank runs the same script and so passes the same path (two
    writers would garble one file). A model with sok layers has global logs
    and whole tables there. For a model without, whose logs are each
    rank's own, another rank says once that it does not write them (they
    were lost silently: QA)."""
    if _rank() == 0:
        return True
    model = getattr(callback, "_model", None)
    if model is not None and getattr(callback, "_sok_told", None) is not model:
        callback._sok_told = model
        from sok_keras.optimizers.auto_wrap import has_sok_layers

        if not has_sok_layers(model):
            import logging

            logging.getLogger("sok_keras").warning(
                "sok_keras: rank %d: %s writes from rank 0 only (every "
                "rank passes the same path); this rank's logs of model "
                "'%s', which has no sok layers and so no global logs, are "
                "not written. To keep them, give the callback a path of "
                "this rank's own and write it yourself, or train that "
                "model on rank 0.", _rank(), type(callback).__name__,
                model.name)
    return False


def _is_sharded(weight):
    from sok_keras.variable import is_sok_variable

    return is_sok_variable(weight) and weight.num_ranks > 1


def _counted_in_chunks(weight):
    """Whether `_log_weights` counts `weight`'s histogram itself: a sharded
    table (collectively), or in a world of one any sok table (QA:
    TensorFlow's histogram of a 2M x 64 table made a one-hot of
    [128000000, 30] float64 and ran out of memory)."""
    from sok_keras import world
    from sok_keras.variable import is_sok_variable

    return _is_sharded(weight) or (is_sok_variable(weight)
                                   and world.num_ranks() == 1)


def bucket_counts(data, lo, hi, bucket_count=DEFAULT_BUCKET_COUNT):
    """Counts `data` into the buckets `tf.summary.histogram` uses for a
    tensor whose min is `lo` and max is `hi` (`lo < hi`).

    Args:
        data: the values (any shape), castable to float64.
        lo: the minimum over the whole table (float64).
        hi: the maximum over the whole table (float64).
        bucket_count: the number of buckets.

    Returns:
        A float64 tensor of `bucket_count` counts.
    """
    import tensorflow as tf

    data = tf.cast(tf.reshape(data, [-1]), tf.float64)
    lo = tf.constant(lo, tf.float64)
    hi = tf.constant(hi, tf.float64)
    width = (hi - lo) / tf.cast(bucket_count, tf.float64)
    index = tf.cast(tf.floor((data - lo) / width), tf.int32)
    index = tf.minimum(index, bucket_count - 1)
    counts = tf.math.bincount(index, minlength=bucket_count,
                              maxlength=bucket_count, dtype=tf.int64)
    return tf.cast(counts, tf.float64)


def buckets_from(lo, hi, counts, total, bucket_count=DEFAULT_BUCKET_COUNT):
    """The `[bucket_count, 3]` (left, right, count) tensor of
    `tf.summary.histogram` from the global min/max, counts and size."""
    import tensorflow as tf

    if total == 0:
        return tf.zeros((bucket_count, 3), tf.float64)
    if lo == hi:
        edges = tf.fill([bucket_count], tf.constant(hi, tf.float64))
        last = np.zeros([bucket_count], np.float64)
        last[-1] = total
        return tf.transpose(tf.stack([edges, edges, tf.constant(last)]))
    edges = tf.linspace(tf.constant(lo, tf.float64),
                        tf.constant(hi, tf.float64), bucket_count + 1)
    edges = tf.concat([edges[:-1], [tf.constant(hi, tf.float64)]], 0)
    return tf.transpose(tf.stack([edges[:-1], edges[1:], counts]))


def global_histogram(table, key, bucket_count=DEFAULT_BUCKET_COUNT):
    """The histogram buckets of a whole sharded table (a collective: every
    rank must call it, with the same `key`).

    Args:
        table: a `sok_keras.Variable`.
        key: the call site's key (the same on every rank).
        bucket_count: the number of buckets.

    Returns:
        A float64 tensor `[bucket_count, 3]` of (left edge, right edge,
        count), what `tf.summary.histogram` computes for the whole table.
    """
    import tensorflow as tf

    from sok_keras import world
    from sok_keras.variable import slice_rows

    comm = world.control_communicator()
    with tf.device("/CPU:0"):
        local = tf.convert_to_tensor(table.value)
        size = int(local.shape[0]) * int(local.shape[1])
        if size:  # min/max in the table's dtype: exact in float64
            ends = tf.cast(tf.stack([tf.reduce_min(local),
                                     -tf.reduce_max(local)]), tf.float64)
        else:  # an empty shard (a localized table on another rank)
            ends = tf.constant([np.inf, np.inf], tf.float64)
        ends = comm.all_reduce(ends, key=f"{key}/minmax", op="min").numpy()
        lo, hi = float(ends[0]), -float(ends[1])
        rows, dim = table.global_shape
        total = int(rows) * int(dim)
        if total == 0 or lo == hi:
            return buckets_from(lo, hi, None, total, bucket_count)
        counts = tf.zeros([bucket_count], tf.float64)
        step = max(1, _CHUNK_ELEMENTS // max(1, int(dim)))
        for first in range(0, int(local.shape[0]), step):
            counts += bucket_counts(
                slice_rows(local, first,
                           min(first + step, int(local.shape[0]))),
                lo, hi, bucket_count)
        counts = comm.all_reduce(counts, key=f"{key}/counts", op="sum")
    return buckets_from(lo, hi, counts, total, bucket_count)


def write_histogram(name, buckets, step):
    """Writes precomputed histogram `buckets` as `tf.summary.histogram`
    would (same tag, plugin metadata) to the default writer."""
    import tensorflow as tf
    from tensorboard.plugins.histogram import metadata

    summary_metadata = metadata.create_summary_metadata(
        display_name=None, description=None)
    with tf.summary.experimental.summary_scope(
            name, "histogram_summary", values=[buckets, step]) as (tag, _):
        return tf.summary.write(tag=tag, tensor=buckets, step=step,
                                metadata=summary_metadata)


def _log_weights(self, epoch):
    """Keras' `TensorBoard._log_weights` with sok tables' histograms
    computed over the whole table (collectively: the callback must be
    given on every rank, which `check_in` makes a clear error)."""
    if any(_is_sharded(w) for w in self.model.weights):
        from sok_keras import global_views

        global_views.check_in(
            "keras.callbacks.TensorBoard(histogram_freq=...), whose "
            "histograms of sok tables are computed by every rank together "
            "(pass the callback on every rank; rank 0 alone writes)",
            key=f"tensorboard/histograms/{epoch}")
    with self._train_writer.as_default():
        for layer in self.model.layers:
            for weight in layer.weights:
                weight_name = weight.path.replace(":", "_")
                histogram_weight_name = f"{weight_name}/histogram"
                if _counted_in_chunks(weight):
                    buckets = global_histogram(
                        weight, key=f"tensorboard/{weight.path}")
                    write_histogram(histogram_weight_name, buckets, epoch)
                    continue
                self.summary.histogram(
                    histogram_weight_name, weight, step=epoch)
                if self.write_images:
                    image_weight_name = f"{weight_name}/image"
                    self._log_weight_as_image(
                        weight, image_weight_name, epoch)
        self._train_writer.flush()


def _writer(original, kind):
    """A `_train_writer` / `_val_writer` property that is a no-op writer
    where this rank does not write (`_writes_here`)."""

    @functools.wraps(original.fget)
    def get(self):
        if kind not in self._writers and not _writes_here(self):
            import tensorflow as tf

            self._writers[kind] = tf.summary.create_noop_writer()
        return original.fget(self)

    return property(get)


def _rank0_only(original):
    """`original`, a callback's method, run only where this rank writes
    the callback's files (`_writes_here`: rank 0)."""
    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        if not _writes_here(self):
            return None
        return original(self, *args, **kwargs)

    wrapped._sok_keras = True
    return wrapped


def install_histograms():
    """Makes `keras.callbacks.TensorBoard` count the histograms of sok
    tables in chunks (`_log_weights`) in a world of one too (idempotent;
    `import sok_keras` calls it). Their buckets are TensorFlow's."""
    if _HISTOGRAMS:
        return
    from keras.src.callbacks import tensorboard as keras_tb

    _log_weights._sok_keras = True
    keras_tb.TensorBoard._log_weights = _log_weights
    _HISTOGRAMS.append(True)


def install():
    """Makes `keras.callbacks.TensorBoard` write once, from rank 0, with
    global histograms of sok tables (idempotent; `sok_keras.init` calls it
    when there are several ranks)."""
    if _INSTALLED:
        return
    from keras.src.callbacks import tensorboard as keras_tb

    cls = keras_tb.TensorBoard
    cls._train_writer = _writer(cls._train_writer, "train")
    cls._val_writer = _writer(cls._val_writer, "val")
    cls._train_writer.fget._sok_keras = True
    cls._val_writer.fget._sok_keras = True
    install_histograms()
    cls._configure_embeddings = _rank0_only(cls._configure_embeddings)
    cls._start_profiler = _rank0_only(cls._start_profiler)
    _INSTALLED.append(True)


def install_csv_logger():
    """Makes `keras.callbacks.CSVLogger` write from rank 0 only (its logs
    are global): with one path for every rank, `append=True` wrote every
    row, and the header, once per rank (idempotent)."""
    import keras

    cls = keras.callbacks.CSVLogger
    for hook in ("on_train_begin", "on_epoch_end", "on_train_end"):
        method = getattr(cls, hook)
        if not getattr(method, "_sok_keras", False):
            setattr(cls, hook, _rank0_only(method))
