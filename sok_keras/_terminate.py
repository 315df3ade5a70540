"""A SIGTERM during a save or load removes its temporary files first.

Saving and loading a model with sok tables goes through files on disk
(`sok_keras._keras_h5`): the writer builds the weights in a temporary file
beside the `.keras` file (and sok's writer renames a hidden
`.<name>.sok-tmp-<token>.keras` into place), and each reader extracts the
whole `model.weights.h5` into a `.sok-tmp-<token>-load-*` folder beside
it (`_leftovers`: what a SIGKILL leaves goes at the next operation). Each is removed in
a `finally` block, which Python's default SIGTERM (death at once) skips:
`sokrun --timeout`, Slurm or Kubernetes stopping a job mid-load would leave
a full copy of the weights per rank on disk.

`on_sigterm_clean_up()` turns a SIGTERM into an exception for the time of
the call, so those `finally` blocks run, and then lets the signal kill the
process as it would have (the exit status is still "killed by SIGTERM").
It changes nothing where the program has its own SIGTERM handler, or off
the main thread. A signal that arrives while the main thread waits inside
TensorFlow is handled when that call returns (sokrun's SIGKILL follows
after `--grace` seconds in any case).
"""

import contextlib
import functools
import os
import signal
import threading

_DEPTH = 0  # nested guarded calls on the main thread
_RECEIVED = False


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM inside a guarded call."""


def _handler(signum, frame):
    global _RECEIVED
    del frame
    _RECEIVED = True
    # Once: a second SIGTERM while cleaning up kills at once.
    signal.signal(signum, signal.SIG_DFL)
    raise _Terminated()


@contextlib.contextmanager
def on_sigterm_clean_up():
    """Runs the body with SIGTERM raised as an exception (see module).

    The outermost call re-sends the signal to the process once the body
    has unwound, so the process dies of it after every `finally` ran.
    """
    global _DEPTH, _RECEIVED
    if _DEPTH:
        _DEPTH += 1
        try:
            yield
        finally:
            _DEPTH -= 1
        return
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    _DEPTH, _RECEIVED = 1, False
    signal.signal(signal.SIGTERM, _handler)
    stopped = None
    try:
        yield
    except _Terminated as e:  # the process ends below
        stopped = e
    finally:
        _DEPTH = 0
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _RECEIVED:
        # Even if Keras swallowed the exception (a bare `except:` falls back
        # to reading the zip): the signal still ends the process.
        _die_of_sigterm(stopped)


def _die_of_sigterm(stopped):
    """Ends the process as SIGTERM would have, once the frames that the
    exception `stopped` unwound have let go of their locals: a temporary
    file whose `finally` the signal interrupted (Keras' `NamedTemporaryFile`
    of the weights, whose copy into the zip it stopped) is removed when its
    object goes."""
    import gc
    import traceback

    seen = set()
    while stopped is not None and id(stopped) not in seen:
        seen.add(id(stopped))
        traceback.clear_frames(stopped.__traceback__)
        stopped = stopped.__context__
    gc.collect()
    try:
        from sok_keras import divergence

        ch = divergence.channel()
        if ch is not None:  # the other ranks learn why, not "no word"
            ch.publish(t="failed", msg=f"rank {ch.rank} received SIGTERM "
                       "during a model save or load")
    except Exception:  # noqa: BLE001 - best effort while dying
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # (not reached: SIGTERM's default)


def guarded(fn):
    """`fn` run under `on_sigterm_clean_up()`."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with on_sigterm_clean_up():
            return fn(*args, **kwargs)

    call._sok_keras = True
    return call
