"""`sok.init()` in processes started without sokrun (torchrun-style and
Open MPI-style environments), each under a timeout."""

import json
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "seed_example.py")


_HELD = []  # the sockets holding the ports of this test's ranks


@pytest.fixture(autouse=True)
def _release_held_ports():
    yield
    while _HELD:
        _HELD.pop().close()


def _free_port_block(count):
    """A base port p such that p+1..p+count are free; they stay bound (with
    SO_REUSEADDR, not listening) until the test ends, as sokrun holds its
    ports: the ranks can listen on them, no other test's job can take one
    while these ranks start."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        socks = []
        try:
            for i in range(1, count + 1):
                t = socket.socket()
                socks.append(t)
                # Bound first without SO_REUSEADDR, so that a port another
                # job holds (bound with it) is refused, then marked so that
                # the rank's own server can bind it over this socket.
                t.bind(("", base + i))
                t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except OSError:
            for t in socks:
                t.close()
            continue
        _HELD.extend(socks)
        return base
    raise RuntimeError("no free port block")


def _run_two_ranks(style, worker, args, tmp_path, extra_env=None):
    """Starts `worker` as 2 ranks by hand in a torchrun- or Open MPI-style
    environment (plus `extra_env`); returns the per-rank results."""
    base = _free_port_block(2)
    procs = []
    for rank in range(2):
        # (The caller's PYTHONPATH last: a TensorFlow installed through it,
        # as on the GPU machine, stays visible.)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [REPO, os.path.join(REPO, "tests", "workers")]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
               else [])),
            TF_CPP_MIN_LOG_LEVEL="2", SOK_TEST_OUT=str(tmp_path),
            PYTHONUNBUFFERED="1")
        for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS",
                    "SOK_BIND_HOST", "LD_PRELOAD"):
            env.pop(var, None)
        if style == "torchrun":
            env.update(RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(base))
        else:
            env.update(OMPI_COMM_WORLD_RANK=str(rank),
                       OMPI_COMM_WORLD_SIZE="2",
                       SOK_WORKER_ADDRS=",".join(
                           f"127.0.0.1:{base + 1 + i}" for i in range(2)))
        env.update(extra_env or {})
        # The worker's result file is named after its rank; without sokrun
        # there is no SOK_RANK, so the harness passes it separately.
        env["SOK_TEST_RANK"] = str(rank)
        procs.append(subprocess.Popen(
            [sys.executable, worker] + list(args), env=env, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    return [json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in range(2)]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """Under torchrun's environment, one launch of 2 ranks for both tests
    (tests/workers/sequence.py): the seed example, then the listening
    sockets (those of every server the process has started by then)."""
    results = _run_two_ranks(
        "torchrun", os.path.join(REPO, "tests", "workers", "sequence.py"),
        ["seed_example", "distributed", "+", "listen_check"],
        tmp_path_factory.mktemp("torchrun"))
    for r in results:
        assert len(r["cases"]) == 2, r
    return {"seed_example": [r["cases"][0] for r in results],
            "listen_check": [r["cases"][1] for r in results]}


@pytest.mark.parametrize("style", ["torchrun", "openmpi"])
def test_two_ranks_without_sokrun(style, tmp_path, request):
    if style == "torchrun":
        results = request.getfixturevalue("torchrun_runs")["seed_example"]
    else:
        results = _run_two_ranks(style, WORKER, ["distributed"], tmp_path)
    assert results[0]["shapes"] == [[9, 3], [4, 5]]
    assert results[1]["shapes"] == [[8, 3], [3, 5]]
    assert results[0]["grad_rows"] == [1, 1]
    assert results[1]["grad_rows"] == [3, 2]


def _loopback(addr):
    return (addr.startswith("127.") or addr == "0000:0000:0000:0000:0000:"
            "0000:0000:0001" or addr.startswith("::ffff:127."))


@pytest.mark.parametrize("launcher", ["sokrun", "torchrun"])
def test_rank_servers_listen_on_loopback_only(launcher, request):
    """TensorFlow's gRPC server would listen on every interface (and serves
    anyone); under sokrun and under another launcher the ranks' servers
    must listen on loopback only."""
    worker = os.path.join(REPO, "tests", "workers", "listen_check.py")
    if launcher == "sokrun":
        from tests.multiprocess import run_workers

        results = run_workers(worker, 2, timeout=90)
    else:
        results = request.getfixturevalue("torchrun_runs")["listen_check"]
    for r in results:
        assert r["sum"] == 2.0
        assert r["listening"], r
        assert all(_loopback(a) for a, _ in r["listening"]), r
        assert r["bind_host"] == "127.0.0.1"


def test_a_bind_host_set_by_hand_is_honoured(tmp_path):
    """`SOK_BIND_HOST=127.0.0.1` set by the user of another launcher (no
    LD_PRELOAD): the servers listen on that address. Before, the variable
    alone was taken for "the guard is loaded", and they listened on every
    interface (QA)."""
    worker = os.path.join(REPO, "tests", "workers", "listen_check.py")
    results = _run_two_ranks("torchrun", worker, [], tmp_path,
                             extra_env={"SOK_BIND_HOST": "127.0.0.1"})
    for r in results:
        assert r["sum"] == 2.0
        assert r["listening"], r
        assert all(_loopback(a) for a, _ in r["listening"]), r


def _lone_rank_0_env(base, timeout):
    """The environment of torchrun-style rank 0 of 2 (MASTER_PORT `base`),
    with the caller's PYTHONPATH after the repo's (a TensorFlow installed
    through it stays visible)."""
    path = os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1", RANK="0", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(base),
               SOK_COMM_TIMEOUT=str(timeout))
    for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS",
                "SOK_BIND_HOST", "LD_PRELOAD"):
        env.pop(var, None)
    return env


def _start_lone_rank_0(timeout, **kwargs):
    """Rank 0 of 2 (torchrun-style variables) alone, in sok.init(); prints
    INIT-DONE if init returns."""
    env = _lone_rank_0_env(_free_port_block(2), timeout=timeout)
    return subprocess.Popen(
        [sys.executable, "-c",
         "import sok_keras as sok; sok.init(); print('INIT-DONE')"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, **kwargs)


def test_a_rank_whose_peer_never_starts_stops_after_the_timeout():
    """torchrun-style rank 0 of 2 alone: TensorFlow's coordination service
    would wait for rank 1 for ever (swallowing SIGTERM); sok.init() stops
    the rank after SOK_COMM_TIMEOUT, saying why."""
    proc = _start_lone_rank_0(timeout=4)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    assert "INIT-DONE" not in out, out
    assert ("sok_keras.init(): rank 0 of 2: not every rank joined within "
            "4 s") in out, out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_rank_waiting_for_its_peers_stops_on_a_signal_to_its_group(sig):
    """Ctrl-C in a terminal, `timeout` or a scheduler signal the whole
    process group while rank 0 waits in sok.init() for a peer that never
    starts. The rank cannot act on it (TensorFlow holds it in C++); before,
    the group's signal also ended sok's watch, and the rank waited for
    ever. Now the watch stops it at once, saying why."""
    import signal
    import time

    proc = _start_lone_rank_0(timeout=300, start_new_session=True)
    try:
        # Wait for the watch (a child process running sok's watch code:
        # other children may come and go first) to catch SIGHUP, SIGINT
        # and SIGTERM (its handlers are set up).
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"
        wanted = ((1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1))
                  | (1 << (signal.SIGTERM - 1)))

        def watch_ready():
            try:
                with open(children) as f:
                    pids = f.read().split()
                for pid in pids:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"select.select" not in f.read():
                            continue
                    with open(f"/proc/{pid}/status") as f:
                        caught = next(int(line.split()[1], 16) for line in f
                                      if line.startswith("SigCgt:"))
                    if caught & wanted == wanted:
                        return True
            except (OSError, StopIteration):
                pass
            return False

        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and proc.poll() is None
               and not watch_ready()):
            time.sleep(0.1)
        assert watch_ready(), "the watch did not start"
        start = time.monotonic()
        os.killpg(proc.pid, getattr(signal, sig))
        out, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out
    assert "INIT-DONE" not in out, out
    assert (f"sok_keras.init(): rank 0 of 2: {sig} while waiting for every "
            "rank to join") in out, out
    assert elapsed < 30, (elapsed, out)


def test_a_rank_whose_port_is_taken_says_which():
    """Rank 0's address is in use: an error naming it, at once (before:
    TensorFlow's "UnknownError: Could not start gRPC server", the port only
    in a C++ log line)."""
    base = _free_port_block(2)
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hog.bind(("127.0.0.1", base + 1))  # rank 0 listens on MASTER_PORT + 1
    hog.listen(1)
    env = _lone_rank_0_env(base, timeout=30)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import sok_keras as sok; sok.init()"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=90)
    finally:
        hog.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert (f"rank 0 of 2 could not listen on its address "
            f"127.0.0.1:{base + 1}") in out, out
    assert "MASTER_PORT" in out, out


def test_a_master_addr_of_another_host_says_so():
    """MASTER_ADDR (rank 0 listens there) is not an address of this host:
    said so, not "the port is in use" (192.0.2.1: a documentation address,
    never a host's)."""
    base = _free_port_block(2)
    env = dict(_lone_rank_0_env(base, timeout=30), MASTER_ADDR="192.0.2.1")
    proc = subprocess.run(
        [sys.executable, "-c", "import sok_keras as sok; sok.init()"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert (f"could not listen on its address 192.0.2.1:{base + 1}"
            in out), out
    assert "192.0.2.1 is not an address of this host" in out, out
    assert "port is in use" not in out, out
