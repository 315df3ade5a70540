"""Where a sok step's GPU time goes: kernel times from TensorFlow's profiler.

Profiles, on the GPU, the one-rank pooled lookup's forward, its forward +
backward, the sparse Adam update of its gradient, and with `--steps-too`
whole `train_on_batch` steps of bench/gpu_step.py's sok models, on the inputs of
bench/gpu_step.py (Zipf ids, batch x features x hotness into a vocab x dim
fp32 table), then reads the profiler's XPlane files and prints, per phase,
the GPU kernels and copies that took the most device time (summed over the
profiled steps, divided by the step count).

Usage (on the GPU machine): `python bench/gpu_profile.py [--out FILE]`.
"""

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402  (zipf_ids)


def _planes(logdir):
    """Every plane of the profiler's XPlane files under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    for path in glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                          recursive=True):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        yield from space.planes


def kernel_times(logdir):
    """({event name: total device ms} over the GPU planes of the trace,
    {event name: total ms} over the host plane: TF ops and runtime events,
    nested events counted in each)."""
    totals = collections.Counter()
    host_totals = collections.Counter()
    seen = []
    for plane in _planes(logdir):
        seen.append((plane.name, [ln.name for ln in plane.lines][:8]))
        if plane.name.startswith("/host:CPU"):
            names = {k: v.name for k, v in plane.event_metadata.items()}
            for line in plane.lines:
                for ev in line.events:
                    host_totals[names.get(ev.metadata_id, "?")] += (
                        ev.duration_ps / 1e9)
            continue
        if not plane.name.startswith("/device:GPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            # Kernel and memcpy lines carry the stream's events; skip the
            # derived lines (TF op / step summaries) that repeat them.
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                name = names.get(ev.metadata_id, "?")
                if name.startswith("Memcpy"):
                    # Which TF op the copy belongs to, and its size.
                    stats = {}
                    for st in ev.stats:
                        key = stat_names.get(st.metadata_id, "")
                        val = (st.str_value or st.int64_value
                               or st.uint64_value
                               or (stat_names.get(st.ref_value)
                                   if st.ref_value else ""))
                        stats[key] = val
                    op = stats.get("tf_op") or stats.get("hlo_op") or ""
                    size = stats.get("memcpy_details", "")
                    name = f"{name} [{op}] {size}"[:160]
                totals[name] += ev.duration_ps / 1e9
    if not totals:
        print("no GPU stream events; planes and lines:", seen)
    return totals, host_totals


def timeline(logdir, window="one_step_on_data", min_us=8.0, limit=160):
    """The last `window` host event of the trace and every host and GPU
    stream event of at least `min_us` inside it, in start order, as
    (start µs from the window's start, duration µs, "host"/"gpu", name):
    where the host waits for the device and what the device does then."""
    events = []
    for plane in _planes(logdir):
        host = plane.name.startswith("/host:CPU")
        if not host and not plane.name.startswith("/device:GPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not host and "stream" not in line.name.lower():
                continue
            for ev in line.events:
                start = line.timestamp_ns * 1e3 + ev.offset_ps  # ps
                events.append((start, ev.duration_ps,
                               "host" if host else "gpu",
                               names.get(ev.metadata_id, "?")))
    frames = [e for e in events if e[2] == "host" and e[3] == window]
    if not frames:
        return []
    t0, dur = max(frames)[:2]
    out = [((s - t0) / 1e6, d / 1e6, where, name)
           for s, d, where, name in events
           if t0 <= s <= t0 + dur and d / 1e6 >= min_us]
    out.sort()
    return out[:limit]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--hotness", type=int, default=8)
    p.add_argument("--vocab", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default=None)
    p.add_argument("--timeline", action="store_true",
                   help="with --steps-too: print the last step's host and "
                        "GPU events in time order")
    p.add_argument("--steps-too", action="store_true",
                   help="also profile bench/gpu_step.py's sok train steps")
    args = p.parse_args()
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    import keras
    import numpy as np
    import tensorflow as tf

    import sok_keras as sok
    from sok_keras.optimizers import sparse_kernels

    B, F, H, V, D = (args.batch, args.features, args.hotness, args.vocab,
                     args.dim)
    ids = gpu_step.zipf_ids(B * F * H, V, seed=1)
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    table = sok.Variable(init, shape=(V, D), name="profile_table")
    bags = tf.constant(ids.reshape(-1, H))
    up = tf.ones([B * F, D])

    @tf.function
    def fwd_bwd():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(
                sok.lookup_sparse(table, bags, combiners="sum") * up)
        g = tape.gradient(loss, table.value)
        return g.values, g.indices

    values, indices = fwd_bwd()
    m = tf.Variable(tf.zeros([V, D]))
    v = tf.Variable(tf.zeros([V, D]))

    @tf.function
    def adam():
        sparse_kernels.sparse_adam(table.value, m, v, indices, values, 1e-3,
                                   1, 0.9, 0.999, 1e-7)
        return tf.constant(0)

    adam()

    @tf.function
    def forward():
        return sok.lookup_sparse(table, bags, combiners="sum")

    phases = [("forward", forward), ("forward_backward", fwd_bwd),
              ("sparse_adam", adam)]
    if args.steps_too:
        # Whole `train_on_batch` steps of bench/gpu_step.py's sok models
        # (the tables above are dropped first: the models make their own).
        x3 = ids.reshape(B, F, H)
        y = tf.constant((np.arange(B) % 2).astype(np.float32)[:, None])
        for label, pooled, x in (("pooled_step", True, x3),
                                 ("unpooled_step", False, x3[:, :, 0])):
            model = gpu_step.build_step_model("sok", pooled, V, D, F, H)
            xt = tf.constant(x)
            model.train_on_batch(xt, y)
            phases.append((label, lambda m=model, xt=xt: m.train_on_batch(
                xt, y)))
    sync = gpu_step.sync_first

    report = {"config": vars(args)}
    for name, fn in phases:
        # Wall time per call without the profiler, for comparison with the
        # GPU time the profiler sees.
        sync(fn())
        t0 = time.perf_counter()
        for _ in range(args.steps):
            out = fn()
        sync(out)
        wall_ms = (time.perf_counter() - t0) / args.steps * 1000.0
        logdir = tempfile.mkdtemp(prefix=f"sok_prof_{name}_")
        tf.profiler.experimental.start(logdir)
        for _ in range(args.steps):
            out = fn()
        sync(out)
        tf.profiler.experimental.stop()
        try:
            totals, host = kernel_times(logdir)
        except Exception as e:  # the trace format is TF's to change
            report[name] = {"error": repr(e)}
            print(name, "could not read the trace:", repr(e))
            continue
        per_step = {k: round(t / args.steps, 4)
                    for k, t in totals.most_common(args.top)}
        report[name] = {
            "wall_ms_per_step": round(wall_ms, 3),
            "gpu_ms_per_step": round(sum(totals.values()) / args.steps, 3),
            "top": per_step,
            "host_top": {k: round(t / args.steps, 4)
                         for k, t in host.most_common(args.top)}}
        print(f"== {name}: {report[name]['wall_ms_per_step']} ms wall, "
              f"{report[name]['gpu_ms_per_step']} ms of GPU events per step")
        for k, t in per_step.items():
            print(f"  {t:8.3f} ms  {k[:110]}")
        print("  host:")
        for k, t in report[name]["host_top"].items():
            print(f"  {t:8.3f} ms  {k[:110]}")
        if args.timeline and name.endswith("_step"):
            line = timeline(logdir)
            report[name]["timeline"] = line
            print("  timeline (µs from the step's start, duration):")
            for start, d, where, ev in line:
                print(f"  {start:8.1f} {d:8.1f} {where:4s} {ev[:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
