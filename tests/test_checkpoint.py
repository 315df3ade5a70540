"""sok.dump / sok.load: sharded checkpoints that re-shard
(sok_keras/checkpoint.py)."""

import json
import os
import re
import shutil
import struct
import zlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras import checkpoint
from sok_keras.optimizers.wrapper import build_once
from tests.multiprocess import launch
from tests.multiprocess import run_sequence
from tests.multiprocess import run_workers
from tests.multiprocess import worker_path
from tests.training_setup import make_model_and_data

WORKER = worker_path("checkpoint_train")


# -- helpers -----------------------------------------------------------------
def _dlrm(steps=2, batch=16):
    model, opt, data = make_model_and_data("sok", "adam", steps, batch)
    model.compile(optimizer=sok.optimizers.OptimizerWrapper(opt),
                  loss="binary_crossentropy")
    return model, data


def _state(model, optimizer=None):
    optimizer = optimizer or model.optimizer
    out = {}
    for v in model.variables:
        if isinstance(v, sok.Variable):
            out[v.path] = v.read_global().copy()
            for k, s in v.slots.items():
                out[f"{v.path}:{k}"] = s.read_global().copy()
        else:
            out[v.path] = np.array(v.numpy())
    if optimizer is not None:
        for v in optimizer.variables:
            out[f"opt:{v.path}"] = np.array(v.numpy())
    return out


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _manifest(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def _write_manifest(folder, m, fix_crc=True):
    if fix_crc:
        m["manifest_crc32"] = checkpoint._manifest_crc(m)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(m, f)


def _data_file(folder, name):
    return os.path.join(folder, _manifest(folder)["data"], name)


@pytest.fixture(scope="module")
def _pristine(tmp_path_factory):
    """A one-rank DLRM trained 2 steps and dumped, once per module: the
    checkpoint's path and the model's state."""
    keras.utils.clear_session()
    model, (x, y) = _dlrm()
    model.fit(x, y, batch_size=16, verbose=0)
    path = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    sok.dump(path, model)
    saved = _state(model)
    keras.utils.clear_session()
    return path, saved


@pytest.fixture
def trained(_pristine, tmp_path):
    """The one-rank DLRM trained 2 steps and dumped (a copy of `_pristine`'s
    checkpoint, which this test may break), its state, a fresh model to
    load into, and the fresh model's state before loading."""
    pristine, saved = _pristine
    path = str(tmp_path / "ckpt")
    shutil.copytree(pristine, path, symlinks=True)
    fresh, _ = _dlrm()
    build_once(fresh.optimizer, fresh.trainable_variables)
    return path, saved, fresh, _state(fresh)


def _load_fails(path, model, before, *needles):
    with pytest.raises(sok.CheckpointError) as info:
        sok.load(path, model)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    _assert_same(before, _state(model))  # nothing partly loaded
    return message


# -- one rank ----------------------------------------------------------------
def test_one_rank_round_trip(trained, tmp_path):
    path, saved, fresh, _ = trained
    manifest = sok.load(path, fresh)
    assert manifest["world_size"] == 1
    assert manifest["format_version"] == checkpoint.FORMAT_VERSION
    assert manifest["optimizer"]["iterations"] == 2
    loaded = _state(fresh)
    _assert_same(saved, loaded)
    assert sorted(fresh.get_layer("embedding").embeddings.slots) == ["m", "v"]
    # Dumping again replaces the data folder; the old one is removed.
    old = _manifest(path)["data"]
    sok.dump(path, fresh)
    new = _manifest(path)["data"]
    assert new != old and not os.path.exists(os.path.join(path, old))
    assert sorted(os.listdir(path)) == sorted(["manifest.json", new])


def test_a_path_that_is_no_path_is_named(trained):
    """(Before: a bare "expected str, bytes or os.PathLike object".)"""
    _, _, fresh, before = trained
    for call in (sok.dump, sok.load):
        with pytest.raises(TypeError, match=rf"sok_keras.{call.__name__}: "
                           r"`path` must be a str.*Received: path=None"):
            call(None, fresh)
    _assert_same(before, _state(fresh))


def test_a_dump_leaves_another_jobs_dump_in_progress(tmp_path):
    """Two jobs dumping into one folder: a dump removes the folder the
    previous manifest named and old leftovers of killed dumps, but not a
    data folder changed recently (before: every other `data-*` folder,
    so another job's dump in progress lost its files and its manifest
    named missing ones)."""
    path = str(tmp_path / "ckpt")
    model, _ = _dlrm()
    sok.dump(path, model)
    first = _manifest(path)["data"]
    other = os.path.join(path, "data-0123456789ab")  # another job's
    os.makedirs(other)
    with open(os.path.join(other, "t0-r0.bin"), "wb") as f:
        f.write(b"rows being written")
    sok.dump(path, model)
    second = _manifest(path)["data"]
    assert sorted(os.listdir(path)) == sorted(
        ["manifest.json", second, "data-0123456789ab"])
    assert not os.path.exists(os.path.join(path, first))
    # Nothing changed in it for an hour: a killed dump's leftover.
    old = os.path.getmtime(other) - 3600
    for p in (other, os.path.join(other, "t0-r0.bin")):
        os.utime(p, (old, old))
    sok.dump(path, model)
    assert sorted(os.listdir(path)) == sorted(
        ["manifest.json", _manifest(path)["data"]])


def test_a_dump_whose_folder_is_removed_meanwhile_says_so(tmp_path,
                                                          monkeypatch):
    path = str(tmp_path / "ckpt")
    model, _ = _dlrm()
    sok.dump(path, model)
    before = _manifest(path)
    original = checkpoint._outcome

    def outcome(what, error, message):
        if what == "ckpt/dump/written":  # another job's cleanup, meanwhile
            for name in os.listdir(path):
                if name.startswith("data-") and name != before["data"]:
                    shutil.rmtree(os.path.join(path, name))
        return original(what, error, message)

    monkeypatch.setattr(checkpoint, "_outcome", outcome)
    with pytest.raises(sok.CheckpointError, match=(
            "was removed while the ranks wrote it: another job dumping "
            "into the same folder")):
        sok.dump(path, model)
    assert _manifest(path) == before
    assert sorted(os.listdir(path)) == sorted(
        ["manifest.json", before["data"]])


def test_two_jobs_dumping_into_one_folder(tmp_path):
    """Two single-process jobs dump into one folder in a loop: every dump
    returns, and the folder's manifest names a whole checkpoint (a load
    while the other job dumps is not safe: that dump removes the folder
    the manifest named when it commits)."""
    path = str(tmp_path / "ckpt")
    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        "import sok_keras as sok\n"
        "sok.init()\n"
        "from tests.test_checkpoint import _dlrm\n"
        "model, (x, y) = _dlrm()\n"
        "model.fit(x, y, batch_size=16, verbose=0)\n"
        "for i in range(40):\n"
        "    sok.dump(sys.argv[1], model)\n"
        "print('done', flush=True)\n")
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    for k in [k for k in env if k.startswith("SOK_") or k in (
            "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")]:
        del env[k]
    jobs = [subprocess.Popen([sys.executable, str(script), path],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, text=True) for _ in range(2)]
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=240)[0])
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
    for job, output in zip(jobs, outputs):
        assert job.returncode == 0 and "done" in output, output[-3000:]
    model, (x, y) = _dlrm()
    model.fit(x, y, batch_size=16, verbose=0)
    sok.load(path, model)


def test_one_rank_continued_training_matches(tmp_path):
    model, (x, y) = _dlrm(steps=4)
    model.fit({k: v[:32] for k, v in x.items()}, y[:32], batch_size=16,
              verbose=0, shuffle=False)
    sok.dump(str(tmp_path / "c"), model)
    rest = ({k: v[32:] for k, v in x.items()}, y[32:])
    expected = model.fit(*rest, batch_size=16, verbose=0,
                         shuffle=False).history["loss"]
    keras.utils.clear_session()
    fresh, _ = _dlrm(steps=4)
    sok.load(str(tmp_path / "c"), fresh)  # builds the optimizer
    got = fresh.fit(*rest, batch_size=16, verbose=0,
                    shuffle=False).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("inner", ["wrapper", "plain"])
def test_a_loss_scale_optimizer_round_trips(inner, tmp_path):
    """A model compiled with Keras' `LossScaleOptimizer` (what the
    `mixed_float16` policy compiles): its own step count, learning rate
    and scale load back (before: taken for an older wrapper's leftovers,
    dropped, and no dump of such a model loaded, "optimizer variables do
    not match: not in the checkpoint: ['loss_scale_optimizer/iteration',
    ...]")."""
    def make():
        model, opt, data = make_model_and_data("sok", "adam", 4, 16)
        if inner == "wrapper":
            opt = sok.optimizers.OptimizerWrapper(opt)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(opt),
                      loss="binary_crossentropy")
        return model, data

    model, (x, y) = make()
    model.fit({k: v[:32] for k, v in x.items()}, y[:32], batch_size=16,
              verbose=0, shuffle=False)
    saved = _state(model)
    sok.dump(str(tmp_path / "c"), model)
    rest = ({k: v[32:] for k, v in x.items()}, y[32:])
    expected = model.fit(*rest, batch_size=16, verbose=0,
                         shuffle=False).history["loss"]
    keras.utils.clear_session()
    fresh, _ = make()
    sok.load(str(tmp_path / "c"), fresh)
    assert any("scale" in k for k in saved), sorted(saved)
    _assert_same(_state(fresh), saved)
    got = fresh.fit(*rest, batch_size=16, verbose=0,
                    shuffle=False).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_a_plain_optimizer_compiled_again_loads_its_own_dump(tmp_path):
    """compile(A, a plain Keras Adam: wrapped for you), dump, compile(B),
    compile(A) again (wrapped anew, `optimizer_wrapper_1`), load: A's
    state comes back (before: A's dense slots, named under the first
    wrapper, matched no name and the load failed)."""
    model, (x, y) = _dlrm(steps=2)
    plain = keras.optimizers.Adam(0.01)
    model.compile(optimizer=plain, loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    saved = _state(model)
    sok.dump(str(tmp_path / "c"), model)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    model.compile(optimizer=plain, loss="binary_crossentropy")
    assert model.optimizer.name != "optimizer_wrapper"
    sok.load(str(tmp_path / "c"), model)
    # (The new wrapper's own variables differ only in Keras' numbering.)
    unnumbered = lambda state: {  # noqa: E731
        re.sub(r"optimizer_wrapper_\d+/", "optimizer_wrapper/", k): v
        for k, v in state.items()}
    _assert_same(unnumbered(_state(model)), unnumbered(saved))


def test_the_plain_optimizer_compile_wrapped_stands_for_its_wrapper(
        tmp_path):
    """`sok.dump(path, model, optimizer=plain)` / `sok.load(...)` with the
    plain Keras optimizer given to `compile` (which wrapped it) save and
    restore the model's optimizer state, as with the default
    `model.optimizer` (before: the plain optimizer's variables matched none
    of the wrapper's and the load failed)."""
    model, (x, y) = _dlrm(steps=2)
    plain = keras.optimizers.Adam(0.01)
    model.compile(optimizer=plain, loss="binary_crossentropy")
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    saved = _state(model)
    for dump_with, load_with in ((plain, None), (None, plain),
                                 (plain, plain)):
        path = str(tmp_path / f"c{id(dump_with)}{id(load_with)}")
        sok.dump(path, model, optimizer=dump_with)
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        assert _state(model).keys() == saved.keys()
        sok.load(path, model, optimizer=load_with)
        _assert_same(_state(model), saved)


@pytest.mark.parametrize("make_opt", [
    lambda: sok.OptimizerWrapper(keras.optimizers.Adam(0.1)),
    lambda: sok.optimizers.Adam(0.1),
    lambda: sok.OptimizerWrapper(keras.optimizers.Nadam(0.1)),
    lambda: sok.optimizers.Nadam(0.1)],
    ids=["wrapper", "sok_adam", "wrapper_nadam", "sok_nadam"])
def test_loading_tables_alone_leaves_the_optimizer_to_its_first_step(
        tmp_path, make_opt):
    """SOK's `sok.load(path, sok_vars, optimizer)` into a fresh optimizer,
    then steps on the tables and the dense weights: the load makes the
    tables' slots only, and the first step builds the optimizer for what it
    trains (before: it was built for the tables alone, and the step failed
    with Keras' "Unknown variable"). The tables' next step equals the
    uninterrupted run's (the dense weight is put back by hand)."""
    def make():
        table = sok.Variable(
            np.arange(20, dtype=np.float32).reshape(10, 2) / 10)
        kernel = tf.Variable([[1.0], [-2.0]])
        return table, kernel, make_opt()

    def step(table, kernel, opt):
        ids = tf.ragged.constant([[1, 2], [2, 7]], dtype=tf.int64)
        with tf.GradientTape() as tape:
            emb = sok.lookup_sparse([table], [ids])[0]
            loss = tf.reduce_sum(tf.square(tf.matmul(emb, kernel) - 1.0))
        opt.apply_gradients(zip(tape.gradient(loss, [table, kernel]),
                                [table, kernel]))

    table, kernel, opt = make()
    step(table, kernel, opt)
    sok.dump(str(tmp_path / "c"), [table], opt)
    saved_kernel = kernel.numpy()
    step(table, kernel, opt)
    want = table.numpy()
    want_variables = [checkpoint._unnumbered(v.path) for v in opt.variables]
    table, kernel, opt = make()
    sok.load(str(tmp_path / "c"), [table], opt)
    assert not opt.built and int(opt.iterations.numpy()) == 1
    kernel.assign(saved_kernel)
    step(table, kernel, opt)
    # (Nadam: its schedule, restored before the step built the optimizer,
    # is the built optimizer's; before, the load failed, "not in the
    # checkpoint: ['u_product']".)
    np.testing.assert_allclose(table.numpy(), want, rtol=0, atol=1e-6)
    assert int(opt.iterations.numpy()) == 2
    assert [checkpoint._unnumbered(v.path) for v in opt.variables] == (
        want_variables)


def test_a_loaded_model_and_a_built_one_read_each_others_checkpoints(
        tmp_path):
    """`load_model` restores the wrapped optimizer's slots under the inner
    optimizer's name (`adam/...`), a model's first step builds them under
    the wrapper's (`optimizer_wrapper/adam/...`): checkpoints key them
    alike, so a checkpoint of either loads into the other."""
    def state(model):  # `_state`, optimizer variables by checkpoint key
        return {
            (f"opt:{checkpoint._optimizer_key(model.optimizer, k[4:])}"
             if k.startswith("opt:") else k): v
            for k, v in _state(model).items()}

    keras.utils.clear_session()
    model, (x, y) = _dlrm()
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(str(tmp_path / "m.keras"))
    keras.utils.clear_session()
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    loaded.fit(x, y, batch_size=16, verbose=0)
    assert any(v.path.startswith("adam/")
               for v in loaded.optimizer.variables)
    sok.dump(str(tmp_path / "from_loaded"), loaded)
    want = state(loaded)
    keras.utils.clear_session()
    fresh, _ = _dlrm()
    build_once(fresh.optimizer, fresh.trainable_variables)
    assert any(v.path.startswith("optimizer_wrapper/adam/")
               for v in fresh.optimizer.variables)
    sok.load(str(tmp_path / "from_loaded"), fresh)
    _assert_same(want, state(fresh))
    sok.dump(str(tmp_path / "from_fresh"), fresh)
    keras.utils.clear_session()
    again = keras.models.load_model(str(tmp_path / "m.keras"))
    sok.load(str(tmp_path / "from_fresh"), again)
    _assert_same(want, state(again))


def test_list_of_variables_and_config_mismatches(tmp_path):
    path = str(tmp_path / "vars")
    table = sok.Variable(np.arange(40, dtype=np.float32).reshape(10, 4),
                         name="t")
    dense = keras.Variable(np.ones((3,), np.float32), name="w")
    sok.dump(path, [table, dense])
    other = sok.Variable(np.zeros((10, 4), np.float32), name="t")
    w2 = keras.Variable(np.zeros((3,), np.float32), name="w")
    sok.load(path, [other, w2])
    np.testing.assert_array_equal(other.numpy(), table.numpy())
    np.testing.assert_array_equal(w2.numpy(), dense.numpy())
    cases = [
        (np.zeros((11, 4), np.float32), "float32", "(10, 4)"),  # vocabulary
        (np.zeros((10, 5), np.float32), "float32", "(10, 4)"),  # dim
        (np.zeros((10, 4), np.float64), "float64", "float32"),  # dtype
    ]
    for value, dtype, expected in cases:
        bad = sok.Variable(value, dtype=dtype, name="t")
        w3 = keras.Variable(np.zeros((3,), np.float32), name="w")
        before = bad.numpy().copy()
        with pytest.raises(sok.CheckpointError) as info:
            sok.load(path, [bad, w3])
        message = str(info.value)
        assert "manifest.json" in message and "'t'" in message, message
        assert f"expected {expected}" in message or expected in message, \
            message
        np.testing.assert_array_equal(bad.numpy(), before)
        np.testing.assert_array_equal(w3.numpy(), np.zeros(3))
    renamed = sok.Variable(np.zeros((10, 4), np.float32), name="u")
    with pytest.raises(sok.CheckpointError, match="tables do not match"):
        sok.load(path, [renamed, w2])


def test_a_list_loads_some_of_the_checkpoints_variables_by_name(tmp_path):
    """As SOK's `load(path, vars)`: a list may hold some of the dumped
    variables, each loaded from the entry of its name, and `dump` / `load`
    take one variable alone (before: "tables do not match ... missing [],
    unexpected ['item_table']", and a TypeError for one variable). A
    model still loads all of its tables; an unknown name says which."""
    path = str(tmp_path / "ck")
    user = sok.Variable(np.full((10, 4), 1.0, np.float32), name="user_table")
    item = sok.Variable(np.full((5, 2), 2.0, np.float32), name="item_table")
    dense = keras.Variable(np.full((3,), 3.0, np.float32), name="w")
    sok.dump(path, [user, item, dense])
    user2 = sok.Variable(np.zeros((10, 4), np.float32), name="user_table")
    sok.load(path, [user2])
    np.testing.assert_array_equal(user2.numpy(), user.numpy())
    item2 = sok.Variable(np.zeros((5, 2), np.float32), name="item_table")
    dense2 = keras.Variable(np.zeros((3,), np.float32), name="w")
    sok.load(path, [dense2, item2])
    np.testing.assert_array_equal(item2.numpy(), item.numpy())
    np.testing.assert_array_equal(dense2.numpy(), dense.numpy())
    item3 = sok.Variable(np.zeros((5, 2), np.float32), name="item_table")
    sok.load(path, item3)  # one variable, not in a list
    np.testing.assert_array_equal(item3.numpy(), item.numpy())
    single = str(tmp_path / "single")
    sok.dump(single, user)
    user4 = sok.Variable(np.zeros((10, 4), np.float32), name="user_table")
    sok.load(single, [user4])
    np.testing.assert_array_equal(user4.numpy(), user.numpy())
    # One variable with an optimizer (before: a TensorFlow slicing error).
    opt = sok.OptimizerWrapper(keras.optimizers.Adam(0.1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.lookup_sparse(
            [user], [tf.ragged.constant([[1, 2]], dtype=tf.int64)])[0])
    opt.apply_gradients([(tape.gradient(loss, user), user)])
    with_opt = str(tmp_path / "with_opt")
    sok.dump(with_opt, user, opt)
    user5 = sok.Variable(np.zeros((10, 4), np.float32), name="user_table")
    opt5 = sok.OptimizerWrapper(keras.optimizers.Adam(0.1))
    sok.load(with_opt, user5, opt5)
    np.testing.assert_array_equal(user5.numpy(), user.numpy())
    np.testing.assert_array_equal(user5.slots["m"].numpy(),
                                  user.slots["m"].numpy())
    assert int(opt5.iterations.numpy()) == 1
    other = sok.Variable(np.zeros((10, 4), np.float32), name="other_table")
    with pytest.raises(sok.CheckpointError, match=(
            r"not in the checkpoint: \['other_table'\].*"
            r"A list of variables may hold some of the checkpoint's")):
        sok.load(path, [other, user2])
    np.testing.assert_array_equal(other.numpy(), np.zeros((10, 4)))


@pytest.mark.parametrize("wrap", ["wrapper", "sok_adam", "keras_adam"])
def test_a_list_of_tables_with_an_optimizer_of_more_variables(tmp_path,
                                                              wrap):
    """SOK's `dump(path, tables, optimizer)` with one optimizer over the
    tables and dense weights: the listed variables' optimizer state is
    saved and loads, with the same list, into a fresh optimizer (before:
    "optimizer variables do not match: unexpected ['adam/k_momentum',
    ...]") or into one built for every variable, whose other slots stay."""
    def make():
        opt = {"wrapper": lambda: sok.OptimizerWrapper(
                   keras.optimizers.Adam(0.1)),
               "sok_adam": lambda: sok.optimizers.Adam(0.1),
               "keras_adam": lambda: keras.optimizers.Adam(0.1)}[wrap]()
        t = sok.Variable(np.ones((10, 2), np.float32), name="t")
        k = keras.Variable(np.ones((2, 1), np.float32), name="k")
        return opt, t, k

    def step(opt, t, k, only_table=False):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(sok.lookup_sparse(
                t, tf.ragged.constant([[1, 2], [2, 5]], tf.int64),
                combiners="sum") @ tf.convert_to_tensor(k))
        variables = [t] if only_table else [t, k]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def k_slots(opt):
        return [v.numpy().copy() for v in opt.variables
                if v.path.rsplit("/", 1)[-1].startswith("k_")]

    opt, t, k = make()
    step(opt, t, k)
    step(opt, t, k)
    path = str(tmp_path / "tables")
    sok.dump(path, [t], optimizer=opt)
    fresh, t2, _ = make()
    sok.load(path, [t2], optimizer=fresh)
    np.testing.assert_array_equal(t2.numpy(), t.numpy())
    assert int(fresh.iterations.numpy()) == 2
    assert k_slots(fresh) == []
    built, t3, k3 = make()
    step(built, t3, k3)
    before = k_slots(built)
    assert len(before) == 2
    sok.load(path, [t3], optimizer=built)
    np.testing.assert_array_equal(t3.numpy(), t.numpy())
    for a, b in zip(k_slots(built), before):
        np.testing.assert_array_equal(a, b)
    # The table's slots came back: the next step of the loaded table is
    # the original's.
    step(opt, t, k.numpy(), only_table=True)
    step(fresh, t2, k.numpy(), only_table=True)
    np.testing.assert_allclose(t2.numpy(), t.numpy(), rtol=1e-6)


def test_missing_shard(trained):
    path, _, fresh, before = trained
    os.remove(_data_file(path, "t0-r0.bin"))
    _load_fails(path, fresh, before, "t0-r0.bin", "embedding/embeddings",
                "missing")


def test_corrupted_byte_is_a_checksum_error_and_nothing_is_loaded(trained):
    path, _, fresh, before = trained
    shard = _data_file(path, "t0-r0.bin")
    with open(shard, "r+b") as f:  # the last byte: in the last slot, so
        f.seek(-1, os.SEEK_END)     # the table's rows were read fine
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    _load_fails(path, fresh, before, "t0-r0.bin", "embedding/embeddings",
                "checksum mismatch", "expected 0x")


def test_corrupted_dense_file(trained):
    path, _, fresh, before = trained
    with open(_data_file(path, "dense.bin"), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    _load_fails(path, fresh, before, "dense.bin", "checksum mismatch")


def test_newer_format_version(trained):
    path, _, fresh, before = trained
    m = _manifest(path)
    m["format_version"] = checkpoint.FORMAT_VERSION + 1
    _write_manifest(path, m)
    _load_fails(path, fresh, before, "manifest.json",
                f"format version {checkpoint.FORMAT_VERSION + 1}",
                f"expected at most {checkpoint.FORMAT_VERSION}")


def test_edited_manifest_fails_its_checksum(trained):
    path, _, fresh, before = trained
    m = _manifest(path)
    m["tables"][0]["shape"][0] += 1
    _write_manifest(path, m, fix_crc=False)
    _load_fails(path, fresh, before, "manifest.json", "checksum")


@pytest.mark.parametrize("bad", ["../t0-r0.bin", "/etc/passwd", "a/../../b",
                                 ".."])
def test_path_escape_in_manifest_is_refused(trained, bad):
    path, _, fresh, before = trained
    m = _manifest(path)
    m["files"][bad] = m["files"].pop("t0-r0.bin")
    m["tables"][0]["files"] = [bad]
    _write_manifest(path, m)
    _load_fails(path, fresh, before, repr(bad), "not a plain file name")


def test_data_folder_escape_in_manifest_is_refused(trained):
    path, _, fresh, before = trained
    m = _manifest(path)
    m["data"] = "../elsewhere"
    _write_manifest(path, m)
    _load_fails(path, fresh, before, "'../elsewhere'", "manifest.json")


def test_symlink_out_of_the_folder_is_refused(trained, tmp_path):
    path, _, fresh, before = trained
    shard = _data_file(path, "t0-r0.bin")
    outside = str(tmp_path / "outside.bin")
    shutil.move(shard, outside)
    os.symlink(outside, shard)
    _load_fails(path, fresh, before, "t0-r0.bin", "outside the checkpoint")


def test_truncated_file(trained):
    path, _, fresh, before = trained
    shard = _data_file(path, "t0-r0.bin")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    _load_fails(path, fresh, before, "t0-r0.bin", "embedding/embeddings",
                f"{size // 2} bytes on disk, expected {size}")


def test_size_field_that_lies_is_caught_before_allocating(trained):
    path, _, fresh, before = trained
    shard = _data_file(path, "t0-r0.bin")
    with open(shard, "r+b") as f:  # a header claiming 1 TB, CRC fixed up
        head = f.read(checkpoint._HEADER.size)
        magic, version, block, _ = checkpoint._HEADER.unpack(head)
        head = checkpoint._HEADER.pack(magic, version, block, 1 << 40)
        f.seek(0)
        f.write(head + struct.pack("<I", zlib.crc32(head)))
    _load_fails(path, fresh, before, "t0-r0.bin", "header says 1099511627776")
    # The same lie in the manifest (sizes, and as many CRCs as it needs):
    # the file on disk is smaller, so nothing is read or allocated.
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    m = _manifest(path)
    rec = m["files"]["t0-r0.bin"]
    rec["payload_bytes"] = 1 << 40
    rec["block_crc32"] = [0] * ((1 << 40) // rec["block_bytes"])
    _write_manifest(path, m)
    _load_fails(path, fresh, before, "t0-r0.bin",
                f"expected {checkpoint._HEADER_BYTES + (1 << 40)}")


def test_unknown_dtype_in_manifest(trained):
    path, _, fresh, before = trained
    m = _manifest(path)
    m["tables"][0]["dtype"] = "object"
    _write_manifest(path, m)
    _load_fails(path, fresh, before, "embedding/embeddings", "'object'")


def test_no_manifest_is_not_a_checkpoint(tmp_path):
    model, _ = _dlrm()
    with pytest.raises(sok.CheckpointError, match="no checkpoint manifest"):
        sok.load(str(tmp_path / "nothing"), model)


# -- several ranks -----------------------------------------------------------
def _npz(path):
    with np.load(path) as f:  # allow_pickle defaults to False
        return {k: f[k] for k in f.files}


def _check_resharded(out, saved_state, loaded, n, uninterrupted, names):
    got = _npz(os.path.join(out, f"loaded{n}.npz"))
    for k, v in saved_state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=f"{k} at {n} ranks")
    for name in names:
        np.testing.assert_array_equal(
            got[f"{name}/lookup"], saved_state[f"{name}/table"],
            err_msg=f"lookup of every id of {name} at {n} ranks")
    for r in loaded:
        assert r["saved_world_size"] == 2
        np.testing.assert_allclose(r["losses_after"], uninterrupted,
                                   rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Both models dumped at 2 ranks, in one job: "dlrm" (a distributed
    table) and "localized" (its LocalizedEmbedding on rank 1 of 2). Each:
    (checkpoint path, out folder, per-rank results)."""
    base = tmp_path_factory.mktemp("ckpt2")
    made = {}
    for kind in ("dlrm", "localized"):
        made[kind] = (str(base / kind / "ckpt"), str(base / kind / "out"))
        os.makedirs(made[kind][1])
    dlrm, localized = run_sequence(
        [("checkpoint_train", ["dump", "dlrm", *made["dlrm"]]),
         ("checkpoint_train", ["dump", "localized", *made["localized"], 1])],
        2, timeout=300)
    return {"dlrm": (*made["dlrm"], dlrm),
            "localized": (*made["localized"], localized)}


@pytest.fixture(scope="module")
def dumped_on_two(dumps):
    path, out, results = dumps["dlrm"]
    assert results[0]["losses_after"] == results[1]["losses_after"]
    return path, out, results[0]["losses_after"]


@pytest.fixture(scope="module")
def loads(dumps):
    """Both checkpoints of `dumps` loaded at 3 ranks and at 1, one job per
    rank count: {n: {"dlrm": results, "localized": results}}; the localized
    table goes to rank 2 of 3, and to the only rank."""
    out = {}
    for n, target in ((3, 2), (1, 0)):
        dlrm, localized = run_sequence(
            [("checkpoint_train", ["load", "dlrm", *dumps["dlrm"][:2]]),
             ("checkpoint_train", ["load", "localized",
                                   *dumps["localized"][:2], target])],
            n, timeout=300)
        out[n] = {"dlrm": dlrm, "localized": localized}
    return out


def test_dump_on_two_ranks_load_on_one_and_three(dumped_on_two, loads):
    path, out, uninterrupted = dumped_on_two
    saved = _npz(os.path.join(out, "saved.npz"))
    assert {"embedding/slot/m", "embedding/slot/v"} <= set(saved)
    m = _manifest(path)
    assert m["world_size"] == 2
    assert [f for f in m["tables"][0]["files"]] == ["t0-r0.bin", "t0-r1.bin"]
    vocab = saved["embedding/table"].shape[0]
    for n in (3, 1):
        loaded = loads[n]["dlrm"]
        assert [r["local_rows"]["embedding"] for r in loaded] == [
            len(range(r, vocab, n)) for r in range(n)]
        assert all(r["iterations"] == 4 for r in loaded)
        _check_resharded(out, saved, loaded, n, uninterrupted, ["embedding"])


def _global_slots(results, kind):
    """Every slot of a raw-loop run's tables as whole tables, from each
    rank's rows (`dist`: rank r holds ids r, r + N, ...; `loc`: the last
    rank holds all)."""
    n = len(results)
    out = {}
    for name in results[0][kind]["slots"]:
        parts = [np.asarray(r[kind]["slots"][name], np.float32).reshape(
            -1, 3) for r in results]
        if name.startswith(f"{kind}_dist/"):
            whole = np.empty((sum(len(p) for p in parts), 3), np.float32)
            for r, p in enumerate(parts):
                whole[r::n] = p
        else:
            assert all(len(p) == 0 for p in parts[:-1]), name
            whole = parts[-1]
        out[name] = whole
    return out


@pytest.fixture(scope="module")
def raw_loop_dumped(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("raw_loop"))
    return ckpt, run_workers(worker_path("raw_loop_checkpoint"), 2,
                             args=["dump", ckpt], timeout=240)


@pytest.mark.parametrize("n", [2, 1, 3])
def test_a_plain_optimizers_table_slots_reshard_with_the_table(
        raw_loop_dumped, n):
    """SOK's raw loop: `sok.dump(path, tables, plain_keras_optimizer)` on 2
    ranks, `sok.load` into fresh tables and a fresh optimizer on 1, 2 and 3
    ranks. Keras' own slots of a table (momentum, accumulator, Adam's
    moments; one shard per rank) are saved and re-sharded with the table:
    every rank gets its own rows, and the next steps equal the
    uninterrupted run's. (Before: rank 0 wrote its shard of them as
    replicated state: rank 1 loaded rank 0's rows, and a load at another
    number of ranks failed on their shape.)"""
    ckpt, dumped = raw_loop_dumped
    loaded = run_workers(worker_path("raw_loop_checkpoint"), n,
                         args=["load", ckpt], timeout=240)
    for kind in ("sgd_momentum", "adagrad", "adam"):
        saved = _global_slots(dumped, kind)
        assert len(saved) == {"sgd_momentum": 2, "adagrad": 2, "adam": 4}[
            kind], sorted(saved)
        got = _global_slots(loaded, kind)
        assert sorted(got) == sorted(saved)
        for name in saved:
            np.testing.assert_array_equal(got[name], saved[name],
                                          err_msg=f"{name} at {n} ranks")
        assert all(r[kind]["iterations"] == 3 for r in loaded)
        for name, want in dumped[0][kind]["after"].items():
            np.testing.assert_allclose(
                loaded[0][kind]["after"][name], want, rtol=0, atol=1e-5,
                err_msg=f"{kind}: {name} after 3 more steps at {n} ranks")


def test_error_on_one_rank_fails_every_rank_and_loads_nothing(
        dumped_on_two, tmp_path):
    path, _, _ = dumped_on_two
    copy = str(tmp_path / "ckpt")
    shutil.copytree(path, copy)
    # Loading at 2 ranks, rank 0 reads only t0-r0.bin: corrupt t0-r1.bin.
    shard = _data_file(copy, "t0-r1.bin")
    with open(shard, "r+b") as f:
        f.seek(checkpoint._HEADER_BYTES + 5)
        b = f.read(1)
        f.seek(checkpoint._HEADER_BYTES + 5)
        f.write(bytes([b[0] ^ 0x40]))
    r0, r1 = run_workers(WORKER, 2, args=["load_error", "dlrm", copy,
                                          str(tmp_path)], timeout=240)
    assert "checksum mismatch" in r1["error"] and "t0-r1.bin" in r1["error"]
    assert "failed on rank(s) [1]" in r0["error"], r0["error"]
    assert "nothing was loaded" in r0["error"]
    assert r0["unchanged"] and r1["unchanged"]


def test_localized_tables_reshard(dumps, loads):
    # Saved with the localized table on rank 1 of 2; loaded with it on rank
    # 2 of 3, and on the only rank.
    path, out, dumped = dumps["localized"]
    saved = _npz(os.path.join(out, "saved.npz"))
    assert {"loc/slot/m", "dist/slot/v"} <= set(saved)
    m = _manifest(path)
    loc = [t for t in m["tables"] if t["name"] == "loc/embeddings"][0]
    assert loc["mode"] == "localized:1" and loc["files"][0] is None
    for n, target in ((3, 2), (1, 0)):
        loaded = loads[n]["localized"]
        assert [r["local_rows"]["loc"] for r in loaded] == [
            37 if r == target else 0 for r in range(n)]
        _check_resharded(out, saved, loaded, n, dumped[0]["losses_after"],
                         ["loc", "dist"])


def test_dump_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    job = launch(WORKER, 2, args=["crash_dump", "dlrm", path, out],
                 timeout=120, env={"SOK_COMM_TIMEOUT": "10"})
    assert job.returncode != 0, job.output
    assert job.leftovers == []
    assert not any(r.get("second_dump_returned")
                   for r in job.results.values()), job.output
    m = _manifest(path)
    data = sorted(d for d in os.listdir(path) if d.startswith("data-"))
    # The manifest still names the first dump's folder, which is whole; the
    # killed dump's folder is either left unreferenced or (when the
    # surviving rank learns of the exit in time, sok_keras.divergence)
    # removed by its failed dump.
    assert m["data"] in data and len(data) in (1, 2), (data, job.output)
    saved = _npz(os.path.join(out, "saved.npz"))
    model, _ = _dlrm()
    sok.load(path, model)
    st = _state(model)
    table = model.get_layer("embedding").embeddings
    np.testing.assert_array_equal(st[table.path], saved["embedding/table"])
    for k in ("m", "v"):
        np.testing.assert_array_equal(st[f"{table.path}:{k}"],
                                      saved[f"embedding/slot/{k}"])
    for k, v in saved.items():
        if k.startswith("dense/"):
            np.testing.assert_array_equal(st[k[len("dense/"):]], v)
    assert int(model.optimizer.iterations.numpy()) == 4


# -- the model.fit callback (deliverable 4) ---------------------------------
FIT_WORKER = worker_path("checkpoint_fit")


def test_sharded_checkpoint_arguments():
    for kwargs in ({"every_n_steps": 0}, {"keep": -1},
                   {"every_n_epochs": 1.5}, {"every_n_steps": True}):
        with pytest.raises(ValueError, match="positive integer"):
            sok.callbacks.ShardedCheckpoint("/tmp/x", **kwargs)
    cb = sok.callbacks.ShardedCheckpoint("/tmp/x")
    assert cb.every_n_epochs == 1 and cb.every_n_steps is None


def test_sharded_checkpoint_one_rank_keeps_last_k_and_restores(tmp_path):
    model, (x, y) = _dlrm(steps=6)
    cb = sok.callbacks.ShardedCheckpoint(str(tmp_path), every_n_steps=2,
                                         keep=2)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False,
              callbacks=[cb])
    assert cb.checkpoints() == [4, 6]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000000004",
                                            "ckpt-0000000006"]
    saved = _state(model)
    keras.utils.clear_session()
    fresh, _ = _dlrm(steps=6)
    meta = sok.callbacks.ShardedCheckpoint(str(tmp_path)).restore_latest(
        fresh)
    # The last step of the epoch: the next thing to do is epoch 1.
    assert meta == {"step": 6, "epoch": 1, "batch_in_epoch": 0,
                    "steps_in_epoch": 6}
    _assert_same(saved, _state(fresh))
    empty = sok.callbacks.ShardedCheckpoint(str(tmp_path / "none"))
    assert empty.restore_latest(fresh) is None
    # The newest checkpoint damaged (a shard cut short): the error says how
    # to resume from the one before; once it is moved away, that one loads.
    newest = tmp_path / "ckpt-0000000006"
    shard = next(p for p in sorted(newest.rglob("*"))
                 if p.is_file() and p.name != "manifest.json"
                 and p.stat().st_size > 16)
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(sok.CheckpointError, match=r"the newest checkpoint, "
                       r"'.*ckpt-0000000006', could not be loaded; to resume "
                       r"from the one before it, move that folder out"):
        sok.callbacks.ShardedCheckpoint(str(tmp_path)).restore_latest(fresh)
    os.rename(newest, tmp_path.parent / f"{tmp_path.name}-damaged")
    meta = sok.callbacks.ShardedCheckpoint(str(tmp_path)).restore_latest(
        fresh)
    assert meta["step"] == 4


@pytest.fixture(scope="module")
def killed_fits(tmp_path_factory):
    """The two fits on 2 ranks where rank 1 dies mid-epoch (each its own
    job): with ShardedCheckpoint ("killed", its checkpoints copied to
    "copy" right after) and with BackupAndRestore ("backup-killed", the
    names in its folder right after: "backup_files"; the resume deletes
    the folder)."""
    base = tmp_path_factory.mktemp("fits")
    fits = {"out": str(base)}
    for action, folder in (("killed", "ckpts"), ("backup-killed", "backup")):
        directory = str(base / folder)
        job = launch(FIT_WORKER, 2, args=[action, directory, str(base)],
                     timeout=120, env={"SOK_COMM_TIMEOUT": "10"})
        fits[action] = (directory, job)
        if action == "killed" and os.path.isdir(directory):
            fits["copy"] = str(base / "ckpts-copy")
            shutil.copytree(directory, fits["copy"])
            # Never resumed from (the tests that resume copy it first).
            fits["pristine"] = str(base / "ckpts-pristine")
            shutil.copytree(directory, fits["pristine"])
        if action == "backup-killed" and os.path.isdir(directory):
            fits["backup_files"] = sorted(os.listdir(directory))
    return fits


@pytest.fixture(scope="module")
def resumed_fits(killed_fits):
    """One 2-rank job after `killed_fits`: the uninterrupted fit (2 epochs,
    no interruption), then "resume" (ShardedCheckpoint) and
    "backup-resume" (BackupAndRestore) of the killed fits. Their per-rank
    results and final_<action>.npz (in killed_fits["out"])."""
    out = killed_fits["out"]
    _, resume, backup = run_sequence(
        [("checkpoint_fit", ["uninterrupted", out + "/u", out]),
         ("checkpoint_fit", ["resume", killed_fits["killed"][0], out]),
         ("checkpoint_fit", ["backup-resume",
                             killed_fits["backup-killed"][0], out])],
        2, timeout=360)
    return {"resume": resume, "backup-resume": backup,
            "uninterrupted": _npz(os.path.join(
                out, "final_uninterrupted.npz"))}


def test_fit_killed_mid_epoch_resumes_to_the_uninterrupted_result(
        tmp_path, killed_fits, request):
    out = killed_fits["out"]
    directory, job = killed_fits["killed"]
    assert job.returncode != 0, job.output
    assert job.leftovers == []
    # Killed at global step 9 (epoch 1, batch 3); checkpoints every 2
    # steps, the last 2 kept (as they were right after the kill: `copy`).
    assert sorted(os.listdir(killed_fits["copy"])) == [
        "ckpt-0000000006", "ckpt-0000000008"], job.output
    copy = killed_fits["copy"]
    resumed = request.getfixturevalue("resumed_fits")
    uninterrupted = resumed["uninterrupted"]
    r0, r1 = resumed["resume"]
    assert r0["meta"] == {"step": 8, "epoch": 1, "batch_in_epoch": 2,
                          "steps_in_epoch": 6}
    assert r0["iterations"] == 8 and r1["iterations"] == 8
    assert r0["checkpoints"] == [10, 12]
    expected = uninterrupted
    got = _npz(os.path.join(out, "final_resume.npz"))
    assert sorted(expected) == sorted(got)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6,
                                   err_msg=k)
    # The same checkpoint resumed at 3 ranks (re-sharded): the same result
    # (runs at different numbers of ranks agree to 1e-6, see
    # tests/training_setup.py).
    out3 = str(tmp_path / "three")
    os.makedirs(out3)
    results = run_workers(FIT_WORKER, 3, args=["resume", copy, out3],
                          timeout=240)
    assert all(r["iterations"] == 8 for r in results)
    got3 = _npz(os.path.join(out3, "final_resume.npz"))
    for k in expected:
        np.testing.assert_allclose(got3[k], expected[k], rtol=0, atol=1e-6,
                                   err_msg=f"{k} at 3 ranks")


def test_a_resumed_fit_killed_again_resumes_to_the_uninterrupted_result(
        tmp_path, killed_fits, request):
    """docs/checkpoints.md's recipe, interrupted twice: resumed from step
    8 (epoch 1, batch 2), rank 1 is killed again at step 11. The
    checkpoint at step 10 counts the epoch's batches from its start (4;
    before: 2, the shortened fit's own count, and the second resume then
    trained batches 2-3 twice, ending at step 14), and the second resume
    ends with the uninterrupted run's state."""
    if "pristine" not in killed_fits:
        pytest.fail(f"the killed fit left no checkpoints: "
                    f"{killed_fits['killed'][1].output}")
    directory = str(tmp_path / "ckpts")
    shutil.copytree(killed_fits["pristine"], directory)
    out = str(tmp_path)
    job = launch(FIT_WORKER, 2, args=["resume-killed", directory, out],
                 timeout=120, env={"SOK_COMM_TIMEOUT": "10"})
    assert job.returncode != 0, job.output
    assert job.leftovers == []
    with open(os.path.join(directory, "ckpt-0000000010",
                           "manifest.json")) as f:
        meta = json.load(f)["metadata"]
    assert meta == {"step": 10, "epoch": 1, "batch_in_epoch": 4,
                    "steps_in_epoch": 6}, meta
    r0, _ = run_workers(FIT_WORKER, 2, args=["resume", directory, out],
                        timeout=240)
    assert r0["meta"]["step"] == 10 and r0["iterations"] == 10
    got = _npz(os.path.join(out, "final_resume.npz"))
    expected = request.getfixturevalue("resumed_fits")["uninterrupted"]
    assert sorted(got) == sorted(expected)  # the step count among them
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-6,
                                   err_msg=k)


def test_backup_and_restore_resumes_a_killed_fit(killed_fits, request):
    """keras.callbacks.BackupAndRestore on 2 ranks (its backups go through
    model.save_weights, called on every rank): rank 1 killed mid-epoch, the
    same command run again resumes from the last backup and ends with the
    uninterrupted run's weights, tables and slots; the folder is deleted
    once (by rank 0) at the end."""
    out = killed_fits["out"]
    directory, job = killed_fits["backup-killed"]
    assert job.returncode != 0, job.output
    assert job.leftovers == []
    # One epoch's backup (6 steps), written by rank 0 alone (the folder as
    # the killed job left it, before the resume deleted it).
    files = killed_fits.get("backup_files", [])
    assert "latest.weights.h5" in files, (files, job.output)
    assert not [n for n in files if "sok-tmp" in n], files
    resumed = request.getfixturevalue("resumed_fits")
    uninterrupted = resumed["uninterrupted"]
    r0, r1 = resumed["backup-resume"]
    assert r0["iterations"] == 6 and r1["iterations"] == 6
    assert not r0["backup_left"] and not r1["backup_left"]
    got = _npz(os.path.join(out, "final_backup-resume.npz"))
    # The same variables under the same paths: the optimizer is built at
    # the start of fit, before the callback restores (before, a restore
    # built it outside the wrapper's name scope, "adam/..." instead of
    # "optimizer_wrapper/adam/...").
    expected = uninterrupted
    assert sorted(got) == sorted(expected)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=0,
                                   atol=1e-6, err_msg=k)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_round_trip_bit_for_bit(tmp_path, dtype):
    rng = np.random.default_rng(5)
    value = rng.normal(size=(23, 3)).astype(np.float32)
    table = sok.Variable(value, dtype=dtype, name="t")
    sok.dump(str(tmp_path / "c"), [table])
    other = sok.Variable(np.zeros((23, 3), np.float32), dtype=dtype,
                         name="t")
    sok.load(str(tmp_path / "c"), [other])
    assert other.dtype == table.dtype
    np.testing.assert_array_equal(
        np.asarray(other.numpy()).view(np.uint8),
        np.asarray(table.numpy()).view(np.uint8))


def _bf16_model():
    ids = keras.Input((3,), dtype="int64")
    emb = sok.layers.DistributedEmbedding(20, 4, dtype="bfloat16")
    model = keras.Model(ids, keras.layers.Dense(1)(emb(ids)))
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam(0.1)),
                  loss="mse")
    return model


def _values(model):
    """Every table, slot, dense and optimizer variable, in model order."""
    out = []
    for v in model.variables:
        if isinstance(v, sok.Variable):
            out.append(np.asarray(v.read_global(), np.float32))
            out += [s.read_global() for _, s in sorted(v.slots.items())]
        else:
            out.append(np.array(v.numpy()))
    return out + [np.array(v.numpy()) for v in model.optimizer.variables]


def test_a_16_bit_table_with_slots_and_the_model_rebuilt_in_one_process(
        tmp_path):
    """A bfloat16 table keeps float32 slots: they load (the load checked
    them against the table's dtype and refused). The model built again in
    the same process (no clear_session) has Keras-numbered names
    (`distributed_embedding_1`, `optimizer_wrapper_1`, ...): the
    checkpoint loads by position, as Keras' own `load_weights` does."""
    model = _bf16_model()
    x = np.arange(24).reshape(8, 3) % 20
    model.fit(x, np.ones((8, 1)), verbose=0)
    slots = model.layers[1].embeddings.slots
    assert {k: v.dtype for k, v in slots.items()} == {"m": "float32",
                                                      "v": "float32"}
    sok.dump(str(tmp_path / "c"), model)
    again = _bf16_model()
    assert again.layers[1].name != model.layers[1].name
    sok.load(str(tmp_path / "c"), again)
    want, got = _values(model), _values(again)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again.predict(x, verbose=0),
                                  model.predict(x, verbose=0))
