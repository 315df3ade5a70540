"""MirroredStrategy over 2 and 4 logical CPU devices (one process): the
replica communicator's collectives and exchange (eager and tf.function);
sok tables sharded over the replicas: the seed's custom-loop recipe,
`model.fit` (graph and eager), 100 steps of 3 sok layers, `model.save` /
`load_model`, lookups outside `strategy.run`, each against the same
program in one process without a strategy (docs/recipes.md)."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


@pytest.fixture(scope="module")
def result():
    return run_workers(worker_path("recipe_mirrored"), 1, timeout=240)[0]


def _expected(n):
    counts = [[i + j + 1 for j in range(n)] for i in range(n)]
    rows = {i: [[i, j, k] for j in range(n) for k in range(counts[i][j])]
            for i in range(n)}
    got = {j: [[i, j, k] for i in range(n) for k in range(counts[i][j])]
           for j in range(n)}
    grad = {}
    for i in range(n):
        g = []
        for j in range(n):
            offset = sum(counts[s][j] for s in range(i))
            g += [[offset + k + 1.0] * 3 for k in range(counts[i][j])]
        grad[i] = g
    return rows, got, grad


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("how", ["eager", "function"])
def test_replica_collectives(result, n, how):
    rows, got, grad = _expected(n)
    x = np.array([[r + 1.0, 10.0 * (r + 1)] for r in range(n)])
    replicas = result[str(n)][how]
    assert [r["rank"] for r in replicas] == list(range(n))
    for r, res in enumerate(replicas):
        assert res["sum"] == x.sum(0).tolist()
        assert res["mean"] == x.mean(0).tolist()
        assert res["max"] == x.max(0).tolist()
        assert res["gather"] == x.tolist()
        assert res["bcast"] == x[n - 1].tolist()
        assert res["rows"] == np.array(rows[r], float).tolist()
        assert res["got"] == np.array(got[r], float).tolist()
        assert res["back"] == res["rows"]  # exchange_back undoes it
        # The exchange's gradient is the reverse exchange.
        assert res["grad"] == grad[r]


@pytest.fixture(scope="module")
def trained():
    """One process per replica count (1 is the reference, no strategy)."""
    script = worker_path("recipe_mirrored_train")
    with ThreadPoolExecutor(3) as pool:
        jobs = {n: pool.submit(run_workers, script, 1, args=(str(n),),
                               timeout=400) for n in (1, 2, 4)}
        return {n: job.result()[0] for n, job in jobs.items()}


def _same_weights(got, want, rtol, atol):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = np.array(a), np.array(b)
        if a.shape != b.shape:  # All2AllDenseEmbedding: rows per GPU x N
            assert a.shape[1:] == b.shape[1:] and a.shape[0] > b.shape[0]
            a = a[:b.shape[0]]
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("n", [2, 4])
def test_tables_are_sharded_over_the_replicas(trained, n):
    run = trained[n]
    assert run["replicas"] == n
    num_ranks, shapes, devices = run["loop"]["shards"][0]
    # DemoModel's All2AllDenseEmbedding: 64 rows per replica, n shards.
    assert num_ranks == n and shapes == [[64, 8]] * n
    assert [d.split("device:")[1] for d in devices] == [
        f"CPU:{i}" for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_seed_custom_loop_parity(trained, n):
    """SOK's MirroredStrategy recipe (strategy.run / strategy.reduce, Adam
    on the tables through sok.OptimizerScope) against one process."""
    got, want = trained[n]["loop"], trained[1]["loop"]
    assert len(want["losses"]) == 4
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    # The seed's Adam(0.1): see the tolerance note in docs/recipes.md.
    _same_weights(got["weights"], want["weights"], 1e-5, 1e-4)


@pytest.mark.parametrize("n,part", [(2, "fit"), (2, "eager"), (2, "long"),
                                    (4, "long")])
def test_fit_under_mirrored_strategy_parity(trained, n, part):
    """`model.fit` of 3 sok layers (distributed, localized on the last
    replica, All2AllDenseEmbedding) + OptimizerWrapper(Adam): graph,
    eager, and 100 steps (no hang), against one process."""
    got = trained[n][part]
    want = trained[1]["long" if part == "long" else "fit"]
    assert len(got["loss"]) == 1
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    _same_weights(got["weights"], want["weights"], 1e-5, 1e-6)
    _same_weights(got["slots"], want["slots"], 1e-5, 1e-6)
    np.testing.assert_allclose(got["preds"], want["preds"], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("n", [2, 4])
def test_embedding_collection_inside_strategy_run(trained, n):
    """Pooled and unpooled features of a distributed and a localized table
    (`EmbeddingCollection`) and one `sok.optimizers.SGD` step inside
    `strategy.run`, against one process on the whole batch."""
    got, want = trained[n]["collection"], trained[1]["collection"]
    for k in ("user_id", "clicked", "history"):
        np.testing.assert_allclose(got["outputs"][k], want["outputs"][k],
                                   rtol=1e-6, atol=1e-6)
    _same_weights(got["tables"], want["tables"], 1e-6, 1e-6)
    for before, after in zip(got["initial"], got["tables"]):
        assert before != after  # the step trained both tables


@pytest.mark.parametrize("n", [2])
def test_save_and_load_under_mirrored_strategy(trained, n):
    fit = trained[n]["fit"]
    back = fit["saved"]["mirrored"]
    _same_weights(back["weights"], fit["weights"], 0, 0)
    assert back["slots"] == fit["slots"]
    assert back["preds"] == fit["preds"]
    # tf.train.Checkpoint restores every replica's shard of the tables and
    # of their Adam slots.
    assert fit["tf_checkpoint"] == {"cleared": True, "restored": True,
                                    "slots": 6}, fit["tf_checkpoint"]
    # Sharded checkpoints (one file per process rank) say what to use.
    assert "MirroredStrategy" in fit["dump_refused"]
    assert "model.save" in fit["dump_refused"]


@pytest.mark.parametrize("n", [2, 4])
def test_lookup_outside_strategy_run_reads_every_shard(trained, n):
    table = np.arange(17 * 3).reshape(17, 3)
    want = [table[[1, 2, 16]].sum(0), table[[3, 3, 0]].sum(0)]
    assert trained[n]["cross"] == np.array(want, float).tolist()


@pytest.mark.parametrize("n", [2, 4])
def test_table_made_outside_the_scope_is_refused(trained, n):
    message = trained[n]["refused"]
    assert message is not None
    assert f"MirroredStrategy with {n} replicas" in message
    assert "outside_table" in message and "strategy.scope()" in message


def _gpu_visible():
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


@pytest.mark.skipif(not _gpu_visible(), reason="no GPU visible")
def test_mirrored_strategy_on_two_logical_gpus():
    """The same recipes with 2 logical GPUs on the first GPU, against one
    process on that GPU without a strategy."""
    script = worker_path("recipe_mirrored_train")
    with ThreadPoolExecutor(2) as pool:
        jobs = {n: pool.submit(run_workers, script, 1, args=(str(n), "GPU"),
                               timeout=400) for n in (1, 2)}
        runs = {n: job.result()[0] for n, job in jobs.items()}
    got, want = runs[2], runs[1]
    assert all("GPU" in d for d in got["loop"]["shards"][0][2])
    np.testing.assert_allclose(got["loop"]["losses"], want["loop"]["losses"],
                               rtol=1e-5)
    _same_weights(got["loop"]["weights"], want["loop"]["weights"], 1e-5, 1e-4)
    for part in ("fit", "long"):
        np.testing.assert_allclose(got[part]["loss"], want[part]["loss"],
                                   rtol=1e-5)
        _same_weights(got[part]["weights"], want[part]["weights"], 1e-5, 1e-6)
