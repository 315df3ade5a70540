"""First step and step time of many separate pooled tables per `pooling`
mode ("auto", "home", "owner"), on N ranks (the layers' docstring cites it).

Each mode runs in its own job (`sokrun`), the modes alternating over
`--rounds`, so that a machine's drift touches them alike. The model: F
features of `--ids` ids each (1: one-id features, for which "auto" pools at
home without a per-step `tf.cond`), each its own `DistributedEmbedding`
(pooled sum), then
Concatenate, Dense(64, relu), Dense(1); `OptimizerWrapper(Adam)`; Zipf ids.

Usage (from the repository root):
    PYTHONPATH=. python bench/pooling_modes.py --out bench/results/pooling_modes.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

MODES = ("auto", "home", "owner")


def worker(args):
    """One rank of one job: prints rank 0's timings as a JSON line."""
    import sok_keras as sok

    sok.init()
    import keras
    import numpy as np
    import tensorflow as tf

    f, v, d, b, k = args.features, args.vocab, args.dim, args.batch, args.ids
    keras.utils.set_random_seed(0)
    inp = keras.Input((f * k,), dtype="int64")
    cols = [sok.layers.DistributedEmbedding(
        v, d, combiner="sum", pooling=args.mode, name=f"e{i}")(
            inp[:, i * k:(i + 1) * k]) for i in range(f)]
    x = keras.layers.Dense(64, activation="relu")(
        keras.layers.Concatenate()(cols))
    model = keras.Model(inp, keras.layers.Dense(1)(x))
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(1e-3)),
                  loss="mse")
    rng = np.random.default_rng(1)
    steps = args.warmup + args.steps
    ids = rng.zipf(1.2, size=(b * steps, f * k)) % v
    y = rng.normal(size=(b * steps, 1)).astype("float32")
    ds = sok.shard_batches(tf.data.Dataset.from_tensor_slices(
        (ids, y)).batch(b, drop_remainder=True))
    t0 = time.perf_counter()
    model.fit(ds.take(args.warmup), verbose=0)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.fit(ds.skip(args.warmup), verbose=0)
    step = (time.perf_counter() - t0) / args.steps
    if sok.rank() == 0:
        print("RESULT " + json.dumps({
            "mode": args.mode, "warmup_s": round(first, 2),
            "step_ms": round(step * 1e3, 2)}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--ids", type=int, default=1,
                   help="ids per feature and sample")
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3,
                   help="steps of the first fit (its trace included)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(
        "bench", "results", "pooling_modes.json"))
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return worker(args)
    t0 = time.perf_counter()
    result = {"machine": _common.machine_info(),
              "command": _common.command_line(),
              "config": {k: v for k, v in vars(args).items()
                         if k not in ("mode", "out")},
              "runs": []}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(
        [_common.REPO] + [q for q in env.get("PYTHONPATH", "").split(
            os.pathsep) if q])
    passed = [f"--{k}={v}" for k, v in result["config"].items()
              if k not in ("ranks", "rounds")]
    for r in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, "-m", "sokrun", "-np", str(args.ranks),
                   "--timeout", "600", sys.executable, os.path.abspath(
                       __file__), "--mode", mode] + passed
            out = subprocess.run(cmd, env=env, cwd=_common.REPO,
                                 capture_output=True, text=True, check=True)
            line = next(x for x in out.stdout.splitlines()
                        if "RESULT " in x)
            run = dict(json.loads(line.split("RESULT ", 1)[1]), round=r)
            print(run, flush=True)
            result["runs"].append(run)
    result["median"] = {
        mode: {key: sorted(x[key] for x in result["runs"]
                           if x["mode"] == mode)[args.rounds // 2]
               for key in ("warmup_s", "step_ms")} for mode in MODES}
    _common.finish(args.out, result, t0)


if __name__ == "__main__":
    main()
