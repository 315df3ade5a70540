"""Which build of the op library to load, and the digest of its sources
(`csrc/`); standard library only (`setup.py` and `sokrun` load this file
by path).

`setup.py` records the digest in `_build_info.py` when it builds the
library; a source checkout's import compares it with `csrc/` as it is now
(`_ops`), so that a library left from older sources (a `git pull` after an
editable install) is named at import, not by a missing op in the first
step.
"""

import glob
import hashlib
import importlib.machinery
import os

# The files of csrc/ a build reads.
SUFFIXES = (".h", ".cuh", ".cc", ".c")


def files(root):
    """The paths (relative to `root`, with "/") of the source files under
    `root/csrc` a build reads, in a fixed order. As setup.py's glob: no
    hidden files (an editor's lock file, `.#lookup.cc`, a dangling link),
    only files that exist."""
    found = []
    for folder, dirs, names in os.walk(os.path.join(root, "csrc")):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = os.path.join(folder, name)
            if (not name.startswith(".") and name.endswith(SUFFIXES)
                    and os.path.isfile(path)):
                found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return found


def digest(root):
    """The SHA-256 of every source file under `root/csrc` (`files`): their
    paths and contents, in a fixed order."""
    h = hashlib.sha256()
    for rel in files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def built_library(folder, stem):
    """`folder/<stem><suffix>`: the build of a compiled library for this
    Python (its extension suffix), else any other build of it there;
    None if there is none. (QA: a checkout built for two Pythons took
    the first name in order, another Python's.)"""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, stem + suffix)
        if os.path.exists(path):
            return path
    found = sorted(glob.glob(os.path.join(folder, stem + "*.so")))
    return found[0] if found else None
