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
    assert "killed by SIGTERM" in job.output, job.output
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
