"""sokrun behaviour without TensorFlow. argv[1] is the mode:

- echo: lines on stdout and stderr (one without a newline), exit 0;
- fail: every rank starts a grandchild and reports; rank 1 exits 3 after
  0.5 s, the others sleep 60 s;
- codes: rank 0 exits 0 at once, rank 1 exits 7 after 0.3 s;
- hang: every rank reports and sleeps 60 s; rank 0 ignores SIGTERM.
"""

import signal
import subprocess
import sys
import time

from _worker import RANK, write_result

mode = sys.argv[1]
if mode == "echo":
    print(f"hello from rank {RANK}")
    print(f"warning from rank {RANK}", file=sys.stderr)
    sys.stdout.write(f"no newline {RANK}")
    sys.exit(0)
if mode == "codes":
    if RANK == 1:
        time.sleep(0.3)
        sys.exit(7)
    sys.exit(0)
if mode == "fail":
    child = subprocess.Popen(["sleep", "60"])  # same process group
    write_result({"child": child.pid})
    if RANK == 1:
        time.sleep(0.5)
        print("rank 1: something went wrong, exiting 3", file=sys.stderr)
        sys.exit(3)
    time.sleep(60)
    sys.exit(0)
if mode == "hang":
    if RANK == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_result({"ready": True})
    time.sleep(60)
    sys.exit(0)
sys.exit(f"unknown mode {mode!r}")
