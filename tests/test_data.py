"""shard_batches: each rank keeps its contiguous slice of global batches."""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import data
from sok_keras import world


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(rank, n):
        monkeypatch.setattr(world, "_WORLD", None)
        monkeypatch.setenv("SOK_RANK", str(rank))
        monkeypatch.setenv("SOK_NUM_RANKS", str(n))
        monkeypatch.setenv(
            "SOK_WORKER_ADDRS", ",".join(f"127.0.0.1:{i + 1}" for i in range(n))
        )

    return set_rank


def _global(batch=8, steps=3):
    ids = np.arange(batch * steps * 2).reshape(-1, 2)
    labels = np.arange(batch * steps, dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices(({"ids": ids}, labels))
    return ds.batch(batch, drop_remainder=True), ids, labels


@pytest.mark.parametrize("n", [1, 2, 4])
def test_each_rank_keeps_its_slice(as_rank, n):
    batch = 8
    b = batch // n
    for rank in range(n):
        as_rank(rank, n)
        ds, ids, labels = _global(batch)
        out = list(data.shard_batches(ds, global_batch_size=batch))
        assert len(out) == 3  # same number of steps on every rank
        for step, (x, y) in enumerate(out):
            lo = step * batch + rank * b
            np.testing.assert_array_equal(x["ids"].numpy(), ids[lo : lo + b])
            np.testing.assert_array_equal(y.numpy(), labels[lo : lo + b])


def test_structures_ragged_and_single_tensor(as_rank):
    as_rank(1, 2)
    ds = tf.data.Dataset.range(8).batch(4, drop_remainder=True)
    got = [t.numpy().tolist() for t in data.shard_batches(ds)]
    assert got == [[2, 3], [6, 7]]
    rt = tf.ragged.constant([[1], [2, 2], [], [4, 4, 4]])
    ds = tf.data.Dataset.from_tensor_slices((rt, tf.range(4))).batch(
        4, drop_remainder=True)
    (r, i), = list(data.shard_batches(ds))
    assert r.to_list() == [[], [4, 4, 4]] and i.numpy().tolist() == [2, 3]
    ds = tf.data.Dataset.from_tensors(
        (tf.sparse.from_dense(tf.eye(4)),)).map(lambda s: (s,))
    (s,), = list(data.shard_batches(ds))
    np.testing.assert_array_equal(tf.sparse.to_dense(s).numpy(), np.eye(4)[2:])


def test_an_unseeded_shuffle_is_refused_on_several_ranks(as_rank):
    """Each rank would shuffle with its own seed and keep its slice of
    another global batch (before: 259 of 1024 rows trained twice per epoch
    on 2 ranks, 259 never, with no error)."""
    base = tf.data.Dataset.range(64)
    tf.random.set_seed(None)  # no global seed
    unseeded = base.shuffle(64).batch(8, drop_remainder=True).prefetch(1)
    seeded = base.shuffle(64, seed=7).batch(8, drop_remainder=True)
    tf.random.set_seed(3)  # a global seed gives every shuffle a seed
    globally = base.shuffle(64).batch(8, drop_remainder=True)
    tf.random.set_seed(None)
    as_rank(0, 2)
    with pytest.raises(ValueError, match=(
            r"shuffles with no seed .* each of the 2 ranks would shuffle "
            r"differently")):
        data.shard_batches(unseeded)
    for ds in (seeded, globally):
        rows = [t.numpy().tolist() for t in data.shard_batches(ds)]
        assert len(rows) == 8 and all(len(r) == 4 for r in rows)
    as_rank(0, 1)  # one process: its own shuffle is fine
    assert data.shard_batches(unseeded) is unseeded


def test_errors(as_rank):
    as_rank(0, 2)
    ds = tf.data.Dataset.range(10).batch(4)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        data.shard_batches(ds)
    ds = tf.data.Dataset.range(9).batch(3, drop_remainder=True)
    with pytest.raises(ValueError, match="global batch size 3 is not divisible"
                       " by the number of ranks 2"):
        data.shard_batches(ds)
    ds = tf.data.Dataset.range(8).batch(4, drop_remainder=True)
    with pytest.raises(ValueError, match="global_batch_size=6 but"):
        data.shard_batches(ds, global_batch_size=6)
    # Before: "global_batch_size=4 but the dataset's batches have 4 rows".
    for bad in ("4", 4.0, True):
        with pytest.raises(TypeError, match="must be an int or None"):
            data.shard_batches(ds, global_batch_size=bad)
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        data.shard_batches([1, 2])
    # A sparse component made in a map after batching: the message names
    # it and says how to give the size back (before: only "batch with
    # drop_remainder=True", which the user had done).
    ids = tf.ragged.constant([[1, 2], [3], [], [4, 5, 6]], dtype=tf.int64)
    ds = tf.data.Dataset.zip(
        tf.data.Dataset.from_tensor_slices(ids),
        tf.data.Dataset.range(4)).ragged_batch(2, drop_remainder=True)
    with pytest.raises(ValueError, match=r"component\(s\) \['#0'\].*"
                       r"other components have 2 rows.*set_shape"):
        data.shard_batches(ds.map(lambda r, y: (r.to_sparse(), y)))

    def sized(r, y):
        s = r.to_sparse()
        s.set_shape([2, None])
        return s, y

    (s, _), _ = list(data.shard_batches(ds.map(sized)))
    assert int(s.dense_shape[0]) == 1
