"""`EmbeddingCollection`: several tables, one exchange per direction."""

import collections.abc
import logging

import keras
import tensorflow as tf

from sok_keras import consistency
from sok_keras._keras_h5 import first_load_error
from sok_keras import lookup
from sok_keras.layers import feature_config
from sok_keras.layers.base_embedding import check_combiner
from sok_keras.layers.base_embedding import check_positive_int
from sok_keras.layers.base_embedding import check_pooled_rank
from sok_keras.layers.base_embedding import get_initializer
from sok_keras.layers.base_embedding import get_table_optimizer
from sok_keras.layers.base_embedding import serialize_table_optimizer
from sok_keras.layers.base_embedding import init_keras_layer
from sok_keras.layers.base_embedding import layer_name
from sok_keras.layers.base_embedding import load_table
from sok_keras.layers.base_embedding import padding_mask
from sok_keras.layers.base_embedding import ragged_spec
from sok_keras.layers.base_embedding import refuse_keras_only_arguments
from sok_keras.layers.base_embedding import save_table
from sok_keras.layers.base_embedding import as_int_ids
from sok_keras.layers.base_embedding import flatten_deep_ids
from sok_keras.variable import NOTHING_SAVED_HINT
from sok_keras.variable import Variable
from sok_keras.variable import check_mode_form
from sok_keras.variable import mode_for_world
from sok_keras.variable import parse_mode
from sok_keras._ops import not_converted as _not_converted

_LOG = logging.getLogger("sok_keras")

_TABLE_KEYS = ("vocabulary_size", "embedding_dim", "mode", "initializer",
               "optimizer")
_FEATURE_KEYS = ("table", "combiner")


def _checked_spec(layer_name, kind, key, spec, allowed):
    """``spec`` as a dict, after checking it names only ``allowed`` keys."""
    if not isinstance(spec, collections.abc.Mapping):
        example = ("{'table': 'my_table'}" if kind == "feature" else
                   "{'vocabulary_size': 1000, 'embedding_dim': 16}")
        raise TypeError(
            f"EmbeddingCollection '{layer_name}': {kind} '{key}' must be a "
            f"dict of {list(allowed)}, e.g. {example}. Received: "
            f"{spec!r}.")
    spec = dict(spec)
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(
            f"EmbeddingCollection '{layer_name}': {kind} '{key}' has unknown "
            f"keys {unknown}; allowed: {list(allowed)}.")
    return spec


def _check_saved_names(tables, where):
    """Refuses two table names whose entries in a saved file would clash:
    table `t`'s slots are saved as `table.<t>.slot.<slot>`, so a table
    named `<t>.slot.<x>` would overwrite (or be loaded as) a slot of `t`.
    (QA: `model.save` failed with h5py's bare "name already exists", after
    training.)"""
    names = sorted(str(t) for t in tables)
    for t in names:
        for u in names:
            if u.startswith(t + ".slot."):
                raise ValueError(
                    f"{where}: tables {t!r} and {u!r} cannot be saved "
                    f"together: the file keeps table {t!r}'s optimizer "
                    f"slots as 'table.{t}.slot.<slot>', and {u!r} would be "
                    f"taken for one of them. Rename table {u!r}.")


# Arguments of keras_rs' TensorFlow DistributedEmbedding that only mean
# something on a TPU.
_TPU_ONLY_KWARGS = ("optimizer", "pipeline_execution_with_tensor_core",
                    "sparse_core_embedding_config")
_PREPROCESSED = "preprocessed_inputs_per_placement"


class _KerasRsSpec:
    """The keras-rs form of a collection: the structure of its features
    (`feature_config.FeaturePath` leaves), each feature and each table,
    normalized. A plain object, so that Keras' attribute tracking leaves the
    structure's types alone."""

    def __init__(self, skeleton, features, tables):
        self.skeleton = skeleton
        self.features = features
        self.tables = tables


def _check_table_stacking(value, tables, where):
    """keras-rs' `table_stacking`: `"auto"`, None, or table names (a list,
    or a list of lists), the values its TPU path takes (off TPU keras-rs
    ignores it). Unused here, but a typo in ported code is refused rather
    than ignored."""
    if value is None or value == "auto" or (
            isinstance(value, (list, tuple)) and not value):
        return  # ([]: no stacking, as None)
    groups = value if isinstance(value, (list, tuple)) else None
    if groups and all(isinstance(g, str) for g in groups):
        groups = [groups]
    names = [] if groups is None else [
        n for g in groups if isinstance(g, (list, tuple)) for n in g]
    if (not groups or any(not isinstance(g, (list, tuple)) for g in groups)
            or any(not isinstance(n, str) for n in names)):
        raise ValueError(
            f"{where}: `table_stacking` must be 'auto', None, a list of "
            "table names or a list of lists of them. Received: "
            f"table_stacking={value!r}.")
    unknown = sorted(set(names) - set(tables))
    if unknown:
        raise ValueError(
            f"{where}: `table_stacking` names tables {unknown}, which are "
            f"not the layer's ({sorted(tables)}).")


@keras.saving.register_keras_serializable(package="sok_keras")
class EmbeddingCollection(keras.layers.Layer):
    """Several sharded tables shared by named features, looked up together.

    One call looks every feature up with one exchange per direction for all
    tables (`sok_keras.lookup_sparse`'s fused path), where one layer per
    table would make one exchange per table. Each table has its own size,
    width, sharding mode, initializer and (optionally) optimizer; several
    features may share a table.

    It takes its configuration in one of two forms:

    - sok's own: `EmbeddingCollection(tables, features)`, two flat dicts;
    - keras-rs': `EmbeddingCollection(feature_configs)`, the argument of
      `keras_rs.layers.DistributedEmbedding`: a nested structure (dicts,
      lists, tuples) of `keras_rs.layers.FeatureConfig` (each naming a
      `keras_rs.layers.TableConfig`), or of plain dicts with the same fields
      (keras-rs need not be installed). keras-rs' defaults apply: combiner
      `"mean"` per table, initializer `VarianceScaling(mode="fan_out")`
      (a copy per table), and each table trained by its own
      `TableConfig.optimizer` (default `"adam"`, applied lazily), as
      keras-rs documents. Inputs, weights and outputs have the structure of
      `feature_configs`. `placement` `"auto"`/`"default_device"` means a
      table sharded over every rank (`"localized:<rank>"` puts it on one
      rank); `"sparsecore"` is rejected (TPU only). See `docs/keras_rs.md`.

    Args:
        tables: sok's form: dict `{table_name: spec}`; a spec is a dict with
            `vocabulary_size` (int), `embedding_dim` (int), and optionally
            `mode` (`"distributed"`, default, or `"localized:<rank>"`),
            `initializer` (default `"uniform"`) and `optimizer` (a Keras
            optimizer for this table only, as on `DistributedEmbedding`).
            Passed alone (without `features`), it is read as
            `feature_configs`, so that `EmbeddingCollection(feature_configs)`
            reads like keras-rs.
        features: sok's form: dict `{feature_name: spec}`; a spec is a dict
            with `table` (a key of `tables`) and optionally `combiner`
            (`"sum"`, default, `"mean"`, `"sqrtn"`, or `None` for unpooled
            rows).
        feature_configs: keras-rs' form (see above). Defaults to `None`.
        use_table_optimizers: keras-rs' form only. `True` (default): each
            table is trained by its `TableConfig.optimizer` (the model's
            optimizer still clips and averages across ranks, and trains the
            rest of the model). `False`: `TableConfig.optimizer` is ignored
            and the model's optimizer trains the tables too, which is what
            keras-rs' own layer does on CPU and GPU.
        table_stacking: keras-rs' argument: `"auto"`, None, or table
            names (a list, or a list of lists), checked and unused (all
            tables already share one exchange per direction). Defaults to
            `"auto"`.
        update_stats: keras-rs' argument (JAX SparseCore only); must be
            `False` (default).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: sok's form: dict `{feature_name: ids}`, ids dense (`-1`
            padding), ragged or sparse, as for `DistributedEmbedding`.
            keras-rs' form: ids in the structure of `feature_configs` (or
            the output of `preprocess`).
        weights: optional per-id weights, in the structure of `inputs`.
        training: unused (keras-rs' signature).

    Returns:
        sok's form: a dict `{feature_name: embeddings}`. keras-rs' form: the
        embeddings in the structure of `feature_configs`.

    Example:

    >>> emb = sok.layers.EmbeddingCollection(
    ...     tables={"user": {"vocabulary_size": 10_000, "embedding_dim": 16},
    ...             "item": {"vocabulary_size": 50_000, "embedding_dim": 32,
    ...                      "mode": "localized:0"}},
    ...     features={"user_id": {"table": "user"},
    ...               "clicked": {"table": "item", "combiner": "mean"}})
    >>> out = emb({"user_id": np.array([[3]]),
    ...            "clicked": np.array([[5, 9, -1]])})

    The same layer written for keras-rs (only the class differs from
    `keras_rs.layers.DistributedEmbedding(feature_configs)`):

    >>> import keras_rs
    >>> item = keras_rs.layers.TableConfig(
    ...     name="item", vocabulary_size=50_000, embedding_dim=32,
    ...     optimizer=keras.optimizers.Adagrad(0.05))
    >>> feature_configs = {"clicked": keras_rs.layers.FeatureConfig(
    ...     name="clicked", table=item, input_shape=(256, 3),
    ...     output_shape=(256, 32))}
    >>> emb = sok.layers.EmbeddingCollection(feature_configs)
    >>> out = emb({"clicked": np.array([[5, 9, 2]])})  # {"clicked": [1, 32]}
    """

    def __init__(self, tables=None, features=None, *, feature_configs=None,
                 use_table_optimizers=True, table_stacking="auto",
                 update_stats=False, **kwargs):
        tpu_only = sorted(set(kwargs) & set(_TPU_ONLY_KWARGS))
        if tpu_only:
            raise ValueError(
                f"EmbeddingCollection: {tpu_only} are arguments of keras-rs' "
                "DistributedEmbedding for TPUs only. Give each table its "
                "optimizer in `TableConfig.optimizer`.")
        refuse_keras_only_arguments(
            layer_name("EmbeddingCollection", kwargs.get("name")), kwargs)
        init_keras_layer(super().__init__, "EmbeddingCollection", kwargs)
        # Ids are never cast to the compute dtype (`as_int_ids`), as
        # `keras.layers.Embedding` does not cast them.
        self.autocast = False
        name = self.name
        if feature_configs is None and features is None and (
                tables is not None):
            feature_configs, tables = tables, None  # keras-rs' positional
        self._keras_rs = None
        if feature_configs is not None:
            self._init_keras_rs(feature_configs, tables, features,
                                use_table_optimizers, table_stacking,
                                update_stats)
            self.supports_jit = False
            return
        if use_table_optimizers is not True or table_stacking != "auto" or (
                update_stats):
            raise ValueError(
                f"EmbeddingCollection '{name}': `use_table_optimizers`, "
                "`table_stacking` and `update_stats` belong to the keras-rs "
                "form (`feature_configs`). Received: use_table_optimizers="
                f"{use_table_optimizers!r}, table_stacking="
                f"{table_stacking!r}, update_stats={update_stats!r}.")
        if not isinstance(tables, dict) or not tables:
            raise ValueError(
                f"EmbeddingCollection '{name}': `tables` must be a non-empty "
                f"dict. Received: tables={tables!r}.")
        if not isinstance(features, dict) or not features:
            raise ValueError(
                f"EmbeddingCollection '{name}': `features` must be a "
                f"non-empty dict. Received: features={features!r}.")
        self.tables = {}
        self._table_optimizers = {}
        for t, spec in tables.items():
            spec = _checked_spec(name, "table", t, spec, _TABLE_KEYS)
            where = f"EmbeddingCollection '{name}', table '{t}'"
            mode = spec.get("mode", "distributed")
            check_mode_form(mode, t)  # the rank is checked at build
            self.tables[t] = {
                "vocabulary_size": check_positive_int(
                    spec.get("vocabulary_size"), "vocabulary_size", where),
                "embedding_dim": check_positive_int(
                    spec.get("embedding_dim"), "embedding_dim", where),
                "mode": mode,
                "initializer": keras.initializers.serialize(
                    get_initializer(spec.get("initializer", "uniform"),
                                    where)),
            }
            self._table_optimizers[t] = get_table_optimizer(
                spec.get("optimizer"), where)
        _check_saved_names(self.tables, f"EmbeddingCollection '{name}'")
        self.features = {}
        for f, spec in features.items():
            spec = _checked_spec(name, "feature", f, spec, _FEATURE_KEYS)
            if spec.get("table") not in self.tables:
                raise ValueError(
                    f"EmbeddingCollection '{name}': feature '{f}' refers to "
                    f"table {spec.get('table')!r}, which is not one of "
                    f"{sorted(self.tables)}.")
            self.features[f] = {
                "table": spec["table"],
                "combiner": check_combiner(
                    spec.get("combiner", "sum"),
                    f"EmbeddingCollection '{name}', feature '{f}'"),
            }
        self.supports_jit = False

    def _init_keras_rs(self, feature_configs, tables, features,
                       use_table_optimizers, table_stacking, update_stats):
        where = f"EmbeddingCollection '{self.name}'"
        if features is not None:
            raise ValueError(
                f"{where}: pass either `feature_configs` (keras-rs' form) or "
                "`tables` and `features` (sok's form), not both.")
        if not isinstance(use_table_optimizers, bool):
            raise ValueError(
                f"{where}: `use_table_optimizers` must be True or False. "
                f"Received: use_table_optimizers={use_table_optimizers!r}.")
        if update_stats is not False:
            raise ValueError(
                f"{where}: `update_stats` is keras-rs' option for JAX on "
                "SparseCore; it must be False here. Received: "
                f"update_stats={update_stats!r}.")
        skeleton, feats, tabs = feature_config.parse(
            feature_configs, where, tables_list=tables,
            check_optimizer=use_table_optimizers)
        self._keras_rs = _KerasRsSpec(skeleton, feats, tabs)
        _check_table_stacking(table_stacking, tabs, where)
        self.use_table_optimizers = use_table_optimizers
        self.table_stacking = table_stacking
        self.update_stats = update_stats
        self.tables = {}
        self._table_optimizers = {}
        for t, spec in tabs.items():
            self.tables[t] = {
                "vocabulary_size": spec["vocabulary_size"],
                "embedding_dim": spec["embedding_dim"],
                "mode": feature_config.mode_of(spec["placement"], where),
                "initializer": spec["initializer"],
            }
            self._table_optimizers[t] = get_table_optimizer(
                spec["optimizer"] if use_table_optimizers else None,
                f"{where}, table '{t}'")
        _check_saved_names(self.tables, where)
        self.features = {
            path: {"table": f["table"],
                   "combiner": tabs[f["table"]]["combiner"]}
            for path, f in feats.items()}
        # Tables left at keras-rs' default optimizer, "adam", which keras-rs'
        # own layer ignores on CPU and GPU (`build` says so once).
        self._default_adam_tables = sorted(
            t for t, spec in tabs.items()
            if use_table_optimizers and spec["optimizer"] == "adam")

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        # TensorFlow's object graph (`tf.train.Checkpoint`,
        # `CheckpointManager`) sees a layer's variables through its
        # attributes; Keras' dict of the tables is not one of its
        # trackables, so each table is added as a child of its own (before:
        # the tables were checkpointed only through the optimizer, and not
        # restored into a model whose optimizer was not built yet, or at
        # all when frozen).
        children = super()._trackable_children(save_type, **kwargs)
        if self.built:
            for t, var in self.embeddings.items():
                children.setdefault(f"table_{t}", var)
        return children

    def build(self, input_shape=None):
        if self.built:
            return
        from sok_keras import replicas

        self.embeddings = {}
        n = replicas.table_ranks()
        default_adam = getattr(self, "_default_adam_tables", None)
        if default_adam and not getattr(self, "_from_saved_config", False):
            _LOG.warning(
                "sok_keras: EmbeddingCollection '%s': tables %s train with "
                "their TableConfig.optimizer, keras-rs' default 'adam' "
                "(learning rate 0.001), as keras-rs does on TPU; keras-rs' "
                "own layer on CPU and GPU trains them with the model's "
                "optimizer: pass use_table_optimizers=False for that.",
                self.name, default_adam)
        for t, spec in self.tables.items():
            if getattr(self, "_from_saved_config", False):
                mode = mode_for_world(spec["mode"], n)
                if mode != spec["mode"]:
                    _LOG.warning(
                        "sok_keras: EmbeddingCollection '%s', table '%s' "
                        "was placed %r; this job has %d rank(s): %r.",
                        self.name, t, spec["mode"], n, mode)
                    spec["mode"] = mode
            parse_mode(spec["mode"], n, t)
            var = Variable(
                keras.initializers.deserialize(spec["initializer"]),
                shape=(spec["vocabulary_size"], spec["embedding_dim"]),
                mode=spec["mode"], dtype=self.variable_dtype, name=t)
            var.optimizer = self._table_optimizers[t]
            self.embeddings[t] = var
            if not self.trainable:  # as Keras' add_weight does
                var.trainable = False
        self.built = True

    @_not_converted
    def call(self, inputs, weights=None, training=None):
        del training
        inputs = as_int_ids(inputs, None)  # (Keras' shape inference)
        if self._keras_rs is None:
            where = f"EmbeddingCollection '{self.name}'"
            for what, value in (("inputs", inputs), ("weights", weights)):
                if value is not None and not isinstance(value, dict):
                    raise TypeError(
                        f"{where}: `{what}` must be a dict "
                        f"{{feature name: tensor}} over the features "
                        f"{feature_config.ordered(self.features)}. "
                        "Received: "
                        f"{type(value).__name__}.")
            missing = feature_config.ordered(
                set(self.features) - set(inputs))
            if missing:
                raise ValueError(
                    f"{where}: no ids for features {missing}. Received: "
                    f"{feature_config.ordered(inputs)}.")
            for what, value in (("inputs", inputs), ("weights", weights)):
                unknown = feature_config.ordered(
                    set(value or {}) - set(self.features))
                if unknown:
                    raise ValueError(
                        f"{where}: `{what}` has keys {unknown}, which are "
                        "not features of the layer "
                        f"({feature_config.ordered(self.features)}"
                        ").")
            return self._lookup(inputs, weights or {})
        flat_ids, flat_weights = self._flat_keras_rs_inputs(inputs, weights)
        return self._nested(self._lookup(flat_ids, flat_weights))

    def _lookup(self, inputs, weights):
        # In name order, not the dict's: ranks whose `features` dicts were
        # built in another order (from a set, say) look the same tables up
        # in the same order, so their exchanges meet. The outputs keep the
        # dict's order.
        names = feature_config.ordered(self.features)
        feats, shapes = [], {}
        for f in names:
            table = self.tables[self.features[f]["table"]]
            label = f"{self.name}/{self._feature_label(f)}"
            ids = as_int_ids(inputs[f], table["vocabulary_size"], label)
            w = weights.get(f)
            if self.features[f]["combiner"] is None:
                ids, w, shapes[f] = flatten_deep_ids(ids, w, label)
            feats.append(lookup.normalize_ids(ids, w, label))
        params = [self.embeddings[self.features[f]["table"]] for f in names]
        consistency.record_lookup(params, "embedding_collection")
        rows = lookup.gather_rows_fused(
            params, [x.values for x in feats],
            [self._table_label(f) for f in names],
            [x.problem for x in feats], [x.positions for x in feats])
        out = {}
        for f, feat, (r, inverse) in zip(names, feats, rows):
            combiner = self.features[f]["combiner"]
            if combiner is None:
                value = lookup.unpooled(r, inverse, feat)
                if shapes[f] is not None:  # ids of rank > 2
                    value = tf.reshape(value, tf.concat([shapes[f], [
                        self.tables[self.features[f]["table"]][
                            "embedding_dim"]]], 0))
            else:
                value = lookup.pool(r, inverse, feat, combiner)
            out[f] = tf.cast(value, self.compute_dtype)
        return {f: out[f] for f in self.features}

    def _table_label(self, f):
        """The table of feature `f` in messages, with the feature where
        their names differ (several features may share a table)."""
        t = self.features[f]["table"]
        label = self._feature_label(f)
        return f"{self.name}/{t}" + (
            f" (feature {label})" if label != t else "")

    def _feature_label(self, f):
        """The feature in messages: its key, or, for a lone keras-rs
        `FeatureConfig` (whose path is empty), its name."""
        if f or self._keras_rs is None:
            return f
        return self._keras_rs.features[f].get("name") or "<top>"

    # -- keras-rs' form ---------------------------------------------------
    def _where(self):
        return f"EmbeddingCollection '{self.name}'"

    def _flat_keras_rs_inputs(self, inputs, weights):
        """`({path: ids}, {path: weights})` of keras-rs-structured (or
        preprocessed) inputs, their shapes checked against the configs."""
        paths = self._keras_rs.features
        where = self._where()
        if isinstance(inputs, dict) and _PREPROCESSED in inputs:
            if weights is not None:
                raise ValueError(
                    f"{where}: preprocessed inputs carry their weights; "
                    "pass no `weights` with them.")
            per_placement = inputs[_PREPROCESSED]
            if not isinstance(per_placement, dict) or set(per_placement) - {
                    "default_device"}:
                raise ValueError(
                    f"{where}: preprocessed inputs must be the output of "
                    "`preprocess` (placement 'default_device'). Received: "
                    f"{_PREPROCESSED}={per_placement!r}.")
            part = per_placement.get("default_device", {})
            flat_ids = dict(part.get("inputs", {}))
            flat_weights = dict(part.get("weights") or {})
            missing = sorted(set(paths) - set(flat_ids))
            extra = sorted(set(flat_ids) - set(paths))
            if missing or extra:
                raise ValueError(
                    f"{where}: preprocessed inputs lack features {missing} "
                    f"and hold unknown ones {extra}.")
        else:
            flat_ids = feature_config.gather(inputs, paths, "`inputs`",
                                             where)
            flat_weights = {} if weights is None else feature_config.gather(
                weights, paths, "`weights`", where)
        for path, ids in flat_ids.items():
            self._check_input_shape(path, ids)
        return flat_ids, flat_weights

    def _check_input_shape(self, path, ids):
        want = self._keras_rs.features[path]["input_shape"]
        if want is None:
            return
        got = getattr(ids, "shape", None)
        if got is None:
            got = tf.convert_to_tensor(ids).shape
        got = tuple(tf.TensorShape(got).as_list()) if tf.TensorShape(
            got).rank is not None else None
        if got is None:
            return
        # The batch dimension is keras-rs' global batch: not checked.
        if len(got) != len(want) or any(
                a is not None and b is not None and a != b
                for a, b in zip(got[1:], want[1:])):
            raise ValueError(
                f"{self._where()}: feature '{path}' "
                f"('{self._keras_rs.features[path]['name']}') got ids of "
                f"shape {got}, but its FeatureConfig says input_shape="
                f"{want} (the batch dimension is not compared).")

    def preprocess(self, inputs, weights=None, training=False):
        """keras-rs' `preprocess`: bundles `inputs` and `weights` by
        feature path, in keras-rs' layout, for `call`.

        It is optional (as with keras-rs on CPU and GPU); `call` takes
        inputs preprocessed by this layer or by keras-rs' layer with the
        same `feature_configs`.

        Args:
            inputs: ids in the structure of `feature_configs`.
            weights: optional weights in the same structure.
            training: unused.

        Returns:
            `{"preprocessed_inputs_per_placement": {"default_device":
            {"inputs": {path: ids}, "weights": {path: weights}}}}` (no
            `"weights"` without weights).
        """
        del training
        if self._keras_rs is None:
            raise ValueError(
                f"{self._where()}: `preprocess` belongs to the keras-rs form "
                "(`feature_configs`).")
        flat_ids, flat_weights = self._flat_keras_rs_inputs(inputs, weights)
        part = {"inputs": flat_ids}
        if weights is not None:
            part["weights"] = flat_weights
        return {_PREPROCESSED: {"default_device": part}}

    def get_embedding_tables(self):
        """The whole tables by name, as keras-rs' method returns them.

        Returns:
            A dict `{table_name: numpy array [vocabulary_size, dim]}` in
            global row order (gathered from every rank: with several ranks
            every rank must call it).
        """
        self._check_built("get_embedding_tables")
        return {t: var.read_global() for t, var in self.embeddings.items()}

    def _check_built(self, what):
        if not self.built:
            raise ValueError(
                f"{self._where()}: `{what}` needs a built layer (call it, or "
                "`build()` it, first).")

    def compute_mask(self, inputs, mask=None):
        """Like the single-table layers: each unpooled feature with dense
        ids of rank >= 2 gets `ids != -1`, so that mask-aware layers skip
        padding; pooled features, and ragged or sparse ids, get None.
        Returns the outputs' structure (a dict by feature, or keras-rs'
        nesting) of masks, or None when nothing is masked."""
        del mask
        if all(spec["combiner"] is not None
               for spec in self.features.values()):
            return None
        ids = self._flat_ids(inputs)
        return self._nested({
            f: padding_mask(ids.get(f), self.features[f]["combiner"])
            for f in self.features})

    def compute_output_spec(self, inputs, *args, **kwargs):
        spec = super().compute_output_spec(inputs, *args, **kwargs)
        ids = self._flat_ids(inputs)
        if not ids:
            return spec
        if self._keras_rs is None:
            flat = spec
        else:
            flat = feature_config.gather(
                spec, self._keras_rs.features, "the output spec",
                self._where())
        return self._nested({
            f: ragged_spec(s, ids.get(f), self.features[f]["combiner"])
            if f in self.features else s for f, s in flat.items()})

    def _flat_ids(self, inputs):
        """`{feature: ids}` of the inputs in either form ({} where they do
        not fit the features: `call` says why)."""
        if self._keras_rs is None:
            return inputs if isinstance(inputs, dict) else {}
        try:
            flat, _ = self._flat_keras_rs_inputs(inputs, None)
        except (TypeError, ValueError, AttributeError, KeyError):
            return {}
        return flat

    def _nested(self, flat):
        """`{feature: value}` in the outputs' structure."""
        if self._keras_rs is None:
            return flat
        return feature_config.map_structure(
            lambda _, p: flat[p], self._keras_rs.skeleton,
            is_leaf=feature_config.is_path)

    def compute_output_shape(self, inputs_shape=None, weights_shape=None,
                             **kwargs):
        # Keras' `summary` of a layer built outside a functional model
        # passes `build`'s argument name, `input_shape`.
        if inputs_shape is None:
            inputs_shape = kwargs.pop("input_shape")
        if self._keras_rs is None:
            shapes = inputs_shape
        elif isinstance(inputs_shape, dict) and _PREPROCESSED in (
                inputs_shape):
            shapes = inputs_shape[_PREPROCESSED]["default_device"]["inputs"]
        else:
            shapes = feature_config.gather(
                inputs_shape, self._keras_rs.features, "the input shapes",
                self._where())
        out = {}
        for f, spec in self.features.items():
            shape = tuple(shapes[f])
            dim = self.tables[spec["table"]]["embedding_dim"]
            if spec["combiner"] is not None:
                check_pooled_rank(shape, spec["combiner"],
                                   f"{self._where()}, feature '{f}'")
            if spec["combiner"] is not None or len(shape) == 1:
                out[f] = (shape[0], dim)
            else:
                out[f] = shape + (dim,)
        return self._nested(out)

    # -- saving: each table (and its slots) whole, in global row order,
    # streamed in bounded chunks; loading reads only this rank's rows.
    def save_own_variables(self, store):
        if not self.built:  # as BaseEmbedding.save_own_variables
            return
        for t in sorted(self.embeddings):
            save_table(store, f"table.{t}", f"table.{t}.slot.",
                       self.embeddings[t])

    @first_load_error
    def load_own_variables(self, store):
        if not self.built and not list(store.keys()):
            return  # as BaseEmbedding.load_own_variables
        if not self.built:  # as BaseEmbedding.load_own_variables
            self.build()
        keys = list(store.keys())
        for t in sorted(self.embeddings):
            if f"table.{t}" not in keys:
                raise ValueError(
                    f"EmbeddingCollection '{self.name}': no 'table.{t}' "
                    f"entry in the saved weights. Found: {keys}."
                    f"{NOTHING_SAVED_HINT if not keys else ''}")
        for t in sorted(self.embeddings):
            load_table(store, f"table.{t}", f"table.{t}.slot.",
                       self.embeddings[t],
                       f"EmbeddingCollection '{self.name}', table '{t}'")

    @classmethod
    def from_config(cls, config):
        """Rebuilds the layer (`load_model`, `clone_model`); a table placed
        on a rank this job does not have (a file from a job of more ranks)
        goes to `rank % num_ranks`, with a log line, so that the file loads
        at any number of ranks."""
        layer = super().from_config(config)
        layer._from_saved_config = True
        return layer

    def get_config(self):
        if self._keras_rs is not None:
            feature_configs, tables = feature_config.serialize(
                self._keras_rs.skeleton, self._keras_rs.features,
                self._keras_rs.tables)
            return {**super().get_config(),
                    "feature_configs": feature_configs, "tables": tables,
                    "use_table_optimizers": self.use_table_optimizers,
                    "table_stacking": self.table_stacking,
                    "update_stats": self.update_stats}
        tables = {}
        for t, spec in self.tables.items():
            spec = dict(spec)
            opt = self._table_optimizers[t]
            if opt is not None:
                spec["optimizer"] = serialize_table_optimizer(opt)
            tables[t] = spec
        return {**super().get_config(), "tables": tables,
                "features": {f: dict(s) for f, s in self.features.items()}}
