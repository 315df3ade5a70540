"""P5b benchmark: sok's variable-size all-to-all vs torch's, per message size.

Run on N ranks (N >= 2) through sokrun; rank 0 writes the JSON record:

    python -m sokrun -np N python bench/alltoall.py --out FILE.json
        [--sizes-mib 16,32,64,128,256,512,1024] [--backend auto|nccl|collective]
        [--torch auto|nccl|gloo|none] [--iters 10] [--warmup 3] [--rounds 7]

What is measured, for every per-rank message size S (the bytes one rank
sends in one all-to-all, its own block included) and two splits:

- `equal`: rank i sends S/N to every rank (nccl-tests' alltoall);
- `zipf`: a skewed split, the same on every rank relative to itself: rank i
  sends to rank (i + d) mod N a share proportional to k^-1.2, k = d for
  d = 1..N-1 and k = N for itself (d = 0). Every rank still sends and
  receives S in all (the count matrix is circulant), but the blocks are of
  unequal sizes, as the lookup's are when some owners hold hot ids.

1. `sok`: the communicator's `exchange(x, counts_matrix, key)`, as the
   lookup calls it (`sok_keras.lookup._exchange_parts`): x is
   `[rows, width]` float32 rows (`--width`, default 128: a 128-wide fp32
   embedding row of 512 bytes) grouped by destination, the `[N, N]` count
   matrix a tensor. With the NCCL backend that is one `SokNcclAllToAll`;
   with the collective backend (TensorFlow's collectives, e.g. several ranks
   on one GPU, or CPU) the rows are padded to the power-of-two bucket, sent
   with `CollectiveAllToAllV2` and unpadded.
2. `torch`: `torch.distributed.all_to_all_single` with the same splits
   (`input_split_sizes` / `output_split_sizes`), on the same bytes, in one
   separate process per rank started by the rank (so that torch's CUDA and
   NCCL libraries never share a process with TensorFlow's). Backend: NCCL
   when every rank has its own GPU; gloo on CPU tensors otherwise (ranks
   sharing a GPU, or no GPU), which the record says. Skipped, with the
   reason recorded, when torch is not installed.

Timing, for both: `--warmup` rounds, then `--rounds` rounds; a round is a
barrier, then `--iters` all-to-alls back to back (sok: chained in one
`tf.function`; torch: on the same buffers, as nccl-tests does), then a
synchronization (sok: the result fetched; torch: `cuda.synchronize`). A
round's time / iters is one sample; each rank takes the median of its
samples, and the record's time is the largest median over the ranks.
algbw = S / time, busbw = algbw * (N - 1) / N (nccl-tests' definition for
alltoall), in GB/s (1e9 bytes/s). Every result is checked once before the
timing (each row carries its source and destination rank).

Sizes that would not fit are skipped with the reason, not run: the budget
per rank is the free memory of its GPU (from nvidia-smi, before TensorFlow
starts) divided by the ranks that share that GPU, or, without a GPU,
MemAvailable / N; every rank uses the smallest budget of all ranks, so that
all skip the same sizes. The torch processes run first and exit before the
sok half starts, so their memory is free again for TensorFlow.
"""

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

DEFAULT_SIZES_MIB = "16,32,64,128,256,512,1024"
SPLITS = ("equal", "zipf")
ZIPF_EXPONENT = 1.2
# Fraction of the memory budget a size may use (allocator slack, TF's own).
BUDGET_FRACTION = 0.8
TARGET = {"issue": "P5b", "min_busbw_ratio": 0.8, "from_size_mib": 128}
KEY = "bench_a2a"


def count_matrix(n, rows, split):
    """The `[n, n]` count matrix (rows rank i sends to rank j) as lists.

    Args:
        n: the number of ranks.
        rows: the rows each rank sends in all.
        split: `"equal"` or `"zipf"` (see the module docstring).

    Returns:
        A list of n lists of n ints; every row sums to the same total, and
        so does every column.
    """
    if split == "equal":
        per = max(1, rows // n)
        return [[per] * n for _ in range(n)]
    if split != "zipf":
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    weights = [(k + 1) ** -ZIPF_EXPONENT for k in range(n)]
    total = sum(weights)
    # Offsets in decreasing share: the next rank gets the most, itself the
    # least (so that most bytes cross the network, as in the lookup).
    order = list(range(1, n)) + [0]
    share = [0.0] * n
    for k, d in enumerate(order):
        share[d] = weights[k] / total
    per = [max(1, int(rows * s)) for s in share]
    per[order[0]] += rows - sum(per)
    return [[per[(j - i) % n] for j in range(n)] for i in range(n)]


def _next_pow2(m):
    return 1 << max(0, int(m) - 1).bit_length()


def sok_bytes_needed(c, row_bytes, backend):
    """A rank's peak bytes for one chained sok exchange of matrix `c`:
    the input kept by the caller, the current input and the output
    (NCCL); plus the padded send and receive buffers (collective)."""
    n = len(c)
    send = max(sum(c[i]) for i in range(n)) * row_bytes
    recv = max(sum(c[i][j] for i in range(n)) for j in range(n)) * row_bytes
    if backend == "nccl":
        return 2 * send + 2 * recv
    padded = n * _next_pow2(max(max(row) for row in c)) * row_bytes
    return 2 * send + 2 * padded + recv


def torch_bytes_needed(c, row_bytes):
    """torch's buffers (input and output) plus a quarter for the
    library's own."""
    n = len(c)
    send = max(sum(c[i]) for i in range(n)) * row_bytes
    recv = max(sum(c[i][j] for i in range(n)) for j in range(n)) * row_bytes
    return int(1.25 * (send + recv))


def _gib(b):
    return round(b / 2**30, 3)


def _bandwidth(bytes_per_rank, n, seconds):
    algbw = bytes_per_rank / seconds / 1e9
    return round(algbw, 3), round(algbw * (n - 1) / n, 3)


def _entries(args, n):
    """One entry per (size, split): the count matrix and byte counts."""
    row_bytes = 4 * args.width
    out = []
    for size in args.sizes:
        rows = max(n, int(size * 2**20) // row_bytes)
        for split in SPLITS:
            c = count_matrix(n, rows, split)
            sent = sum(c[0]) * row_bytes
            out.append({
                "size_mib": size, "split": split, "counts_matrix": c,
                "bytes_per_rank": sent,
                "bytes_off_rank_per_rank": sent - c[0][0] * row_bytes,
            })
    return out


def _local_rank(rank):
    v = os.environ.get("SOK_LOCAL_RANK", "")
    return int(v) if v.strip().isdigit() else rank


def _budgets(gpus, local, n):
    """(GPU bytes, host bytes) this rank may use; GPU is 0 without one."""
    host = _common.mem_available_bytes() // n
    if not gpus:
        return 0, host
    g = len(gpus)
    mine = local % g
    sharing = sum(1 for lr in range(n) if lr % g == mine)
    return gpus[mine]["memory_free_mib"] * 2**20 // sharing, host


def _median(xs):
    return statistics.median(xs) if xs else None


# -- torch half (its own process per rank; no TensorFlow there) -----------


def _torch_worker(cfg_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    import datetime

    import torch
    import torch.distributed as dist

    r, n, local = cfg["rank"], cfg["num_ranks"], cfg["local_rank"]
    want = cfg["backend"]
    cuda = torch.cuda.is_available()
    g = torch.cuda.device_count() if cuda else 0
    if want == "nccl" or (want == "auto" and cuda and g >= n):
        if g < n:
            raise SystemExit(
                f"bench/alltoall.py: --torch nccl needs one GPU per rank: "
                f"{n} ranks, {g} GPU(s) visible to torch")
        backend, dev = "nccl", torch.device("cuda", local % g)
        torch.cuda.set_device(dev)
        why = "every rank has its own GPU"
        budget = cfg["gpu_budget"]
    else:
        backend, dev = "gloo", torch.device("cpu")
        if want == "gloo":
            why = "--torch gloo"
        elif not cuda:
            why = "torch sees no CUDA GPU"
        else:
            why = (f"{n} ranks share {g} GPU(s) and NCCL needs one GPU per "
                   "rank: gloo on CPU tensors (host memory, loopback TCP), "
                   "not comparable with sok's exchange on the GPU")
        budget = cfg["host_budget"]
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=r,
        world_size=n, timeout=datetime.timedelta(seconds=cfg["timeout"]))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def barrier():
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        sync()

    width, row_bytes = cfg["width"], 4 * cfg["width"]
    out = {"backend": backend, "device": str(dev), "why": why,
           "version": torch.__version__, "entries": []}
    if backend == "nccl":
        v = torch.cuda.nccl.version()
        out["nccl_version"] = (".".join(str(x) for x in v)
                               if isinstance(v, (tuple, list)) else str(v))
    medians, errors = [], []
    for e in cfg["entries"]:
        c = e["counts_matrix"]
        need = torch_bytes_needed(c, row_bytes)
        rec = {"bytes_needed_per_rank": need}
        if need > BUDGET_FRACTION * budget:
            rec.update(status="skipped", reason=(
                f"needs ~{_gib(need)} GiB per rank; the budget is "
                f"{_gib(budget)} GiB x {BUDGET_FRACTION}"))
            out["entries"].append(rec)
            medians.append(0.0)
            errors.append(0.0)
            continue
        send = list(c[r])
        recv = [c[i][r] for i in range(n)]
        codes = torch.repeat_interleave(
            torch.tensor([float(r * n + j) for j in range(n)]),
            torch.tensor(send))
        inp = codes.to(dev)[:, None].expand(-1, width).contiguous()
        outb = torch.empty(sum(recv), width, device=dev)

        def op(dst, src):
            dist.all_to_all_single(dst, src, output_split_sizes=recv,
                                   input_split_sizes=send)

        op(outb, inp)
        sync()
        want_codes = torch.repeat_interleave(
            torch.tensor([float(i * n + r) for i in range(n)]),
            torch.tensor(recv)).to(dev)
        err = max(float((outb[:, 0] - want_codes).abs().max()),
                  float((outb[:, -1] - want_codes).abs().max()))
        samples = []
        for k in range(cfg["warmup"] + cfg["rounds"]):
            barrier()
            t0 = time.perf_counter()
            for _ in range(cfg["iters"]):
                op(outb, inp)
            sync()
            if k >= cfg["warmup"]:
                samples.append((time.perf_counter() - t0) / cfg["iters"])
        rec.update(status="ok", my_median_ms=round(1e3 * _median(samples), 4),
                   rounds_ms=[round(1e3 * s, 4) for s in samples])
        out["entries"].append(rec)
        medians.append(_median(samples))
        errors.append(err)
        del inp, outb, codes, want_codes
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    both = torch.tensor(medians + errors, dtype=torch.float64, device=dev)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    gathered = [torch.zeros_like(both) for _ in range(n)]
    mine = torch.tensor(medians + errors, dtype=torch.float64, device=dev)
    dist.all_gather(gathered, mine)
    k = len(medians)
    per_rank = [g_.cpu().tolist()[:k] for g_ in gathered]
    both = both.cpu().tolist()
    for i, rec in enumerate(out["entries"]):
        if rec["status"] == "ok":
            rec["time_ms"] = round(1e3 * both[i], 4)
            rec["time_ms_per_rank"] = [round(1e3 * p[i], 4) for p in per_rank]
            rec["check_max_abs_error"] = both[k + i]
    dist.destroy_process_group()
    _common.write_json(cfg["out"], out)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_available(python):
    if python == sys.executable:
        return importlib.util.find_spec("torch") is not None
    try:
        return subprocess.run([python, "-c", "import torch"],
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _torch_phase(args, ctl, r, n, local, entries, gpu_budget, host_budget):
    """Runs the torch half on every rank; returns its record (rank 0's)."""
    python = args.torch_python or sys.executable
    if args.torch == "none":
        return {"status": "skipped", "reason": "--torch none"}
    have = _torch_available(python)
    count = ctl.agree(f"{KEY}/torch_ok", int(have), timeout=300)
    if count < n:
        return {"status": "skipped", "reason": (
            f"torch is not installed for {python} (importable on {count} "
            f"of {n} ranks)")}
    port = ctl.agree(f"{KEY}/torch_port", _free_port() if r == 0 else 0,
                     timeout=300)
    with tempfile.TemporaryDirectory(prefix="sok_a2a_torch_") as tmp:
        cfg = {"rank": r, "num_ranks": n, "local_rank": local, "port": port,
               "backend": args.torch, "width": args.width,
               "iters": args.iters, "warmup": args.warmup,
               "rounds": args.rounds, "timeout": args.torch_timeout,
               "gpu_budget": gpu_budget, "host_budget": host_budget,
               "entries": [{"counts_matrix": e["counts_matrix"]}
                           for e in entries],
               "out": os.path.join(tmp, "torch.json")}
        cfg_path = os.path.join(tmp, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        cmd = [python, os.path.abspath(__file__), "--torch-worker", cfg_path]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=args.torch_timeout + 60)
            code, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            code = "timeout"
            tail = ((e.stdout or b"") + (e.stderr or b""))[-3000:]
            tail = tail.decode("utf-8", "replace") if isinstance(
                tail, bytes) else tail
        ok = ctl.agree(f"{KEY}/torch_done", int(code == 0), timeout=
                       args.torch_timeout + 120)
        if code != 0:
            return {"status": "failed", "reason": (
                f"torch process of rank {r} exited with {code}"),
                "output_tail": tail}
        if ok < n:
            return {"status": "failed", "reason": (
                f"the torch process failed on {n - ok} of {n} ranks")}
        with open(cfg["out"]) as f:
            res = json.load(f)
    res["status"] = "ok"
    res["python"] = python
    return res


# -- sok half --------------------------------------------------------------


def _sok_phase(args, comm, r, n, device, backend, entries, budget):
    import numpy as np
    import tensorflow as tf

    width, row_bytes = args.width, 4 * args.width

    @tf.function
    def barrier_fn():
        return comm.all_reduce(tf.ones([1]), key=f"{KEY}/barrier")

    spec = [tf.TensorSpec([None, width], tf.float32),
            tf.TensorSpec([n, n], tf.int64)]

    @tf.function(input_signature=spec)
    def chain(x, c):
        y = x
        for i in range(args.iters):
            y = comm.exchange(y, c, key=f"{KEY}/chain{i}")
        return y[0, 0]

    @tf.function(input_signature=spec + [tf.TensorSpec([None], tf.float32)])
    def check(x, c, want):
        y = comm.exchange(x, c, key=f"{KEY}/check")
        return tf.maximum(tf.reduce_max(tf.abs(y[:, 0] - want)),
                          tf.reduce_max(tf.abs(y[:, -1] - want)))

    records, medians, errors = [], [], []
    for e in entries:
        c = e["counts_matrix"]
        need = sok_bytes_needed(c, row_bytes, backend)
        rec = {"bytes_needed_per_rank": need}
        if need > BUDGET_FRACTION * budget:
            rec.update(status="skipped", reason=(
                f"needs ~{_gib(need)} GiB per rank; the budget is "
                f"{_gib(budget)} GiB x {BUDGET_FRACTION}"))
            records.append(rec)
            medians.append(0.0)
            errors.append(0.0)
            continue
        send = np.array(c[r], np.int64)
        recv = np.array([c[i][r] for i in range(n)], np.int64)
        with tf.device(device):
            codes = tf.repeat(tf.constant([float(r * n + j) for j in range(n)],
                                          tf.float32), send)
            x = tf.tile(codes[:, None], [1, width])
            want = tf.repeat(tf.constant([float(i * n + r) for i in range(n)],
                                         tf.float32), recv)
            cm = tf.constant(c, tf.int64)
        err = float(check(x, cm, want).numpy())
        del want, codes
        samples = []
        for k in range(args.warmup + args.rounds):
            barrier_fn().numpy()
            t0 = time.perf_counter()
            chain(x, cm).numpy()
            if k >= args.warmup:
                samples.append((time.perf_counter() - t0) / args.iters)
        del x
        rec.update(status="ok", my_median_ms=round(1e3 * _median(samples), 4),
                   rounds_ms=[round(1e3 * s, 4) for s in samples])
        records.append(rec)
        medians.append(_median(samples))
        errors.append(err)
    return records, medians, errors


def _worker(args):
    t_start = time.perf_counter()
    # Several ranks may share a GPU: TensorFlow must not take it all.
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    gpus = _common.visible_gpus()  # before TensorFlow starts
    info = _common.machine_info()
    info["gpus"] = gpus

    import sok_keras as sok

    w = sok.init(backend=args.backend)
    import numpy as np
    import tensorflow as tf

    from sok_keras import world as sok_world

    r, n = sok.rank(), sok.num_ranks()
    if n < 2:
        raise SystemExit(
            "bench/alltoall.py: an all-to-all needs at least 2 ranks; run it "
            "as `python -m sokrun -np N python bench/alltoall.py ...` with "
            f"N >= 2 (got N = {n}).")
    local = _local_rank(r)
    ctl = sok_world.control_communicator()
    comm = sok_world.communicator()
    gpu_b, host_b = _budgets(gpus, local, n)
    allb = ctl.all_gather(tf.constant([[gpu_b, host_b]], tf.int64),
                          f"{KEY}/budgets").numpy()
    gpu_budget, host_budget = int(allb[:, 0].min()), int(allb[:, 1].min())
    on_gpu = w.gpu is not None
    sok_budget = gpu_budget if on_gpu else host_budget
    device = "/GPU:0" if on_gpu else "/CPU:0"
    entries = _entries(args, n)

    t0 = time.perf_counter()
    torch_rec = _torch_phase(args, ctl, r, n, local, entries, gpu_budget,
                             host_budget)
    torch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sok_recs, medians, errors = _sok_phase(
        args, comm, r, n, device, w.backend, entries, sok_budget)
    sok_s = time.perf_counter() - t0
    k = len(medians)
    allm = ctl.all_gather(
        tf.constant([medians + errors], tf.float64), f"{KEY}/medians").numpy()
    if r != 0:
        return
    torch_entries = torch_rec.pop("entries", None)
    results = []
    for i, e in enumerate(entries):
        s = sok_recs[i]
        if s["status"] == "ok":
            s["time_ms_per_rank"] = [round(1e3 * v, 4) for v in allm[:, i]]
            s["time_ms"] = round(1e3 * float(allm[:, i].max()), 4)
            s["check_max_abs_error"] = float(allm[:, k + i].max())
            s["algbw_GBps"], s["busbw_GBps"] = _bandwidth(
                e["bytes_per_rank"], n, float(allm[:, i].max()))
        if torch_entries is None:
            t = {"status": torch_rec["status"],
                 "reason": torch_rec.get("reason")}
        else:
            t = torch_entries[i]
            if t["status"] == "ok":
                t["algbw_GBps"], t["busbw_GBps"] = _bandwidth(
                    e["bytes_per_rank"], n, t["time_ms"] / 1e3)
        ratio = None
        if s["status"] == "ok" and t["status"] == "ok" and t["busbw_GBps"]:
            ratio = round(s["busbw_GBps"] / t["busbw_GBps"], 3)
        results.append({**e, "sok": s, "torch": t,
                        "sok_over_torch_busbw": ratio})
    for res in results:
        for side in ("sok", "torch"):
            err = res[side].get("check_max_abs_error")
            if err is not None and err != 0.0:
                raise SystemExit(
                    f"bench/alltoall.py: {side}'s all-to-all of "
                    f"{res['size_mib']} MiB ({res['split']}) delivered wrong "
                    f"rows (max abs error {err})")
    result = {
        "benchmark": "alltoall",
        "label": args.label,
        "setup": _setup(on_gpu, w.backend, torch_rec, gpus, n),
        "command": _common.sokrun_command(n),
        "machine": info,
        "env": _common.relevant_env(),
        "versions": {"tensorflow": tf.__version__,
                     "keras": __import__("keras").__version__,
                     "numpy": np.__version__,
                     "torch": torch_rec.get("version")},
        "config": {
            "num_ranks": n, "sizes_mib": args.sizes, "splits": list(SPLITS),
            "zipf_exponent": ZIPF_EXPONENT, "dtype": "float32",
            "width": args.width, "row_bytes": 4 * args.width,
            "iters": args.iters, "warmup": args.warmup,
            "rounds": args.rounds,
            "budget_bytes_per_rank": {"gpu": gpu_budget, "host": host_budget,
                                      "fraction_used": BUDGET_FRACTION},
            "time": "max over ranks of each rank's median over rounds of "
                    "(round time / iters)",
            "busbw": "algbw * (N - 1) / N, algbw = bytes_per_rank / time "
                     "(GB/s = 1e9 B/s, nccl-tests' alltoall)",
        },
        "sok": {"backend": w.backend, "device": device,
                "phase_s": round(sok_s, 1)},
        "torch": {**torch_rec, "phase_s": round(torch_s, 1)},
        "results": results,
        "target": _target(results, w.backend, torch_rec),
    }
    _common.finish(args.out, result, t_start)
    _print_table(result)


def _setup(on_gpu, backend, torch_rec, gpus, n):
    if not on_gpu:
        return "CPU only: a dry run of the scripts, not a result"
    if n > len(gpus):
        return (f"{n} ranks sharing {len(gpus)} GPU(s): a dry run, not a "
                "result")
    if backend == "nccl" and torch_rec.get("backend") == "nccl":
        return f"{n} GPUs, one per rank, NCCL on both sides"
    return f"{n} GPUs, one per rank; sok backend {backend}"


def _target(results, backend, torch_rec):
    """Whether P5b's target holds in this run (None: not measurable)."""
    t = dict(TARGET)
    t["rule"] = (f"sok busbw >= {TARGET['min_busbw_ratio']} x torch busbw "
                 f"at every size >= {TARGET['from_size_mib']} MiB, both "
                 "splits, NCCL on both sides, one GPU per rank")
    if backend != "nccl" or torch_rec.get("backend") != "nccl":
        t["met"] = None
        t["why"] = (f"not measurable here: sok backend {backend}, torch "
                    f"{torch_rec.get('backend') or torch_rec['status']}")
        return t
    rows = [x for x in results if x["size_mib"] >= TARGET["from_size_mib"]]
    ratios = [x["sok_over_torch_busbw"] for x in rows]
    if not rows or any(v is None for v in ratios):
        t["met"] = None
        t["why"] = "some sizes >= the threshold were skipped or not run"
        return t
    t["worst_ratio"] = min(ratios)
    t["met"] = min(ratios) >= TARGET["min_busbw_ratio"]
    return t


def _print_table(result):
    print(f"{result['setup']}; sok backend {result['sok']['backend']}, "
          f"torch {result['torch'].get('backend', result['torch']['status'])}")
    print(f"{'MiB':>8} {'split':>6} {'sok ms':>9} {'sok busbw':>10} "
          f"{'torch ms':>9} {'torch busbw':>11} {'ratio':>6}")
    for x in result["results"]:
        s, t = x["sok"], x["torch"]
        print(f"{x['size_mib']:>8g} {x['split']:>6} "
              f"{s.get('time_ms', '-'):>9} {s.get('busbw_GBps', '-'):>10} "
              f"{t.get('time_ms', '-'):>9} {t.get('busbw_GBps', '-'):>11} "
              f"{x['sok_over_torch_busbw'] or '-':>6}")
    print("target:", json.dumps(result["target"]))


def _sizes(text):
    try:
        sizes = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(not s > 0 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"--sizes-mib must be positive numbers separated by commas, got "
            f"{text!r}")
    return [int(s) if s == int(s) else s for s in sizes]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="the JSON record rank 0 writes")
    p.add_argument("--sizes-mib", dest="sizes", type=_sizes,
                   default=_sizes(DEFAULT_SIZES_MIB),
                   help="per-rank message sizes in MiB (default "
                        f"{DEFAULT_SIZES_MIB})")
    p.add_argument("--backend", default="auto",
                   choices=["auto", "nccl", "collective"],
                   help="sok_keras.init(backend=...)")
    p.add_argument("--torch", default="auto",
                   choices=["auto", "nccl", "gloo", "none"],
                   help="torch.distributed backend (auto: NCCL when every "
                        "rank has its own GPU, gloo on CPU otherwise)")
    p.add_argument("--torch-python", default=None,
                   help="the Python that runs the torch half (default: "
                        "this one)")
    p.add_argument("--torch-timeout", type=float, default=600)
    p.add_argument("--width", type=int, default=128,
                   help="float32 values per row (default 128: 512-byte rows)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--label", default="",
                   help="free text stored in the record (e.g. 'CPU dry run')")
    p.add_argument("--torch-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_worker:
        return _torch_worker(args.torch_worker)
    if not args.out:
        p.error("--out FILE.json is required")
    for name in ("width", "iters", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return _worker(args)


if __name__ == "__main__":
    main()
