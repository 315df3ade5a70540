"""float16 / bfloat16 tables on the lookup-path ops (CPU).

The kernels load each 16-bit value into float32, do every sum, product,
division and square root in float32 (in ascending position order), and
round once to the storage type (round to nearest even) when they store an
output element. The NumPy references below do exactly that, element by
element in float32, so the comparisons are bit for bit.
"""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import bucket_ops, lookup_ops
from sok_keras._ops import ops

COMBINERS = ("sum", "mean", "sqrtn")
HALF_DTYPES = (tf.float16, tf.bfloat16)
F32 = np.float32


def _bits(x):
    """The raw 16-bit patterns of a float16/bfloat16 array (for exact
    comparisons that also distinguish -0.0 and NaN payloads)."""
    return np.asarray(x).view(np.uint16)


def _assert_bits_equal(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


def _stored(values, dtype):
    """float values rounded to nearest even into `dtype` (a tf dtype)."""
    return np.asarray(values, F32).astype(dtype.as_numpy_dtype)


def _ref_combine(rows, inverse, segment_ids, weights, batch, combiner):
    """float32 per-position accumulation in ascending position order."""
    rows32 = np.asarray(rows).astype(F32)
    dim = rows32.shape[1]
    acc = np.zeros((batch, dim), F32)
    wsum = np.zeros(batch, F32)
    wsq = np.zeros(batch, F32)
    w32 = None if weights is None else np.asarray(weights).astype(F32)
    for i in range(len(inverse)):
        b = segment_ids[i]
        if w32 is None:
            acc[b] = acc[b] + rows32[inverse[i]]
            wsum[b] = wsum[b] + F32(1)
            wsq[b] = wsq[b] + F32(1)
        else:
            w = w32[i]
            acc[b] = acc[b] + w * rows32[inverse[i]]
            wsum[b] = wsum[b] + w
            wsq[b] = wsq[b] + w * w
    if combiner == "sum":
        return acc
    den = wsum if combiner == "mean" else np.sqrt(wsq)
    out = np.zeros_like(acc)
    for b in range(batch):
        if den[b] != F32(0):
            out[b] = acc[b] / den[b]
    return out


def _ref_combine_grad(grad, inverse, segment_ids, weights, num_rows,
                      combiner):
    """float32: scale by the segment's denominator, then sum per row in
    ascending position order."""
    g32 = np.asarray(grad).astype(F32)
    batch, dim = g32.shape
    w32 = None if weights is None else np.asarray(weights).astype(F32)
    scaled = g32.copy()
    if combiner != "sum":
        den = np.zeros(batch, F32)
        for i in range(len(inverse)):
            w = F32(1) if w32 is None else w32[i]
            den[segment_ids[i]] = den[segment_ids[i]] + (
                w if combiner == "mean" else w * w)
        if combiner == "sqrtn":
            den = np.sqrt(den)
        for b in range(batch):
            scaled[b] = (np.zeros(dim, F32) if den[b] == F32(0)
                         else g32[b] / den[b])
    out = np.zeros((num_rows, dim), F32)
    for i in range(len(inverse)):
        s = scaled[segment_ids[i]]
        out[inverse[i]] = out[inverse[i]] + (s if w32 is None else s * w32[i])
    return out


def _batch(seed, dtype, weighted, nnz=70, batch=9, num_rows=13, dim=5):
    rng = np.random.default_rng(seed)
    inverse = rng.integers(0, num_rows, nnz).astype(np.int32)
    segment_ids = rng.integers(0, batch - 1, nnz)  # the last segment empty
    rows = _stored(rng.normal(size=(num_rows, dim)), dtype)
    weights = (_stored(rng.uniform(0.1, 2.0, nnz), dtype) if weighted
               else None)
    grad = _stored(rng.normal(size=(batch, dim)), dtype)
    return inverse, segment_ids, rows, weights, grad, batch, num_rows


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("seg_dtype", [tf.int32, tf.int64])
def test_segment_combine_matches_float32_reference_bitwise(
        dtype, combiner, weighted, seg_dtype):
    inverse, segment_ids, rows, weights, _, batch, _ = _batch(
        3 + weighted, dtype, weighted)
    out = lookup_ops.segment_combine(
        tf.constant(rows, dtype), inverse,
        tf.constant(segment_ids, seg_dtype),
        None if weights is None else tf.constant(weights, dtype),
        batch, combiner)
    assert out.dtype == dtype
    expected = _ref_combine(rows, inverse, segment_ids, weights, batch,
                            combiner)
    _assert_bits_equal(out.numpy(), _stored(expected, dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_segment_combine_accumulates_in_float32(dtype):
    # 4096 ones + 1 each: a bfloat16 (float16) running sum stops growing at
    # 256 (2048); the float32 sum is exact and rounds to 4096 once.
    nnz = 4096
    rows = tf.ones([1, 2], dtype)
    out = lookup_ops.segment_combine(
        rows, np.zeros(nnz, np.int32), np.zeros(nnz, np.int64), None, 1,
        "sum")
    np.testing.assert_array_equal(out.numpy().astype(F32), [[4096, 4096]])
    mean = lookup_ops.segment_combine(
        rows, np.zeros(nnz, np.int32), np.zeros(nnz, np.int64), None, 1,
        "mean")
    np.testing.assert_array_equal(mean.numpy().astype(F32), [[1, 1]])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_combine_grad_matches_float32_reference_bitwise(
        dtype, combiner, weighted):
    inverse, segment_ids, _, weights, grad, _, num_rows = _batch(
        11 + weighted, dtype, weighted)
    out = ops().sok_segment_combine_grad(
        grad=tf.constant(grad, dtype),
        inverse=tf.constant(inverse),
        segment_ids=tf.constant(segment_ids),
        weights=(tf.zeros([0], dtype) if weights is None
                 else tf.constant(weights, dtype)),
        num_unique=tf.constant(num_rows, tf.int64),
        combiner=combiner,
    )
    assert out.dtype == dtype
    expected = _ref_combine_grad(grad, inverse, segment_ids, weights,
                                 num_rows, combiner)
    _assert_bits_equal(out.numpy(), _stored(expected, dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_segment_combine_tape_gradient_has_table_dtype(dtype):
    inverse, segment_ids, rows, weights, _, batch, num_rows = _batch(
        21, dtype, True)
    table = tf.Variable(rows)
    with tf.GradientTape() as tape:
        out = lookup_ops.segment_combine(
            table, inverse, segment_ids, tf.constant(weights, dtype), batch,
            "mean")
        loss = tf.reduce_sum(tf.cast(out, tf.float32))
    g = tape.gradient(loss, table)
    assert g.dtype == dtype
    ones = np.ones((batch, rows.shape[1]), dtype.as_numpy_dtype)
    expected = _ref_combine_grad(ones, inverse, segment_ids, weights,
                                 num_rows, "mean")
    _assert_bits_equal(tf.convert_to_tensor(g).numpy(),
                       _stored(expected, dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_rounding_is_to_nearest_even(dtype):
    # One segment: rows a and b summed in float32 give a value exactly half
    # way between two neighbours of the storage type; ties go to even.
    np_dt = dtype.as_numpy_dtype
    one = np_dt(1.0)
    # The 16-bit ulp at 1: 2^-7 (bfloat16), 2^-10 (float16).
    ulp16 = 2.0 ** (-7 if dtype == tf.bfloat16 else -10)
    # 1 + ulp16 / 2 is a tie between 1 (even) and 1 + ulp16 (odd): to 1.
    # 1 + 3 ulp16 / 2 is a tie between 1 + ulp16 (odd) and 1 + 2 ulp16: up.
    rows = np.array([[one, one], [np_dt(ulp16 / 2), np_dt(3 * ulp16 / 2)]],
                    np_dt)
    out = lookup_ops.segment_combine(
        tf.constant(rows, dtype), np.array([0, 1], np.int32),
        np.array([0, 0], np.int64), None, 1, "sum").numpy().astype(F32)
    np.testing.assert_array_equal(out, [[1.0, 1.0 + 2 * ulp16]])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_segment_combine_empty_and_zero_weights(dtype):
    rows = tf.constant([[1.5, -2.0]], dtype)
    out = lookup_ops.segment_combine(
        rows, np.zeros(2, np.int32), np.array([0, 0], np.int64),
        tf.zeros([2], dtype), 3, "mean")
    assert out.dtype == dtype
    _assert_bits_equal(out.numpy(), np.zeros((3, 2), dtype.as_numpy_dtype))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_bucket_pad_round_trips_half_rows_exactly(dtype):
    rng = np.random.default_rng(5)
    counts = np.array([[3, 1], [2, 0]], np.int64)
    x = _stored(rng.normal(size=(4, 3)), dtype)
    x[0, 0] = -0.0  # the sign of zero survives
    padded, e = bucket_ops.bucket_pad(tf.constant(x, dtype), counts, 0)
    assert padded.dtype == dtype and int(e) == 2
    expected = np.zeros((8, 3), dtype.as_numpy_dtype)
    expected[0:3] = x[0:3]
    expected[4:5] = x[3:4]
    _assert_bits_equal(padded.numpy(), expected)
    # Rank 0 receives counts[:, 0] = [3, 2] rows: from itself and rank 1.
    received = np.zeros((8, 3), dtype.as_numpy_dtype)
    received[0:3] = x[0:3]
    received[4:6] = x[1:3]
    out = bucket_ops.bucket_unpad(tf.constant(received, dtype), counts, e, 0)
    _assert_bits_equal(out.numpy(), np.concatenate([x[0:3], x[1:3]]))


TABLE_OPS = ("SokSegmentCombine", "SokSegmentCombineGrad", "SokBucketPad",
             "SokBucketUnpad", "SokSparseApplySgd", "SokSparseApplyMomentum",
             "SokSparseApplyAdagrad", "SokSparseApplyAdam",
             "SokSparseApplyAdamW", "SokSparseApplyFtrl",
             "SokSparseApplyRmsprop")


@pytest.mark.parametrize("op", TABLE_OPS)
def test_half_kernels_are_registered(op):
    """CPU kernels for float16 and bfloat16 (and GPU ones in a CUDA build);
    the optimizers' with float32 slots (Tacc)."""
    from tensorflow.python.framework import kernels

    from sok_keras import _ops

    _ops.ops()  # loads the library
    devices = ["CPU"] + (["GPU"] if _ops.build_info()["with_cuda"] else [])
    found = {}
    for k in kernels.get_registered_kernels_for_op(op).kernel:
        c = {x.name: list(x.allowed_values.list.type) for x in k.constraint}
        # No constraint on T (SokBucketPad on the CPU): every dtype.
        for t in c.get("T", [d.as_datatype_enum for d in HALF_DTYPES]):
            found.setdefault((k.device_type, t), []).append(c.get("Tacc"))
    for device in devices:
        for dtype in HALF_DTYPES:
            key = (device, dtype.as_datatype_enum)
            assert key in found, f"{op}: no {device} kernel for {dtype.name}"
            if op.startswith("SokSparseApply"):
                assert all(acc == [tf.float32.as_datatype_enum]
                           for acc in found[key]), (op, device, found[key])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_every_16_bit_value_loads_and_stores_exactly(dtype):
    # One position per segment: out = store(load(x)) for all 65536 bit
    # patterns; NaNs stay NaN (quieted, with the sign kept).
    np_dt = dtype.as_numpy_dtype
    rows = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np_dt)
    rows = rows.reshape(-1, 1)
    n = rows.shape[0]
    out = lookup_ops.segment_combine(
        tf.constant(rows), np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.int64), None, n, "sum").numpy()
    values = rows.astype(F32)
    nan = np.isnan(values)
    # The sum starts from +0, and +0 + -0 is +0.
    minus_zero = _bits(rows) == 0x8000
    # float32 denormals (only bfloat16 has values below 2^-126): TensorFlow
    # runs CPU kernels with denormals flushed to zero, so they may read 0.
    denormal = (values != 0) & (np.abs(values) < np.finfo(F32).tiny)
    exact = ~(nan | minus_zero | denormal)
    np.testing.assert_array_equal(_bits(out)[exact], _bits(rows)[exact])
    assert np.isnan(out.astype(F32)[nan]).all()
    np.testing.assert_array_equal(_bits(out)[nan] & 0x8000,
                                  _bits(rows)[nan] & 0x8000)
    assert (_bits(out)[minus_zero] == 0).all()
    got = out.astype(F32)[denormal]
    assert ((got == values[denormal]) | (got == 0)).all()
    assert denormal.sum() == (254 if dtype == tf.bfloat16 else 0)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=lambda d: d.name)
def test_store_rounds_like_numpy_across_the_range(dtype):
    # w * row is exact in float32 (8- or 11-bit significands), so each
    # output is one rounding of a known float32: ties, subnormal results
    # and overflow to infinity included. NumPy / ml_dtypes round to
    # nearest even.
    np_dt = dtype.as_numpy_dtype
    rng = np.random.default_rng(9)
    n = 20000
    if dtype == tf.float16:
        exp_w = rng.integers(-24, 16, n)
        exp_r = rng.integers(-14, 16, n)
    else:  # keep the float32 products normal (no flush-to-zero question)
        exp_w = rng.integers(-60, 60, n)
        exp_r = rng.integers(-60, 60, n)
    w = (rng.uniform(1, 2, n) * 2.0 ** exp_w).astype(F32).astype(np_dt)
    r = (rng.uniform(1, 2, n) * 2.0 ** exp_r).astype(F32).astype(np_dt)
    r = np.where(rng.random(n) < 0.5, r, -r).astype(np_dt).reshape(-1, 1)
    out = lookup_ops.segment_combine(
        tf.constant(r), np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.int64), tf.constant(w), n, "sum").numpy()
    with np.errstate(over="ignore"):  # overflow to inf is intended
        want = (w.astype(F32) * r[:, 0].astype(F32)).astype(np_dt)
    want = want.reshape(-1, 1)
    np.testing.assert_array_equal(_bits(out), _bits(want))
    stored = np.abs(want.astype(F32))
    if dtype == tf.float16:  # the sample reaches both ends of the range
        assert np.isinf(stored).any() and (stored < 2.0 ** -14).any()
