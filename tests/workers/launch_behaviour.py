"""sokrun behaviour without TensorFlow. argv[1] is the mode:

- echo: lines on stdout and stderr (one without a newline), exit 0;
- fail: every rank starts a grandchild and reports; rank 1 exits 3 after
  0.5 s, the others sleep 60 s;
- codes: rank 0 exits 0 at once, rank 1 exits 7 after 0.3 s;
- hang: every rank reports and sleeps 60 s; rank 0 ignores SIGTERM.
- reported: rank 1 reports rank 0's failure in sok_keras' words and exits
  1 first; rank 0 exits 5 3 s later.
- reported_stuck: as reported, but rank 0 hangs (60 s) instead of
  exiting.
- cascade: rank 1 exits 3; rank 0 exits 1 25 ms after rank 1's process
  has ended (as a peer that learns of a rank's death does).
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
if mode in ("reported", "reported_stuck"):
    # sok_keras' way: rank 0 fails and waits for its peer to say why
    # before it exits; rank 1 reports rank 0's failure and exits first.
    if RANK == 0:
        print("RuntimeError: rank 0's own error", file=sys.stderr,
              flush=True)
        time.sleep(3 if mode == "reported" else 60)
        sys.exit(5)
    time.sleep(0.5)
    print("sok_keras: rank 1: rank 0 failed at step 5 of epoch 1 of fit: "
          "RuntimeError: rank 0's own error", file=sys.stderr, flush=True)
    sys.exit(1)
if mode == "cascade":
    import os

    from _worker import OUT

    marker = os.path.join(OUT, "rank1.pid")
    if RANK == 1:
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        os._exit(3)
    while not os.path.exists(marker):
        time.sleep(0.001)
    with open(marker) as f:
        pid = int(f.read())

    def ended():
        """Rank 1 is reaped (not only a zombie): its parent's wait for it
        has returned (sokrun's, or the fork server's)."""
        return not os.path.exists(f"/proc/{pid}")

    while not ended():
        time.sleep(0.0005)
    # A peer learns of a rank's exit some time after it (a closed socket,
    # a missed heartbeat): 25 ms here, inside sokrun's 50 ms poll, and
    # room for its waiter threads on a loaded machine.
    time.sleep(0.025)
    os._exit(1)
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
