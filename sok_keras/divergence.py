"""Fast failure when the ranks of a job diverge.

Every collective waits for every rank. A rank that runs out of data, raises
or exits would leave the others waiting for `SOK_COMM_TIMEOUT`; this module
makes them fail within seconds instead, with an error naming the rank and
the step (`RankDivergedError`).

How. With more than one rank, `sok_keras.init()` opens a small side channel:
rank 0 listens on its own address (a random port, published to the others
through TensorFlow's coordination service with a random token that every
peer must present) and relays what each rank reports to every other rank.
Each rank reports:

- its progress in `fit`, `evaluate` and `predict` (the loop, the epoch and
  the step, tracked by a callback that the hooked loops put first);
- "finished epoch e after step k" when its data for an epoch ran out;
- "failed at step k: <error>" when a loop, or the program, raises;
- "bye" when the process exits normally (`atexit`); it then waits until
  each other rank has ended, failed, left, or released it (no collective
  begun before the goodbye in flight there; at most `_EXIT_WAIT` s),
  since a peer may still be fetching its part of the last collective;
- nothing when it is killed or calls `os._exit`: its connection closes, and
  rank 0 reports the rank lost, with the last step it reported.

A thread on every rank reads these reports. When another rank has finished
an epoch (or the whole loop: a rank-local early stop) after fewer steps
than this rank is running, has failed, or is gone while this rank is
inside a loop (or waits in a collective), it aborts
this process's collectives (`abort_collective_ops`), so the blocked step
fails at once; the hooked loop then raises `RankDivergedError`, e.g.
"fit diverged in epoch 1: rank 1 finished after step 4; rank 0 is at
step 5", and reports its own failure, so every rank fails alike. A rank
whose loop raises prints its error, then waits (at most `_GRACE` seconds)
for the others to fail or leave before raising, so that a launcher that
stops the job when one rank exits does not kill them before they have said
why. A loop that ends normally waits for every other rank to end the same
loop (at most `SOK_COMM_TIMEOUT`): a rank never returns from `fit` while
another is still training, and ranks that ran different numbers of steps
all raise. Ranks that run the same number of steps exchange nothing but
one short message per step to rank 0.

Limits. A rank alive but stalled says nothing: the communicator's watchdog
(`SOK_COMM_TIMEOUT`) still finds it, and the error of a rank whose
collective timed out lists where each other rank last reported and how
long ago (the stalled rank's report is as old as the timeout; rank 0 keeps
these reports, its own included, and its reader thread answers a rank
that asks, even while its main thread stalls). A host that vanishes
without closing its connections (power loss, network partition)
is found by the coordination service's heartbeat
(`SOK_HEARTBEAT_TIMEOUT`, 10 s). If rank 0 is gone, the others learn it but can no longer tell each other anything.
Under the NCCL backend the NCCL communicator is aborted too
(`NcclCommunicator.abort`: the op library's watchdog calls
`ncclCommAbort`), so a step waiting in an NCCL collective fails as well.
"""

import atexit
import json
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time

import keras

_KV_KEY = "sok_keras/divergence/hub"
_GRACE = 10.0  # seconds a failing rank waits for the others to fail too
_POLL = 0.25  # seconds between the reader's periodic checks
_HELLO_LIMIT = 4096  # bytes of a connection's first line (its hello)
_LINE_LIMIT = 16 << 20  # bytes of any later line (a rank's report)
_PEER_REPORT = 2.0  # seconds a failed collective waits for a peer's report
_DEPARTED_GRACE = 1.0  # a collective still in flight this long after a
#                        peer left can never complete
_EXIT_WAIT = 60.0  # seconds a rank whose program ended waits for the others
_EXIT_NOTICE = 5.0  # ... before it says that it waits
_FINISHING_GRACE = 10.0  # a collective begun before a peer left may still
#                          complete (the peer serves its part) this long
_LOG = logging.getLogger("sok_keras")


def _steps(n):
    return f"{n} step" if n == 1 else f"{n} steps"


def unhealthy_ranks(message):
    """The ranks TensorFlow's coordination service says stopped sending
    heartbeats in `message` ("The following tasks are unhealthy (stopped
    sending heartbeats):" then `/job:worker/replica:0/task:R` lines; task
    R is rank R), sorted; [] if it says none."""
    at = message.find("stopped sending heartbeats")
    if at < 0:
        return []
    rest = message[at:].split("\n", 1)[-1]
    ranks = []
    for line in rest.splitlines():
        m = re.fullmatch(r"\s*/job:\w+/replica:\d+/task:(\d+)\s*", line)
        if not m:
            break
        ranks.append(int(m.group(1)))
    return sorted(set(ranks))


# Unindented lines of a TensorFlow op error that are not its message (QA:
# a failed `py_function` / `from_generator` was reported to the other ranks
# as "<stack traces unavailable>", its Python error hidden under it).
_NOT_THE_MESSAGE = ("Detected at node", "<stack traces unavailable>",
                    "Traceback (most recent call last)")


def headline(error):
    """`error` as `Type: message` on one line, for the other ranks: the
    message, not the generic first line TensorFlow or Keras put above it.
    sok_keras' own message where there is one; else, for a TensorFlow op
    error ("Graph execution error:", the traceback of the op's creation,
    the op's message, then `[[{{node ...}}]]`), the op's message and the
    node it failed at."""
    lines = str(error).splitlines() or [""]
    mine = [line[line.index("sok_keras:"):] for line in lines
            if "sok_keras:" in line]
    message = mine[0] if mine else lines[0]
    if not mine and message.strip() == "in user code:":
        # AutoGraph's trace error: the traceback, then the error itself.
        inner = [line.strip() for line in lines[1:] if line.strip()]
        if inner:
            if re.match(r"[A-Za-z_][\w.]*: ", inner[-1]):
                return inner[-1]
            message = inner[-1]
    nodes = [i for i, line in enumerate(lines) if "[[{{" in line]
    if not mine and nodes:
        # The op's message: its first line, the first unindented one after
        # the header and the traceback (whose lines are indented); under
        # "N root error(s) found." (a GPU step), the first root's.
        body = [i for i in range(1, nodes[0]) if lines[i].strip()
                and not lines[i][0].isspace()
                and not lines[i].startswith(_NOT_THE_MESSAGE)]
        roots = [m.group(1) for m in (
            re.match(r"\s*\(0\) [A-Z_]+:\s*(.+)", line)
            for line in lines[1:nodes[0]]) if m]
        if roots:
            message = roots[0].strip()
        elif body:
            message = lines[body[0]].strip()
        node = re.search(r"\{\{node ([^}]+)\}\}", lines[nodes[0]])
        if node:
            message += f" (at node {node.group(1)})"
    return f"{type(error).__name__}: {message}"


class RankDivergedError(RuntimeError):
    """Another rank failed, exited, or ran a different number of steps."""

    # Exception's own constructor: AutoGraph re-raises an error from a
    # traced function (its message with the user's code) as the same class
    # only for such classes, as a StagingError otherwise.
    __init__ = Exception.__init__


# Added to a divergence in step counts.
_SAME_STEPS = (
    ". Every rank must run the same number of steps: batch the data with "
    "`drop_remainder=True` and split each global batch with "
    "`sok.shard_batches`, or give every rank as many batches of its own "
    "(pad the last ones: docs/failures.md)")

# The same, where a rank ended its `fit` early because a callback set
# `model.stop_training` there.
_SAME_STOP = (
    ". `model.stop_training` was set on rank {ranks} (by a callback) and "
    "not alike on every rank: a callback must decide the same on every "
    "rank, from the logs (global with several ranks), or agree on a "
    "decision of one rank's own (a stop file, a clock) first, e.g. with "
    "`sok_keras.compat.horovod.broadcast` on every rank "
    "(docs/failures.md)")

# Reports that rank 0 keeps to itself: progress (one per step).
# ("where?" and "released" go to one rank only: `_hub_line`.)
_LOCAL = ("progress",)

# Added where a peer left while this rank waits in a collective.
_SAME_CALLS = (
    ". Every rank must make the same collective calls (lookups, their "
    "gradients, updates) before any rank ends.")


class _Loop:
    """One `fit` / `evaluate` / `predict` call on this rank."""

    def __init__(self, kind, lid, label=None):
        self.kind = kind
        # In messages: "fit", or "the validation (evaluate) inside fit".
        self.label = label or kind
        self.lid = lid  # "fit#1": the same on every rank
        self.epoch = 0
        self.step = 0  # the step (1-based) running or last run
        # The steps that ran to their end: with data of unknown length,
        # Keras begins one more step whose input turns out empty.
        self.done = 0
        self.ended = False  # this epoch's data ran out

    def where(self):
        if self.ended:  # (not the step begun that found no data)
            return (f"the end of epoch {self.epoch + 1} of {self.label}, "
                    f"after step {self.done}")
        return f"step {self.step} of epoch {self.epoch + 1} of {self.label}"


class _Channel:
    """This rank's end of the side channel, and what it knows of the
    others."""

    def __init__(self, rank, num_ranks, abort):
        self.rank = rank
        self.n = num_ranks
        self._abort_fn = abort
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.stack = []  # the loops running on this rank, outermost first
        self.labels = {}  # lid -> its loop's label, after it ended too
        self.seq = 0
        self.my_ends = {}  # (lid, epoch) -> steps, this rank
        self.peer_ends = {}  # (rank, lid, epoch) -> steps
        self.loop_done = {}  # (rank, lid) -> steps of its loop
        # (rank, lid): that rank's `fit` stopped on `model.stop_training`.
        self.stopped = set()
        self.failed = {}  # rank -> message
        # A peer ended an epoch one step before the step begun here, which
        # may yet find its data empty (`diverged`, `_periodic`).
        self.pending_divergence = None
        self.gone = {}  # rank -> (monotonic time, message)
        # rank -> ("step k of epoch e of fit", when it was reported);
        # rank 0 only (progress is not relayed), its own included.
        self.progress = {}
        # rank > 0: rank 0's answer to "where is everyone?" (`_ask_where`).
        self.where_answer = None
        self.failure = None  # why this rank's collectives were aborted
        self.reason = None  # the same, without "sok_keras: rank r: "
        self.reported = False  # this rank reported its own failure
        self.closing = False
        self.leaving = False  # this rank's program ended (`close`)
        self._hub_closed = False  # rank > 0: rank 0's connection closed
        # Peers whose program ended, waiting for this rank to release them
        # (no collective begun before their goodbye in flight here):
        # rank -> when the goodbye came.
        self.to_release = {}
        self.released = set()  # the ranks that released this one
        self._pid = os.getpid()  # (a forked child has no channel)
        self._send_lock = threading.Lock()
        self._threads = []
        self._sock = None  # rank > 0: the connection to rank 0
        self._server = None  # rank 0
        self._peers = {}  # rank 0: rank -> socket
        self._backlog = []  # rank 0: messages for ranks not yet connected
        self._token = None

    # -- wire --------------------------------------------------------------

    @staticmethod
    def _encode(msg):
        return (json.dumps(msg) + "\n").encode()

    def _send_to(self, sock, msg):
        try:
            with self._send_lock:
                sock.sendall(self._encode(msg))
        except OSError:
            pass  # the peer is gone; its reader reports it

    def _send_to_rank(self, r, msg):
        """Sends `msg` to rank `r` alone: from rank 0 directly, from the
        others through rank 0 (which routes it by its `to`)."""
        if self.rank != 0:
            if self._sock is not None:
                self._send_to(self._sock, msg)
            return
        with self.lock:
            sock = self._peers.get(r)
        if sock is not None:
            self._send_to(sock, msg)

    def publish(self, **msg):
        """Tells every other rank `msg` (a dict; `rank` is added)."""
        msg["rank"] = self.rank
        if self.rank == 0:
            self._relay(msg)
        elif self._sock is not None:
            self._send_to(self._sock, msg)

    def _relay(self, msg):
        """Rank 0: forwards `msg` to every rank but its sender."""
        with self.lock:
            if msg.get("t") not in _LOCAL and self._backlog is not None:
                self._backlog.append(msg)
            peers = list(self._peers.items())
        for r, sock in peers:
            if r != msg["rank"] and msg.get("t") not in _LOCAL:
                self._send_to(sock, msg)

    # -- starting and stopping ---------------------------------------------

    def start_hub(self, host):
        from tensorflow.python.eager import context

        self._token = secrets.token_hex(16)
        self._server = socket.create_server((host, 0))
        self._server.settimeout(_POLL)
        port = self._server.getsockname()[1]
        context.context().set_config_key_value(
            _KV_KEY, json.dumps([host, port, self._token]))
        self._spawn(self._serve, "sok_keras-divergence-hub")

    def connect(self, timeout):
        from tensorflow.python.eager import context

        host, port, token = json.loads(context.context().get_config_key_value(
            _KV_KEY, int(timeout * 1000)))
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.settimeout(_POLL)
        self._send_to(self._sock, {"t": "hello", "rank": self.rank,
                                   "token": token})
        self._spawn(self._read_hub, "sok_keras-divergence-reader")

    def _spawn(self, target, name):
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self):
        """Says goodbye, waits for the others to end too, and stops the
        threads (at exit).

        The wait: a collective that has completed here may not have
        completed on a peer yet, which is still fetching this rank's part
        of it from this process's TensorFlow server (gRPC). A rank that
        exited as soon as its last step returned would take that server
        down, and the peer's step would fail ("Socket closed"). So a rank
        whose program ended stays until every other rank has ended, failed,
        is gone or released it (at most `_EXIT_WAIT` s; not after its own failure,
        which waited already), as `hvd.shutdown` does in Horovod. A peer
        that has no collective begun before the goodbye in flight releases
        it at once (one that is preprocessing, say), so a program that ends
        early after an error of its own is not held back.
        """
        if os.getpid() != self._pid:
            return  # a child forked by the program: not a rank
        with self.lock:
            if self.closing or self.leaving:
                return
            self.leaving = True
        try:
            self.publish(t="bye")
            if not self.reported:
                self._wait_to_leave(_EXIT_WAIT)
        finally:  # (also after a Ctrl-C in the wait)
            with self.lock:
                self.closing = True
            self._stop()

    def _stop(self):
        """Closes the sockets and stops the threads."""
        if self._sock is not None:
            _shut(self._sock)
        for t in self._threads:
            t.join(timeout=2 * _POLL + 1.0)
        if self._server is not None:
            for sock in list(self._peers.values()):
                _shut(sock)
            self._server.close()

    # -- readers -------------------------------------------------------------

    def _serve(self):
        """Rank 0: accepts the other ranks and relays their messages."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        buffers = {}
        while not self.closing:
            try:
                ready = sel.select(_POLL)
            except (OSError, ValueError):
                break
            for key, _ in ready:
                sock = key.fileobj
                if sock is self._server:
                    try:
                        conn, _ = self._server.accept()
                    except OSError:
                        continue
                    conn.settimeout(_POLL)
                    buffers[conn] = [b"", None]
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(65536)
                except (socket.timeout, BlockingIOError):
                    continue
                except OSError:
                    data = b""
                state = buffers[sock]
                if not data:
                    sel.unregister(sock)
                    del buffers[sock]
                    sock.close()
                    if state[1] is not None:
                        self._peer_closed(state[1])
                    continue
                state[0] += data
                lines = []
                if b"\n" in data:  # (never re-split a long partial line)
                    *lines, state[0] = state[0].split(b"\n")
                keep = True
                for line in lines:
                    if not keep:
                        break
                    try:
                        keep = self._hub_line(sock, state, line)
                    except Exception as e:  # never let a line end the hub
                        _LOG.warning("sok_keras: dropped a bad message on "
                                     "the ranks' side channel: %r", e)
                        keep = state[1] is not None
                # A stranger gets one short hello line; a rank's lines are
                # small JSON too. Past the limit the connection is dropped
                # (QA: an unbounded line cost memory and quadratic time).
                limit = _HELLO_LIMIT if state[1] is None else _LINE_LIMIT
                keep = keep and len(state[0]) <= limit
                if not keep:
                    sel.unregister(sock)
                    del buffers[sock]
                    _shut(sock)
                    if state[1] is not None:
                        self._peer_closed(state[1])
            self._periodic()
        sel.close()

    def _hub_line(self, sock, state, line):
        """Handles one line of a connection; False to drop it (anything
        but a valid hello first: a process that is not one of the ranks,
        or that does not hold the job's token)."""
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if not isinstance(msg, dict):  # (QA: `1` or `[]` ended the hub)
            return state[1] is not None
        if state[1] is None:  # the first line must be a valid hello
            if not (msg.get("t") == "hello"
                    and msg.get("token") == self._token
                    and type(msg.get("rank")) is int
                    and 0 < msg["rank"] < self.n):
                return False
            self._hello(sock, state, msg["rank"])
        else:
            self._hub_message(sock, state, msg)
        return True

    def _hello(self, sock, state, r):
        """A rank's valid hello: registers it and sends what it missed."""
        state[1] = r
        with self.lock:
            self._peers[r] = sock
            backlog = [m for m in self._backlog or () if m["rank"] != r]
            if len(self._peers) == self.n - 1:
                self._backlog = None  # everyone is here
        for m in backlog:
            self._send_to(sock, m)

    def _hub_message(self, sock, state, msg):
        msg["rank"] = state[1]  # a rank speaks for itself only
        if msg.get("t") == "where?":
            self._send_to(sock, {"t": "where", "rank": 0,
                                 "reports": self._reports(state[1])})
            return
        if msg.get("t") == "released":  # for one rank only
            if msg.get("to") == 0:
                self.receive(msg)
            else:
                self._send_to_rank(msg.get("to"), msg)
            return
        self._relay(msg)
        self.receive(msg)

    def _peer_closed(self, r):
        with self.lock:
            self._peers.pop(r, None)
            said_bye = r in self.gone
            where = self.progress.get(r, (None, 0))[0]
        if said_bye:
            return
        after = f" (it last reported {where})" if where else ""
        msg = {"t": "lost", "rank": 0, "who": r,
               "msg": f"rank {r} exited without a word{after}"}
        self._relay(msg)
        self.receive(msg)

    def _read_hub(self):
        """Ranks > 0: reads what rank 0 relays."""
        buf = b""
        while not self.closing:
            try:
                data = self._sock.recv(65536)
            except socket.timeout:
                self._periodic()
                continue
            except OSError:
                data = b""
            if not data:
                with self.lock:
                    known = 0 in self.gone or self.closing
                    self._hub_closed = True
                    self.changed.notify_all()
                if not known:
                    self.receive({"t": "lost", "rank": 0, "who": 0,
                                  "msg": "rank 0 exited without a word"})
                # Rank 0 is gone: go on finding collectives that wait for it.
                while not self.closing and self.failure is None:
                    self._periodic()
                    time.sleep(_POLL)
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                try:
                    self.receive(json.loads(line))
                except ValueError:
                    continue
            self._periodic()

    # -- decisions ------------------------------------------------------------

    def receive(self, msg):
        """Takes in a report from another rank and acts on it."""
        kind = msg.get("t")
        r = msg.get("who", msg.get("rank"))
        if not isinstance(r, int) or r == self.rank:
            return
        with self.lock:
            if kind == "progress":
                self.progress[r] = (msg.get("where"), time.monotonic())
                return
            if kind == "where":
                self.where_answer = msg.get("reports") or []
                self.changed.notify_all()
                return
            if kind == "released":
                if msg.get("to") == self.rank:
                    self.released.add(r)
                    self.changed.notify_all()
                return
            if msg.get("stopped") and "lid" in msg:
                self.stopped.add((r, msg["lid"]))
            if kind == "epoch_end":
                self.peer_ends[(r, msg["lid"], msg["epoch"])] = msg["steps"]
            elif kind == "loop_done":
                self.loop_done[(r, msg["lid"])] = msg["steps"]
            elif kind == "failed":
                self.failed.setdefault(r, msg.get("msg", ""))
            elif kind in ("bye", "lost"):
                self.gone.setdefault(r, (time.monotonic(), msg.get(
                    "msg", f"rank {r} has exited (its program ended)")))
                if kind == "bye":
                    self.to_release.setdefault(r, time.monotonic())
                if kind == "lost":
                    self.failed.setdefault(r, msg.get("msg", ""))
            self.changed.notify_all()
            reason = self.diverged()
        if reason is not None:
            self.abort(reason)
        if kind == "bye":
            self._release()

    def _release(self):
        """Tells each peer whose program ended, once no collective begun
        before its goodbye is in flight here and no loop runs here, that
        it may go."""
        with self.lock:
            # Not inside fit / evaluate / predict: a step may run
            # collectives that `inflight` does not see (a strategy's own).
            if not self.to_release or self.stack:
                return
            pending = dict(self.to_release)
        now = time.monotonic()
        try:
            from sok_keras import inflight

            running = [s for _, s in inflight.snapshot()]
        except Exception:  # interpreter shutting down
            running = []
        for r, since in pending.items():
            if any(s >= now - since for s in running):
                continue  # begun before the goodbye: may need rank r
            with self.lock:
                self.to_release.pop(r, None)
            self._send_to_rank(r, {"t": "released", "rank": self.rank,
                                   "to": r})

    def _advice(self, lid, ranks):
        """What to do about `lid` ending after other steps on `ranks`."""
        stopped = [r for r in sorted(ranks) if (r, lid) in self.stopped]
        if not stopped:
            return _SAME_STEPS
        return _SAME_STOP.format(ranks=" and ".join(map(str, stopped)))

    def diverged(self):
        """Why this rank cannot go on, or None (call with the lock)."""
        me = self.rank
        for (r, lid, epoch), steps in sorted(self.peer_ends.items()):
            mine = self.my_ends.get((lid, epoch))
            loop = next((x for x in self.stack if x.lid == lid), None)
            if mine == steps:  # agreed: nothing more to compare
                del self.peer_ends[(r, lid, epoch)]
                continue
            if mine is not None:
                kind = self.labels.get(lid, lid.partition("#")[0])
                return (f"{kind} diverged in epoch {epoch + 1}: rank {r} "
                        f"finished after step {steps}; rank {me} finished "
                        f"after step {mine}{self._advice(lid, (r, me))}")
            if (mine is None and loop is not None and loop.epoch == epoch
                    and loop.step > steps):
                reason = (f"{loop.label} diverged in epoch {epoch + 1}: rank "
                          f"{r} finished after step {steps}; rank {me} is at "
                          f"step {loop.step}{self._advice(lid, (r, me))}")
                if loop.step == steps + 1 and loop.done == steps:
                    # Begun, not finished: with data of unknown length this
                    # may be the step that finds the data empty (the peer
                    # had one too). `_periodic` decides once a collective
                    # of it waits.
                    self.pending_divergence = reason
                    continue
                return reason
        for (r, lid), total in sorted(self.loop_done.items()):
            loop = next((x for x in self.stack if x.lid == lid), None)
            if loop is None:
                continue
            mine = sum(v for (i, _), v in self.my_ends.items() if i == lid)
            if not loop.ended:
                mine += loop.step
            if mine > total:  # e.g. rank-local early stopping
                reason = (f"{loop.label} diverged: rank {r} finished it "
                          f"after {_steps(total)} in all; rank {me} is at "
                          f"{loop.where()} ({_steps(mine)})"
                          f"{self._advice(lid, (r, me))}")
                if (not loop.ended and mine == total + 1
                        and loop.step == loop.done + 1):
                    # Begun, not finished: the step that finds the data
                    # empty, as the peer's last one did (Keras begins a
                    # step of data with no batch at all: QA, `evaluate`
                    # of 0 samples). `_periodic` decides once a
                    # collective of it waits.
                    self.pending_divergence = reason
                    continue
                return reason
        here = self.stack[-1].where() if self.stack else None
        if self.failed and not self.reported:
            r, why = min(self.failed.items())
            at = f"; rank {me} is at {here}" if here else ""
            return f"{_failure_of(r, why)}{at}"
        outer = self.stack[0].lid if self.stack else None
        left = [(r, why) for r, (_, why) in sorted(self.gone.items())
                if (r, outer) not in self.loop_done]
        if self.stack and left:  # gone before the end of this loop
            r, why = left[0]
            return f"{why}; rank {me} is at {here}"
        return None

    def _periodic(self):
        """A peer that left, or ended the epoch a step earlier, while a
        collective waits here: it never ends."""
        with self.lock:
            self.pending_divergence = None
            reason = None if self.failure is not None else self.diverged()
            pending = self.pending_divergence
        if reason is None and pending is not None and self._collective_waits():
            reason = pending
        if reason is not None:
            self.abort(reason)
            return
        self._release()
        with self.lock:
            if self.failure is not None or not self.gone:
                return
            left = min(t for t, _ in self.gone.values())
            r, (_, why) = min(self.gone.items())
        since = time.monotonic() - left
        if since < _DEPARTED_GRACE:
            return
        # Begun after the peer left: never completes. Begun before: the
        # peer (waiting at its exit) may still serve its part of it.
        waiting = [k for k, s in self._collective_waits()
                   if s < since or since > _FINISHING_GRACE]
        if waiting:
            self.abort(f"{why}; rank {self.rank} waits in {waiting[0]}"
                       f"{_SAME_CALLS}")

    @staticmethod
    def _collective_waits():
        """The collectives in flight here for over `_DEPARTED_GRACE` s, as
        `(key, seconds)`."""
        try:
            from sok_keras import inflight

            return [(k, s) for k, s in inflight.snapshot()
                    if s > _DEPARTED_GRACE]
        except Exception:  # interpreter shutting down
            return []

    def abort(self, reason):
        """Aborts this process's collectives with `reason` (once)."""
        with self.lock:
            if self.failure is not None or self.closing or self.leaving:
                return
            self.reason = reason
            self.failure = f"sok_keras: rank {self.rank}: {reason}"
            self.changed.notify_all()
            message = self.failure
        # Tell the others first: TensorFlow passes the abort on to the
        # peers of a pending collective, and they should know why.
        self.publish(t="failed", msg=reason)
        self._abort_fn(message)

    # -- loops (main thread) ------------------------------------------------

    def begin_loop(self, kind):
        with self.lock:
            self.seq += 1
            parent = self.stack[-1] if self.stack else None
            inside = parent is not None and parent.kind == "fit"
            loop = _Loop(kind, f"{kind}#{self.seq}",
                         f"the validation ({kind}) inside fit" if inside
                         else None)
            self.labels[loop.lid] = loop.label
            self.stack.append(loop)
        if parent is not None and parent.kind == "fit":
            self.end_epoch(parent)  # validation: the training data ran out
        return loop

    def end_loop(self, loop):
        with self.lock:
            if loop in self.stack:
                self.stack.remove(loop)

    def step(self, loop, step):
        """This rank starts `step` (1-based) of `loop`; raises if another
        rank cannot run it."""
        with self.lock:
            loop.step = step
            where = loop.where()
            if self.rank == 0:
                self.progress[0] = (where, time.monotonic())
            reason = self.failure or self.diverged()
        self.publish(t="progress", where=where)
        if reason is not None:
            self.abort(reason)
            raise RankDivergedError(self.failure)

    def check_steps(self, loop, steps, per_execution):
        """Before the first step of `loop` with `steps_per_execution` > 1:
        every rank must have the same number of steps per epoch (`steps`,
        None where the data's length is unknown).

        Keras reports one step per execution then, so the step at which
        a rank's data runs out (inside an execution) is not seen here, and
        a rank with more steps would wait in that step's collectives for
        `SOK_COMM_TIMEOUT`. Where every rank knows its count, the ranks
        compare them now (three agreements) and all raise alike.
        """
        if per_execution <= 1 or self.n == 1:
            return
        from sok_keras import world

        agree = world.control_communicator().agree
        timeout = world.timeout()
        what = f"divergence/{loop.lid}/steps"
        known = steps is not None and steps > 0
        if agree(f"{what}/known", int(known), timeout) != self.n:
            return  # (some rank's data has no known length)
        total = agree(f"{what}/sum", steps, timeout)
        squares = agree(f"{what}/squares", steps * steps, timeout)
        if self.n * squares == total * total:  # all equal
            return
        others = (f"rank {1 - self.rank} has {total - steps}" if self.n == 2
                  else f"the {self.n} ranks have {total} in all")
        reason = (f"{loop.label} diverged before its first step: rank "
                  f"{self.rank} has {steps} steps per epoch, {others} "
                  f"(with steps_per_execution={per_execution} the ranks "
                  f"compare their counts first){_SAME_STEPS}")
        with self.lock:
            self.reason = reason
            self.failure = f"sok_keras: rank {self.rank}: {reason}"
        raise RankDivergedError(self.failure)

    def step_done(self, loop, step):
        """This rank's `step` (1-based) of `loop` ran to its end."""
        with self.lock:
            loop.done = step

    def begin_epoch(self, loop, epoch):
        with self.lock:
            loop.epoch = epoch
            loop.step = 0
            loop.done = 0
            loop.ended = False

    def end_epoch(self, loop, stopped=False):
        """`loop`'s data for its current epoch ran out on this rank (or
        `stopped`: `model.stop_training` ended it)."""
        with self.lock:
            if loop.ended:
                return
            loop.ended = True
            self.my_ends[(loop.lid, loop.epoch)] = loop.done
            if stopped:
                self.stopped.add((self.rank, loop.lid))
            reason = self.diverged()
        self.publish(t="epoch_end", lid=loop.lid, epoch=loop.epoch,
                     steps=loop.done, stopped=stopped)
        if reason is not None:
            self.abort(reason)

    def finish(self, loop, total, timeout, stopped=False):
        """`loop` returned on this rank (`stopped`: a `fit` that
        `model.stop_training` ended): waits until every other rank has
        ended it too; raises if one failed, left, or ran other steps."""
        if stopped:
            with self.lock:
                self.stopped.add((self.rank, loop.lid))
        self.publish(t="loop_done", lid=loop.lid, steps=total,
                     stopped=stopped)
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                reason = self.failure or self.diverged()
                if reason is None:
                    pending = [r for r in range(self.n) if r != self.rank
                               and (r, loop.lid) not in self.loop_done
                               and r not in self.gone]
                    other = [(r, self.loop_done[(r, loop.lid)])
                             for r in range(self.n)
                             if self.loop_done.get((r, loop.lid),
                                                   total) != total]
                    if other:
                        r, steps = other[0]
                        reason = (f"{loop.label} ran {steps} steps on rank {r} "
                                  f"and {total} on rank {self.rank}")
                    elif not pending:
                        return
                    elif time.monotonic() > deadline:
                        reason = (f"ranks {pending} did not finish "
                                  f"{loop.label} within {timeout:g} s of rank "
                                  f"{self.rank} (SOK_COMM_TIMEOUT)")
                if reason is not None:
                    break
                self.changed.wait(_POLL)
        self.abort(reason)
        raise RankDivergedError(self.failure)

    def failed_here(self, loop, error):
        """`loop` raised `error` here: reports it, prints it, and waits a
        little for the other ranks to fail too. Returns the error to raise
        instead of `error`, or None."""
        import tensorflow as tf

        with self.lock:
            if isinstance(error, tf.errors.OpError):
                # Aborted by a peer through TensorFlow: its report on the
                # side channel is on its way.
                deadline = time.monotonic() + _PEER_REPORT
                while self.failure is None and time.monotonic() < deadline:
                    self.changed.wait(0.05)
            cause = self.failure
            where = loop.where() if loop is not None else "outside a loop"
            self.reported = True
        # A collective that failed after this rank aborted them: the abort's
        # reason is the error. Any other error is this rank's own.
        ours = isinstance(error, RankDivergedError) or (
            cause is not None and isinstance(error, tf.errors.OpError))
        if ours and cause is not None:
            text = self.reason
        else:
            text = (f"rank {self.rank} failed at {where}: "
                    f"{headline(error)[:500]}")
            peers = []
            if isinstance(error, tf.errors.DeadlineExceededError):
                # A peer alive but stalled (or slow) says nothing; rank 0
                # knows where each rank last was (itself included), and
                # tells the others.
                reports = (self._reports(0) if self.rank == 0
                           else self._ask_where())
                peers = [f"rank {r} at {w}, {age:.0f} s ago"
                         for r, w, age in reports]
            frozen = unhealthy_ranks(str(error))
            if frozen:  # (QA: a SIGSTOPped rank was named as task:1 only)
                text += (f" (rank{'s' if len(frozen) > 1 else ''} "
                         f"{', '.join(map(str, frozen))} stopped sending "
                         "heartbeats: frozen (SIGSTOP, a debugger), stuck "
                         "in the kernel, or on a host that is unreachable)")
            if peers:
                text += (f" (the other ranks' last reports: "
                         f"{'; '.join(peers)}: a rank whose report is old "
                         "is stalled or slow)")
        self.publish(t="failed", msg=text)
        print(f"sok_keras: rank {self.rank}: {text}", file=sys.stderr,
              flush=True)
        self.wait_for_peers(_GRACE)
        if ours and not isinstance(error, RankDivergedError):
            return RankDivergedError(cause)
        return None

    def _reports(self, asker):
        """Rank 0: [(rank, where it last reported, seconds ago)] of the
        ranks alive but `asker`."""
        now = time.monotonic()
        with self.lock:
            return [(r, w, now - t) for r, (w, t) in sorted(
                self.progress.items()) if r != asker
                and r not in self.failed and r not in self.gone]

    def _ask_where(self, wait=1.0):
        """Rank > 0: rank 0's `_reports` for this rank (its reader thread
        answers while its main thread stalls), or [] within `wait` s."""
        with self.lock:
            self.where_answer = None
        if self._sock is None or self._hub_closed:
            return []
        self._send_to(self._sock, {"t": "where?", "rank": self.rank})
        deadline = time.monotonic() + wait
        with self.lock:
            while self.where_answer is None and time.monotonic() < deadline:
                self.changed.wait(max(0.0, deadline - time.monotonic()))
            return [tuple(x) for x in self.where_answer or ()]

    def _wait_to_leave(self, timeout):
        """Waits until every other rank has ended, failed, is gone or has
        released this one, or rank 0's connection closed (nothing more can
        be learnt), at most `timeout` s; says so once the wait is long."""
        start = time.monotonic()
        told = False
        with self.lock:
            while True:
                waiting = [r for r in range(self.n) if r != self.rank
                           and r not in self.failed and r not in self.gone
                           and r not in self.released]
                elapsed = time.monotonic() - start
                if not waiting or self._hub_closed or elapsed >= timeout:
                    return
                if not told and elapsed >= _EXIT_NOTICE:
                    told = True
                    _LOG.warning(
                        "sok_keras: rank %d has ended its program and waits "
                        "(at most %g s) for rank(s) %s to end theirs: they "
                        "may still be receiving its part of their last "
                        "collective", self.rank, timeout,
                        ", ".join(map(str, waiting)))
                self.changed.wait(_POLL)

    def wait_for_peers(self, timeout):
        """Waits until every other rank has failed or left (at most
        `timeout` s), so that none is stopped before it said why."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while time.monotonic() < deadline:
                if all(r in self.failed or r in self.gone
                       for r in range(self.n) if r != self.rank):
                    return
                self.changed.wait(_POLL)


def _shut(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


_CHANNEL = None


def channel():
    """The process's side channel, or None (one rank, or not started)."""
    return _CHANNEL


def _failure_of(r, why):
    """A peer's reported failure as a sentence that names the rank."""
    return why if why.startswith(f"rank {r} ") else f"rank {r} failed: {why}"


def explain_failed_collective(error, what, wait=1.0):
    """`error`, a TensorFlow error of an eager collective, with the reason
    the side channel knows (a peer that exited or failed), or `error`
    itself when it knows none within `wait` seconds.

    TensorFlow reports a peer that left as "Socket closed" or
    "Connection refused"; the peer's goodbye on the side channel says
    which rank it was and that its program ended.
    """
    import tensorflow as tf

    ch = _CHANNEL
    if ch is None or not isinstance(error, (
            tf.errors.UnavailableError, tf.errors.AbortedError,
            tf.errors.CancelledError)) or "sok_keras" in (error.message or ""):
        return error  # not a peer's loss, or already sok's own reason
    deadline = time.monotonic() + wait
    with ch.lock:
        while not (ch.gone or ch.failed) and time.monotonic() < deadline:
            ch.changed.wait(max(0.0, deadline - time.monotonic()))
        known = ([(r, why) for r, (_, why) in sorted(ch.gone.items())]
                 + sorted(ch.failed.items()))
    if not known:
        return error
    why = _failure_of(*known[0])
    first = (error.message or "").strip().splitlines()
    return type(error)(
        error.node_def, error.op,
        f"sok_keras: rank {ch.rank}: {what} cannot complete: {why}"
        f"{_SAME_CALLS} (TensorFlow: {first[0][:200] if first else ''})")


def _abort_collectives(message):
    import tensorflow as tf
    from tensorflow.python.eager import context

    from sok_keras import world

    w = world.world()
    for comm in (w.collective, w.communicator, getattr(w, "host", None)):
        if comm is not None and hasattr(comm, "aborted"):
            if comm.aborted is None:
                comm.aborted = message
    nccl = w.communicator
    if nccl is not None and hasattr(nccl, "abort"):  # NcclCommunicator
        try:
            nccl.abort(message)
        except Exception as e:  # noqa: BLE001 - never kill the reader thread
            _LOG.warning("sok_keras: could not abort NCCL: %s", e)
    try:
        context.context().abort_collective_ops(tf.errors.ABORTED, message)
    except Exception as e:  # noqa: BLE001 - never kill the reader thread
        _LOG.warning("sok_keras: could not abort the collectives: %s", e)


def start(world):
    """Opens the side channel of `world` (called by `sok_keras.init()`)."""
    global _CHANNEL
    if world.num_ranks == 1 or _CHANNEL is not None:
        return
    ch = _Channel(world.rank, world.num_ranks, _abort_collectives)
    if world.rank == 0:
        from sok_keras import world as world_module

        host = world_module._host_of(world.worker_addrs[0])
        if host in world_module._WILDCARDS:
            host = ""
        ch.start_hub(host)
    else:
        ch.connect(world.timeout)
    _CHANNEL = ch
    atexit.register(ch.close)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        report = not ch.stack and not ch.reported and not ch.closing
        if report:  # outside a hooked loop (those report themselves)
            ch.reported = True
            ch.publish(t="failed", msg=(
                f"rank {ch.rank} failed: {kind.__name__}: {value}"
            ).splitlines()[0][:500])
        previous(kind, value, tb)
        if report:
            ch.wait_for_peers(_GRACE)

    sys.excepthook = excepthook


class _Tracker(keras.callbacks.Callback):
    """Follows this rank's steps in a loop (the first callback)."""

    sok_first = True  # (`sok_keras.callbacks.joining` keeps it first)

    def __init__(self, ch, loop):
        super().__init__()
        self._ch = ch
        self._top = loop
        self._inner = []

    def _current(self):
        return self._inner[-1] if self._inner else self._top

    def _check_steps(self):
        per_execution = getattr(self.model, "steps_per_execution", 1) or 1
        self._ch.check_steps(self._top, (self.params or {}).get("steps"),
                             int(per_execution))

    def on_train_begin(self, logs=None):
        self._check_steps()

    def on_predict_begin(self, logs=None):
        self._check_steps()

    def on_epoch_begin(self, epoch, logs=None):
        self._ch.begin_epoch(self._top, epoch)

    def on_epoch_end(self, epoch, logs=None):
        # (The first callback: a stop decided in a later one's
        # `on_epoch_end` reaches the peers with the loop's end, `finish`.)
        self._ch.end_epoch(
            self._top, stopped=bool(getattr(self.model, "stop_training",
                                            False)))

    def on_train_batch_begin(self, batch, logs=None):
        self._ch.step(self._top, batch + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._ch.step_done(self._top, batch + 1)

    def _nested_begin(self, kind):
        if self._top.kind == "fit":  # validation inside fit
            self._inner.append(self._ch.begin_loop(kind))

    def _nested_end(self):
        if self._inner:
            loop = self._inner.pop()
            self._ch.end_epoch(loop)
            self._ch.end_loop(loop)
        elif self._top.kind != "fit":
            self._ch.end_epoch(self._top)

    def on_test_begin(self, logs=None):
        if self._top.kind == "evaluate":
            self._check_steps()
        self._nested_begin("evaluate")
        if self._top.kind == "fit" and self._inner:
            self._check_validation_steps()

    def _check_validation_steps(self):
        """As `_check_steps`, for the validation inside `fit` (Keras keeps
        its data's iterator on the model; its count, where known)."""
        per_execution = int(
            getattr(self.model, "steps_per_execution", 1) or 1)
        if per_execution <= 1:
            return
        iterator = getattr(self.model, "_eval_epoch_iterator", None)
        steps = getattr(iterator, "num_batches", None)
        self._ch.check_steps(self._inner[-1], steps, per_execution)

    def on_test_batch_begin(self, batch, logs=None):
        self._ch.step(self._current(), batch + 1)

    def on_test_batch_end(self, batch, logs=None):
        self._ch.step_done(self._current(), batch + 1)

    def on_test_end(self, logs=None):
        self._nested_end()

    def on_predict_batch_begin(self, batch, logs=None):
        self._ch.step(self._current(), batch + 1)

    def on_predict_batch_end(self, batch, logs=None):
        self._ch.step_done(self._current(), batch + 1)

    def on_predict_end(self, logs=None):
        self._nested_end()


def before_loop():
    """A loop is about to start on this rank. Inside `fit` (validation) it
    means this epoch's training data ran out here: the other ranks hear it
    now, before the loop's first collective (its check-in), which a rank
    still training would never join."""
    ch = _CHANNEL
    if ch is not None and ch.stack and ch.stack[-1].kind == "fit":
        ch.end_epoch(ch.stack[-1])


def run_loop(kind, original, model, args, kwargs):
    """Runs Keras' `fit` / `evaluate` / `predict` under the divergence
    checks (called by the hooks of `sok_keras.optimizers.auto_wrap`)."""
    import inspect

    ch = _CHANNEL
    if ch is None or ch.stack:  # one rank, or nested (validation in fit)
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    loop = ch.begin_loop(kind)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        # The caller's list: the tracker joins it for this loop.
        from sok_keras.callbacks import joining

        call = joining(callbacks, [_Tracker(ch, loop)], original)
    else:
        call = original
        bound.arguments["callbacks"] = [_Tracker(ch, loop)] + list(
            keras.tree.flatten(callbacks) if callbacks else ())
    try:
        try:
            out = call(*bound.args, **bound.kwargs)
        except BaseException as e:
            replacement = ch.failed_here(loop, e)
            if replacement is not None:
                raise replacement from e
            raise
        with ch.lock:
            total = sum(v for (lid, _), v in ch.my_ends.items()
                        if lid == loop.lid) if kind == "fit" else loop.done
        ch.finish(loop, total, _timeout(), stopped=kind == "fit" and bool(
            getattr(model, "stop_training", False)))
        return out
    finally:
        ch.end_loop(loop)


def _timeout():
    from sok_keras import world

    return world.timeout()
