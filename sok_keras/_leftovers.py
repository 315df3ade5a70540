"""The temporary files of saves, loads and exports name their owner, so
that what a killed process left behind is removed by the next one.

Saving, loading and exporting a model with sok tables write beside the
user's file: the hidden file or folder that is renamed into place
(`.<name>.sok-tmp-<owner>.keras`, `.<name>.sok-tmp-<owner>` for an
export), Keras' weights file (`.sok-tmp-weights-<owner>-*`) and each
loading rank's extracted copy of the weights (`.sok-tmp-load-<owner>-*`).
Each is as large as the weights. A save or load that fails, or is stopped
by SIGTERM (`_terminate`), removes its own; a process killed outright
(SIGKILL, the OOM killer, a preemption's grace running out) removes
nothing.

`<owner>` is `<host>-<pid>`, `<host>` eight hex digits of the host name
and the process' PID namespace. Before writing into a folder, or loading
from it, `remove_dead(folder)` removes the entries whose owner is on this
host (and in this PID namespace) and no longer runs. A live owner's
entries (another save in progress), another host's (a shared disk, where
this host cannot tell) and names of any other form are left alone.
"""

import contextlib
import os
import re
import shutil
import socket
import zlib

MARK = "sok-tmp-"
# `.<name>.sok-tmp-<host>-<pid>[.<suffix>]` and
# `.sok-tmp-<kind>-<host>-<pid>-<random>`.
_ENTRY = re.compile(r"^\..*?" + re.escape(MARK)
                    + r"(?:weights-|load-)?([0-9a-f]{8})-([0-9]+)(?:$|[.-])")


def host_tag():
    """Eight hex digits naming this host and PID namespace (containers
    sharing a host name, with `--network host`, have PID namespaces of
    their own, and a PID is only meaningful inside one)."""
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    key = f"{socket.gethostname()}\0{namespace}".encode()
    return f"{zlib.crc32(key):08x}"


def owner(pid=None, host=None):
    """`<host>-<pid>`: this process' by default."""
    return f"{host_tag() if host is None else host}-" \
           f"{os.getpid() if pid is None else pid}"


def _gone(host, pid):
    if host != host_tag():
        return False  # another host's: it may be running there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False  # EPERM: it runs, as another user
    return False


def remove_dead(folder):
    """Removes the temporary files and folders in `folder` whose owner,
    on this host, no longer runs; returns their names."""
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        match = _ENTRY.match(entry)
        if match is None or not _gone(match.group(1), int(match.group(2))):
            continue
        path = os.path.join(folder, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError:
            continue  # (removed meanwhile, or not ours to remove)
        removed.append(entry)
    return removed
