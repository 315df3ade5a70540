"""Time to the first training step of a model with many separate pooled
tables on N ranks (trace + first run), with and without the per-step
`tf.cond` of `pooling="auto"`.

One-id features (`keras.Input(shape=(1,))`, the Criteo layout) pool at
home without that `tf.cond`; the baseline, in the same run, gives every
feature a second column of padding (`shape=(2,)`, every second id -1): the
same ids and the same numbers, but a static width of 2, so `"auto"` traces
the `tf.cond` between home and owner pooling and its gradient. The
variants alternate, each in a fresh model, after one warm-up model.

    python -m sokrun -np 2 python bench/first_step.py --tables 26 \\
        --out bench/results/first_step.json
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def _ops():
    """Operations in every function traced so far in this process."""
    from tensorflow.python.eager import context

    ctx = context.context()
    return sum(len(ctx.get_function_def(n).node_def)
               for n in ctx.list_function_names())


def _measure(sok, keras, np, tables, batch, padded, steps, tag):
    width = 2 if padded else 1
    inputs = [keras.Input(shape=(width,), dtype="int64", name=f"{tag}_f{i}")
              for i in range(tables)]
    pooled = [sok.layers.DistributedEmbedding(
        1000, 8, combiner="sum", name=f"{tag}_e{i}")(x)
        for i, x in enumerate(inputs)]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(pooled))
    model = keras.Model(inputs, out)
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(
        keras.optimizers.Adam(1e-3)), loss="mse")
    rng = np.random.default_rng(0)
    xs = {}
    for i in range(tables):
        ids = rng.integers(0, 1000, (batch, 1))
        if padded:
            ids = np.concatenate([ids, -np.ones_like(ids)], 1)
        xs[f"{tag}_f{i}"] = ids
    y = rng.random((batch, 1)).astype("float32")
    before = _ops()
    t = time.perf_counter()
    model.train_on_batch(xs, y)
    first = time.perf_counter() - t
    ops = _ops() - before
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model.train_on_batch(xs, y)
        times.append(time.perf_counter() - t)
    return {"first_step_s": round(first, 3), "graph_ops": ops,
            "step": _common.summarize(times)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(_common.RESULTS,
                                                 "first_step.json"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    import sok_keras as sok

    sok.init()
    import keras
    import numpy as np

    _measure(sok, keras, np, 2, args.batch, True, 1, "warmup")
    runs = {"one_id": [], "padded_width_2": []}
    for r in range(args.rounds):
        for name, padded in (("padded_width_2", True), ("one_id", False)):
            runs[name].append(_measure(sok, keras, np, args.tables,
                                       args.batch, padded, args.steps,
                                       f"r{r}_{name}"))
            keras.backend.clear_session()
    first = {k: statistics.median(x["first_step_s"] for x in v)
             for k, v in runs.items()}
    result = {
        "benchmark": "first_step",
        "command": (f"python -m sokrun -np {sok.num_ranks()} "
                    + _common.command_line()),
        "machine": _common.machine_info(),
        "ranks": sok.num_ranks(),
        "tables": args.tables,
        "batch_per_rank": args.batch,
        "runs": runs,
        "first_step_s_median": first,
        "first_step_speedup": round(
            first["padded_width_2"] / first["one_id"], 2),
    }
    if sok.rank() == 0:
        _common.finish(args.out, result, t0)
        print({k: result[k] for k in ("first_step_s_median",
                                      "first_step_speedup")})


if __name__ == "__main__":
    main()
