"""Input helpers for multi-rank training."""

import tensorflow as tf

from sok_keras import world as _world


def _batch_dim(spec, path):
    if isinstance(spec, tf.SparseTensorSpec):
        shape = spec.shape
    elif isinstance(spec, (tf.TensorSpec, tf.RaggedTensorSpec)):
        shape = spec.shape
    else:
        raise TypeError(
            f"shard_batches: unsupported dataset component {path or 'element'}"
            f": {spec!r} (tensors, ragged and sparse tensors are supported)."
        )
    if shape.rank is None or shape.rank == 0:
        raise ValueError(
            f"shard_batches: component {path or 'element'} has no batch "
            f"dimension (shape {shape}); the dataset must yield batches."
        )
    return shape[0]


def _slice(t, start, size):
    if isinstance(t, tf.SparseTensor):
        shape = tf.shape(t, out_type=tf.int64)
        begin = tf.concat([[start], tf.zeros_like(shape[1:])], 0)
        return tf.sparse.slice(
            t, begin, tf.concat([[size], shape[1:]], 0)
        )
    return t[start : start + size]


def _has_unseeded_shuffle(dataset):
    """Whether a `shuffle` in `dataset`'s pipeline has no seed (neither
    its own nor TensorFlow's global one when it was made): each process
    shuffles it with its own random seed."""
    seen, todo = set(), [dataset]
    while todo:
        ds = todo.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        # tf.data gives an unseeded shuffle the seeds (0, 0), which mean
        # "a random seed" (a seeded one never gets both).
        if type(ds).__name__ == "_ShuffleDataset" and all(
                _static(getattr(ds, attr, None)) == 0
                for attr in ("_seed", "_seed2")):
            return True
        try:
            todo.extend(ds._inputs())
        except Exception:  # noqa: BLE001 - a dataset kind without inputs
            pass
    return False


def _static(value):
    try:
        return None if value is None else tf.get_static_value(value)
    except Exception:  # noqa: BLE001 - not a tensor we can read
        return None


def _check_seeded(dataset, n):
    if _has_unseeded_shuffle(dataset):
        raise ValueError(
            "shard_batches: the dataset shuffles with no seed "
            "(`shuffle(...)` without `seed=`, and no global seed when it "
            f"was made), so each of the {n} ranks would shuffle "
            "differently and keep its slice of another global batch: some "
            "rows trained twice per epoch, others never. Pass the same "
            "seed on every rank, `shuffle(buffer_size, seed=42)`, or call "
            "`keras.utils.set_random_seed(42)` on every rank before making "
            "the dataset.")


def shard_batches(dataset, global_batch_size=None):
    """Keeps this rank's slice of every global batch of `dataset`.

    Every rank reads the same dataset of global batches (same files, same
    shuffle seed) and keeps the contiguous rows
    `[rank * b, (rank + 1) * b)` of each batch, with
    `b = global_batch_size // num_ranks`. All ranks therefore run the same
    number of steps, which multi-rank training requires (a rank with one
    step more would wait forever for its peers). In a world of one the
    dataset is returned unchanged (after the same checks).

    Args:
        dataset: a `tf.data.Dataset` whose elements are batches (a tensor or
            any nest of tensors, ragged or sparse tensors: dicts, tuples),
            batched with `drop_remainder=True` so that the batch dimension
            is static and the same for every component.
        global_batch_size: optional; the expected global batch size, checked
            against the dataset's batch dimension.

    Returns:
        A `tf.data.Dataset` of per-rank batches of `global_batch_size //
        num_ranks` rows, with the same structure.

    Raises:
        ValueError: if the batch dimension is not static (batch with
            `drop_remainder=True`), differs between components or from
            `global_batch_size`, or is not divisible by the number of ranks;
            on several ranks, if the pipeline has a `shuffle` with no seed
            (each rank would shuffle differently).

    Example:

    >>> import sok_keras as sok
    >>> ds = tf.data.Dataset.from_tensor_slices(({"ids": ids}, labels))
    >>> ds = ds.shuffle(10_000, seed=42).batch(4096, drop_remainder=True)
    >>> ds = sok.data.shard_batches(ds)  # 4096 / N rows per rank
    >>> model.fit(ds, epochs=3)
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"shard_batches expects a tf.data.Dataset, got {type(dataset)!r}"
        )
    spec = dataset.element_spec
    flat = tf.nest.flatten(spec)
    paths = [f"#{i}" for i in range(len(flat))] if len(flat) > 1 else [""]
    per = [_batch_dim(s, p) for s, p in zip(flat, paths)]
    dims = set(per)
    if None in dims:
        unknown = [p or "element" for p, d in zip(paths, per) if d is None]
        known = sorted(d for d in dims if d is not None)
        raise ValueError(
            "shard_batches needs a static batch dimension, but the batch "
            f"size of component(s) {unknown} is unknown (element_spec "
            f"{spec}). Batch the dataset with "
            "`.batch(global_batch_size, drop_remainder=True)`"
            + (f" (the other components have {known[0]} rows)"
               if known else "")
            + "; a component made after batching, in `.map` (a "
            "`RaggedTensor.to_sparse()`, say), loses the static size: "
            "convert before batching, or give it back in the map "
            "(`t.set_shape([global_batch_size, ...])`)."
        )
    if len(dims) != 1:
        raise ValueError(
            "shard_batches: the components of each batch have different "
            f"batch sizes {sorted(dims)} (element_spec {spec})."
        )
    size = dims.pop()
    if global_batch_size is not None and (
            isinstance(global_batch_size, bool)
            or not isinstance(global_batch_size, int)):
        raise TypeError(
            "shard_batches: `global_batch_size` must be an int or None. "
            f"Received: global_batch_size={global_batch_size!r}.")
    if global_batch_size is not None and global_batch_size != size:
        raise ValueError(
            f"shard_batches: global_batch_size={global_batch_size} but the "
            f"dataset's batches have {size} rows."
        )
    n = _world.num_ranks()
    if size % n:
        raise ValueError(
            f"shard_batches: the global batch size {size} is not divisible "
            f"by the number of ranks {n}."
        )
    if n == 1:
        return dataset
    _check_seeded(dataset, n)
    b = size // n
    start = _world.rank() * b
    is_tuple = type(spec) is tuple  # tf.data unpacks plain tuples only

    def keep(*args):
        element = args if is_tuple else args[0]
        out = tf.nest.map_structure(lambda t: _slice(t, start, b), element)
        return tuple(out) if is_tuple else out

    return dataset.map(keep, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True)
