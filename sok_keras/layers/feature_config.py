"""keras-rs feature configurations for `EmbeddingCollection`.

`keras_rs.layers.DistributedEmbedding(feature_configs)` takes a nested
structure (dicts, lists, tuples) of `keras_rs.layers.FeatureConfig`, each
naming a `keras_rs.layers.TableConfig`. This module reads that structure —
keras-rs objects, or plain dicts of the same fields, so that keras-rs stays
optional — and turns it into `EmbeddingCollection`'s tables and features.

keras-rs is never imported here: its objects are recognised only when the
caller has imported it already (it is in `sys.modules`).

Field by field (keras-rs 0.4.0):

- `TableConfig.name`: the table's name. Features whose tables have the same
  name share one table, and their table settings must agree.
- `vocabulary_size`, `embedding_dim`: positive ints.
- `initializer` (default `VarianceScaling(mode="fan_out")`): any Keras
  initializer. Each table gets its own copy (keras-rs' default is one shared
  instance, which gives every default table the same values).
- `optimizer` (default `"adam"`): the table's own optimizer, as keras-rs
  documents it (independent of `model.compile`'s): sok's per-table
  optimizer, applied lazily. Each table gets its own copy.
- `combiner` (default `"mean"`): `"mean"`, `"sum"` or `"sqrtn"` (sok also
  takes `None`: unpooled rows).
- `placement` (default `"auto"`): `"auto"` and `"default_device"` mean a
  table sharded over every rank (`"distributed"`); sok's modes
  `"distributed"` and `"localized:<rank>"` are accepted too; `"sparsecore"`
  (TPU only) is rejected.
- `max_ids_per_partition`, `max_unique_ids_per_partition` (default 256):
  TPU buffer sizes; checked to be positive ints and otherwise unused (sok
  sizes every exchange from the batch).
- `FeatureConfig.name`, `table`, `input_shape`, `output_shape`: as in
  keras-rs; the batch dimension of the shapes is not checked (keras-rs'
  is the global batch, a rank sees its share). `input_shape` and
  `output_shape` may be left out of a plain dict.
"""

import sys

import keras

from sok_keras.layers.base_embedding import check_combiner
from sok_keras.layers.base_embedding import check_positive_int
from sok_keras.layers.base_embedding import get_initializer
from sok_keras.layers.base_embedding import get_table_optimizer

TABLE_FIELDS = (
    "name", "vocabulary_size", "embedding_dim", "initializer", "optimizer",
    "combiner", "placement", "max_ids_per_partition",
    "max_unique_ids_per_partition",
)
FEATURE_FIELDS = ("name", "table", "input_shape", "output_shape")
# keras-rs' placements, and what they mean here.
PLACEMENTS = {"auto": "distributed", "default_device": "distributed"}


def table_defaults():
    """keras-rs' `TableConfig` defaults (a fresh initializer each call)."""
    return {
        "initializer": keras.initializers.serialize(
            keras.initializers.VarianceScaling(mode="fan_out")),
        "optimizer": "adam",
        "combiner": "mean",
        "placement": "auto",
        "max_ids_per_partition": 256,
        "max_unique_ids_per_partition": 256,
    }


def _keras_rs_classes():
    """`(FeatureConfig, TableConfig)` of keras-rs if it is imported, else
    `()`: objects of keras-rs can only exist once it is."""
    if sys.modules.get("keras_rs") is None:
        return ()
    from keras_rs import layers

    return layers.FeatureConfig, layers.TableConfig


def _is_feature_object(obj):
    classes = _keras_rs_classes()
    return bool(classes) and isinstance(obj, classes[0])


def _is_table_object(obj):
    classes = _keras_rs_classes()
    return bool(classes) and isinstance(obj, classes[1])


def is_feature_leaf(obj):
    """Whether `obj` is one feature: a keras-rs `FeatureConfig`, or a dict
    with a `"table"` entry that is a table (a dict, a `TableConfig`, or a
    table index in a serialized config)."""
    if _is_feature_object(obj):
        return True
    if isinstance(obj, dict) and "table" in obj:
        table = obj["table"]
        if isinstance(table, dict):
            # {"table": <a feature>} is a structure holding one feature.
            return not is_feature_leaf(table)
        return (isinstance(table, int) and not isinstance(table, bool)) or (
            _is_table_object(table))
    return False


def _is_tpu_feature(obj):
    return type(obj).__module__.startswith("tensorflow") and (
        type(obj).__name__ == "FeatureConfig")


def ordered(keys):
    """`keys` sorted (dict keys in keras-rs' order), keys of different
    types (`0` and `"a"`) by type name first instead of failing."""
    keys = list(keys)
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda k: (type(k).__name__, str(k)))


def _check_not_a_broken_feature(node, path, where):
    """Raises for a dict of a feature's fields whose `table` is missing or
    not a table (it would otherwise be walked as a structure, and the error
    would point at its `name`)."""
    if not node or not set(node) <= set(FEATURE_FIELDS) or not (
            isinstance(node.get("name"), str)
            or "input_shape" in node or "output_shape" in node):
        return
    if any(is_feature_leaf(v) or isinstance(v, dict)
           for v in node.values()):
        return  # a structure whose keys happen to be field names
    at = ".".join(str(p) for p in path) or "<top>"
    if "table" not in node:
        raise ValueError(f"{where}: feature '{at}': no `table`.")
    raise ValueError(
        f"{where}: feature '{at}': `table` must be a "
        "`keras_rs.layers.TableConfig` or a dict of its fields "
        f"{list(TABLE_FIELDS)}. Received: table={node['table']!r}. (sok's "
        "own form names tables by name: pass `tables` and `features`.)")


def flatten(structure, where):
    """`[(path, leaf)]` of a nested structure of features, in keras-rs'
    order (dict keys sorted, as `keras.tree.flatten_with_path`), `path` the
    keys joined with dots (keras-rs' feature path)."""
    out = []

    def walk(node, path):
        if is_feature_leaf(node):
            out.append((".".join(str(p) for p in path), node))
        elif isinstance(node, dict):
            _check_not_a_broken_feature(node, path, where)
            for key in ordered(node):
                walk(node[key], path + (key,))
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(item, path + (i,))
        elif _is_tpu_feature(node):
            raise ValueError(
                f"{where}: feature '{'.'.join(map(str, path))}' is a "
                "`tf.tpu.experimental.embedding.FeatureConfig`, which is "
                "TPU-only. Use `keras_rs.layers.FeatureConfig` or a dict of "
                f"its fields {list(FEATURE_FIELDS)}.")
        else:
            at = ".".join(str(p) for p in path) or "<top>"
            raise ValueError(
                f"{where}: `feature_configs` must be a nested structure "
                "(dicts, lists, tuples) of `keras_rs.layers.FeatureConfig` "
                "or dicts with the fields "
                f"{list(FEATURE_FIELDS)}. At '{at}' it holds "
                f"{node!r} (of type {type(node).__name__}). (For sok's own "
                "form, pass both `tables` and `features`.)")

    walk(structure, ())
    if not out:
        raise ValueError(
            f"{where}: `feature_configs` holds no feature. Received: "
            f"feature_configs={structure!r}.")
    return out


def map_structure(fn, structure, is_leaf=is_feature_leaf):
    """`structure` with each leaf replaced by `fn(path, leaf)`; the dicts
    keep their key order."""

    def walk(node, path):
        if is_leaf(node):
            return fn(".".join(str(p) for p in path), node)
        if isinstance(node, dict):
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*[walk(v, path + (i,))
                                for i, v in enumerate(node)])
        return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))

    return walk(structure, ())


def gather(values, paths, what, where):
    """`{path: value}` from `values`, a nested structure shaped like the
    feature configs (`paths` their paths). Raises if a feature is missing
    or `values` holds anything else."""
    found = {}

    def walk(node, path):
        key = ".".join(str(p) for p in path)
        if key in paths:
            if isinstance(node, dict):
                raise ValueError(
                    f"{where}: {what} must have the structure of the "
                    f"layer's feature_configs; at '{key or '<top>'}' it "
                    f"holds a dict with keys {ordered(node)}, where one "
                    f"feature's tensor belongs.")
            found[key] = node
            return
        if not any(p.startswith(key + ".") or not key for p in paths):
            raise ValueError(
                f"{where}: {what} holds '{key}', which is no feature of the "
                f"layer's feature_configs. Features: {sorted(paths)}.")
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, path + (i,))
        else:
            raise ValueError(
                f"{where}: {what} must have the structure of the layer's "
                f"feature_configs; at '{key or '<top>'}' it holds a "
                f"{type(node).__name__}, where the features "
                f"{sorted(p for p in paths if p.startswith(key))} belong.")

    walk(values, ())
    missing = sorted(set(paths) - set(found))
    if missing:
        raise ValueError(
            f"{where}: {what} has no entry for features {missing} (paths in "
            "the structure of feature_configs).")
    return found


def _fields(obj, fields, kind, where):
    """A keras-rs config object or a dict as a dict of known fields."""
    if isinstance(obj, dict):
        spec = dict(obj)
    elif kind == "table" and _is_table_object(obj) or (
            kind == "feature" and _is_feature_object(obj)):
        spec = {f: getattr(obj, f) for f in fields}
    else:
        raise ValueError(
            f"{where}: a {kind} must be a keras_rs.layers."
            f"{kind.capitalize()}Config or a dict of its fields "
            f"{list(fields)}. Received: {obj!r} (of type "
            f"{type(obj).__name__}).")
    unknown = sorted(set(spec) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: {kind} has unknown keys {unknown}; allowed: "
            f"{list(fields)}.")
    return spec


def normalize_table(table, where, check_optimizer=True):
    """A table (`TableConfig` or dict) as a complete dict of its fields,
    initializer and optimizer serialized. Raises on a bad field (the
    optimizer's only with `check_optimizer`: with keras-rs'
    `use_table_optimizers=False` it is ignored, as keras-rs ignores it)."""
    spec = _fields(table, TABLE_FIELDS, "table", where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{where}: a table needs a `name` (a non-empty string). "
            f"Received: name={name!r}.")
    where = f"{where}, table '{name}'"
    merged = {**table_defaults(), **spec}
    out = {k: merged.get(k) for k in TABLE_FIELDS}
    for arg in ("vocabulary_size", "embedding_dim", "max_ids_per_partition",
                "max_unique_ids_per_partition"):
        out[arg] = check_positive_int(out.get(arg), arg, where)
    out["combiner"] = check_combiner(out["combiner"], where)
    mode_of(out["placement"], where)
    out["initializer"] = keras.initializers.serialize(
        get_initializer(out["initializer"], where))
    opt = out["optimizer"]
    if opt is not None and check_optimizer:
        get_table_optimizer(opt, where)  # raises if unsupported
    if opt is not None and not isinstance(opt, (str, dict)):
        # An instance: its config (every table makes its own copy).
        out["optimizer"] = keras.saving.serialize_keras_object(opt)
    return out


def mode_of(placement, where):
    """The sok table mode of a keras-rs `placement`."""
    if placement in PLACEMENTS:
        return PLACEMENTS[placement]
    if placement == "distributed" or (
            isinstance(placement, str) and placement.startswith(
                "localized:")):
        return placement  # checked against the world when built
    if placement == "sparsecore":
        raise ValueError(
            f"{where}: `placement='sparsecore'` needs a TPU with "
            "SparseCore; sok_keras shards the table over the ranks instead. "
            "Use 'auto' or 'default_device' (sharded over every rank), or "
            "'localized:<rank>' (the whole table on one rank).")
    raise ValueError(
        f"{where}: `placement` must be one of {sorted(PLACEMENTS)}, "
        "'distributed' or 'localized:<rank>'. Received: "
        f"placement={placement!r}.")


def _shape(value, arg, where):
    if value is None:
        return None
    try:
        shape = tuple(value)
    except TypeError:
        shape = None
    if shape is None or not shape or not all(
            d is None or (isinstance(d, int) and not isinstance(d, bool)
                          and d >= 0) for d in shape):
        raise ValueError(
            f"{where}: `{arg}` must be a non-empty tuple of ints or None. "
            f"Received: {arg}={value!r}.")
    return shape


def normalize_feature(path, feature, tables, where, check_optimizer=True):
    """A feature as `{name, table: <table name>, input_shape,
    output_shape}`; its table, normalized, goes into `tables` (by name)."""
    spec = _fields(feature, FEATURE_FIELDS, "feature", where)
    name = spec.get("name", path)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{where}: feature '{path}' needs a `name` (a non-empty string). "
            f"Received: name={name!r}.")
    where_f = f"{where}, feature '{path}'"
    if "table" not in spec:
        raise ValueError(f"{where_f}: no `table`.")
    table = normalize_table(spec["table"], where_f, check_optimizer)
    known = tables.get(table["name"])
    if known is None:
        tables[table["name"]] = table
    elif _differences(known, table):
        diff = _differences(known, table)
        raise ValueError(
            f"{where_f}: its table '{table['name']}' differs from another "
            f"feature's table of that name in {diff}. Tables are known by "
            "name: give different tables different names.")
    dim = table["embedding_dim"]
    input_shape = _shape(spec.get("input_shape"), "input_shape", where_f)
    output_shape = _shape(spec.get("output_shape"), "output_shape", where_f)
    if input_shape is not None and len(input_shape) > 2:
        raise ValueError(
            f"{where_f}: `input_shape` must be (batch,) or (batch, n). "
            f"Received: input_shape={input_shape}.")
    if output_shape is not None:
        if table["combiner"] is None:
            rank = None if input_shape is None else len(input_shape) + 1
        else:
            rank = 2
        if output_shape[-1] not in (None, dim) or (
                rank is not None and len(output_shape) != rank):
            if table["combiner"] is not None:
                expected = f"(batch, {dim})"
            elif input_shape is None:
                expected = f"(..., {dim})"
            else:
                expected = str(tuple(input_shape) + (dim,))
            hint = ""
            if table["combiner"] is not None and len(output_shape) > 2:
                hint = (" A sequence feature (one row per id, unpooled) "
                        "needs `combiner=None` on its `TableConfig` "
                        "(keras-rs' default is 'mean').")
            raise ValueError(
                f"{where_f}: `output_shape` {output_shape} does not fit its "
                f"table '{table['name']}' (embedding_dim={dim}, combiner="
                f"{table['combiner']!r}): expected {expected}.{hint}")
    return {"name": name, "table": table["name"],
            "input_shape": input_shape, "output_shape": output_shape}


def _comparable(table, key):
    value = table[key]
    if isinstance(value, dict):
        # Keras marks an object serialized twice inside one save with a
        # `shared_object_id`: not a setting.
        value = {k: v for k, v in value.items() if k != "shared_object_id"}
    if key == "optimizer" and isinstance(value, dict):
        # Keras numbers the names of optimizers made from one string.
        config = {k: v for k, v in value.get("config", {}).items()
                  if k != "name"}
        return {**value, "config": config}
    return value


def _differences(a, b):
    # Serialized, an unseeded initializer is the same whatever its object.
    return sorted(k for k in TABLE_FIELDS
                  if _comparable(a, k) != _comparable(b, k))


class FeaturePath(str):
    """A feature's path, standing for the feature in a skeleton of the
    feature configs' structure."""


def is_path(obj):
    return isinstance(obj, FeaturePath)


def parse(feature_configs, where, tables_list=None, check_optimizer=True):
    """Reads keras-rs feature configs.

    Args:
        feature_configs: a nested structure of `FeatureConfig`s or dicts.
            In a serialized config (`get_config`), a feature's `table` is an
            index into `tables_list`.
        where: the layer, for error messages.
        tables_list: the serialized tables of a config, or None.
        check_optimizer: whether the tables' optimizers must be ones
            sok_keras can apply (False: keras-rs' `use_table_optimizers=
            False`, which ignores them).

    Returns:
        `(skeleton, features, tables)`: `skeleton` is `feature_configs`
        with each feature replaced by its `FeaturePath`, `features` maps
        each path to the feature's normalized dict, `tables` each table's
        name to its normalized dict (in first-use order).
    """
    if tables_list is not None and not isinstance(tables_list, (list,
                                                                tuple)):
        raise ValueError(
            f"{where}: with `feature_configs`, `tables` is the list of "
            "serialized tables of a saved config (features refer to them by "
            f"index). Received: tables={tables_list!r}.")
    features, tables = {}, {}
    for path, leaf in flatten(feature_configs, where):
        if isinstance(leaf, dict) and isinstance(leaf["table"], int):
            index = leaf["table"]
            if tables_list is None or not 0 <= index < len(tables_list):
                raise ValueError(
                    f"{where}: feature '{path}' refers to table index "
                    f"{index}, but `tables` has "
                    f"{0 if tables_list is None else len(tables_list)} "
                    "entries.")
            leaf = dict(leaf, table=tables_list[index])
        if path in features:
            raise ValueError(
                f"{where}: two features have the path '{path}' (keys joined "
                "with dots: a key 'a.b' and a key 'b' under 'a', or the keys "
                "0 and '0'): rename one of them.")
        features[path] = normalize_feature(path, leaf, tables, where,
                                           check_optimizer)
    skeleton = map_structure(lambda p, _: FeaturePath(p), feature_configs)
    return skeleton, features, tables


def serialize(skeleton, features, tables):
    """keras-rs' config layout: `(feature_configs, tables)`, the features
    referring to the flat `tables` list by index (a shared table is stored
    once)."""
    names = list(tables)
    feature_configs = map_structure(
        lambda _, p: {**features[p],
                      "table": names.index(features[p]["table"])},
        skeleton, is_leaf=is_path)
    return feature_configs, [dict(tables[n]) for n in names]
