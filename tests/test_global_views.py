"""Global views (sok_keras/global_views.py): global parameter counts,
gathered predictions, and collective calls made on some ranks only."""

import io
import contextlib

import keras
import numpy as np
import pytest

import sok_keras as sok
from sok_keras import global_views
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


def test_keras_still_counts_what_we_patch():
    """sok_keras replaces keras.src.utils.summary_utils.count_params and
    weight_memory_size, which Layer.count_params and Model.summary call:
    fail loudly if Keras moves them."""
    import inspect

    from keras.src.utils import summary_utils

    assert getattr(summary_utils.count_params, "_sok_keras", False)
    assert getattr(summary_utils.weight_memory_size, "_sok_keras", False)
    layer_src = inspect.getsource(keras.layers.Layer.count_params)
    assert "summary_utils.count_params(" in layer_src
    summary_src = inspect.getsource(summary_utils.print_summary)
    assert "count_params(" in summary_src
    assert "weight_memory_size(" in summary_src


def test_one_rank_counts_are_keras_counts():
    ids = keras.Input((2,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(17, 3, name="emb")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    assert model.count_params() == 17 * 3 + 4
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.summary()
    assert "Total params: 55" in out.getvalue()
    assert "Sharded tables" not in out.getvalue()  # one rank: no note


@pytest.mark.parametrize("layer", ["distributed", "localized", "a2a",
                                   "collection"])
def test_summary_of_a_subclassed_model_that_owns_a_sok_layer(layer):
    """A layer built by a call, not in a functional model: Keras' summary
    asks it for its output shape with `build`'s argument name (before:
    TypeError, unexpected keyword argument 'input_shape')."""
    make = {
        "distributed": lambda: sok.layers.DistributedEmbedding(20, 4),
        "localized": lambda: sok.layers.LocalizedEmbedding(20, 4),
        "a2a": lambda: sok.layers.All2AllDenseEmbedding(
            20, 4, slot_num=1, nnz_per_slot=3),
        "collection": lambda: sok.layers.EmbeddingCollection(
            tables={"t": {"vocabulary_size": 20, "embedding_dim": 4}},
            features={"f": {"table": "t"}}),
    }[layer]

    class Owner(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = make()
            self.head = keras.layers.Dense(1)

        def call(self, x):
            e = self.emb(x)
            return self.head(e["f"] if isinstance(e, dict) else e)

    ids = np.array([[1, 2, 3], [4, 5, 6]])
    model = Owner()
    model({"f": ids} if layer == "collection" else
          ids.reshape(2, 1, 3) if layer == "a2a" else ids)
    counts = _summary_counts(model)
    assert counts["Total params"] == 20 * 4 + 5, counts


def _summary_counts(model):
    lines = []
    model.summary(print_fn=lambda text, **kw: lines.append(text))
    return {line.split(":")[0].strip(): int(
        line.split(":")[1].split("(")[0].replace(",", ""))
        for line in "\n".join(lines).splitlines()
        if line.strip().endswith(")") and "params:" in line}


def test_summary_counts_the_tables_slots_as_optimizer_params():
    """Adam's m and v of a table live on the table, not in
    `optimizer.variables`: the summary counts them as Keras counts the
    moments of a keras.layers.Embedding."""
    def fitted(layer, optimizer):
        ids = keras.Input((1,), dtype="int64")  # one id: pooled == flat
        x = keras.layers.Flatten()(layer(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(x))
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(np.arange(20).reshape(20, 1), np.zeros((20, 1)),
                  verbose=0)
        return model

    ours = _summary_counts(fitted(
        sok.layers.DistributedEmbedding(50, 4),
        sok.OptimizerWrapper(keras.optimizers.Adam())))
    theirs = _summary_counts(fitted(keras.layers.Embedding(50, 4),
                                    keras.optimizers.Adam()))
    assert ours["Trainable params"] == theirs["Trainable params"]
    own = len(sok.OptimizerWrapper(keras.optimizers.Adam()).variables)
    # Both: iterations, learning rate, m and v of every weight.
    slots = 2 * 50 * 4
    assert ours["Optimizer params"] >= slots
    assert ours["Optimizer params"] - theirs["Optimizer params"] == (
        own - len(keras.optimizers.Adam().variables))
    assert ours["Total params"] == (ours["Trainable params"]
                                    + ours["Optimizer params"])


def test_gather_predictions_in_a_world_of_one():
    y = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(sok.gather_predictions(y), y)
    got = sok.gather_predictions({"a": y, "b": (y[:, 0],)})
    np.testing.assert_array_equal(got["b"][0], y[:, 0])
    np.testing.assert_array_equal(
        sok.gather_predictions(y, batch_size=len(y)), y)
    with pytest.raises(ValueError, match="multiple of it"):
        sok.gather_predictions(y[:3], batch_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        sok.gather_predictions(y, batch_size=0)
    with pytest.raises(ValueError, match="rows dimension"):
        sok.gather_predictions(np.float32(1.0))
    np.testing.assert_array_equal(sok.gather_predictions(y, strided=True), y)
    with pytest.raises(ValueError, match="not both"):
        sok.gather_predictions(y, batch_size=1, strided=True)
    with pytest.raises(TypeError, match="True or False"):
        sok.gather_predictions(y, strided="yes")


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", "1e12"])
def test_enter_timeout_is_checked(monkeypatch, value):
    """(QA: `inf` and `1e12` were taken, and each agreement's deadline
    thread then died of an OverflowError, so no RankMismatchError could
    come.)"""
    monkeypatch.setenv("SOK_SAVE_TIMEOUT", value)
    with pytest.raises(RuntimeError, match=f"SOK_SAVE_TIMEOUT.*'{value}'"):
        global_views.enter_timeout()
    monkeypatch.setenv("SOK_SAVE_TIMEOUT", "2.5")
    assert global_views.enter_timeout() == 2.5


@pytest.mark.parametrize("last,what", [
    ("predict", "model.predict"), ("load", "keras.saving.load_model"),
    ("restore", "ShardedCheckpoint('"),
    ("export", "sok.export_for_serving('"),
    # (QA: it waited SOK_COMM_TIMEOUT, then named a gather's key.)
    ("read_global", "table 'emb/embeddings'.read_global()")])
def test_global_views_on_two_ranks(tmp_path, last, what):
    """Counts and summary are global (before: 918,560 shown for a
    1,837,120-parameter table's shard); gather_predictions returns every
    rank's rows in rank order; predict, load_model,
    ShardedCheckpoint.restore_latest or model.export on rank 0 only fails
    within SOK_SAVE_TIMEOUT (before: waited for the 300-600 s
    communication timeout); loading a plain Keras model on one rank is not
    stopped; `set_weights` of a whole table, or of another layer's shard,
    says to use `assign_global` (before: Keras' bare shape mismatch)."""
    r0, r1 = run_workers(worker_path("global_views"), 2,
                         args=[str(tmp_path), last], timeout=300,
                         env={"SOK_SAVE_TIMEOUT": "5"})
    total = 1001 * 8 + 8 * 2 + 2
    for r in (r0, r1):
        assert r["count_params"] == total and r["loaded_count"] == total
        assert r["layer_count"] == 1001 * 8
        assert ("set_weights takes this rank's shard of table "
                "'emb/embeddings'" in r["set_whole"]
                and "assign_global(table)" in r["set_whole"]), r["set_whole"]
        # (QA: rank 1 got Keras' bare "weight shape (50, 4) is not
        # compatible with provided weight shape (0, 4)".)
        assert ("LocalizedEmbedding 'placed1': set_weights takes this "
                "rank's shard of table 'placed1/embeddings'" in r["set_other"]
                and "assign_global(table)" in r["set_other"]), r["set_other"]
        assert f"Trainable params: {total:,}" in r["summary"]
        assert "Sharded tables" in r["summary"]
        assert (f"{1001 * 8:,} params (1,001 x 8), "
                f"{r['local_rows'] * 8:,} on this rank") in r["summary"]
        assert r["gathered"] == r0["mine"] + r1["mine"]
        assert r["nested_b"] == [0] * 5 + [1] * 3 and r["nested_a_equal"]
        assert r["batched"] == [0, 1, 10, 11, 2, 3, 12, 13]
        assert "same number of rows" in r["batched_uneven"], r
        assert r["strided"] == [1.5 * i for i in range(7)]
        assert "[4, 4] rows per rank. Received: [5, 3]" in (
            r["strided_uneven"]), r
    assert r0["whole_shape"] == r1["whole_shape"] == [1001, 8]
    assert (r0["local_rows"], r1["local_rows"]) == (501, 500)
    assert r0["plain_load"] == "no error"
    assert r0[last].startswith("RankMismatchError"), r0[last]
    assert what in r0[last] and "every rank (2 ranks)" in r0[last]
    assert r0[last + "_s"] < 30, r0[last + "_s"]
