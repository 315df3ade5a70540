"""Fast failure on divergence (issue P10, deliverable 4): a rank that runs
out of data, raises or exits makes every other rank fail within seconds,
with a message naming the rank and the step, not after SOK_COMM_TIMEOUT."""

import re
import types

import pytest

from tests.multiprocess import launch
from tests.multiprocess import worker_path

# Far below SOK_COMM_TIMEOUT (600 s here): a rank that waits for the
# timeout shows as a job stopped by sokrun (exit 124), i.e. a failure.
TIMEOUT = 90
ENV = {"SOK_COMM_TIMEOUT": "600", "SOK_SAVE_TIMEOUT": "600",
       "SOK_BACKEND": "collective"}


# The two runs where no rank diverges go first in the jobs of two runs
# that diverge (tests/workers/sequence.py): one launch for two scenarios. A
# divergence aborts the ranks' collectives for good, so it comes last; an
# equal run leaves them as they were.
_SHARED = {
    (5, 5, "save", 1): ((5, 5, "save", 1), (5, 4, "metrics", 1)),
    (5, 4, "metrics", 1): ((5, 5, "save", 1), (5, 4, "metrics", 1)),
    (5, 5, "validate", 2): ((5, 5, "validate", 2), (4, 5, "metrics", 1)),
    (4, 5, "metrics", 1): ((5, 5, "validate", 2), (4, 5, "metrics", 1)),
    (5, 5, "callback_list", 2): ((5, 5, "callback_list", 2),
                                 (5, 4, "callback_list", 1)),
    (5, 4, "callback_list", 1): ((5, 5, "callback_list", 2),
                                 (5, 4, "callback_list", 1)),
    (5, 5, "spe", 2): ((5, 5, "spe", 2), (5, 4, "spe", 1)),
    (5, 4, "spe", 1): ((5, 5, "spe", 2), (5, 4, "spe", 1)),
}
_shared_jobs = {}


def _job(steps0, steps1, extra, epochs=1):
    """The job of one run (its own, or shared with another run: then a
    view of it with this run's results and the whole job's output)."""
    case = (steps0, steps1, extra, epochs)
    if case not in _SHARED:
        job = launch(worker_path("divergence_fit"), 2, list(case),
                     timeout=TIMEOUT, env=ENV)
    else:
        cases = _SHARED[case]
        if cases not in _shared_jobs:
            args = [*map(str, cases[0]), "+", "divergence_fit",
                    *map(str, cases[1])]
            _shared_jobs[cases] = launch(
                worker_path("sequence"), 2, ["divergence_fit", *args],
                timeout=TIMEOUT, env=ENV)
        whole = _shared_jobs[cases]
        index = cases.index(case)
        job = types.SimpleNamespace(
            returncode=whole.returncode, output=whole.output,
            elapsed=whole.elapsed, leftovers=whole.leftovers,
            results={rank: r["cases"][index]
                     for rank, r in whole.results.items()})
    detail = f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"
    assert job.returncode != 124, f"the job hung{detail}"
    assert not job.leftovers, detail
    return job, detail


def _both_diverged(job, detail, phrase):
    assert job.returncode == 0, detail
    assert sorted(job.results) == [0, 1], detail
    for r in (0, 1):
        result = job.results[r]
        assert result["type"] == "RankDivergedError", detail
        assert phrase in result["error"], detail


def test_fewer_batches_on_one_rank_with_global_metrics():
    job, detail = _job(5, 4, "metrics")
    _both_diverged(job, detail,
                   "rank 1 finished after step 4; rank 0 is at step 5")


def test_fewer_batches_on_rank_0():
    job, detail = _job(4, 5, "metrics")
    _both_diverged(job, detail,
                   "rank 0 finished after step 4; rank 1 is at step 5")


def test_fewer_batches_with_save_at_the_end():
    job, detail = _job(5, 4, "save")
    _both_diverged(job, detail,
                   "rank 1 finished after step 4; rank 0 is at step 5")
    assert not any(r.get("saved") for r in job.results.values()), detail


def test_fewer_batches_without_any_later_collective():
    # Rank 1 would otherwise return from fit and exit 0 while rank 0 hangs.
    job, detail = _job(5, 4, "none")
    _both_diverged(job, detail,
                   "rank 1 finished after step 4; rank 0 is at step 5")


def test_data_of_unknown_length_on_equal_ranks_trains():
    """Keras begins one more step per epoch than a dataset of unknown length
    holds (it finds the data empty): counted as not run, on every rank,
    in training and validation."""
    job, detail = _job(5, 5, "unknown", 2)
    assert job.returncode == 0, detail
    for r in (0, 1):
        assert job.results[r]["error"] is None, detail
        assert len(job.results[r]["losses"]) == 2, detail


def test_fewer_batches_on_one_rank_with_validation():
    """(Before: the rank that ran out joined the validation's first
    collective before saying so, and the other waited for
    SOK_COMM_TIMEOUT.)"""
    job, detail = _job(5, 4, "validate")
    _both_diverged(job, detail,
                   "rank 1 finished after step 4; rank 0 is at step 5")


def test_fewer_batches_of_unknown_length_on_one_rank():
    """(Before: both ranks counted the empty step, so they agreed, and rank
    0's last step waited for SOK_COMM_TIMEOUT.)"""
    job, detail = _job(5, 4, "unknown")
    _both_diverged(job, detail,
                   "rank 1 finished after step 4; rank 0 is at step 5")
    assert max(r["elapsed"] for r in job.results.values()) < 60, detail
    # Rank 1, which ran out of data, says where it is when it learns of
    # rank 0's failure: not in step 5, which Keras began and found empty.
    assert job.results[1]["error"].endswith(
        "rank 1 is at the end of epoch 1 of fit, after step 4"), detail


def test_fewer_batches_with_several_steps_per_execution():
    """With `steps_per_execution` > 1 Keras reports one step per
    execution, so a rank whose data ends inside one is not seen: the ranks
    compare their steps per epoch before the first, and fail at once
    (before: rank 0's last step waited for SOK_COMM_TIMEOUT). Ranks with
    equal steps train as before."""
    job, detail = _job(5, 5, "spe", 2)
    assert job.returncode == 0, detail
    for r in (0, 1):
        assert job.results[r]["error"] is None, detail
        assert len(job.results[r]["losses"]) == 2, detail
    _counts_compared(*_job(5, 4, "spe"), 5, 4)


def _counts_compared(job, detail, steps0, steps1):
    """Both ranks failed at once on the comparison of their step counts.
    Rank 0 raises its own comparison, or rank 1's if that reached it first
    (a race): either names both counts."""
    _both_diverged(job, detail, "diverged before its first step")
    assert re.search(
        f"rank 0 has {steps0} steps per epoch, rank 1 has {steps1}"
        f"|rank 1 has {steps1} steps per epoch, rank 0 has {steps0}",
        job.results[0]["error"]), detail
    assert max(r["elapsed"] for r in job.results.values()) < 60, detail


def test_uneven_validation_with_several_steps_per_execution():
    """The same for the validation inside fit: 1 and 2 batches, both inside
    one execution (before: rank 1's second step waited for
    SOK_COMM_TIMEOUT)."""
    _counts_compared(*_job(5, 5, "spe_validate"), 1, 2)


def test_rank_that_stops_training_early():
    """EarlyStopping on rank-local logs: rank 1 stops after epoch 1, or a
    callback of its own stops it after step 2. Both ranks' errors say that
    `model.stop_training` was set on rank 1 (QA: they said only to batch
    the data evenly, which it was)."""
    job, detail = _job(5, 5, "stop", 3)
    _both_diverged(job, detail,
                   "fit diverged: rank 1 finished it after 5 steps in all; "
                   "rank 0 is at step 1 of epoch 2 of fit (6 steps). "
                   "`model.stop_training` was set on rank 1")
    job, detail = _job(5, 5, "stop_batch", 2)
    _both_diverged(job, detail,
                   "fit diverged in epoch 1: rank 1 finished after step 2; "
                   "rank 0 is at step 3. `model.stop_training` was set on "
                   "rank 1 (by a callback)")
    assert "drop_remainder" not in job.results[0]["error"], detail


@pytest.mark.parametrize("extra", ["raise", "raise_poisoned"])
def test_rank_that_raises_mid_fit(extra):
    """Rank 1 raises at step 5: rank 0 stops with an error naming it. Also
    after local processes sent rank 0's side channel lines that are not a
    rank's (QA: a line `null` ended the hub's thread; rank 0 then saw
    only gRPC's "Socket closed" late, and a healthy job hung at exit)."""
    job, detail = _job(8, 8, extra)
    assert job.returncode == 0, detail
    r0, r1 = job.results[0], job.results[1]
    assert r1["type"] == "RuntimeError", detail
    assert r1["error"] == "rank 1 fails on purpose at step 5", detail
    assert r0["type"] == "RankDivergedError", detail
    assert ("rank 1 failed at step 5 of epoch 1 of fit: RuntimeError: rank 1 "
            "fails on purpose at step 5; rank 0 is at step") in r0["error"], (
                detail)


def test_rank_whose_op_fails_mid_fit_is_quoted():
    """A TensorFlow op failing in one rank's step: the other rank's error
    quotes the op's message and node (before: only TensorFlow's first
    line, "InvalidArgumentError: Graph execution error:")."""
    job, detail = _job(8, 8, "op_error")
    assert job.returncode == 0, detail
    r0, r1 = job.results[0], job.results[1]
    assert r1["type"] == "InvalidArgumentError", detail
    assert r0["type"] == "RankDivergedError", detail
    assert re.search(
        r"rank 1 failed at step 5 of epoch 1 of fit: InvalidArgumentError: "
        r"assertion failed: \[op_error: id 31 seen\].* \(at node "
        r"\S*assert_less\S*\); rank 0 is at step", r0["error"]), detail


def test_headline_of_errors():
    from sok_keras.divergence import headline

    graph = ("Graph execution error:\n\nDetected at node m/Check defined at "
             "(most recent call last):\n  File \"a.py\", line 1, in <m>\n\n"
             "  File \"b.py\", line 2, in f\n\nthe op's message\nCondition "
             "x < y did not hold.\n[31]\n\t [[{{node m/Check}}]] "
             "[Op:__inference_x_1]")
    assert headline(RuntimeError(graph)) == (
        "RuntimeError: the op's message (at node m/Check)")
    # Several root errors (a step on a GPU): the first root's message.
    roots = ("Graph execution error:\n\nDetected at node m/Check defined at "
             "(most recent call last):\n  File \"a.py\", line 1, in <m>\n\n"
             "2 root error(s) found.\n  (0) INVALID_ARGUMENT:  the op's "
             "message\n\t [[{{node m/Check}}]]\n\t [[x/_78]]\n  (1) "
             "INVALID_ARGUMENT:  the op's message\n\t [[{{node m/Check}}]]\n"
             "0 successful operations.\n0 derived errors ignored. [Op:x]")
    assert headline(RuntimeError(roots)) == (
        "RuntimeError: the op's message (at node m/Check)")
    # A Python error in a py_function (a data pipeline's generator).
    pyfunc = ("Graph execution error:\n\nDetected at node PyFunc defined at "
              "(most recent call last):\n<stack traces unavailable>\n"
              "OSError: /data/part-3 is corrupt\nTraceback (most recent "
              "call last):\n\n  File \"a.py\", line 5, in gen\n\nOSError: "
              "/data/part-3 is corrupt\n\n\n\t [[{{node PyFunc}}]]\n\t "
              "[[IteratorGetNext]] [Op:__inference_f_29]")
    assert headline(RuntimeError(pyfunc)) == (
        "RuntimeError: OSError: /data/part-3 is corrupt (at node PyFunc)")
    assert headline(ValueError("one\ntwo")) == "ValueError: one"
    # AutoGraph's error at trace time: the error under its traceback.
    autograph = ("in user code:\n\n    File \"a.py\", line 3, in f  *\n"
                 "        return g(x)\n\n    ValueError: the real reason\n")
    assert headline(ValueError(autograph)) == "ValueError: the real reason"
    assert headline(RuntimeError("Graph execution error:\n  sok_keras: "
                                 "table 't' id 9")) == (
        "RuntimeError: sok_keras: table 't' id 9")


@pytest.mark.parametrize("stalled", [1, 0])
def test_a_stalled_rank_is_named(stalled):
    """Rank `stalled` stalls (alive, silent) before step 5: the other's
    collective times out (SOK_COMM_TIMEOUT), and its error says where the
    stalled rank last reported, and how long ago. Before: only rank 0 knew
    (rank 1 stalled: rank 0's timeout alone, which sokrun showed as "rank 0
    failed"); a stalled rank 0 was named by no rank, and then failed
    "because rank 1 failed". Rank 0's reader thread answers while its main
    thread sleeps."""
    waited = 1 - stalled
    job = launch(worker_path("divergence_fit"), 2,
                 ["8", "8", "stall" if stalled else "stall0"],
                 timeout=TIMEOUT, env=dict(ENV, SOK_COMM_TIMEOUT="6"))
    detail = f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"
    assert job.returncode == 0, detail
    assert job.results[waited]["type"] == "DeadlineExceededError", detail
    assert job.results[stalled]["type"] == "RankDivergedError", detail
    said = re.search(rf"rank {waited} failed at step 5 of epoch 1 of fit: "
                     r"DeadlineExceededError: .*\(the other ranks' last "
                     rf"reports: rank {stalled} at step 5 of epoch 1 of fit, "
                     r"(\d+) s ago: a rank whose report is old is stalled "
                     r"or slow\)", job.results[stalled]["error"])
    assert said, detail
    assert int(said.group(1)) >= 5, detail  # the timeout's age, not fresh


def test_rank_that_raises_and_ends_the_program():
    # sokrun stops the job when rank 1 exits 1; rank 0 has said why first.
    job, detail = _job(8, 8, "raise_uncaught")
    assert job.returncode == 1, detail
    # Rank 0's own line, or (when sokrun stops it before its error reaches
    # the top) the abort of its collectives that it logs with the reason.
    rank0 = [line for line in job.output.splitlines()
             if line.startswith("[0] ")]
    assert any("sok_keras: rank 0: rank 1 failed at step 5 of epoch 1 of "
               "fit" in line for line in rank0), detail
    assert "[1] RuntimeError: rank 1 fails on purpose at step 5" in (
        job.output), detail


def test_rank_that_exits_mid_fit():
    # os._exit(0): no Python clean-up runs and sokrun sees a success; only
    # rank 0 is left to fail.
    job, detail = _job(8, 8, "exit")
    assert job.returncode == 0, detail
    assert sorted(job.results) == [0], detail
    r0 = job.results[0]
    assert r0["type"] == "RankDivergedError", detail
    assert ("rank 1 exited without a word (it last reported step 5 of epoch "
            "1 of fit); rank 0 is at step") in r0["error"], detail


def test_equal_steps_never_trigger_anything():
    job, detail = _job(5, 5, "save")
    assert job.returncode == 0, detail
    for r in (0, 1):
        assert job.results[r]["error"] is None, detail
    assert job.results[0]["saved"] and job.results[1]["saved"], detail


def test_a_keras_callback_list_gets_global_logs_and_divergence_checks():
    """Keras runs a `CallbackList` given to `fit` as it is: sok's tracker
    and `GlobalMetrics` join it for the loop (QA: before, each rank's
    History held its own losses, and a rank with fewer batches went
    unseen until SOK_COMM_TIMEOUT)."""
    job, detail = _job(5, 5, "callback_list", 2)
    assert job.returncode == 0, detail
    for r in (0, 1):
        assert job.results[r]["error"] is None, detail
        assert len(job.results[r]["losses"]) == 2, detail
    assert job.results[0]["losses"] == job.results[1]["losses"], detail
    _both_diverged(*_job(5, 4, "callback_list"),
                   "rank 1 finished after step 4; rank 0 is at step 5")


def test_a_learning_rate_set_on_rank_0_only_is_refused():
    """(QA: a model of tables only trained each rank's rows at its own rate
    without a word; with dense weights, the error blamed averaging.)"""
    job, detail = _job(5, 5, "lr_rank0")
    assert job.returncode == 0, detail
    for r in (0, 1):
        error = job.results[r]["error"] or ""
        # Each rank raises it; one that hears of its peer's first raises
        # the RankDivergedError quoting it.
        assert job.results[r]["type"] in (
            "RuntimeError", "RankDivergedError"), detail
        assert ("after epoch 1, the learning rate of the model's optimizer "
                "OptimizerWrapper differs between the ranks (rank 0: 0.01, "
                "rank 1: 0.1)") in error, detail


def test_equal_steps_with_validation_and_two_epochs():
    job, detail = _job(5, 5, "validate", 2)
    assert job.returncode == 0, detail
    for r in (0, 1):
        assert job.results[r]["error"] is None, detail
        assert len(job.results[r]["losses"]) == 2, detail
    assert job.results[0]["losses"] == job.results[1]["losses"], detail


def _custom(mode):
    job = launch(worker_path("divergence_custom"), 2, [mode],
                 timeout=TIMEOUT, env=ENV)
    detail = f"\n--- output ({job.elapsed:.1f} s) ---\n{job.output}"
    assert job.returncode != 124, f"the job hung{detail}"
    assert not job.leftovers, detail
    assert 0 in job.results, detail
    return job, job.results[0], detail


def test_custom_loop_rank_that_raises():
    job, r0, detail = _custom("raise")
    assert job.returncode == 1, detail  # rank 1's error ends the job
    # Iteration 3 when rank 1 left before rank 0 had all of that one.
    assert r0["iteration"] in (3, 4), detail
    assert ("rank 1 failed: RuntimeError: rank 1 stops its custom loop"
            in r0["error"]), detail


def test_custom_loop_rank_that_exits_normally():
    job, r0, detail = _custom("exit")
    assert job.returncode == 0, detail
    # Iteration 3 when rank 1 left before rank 0 had all of that one (a
    # race, as in the test above): the collective then says it cannot
    # complete.
    if r0["iteration"] == 3:
        assert ("all_reduce:custom/loop cannot complete: rank 1 has exited "
                "(its program ended)") in r0["error"], detail
    else:
        assert r0["iteration"] == 4, detail
        assert ("rank 1 has exited (its program ended); rank 0 waits in "
                "all_reduce:custom/loop") in r0["error"], detail


def test_a_rank_whose_program_ended_waits_for_the_others():
    """Rank 1's program ends while rank 0 is inside a collective begun
    before: rank 1 stays (its TensorFlow server serves its part of it)
    until rank 0 gives that collective up, 10 s on. Before: rank 1 exited
    at once, taking its server down while rank 0 might still be fetching
    its part (rank 0: "UnavailableError: Socket closed", seen once in
    CI)."""
    job = launch(worker_path("exit_wait"), 2, timeout=120)
    detail = f"{job}\n{job.output}"
    assert job.returncode == 0, detail
    r0 = job.results[0]
    assert r0["gone_after"] is not None and 8 <= r0["gone_after"] < 40, detail
    assert ("rank 1 has exited (its program ended); rank 0 waits in"
            in r0["error"]), detail
    assert job.leftovers == []


def test_a_rank_released_by_its_peers_leaves_at_once():
    """A rank whose program ended early (an error of its own, `sys.exit`)
    while the others run no collective is not held back (eager_lookup's
    worker: rank 0 sleeps 1 s, then looks up alone)."""
    job = launch(worker_path("peer_exit_eager"), 2, timeout=120)
    detail = f"{job}\n{job.output}"
    assert job.returncode == 0, detail
    assert "waits (at most" not in job.output, detail
    assert job.results[0]["rank1_gone_before_lookup"] is True, detail


def test_the_wait_at_exit_is_bounded_and_said():
    job = launch(worker_path("exit_wait"), 2, args=["6"], timeout=120)
    detail = f"{job}\n{job.output}"
    assert job.returncode == 0, detail
    # Gone after the 6 s cap (and its own shut-down), long before rank 0
    # would give its collective up (30 s here).
    gone_after = job.results[0]["gone_after"]
    assert gone_after is not None and 5 <= gone_after < 25, detail
    assert ("rank 1 has ended its program and waits (at most 6 s) for "
            "rank(s) 0 to end theirs") in job.output, detail
    assert job.leftovers == []


# -- the decisions, in one process (no sockets) --------------------------


def _channel(rank=0, n=2):
    from sok_keras import divergence

    aborted = []
    ch = divergence._Channel(rank, n, aborted.append)
    ch.publish = lambda **msg: None  # nowhere to send
    return ch, aborted


def _steps_done(ch, loop, n):
    """Steps 1..n of `loop` begin and end on this rank."""
    for step in range(1, n + 1):
        ch.step(loop, step)
        ch.step_done(loop, step)


def test_equal_epoch_ends_never_abort():
    ch, aborted = _channel()
    loop = ch.begin_loop("fit")
    for epoch in range(3):
        ch.begin_epoch(loop, epoch)
        _steps_done(ch, loop, 4)
        # The peer's report may come before or after this rank's own end.
        if epoch % 2:
            ch.receive({"t": "epoch_end", "rank": 1, "lid": loop.lid,
                        "epoch": epoch, "steps": 4})
            ch.end_epoch(loop)
        else:
            ch.end_epoch(loop)
            ch.receive({"t": "epoch_end", "rank": 1, "lid": loop.lid,
                        "epoch": epoch, "steps": 4})
    ch.receive({"t": "loop_done", "rank": 1, "lid": loop.lid, "steps": 12})
    ch.finish(loop, 12, timeout=5)
    ch.end_loop(loop)
    ch.receive({"t": "bye", "rank": 1})  # exits after the loop: fine
    assert aborted == []


def test_peer_that_ran_out_of_data_aborts_the_rank_that_did_not():
    from sok_keras import divergence

    ch, aborted = _channel()
    loop = ch.begin_loop("fit")
    ch.begin_epoch(loop, 0)
    _steps_done(ch, loop, 4)
    ch.receive({"t": "epoch_end", "rank": 1, "lid": loop.lid, "epoch": 0,
                "steps": 4})
    assert aborted == []  # step 4 is not past the peer's end
    # Step 5 begins: it may yet find the data empty (data of unknown
    # length), so nothing is decided until one of its collectives waits.
    ch.step(loop, 5)
    ch._periodic()
    assert aborted == [] and ch.pending_divergence is not None
    ch._collective_waits = lambda: [("all_to_all:t/ids", 2.0)]
    ch._periodic()
    assert len(aborted) == 1
    assert "rank 1 finished after step 4; rank 0 is at step 5" in aborted[0]
    # A step after an unfinished one is past the peer's end for sure.
    ch2, aborted2 = _channel()
    loop = ch2.begin_loop("fit")
    ch2.begin_epoch(loop, 0)
    ch2.receive({"t": "epoch_end", "rank": 1, "lid": loop.lid, "epoch": 0,
                 "steps": 1})
    ch2.step(loop, 1)
    ch2.step_done(loop, 1)
    ch2.step(loop, 2)
    ch2.step_done(loop, 2)
    try:
        ch2.step(loop, 3)
    except divergence.RankDivergedError as e:
        message = str(e)
    else:
        raise AssertionError("step 3 should have raised")
    assert "rank 1 finished after step 1; rank 0 is at step 3" in message
    assert aborted2 == [message]


def test_a_step_that_finds_the_data_empty_is_not_counted():
    """Data of unknown length: Keras begins a step past the end on every
    rank. Begun, its input empty, it is not counted: no divergence."""
    ch, aborted = _channel()
    loop = ch.begin_loop("fit")
    ch.begin_epoch(loop, 0)
    _steps_done(ch, loop, 3)
    ch.step(loop, 4)  # finds the data empty
    ch.receive({"t": "epoch_end", "rank": 1, "lid": loop.lid, "epoch": 0,
                "steps": 3})
    ch.end_epoch(loop)
    ch._collective_waits = lambda: [("all_reduce:global_metrics/epoch", 2.0)]
    ch._periodic()
    assert aborted == [] and ch.my_ends[(loop.lid, 0)] == 3


def test_a_loop_over_no_data_is_not_ahead_of_its_peer():
    """Keras begins step 1 of `evaluate` over 0 samples before it finds no
    data. A peer that ended the whole loop first (after 0 steps) made this
    rank "at step 1" and raised (QA: 6 runs in 11 on 2 ranks). Begun and
    not finished, the step is decided as an epoch's last one is."""
    ch, aborted = _channel(rank=1)
    loop = ch.begin_loop("evaluate")
    ch.begin_epoch(loop, 0)
    ch.step(loop, 1)  # finds no data
    ch.receive({"t": "epoch_end", "rank": 0, "lid": loop.lid, "epoch": 0,
                "steps": 0})
    ch.receive({"t": "loop_done", "rank": 0, "lid": loop.lid, "steps": 0})
    ch._periodic()
    assert aborted == []
    ch.end_epoch(loop)
    ch.finish(loop, 0, timeout=5)
    ch.end_loop(loop)
    assert aborted == []
    # A step that does wait in a collective is past the peer's end.
    ch2, aborted2 = _channel(rank=1)
    loop = ch2.begin_loop("evaluate")
    ch2.begin_epoch(loop, 0)
    ch2.step(loop, 1)
    ch2.receive({"t": "loop_done", "rank": 0, "lid": loop.lid, "steps": 0})
    ch2._collective_waits = lambda: [("all_to_all:t/ids", 2.0)]
    ch2._periodic()
    assert len(aborted2) == 1
    assert "rank 0 finished it after 0 steps in all" in aborted2[0]


def _rank_0_ended_after_step_2_while_step_3_waits(ch, loop):
    """Rank 1 runs steps 1-3 of `loop` (step 3 waits in a collective) and
    hears that rank 0 ended epoch 1 after step 2."""
    for step in range(1, 4):
        ch.step(loop, step)
        if step < 3:
            ch.step_done(loop, step)
    ch._collective_waits = lambda: [("all_to_all:t/ids", 2.0)]  # step 3
    ch.receive({"t": "epoch_end", "rank": 0, "lid": loop.lid, "epoch": 0,
                "steps": 2})
    ch._periodic()


def test_peer_report_while_this_rank_waits_in_a_step_aborts():
    ch, aborted = _channel(rank=1)
    loop = ch.begin_loop("evaluate")
    _rank_0_ended_after_step_2_while_step_3_waits(ch, loop)
    assert len(aborted) == 1
    assert ("evaluate diverged in epoch 1: rank 0 finished after step 2; "
            "rank 1 is at step 3") in aborted[0]


def test_the_validation_inside_fit_is_named_as_such():
    """(QA: "evaluate diverged" where the user called `fit`.)"""
    ch, aborted = _channel(rank=1)
    fit = ch.begin_loop("fit")
    ch.step(fit, 1)
    ch.step_done(fit, 1)
    loop = ch.begin_loop("evaluate")
    _rank_0_ended_after_step_2_while_step_3_waits(ch, loop)
    assert len(aborted) == 1
    assert ("the validation (evaluate) inside fit diverged in epoch 1: "
            "rank 0 finished after step 2; rank 1 is at step 3") in aborted[0]


def test_failed_and_lost_peers_abort_and_name_this_ranks_step():
    for report, expected in [
            ({"t": "failed", "rank": 1,
              "msg": "rank 1 failed at step 2 of epoch 1 of fit: OSError"},
             "rank 1 failed at step 2 of epoch 1 of fit: OSError; rank 0 is "
             "at step 3 of epoch 1 of fit"),
            ({"t": "lost", "rank": 0, "who": 1,
              "msg": "rank 1 exited without a word"},
             "rank 1 exited without a word; rank 0 is at step 3")]:
        ch, aborted = _channel()
        loop = ch.begin_loop("fit")
        ch.step(loop, 3)
        ch.receive(report)
        assert len(aborted) == 1 and expected in aborted[0], aborted


def test_a_peer_that_left_outside_a_loop_aborts_nothing():
    ch, aborted = _channel()
    ch.receive({"t": "bye", "rank": 1})
    assert aborted == []


def test_an_eager_lookup_after_the_other_rank_ended_names_it():
    """Before: TensorFlow's raw "UnavailableError: ... Socket closed"."""
    job = launch(worker_path("peer_exit_eager"), 2, timeout=120)
    r0 = job.results.get(0)
    assert r0 is not None, job.output
    assert r0["error"] is not None, r0
    assert "rank 1 has exited (its program ended)" in r0["error"], r0
    assert "must make the same collective calls" in r0["error"], r0
    assert r0["elapsed"] < 60, r0
    assert job.leftovers == []


def test_a_forked_child_leaves_the_channel_alone():
    """A child that the program forks and that ends normally runs the
    parent's exit handlers: it must neither say goodbye for the rank nor
    wait for the peers (before the fix: it waited up to 60 s and shut the
    parent's socket down)."""
    import os
    import time

    ch, _ = _channel(rank=1)
    said = []
    ch.publish = lambda **msg: said.append(msg)
    ch._pid = os.getpid() + 1  # as in a forked child
    start = time.monotonic()
    ch.close()
    assert said == [] and not ch.leaving and not ch.closing
    assert time.monotonic() - start < 1


def test_a_peer_is_released_once_no_collective_begun_before_it_left_runs():
    """Rank 0 holds a collective begun before rank 1's goodbye: rank 1 is
    released only when it ends; one begun after the goodbye (which rank 1
    can never join) does not hold it."""
    import time

    import tensorflow as tf

    from sok_keras import inflight

    ch, _ = _channel(rank=0, n=3)
    sent = []
    ch._send_to = lambda sock, msg: sent.append(msg)
    ch._peers = {1: object()}
    x, token = inflight.begin(tf.zeros([1]), "test/before")
    time.sleep(0.05)
    ch.receive({"t": "bye", "rank": 1})
    assert sent == []  # begun before the goodbye: may need rank 1
    inflight.end(x, token)
    ch._release()
    assert sent == [{"t": "released", "rank": 0, "to": 1}]
    sent.clear()
    x, token = inflight.begin(tf.zeros([1]), "test/after")
    try:
        ch._peers[2] = object()
        ch.to_release[2] = time.monotonic() - 0.5  # the goodbye came first
        ch._release()
        assert sent == [{"t": "released", "rank": 0, "to": 2}]
    finally:
        inflight.end(x, token)


def test_a_peer_is_not_released_while_a_loop_runs_here():
    """Inside fit / evaluate / predict a step may run collectives that the
    in-flight registry does not see (a tf.distribute strategy's own): the
    peer is released when the loop has ended."""
    ch, _ = _channel(rank=0)
    sent = []
    ch._send_to = lambda sock, msg: sent.append(msg)
    ch._peers = {1: object()}
    loop = ch.begin_loop("fit")
    ch.loop_done[(1, loop.lid)] = 0  # rank 1 ended the same loop
    ch.receive({"t": "bye", "rank": 1})
    ch._release()
    assert sent == []
    ch.end_loop(loop)
    ch._release()
    assert sent == [{"t": "released", "rank": 0, "to": 1}]


def test_ranks_that_stopped_sending_heartbeats_are_named():
    """A frozen rank (SIGSTOP) is found by TensorFlow's heartbeats, whose
    error names it as `task:R` only: sok's error names the rank (QA:
    "rank 0 failed" was all a user read)."""
    from sok_keras import divergence

    message = (
        "Collective ops is aborted by: Error reported from "
        "/job:worker/task:1: The following tasks are unhealthy (stopped "
        "sending heartbeats):\n/job:worker/replica:0/task:3\n"
        "/job:worker/replica:0/task:1\nThe tasks have crashed. Check the "
        "task logs for an earlier error.\n\t [[{{node x/task:7}}]]")
    assert divergence.unhealthy_ranks(message) == [1, 3]
    assert divergence.unhealthy_ranks("Socket closed /task:1") == []


def test_the_hub_keeps_its_ranks_and_drops_strangers():
    """Rank 0's side channel without a job: a rank whose hello comes in
    one read with more than the hello limit of its next line is kept
    (review: it was dropped); a stranger's lines that are not a rank's
    hello (not an object, a bool rank, a long line, bad bytes) close that
    connection only, and the hub's thread goes on."""
    import json
    import socket

    from sok_keras import divergence

    ch = divergence._Channel(0, 3, lambda message: None)
    ch._token = "tok"
    ch._server = socket.create_server(("127.0.0.1", 0))
    ch._server.settimeout(0.25)
    ch._spawn(ch._serve, "test-hub")
    port = ch._server.getsockname()[1]

    def closed(sock):
        sock.settimeout(5.0)
        try:
            return sock.recv(16) == b""
        except OSError:
            return True

    try:
        rank = socket.create_connection(("127.0.0.1", port))
        hello = json.dumps({"t": "hello", "rank": 1, "token": "tok"})
        report = json.dumps({"t": "progress", "msg": "x" * 6000})
        rank.sendall((hello + "\n" + report[:5000]).encode())
        strangers = []
        for junk in (b"null\n", b"[]\n", b"1\n", b"x" * 5000, b"\xff\xfe\n",
                     b'{"t": "hello", "rank": true, "token": "tok"}\n'):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(junk)
            strangers.append(s)
        assert all(closed(s) for s in strangers)
        assert sorted(ch._peers) == [1]
        assert all(t.is_alive() for t in ch._threads)
        rank.settimeout(0.5)
        with pytest.raises(socket.timeout):  # still open
            rank.recv(16)
        rank.close()
    finally:
        ch.closing = True
        ch._server.close()
