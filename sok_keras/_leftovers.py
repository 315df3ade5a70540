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
`.sok-tmp-<token>-load-*`, and while it runs holds an exclusive `flock`
on the lock file `.sok-tmp-<token>.lock` in the folder, into which it
writes the kernel it runs on (Linux' boot id, else the host name). The
kernel releases the lock when the process dies, however it dies.
`remove_dead(folder)`, at the start of the next operation there, takes
each lock it can: if the lock file names this kernel, its owner is gone,
and its entries are removed. A lock taken on a file that names another
kernel proves nothing (some shared file systems lock on each host
alone), so another host's files stay, as do a live operation's and any
name that is not a claimed token's. A user's file that a killed export or
`zipped=False` save had moved aside (`.<name>.sok-tmp-<token>.old`) is
moved back when nothing took its place.
"""

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import socket
import threading
import time
import weakref

MARK = "sok-tmp-"
_LOCK_SUFFIX = ".lock"
_active = threading.local()  # the claims this thread holds, innermost last
_CLAIMS = weakref.WeakSet()  # every live claim (for fork)
# A lock file with nothing in it is younger than this while its owner
# writes it; older and unlocked, its owner died before making anything.
_EMPTY_GRACE_S = 60.0


def _kernel():
    with contextlib.suppress(OSError), open(
            "/proc/sys/kernel/random/boot_id") as f:
        return "boot:" + f.read().strip()
    return "host:" + socket.gethostname()


def _lock_name(token):
    return f".{MARK}{token}{_LOCK_SUFFIX}"


def new_token():
    """12 random hex digits (an int below 2**48 for `int(token, 16)`)."""
    return secrets.token_hex(6)


def _stack():
    stack = getattr(_active, "claims", None)
    if stack is None:
        stack = _active.claims = []
    return stack


class Claim:
    """One operation's temporaries in `folder`: removes what dead
    operations left there, then holds the lock that marks this one's
    token as alive until `release()` (also a context manager).

    Args:
        folder: where the temporaries go.
        token: the names' token; by default a new one.
    """

    def __init__(self, folder, token=None):
        self.folder = folder or "."
        self.token = token or new_token()
        remove_dead(self.folder)
        self._fd = _acquire(os.path.join(self.folder,
                                         _lock_name(self.token)))
        _stack().append(self)
        _CLAIMS.add(self)

    def release(self):
        """Ends the claim. The lock file goes once the operation's
        temporaries are gone (else the next operation removes both)."""
        with contextlib.suppress(ValueError):
            _stack().remove(self)
        _CLAIMS.discard(self)
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if not _entries_of(self.folder, self.token):
                # Unlinked before the lock is released: a cleaner that
                # opens the name afterwards finds nothing.
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.folder,
                                           _lock_name(self.token)))
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def _forget_in_child():
    """A forked child does not own its parent's claims: it closes its copy
    of their locks (the parent's still hold them) and never removes them."""
    for claim in list(_CLAIMS):
        fd, claim._fd = claim._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _CLAIMS.clear()
    _active.claims = []


os.register_at_fork(after_in_child=_forget_in_child)


def active_token(folder):
    """The token of this thread's innermost claim on `folder`, or None
    (Keras' temporary files made inside a save or load take it)."""
    real = os.path.realpath(folder or ".")
    for claim in reversed(_stack()):
        if os.path.realpath(claim.folder) == real:
            return claim.token
    return None


def _acquire(path):
    """Creates `path`, locks it and writes this kernel into it; the fd, or
    None where it cannot (a folder that is not writable, no locks)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        return None
    try:
        for attempt in range(200):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 199:
                    raise
                time.sleep(0.01)  # a cleaner looks at it (it is empty)
        os.write(fd, json.dumps({"kernel": _kernel(),
                                 "pid": os.getpid()}).encode())
        return fd
    except OSError:  # (ENOLCK, EOPNOTSUPP...: no locks, no claim)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)
        return None


def _entries_of(folder, token):
    """The names in `folder` of `token`'s temporaries (not its lock)."""
    mark, lock = f"{MARK}{token}", _lock_name(token)
    try:
        return [e for e in os.listdir(folder) if mark in e and e != lock]
    except OSError:
        return []


def _restore_or_remove(folder, entry, token):
    """A `.old` entry holds what the user had at the target: moved back if
    nothing took its place (a kill between the two renames), removed if
    the new one is in place."""
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


def _dead_owner(fd, path):
    """Whether the lock file `path`, locked by us on `fd`, is a dead
    operation's of this kernel: "dead", "empty" (died before writing,
    long ago) or None (not ours to judge)."""
    try:
        with open(fd, "rb", closefd=False) as f:
            f.seek(0)
            text = f.read(4096)
        if not text:
            old = time.time() - os.fstat(fd).st_mtime > _EMPTY_GRACE_S
            return "empty" if old else None
        owner = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or owner.get("kernel") != _kernel():
        return None
    return "dead"


def remove_dead(folder):
    """Removes the temporaries in `folder` of operations whose process is
    gone (see the module); returns the names removed or moved back."""
    folder = folder or "."
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    prefix, done = f".{MARK}", []
    for lock in entries:
        if not (lock.startswith(prefix) and lock.endswith(_LOCK_SUFFIX)):
            continue
        token = lock[len(prefix):-len(_LOCK_SUFFIX)]
        if len(token) != 12 or any(c not in "0123456789abcdef"
                                   for c in token):
            continue
        path = os.path.join(folder, lock)
        try:
            # (Read-write: NFS makes flock a POSIX lock, which an
            # exclusive lock takes write access for.)
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # alive (or no locks here: nothing to judge)
            verdict = _dead_owner(fd, path)
            if verdict is None:
                continue
            if verdict == "dead":
                for entry in _entries_of(folder, token):
                    if entry.endswith(".old"):
                        _restore_or_remove(folder, entry, token)
                    else:
                        _remove(os.path.join(folder, entry))
                    done.append(entry)
            if not _entries_of(folder, token):
                with contextlib.suppress(OSError):
                    os.remove(path)
        finally:
            os.close(fd)
    return done
