"""`EmbeddingCollection`: several tables, one exchange per direction."""

import keras
import tensorflow as tf

from sok_keras.layers.base_embedding import check_combiner
from sok_keras.layers.base_embedding import check_positive_int
from sok_keras.layers.base_embedding import get_table_optimizer
from sok_keras.variable import Variable
from sok_keras.variable import parse_mode

_TABLE_KEYS = ("vocabulary_size", "embedding_dim", "mode", "initializer",
               "optimizer")
_FEATURE_KEYS = ("table", "combiner")


def _checked_spec(layer_name, kind, key, spec, allowed):
    """``spec`` as a dict, after checking it names only ``allowed`` keys."""
    spec = dict(spec)
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise ValueError(
            f"EmbeddingCollection '{layer_name}': {kind} '{key}' has unknown "
            f"keys {unknown}; allowed: {list(allowed)}.")
    return spec


@keras.saving.register_keras_serializable(package="sok_keras")
class EmbeddingCollection(keras.layers.Layer):
    """Several sharded tables shared by named features, looked up together.

    One call looks every feature up with one exchange per direction for all
    tables (`sok_keras.lookup_sparse`'s fused path), where one layer per
    table would make one exchange per table. Each table has its own size,
    width, sharding mode, initializer and (optionally) optimizer; several
    features may share a table.

    Args:
        tables: dict `{table_name: spec}`; a spec is a dict with
            `vocabulary_size` (int), `embedding_dim` (int), and optionally
            `mode` (`"distributed"`, default, or `"localized:<rank>"`),
            `initializer` (default `"uniform"`) and `optimizer` (a Keras
            optimizer for this table only, as on `DistributedEmbedding`).
        features: dict `{feature_name: spec}`; a spec is a dict with `table`
            (a key of `tables`) and optionally `combiner` (`"sum"`, default,
            `"mean"`, `"sqrtn"`, or `None` for unpooled rows).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: dict `{feature_name: ids}`, ids dense (`-1` padding), ragged
            or sparse, as for `DistributedEmbedding`.
        weights: optional dict `{feature_name: per-id weights}`.

    Returns:
        A dict `{feature_name: embeddings}`.

    Example:

    >>> emb = sok.layers.EmbeddingCollection(
    ...     tables={"user": {"vocabulary_size": 10_000, "embedding_dim": 16},
    ...             "item": {"vocabulary_size": 50_000, "embedding_dim": 32,
    ...                      "mode": "localized:0"}},
    ...     features={"user_id": {"table": "user"},
    ...               "clicked": {"table": "item", "combiner": "mean"}})
    >>> out = emb({"user_id": np.array([[3]]),
    ...            "clicked": np.array([[5, 9, -1]])})
    """

    def __init__(self, tables, features, **kwargs):
        super().__init__(**kwargs)
        name = self.name
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
            self.tables[t] = {
                "vocabulary_size": check_positive_int(
                    spec.get("vocabulary_size"), "vocabulary_size", where),
                "embedding_dim": check_positive_int(
                    spec.get("embedding_dim"), "embedding_dim", where),
                "mode": spec.get("mode", "distributed"),
                "initializer": keras.initializers.serialize(
                    keras.initializers.get(spec.get("initializer",
                                                    "uniform"))),
            }
            self._table_optimizers[t] = get_table_optimizer(
                spec.get("optimizer"), where)
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

    def build(self, input_shape=None):
        if self.built:
            return
        from sok_keras import world

        self.embeddings = {}
        for t, spec in self.tables.items():
            parse_mode(spec["mode"], world.num_ranks(), t)
            var = Variable(
                keras.initializers.deserialize(spec["initializer"]),
                shape=(spec["vocabulary_size"], spec["embedding_dim"]),
                mode=spec["mode"], dtype=self.variable_dtype, name=t)
            var.optimizer = self._table_optimizers[t]
            self.embeddings[t] = var
        self.built = True

    def call(self, inputs, weights=None):
        from sok_keras import lookup

        missing = sorted(set(self.features) - set(inputs))
        if missing:
            raise ValueError(
                f"EmbeddingCollection '{self.name}': no ids for features "
                f"{missing}. Received: {sorted(inputs)}.")
        weights = weights or {}
        names = list(self.features)
        feats = [
            lookup.normalize_ids(inputs[f], weights.get(f),
                                 f"{self.name}/{f}")
            for f in names
        ]
        params = [self.embeddings[self.features[f]["table"]] for f in names]
        rows = lookup.gather_rows_fused(
            params, [x.values for x in feats],
            [f"{self.name}/{self.features[f]['table']}" for f in names],
            [x.problem for x in feats])
        out = {}
        for f, feat, (r, inverse) in zip(names, feats, rows):
            combiner = self.features[f]["combiner"]
            if combiner is None:
                value = lookup.unpooled(r, inverse, feat)
            else:
                value = lookup.pool(r, inverse, feat, combiner)
            out[f] = tf.cast(value, self.compute_dtype)
        return out

    def compute_output_shape(self, inputs_shape, weights_shape=None):
        out = {}
        for f, spec in self.features.items():
            shape = tuple(inputs_shape[f])
            dim = self.tables[spec["table"]]["embedding_dim"]
            if spec["combiner"] is not None or len(shape) == 1:
                out[f] = (shape[0], dim)
            else:
                out[f] = shape + (dim,)
        return out

    # -- saving: each table (and its slots) whole, in global row order.
    def save_own_variables(self, store):
        for t in sorted(self.embeddings):
            var = self.embeddings[t]
            store[f"table.{t}"] = var.read_global()
            for name, value in var.slot_values_for_saving():
                store[f"table.{t}.slot.{name}"] = value

    def load_own_variables(self, store):
        keys = list(store.keys())
        for t in sorted(self.embeddings):
            key = f"table.{t}"
            if key not in keys:
                raise ValueError(
                    f"EmbeddingCollection '{self.name}': no '{key}' entry in "
                    f"the saved weights. Found: {keys}.")
            var = self.embeddings[t]
            var.assign_global(store[key], f"{self.name}/{t}")
            prefix = f"{key}.slot."
            for k in keys:
                if k.startswith(prefix):
                    var.restore_slot(k[len(prefix):], store[k])

    def get_config(self):
        tables = {}
        for t, spec in self.tables.items():
            spec = dict(spec)
            opt = self._table_optimizers[t]
            if opt is not None:
                spec["optimizer"] = keras.saving.serialize_keras_object(opt)
            tables[t] = spec
        return {**super().get_config(), "tables": tables,
                "features": {f: dict(s) for f, s in self.features.items()}}
