"""Every notebook in notebooks/ runs top to bottom in a fresh interpreter."""

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


def _script(path):
    with open(path) as f:
        nb = json.load(f)
    cells = ["".join(c["source"]) for c in nb["cells"]
             if c["cell_type"] == "code"]
    return "\n\n".join(cells)


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    script = tmp_path / "nb.py"
    script.write_text(_script(path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]), TF_CPP_MIN_LOG_LEVEL="2",
               MPLBACKEND="Agg", TMPDIR=str(tmp_path))
    for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=str(tmp_path), env=env,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_on_two_ranks(path, tmp_path):
    """The notebooks say their code runs on N ranks under sokrun: it does
    (each rank a cold process; TMPDIR is the test's own folder, so the
    path every rank shares is this job's)."""
    from tests.multiprocess import launch

    script = tmp_path / "nb.py"
    script.write_text(_script(path))
    job = launch(str(script), 2, timeout=240, forkserver=False,
                 env={"TMPDIR": str(tmp_path), "MPLBACKEND": "Agg",
                      "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert job.returncode == 0, job.output
    assert not job.leftovers, job.output
    assert "rank 1 of 2" in job.output, job.output
