"""Helpers for worker scripts run by tests/multiprocess.py."""

import json
import os

# SOK_TEST_RANK: set by tests that start ranks without sokrun.
RANK = int(os.environ.get("SOK_RANK", os.environ.get("SOK_TEST_RANK", "0")))
NUM_RANKS = int(os.environ.get("SOK_NUM_RANKS", "1"))
OUT = os.environ.get("SOK_TEST_OUT", ".")


def write_result(result):
    """Writes this rank's JSON result (atomically) for the harness."""
    result = dict(result, pid=os.getpid())
    path = os.path.join(OUT, f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
