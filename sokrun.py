"""`sokrun`: starts N worker processes of one program on this host.

Usage:

```
sokrun -np N [--timeout S] [--grace S] program [args...]
python -m sokrun -np 2 python train.py --epochs 3
sokrun -np 2 train.py --epochs 3     # a .py file runs with this Python
```

Each rank gets the environment variables

- `SOK_RANK`: its rank, 0..N-1;
- `SOK_NUM_RANKS`: N;
- `SOK_LOCAL_RANK`: its rank on this host (here: its rank), which
  `sok_keras.init()` uses to give each rank its own GPU;
- `SOK_WORKER_ADDRS`: the comma-separated `127.0.0.1:port` addresses of all
  ranks, in rank order (free loopback ports picked by sokrun);
- `PYTHONUNBUFFERED=1`, so that Python output arrives line by line;
- `LD_PRELOAD` of sok_keras's bind guard and `SOK_BIND_HOST=127.0.0.1`, so
  that TensorFlow's (unauthenticated) gRPC servers listen on the loopback
  address only, not on every interface (`SOK_BIND_GUARD=0` turns it off).

`sok_keras.init()` reads them. Every output line of rank r (stdout and
stderr) is printed with the prefix `[r] `.

If a rank exits with a non-zero code, or the job runs longer than
`--timeout` seconds, sokrun stops every other rank (SIGTERM to its process
group, SIGKILL after `--grace` seconds), says which rank failed and why, and
exits non-zero: with the failing rank's exit code (128 + signal number when
it was killed by a signal), or 124 on timeout. Where the rank that exited
first reports another rank's failure (sok_keras' failing rank waits for its
peers to say why before it exits), that rank's own code is the job's once it
exits (sokrun waits 15 s for it, within `--timeout`). Ctrl-C, SIGTERM or SIGHUP
(a closed terminal) to sokrun stops all ranks the same way (exit 130 / 143
/ 129). sokrun exits 0 only if every
rank exited 0.

Each rank runs in its own process group, and its first process dies with
sokrun even if sokrun is killed with SIGKILL (PR_SET_PDEATHSIG on Linux).

sokrun holds each rank's port (a socket bound with SO_REUSEADDR, never
listening) until the job ends: the rank's server binds it, no other
program's `bind` gets it meanwhile.

Limits: a program that binds with SO_REUSEADDR to one of these ports on
purpose can still take it first. If sokrun is killed with SIGKILL,
processes that a rank started itself (grandchildren) are not stopped by
PR_SET_PDEATHSIG; with any other ending they are (process-group kill).
With `SOK_BIND_GUARD=0`, or a program whose TensorFlow does not load the
bind guard (a static binary), TensorFlow's gRPC servers listen on every
interface.
"""

import argparse
import collections
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 20


def _free_ports(n):
    """Returns `n` distinct free TCP ports (free on every interface) and the
    sockets that hold them until the job ends (close them then).

    Each socket stays bound (with SO_REUSEADDR, never listening), so the
    rank's own server (also SO_REUSEADDR) can bind and listen on the port,
    while the kernel hands the port to no other `bind(port 0)` meanwhile:
    another job started at the same moment cannot pick it.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks], socks
    except BaseException:
        for s in socks:
            s.close()
        raise


def bind_guard_library():
    """The path of sok_keras's bind guard (`_sok_bind_guard*.so`), found
    without importing sok_keras (nor TensorFlow); None if not built."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sok_keras")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        sources = os.path.join(folder, "_sources.py")
        if not os.path.exists(sources):
            continue
        # (By path: importing `sok_keras._sources` would import sok_keras.)
        spec = importlib.util.spec_from_file_location("_sok_sources", sources)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found = module.built_library(folder, "_sok_bind_guard")
        if found:
            return found
    return None


def bind_guard_env(host, env=None):
    """The variables that make a rank's servers listen on `host` only.

    TensorFlow's gRPC server listens on the wildcard address; with these
    (`LD_PRELOAD` of the bind guard and `SOK_BIND_HOST`), a bind to the
    wildcard address becomes a bind to `host`. Returns {} when the guard is
    not built or `SOK_BIND_GUARD=0` asks for TensorFlow's behaviour.
    """
    env = os.environ if env is None else env
    if env.get("SOK_BIND_GUARD", "1") == "0":
        return {}
    lib = bind_guard_library()
    if lib is None:
        return {}
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if lib not in preload:
        preload.insert(0, lib)
    return {"LD_PRELOAD": ":".join(preload), "SOK_BIND_HOST": host}


def _child_setup(parent_pid):
    """Runs in the child between fork and exec."""

    def setup():
        os.setpgid(0, 0)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # not Linux: groups still work
            pass
        if os.getppid() != parent_pid:  # sokrun died before prctl
            os._exit(1)

    return setup


_CAUSE_PATTERNS = (
    # divergence.py: "sok_keras: rank 1: rank 0 failed at step 5 ..."
    re.compile(r"sok_keras: rank (\d+): rank (\d+) failed"),
    # saving.py: "sok_keras: rank 1: model.save('p') failed on rank 0 (of"
    re.compile(r"sok_keras: rank (\d+): .* failed on rank (\d+) \(of "),
)


def _cause_named(rank):
    """The other rank whose failure `rank`'s last output reports in
    sok_keras' own words, or None."""
    for line in reversed(rank.tail):
        for pattern in _CAUSE_PATTERNS:
            m = pattern.search(line)
            if m and int(m.group(1)) == rank.rank != int(m.group(2)):
                return int(m.group(2))
    return None


def _describe(code):
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class _Rank:
    def __init__(self, rank, proc):
        self.rank = rank
        self.proc = proc
        self.tail = collections.deque(maxlen=_TAIL_LINES)
        self.readers = []
        # When the process exited, taken by a thread blocked in wait(): of
        # two ranks that exit within one poll, the first is the cause (a
        # peer that learns of its exit exits right after it).
        self.exited_at = None
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self):
        self.proc.wait()
        self.exited_at = time.monotonic()

    def exit_time(self):
        """When it exited (its waiter's time, else now)."""
        return self.exited_at if self.exited_at is not None else (
            time.monotonic())

    def signal_group(self, sig):
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self):
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False


class _Printer:
    """Prefixes and forwards lines; one lock so lines never interleave."""

    def __init__(self):
        self.lock = threading.Lock()

    def pump(self, pipe, out, prefix, tail):
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                tail.append(line.decode("utf-8", "replace").rstrip("\n"))
                with self.lock:
                    try:
                        out.write(prefix + line)
                        out.flush()
                    except (BrokenPipeError, ValueError):
                        pass
        finally:
            pipe.close()

    def say(self, message):
        with self.lock:
            sys.stderr.write(f"sokrun: {message}\n")
            sys.stderr.flush()


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="sokrun",
        description="Runs N ranks of a program on this host for sok_keras.",
    )
    parser.add_argument(
        "-np", "--np", dest="np", type=int, required=True,
        help="number of ranks (processes) to start",
    )
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="seconds after which the whole job is stopped (exit 124)",
    )
    parser.add_argument(
        "--grace", type=float, default=5.0,
        help="seconds between SIGTERM and SIGKILL when stopping ranks "
        "(default 5)",
    )
    parser.add_argument(
        "program", help="the program to run, e.g. python; a path to a .py "
        "file runs with this Python (as torchrun does)")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.np < 1:
        parser.error(f"-np must be at least 1, got {ns.np}")
    if ns.timeout is not None and not 0 < ns.timeout < float("inf"):
        parser.error(f"--timeout must be a positive number of seconds, got "
                     f"{ns.timeout} (leave it out for no timeout)")
    if not 0 <= ns.grace < float("inf"):
        parser.error(f"--grace must be a number of seconds >= 0, got "
                     f"{ns.grace}")
    return ns


def _command(program, args):
    """The command line of a rank: a `.py` file that exists runs with this
    Python (`sokrun -np 2 train.py`, as torchrun does), anything else as
    given."""
    if program.endswith(".py") and os.path.isfile(program):
        return [sys.executable, program] + list(args)
    return [program] + list(args)


def main(argv=None):
    """Entry point of `sokrun`; returns (and exits with) the job's code.

    Args:
        argv: the arguments without the program name; defaults to
            `sys.argv[1:]`.

    Returns:
        The exit code: 0 if every rank exited 0, else the code of the first
        rank that failed, 124 on timeout, 130/143 when interrupted.

    Example:

    >>> import sokrun
    >>> sokrun.main(["-np", "2", "python", "-c", "print('hi')"])
    """
    ns = _parse(sys.argv[1:] if argv is None else list(argv))
    n = ns.np
    printer = _Printer()
    try:
        ports, held = _free_ports(n)
    except OSError as e:  # (QA: -np 100000 ended in a raw traceback)
        printer.say(f"cannot reserve {n} ports for {n} ranks on this "
                    f"machine: {e}")
        return 1
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old_handlers = {
        s: signal.signal(s, on_signal)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    ranks = []
    code = 0
    try:
        for r in range(n):
            env = dict(os.environ)
            env.update(bind_guard_env("127.0.0.1", env))
            env.update(
                SOK_RANK=str(r),
                SOK_NUM_RANKS=str(n),
                SOK_LOCAL_RANK=str(r),
                SOK_WORKER_ADDRS=addrs,
                PYTHONUNBUFFERED="1",
            )
            try:
                proc = subprocess.Popen(
                    _command(ns.program, ns.args),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    preexec_fn=_child_setup(os.getpid()),
                )
            except OSError as e:
                hint = ""
                if ns.program.endswith(".py"):
                    hint = (" (to run a Python script, name it by its path, "
                            f"or: sokrun -np {n} python {ns.program})")
                printer.say(f"cannot start rank {r}: {ns.program!r}: {e}"
                            f"{hint}")
                code = 127
                break
            rank = _Rank(r, proc)
            prefix = f"[{r}] ".encode()
            for pipe, out in (
                (proc.stdout, sys.stdout.buffer),
                (proc.stderr, sys.stderr.buffer),
            ):
                t = threading.Thread(
                    target=printer.pump,
                    args=(pipe, out, prefix, rank.tail),
                    daemon=True,
                )
                t.start()
                rank.readers.append(t)
            ranks.append(rank)
        if code == 0:
            code = _supervise(ranks, ns.timeout, stop, printer,
                              _other_python(ns.program))
    finally:
        _stop_all(ranks, ns.grace)
        for rank in ranks:
            for t in rank.readers:
                t.join(timeout=2.0)
        for s, h in old_handlers.items():
            signal.signal(s, h)
        for sock in held:
            sock.close()
    return code


def _other_python(program):
    """A note for a failure when `program` is a bare `python` / `python3`
    that is not the Python running sokrun (another one first on PATH,
    maybe without the job's packages); else ''."""
    if program not in ("python", "python3"):
        return ""
    found = shutil.which(program)
    if found is None or os.path.realpath(found) == os.path.realpath(
            sys.executable):
        return ""
    return (f" (note: '{program}' is {found} here, not sokrun's own Python, "
            f"{sys.executable}; to run a script with sokrun's, name it: "
            "sokrun -np N train.py)")


def _supervise(ranks, timeout, stop, printer, note=""):
    """Waits for the ranks; returns the job's exit code (`note`: added to
    a failure's message)."""
    start = time.monotonic()
    while True:
        if stop["signal"] is not None:
            sig = stop["signal"]
            printer.say(
                f"received {signal.Signals(sig).name}; stopping all ranks"
            )
            return 128 + sig
        codes = [(rank, rank.proc.poll()) for rank in ranks]
        failed = [(rank, rc) for rank, rc in codes if rc not in (None, 0)]
        if failed:
            # The rank that exited first (several may have by this poll).
            rank, rc = min(failed, key=lambda f: f[0].exit_time())
            for t in rank.readers:  # let its last lines arrive first
                t.join(timeout=1.0)
            msg = f"rank {rank.rank} failed: it {_describe(rc)}{note}"
            cause = _cause_named(rank)
            if cause is not None:
                # A rank that failed waits a little before it raises, so
                # that its peers say why too: one of them often exits
                # first, with an error naming the rank that failed.
                msg += (f", after rank {cause} failed (rank {cause}'s error "
                        f"is in its output, lines [{cause}])")
                # The job's exit code is the failed rank's own (a
                # `sys.exit(3)` a scheduler reads), which it gives once
                # it sees its peer gone.
                wait = _CAUSE_WAIT if timeout is None else min(
                    _CAUSE_WAIT, timeout - (time.monotonic() - start))
                code = (_exit_code_of(ranks[cause], stop, wait)
                        if 0 <= cause < len(ranks) else None)
                if code not in (None, 0):
                    rc = code
                    msg += (f"; rank {cause} {_describe(code)}, which is "
                            "the job's exit code")
            others = [x.rank for x in ranks if x.proc.poll() is None]
            if others:
                msg += f"; stopping ranks {others}"
            if rank.tail:
                msg += f". Last output of rank {rank.rank}:\n" + "\n".join(
                    f"  | {line}" for line in rank.tail
                )
            printer.say(msg)
            return rc if rc > 0 else 128 - rc
        if all(rc is not None for _, rc in codes):
            return 0
        if timeout is not None and time.monotonic() - start > timeout:
            waiting = [x.rank for x in ranks if x.proc.poll() is None]
            printer.say(
                f"timeout: the job ran longer than --timeout {timeout:g} s; "
                f"ranks {waiting} were still running; stopping them"
            )
            return 124
        time.sleep(0.05)


# Seconds sokrun waits for a failed rank that its peer's error names to
# exit with its own code (it waits divergence._GRACE, 10 s, at most, for
# its peers to say why before it raises).
_CAUSE_WAIT = 15.0


def _exit_code_of(rank, stop, wait):
    """`rank`'s exit code once it has exited, within `wait` s (None if it
    has not, or a signal came meanwhile)."""
    deadline = time.monotonic() + wait
    while rank.proc.poll() is None and time.monotonic() < deadline:
        if stop["signal"] is not None:
            return None
        time.sleep(0.05)
    return rank.proc.poll()


def _stop_all(ranks, grace):
    """SIGTERM every rank's process group, SIGKILL what is left after
    `grace` seconds; waits for the direct children."""
    live = [r for r in ranks if r.proc.poll() is None or r.group_alive()]
    if not live:
        return
    for r in live:
        r.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not any(r.proc.poll() is None or r.group_alive() for r in live):
            break
        time.sleep(0.05)
    for r in live:
        if r.proc.poll() is None or r.group_alive():
            r.signal_group(signal.SIGKILL)
    for r in live:
        try:
            r.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    sys.exit(main())
