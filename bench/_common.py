"""Helpers shared by the benchmark scripts (no TensorFlow import here)."""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")


def loadavg():
    """The 1/5/15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def summarize(samples_s):
    """Median, quartiles, min and max of a list of seconds, in ms."""
    ms = sorted(1000.0 * s for s in samples_s)
    if len(ms) >= 4:
        q = statistics.quantiles(ms, n=4)
        p25, p75 = q[0], q[2]
    else:
        p25, p75 = ms[0], ms[-1]
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p25_ms": round(p25, 3),
        "p75_ms": round(p75, 3),
        "min_ms": round(ms[0], 3),
        "max_ms": round(ms[-1], 3),
    }


def machine_info():
    """What the results were measured on."""
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": loadavg(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal", "MemAvailable")):
                    k, v = line.split(":", 1)
                    info[k] = v.strip()
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
            text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def max_rss_mb():
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                 1)


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def command_line():
    """This script's command line, relative to the repository."""
    return " ".join(
        ["python", os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def finish(path, result, t0):
    """Stamps the end load and total time on ``result``, writes it to
    ``path`` and says so."""
    result["loadavg_end"] = loadavg()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    write_json(path, result)
    print(f"wrote {path} in {result['total_s']} s")


def gpu_info():
    """The GPUs `nvidia-smi` lists (index, name, memory in MiB, driver), or
    [] when there is none or no `nvidia-smi`. Does not start CUDA."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,"
             "driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            gpus.append({"index": int(parts[0]), "name": parts[1],
                         "memory_total_mib": int(parts[2]),
                         "memory_free_mib": int(parts[3]),
                         "driver": parts[4]})
    return gpus


def visible_gpus():
    """The `gpu_info()` entries this process may use (`CUDA_VISIBLE_DEVICES`
    as a list of indices is honoured; UUIDs are not resolved: all GPUs)."""
    gpus = gpu_info()
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return gpus
    vis = vis.strip()
    if vis in ("", "-1"):
        return []
    wanted = [v.strip() for v in vis.split(",")]
    if not all(v.isdigit() for v in wanted):
        return gpus
    by_index = {g["index"]: g for g in gpus}
    return [by_index[int(v)] for v in wanted if int(v) in by_index]


def sokrun_command(num_ranks, timeout=None):
    """The sokrun line that runs this script on `num_ranks` ranks, as a
    string (for the results' "command")."""
    head = f"python -m sokrun -np {num_ranks}"
    if timeout:
        head += f" --timeout {timeout:g}"
    return head + " " + command_line()


def relevant_env():
    """The environment variables that change what a benchmark measures."""
    prefixes = ("SOK_BACKEND", "SOK_COMM_TIMEOUT", "NCCL_", "TF_FORCE_GPU",
                "TF_NUM_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(prefixes)}
