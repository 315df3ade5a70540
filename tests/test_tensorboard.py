"""keras.callbacks.TensorBoard on N ranks (sok_keras/tensorboard.py): one
run written by rank 0, histograms of sok tables over the global table."""

import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.plugins.histogram import summary_v2

import sok_keras as sok
from sok_keras import tensorboard as sok_tb
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


def _events(log_dir):
    """{subdir: [event file names]} under log_dir."""
    found = {}
    for d, _, files in os.walk(log_dir):
        names = [f for f in files if f.startswith("events.out.tfevents")]
        if names:
            found[os.path.relpath(d, log_dir)] = sorted(names)
    return found


def _histograms(path):
    """{(tag, step): [k, 3] buckets} of the histogram summaries in `path`."""
    out = {}
    for event in tf.compat.v1.train.summary_iterator(path):
        for v in event.summary.value:
            if v.metadata.plugin_data.plugin_name == "histograms":
                out[(v.tag, event.step)] = tf.make_ndarray(v.tensor)
    return out


def _tensorboard_buckets(table):
    """What tf.summary.histogram computes for `table` (tensorboard's own)."""
    return summary_v2._buckets(tf.constant(table, tf.float32)).numpy()


def test_keras_still_has_what_we_wrap():
    """sok_keras replaces TensorBoard._train_writer / _val_writer (lazy
    writers kept in self._writers), _log_weights (a copy of Keras' loop),
    _configure_embeddings and _start_profiler: fail loudly if Keras
    changes them."""
    from keras.src.callbacks import tensorboard as keras_tb

    cls = keras_tb.TensorBoard
    assert keras.callbacks.TensorBoard is cls
    for name, kind in (("_train_writer", "train"), ("_val_writer", "val")):
        prop = inspect.getattr_static(cls, name)
        assert isinstance(prop, property)
        src = inspect.getsource(prop.fget)
        assert f'self._writers["{kind}"] = self.summary.create_file_writer' \
            in src
    src = inspect.getsource(cls._log_weights)
    for line in ("with self._train_writer.as_default():",
                 "for layer in self.model.layers:",
                 "for weight in layer.weights:",
                 'weight_name = weight.path.replace(":", "_")',
                 'histogram_weight_name = f"{weight_name}/histogram"',
                 "self.summary.histogram(",
                 "histogram_weight_name, weight, step=epoch",
                 "self._log_weight_as_image(",
                 "self._train_writer.flush()"):
        assert line in src, line
    assert "self._log_weights(epoch)" in inspect.getsource(cls.on_epoch_end)
    assert "self._writers = {}" in inspect.getsource(cls.set_model)
    for name in ("_configure_embeddings", "_start_profiler",
                 "_log_weight_as_image"):
        assert callable(getattr(cls, name, None)), name
    src = inspect.getsource(summary_v2._buckets)
    assert "bucket_count = DEFAULT_BUCKET_COUNT" in src
    assert summary_v2.DEFAULT_BUCKET_COUNT == sok_tb.DEFAULT_BUCKET_COUNT


def _split_buckets(parts):
    """The global histogram of the concatenation of `parts`, computed the
    sharded way: global min/max, per-part counts, summed."""
    whole = np.concatenate([p.ravel() for p in parts]).astype(np.float64)
    total = whole.size
    lo = float(whole.min()) if total else np.inf
    hi = float(whole.max()) if total else -np.inf
    if total == 0 or lo == hi:
        return sok_tb.buckets_from(lo, hi, None, total).numpy()
    counts = sum(sok_tb.bucket_counts(p, lo, hi) for p in parts if p.size)
    return sok_tb.buckets_from(lo, hi, counts, total).numpy()


@pytest.mark.parametrize("case", [
    "normal", "ties_at_edges", "single_value", "one_shard_empty", "empty",
    "float16"])
def test_sharded_buckets_are_tensorboards(case):
    """Counting shards over the global edges gives exactly tensorboard's
    histogram of the whole tensor (edges, last-edge and min == max cases)."""
    rng = np.random.default_rng(7)
    if case == "normal":
        parts = [rng.normal(size=(9, 4)), rng.normal(size=(8, 4)) * 3]
    elif case == "ties_at_edges":  # many values on bucket edges and at max
        grid = np.linspace(-1.5, 1.5, 31)
        parts = [rng.choice(grid, (20, 3)), rng.choice(grid, (19, 3))]
        parts[1][0, 0] = 1.5
    elif case == "single_value":
        parts = [np.full((3, 2), 0.25), np.full((2, 2), 0.25)]
    elif case == "one_shard_empty":  # a localized table
        parts = [rng.uniform(size=(5, 3)), np.zeros((0, 3))]
    elif case == "empty":
        parts = [np.zeros((0, 3)), np.zeros((0, 3))]
    else:
        parts = [rng.normal(size=(6, 2)).astype(np.float16),
                 rng.normal(size=(5, 2)).astype(np.float16)]
    parts = [p.astype(np.float32) if p.dtype == np.float64 else p
             for p in parts]
    whole = np.concatenate([p.ravel() for p in parts])
    want = summary_v2._buckets(tf.constant(whole)).numpy()
    got = _split_buckets(parts)
    assert got.shape == want.shape == (30, 3)
    np.testing.assert_array_equal(got, want)
    assert got[:, 2].sum() == whole.size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_global_histogram_of_a_table_in_chunks(monkeypatch, dtype):
    """global_histogram counts a table a few rows at a time (here 3 rows of
    4 per chunk) and still gives tensorboard's histogram of the table."""
    monkeypatch.setattr(sok_tb, "_CHUNK_ELEMENTS", 12)
    table = np.random.default_rng(3).normal(size=(17, 4)).astype(np.float32)
    v = sok.Variable(table, dtype=dtype)
    whole = keras.ops.convert_to_numpy(keras.ops.cast(v.value, "float32"))
    got = sok_tb.global_histogram(v, key="test").numpy()
    np.testing.assert_array_equal(got, _tensorboard_buckets(whole))


def test_one_rank_histograms_are_tensorboards_counted_in_chunks(
        tmp_path, monkeypatch):
    """A world of one: a sok table's histogram is counted in chunks (QA:
    TensorFlow's own made a one-hot of [values, 30] float64 and ran out of
    memory for a 2M x 64 table), and equals TensorBoard's of the table;
    the dense weights' are Keras' own."""
    assert sok.num_ranks() == 1
    monkeypatch.setattr(sok_tb, "_CHUNK_ELEMENTS", 40)  # 10 rows of 4
    chunks = []
    count = sok_tb.bucket_counts
    monkeypatch.setattr(sok_tb, "bucket_counts",
                        lambda data, *a: chunks.append(1) or count(data, *a))
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(40, 4, name="emb")
    model = keras.Model(ids, keras.layers.Dense(2, name="head")(emb(ids)))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 40, (16, 3)), rng.normal(size=(16, 2))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(str(tmp_path),
                                                     histogram_freq=1)])
    events = _events(str(tmp_path))
    assert list(events) == ["train"] and len(events["train"]) == 1
    hist = _histograms(os.path.join(tmp_path, "train", events["train"][0]))
    table = keras.ops.convert_to_numpy(emb.embeddings.value)
    np.testing.assert_array_equal(hist[("emb/embeddings/histogram", 0)],
                                  _tensorboard_buckets(table))
    assert len(chunks) == 4  # 40 rows, 10 per chunk
    assert ("head/kernel/histogram", 0) in hist


def test_tensorboard_on_two_ranks(tmp_path):
    """One run in log_dir (train/ and validation/), from rank 0's process
    only (before: rank 1 wrote its own event files beside rank 0's), and
    the tables' histograms are those of the whole tables (before: rank 0's
    20 x 4 shard of the 40 x 4 table, and nothing of the 7 x 2 table
    localized on rank 1)."""
    log_dir = str(tmp_path / "logs")
    r0, r1 = run_workers(worker_path("tensorboard_fit"), 2, args=[log_dir],
                         timeout=300)
    shapes = {"emb/embeddings": ([20, 4], [20, 4], (40, 4)),
              "loc/embeddings": ([0, 2], [7, 2], (7, 2))}
    for path, (s0, s1, _) in shapes.items():
        assert r0["local_shapes"][path] == s0
        assert r1["local_shapes"][path] == s1
    events = _events(log_dir)
    assert sorted(events) == ["train", "validation"], events
    # CSVLogger: the header and one row per epoch, once (before: each row
    # and the header once per rank).
    with open(log_dir + ".csv") as f:
        lines = f.read().splitlines()
    assert [line.split(",")[0] for line in lines] == ["epoch", "0", "1"], (
        lines)
    for folder, names in events.items():
        assert len(names) == 1, events
        assert f".{r0['pid']}." in names[0], names
        assert f".{r1['pid']}." not in names[0], names
    hist = _histograms(os.path.join(log_dir, "train", events["train"][0]))
    for epoch in (0, 1):
        for path, (_, _, shape) in shapes.items():
            table = np.array(r0["tables"][epoch][path], np.float32)
            assert table.shape == shape
            np.testing.assert_array_equal(table, r1["tables"][epoch][path])
            got = hist[(f"{path}/histogram", epoch)]
            assert got[:, 2].sum() == shape[0] * shape[1]
            np.testing.assert_array_equal(got, _tensorboard_buckets(table))
        assert (f"{r0['kernel_path']}/histogram", epoch) in hist
    assert len(hist) == 8 and {t for t, _ in hist} == {
        "emb/embeddings/histogram", "loc/embeddings/histogram",
        f"{r0['kernel_path']}/histogram", "head/bias/histogram"}
    val = os.path.join(log_dir, "validation", events["validation"][0])
    tags = {v.tag for e in tf.compat.v1.train.summary_iterator(val)
            for v in e.summary.value}
    assert "epoch_loss" in tags


def test_callbacks_given_on_some_ranks_and_whole_weights(tmp_path):
    """A plain model's CSVLogger and TensorBoard on rank 1 say, once each,
    that rank 1's logs are not written (rank 0 alone writes: every rank
    passes one path, and two writers garbled one CSV file); `set_weights`
    names the table whose shard a whole table was given for; TensorBoard
    histograms with the callback on rank 0 only fail within seconds on
    both ranks, not after SOK_COMM_TIMEOUT."""
    r0, r1 = run_workers(worker_path("callbacks_some_ranks"), 2,
                         args=[str(tmp_path)], timeout=240,
                         env={"SOK_SAVE_TIMEOUT": "5"})
    assert r1["files"] == [], r1["files"]
    told = [w for w in r1["warnings"] if "writes from rank 0 only" in w]
    assert sorted(w.split(": ")[2].split(" ")[0] for w in told) == [
        "CSVLogger", "TensorBoard"], r1["warnings"]
    assert all("model 'sequential'" in w for w in told), told
    assert not [w for w in r0["warnings"] if "writes from rank 0" in w]
    for r in (r0, r1):
        assert ("'emb/embeddings', (50, 4) on rank" in r["set_weights"]
                and "received the whole table (100, 4)" in r["set_weights"]
                and "assign_global" in r["set_weights"]), r["set_weights"]
        assert r["fit_seconds"] < 120, r
    assert r0["fit"].startswith("RankMismatchError"), r0["fit"]
    assert "TensorBoard(histogram_freq=...)" in r0["fit"], r0["fit"]
    assert "pass the callback on every rank" in r0["fit"], r0["fit"]
    assert r1["fit"].startswith("RankDivergedError"), r1["fit"]
    assert "RankMismatchError" in r1["fit"], r1["fit"]
