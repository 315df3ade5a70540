"""P11 benchmark: weak scaling of a 26-table DLRM training step over N ranks.

The model: 13 dense features -> bottom MLP; 26 categorical features, one id
each, in 26 tables of Criteo Kaggle's cardinalities (the ones DLRM's
Kaggle runs use; 33.8M rows in all) held by one
`sok.layers.EmbeddingCollection` (sharded over the ranks, one exchange per
direction for all 26 tables); the bottom MLP's output and the 26 embeddings
meet in DLRM's dot interaction (`sok_keras.examples.dlrm.DotInteraction`),
then the top MLP and a sigmoid. Defaults follow MLPerf's DLRM: width 128,
bottom 512-256-128, top 1024-1024-512-256-1. Trained with
`model.train_on_batch` (Keras' compiled train step, what `fit` runs) and
`sok.optimizers.OptimizerWrapper(keras.optimizers.Adam)`, binary
cross-entropy.

Weak scaling: every rank trains on its own batch of `--batch-per-rank`
examples (Zipf ids, exponent 1.05, scrambled over each table by
id * 2654435761 mod V so that hot ids spread over the owners; a few batches
drawn once per rank and used in turn), so the global batch is N times the
per-rank one and the tables are the same for every N. Each step is timed
alone (`train_on_batch` returns the loss: the step is finished); examples/s
= N * batch-per-rank / (the largest over ranks of each rank's median step
time after `--warmup` steps).

One run, N ranks (rank 0 writes the record):

    python -m sokrun -np N python bench/dlrm_scaling.py --out FILE.json
        [--small] [--batch-per-rank 8192] [--steps 50] [--warmup 10]
        [--backend auto|nccl|collective]

Driver (runs each N through sokrun, then computes the scaling):

    python bench/dlrm_scaling.py --ranks 1,2,8 --out FILE.json [...]

speedup(N) = examples/s(N) / examples/s(1); efficiency(N) = speedup(N) / N.
`--small` (dry runs): the example's small vocabularies (sok_keras.examples
.synthetic, 127k rows), width 16, small MLPs, batch 256.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

# Criteo Kaggle (Display Advertising Challenge) cardinalities, as in DLRM's
# Kaggle runs.
CRITEO_KAGGLE = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
    8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
    286181, 105, 142572,
)
FULL = {"dim": 128, "bottom": (512, 256), "top": (1024, 1024, 512, 256),
        "batch": 8192}
SMALL = {"dim": 16, "bottom": (64,), "top": (64, 32), "batch": 256}
NUM_DENSE = 13
NUM_BATCHES = 4
HASH = 2654435761
TARGETS = {"issue": "P11", "speedup_at_2_min": 1.7,
           "efficiency_at_8_min": 0.8}


def vocab_sizes(small):
    if small:
        from sok_keras.examples.synthetic import DEFAULT_VOCAB_SIZES

        return tuple(DEFAULT_VOCAB_SIZES)
    return CRITEO_KAGGLE


def build_model(sizes, dim, bottom, top):
    """The 26-table DLRM (see the module docstring).

    Args:
        sizes: the tables' vocabulary sizes (one feature per table).
        dim: the embedding width (the bottom MLP ends with `dim` units).
        bottom: the bottom MLP's hidden units (before the last, `dim`).
        top: the top MLP's hidden units (a 1-unit sigmoid follows).

    Returns:
        A `keras.Model` taking `{"dense": [b, 13], "c0".."c25": [b]}`.
    """
    import keras

    import sok_keras as sok
    from sok_keras.examples.dlrm import DotInteraction

    names = [f"c{i}" for i in range(len(sizes))]
    dense_in = keras.Input((NUM_DENSE,), name="dense")
    sparse_in = {f: keras.Input((), dtype="int64", name=f) for f in names}
    seeds = iter(range(100, 200))

    def dense(units, name, activation="relu"):
        return keras.layers.Dense(
            units, activation=activation, name=name,
            kernel_initializer=keras.initializers.GlorotUniform(next(seeds)))

    x = dense_in
    for i, units in enumerate(tuple(bottom) + (dim,)):
        x = dense(units, f"bottom_{i}")(x)
    emb = sok.layers.EmbeddingCollection(
        tables={f"t{i}": {"vocabulary_size": int(v), "embedding_dim": dim}
                for i, v in enumerate(sizes)},
        features={f: {"table": f"t{i}", "combiner": None}
                  for i, f in enumerate(names)},
        name="embeddings")(sparse_in)
    stacked = keras.layers.Concatenate(axis=1)(
        [keras.layers.Reshape((1, dim))(x)]
        + [keras.layers.Reshape((1, dim))(emb[f]) for f in names])
    inter = DotInteraction(name="interaction")(stacked)
    z = keras.layers.Concatenate()([x, inter])
    for i, units in enumerate(top):
        z = dense(units, f"top_{i}")(z)
    out = dense(1, "click", activation="sigmoid")(z)
    return keras.Model({"dense": dense_in, **sparse_in}, out)


def make_batches(sizes, batch, seed, count=NUM_BATCHES):
    """`count` batches of numpy arrays: ({"dense", "c0".."c25"}, labels)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = {"dense": np.log1p(rng.lognormal(0.0, 1.0, (batch, NUM_DENSE))
                               ).astype(np.float32)}
        for i, v in enumerate(sizes):
            r = rng.zipf(1.05, batch) - 1
            r = np.where(r < v, r, rng.integers(0, v, batch))
            x[f"c{i}"] = ((r.astype(np.uint64) * np.uint64(HASH))
                          % np.uint64(v)).astype(np.int64)
        y = (rng.random((batch, 1)) < 0.25).astype(np.float32)
        out.append((x, y))
    return out


def _worker(args):
    t_start = time.perf_counter()
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    gpus = _common.visible_gpus()
    info = _common.machine_info()
    info["gpus"] = gpus

    import sok_keras as sok

    w = sok.init(backend=args.backend)
    import keras
    import numpy as np
    import tensorflow as tf

    from sok_keras import world as sok_world

    r, n = sok.rank(), sok.num_ranks()
    cfg = SMALL if args.small else FULL
    dim = args.dim or cfg["dim"]
    batch = args.batch_per_rank or cfg["batch"]
    sizes = vocab_sizes(args.small)
    keras.utils.set_random_seed(1234)  # the same dense layers on every rank
    t0 = time.perf_counter()
    model = build_model(sizes, dim, cfg["bottom"], cfg["top"])
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adam(learning_rate=args.lr)),
        loss="binary_crossentropy")
    build_s = time.perf_counter() - t0
    device = "/GPU:0" if w.gpu is not None else "/CPU:0"
    with tf.device(device):
        data = [({k: tf.identity(tf.constant(v)) for k, v in x.items()},
                 tf.identity(tf.constant(y)))
                for x, y in make_batches(sizes, batch, 1000 + r)]
    times, losses = [], []
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps):
        x, y = data[step % len(data)]
        s0 = time.perf_counter()
        loss = model.train_on_batch(x, y)
        dt = time.perf_counter() - s0
        loss = float(np.asarray(loss).reshape(-1)[0])
        losses.append(loss)
        if step >= args.warmup:
            times.append(dt)
    train_s = time.perf_counter() - t0
    med = statistics.median(times)
    ctl = sok_world.control_communicator()
    all_med = [med]
    if n > 1:
        all_med = ctl.all_gather(tf.constant([[med]], tf.float64),
                                 "bench_dlrm/medians").numpy()[:, 0].tolist()
    bad = [v for v in losses if not np.isfinite(v)]
    if bad:
        raise SystemExit(
            f"bench/dlrm_scaling.py: rank {r}: non-finite loss {bad[0]} "
            "during training")
    if r != 0:
        return
    slowest = max(all_med)
    table_rows = int(sum(sizes))
    emb = model.get_layer("embeddings")
    rows_here = int(sum(v.shape[0] for v in emb.embeddings.values()))
    result = {
        "benchmark": "dlrm_scaling",
        "label": args.label,
        "setup": _setup(w, gpus, n),
        "command": _common.sokrun_command(n),
        "machine": info,
        "env": _common.relevant_env(),
        "versions": {"tensorflow": tf.__version__,
                     "keras": keras.__version__, "numpy": np.__version__},
        "num_ranks": n,
        "backend": w.backend,
        "device": device,
        "config": {
            "small": args.small, "tables": len(sizes),
            "vocab_sizes": list(sizes), "table_rows_total": table_rows,
            "embedding_dim": dim, "bottom": list(cfg["bottom"]) + [dim],
            "top": list(cfg["top"]) + [1], "batch_per_rank": batch,
            "global_batch": batch * n, "optimizer":
                f"OptimizerWrapper(Adam(learning_rate={args.lr}))",
            "step": "model.train_on_batch", "steps": args.steps,
            "warmup": args.warmup, "ids": "Zipf(1.05), scrambled by "
            "id*2654435761 mod V, per-rank seeds",
        },
        "table_rows_on_rank0": rows_here,
        "step_ms_median_per_rank": [round(1e3 * v, 3) for v in all_med],
        "step_ms_rank0": _common.summarize(times),
        "step_s_rank0": [round(t, 5) for t in times],
        "examples_per_s": round(n * batch / slowest, 1),
        "examples_per_s_per_rank": round(batch / slowest, 1),
        "loss_first_last": [round(losses[0], 5), round(losses[-1], 5)],
        "build_s": round(build_s, 1),
        "train_s": round(train_s, 1),
        "max_rss_mb_rank0": _common.max_rss_mb(),
    }
    _common.finish(args.out, result, t_start)
    print(f"N={n}: {result['examples_per_s']:,.0f} examples/s "
          f"(median step {1e3 * slowest:.2f} ms, batch {batch}/rank, "
          f"backend {w.backend}, {result['setup']})")


def _setup(w, gpus, n):
    if w.gpu is None:
        return "CPU only: a dry run of the scripts, not a result"
    if n > len(gpus):
        return (f"{n} ranks sharing {len(gpus)} GPU(s): a dry run, not a "
                "result")
    return f"{n} GPU(s), one per rank, backend {w.backend}"


def scaling(runs):
    """Speed-up and efficiency of every run against the one-rank run.

    Args:
        runs: the runs' records (each with `num_ranks`, `examples_per_s`).

    Returns:
        A dict: `{"N": {"examples_per_s", "speedup", "efficiency"}}`
        (speed-up and efficiency None without a one-rank run).
    """
    base = next((x["examples_per_s"] for x in runs if x["num_ranks"] == 1),
                None)
    out = {}
    for x in runs:
        n, eps = x["num_ranks"], x["examples_per_s"]
        speedup = round(eps / base, 3) if base else None
        out[str(n)] = {"examples_per_s": eps, "speedup": speedup,
                       "efficiency": round(speedup / n, 3) if base else None}
    return out


def targets(table, runs):
    """P11's targets where this run measured them (None: not measured, or
    not on one GPU per rank)."""
    real = all(x["setup"].startswith(f"{x['num_ranks']} GPU")
               for x in runs)
    t = dict(TARGETS)
    two, eight = table.get("2", {}), table.get("8", {})
    t["speedup_at_2"] = two.get("speedup")
    t["efficiency_at_8"] = eight.get("efficiency")
    t["met_at_2"] = (None if t["speedup_at_2"] is None or not real
                     else t["speedup_at_2"] >= TARGETS["speedup_at_2_min"])
    t["met_at_8"] = (None if t["efficiency_at_8"] is None or not real
                     else t["efficiency_at_8"]
                     >= TARGETS["efficiency_at_8_min"])
    if not real:
        t["why_none"] = "not every run had one GPU per rank (a dry run)"
    return t


SAME_MODEL_KEYS = ("small", "vocab_sizes", "embedding_dim", "bottom", "top",
                   "batch_per_rank", "optimizer", "steps", "warmup")


def check_same_model(runs):
    """Raises SystemExit unless every run trained the same model with the
    same per-rank batch (a --baseline from another configuration)."""
    first = {k: runs[0]["config"].get(k) for k in SAME_MODEL_KEYS}
    for x in runs[1:]:
        other = {k: x["config"].get(k) for k in SAME_MODEL_KEYS}
        diff = sorted(k for k in SAME_MODEL_KEYS if first[k] != other[k])
        if diff:
            raise SystemExit(
                "bench/dlrm_scaling.py: the runs differ in "
                + ", ".join(f"{k} ({first[k]} at N={runs[0]['num_ranks']}, "
                            f"{other[k]} at N={x['num_ranks']})"
                            for k in diff)
                + "; efficiency needs the same model and batch per rank")


def load_baseline(path):
    """The one-rank run of an earlier record (a one-run record or a
    driver's), to compare later runs with."""
    with open(path) as f:
        rec = json.load(f)
    runs = rec.get("runs", [rec])
    one = [x for x in runs if x.get("num_ranks") == 1]
    if not one:
        raise SystemExit(
            f"bench/dlrm_scaling.py: --baseline {path} has no one-rank run")
    return dict(one[0], baseline_from=path)


def _without_backend(argv):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--backend":
            skip = True
        elif not a.startswith("--backend="):
            out.append(a)
    return out


def _driver(args, argv):
    try:
        ranks = [int(v) for v in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks must list positive ints, got {args.ranks}")
    if any(v < 1 for v in ranks):
        raise SystemExit(f"--ranks must list positive ints, got {args.ranks}")
    info = _common.machine_info()
    info["gpus"] = _common.visible_gpus()
    t0 = time.perf_counter()
    passed = []  # the worker's arguments: ours less --ranks and --out
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--ranks", "--out", "--baseline"):
            skip = True
            continue
        if a.startswith(("--ranks=", "--out=", "--baseline=")):
            continue
        passed.append(a)
    runs = []
    if args.baseline:
        runs.append(load_baseline(args.baseline))
    env = dict(os.environ)
    for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS",
                "SOK_LOCAL_RANK"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory(prefix="sok_dlrm_") as tmp:
        for n in ranks:
            # One rank has no one to talk to: its run keeps the default
            # backend ("auto": no communicator), whatever --backend says.
            args_n = passed if n > 1 else _without_backend(passed)
            path = os.path.join(tmp, f"n{n}.json")
            cmd = [sys.executable, "-m", "sokrun", "-np", str(n),
                   "--timeout", str(args.timeout), sys.executable,
                   os.path.abspath(__file__), "--out", path] + args_n
            proc = subprocess.run(cmd, env=env, cwd=_common.REPO,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write((proc.stdout + proc.stderr)[-6000:])
                raise SystemExit(
                    f"bench/dlrm_scaling.py: the {n}-rank run failed "
                    f"(exit {proc.returncode})")
            print(proc.stdout.strip().splitlines()[-1], flush=True)
            with open(path) as f:
                rec = json.load(f)
            rec["command"] = " ".join(
                ["python -m sokrun -np", str(n), "--timeout",
                 f"{args.timeout:g}", "python bench/dlrm_scaling.py",
                 "--out FILE"] + args_n)
            runs.append(rec)
    check_same_model(runs)
    table = scaling(runs)
    result = {
        "benchmark": "dlrm_scaling",
        "label": args.label,
        "command": _common.command_line(),
        "machine": info,
        "ranks": ranks,
        "scaling": table,
        "targets": targets(table, runs),
        "runs": runs,
    }
    _common.finish(args.out, result, t0)
    for n, row in table.items():
        print(f"N={n}: {row['examples_per_s']:,.0f} examples/s, speedup "
              f"{row['speedup']}, efficiency {row['efficiency']}")
    print("targets:", json.dumps(result["targets"]))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the JSON record")
    p.add_argument("--ranks", default=None,
                   help="driver: run these rank counts (e.g. 1,2,8) through "
                        "sokrun and compute the scaling")
    p.add_argument("--small", action="store_true",
                   help="small tables and model, for dry runs")
    p.add_argument("--batch-per-rank", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backend", default="auto",
                   choices=["auto", "nccl", "collective"])
    p.add_argument("--baseline", default=None,
                   help="driver: take the one-rank run from this earlier "
                        "record instead of running it")
    p.add_argument("--timeout", type=float, default=1800,
                   help="driver: sokrun's --timeout for each run")
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    for name in ("steps", "batch_per_rank", "dim"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.ranks:
        return _driver(args, argv)
    return _worker(args)


if __name__ == "__main__":
    main()
