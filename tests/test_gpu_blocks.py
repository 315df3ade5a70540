"""SokGatherBlocks / SokScatterBlocks on the GPU against the CPU kernels,
skipped where TensorFlow sees no GPU. Bitwise equal (the ops only copy),
deterministic, every dtype, and the gradient on the GPU."""

import numpy as np
import pytest
import tensorflow as tf

from sok_keras import lookup_ops

GPUS = tf.config.list_physical_devices("GPU")
pytestmark = pytest.mark.skipif(not GPUS, reason="no GPU visible")

CPU, GPU = "/CPU:0", "/GPU:0"
DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
          np.uint32, np.int64, np.uint64, np.float16,
          tf.bfloat16.as_numpy_dtype, np.float32, np.float64, np.complex64,
          np.complex128]


def _on(device, fn, *args):
    with tf.device(device):
        out = fn(*args)
        assert device[1:4] in out.device  # ran where asked
    return out.numpy()


def _check(fn, *args):
    cpu = _on(CPU, fn, *args)
    gpu = _on(GPU, fn, *args)
    gpu2 = _on(GPU, fn, *args)
    assert cpu.dtype == gpu.dtype and cpu.shape == gpu.shape
    np.testing.assert_array_equal(gpu, gpu2)
    np.testing.assert_array_equal(cpu, gpu)


def _blocks(rng, n, m, disjoint):
    if disjoint:
        cuts = np.sort(rng.integers(0, n + 1, size=2 * m))
        order = rng.permutation(m)
        return cuts[0::2][order], (cuts[1::2] - cuts[0::2])[order]
    starts = rng.integers(0, n + 1, size=m)
    return starts, np.array([rng.integers(0, n - s + 1) for s in starts])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_match_cpu(dtype):
    rng = np.random.default_rng(0)
    for n, m, rest in ((0, 0, ()), (1, 1, ()), (50, 7, (3,)),
                       (4000, 64, (2, 5))):
        values = (rng.normal(size=(n,) + rest) * 10).astype(dtype)
        starts, lengths = _blocks(rng, n, m, disjoint=False)
        _check(lambda: lookup_ops.gather_blocks(values, starts, lengths))
        starts, lengths = _blocks(rng, n, m, disjoint=True)
        grad = (rng.normal(size=(int(lengths.sum()),) + rest)).astype(dtype)
        _check(lambda: lookup_ops.scatter_blocks(grad, starts, lengths, n))


def test_exchange_layout_adjacent_blocks():
    """The fused exchange's packing: blocks (rank j, table t) that are often
    adjacent in the source, merged into one copy on the GPU."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 4)).astype(np.float32)
    starts, lengths = [0, 10, 4, 14, 7, 20], [4, 4, 3, 6, 3, 10]
    _check(lambda: lookup_ops.gather_blocks(x, starts, lengths))
    _check(lambda: lookup_ops.gather_blocks(x, [0, 5, 10], [5, 5, 20]))
    _check(lambda: lookup_ops.scatter_blocks(x, [0, 5, 10], [5, 5, 20], 30))


def test_gradient_on_gpu_matches_cpu():
    rng = np.random.default_rng(2)
    x0 = rng.normal(size=(40, 3)).astype(np.float32)
    up = rng.normal(size=(17, 3)).astype(np.float32)
    starts, lengths = [30, 0, 12, 40], [8, 4, 5, 0]

    def grad():
        x = tf.constant(x0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = lookup_ops.gather_blocks(x, starts, lengths)
            loss = tf.reduce_sum(y * up)
        return tape.gradient(loss, x)

    _check(grad)


def test_bad_blocks_raise_on_gpu():
    x = tf.zeros([5, 2])
    with tf.device(GPU):
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            lookup_ops.gather_blocks(x, [4], [3], site="k")
        assert "block 0 (start 4, length 3) is out of range" in str(
            info.value)
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            lookup_ops.scatter_blocks(tf.zeros([5, 2]), [2, 0], [2, 3], 6)
        assert "overlap" in str(info.value)
