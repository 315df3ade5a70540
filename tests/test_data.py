"""shard_batches: each rank keeps its contiguous slice of global batches."""

import re

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import data
from sok_keras import world
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


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
            r"has a `shuffle` with no seed, so each of the 2 ranks would "
            r"read other global batches")):
        data.shard_batches(unseeded)
    for ds in (seeded, globally):
        rows = [t.numpy().tolist() for t in data.shard_batches(ds)]
        assert len(rows) == 8 and all(len(r) == 4 for r in rows)
    as_rank(0, 1)  # one process: its own shuffle is fine
    assert data.shard_batches(unseeded) is unseeded


def test_other_randomness_is_refused_on_several_ranks(as_rank):
    """Each of these makes each process read other global batches, as an
    unseeded shuffle does; `shard_batches` refused only the shuffle (QA:
    `sample_from_datasets` without a seed trained 14 of 64 rows twice and
    14 never; a random `filter` ended in `RankDivergedError` advising
    `drop_remainder`). Their seeded (or deterministic) forms pass."""
    base = tf.data.Dataset.range(64)

    def batched(ds):
        return ds.batch(8, drop_remainder=True)

    def shuffled_inside(seed):
        return tf.data.Dataset.range(2).interleave(
            lambda i: tf.data.Dataset.range(32).shuffle(32, seed=seed),
            cycle_length=2)

    def nondeterministic_option():
        options = tf.data.Options()
        options.deterministic = False
        return batched(base).with_options(options)

    tf.random.set_seed(None)  # no global seed
    refused = {
        "sample_from_datasets": lambda: batched(
            tf.data.Dataset.sample_from_datasets([base, base])),
        "Dataset.random": lambda: batched(tf.data.Dataset.random().take(64)),
        "random op": lambda: batched(base.filter(
            lambda x: tf.random.uniform(()) < 0.5)),
        "a dataset with no seed": lambda: batched(shuffled_inside(None)),
        "deterministic=False": lambda: batched(base.map(
            lambda x: x + 1, num_parallel_calls=2, deterministic=False)),
        "(in ParallelInterleaveDataset)": lambda: batched(
            tf.data.Dataset.range(2).interleave(
                lambda i: tf.data.Dataset.range(32), cycle_length=2,
                num_parallel_calls=2, deterministic=False)),
        "Options().deterministic": nondeterministic_option,
    }
    passed = {
        "sample_from_datasets": lambda: batched(
            tf.data.Dataset.sample_from_datasets([base, base], seed=1)),
        "Dataset.random": lambda: batched(
            tf.data.Dataset.random(seed=1).take(64)),
        "random op": lambda: batched(base.filter(
            lambda x: tf.random.uniform((), seed=1) < 0.5)),
        "stateless random op": lambda: batched(base.filter(
            lambda x: tf.random.stateless_uniform((), seed=[1, x]) < 0.5)),
        "a dataset with no seed": lambda: batched(shuffled_inside(5)),
        "parallel map": lambda: batched(base.map(
            lambda x: x + 1, num_parallel_calls=2)),
        # A map's random op changes values, not which rows form a batch:
        # each rank augments its own rows, as one process would.
        "random augmentation": lambda: batched(base.map(
            lambda x: tf.cast(x, tf.float32) + tf.random.normal([]))),
    }
    as_rank(0, 2)
    for what, make in refused.items():
        with pytest.raises(ValueError, match=(
                r"pipeline has .*" + re.escape(what)
                + r".* each of the 2 ranks would read other global batches")):
            data.shard_batches(make())
    for what, make in passed.items():
        rows = list(data.shard_batches(make()))
        assert rows and all(len(r) == 4 for r in rows), what
    tf.random.set_seed(3)  # a global seed seeds the random op and dataset
    for make in (refused["random op"], refused["Dataset.random"]):
        assert list(data.shard_batches(make()).take(1))
    tf.random.set_seed(None)
    as_rank(0, 1)  # one process: fine
    ds = refused["sample_from_datasets"]()
    assert data.shard_batches(ds) is ds


@pytest.mark.parametrize("n", [1, 2])
def test_a_dataset_of_single_samples_is_refused(as_rank, n):
    """`.batch()` forgotten: each element is one sample, which N ranks
    would split column-wise (rank 0 kept ids [0, 1] of a sample, rank 1
    [2, 3]), and one rank passed it on. Refused, saying to batch it."""
    as_rank(0, n)
    ids = np.arange(24).reshape(6, 4)
    labels = np.arange(6, dtype=np.float32)[:, None]
    single = [
        tf.data.Dataset.from_tensor_slices(ids),
        tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(
            6, seed=1).repeat().prefetch(2),
        tf.data.Dataset.from_tensor_slices((ids, labels)).map(
            lambda x, y: ({"ids": x}, tf.cast(y, tf.float64))),
        tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices(ids),
                            tf.data.Dataset.from_tensors(labels).repeat()),
        tf.data.Dataset.from_tensor_slices(ids).batch(
            2, drop_remainder=True).unbatch(),
        tf.data.Dataset.from_tensor_slices(tf.sparse.from_dense(ids)),
    ]
    for ds in single:
        with pytest.raises(ValueError, match=r"single samples.*"
                           r"\.batch\(global_batch_size, drop_remainder="
                           r"True\).*shard_batches\(dataset, "
                           r"global_batch_size="):
            data.shard_batches(ds)
    # Batches: a batching stage, or sources that may yield batches.
    batched = [
        tf.data.Dataset.from_tensor_slices(ids).batch(2, drop_remainder=True),
        tf.data.Dataset.from_tensor_slices(ids).map(
            lambda x: tf.reshape(x, [2, 2])),
        tf.data.Dataset.from_tensors(ids),
        tf.data.Dataset.from_generator(
            lambda: iter([ids]), output_signature=tf.TensorSpec(
                (6, 4), tf.int64)),
        tf.data.Dataset.from_tensor_slices(["f1", "f2"]).interleave(
            lambda f: tf.data.Dataset.from_tensors(ids)),
        # A stage of unknown rank (review: "Cannot iterate over a shape
        # with unknown rank" from the check).
        tf.data.Dataset.range(2).map(
            lambda i: tf.py_function(lambda: ids, [], tf.int64)).map(
                lambda x: tf.ensure_shape(x, [6, 4])),
    ]
    for ds in batched:
        data.shard_batches(ds)
    # Batches sliced from a [steps, batch, ...] array: said so.
    steps = tf.data.Dataset.from_tensor_slices(ids.reshape(3, 2, 4))
    got = [t.numpy().tolist() for t in data.shard_batches(
        steps, global_batch_size=2)]
    assert got == ([b.tolist() for b in ids.reshape(3, 2, 4)] if n == 1
                   else [[[0, 1, 2, 3]], [[8, 9, 10, 11]], [[16, 17, 18, 19]]])


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
    # A sparse (or ragged) component made in a map after batching loses
    # its static size: it is sliced with the batch's other components,
    # its rows checked at each batch (before: refused, advising a
    # `set_shape`, which ragged tensors do not have: QA).
    ids = tf.ragged.constant([[1, 2], [3], [], [4, 5, 6]], dtype=tf.int64)
    ds = tf.data.Dataset.zip(
        tf.data.Dataset.from_tensor_slices(ids),
        tf.data.Dataset.range(4)).ragged_batch(2, drop_remainder=True)
    as_rank(1, 2)
    got = list(data.shard_batches(ds.map(lambda r, y: (r.to_sparse(), y))))
    assert [tf.sparse.to_dense(s).numpy().tolist() for s, _ in got] == [
        [[3, 0]], [[4, 5, 6]]]
    texts = tf.data.Dataset.from_tensor_slices(
        (["a b", "c", "", "d e f"], [0, 1, 2, 3])).batch(
            2, drop_remainder=True).map(
                lambda t, y: (tf.strings.split(t), y))
    got = [(r.to_list(), y.numpy().tolist())
           for r, y in data.shard_batches(texts)]
    assert got == [([[b"c"]], [1]), ([[b"d", b"e", b"f"]], [3])]
    # ... and a component whose rows are not the batch's is an error.
    wrong = ds.map(lambda r, y: (
        tf.ragged.boolean_mask(r, tf.range(2) < 1), y))  # 1 row, unknown
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            r"component #0 of a batch does not have 2 rows, as the other "
            r"components of the batch")):
        list(data.shard_batches(wrong))
    # No static batch size at all (a pipeline batched for the user):
    # how to batch it again.
    csv_like = tf.data.Dataset.range(8).batch(4).map(lambda x: x)
    with pytest.raises(ValueError, match=(
            r"batch size of the dataset's batches is unknown.*"
            r"\.unbatch\(\)\.batch\(global_batch_size, "
            r"drop_remainder=True\)")):
        data.shard_batches(csv_like)


def test_seeds_that_differ_between_ranks_are_refused_by_fit():
    """With the global seed set, a `shuffle` given no seed of its own takes
    its second seed from the number of random ops made before it: a rank
    that made one more shuffled another way, and each rank sliced another
    global batch (QA: sample 20 on both ranks, another on none). `fit`
    compares the seeds before `shard_batches` across the ranks; a rank may
    call `shard_batches` alone (review: a collective in it failed that)."""
    jobs = {case: run_workers(worker_path("shuffle_seeds"), 2, [case],
                              timeout=90)
            for case in ("same", "peek", "extra_op", "global")}
    for case in ("same", "peek"):
        same = jobs[case]
        assert [r["error"] for r in same] == [None, None], case
        rows = same[0]["rows"] + same[1]["rows"]
        assert sorted(rows) == sorted(set(rows)) and len(rows) == 12, case
        assert same[0]["loss"] == same[1]["loss"], case
    for case, why in (("extra_op", "pass the seed to the stage itself"),
                      ("global", "set the same one on every rank")):
        for r in jobs[case]:
            assert r["error"].startswith(
                "sok_keras: the ranks differ at the start of fit of model "
                "'functional': the seeds (seed, seed2) of the random stages "
                "before `sok.shard_batches` are rank 0: [[4"), (case, r)
            assert why in r["error"], (case, r)


def test_lookups_in_an_input_pipeline_are_refused_on_several_ranks():
    """A lookup on N ranks inside `map(..., num_parallel_calls=4)` ran its
    exchanges concurrently under one key: TensorFlow aborted them with
    "BufRendezvous::ProvideBuf already called", naming no table, and no
    lookup of the process worked again (QA). One element at a time is no
    better: with a `prefetch` the stage runs while the model looks the
    same table up, and a rank got another's rows without an error
    (review). Every stage is refused while tracing, on every rank; a
    `for x in ds:` loop of a `tf.function` and `ds.reduce` run their
    function in the step itself, and work."""
    ranks = run_workers(worker_path("lookup_in_dataset"), 2, timeout=150)
    for results in ranks:
        cases = ("parallel", "autotune", "sequential", "one", "interleave",
                 "experimental_interleave", "scan", "filter",
                 "generator")
        for case in cases:
            r = results[case]
            assert r["error"] is not None and (
                "Table 'emb' is looked up on 2 ranks inside a tf.data stage"
            ) in r["error"], (case, r)
            assert r["after"], (case, r)
        # A step's own loop over a dataset (autograph's scan and reduce,
        # `ds.reduce`) runs in the step: not refused (QA: it was).
        sums = results["sums"]
        for name in ("for_loop", "for_break", "reduce"):
            assert np.isclose(sums[name], sums["direct"], rtol=1e-5), sums
