"""Both ranks make one lookup; then rank 1's program ends at once while
rank 0 stays on for `argv[1]` seconds (as if it were still fetching rank
1's part of the last collective). Rank 0 records whether rank 1's process
was still alive at the end, and after how many seconds it went; argv[2]
(optional) lowers the exit wait's cap."""

import os
import sys
import time

import sok_keras as sok

sok.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import OUT, RANK, write_result  # noqa: E402

from sok_keras import divergence  # noqa: E402

if len(sys.argv) > 2:
    divergence._EXIT_WAIT = float(sys.argv[2])
stay = float(sys.argv[1])

table = sok.Variable(np.ones((20, 2)), dtype="float32", name="t")
ids = tf.constant([[1, 2], [3, -1]], tf.int64)
sok.lookup_sparse(table, ids).numpy()  # both ranks


def alive(pid):
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


if RANK == 1:
    write_result({"ended": time.time()})
else:
    deadline = time.monotonic() + 60
    path = os.path.join(OUT, "rank1.json")
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    import json

    with open(path) as f:
        peer = json.load(f)
    # Stays `stay` s watching rank 1, or until it went: after how long
    # (None: still alive)?
    start, gone_after = time.monotonic(), None
    while time.monotonic() - start < stay and gone_after is None:
        if not alive(peer["pid"]):
            gone_after = time.monotonic() - start
        time.sleep(0.02)
    write_result({"peer_alive": alive(peer["pid"]), "gone_after": gone_after})
