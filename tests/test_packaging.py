"""The source distribution and rebuilds of the op library (setup.py,
MANIFEST.in), as a user installing with pip meets them."""

import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.splitlines()
            if os.path.isfile(os.path.join(REPO, f))]


def _copy_of_the_checkout(into):
    """The tracked files, as a fresh clone has them (no build outputs)."""
    for name in _tracked_files():
        target = os.path.join(into, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), target)
    return into


def _setup(tree, *args, **env):
    return subprocess.run(
        [sys.executable, "setup.py", *args], cwd=tree,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env),
        capture_output=True, text=True, timeout=600)


def test_the_source_distribution_holds_every_file_the_build_reads(
        tmp_path):
    """QA: the sdist held only the sources setup.py lists, so building
    it (`pip install sok_keras-*.tar.gz`, `python -m build`) failed at
    the first header: "core/blocks.h: No such file or directory"."""
    tree = _copy_of_the_checkout(str(tmp_path / "src"))
    done = _setup(tree, "-q", "sdist", "-d", str(tmp_path / "dist"))
    assert done.returncode == 0, done.stderr
    (archive,) = os.listdir(tmp_path / "dist")
    with tarfile.open(tmp_path / "dist" / archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {f for f in _tracked_files() if f.startswith("csrc/")
              and f.endswith((".h", ".cuh", ".cc", ".c"))}
    assert wanted and not wanted - names, sorted(wanted - names)
    assert {"setup.py", "setup.cfg", "pyproject.toml", "README.md",
            "LICENSE", "sok_keras/__init__.py", "sokrun.py"} <= names
    # The README's links (QA: the archive had no docs/).
    docs = {f for f in _tracked_files() if f.startswith("docs/")}
    assert "docs/install.md" in docs and not docs - names, sorted(
        docs - names)
    assert {"bench/RESULTS.md", "Makefile"} <= names
    # The README's `make test` runs from the archive: every test file
    # (QA: setuptools 84 put in tests/test_*.py without conftest.py).
    tests = {f for f in _tracked_files() if f.startswith("tests/")}
    assert "tests/conftest.py" in tests and not tests - names, sorted(
        tests - names)
    assert not [n for n in names
                if n.endswith((".so", ".o", "_build_info.py"))], names


def test_a_rebuild_for_another_tensorflow_compiles_again(tmp_path):
    """QA: `pip install .` leaves `build/` in the checkout; the next build
    there (after a TensorFlow upgrade, as the version error advises)
    found the sources older than the library, kept the old library and
    wrote the new TensorFlow's version beside it. The build now records
    what it compiled for (`sok_build_key.json`) and compiles everything
    again when that changes, or when any header does; an unchanged tree
    is not compiled again."""
    tree = _copy_of_the_checkout(str(tmp_path / "src"))
    # Four sources that link alone (the build's rules are the same for
    # any; the whole library three times took ~4 minutes of CI).
    kept = {"csrc/core/device.cc", "csrc/core/inflight.cc",
            "csrc/tf/build_info_ops.cc", "csrc/tf/inflight_ops.cc"}
    for folder, _, names in os.walk(os.path.join(tree, "csrc")):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), tree)
            if name.endswith(".cc") and rel.replace(os.sep, "/") not in kept:
                os.remove(os.path.join(folder, name))
    args = ("build_ext", "-b", str(tmp_path / "lib"),
            "-t", str(tmp_path / "temp"))

    def compiled():
        done = _setup(tree, *args, SOK_CUDA="0")
        assert done.returncode == 0, done.stdout + done.stderr
        return {line.split(" -c ")[1].split()[0]
                for line in done.stdout.splitlines() if " -c csrc/" in line}

    assert compiled() >= kept  # every source
    assert compiled() == set()  # up to date
    stamp = tmp_path / "temp" / "sok_build_key.json"
    stamp.write_text(stamp.read_text().replace('"tensorflow": "',
                                               '"tensorflow": "0.'))
    assert compiled() >= kept  # what the objects were built for changed
    # (distutils compares whole seconds: a header edited later)
    later = time.time() + 5
    os.utime(os.path.join(tree, "csrc", "core", "status.h"), (later, later))
    assert compiled() >= kept  # a header
    # The build info goes beside the library it describes, naming it: a
    # build elsewhere leaves the checkout's alone (QA: a wheel's or
    # another Python's build rewrote it).
    assert not os.path.exists(os.path.join(tree, "sok_keras",
                                           "_build_info.py"))
    info = (tmp_path / "lib" / "sok_keras" / "_build_info.py").read_text()
    assert "SOURCES_SHA256 = '" in info and "LIBRARY = '_sok_ops." in info
