"""The seed example on 2 ranks: shard shapes, embeddings, gradient rows."""

import numpy as np
import pytest

from tests.multiprocess import run_sequence

EMB1 = [[6, 8, 10], [36, 39, 42]]
EMB2 = [[5, 6, 7, 8, 9], [25, 27, 29, 31, 33]]


@pytest.fixture(scope="module")
def runs():
    """Both modes of the seed example in one 2-rank job."""
    distributed, localized = run_sequence(
        [("seed_example", ["distributed"]), ("seed_example", ["localized"])],
        2, timeout=150)
    return {"distributed": distributed, "localized": localized}


def _expected_delta():
    # Both ranks look up the same ids and SGD(1.0) applies the summed
    # gradient (no averaging without OptimizerWrapper): 2 ranks x counts.
    d1 = np.zeros((17, 3))
    d1[1] = 2 * 2
    d1[[3, 4, 5]] = 2
    d2 = np.zeros((7, 5))
    d2[[1, 2, 3]] = 2
    return d1, d2


def test_seed_example_distributed_on_two_ranks(runs):
    results = runs["distributed"]
    assert results[0]["shapes"] == [[9, 3], [4, 5]]
    assert results[1]["shapes"] == [[8, 3], [3, 5]]
    for r in results:
        assert r["emb"] == [EMB1, EMB2]
    # The seed: v1 has 1 gradient row on rank 0 and 3 on rank 1; v2 1 and 2.
    assert results[0]["grad_rows"] == [1, 1]
    assert results[1]["grad_rows"] == [3, 2]
    # Local rows: id 4 -> row 2 on rank 0; ids 1, 3, 5 -> rows 0, 1, 2.
    assert results[0]["grad_indices"] == [[2], [1]]
    assert results[1]["grad_indices"] == [[0, 1, 2], [0, 1]]
    d1, d2 = _expected_delta()
    for r in results:
        np.testing.assert_array_equal(r["delta"][0], d1)
        np.testing.assert_array_equal(r["delta"][1], d2)
        # The tf.function lookups (run twice, same keys) see the new tables.
        after1 = np.arange(51.0).reshape(17, 3) - d1
        after2 = np.arange(35.0).reshape(7, 5) - d2
        for o in r["fn"]:
            np.testing.assert_allclose(
                o[0], [after1[1], after1[3:6].mean(0)], rtol=1e-6)
            np.testing.assert_allclose(
                o[1], [after2[1], after2[2] + after2[3]], rtol=1e-6)


def test_seed_example_localized_on_two_ranks(runs):
    results = runs["localized"]
    assert results[0]["shapes"] == [[17, 3], [0, 5]]
    assert results[1]["shapes"] == [[0, 3], [7, 5]]
    for r in results:
        assert r["emb"] == [EMB1, EMB2]
    # The seed: localized, v1's gradient has 4 rows on rank 0 and none on
    # rank 1; v2's has 3 rows on rank 1.
    assert results[0]["grad_rows"][0] == 4
    assert results[1]["grad_rows"][1] == 3
    assert results[1]["grad_rows"][0] == 0 and results[0]["grad_rows"][1] == 0
