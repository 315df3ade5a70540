"""Input helpers for multi-rank training."""

import functools
import inspect
import json

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


# Stateful random ops: with neither an op seed nor a global one when the
# function was traced (seed == seed2 == 0), each process draws its own.
_RANDOM_OPS = frozenset((
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "RandomShuffle",
    "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial"))
# Dataset ops made inside a function (`interleave`, `flat_map`), by the
# positions of their seed inputs.
_SEEDED_DATASET_OPS = {"ShuffleDataset": (2, 3), "ShuffleDatasetV3": (2, 3),
                       "ShuffleAndRepeatDataset": (2, 3),
                       "ShuffleAndRepeatDatasetV2": (2, 3),
                       "RandomDataset": (0, 1), "RandomDatasetV2": (0, 1),
                       "ExperimentalRandomDataset": (0, 1)}
_WHAT = {"_ShuffleDataset": "a `shuffle` with no seed",
         "_RandomDataset": "`Dataset.random()` (or `sample_from_datasets` / "
                           "`choose_from_datasets`' random choice) with no "
                           "seed"}


# Datasets whose function makes each element's values only.
_VALUE_MAPS = frozenset(("_MapDataset", "_ParallelMapDataset"))


def _record_interleave_determinism():
    """`interleave(..., num_parallel_calls=k, deterministic=False)` keeps
    its `deterministic` only in its op (`map` and `batch` keep it as
    `_deterministic`): kept on the dataset too, for `_nondeterminism`
    (idempotent)."""
    from tensorflow.python.data.ops import interleave_op

    cls = getattr(interleave_op, "_ParallelInterleaveDataset", None)
    if cls is None or getattr(cls.__init__, "_sok_keras", False):
        return
    original = cls.__init__
    params = list(inspect.signature(original).parameters)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = dict(zip(params[1:], args), **kwargs)
        self._sok_deterministic = bound.get("deterministic")
        original(self, *args, **kwargs)

    __init__._sok_keras = True
    cls.__init__ = __init__


_record_interleave_determinism()


def _unseeded(seeds):
    """Whether tf.data's `(seed, seed2)` mean "a random seed": (0, 0) or
    None (a seeded op never gets both)."""
    return all(_static(v) in (None, 0) for v in seeds)


def _const(nodes, name):
    """The value of the Const node `name` ("node:output:0" or "node:0")
    among `nodes`, or None."""
    node = nodes.get(name.lstrip("^").split(":")[0])
    if node is None or node.op != "Const":
        return None
    return tf.make_ndarray(node.attr["value"].tensor)


def _function_nondeterminism(wrapper, values_only):
    """What in a dataset function's graph (and the functions it calls)
    differs between processes: an unseeded random op (unless the function
    only makes values, a `map`'s: its rows stay the same, augmented
    otherwise on each rank, as one process's are), a dataset made inside
    it with no seed, a `deterministic=False` one; or None."""
    try:
        graph_def = wrapper.function.graph.as_graph_def()
    except Exception:  # noqa: BLE001 - not a traced function we can read
        return None
    bodies = [list(graph_def.node)] + [
        list(f.node_def) for f in graph_def.library.function]
    for nodes in bodies:
        by_name = {n.name: n for n in nodes}
        for n in nodes:
            if not values_only and n.op in _RANDOM_OPS and (
                    n.attr["seed"].i == 0 and n.attr["seed2"].i == 0):
                return (f"a random op ({n.op}) with no seed in a dataset "
                        "function that decides which elements come "
                        "(`filter`, `interleave`, `flat_map`...)")
            where = _SEEDED_DATASET_OPS.get(n.op)
            # (Seeds computed in the function, not constants: seeded.)
            if where and len(n.input) > max(where) and all(
                    _const(by_name, n.input[i]) == 0 for i in where):
                return (f"a dataset with no seed ({n.op}) made inside a "
                        "dataset function (`interleave`, `flat_map`...)")
            if n.attr["deterministic"].s == b"false" or n.attr["sloppy"].b:
                return (f"`deterministic=False` ({n.op}) inside a dataset "
                        "function")
    return None


def _stages(dataset):
    """Yields each dataset of `dataset`'s pipeline once, from the last
    stage back (a fixed order: the same pipeline gives the same order)."""
    seen, todo = set(), [dataset]
    while todo:
        ds = todo.pop()
        if id(ds) in seen or not isinstance(ds, tf.data.Dataset):
            continue
        seen.add(id(ds))
        yield ds
        try:
            todo.extend(ds._inputs())
        except Exception:  # noqa: BLE001 - a dataset kind without inputs
            pass


def _nondeterminism(dataset):
    """What in `dataset`'s pipeline makes each process read other batches
    (an unseeded `shuffle`, `Dataset.random()` or random op, a
    `deterministic=False` stage or option), as a phrase; or None.
    (Seeds count when given to the op or set globally when it was made.)"""
    if dataset.options().deterministic is False:
        return "`tf.data.Options().deterministic = False`"
    for ds in _stages(dataset):
        kind = type(ds).__name__
        if kind in _WHAT and _unseeded(
                (getattr(ds, "_seed", None), getattr(ds, "_seed2", None))):
            return _WHAT[kind]
        if getattr(ds, "_deterministic", getattr(
                ds, "_sok_deterministic", None)) in ("false", False):
            return f"`deterministic=False` (in {kind.strip('_')})"
        try:
            functions = ds._functions()
        except Exception:  # noqa: BLE001 - a dataset kind without them
            functions = []
        for wrapper in functions:
            found = _function_nondeterminism(
                wrapper, values_only=kind in _VALUE_MAPS)
            if found:
                return found
    return None


# Sources whose elements are single samples: the rows of the tensors
# given to `from_tensor_slices`, and what `unbatch` gives.
_SAMPLE_SOURCES = ("_TensorSliceDataset", "_SparseTensorSliceDataset",
                   "_UnbatchDataset")


def _flat_shapes(spec):
    """The components' shapes as tuples, or None if one has no known rank."""
    shapes = [getattr(s, "shape", tf.TensorShape([]))
              for s in tf.nest.flatten(spec)]
    if any(s.rank is None for s in shapes):
        return None
    return [tuple(s) for s in shapes]


def _yields_samples(dataset):
    """Whether `dataset`'s elements are certainly single samples, not
    batches: the rows of `from_tensor_slices` (or of an `unbatch`) reach
    the output through stages that keep each element's shapes (`map`s that
    only rename or cast, `shuffle`, `repeat`, `prefetch`, ...), with no
    batching stage (which changes the shapes) between. Other sources
    (generators, files, `from_tensors`) may yield whole batches: False."""
    kind = type(dataset).__name__
    if kind in _SAMPLE_SOURCES:
        return True
    try:
        inputs = list(dataset._inputs())
    except Exception:  # noqa: BLE001 - a dataset kind without inputs
        return False
    if kind == "_ZipDataset":
        return any(_yields_samples(d) for d in inputs)
    if len(inputs) != 1:
        return False
    shapes = _flat_shapes(dataset.element_spec)
    if shapes is None or shapes != _flat_shapes(inputs[0].element_spec):
        return False
    return _yields_samples(inputs[0])


def _static(value):
    try:
        return None if value is None else tf.get_static_value(value)
    except Exception:  # noqa: BLE001 - not a tensor we can read
        return None


def _check_seeded(dataset, n):
    found = _nondeterminism(dataset)
    if found:
        raise ValueError(
            f"shard_batches: the dataset's pipeline has {found}, so each "
            f"of the {n} ranks would read other global batches and keep "
            "its slice of another batch than its peers: some rows trained "
            "twice per epoch, others never (and the ranks may run "
            "different numbers of steps). Pass the same seed on every "
            "rank (`shuffle(buffer_size, seed=42)`, `seed=` of the random "
            "op, `sample_from_datasets(..., seed=42)`), or call "
            "`keras.utils.set_random_seed(42)` on every rank before making "
            "the dataset; keep every stage deterministic.")


def _seeds(dataset):
    """The `(seed, seed2)` of the pipeline's `shuffle` and
    `Dataset.random()` stages, in a fixed order (None where not static)."""
    found = []
    for ds in _stages(dataset):
        if type(ds).__name__ in _WHAT:
            values = [_static(getattr(ds, a, None)) for a in ("_seed", "_seed2")]
            found.append(tuple(None if v is None else int(v) for v in values))
    return found


def shard_seeds(dataset):
    """The seeds of the random stages before `shard_batches` in the
    pipeline of `dataset` (a `tf.data.Dataset` made from one that
    `shard_batches` returned), as JSON text; None where there is none (or
    `dataset` is no `tf.data.Dataset`).
    `model.fit` compares them across the ranks
    (`consistency.check_fit_batches`)."""
    for ds in _stages(dataset):
        found = getattr(ds, "_sok_shard_seeds", None)
        if found is not None:
            return found
    return None


def seeds_differ_message(model_name, seeds_by_rank):
    """The error of `fit` when the ranks' `shard_seeds` differ (QA: with
    `keras.utils.set_random_seed(42)` on every rank, a rank that made one
    more random op before the dataset shuffled another way; each rank then
    sliced other global batches, some samples twice, others never)."""
    each = "; ".join(f"rank {r}: {s}" for r, s in seeds_by_rank.items())
    firsts = {tuple(p[0] for p in json.loads(s)) for s in
              seeds_by_rank.values()}
    if len(firsts) > 1:
        why = ("the first seed of each pair is the global seed, and it "
               "differs: set the same one on every rank "
               "(`keras.utils.set_random_seed(42)`) before making the "
               "dataset")
    else:
        why = ("a stage given no seed of its own takes its second seed from "
               "the number of random ops made before it, which differs "
               "where the ranks ran different code first: pass the seed to "
               "the stage itself (`shuffle(buffer_size, seed=42)`), or make "
               "the dataset before any rank-dependent random work")
    return (f"sok_keras: the ranks differ at the start of fit of model "
            f"'{model_name}': the seeds (seed, seed2) of the random stages "
            f"before `sok.shard_batches` are {each}, so each rank reads other "
            "global batches and keeps its slice of another batch than its "
            f"peers: some rows trained twice per epoch, others never. Here {why}.")


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
            against the dataset's batch dimension. Needed only for a
            dataset whose elements are batches that `from_tensor_slices`
            made (rows of a `[steps, batch, ...]` array), which is
            otherwise refused as a dataset of single samples.

    Returns:
        A `tf.data.Dataset` of per-rank batches of `global_batch_size //
        num_ranks` rows, with the same structure.

    Raises:
        ValueError: if the elements are single samples (the rows of
            `from_tensor_slices` or an `unbatch`, with no batching stage
            after them) and `global_batch_size` is not given; if no
            component's batch dimension is static (batch
            with `drop_remainder=True`; a component made after batching,
            whose size is unknown, is sliced as the others, its rows
            checked at each batch), if it differs between components or
            from `global_batch_size`, or is not divisible by the number of
            ranks; on several ranks, if the pipeline reads differently in
            each process: a `shuffle`, `Dataset.random()`,
            `sample_from_datasets`, or a random op in a `filter`,
            `interleave` or `flat_map` function, with no seed (neither its
            own nor a global one when it was made), or a
            `deterministic=False` stage or option (a `map`'s random op
            changes values only and is allowed). The seeds of those
            stages are compared across the ranks at the start of
            `model.fit` of the dataset, which raises if they differ.

    Example:

    ```python
    import sok_keras as sok
    ds = tf.data.Dataset.from_tensor_slices(({"ids": ids}, labels))
    ds = ds.shuffle(10_000, seed=42).batch(4096, drop_remainder=True)
    ds = sok.data.shard_batches(ds)  # 4096 / N rows per rank
    model.fit(ds, epochs=3)
    ```
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"shard_batches expects a tf.data.Dataset, got {type(dataset)!r}"
        )
    spec = dataset.element_spec
    flat = tf.nest.flatten(spec)
    paths = [f"#{i}" for i in range(len(flat))] if len(flat) > 1 else [""]
    per = [_batch_dim(s, p) for s, p in zip(flat, paths)]
    dims = set(per) - {None}
    if global_batch_size is None and _yields_samples(dataset):
        rows = dims.pop() if len(dims) == 1 else "<rows of a batch>"
        raise ValueError(
            "shard_batches: the dataset yields single samples, not batches: "
            "its elements are the rows of `from_tensor_slices` (or of an "
            "`unbatch`) with no batching stage after them (element_spec "
            f"{spec}), so each rank would keep part of every sample. Batch "
            "it first: `.batch(global_batch_size, drop_remainder=True)`. "
            "If each element already is a global batch (sliced from a "
            "[steps, batch, ...] array), say so: "
            f"`shard_batches(dataset, global_batch_size={rows})`.")
    if not dims:
        raise ValueError(
            "shard_batches needs a static batch dimension, but the batch "
            f"size of the dataset's batches is unknown (element_spec "
            f"{spec}). Batch the dataset with "
            "`.batch(global_batch_size, drop_remainder=True)`; a pipeline "
            "that batches for you (`make_csv_dataset`, `from_generator` "
            "with a None batch dimension, `bucket_by_sequence_length`) can "
            "be batched again: `.unbatch().batch(global_batch_size, "
            "drop_remainder=True)`.")
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
    seeds = json.dumps(_seeds(dataset))
    b = size // n
    start = _world.rank() * b
    is_tuple = type(spec) is tuple  # tf.data unpacks plain tuples only

    # A component made after batching (`tf.strings.split` in a `.map`,
    # say) may have lost its static size: it must have the batch's rows,
    # which is checked as each batch is sliced.
    def rows_checked(t, path):
        rows = (t.nrows() if isinstance(t, tf.RaggedTensor) else
                tf.shape(t, out_type=tf.int64)[0])
        # (A stateful op: the dataset function runs it before the slice.)
        tf.debugging.assert_equal(
            tf.cast(rows, tf.int64), tf.constant(size, tf.int64), message=(
                f"shard_batches: component {path or 'element'} of a batch "
                f"does not have {size} rows, as the other components of the "
                "batch"))
        return t

    def keep(*args):
        element = args if is_tuple else args[0]
        flat = [_slice(rows_checked(t, p) if d is None else t, start, b)
                for t, p, d in zip(tf.nest.flatten(element), paths, per)]
        out = tf.nest.pack_sequence_as(element, flat)
        return tuple(out) if is_tuple else out

    out = dataset.map(keep, num_parallel_calls=tf.data.AUTOTUNE,
                      deterministic=True)
    out._sok_shard_seeds = seeds  # (compared by `fit`: `shard_seeds`)
    return out
