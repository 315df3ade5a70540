"""Cross-rank consistency checks (issue P10, deliverable 3): ranks whose
tables or lookup orders differ fail when a loop starts (or at its first
step, or the first eager lookup, or at load), on every rank, with
an error naming the table, the field and both values."""

import pytest

from tests.multiprocess import run_sequence

# Well below SOK_COMM_TIMEOUT: a check that does not fire shows as a hung
# job (exit 124), not as a 10-minute wait.
TIMEOUT = 480
ENV = {"SOK_COMM_TIMEOUT": "600", "SOK_BACKEND": "collective"}
# Every (field, stage) of the tests below, in one 2-rank job (one TensorFlow
# start per rank for all): equal ranks first; each other case raises
# InconsistentRanksError on both ranks before any collective of a step, and
# the next one builds its own model. Last the lookup order in fit, found at
# the first step, whose aborted collectives end the ranks' use of them.
CASES = [
    ("none", "fit"),
    *[(f, "fit") for f in ("vocabulary_size", "embedding_dim", "dtype",
                           "mode", "optimizer", "table_optimizer", "count")],
    ("vocabulary_size", "evaluate"), ("vocabulary_size", "predict"),
    ("vocabulary_size", "load"), ("vocabulary_size", "eager"),
    ("vocabulary_size", "function"), ("embedding_dim", "function"),
    ("none", "function"),
    ("dense", "fit"), ("metrics", "fit"), ("metric_args", "fit"),
    ("vocabulary", "fit"), ("normalization", "fit"), ("batch", "fit"),
    ("order", "eager"), ("order", "fit"),
]


@pytest.fixture(scope="module")
def runs():
    results, output = run_sequence(
        [("consistency_tables", list(case)) for case in CASES], 2,
        timeout=TIMEOUT, env=ENV, output=True)
    return dict(zip(CASES, results)), output


@pytest.fixture
def _run(runs):
    def run(field, stage="fit"):
        by_case, output = runs
        r0, r1 = by_case[(field, stage)]
        case = CASES.index((field, stage))
        detail = (f"\n--- case {case}: {field} {stage}; the job's output "
                  f"---\n{output}")
        return r0, r1, detail

    return run


A = "a/embeddings"
B = "b/embeddings"


@pytest.mark.parametrize("field, values", [
    ("vocabulary_size", ("16", "17")),
    ("embedding_dim", ("4", "5")),
    ("dtype", ("'float32'", "'float64'")),
    ("mode", ("'distributed'", "'localized:0'")),
    ("optimizer", ("'SGD'", "'Adam'")),
    ("table_optimizer", ("'SGD'", "'Adagrad (the table's own)'")),
])
def test_different_tables_raise_on_every_rank(field, values, _run):
    r0, r1, detail = _run(field)
    name = field.replace("table_", "")
    expected = (f"table '{A}': {name} is {values[0]} on rank 0 and "
                f"{values[1]} on rank 1")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert expected in r["error"], detail
    assert r0["error"] == r1["error"], detail


def test_vocabulary_16_vs_17_message(_run):
    r0, r1, detail = _run("vocabulary_size")
    expected = f"table '{A}': vocabulary_size is 16 on rank 0 and 17 on rank 1"
    assert expected in r0["error"] and expected in r1["error"], detail
    # A built (functional) model is compared when fit starts, before Keras
    # builds the optimizer (whose broadcast of the dense weights would
    # otherwise hang on the different shapes).
    assert "the start of fit of model 'two_tables'" in r0["error"], detail


def test_different_lookup_order_raises_on_every_rank(_run):
    r0, r1, detail = _run("order")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        # (One id per sample: "auto" pools at home in a Keras step.)
        assert (f"lookup 1 of the step is lookup_one[sum,home]({A}) on rank "
                f"0 and lookup_one[sum,home]({B}) on rank 1") in r["error"], (
                    detail)


def test_different_dense_weights_raise_on_every_rank(_run):
    """A weight outside the tables of another shape (a Dense of another
    width) is found when fit starts (before: the ranks waited in the
    optimizer's broadcast of the dense weights until the communication
    timeout, with a message naming no layer)."""
    r0, r1, detail = _run("dense")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert ("weight 'hidden/kernel' is float32[8, 2] on rank 0, "
                "'hidden/kernel' float32[8, 3] on rank 1") in r["error"], (
                    detail)


def test_different_metrics_raise_on_every_rank(_run):
    """Ranks compiled with other metrics (no weight differs): global logs
    sum every rank's metric state, so the ranks met other collectives and
    waited until the communication timeout with a generic message."""
    r0, r1, detail = _run("metrics")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert ("the metrics are ['loss', 'auc'] on rank 0, ['loss', "
                "'auc', 'mae'] on rank 1") in r["error"], detail
        # Found before the first step (whose failure would abort the
        # collectives): from what compile was asked for.
        assert "the start of fit of model 'two_tables'" in r["error"], (
            detail)
    r0, r1, detail = _run("metric_args")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert "metric 'auc' is AUC(" in r["error"], detail
        on_0, on_1 = r["error"].split(" on rank 0, ")
        assert '"num_thresholds": 10' in on_0, detail
        assert '"num_thresholds": 20' in on_1, detail


def test_preprocessing_state_of_each_ranks_own_is_found(_run):
    """A lookup layer `adapt`ed on each rank's own slice maps ids (or
    strings) to other rows on each rank, with every table and weight of
    the same shape: found at the start of fit, naming the layer (QA: it
    trained on silently). A Normalization adapted per rank got rank 0's
    variables from the start of fit, but normalized with the tensors made
    from its own: it uses rank 0's on every rank now."""
    r0, r1, detail = _run("vocabulary")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert ("layer 'lookup' (IntegerLookup) has another vocabulary on "
                "rank 1 than on rank 0 (16 and 16 entries): `adapt` it on "
                "the same data on every rank") in r["error"], detail
    r0, r1, detail = _run("normalization")
    assert r0["error"] is None and r1["error"] is None, detail
    assert r0["mean"] == r1["mean"], detail


def test_different_number_of_tables_raises_on_every_rank(_run):
    r0, r1, detail = _run("count")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert "rank 0 has 2 tables" in r["error"], detail
        assert "rank 1 has 3" in r["error"], detail


@pytest.mark.parametrize("stage", ["evaluate", "predict"])
def test_checked_at_the_start_of_evaluate_and_predict(stage, _run):
    r0, r1, detail = _run("vocabulary_size", stage)
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert f"the start of {stage}" in r["error"], detail
        assert "vocabulary_size is 16 on rank 0 and 17 on rank 1" in (
            r["error"]), detail


def test_checked_at_load(_run):
    r0, r1, detail = _run("vocabulary_size", "load")
    for r in (r0, r1):
        # Keras' load_weights re-raises a layer's error as a ValueError
        # (InconsistentRanksError is one) quoting its message.
        assert r["type"] in ("InconsistentRanksError", "ValueError"), detail
        assert f"load of table '{A}'" in r["error"], detail
        assert "vocabulary_size is 16 on rank 0 and 17 on rank 1" in (
            r["error"]), detail


@pytest.mark.parametrize("field, expected", [
    ("vocabulary_size",
     f"table '{A}': vocabulary_size is 16 on rank 0 and 17 on rank 1"),
    ("order", f"table 1 is '{A}' on rank 0 and '{B}' on rank 1"),
])
def test_checked_at_the_first_eager_lookup(field, expected, _run):
    # A model called on a batch before fit looks its tables up at once.
    r0, r1, detail = _run(field, "eager")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert "the first lookup of table" in r["error"], detail
        assert expected in r["error"], detail


@pytest.mark.parametrize("field, expected", [
    ("vocabulary_size",
     f"table '{A}': vocabulary_size is 16 on rank 0 and 17 on rank 1"),
    ("embedding_dim",
     f"table '{A}': embedding_dim is 4 on rank 0 and 5 on rank 1"),
])
def test_checked_when_a_custom_step_is_traced(field, expected, _run):
    """A custom training step in a `tf.function` (SOK's way): the tables
    are compared when their lookups are traced, before the step's
    collectives run (before: tables of other sizes trained on silently,
    of other widths waited in the exchange until SOK_COMM_TIMEOUT)."""
    r0, r1, detail = _run(field, "function")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert "the first traced lookup of table" in r["error"], detail
        assert "train_step" in r["error"], detail  # the user's code
        assert expected in r["error"], detail


def test_different_global_batch_sizes_raise_on_every_rank(_run):
    """Ranks batching the same data to other global sizes before
    `sok.shard_batches` (QA: trained on silently, each rank on its slice of
    another global batch)."""
    r0, r1, detail = _run("batch")
    for r in (r0, r1):
        assert r["type"] == "InconsistentRanksError", detail
        assert ("the start of fit of model 'two_tables': it trains on "
                "batches of 4 on rank 0, 2 on rank 1.") in r["error"], detail


def test_equal_ranks_train_a_custom_step_without_error(_run):
    r0, r1, detail = _run("none", "function")
    assert r0["error"] is None and r1["error"] is None, detail


def test_equal_ranks_train_without_error(_run):
    r0, r1, detail = _run("none")
    assert r0["error"] is None and r1["error"] is None, detail


# -- the comparison, in one process --------------------------------------


def _sig(name="t", **kw):
    base = {"name": name, "vocabulary_size": 16, "embedding_dim": 4,
            "dtype": "float32", "mode": "distributed", "optimizer": "SGD"}
    base.update(kw)
    return base


def test_table_differences_name_the_field_and_both_values():
    from sok_keras import consistency

    assert consistency._table_differences(
        [_sig()], [_sig()], 0, 1) is None
    assert consistency._table_differences(
        [_sig()], [_sig(vocabulary_size=17)], 0, 1) == (
            "table 't': vocabulary_size is 16 on rank 0 and 17 on rank 1")
    assert consistency._table_differences(
        [_sig()], [_sig(mode="localized:1")], 0, 3) == (
            "table 't': mode is 'distributed' on rank 0 and 'localized:1' "
            "on rank 3")
    assert "rank 0 has 1 tables ['t'] and rank 1 has 2" in (
        consistency._table_differences([_sig()], [_sig(), _sig("u")], 0, 1))


def test_names_that_differ_in_keras_numbering_only_say_so():
    """QA: rank 0 alone built (and dropped) a model to look at it; the
    real model's layers were then numbered `_2` there, and the error said
    the ranks built different models. It now names the numbering."""
    from sok_keras import consistency

    a = [_sig("distributed_embedding_2/embeddings"), _sig("emb/embeddings")]
    b = [_sig("distributed_embedding/embeddings"), _sig("emb/embeddings")]
    text = consistency._table_differences(a, b, 0, 1)
    assert text.startswith(
        "table 1 is 'distributed_embedding_2/embeddings' on rank 0 and "
        "'distributed_embedding/embeddings' on rank 1"), text
    assert "differ only in a trailing number: if Keras numbered them" in (
        text), text
    assert "keras.utils.clear_session()" in text, text
    # Other names: no such hint.
    other = consistency._table_differences(
        [_sig("user/embeddings")], [_sig("item/embeddings")], 0, 1)
    assert "trailing number" not in other, other
    # Nor where the pair named differs by more than a number (review).
    mixed = consistency._table_differences(
        [_sig("a/embeddings"), _sig("b_1/embeddings")],
        [_sig("b/embeddings"), _sig("a_1/embeddings")], 0, 1)
    assert mixed.startswith(
        "table 1 is 'a/embeddings' on rank 0 and 'b/embeddings'"), mixed
    assert "trailing number" not in mixed, mixed


def test_lookup_differences():
    from sok_keras import consistency

    assert consistency._lookup_differences(["x", "y"], ["x", "y"], 0, 1,
                                           "the step") is None
    assert "lookup 2 of the step is y on rank 0 and z on rank 1" in (
        consistency._lookup_differences(["x", "y"], ["x", "z"], 0, 1,
                                        "the step"))
    assert "the step makes 1 lookups on rank 0 and 2 on rank 1" in (
        consistency._lookup_differences(["x"], ["x", "y"], 0, 1, "the step"))


def test_lookups_are_recorded_only_while_a_checked_step_is_traced():
    import numpy as np
    import tensorflow as tf

    import sok_keras as sok
    from sok_keras import consistency

    a = sok.Variable(np.ones((5, 2), np.float32), name="ta")
    b = sok.Variable(np.ones((7, 2), np.float32), name="tb")

    @tf.function
    def step(ids):
        return (sok.all2all_dense_embedding(b, ids) +
                sok.lookup_sparse(a, ids[:, None], combiners="sum")[:, None])

    with consistency._Recording() as lookups:
        step(tf.constant([1, 2], tf.int64))
    assert lookups == ["all2all_dense_embedding(tb)", "lookup_sparse(ta)",
                       "lookup_one[sum,auto](ta)"]
    step.python_function(tf.constant([1], tf.int64))  # eager: nothing kept
    assert lookups == ["all2all_dense_embedding(tb)", "lookup_sparse(ta)",
                       "lookup_one[sum,auto](ta)"]
