"""Cross-rank consistency checks: every rank must build the same tables
and look them up in the same order.

A rank whose table has another vocabulary size (16 rows here, 17 there)
would train silently until an id valid only on one rank's view hangs the
job; a rank that looks its tables up in another order sends its rows into
the wrong collectives. sok_keras compares, across ranks:

- at the first step of `fit`, `evaluate` and `predict` (when the step
  function is traced, before any of its collectives runs): every sok table
  of the model (name, vocabulary size, embedding dim, dtype, mode, optimizer
  rule) and the lookups of the step, in order (table and kind);
- when a layer loads its table (`load_own_variables`), and the first time
  a table is looked up eagerly (a subclassed model called on a batch, a
  custom loop) or traced outside those steps (a custom loop's
  `tf.function`): that table.

A difference raises `InconsistentRanksError` on every rank, naming the
model, the table, the field and the values of both ranks, e.g. "table
'emb/embeddings': vocabulary_size is 16 on rank 0 and 17 on rank 1". The
comparison is one eager all-gather of a short description on the control
communicator; in a world of one nothing is compared.
"""

import json
import re
import threading
import zlib

import keras
import numpy as np
import tensorflow as tf

from sok_keras import shard_reads
from sok_keras import world

_FIELDS = ("name", "vocabulary_size", "embedding_dim", "dtype", "mode",
           "optimizer")
_LOCAL = threading.local()


class InconsistentRanksError(ValueError):
    """Ranks built different tables or look them up in different orders."""

    # Exception's own constructor: AutoGraph re-raises an error from a
    # traced function (its message with the user's code) as the same class
    # only for such classes, as a StagingError otherwise.
    __init__ = Exception.__init__


# -- lookup order ---------------------------------------------------------


def record_lookup(table, what):
    """Records, while a checked step function is traced, that it looks up
    `table` (a `sok_keras.Variable` or a list of them) with `what` (the
    entry point). Does nothing otherwise."""
    tables = table if isinstance(table, (list, tuple)) else [table]
    if tf.executing_eagerly():
        # Eager lookups (a subclassed model called on a batch, a custom
        # loop) run their collectives at once: compare each table the
        # first time it is looked up, on every rank alike.
        for t in tables:
            if not getattr(t, "_sok_compared", False):
                check_table(t, "the first lookup")
        return
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        # Traced outside a checked Keras step (a custom loop's
        # tf.function, SOK's way): compare each table the first time one
        # of its lookups is traced, before any collective of the function
        # runs (a table of another size trained on silently, one of
        # another width waited in the exchange until the timeout). Not
        # under a tf.distribute strategy, whose replicas trace in threads
        # of one process.
        from sok_keras.optimizers.wrapper import under_strategy

        if world.num_ranks() > 1 and not under_strategy():
            for t in tables:
                if not getattr(t, "_sok_compared", False):
                    check_table(t, "the first traced lookup")
        return
    names = ",".join(str(getattr(t, "path", None) or getattr(t, "name", t))
                     for t in tables)
    stack[-1].append(f"{what}({names})")


def recording():
    """Whether a checked Keras step is being traced (its lookups are
    compared across ranks before it runs)."""
    return bool(getattr(_LOCAL, "stack", None))


class _Recording:
    def __enter__(self):
        if not hasattr(_LOCAL, "stack"):
            _LOCAL.stack = []
        self.lookups = []
        _LOCAL.stack.append(self.lookups)
        return self.lookups

    def __exit__(self, *exc):
        _LOCAL.stack.pop()


# -- signatures -----------------------------------------------------------


def _rule_name(optimizer):
    if optimizer is None:
        return "none"
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return _rule_name(inner)
    try:
        from sok_keras.optimizers import sparse_rules

        return sparse_rules.rule_for(optimizer).name
    except Exception:  # noqa: BLE001 - not a sparse rule: name its class
        return type(optimizer).__name__


def table_signature(table, model_optimizer=None):
    """The facts about `table` that must be equal on every rank (a dict)."""
    own = table.optimizer
    rule = (f"{_rule_name(own)} (the table's own)" if own is not None
            else _rule_name(model_optimizer))
    return {
        "name": table.path or table.name,
        "vocabulary_size": int(table.global_shape[0]),
        "embedding_dim": int(table.global_shape[1]),
        "dtype": str(table.dtype),
        "mode": table.mode,
        "optimizer": rule,
    }


def model_tables(model):
    """The sok tables of `model` (not their slots), in the model's order."""
    from sok_keras.variable import Variable

    tables = [v for v in model.variables if isinstance(v, Variable)]
    slots = {id(s) for t in tables for s in t.slots.values()}
    return [t for t in tables if id(t) not in slots]


# -- the comparison ---------------------------------------------------------


def _gather_texts(text, key):
    """Every rank's `text`, in rank order (one eager all-gather)."""
    comm = world.control_communicator()
    data = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    with tf.init_scope():  # eager; the host communicator pins the CPU
        sizes = comm.all_gather(tf.constant([data.size], tf.int64),
                                f"{key}/size").numpy()
        width = int(sizes.max())
        padded = np.zeros([width], np.int32)
        padded[:data.size] = data
        got = comm.all_gather(tf.constant(padded), f"{key}/text").numpy()
    got = got.reshape(len(sizes), width)
    return [bytes(row[:n].astype(np.uint8)).decode("utf-8")
            for row, n in zip(got, sizes)]


def _describe(value):
    return f"'{value}'" if isinstance(value, str) else str(value)


def _unnumbered(name):
    """`name` without a trailing `_<number>` on its path's parts, as Keras
    numbers layers made without a name ('distributed_embedding_2/
    embeddings' -> 'distributed_embedding/embeddings')."""
    return "/".join(re.sub(r"_\d+$", "", part) for part in name.split("/"))


_NUMBERING_HINT = (
    "; the names differ only in a trailing number: if Keras numbered "
    "them (layers made without `name=`), a rank made more layers of that "
    "kind before this model (a model built on some ranks only, or a build "
    "that failed on one rank and was caught), and the ranks may be at "
    "different points of the program. Build the model on every rank after "
    "`keras.utils.clear_session()`, or give its layers names")


def _table_differences(a, b, ra, rb):
    """The first difference between two ranks' table lists, or None."""
    names_a = [t["name"] for t in a]
    names_b = [t["name"] for t in b]
    if names_a != names_b:
        same = len(names_a) == len(names_b) and sorted(
            map(_unnumbered, names_a)) == sorted(map(_unnumbered, names_b))
        for i, (x, y) in enumerate(zip(names_a, names_b)):
            if x != y:
                hint = (_NUMBERING_HINT if same
                        and _unnumbered(x) == _unnumbered(y) else "")
                return (f"table {i + 1} is '{x}' on rank {ra} and '{y}' on "
                        f"rank {rb} (tables: {names_a} on rank {ra}, "
                        f"{names_b} on rank {rb}){hint}")
        return (f"rank {ra} has {len(a)} tables {names_a} and rank {rb} has "
                f"{len(b)} {names_b}")
    for x, y in zip(a, b):
        for field in _FIELDS[1:]:
            if x.get(field) != y.get(field):
                return (f"table '{x['name']}': {field} is "
                        f"{_describe(x.get(field))} on rank {ra} and "
                        f"{_describe(y.get(field))} on rank {rb}")
    return None


def _lookup_differences(a, b, ra, rb, where):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (f"lookup {i + 1} of {where} is {x} on rank {ra} and {y} "
                    f"on rank {rb} (the ranks look their tables up in a "
                    "different order)")
    if len(a) != len(b):
        return (f"{where} makes {len(a)} lookups on rank {ra} and {len(b)} on "
                f"rank {rb}")
    return None


def _by_name(view):
    return sorted(view.get("tables", []), key=lambda t: t["name"])


def dense_signature(model):
    """`[[path, shape, dtype], ...]`: the model's weights other than sok
    tables and their slots, and whether logs are global, which must be
    the same on every rank (a Dense of another width, a layer more, or
    another `SOK_GLOBAL_METRICS` would otherwise stop the ranks at their
    first collective that differs, after the communication timeout)."""
    from sok_keras import callbacks
    from sok_keras.variable import is_sok_variable

    weights = [[getattr(v, "path", None) or v.name, _shape(v),
                str(v.dtype)]
               for v in model.weights if not is_sok_variable(v)]
    enabled = bool(callbacks.global_metrics_enabled())
    # Global logs sum the metrics' state over the ranks: other metrics on
    # one rank would meet other collectives (or mix unlike values).
    return {"weights": weights, "global_metrics": enabled,
            "metrics": _metric_signature(model) if enabled else None,
            "vocabularies": _vocabulary_signature(model)}


def _vocabulary_signature(model):
    """`[[name, class, size, crc32], ...]`: the state of preprocessing
    layers that no weight holds (a `StringLookup`'s or
    `TextVectorization`'s vocabulary, a `Discretization`'s bin
    boundaries). Each rank `adapt`ing such a layer on its own slice of
    the data makes id 1 mean "a" on one rank and "c" on another, with
    every table and weight of the same shape (QA)."""
    out = []
    layers = list(model._flatten_layers(include_self=False))
    # A `TextVectorization`'s vocabulary is its inner lookup layer's: read
    # once (O(V) strings), through the outer layer.
    inner = {id(getattr(layer, "_lookup_layer", None)) for layer in layers}
    for layer in layers:
        if id(layer) in inner:
            continue
        if hasattr(layer, "get_vocabulary") and hasattr(
                layer, "vocabulary_size"):
            try:
                state = [str(t) for t in layer.get_vocabulary()]
            except Exception:  # noqa: BLE001 - not adapted or built yet
                continue
        elif isinstance(layer, keras.layers.Discretization):
            state = [repr(b) for b in (layer.bin_boundaries or [])]
        else:
            continue
        out.append([layer.name, type(layer).__name__, len(state),
                    zlib.crc32("\x1f".join(state).encode("utf-8"))])
    return out


def _shape(v):
    return [int(d) if d is not None else None for d in v.shape]


def _metric_signature(model):
    """`[[name, details], ...]`: the model's metrics. Those of `compile`
    are described by what was asked for (a name, or a metric's class and
    config), which is known before they are built (at the start of `fit`);
    any other metric by its state variables."""
    out = []

    def asked(metric, prefix=""):
        if isinstance(metric, keras.metrics.Metric):
            try:
                # Objects without a JSON form by their repr, less their
                # addresses (which differ between processes).
                config = re.sub(r" at 0x[0-9a-fA-F]+", "", json.dumps(
                    metric.get_config(), sort_keys=True, default=repr))
            except Exception:  # noqa: BLE001 - a custom metric's config
                config = None
            return [prefix + metric.name, [type(metric).__name__, config]]
        if isinstance(metric, str):
            return [prefix + metric, None]
        return [prefix + getattr(metric, "__name__", type(metric).__name__),
                None]

    def walk(metric):
        if hasattr(metric, "_user_metrics"):  # Keras' CompileMetrics
            out.extend(asked(m) for m in keras.tree.flatten(
                metric._user_metrics or []))
            out.extend(asked(m, "weighted ") for m in keras.tree.flatten(
                metric._user_weighted_metrics or []))
        elif isinstance(getattr(type(metric), "metrics", None), property):
            for inner in metric.metrics:  # Keras' CompileLoss
                walk(inner)
        else:
            out.append([metric.name, [[_shape(v), str(v.dtype)]
                                      for v in metric.variables]])

    for metric in getattr(model, "metrics", None) or ():
        walk(metric)
    return out


def _dense_differences(a, b, ra, rb):
    """The first difference between two ranks' `dense_signature`s, or
    None. Weights compare by position, shape and dtype (Keras numbers
    automatic names per process: a rank that made another layer first
    names the same weight `dense_2/kernel`); the names are for the
    message."""
    if a is None or b is None:
        return None
    if a["global_metrics"] != b["global_metrics"]:
        return (f"global logs are {'on' if a['global_metrics'] else 'off'} "
                f"on rank {ra}, {'on' if b['global_metrics'] else 'off'} on "
                f"rank {rb} (SOK_GLOBAL_METRICS, sok.init(global_metrics="
                "...))")
    problem = _metric_differences(a.get("metrics"), b.get("metrics"), ra,
                                  rb)
    if problem is not None:
        return problem
    wa, wb = a["weights"], b["weights"]
    for x, y in zip(wa, wb):
        if x[1:] != y[1:]:
            return (f"weight '{x[0]}' is {x[2]}{x[1]} on rank {ra}, "
                    f"'{y[0]}' {y[2]}{y[1]} on rank {rb}")
    if len(wa) != len(wb):
        more, extra = (ra, wa[len(wb)]) if len(wa) > len(wb) else (
            rb, wb[len(wa)])
        return (f"rank {more} has more weights ({len(wa)} on rank {ra}, "
                f"{len(wb)} on rank {rb}; the first extra one: "
                f"'{extra[0]}' {extra[2]}{extra[1]})")
    for x, y in zip(a.get("vocabularies") or [], b.get("vocabularies") or []):
        if x[1:] != y[1:]:
            what = ("bin boundaries" if x[1] == "Discretization"
                    else "vocabulary")
            return (f"layer '{x[0]}' ({x[1]}) has another {what} on rank "
                    f"{rb} than on rank {ra} ({x[2]} and {y[2]} entries): "
                    "`adapt` it on the same data on every rank (not on the "
                    "rank's own slice), or give it its "
                    f"{'bin_boundaries' if what != 'vocabulary' else what}"
                    "=")
    return None


def _metric_differences(a, b, ra, rb):
    """The first difference between two ranks' `_metric_signature`s (None
    where logs are not global), or None."""
    if a is None or b is None or a == b:
        return None
    names_a, names_b = [m[0] for m in a], [m[0] for m in b]
    if names_a != names_b:
        return (f"the metrics are {names_a} on rank {ra}, {names_b} on rank "
                f"{rb} (global logs combine every rank's metrics: compile "
                "each rank's model with the same metrics)")
    for (name, da), (_, db) in zip(a, b):
        if da != db:
            return (f"metric '{name}' is {_metric_text(da)} on rank {ra}, "
                    f"{_metric_text(db)} on rank {rb} (the same metric with "
                    "other arguments)")
    return None


def _metric_text(details):
    if details and isinstance(details[0], str):  # [class, config json]
        cls, config = details
        return f"{cls}({config})" if config else cls
    return "state " + ", ".join(f"{d}{s}" for s, d in details or ())


def compare(description, key, what):
    """Compares `description` (a dict with "tables" and optionally
    "lookups") across ranks; raises `InconsistentRanksError` on every rank
    when they differ.

    Args:
        description: this rank's `{"tables": [signature, ...],
            "lookups": [str, ...]}`.
        key: the collective key (the same on every rank).
        what: names the check in the error (e.g. "the first step of fit of
            model 'm'").
    """
    if world.num_ranks() == 1:
        return
    texts = _gather_texts(json.dumps(description, sort_keys=True), key)
    views = [json.loads(t) for t in texts]
    for r in range(1, len(views)):
        a, b = views[0], views[r]
        # Tables by name (a model lists them in its execution order, which
        # the lookup order below compares).
        problem = _table_differences(_by_name(a), _by_name(b), 0, r)
        if problem is None:
            problem = _dense_differences(a.get("dense"), b.get("dense"), 0,
                                         r)
        if problem is None and ("lookups" in a or "lookups" in b):
            problem = _lookup_differences(a.get("lookups", []),
                                          b.get("lookups", []), 0, r,
                                          "the step")
        if problem is not None:
            raise InconsistentRanksError(
                f"sok_keras: the ranks differ at {what}: {problem}. Every "
                "rank must build the same model: the same tables (same "
                "vocabulary size, dim, dtype, mode and optimizer), looked "
                "up in the same order, and the same other weights, "
                "metrics and settings.")


def check_table(table, what="load"):
    """Compares one table across ranks (e.g. before a layer loads it)."""
    if world.num_ranks() == 1:
        return
    table._sok_compared = True
    compare({"tables": [table_signature(table)]}, "consistency/table",
            f"{what} of table '{table.path or table.name}'")


def fit_batch_size(x, batch_size):
    """The per-rank batch size `fit` will train on, where it is known
    before the loop: a `tf.data.Dataset`'s static batch dimension (one
    batched with `drop_remainder=True`, as `sok.shard_batches` makes), or
    the `batch_size` of arrays (Keras' default 32). None otherwise."""
    if isinstance(x, tf.data.Dataset):
        for spec in tf.nest.flatten(x.element_spec):
            shape = getattr(spec, "shape", None)
            if shape is not None and shape.rank and shape[0] is not None:
                return int(shape[0])
        return None
    if isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)):
        return 32 if batch_size is None else int(batch_size)
    return None


def check_fit_batches(model, x, batch_size):
    """Raises `InconsistentRanksError` on every rank when the ranks would
    train on batches of other sizes: each would then train on its slice of
    another global batch (QA: ranks batching the same data by 64 and by 32
    before `sok.shard_batches` trained on silently), or when the seeds of
    the random stages before `sok.shard_batches` differ (`data.shard_seeds`).
    One eager all-gather; nothing in a world of one."""
    if world.num_ranks() == 1:
        return
    from sok_keras import data

    mine = [fit_batch_size(x, batch_size), data.shard_seeds(x)]
    gathered = [json.loads(t) for t in _gather_texts(json.dumps(mine),
                                                     "consistency/fit_batch")]
    sizes = [g[0] for g in gathered]
    known = {r: b for r, b in enumerate(sizes) if b is not None}
    if len(set(known.values())) > 1:
        text = ", ".join(f"{b} on rank {r}" for r, b in known.items())
        raise InconsistentRanksError(
            f"sok_keras: the ranks differ at the start of fit of model "
            f"'{model.name}': it trains on batches of {text}. Every rank "
            "must train on its slice of the same global batches: the same "
            "dataset, batched to the same global size on every rank, then "
            "`sok.shard_batches` (or arrays sliced `x[sok.rank()::"
            "sok.num_ranks()]` with the same `batch_size` everywhere).")
    seeds = {r: g[1] for r, g in enumerate(gathered) if g[1] is not None}
    if len(set(seeds.values())) > 1:
        raise InconsistentRanksError(
            data.seeds_differ_message(model.name, seeds))


def wrap_step(model, attr, kind):
    """Makes `model.<attr>` (train_step, test_step, predict_step) compare
    the tables and the step's lookups across ranks the first time it is
    traced, before the traced step runs."""
    original = getattr(model, attr)
    if getattr(original, "_sok_checked", False):
        return
    state = {"done": False}

    def step(*args, **kwargs):
        if state["done"] or tf.executing_eagerly():
            return original(*args, **kwargs)
        with _Recording() as lookups, shard_reads.watching() as ours:
            out = original(*args, **kwargs)
        state["done"] = True
        # An uncompiled model (predict only) has no optimizer attribute.
        optimizer = getattr(model, "optimizer", None)
        tables = model_tables(model)
        if world.num_ranks() > 1:
            # (Before the comparison: every rank refuses alike, and no
            # collective waits for one that raised.)
            shard_reads.refuse_other_reads(model, tables, ours)
        compare({"tables": [table_signature(t, optimizer) for t in tables],
                 "lookups": lookups, "dense": dense_signature(model)},
                f"consistency/{attr}",
                f"the first step of {kind} of model '{model.name}'")
        for t in tables:
            t._sok_compared = True
        return out

    step._sok_checked = True
    object.__setattr__(model, attr, step)
