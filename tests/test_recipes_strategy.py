"""SOK's MultiWorkerMirroredStrategy recipe on 2 workers (the program's own
strategy from TF_CONFIG, sok adopting it), and Keras `model.fit` under the
strategy with sok layers; compared with one process."""

import numpy as np
import pytest

from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.testing import assert_adam_parity


@pytest.fixture(scope="module")
def runs():
    two = run_workers(worker_path("recipe_mwms"), 2, timeout=300)
    one = run_workers(worker_path("recipe_mwms"), 1, timeout=300)
    return two, one[0]


def _compare(two, one, part, atol, adam=False):
    for r in (0, 1):
        np.testing.assert_allclose(two[r][part]["losses"],
                                   one[part]["losses"], rtol=1e-5)
    for a, b, c in zip(two[0][part]["weights"], two[1][part]["weights"],
                       one[part]["weights"]):
        a, b, c = np.array(a), np.array(b), np.array(c)
        np.testing.assert_array_equal(a, b)  # workers agree bitwise
        if a.shape != c.shape:  # All2AllDenseEmbedding: rows per GPU x N
            a = a[:c.shape[0]]
        if adam:
            assert_adam_parity(a, c, rtol=1e-5, atol=atol)
        else:
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=atol)


def test_sok_adopts_the_programs_strategy(runs):
    two, _ = runs
    for r in (0, 1):
        rank, size, _, adopted = two[r]["world"]
        assert (rank, size, adopted) == (r, 2, True)


def test_custom_loop_parity(runs):
    two, one = runs
    assert len(one["loop"]["losses"]) == 4
    # The seed's Adam(0.1): tests/testing.py, assert_adam_parity.
    _compare(two, one, "loop", atol=1e-4, adam=True)


def test_fit_under_multi_worker_strategy_parity(runs):
    two, one = runs
    assert len(one["fit"]["losses"]) == 2
    _compare(two, one, "fit", atol=1e-6)


def test_three_sok_layers_100_steps_of_fit_parity(runs):
    """`model.fit` of 3 sok layers (distributed, localized on the last
    worker, All2AllDenseEmbedding) under the strategy: 100 steps, no hang,
    parity with one process."""
    two, one = runs
    assert one["long"]["steps"] == 100
    assert [two[r]["long"]["steps"] for r in (0, 1)] == [100, 100]
    _compare(two, one, "long", atol=1e-6)


def test_save_inside_the_strategy_scope(runs):
    """`model.save` / `save_weights` inside the scope on every rank: no hang,
    and the file loads with the trained weights."""
    two, _ = runs
    for r in (0, 1):
        assert two[r]["saved_in_scope_s"] < 60, two[r]["saved_in_scope_s"]
        for a, b in zip(two[r]["loaded_weights"], two[r]["long"]["weights"]):
            np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_upstream_keras_20585_still_open(runs):
    """A plain Keras model's `fit` under the same 2-worker strategy still
    fails in `_maybe_symbolic_build` (keras-team/keras#20585). When this
    test fails, Keras fixed it: remove sok_keras/compat/keras_mwms.py and
    its install() in sok_keras/world.py."""
    two, _ = runs
    for r in (0, 1):
        message = two[r]["upstream_bug"]
        assert message is not None, (
            "keras-team/keras#20585 looks fixed upstream: plain fit under "
            "MultiWorkerMirroredStrategy worked; drop "
            "sok_keras.compat.keras_mwms")
        assert "PerReplica" in message
