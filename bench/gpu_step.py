"""P5 on one GPU: sok_keras against torch, the HBM floor and Keras, one run.

Measures, on the GPU TensorFlow sees (and torch, in a subprocess of the
same run, on the same ids):

1. device copy bandwidth (torch, 4 GiB; read + written bytes / time);
2. forward pooled lookup, batch B x F features x H ids (sum), a V x D fp32
   table, Zipf ids: torch `embedding_bag(mode="sum")` vs
   `sok.lookup_sparse`, and the HBM floor (B*F*H rows x D*4 bytes over the
   copy bandwidth). Both as device time (torch: CUDA events; sok: its
   kernels' time from TensorFlow's profiler) and as wall time per call,
   each call synchronized;
3. a training step (`train_on_batch`: forward, backward, update) of
   B x F x H pooled features -> Dense(1): `keras.layers.Embedding` + Keras
   Adam (XLA, Keras' default on a GPU, and op by op) vs
   `sok.layers.DistributedEmbedding` + `OptimizerWrapper(Adam)`, and the
   peer's step (torch `EmbeddingBag(sparse=True)` + `SparseAdam`, in the
   torch subprocess);
4. the unpooled model: B x F one-id features -> Flatten -> Dense(256, relu)
   -> Dense(1), Keras Embedding + Adam vs sok + OptimizerWrapper(Adam);
5. for both, a lower bound of any step's memory traffic (distinct rows
   read, rows and Adam's slots read and written, output and its gradient
   once) over the copy bandwidth: Keras' step over it is the largest
   speed-up over Keras that any implementation could reach here.

Usage (on the GPU machine): `python bench/gpu_step.py --out FILE`
(`--small` for a quick check anywhere). Writes a JSON record and prints a
summary table.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def zipf_ids(n, vocab, seed, a=1.05):
    """Zipf-distributed ids in [0, vocab), hot ids spread over the table."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = rng.zipf(a, n) - 1
    ranks = np.where(ranks < vocab, ranks, rng.integers(0, vocab, n))
    return ((ranks * 2654435761) % vocab).astype(np.int64)


TORCH = r"""
import json, sys, time
import numpy as np, torch
cfg = json.loads(sys.argv[1])
ids = torch.from_numpy(np.load(cfg["ids"])).cuda()
dev = torch.device("cuda")
out = {}
# Copy bandwidth: 4 GiB device to device.
x = torch.empty(1 << 30, dtype=torch.float32, device=dev).uniform_()
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
times = []
for _ in range(10):
    ev[0].record(); y.copy_(x); ev[1].record(); torch.cuda.synchronize()
    times.append(ev[0].elapsed_time(ev[1]))
times.sort()
out["copy_GBps"] = 2 * x.numel() * 4 / (times[len(times) // 2] * 1e-3) / 1e9
del x, y
table = torch.empty(cfg["vocab"], cfg["dim"], device=dev).uniform_(-0.05, 0.05)
bags = ids.view(-1, cfg["hotness"])
f = lambda: torch.nn.functional.embedding_bag(bags, table, mode="sum")
for _ in range(5):
    f()
torch.cuda.synchronize()
times = []
for _ in range(30):
    ev[0].record(); f(); ev[1].record(); torch.cuda.synchronize()
    times.append(ev[0].elapsed_time(ev[1]))
times.sort()
out["torch_embedding_bag_ms"] = times[len(times) // 2]
# Wall time per call, each call synchronized (as sok's forward, which waits
# for its kernel's error summary), for a wall-to-wall comparison.
walls = []
for _ in range(30):
    t0 = time.perf_counter(); f(); torch.cuda.synchronize()
    walls.append((time.perf_counter() - t0) * 1000.0)
walls.sort()
out["torch_embedding_bag_wall_ms"] = walls[len(walls) // 2]
out["torch_version"] = torch.__version__
if cfg.get("step"):
    # The peer's pooled training step on the same ids: EmbeddingBag(sum,
    # sparse gradient) + SparseAdam (lazy: only the rows of the batch),
    # Linear(F*D, 1) + Adam, MSE; `loss.item()` ends each step, as
    # `train_on_batch` returns its loss.
    B, F = cfg["batch"], cfg["features"]
    emb = torch.nn.EmbeddingBag(cfg["vocab"], cfg["dim"], mode="sum",
                                sparse=True).to(dev)
    with torch.no_grad():
        emb.weight.copy_(table)
    del table
    lin = torch.nn.Linear(F * cfg["dim"], 1).to(dev)
    opts = [torch.optim.SparseAdam(emb.parameters(), lr=1e-3),
            torch.optim.Adam(lin.parameters(), lr=1e-3)]
    target = (torch.arange(B, device=dev) % 2).float()[:, None]

    def step():
        pred = lin(emb(bags).view(B, F * cfg["dim"]))
        loss = torch.nn.functional.mse_loss(pred, target)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        return loss.item()

    for _ in range(3):
        step()
    per = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            step()
        per.append((time.perf_counter() - t0) / cfg["steps"] * 1000.0)
    per.sort()
    out["torch_pooled_sparse_adam_step_ms"] = per[1]
    out["torch_pooled_sparse_adam_rounds"] = per
print(json.dumps(out))
"""


def sync_first(out):
    """Waits for `out` (a tensor, a structure of them, or a number) by
    copying one element of its first tensor to the host, not the tensor."""
    import numpy as np
    import tensorflow as tf

    x = tf.nest.flatten(out)[0]
    if isinstance(x, tf.Tensor):
        x = tf.reshape(x, [-1])[:1]
    np.asarray(x)


def _device_ms(fn, sync, steps):
    """GPU time (kernels and copies) per call of `fn`, from the profiler."""
    import tempfile

    import tensorflow as tf

    import gpu_profile

    sync(fn())
    logdir = tempfile.mkdtemp(prefix="sok_gpu_step_prof_")
    tf.profiler.experimental.start(logdir)
    for _ in range(steps):
        r = fn()
    sync(r)
    tf.profiler.experimental.stop()
    try:
        totals, _ = gpu_profile.kernel_times(logdir)
    except Exception as e:  # the trace format is TensorFlow's to change
        print("could not read the profile:", repr(e))
        return None
    return round(sum(totals.values()) / steps, 3)


def _time(fn, sync, steps, rounds=3):
    """Median over `rounds` of (wall time of `steps` calls) / steps, ms."""
    per = []
    for _ in range(rounds):
        sync(fn())
        t0 = time.perf_counter()
        for _ in range(steps):
            r = fn()
        sync(r)
        per.append((time.perf_counter() - t0) / steps * 1000.0)
    per.sort()
    return round(per[len(per) // 2], 3), [round(p, 3) for p in per]


def build_step_model(kind, pooled, vocab, dim, features, hotness):
    """The benchmark's model, compiled with Adam(1e-3) and MSE.

    kind: "keras" (`keras.layers.Embedding` + Keras Adam, Keras' default
    `jit_compile="auto"`: XLA on a GPU), "keras_nojit" (the same with
    `jit_compile=False`), "sok"
    (`DistributedEmbedding` + `OptimizerWrapper(Adam)`, its defaults) or
    "sok_opbyop" (the same with `jit_compile=False`: the dense weights'
    update op by op, as Keras runs it once XLA is off). pooled: inputs
    (batch, features, hotness), each bag summed, then Dense(1); else inputs
    (batch, features) of one id each, Flatten, Dense(256, relu), Dense(1).
    """
    import keras

    import sok_keras as sok

    F, H, D = features, hotness, dim
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)

    class PooledFeatures(keras.layers.Layer):
        def __init__(self, emb, **kw):
            super().__init__(**kw)
            self.emb = emb

        def build(self, input_shape):
            if isinstance(self.emb, keras.layers.Embedding):
                self.emb.build(input_shape)
            else:
                self.emb.build((None, H))

        def call(self, x):
            if isinstance(self.emb, keras.layers.Embedding):
                return keras.ops.reshape(
                    keras.ops.sum(self.emb(x), axis=2), (-1, F * D))
            out = self.emb(keras.ops.reshape(x, (-1, H)))
            return keras.ops.reshape(out, (-1, F * D))

    keras.utils.clear_session()
    if kind.startswith("keras"):
        emb = keras.layers.Embedding(vocab, D, embeddings_initializer=init)
        opt = keras.optimizers.Adam(1e-3)
    else:
        emb = sok.layers.DistributedEmbedding(
            vocab, D, combiner="sum" if pooled else None,
            embeddings_initializer=init)
        opt = sok.optimizers.OptimizerWrapper(
            keras.optimizers.Adam(1e-3),
            jit_compile="auto" if kind == "sok" else False)
    if pooled:
        inp = keras.Input((F, H), dtype="int64")
        h = PooledFeatures(emb)(inp)
    else:
        inp = keras.Input((F,), dtype="int64")
        h = keras.layers.Flatten()(emb(inp))
        h = keras.layers.Dense(256, activation="relu")(h)
    out = keras.layers.Dense(1)(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=opt, loss="mse",
                  jit_compile=False if kind == "keras_nojit" else "auto")
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--hotness", type=int, default=8)
    p.add_argument("--vocab", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--small", action="store_true")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--forward-only", action="store_true",
                   help="time only the forward lookup")
    p.add_argument("--unroll-sweep", action="store_true",
                   help="also time the forward at SOK_POOLED_LOOKUP_UNROLL="
                        "1, 2, 4, 8")
    p.add_argument("--out", default=os.path.join(_common.RESULTS,
                                                 "gpu_step.json"))
    args = p.parse_args()
    if args.small:
        args.batch, args.vocab, args.steps = 512, 100_000, 3
    t0 = time.perf_counter()
    import numpy as np

    nnz = args.batch * args.features * args.hotness
    ids = zipf_ids(nnz, args.vocab, seed=1)
    result = {"machine": _common.machine_info(), "command":
              _common.command_line(), "config": vars(args),
              "ids": {"nnz": nnz, "unique": int(np.unique(ids).size)}}
    ids_path = os.path.join("/tmp", "sok_gpu_step_ids.npy")
    np.save(ids_path, ids)
    if not args.no_torch:  # first, in its own process: TF takes the memory
        cfg = {"ids": ids_path, "vocab": args.vocab, "dim": args.dim,
               "hotness": args.hotness, "batch": args.batch,
               "features": args.features, "steps": args.steps,
               "step": not args.forward_only}
        run = subprocess.run([sys.executable, "-c", TORCH, json.dumps(cfg)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            result["torch_error"] = run.stderr[-2000:]
        else:
            result.update(json.loads(run.stdout.strip().splitlines()[-1]))

    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    import keras
    import tensorflow as tf

    import sok_keras as sok
    from sok_keras import _ops

    result["tf_version"] = tf.__version__
    result["gpus"] = [d.name for d in tf.config.list_physical_devices("GPU")]
    B, F, H, V, D = (args.batch, args.features, args.hotness, args.vocab,
                     args.dim)

    sync = sync_first
    # 2. Forward pooled lookup.
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    table = sok.Variable(init, shape=(V, D), name="bench_table")
    bags = tf.constant(ids.reshape(-1, H))
    fwd = tf.function(lambda: sok.lookup_sparse(table, bags, combiners="sum"))
    syncs0 = _ops.build_info()["gpu_host_syncs"]
    sync(fwd())
    result["sok_forward_host_syncs"] = (
        _ops.build_info()["gpu_host_syncs"] - syncs0)
    result["sok_forward_ms"], result["sok_forward_rounds"] = _time(
        fwd, sync, args.steps * 3)

    # The forward's device time, from TensorFlow's profiler (the kernels'
    # time per call), as torch's is timed with CUDA events.
    result["sok_forward_gpu_ms"] = _device_ms(fwd, sync, args.steps)

    if args.unroll_sweep:  # the kernel reads the variable on each call
        sweep = {}
        for u in ("1", "2", "4", "8"):
            os.environ["SOK_POOLED_LOOKUP_UNROLL"] = u
            sweep[u] = _time(fwd, sync, args.steps * 3)[0]
        os.environ.pop("SOK_POOLED_LOOKUP_UNROLL")
        result["sok_forward_ms_by_unroll"] = sweep
        print("forward ms by SOK_POOLED_LOOKUP_UNROLL", sweep)

    if args.forward_only:
        _common.finish(args.out, result, t0)
        print("forward_only", result["sok_forward_ms"],
              result["sok_forward_rounds"])
        return

    # Where the forward's time goes: each stage alone, on the same inputs.
    from sok_keras import lookup as sok_lookup
    from sok_keras import lookup_ops

    feat = sok_lookup.normalize_ids(bags)
    dedup = lookup_ops.dedup_bucketize(feat.values, 1, V)
    rows = tf.gather(table.value, dedup.local_rows)
    stages = {
        "normalize_ids": lambda: sok_lookup.normalize_ids(bags).values,
        "dedup_bucketize": lambda: lookup_ops.dedup_bucketize(
            feat.values, 1, V).inverse,
        "gather_unique_rows": lambda: tf.gather(table.value,
                                                dedup.local_rows),
        "segment_combine": lambda: lookup_ops.segment_combine(
            rows, dedup.inverse, feat.segment_ids, None, feat.batch_size),
        "tf_gather_all_rows": lambda: tf.gather(table.value, feat.values),
    }
    result["forward_stages_ms"] = {
        name: _time(tf.function(fn), sync, args.steps * 3)[0]
        for name, fn in stages.items()}

    # The pooled training step's pieces on their own: forward + backward
    # (the table's IndexedSlices gradient), and the sparse Adam update of
    # that gradient.
    up = tf.ones([B * F, D], tf.float32)

    @tf.function
    def fwd_bwd():
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, bags, combiners="sum")
            loss = tf.reduce_sum(out * up)
        g = tape.gradient(loss, table.value)
        return g.values, g.indices

    grad_values, grad_indices = fwd_bwd()
    result["pooled_grad_unique_rows"] = int(grad_indices.shape[0])
    result["sok_forward_backward_ms"] = _time(fwd_bwd, sync, args.steps)[0]
    slots = [tf.Variable(tf.zeros([V, D])), tf.Variable(tf.zeros([V, D]))]
    from sok_keras.optimizers import sparse_kernels

    def adam():
        sparse_kernels.sparse_adam(table.value, slots[0], slots[1],
                                   grad_indices, grad_values, 1e-3, 1, 0.9,
                                   0.999, 1e-7)
        # A one-element slice, not the slot: a returned read of the slot
        # would share its buffer, and the next update would copy the
        # whole slot first (copy-on-write).
        return slots[0][:1, :1]

    adam_fn = tf.function(adam)
    copies0 = _ops.build_info()["variable_copy_bytes"]
    result["sok_sparse_adam_ms"] = _time(adam_fn, sync, args.steps)[0]
    result["sparse_adam_variable_copy_bytes"] = (
        _ops.build_info()["variable_copy_bytes"] - copies0)
    # Free what the sections above hold before the models: the table, its
    # slots, and the traced functions that capture them. On an 80 GB card,
    # Keras' XLA step on a 10M x 128 table needs 24 GiB beside its own
    # weights, and run 27 ran out of memory there with these still held.
    slots.clear()
    table = fwd = fwd_bwd = adam = adam_fn = stages = rows = up = None
    grad_values = grad_indices = feat = dedup = bags = None
    gc.collect()

    def gpu_bytes():
        if not result["gpus"]:
            return None
        return tf.config.experimental.get_memory_info("GPU:0")["current"]

    # 3. Training step, pooled features.
    x3 = ids.reshape(B, F, H)
    y = (np.arange(B) % 2).astype(np.float32)[:, None]

    def step_model(kind, pooled):
        return build_step_model(kind, pooled, V, D, F, H)

    for name, pooled, x in (("pooled", True, x3),
                            ("unpooled", False, x3[:, :, 0])):
        xt = tf.constant(x)
        yt = tf.constant(y)
        for kind in ("keras", "keras_nojit", "sok", "sok_opbyop"):
            result[f"{name}_{kind}_gpu_bytes_before"] = gpu_bytes()
            model = step_model(kind, pooled)
            # Keras' "auto": XLA for the Keras model on a GPU; off for the
            # sok ones (the op library has no XLA kernels).
            result[f"{name}_{kind}_model_jit_compile"] = bool(
                model.jit_compile)
            first = time.perf_counter()
            model.train_on_batch(xt, yt)
            first = time.perf_counter() - first
            copies0 = _ops.build_info()["variable_copy_bytes"]
            ms, rounds = _time(lambda: model.train_on_batch(xt, yt),
                               lambda r: float(r), args.steps)
            if not kind.startswith("keras"):  # copy-on-write of a table: should be 0
                result[f"{name}_sok_variable_copy_bytes"] = (
                    _ops.build_info()["variable_copy_bytes"] - copies0)
            result[f"{name}_{kind}_step_ms"] = ms
            result[f"{name}_{kind}_rounds"] = rounds
            result[f"{name}_{kind}_first_step_s"] = round(first, 2)
            model = None  # freed before the next model is built
            gc.collect()

    copy = result.get("copy_GBps")
    gpu_ms = result.get("sok_forward_gpu_ms")
    if copy:
        floor = nnz * D * 4 / (copy * 1e9) * 1000.0
        result["hbm_floor_ms"] = round(floor, 3)
        # Device time over the floor (the floor is device time too), and
        # the wall time per synchronized call over it.
        if gpu_ms:
            result["forward_over_floor"] = round(gpu_ms / floor, 2)
        result["forward_wall_over_floor"] = round(
            result["sok_forward_ms"] / floor, 2)
    if "torch_embedding_bag_ms" in result:
        # Device time against device time (torch: CUDA events), and wall
        # against wall (each call synchronized on both sides).
        if gpu_ms:
            result["forward_vs_torch"] = round(
                result["torch_embedding_bag_ms"] / gpu_ms, 2)
        result["forward_wall_vs_torch"] = round(
            result["torch_embedding_bag_wall_ms"] / result["sok_forward_ms"],
            2)
    if copy:
        # A lower bound of any pooled or unpooled step's memory traffic: each
        # distinct row read once by the forward, and read and written with
        # Adam's two slots by the update (7 row reads or writes), the
        # lookup's output (B x F rows) written once and its gradient read
        # once; no cache reuse beyond that, no dense layers, no host time.
        # Keras' step over this time is the largest speed-up over Keras that
        # any implementation could reach on this GPU.
        distinct = {"pooled": result["ids"]["unique"],
                    "unpooled": int(np.unique(x3[:, :, 0]).size)}
        for name, u in distinct.items():
            lower = (7 * u + 2 * B * F) * D * 4 / (copy * 1e9) * 1000.0
            result[f"{name}_distinct_ids"] = u
            result[f"{name}_step_memory_lower_bound_ms"] = round(lower, 3)
            result[f"{name}_keras_over_lower_bound"] = round(
                result[f"{name}_keras_step_ms"] / lower, 2)
    if "torch_pooled_sparse_adam_step_ms" in result:
        result["pooled_torch_sparse_adam_speedup_vs_keras"] = round(
            result["pooled_keras_step_ms"]
            / result["torch_pooled_sparse_adam_step_ms"], 2)
    for name in ("pooled", "unpooled"):
        result[f"{name}_nojit_keras_over_sok"] = round(
            result[f"{name}_keras_nojit_step_ms"]
            / result[f"{name}_sok_step_ms"], 2)
        result[f"{name}_speedup_vs_keras"] = round(
            result[f"{name}_keras_step_ms"] / result[f"{name}_sok_step_ms"], 2)
        result[f"{name}_opbyop_speedup_vs_keras"] = round(
            result[f"{name}_keras_step_ms"]
            / result[f"{name}_sok_opbyop_step_ms"], 2)
    _common.finish(args.out, result, t0)
    keys = ["copy_GBps", "torch_embedding_bag_ms",
            "torch_embedding_bag_wall_ms", "sok_forward_ms",
            "sok_forward_gpu_ms", "hbm_floor_ms", "forward_over_floor",
            "forward_wall_over_floor", "forward_vs_torch",
            "forward_wall_vs_torch",
            "sok_forward_host_syncs", "forward_stages_ms",
            "sok_forward_backward_ms", "pooled_grad_unique_rows",
            "sok_sparse_adam_ms", "sparse_adam_variable_copy_bytes",
            "pooled_sok_variable_copy_bytes",
            "unpooled_sok_variable_copy_bytes",
            "pooled_keras_step_ms", "pooled_keras_nojit_step_ms",
            "pooled_sok_step_ms", "pooled_speedup_vs_keras",
            "pooled_nojit_keras_over_sok",
            "torch_pooled_sparse_adam_step_ms",
            "pooled_torch_sparse_adam_speedup_vs_keras",
            "pooled_distinct_ids", "pooled_step_memory_lower_bound_ms",
            "pooled_keras_over_lower_bound",
            "pooled_sok_opbyop_step_ms", "pooled_opbyop_speedup_vs_keras",
            "unpooled_keras_step_ms", "unpooled_keras_nojit_step_ms",
            "unpooled_sok_step_ms", "unpooled_speedup_vs_keras",
            "unpooled_nojit_keras_over_sok",
            "unpooled_distinct_ids", "unpooled_step_memory_lower_bound_ms",
            "unpooled_keras_over_lower_bound", "unpooled_sok_opbyop_step_ms",
            "unpooled_opbyop_speedup_vs_keras",
            "unpooled_keras_model_jit_compile",
            "unpooled_sok_model_jit_compile"]
    for k in keys:
        print(f"{k:32s} {result.get(k)}")


if __name__ == "__main__":
    main()
