"""All sok layers (EmbeddingCollection included) trained with model.fit on 2 and 3 ranks equal one
process; dense weights are broadcast from rank 0."""

import keras
import numpy as np
import pytest

from tests.layers_model import VOCABS
from tests.layers_model import build_and_fit
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path

STEPS, GLOBAL_BATCH = 20, 24


@pytest.fixture(scope="module")
def reference():
    keras.utils.clear_session()
    keras.utils.set_random_seed(0)  # rank 0's seed in the workers
    return build_and_fit(STEPS, GLOBAL_BATCH)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_all_layers_fit_on_ranks_matches_one_process(num_ranks, reference):
    results = run_workers(worker_path("layers_fit"), num_ranks,
                          args=[STEPS, GLOBAL_BATCH], timeout=180)
    for rank, r in enumerate(results):
        # Padding masked for mask-aware layers on every rank.
        assert r["mask_max_err"] < 1e-5, r["mask_max_err"]
        # Localized on the last rank; distributed split id % N.
        owner = num_ranks - 1
        assert r["local_rows"]["loc_emb"] == (
            VOCABS["loc"] if rank == owner else 0)
        assert r["local_rows"]["dist_emb"] == len(
            range(rank, VOCABS["dist"], num_ranks))
        assert r["local_rows"]["coll.t2"] == (VOCABS["t2"] if rank == 0
                                              else 0)
        np.testing.assert_allclose(r["losses"], reference["losses"],
                                   rtol=1e-5)
        for name, table in reference["tables"].items():
            np.testing.assert_allclose(r["tables"][name], table, rtol=1e-5,
                                       atol=1e-6, err_msg=name)
        for got, want in zip(r["dense"], reference["dense"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
