"""`All2AllDenseEmbedding`, SOK's unpooled fixed-shape layer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from tests.testing import assert_config_round_trip
from tests.testing import assert_model_saving


def test_output_shape_and_rows():
    layer = sok.layers.All2AllDenseEmbedding(
        max_vocabulary_size_per_gpu=20, embedding_vec_size=4, slot_num=3,
        nnz_per_slot=2)
    ids = np.random.default_rng(0).integers(0, 20, size=(5, 3, 2))
    out = layer(ids)
    assert out.shape == (5, 3, 2, 4)
    table = layer.embeddings.numpy()
    np.testing.assert_allclose(out.numpy(), table[ids], rtol=1e-6)


def test_shape_errors_and_hashtable():
    layer = sok.layers.All2AllDenseEmbedding(10, 4, slot_num=3,
                                             nnz_per_slot=2, name="dense_emb")
    with pytest.raises(ValueError, match=r"dense_emb.*\[batch, 3, 2\]"):
        layer(np.zeros((2, 3, 5), np.int64))
    with pytest.raises(ValueError, match="use_hashtable"):
        sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, use_hashtable=True)
    # (Before: accepted and ignored.)
    with pytest.raises(ValueError, match="dynamic_input.*combiner=None"):
        sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, dynamic_input=True)
    sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, dynamic_input=False)
    with pytest.raises(ValueError, match="no `combiner`.*'sum'"):
        sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, combiner="sum")


def test_sok_1_positional_arguments_and_embedding_variable():
    """SOK 1's positional `(max_vocabulary_size_per_gpu,
    embedding_vec_size, slot_num, nnz_per_slot, dynamic_input,
    use_hashtable, key_dtype)`: the first four are this layer's; the
    others' places hold other arguments here, refused with what to do
    (before: "Could not interpret initializer identifier: False" and the
    like). SOK 1's `embedding_variable` is the table."""
    for args in ((False,), (False, False), (False, False, tf.int64)):
        with pytest.raises(ValueError, match=r"not SOK 1's `dynamic_input`"
                           r".*by name.*Received: embeddings_initializer="
                           r"False"):
            sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, *args)
    with pytest.raises(ValueError, match=r"Received: optimizer=tf.int64"):
        sok.layers.All2AllDenseEmbedding(10, 4, 3, 2, "uniform", None,
                                         tf.int64)
    layer = sok.layers.All2AllDenseEmbedding(
        10, 4, 3, 2, dynamic_input=False, use_hashtable=False,
        key_dtype=tf.int64)
    with pytest.raises(AttributeError, match="no table yet"):
        layer.embedding_variable
    layer(np.zeros((1, 3, 2), np.int64))
    assert layer.embedding_variable is layer.embeddings


def test_config_and_saving(tmp_path):
    layer = sok.layers.All2AllDenseEmbedding(
        16, 3, slot_num=2, nnz_per_slot=2, vocabulary_size=40, name="a2a")
    clone = assert_config_round_trip(layer)
    assert clone.vocabulary_size == 40 and clone.slot_num == 2
    ids = keras.Input(shape=(2, 2), dtype="int64")
    out = keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids)))
    model = keras.Model(ids, out)
    x = np.random.default_rng(1).integers(0, 40, size=(6, 2, 2))
    assert_model_saving(model, x, tmp_path)


def test_the_config_keeps_the_tables_rows_at_any_number_of_ranks(
        monkeypatch):
    """Without `vocabulary_size` the table has max_vocabulary_size_per_gpu
    x N rows; the config records those rows, so a model saved at 2 ranks
    loads at 1 (before: the config rebuilt 16 x 1 rows there, and loading
    the saved 32-row table failed on its shape)."""
    from sok_keras import replicas

    monkeypatch.setattr(replicas, "table_ranks", lambda: 2)
    layer = sok.layers.All2AllDenseEmbedding(16, 3, slot_num=2,
                                             nnz_per_slot=2)
    config = layer.get_config()
    monkeypatch.undo()
    assert layer.vocabulary_size == 32
    clone = sok.layers.All2AllDenseEmbedding.from_config(config)
    assert clone.vocabulary_size == 32
    assert clone.max_vocabulary_size_per_gpu == 16


def test_ragged_and_sparse_ids_are_a_clear_error_and_the_output_has_no_mask():
    """SOK's fixed-shape layer: ragged or sparse ids get an error naming the
    layer and what to use (before: "object of type 'RaggedTensor' has no
    len()"); every id is a row, so the output carries no mask (before: an
    always-true one, and Keras' Flatten warned that it drops it)."""
    layer = sok.layers.All2AllDenseEmbedding(10, 2, slot_num=1,
                                             nnz_per_slot=2, name="a2a")
    ragged = tf.ragged.constant([[[1, 2]], [[3]]])
    with pytest.raises(TypeError, match="'a2a'.*DistributedEmbedding"):
        layer(ragged)
    with pytest.raises(TypeError, match="'a2a'.*SparseTensor"):
        layer(tf.sparse.from_dense(tf.constant([[[1, 2]]], tf.int64)))
    ids = keras.Input((1, 2), dtype="int64")
    out = layer(ids)
    assert getattr(out, "_keras_mask", None) is None
    assert layer.compute_mask(ids) is None
