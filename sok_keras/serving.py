"""`sok.export_for_serving`: a SavedModel that serves with plain TensorFlow.

Keras' own `model.export(path)` traces the model's `call`, which for sok
layers runs sok_keras' compiled ops and, on several ranks, collectives: the
result would not load where sok_keras is not installed, nor run in one
process. `export_for_serving` instead

1. gathers every sok table whole on rank 0, streamed in bounded chunks
   (every rank calls it; the others send their rows);
2. on rank 0, clones the model with each sok layer replaced by a plain
   serving layer that holds the whole table as an ordinary variable and
   looks ids up with `tf.gather` and `tf.math.unsorted_segment_sum` (the
   same dense `-1`-padded, ragged or sparse ids, per-id weights and
   combiners as the sok layer; other layers are shared, not copied); a
   subclassed model, or one whose own layers hold sok layers, which
   cloning cannot rebuild, is traced instead with each sok layer's
   lookups redirected to its serving layer (`_export_traced`);
3. writes it with Keras' `ExportArchive` (`clone.export`) into a
   temporary folder beside `path`, renamed into place only when complete
   (an existing export is replaced only then); every rank returns once it
   is there, and an error on any rank raises on all.

The SavedModel's `serve` endpoint takes the model's inputs and returns its
outputs; `tf.saved_model.load(path).serve(inputs)` works in a Python
without sok_keras (`tests/test_serving.py`).
"""

import contextlib
import os
import shutil

import keras
import numpy as np
import tensorflow as tf

from sok_keras import _leftovers
from sok_keras import world
from sok_keras.layers.base_embedding import padding_mask


def _np_dtype(dtype):
    from sok_keras.variable import _np_dtype as np_dtype

    return np_dtype(dtype)


def _whole_table(table):
    """The whole table on rank 0 (None elsewhere); a collective."""
    from sok_keras.variable import SavedEntry
    from sok_keras.variable import stream_entry

    entry = SavedEntry(table)
    if entry.num_ranks == 1:
        return keras.ops.convert_to_numpy(table.value)
    out = (np.empty((entry.rows, entry.dim), _np_dtype(entry.dtype))
           if world.rank() == 0 else None)

    def sink(first, rows):
        out[first:first + len(rows)] = rows

    stream_entry(entry, sink, writer_only=True, key="export/stream")
    return out


def _plain_lookup(table, ids, weights, combiner, name):
    """A sok lookup of `ids` in the whole `table`, in plain TF ops."""
    from sok_keras.layers.base_embedding import flatten_deep_ids
    from sok_keras.lookup import normalize_ids
    from sok_keras.lookup import unpooled

    shape = None
    if combiner is None:  # ids of any rank, as the sok layer takes them
        ids, weights, shape = flatten_deep_ids(ids, weights, name)
    feat = normalize_ids(ids, weights, name)
    if combiner is None:
        out = unpooled(table, feat.values, feat)
        if shape is not None:
            out = tf.reshape(out, tf.concat([shape, tf.shape(table)[1:]], 0))
        return out
    compute = tf.float32 if table.dtype in (tf.float16, tf.bfloat16) else (
        table.dtype)
    rows = tf.cast(tf.gather(table, feat.values), compute)
    segs = tf.cast(feat.segment_ids, tf.int64)
    n = tf.cast(feat.batch_size, tf.int64)
    # Weights in the table's dtype first, as the sok layer takes them
    # (`lookup.pool`): a 16-bit table's are rounded to 16 bits.
    w = (tf.ones_like(rows[:, 0]) if feat.weights is None
         else tf.cast(tf.cast(feat.weights, table.dtype), compute))
    total = tf.math.unsorted_segment_sum(rows * w[:, None], segs, n)
    if combiner == "mean":
        den = tf.math.unsorted_segment_sum(w, segs, n)
    elif combiner == "sqrtn":
        den = tf.sqrt(tf.math.unsorted_segment_sum(w * w, segs, n))
    else:
        den = None
    if den is not None:
        total = tf.math.divide_no_nan(total, den[:, None])
    return tf.cast(total, table.dtype)


class ServingEmbedding(keras.layers.Layer):
    """What a sok embedding layer becomes in a serving export: the whole
    table as a plain variable, looked up with plain TF ops.

    Args:
        table: the whole table, `[rows, dim]` NumPy array.
        combiner: `"sum"`, `"mean"`, `"sqrtn"` or None (unpooled).
        fixed_shape: for `All2AllDenseEmbedding`: ids of any shape, every
            id valid, output `ids.shape + [dim]`.
        **kwargs: base layer arguments (`name`, `dtype`).
    """

    def __init__(self, table, combiner="sum", fixed_shape=False, **kwargs):
        super().__init__(**kwargs)
        self.autocast = False  # ids as the sok layer takes them
        self.combiner = combiner
        self.fixed_shape = fixed_shape
        # autocast=False: under a mixed policy Keras would round every row
        # to the compute dtype before the sum; the sok layer sums in the
        # table's dtype (float32 for 16-bit tables) and rounds once.
        self.table = self.add_weight(
            shape=table.shape, dtype=str(table.dtype), initializer="zeros",
            trainable=False, autocast=False, name="embeddings")
        self.table.assign(table)

    def compute_mask(self, inputs, mask=None):
        """As the sok layer's: `ids != -1` for unpooled dense ids."""
        if self.fixed_shape:
            return None
        return padding_mask(inputs, self.combiner)

    def call(self, inputs, weights=None):
        from sok_keras.layers.base_embedding import as_int_ids

        table = tf.convert_to_tensor(self.table)
        inputs = as_int_ids(inputs, self.table.shape[0], self.name,
                            local=True)
        if self.fixed_shape:
            ids = tf.convert_to_tensor(inputs)
            out = tf.gather(table, tf.cast(ids, tf.int64))
        else:
            out = _plain_lookup(table, inputs, weights, self.combiner,
                                self.name)
        return tf.cast(out, self.compute_dtype)


class ServingEmbeddingCollection(keras.layers.Layer):
    """What an `EmbeddingCollection` becomes in a serving export.

    Args:
        tables: dict `{table_name: whole table (NumPy)}`.
        features: dict `{feature_name: {"table": ..., "combiner": ...}}`.
        **kwargs: base layer arguments.
    """

    def __init__(self, tables, features, structured_like=None, **kwargs):
        super().__init__(**kwargs)
        self.autocast = False  # ids as the sok layer takes them
        self.features = {f: dict(s) for f, s in features.items()}
        # keras-rs' form (a single FeatureConfig, a list, nested dicts):
        # the sok layer's own flattening of the inputs and nesting of the
        # outputs, kept as plain functions (not the layer, whose sharded
        # tables the export must not track).
        self._structure = None
        if structured_like is not None:
            from sok_keras.layers import feature_config

            skeleton = structured_like._keras_rs.skeleton
            self._structure = (
                structured_like._flat_keras_rs_inputs,
                lambda out: feature_config.map_structure(
                    lambda _, p: out[p], skeleton,
                    is_leaf=feature_config.is_path))
        self.tables = {}
        for t, value in tables.items():
            var = self.add_weight(  # autocast=False: as ServingEmbedding
                shape=value.shape, dtype=str(value.dtype),
                initializer="zeros", trainable=False, autocast=False,
                name=t)
            var.assign(value)
            self.tables[t] = var

    def compute_mask(self, inputs, mask=None):
        """As the sok layer's: `ids != -1` for each unpooled feature's
        dense ids; None when no feature is unpooled."""
        if self._structure is not None or not isinstance(
                inputs, dict) or all(spec["combiner"] is not None
                                     for spec in self.features.values()):
            return None  # (keras-rs' form: as the sok layer, no mask)
        return {f: padding_mask(inputs.get(f), spec["combiner"])
                for f, spec in self.features.items()}

    def call(self, inputs, weights=None):
        if self._structure is not None:
            flatten, nest = self._structure
            inputs, weights = flatten(inputs, weights)
            return nest(self._lookups(inputs, weights))
        return self._lookups(inputs, weights)

    def _lookups(self, inputs, weights):
        from sok_keras.layers.base_embedding import as_int_ids

        weights = weights or {}
        out = {}
        for f, spec in self.features.items():
            table = tf.convert_to_tensor(self.tables[spec["table"]])
            ids = as_int_ids(inputs[f], self.tables[spec["table"]].shape[0],
                             f"{self.name}/{f}", local=True)
            value = _plain_lookup(table, ids, weights.get(f),
                                  spec["combiner"], f"{self.name}/{f}")
            out[f] = tf.cast(value, self.compute_dtype)
        return out


def _is_sok_layer(layer):
    from sok_keras.layers import EmbeddingCollection
    from sok_keras.layers.base_embedding import BaseEmbedding

    return isinstance(layer, (BaseEmbedding, EmbeddingCollection))


def _sok_layers(model):
    # (Built ones: a layer never called has no table and is in no traced
    # function: QA, a subclassed model's unused layer failed the export.)
    return [layer for layer in model._flatten_layers(include_self=False)
            if _is_sok_layer(layer) and layer.built]


def _serving_layer(layer, tables):
    from sok_keras.layers import All2AllDenseEmbedding
    from sok_keras.layers import EmbeddingCollection

    kw = {"name": layer.name, "dtype": layer.dtype_policy}
    if isinstance(layer, EmbeddingCollection):
        return ServingEmbeddingCollection(
            {t: tables[id(v)] for t, v in layer.embeddings.items()},
            layer.features, structured_like=(
                layer if layer._keras_rs is not None else None), **kw)
    return ServingEmbedding(
        tables[id(layer.embeddings)], combiner=layer.combiner,
        fixed_shape=isinstance(layer, All2AllDenseEmbedding), **kw)


def _check_exportable(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "export_for_serving: `model` must be a keras.Model. "
            f"Received: {type(model).__name__}.")
    if not model.built:
        raise ValueError(
            f"export_for_serving: model '{model.name}' is not built.")
    from sok_keras.variable import is_sok_variable

    owned = {id(v) for layer in _sok_layers(model) for v in (
        layer.embeddings.values() if isinstance(layer.embeddings, dict)
        else [layer.embeddings])}
    loose = [v.path for v in model.variables
             if is_sok_variable(v) and id(v) not in owned]
    if loose:
        raise ValueError(
            f"export_for_serving: model '{model.name}' looks up the sharded "
            f"table(s) {loose} outside sok layers (a custom layer's own "
            "sok_keras.Variable): only sok layers are swapped for serving "
            "lookups. Use a sok layer for the table.")
    from keras.src.models.functional import Functional

    # Cloning swaps the sok layers of functional and Sequential models
    # (at any depth of such models); a subclassed model, or a layer of
    # its own holding sok layers, is traced with its sok layers' lookups
    # redirected instead (`_export_traced`).
    return isinstance(model, (Functional, keras.Sequential)) and not (
        _held_sok_layers(model))


def _held_sok_layers(model):
    """`[(layer, [sok layers])]`: the layers other than functional and
    Sequential models in `model` (at any depth of such models) that hold
    sok layers themselves (a custom layer, a subclassed sub-model)."""
    from keras.src.models.functional import Functional

    out = []
    for layer in model.layers:
        if _is_sok_layer(layer):
            continue
        if isinstance(layer, (Functional, keras.Sequential)):
            out += _held_sok_layers(layer)
            continue
        inner = [x for x in layer._flatten_layers(include_self=False)
                 if _is_sok_layer(x)]
        if inner:
            out.append((layer, inner))
    return out


def _replace_dir(tmp, path):
    """Moves folder `tmp` to `path`, replacing an existing `path` only once
    `tmp` is complete."""
    old = None
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except Exception:
        if old is not None:
            os.replace(old, path)
        raise
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)


def _target_problem(path):
    """Why rank 0 must not replace `path` (None if it may): only a new
    path, an empty folder or an earlier SavedModel is replaced."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path):
        return (f"'{path}' is a symbolic link (to '{os.readlink(path)}'); "
                "export_for_serving replaces a folder, not a link, nor "
                "what it points to. Export to a new folder (e.g. "
                "'<models>/<name>/2') and point the link there.")
    if not os.path.isdir(path):
        return (f"'{path}' exists and is not a folder; export_for_serving "
                "writes a SavedModel folder there, replacing only an "
                "earlier export. Give a new path (e.g. '<models>/<name>/1').")
    names = os.listdir(path)
    if names and "saved_model.pb" not in names:
        shown = sorted(names)[:5]
        return (f"'{path}' is a folder that holds other files ({shown}"
                f"{', ...' if len(names) > 5 else ''}) and no SavedModel; "
                "export_for_serving replaces only an earlier export or an "
                "empty folder. Give a new path (e.g. '<models>/<name>/1').")
    return None


def _check_target(path, n, rank):
    """Refuses, on every rank, a `path` that rank 0 must not replace."""
    problem = _target_problem(path) if rank == 0 else None
    bad = int(problem is not None)
    if n > 1:
        bad = world.control_communicator().agree(
            "export/target", bad, world.timeout())
    if problem is not None:
        raise FileExistsError(f"sok_keras.export_for_serving: {problem}")
    if bad:
        raise FileExistsError(
            f"sok_keras.export_for_serving: rank 0 refused '{path}' (its "
            "error says why); nothing was written.")


def export_for_serving(model, path, verbose=False, input_signature=None,
                       **kwargs):
    """Writes a TF SavedModel of `model` that serves with plain TF ops.

    Every rank must call it (the tables are gathered onto rank 0, in
    bounded chunks); rank 0 writes `path` atomically (a temporary folder
    beside it, renamed into place). The result runs in one process and
    loads with `tf.saved_model.load` where sok_keras is not installed: its
    `serve` endpoint takes the model's inputs and returns its outputs.
    Rank 0 holds every table whole while it exports (about twice the
    tables' size).

    Args:
        model: a built `keras.Model` (functional, Sequential, or
            subclassed and called once) with sok layers
            (`DistributedEmbedding`, `LocalizedEmbedding`,
            `All2AllDenseEmbedding`, `EmbeddingCollection`), anywhere in
            it.
        path: the SavedModel folder (a local path): a new path, an empty
            folder, or an earlier export, which is replaced once the new
            one is complete.
        verbose: passed to Keras' export.
        input_signature: passed to Keras' export (`model.export`): the
            serving endpoint's input specs; by default the model's inputs.
        **kwargs: other arguments of Keras' `model.export` for
            `format="tf_saved_model"`, passed to it.

    Raises:
        ValueError: for an unbuilt model (or a subclassed one never
            called, without `input_signature`), or a table looked up
            outside sok layers.
        sok_keras.RankMismatchError: if not every rank calls it within
            `SOK_SAVE_TIMEOUT` seconds.
        FileExistsError: if `path` is a file, or a folder holding other
            files than an earlier export (nothing is written or removed).
        RuntimeError: if another rank failed (its error is in its output);
            the rank that failed raises its own error. `path` is unchanged.

    Example:

    ```python
    sok.export_for_serving(model, "/models/ranker/1")
    served = tf.saved_model.load("/models/ranker/1")  # no sok_keras
    scores = served.serve(ids)
    ```
    """
    from sok_keras._terminate import on_sigterm_clean_up

    # A SIGTERM mid-export removes rank 0's temporary folder (a copy of
    # every table) before the process dies of it.
    with on_sigterm_clean_up():
        return _export(model, path, verbose, input_signature, **kwargs)


def _export(model, path, verbose, input_signature, **kwargs):
    clone = _check_exportable(model)
    n, rank = world.num_ranks(), world.rank()
    from sok_keras.checkpoint import checked_path

    path = checked_path(path, "sok_keras.export_for_serving")
    from sok_keras import global_views

    # A call on some ranks only (`if sok.rank() == 0: model.export(...)`)
    # fails within SOK_SAVE_TIMEOUT, naming it (before: the gather of the
    # tables waited for SOK_COMM_TIMEOUT, then TensorFlow's timeout).
    global_views.check_in(f"sok.export_for_serving('{path}') (or "
                          "model.export)", key="export_for_serving")
    _check_target(path, n, rank)
    layers = _sok_layers(model)
    error = None
    tmp = claim = None
    try:
        tables = {}
        for layer in layers:
            variables = (list(layer.embeddings.values())
                         if isinstance(layer.embeddings, dict)
                         else [layer.embeddings])
            for v in variables:
                tables[id(v)] = _whole_table(v)
        if rank == 0:
            folder = os.path.dirname(os.path.abspath(path))
            # Removes what killed exports, saves and loads left here.
            claim = _leftovers.Claim(folder)
            tmp = os.path.join(folder, f".{os.path.basename(path)}."
                               f"{_leftovers.MARK}{claim.token}")
            write = _export_cloned if clone else _export_traced
            write(model, layers, tables, tmp, verbose=verbose,
                  input_signature=input_signature, **kwargs)
            del tables
    except Exception as e:  # reported to every rank below
        error = e
    control = world.control_communicator()
    failed = control.agree("export/done", int(error is not None),
                           world.timeout()) if n > 1 else int(
        error is not None)
    try:
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(
                f"sok_keras: export_for_serving('{path}') failed on "
                f"{failed} other rank(s) of the {n}; the error is in their "
                "output. Nothing was written.")
        if rank == 0:
            _replace_dir(tmp, path)
        if n > 1:
            control.agree("export/renamed", 1, world.timeout())
    finally:
        if rank == 0 and tmp is not None and os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if claim is not None:
            claim.release()


def _export_cloned(model, layers, tables, tmp, **kwargs):
    """Writes the export of a functional or Sequential `model`: a clone
    with its sok `layers` swapped for serving layers (`tables`: whole
    tables by variable id)."""
    replaced = {id(layer) for layer in layers}

    def clone_function(layer):
        if id(layer) in replaced:
            return _serving_layer(layer, tables)
        return layer  # shared, weights and all

    # Not compiled (nor any model nested in it, which cloning compiles
    # too): compiling would build the optimizer wrapper, whose build is a
    # collective (rank 0 is alone here).
    models = [m for m in model._flatten_layers(include_self=True)
              if isinstance(m, keras.Model)]
    compiled = [getattr(m, "compiled", False) for m in models]
    try:
        for m in models:
            m.compiled = False
        # (recursive: sok layers of nested functional models.)
        clone = keras.models.clone_model(
            model, clone_function=clone_function, recursive=True)
    except ValueError as e:
        raise ValueError(
            f"export_for_serving: model '{model.name}' could not be cloned "
            "with its sok layers swapped for plain-TF serving layers. "
            f"Keras says: {e}") from e
    finally:
        for m, c in zip(models, compiled):
            m.compiled = c
    clone.export(tmp, format="tf_saved_model", **kwargs)


class _Variables(keras.layers.Layer):
    """What a traced export tracks: the given variables (the serving
    tables and the model's other weights), not the model, whose sharded
    tables must stay out of the SavedModel."""

    def __init__(self, variables):
        super().__init__(name="sok_serving_variables")
        self._held = list(variables)
        self.built = True

    @property
    def variables(self):
        return list(self._held)

    @property
    def trainable_variables(self):
        return [v for v in self._held if v.trainable]

    @property
    def non_trainable_variables(self):
        return [v for v in self._held if not v.trainable]


@contextlib.contextmanager
def _serving_calls(twins):
    """While the block runs, each sok layer of `twins` (`[(layer, its
    serving layer)]`) looks ids up as its serving layer does (its `call`
    replaced on the instance; Keras' `__call__` around it, masks
    included, is the layer's own)."""
    saved = []
    for layer, twin in twins:
        saved.append((layer, layer.__dict__.get("call", _UNSET)))

        def call(inputs, weights=None, _twin=twin, **kwargs):
            del kwargs  # (`training`: lookups take none)
            return _twin.call(inputs, weights)

        object.__setattr__(layer, "call", call)
    try:
        yield
    finally:
        for layer, old in saved:
            if old is _UNSET:
                del layer.__dict__["call"]
            else:
                object.__setattr__(layer, "call", old)


_UNSET = object()


def _export_traced(model, layers, tables, tmp, verbose=None,
                   input_signature=None, **kwargs):
    """Writes the export of a subclassed `model`, or of one whose own
    layers hold sok layers, which cloning cannot swap: the model's own
    `__call__` traced (as Keras' export traces it) while its sok `layers`
    look ids up with serving layers, and a SavedModel that tracks those
    and the model's other variables (not its sharded tables)."""
    from keras.src.export.export_utils import get_input_signature

    from sok_keras.variable import is_sok_variable

    twins = [(layer, _serving_layer(layer, tables)) for layer in layers]
    archive = keras.export.ExportArchive()
    # The model itself is not tracked (its sharded tables would be saved):
    # the layers that hold no sharded table (with their resources, e.g. a
    # StringLookup's hash table), then the serving tables and the model's
    # weights that no such layer holds.
    tracked = set()
    for layer in model._flatten_layers(include_self=False):
        if layer.built and not any(is_sok_variable(v)
                                   for v in layer.variables):
            archive.track(layer)
            tracked.update(id(v) for v in layer.variables)
    held = [v for v in model.variables
            if not is_sok_variable(v) and id(v) not in tracked]
    for _, twin in twins:
        held += twin.variables
    archive.track(_Variables(held))
    if input_signature is None:
        input_signature = get_input_signature(model)
    with _serving_calls(twins):
        archive.add_endpoint("serve", model.__call__, input_signature,
                             **kwargs)
        _refuse_sharded_reads(model, archive)
        archive.write_out(tmp, verbose=True if verbose is None else verbose)


def _refuse_sharded_reads(model, archive):
    """Raises if the traced endpoint reads a sharded table other than
    through a sok layer's lookup (tied output weights reading
    `layer.embeddings`): it would save this rank's shard."""
    from sok_keras.variable import is_sok_variable

    shards = {}
    for v in model.variables:
        if is_sok_variable(v):
            shards[id(v)] = shards[id(getattr(v, "_value", v))] = v.path
    trainable, other = archive._get_variables_used_by_endpoints()
    read = sorted({shards[id(u)] for u in trainable + other
                   if id(u) in shards})
    if read:
        raise ValueError(
            f"export_for_serving: model '{model.name}' reads the sharded "
            f"table(s) {read} other than by looking ids up through its sok "
            "layers (e.g. tied output weights reading `layer.embeddings`): "
            "the export would hold one rank's rows. Only lookups are "
            "served from whole tables.")


def install():
    """`model.export(path)` of a model with sok tables writes
    `export_for_serving`'s SavedModel: Keras' own would hold sok's ops (it
    would not load without sok_keras) and, on several ranks, their
    collectives (its `serve` would wait for peers for ever)."""
    original = keras.Model.export
    if getattr(original, "_sok_keras", False):
        return

    import functools

    @functools.wraps(original)
    def export(self, filepath, format="tf_saved_model", verbose=None,
               input_signature=None, **kwargs):
        from sok_keras.optimizers.auto_wrap import has_sok_layers

        if not has_sok_layers(self):
            return original(self, filepath, format=format, verbose=verbose,
                            input_signature=input_signature, **kwargs)
        if format != "tf_saved_model":
            raise ValueError(
                f"sok_keras: model '{self.name}' holds sok embedding "
                "tables, which export only as a TF SavedModel of plain "
                "lookups (`format=\"tf_saved_model\"`, "
                f"`sok.export_for_serving`). Received: format={format!r}.")
        import logging

        logging.getLogger("sok_keras").info(
            "sok_keras: model.export of '%s' writes sok.export_for_serving's "
            "SavedModel (plain TF lookups of the whole tables: it serves in "
            "one process, without sok_keras).", self.name)
        return export_for_serving(self, filepath, verbose=bool(verbose),
                                  input_signature=input_signature, **kwargs)

    export._sok_keras = True
    keras.Model.export = export
