"""Runs several worker scripts one after the other in one process: one
launch (one TensorFlow start per rank) for several scenarios.

argv: SCRIPT [ARGS...] [+ SCRIPT [ARGS...]]...

Each script (a file of tests/workers/, `.py` optional) runs as `__main__`
with its own `sys.argv`, after `keras.utils.clear_session()` (the names of
its layers and variables are those of a fresh process). What it passes to
`write_result` is collected; this rank's result is `{"cases": [result,
...]}` in script order (`tests/multiprocess.py` `run_sequence`). Each case
is announced on stdout (`[case i] script args`), so that a failure in the
job's output names its case; `sys.exit(0)` ends a case, another exit code
ends the job. A script that changes module state for its own
checks (a patched function, a chunk size) must come last or restore it.
"""

import os
import runpy
import sys

import _worker

HERE = os.path.dirname(os.path.abspath(__file__))


def split_cases(argv):
    cases, current = [], []
    for arg in argv:
        if arg == "+":
            cases.append(current)
            current = []
        else:
            current.append(arg)
    cases.append(current)
    if any(not c for c in cases):
        raise SystemExit(f"sequence: an empty case in {argv!r}")
    return cases


results = []
write_result = _worker.write_result
for index, (script, *args) in enumerate(split_cases(sys.argv[1:])):
    if not script.endswith(".py"):
        script += ".py"
    print(f"[case {index}] {script} {' '.join(args)}", flush=True)
    if index:
        import keras

        keras.utils.clear_session()
    got = []
    _worker.write_result = got.append
    sys.argv = [os.path.join(HERE, script), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:  # sys.exit(0) ends a case; anything else fails
        if e.code not in (None, 0):
            raise
    if len(got) != 1:
        raise SystemExit(f"sequence: case {index} ({script} {args}) wrote "
                         f"{len(got)} results, not one")
    results.append(dict(got[0], pid=os.getpid()))
write_result({"cases": results})
