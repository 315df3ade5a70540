"""SIGTERM in the middle of a save or load of a model with sok tables:
the process still dies of the signal, and leaves no temporary weights
file or folder (a full copy of the weights each) beside the model file
(sok_keras/_terminate.py)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.multiprocess import _repo_env
from tests.multiprocess import launch
from tests.multiprocess import worker_path


@pytest.mark.parametrize("mode", ["save", "load"])
def test_sigterm_mid_save_or_load_leaves_no_temporary_files(tmp_path, mode):
    proc = subprocess.run(
        [sys.executable, worker_path("terminated_save_load"), mode,
         str(tmp_path)], env=_repo_env(), capture_output=True, text=True,
        timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM, out
    during = [line for line in proc.stdout.splitlines()
              if line.startswith("during:")]
    assert len(during) == 1, out
    # The guarded call had made its temporary file (save) or folder (load).
    assert during[0] != "during: ['model.keras']", out
    # One rank saves into a hidden file renamed onto model.keras when
    # complete (before: Keras wrote model.keras in place, half-written
    # here): a stopped first save leaves nothing; a stopped load, the file.
    left = sorted(os.listdir(tmp_path))
    assert left == ([] if mode == "save" else ["model.keras"]), (left, out)



@pytest.mark.parametrize("mode", ["save", "load"])
def test_what_a_sigkill_left_goes_at_the_next_save_or_load(tmp_path, mode):
    """SIGKILL (the OOM killer, a preemption's grace running out) skips
    every clean-up: a killed save left its hidden `.keras` and Keras'
    weights file, a killed load its extracted copy of the weights, each
    as large as the weights, until someone found them. The next save or
    load in the folder removes them (their owner's lock is free); a live
    operation's files (its lock held) and a user's own stay."""
    import fcntl

    import keras
    import numpy as np

    import sok_keras as sok

    proc = subprocess.run(
        [sys.executable, worker_path("terminated_save_load"), mode,
         str(tmp_path)], env=dict(_repo_env(), STOP_SIGNAL="SIGKILL"),
        capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL, out
    killed = sorted(n for n in os.listdir(tmp_path) if "sok-tmp" in n)
    # save: sok's file and Keras' weights file; load: the extracted
    # weights; and the operation's lock file.
    assert len(killed) == (3 if mode == "save" else 2), (killed, out)
    live = tmp_path / ".sok-tmp-00000000000a.lock"
    held = os.open(live, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    kept = [live.name, ".model.sok-tmp-00000000000a.keras",
            ".sok-tmp-00000000000a-load-x", "notes.sok-tmp-backup"]
    for name in kept[1:]:
        (tmp_path / name).write_bytes(b"x")
    path = tmp_path / "model.keras"
    try:
        if mode == "save":
            ids = keras.Input((2,), dtype="int64")
            model = keras.Model(ids, keras.layers.Dense(1)(
                sok.layers.DistributedEmbedding(1000, 8, name="emb")(ids)))
            model.save(str(path))
        else:
            model = keras.models.load_model(str(path))
        assert model.predict(np.array([[1, 2]]), verbose=0).shape == (1, 1)
        assert sorted(os.listdir(tmp_path)) == sorted(
            kept + ["model.keras"])
    finally:
        os.close(held)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_keras_extracts_the_weights_stops_the_load(
        tmp_path, sig):
    """Keras' bare `except:` around the extraction of the weights file took
    the signal's exception for a disk problem and read every table from
    the zip instead (35 s at full CPU for 768 MB): SIGTERM ended the
    process only after that, and Ctrl-C was lost (the load succeeded).
    Now the load stops at once, and the extracted folder is removed."""
    proc = subprocess.run(
        [sys.executable, worker_path("terminated_save_load"), "load-extract",
         str(tmp_path)], env=dict(_repo_env(), STOP_SIGNAL=sig),
        capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert "during:" in out, out
    assert "a table loaded after the signal" not in out, out
    assert "not terminated" not in out, out
    if sig == "SIGTERM":
        assert proc.returncode == -signal.SIGTERM, out
    else:
        assert proc.returncode != 0 and "KeyboardInterrupt" in out, out
    assert sorted(os.listdir(tmp_path)) == ["model.keras"], out


def test_sigterm_mid_export_leaves_no_temporary_folder(tmp_path):
    """SIGTERM during `model.export`: the temporary SavedModel (a copy of
    every table) is removed before the process dies of the signal, and a
    folder left by an export killed earlier is removed by the next one
    (before: both stayed, never cleaned up)."""
    proc = subprocess.run(
        [sys.executable, worker_path("terminated_save_load"), "export",
         str(tmp_path)], env=_repo_env(), capture_output=True, text=True,
        timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGTERM, out
    assert "during: ['.served.sok-tmp-" in out, out  # the export's own
    assert os.listdir(tmp_path) == [], out


def test_a_program_that_catches_ctrl_c_can_still_save(tmp_path):
    """`except KeyboardInterrupt: model.save(...)` (save on Ctrl-C): the
    interruption the program handles is not raised again by the save."""
    code = (
        "import sys, keras, numpy as np, sok_keras as sok\n"
        "sok.init()\n"
        "ids = keras.Input((2,), dtype='int64')\n"
        "m = keras.Model(ids, keras.layers.Dense(1)(\n"
        "    sok.layers.DistributedEmbedding(50, 4)(ids)))\n"
        "try:\n"
        "    raise KeyboardInterrupt\n"
        "except KeyboardInterrupt:\n"
        "    m.save(sys.argv[1])\n"
        "    keras.models.load_model(sys.argv[1])\n"
        "print('saved and loaded')\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.keras")],
        env=_repo_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saved and loaded" in proc.stdout


def test_sigterm_to_the_writer_of_a_save_on_two_ranks_leaves_no_files(
        tmp_path):
    """Rank 0 writes a hidden temporary .keras file, and Keras' weights
    file beside it: both go, and no model.keras appears."""
    job = launch(worker_path("terminated_save_load"), 2,
                 args=["save-ranks", str(tmp_path)], timeout=120)
    assert job.returncode != 0, job.output
    assert "during: ['.model.sok-tmp-" in job.output, job.output
    # sokrun names the first rank to end: rank 0, killed by the signal, or
    # rank 1, failing at once on rank 0's last word.
    assert ("rank 0 failed: it was killed by SIGTERM" in job.output
            or "rank 0 received SIGTERM during a model save" in job.output
            ), job.output
    assert job.leftovers == []
    assert sorted(os.listdir(tmp_path)) == [], job.output


@pytest.mark.parametrize("when", ["stream", "zip"])
def test_sigterm_to_the_writer_mid_stream_or_mid_copy(tmp_path, when):
    """"stream": rank 0 is stopped while rank 1 sends it a table's rows;
    rank 1 learns why at once (before: rank 0's cleanup began another
    collective, and both waited for SOK_COMM_TIMEOUT). "zip": the signal
    cuts short Keras' `finally` that copies and closes its temporary
    weights file (before: left beside the model, a full copy of the
    weights)."""
    job = launch(worker_path("terminated_save_load"), 2,
                 args=[f"save-ranks-{when}", str(tmp_path)], timeout=150,
                 env={"SOK_COMM_TIMEOUT": "60"})
    assert job.returncode != 0, job.output
    assert "during: ['.model.sok-tmp-" in job.output, job.output
    # sokrun names the first rank to end: rank 0, killed by the signal, or
    # rank 1, failing at once on rank 0's last word.
    assert ("rank 0 failed: it was killed by SIGTERM" in job.output
            or "rank 0 received SIGTERM during a model save" in job.output
            ), job.output
    if when == "stream":
        assert "rank 0 received SIGTERM during a model save" in (
            job.output), job.output
        assert "got no answer" not in job.output, job.output
    assert job.leftovers == []
    assert sorted(os.listdir(tmp_path)) == [], job.output


def test_ctrl_c_to_the_writer_mid_stream(tmp_path):
    """SIGINT (Ctrl-C) where the SIGTERM above arrived: the writer raises
    KeyboardInterrupt without starting another collective, and the other
    rank fails at once, naming it (before: both waited for
    SOK_COMM_TIMEOUT)."""
    job = launch(worker_path("terminated_save_load"), 2,
                 args=["save-ranks-stream", str(tmp_path)], timeout=150,
                 env={"SOK_COMM_TIMEOUT": "60", "STOP_SIGNAL": "SIGINT"})
    assert job.returncode != 0, job.output
    assert "rank 0 failed: KeyboardInterrupt" in job.output, job.output
    assert "got no answer" not in job.output, job.output
    assert job.leftovers == []
    assert sorted(os.listdir(tmp_path)) == [], job.output


def test_a_program_with_its_own_sigterm_handler_keeps_it():
    from sok_keras import _terminate

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with _terminate.on_sigterm_clean_up():
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
