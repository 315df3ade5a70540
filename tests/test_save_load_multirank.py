"""A .keras file saved at N ranks loads at M ranks; tables re-shard."""

import keras
import numpy as np

from sok_keras.optimizers import OptimizerWrapper  # noqa: F401 (registers)
from tests.multiprocess import launch
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.training_setup import VOCAB
from tests.training_setup import make_model_and_data


def test_save_on_two_ranks_load_on_one_and_three(tmp_path):
    path = str(tmp_path / "model.keras")
    saved = run_workers(worker_path("save_load"), 2, args=["save", path],
                        timeout=120)
    loaded3 = run_workers(worker_path("save_load"), 3, args=["load", path],
                          timeout=120)
    assert [r["local_rows"] for r in loaded3] == [
        len(range(i, sum(VOCAB), 3)) for i in range(3)]
    # One process, here.
    _, _, (x, y) = make_model_and_data("sok", "adam", 8, 48)
    model = keras.models.load_model(path)
    model.fit({k: v[:48] for k, v in x.items()}, y[:48], batch_size=48,
              verbose=0)
    probe = {k: v[:96] for k, v in x.items()}
    one = model.predict(probe, verbose=0).ravel()
    emb = model.get_layer("embedding").embeddings
    assert sorted(emb.slots) == ["m", "v"]
    for results in (saved, loaded3):
        for r in results:
            assert r["slots"] == ["m", "v"]
            np.testing.assert_allclose(r["predictions"], one, rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(r["table"], emb.numpy().ravel(),
                                       rtol=1e-5, atol=1e-6)


def test_several_tables_in_one_step_on_two_and_three_ranks():
    for n in (2, 3):
        results = run_workers(worker_path("multi_table"), n, args=["same"],
                              timeout=120)
        for r in results:
            np.testing.assert_allclose(r["sums"], r["expected"], rtol=1e-4)
            # lookup_sparse over the three tables (one fused exchange per
            # direction) equals three separate lookups, values and grads.
            assert r["fused_max_diff"] < 1e-6


def test_mismatched_collective_order_times_out_with_a_clear_error():
    job = launch(worker_path("multi_table"), 2, args=["reversed"],
                 timeout=120, env={"SOK_COMM_TIMEOUT": "5"})
    assert job.returncode != 0
    assert job.elapsed < 90, job.output
    assert "got no answer from its peers" in job.output, job.output
    assert "rank 1" in job.output or "rank 0" in job.output
    assert job.leftovers == []
