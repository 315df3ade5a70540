"""Temporaries of killed operations go at the next operation in their
folder; a live operation's, another kernel's and a user's files stay
(sok_keras/_leftovers.py). The SIGKILLed saves and loads themselves:
tests/test_terminate.py, tests/test_saving.py."""

import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np

import sok_keras as sok
from sok_keras import _leftovers

# Another process that loads `_leftovers.py` alone (no TensorFlow): a
# cleaner (argument "clean") or an operation that claims the folder,
# makes its temporaries and dies of SIGKILL ("die").
_OTHER = """
import importlib.util, json, os, signal, sys
spec = importlib.util.spec_from_file_location("lo", sys.argv[1])
lo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lo)
folder = sys.argv[3]
if sys.argv[2] == "clean":
    print(json.dumps(lo.remove_dead(folder)), flush=True)
else:
    claim = lo.Claim(folder)
    t = claim.token
    os.makedirs(os.path.join(folder, f".served.sok-tmp-{t}", "x"))
    os.makedirs(os.path.join(folder, f".served.sok-tmp-{t}.old"))
    with open(os.path.join(folder, f".served.sok-tmp-{t}.old",
                           "saved_model.pb"), "w") as f:
        f.write("mine")
    open(os.path.join(folder, f".sok-tmp-{t}-weights-x"), "w").close()
    print(t, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _other(what, folder):
    return subprocess.run(
        [sys.executable, "-c", _OTHER, _leftovers.__file__, what,
         str(folder)], capture_output=True, text=True, timeout=60)


def test_a_dead_operations_files_go_and_what_it_moved_aside_comes_back(
        tmp_path):
    """An export replaces an earlier one in two renames (the old one
    aside, the new one in). Killed between them, the user's export was at
    `.<name>.sok-tmp-<token>.old` and nothing at the name: it is moved
    back, and the rest of the operation's files go, with its lock."""
    died = _other("die", tmp_path)
    assert died.returncode == -signal.SIGKILL, died.stderr
    token = died.stdout.strip()
    assert len(os.listdir(tmp_path)) == 4  # 3 temporaries and the lock
    (tmp_path / "notes.txt").write_text("a user's")
    with _leftovers.Claim(str(tmp_path)):
        pass
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "served"], token
    assert (tmp_path / "served" / "saved_model.pb").read_text() == "mine"


def test_a_live_claim_keeps_its_files_from_cleaners_and_forked_children(
        tmp_path):
    """A cleaner in another process cannot take a live operation's lock;
    a child forked during the operation does not own it (ending the claim
    there removed the parent's lock file before)."""
    claim = _leftovers.Claim(str(tmp_path))
    mine = tmp_path / f".m.sok-tmp-{claim.token}.keras"
    try:
        pid = os.fork()
        if pid == 0:  # the child unwinds its copy of the claim
            claim.release()
            os._exit(0)
        os.waitpid(pid, 0)
        mine.write_bytes(b"x")
        cleaned = _other("clean", tmp_path)
        assert json.loads(cleaned.stdout) == [], cleaned.stderr
        assert sorted(os.listdir(tmp_path)) == sorted(
            [mine.name, f".sok-tmp-{claim.token}.lock"])
    finally:
        mine.unlink(missing_ok=True)
        claim.release()
    assert os.listdir(tmp_path) == []


def test_another_kernels_or_a_fresh_empty_lock_is_not_judged(tmp_path):
    """A lock that can be taken on a file naming another kernel proves
    nothing (shared file systems that lock on each host alone); an empty
    lock file is an owner between creating and writing it, until it is a
    minute old."""
    other, empty = "0123456789ab", "ba9876543210"
    (tmp_path / f".sok-tmp-{other}.lock").write_text(
        json.dumps({"kernel": "boot:another-host", "pid": 1}))
    (tmp_path / f".m.sok-tmp-{other}.keras").write_bytes(b"x")
    (tmp_path / f".sok-tmp-{empty}.lock").write_bytes(b"")
    before = sorted(os.listdir(tmp_path))
    assert _leftovers.remove_dead(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == before
    os.utime(tmp_path / f".sok-tmp-{empty}.lock", (0, 0))
    _leftovers.remove_dead(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [
        f".m.sok-tmp-{other}.keras", f".sok-tmp-{other}.lock"]


def _model():
    ids = keras.Input((2,), dtype="int64")
    return keras.Model(ids, keras.layers.Dense(1)(
        sok.layers.DistributedEmbedding(1000, 8, name="emb")(ids)))


def test_a_cleaner_during_a_save_and_a_load_removes_nothing(
        tmp_path, monkeypatch):
    """Mid-save (Keras' weights file and sok's hidden file exist) and
    mid-load (the extracted weights exist), a cleaner in another process
    finds every lock held: both operations complete."""
    path = str(tmp_path / "model.keras")
    seen = []
    cls = sok.layers.DistributedEmbedding

    def cleaning(original):
        def hook(self, store):
            during = sorted(os.listdir(tmp_path))
            cleaned = _other("clean", tmp_path)
            seen.append((during, json.loads(cleaned.stdout)))
            return original(self, store)
        return hook

    monkeypatch.setattr(cls, "save_own_variables",
                        cleaning(cls.save_own_variables))
    monkeypatch.setattr(cls, "load_own_variables",
                        cleaning(cls.load_own_variables))
    model = _model()
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.array([[1, 2]])
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))
    assert len(seen) == 2, seen
    for during, removed in seen:
        assert len([n for n in during if "sok-tmp" in n]) >= 2, during
        assert removed == [], seen
    assert os.listdir(tmp_path) == ["model.keras"]
