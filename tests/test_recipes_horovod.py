"""SOK's Horovod recipes through `sok_keras.compat.horovod` on 2 ranks
(sokrun), compared with one process on the same global batch."""

import json

import numpy as np
import pytest

from sok_keras import world
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.testing import assert_adam_parity


@pytest.fixture(scope="module")
def runs():
    two = run_workers(worker_path("recipe_horovod"), 2, timeout=300)
    one = run_workers(worker_path("recipe_horovod"), 1, timeout=300)
    return two, one[0]


def test_world_and_collectives(runs):
    two, _ = runs
    for r in (0, 1):
        res = two[r]
        assert (res["rank"], res["size"]) == (r, 2)
        assert (res["local_rank"], res["local_size"]) == (r, 2)
        c = res["collectives"]
        assert c["average"] == [1.5, 15.0]
        assert c["sum"] == [3.0, 30.0]
        assert c["max"] == [2.0, 20.0]
        assert c["scaled"] == [3.0, 30.0]
        # Ragged allgather: rank 0 sent 1 row of 0s, rank 1 2 rows of 1s.
        assert c["allgather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert c["broadcast"] == [8]  # root_rank=1 sent 1 + 7
        assert c["tf_variable"] == [3.0]  # rank 0's
        # IndexedSlices: gathered, values averaged (rows 0 and 1).
        assert c["sparse"] == [[0.5, 1.0], [1.0, 2.0], [0.0, 0.0]]
        assert c["in_function"] == [[1.5, 15.0], [6.0, 60.0],
                                    [1.0, 2.0, 20.0]]


def test_collectives_have_horovods_gradients(runs):
    """Rank s's loss weighs each collective's output by s + 1; each rank
    gets the gradient of the ranks' summed losses (Horovod's rules).
    Before, a GradientTape through them failed: "gradient registry has no
    entry for: CollectiveGatherV2" (and a model gathering in-batch
    negatives from every rank could not train)."""
    two, one = runs
    w = [1.0, 2.0]  # the ranks' weights
    for r in (0, 1):
        for mode in ("eager", "function"):
            g = two[r]["gradients"][mode]
            np.testing.assert_allclose(g["average"], [sum(w) / 2] * 2)
            np.testing.assert_allclose(g["sum"], [sum(w)] * 2)
            # rank 0 sent 1 copy of `a` (gathered row 0), rank 1 two
            # (rows 1, 2); position k of the gathered [3, 2] is weighed
            # by k: d/da is the sum of this rank's rows of k.
            k = np.arange(6.0).reshape(3, 2)
            mine = k[:1] if r == 0 else k[1:]
            np.testing.assert_allclose(g["allgather"],
                                       sum(w) * mine.sum(0))
            np.testing.assert_allclose(
                g["broadcast"], [sum(w) if r == 1 else 0.0] * 2)
    g = one["gradients"]["eager"]  # one rank: plain identities
    np.testing.assert_allclose(g["allgather"], [0.0, 1.0])
    np.testing.assert_allclose(g["sum"], [1.0, 1.0])


def test_in_batch_negatives_gathered_from_every_rank_train_as_one_process():
    """A two-tower model scoring its users against the whole global
    batch's items (`hvd.allgather` in a custom `train_step`) trains on 2
    ranks the model 1 process trains (before: LookupError, no gradient
    for the gather)."""
    two = run_workers(worker_path("global_negatives"), 2, timeout=240)
    one = run_workers(worker_path("global_negatives"), 1, timeout=240)[0]
    for r in two:
        np.testing.assert_allclose(r["loss"], one["loss"], rtol=1e-5)
        for a, b in zip(r["tables"] + r["dense"],
                        one["tables"] + one["dense"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_experimental_recipe(runs):
    two, one = runs
    assert two[0]["experimental"]["shapes"] == [[9, 3], [4, 5]]
    assert two[1]["experimental"]["shapes"] == [[8, 3], [3, 5]]
    assert two[0]["experimental"]["grad_rows"] == [1, 1]
    assert two[1]["experimental"]["grad_rows"] == [3, 2]
    for res in (two[0], two[1], one):
        assert res["experimental"]["emb"] == [
            [[6, 8, 10], [36, 39, 42]], [[5, 6, 7, 8, 9], [25, 27, 29, 31, 33]]]
    # SGD(1.0) on the summed gradient: both ranks looked the ids up.
    d1 = np.arange(51.0).reshape(17, 3) - np.array(
        two[0]["experimental"]["after"][0])
    expected = np.zeros((17, 3))
    expected[1] = 4
    expected[[3, 4, 5]] = 2
    np.testing.assert_array_equal(d1, expected)


def _compare(two, one, part, rtol, atol, adam=False):
    for r in (0, 1):
        np.testing.assert_allclose(two[r][part]["losses"],
                                   one[part]["losses"], rtol=1e-5)
    w0, w1, ref = (two[0][part]["weights"], two[1][part]["weights"],
                   one[part]["weights"])
    assert len(w0) == len(ref)
    for a, b, c in zip(w0, w1, ref):
        a, b, c = np.array(a), np.array(b), np.array(c)
        np.testing.assert_array_equal(a, b)  # ranks agree bitwise
        rows = min(a.shape[0], c.shape[0]) if a.ndim == 2 else None
        # All2AllDenseEmbedding's table has max_vocabulary_size_per_gpu *
        # N rows; the ids are below the one-process size.
        if rows is not None and a.shape != c.shape:
            a, c = a[:rows], c[:rows]
        if adam:
            assert_adam_parity(a, c, rtol=rtol, atol=atol)
        else:
            np.testing.assert_allclose(a, c, rtol=rtol, atol=atol)


def test_demo_model_recipe_parity(runs):
    two, one = runs
    assert np.all(np.isfinite(one["demo"]["losses"]))
    # Losses to 1e-5. Weights: the seed's Adam(0.1) magnifies a float32
    # rounding difference (another summation order) in a near-zero
    # gradient component (tests/testing.py, assert_adam_parity).
    _compare(two, one, "demo", rtol=1e-5, atol=1e-4, adam=True)


def test_three_sok_layers_100_steps_parity(runs):
    two, one = runs
    assert len(one["three_layers"]["losses"]) == 100
    _compare(two, one, "three_layers", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("env, expected", [
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "MASTER_PORT": "7000"},
     (1, 2, "horovodrun (Gloo)")),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1", "h:2", "h:3"]},
                               "task": {"type": "worker", "index": 2}})},
     (2, 3, "TF_CONFIG")),
])
def test_world_sources(env, expected):
    w = world.world_from_env(env)
    assert (w.rank, w.num_ranks, w.source) == expected


@pytest.mark.parametrize("config", [
    {"cluster": {"worker": ["h:1"], "chief": ["h:0"]},
     "task": {"type": "worker", "index": 0}},
    {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 3}},
    "not json",
])
def test_bad_tf_config(config):
    text = config if isinstance(config, str) else json.dumps(config)
    with pytest.raises(RuntimeError, match="TF_CONFIG"):
        world.world_from_env({"TF_CONFIG": text})


def test_bad_arguments_are_refused():
    import tensorflow as tf

    import sok_keras as sok
    import sok_keras.compat.horovod as hvd

    hvd.init()
    x = tf.constant([1.0])
    with pytest.raises(ValueError, match="Adasum|adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(ValueError, match="unknown op"):
        hvd.allreduce(x, op="median")
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    table = sok.Variable(np.zeros((4, 2)), dtype="float32", name="t")
    with pytest.raises(ValueError, match="sharded"):
        hvd.allreduce(table)
    with pytest.raises(ValueError, match="root_rank"):
        hvd.broadcast(x, root_rank=1)
    with pytest.raises(ValueError, match="process sets"):
        hvd.allgather(x, process_set=object())
    with pytest.raises(ValueError, match="num_groups"):
        hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2)
    # One rank: every collective is the identity.
    assert hvd.allreduce(x).numpy().tolist() == [1.0]
    # Horovod's spellings in SOK's DLRM trainer (before: AttributeError).
    for compression in (hvd.compression.NoneCompressor,
                        hvd.Compression.none):
        assert hvd.allreduce(x, op=hvd.mpi_ops.Sum,
                             compression=compression).numpy().tolist() == [1.0]
    assert hvd.mpi_ops.Sum == hvd.Sum and hvd.mpi_ops.Average == hvd.Average
    assert hvd.broadcast_variables([table], root_rank=0) == []


def test_three_sok_layers_100_steps_of_fit_on_sokrun_ranks(runs):
    """Plain `model.fit` (no strategy, no hvd) of the same 3 sok layers on
    `sokrun -np 2`: 100 steps, no hang, parity with one process."""
    two, one = runs
    assert one["fit_three_layers"]["steps"] == 100
    for r in (0, 1):
        got = two[r]["fit_three_layers"]
        assert got["steps"] == 100
        np.testing.assert_allclose(got["loss"],
                                   one["fit_three_layers"]["loss"],
                                   rtol=1e-5)
    for a, b, c in zip(two[0]["fit_three_layers"]["weights"],
                       two[1]["fit_three_layers"]["weights"],
                       one["fit_three_layers"]["weights"]):
        a, b, c = np.array(a), np.array(b), np.array(c)
        np.testing.assert_array_equal(a, b)
        if a.shape != c.shape:  # All2AllDenseEmbedding: rows per GPU x N
            a = a[:c.shape[0]]
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,hint", [
    ("join", "the same steps"), ("barrier", "allreduce"),
    ("broadcast_object", "hvd.broadcast"), ("elastic", "not supported"),
    ("no_such_name", "")])
def test_horovod_names_it_lacks_say_what_it_has(name, hint):
    """A ported script's `hvd.join()` etc. say what to do instead and list
    what the module provides (before: a bare "has no attribute")."""
    import sok_keras.compat.horovod as hvd

    with pytest.raises(AttributeError) as e:
        getattr(hvd, name)
    message = str(e.value)
    assert repr(name) in message and hint in message
    for provided in ("allreduce", "DistributedGradientTape",
                     "broadcast_variables", "docs/recipes.md"):
        assert provided in message
    assert not hasattr(hvd, "__no_such_dunder__")


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_local_size_that_is_no_number_of_ranks_names_the_variable(
        monkeypatch, value):
    """QA: `LOCAL_WORLD_SIZE=abc` was passed over (local_size() 1), and 0
    returned as is."""
    import sok_keras.compat.horovod as hvd

    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE",
                 "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE must be the "
                       f"number of ranks on this host.*got '{value}'"):
        hvd.local_size()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert hvd.local_size() == 3
