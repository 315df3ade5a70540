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
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")
MARKER_VAR = "SOK_TEST_MARKER"


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


def worker_path(name):
    """Returns the path of `tests/workers/<name>` (`.py` optional)."""
    if not name.endswith(".py"):
        name += ".py"
    return os.path.join(WORKERS, name)


def launch(
    program, num_ranks, args=(), timeout=120, grace=5.0, env=None,
    python=True,
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

    Returns:
        A `JobResult`. `leftovers` lists marked processes that were still
        running after the job (they have been killed).
    """
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="sok_mp_") as out:
        full_env = dict(os.environ)
        full_env.pop("SOK_RANK", None)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
        full_env["SOK_TEST_OUT"] = out
        full_env[MARKER_VAR] = marker
        full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        full_env.update(env or {})
        cmd = [
            sys.executable, "-m", "sokrun", "-np", str(num_ranks),
            "--timeout", str(timeout), "--grace", str(grace),
        ]
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
