"""The world: this process's rank, the number of ranks, and their runtime.

One process per device (or per CPU worker) is sok_keras's model. Call
`sok_keras.init()` once, at the very start of the program, before
TensorFlow runs any operation:

```python
import sok_keras as sok

sok.init()
print(sok.rank(), sok.num_ranks())
```

`init` reads the world from the environment, in this order:

1. `SOK_RANK`, `SOK_NUM_RANKS`, `SOK_WORKER_ADDRS` (set by `sokrun`);
2. `HOROVOD_RANK`, `HOROVOD_SIZE` (`horovodrun` with Gloo);
3. `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` (Open MPI's `mpirun`);
4. `PMI_RANK`, `PMI_SIZE` (MPICH / Intel MPI);
5. `RANK`, `WORLD_SIZE` with `MASTER_ADDR`, `MASTER_PORT` (torchrun style);
6. `SLURM_PROCID`, `SLURM_NTASKS` (`srun`; last, as Slurm's variables
   reach the processes of any launcher `srun` started);
7. `TF_CONFIG` (MultiWorkerMirroredStrategy's): rank = the worker's task
   index, addresses = its cluster's workers.

If the program imported and initialized `horovod.tensorflow`, its rank and
size must agree with these. If the program built its own
`tf.distribute.MultiWorkerMirroredStrategy` before `init` (SOK's recipe:
`sok.Init` inside `strategy.scope()`), `init` reuses that strategy's
collective runtime instead of starting one, after checking that its
replicas are the world's ranks (one device per worker).

Worker addresses come from `SOK_WORKER_ADDRS` (comma-separated `host:port`,
rank order) when it is set; otherwise rank i listens on
`MASTER_ADDR:(MASTER_PORT + 1 + i)` (`MASTER_ADDR` defaults to 127.0.0.1).
That derivation only works when every rank runs on one host: for multi-host
runs set `SOK_WORKER_ADDRS`. Without any of these variables the process is a
world of one: no collective runtime is started and every communication is
local.

With more than one rank, `init` starts TensorFlow's collective runtime
(gRPC, one CPU worker per rank) by constructing a
`tf.distribute.MultiWorkerMirroredStrategy` from the equivalent of
`TF_CONFIG = {"cluster": {"worker": addrs}, "task": {"type": "worker",
"index": rank}}` (the strategy's scope is never entered, Keras' default
strategy is untouched), and creates the process's communicator
(`sok_keras.comm.CollectiveCommunicator`).

GPUs and the backend. When a process sees several GPUs, `init` keeps only
the one of its local rank (`SOK_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`,
`SLURM_LOCALID`, `LOCAL_RANK`; modulo the number of GPUs), so that each
rank has its own device. `init(backend=...)` (or `SOK_BACKEND`) chooses how
ranks communicate: `"collective"` is TensorFlow's collective ops over gRPC
(CPU or GPU tensors); `"nccl"` is the op library's NCCL communicator
(`sok_keras.comm_nccl`), one GPU per rank; `"auto"` (the default) takes
NCCL when the library has CUDA kernels, NCCL loads, and no two ranks share
a GPU, and the collective backend otherwise (several ranks on one GPU, which
NCCL refuses, or CPU-only processes).

Security. TensorFlow's collective runtime is an unauthenticated gRPC
server that would listen on every interface. sok_keras keeps it on the
rank's own address: `sokrun` starts ranks with the bind guard preloaded
(`SOK_BIND_HOST=127.0.0.1`), and `init` re-executes a rank started by
another launcher under it, bound to the host of its `SOK_WORKER_ADDRS` or
`MASTER_ADDR` entry (give `0.0.0.0`, or set `SOK_BIND_GUARD=0`, to listen
on every interface). Multi-host jobs still belong on a private network:
anyone who can reach a rank's address can run TensorFlow ops there. Rank 0
also listens on a random port of its own address for the ranks' progress
and failure reports (`sok_keras.divergence`); a peer must present a random
token published through TensorFlow's coordination service.

Other environment variables:

- `SOK_COMM_TIMEOUT`: seconds a collective may wait for its peers before the
  watchdog turns it into an error (default 300; `init(timeout=...)` wins).
  A peer that fails, exits or runs out of data is reported within seconds
  by `sok_keras.divergence`; the timeout is for a peer alive but stalled.
  300 s is four times the longest wait a healthy job has (rank 0 writing a
  checkpoint of 10M x 128 float32 rows with Adam's slots, ~15 GB, while
  the others wait: ~80 s at 200 MB/s) and hundreds of times a training
  step (0.3-1.5 s measured on CPU, milliseconds on a GPU); raise it for
  larger checkpoints.
- `SOK_HEARTBEAT_TIMEOUT`: seconds without a heartbeat after which the
  coordination service declares a peer dead (default 10;
  `init(heartbeat_timeout=...)` wins).
"""

import contextlib
import logging
import numbers
import os
import signal
import threading

_LOCK = threading.Lock()
_WORLD = None  # the World once init() ran

_DEFAULT_TIMEOUT = 300.0  # see SOK_COMM_TIMEOUT in the module docstring
_DEFAULT_HEARTBEAT = 10.0

_BACKENDS = ("auto", "nccl", "collective")
_LOCAL_RANK_VARS = ("SOK_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "HOROVOD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID",
                    "LOCAL_RANK")

_SOURCES = (
    ("sokrun", "SOK_RANK", "SOK_NUM_RANKS"),
    ("horovodrun (Gloo)", "HOROVOD_RANK", "HOROVOD_SIZE"),
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI (MPICH / Intel MPI)", "PMI_RANK", "PMI_SIZE"),
    ("torchrun-style RANK/WORLD_SIZE", "RANK", "WORLD_SIZE"),
    # Last: Slurm's variables reach every process of the allocation, also
    # those of a launcher that `srun` started (torchrun, accelerate), whose
    # own pair describes them. (Review: Slurm's pair came first, and every
    # process of `srun --ntasks-per-node=1 torchrun ...` took a node's rank.)
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"),
)


class World:
    """The process's place in the job.

    Attributes:
        rank: this process's rank, `0 <= rank < num_ranks`.
        num_ranks: the number of processes in the job.
        worker_addrs: the `host:port` of every rank (rank order); empty for a
            world of one.
        source: which launcher's variables described the world (`"none"` for
            a world of one without any).
        timeout: seconds a collective may wait before the watchdog aborts it.
        heartbeat_timeout: the coordination service's heartbeat timeout.
        initialized: whether `init` set up the runtime for this world.
    """

    def __init__(
        self,
        rank,
        num_ranks,
        worker_addrs=(),
        source="none",
        timeout=_DEFAULT_TIMEOUT,
        heartbeat_timeout=_DEFAULT_HEARTBEAT,
    ):
        self.rank = rank
        self.num_ranks = num_ranks
        self.worker_addrs = list(worker_addrs)
        self.source = source
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.initialized = False
        self.strategy = None
        self.communicator = None
        self.backend = "local"
        self.collective = None  # the gRPC communicator, when N > 1
        self.host = None  # its CPU-pinned twin for agreements, when N > 1
        self.gpu = None  # the name of this rank's GPU, if any

    @property
    def tf_config(self):
        """The TF_CONFIG dict equivalent to this world (None for one rank)."""
        if self.num_ranks == 1:
            return None
        return {
            "cluster": {"worker": list(self.worker_addrs)},
            "task": {"type": "worker", "index": self.rank},
        }

    def __repr__(self):
        return (
            f"World(rank={self.rank}, num_ranks={self.num_ranks}, "
            f"source={self.source!r}, backend={self.backend!r}, "
            f"gpu={self.gpu!r}, initialized={self.initialized})"
        )


def _int_env(name, env):
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(
            f"sok_keras: environment variable {name} must be an integer, "
            f"got {value!r}."
        ) from None


def _float_env(name, default, env):
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        out = float(value)
    except ValueError:
        out = -1.0
    if not 0 < out <= MAX_SECONDS:
        raise RuntimeError(
            f"sok_keras: environment variable {name} must be a positive "
            f"number of seconds, at most {MAX_SECONDS:g} (a year), got "
            f"{value!r}."
        )
    return out


# The longest timeout taken (a year): longer ones, `inf` among them, would
# overflow the clocks and millisecond counts they become.
MAX_SECONDS = 365 * 86400.0


def world_from_env(env=None):
    """Describes the world from environment variables, without starting
    anything (TensorFlow is not imported).

    Args:
        env: a mapping to read instead of `os.environ`.

    Returns:
        A `World` (not initialized).

    Raises:
        RuntimeError: if the variables are inconsistent; the message names
            the variables and the values received.
    """
    env = os.environ if env is None else env
    for i, (source, rank_var, size_var) in enumerate(_SOURCES):
        if rank_var in env and size_var in env:
            # A launcher above the one whose pair is set: a rank > 0
            # without its number of ranks is an error too (`SOK_RANK=1`
            # beside torchrun's pair; QA). A number of ranks alone is not:
            # `salloc -n 4` exports SLURM_NTASKS to a shell that starts
            # torchrun (review).
            for above in _SOURCES[:i]:
                _check_no_rank_alone(env, *above)
            break
    else:
        _check_no_half_world(env)
        if env.get("TF_CONFIG"):
            return _world_from_tf_config(env["TF_CONFIG"])
        return World(0, 1)
    rank = _int_env(rank_var, env)
    size = _int_env(size_var, env)
    if size < 1 or not 0 <= rank < size:
        raise RuntimeError(
            f"sok_keras: inconsistent world from {source}: {rank_var}={rank}, "
            f"{size_var}={size} (need 0 <= rank < size)."
        )
    addrs = []
    if size > 1:
        if env.get("SOK_WORKER_ADDRS"):
            addrs = [a.strip() for a in env["SOK_WORKER_ADDRS"].split(",")]
            if len(addrs) != size or not all(":" in a for a in addrs):
                raise RuntimeError(
                    "sok_keras: SOK_WORKER_ADDRS must hold one host:port per "
                    f"rank ({size} from {size_var}), got "
                    f"{env['SOK_WORKER_ADDRS']!r}."
                )
            _check_worker_addrs(
                addrs, "SOK_WORKER_ADDRS",
                f"SOK_WORKER_ADDRS={env['SOK_WORKER_ADDRS']!r}")
        elif "MASTER_PORT" in env:
            host = env.get("MASTER_ADDR") or "127.0.0.1"
            if ":" in host or host.startswith("["):
                raise RuntimeError(
                    "sok_keras: MASTER_ADDR must be an IPv4 address or a "
                    "host name: IPv6 addresses are not supported (the "
                    "ranks' hub listens on IPv4). Received: MASTER_ADDR="
                    f"{host!r}.")
            port = _int_env("MASTER_PORT", env)
            if not 0 < port or port + size > 65535:
                raise RuntimeError(
                    f"sok_keras: MASTER_PORT={port}: the ranks listen on "
                    f"MASTER_PORT + 1 .. MASTER_PORT + {size}, which must be "
                    "ports (1..65535).")
            addrs = [f"{host}:{port + 1 + i}" for i in range(size)]
        else:
            raise RuntimeError(
                f"sok_keras: {source} describes {size} ranks ({rank_var}="
                f"{rank}, {size_var}={size}) but not where they listen: set "
                "SOK_WORKER_ADDRS to the comma-separated host:port of every "
                "rank, or MASTER_ADDR and MASTER_PORT (single host only), or "
                "launch with `sokrun -np N`."
            )
    return World(rank, size, addrs, source)


# (QA: an IPv6 MASTER_ADDR hung until the timeout, `[::1]` failed in the
# hub with a raw OSError.)
def _check_worker_addrs(addrs, what, received):
    """Refuses rank addresses (from `what`) TensorFlow would not listen on
    as given: a port outside 1..65535, an IPv6 host, one address for two
    ranks."""
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not (port.isascii() and port.isdigit()
                and 0 < int(port) <= 65535):
            raise RuntimeError(
                f"sok_keras: {what}: {a!r} has no port in 1..65535 "
                f"(TensorFlow would listen on another). Received: "
                f"{received}.")
        if not host or ":" in host or host.startswith("["):
            raise RuntimeError(
                f"sok_keras: {what}: {a!r} has no IPv4 host or host name: "
                "IPv6 addresses are not supported (the ranks' hub listens "
                f"on IPv4). Received: {received}.")
    twice = sorted({a for a in addrs if addrs.count(a) > 1})
    if twice:
        raise RuntimeError(
            f"sok_keras: {what} names {twice} for more than one rank: each "
            "rank listens on an address of its own. Received: "
            f"{received}.")


def _check_no_rank_alone(env, source, rank_var, size_var):
    """Refuses a rank (> 0) without the number of ranks (`RANK=1` without
    `WORLD_SIZE`): the process would train as a world of one."""
    if size_var in env:
        return
    try:
        rank = int(env.get(rank_var, ""))
    except ValueError:
        return
    if rank > 0:
        raise RuntimeError(
            f"sok_keras: {rank_var}={rank} is set ({source}) but {size_var} "
            "is not, so this process does not know how many ranks the job "
            f"has. Set {size_var} on every rank, or unset {rank_var} to run "
            "as one process.")


def _check_no_half_world(env):
    """Refuses half of a launcher's pair of variables where the half says
    there are other ranks: a number of ranks (> 1) without the rank
    (`WORLD_SIZE=4` without `RANK`), or a rank (> 0) without the number of
    ranks (`RANK=1` without `WORLD_SIZE`). Each process would otherwise train
    alone, as a world of one, and nothing would say so. A lone rank 0 is a
    world of one."""
    for source, rank_var, size_var in _SOURCES:
        for name in (rank_var, size_var):
            if (env.get(name, "").strip()
                    and (rank_var in env) != (size_var in env)):
                # A half that is no number says nothing either way: an
                # error, not a world of one (QA: `WORLD_SIZE=4x`).
                _int_env(name, env)
        try:
            size = int(env.get(size_var, ""))
        except ValueError:
            size = None
        if size is not None and size > 1 and rank_var not in env:
            raise RuntimeError(
                f"sok_keras: {size_var}={size} is set ({source}) but "
                f"{rank_var} is not, so this process does not know its "
                f"rank. Set {rank_var} on every rank (0..{size - 1}), or "
                f"unset {size_var} to run as one process.")
        _check_no_rank_alone(env, source, rank_var, size_var)


def _world_from_tf_config(text):
    """The world of a `TF_CONFIG` (MultiWorkerMirroredStrategy's variable):
    rank = the worker's task index, one rank per worker."""
    import json

    try:
        config = json.loads(text)
        workers = config["cluster"]["worker"]
        task = config.get("task", {})
        kind, index = task.get("type", "worker"), task.get("index", 0)
        # (QA: a string was split into one worker per character, and an
        # index of 1.9 taken as 1.)
        if not isinstance(workers, list) or not all(
                isinstance(w, str) for w in workers):
            raise TypeError("cluster.worker is no list of host:port strings")
        # (TensorFlow's resolver takes `int(index)`: "1" too.)
        if isinstance(index, str) and index.strip().isdigit():
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError("task.index is no integer")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise RuntimeError(
            "sok_keras: TF_CONFIG must be JSON with cluster.worker (a list "
            "of host:port) and task.type/index; got "
            f"{text!r} ({type(e).__name__}: {e}).") from None
    other = sorted(set(config["cluster"]) - {"worker"})
    if kind != "worker" or other:
        raise RuntimeError(
            "sok_keras: TF_CONFIG may only describe workers (one rank per "
            f"worker, MultiWorkerMirroredStrategy); got task type {kind!r} "
            f"and other jobs {other}.")
    if not 0 <= index < len(workers):
        raise RuntimeError(
            f"sok_keras: TF_CONFIG task index {index} is not a worker of "
            f"the cluster's {len(workers)}.")
    if len(workers) > 1:
        _check_worker_addrs(workers, "TF_CONFIG", f"TF_CONFIG={text!r}")
    return World(index, len(workers), workers if len(workers) > 1 else (),
                 "TF_CONFIG")


def _horovod_world():
    """(rank, size) of an initialized `horovod.tensorflow`, if the program
    imported it, else None."""
    import sys

    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None:
        return None
    try:
        if hasattr(hvd, "is_initialized") and not hvd.is_initialized():
            return None
        return int(hvd.rank()), int(hvd.size())
    except Exception:  # Horovod imported but not initialized
        return None


def _user_runtime():
    """The collective runtime the program started itself, if any.

    Returns `(strategy, configured)`: the `MultiWorkerMirroredStrategy`
    whose scope is entered (or None), and whether TensorFlow's collective
    runtime is already configured (a strategy built from TF_CONFIG).
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    strategy = None
    if tf.distribute.has_strategy():
        s = tf.distribute.get_strategy()
        if isinstance(s, tf.distribute.MultiWorkerMirroredStrategy):
            strategy = s
    configured = getattr(context.context(), "_collective_ops_server_def",
                         None) is not None
    return strategy, configured


def _adopt_user_runtime(world, strategy):
    """Uses the program's own MultiWorkerMirroredStrategy as the runtime
    (its ranks must be the world's)."""
    if strategy is None:
        return
    resolver = strategy.cluster_resolver
    task = getattr(resolver, "task_id", None)
    replicas = strategy.num_replicas_in_sync
    if replicas != world.num_ranks or (task is not None
                                       and int(task) != world.rank):
        raise RuntimeError(
            "sok_keras.init(): the MultiWorkerMirroredStrategy in scope has "
            f"{replicas} replicas and this worker's task index is {task}, "
            f"but sok_keras's world is rank {world.rank} of "
            f"{world.num_ranks} (from {world.source}). sok_keras runs one "
            "rank per worker: give each worker one device "
            "(CUDA_VISIBLE_DEVICES) and launch one process per rank.")
    world.strategy = strategy


def _check_tf_not_started():
    from tensorflow.python.eager import context

    if getattr(context.context(), "_initialized", False):
        raise RuntimeError(
            "sok_keras.init() must run before TensorFlow executes any "
            "operation, but TensorFlow's runtime is already initialized "
            "(some tensor was created or an op ran). TensorFlow's collective "
            "runtime can only be configured at program startup: call "
            "`sok_keras.init()` at the start of the program, right after the "
            "imports."
        )


_INIT_WATCH = """
import os, select, signal, sys
r, pid, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def stop(message):
    sys.stderr.write(message + "\\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
    os._exit(0)
def interrupted(signum, frame):
    stop(sys.argv[5].replace("SIGNAL", signal.Signals(signum).name))
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, interrupted)
if not select.select([r], [], [], timeout)[0]:
    stop(sys.argv[4])
"""


def _start_collectives_bounded(world):
    """`_start_collectives`, but a rank whose peers do not all join within
    `world.timeout` (SOK_COMM_TIMEOUT) is ended with a message naming the
    wait. TensorFlow's coordination service waits for every task for ever,
    in C++ and holding the interpreter (no Python thread or exception can
    interrupt it), and its preemption notifier swallows SIGTERM meanwhile:
    without this a rank whose peer never started (a launcher other than
    sokrun) would hang. The watch is a small process that kills this one
    (SIGKILL) unless this end of a pipe closes in time, or at once when
    the process group is sent SIGINT, SIGTERM or SIGHUP."""
    import subprocess
    import sys

    message = (
        f"sok_keras.init(): rank {world.rank} of {world.num_ranks}: not "
        f"every rank joined within {world.timeout:g} s (SOK_COMM_TIMEOUT or "
        "sok_keras.init(timeout=...)): a rank did not start, or the "
        f"addresses from {world.source} are wrong "
        f"({', '.join(world.worker_addrs)}). Stopping this rank.")
    # A signal to the process group (Ctrl-C in a terminal, `timeout`, a
    # job scheduler) reaches the watch too: it stops this rank, which
    # cannot act on the signal until TensorFlow returns.
    interrupted = (
        f"sok_keras.init(): rank {world.rank} of {world.num_ranks}: SIGNAL "
        "while waiting for every rank to join (TensorFlow's coordination "
        "service holds this rank until then). Stopping this rank.")
    r, w = os.pipe()
    try:
        watch = subprocess.Popen(
            [sys.executable, "-S", "-c", _INIT_WATCH, str(r), str(os.getpid()),
             str(world.timeout), message, interrupted], pass_fds=(r,),
            stdin=subprocess.DEVNULL)
    finally:
        os.close(r)
    try:
        _start_collectives(world)
    finally:
        os.close(w)  # the watch sees end-of-file and exits
        watch.wait()


def _start_collectives(world):
    import tensorflow as tf
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2,
    )
    from tensorflow.python.eager import context

    spec = tf.train.ClusterSpec(world.tf_config["cluster"])
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=world.rank, rpc_layer="grpc"
    )
    # Configure the coordination service ourselves (the strategy keeps a
    # configuration it finds) to choose how fast a dead peer is detected.
    ctx = context.context()
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader="/job:worker/replica:0/task:0",
        heartbeat_timeout_in_ms=int(world.heartbeat_timeout * 1000),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(
                name="worker", num_tasks=world.num_ranks
            )
        ],
    )
    experimental = tf.distribute.experimental
    options = experimental.CommunicationOptions(
        implementation=experimental.CommunicationImplementation.RING
    )
    try:
        world.strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options
        )
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" not in str(e):
            raise
        # (TensorFlow names the port only in a C++ log line.)
        raise RuntimeError(
            f"sok_keras.init(): rank {world.rank} of {world.num_ranks} could "
            "not listen on its address "
            f"{world.worker_addrs[world.rank]} (from {world.source}): "
            f"{_why_not_listening(world.worker_addrs[world.rank])}. "
            f"TensorFlow: {str(e).splitlines()[0]}") from e


def _host_of(addr):
    """The host of a rank's address "host:port" ("[v6]:port" too)."""
    return addr.rsplit(":", 1)[0].strip("[]")


def _why_not_listening(addr):
    """Why `addr` ("host:port") cannot be listened on, in words: not an
    address of this host, or the port in use."""
    import errno
    import socket

    host = _host_of(addr)
    if host not in _WILDCARDS:
        try:
            info = socket.getaddrinfo(host, None)[0]
            with socket.socket(info[0], socket.SOCK_STREAM) as s:
                s.bind((info[4][0], 0))  # any port: is the address ours?
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return (f"{host} is not an address of this host (each "
                        "rank listens on its own address: MASTER_ADDR is "
                        "rank 0's host, reachable by the others; check "
                        "your launcher's addresses)")
    return ("the port is in use, by another job or a program still "
            "running; choose another (MASTER_PORT, or your launcher's "
            "addresses) or stop that program")


_WILDCARDS = ("", "0.0.0.0", "::", "*")
# Set in a rank that `_guard_servers` re-executed under the bind guard (a
# guard that still does not load is then an error, not another exec).
_GUARD_EXEC = "SOK_BIND_GUARD_EXEC"


def _guard_servers(world):
    """Makes this rank's TensorFlow servers listen on its own address only.

    TensorFlow's gRPC server binds the wildcard address whatever TF_CONFIG
    says, and serves anyone who connects. Unless the process already runs
    under sok_keras's bind guard (sokrun starts ranks under it), or
    `SOK_BIND_GUARD=0`, or the rank's address is itself a wildcard, this
    re-executes the program (same interpreter, same arguments) with the
    guard preloaded: nothing has run in TensorFlow yet, so nothing is lost.
    """
    import socket
    import sys

    if _bind_guard_off():
        return
    # An address given in SOK_BIND_HOST is honoured whoever set it: before,
    # the variable alone was taken for "the guard is loaded" (as under
    # sokrun), and a rank started by hand with it listened on every
    # interface (QA).
    ip = _bind_host()
    if ip is not None:
        _check_bind_host(ip, world)
    if ip is not None and _bind_guard_loaded():
        os.environ.pop(_GUARD_EXEC, None)  # (not for this rank's children)
        return
    if os.environ.get(_GUARD_EXEC):
        raise RuntimeError(
            "sok_keras: the bind guard did not load in the re-executed "
            f"rank {world.rank} (LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '')!r}); set SOK_BIND_GUARD=0 "
            "to let TensorFlow's servers listen on every interface.")
    if ip is None:
        host = _host_of(world.worker_addrs[world.rank])
        if host in _WILDCARDS:
            return  # the user asked for every interface
        try:
            ip = socket.getaddrinfo(host, None)[0][4][0]
        except OSError as e:
            raise RuntimeError(
                f"sok_keras: cannot resolve rank {world.rank}'s address "
                f"{host!r} (from {world.source}): {e}") from None
    try:
        import sokrun
    except ImportError:
        return
    env = sokrun.bind_guard_env(ip)
    if not env:
        logging.getLogger("sok_keras").warning(
            "sok_keras: the bind guard is not built; TensorFlow's servers "
            "listen on every interface.")
        return
    os.environ.update(env)
    os.environ[_GUARD_EXEC] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable] + list(sys.orig_argv[1:]))


def _check_bind_host(ip, world):
    """`SOK_BIND_HOST` must be an address of the rank's own host (its
    `MASTER_ADDR` / `SOK_WORKER_ADDRS` entry), unless that entry is a
    wildcard: TensorFlow's server listens there, and the other ranks
    connect to the entry (review: 127.0.0.1, sokrun's value, exported in
    a multi-host job failed as "the port is in use", or hung until
    SOK_COMM_TIMEOUT)."""
    import ipaddress
    import socket

    host = _host_of(world.worker_addrs[world.rank])
    if host in _WILDCARDS:
        return
    try:
        mine = {ipaddress.ip_address(a[4][0].split("%")[0])
                for a in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return  # `_guard_servers` names an address that does not resolve
    if ipaddress.ip_address(ip) not in mine:
        raise RuntimeError(
            f"sok_keras: SOK_BIND_HOST={ip} is not rank {world.rank}'s "
            f"address {host!r} (from {world.source}), where the other ranks "
            "connect: unset it (the rank then listens on its own address), "
            "or set it to that address.")


def _confine_nccl():
    """Keeps NCCL's sockets on loopback when the ranks' servers are.

    NCCL's bootstrap (sok_keras' NCCL backend, and TensorFlow's own
    collectives on GPU tensors) listens on the first network interface it
    finds, whatever the job's addresses, and serves anyone who connects.
    When every rank listens on loopback (one host: sokrun, or
    MASTER_ADDR=127.0.0.1), NCCL is told to use loopback too
    (`NCCL_SOCKET_IFNAME=lo`), unless that variable is set already.
    """
    import ipaddress

    host = os.environ.get("SOK_BIND_HOST", "")
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return
    if loopback and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = "lo"


@contextlib.contextmanager
def _sigterm_kept():
    """Restores the SIGTERM handler that TensorFlow's multi-worker runtime
    replaces (its preemption handling swallows the signal, so a rank would
    survive a launcher's stop until SIGKILL)."""
    try:
        before = signal.getsignal(signal.SIGTERM)
    except ValueError:
        before = None
    try:
        yield
    finally:
        if before is not None and (
                threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, before)


def _local_rank(env):
    """This rank's local rank from the first launcher variable set, or None;
    a value that is no rank is an error (QA: `SOK_LOCAL_RANK=xyz` was
    passed over silently, and the next variable or none used)."""
    for name in _LOCAL_RANK_VARS:
        value = env.get(name, "").strip()
        if not value or value == "-1":
            # (`LOCAL_RANK=-1` means "not distributed" to some tools, e.g.
            # Hugging Face scripts: as unset. Review.)
            continue
        if not (value.isascii() and value.isdigit()):
            raise RuntimeError(
                f"sok_keras: environment variable {name} must be this "
                f"rank's local rank (0, 1, ...), got {env[name]!r}.")
        return int(value)
    return None


def _pin_gpu(world):
    """Keeps only this rank's GPU visible (before TensorFlow starts)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    local = _local_rank(os.environ)
    if len(gpus) > 1 and local is not None:
        mine = gpus[local % len(gpus)]
        try:
            tf.config.set_visible_devices([mine], "GPU")
        except RuntimeError:  # TensorFlow already started: leave it
            pass
    # (Physical devices only: listing logical ones would start TensorFlow's
    # runtime before the collectives are configured.)
    visible = tf.config.get_visible_devices("GPU")
    if visible:
        world.gpu = visible[0].name


def _gpu_fingerprint(world):
    """One int per rank: equal on two ranks that use the same GPU."""
    import socket
    import zlib

    import tensorflow as tf

    if world.gpu is None:
        return -1
    visible = [d.name for d in tf.config.get_visible_devices("GPU")]
    text = "|".join([socket.gethostname(),
                     os.environ.get("CUDA_VISIBLE_DEVICES", "<all>"),
                     ",".join(visible)])
    return zlib.crc32(text.encode())


def _nccl_unavailable(world, collective):
    """Why NCCL cannot serve this world, or None (collective: the gRPC
    communicator, to compare the ranks' GPUs)."""
    import tensorflow as tf

    from sok_keras import _ops

    if not _ops.build_info()["with_cuda"]:
        return "this sok_keras build has no CUDA kernels"
    fingerprint = _gpu_fingerprint(world)
    if collective is None:
        return None if fingerprint != -1 else "this process sees no GPU"
    agreer = world.host if world.host is not None else collective
    prints = agreer.all_gather(
        tf.constant([fingerprint], tf.int64), "init/gpus").numpy().tolist()
    if -1 in prints:
        return f"rank {prints.index(-1)} sees no GPU"
    if len(set(prints)) != len(prints):
        return ("several ranks share one GPU (NCCL needs one GPU per rank); "
                f"GPU fingerprints by rank: {prints}")
    return None


def _nccl_communicator(world, collective):
    import tensorflow as tf

    from sok_keras import comm_nccl

    uid = comm_nccl.NcclCommunicator.new_unique_id() if world.rank == 0 else (
        tf.zeros([128], tf.uint8))
    if world.host is not None:  # a host-side agreement (CPU)
        uid = world.host.broadcast(uid, "init/nccl_id")
    elif collective is not None:
        uid = collective.broadcast(uid, "init/nccl_id")
    return comm_nccl.NcclCommunicator(world.rank, world.num_ranks, uid,
                                      timeout=world.timeout)


def _choose_communicator(world, backend):
    from sok_keras import comm

    collective = None
    if world.num_ranks > 1:
        collective = comm.CollectiveCommunicator(
            world.rank, world.num_ranks, timeout=world.timeout)
    wants_nccl = backend == "nccl" or (backend == "auto"
                                       and world.num_ranks > 1)
    if wants_nccl:
        reason = _nccl_unavailable(world, collective)
        if reason is None:
            try:
                world.communicator = _nccl_communicator(world, collective)
                world.backend = "nccl"
                world.collective = collective
                return
            except Exception as e:  # NCCL missing or refused the GPUs
                if backend == "nccl":
                    raise
                reason = f"NCCL could not be initialized: {e}"
        if backend == "nccl":
            raise RuntimeError(
                f"sok_keras.init(backend='nccl'): {reason}. Use "
                "backend='auto' or 'collective'.")
        logging.getLogger("sok_keras").info(
            "sok_keras: using TensorFlow collectives, not NCCL: %s", reason)
    if collective is None:
        world.communicator = comm.LocalCommunicator()
        world.backend = "local"
    else:
        world.communicator = collective
        world.backend = "collective"
    world.collective = collective


def _start_host_communicator(world):
    """The CPU-pinned communicator of host-side agreements (N > 1)."""
    from sok_keras import comm

    if world.num_ranks > 1:
        world.host = comm.HostCollectiveCommunicator(
            world.rank, world.num_ranks, timeout=world.timeout)


def _check_later_variables(global_metrics):
    """Checks the variables read only later (at a save or load, at `fit`,
    at a rank's start) now, so that a bad value fails at the start of the
    job rather than hours into it."""
    from sok_keras import callbacks
    from sok_keras import global_views

    global_views.enter_timeout()  # SOK_SAVE_TIMEOUT
    if global_metrics is None:
        callbacks.global_metrics_enabled()  # SOK_GLOBAL_METRICS
    elif not isinstance(global_metrics, bool):
        callbacks.set_global_metrics(global_metrics)  # raises, naming it
    _bind_guard_off()  # SOK_BIND_GUARD
    _bind_host()  # SOK_BIND_HOST


def _bind_host():
    """`SOK_BIND_HOST` (an IPv4 or IPv6 address: the bind guard rewrites a
    wildcard bind to it), or None when unset; anything else is an error
    (QA: `SOK_BIND_HOST=notahost` was taken, and the guard, which reads
    only addresses, let the servers listen on every interface)."""
    import socket

    host = os.environ.get("SOK_BIND_HOST", "")
    if not host:
        return None
    try:
        # (inet_pton, as the guard reads it: no "%scope", which
        # `ipaddress` takes and the guard would pass over. Review.)
        socket.inet_pton(socket.AF_INET6 if ":" in host
                         else socket.AF_INET, host)
    except OSError:
        raise RuntimeError(
            "sok_keras: SOK_BIND_HOST must be the IPv4 or IPv6 address this "
            "rank's servers listen on (e.g. 127.0.0.1), not a host name. "
            f"Received: SOK_BIND_HOST={host!r}.") from None
    return host


def _bind_guard_loaded():
    """Whether the bind guard is loaded in this process (its library is
    mapped: `LD_PRELOAD` of it took effect)."""
    try:
        with open("/proc/self/maps") as f:
            return any("_sok_bind_guard" in line for line in f)
    except OSError:
        return False


def _bind_guard_off():
    """Whether `SOK_BIND_GUARD=0` asks servers to listen on every
    interface; any value but 0 or 1 is an error."""
    guard = os.environ.get("SOK_BIND_GUARD", "")
    if guard not in ("", "0", "1"):
        raise RuntimeError(
            "sok_keras: SOK_BIND_GUARD must be 1 (the default: servers "
            "listen on the rank's own address) or 0 (every interface). "
            f"Received: SOK_BIND_GUARD={guard!r}.")
    return guard == "0"


def init(timeout=None, heartbeat_timeout=None, backend=None,
         global_metrics=None, **kwargs):
    """Initializes sok_keras for this process (idempotent).

    Call it once at the start of the program, before TensorFlow runs any
    operation. Later calls return the same world (a new `timeout` is applied;
    a `backend` that would give another communicator, or another
    `heartbeat_timeout`, raises a `ValueError`).

    Args:
        timeout: seconds a collective may wait for its peers before it fails
            with an error naming the rank and the call site, instead of
            hanging. Defaults to `SOK_COMM_TIMEOUT` or 300.
        heartbeat_timeout: seconds after which the coordination service
            declares a silent peer dead (every rank then fails). Defaults to
            `SOK_HEARTBEAT_TIMEOUT` or 10. Only used by the first call.
        backend: `"auto"` (default, or `SOK_BACKEND`), `"nccl"` or
            `"collective"`: how ranks communicate (see the module
            docstring). Only used by the first call.
        global_metrics: with several ranks, `fit` and `evaluate` show and
            return global logs (`sok_keras.callbacks.GlobalMetrics`, first
            among the callbacks) so that every rank decides alike. False
            turns that off (rank-local logs); None (default) leaves it to
            `SOK_GLOBAL_METRICS` (default on).
        **kwargs: accepted for compatibility with SparseOperationKit's
            `sok.init`: `comm_tool` (`None`, `"tf"` or SOK's default
            `"horovod"`, all the same runtime: `hvd` calls go to
            `sok_keras.compat.horovod`) and `use_legacy_optimizer`
            (ignored). SOK's positional form, `init("horovod")` or
            `init("horovod", True)`, is taken as those two.

    Returns:
        The `World`.

    Raises:
        RuntimeError: if TensorFlow already executed operations in a
            multi-rank job, or the launcher's variables are inconsistent.

    Example:

    >>> import sok_keras as sok
    >>> world = sok.init()
    >>> sok.rank(), sok.num_ranks()
    (0, 1)
    """
    global _WORLD
    # SOK's positional form, `init(comm_tool, use_legacy_optimizer)`: a
    # comm_tool is never a timeout, nor a bool a heartbeat timeout.
    if timeout in ("horovod", "tf", "tensorflow"):
        kwargs.setdefault("comm_tool", timeout)
        timeout = None
        if isinstance(heartbeat_timeout, bool):
            heartbeat_timeout = None  # use_legacy_optimizer: ignored
    for name, value in kwargs.items():
        if name == "comm_tool":
            # SOK's default is "horovod": a ported script keeps it, and its
            # `hvd` calls go to `sok_keras.compat.horovod` (the same ranks,
            # through sok's own runtime; no Horovod is needed).
            if value not in (None, "tf", "tensorflow", "horovod"):
                raise ValueError(
                    "sok_keras communicates through TensorFlow collectives "
                    "(CPU) and NCCL (GPU); `comm_tool` may be 'horovod' "
                    "(SOK's default: use `import sok_keras.compat.horovod as "
                    "hvd`) or 'tf'. Received "
                    f"comm_tool={value!r}."
                )
        elif name != "use_legacy_optimizer":
            raise TypeError(
                f"sok_keras.init() got an unexpected keyword argument {name!r}"
            )
    for arg, value in (("timeout", timeout),
                       ("heartbeat_timeout", heartbeat_timeout)):
        if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)):
            raise TypeError(
                f"sok_keras.init(): `{arg}` must be a number of seconds. "
                f"Received: {arg}={value!r}.")
        if value is not None and not 0 < value <= MAX_SECONDS:
            raise ValueError(
                f"`{arg}` must be a positive number of seconds, at most "
                f"{MAX_SECONDS:g} (a year), got {value!r}")
    given = f"backend={backend!r}"
    explicit_backend = (backend is not None
                        or bool(os.environ.get("SOK_BACKEND")))
    if backend is None and os.environ.get("SOK_BACKEND"):
        backend = os.environ["SOK_BACKEND"]
        given = f"SOK_BACKEND={backend!r} (environment)"
    # (QA: "", 0 and False were taken as "auto".)
    backend = "auto" if backend is None else backend
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(
            f"`backend` must be one of {_BACKENDS}. Received: {given}.")
    _check_later_variables(global_metrics)
    with _LOCK:
        if _WORLD is not None:
            first = {"backend": getattr(_WORLD, "requested_backend", None),
                     "heartbeat_timeout": _WORLD.heartbeat_timeout}
            changed = {}
            # What `backend` gives this world: "collective" is "local" on
            # one rank (QA: `init()` then `init(backend="collective")`
            # passed on 2 ranks and raised on 1).
            gives = ("local" if backend == "collective"
                     and _WORLD.num_ranks == 1 else backend)
            if explicit_backend and backend not in (
                    "auto", first["backend"]) and gives != _WORLD.backend:
                changed["backend"] = backend
            if (heartbeat_timeout is not None
                    and float(heartbeat_timeout) != first[
                        "heartbeat_timeout"]):
                changed["heartbeat_timeout"] = heartbeat_timeout
            if changed:
                raise ValueError(
                    "sok_keras.init() was called before with "
                    + ", ".join(f"{k}={first[k]!r}" for k in changed)
                    + "; the world's communicator is made once, by the "
                    "first call (only `timeout` may change later). "
                    "Received: " + ", ".join(
                        f"{k}={v!r}" for k, v in changed.items()) + ".")
            _set_global_metrics(global_metrics)
            if timeout is not None:
                _WORLD.timeout = float(timeout)
                _WORLD.communicator.timeout = float(timeout)
                if _WORLD.host is not None:
                    _WORLD.host.timeout = float(timeout)
            return _WORLD
        world = world_from_env()
        world.timeout = (
            float(timeout)
            if timeout is not None
            else _float_env("SOK_COMM_TIMEOUT", _DEFAULT_TIMEOUT, os.environ)
        )
        world.heartbeat_timeout = (
            float(heartbeat_timeout)
            if heartbeat_timeout is not None
            else _float_env(
                "SOK_HEARTBEAT_TIMEOUT", _DEFAULT_HEARTBEAT, os.environ
            )
        )
        if world.heartbeat_timeout < 0.001:
            # TensorFlow counts whole milliseconds, and takes 0 for its
            # default (QA: 1e-4 s was accepted as 0 ms).
            raise ValueError(
                "sok_keras.init(): the heartbeat timeout must be at least "
                "0.001 s (TensorFlow counts whole milliseconds). Received: "
                + (f"heartbeat_timeout={heartbeat_timeout!r}."
                   if heartbeat_timeout is not None else
                   "SOK_HEARTBEAT_TIMEOUT="
                   f"{os.environ.get('SOK_HEARTBEAT_TIMEOUT')!r}."))
        _local_rank(os.environ)  # a bad value is an error here, GPU or not
        hvd = _horovod_world()
        if hvd is not None and hvd != (world.rank, world.num_ranks):
            if world.num_ranks == 1 and hvd[1] > 1:
                raise RuntimeError(
                    f"sok_keras.init(): Horovod says rank {hvd[0]} of "
                    f"{hvd[1]}, but no launcher variable tells sok_keras "
                    "where the ranks listen: set MASTER_ADDR and "
                    "MASTER_PORT (one host) or SOK_WORKER_ADDRS.")
            raise RuntimeError(
                f"sok_keras.init(): Horovod says rank {hvd[0]} of {hvd[1]} "
                f"but {world.source} says rank {world.rank} of "
                f"{world.num_ranks}.")
        strategy, configured = (None, False)
        if world.num_ranks > 1:
            strategy, configured = _user_runtime()
        if configured:
            # The program built its MultiWorkerMirroredStrategy first (the
            # SOK recipe): reuse its collective runtime.
            _adopt_user_runtime(world, strategy)
            _pin_gpu(world)
            from sok_keras.compat import keras_mwms

            keras_mwms.install()  # Keras' fit under MWMS (keras#20585)
        elif world.num_ranks > 1:
            _check_tf_not_started()
            _guard_servers(world)
            _confine_nccl()
            _pin_gpu(world)
            with _sigterm_kept():
                _start_collectives_bounded(world)
        else:
            _pin_gpu(world)
        _start_host_communicator(world)
        _choose_communicator(world, backend)
        world.requested_backend = backend
        if world.num_ranks > 1:
            from sok_keras import divergence
            from sok_keras import global_views
            from sok_keras import saving
            from sok_keras import tensorboard
            from sok_keras.optimizers import auto_wrap

            saving.install()
            tensorboard.install()  # one writer (rank 0), global histograms
            tensorboard.install_csv_logger()  # rank 0 writes the CSV file
            global_views.install_load_checks()  # loads on some ranks only
            # Fast failure when the ranks diverge, and the first-step
            # comparison of the tables (sok_keras.divergence, .consistency).
            divergence.start(world)
            auto_wrap.install_loop_hooks()
        _set_global_metrics(global_metrics)
        world.initialized = True
        _WORLD = world
        logging.getLogger("sok_keras").info("sok_keras initialized: %r", world)
        return world


def _set_global_metrics(enabled):
    # Once `init` succeeds (QA: a refused `init` had changed the setting).
    if enabled is not None:
        from sok_keras import callbacks

        callbacks.set_global_metrics(enabled)


def is_initialized():
    """Returns whether `init()` has run in this process."""
    return _WORLD is not None


def _current():
    return _WORLD if _WORLD is not None else world_from_env()


def rank():
    """Returns this process's rank (from the environment if `init()` has not
    run yet; this never starts TensorFlow)."""
    return _current().rank


def num_ranks():
    """Returns the number of ranks (from the environment if `init()` has not
    run yet; this never starts TensorFlow)."""
    return _current().num_ranks


def world():
    """Returns the `World` (a description from the environment, not
    initialized, if `init()` has not run)."""
    return _current()


def control_communicator():
    """The communicator for small host-side agreements (`agree`, the
    consistency checks): with several ranks a gRPC collective communicator
    pinned to the CPU in its own collective group (also under the NCCL
    backend; see `comm.HostCollectiveCommunicator`), the local one
    otherwise."""
    if _WORLD is not None and _WORLD.host is not None:
        return _WORLD.host
    return communicator()


def timeout():
    """Seconds a collective may wait for its peers (`SOK_COMM_TIMEOUT`)."""
    w = _current()
    return w.timeout


def communicator():
    """Returns the process's communicator.

    Returns:
        A `sok_keras.comm.Communicator`: `LocalCommunicator` in a world of
        one, `CollectiveCommunicator` otherwise.

    Raises:
        RuntimeError: in a multi-rank job before `init()`.
    """
    if _WORLD is not None:
        return _WORLD.communicator
    w = world_from_env()
    if w.num_ranks == 1:
        from sok_keras import comm

        return comm.LocalCommunicator()
    raise RuntimeError(
        f"sok_keras: this process is rank {w.rank} of {w.num_ranks} "
        f"(from {w.source}) but sok_keras.init() has not been called. Call "
        "`sok_keras.init()` at the start of the program."
    )
