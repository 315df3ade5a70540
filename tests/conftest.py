import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


_tests_since_gc = [0]


@pytest.fixture(autouse=True)
def _clear_session():
    # Keras' state is reset before every test; Python's garbage collection
    # (clear_session's `free_memory`, ~0.2 s of CPU in a process that has
    # TensorFlow loaded, which made it most of a small test's time) only
    # every 20 tests, to bound the memory of old models.
    _tests_since_gc[0] += 1
    collect = _tests_since_gc[0] >= 20
    if collect:
        _tests_since_gc[0] = 0
    keras.utils.clear_session(free_memory=collect)
    yield


# -- scheduling under pytest-xdist (`--dist loadgroup`, see pyproject.toml) --
#
# The suite's time is dominated by a few multi-process jobs (each starts 2-3
# TensorFlow workers). With the tests in file order, a 3-minute job could
# start last and run alone at the end. Under `--dist loadgroup` xdist hands
# out work units one at a time in collection order, so the collection is
# sorted here: the longest units first (known costs below), then the rest in
# file order. The order changes nothing else: each test sets up what it
# needs.

# Seconds of a test (its node id, or its node id without parameters) with
# its setup, roughly: wall seconds under `-n 3` on the 2-core CI machine,
# from the CPU report (SOK_TEST_CPU_REPORT, below) of the run before the
# launches were shared, scaled by each module's CPU after (a module
# fixture's workers are counted with the test that sets it up; the tests
# of a module in _WHOLE_MODULES add up to one unit). Only the order
# matters; a test not listed counts one second.
_KNOWN_SECONDS = {
    # test_checkpoint.py (one unit): 9 launches, ~200 s of CPU.
    "tests/test_checkpoint.py::test_fit_killed_mid_epoch_resumes_to_the_"
    "uninterrupted_result": 170,
    "tests/test_checkpoint.py::test_dump_on_two_ranks_load_on_one_and_"
    "three": 110,
    "tests/test_checkpoint.py::test_dump_killed_midway_leaves_the_"
    "previous_checkpoint": 30,
    "tests/test_checkpoint.py::test_error_on_one_rank_fails_every_rank_"
    "and_loads_nothing": 30,
    # test_save_load_multirank.py (one unit): a 2-rank and a 3-rank job
    # for three tests, and the lookup-order test.
    "tests/test_save_load_multirank.py::test_save_on_two_ranks_load_on_"
    "one_and_three": 230,
    "tests/test_save_load_multirank.py::test_mismatched_lookup_order_in_"
    "a_custom_function_is_refused": 20,
    # test_lookup_multirank.py (one unit).
    "tests/test_lookup_multirank.py::test_pooling_on_the_owner_equals_"
    "pooling_at_home": 130,
    "tests/test_lookup_multirank.py::test_padding_only_rank_empty_batch_"
    "and_mixed_precision": 100,
    "tests/test_bad_inputs_multirank.py::test_bad_input_matrix_on_two_ranks":
        190,
    "tests/test_training_multirank.py::test_fit_on_ranks_matches_one_"
    "process": 66,
    "tests/test_training_multirank.py::test_clipping_engages_in_the_"
    "clipped_references": 50,
    "tests/test_recipes_strategy.py::test_sok_adopts_the_programs_strategy":
        100,
    "tests/test_decisions_multirank.py::test_plateau_callbacks_decide_alike_"
    "from_global_val_loss": 85,
    "tests/test_recipes_horovod.py::test_world_and_collectives": 96,
    "tests/layers/test_layers_multirank.py::test_all_layers_fit_on_ranks_"
    "matches_one_process": 67,
    "tests/test_world_launchers.py::test_two_ranks_without_sokrun": 55,
    "tests/test_saving.py::test_every_rank_saves_one_file_atomically": 61,
    "tests/test_saving.py::test_a_save_killed_half_way_leaves_the_previous_"
    "file_loadable": 60,
    "tests/test_recipes_mirrored.py::test_tables_are_sharded_over_the_"
    "replicas": 40,
    "tests/test_bench_scripts.py::test_dlrm_scaling_driver_on_one_and_two_"
    "ranks": 100,
    "tests/test_tensorboard.py::test_tensorboard_on_two_ranks": 55,
    "tests/test_consistency.py::test_different_tables_raise_on_every_rank":
        8,
    "tests/test_saving.py::test_save_on_rank_0_only_fails_fast_with_a_clear_"
    "error": 43,
    "tests/test_comm.py::test_collectives[3]": 39,
    "tests/test_comm.py::test_collectives[2]": 30,
    "tests/test_seed_example_multirank.py::test_seed_example_distributed_on_"
    "two_ranks": 35,
    "tests/test_notebooks.py::test_notebook_runs[quickstart.ipynb]": 36,
    "tests/layers/test_halfprec_layers.py::test_all_layers_bfloat16_fit_on_"
    "two_ranks_matches_one_process": 35,
    "tests/test_global_views.py::test_global_views_on_two_ranks": 32,
    "tests/test_init_global.py::test_tables_are_bit_identical_on_1_2_and_3_"
    "ranks[3]": 28,
    "tests/optimizers/test_auto_wrap.py::test_plain_adam_on_two_ranks_keeps_"
    "dense_weights_equal": 27,
    "tests/test_serving.py::test_export_serves_the_same_predictions_without_"
    "sok_keras": 26,
}
_DEFAULT_SECONDS = 1
# A module's default instead, where most tests launch a job of their own:
# test_divergence.py (one unit), 10 launches among 17 tests.
_MODULE_SECONDS = {"tests/test_divergence.py": 14}


# Modules whose module-scoped fixtures launch workers: each is one work
# unit, so that those workers run once. (Not via `xdist_group` markers:
# pytest-xdist 3.8 renames `item._nodeid`, which pytest 9 no longer reads.)
_WHOLE_MODULES = {
    "tests/test_checkpoint.py", "tests/test_decisions_multirank.py",
    "tests/test_recipes_horovod.py", "tests/test_recipes_mirrored.py",
    "tests/test_recipes_strategy.py", "tests/test_training_multirank.py",
    "tests/test_lookup_multirank.py", "tests/test_save_load_multirank.py",
    "tests/test_consistency.py", "tests/test_seed_example_multirank.py",
    "tests/test_divergence.py", "tests/test_world_launchers.py",
    "tests/layers/test_keras_rs.py", "tests/layers/test_layers_multirank.py",
}


# Tests of those modules that form a unit of their own (they share no
# module fixture's workers with the rest of their module): test name ->
# unit.
_OWN_UNITS = {
    # ShardedCheckpoint and BackupAndRestore in fit (fixtures killed_fits,
    # resumed_fits): 5 launches, beside the dump/load tests' 4.
    "tests/test_checkpoint.py::test_fit_killed_mid_epoch_resumes_to_the_"
    "uninterrupted_result": "tests/test_checkpoint.py (fit)",
    "tests/test_checkpoint.py::test_backup_and_restore_resumes_a_killed_fit":
        "tests/test_checkpoint.py (fit)",
    "tests/test_save_load_multirank.py::test_mismatched_lookup_order_in_"
    "a_custom_function_is_refused": "tests/test_save_load_multirank.py "
                                    "(order)",
}


def _unit(nodeid):
    """The work unit of a test: its entry in _OWN_UNITS, else its module in
    _WHOLE_MODULES, else itself."""
    if nodeid.split("[")[0] in _OWN_UNITS:
        return _OWN_UNITS[nodeid.split("[")[0]]
    module = nodeid.split("::")[0]
    return module if module in _WHOLE_MODULES else nodeid


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Units(LoadScopeScheduling):
        # Units in collection order (the workers sort it, below).
        def _split_scope(self, nodeid):
            return _unit(nodeid)

    return _Units(config, log)


def _seconds(item):
    for key in (item.nodeid, item.nodeid.split("[")[0]):
        if key in _KNOWN_SECONDS:
            return _KNOWN_SECONDS[key]
    return _MODULE_SECONDS.get(item.nodeid.split("::")[0], _DEFAULT_SECONDS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Only in an xdist worker under loadgroup: a plain run keeps file order,
    # and `--dist load` sends blocks of consecutive tests, for which
    # longest-first would put every long job on one worker.
    # (A worker's own `dist` is "no"; xdist sets `loadgroup` there.)
    if (not os.environ.get("PYTEST_XDIST_WORKER")
            or not getattr(config.option, "loadgroup", False)):
        return
    units = {}  # unit -> [seconds, first index, items]
    for index, item in enumerate(items):
        unit = units.setdefault(_unit(item.nodeid), [0, index, []])
        unit[0] += _seconds(item)
        unit[2].append(item)
    ordered = sorted(units.values(), key=lambda u: (-u[0], u[1]))
    items[:] = [item for unit in ordered for item in unit[2]]


# -- opt-in CPU report (`SOK_TEST_CPU_REPORT=path`) --
#
# Per test: CPU seconds of the pytest process itself plus those of its
# reaped children (sokrun jobs and their ranks, forked ones too; other
# Python subprocesses),
# around its setup + call + teardown (a module fixture is charged to the
# test that sets it up or tears it down), its wall time, and the Python /
# sokrun processes it started (`launches`; `ranks` counts sokrun's ranks as
# well). Each process (each xdist worker) appends its lines to
# `path.raw`; the process that ends the session (xdist's controller, or a
# plain run) writes them to `path`, the most CPU first, with totals.

_CPU_REPORT = os.environ.get("SOK_TEST_CPU_REPORT")
_launch_counts = [0, 0]  # [launches, ranks] since the last test began


def _count_launch(cmd):
    import sys

    argv = [cmd] if isinstance(cmd, (str, bytes)) else list(cmd or ())
    argv = [a.decode() if isinstance(a, bytes) else str(a) for a in argv]
    if len(argv) == 1 and " " in argv[0]:
        argv = argv[0].split()
    names = [os.path.basename(a) for a in argv]
    if "sokrun" in names or "sokrun.py" in names:
        ranks = 1
        if "-np" in argv[:-1]:
            try:
                ranks = int(argv[argv.index("-np") + 1])
            except ValueError:
                pass
        _launch_counts[0] += 1
        _launch_counts[1] += 1 + ranks
    elif argv and (argv[0] == sys.executable
                   or names[0].startswith("python")):
        _launch_counts[0] += 1
        _launch_counts[1] += 1


if _CPU_REPORT:
    import subprocess as _subprocess

    _popen_init = _subprocess.Popen.__init__

    def _counting_popen_init(self, args, *rest, **kwargs):
        _count_launch(args)
        _popen_init(self, args, *rest, **kwargs)

    _subprocess.Popen.__init__ = _counting_popen_init


def _cpu_seconds():
    import resource
    import sys

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = 0.0  # ranks forked by the fork server (tests/forkserver.py)
    harness = sys.modules.get("multiprocess") or sys.modules.get(
        "tests.multiprocess")  # one module under both names
    if harness is not None:
        forked = harness.forked_cpu_seconds()
    return (own.ru_utime + own.ru_stime,
            kids.ru_utime + kids.ru_stime + forked)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_REPORT:
        yield
        return
    import time

    _launch_counts[:] = [0, 0]
    own0, kids0 = _cpu_seconds()
    wall0 = time.monotonic()
    yield
    wall = time.monotonic() - wall0
    own1, kids1 = _cpu_seconds()
    line = "\t".join([
        f"{own1 - own0 + kids1 - kids0:.2f}", f"{own1 - own0:.2f}",
        f"{kids1 - kids0:.2f}", f"{wall:.2f}", str(_launch_counts[0]),
        str(_launch_counts[1]), item.nodeid,
    ])
    with open(_CPU_REPORT + ".raw", "a") as f:
        f.write(line + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if _CPU_REPORT and not os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            os.remove(_CPU_REPORT + ".raw")
        except FileNotFoundError:
            pass


def pytest_sessionfinish(session):
    if not _CPU_REPORT or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        with open(_CPU_REPORT + ".raw") as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    except FileNotFoundError:
        rows = []
    rows.sort(key=lambda r: -float(r[0]))
    totals = [sum(float(r[i]) for r in rows) for i in range(4)]
    totals += [sum(int(r[i]) for r in rows) for i in (4, 5)]
    with open(_CPU_REPORT, "w") as f:
        f.write("# cpu_s\tpytest_s\tchildren_s\twall_s\tlaunches\tprocs\t"
                "test\n")
        f.write("\t".join(f"{t:.2f}" for t in totals[:4]) + "\t"
                + "\t".join(str(t) for t in totals[4:])
                + f"\tTOTAL ({len(rows)} tests)\n")
        for r in rows:
            f.write("\t".join(r) + "\n")
