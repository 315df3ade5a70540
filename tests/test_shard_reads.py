"""A model that reads a sharded table other than by looking ids up (tied
output weights) is refused on N ranks, in every Keras loop, naming the
table and the op; it runs on one rank, and a model that only looks its
tables up runs on N (tests/workers/tied_weights.py)."""

import pytest

from tests.multiprocess import run_workers
from tests.multiprocess import worker_path

KINDS = ("distributed", "localized", "collection")


def _run(ranks, *args):
    results = run_workers(worker_path("tied_weights"), ranks, timeout=300,
                          args=list(args))
    return [{k: v for k, v in r.items() if k != "pid"} for r in results]


def test_tied_output_weights_run_on_one_rank():
    (r,) = _run(1, "tied", *KINDS)
    assert len(r) == 18 and all(e is None for e in r.values()), r


@pytest.mark.parametrize("model", ["dense", "penalty"])
def test_models_that_only_look_tables_up_run_on_two_ranks(model):
    """"penalty" also reads the shard elementwise (a penalty on it times the
    number of ranks, as docs/design.md recommends): right on N ranks."""
    for r in _run(2, model, *KINDS):
        assert len(r) == 18 and all(e is None for e in r.values()), r


@pytest.mark.parametrize("model,case", [
    ("tied", "distributed/predict"), ("tied", "localized/fit"),
    ("tied", "collection/evaluate"), ("gather", "distributed/fit"),
    ("tied", "distributed/train_on_batch"),
    ("tied", "localized/predict_on_batch")])
def test_tied_output_weights_are_refused_on_two_ranks(model, case):
    """Before: `predict` returned logits over this rank's rows, `fit`
    trained against other items than the labels name (or failed in the
    loss with a bare shape error)."""
    table = "items/t" if case.startswith("collection") else "items/embeddings"
    op = "ReadVariableOp" if model == "tied" else "Gather"
    for rank, r in enumerate(_run(2, model, case)):
        assert list(r) == [case], r
        name, message = r[case]
        # (The rank that learns of the other's failure first raises
        # RankDivergedError quoting it: sok_keras/divergence.py.)
        assert name in ("ValueError", "RankDivergedError"), (rank, r)
        for word in (table, "other than by looking ids up",
                     op, "2 ranks", "this rank's part"):
            assert word in message, (rank, word, message)
