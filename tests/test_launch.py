"""sokrun: output prefixes, exit codes, failure and timeout handling, no
processes left behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess import REPO  # noqa: E402
from multiprocess import MARKER_VAR  # noqa: E402
from multiprocess import _marked_pids  # noqa: E402
from multiprocess import launch  # noqa: E402
from multiprocess import process_gone  # noqa: E402
from multiprocess import worker_path  # noqa: E402

SCRIPT = worker_path("launch_behaviour")


def _details(job):
    return f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"


def test_prefixes_lines_and_exits_zero():
    job = launch(SCRIPT, 3, args=["echo"], timeout=30, forkserver=False)
    assert job.returncode == 0, _details(job)
    lines = job.output.splitlines()
    for r in range(3):
        assert f"[{r}] hello from rank {r}" in lines, _details(job)
        assert f"[{r}] warning from rank {r}" in lines, _details(job)
        assert f"[{r}] no newline {r}" in lines, _details(job)
    assert not job.leftovers


def test_propagates_exit_code():
    job = launch(SCRIPT, 2, args=["codes"], timeout=30, forkserver=False)
    assert job.returncode == 7, _details(job)
    assert "rank 1 failed: it exited with code 7" in job.output, _details(job)
    assert not job.leftovers


def test_the_rank_that_exited_first_is_named():
    """Rank 1 exits 3 and rank 0, learning of it, exits 1 within the same
    poll: sokrun names rank 1 and exits 3 (before: the lower rank of those
    seen exited, rank 0, and 1)."""
    for _ in range(5):
        job = launch(SCRIPT, 2, args=["cascade"], timeout=30,
                     forkserver=False)
        assert job.returncode == 3, _details(job)
        assert "rank 1 failed: it exited with code 3" in job.output, (
            _details(job))
        assert not job.leftovers


def test_a_rank_reporting_another_ranks_failure_names_it():
    """sok_keras' failing rank waits for its peers to say why before it
    exits, so a peer often exits first: sokrun names that peer and adds
    the rank whose failure its output reports (before: only "rank 1
    failed", the real error under another prefix), and the job exits with
    that rank's own code once it exits (before: the peer's 1, where rank
    0 called `sys.exit(5)`: QA)."""
    job = launch(SCRIPT, 2, args=["reported"], timeout=30,
                 forkserver=False)
    assert job.returncode == 5, _details(job)
    assert ("rank 1 failed: it exited with code 1, after rank 0 failed "
            "(rank 0's error is in its output, lines [0]); rank 0 exited "
            "with code 5, which is the job's exit code") in job.output, (
                _details(job))
    assert not job.leftovers


def test_the_wait_for_the_reported_rank_keeps_to_the_timeout():
    """The reported rank hangs: sokrun waits for its code no longer than
    `--timeout` allows (review: 15 s past a 3 s timeout), then exits with
    the reporting rank's code and stops it."""
    job = launch(SCRIPT, 2, args=["reported_stuck"], timeout=3, grace=1,
                 forkserver=False)
    assert job.returncode == 1, _details(job)
    assert job.elapsed < 14, _details(job)  # (15 s: the bug)
    assert "stopping ranks [0]" in job.output, _details(job)
    assert not job.leftovers


def test_failing_rank_stops_the_others():
    job = launch(SCRIPT, 3, args=["fail"], timeout=60, grace=2, forkserver=False)
    assert job.returncode == 3, _details(job)
    # The others sleep 60 s: they must have been stopped long before (the
    # margin is for a loaded CI machine; it takes ~1 s when idle).
    assert job.elapsed < 30, _details(job)
    assert "[1] rank 1: something went wrong, exiting 3" in job.output
    assert "sokrun: rank 1 failed: it exited with code 3" in job.output
    assert "stopping ranks [0, 2]" in job.output, _details(job)
    assert sorted(job.results) == [0, 1, 2], _details(job)
    # Grandchildren (same process group) are gone too.
    assert not job.leftovers, _details(job)
    for res in job.results.values():
        assert process_gone(res["child"])


def test_timeout_kills_hanging_job():
    # Rank 0 ignores SIGTERM: it must get SIGKILL after the grace period.
    job = launch(SCRIPT, 2, args=["hang"], timeout=2, grace=1, forkserver=False)
    assert job.returncode == 124, _details(job)
    assert "timeout" in job.output, _details(job)
    assert job.elapsed < 30, _details(job)  # ranks sleep 60 s
    assert not job.leftovers, _details(job)


def _start_sokrun(args, marker):
    env = dict(os.environ, PYTHONPATH=REPO, **{MARKER_VAR: marker})
    env["SOK_TEST_OUT"] = "/tmp"
    return subprocess.Popen(
        [sys.executable, "-m", "sokrun", "-np", "2", "--grace", "1",
         sys.executable, "-c",
         "import time; print('up', flush=True); time.sleep(60)"] + args,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_ranks(marker, n, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # sokrun itself carries the marker too.
        if len(_marked_pids(marker)) >= n + 1:
            return
        time.sleep(0.05)
    raise AssertionError("ranks did not start")


def _wait_gone(marker, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _marked_pids(marker)
        if not left:
            return
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes left running: {left}")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP"])
def test_a_signal_to_sokrun_stops_all_ranks(sig):
    """Ctrl-C, or SIGHUP (the terminal closed, an ssh session dropped;
    before: sokrun died of it, saying nothing, and the ranks were
    SIGKILLed by their parent-death signal, their clean-up skipped)."""
    marker = f"{sig}-{os.getpid()}-{time.time()}"
    proc = _start_sokrun([], marker)
    try:
        _wait_ranks(marker, 2)
        proc.send_signal(getattr(signal, sig))
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 128 + getattr(signal, sig), out.decode()
        assert f"received {sig}".encode() in out
        _wait_gone(marker)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ranks_die_when_sokrun_is_killed():
    marker = f"sigkill-{os.getpid()}-{time.time()}"
    proc = _start_sokrun([], marker)
    try:
        _wait_ranks(marker, 2)
        proc.kill()  # SIGKILL: no chance to clean up; PDEATHSIG must act
        proc.wait()
        _wait_gone(marker, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_usage_errors():
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "0", "true"],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
    )
    assert out.returncode == 2
    assert b"-np must be at least 1, got 0" in out.stderr
    # (QA: nan and inf were taken, as no timeout at all.)
    for flag, value in (("--timeout", "nan"), ("--timeout", "inf"),
                        ("--timeout", "0"), ("--grace", "nan")):
        out = subprocess.run(
            [sys.executable, "-m", "sokrun", "-np", "1", flag, value,
             "true"],
            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True)
        assert out.returncode == 2, (flag, value, out.stderr)
        assert f"{flag} must be".encode() in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "1",
         "/nonexistent/program"],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
    )
    assert out.returncode == 127
    assert b"cannot start rank 0" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "1", "missing_script.py"],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
    )
    assert out.returncode == 127
    assert b"sokrun -np 1 python missing_script.py" in out.stderr
    # More ranks than this machine has ports (file descriptors) for: a
    # sentence, not a traceback (QA: "Too many open files" raw).
    import resource

    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "500", "true"],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                              (64, 64)), timeout=60)
    assert out.returncode == 1, out.stderr
    assert (b"sokrun: cannot reserve 500 ports for 500 ranks on this "
            b"machine: [Errno 24] Too many open files") in out.stderr
    assert b"Traceback" not in out.stderr


def test_a_python_script_runs_with_this_python(tmp_path):
    """`sokrun -np 2 hello.py` (no `python`): before, "No such file or
    directory" for a file that is there."""
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\n"
                      "print('rank', os.environ['SOK_RANK'], sys.executable)\n")
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "2", str(script)],
        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
        text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for r in range(2):
        assert f"[{r}] rank {r} {sys.executable}" in out.stdout, out.stdout


def test_a_failure_of_another_python_on_path_says_so(tmp_path):
    """`sokrun -np 2 python train.py` where `python` on PATH is not
    sokrun's Python (a venv's sokrun, not activated): the ranks fail
    (here: the import), and sokrun's message says which Python ran and
    how to use its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = bin_dir / "python"
    other.write_text("#!/bin/sh\necho 'No module named tensorflow' >&2\n"
                     "exit 1\n")
    other.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=REPO,
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "2", "python", "train.py"],
        env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"(note: 'python' is {other} here, not sokrun's own Python, " \
        f"{sys.executable}; to run a script with sokrun's, name it: sokrun " \
        "-np N train.py)" in out.stderr, out.stderr
    # sokrun's own Python by name: no note.
    out = subprocess.run(
        [sys.executable, "-m", "sokrun", "-np", "1", sys.executable, "-c",
         "import sys; sys.exit(2)"], env=env, capture_output=True,
        text=True, timeout=60)
    assert out.returncode == 2 and "note:" not in out.stderr, out.stderr


def test_sigterm_to_a_rank_stops_the_job_promptly():
    """sok.init() must not leave TensorFlow's SIGTERM handler in place (a
    rank that ignores SIGTERM survives Slurm's, Kubernetes' or mpirun's
    stop until SIGKILL)."""
    from tests.multiprocess import launch
    from tests.multiprocess import worker_path

    job = launch(worker_path("sigterm_self"), 2, timeout=60)
    assert job.returncode != 0, job.output
    assert job.elapsed < 40, (job.elapsed, job.output)
    assert "SIGTERM" in job.output, job.output
    assert not job.leftovers


def test_the_ranks_ports_are_held_until_the_job_ends():
    """sokrun's `_free_ports` picks a free port per rank and keeps it bound
    (SO_REUSEADDR, not listening; `main` closes the sockets when the job
    ends): the rank's own server can listen on it, no other program can
    bind it meanwhile (before: the port was released at once, and a job
    starting at the same moment could be given it)."""
    import socket

    import sokrun

    ports, held = sokrun._free_ports(2)
    try:
        assert len(set(ports)) == 2
        for port in ports:
            other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            with pytest.raises(OSError):
                other.bind(("", port))  # another program: refused
            other.close()
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))  # the rank's server: fine
            server.listen()
            server.close()
    finally:
        for s in held:
            s.close()
