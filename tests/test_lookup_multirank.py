"""Lookup edge cases on 2 ranks: a rank with only padding, empty batches,
mixed precision."""

import re

import numpy as np

import pytest

from tests.multiprocess import run_sequence
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


@pytest.fixture(scope="module")
def two_ranks():
    """The 2-rank scenarios of this module in one job (one TensorFlow start
    per rank): edge cases, the pooling modes on the batch of many samples,
    and last the bad id (which ends in errors on purpose)."""
    edge, pooling, double, custom, layouts, bad_id, drift = run_sequence(
        [("edge_cases", []), ("pooling_modes", ["many"]),
         ("double_gradient", []), ("custom_step", ["extra"]),
         ("mixed_layouts", []), ("bad_id", []), ("custom_step", ["drift"])],
        2, timeout=480)
    return {"edge_cases": edge, "pooling_modes": pooling,
            "double_gradient": double, "custom_step": custom,
            "mixed_layouts": layouts, "bad_id": bad_id, "drift": drift}


def test_ranks_with_ids_in_different_layouts(two_ranks):
    """Dense ids on rank 0, the same ids as a SparseTensor or RaggedTensor
    on rank 1, in every pooling mode (before: dense vs sparse waited for
    SOK_COMM_TIMEOUT, then every later lookup failed)."""
    r0, r1 = two_ranks["mixed_layouts"]
    rows = [[2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]  # table rows 1, 2, 3
    plain = [[6.0, 8.0], [6.0, 7.0]]
    weighted = [[0.5 * 2 + 2 * 4, 0.5 * 3 + 2 * 5],
                [3 * rows[2][0], 3 * rows[2][1]]]
    keys = [k for k in r0 if "/" in k]  # (and the worker's pid)
    assert len(keys) == 24 and sorted(keys) == sorted(
        k for k in r1 if "/" in k), sorted(r0)
    for key in keys:
        want = weighted if "/True/" in key else plain
        assert r0[key] == want and r1[key] == want, (key, r0[key], r1[key])


def test_padding_only_rank_empty_batch_and_mixed_precision(two_ranks):
    r0, r1 = two_ranks["edge_cases"]
    # Rank 0: v rows 1+2 and 3; w (localized on rank 1) means of rows.
    assert r0["a"] == [[6.0, 8.0], [6.0, 7.0]]
    assert r0["b"] == [[4.5, 5.5, 6.5], [9.0, 10.0, 11.0]]
    assert r1["a"] == [[0.0, 0.0], [0.0, 0.0]]
    assert r1["b"] == [[0.0] * 3, [0.0] * 3]
    # Gradient rows live with the owners: v's ids {1, 2, 3} -> id 2 on
    # rank 0, ids 1 and 3 on rank 1; w is whole on rank 1.
    assert r0["grad_rows"] == [1, 0] and r1["grad_rows"] == [2, 3]
    # d(sum a)/dv: 2 per id (dim 2); d(sum b)/dw: 3 * (1/2 + 1/2 + 1).
    assert r0["grad_sums"][0] + r1["grad_sums"][0] == 6.0
    assert r1["grad_sums"][1] == 6.0
    for r in (r0, r1):
        # Eager gradients with respect to the weights equal TensorFlow's on
        # the whole table, also where a rank receives no id to pool (QA:
        # a wrong gradient or None, and a hang) or has only padding.
        assert len(r["eager_wgrads"]) == 7
        for key, (got, want) in r["eager_wgrads"].items():
            assert got is not None, key
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                                       err_msg=key)
        assert r["empty_shape"] == [0, 2]
        assert r["mixed"] == ["float16", "float32"]
        for what, error in r["plain_variable"].items():
            assert error.startswith("TypeError: sok_keras lookups need a "
                                    "sok_keras.Variable"), (what, error)


def test_pooling_on_the_owner_equals_pooling_at_home(two_ranks):
    # Each batch kind at one rank count (every weighting and pooling mode
    # on each): the one where pooling on the owner pays at 3 ranks (with
    # "mean", which has weights and denominators: the combiners' own math
    # does not depend on the rank count), the other at 2 with every
    # combiner (in the module's 2-rank job).
    three = run_workers(worker_path("pooling_modes"), 3, args=["few", "mean"],
                        timeout=240)
    for n, results, cases in ((2, two_ranks["pooling_modes"], 36),
                              (3, three, 12)):
        for r in results:
            assert r["cases"] == cases, (n, r)
            assert r["max_err"] < 1e-4, (n, r)
            assert r["max_grad_diff"] < 1e-4, (n, r)
            # The weights' gradient, home and on the owner, against
            # tf.nn.embedding_lookup_sparse's.
            assert r["max_wgrad_err"] < 1e-4, (n, r)
            # One id per sample: pooling on the owner never moves fewer
            # bytes, so "auto" in a Keras step traces no tf.cond of both
            # ways (QA: it tripled the trace of models of many one-id
            # tables); a custom tf.function keeps it.
            assert r["both_ways"] == {"fit": ["three/embeddings"],
                                      "function": ["one/embeddings"]}, (n, r)


def test_two_gradients_of_one_lookup_in_a_function(two_ranks):
    """Two `tape.gradient` calls of a persistent tape over one lookup in a
    `tf.function` (every pooling mode, and unpooled), in several steps,
    equal the same computed eagerly; so do lookups of one table in nested
    `tf.function`s and beside them in one step. Before the fixes their
    exchanges shared keys: TensorFlow's collective runtime aborted
    ("ProvideBuf already called") or hung."""
    for r in two_ranks["double_gradient"]:
        assert set(r["errors"]) == {"auto", "home", "owner", "unpooled",
                                    "nested"}
        for case, err in r["errors"].items():
            assert err < 1e-5, (case, err)


def test_a_custom_train_step_logs_global_metrics_and_keeps_ranks_equal(
        two_ranks):
    """A subclassed model's own `train_step` on 2 ranks: an extra entry
    in its logs (the learning rate) leaves the metric entries global (the
    same AUC as without it); dense weights applied by a plain optimizer,
    unaveraged, stop `fit` with an error naming them, on every rank.
    Before, the extra entry made AUC a mean of the ranks' values, and the
    ranks drifted apart silently."""
    r0, r1 = two_ranks["custom_step"]
    for r in (r0, r1):
        assert r["extra"]["auc"] == r["plain"]["auc"]
        assert r["extra"]["loss"] == r["plain"]["loss"]
        assert "lr" in r["extra"]
    assert r0["plain"] == r1["plain"]
    for r in two_ranks["drift"]:
        error = r["drift_error"]
        assert "differ between the ranks" in error, error
        assert re.search(r"dense(_\d+)?/kernel", error), error


def test_invalid_id_on_one_rank_raises_on_every_rank(two_ranks):
    """Every pooling mode and the fused multi-table exchange: rank 1's bad
    id raises the same error on both ranks (naming table, rank and id),
    nothing changes, the ranks stay in step. Before the fix, pooling
    'auto'/'owner' failed on rank 1 alone."""
    results = two_ranks["bad_id"]
    expected_after = [[9.0, 11.0, 13.0], [9.0, 10.0, 11.0]]
    for r in results:
        assert r["unchanged"]
        names = [k for k in r["cases"] if not k.endswith("/after")]
        assert len(names) == 10
        assert {"eager/fused", "function/fused"} <= set(names)
        for name in names:
            msg = r["cases"][name]
            assert "rank 1" in msg and "40" in msg, (name, msg)
            assert "tbl" in msg or "emb" in msg, (name, msg)
            after = r["cases"][name + "/after"]
            if "unpooled" not in name:
                assert after == expected_after, (name, after)
    # The same message on both ranks (past TensorFlow's device prefix).
    def ours(r):
        return {k: v[v.index("sok_keras:"):].split("\n")[0]
                if isinstance(v, str) else v for k, v in r["cases"].items()}

    assert ours(results[0]) == ours(results[1])
