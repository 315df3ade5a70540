"""What a killed save, load or export left beside the user's files goes
at the next one in that folder.

Saving, loading and exporting a model with sok tables write beside the
user's file: the hidden file or folder that is renamed into place, Keras'
weights file, and each loading rank's extracted copy of the weights, each
as large as the weights. A save or load that fails, or is stopped by
SIGTERM (`_terminate`), removes its own; a process killed outright
(SIGKILL, the OOM killer, a preemption's grace running out) removes
nothing.

Each operation (`Claim`) names its temporaries with a random token,
`.<name>.sok-tmp-<token>.keras`, `.sok-tmp-<token>-weights-*`,
`.sok-tmp-<token>-load-*`, and holds an exclusive `flock` on a lock file
`.sok-tmp-<token>.lock` in the folder while it runs. The kernel releases
the lock when the process dies, however it dies. `remove_dead(folder)`,
at the start of the next operation there, takes each lock it can: those
tokens' owners are gone, and their entries are removed. A user's file
that a killed export or `zipped=False` save had moved aside
(`.<name>.sok-tmp-<token>.old`) is moved back when nothing took its
place. A live operation's lock cannot be taken, on this host or another
(flock through NFS is a lock on the server), so its files stay; where the
file system has no locks, nothing is removed.
"""

import contextlib
import fcntl
import os
import secrets
import shutil
import threading

MARK = "sok-tmp-"
_LOCK_SUFFIX = ".lock"
_active = threading.local()  # the claims this thread holds, innermost last


def _lock_name(token):
    return f".{MARK}{token}{_LOCK_SUFFIX}"


def new_token():
    """12 random hex digits (an int below 2**48 for `int(token, 16)`)."""
    return secrets.token_hex(6)


class Claim:
    """One operation's temporaries in `folder`: removes what dead
    operations left there, then holds the lock that marks this one's
    token as alive until `release()` (also a context manager).

    Args:
        folder: where the temporaries go.
        token: the names' token (another rank's, agreed); by default a
            new one.
        lock: whether this process writes the temporaries (holds the
            lock); False for ranks that only name rank 0's.
    """

    def __init__(self, folder, token=None, lock=True):
        self.folder = folder or "."
        self.token = token or new_token()
        self._fd = None
        if lock:
            remove_dead(self.folder)
            self._fd = _locked(os.path.join(self.folder,
                                            _lock_name(self.token)),
                               create=True)
        stack = getattr(_active, "claims", None)
        if stack is None:
            stack = _active.claims = []
        stack.append(self)

    def release(self):
        stack = getattr(_active, "claims", [])
        if self in stack:
            stack.remove(self)
        if self._fd is not None:
            # Unlinked first: a cleaner that opens the name afterwards
            # finds nothing; one that opened it before gets the lock only
            # once this operation's temporaries are gone.
            with contextlib.suppress(OSError):
                os.remove(os.path.join(self.folder, _lock_name(self.token)))
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def active_token(folder):
    """The token of this thread's innermost claim on `folder`, or None
    (Keras' temporary files made inside a save or load take it)."""
    real = os.path.realpath(folder or ".")
    for claim in reversed(getattr(_active, "claims", [])):
        if os.path.realpath(claim.folder) == real:
            return claim.token
    return None


def _locked(path, create=False):
    """An fd of `path` holding an exclusive flock, or None (held by a live
    process, gone, or the file system has no locks)."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        if create:  # no locks here: no lock file either
            with contextlib.suppress(OSError):
                os.remove(path)
        return None
    return fd


def _restore_or_remove(folder, entry, token):
    """A `.old` entry holds what the user had at the target: moved back if
    nothing took its place (a kill between the two renames), else
    removed."""
    path = os.path.join(folder, entry)
    original = os.path.join(
        folder, entry[1:-len(".old")].replace(f".{MARK}{token}", "", 1))
    if not os.path.lexists(original):
        with contextlib.suppress(OSError):
            os.replace(path, original)
            return
    _remove(path)


def _remove(path):
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def remove_dead(folder):
    """Removes the temporaries in `folder` of operations whose process is
    gone (see the module); returns the names removed or moved back."""
    folder = folder or "."
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    done = []
    prefix = f".{MARK}"
    for lock in entries:
        if not (lock.startswith(prefix) and lock.endswith(_LOCK_SUFFIX)):
            continue
        token = lock[len(prefix):-len(_LOCK_SUFFIX)]
        if len(token) != 12 or not all(c in "0123456789abcdef"
                                       for c in token):
            continue
        fd = _locked(os.path.join(folder, lock))
        if fd is None:
            continue  # alive (or not ours to judge)
        try:
            mark = f"{MARK}{token}"
            for entry in entries:
                if entry == lock or mark not in entry:
                    continue
                if entry.endswith(".old"):
                    _restore_or_remove(folder, entry, token)
                else:
                    _remove(os.path.join(folder, entry))
                done.append(entry)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, lock))
        finally:
            os.close(fd)
    return done
