"""A fork server for the suite's rank processes (`SOK_TEST_FORKSERVER=1`).

Each multi-process test starts its ranks through sokrun, and each rank used
to pay about 5 CPU-seconds for `import tensorflow, keras, sok_keras` before
its first line ran: over a hundred such starts were a third of the suite's
CPU time. The server imports them once (one server per pytest process, run
by `tests/multiprocess.py`) and forks a fresh process for each rank.

Nothing else about a rank changes. sokrun still starts one process per
rank, with its environment, ports, process group and signals; that process
is this file's client. It hands its standard streams, environment, working
directory and arguments to the server, then stands in for the forked rank:
it forwards the signals it gets to the rank's process group and exits with
the rank's status (or dies of the same signal). The rank runs the script as
`__main__` (runpy) after a reset to what a new interpreter would have:
signal handlers, `sys.argv`, `sys.orig_argv` and `sys.path` from the script
and PYTHONPATH, NumPy's global generator reseeded. If the client dies, even
by SIGKILL, the rank kills its process group (it watches a pipe only the
client holds), so sokrun's and the harness' guarantee holds: nothing is
left running.

What the server cannot give a rank: a hash seed of its own (every rank
shares the server's `PYTHONHASHSEED`), and environment variables that
TensorFlow reads while it is imported (the suite sets none per job). A
job that needs a cold start passes `forkserver=False` to
`multiprocess.launch`; `SOK_TEST_FORKSERVER=0` (the default outside
`make test`) runs every rank as a plain `python script.py`.

Usage:
    python tests/forkserver.py --serve SOCKET       # prints "ready"
    SOK_TEST_FORKSERVER_SOCKET=SOCKET python tests/forkserver.py SCRIPT ARGS
"""

import json
import os
import select
import signal
import socket
import struct
import sys

SOCKET_VAR = "SOK_TEST_FORKSERVER_SOCKET"
MARKER_VAR = "SOK_TEST_MARKER"  # the harness' job marker (multiprocess.py)
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
              signal.SIGUSR1, signal.SIGUSR2)


def _send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    data = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock, maxfds=0):
    """One message (and the fds sent with its first bytes); None at EOF.
    Reads no byte past the message: the next one stays in the socket."""
    fds = []
    buf = b""

    def fill(n):  # until len(buf) == n
        nonlocal buf, fds
        while len(buf) < n:
            if maxfds and not buf:
                more, fds, _, _ = socket.recv_fds(sock, n, maxfds)
            else:
                more = sock.recv(n - len(buf))
            if not more:
                return False
            buf += more
        return True

    if not fill(4) or not fill(4 + struct.unpack("!I", buf[:4])[0]):
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(buf[4:]), fds


def _die_like(code):
    """Ends this process with exit code `code`; a negative one is death by
    signal -code, as `os.waitstatus_to_exitcode` reports it."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        code = 128 - code  # only if the signal did not end us
    os._exit(code)


# -- client: the process sokrun starts for a rank ----------------------------

def client(script_argv):
    """Runs `script_argv` in a process forked by the server; returns never
    (exits with that process' status)."""
    path = os.environ[SOCKET_VAR]
    env = dict(os.environ)
    del env[SOCKET_VAR]
    death_r, death_w = os.pipe()  # the rank's read end sees EOF when we die
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _send(sock, {"run": script_argv, "env": env, "cwd": os.getcwd()},
          fds=[0, 1, 2, death_r])
    os.close(death_r)
    state = {"pid": None, "pending": []}

    def forward(signum, frame):
        if state["pid"] is None:
            state["pending"].append(signum)
        else:  # to the rank's process group, as sokrun signals ours
            try:
                os.killpg(state["pid"], signum)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(state["pid"], signum)
                except ProcessLookupError:
                    pass

    for s in _FORWARDED:
        signal.signal(s, forward)
    reply, _ = _recv(sock)
    if reply is None or "pid" not in reply:
        sys.stderr.write(f"forkserver: no rank was started: {reply}\n")
        os._exit(1)
    state["pid"] = reply["pid"]
    for signum in state["pending"]:
        forward(signum, None)
    reply, _ = _recv(sock)  # signals in between: forwarded, recv resumed
    if reply is None or "status" not in reply:
        sys.stderr.write("forkserver: the server went away before the rank "
                         "ended\n")
        os._exit(1)
    os.close(death_w)
    _die_like(os.waitstatus_to_exitcode(reply["status"]))


# -- the forked rank ---------------------------------------------------------

def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return 1


def _rank(request, fds, base_path, base_pythonpath):
    """Becomes the rank: standard streams, environment, arguments, then the
    script as `__main__`. Never returns."""
    import runpy
    import threading

    import numpy as np

    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        death = fds[3]

        def watch():  # EOF: the client (the process sokrun knows) died
            while True:
                try:
                    if not os.read(death, 1):
                        break
                except InterruptedError:
                    continue
            os.killpg(0, signal.SIGKILL)  # with what it started in its group

        threading.Thread(target=watch, daemon=True).start()
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["run"][0]
        sys.argv = list(request["run"])
        sys.orig_argv = [sys.executable] + sys.argv
        pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(
            os.pathsep) if p]
        rest = [p for p in base_path[1:] if p not in base_pythonpath]
        sys.path[:] = ([os.path.dirname(os.path.abspath(script))]
                       + [os.path.abspath(p) for p in pythonpath] + rest)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                  signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        np.random.seed(None)
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(line_buffering=True, write_through=True)
            sys.stderr.reconfigure(line_buffering=True, write_through=True)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        try:
            threading._shutdown()  # as at interpreter exit: non-daemon threads
        except Exception:
            pass
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        _die_like(code)


# -- server -------------------------------------------------------------------

def serve(path):
    """Imports TensorFlow, Keras and sok_keras, then forks a rank for each
    client; serves until its parent (the pytest process) exits (the
    harness also starts it with sokrun's parent-death signal)."""
    parent = os.getppid()
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401
    import keras  # noqa: F401
    import sok_keras  # noqa: F401

    base_path = list(sys.path)
    base_pythonpath = [os.path.abspath(p) for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    ranks = {}  # pid -> (connection, marker)
    cpu = 0.0  # CPU seconds of the ranks reaped so far
    while os.getppid() == parent:
        while ranks:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            cpu += usage.ru_utime + usage.ru_stime
            conn, _ = ranks.pop(pid, (None, None))
            if conn is not None:
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()
        ready, _, _ = select.select([listener], [], [], 0.05)
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _recv(conn, maxfds=4)
        except OSError:
            conn.close()
            continue
        if request is None:
            conn.close()
            continue
        if "cpu" in request:  # the CPU report (tests/conftest.py)
            _send(conn, {"cpu": cpu})
            conn.close()
            continue
        if "live" in request:  # the harness: ranks of a job still running
            _send(conn, {"pids": [p for p, (_, m) in ranks.items()
                                  if m == request["live"]]})
            conn.close()
            continue
        if len(fds) != 4:
            _send(conn, {"error": f"expected 4 fds, got {len(fds)}"})
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other, _ in ranks.values():
                other.close()
            conn.close()
            _rank(request, fds, base_path, base_pythonpath)
        for fd in fds:
            os.close(fd)
        ranks[pid] = (conn, request["env"].get(MARKER_VAR))
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass


def _ask(path, request):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _send(sock, request)
        reply, _ = _recv(sock)
    except OSError:
        return {}
    finally:
        sock.close()
    return reply or {}


def live_ranks(path, marker):
    """PIDs of the server's ranks started for the job `marker` that have
    not been reaped yet."""
    return list(_ask(path, {"live": marker}).get("pids", []))


def ranks_cpu_seconds(path):
    """CPU seconds of the server's ranks that have ended."""
    return float(_ask(path, {"cpu": True}).get("cpu", 0.0))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])
