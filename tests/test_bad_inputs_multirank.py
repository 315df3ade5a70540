"""The bad-input matrix on 2 ranks, in one sokrun job
(tests/workers/bad_inputs.py runs every cell of tests/bad_input_cases.py
eagerly and in a tf.function, then a few `fit` cases).

Every cell: the expected error (naming the table, the value, and for a bad
input on one rank that rank) or the right output, on every rank; no shard
changed; a good lookup right after is right on both ranks (the ranks are
still in step); an error has the same message on both ranks.
"""

import numpy as np

from tests import bad_input_cases as cases
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path


def _ours(message):
    return message.split("\n")[0]


def test_bad_input_matrix_on_two_ranks():
    results = run_workers(worker_path("bad_inputs"), 2, timeout=600)
    cells = cases.cells()
    wrong = {}
    for rank, r in enumerate(results):
        assert len(r["cases"]) == sum(
            len(cases.multirank_modes(i)) for i, _ in cells)
        for key, result in r["cases"].items():
            input_name, entry, _ = key.split("|")
            problems = cases.check_cell(result, input_name, entry, rank, 2,
                                        cases.BAD_RANK)
            if problems:
                wrong[f"rank {rank}: {key}"] = problems
        assert r["unchanged_overall"]
    assert not wrong, wrong
    # The same error on both ranks.
    r0, r1 = (r["cases"] for r in results)
    differ = {k: (r0[k]["message"], r1[k]["message"]) for k in r0
              if (r0[k]["error"], _ours(r0[k]["message"])) !=
              (r1[k]["error"], _ours(r1[k]["message"]))}
    assert not differ, differ

    f0, f1 = (r["fit"] for r in results)
    for f in (f0, f1):
        assert f["padding_only_rank_trained"]
        # NaN weights on rank 1: every rank skipped the step.
        assert f["nan_skipped_unchanged"] and f["nan_skipped_steps"] == 1
        # A bad id on rank 1 in fit: an error on every rank naming the
        # layer, the rank and the id; nothing changed.
        # (The rank that learns of the other's failure first raises
        # RankDivergedError quoting it, see sok_keras/divergence.py.)
        assert f["bad_id_error"] in ("InvalidArgumentError",
                                     "RankDivergedError"), f
        for word in ("fit_emb", "rank 1", "id 40"):
            assert word in f["bad_id_message"], (word, f["bad_id_message"])
        assert f["bad_id_unchanged"]
    # The padding-only rank's table equals the other's (one global table).
    np.testing.assert_array_equal(f0["padding_only_table"],
                                  f1["padding_only_table"])
