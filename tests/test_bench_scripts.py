"""The multi-GPU benchmark scripts (bench/alltoall.py, bench/dlrm_scaling.py)
run tiny on 2 CPU ranks and write the records they promise, so that they
are ready for the multi-GPU machines."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests import multiprocess

BENCH = os.path.join(multiprocess.REPO, "bench")
sys.path.insert(0, BENCH)
import alltoall  # noqa: E402
import dlrm_scaling  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("split", alltoall.SPLITS)
def test_count_matrix_sends_and_receives_the_same_total(n, split):
    c = alltoall.count_matrix(n, 10_000, split)
    rows = [sum(r) for r in c]
    cols = [sum(c[i][j] for i in range(n)) for j in range(n)]
    assert len(set(rows)) == 1 and rows == cols
    assert rows[0] <= 10_000 and rows[0] >= 10_000 - n
    assert all(v > 0 for r in c for v in r)
    if split == "zipf":
        # Skewed: the next rank gets the most, the rank itself the least.
        assert c[0][1] == max(c[0]) and c[0][0] == min(c[0])
        assert c[0][1] > c[0][0]
    else:
        assert len({v for r in c for v in r}) == 1


def test_count_matrix_rejects_an_unknown_split():
    with pytest.raises(ValueError, match="unknown split 'uniform'"):
        alltoall.count_matrix(2, 100, "uniform")


def test_alltoall_on_two_ranks_writes_its_record(tmp_path):
    out = tmp_path / "a2a.json"
    huge = 2**20  # MiB per rank: 1 TiB, which no budget holds
    job = multiprocess.launch(
        os.path.join(BENCH, "alltoall.py"), 2,
        args=["--out", out, "--sizes-mib", f"1,{huge}", "--iters", "2",
              "--rounds", "2", "--warmup", "1", "--label", "test"],
        timeout=300)
    detail = f"\n--- output ---\n{job.output}"
    assert job.returncode == 0, detail
    assert not job.leftovers, detail
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "alltoall" and rec["label"] == "test"
    assert rec["command"].startswith("python -m sokrun -np 2 python "
                                     "bench/alltoall.py --out ")
    assert rec["setup"].startswith("CPU only")
    assert rec["sok"]["backend"] == "collective"
    assert rec["config"]["num_ranks"] == 2
    assert {"date_utc", "cpu_count", "gpus"} <= set(rec["machine"])
    got = [(x["size_mib"], x["split"]) for x in rec["results"]]
    assert got == [(1, "equal"), (1, "zipf"), (huge, "equal"),
                   (huge, "zipf")]
    for x in rec["results"][:2]:
        s = x["sok"]
        assert s["status"] == "ok", s
        assert x["bytes_per_rank"] == 2**20
        assert s["check_max_abs_error"] == 0.0
        assert len(s["time_ms_per_rank"]) == 2
        assert s["time_ms"] == max(s["time_ms_per_rank"]) > 0
        assert len(s["rounds_ms"]) == 2
        algbw = x["bytes_per_rank"] / (s["time_ms"] / 1e3) / 1e9
        assert s["algbw_GBps"] == pytest.approx(algbw, rel=1e-2, abs=2e-3)
        assert s["busbw_GBps"] == pytest.approx(s["algbw_GBps"] / 2,
                                                abs=2e-3)
    zipf = rec["results"][1]["counts_matrix"]
    assert zipf[0][1] > zipf[0][0]
    for x in rec["results"][2:]:
        for side in ("sok", "torch"):
            if x[side]["status"] == "skipped" and "GiB" in (
                    x[side]["reason"] or ""):
                assert "budget" in x[side]["reason"]
        assert x["sok"]["status"] == "skipped"
        assert x["sok_over_torch_busbw"] is None
    if HAVE_TORCH:
        assert rec["torch"]["status"] == "ok", rec["torch"]
        assert rec["torch"]["backend"] == "gloo"
        for x in rec["results"][:2]:
            assert x["torch"]["check_max_abs_error"] == 0.0
            assert x["sok_over_torch_busbw"] == pytest.approx(
                x["sok"]["busbw_GBps"] / x["torch"]["busbw_GBps"], rel=1e-2)
    else:
        assert rec["torch"]["status"] == "skipped"
        assert "torch is not installed" in rec["torch"]["reason"]
        for x in rec["results"]:
            assert x["torch"]["status"] == "skipped"
            assert x["sok_over_torch_busbw"] is None
    assert rec["target"]["met"] is None
    assert "not measurable" in rec["target"]["why"]


def test_alltoall_refuses_one_rank(tmp_path):
    job = multiprocess.launch(
        os.path.join(BENCH, "alltoall.py"), 1,
        args=["--out", tmp_path / "x.json", "--sizes-mib", "1"], timeout=120)
    assert job.returncode != 0
    assert "needs at least 2 ranks" in job.output
    assert not (tmp_path / "x.json").exists()


def test_scaling_and_targets_from_records():
    runs = [{"num_ranks": 1, "examples_per_s": 100.0, "setup": "1 GPU(s)"},
            {"num_ranks": 2, "examples_per_s": 180.0, "setup": "2 GPU(s)"},
            {"num_ranks": 8, "examples_per_s": 600.0, "setup": "8 GPU(s)"}]
    table = dlrm_scaling.scaling(runs)
    assert table["2"] == {"examples_per_s": 180.0, "speedup": 1.8,
                          "efficiency": 0.9}
    assert table["8"]["efficiency"] == 0.75
    t = dlrm_scaling.targets(table, runs)
    assert t["met_at_2"] is True and t["met_at_8"] is False
    dry = [dict(r, setup="CPU only") for r in runs]
    assert dlrm_scaling.targets(table, dry)["met_at_2"] is None
    assert dlrm_scaling.scaling(runs[1:])["2"]["speedup"] is None


def test_baseline_must_be_a_one_rank_run_of_the_same_model(tmp_path):
    cfg = {k: 1 for k in dlrm_scaling.SAME_MODEL_KEYS}
    one = {"num_ranks": 1, "examples_per_s": 10.0, "config": cfg}
    two = {"num_ranks": 2, "examples_per_s": 15.0, "config": cfg}
    path = tmp_path / "base.json"
    path.write_text(json.dumps({"runs": [one, two]}))
    base = dlrm_scaling.load_baseline(str(path))
    assert base["num_ranks"] == 1 and base["baseline_from"] == str(path)
    dlrm_scaling.check_same_model([base, two])
    path.write_text(json.dumps({"runs": [two]}))
    with pytest.raises(SystemExit, match="has no one-rank run"):
        dlrm_scaling.load_baseline(str(path))
    other = dict(two, config=dict(cfg, batch_per_rank=64))
    with pytest.raises(SystemExit, match=r"batch_per_rank \(1 at N=1, 64 "):
        dlrm_scaling.check_same_model([base, other])


def test_dlrm_scaling_driver_on_one_and_two_ranks(tmp_path):
    out = tmp_path / "dlrm.json"
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [multiprocess.REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    env[multiprocess.MARKER_VAR] = marker
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS"):
        env.pop(var, None)
    cmd = [sys.executable, os.path.join(BENCH, "dlrm_scaling.py"),
           "--ranks", "1,2", "--small", "--steps", "3", "--warmup", "1",
           "--batch-per-rank", "64", "--timeout", "240", "--out", str(out),
           "--backend", "collective"]
    proc = subprocess.Popen(cmd, env=env, cwd=multiprocess.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=560)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    leftovers = multiprocess._marked_pids(marker)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    detail = f"\n--- output ---\n{output.decode('utf-8', 'replace')}"
    assert proc.returncode == 0, detail
    assert not leftovers, detail
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "dlrm_scaling" and rec["ranks"] == [1, 2]
    runs = {r["num_ranks"]: r for r in rec["runs"]}
    assert sorted(runs) == [1, 2]
    assert runs[1]["backend"] == "local"
    assert runs[2]["backend"] == "collective"
    # --backend goes to the runs of N > 1 only.
    assert "--backend" not in runs[1]["command"]
    assert runs[2]["command"].endswith("--backend collective")
    for n, r in runs.items():
        assert r["config"]["tables"] == 26
        assert r["config"]["batch_per_rank"] == 64
        assert r["config"]["global_batch"] == 64 * n
        assert len(r["step_s_rank0"]) == 3
        assert len(r["step_ms_median_per_rank"]) == n
        slowest = max(r["step_ms_median_per_rank"]) / 1e3
        assert r["examples_per_s"] == pytest.approx(n * 64 / slowest,
                                                    rel=1e-2)
        assert r["command"].startswith(f"python -m sokrun -np {n} ")
        assert all(v == v for v in r["loss_first_last"])  # finite
    # Each rank holds its share of the 26 tables' rows.
    total = runs[1]["config"]["table_rows_total"]
    assert runs[1]["table_rows_on_rank0"] == total
    assert total / 2 - 26 <= runs[2]["table_rows_on_rank0"] <= total / 2 + 26
    s = rec["scaling"]
    e1, e2 = runs[1]["examples_per_s"], runs[2]["examples_per_s"]
    assert s["1"]["speedup"] == 1.0
    assert s["2"]["speedup"] == pytest.approx(e2 / e1, abs=1e-3)
    assert s["2"]["efficiency"] == pytest.approx(e2 / (2 * e1), abs=1e-3)
    assert rec["targets"]["met_at_2"] is None  # CPU: a dry run
