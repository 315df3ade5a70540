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
    # One rank saves with Keras' own save, which writes model.keras in
    # place: only that (half-written) file may be left.
    left = sorted(os.listdir(tmp_path))
    assert left == ["model.keras"], (left, out)


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
