"""Collectives on N ranks: all_reduce / all_gather / broadcast / exchange,
eager and in tf.function, with changing shapes and gradients."""

import time

import numpy as np

from _worker import NUM_RANKS, RANK, write_result

import sok_keras.world as world

world.init(timeout=60)

import tensorflow as tf  # noqa: E402

comm = world.communicator()
N, R = NUM_RANKS, RANK
assert comm.rank == R and comm.num_ranks == N, (comm.rank, comm.num_ranks)
result = {}
t0 = time.time()

# -- all_reduce / all_gather / broadcast, eager --------------------------
x = tf.constant([R + 1.0, 10.0 * R], tf.float32)
result["sum"] = comm.all_reduce(x, "ar/f32").numpy().tolist()
result["mean"] = comm.all_reduce(x, "ar/f32m", op="mean").numpy().tolist()
result["max_i64"] = comm.all_reduce(
    tf.constant([R, -R], tf.int64), "ar/i64", op="max").numpy().tolist()
result["min_i32"] = comm.all_reduce(
    tf.constant([R + 5], tf.int32), "ar/i32", op="min").numpy().tolist()
result["gather_i32"] = comm.all_gather(
    tf.constant([[R, R + 100]], tf.int32), "ag/i32").numpy().tolist()
result["gather_i64"] = comm.all_gather(
    tf.fill([2], tf.constant(R, tf.int64)), "ag/i64").numpy().tolist()
result["gather_bool"] = comm.all_gather(
    tf.constant([R % 2 == 0]), "ag/bool").numpy().tolist()
result["bcast0"] = comm.broadcast(
    tf.constant([R * 1.5, 2.0]), "bc/0").numpy().tolist()
result["bcast_last"] = comm.broadcast(
    tf.constant([R], tf.int64), "bc/last", root=N - 1).numpy().tolist()

# -- the same inside tf.function with shapes unknown at trace time ---------
@tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
def dyn(v):
    return (comm.all_reduce(v, "dyn/ar"), comm.all_gather(v, "dyn/ag"),
            comm.broadcast(v, "dyn/bc", root=N - 1))


for length in (1, 3, 5, 3):
    v = tf.range(length, dtype=tf.float32) + R
    s, g, b = dyn(v)
    base = np.arange(length, dtype=np.float32)
    np.testing.assert_allclose(s.numpy(), N * base + sum(range(N)))
    np.testing.assert_allclose(
        g.numpy(), np.concatenate([base + r for r in range(N)]))
    np.testing.assert_allclose(b.numpy(), base + N - 1)
result["dyn_traces"] = dyn.experimental_get_tracing_count()


# -- exchange --------------------------------------------------------------
def make_counts(seed, high):
    """Same on every rank: random counts with zeros."""
    rng = np.random.RandomState(seed)
    c = rng.randint(0, high + 1, size=(N, N))
    c[rng.rand(N, N) < 0.3] = 0
    return c.astype(np.int64)


def rows_from(src, c, dim):
    """The rows rank src sends: value encodes (src, dst, i, col)."""
    out = []
    for dst in range(N):
        for i in range(c[src, dst]):
            out.append([src * 1e6 + dst * 1e4 + i * 10 + k for k in range(dim)])
    return np.asarray(out, np.float32).reshape(-1, dim)


def expected_recv(c, dim):
    parts = []
    for src in range(N):
        rows = rows_from(src, c, dim)
        off = int(c[src, :R].sum())
        parts.append(rows[off : off + c[src, R]])
    return np.concatenate(parts).reshape(-1, dim)


DIM = 3


@tf.function(input_signature=[tf.TensorSpec([None, DIM], tf.float32),
                              tf.TensorSpec([N, N], tf.int64)])
def exchange_fn(x, c):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = comm.exchange(x, c, "ex/rows")
        # Weighted by the receiving rank: dL/dx = x * (destination + 1).
        loss = 0.5 * tf.reduce_sum(y * y) * (R + 1)
    back = comm.exchange_back(y, c, "ex/rows")
    return y, back, tape.gradient(loss, x)


buckets = []
for step, high in enumerate([1, 6, 0, 17, 3, 40, 6]):
    c = make_counts(1000 + step, high)
    buckets.append(int(max(1, c.max())))
    x = rows_from(R, c, DIM)
    want_y = expected_recv(c, DIM)
    dest = np.repeat(np.arange(N), c[R])
    want_grad = x * (dest + 1)[:, None]
    y, back, grad = exchange_fn(tf.constant(x), tf.constant(c))
    np.testing.assert_array_equal(y.numpy(), want_y)
    np.testing.assert_array_equal(back.numpy(), x)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-6)
    # eagerly, int64 ids, 1-D
    ids = tf.constant(x[:, 0].astype(np.int64))
    got = comm.exchange(ids, tf.constant(c), "ex/ids")
    np.testing.assert_array_equal(got.numpy(), want_y[:, 0].astype(np.int64))
    # eager gradient
    xv = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xv)
        ye = comm.exchange(xv, c, "ex/eager")
        loss = 0.5 * tf.reduce_sum(ye**2) * (R + 1)
    np.testing.assert_allclose(tape.gradient(loss, xv).numpy(), want_grad,
                               rtol=1e-6)
result["exchange_traces"] = exchange_fn.experimental_get_tracing_count()


def threads():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("Threads:"))


# Host agreements with a long deadline (a save's, a fit's entry): each
# left a thread sleeping out its timeout (TensorFlow's collective
# timeout), so frequent saves piled up hundreds of threads.
control = world.control_communicator()
before = threads()
sums = [control.agree("threads", R + 1, 120) for _ in range(30)]
assert sums == [N * (N + 1) // 2] * 30, sums
result["agree_thread_growth"] = threads() - before
result["buckets"] = buckets
result["seconds"] = time.time() - t0
write_result(result)
print(f"rank {R}: ok in {result['seconds']:.1f} s")
