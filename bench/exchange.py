"""P2 benchmark: the sharded lookup's exchange vs a purely local lookup.

Every rank looks up a fixed per-rank batch (`--batch` samples x `--hot` ids,
sum-pooled) in one `--vocab` x `--dim` table and takes the gradient with
respect to the table (forward + backward), inside a `tf.function`:

- `sok fwd+bwd`: `sok.lookup_sparse` on a `sok.Variable` row-sharded over the
  N ranks: dedup + bucketize, all-gather of the counts, all-to-all of the
  unique ids, gather on the owner, all-to-all of the rows back, pool; the
  backward pass reduces per unique id and sends the row gradients back
  (one more all-to-all). With N = 1 there is no exchange at all.
- `sok fwd`: the same, forward only.
- `local gather+segsum fwd+bwd`: what one process does with the whole table
  in its own memory: `tf.gather` + `tf.math.segment_sum`, gradient as a
  `tf.IndexedSlices` (one row per id, no dedup).
- `local embedding_lookup_sparse fwd+bwd`: `tf.nn.embedding_lookup_sparse`
  on the whole local table (what `keras`/TF users call).
- `collectives only` (N > 1): the four collectives of one `sok fwd+bwd`
  step (all-gather of counts, ids all-to-all, rows all-to-all, gradient
  all-to-all) on the same unique ids and counts, with the rows made up:
  the communication part of the step.
- `collectives only, no in-flight markers` (N > 1): the same through a
  `CollectiveCommunicator(timeout=None)` (no watchdog markers).
- `raw TF collectives, pre-padded` (N > 1): the same four collectives as
  bare `CollectiveGatherV2` / `CollectiveAllToAllV2` ops on buffers already
  padded to the exchange's power-of-two bucket: TF's runtime alone, without
  sok_keras' bookkeeping (padding, unpadding, checks, in-flight markers).
- `barrier` (N > 1): one all-reduce of a scalar: the latency floor of a
  single collective on this runtime.

All ranks run the same variant at the same time (a barrier before every
block of steps), so the local variants see the same CPU contention as the
sharded ones. Variants are timed in alternating blocks (`--rounds`), each
step alone (the result is fetched with `.numpy()`). Ids follow a truncated
Zipf law (exponent 1.2, `sok_keras.examples.synthetic.zipf_ids`) scrambled
by a fixed bijection `id -> id * 2654435761 mod V`, so that hot ids are
spread over the owners; every rank draws its own batches (8 of them, used
in turn).

Usage (driver: N = 1 as a plain process, N > 1 through sokrun):
    python bench/exchange.py [--ranks 1,2,3] [--vocab 1000000] [--dim 16]
        [--batch 1024] [--hot 26] [--steps 30] [--warmup 5] [--rounds 3]
        [--out bench/results/exchange.json]
Worker (what the driver runs):
    python -m sokrun -np N --timeout 300 \\
        python bench/exchange.py --worker --json OUT ...
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

NUM_BATCHES = 8
HASH = 2654435761


def _worker(args):
    import sok_keras as sok

    sok.init()
    import numpy as np
    import tensorflow as tf

    from sok_keras import lookup_ops
    from sok_keras import world
    from sok_keras.examples.synthetic import zipf_ids

    r, n = sok.rank(), sok.num_ranks()
    comm = world.communicator()
    v, d, b, h = args.vocab, args.dim, args.batch, args.hot
    if math.gcd(HASH, v) != 1:
        raise ValueError(f"id scrambling is not a bijection for V={v}")

    table = sok.Variable(
        "uniform", shape=(v, d), name="bench_table")
    local = tf.Variable(
        tf.random.stateless_uniform([v, d], seed=[1, 2], minval=-0.05,
                                    maxval=0.05), name="local_table")
    rng = np.random.default_rng(1000 + r)
    batches, sparse, prep, stats = [], [], [], []
    for _ in range(NUM_BATCHES):
        ids = (zipf_ids(rng, v, b * h).astype(np.uint64)
               * np.uint64(HASH) % np.uint64(v)).astype(np.int64)
        ids = ids.reshape(b, h)
        batches.append(tf.constant(ids))
        idx = np.stack([np.repeat(np.arange(b), h), np.tile(np.arange(h), b)],
                       1)
        sparse.append(tf.SparseTensor(idx, ids.ravel(), [b, h]))
        uniq, _, _, counts, _ = lookup_ops.dedup_bucketize(
            ids.ravel(), num_ranks=n, vocab_size=v, owner=-1)
        prep.append((uniq, counts))
        c = counts.numpy()
        stats.append({"nnz": b * h, "unique": int(uniq.shape[0]),
                      "unique_per_owner": c.tolist(),
                      "sent_to_others": int(c.sum() - c[r])})
    w = tf.constant(
        np.random.default_rng(7).normal(size=(b, d)).astype(np.float32))
    ids_spec = tf.TensorSpec([b, h], tf.int64)

    @tf.function(input_signature=[ids_spec])
    def sok_fwd_bwd(ids):
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
            loss = tf.reduce_sum(out * w)
        g = tape.gradient(loss, table)
        return tf.reduce_sum(g.values) + loss

    @tf.function(input_signature=[ids_spec])
    def sok_fwd(ids):
        return tf.reduce_sum(sok.lookup_sparse(table, ids, combiners="sum")
                             * w)

    segs = tf.repeat(tf.range(b, dtype=tf.int64), h)

    @tf.function(input_signature=[ids_spec])
    def local_gather(ids):
        with tf.GradientTape() as tape:
            rows = tf.gather(local, tf.reshape(ids, [-1]))
            out = tf.math.segment_sum(rows, segs)
            loss = tf.reduce_sum(out * w)
        g = tape.gradient(loss, local)
        return tf.reduce_sum(g.values) + loss

    @tf.function(input_signature=[tf.SparseTensorSpec([b, h], tf.int64)])
    def local_els(sp):
        with tf.GradientTape() as tape:
            out = tf.nn.embedding_lookup_sparse(local, sp, None,
                                                combiner="sum")
            loss = tf.reduce_sum(out * w)
        g = tape.gradient(loss, local)
        return tf.reduce_sum(g.values) + loss

    def make_comm_only(c, tag):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([n], tf.int64)])
        def comm_only(uniq, counts):
            summary = tf.concat([counts, tf.constant([-1, 0], tf.int64)], 0)
            gathered = c.all_gather(summary[None, :], key=f"{tag}/counts")
            cm = gathered[:, :n]
            received = c.exchange(uniq, cm, key=f"{tag}/ids")
            rows = tf.tile(tf.cast(received, tf.float32)[:, None], [1, d])
            back = c.exchange(rows, tf.transpose(cm), key=f"{tag}/rows")
            grad = c.exchange(back * 0.5, cm, key=f"{tag}/grad")
            return tf.reduce_sum(grad)
        return comm_only

    comm_only = make_comm_only(comm, "bench")
    comm_only_nowd = None
    if n > 1:
        from sok_keras.comm import CollectiveCommunicator

        # Same collectives, same group, without the watchdog's in-flight
        # markers (timeout=None).
        comm_only_nowd = make_comm_only(
            CollectiveCommunicator(r, n, timeout=None), "bench_nowd")

    # The same four collectives issued as raw TF ops on buffers already
    # padded to the exchange's bucket (no counts bookkeeping, no padding or
    # unpadding, no in-flight markers): what TF's runtime itself costs.
    raw = []
    if n > 1:
        from sok_keras.comm import GROUP_KEY

        for uniq, counts in prep:
            cm = comm.all_gather(counts[None, :], key="bench/setup").numpy()
            bucket = 1 << max(0, int(cm.max() - 1).bit_length())
            e = bucket.bit_length()
            raw.append((
                tf.constant([[*counts.numpy(), -1, 0]], tf.int64),
                tf.zeros([n, bucket], tf.int64),
                tf.zeros([n, bucket * d], tf.float32),
                tf.constant(e, tf.int32)))

    @tf.function(input_signature=[tf.TensorSpec([1, n + 2], tf.int64),
                                  tf.TensorSpec([n, None], tf.int64),
                                  tf.TensorSpec([n, None], tf.float32),
                                  tf.TensorSpec([], tf.int32)])
    def raw_collectives(summary, ids_buf, rows_buf, e):
        def a2a(x, base):
            return tf.raw_ops.CollectiveAllToAllV2(
                input=x, group_size=n, group_key=GROUP_KEY,
                instance_key=base + e, ordering_token=[],
                communication_hint="auto", timeout_seconds=0)

        g = tf.raw_ops.CollectiveGatherV2(
            input=summary, group_size=n, group_key=GROUP_KEY,
            instance_key=0x7E0000, ordering_token=[],
            communication_hint="auto", timeout_seconds=0)
        ids = a2a(ids_buf + g[0, 0] * 0, 0x7E0100)
        rows = a2a(rows_buf + tf.cast(ids[0, 0], tf.float32) * 0, 0x7E0200)
        grad = a2a(rows * 0.5, 0x7E0300)
        return tf.reduce_sum(grad[:, :1])

    @tf.function
    def barrier_fn():
        return comm.all_reduce(tf.constant([1.0]), key="bench/barrier")

    def barrier():
        if n > 1:
            barrier_fn().numpy()

    variants = {
        "sok fwd+bwd": lambda i: sok_fwd_bwd(batches[i]),
        "sok fwd": lambda i: sok_fwd(batches[i]),
        "local gather+segsum fwd+bwd": lambda i: local_gather(batches[i]),
        "local embedding_lookup_sparse fwd+bwd":
            lambda i: local_els(sparse[i]),
    }
    if n > 1:
        variants["collectives only"] = lambda i: comm_only(*prep[i])
        variants["collectives only, no in-flight markers"] = (
            lambda i: comm_only_nowd(*prep[i]))
        variants["raw TF collectives, pre-padded"] = (
            lambda i: raw_collectives(*raw[i]))
        variants["barrier"] = lambda i: barrier_fn()

    counter = {k: 0 for k in variants}

    def step(name):
        i = counter[name] % NUM_BATCHES
        counter[name] += 1
        t0 = time.perf_counter()
        out = variants[name](i)
        out.numpy()
        return time.perf_counter() - t0

    for name in variants:  # trace, warm up
        barrier()
        for _ in range(args.warmup):
            step(name)
    times = {k: [] for k in variants}
    per_block = max(1, args.steps // args.rounds)
    load = [_common.loadavg()]
    for _ in range(args.rounds):
        for name in variants:
            barrier()
            for _ in range(per_block):
                times[name].append(step(name))
        load.append(_common.loadavg())

    mine = {k: _common.summarize(ts) for k, ts in times.items()}
    names = list(variants)
    med = np.array([mine[k]["median_ms"] for k in names], np.float64)
    if n > 1:
        all_med = comm.all_gather(tf.constant(med[None, :]),
                                  key="bench/medians").numpy()
    else:
        all_med = med[None, :]
    if r == 0:
        per_rank = {k: all_med[:, j].round(3).tolist()
                    for j, k in enumerate(names)}
        result = {
            "num_ranks": n,
            "rank0": mine,
            "median_ms_per_rank": per_rank,
            "median_ms_max_over_ranks": {
                k: round(max(v_), 3) for k, v_ in per_rank.items()},
            "step_s_rank0": {k: [round(t, 6) for t in ts]
                             for k, ts in times.items()},
            "batches_rank0": stats,
            "table_rows_on_rank0": int(table.shape[0]),
            "loadavg_during": load,
            "max_rss_mb_rank0": _common.max_rss_mb(),
            "versions": {"tensorflow": tf.__version__,
                         "keras": __import__("keras").__version__,
                         "numpy": np.__version__},
            "tf_threads": {
                "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
            },
        }
        _common.write_json(args.json, result)


def _run(n, args):
    path = os.path.join(args.tmp, f"bench_{os.getpid()}_exchange_{n}.json")
    worker = [sys.executable, os.path.abspath(__file__), "--worker",
              "--json", path, "--vocab", str(args.vocab),
              "--dim", str(args.dim), "--batch", str(args.batch),
              "--hot", str(args.hot), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
    if n == 1:
        cmd = worker
    else:
        cmd = [sys.executable, "-m", "sokrun", "-np", str(n),
               "--timeout", str(args.timeout)] + worker
    env = dict(os.environ)
    for var in ("SOK_RANK", "SOK_NUM_RANKS", "SOK_WORKER_ADDRS"):
        env.pop(var, None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{cmd} failed with {proc.returncode}")
    with open(path) as f:
        out = json.load(f)
    os.remove(path)
    out["process_wall_s"] = round(wall, 1)
    out["command"] = " ".join(
        "python" if c == sys.executable else
        os.path.relpath(c, _common.REPO) if c.startswith(_common.REPO)
        else c for c in cmd)
    threads = {k: env[k] for k in ("TF_NUM_INTRAOP_THREADS",
                                   "TF_NUM_INTEROP_THREADS") if k in env}
    if threads:
        out["command"] = " ".join(
            f"{k}={v}" for k, v in threads.items()) + " " + out["command"]
    out["tf_thread_env"] = threads
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--hot", type=int, default=26)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=os.path.join(_common.RESULTS,
                                                 "exchange.json"))
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    info = _common.machine_info()
    t0 = time.perf_counter()
    runs = []
    for n in [int(x) for x in args.ranks.split(",")]:
        out = _run(n, args)
        runs.append(out)
        m = out["median_ms_max_over_ranks"]
        line = "  ".join(f"{k}: {v:.2f}" for k, v in m.items())
        print(f"N={n}: {line}  (load {_common.loadavg()})", flush=True)
    result = {
        "benchmark": "exchange",
        "command": _common.command_line(),
        "machine": info,
        "versions": runs[0]["versions"],
        "config": {"vocab": args.vocab, "dim": args.dim,
                   "batch_per_rank": args.batch, "ids_per_sample": args.hot,
                   "ids": "Zipf(1.2) over [0, V), scrambled by "
                          "id*2654435761 mod V; per-rank seeds",
                   "steps": args.steps, "warmup": args.warmup,
                   "rounds": args.rounds},
        "runs": runs,
    }
    _common.finish(args.out, result, t0)


if __name__ == "__main__":
    main()
