"""Probe for tests/test_forkserver.py: what a rank forked by the fork server
sees, and how it ends. argv: CASE [ARGS...]."""

import os
import signal
import subprocess
import sys
import time

already = "tensorflow" in sys.modules  # before this script imports it

import numpy as np  # noqa: E402

from _worker import write_result  # noqa: E402

case = sys.argv[1]
if case == "env":
    import tensorflow as tf

    write_result({
        "argv": sys.argv, "orig_argv": sys.orig_argv, "cwd": os.getcwd(),
        "path0": sys.path[0], "probe": os.environ.get("PROBE"),
        "pgid_is_pid": os.getpgid(0) == os.getpid(), "preloaded": already,
        "name": __name__, "random": float(np.random.rand()),
        "sum": float(tf.reduce_sum(tf.range(10.0))),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    })
elif case == "exit":
    sys.exit(int(sys.argv[2]))
elif case == "raise":
    raise ValueError("probe failed on purpose")
elif case == "sigterm_self":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
elif case == "sleep":  # a grandchild in the rank's group, then wait
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; time.sleep(120)"])
    write_result({"child": child.pid})
    print("sleeping", flush=True)
    time.sleep(120)
