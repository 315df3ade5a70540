"""The test suite's fork server (tests/forkserver.py): a rank forked from
it sees what a fresh `python script.py` would and ends as one would, and
nothing it started outlives its client."""

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import forkserver  # noqa: E402
import multiprocess  # noqa: E402

PROBE = multiprocess.worker_path("forkserver_probe")
_gone = multiprocess.process_gone


def _client(tmp_path, *args, env=None, **kwargs):
    full = multiprocess._repo_env()
    full[forkserver.SOCKET_VAR] = multiprocess.forkserver_socket(force=True)
    full["SOK_TEST_OUT"] = str(tmp_path)
    full.update(env or {})
    return subprocess.Popen(
        [sys.executable, multiprocess.FORKSERVER, PROBE, *args], env=full,
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        **kwargs)


def _result(tmp_path):
    with open(tmp_path / "rank0.json") as f:
        return json.load(f)


def test_rank_sees_a_fresh_interpreter(tmp_path):
    results = []
    for _ in range(2):
        proc = _client(tmp_path, "env", "x y", env={"PROBE": "1"})
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()
        results.append(_result(tmp_path))
    r = results[0]
    assert r["argv"] == [PROBE, "env", "x y"]
    assert r["orig_argv"] == [sys.executable, PROBE, "env", "x y"]
    assert r["cwd"] == str(tmp_path)
    assert r["path0"] == os.path.dirname(PROBE)
    assert r["probe"] == "1" and r["name"] == "__main__"
    assert r["pgid_is_pid"] and r["sigterm_default"]
    assert r["preloaded"], "the rank imported TensorFlow itself"
    assert r["sum"] == 45.0
    assert results[0]["random"] != results[1]["random"]  # reseeded
    assert results[0]["pid"] != results[1]["pid"]


def test_exit_codes_and_exceptions_come_back(tmp_path):
    proc = _client(tmp_path, "exit", "7")
    proc.communicate(timeout=120)
    assert proc.returncode == 7
    proc = _client(tmp_path, "raise")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert b"ValueError: probe failed on purpose" in out


def test_death_by_signal_is_mirrored(tmp_path):
    proc = _client(tmp_path, "sigterm_self")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM


def test_signals_reach_the_rank(tmp_path):
    proc = _client(tmp_path, "sleep")
    assert proc.stdout.readline().strip() == b"sleeping"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    r = _result(tmp_path)
    deadline = time.monotonic() + 10
    while not (_gone(r["pid"]) and _gone(r["child"])):
        assert time.monotonic() < deadline, "rank or its child still running"
        time.sleep(0.05)


def test_a_killed_client_takes_the_rank_and_its_group_along(tmp_path):
    proc = _client(tmp_path, "sleep")
    assert proc.stdout.readline().strip() == b"sleeping"
    r = _result(tmp_path)
    assert not _gone(r["pid"]) and not _gone(r["child"])
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not (_gone(r["pid"]) and _gone(r["child"])):
        assert time.monotonic() < deadline, "rank or its child outlived it"
        time.sleep(0.05)


def test_messages_sent_back_to_back_are_read_one_at_a_time():
    # The server's "pid" and "status" replies can both be waiting when a
    # rank ends at once: reading the first must leave the second.
    import socket

    a, b = socket.socketpair()
    with a, b:
        r, w = os.pipe()
        forkserver._send(a, {"pid": 1}, fds=[r])
        forkserver._send(a, {"status": 0})
        os.close(r)
        first, fds = forkserver._recv(b, maxfds=1)
        assert first == {"pid": 1} and len(fds) == 1
        os.close(fds[0])
        os.close(w)
        assert forkserver._recv(b) == ({"status": 0}, [])
        a.close()
        assert forkserver._recv(b) == (None, [])
