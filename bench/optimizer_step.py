"""P3 benchmark: one `train_on_batch` step, sparse sok_keras vs dense Keras.

The model (as in /work/shared/DESIGN.md, "Baseline on this CPU machine"):
batch 1024 samples x 8 ids, the 8 rows of each sample sum-pooled, a
`Dense(1, sigmoid)` head, binary cross-entropy.

- "keras": `keras.layers.Embedding(V, 64)` + `keras.ops.sum(axis=1)`, compiled
  with the plain Keras optimizer (Adam: dense update of the table and of its
  two slots every step).
- "sok": `sok.layers.DistributedEmbedding(V, 64, combiner="sum")` (one rank,
  so no exchange), compiled with
  `sok.optimizers.OptimizerWrapper(<the same Keras optimizer>)` (lazy update
  of only the rows in the batch).

Ids are drawn uniformly from [0, V) (the worst case for the sparse path: the
most distinct rows per step, ~8,170 of 8,192 at V >= 2M), from 4 pre-built
batches used in turn. `jit_compile=False` for both (Keras' "auto" on a
CPU-only machine resolves to False anyway).

Timing: after `--warmup` steps (the first one traces and builds the
optimizer), `--steps` steps per model, each timed alone (`train_on_batch`
returns the loss as a Python float, so the step has finished). When the two
models fit in memory together they are built in one process and timed in
alternating blocks (`--rounds` blocks each), so that load changes on this
shared machine hit both; otherwise (large V) each model runs in its own
process, back to back.

Usage:
    python bench/optimizer_step.py [--sizes 200000,2000000,8000000]
        [--optimizers adam,sgd] [--steps 12] [--warmup 3] [--rounds 3]
        [--out bench/results/optimizer_step.json]
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

BATCH = 1024
HOT = 8
DIM = 64
NUM_BATCHES = 4


def _child(args):
    import sok_keras as sok

    sok.init()
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(1234)
    v = args.vocab
    batches = []
    uniques = []
    for _ in range(NUM_BATCHES):
        ids = rng.integers(0, v, size=(BATCH, HOT), dtype=np.int64)
        y = (rng.random((BATCH, 1)) < 0.5).astype(np.float32)
        uniques.append(int(np.unique(ids).size))
        batches.append((tf.constant(ids), tf.constant(y)))

    def make_opt():
        if args.opt == "adam":
            return keras.optimizers.Adam(1e-3)
        if args.opt == "sgd":
            return keras.optimizers.SGD(0.01)
        raise ValueError(args.opt)

    def build(kind):
        inp = keras.Input(shape=(HOT,), dtype="int64", name="ids")
        if kind == "keras":
            x = keras.layers.Embedding(v, DIM, name="emb_keras")(inp)
            x = keras.ops.sum(x, axis=1)
            opt = make_opt()
        else:
            x = sok.layers.DistributedEmbedding(
                v, DIM, combiner="sum", name="emb_sok")(inp)
            opt = sok.optimizers.OptimizerWrapper(make_opt())
        out = keras.layers.Dense(1, activation="sigmoid", name="head")(x)
        model = keras.Model(inp, out, name=f"model_{kind}")
        model.compile(optimizer=opt, loss="binary_crossentropy",
                      jit_compile=False)
        return model

    models = {}
    build_s = {}
    for kind in args.models:
        t0 = time.perf_counter()
        models[kind] = build(kind)
        build_s[kind] = round(time.perf_counter() - t0, 2)
    counter = {kind: 0 for kind in models}

    def step(kind):
        x, y = batches[counter[kind] % NUM_BATCHES]
        counter[kind] += 1
        t0 = time.perf_counter()
        loss = models[kind].train_on_batch(x, y)
        dt = time.perf_counter() - t0
        if not np.isfinite(loss):
            raise RuntimeError(f"{kind}: loss is {loss}")
        return dt

    warm = {}
    for kind in models:
        warm[kind] = [round(step(kind), 3) for _ in range(args.warmup)]
    times = {kind: [] for kind in models}
    per_block = max(1, args.steps // args.rounds)
    load = [_common.loadavg()]
    for _ in range(args.rounds):
        for kind in models:
            for _ in range(per_block):
                times[kind].append(step(kind))
        load.append(_common.loadavg())
    result = {
        "vocab": v,
        "opt": args.opt,
        "models": list(models),
        "unique_ids_per_batch": uniques,
        "build_s": build_s,
        "warmup_s": warm,
        "step_s": {k: [round(t, 5) for t in ts] for k, ts in times.items()},
        "summary": {k: _common.summarize(ts) for k, ts in times.items()},
        "loadavg_during": load,
        "max_rss_mb": _common.max_rss_mb(),
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                     "numpy": np.__version__},
    }
    _common.write_json(args.json, result)


def _estimate_bytes(vocab, opt, kinds):
    """Rough peak memory: table copies alive at once (float32)."""
    table = vocab * DIM * 4
    copies = 0
    for kind in kinds:
        if kind == "keras":
            # table + slots + dense temporaries of the update
            copies += 6 if opt == "adam" else 3
        else:
            copies += 3 if opt == "adam" else 1
    return table * copies + (1 << 30)


def _run_child(vocab, opt, kinds, args, tag):
    path = os.path.join(
        args.tmp, f"bench_{os.getpid()}_opt_{vocab}_{opt}_{tag}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child",
           "--vocab", str(vocab), "--opt", opt, "--models", ",".join(kinds),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds if len(kinds) > 1 else 1),
           "--json", path]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"child {cmd} failed with {proc.returncode}")
    with open(path) as f:
        out = json.load(f)
    os.remove(path)
    out["process_wall_s"] = round(wall, 1)
    return out


def run(args):
    rows = []
    for opt in args.optimizers:
        for vocab in args.sizes:
            kinds = ["keras", "sok"]
            need = _estimate_bytes(vocab, opt, kinds)
            avail = _common.mem_available_bytes()
            if need < 0.7 * avail:
                mode = "same process, alternating blocks"
                parts = [_run_child(vocab, opt, kinds, args, "both")]
            else:
                mode = "back-to-back processes"
                parts = [_run_child(vocab, opt, [k], args, k) for k in kinds]
            summary, steps, rss, warm, uniq = {}, {}, {}, {}, None
            for p in parts:
                summary.update(p["summary"])
                steps.update(p["step_s"])
                warm.update(p["warmup_s"])
                uniq = p["unique_ids_per_batch"]
                for k in p["models"]:
                    rss[k] = p["max_rss_mb"]
            ratio = summary["keras"]["median_ms"] / summary["sok"]["median_ms"]
            row = {
                "vocab": vocab, "dim": DIM, "opt": opt, "mode": mode,
                "keras": summary["keras"], "sok": summary["sok"],
                "speedup_median": round(ratio, 2),
                # conservative: slowest quartile of sok vs fastest of keras
                "speedup_p75_sok_vs_p25_keras": round(
                    summary["keras"]["p25_ms"] / summary["sok"]["p75_ms"], 2),
                "max_rss_mb": rss,
                "warmup_s": warm,
                "step_s": steps,
                "unique_ids_per_batch": uniq,
                "loadavg_during": [p["loadavg_during"] for p in parts],
                "versions": parts[0]["versions"],
            }
            rows.append(row)
            print(f"{opt:5s} V={vocab:>9,d}  keras {summary['keras']['median_ms']:9.1f} ms"
                  f"  sok {summary['sok']['median_ms']:8.1f} ms"
                  f"  x{ratio:6.1f}  ({mode}; load {_common.loadavg()})",
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="200000,2000000,8000000")
    p.add_argument("--optimizers", default="adam,sgd")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(_common.RESULTS,
                                                 "optimizer_step.json"))
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--opt", help=argparse.SUPPRESS)
    p.add_argument("--models", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.models = args.models.split(",")
        return _child(args)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.optimizers = args.optimizers.split(",")
    info = _common.machine_info()
    t0 = time.perf_counter()
    rows = run(args)
    versions = rows[0].pop("versions") if rows else {}
    for row in rows[1:]:
        row.pop("versions", None)
    result = {
        "benchmark": "optimizer_step",
        "command": _common.command_line(),
        "machine": info,
        "versions": versions,
        "config": {"batch": BATCH, "ids_per_sample": HOT, "dim": DIM,
                   "ids": "uniform in [0, V), 4 pre-built batches in turn",
                   "head": "Dense(1, sigmoid), binary cross-entropy",
                   "steps": args.steps, "warmup": args.warmup,
                   "rounds": args.rounds, "jit_compile": False},
        "rows": rows,
    }
    _common.finish(args.out, result, t0)


if __name__ == "__main__":
    main()
