"""GPU kernels and GPU training, skipped where TensorFlow sees no GPU.

Every CUDA kernel is checked against its CPU kernel on random inputs
(duplicates, empty rows, padding, every dtype the op takes); lookups and
gradients against `tf.nn.embedding_lookup_sparse` on the GPU; `model.fit`
against `keras.layers.Embedding` on the GPU. GPU results must also be
deterministic: the same inputs give bitwise the same outputs.

That every op has a GPU kernel registered is checked in
`tests/test_ops_loading.py`, without a GPU.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras import bucket_ops
from sok_keras import lookup_ops
from sok_keras._ops import ops
from sok_keras.optimizers import sparse_kernels

GPUS = tf.config.list_physical_devices("GPU")
pytestmark = pytest.mark.skipif(not GPUS, reason="no GPU visible")

CPU, GPU = "/CPU:0", "/GPU:0"


def _on(device, fn, *args):
    with tf.device(device):
        out = fn(*args)
    return tf.nest.map_structure(
        lambda t: t.numpy() if hasattr(t, "numpy") else t, out)


def _both(fn, *args):
    """(cpu result, gpu result, gpu again) of fn(*args)."""
    return _on(CPU, fn, *args), _on(GPU, fn, *args), _on(GPU, fn, *args)


def _assert_same(cpu, gpu, gpu2, rtol=0.0, atol=0.0):
    for a, b, c in zip(tf.nest.flatten(cpu), tf.nest.flatten(gpu),
                       tf.nest.flatten(gpu2)):
        np.testing.assert_array_equal(b, c)  # deterministic on the GPU
        if rtol == 0 and atol == 0:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def _ids(rng, nnz, vocab, dtype):
    # Zipf-like: many duplicates, some singletons.
    hot = rng.integers(0, min(vocab, 7), nnz)
    cold = rng.integers(0, vocab, nnz)
    return np.where(rng.random(nnz) < 0.5, hot, cold).astype(dtype)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("num_ranks,owner", [(1, -1), (3, -1), (3, 2)])
@pytest.mark.parametrize("nnz", [0, 1, 1000, 70_000])
def test_dedup_bucketize_matches_cpu(id_dtype, num_ranks, owner, nnz):
    rng = np.random.default_rng(1000 + nnz + num_ranks)
    ids = tf.constant(_ids(rng, nnz, 5000, id_dtype))

    def f(ids):
        return tuple(lookup_ops.dedup_bucketize(
            tf.identity(ids), num_ranks=num_ranks, vocab_size=5000,
            owner=owner, table_name="t"))

    _assert_same(*_both(f, ids))


def test_dedup_bucketize_invalid_id_on_gpu():
    ids = tf.constant([3, 7, 9000, -4], tf.int64)
    with tf.device(GPU):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="table 'tbl'.*id 9000 at position 2"):
            lookup_ops.dedup_bucketize(tf.identity(ids), 2, 5000,
                                       table_name="tbl")
        out = lookup_ops.dedup_bucketize(tf.identity(ids), 2, 5000,
                                         table_name="tbl",
                                         raise_on_error=False)
    assert out.error.numpy().tolist() == [2, 9000]
    assert out.unique_ids.shape[0] == 0


def test_dedup_bucketize_maps_the_position_of_an_invalid_id_on_gpu():
    """Given the ids' positions in the caller's input (device memory), the
    GPU kernel names the invalid id's there, as the CPU kernel, with one
    more host sync on the error path only (none more without an error)."""
    from sok_keras._ops import build_info

    ids = tf.constant([3, 7, 9000, -4], tf.int64)
    positions = tf.constant([1, 4, 6, 7], tf.int64)
    good = tf.constant([3, 7, 9, 4], tf.int64)

    def run(ids, raise_on_error):
        return lookup_ops.dedup_bucketize(
            tf.identity(ids), 2, 5000, table_name="tbl",
            raise_on_error=raise_on_error, positions=tf.identity(positions))

    with tf.device(GPU):
        run(good, True)  # (warm-up)
        before = build_info()["gpu_host_syncs"]
        run(good, True)
        assert build_info()["gpu_host_syncs"] - before == 1
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="table 'tbl'.*id 9000 at position 6 "):
            run(ids, True)
        before = build_info()["gpu_host_syncs"]
        out = run(ids, False)
        assert build_info()["gpu_host_syncs"] - before == 2
    assert out.error.numpy().tolist() == [6, 9000]
    with tf.device(CPU):
        assert run(ids, False).error.numpy().tolist() == [6, 9000]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seg_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 16, 129])
def test_segment_combine_and_grad_match_cpu(dtype, seg_dtype, combiner,
                                            weighted, dim):
    rng = np.random.default_rng(7 + dim)
    num_rows, nnz, batch = 300, 4000, 700  # some segments stay empty
    rows = tf.constant(rng.normal(size=(num_rows, dim)).astype(dtype))
    inverse = tf.constant(rng.integers(0, num_rows, nnz).astype(np.int32))
    segs = tf.constant(rng.integers(0, batch, nnz).astype(seg_dtype))
    w = (rng.uniform(0.1, 2.0, nnz) if combiner != "sum" or not weighted
         else rng.uniform(-1.0, 2.0, nnz)).astype(dtype)
    weights = tf.constant(w) if weighted else None
    grad = tf.constant(rng.normal(size=(batch, dim)).astype(dtype))

    def f(rows, grad):
        fwd = lookup_ops.segment_combine(rows, inverse, segs, weights, batch,
                                         combiner)
        bwd = ops().sok_segment_combine_grad(
            grad=grad, inverse=inverse, segment_ids=segs,
            weights=weights if weights is not None else tf.zeros([0], dtype),
            num_unique=tf.constant(num_rows, tf.int64), combiner=combiner)
        return fwd, bwd

    tol = 1e-5 if dtype == np.float32 else 1e-12
    _assert_same(*_both(f, rows, grad), rtol=tol, atol=tol)


def test_segment_combine_bad_index_on_gpu():
    rows = tf.ones([4, 2])
    with tf.device(GPU):
        with pytest.raises(tf.errors.InvalidArgumentError):
            lookup_ops.segment_combine(
                tf.identity(rows), tf.constant([0, 9], tf.int32),
                tf.constant([0, 0], tf.int64), None, 2, "sum")


@pytest.mark.parametrize("dtype", [tf.float32, tf.int64, tf.int32,
                                   tf.float64, tf.float16, tf.bfloat16])
def test_bucket_pad_unpad_match_cpu(dtype):
    counts = tf.constant([[3, 0, 5], [1, 2, 2], [0, 0, 7]], tf.int64)
    rng = np.random.default_rng(3)
    x = tf.cast(tf.constant(rng.integers(-50, 50, (8, 3))), dtype)

    def f(x):
        padded, e = bucket_ops.bucket_pad(tf.identity(x), counts, 0)
        back = bucket_ops.bucket_unpad(padded, counts, e, 0)
        return padded, e, back

    cpu, gpu, gpu2 = _both(f, x)
    _assert_same(cpu, gpu, gpu2)
    np.testing.assert_array_equal(gpu[2][:3], x.numpy()[:3])


def _slots(n, shape, dtype, rng):
    return [tf.Variable(rng.uniform(0.1, 1.0, shape).astype(dtype))
            for _ in range(n)]


RULES = {
    "sgd": (0, lambda v, s, i, g: sparse_kernels.sparse_sgd(v, i, g, 0.1)),
    "momentum": (1, lambda v, s, i, g: sparse_kernels.sparse_momentum(
        v, s[0], i, g, 0.1, 0.9, nesterov=True)),
    "adagrad": (1, lambda v, s, i, g: sparse_kernels.sparse_adagrad(
        v, s[0], i, g, 0.1, 1e-7)),
    "adam": (2, lambda v, s, i, g: sparse_kernels.sparse_adam(
        v, s[0], s[1], i, g, 0.01, 3)),
    "amsgrad": (3, lambda v, s, i, g: sparse_kernels.sparse_adam(
        v, s[0], s[1], i, g, 0.01, 3, vhat=s[2])),
    "adamw": (2, lambda v, s, i, g: sparse_kernels.sparse_adamw(
        v, s[0], s[1], i, g, 0.01, 3, weight_decay=0.004)),
    "ftrl": (2, lambda v, s, i, g: sparse_kernels.sparse_ftrl(
        v, s[0], s[1], i, g, 0.05, l1_regularization_strength=0.01,
        l2_regularization_strength=0.01)),
    "rmsprop": (3, lambda v, s, i, g: sparse_kernels.sparse_rmsprop(
        v, s[0], i, g, 0.01, 0.9, 0.5, 1e-7, momentum_slot=s[1],
        average_gradient=s[2])),
    "adamax": (2, lambda v, s, i, g: sparse_kernels.sparse_adamax(
        v, s[0], s[1], i, g, 0.01, 3, beta_1=0.85, beta_2=0.99)),
    "adadelta": (2, lambda v, s, i, g: sparse_kernels.sparse_adadelta(
        v, s[0], s[1], i, g, 0.5, rho=0.9, epsilon=1e-6)),
    "lion": (1, lambda v, s, i, g: sparse_kernels.sparse_lion(
        v, s[0], i, g, 0.01, beta_1=0.8, beta_2=0.95)),
    "nadam": (2, lambda v, s, i, g: sparse_kernels.sparse_nadam(
        v, s[0], s[1], i, g, 0.01, 0.85, 0.86, 0.6, 0.97, beta_1=0.9,
        beta_2=0.99)),
}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_sparse_optimizer_matches_cpu(rule, dtype, index_dtype):
    nslots, apply = RULES[rule]
    rows, dim, k = 500, 24, 3000
    results = []
    for device in (CPU, GPU, GPU):
        rng = np.random.default_rng(11)  # the same start on every device
        with tf.device(device):
            var = tf.Variable(rng.normal(size=(rows, dim)).astype(dtype))
            slots = _slots(nslots, (rows, dim), dtype, rng)
            idx = tf.constant(_ids(rng, k, rows, index_dtype))
            grad = tf.constant(rng.normal(size=(k, dim)).astype(dtype))
            for _ in range(3):
                apply(var, slots, idx, grad)
        results.append([var.numpy()] + [s.numpy() for s in slots])
    tol = 2e-6 if dtype == np.float32 else 1e-12
    if rule == "ftrl":  # pow() is not correctly rounded on either device,
        # and Ftrl's cancellations amplify a 1-ulp difference.
        tol = 1e-3 if dtype == np.float32 else 1e-9
    _assert_same(*results, rtol=tol, atol=tol)


def test_sparse_optimizer_bad_index_on_gpu_writes_nothing():
    with tf.device(GPU):
        var = tf.Variable(tf.ones([5, 2]))
        with pytest.raises(tf.errors.InvalidArgumentError, match="7"):
            sparse_kernels.sparse_sgd(var, tf.constant([1, 7], tf.int64),
                                      tf.ones([2, 2]), 1.0)
    np.testing.assert_array_equal(var.numpy(), np.ones([5, 2]))


# ---------------------------------------------------------------------------
# float16 / bfloat16 tables: the GPU equals the CPU bit for bit (both load
# into float32, compute with the same correctly rounded operations in the
# same order, and round once to nearest even at the store).

HALF_DTYPES = [tf.float16, tf.bfloat16]


def _assert_bits_equal(what, want, got):
    """Bitwise equality of two 16-bit (or float32) arrays, with a message
    that says how many elements differ and shows the first one."""
    want, got = np.asarray(want), np.asarray(got)
    assert want.dtype == got.dtype and want.shape == got.shape, (
        f"{what}: {want.dtype}{want.shape} vs {got.dtype}{got.shape}")
    view = np.uint16 if want.dtype.itemsize == 2 else np.uint32
    # NaN is NaN: its sign and payload are not specified (centered RMSprop
    # on random slots takes square roots of negative numbers).
    both_nan = np.isnan(want.astype(np.float32)) & np.isnan(
        got.astype(np.float32))
    diff = np.argwhere((want.view(view) != got.view(view)) & ~both_nan)
    if diff.size:
        first = tuple(int(i) for i in diff[0])
        raise AssertionError(
            f"{what}: {len(diff)} of {want.size} elements differ bitwise; "
            f"first at {first}: CPU {want[first]!r} "
            f"(0x{int(want.view(view)[first]):x}) vs GPU {got[first]!r} "
            f"(0x{int(got.view(view)[first]):x})")


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 16, 129])
def test_half_segment_combine_and_grad_bitwise_equal_cpu(dtype, combiner,
                                                         weighted, dim):
    rng = np.random.default_rng(70 + dim)
    num_rows, nnz, batch = 300, 4000, 700  # some segments stay empty
    rows = tf.constant(rng.normal(size=(num_rows, dim)), dtype)
    inverse = tf.constant(rng.integers(0, num_rows, nnz).astype(np.int32))
    segs = tf.constant(rng.integers(0, batch, nnz).astype(np.int64))
    weights = (tf.constant(rng.uniform(0.1, 2.0, nnz), dtype) if weighted
               else None)
    grad = tf.constant(rng.normal(size=(batch, dim)), dtype)

    def f(rows, grad):
        fwd = lookup_ops.segment_combine(rows, inverse, segs, weights, batch,
                                         combiner)
        bwd = ops().sok_segment_combine_grad(
            grad=grad, inverse=inverse, segment_ids=segs,
            weights=weights if weights is not None else tf.zeros([0], dtype),
            num_unique=tf.constant(num_rows, tf.int64), combiner=combiner)
        return fwd, bwd

    cpu, gpu, gpu2 = _both(f, rows, grad)
    for name, c, g, g2 in zip(("SokSegmentCombine", "SokSegmentCombineGrad"),
                              cpu, gpu, gpu2):
        assert c.dtype == dtype.as_numpy_dtype
        _assert_bits_equal(f"{name} {dtype.name} GPU run 1 vs run 2", g, g2)
        _assert_bits_equal(f"{name} {dtype.name} CPU vs GPU", c, g)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_half_sparse_optimizer_bitwise_equal_cpu(rule, dtype, index_dtype):
    """A 16-bit table with float32 slots, three steps on each device."""
    nslots, apply = RULES[rule]
    rows, dim, k = 500, 24, 3000
    results = []
    for device in (CPU, GPU, GPU):
        rng = np.random.default_rng(12)  # the same start on every device
        with tf.device(device):
            var = tf.Variable(tf.constant(rng.normal(size=(rows, dim)),
                                          dtype))
            slots = _slots(nslots, (rows, dim), np.float32, rng)
            idx = tf.constant(_ids(rng, k, rows, index_dtype))
            grad = tf.constant(rng.normal(size=(k, dim)), dtype)
            for _ in range(3):
                apply(var, slots, idx, grad)
        assert var.dtype == dtype
        results.append([var.numpy()] + [s.numpy() for s in slots])
    names = ["table"] + [f"slot {i}" for i in range(nslots)]
    for name, c, g, g2 in zip(names, *results):
        _assert_bits_equal(f"{rule} {dtype.name} {name} GPU run 1 vs 2", g,
                           g2)
        if rule == "ftrl":  # pow(): a few ulp apart, as for float32 tables
            np.testing.assert_allclose(
                np.asarray(c, np.float32), np.asarray(g, np.float32),
                rtol=1e-2 if name == "table" else 1e-3, atol=1e-3,
                err_msg=f"ftrl {dtype.name} {name} CPU vs GPU")
            continue
        _assert_bits_equal(f"{rule} {dtype.name} {name} CPU vs GPU", c, g)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fit_half_table_on_gpu(dtype):
    """model.fit with a 16-bit table on the GPU: the table keeps its dtype,
    its Adam slots are float32, all stay on the GPU, the loss falls."""
    rng = np.random.default_rng(8)
    vocab = 3000
    x = _ids(rng, 256 * 4, vocab, np.int64).reshape(-1, 4)
    y = (x[:, :1] % 2).astype(np.float32)
    emb = sok.layers.DistributedEmbedding(vocab, 8, combiner="mean",
                                          dtype=dtype)
    ids = keras.Input(shape=(4,), dtype="int64")
    out = keras.layers.Dense(1)(keras.layers.Activation(
        "linear", dtype="float32")(emb(ids)))
    model = keras.Model(ids, out)
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.01)),
        loss="mse")
    h = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    assert emb.embeddings.dtype == dtype
    assert "GPU" in emb.embeddings.value.device
    for name, slot in emb.embeddings.slots.items():
        assert slot.dtype == "float32", name
        assert "GPU" in slot.value.device, name


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookup_and_gradient_match_tf_on_gpu(combiner):
    rng = np.random.default_rng(5)
    vocab, dim, batch = 2000, 32, 257
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    lengths = rng.integers(0, 6, batch)
    ids = tf.RaggedTensor.from_row_lengths(
        _ids(rng, int(lengths.sum()), vocab, np.int64), lengths)
    with tf.device(GPU):
        v = sok.Variable(table)
        ref = tf.Variable(table)
        with tf.GradientTape(persistent=True) as tape:
            out = sok.lookup_sparse(v, ids, combiners=combiner)
            want = tf.nn.embedding_lookup_sparse(
                ref, ids.to_sparse(), None, combiner=combiner)
            loss, loss_ref = (tf.reduce_sum(out * out),
                              tf.reduce_sum(want * want))
        g = tape.gradient(loss, v)
        g_ref = tape.gradient(loss_ref, ref)
    assert "GPU" in v.value.device
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5,
                               atol=1e-5)
    dense = tf.math.unsorted_segment_sum(g.values, g.indices, vocab)
    dense_ref = tf.math.unsorted_segment_sum(g_ref.values, g_ref.indices,
                                             vocab)
    np.testing.assert_allclose(dense.numpy(), dense_ref.numpy(), rtol=1e-5,
                               atol=1e-5)


def _fit_model(embedding, ids_shape):
    ids = keras.Input(shape=ids_shape, dtype="int64")
    x = keras.layers.Flatten()(embedding(ids))
    out = keras.layers.Dense(1)(x)
    return keras.Model(ids, out)


def test_fit_on_gpu_matches_keras_embedding():
    """model.fit with a sok table on the GPU equals keras.layers.Embedding
    (SGD, the one optimizer whose Keras sparse update is exact)."""
    rng = np.random.default_rng(9)
    vocab, dim, batch = 5000, 8, 64
    table = rng.normal(size=(vocab, dim)).astype(np.float32) * 0.1
    x = _ids(rng, batch * 8 * 3, vocab, np.int64).reshape(-1, 3)
    y = rng.normal(size=(x.shape[0], 1)).astype(np.float32)
    histories, tables = [], []
    for kind in ("keras", "sok"):
        keras.utils.clear_session()
        keras.utils.set_random_seed(1)
        if kind == "keras":
            emb = keras.layers.Embedding(vocab, dim)
            opt = keras.optimizers.SGD(0.05)
        else:
            emb = sok.layers.DistributedEmbedding(vocab, dim, combiner=None)
            opt = sok.optimizers.OptimizerWrapper(keras.optimizers.SGD(0.05))
        model = _fit_model(emb, (3,))
        emb.embeddings.assign(table)
        model.compile(optimizer=opt, loss="mse")
        h = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                      verbose=0)
        histories.append(h.history["loss"])
        tables.append(keras.ops.convert_to_numpy(emb.embeddings.value))
        if kind == "sok":
            assert "GPU" in emb.embeddings.value.device
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    np.testing.assert_allclose(tables[1], tables[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooled", [False, True])
def test_fit_adam_on_gpu_runs_everything_on_the_gpu(pooled):
    """OptimizerWrapper(Adam) under fit: the table and its slots stay on the
    GPU and training lowers the loss."""
    rng = np.random.default_rng(4)
    vocab = 3000
    x = _ids(rng, 256 * 4, vocab, np.int64).reshape(-1, 4)
    y = (x[:, :1] % 2).astype(np.float32)
    emb = sok.layers.DistributedEmbedding(
        vocab, 8, combiner="sum" if pooled else None)
    model = _fit_model(emb, (4,))
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.01)),
        loss="mse")
    h = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    for var in model.optimizer.variables + [emb.embeddings]:
        if len(var.shape) == 2 and var.shape[0] == vocab:
            assert "GPU" in var.value.device, var.path


def test_nccl_communicator_with_one_rank():
    """The NCCL communicator (one GPU, one rank): every collective, in
    eager and in a tf.function, and its health."""
    from sok_keras import comm_nccl

    uid = comm_nccl.NcclCommunicator.new_unique_id()
    comm = comm_nccl.NcclCommunicator(0, 1, uid, timeout=60)
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    np.testing.assert_array_equal(comm.all_reduce(x, "k").numpy(), x.numpy())
    np.testing.assert_array_equal(
        comm.all_reduce(tf.constant([3, 5], tf.int64), "k", op="max").numpy(),
        [3, 5])
    np.testing.assert_array_equal(comm.all_gather(x, "g").numpy(), x.numpy())
    np.testing.assert_array_equal(comm.broadcast(x, "b").numpy(), x.numpy())
    counts = tf.constant([[4]], tf.int64)
    np.testing.assert_array_equal(comm.exchange(x, counts, "e").numpy(),
                                  x.numpy())

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = comm.exchange(x * 2.0, counts, "e2")
            loss = tf.reduce_sum(comm.all_reduce(y, "r2"))
        return loss, tape.gradient(loss, x)

    loss, grad = step(x)
    assert float(loss) == 2.0 * float(tf.reduce_sum(x))
    np.testing.assert_array_equal(grad.numpy(), np.full((4, 3), 2.0))
    assert comm.health() == ""


def test_nccl_abort_fails_later_collectives_with_the_reason():
    """`abort` (what sok_keras.divergence calls when another rank failed):
    the communicator reports the reason, and a collective after it raises
    with that reason instead of running or waiting."""
    import time

    from sok_keras import comm_nccl

    uid = comm_nccl.NcclCommunicator.new_unique_id()
    comm = comm_nccl.NcclCommunicator(0, 1, uid, timeout=60)
    x = tf.ones([8])
    np.testing.assert_array_equal(comm.all_reduce(x, "before").numpy(),
                                  np.ones(8))
    comm.abort("rank 1 failed: test reason")
    deadline = time.monotonic() + 10
    while "test reason" not in comm.health() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "rank 1 failed: test reason" in comm.health()
    with pytest.raises(tf.errors.OpError, match="test reason"):
        comm.all_reduce(x, "after").numpy()


@pytest.mark.parametrize("weighted", [False, True])
def test_segment_combine_grad_hot_rows_match_cpu_exactly(weighted):
    """A Zipf head row seen 300,000 times (four levels of the kGradChunk
    tree) next to cold rows: the GPU sums hot rows in parallel, in the
    same order as the CPU, so the results are bitwise equal."""
    rng = np.random.default_rng(11)
    dim, batch, num_rows = 8, 5000, 50
    inverse = np.concatenate([np.zeros(300_000, np.int32),
                              np.full(5000, 1, np.int32),
                              rng.integers(2, num_rows, 20_000)]
                             ).astype(np.int32)
    rng.shuffle(inverse)
    nnz = inverse.size
    segs = rng.integers(0, batch, nnz).astype(np.int64)
    w = rng.uniform(0.5, 1.5, nnz).astype(np.float32)
    grad = rng.normal(size=(batch, dim)).astype(np.float32)

    def f(grad):
        return ops().sok_segment_combine_grad(
            grad=grad, inverse=tf.constant(inverse),
            segment_ids=tf.constant(segs),
            weights=tf.constant(w) if weighted else tf.zeros([0]),
            num_unique=tf.constant(num_rows, tf.int64), combiner="sum")

    cpu, gpu, gpu2 = _both(f, tf.constant(grad))
    _assert_same(cpu, gpu, gpu2)
    terms = grad[segs].astype(np.float64) * (w[:, None] if weighted else 1)
    want = np.zeros((num_rows, dim))
    np.add.at(want, inverse, terms)
    np.testing.assert_allclose(gpu, want, rtol=1e-4, atol=1e-3)


# ---------------------------------------------------------------------------
# The backward of SokPooledLookup (SokPooledGradPlan + SokPooledGradCombine,
# and both in one op, SokPooledLookupGrad) and the sparse updates'
# distinct-indices path.

def _pooled_bags(rng, batch, max_len, vocab, id_dtype, pad_frac=0.2):
    lengths = rng.integers(0, max_len + 1, batch)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = _ids(rng, int(splits[-1]), vocab, id_dtype)
    ids = np.where(rng.random(ids.size) < pad_frac, -1, ids).astype(id_dtype)
    return ids, splits


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 16, 129])
def test_pooled_lookup_grad_matches_cpu(dtype, id_dtype, combiner, weighted,
                                        dim):
    rng = np.random.default_rng(50 + dim)
    vocab, batch = 4000, 3000
    # Zipf-like ids (hot rows over many kGradChunk chunks), padding, empty
    # bags.
    ids, splits = _pooled_bags(rng, batch, 12, vocab, id_dtype)
    dy = tf.constant(rng.normal(size=(batch, dim)).astype(dtype))
    w = tf.constant(rng.uniform(0.1, 2.0, ids.size).astype(dtype)
                    if weighted else np.zeros([0], dtype))
    ids, splits = tf.constant(ids), tf.constant(splits)

    def f(dy, ids, splits, w):
        return tuple(ops().sok_pooled_lookup_grad(
            grad=tf.identity(dy), ids=tf.identity(ids),
            row_splits=tf.identity(splits), weights=tf.identity(w),
            combiner=combiner, num_rows=vocab, table_name="t"))

    _assert_same(*_both(f, dy, ids, splits, w))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("width", [-1, 1, 4])
def test_pooled_grad_plan_and_combine_match_cpu(dtype, combiner, weighted,
                                                width):
    """The two halves the registered gradient uses, on their own: every
    tensor of SokPooledGradPlan, and SokPooledGradCombine's sums (a GPU
    plan on the GPU, a CPU plan on the CPU), the CPU's bit for bit; ragged
    bags (width -1) and uniform ones."""
    rng = np.random.default_rng(70 + width)
    vocab, dim, batch = 3000, 40, 2000
    if width < 1:
        ids, splits = _pooled_bags(rng, batch, 10, vocab, np.int64)
    else:
        ids = _ids(rng, batch * width, vocab, np.int64)
        ids = np.where(rng.random(ids.size) < 0.2, -1, ids)
        splits = np.zeros([0], np.int64)
    dy = tf.constant(rng.normal(size=(batch, dim)).astype(dtype))
    w = tf.constant(rng.uniform(0.1, 2.0, ids.size).astype(dtype)
                    if weighted else np.zeros([0], dtype))
    ids, splits = tf.constant(ids), tf.constant(splits)

    def f(dy, ids, splits, w):
        plan = ops().sok_pooled_grad_plan(
            ids=tf.identity(ids), row_splits=tf.identity(splits),
            weights=tf.identity(w), combiner=combiner, num_rows=vocab,
            table_name="t", bag_width=width)
        g = ops().sok_pooled_grad_combine(
            grad=tf.identity(dy), offsets=plan.offsets,
            segments=plan.segments, sorted_weights=plan.sorted_weights,
            denominator=plan.denominator, table_name="t")
        return tuple(plan) + (g,)

    _assert_same(*_both(f, dy, ids, splits, w))


@pytest.mark.parametrize("case", ["empty", "all_padding", "no_bags"])
def test_pooled_lookup_grad_corner_cases_match_cpu(case):
    ids, splits, batch = {
        "empty": ([], [0, 0, 0], 2),
        "all_padding": ([-1, -1, -1], [0, 2, 2, 3], 3),
        "no_bags": ([], [0], 0),
    }[case]

    def f():
        return tuple(ops().sok_pooled_lookup_grad(
            grad=tf.ones([batch, 4]), ids=tf.constant(ids, tf.int64),
            row_splits=tf.constant(splits, tf.int64), weights=tf.zeros([0]),
            combiner="mean", num_rows=10, table_name="t"))

    cpu, gpu, gpu2 = _both(f)
    assert gpu[0].shape == (0, 4) and gpu[1].shape == (0,)
    _assert_same(cpu, gpu, gpu2)


def test_pooled_lookup_grad_bad_input_on_gpu():
    with tf.device(GPU):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"table 'emb'.*id 12 at position 2"):
            ops().sok_pooled_lookup_grad(
                grad=tf.ones([2, 4]),
                ids=tf.identity(tf.constant([1, -1, 12, 3], tf.int64)),
                row_splits=tf.constant([0, 2, 4], tf.int64),
                weights=tf.zeros([0]), num_rows=10, table_name="emb")
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="table 'emb'.*row_splits are inconsistent"):
            ops().sok_pooled_lookup_grad(
                grad=tf.ones([3, 4]),
                ids=tf.identity(tf.constant([1, 2, 3, 4], tf.int64)),
                row_splits=tf.constant([0, 3, 2, 4], tf.int64),
                weights=tf.zeros([0]), num_rows=10, table_name="emb")


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("dim", [4, 13, 128, 200])
def test_pooled_lookup_uniform_bags_on_gpu(width, dim):
    """`bag_width` on the GPU (the op makes the row splits on its device):
    the CPU's result bit for bit, and that of the same bags given as row
    splits; a bad id fails the forward and the gradient op, naming the
    table, the value and its position."""
    rng = np.random.default_rng(width * 1000 + dim)
    vocab, batch = 50, 37
    ids = rng.integers(0, vocab, batch * width)
    ids[rng.random(ids.size) < 0.2] = -1
    table = rng.standard_normal([vocab, dim]).astype(np.float32)

    def run(ids):
        return ops().sok_pooled_lookup(
            table=tf.constant(table), ids=tf.identity(tf.constant(ids)),
            row_splits=tf.zeros([0], tf.int64), weights=tf.zeros([0]),
            combiner="mean", table_name="emb", bag_width=width)

    cpu, gpu, gpu2 = _both(run, ids)
    _assert_same(cpu, gpu, gpu2)
    splits = np.arange(batch + 1, dtype=np.int64) * width
    given = _on(GPU, lambda: ops().sok_pooled_lookup(
        table=tf.constant(table), ids=tf.identity(tf.constant(ids)),
        row_splits=tf.constant(splits), weights=tf.zeros([0]),
        combiner="mean", table_name="emb"))
    np.testing.assert_array_equal(gpu, given)
    dy = rng.standard_normal([batch, dim]).astype(np.float32)

    def grad(ids):
        return ops().sok_pooled_lookup_grad(
            grad=tf.constant(dy), ids=tf.identity(tf.constant(ids)),
            row_splits=tf.zeros([0], tf.int64), weights=tf.zeros([0]),
            combiner="mean", num_rows=vocab, table_name="emb",
            bag_width=width)

    _assert_same(*_both(grad, ids))
    bad = ids.copy()
    bad[width] = vocab + 7  # the first id of bag 1
    message = rf"table 'emb'.*id {vocab + 7} at position {width} "
    with tf.device(GPU):
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            run(bad)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            grad(bad)


# ---------------------------------------------------------------------------
# One-id bags (bag_width=1: the unpooled lookup) take the GPU's gather
# kernel, which must give what the general kernel gives for a one-id bag,
# bit for bit, the sign of zero included.

def _assert_bitwise(want, *got):
    """Bitwise equality of float arrays (-0.0 is not 0.0 here, unlike for
    np.testing.assert_array_equal)."""
    want = np.asarray(want)
    view = np.dtype(f"u{want.dtype.itemsize}")
    for g in got:
        g = np.asarray(g)
        assert g.dtype == want.dtype and g.shape == want.shape, (
            f"{want.dtype}{want.shape} vs {g.dtype}{g.shape}")
        diff = np.argwhere(want.view(view) != g.view(view))
        if diff.size:
            first = tuple(int(i) for i in diff[0])
            raise AssertionError(
                f"{len(diff)} of {want.size} elements differ bitwise; first "
                f"at {first}: {want[first]!r} vs {g[first]!r}")


def _one_id_bags(rng, batch, vocab, dim, dtype, id_dtype):
    """A table with -0.0 entries (and a row of them, 3, that the ids hit),
    ids with padding, weights with zeros, -0.0 and negatives."""
    table = rng.standard_normal([vocab, dim]).astype(dtype)
    table[rng.random(table.shape) < 0.1] = -0.0
    table[3] = -0.0
    ids = _ids(rng, batch, vocab, np.int64)
    ids[rng.random(batch) < 0.2] = -1
    ids[1::7] = 3
    weights = rng.uniform(-2.0, 2.0, batch).astype(dtype)
    weights[rng.random(batch) < 0.1] = 0.0
    weights[rng.random(batch) < 0.1] = -0.0
    return table, ids.astype(id_dtype), weights


def _one_id_reference(table, ids, weights, combiner):
    """What a one-id bag pools to, in numpy's correctly rounded float ops:
    sums start from +0 (+0 + -0 is +0), padding gives a zero row."""
    zero = table.dtype.type(0)
    valid = ids != -1
    rows = table[np.where(valid, ids, 0)]
    if weights.size:
        acc = zero + weights[:, None] * rows
        weight_sum = zero + weights
        square_sum = zero + weights * weights
    else:
        acc = zero + rows
        weight_sum = square_sum = np.ones(ids.size, table.dtype)
    if combiner != "sum":
        den = (weight_sum if combiner == "mean" else np.sqrt(square_sum))
        with np.errstate(divide="ignore", invalid="ignore"):
            acc = np.where(den[:, None] == 0, zero, acc / den[:, None])
    return np.where(valid[:, None], acc, zero).astype(table.dtype)


def _one_id_lookup(combiner, width=1):
    def run(table, ids, weights, splits):
        return ops().sok_pooled_lookup(
            table=tf.identity(table), ids=tf.identity(ids),
            row_splits=tf.identity(splits), weights=tf.identity(weights),
            combiner=combiner, table_name="emb", bag_width=width)
    return run


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 4, 13, 128, 200, 300])
@pytest.mark.parametrize("batch", [1, 31, 1000])
def test_pooled_lookup_one_id_bags_bitwise_equal_cpu(dtype, id_dtype,
                                                     combiner, weighted,
                                                     dim, batch):
    """bag_width=1 on the GPU (the gather kernel; 300 columns take several
    passes of 32 lanes; batches not a multiple of the lanes): bitwise the
    CPU kernel's result, the general GPU kernel's on the same bags given as
    row splits, and a one-id bag's closed form."""
    rng = np.random.default_rng(
        [dim, batch, int(weighted), ["sum", "mean", "sqrtn"].index(combiner)])
    table, ids, weights = _one_id_bags(rng, batch, 500, dim, dtype, id_dtype)
    w = tf.constant(weights if weighted else np.zeros([0], dtype))
    table, ids = tf.constant(table), tf.constant(ids)
    no_splits = tf.zeros([0], tf.int64)
    cpu, gpu, gpu2 = _both(_one_id_lookup(combiner), table, ids, w, no_splits)
    splits = tf.range(batch + 1, dtype=tf.int64)
    general = _on(GPU, _one_id_lookup(combiner, width=-1), table, ids, w,
                  splits)
    want = _one_id_reference(table.numpy(), ids.numpy(), w.numpy(), combiner)
    _assert_bitwise(want, cpu, gpu, gpu2, general)


@pytest.mark.parametrize("unroll", ["1", "2", "4", "8"])
@pytest.mark.parametrize("dim", [13, 128, 300])
def test_pooled_lookup_one_id_bags_any_unroll_on_gpu(unroll, dim,
                                                     monkeypatch):
    """SOK_POOLED_LOOKUP_UNROLL (rows in flight) changes nothing, also
    where the last chunk's bags are not a multiple of it."""
    monkeypatch.setenv("SOK_POOLED_LOOKUP_UNROLL", unroll)
    rng = np.random.default_rng(dim)
    table, ids, weights = _one_id_bags(rng, 1003, 500, dim, np.float32,
                                       np.int64)
    args = (tf.constant(table), tf.constant(ids), tf.constant(weights),
            tf.zeros([0], tf.int64))
    cpu, gpu, gpu2 = _both(_one_id_lookup("sqrtn"), *args)
    _assert_bitwise(cpu, gpu, gpu2)


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dim", [4, 13, 128])
def test_pooled_lookup_one_id_bags_bad_id_on_gpu(id_dtype, dim):
    """A bad id among one-id bags fails the op, naming the table, the value
    and the first bad position (several bad ids, in one chunk of bags and
    in others, -1 padding around them)."""
    rng = np.random.default_rng(dim)
    vocab = 50
    table = tf.constant(rng.standard_normal([vocab, dim]).astype(np.float32))
    run = _one_id_lookup("mean")
    for bad, first in (({613: vocab + 7, 614: -5, 977: vocab}, 613),
                       ({45: -3, 40: -1, 500: vocab + 1}, 45),
                       ({999: vocab}, 999)):
        ids = rng.integers(0, vocab, 1000)
        ids[rng.random(ids.size) < 0.2] = -1
        ids[first - 1] = -1
        for position, value in bad.items():
            ids[position] = value
        message = rf"table 'emb'.*id {bad[first]} at position {first} "
        with tf.device(GPU):
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=message):
                run(table, tf.constant(ids.astype(id_dtype)),
                    tf.zeros([0]), tf.zeros([0], tf.int64))


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dim", [13, 128])
def test_sparse_optimizer_distinct_indices_on_gpu(rule, dtype, index_dtype,
                                                  dim, monkeypatch):
    """The GPU update of distinct indices without its dedup (what
    `indices_are_unique` allows; forced here, on distinct unsorted
    indices): bitwise the dedup path's result, and as close to the CPU."""
    nslots, apply = RULES[rule]
    rows, k = 700, 400
    results = []
    for device, unique in ((CPU, True), (GPU, True), (GPU, False)):
        monkeypatch.setattr(sparse_kernels, "indices_are_unique",
                            lambda indices, num_rows, u=unique: u)
        rng = np.random.default_rng(21)
        with tf.device(device):
            var = tf.Variable(rng.normal(size=(rows, dim)).astype(dtype))
            slots = _slots(nslots, (rows, dim), dtype, rng)
            idx = tf.constant(rng.permutation(rows)[:k].astype(index_dtype))
            grad = tf.constant(rng.normal(size=(k, dim)).astype(dtype))
            for _ in range(3):
                apply(var, slots, idx, grad)
        results.append([var.numpy()] + [s.numpy() for s in slots])
    for a, b in zip(results[1], results[2]):
        np.testing.assert_array_equal(a, b)
    tol = 2e-6 if dtype == np.float32 else 1e-12
    if rule == "ftrl":
        tol = 1e-3 if dtype == np.float32 else 1e-9
    for a, b in zip(results[0], results[1]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_sparse_update_of_a_pooled_gradient_is_marked_unique_on_gpu():
    """On the GPU too, the update of a one-rank lookup's gradient gets the
    attr (the proof is the graph's, whatever the device)."""
    with tf.device(GPU):
        table = tf.Variable(tf.ones([50, 8]))
        m, v = tf.Variable(tf.zeros([50, 8])), tf.Variable(tf.zeros([50, 8]))
    seen = []

    @tf.function
    def step(ids, splits):
        with tf.device(GPU):
            with tf.GradientTape() as tape:
                out = ops().sok_pooled_lookup(
                    table=table, ids=ids, row_splits=splits,
                    weights=tf.zeros([0]), combiner="sum")
                loss = tf.reduce_sum(out * out)
            g = tape.gradient(loss, table)
            op = sparse_kernels.sparse_adam(table, m, v, g.indices, g.values,
                                            0.01, 1.0)
            seen.append(op.get_attr("indices_are_unique"))

    step(tf.constant([3, -1, 7, 3, 49], tf.int64),
         tf.constant([0, 2, 5], tf.int64))
    assert seen == [True]
    changed = np.any(table.numpy() != 1.0, axis=1)
    np.testing.assert_array_equal(np.nonzero(changed)[0], [3, 7, 49])


def test_fit_pooled_adam_on_gpu_matches_cpu():
    """A pooled sok model (mean, padding) under fit with Adam on the GPU
    (the fused backward, Adam without its dedup: checked on the graph in
    tests/optimizers/test_sparse_unique.py) matches the CPU's."""
    rng = np.random.default_rng(9)
    vocab = 2000
    x = _ids(rng, 128 * 6, vocab, np.int64).reshape(-1, 6)
    x[rng.random(x.shape) < 0.2] = -1
    y = rng.normal(size=(128, 1)).astype(np.float32)
    tables = []
    for device in (CPU, GPU):
        keras.utils.set_random_seed(3)
        with tf.device(device):
            emb = sok.layers.DistributedEmbedding(vocab, 16, combiner="mean")
            model = _fit_model(emb, (6,))
            model.compile(optimizer=sok.optimizers.OptimizerWrapper(
                keras.optimizers.Adam(0.01)), loss="mse")
            model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                      verbose=0)
            tables.append(keras.ops.convert_to_numpy(emb.embeddings.value))
    np.testing.assert_allclose(tables[1], tables[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", None])
def test_layer_train_step_makes_one_host_sync_on_gpu(combiner):
    """A traced training step of a one-rank DistributedEmbedding (pooled or
    unpooled) with OptimizerWrapper(Adam) makes exactly 1 of the library's
    blocking copies, SokPooledGradPlan's: the lookup, which takes the plan
    as a control input, skips its own (docs/gpu.md); a bad id still fails
    the step naming the table, before any update."""
    import keras

    import sok_keras as sok
    from sok_keras._ops import build_info

    with tf.device(GPU):
        inp = keras.Input((3,), dtype="int64")
        emb = sok.layers.DistributedEmbedding(100, 8, combiner=combiner,
                                              name="emb")
        h = emb(inp)
        if combiner is None:
            h = keras.layers.Flatten()(h)
        model = keras.Model(inp, keras.layers.Dense(1)(h))
        model.compile(optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adam(0.01)), loss="mse")
        x = tf.constant(np.arange(24).reshape(8, 3) % 100, tf.int64)
        y = tf.ones([8, 1])
        model.train_on_batch(x, y)  # traced and warmed up
        before = build_info()["gpu_host_syncs"]
        model.train_on_batch(x, y)
        assert build_info()["gpu_host_syncs"] - before == 1
        table = keras.ops.convert_to_numpy(emb.embeddings.value)
        dense = keras.ops.convert_to_numpy(model.layers[-1].kernel)
        bad = x.numpy().copy()
        bad[2, 1] = 100
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"table 'emb'.*id 100 at position 7"):
            model.train_on_batch(tf.constant(bad), y)
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(emb.embeddings.value), table)
        # (nor the dense weights, whose update is XLA-compiled here)
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(model.layers[-1].kernel), dense)


def test_dense_update_is_xla_compiled_on_gpu_and_trains_alike():
    """OptimizerWrapper(Adam)'s jit_compile="auto" on the GPU: the traced
    step holds one XLA-compiled call (the dense weights' update), and
    model.fit trains as with jit_compile=False (op by op)."""
    from tests.optimizers.test_wrapper import _xla_calls

    rng = np.random.default_rng(11)
    vocab = 2000
    x = _ids(rng, 256 * 3, vocab, np.int64).reshape(-1, 3)
    y = rng.normal(size=(x.shape[0], 1)).astype(np.float32)
    weights = {}
    for jit in ("auto", False):
        keras.utils.clear_session()
        keras.utils.set_random_seed(2)
        emb = sok.layers.DistributedEmbedding(vocab, 8, combiner=None)
        model = _fit_model(emb, (3,))
        opt = sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(0.01),
                                              jit_compile=jit)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        weights[jit] = [keras.ops.convert_to_numpy(w) for w in model.weights]

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

        graph = step.get_concrete_function(
            tf.constant(x[:64]), tf.constant(y[:64])).graph
        assert len(_xla_calls(graph)) == (1 if jit == "auto" else 0), jit
    for a, b in zip(weights["auto"], weights[False]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_one_rank_train_step_makes_two_host_syncs_on_gpu():
    """A one-rank pooled step (forward, the backward's plan and sums,
    Adam's update of the distinct rows) makes exactly 2 of the library's
    blocking copies: SokPooledLookup's and SokPooledGradPlan's
    (docs/gpu.md)."""
    from sok_keras._ops import build_info

    with tf.device(GPU):
        table = tf.Variable(tf.ones([100, 16]))
        m, v = tf.Variable(tf.zeros([100, 16])), tf.Variable(tf.zeros([100, 16]))
    ids = tf.constant([3, -1, 7, 3, 99, 5, -1, 5], tf.int64)
    splits = tf.constant([0, 2, 5, 8], tf.int64)

    @tf.function
    def step():
        with tf.device(GPU):
            with tf.GradientTape() as tape:
                out = ops().sok_pooled_lookup(
                    table=table, ids=ids, row_splits=splits,
                    weights=tf.zeros([0]), combiner="mean")
                loss = tf.reduce_sum(out * out)
            g = tape.gradient(loss, table)
            sparse_kernels.sparse_adam(table, m, v, g.indices, g.values,
                                       0.01, 1.0)
        return loss

    step()  # traced and warmed up
    before = build_info()["gpu_host_syncs"]
    step()
    assert build_info()["gpu_host_syncs"] - before == 2
