"""A .keras file saved at N ranks loads at M ranks; tables re-shard."""

import os

import keras
import numpy as np
import pytest

from sok_keras.optimizers import OptimizerWrapper  # noqa: F401 (registers)
from tests.multiprocess import launch
from tests.multiprocess import run_sequence
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.training_setup import VOCAB
from tests.training_setup import make_model_and_data


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """This module's scenarios in two jobs (one TensorFlow start per rank
    for all of them): at 2 ranks save_load "save", multi_table "same" and
    save_streaming "save"; then at 3 ranks save_load "load", multi_table
    "same" and save_streaming "load" (save_streaming last: it patches
    sok_keras' chunk size and h5 access for its own checks)."""
    base = tmp_path_factory.mktemp("save_load")
    path, folder = str(base / "model.keras"), str(base / "streaming")
    placed = str(base / "placed.keras")
    tf_ckpt = str(base / "tf_checkpoint")
    raw = str(base / "raw_table.keras")
    os.makedirs(folder)
    two = run_sequence(
        [("save_load", ["save", path]), ("multi_table", ["same"]),
         ("placement_save", [placed]), ("tf_checkpoint", [tf_ckpt]),
         ("raw_table", ["save", raw]),
         ("save_streaming", ["save", folder])], 2, timeout=420)
    three = run_sequence(
        [("save_load", ["load", path]), ("multi_table", ["same"]),
         ("raw_table", ["load", raw]),
         ("save_streaming", ["load", folder])], 3, timeout=420)
    return {"path": path, "folder": folder, "placed": placed, "two": two,
            "three": three, "raw": raw}


def test_save_on_two_ranks_load_on_one_and_three(jobs):
    """Saved at 2 ranks, loaded at 3 and at 1: the same slots, and the next
    5 steps give the losses of the uninterrupted run (the saving job
    continuing), to 1e-6."""
    path = jobs["path"]
    saved, loaded3 = jobs["two"][0], jobs["three"][0]
    assert [r["local_rows"] for r in loaded3] == [
        len(range(i, sum(VOCAB), 3)) for i in range(3)]
    # One process, here: the same 5 steps after loading.
    model = keras.models.load_model(path)
    emb = model.get_layer("embedding").embeddings
    assert sorted(emb.slots) == ["m", "v"]
    loaded_slots = {k: emb.slots[k].numpy().ravel().tolist()
                    for k in sorted(emb.slots)}
    _, _, (x, y) = make_model_and_data("sok", "adam", 8, 48)
    probe = {k: v[:96] for k, v in x.items()}
    _, _, (more_x, more_y) = make_model_and_data("sok", "adam", 5, 48)
    losses = []
    for step in range(5):
        part = {k: v[step * 48:(step + 1) * 48] for k, v in more_x.items()}
        model.fit(part, more_y[step * 48:(step + 1) * 48], batch_size=48,
                  verbose=0)
        losses.append(float(model.test_on_batch(probe, y[:96])))
    one = model.predict(probe, verbose=0).ravel()
    # Identical slots after loading, at 1 and 3 ranks.
    for r in [*loaded3]:
        assert r["slots_at_save"] == saved[0]["slots_at_save"]
    assert loaded_slots == saved[0]["slots_at_save"]
    # The next 5 steps: the losses of the uninterrupted (saving) run.
    for results in (saved, loaded3):
        for r in results:
            assert r["slots"] == ["m", "v"]
            np.testing.assert_allclose(r["losses"], saved[0]["losses"],
                                       rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(r["predictions"], one, rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(r["table"], emb.numpy().ravel(),
                                       rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, saved[0]["losses"], rtol=1e-6,
                               atol=1e-6)


def test_several_tables_in_one_step_on_two_and_three_ranks(jobs):
    for n in (2, 3):
        results = jobs["two" if n == 2 else "three"][1]
        for rank, r in enumerate(results):
            np.testing.assert_allclose(r["sums"], r["expected"], rtol=1e-4,
                                       err_msg=f"rank {rank} of {n}")
            # lookup_sparse over the three tables (one fused exchange per
            # direction) equals three separate lookups, values and grads.
            assert r["fused_max_diff"] < 1e-6, (n, rank, r)


def test_mismatched_lookup_order_in_a_custom_function_is_refused():
    """Odd ranks build a custom tf.function's lookups in another order:
    the tables' first traced lookups are compared (before: the exchanges
    paired other tables' collectives, and the watchdog's timeout ended
    the job)."""
    job = launch(worker_path("multi_table"), 2, args=["reversed"],
                 timeout=120, env={"SOK_COMM_TIMEOUT": "60"})
    assert job.returncode != 0
    assert job.elapsed < 90, job.output
    assert ("InconsistentRanksError: sok_keras: the ranks differ at the "
            "first traced lookup of table") in job.output, job.output
    assert "table 1 is 'a' on rank 0 and 'c' on rank 1" in job.output
    assert job.leftovers == []


def test_streamed_save_reads_own_rows_and_exports_on_several_ranks(
        jobs, tmp_path):
    """One 2-rank job: model.save streams a distributed table, a table
    localized on rank 1 and an EmbeddingCollection (slots included) in
    4 KiB chunks; the file holds every table whole; no block rank 0 got
    was over the chunk size, nor any tensor a communicator sent for
    `read_global` of a table or slot; a write failing half-way through a table
    raises on both ranks and leaves the file as it was; export_for_serving
    (and Keras' `model.export`, and the export of the model nested in
    another functional model) writes one SavedModel that predicts the
    same without sok_keras, as does the export of a subclassed model
    (traced on rank 0 alone, its lookups redirected). Then
    load_model at 3 ranks: each rank reads exactly its own rows of each
    dataset, and they equal the saved rows."""
    from tests.test_serving import serve_without_sok

    folder = jobs["folder"]
    r0, r1 = jobs["two"][5]
    assert r0["in_file"] and all(r0["in_file"].values()), r0["in_file"]
    assert len(r0["in_file"]) == 9  # 3 tables, each with m and v
    assert 0 < r0["max_received"] <= r0["chunk_bytes"]
    # `read_global` (and a slot's) too: one collective of a whole shard
    # could pass gRPC's 2 GiB message limit.
    for r in (r0, r1):
        assert 0 < r["max_sent_reading_whole"] <= r["chunk_bytes"], r
    assert "disk full (injected)" in r0["failure"], r0["failure"]
    np.testing.assert_allclose(r0["subclassed"], r1["subclassed"])
    assert "rank 1: model.save(" in r1["failure"], r1["failure"]
    assert "failed on rank 0 (of 2 ranks)" in r1["failure"], r1["failure"]
    assert r0["unchanged"] and r0["leftovers"] == [] == r1["leftovers"]
    np.testing.assert_allclose(r0["predictions"], r1["predictions"])
    expected = np.load(os.path.join(folder, "expected.npz"))
    probe = {k[len("probe_"):]: expected[k] for k in expected.files
             if k.startswith("probe_")}
    # model.export and the model nested in another: the same
    for name in ("serving", "serving_keras", "serving_nested"):
        served = serve_without_sok(os.path.join(folder, name), probe,
                                   tmp_path)
        np.testing.assert_allclose(served.ravel(), r0["predictions"],
                                   rtol=1e-6, atol=1e-6)
    served = serve_without_sok(os.path.join(folder, "serving_subclassed"),
                               {"": probe["ids"]}, tmp_path)
    np.testing.assert_allclose(served.ravel(), r0["subclassed"], rtol=1e-6,
                               atol=1e-6)

    loaded = jobs["three"][3]
    for rank, r in enumerate(loaded):
        assert all(r["same"].values()), (rank, r["same"])
        assert len(r["same"]) == 9
        # Every dataset this rank read: exactly its own rows, nothing more
        # (the localized table: everything on rank 1, nothing elsewhere).
        expected_reads = {k: n for k, n in r["local_rows"].items() if n}
        assert r["reads"] == expected_reads, (rank, r["reads"])
        np.testing.assert_allclose(r["predictions"], r0["predictions"],
                                   rtol=1e-5, atol=1e-6)
    assert loaded[1]["local_rows"]["loc"] == 97
    assert loaded[0]["local_rows"]["loc"] == 0


def test_tables_placed_on_a_rank_load_on_fewer_ranks_and_clone(jobs):
    """A file of 2 ranks with tables on rank 1 (an explicit rank, the
    round-robin's second, an EmbeddingCollection's "localized:1") loads at
    1 rank, every table on rank 0, with the same predictions; at 2 ranks a
    `clone_model` puts the tables where the original's are, so
    `set_weights(model.get_weights())` gives the same model."""
    import sok_keras as sok

    results = jobs["two"][2]
    for r in results:
        assert r["placed"]["pinned"] == 1
        assert {r["placed"]["auto1"], r["placed"]["auto2"]} == {0, 1}
        assert r["clone_placed"] == r["placed"]
        np.testing.assert_allclose(r["clone_predictions"], r["predictions"],
                                   rtol=1e-6)
    model = keras.models.load_model(jobs["placed"])
    assert sok.num_ranks() == 1
    for name in ("pinned", "auto1", "auto2"):
        assert model.get_layer(name)._placed_rank == 0
        np.testing.assert_array_equal(
            model.get_layer(name).embeddings.numpy(),
            np.asarray(results[0]["tables"][name], np.float32))
    assert model.get_layer("coll").embeddings["t"].mode == "localized:0"
    rng = np.random.default_rng(0)
    data = {k: rng.integers(0, 25, (16, 2)) for k in ("a", "b", "c", "d")}
    np.testing.assert_allclose(model.predict(data, verbose=0).ravel(),
                               results[0]["predictions"], rtol=1e-5,
                               atol=1e-6)


def test_a_subclassed_model_saved_on_two_ranks_loads_on_two_and_one(
        tmp_path):
    """Its table is made inside Keras' StatelessScope when load_model
    rebuilds it (deferred, then filled from the file with this rank's
    rows)."""
    from tests import layers_model  # noqa: F401 (registers the model)
    from tests.multiprocess import run_workers

    results = run_workers(worker_path("subclassed_save_load"), 2,
                          args=[str(tmp_path)], timeout=240)
    for r in results:
        assert r["max_diff"] == 0.0 and r["same_table"], results
    assert [r["shard_rows"] for r in results] == [51, 50]
    model = keras.models.load_model(str(tmp_path / "ranker.keras"))
    assert model.emb.embeddings.shape == (101, 4)
    np.testing.assert_array_equal(
        model.predict(np.load(tmp_path / "probe.npy"), verbose=0),
        np.load(tmp_path / "expected.npy"))


def test_a_table_a_model_holds_itself_is_saved_whole(jobs):
    """A subclassed model holding a `sok.Variable` itself (SOK's way):
    saved at 2 ranks, loaded at 3 and at 1, its whole table and Adam's
    slots come back, and it predicts as the saved model. Before (QA): the
    file held rank 0's 20 of 41 rows and no slots; loaded at 2 ranks the
    table was wrong without an error, at 1 or 3 Keras refused the shape."""
    from tests import layers_model  # noqa: F401 (registers the model)

    saved, loaded = jobs["two"][4], jobs["three"][2]
    assert [r["shard_rows"] for r in saved] == [21, 20]
    assert [r["shard_rows"] for r in loaded] == [14, 14, 13]
    assert sorted(saved[0]["slots"]) == ["m", "v"]
    model = keras.models.load_model(jobs["raw"])
    one = {"table": model.table.read_global().tolist(),
           "slots": {k: s.read_global().tolist()
                     for k, s in sorted(model.table.slots.items())}}
    for r in [*loaded, one]:
        assert r["table"] == saved[0]["table"]
        assert r["slots"] == saved[0]["slots"]
    probe = np.arange(60).reshape(20, 3) % 41
    for got in [r["predictions"] for r in loaded] + [
            model.predict(probe, verbose=0).ravel().tolist()]:
        np.testing.assert_allclose(got, saved[0]["predictions"], rtol=1e-6,
                                   atol=1e-6)


def test_tf_checkpoint_restores_a_ranks_own_shard_and_refuses_anothers(jobs):
    """tf.train.Checkpoint holds this rank's shard: a rank restores its own;
    another rank's is refused with both shards named (before: rank 0 got
    rank 1's rows without a word when the shards had the same shape), and
    the table is left as it was."""
    for rank, r in enumerate(jobs["two"][3]):
        assert r["own_restored"], r
        msg = r["other_error"]
        assert msg is not None, r
        assert f"holds the shard of rank {1 - rank} of 2" in msg, msg
        assert f"this is rank {rank} of 2" in msg and "sok.dump" in msg, msg
        assert r["other_unchanged"], r


def test_ranks_given_different_files_refuse_them(tmp_path):
    """`load_model`, `load_weights`, `sok.load` with another file on each
    rank, and `save_weights` to another path on each: every rank raises
    naming the path (before: the loads mixed two checkpoints, each rank
    reading its rows of its own file, and rank 1's save said it saved a
    file only rank 0's path got); `sok.dump` into another folder on each
    rank says so and leaves no file."""
    results = run_workers(worker_path("same_file"), 2,
                          args=[str(tmp_path)], timeout=240)
    for r, res in enumerate(results):
        for key in ("load_model", "load_weights", "sok_load",
                    "save_weights", "save"):
            assert "the ranks were not given the same file" in res[key], (
                r, key, res[key])
            assert f"rank {r}:" in res[key], (r, key, res[key])
        assert "Nothing was loaded" in res["sok_load"]
        for key in ("save_weights", "save"):
            assert "(nothing was written)" in res[key], res[key]
            if r == 1:  # rank 0's temporary file is not in its folder
                assert "not where rank 0 writes it" in res[key], res[key]
        assert res["same_path_loads"]
    # The files the saves named are as they were (before: rank 0's was
    # replaced by a save that then failed), and no temporary file is left.
    assert results[0]["written"] == {
        n: "OLD" for n in ("s0.keras", "s1.keras", "w0.weights.h5",
                           "w1.weights.h5")}, results[0]["written"]
    # sok.dump into another folder on each rank (before: rank 0's bare
    # NotFoundError on rank 1's record, and rank 1's files left behind).
    assert ("rank 1 wrote its rows, but its record" in results[0]["sok_dump"]
            and "not in rank 0's folder" in results[0]["sok_dump"]), (
                results[0]["sok_dump"])
    assert "failed on rank(s) [0]" in results[1]["sok_dump"], (
        results[1]["sok_dump"])
    assert [r["dump_leftovers"] for r in results] == [[], []]

