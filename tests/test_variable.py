"""`sok_keras.Variable` in a world of one process."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras.variable import global_to_local
from sok_keras.variable import parse_mode
from sok_keras.variable import shard_rows


def test_variable_is_a_keras_variable_holding_the_table():
    v = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype=tf.float32,
                     name="t")
    assert isinstance(v, keras.Variable)
    assert v.shape == (17, 3) and v.global_shape == (17, 3)
    assert v.mode == "distributed" and v.target_rank == -1
    assert v.dtype == "float32"
    np.testing.assert_array_equal(v.numpy()[5], [15, 16, 17])


def test_shard_rule_matches_sok():
    # 17 rows on 2 ranks -> 9 and 8; row id lives at id // N on id % N.
    assert [shard_rows(17, "distributed", -1, r, 2) for r in (0, 1)] == [9, 8]
    assert [shard_rows(17, "distributed", -1, r, 3) for r in range(3)] == [
        6, 6, 5]
    np.testing.assert_array_equal(
        global_to_local(7, "distributed", 1, 3), [1, 4])
    assert shard_rows(17, "localized", 1, 1, 2) == 17
    assert shard_rows(17, "localized", 1, 0, 2) == 0


def test_modes_and_errors():
    assert parse_mode("localized:0", 1) == ("localized", 0)
    with pytest.raises(ValueError, match="localized:3"):
        parse_mode("localized:3", 2, "t")
    with pytest.raises(ValueError, match="'bogus'"):
        sok.Variable(np.zeros((3, 2)), mode="bogus")
    with pytest.raises(ValueError, match="2-D"):
        sok.Variable(np.zeros((3,)))
    with pytest.raises(ValueError, match="shape"):
        sok.Variable("uniform")
    v = sok.Variable("zeros", shape=(4, 3), mode="localized:0")
    assert v.shape == (4, 3) and v.mode == "localized:0"


def test_filter_variables():
    v = sok.Variable(np.zeros((3, 2)))
    d = keras.Variable(np.zeros((2,)))
    assert sok.filter_variables([d, v]) == ([v], [d])
    assert sok.split_embedding_variable_from_others([v, d]) == ([v], [d])


def test_world_of_one():
    sok.init()
    assert sok.rank() == 0 and sok.num_ranks() == 1
    sok.Init(global_batch_size=1024)  # the seed's spelling
    assert sok.rank() == 0 and sok.num_ranks() == 1
