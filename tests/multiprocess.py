"""Multi-process test harness: runs a worker script on N ranks via sokrun.

Worker scripts live in `tests/workers/` (module-level code, one file per
scenario). They report with `tests/workers/_worker.py`:

```python
from _worker import RANK, write_result
...
write_result({"sum": float(total)})
```

`run_workers(path, 2)` launches `python -m sokrun -np 2
--timeout T python path ...` with `PYTHONPATH` set to the repository root,
asserts that every rank exited 0 and returns the per-rank results (rank
order). `run_sequence([(name, args), ...], N)` runs several worker scripts
one after the other in one job (tests/workers/sequence.py): one process
start per rank for several scenarios. Failure messages include the whole output of the job. Whatever
happens, nothing started by the run is left running: every process of the
job carries a unique marker in its environment, and `/proc` is scanned for
it afterwards (leftovers are killed and reported).

With `SOK_TEST_FORKSERVER=1` (set by `make test`), a Python rank is forked
from a server that has TensorFlow, Keras and sok_keras imported already
(`tests/forkserver.py`, one per pytest process): sokrun, its environment,
signals and exit codes are as before, without each rank's ~5 CPU-s of
imports. `launch(..., forkserver=False)` starts a job's ranks cold.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

try:  # imported as tests.multiprocess, or with tests/ on sys.path
    from . import forkserver as _fs
except ImportError:
    import forkserver as _fs

# Tests import this module as `multiprocess` and as `tests.multiprocess`:
# one module under both names, so that a process has one fork server.
for _name in ("multiprocess", "tests.multiprocess"):
    sys.modules.setdefault(_name, sys.modules[__name__])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")
MARKER_VAR = _fs.MARKER_VAR
FORKSERVER = os.path.join(REPO, "tests", "forkserver.py")
_server = {}  # this process' fork server: "proc", "socket", "dir"


def _repo_env():
    env = dict(os.environ)
    env.pop("SOK_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _stop_forkserver():
    proc = _server.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if _server.get("dir"):
        shutil.rmtree(_server["dir"], ignore_errors=True)


def forkserver_socket(force=False):
    """The socket of this process' fork server (started on first use), or
    None when `SOK_TEST_FORKSERVER` is not "1" (unless `force`)."""
    if not force and os.environ.get("SOK_TEST_FORKSERVER", "0") != "1":
        return None
    proc = _server.get("proc")
    if proc is not None and proc.poll() is None:
        return _server["socket"]
    _stop_forkserver()
    folder = tempfile.mkdtemp(prefix="sok_fs_")
    path = os.path.join(folder, "socket")
    env = _repo_env()
    for var in ("SOK_NUM_RANKS", "SOK_WORKER_ADDRS", "SOK_BIND_HOST",
                MARKER_VAR):
        env.pop(var, None)
    try:  # ranks bind as sokrun's would: the guard is preloaded here
        import sokrun
    except ImportError:
        sokrun = None
    guard = sokrun.bind_guard_library() if sokrun else None
    if guard:
        env["LD_PRELOAD"] = ":".join(
            [guard] + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    log = open(os.path.join(folder, "server.log"), "wb")
    proc = subprocess.Popen(
        [sys.executable, FORKSERVER, "--serve", path], env=env, cwd=REPO,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
        # its own group, SIGKILL when we die: as sokrun starts a rank
        preexec_fn=sokrun._child_setup(os.getpid()) if sokrun else None,
    )
    log.close()
    _server.update(proc=proc, socket=path, dir=folder)
    line = proc.stdout.readline()  # "ready" once TensorFlow is imported
    if line.strip() != b"ready":
        proc.kill()
        proc.wait()
        with open(os.path.join(folder, "server.log"), "rb") as f:
            detail = f.read().decode("utf-8", "replace")[-4000:]
        _stop_forkserver()
        raise RuntimeError(f"the fork server did not start:\n{detail}")
    if not _server.get("atexit"):
        atexit.register(_stop_forkserver)
        _server["atexit"] = True
    return path


def forked_cpu_seconds():
    """CPU seconds of the ranks this process' fork server has forked and
    reaped (they are its children, not ours: `RUSAGE_CHILDREN` misses
    them); 0 without a server."""
    proc = _server.get("proc")
    if proc is None or proc.poll() is not None:
        return 0.0
    return _fs.ranks_cpu_seconds(_server["socket"])


def _forked_leftovers(path, marker, wait=3.0):
    """The fork server's ranks of job `marker` still running `wait` s after
    the job (their client is gone, so they are killing themselves)."""
    deadline = time.monotonic() + wait
    while True:
        pids = _fs.live_ranks(path, marker)
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


class JobResult:
    """What a launched job left: exit code, output, per-rank results."""

    def __init__(self, returncode, output, results, elapsed, leftovers):
        self.returncode = returncode
        self.output = output
        self.results = results  # rank -> dict (ranks that wrote one)
        self.elapsed = elapsed
        self.leftovers = leftovers  # pids found running after the job

    def __repr__(self):
        return (
            f"JobResult(returncode={self.returncode}, "
            f"elapsed={self.elapsed:.1f}s, ranks={sorted(self.results)})"
        )


def _marked_pids(marker):
    """PIDs of live processes whose environment holds `marker`."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and needle in env.split(b"\0"):
            found.append(int(name))
    return found


def process_gone(pid):
    """Whether process `pid` has ended (it is gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def worker_path(name):
    """Returns the path of `tests/workers/<name>` (`.py` optional)."""
    if not name.endswith(".py"):
        name += ".py"
    return os.path.join(WORKERS, name)


def launch(
    program, num_ranks, args=(), timeout=120, grace=5.0, env=None,
    python=True, forkserver=True,
):
    """Runs `program` on `num_ranks` ranks through sokrun; never raises on
    a failed job.

    Args:
        program: a worker script path (run with this Python), or, with
            `python=False`, an executable.
        num_ranks: the number of ranks.
        args: extra arguments for the program.
        timeout: sokrun's `--timeout` (the harness waits 30 s more).
        grace: sokrun's `--grace`.
        env: extra environment variables.
        python: whether `program` is a Python script.
        forkserver: whether a Python script's ranks may be forked from the
            fork server (when `SOK_TEST_FORKSERVER=1`); False starts each
            as `python program`.

    Returns:
        A `JobResult`. `leftovers` lists marked processes that were still
        running after the job (they have been killed).
    """
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="sok_mp_") as out:
        full_env = _repo_env()
        full_env["SOK_TEST_OUT"] = out
        full_env[MARKER_VAR] = marker
        full_env.update(env or {})
        cmd = [
            sys.executable, "-m", "sokrun", "-np", str(num_ranks),
            "--timeout", str(timeout), "--grace", str(grace),
        ]
        server = forkserver_socket() if python and forkserver else None
        if server:
            full_env[_fs.SOCKET_VAR] = server
            cmd += [sys.executable, FORKSERVER, program]
        else:
            cmd += [sys.executable, program] if python else [program]
        cmd += [str(a) for a in args]
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd, env=full_env, cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout + grace + 30)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code = "harness timeout (sokrun did not stop the job)"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        elapsed = time.monotonic() - start
        leftovers = _marked_pids(marker)
        if server:
            leftovers += _forked_leftovers(server, marker)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        results = {}
        for name in os.listdir(out):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(out, name)) as f:
                    results[int(name[4:-5])] = json.load(f)
    return JobResult(
        code, output.decode("utf-8", "replace"), results, elapsed, leftovers
    )


def run_workers(script_path, num_ranks, args=(), timeout=120, env=None):
    """Runs a worker script on `num_ranks` ranks; asserts success.

    Args:
        script_path: path of the worker script (see `worker_path`).
        num_ranks: the number of ranks.
        args: extra command-line arguments for the script.
        timeout: seconds before sokrun stops the job.
        env: extra environment variables.

    Returns:
        The list of per-rank results (what each rank passed to
        `write_result`), in rank order.

    Example:

    >>> results = run_workers(worker_path("comm_collectives"), 2)
    >>> results[0]["all_reduce"]
    """
    job = launch(script_path, num_ranks, args, timeout=timeout, env=env)
    detail = f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"
    assert job.returncode == 0, f"job failed: exit {job.returncode}{detail}"
    assert not job.leftovers, f"processes left running: {job.leftovers}{detail}"
    missing = [r for r in range(num_ranks) if r not in job.results]
    assert not missing, f"ranks {missing} wrote no result{detail}"
    return [job.results[r] for r in range(num_ranks)]


def run_sequence(cases, num_ranks, timeout=120, env=None, output=False):
    """Runs several worker scripts one after the other in one job (one
    process per rank for all of them, `tests/workers/sequence.py`); asserts
    success.

    Args:
        cases: `(worker name, args)` pairs, run in this order.
        num_ranks: the number of ranks.
        timeout: seconds before sokrun stops the job (all cases).
        env: extra environment variables.
        output: whether to return the job's output as well.

    Returns:
        One list per case: what each rank passed to `write_result` in that
        case, in rank order; with `output=True`, `(that, the job's output)`.

    Example:

    >>> saved, tables = run_sequence(
    ...     [("save_load", ["save", path]), ("multi_table", ["same"])], 2)
    >>> saved[0]["losses"]
    """
    args = []
    for name, case_args in cases:
        if args:
            args.append("+")
        args += [name, *[str(a) for a in case_args]]
    job = launch(worker_path("sequence"), num_ranks, args, timeout=timeout,
                 env=env)
    detail = f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"
    assert job.returncode == 0, f"job failed: exit {job.returncode}{detail}"
    assert not job.leftovers, f"processes left running: {job.leftovers}{detail}"
    missing = [r for r in range(num_ranks) if r not in job.results]
    assert not missing, f"ranks {missing} wrote no result{detail}"
    results = [job.results[r] for r in range(num_ranks)]
    for rank, r in enumerate(results):
        assert len(r["cases"]) == len(cases), (rank, r)
    per_case = [[r["cases"][i] for r in results] for i in range(len(cases))]
    return (per_case, job.output) if output else per_case
