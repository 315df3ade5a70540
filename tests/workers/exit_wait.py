"""Rank 0 begins a lookup that rank 1 never makes; rank 1's program ends
half a second later, while that lookup is in flight on rank 0 (as when
rank 0 is still receiving rank 1's part of their last collective).

Rank 0 watches rank 1's process from a thread: `gone_after` is how long
after the end of its program rank 1 went (None: not within 60 s). Rank 0
records the error of its lookup. argv[1] (optional): rank 1's exit wait
cap (`_EXIT_WAIT`); rank 0 then waits longer before it gives the lookup up
(`_FINISHING_GRACE` 30 s) and aborts it itself once rank 1 is gone."""

import json
import os
import sys
import threading
import time

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import OUT, RANK, write_result  # noqa: E402

from sok_keras import divergence  # noqa: E402

CAP = float(sys.argv[1]) if len(sys.argv) > 1 else None
if CAP is not None:
    divergence._EXIT_WAIT = CAP
    divergence._FINISHING_GRACE = 30.0

table = sok.Variable(np.ones((20, 2)), dtype="float32", name="t")
ids = tf.constant([[1, 2], [3, -1]], tf.int64)
sok.lookup_sparse(table, ids).numpy()  # both ranks
begun = os.path.join(OUT, "begun")
ended = os.path.join(OUT, "rank1.json")


def alive(pid):
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


if RANK == 1:
    wait_for(begun)
    time.sleep(0.5)  # rank 0's lookup is in flight
    write_result({"ended": time.time()})
else:
    watch = {"gone_after": None}

    def watcher():
        wait_for(ended)
        with open(ended) as f:
            peer = json.load(f)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not alive(peer["pid"]):
                watch["gone_after"] = time.time() - peer["ended"]
                if CAP is not None:  # (this rank would wait 30 s)
                    divergence._abort_collectives("rank 1 is gone")
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    with open(begun, "w"):
        pass
    try:
        sok.lookup_sparse(table, tf.constant([[4, 5]], tf.int64)).numpy()
        error = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        error = str(e)
    thread.join(65)
    write_result({"gone_after": watch["gone_after"], "error": error})
