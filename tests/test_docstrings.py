"""The `>>>` examples of sok_keras' docstrings run as written.

A user copies them: each runs with doctest on one process, with the names
of its module and `sok`, `np`, `tf` and `keras`. As in Keras, an example
that needs a model or data it does not make is a ```python block, not
`>>>`.
"""

import doctest
import importlib
import pkgutil

import pytest

import sok_keras


def _modules():
    names = ["sok_keras"]
    def failed(name):
        raise ImportError(f"{name} does not import")  # (else skipped)

    for info in pkgutil.walk_packages(sok_keras.__path__, "sok_keras.",
                                      onerror=failed):
        if info.name.startswith("sok_keras.examples"):
            continue  # programs, not API (run by tests/examples)
        if info.name.rsplit(".", 1)[1].startswith("_"):
            continue  # the compiled libraries and generated modules
        names.append(info.name)
    return sorted(names)


def _doctests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    out = []
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples and test.name.split(".")[0] == "sok_keras":
                out.append(test)
    return out


TESTS = {t.name: t for t in _doctests()}


def test_the_examples_are_found():
    # The layers, the lookups, the Variable and `init` show examples.
    for name in ("sok_keras.lookup.lookup_sparse",
                 "sok_keras.variable.Variable",
                 "sok_keras.layers.distributed_embedding.DistributedEmbedding",
                 "sok_keras.experiment"):
        assert any(t == name or t.startswith(name + ".") for t in TESTS), (
            name, sorted(TESTS))


@pytest.mark.parametrize("name", sorted(TESTS))
def test_docstring_example(name):
    import keras
    import numpy as np
    import tensorflow as tf

    sok_keras.init()  # one process (each example may call it again)
    test = TESTS[name]
    # doctest's own rule: the module's names, and these.
    test.globs = dict(test.globs, sok=sok_keras, np=np, tf=tf, keras=keras)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
