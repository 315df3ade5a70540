"""P4 benchmark: peak memory that saving and loading add on each rank.

Two formats (`--format`):
- `sharded`: `sok.dump` / `sok.load` of one table with its slots;
- `keras`: `model.save("m.keras")` / `keras.models.load_model` of a model
  (`DistributedEmbedding` + `Dense(1)`, compiled with
  `OptimizerWrapper(Adam)`, optimizer built). The load's "added" includes
  creating the model itself (its table and slots: 1x the share).

One `--rows` x `--dim` float32 table with Adam slots (`m`, `v`: the rank's
share is its table rows plus its slot rows, 3x the table shard) is saved
from `--save-ranks` ranks and loaded at `--load-ranks` ranks (re-sharding).
Each rank measures its resident set size right before the call (after the
table, its slots and TensorFlow are set up), resets the kernel's peak RSS
counter (`/proc/self/clear_refs`), runs the call and reads the peak
(`VmHWM`): "added" is peak minus the RSS before. The criterion is added
<= 1.5x the rank's own share. A checksum of every rank's rows (float64 sums
of the table and slots) checks that the load got what the dump wrote.

Usage (driver; runs both jobs through sokrun):
    python bench/checkpoint_memory.py [--rows 2000000] [--dim 32]
        [--save-ranks 2] [--load-ranks 3] [--path DIR] [--format sharded]
        [--pythonpath DIR] [--out bench/results/checkpoint_memory.json]
    (--pythonpath: the sok_keras tree the ranks import, e.g. an older
    checkout for a baseline; defaults to this repository)
Worker (what the driver runs):
    python -m sokrun -np N python bench/checkpoint_memory.py --worker dump|load
        --rows R --dim D --path DIR --json-dir OUT
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _keras_worker(args):
    """model.save (args.worker == "dump") or load_model ("load")."""
    import sok_keras as sok

    sok.init()
    import keras
    import numpy as np
    import tensorflow as tf

    if args.chunk_mb and hasattr(sok.variable, "CHUNK_BYTES"):
        sok.variable.CHUNK_BYTES = int(args.chunk_mb * 2**20)
    path = os.path.join(args.path, "model.keras")
    if args.worker == "dump":
        keras.utils.set_random_seed(1234)
        ids = keras.Input((4,), dtype="int64", name="ids")
        emb = sok.layers.DistributedEmbedding(
            args.rows, args.dim, combiner="sum", name="emb")
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(
            emb(ids)))
        model.compile(optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adam(1e-3)), loss="mse")
        model.optimizer.build(model.trainable_variables)
        table = emb.embeddings
        slots = [table.slots[k] for k in sorted(table.slots)]
        for i, s in enumerate(slots):
            s.assign(tf.convert_to_tensor(table.value) * float(i + 2))
        os.makedirs(args.path, exist_ok=True)
    gc.collect()
    before_kb = _status_kb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if args.worker == "dump":
        model.save(path)
    else:
        model = keras.models.load_model(path)
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    table = model.get_layer("emb").embeddings
    slots = [table.slots[k] for k in sorted(table.slots)]
    share = sum(int(np.prod(v.shape)) * 4 for v in [table] + slots)
    sums = [float(np.sum(v.numpy(), dtype=np.float64))
            for v in [table] + slots]
    return share, before_kb, peak_kb, seconds, sums, int(table.shape[0])


def _worker(args):
    if args.format == "keras":
        share, before_kb, peak_kb, seconds, sums, rows = _keras_worker(args)
        import sok_keras as sok

        _write(args, share, before_kb, peak_kb, seconds, sums, rows,
               chunk=getattr(sok.variable, "CHUNK_BYTES", None))
        return
    import sok_keras as sok

    sok.init()
    import keras
    import numpy as np
    import tensorflow as tf

    from sok_keras import checkpoint
    from sok_keras.optimizers.wrapper import build_once

    if args.chunk_mb:
        checkpoint.CHUNK_BYTES = int(args.chunk_mb * 2**20)

    keras.utils.set_random_seed(1234)
    table = sok.Variable("uniform", shape=(args.rows, args.dim),
                         dtype="float32", name="big")
    opt = sok.optimizers.OptimizerWrapper(keras.optimizers.Adam(1e-3))
    build_once(opt, [table])
    slots = [table.slots[k] for k in sorted(table.slots)]
    if args.worker == "dump":
        # Slots with distinct, checkable values.
        for i, s in enumerate(slots):
            s.assign(tf.convert_to_tensor(table.value) * float(i + 2))
    gc.collect()
    share = sum(int(np.prod(v.shape)) * 4 for v in [table] + slots)
    before_kb = _status_kb("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if args.worker == "dump":
        sok.dump(args.path, [table], optimizer=opt)
    else:
        sok.load(args.path, [table], optimizer=opt)
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    sums = [float(np.sum(v.numpy(), dtype=np.float64))
            for v in [table] + slots]
    _write(args, share, before_kb, peak_kb, seconds, sums,
           int(table.shape[0]), chunk=checkpoint.CHUNK_BYTES)


def _write(args, share, before_kb, peak_kb, seconds, sums, local_rows,
           chunk):
    import sok_keras as sok

    added = (peak_kb - before_kb) * 1024
    result = {
        "rank": sok.rank(), "ranks": sok.num_ranks(),
        "local_rows": int(local_rows),
        "share_bytes": share, "share_mb": round(share / 2**20, 1),
        "table_share_mb": round(share / 3 / 2**20, 1),
        "rss_before_mb": round(before_kb / 1024, 1),
        "peak_mb": round(peak_kb / 1024, 1),
        "added_mb": round(added / 2**20, 1),
        "added_over_share": round(added / share, 3) if share else None,
        "seconds": round(seconds, 2),
        "chunk_bytes": chunk,
        "sums": sums,
    }
    with open(os.path.join(args.json_dir, f"rank{sok.rank()}.json"),
              "w") as f:
        json.dump(result, f)


def _run(action, n, args, json_dir):
    os.makedirs(json_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=args.pythonpath or _common.REPO,
               TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "sokrun", "-np", str(n), "--timeout",
           str(args.timeout), sys.executable, os.path.abspath(__file__),
           "--worker", action, "--rows", str(args.rows), "--dim",
           str(args.dim), "--path", args.path, "--json-dir", json_dir,
           "--chunk-mb", str(args.chunk_mb), "--format", args.format]
    proc = subprocess.run(cmd, env=env, cwd=_common.REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{action} on {n} ranks failed:\n{proc.stdout}\n"
                         f"{proc.stderr}")
    out = []
    for r in range(n):
        with open(os.path.join(json_dir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=["dump", "load"])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--save-ranks", type=int, default=2)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--path")
    p.add_argument("--json-dir")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--chunk-mb", type=float, default=0,
                   help="sok_keras.checkpoint.CHUNK_BYTES, in MiB "
                   "(0: the default)")
    p.add_argument("--format", choices=["sharded", "keras"],
                   default="sharded",
                   help="sok.dump/sok.load, or model.save/load_model")
    p.add_argument("--pythonpath", default=None,
                   help="the sok_keras tree the ranks import (baseline)")
    p.add_argument("--out", default=os.path.join(
        _common.RESULTS, "checkpoint_memory.json"))
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="sok_ckpt_bench_")
    try:
        if args.path is None:
            args.path = os.path.join(scratch, "ckpt")
        dumped = _run("dump", args.save_ranks, args,
                      os.path.join(scratch, "dump"))
        loaded = _run("load", args.load_ranks, args,
                      os.path.join(scratch, "load"))
        on_disk = sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(args.path) for f in files)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    totals = [sum(r["sums"][i] for r in dumped) for i in range(3)]
    got = [sum(r["sums"][i] for r in loaded) for i in range(3)]
    import numpy as np

    result = {
        "benchmark": "checkpoint_memory",
        "command": _common.command_line(),
        "machine": _common.machine_info(),
        "config": {
            "format": args.format,
            "calls": ("model.save / keras.models.load_model"
                      if args.format == "keras" else "sok.dump / sok.load"),
            "sok_keras_tree": args.pythonpath or _common.REPO,
            "rows": args.rows, "dim": args.dim, "dtype": "float32",
            "optimizer": "Adam (slots m, v)",
            "table_mb": round(args.rows * args.dim * 4 / 2**20, 1),
            "chunk_bytes": int(args.chunk_mb * 2**20) if args.chunk_mb
            else ("default (sok_keras.variable.CHUNK_BYTES)"
                  if args.format == "keras" else
                  "default (sok_keras.checkpoint.CHUNK_BYTES)"),
            "save_ranks": args.save_ranks, "load_ranks": args.load_ranks,
            "checkpoint_bytes_on_disk": on_disk,
        },
        "limit_added_over_share": 1.5,
        "dump": dumped,
        "load": loaded,
        "max_added_over_share": max(
            r["added_over_share"] for r in dumped + loaded
            if r["added_over_share"] is not None),
        "checksums_match": bool(np.allclose(got, totals, rtol=1e-9)),
    }
    result["ok"] = (result["max_added_over_share"] <= 1.5
                    and result["checksums_match"])
    _common.finish(args.out, result, t0)
    print(json.dumps({k: result[k] for k in (
        "max_added_over_share", "checksums_match", "ok")}))
    for phase in ("dump", "load"):
        for r in result[phase]:
            print(phase, r["rank"], "share", r["share_mb"], "MB added",
                  r["added_mb"], "MB", r["added_over_share"], "x",
                  r["seconds"], "s")


if __name__ == "__main__":
    main()
