"""The world: reading launchers' environment variables, init in a world of
one, and the error when TensorFlow already ran."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from sok_keras import comm
from sok_keras import world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (0, 1, [], "none")),
        # A lone rank 0 (no size) is a world of one, as before.
        ({"RANK": "0"}, (0, 1, [], "none")),
        (
            {"SOK_RANK": "1", "SOK_NUM_RANKS": "2",
             "SOK_WORKER_ADDRS": "h:1,h:2"},
            (1, 2, ["h:1", "h:2"], "sokrun"),
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
             "SOK_WORKER_ADDRS": "a:1,b:1,c:1", "RANK": "0",
             "WORLD_SIZE": "9"},
            (2, 3, ["a:1", "b:1", "c:1"], "mpirun (Open MPI)"),
        ),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "1"},
            (0, 1, [], "PMI (MPICH / Intel MPI)"),
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2",
             "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
            (1, 2, ["node0:29501", "node0:29502"], "Slurm"),
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "100"},
            (0, 2, ["127.0.0.1:101", "127.0.0.1:102"],
             "torchrun-style RANK/WORLD_SIZE"),
        ),
        # Review: torchrun (or accelerate) inside a Slurm allocation: its
        # pair describes its processes, Slurm's (or `salloc`'s lone
        # SLURM_NTASKS) does not.
        (
            {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "5",
             "WORLD_SIZE": "8", "MASTER_PORT": "100"},
            (5, 8, [f"127.0.0.1:{101 + i}" for i in range(8)],
             "torchrun-style RANK/WORLD_SIZE"),
        ),
        (
            {"SLURM_NTASKS": "4", "RANK": "1", "WORLD_SIZE": "2",
             "MASTER_PORT": "100"},
            (1, 2, ["127.0.0.1:101", "127.0.0.1:102"],
             "torchrun-style RANK/WORLD_SIZE"),
        ),
        # TensorFlow's resolver takes a task index given as a string.
        (
            {"TF_CONFIG": '{"cluster": {"worker": ["h:1", "g:1"]}, '
                          '"task": {"type": "worker", "index": "1"}}'},
            (1, 2, ["h:1", "g:1"], "TF_CONFIG"),
        ),
    ],
)
def test_world_from_env(env, want):
    w = world.world_from_env(env)
    assert (w.rank, w.num_ranks, w.worker_addrs, w.source) == want
    assert not w.initialized
    if w.num_ranks > 1:
        assert w.tf_config == {
            "cluster": {"worker": want[2]},
            "task": {"type": "worker", "index": want[0]},
        }


@pytest.mark.parametrize(
    "env, match",
    [
        ({"SOK_RANK": "x", "SOK_NUM_RANKS": "2"},
         "SOK_RANK must be an integer, got 'x'"),
        ({"SOK_RANK": "2", "SOK_NUM_RANKS": "2",
          "SOK_WORKER_ADDRS": "a:1,b:1"},
         "SOK_RANK=2, SOK_NUM_RANKS=2"),
        ({"SOK_RANK": "0", "SOK_NUM_RANKS": "2", "SOK_WORKER_ADDRS": "a:1"},
         "one host:port per rank .* got 'a:1'"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "set SOK_WORKER_ADDRS"),
        # Before: a world of one, each process training alone, silently.
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 is set .* but RANK is not"),
        ({"SOK_NUM_RANKS": "2", "RANK": "1"},
         "SOK_NUM_RANKS=2 is set .* but SOK_RANK is not"),
        # Before: rank 1 of a world of one, silently.
        ({"SOK_RANK": "1"}, "SOK_RANK=1 is set .* but SOK_NUM_RANKS is not"),
        ({"RANK": "3"}, "RANK=3 is set .* but WORLD_SIZE is not"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "65534"},
         "MASTER_PORT=65534: .* must be ports"),
        # Before: port 99999 listened on 34463, the same address for two
        # ranks waited.
        ({"SOK_RANK": "0", "SOK_NUM_RANKS": "2",
          "SOK_WORKER_ADDRS": "h:1,h:99999"},
         "'h:99999' has no port in 1..65535"),
        ({"SOK_RANK": "0", "SOK_NUM_RANKS": "2",
          "SOK_WORKER_ADDRS": "h:1,h:x"}, "'h:x' has no port"),
        ({"SOK_RANK": "0", "SOK_NUM_RANKS": "3",
          "SOK_WORKER_ADDRS": "h:1,g:1,h:1"},
         r"names \['h:1'\] for more than one rank"),
        # QA: a half pair that is no number was a world of one, silently;
        # so was a half pair above a launcher whose pair is set.
        ({"WORLD_SIZE": "4x"}, "WORLD_SIZE must be an integer, got '4x'"),
        ({"RANK": "abc"}, "RANK must be an integer, got 'abc'"),
        ({"SOK_RANK": "1", "RANK": "0", "WORLD_SIZE": "1"},
         "SOK_RANK=1 is set .* but SOK_NUM_RANKS is not"),
        ({"SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 is set .* but SLURM_PROCID "
         "is not"),
        # QA: TF_CONFIG's workers as a string (one per character), an
        # index that is no integer, one address twice (rank 1 waited the
        # whole timeout), an IPv6 host (hung, or a raw OSError).
        ({"TF_CONFIG": '{"cluster": {"worker": "10.0.0.1:2222"}}'},
         "cluster.worker is no list"),
        ({"TF_CONFIG": '{"cluster": {"worker": ["h:1", "g:1"]}, '
                       '"task": {"index": 1.9}}'}, "task.index is no integer"),
        ({"TF_CONFIG": '{"cluster": {"worker": ["h:1", "h:1"]}}'},
         r"TF_CONFIG names \['h:1'\] for more than one rank"),
        ({"TF_CONFIG": '{"cluster": {"worker": ["h:1", "g"]}}'},
         "TF_CONFIG: 'g' has no port"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "2000",
          "MASTER_ADDR": "::1"}, "MASTER_ADDR must be an IPv4 address .*"
         "Received: MASTER_ADDR='::1'"),
        ({"SOK_RANK": "0", "SOK_NUM_RANKS": "2",
          "SOK_WORKER_ADDRS": "[::1]:1,[::1]:2"},
         "'\\[::1\\]:1' has no IPv4 host or host name"),
    ],
)
def test_world_from_env_errors(env, match):
    with pytest.raises(RuntimeError, match=match):
        world.world_from_env(env)


def test_rank_without_init_reads_env(monkeypatch):
    monkeypatch.setattr(world, "_WORLD", None)
    monkeypatch.setenv("SOK_RANK", "1")
    monkeypatch.setenv("SOK_NUM_RANKS", "3")
    monkeypatch.setenv("SOK_WORKER_ADDRS", "a:1,a:2,a:3")
    assert (world.rank(), world.num_ranks()) == (1, 3)
    assert not world.is_initialized()
    with pytest.raises(
        RuntimeError, match=r"rank 1 of 3 \(from sokrun\) but sok_keras.init"
    ):
        world.communicator()


def test_init_world_of_one(monkeypatch):
    for var in ("SOK_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                "SLURM_PROCID", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(world, "_WORLD", None)
    w = world.init(timeout=5)
    assert world.init() is w  # idempotent
    # The communicator is made once: a later call asking for another one,
    # or another heartbeat, says so (before: ignored silently).
    assert world.init(backend="auto", heartbeat_timeout=w.heartbeat_timeout,
                      timeout=5) is w
    with pytest.raises(ValueError, match=r"called before with "
                       r"backend='auto'.*Received: backend='nccl'"):
        world.init(backend="nccl")
    # "collective" gives one rank the local communicator, as "auto" did
    # (QA: refused on 1 rank, accepted on 2 where "auto" gave it too).
    assert world.init(backend="collective") is w
    assert w.backend == "local"
    with pytest.raises(ValueError, match=r"heartbeat_timeout=.*Received: "
                       r"heartbeat_timeout=3"):
        world.init(heartbeat_timeout=3)
    assert world.is_initialized()
    assert (world.rank(), world.num_ranks(), w.timeout) == (0, 1, 5.0)
    c = world.communicator()
    assert isinstance(c, comm.LocalCommunicator)
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    mean = c.all_reduce(x, "k", op="mean")
    assert mean.numpy().tolist() == x.numpy().tolist()
    assert c.all_gather(x, "k").shape == (2, 2)
    assert c.broadcast(x, "k").shape == (2, 2)
    counts = tf.constant([[2]], tf.int64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = c.exchange(x, counts, "k")
        loss = tf.reduce_sum(y * 3.0)
    assert tape.gradient(loss, x).numpy().tolist() == [[3.0, 3.0]] * 2
    with pytest.raises(ValueError, match=r"\[1, 1\] int .* shape \(2, 2\)"):
        c.exchange(x, tf.zeros([2, 2], tf.int64), "k")
    with pytest.raises(ValueError, match="got 'prod'"):
        c.all_reduce(x, "k", op="prod")


def test_init_arguments(monkeypatch):
    monkeypatch.setattr(world, "_WORLD", None)
    with pytest.raises(ValueError, match="comm_tool='mpi'"):
        world.init(comm_tool="mpi")
    with pytest.raises(TypeError, match="'bogus'"):
        world.init(bogus=1)
    with pytest.raises(ValueError, match="got -1"):
        world.init(timeout=-1)
    # (Before: "'>' not supported between instances of 'str' and 'int'".)
    with pytest.raises(TypeError, match="`timeout` must be a number.*'x'"):
        world.init(timeout="x")
    with pytest.raises(TypeError, match="`heartbeat_timeout` must be"):
        world.init(heartbeat_timeout=True)
    # QA: "", 0 and False were taken as "auto"; a refused init had set the
    # global-metrics setting; a heartbeat under a millisecond became 0 ms
    # (TensorFlow's default).
    from sok_keras import callbacks

    before = callbacks.global_metrics_enabled()
    for bad in ("", 0, False):
        with pytest.raises(ValueError, match=f"Received: backend={bad!r}"):
            world.init(backend=bad, global_metrics=not before)
    assert callbacks.global_metrics_enabled() == before
    with pytest.raises(ValueError, match="at least 0.001 s.*"
                       r"heartbeat_timeout=0.0001"):
        world.init(heartbeat_timeout=0.0001, global_metrics=not before)
    monkeypatch.setenv("WORLD_SIZE", "4")  # refused by the world's checks
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 is set"):
        world.init(global_metrics=not before)
    monkeypatch.delenv("WORLD_SIZE")
    assert callbacks.global_metrics_enabled() == before
    with pytest.raises(TypeError, match="global_metrics='no'"):
        world.init(global_metrics="no")
    monkeypatch.setenv("SOK_LOCAL_RANK", "\u00b2")  # a digit, not ASCII
    with pytest.raises(RuntimeError, match="SOK_LOCAL_RANK must be this "
                       "rank's local rank"):
        world.init()


def test_init_after_tf_ran_is_an_error():
    code = (
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1\n"
        "import sok_keras.world as w\n"
        "w.init()\n"
    )
    # The repo first, then where TensorFlow may live (a PYTHONPATH install).
    path = os.pathsep.join([REPO] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p])
    env = dict(os.environ, PYTHONPATH=path, SOK_RANK="0", SOK_NUM_RANKS="2",
               SOK_WORKER_ADDRS="127.0.0.1:1,127.0.0.1:2",
               TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, timeout=60)
    assert out.returncode != 0
    assert b"sok_keras.init() must run before TensorFlow" in out.stderr


def test_a_bad_backend_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setattr(world, "_WORLD", None)
    monkeypatch.setenv("SOK_BACKEND", "gloo")
    with pytest.raises(ValueError,
                       match=r"Received: SOK_BACKEND='gloo' \(environment\)"):
        world.init()
    with pytest.raises(ValueError, match=r"Received: backend='mpi'"):
        world.init(backend="mpi")


@pytest.mark.parametrize("var, value, match", [
    ("SOK_SAVE_TIMEOUT", "-1", "SOK_SAVE_TIMEOUT must be a positive"),
    ("SOK_GLOBAL_METRICS", "maybe", "SOK_GLOBAL_METRICS='maybe'"),
    ("SOK_BIND_GUARD", "2", "SOK_BIND_GUARD='2'"),
    # (QA: these two were taken and inf's deadline thread died later;
    # local ranks that are no rank were passed over silently.)
    ("SOK_SAVE_TIMEOUT", "inf", "SOK_SAVE_TIMEOUT must be a positive "
     r"number of seconds, at most 3.1536e\+07 \(a year\), got 'inf'"),
    ("SOK_SAVE_TIMEOUT", "1e12", "at most"),
    ("SOK_LOCAL_RANK", "xyz", "SOK_LOCAL_RANK must be this rank's local "
     "rank .*got 'xyz'"),
    ("LOCAL_RANK", "abc", "LOCAL_RANK must be .*got 'abc'"),
    ("LOCAL_RANK", "-2", "LOCAL_RANK must be .*got '-2'"),
    # (QA: taken, and the guard, which reads only addresses, let the
    # servers listen on every interface.)
    ("SOK_BIND_HOST", "notahost", "SOK_BIND_HOST must be the IPv4 or IPv6 "
     "address .*'notahost'"),
    # (Review: a scoped address, which the guard's inet_pton refuses.)
    ("SOK_BIND_HOST", "::1%lo", "SOK_BIND_HOST must be .*'::1%lo'"),
])
def test_variables_read_later_are_checked_at_init(monkeypatch, var, value,
                                                  match):
    """Before: accepted at init, failing at the first save or fit (or, for
    SOK_BIND_GUARD, silently taken as on)."""
    monkeypatch.setattr(world, "_WORLD", None)
    monkeypatch.setenv(var, value)
    with pytest.raises((RuntimeError, ValueError), match=match):
        world.init()


@pytest.mark.parametrize("var", ["SOK_COMM_TIMEOUT", "SOK_HEARTBEAT_TIMEOUT"])
@pytest.mark.parametrize("value", ["inf", "1e12", "nan", "0"])
def test_timeouts_must_be_finite_and_at_most_a_year(monkeypatch, var, value):
    """Before: `inf` or 1e12 passed the check, then every rank crashed at
    init with a bare OverflowError (a millisecond count, a clock)."""
    monkeypatch.setattr(world, "_WORLD", None)
    monkeypatch.setenv(var, value)
    with pytest.raises(RuntimeError, match=f"{var} must be a positive "
                       r"number of seconds, at most 3.1536e\+07 \(a year\), "
                       f"got '{value}'"):
        world.init()
    monkeypatch.delenv(var)
    arg = var[4:].lower().replace("comm_", "")  # timeout, heartbeat_timeout
    with pytest.raises(ValueError, match=f"`{arg}` must be a positive "
                       "number of seconds, at most"):
        world.init(**{arg: float(value)})


def test_local_rank_minus_one_means_not_distributed(monkeypatch):
    """(Review: some tools export LOCAL_RANK=-1 for a run of one process;
    it is as if unset, and the next launcher variable is read.)"""
    for name in world._LOCAL_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "-1")
    assert world._local_rank(dict(os.environ)) is None
    monkeypatch.setattr(world, "_WORLD", None)
    world.init()
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SOK_LOCAL_RANK", "-1")
    assert world._local_rank(dict(os.environ)) == 3


def test_a_bind_host_must_be_the_ranks_own_address():
    """SOK_BIND_HOST set by hand to another address than the rank's entry
    (review: sokrun's 127.0.0.1 exported in a multi-host job failed as
    "the port is in use", or hung until SOK_COMM_TIMEOUT)."""
    import types

    def check(ip, addr):
        w = types.SimpleNamespace(rank=1, worker_addrs=["h:1", addr],
                                  source="MASTER_ADDR")
        world._check_bind_host(ip, w)

    check("127.0.0.1", "127.0.0.1:5000")
    check("127.0.0.1", "localhost:5000")
    check("::1", "[::1]:5000")
    check("127.0.0.1", "0.0.0.0:5000")  # every interface: narrowed
    with pytest.raises(RuntimeError, match=r"SOK_BIND_HOST=127.0.0.2 is not "
                       r"rank 1's address '127.0.0.1' \(from MASTER_ADDR\)"):
        check("127.0.0.2", "127.0.0.1:5000")
    with pytest.raises(RuntimeError, match="is not rank 1's address"):
        check("127.0.0.1", "192.0.2.7:5000")

