"""model.fit on 2 and 3 ranks equals one process (issue P2 / P3 parity)."""

import keras
import numpy as np
import pytest

from sok_keras.optimizers import OptimizerWrapper
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.training_setup import VOCAB
from tests.training_setup import make_model_and_data

STEPS, GLOBAL_BATCH = 24, 48


def _single_process(embedding, opt_name, wrap):
    keras.utils.clear_session()
    model, optimizer, (x, y) = make_model_and_data(
        embedding, opt_name, STEPS, GLOBAL_BATCH)
    model.compile(optimizer=OptimizerWrapper(optimizer) if wrap else optimizer,
                  loss="binary_crossentropy")
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    emb = model.get_layer("embedding").embeddings
    table = emb.read_global() if embedding == "sok" else emb.numpy()
    return losses, table


@pytest.fixture(scope="module")
def references():
    return {
        # P2: plain Keras on one device.
        "sgd": _single_process("keras", "sgd", wrap=False),
        # P3: the lazy rules on one process (Keras' dense Adam differs by
        # design: it decays every row's moments each step).
        "adam": _single_process("sok", "adam", wrap=True),
        "momentum_clipnorm": _single_process(
            "sok", "momentum_clipnorm", wrap=True),
        "adam_global_clipnorm": _single_process(
            "sok", "adam_global_clipnorm", wrap=True),
        "adam_accumulate": _single_process(
            "sok", "adam_accumulate", wrap=True),
    }


def test_clipping_engages_in_the_clipped_references(references):
    # Otherwise the clipped runs would not test clipping across ranks.
    assert not np.allclose(references["adam_global_clipnorm"][0],
                           references["adam"][0], rtol=1e-4)
    from tests import training_setup

    training_setup.OPTIMIZERS["momentum"] = lambda: (
        keras.optimizers.SGD(0.05, momentum=0.9))
    try:
        unclipped = _single_process("sok", "momentum", wrap=True)
    finally:
        del training_setup.OPTIMIZERS["momentum"]
    assert not np.allclose(references["momentum_clipnorm"][0], unclipped[0],
                           rtol=1e-4)


def test_accumulation_engages_in_its_reference(references):
    assert not np.allclose(references["adam_accumulate"][1],
                           references["adam"][1], rtol=1e-3)


# Every optimizer at 2 ranks; at 3 (uneven shards, two peers per rank) the
# two whose update reduces norms over every rank's shard: the plain rules
# are rank-count independent past the exchange, which both cover.
OPTIMIZERS = {2: ["sgd", "adam", "momentum_clipnorm", "adam_global_clipnorm",
                  "adam_accumulate"],
              3: ["momentum_clipnorm", "adam_global_clipnorm"]}


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_fit_on_ranks_matches_one_process(num_ranks, references):
    results = run_workers(
        worker_path("dlrm_fit"), num_ranks,
        args=[STEPS, GLOBAL_BATCH, *OPTIMIZERS[num_ranks]], timeout=300)
    rows = sum(VOCAB)
    for opt_name in OPTIMIZERS[num_ranks]:
        ref_losses, ref_table = references[opt_name]
        local_rows = [r[opt_name]["local_rows"] for r in results]
        assert sum(local_rows) == rows and len(set(local_rows)) <= 2
        for r in results:
            got = r[opt_name]
            assert len(got["losses"]) == STEPS
            np.testing.assert_allclose(got["losses"], ref_losses, rtol=1e-5,
                                       err_msg=opt_name)
            np.testing.assert_allclose(np.array(got["table"]), ref_table,
                                       rtol=1e-5, atol=1e-6, err_msg=opt_name)
            # Dense weights identical on every rank.
            assert got["dense"] == results[0][opt_name]["dense"]


def test_rank_crash_mid_training_stops_the_job():
    from tests.multiprocess import launch

    job = launch(worker_path("crash_mid_fit"), 2, timeout=120, grace=3)
    assert job.returncode != 0, job.output
    assert "rank 1 fails on purpose at batch 4" in job.output
    assert "[1]" in job.output
    assert job.elapsed < 90, job.output  # nobody waited for the timeout
    assert job.leftovers == []


def test_a_custom_loop_with_a_tf_variable_on_two_ranks_equals_one(tmp_path):
    """A plain `tf.Variable` as the dense weight (TensorFlow's, not
    Keras'): OptimizerWrapper trains it on 2 ranks as on 1 process (before:
    its broadcast read `tf.Variable.value`, a method, and failed), and
    `sok.dump` / `sok.load` take it (before: it had no `path`)."""
    out = {}
    for n in (1, 2):
        results = run_workers(worker_path("tf_variable_loop"), n,
                              args=[str(tmp_path / f"ck{n}")])
        for r in results:
            np.testing.assert_allclose(r["final"][1], results[0]["final"][1])
            for a, b in zip(r["resumed"], r["final"]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        out[n] = results[0]["final"]
    for a, b in zip(out[2], out[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_a_sequential_with_no_input_on_two_ranks_equals_one(dtype):
    """Keras builds such a model, and its optimizer, inside the first
    traced step; on 2 ranks the optimizer's broadcast of the dense weights
    there read variables with no value yet, and every rank failed. It is
    built from the first batch's shapes now, before the step, pulling no
    batch (int ids: a dataset reshuffled each epoch, whose first epoch a
    pulled batch made another order than one process's)."""
    out = {n: run_workers(worker_path("sequential_no_input"), n,
                          args=[dtype]) for n in (1, 2)}
    for r in out[2]:
        for key in ("table", "kernel"):
            np.testing.assert_allclose(r[key], out[1][0][key], rtol=1e-5,
                                       atol=1e-6, err_msg=key)


def test_losses_divided_by_data_dependent_counts_on_two_ranks_equal_one():
    """Keras divides a masked loss by the unmasked positions and a
    `mean_with_sample_weight` loss by the weights' sum. Each rank divided
    by its own, so with padding (or weights) spread unevenly over the
    ranks, 2 ranks trained another model than 1 process (QA: 0.13 off
    after three steps; the logged and evaluated losses differed too). The
    divisors are the ranks' mean count now (`sok_keras/global_losses.py`):
    two masked outputs with steps_per_execution=2, evaluate,
    mean_with_sample_weight through fit and train_on_batch, a
    `reduction="sum"` loss (each rank's sum was averaged: half the global
    sum on 2 ranks; now multiplied by N), and a custom
    train_step calling `compute_loss`. A `compute_loss` whose loss is in a
    `tf.cond` on the rank's data runs (no collective in a branch: the
    rank's own count there)."""
    out = {n: run_workers(worker_path("masked_losses"), n, timeout=180)
           for n in (1, 2)}
    one = out[1][0]
    for r in out[2]:
        for key in ("masked_loss", "masked_evaluate", "weighted_loss",
                    "weighted_on_batch", "summed_loss", "summed_evaluate"):
            np.testing.assert_allclose(r[key], one[key], rtol=1e-5,
                                       err_msg=key)
        for key in ("masked", "weighted", "summed", "custom"):
            np.testing.assert_allclose(r[key]["table"], one[key]["table"],
                                       rtol=1e-5, atol=1e-6, err_msg=key)
            for a, b in zip(r[key]["dense"], one[key]["dense"]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                           err_msg=key)
        assert np.isfinite(r["cond"]["table"]).all()


def test_weights_made_inside_the_train_step_are_broadcast():
    """An RNN cell with no `build()` makes its Dense's weights at the first
    traced step. QA: the optimizer's broadcast read them before the step
    had initialized them, and every rank failed at step 1 ("variable.shape
    =(8, 4), Received: value.shape=(0,)"). Now the first run of the step
    broadcasts them, so ranks seeded differently end with rank 0's."""
    r0, r1 = run_workers(worker_path("lazy_weights"), 2, timeout=200)
    np.testing.assert_array_equal(r0["cell_kernel"], r1["cell_kernel"])
    assert np.isfinite(r0["loss"]).all()
    # Two optimizers in one custom step, each for weights it makes.
    for a, b in zip(r0["two_optimizers"], r1["two_optimizers"]):
        np.testing.assert_array_equal(a, b)
