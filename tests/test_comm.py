"""Communicator on 2 and 3 real processes (TF collectives over gRPC)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess import run_workers  # noqa: E402
from multiprocess import worker_path  # noqa: E402


@pytest.mark.parametrize("n", [2, 3])
def test_collectives(n):
    # The worker checks exchange / gradients itself (it raises on mismatch).
    results = run_workers(worker_path("comm_collectives"), n, timeout=120)
    ranks = np.arange(n)
    for r, res in enumerate(results):
        assert res["sum"] == [n * (n + 1) / 2, 10.0 * ranks.sum()]
        np.testing.assert_allclose(
            res["mean"], [(n + 1) / 2, 10.0 * ranks.mean()], rtol=1e-6
        )
        assert res["max_i64"] == [n - 1, 0]
        assert res["min_i32"] == [5]
        assert res["gather_i32"] == [[q, q + 100] for q in range(n)]
        assert res["gather_i64"] == [q for q in range(n) for _ in range(2)]
        assert res["gather_bool"] == [q % 2 == 0 for q in range(n)]
        assert res["bcast0"] == [0.0, 2.0]
        assert res["bcast_last"] == [n - 1]
        # One trace for every shape: instance keys are runtime tensors.
        assert res["dyn_traces"] == 1
        assert res["exchange_traces"] == 1
        # Several power-of-two buckets were exercised.
        buckets = {1 << (b - 1).bit_length() for b in res["buckets"]}
        assert len(buckets) >= 3, res["buckets"]
        # 30 agreements with a 120 s deadline leave no thread behind
        # (before: 2 each, until their timeouts ran out).
        assert res["agree_thread_growth"] <= 4, res["agree_thread_growth"]


def test_watchdog_turns_stall_into_error():
    timeout = 3.0
    results = run_workers(
        worker_path("comm_watchdog"), 2, args=(timeout, 30), timeout=90
    )
    res = results[0]
    assert res["warm"] == [2.0]
    assert res["error"] is not None, res
    assert "sok_keras: rank 0: exchange 'stall/ids'" in res["error"]
    assert f"within {timeout:g} s" in res["error"]
    # Fired after the timeout and long before the 30 s stall ended (tracing
    # takes ~1 s; the margin is for a loaded CI machine).
    assert timeout <= res["elapsed"] < timeout + 15, res["elapsed"]
    # The runtime stays aborted: later collectives fail at once.
    assert "exchange 'stall/ids'" in res["after"]
    # ... without waiting out another timeout.
    assert res["after_elapsed"] < timeout, res["after_elapsed"]


def test_inflight_markers():
    import tensorflow as tf

    from sok_keras import inflight

    x = tf.constant([1.0, 2.0])
    y, token = inflight.begin(x, "eager/key")
    assert [k for k, _ in inflight.snapshot()] == ["eager/key"]
    inflight.end(y, token)
    assert inflight.snapshot() == []

    @tf.function
    def step(x, fail):
        y, token = inflight.begin(x, "graph/key")
        check = tf.debugging.assert_less(fail, 1.0, message="boom")
        with tf.control_dependencies([check]):
            y = y * 2.0
        return inflight.end(y, token)

    assert step(x, 0.0).numpy().tolist() == [2.0, 4.0]
    assert inflight.snapshot() == []
    with pytest.raises(tf.errors.InvalidArgumentError, match="boom"):
        step(x, 5.0)
    # A failed step leaves no entry behind for the watchdog.
    assert inflight.snapshot() == []


def test_next_pow2_exponent():
    import tensorflow as tf

    from sok_keras.comm import _next_pow2_exponent

    for m in list(range(0, 70)) + [2**20 - 1, 2**20, 2**20 + 1, 2**40 + 1]:
        e = int(_next_pow2_exponent(tf.constant(m, tf.int64)))
        assert (1 << e) >= max(m, 1) and (e == 0 or (1 << (e - 1)) < m), m


def test_host_agreements_have_their_own_collective_group():
    """A TF collective group has one device type: host-side agreements
    (pinned to the CPU) must not share the data's group, which is on the
    GPU when the tables are (found on the H200: "joining a group with
    incompatible device type GPU")."""
    from sok_keras import comm

    host = comm.HostCollectiveCommunicator(0, 2, timeout=None)
    data = comm.CollectiveCommunicator(0, 2, timeout=None)
    assert host.group_key != data.group_key
    assert isinstance(host, comm.CollectiveCommunicator)


def test_colliding_keys_are_refused_with_what_to_rename():
    """Call-site keys hash to 25-bit bases (24 before: realistic models of
    about 300 per-feature tables met a collision). A collision is refused
    on the spot, naming both keys and saying that renaming a layer or
    table changes them; the same key again is not a collision."""
    import zlib

    from sok_keras import comm

    data = comm.CollectiveCommunicator(0, 2, timeout=None)
    a = "exchange:emb2029/embeddings#0/rows|float32|[8]"
    b = "exchange:emb8917/embeddings#0/rows|float32|[8]"
    assert zlib.crc32(a.encode()) % comm._BASES == (
        zlib.crc32(b.encode()) % comm._BASES)
    assert data._base(a) == data._base(a)
    with pytest.raises(ValueError, match=r"'exchange:emb2029/embeddings#0/"
                       r"rows\|float32\|\[8\]' and 'exchange:emb8917/.*"
                       r"rename one of the two \(the layer's `name=`"):
        data._base(b)
    # Every instance key (base * 64 + a bucket exponent < 64) is an int32.
    assert comm._BASES * 64 + 63 == 2 ** 31 - 1
    # A collision of the 24-bit bases is none in the 25-bit ones.
    c = "exchange:emb99/embeddings#0/rows|float32|[8]"
    d = "exchange:emb12660/embeddings#0/rows|float32|[8]"
    assert zlib.crc32(c.encode()) % 0xFFFFFF == (
        zlib.crc32(d.encode()) % 0xFFFFFF)
    other = comm.CollectiveCommunicator(0, 2, timeout=None)
    assert other._base(c) != other._base(d)
