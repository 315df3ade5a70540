"""`LocalizedEmbedding` in one process."""

import keras
import numpy as np
import pytest

import sok_keras as sok
from tests.testing import assert_config_round_trip
from tests.testing import assert_model_saving


def test_lookup_equals_table_rows():
    table = np.random.default_rng(0).normal(size=(12, 3)).astype(np.float32)
    layer = sok.layers.LocalizedEmbedding(12, 3, combiner="sum", rank=0)
    layer.build()
    layer.embeddings.assign(table)
    assert layer.embeddings.mode == "localized:0"
    out = layer(np.array([[1, 2], [11, -1]]))
    np.testing.assert_allclose(
        out.numpy(), [table[1] + table[2], table[11]], rtol=1e-6)


def test_rank_validation():
    with pytest.raises(ValueError, match="rank.*-1"):
        sok.layers.LocalizedEmbedding(4, 2, rank=-1)
    layer = sok.layers.LocalizedEmbedding(4, 2, rank=1)
    with pytest.raises(ValueError, match="rank=1.*1 rank"):
        layer.build()


def test_config_and_saving(tmp_path):
    layer = sok.layers.LocalizedEmbedding(
        30, 4, combiner="mean", rank=0, name="loc",
        embeddings_initializer="ones")
    clone = assert_config_round_trip(layer)
    assert clone.rank == 0
    ids = keras.Input(shape=(3,), dtype="int32")
    out = keras.layers.Dense(2)(layer(ids))
    model = keras.Model(ids, out)
    x = np.random.default_rng(1).integers(0, 30, size=(8, 3))
    assert_model_saving(model, x, tmp_path)


def test_round_robin_starts_again_after_clear_session(monkeypatch):
    """The same model code after `keras.utils.clear_session()` places its
    tables alike (QA: on 2 ranks the second model's table went to rank 1,
    and a per-rank checkpoint of the first no longer restored)."""
    from sok_keras import replicas

    monkeypatch.setattr(replicas, "table_ranks", lambda: 2)

    def placed():
        return sok.layers.LocalizedEmbedding(10, 2)._table_mode()

    for _ in range(2):
        keras.utils.clear_session()
        assert [placed(), placed(), placed()] == [
            "localized:0", "localized:1", "localized:0"]
    explicit = sok.layers.LocalizedEmbedding(10, 2, rank=0)
    assert explicit._table_mode() == "localized:0"
    assert placed() == "localized:1"  # an explicit rank takes no turn

