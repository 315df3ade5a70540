"""`sok_keras.Variable` in a world of one process."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok
from sok_keras.variable import global_to_local
from sok_keras.variable import parse_mode
from sok_keras.variable import shard_rows


def test_variable_is_a_keras_variable_holding_the_table():
    v = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype=tf.float32,
                     name="t")
    assert isinstance(v, keras.Variable)
    assert v.shape == (17, 3) and v.global_shape == (17, 3)
    assert v.mode == "distributed" and v.target_rank == -1
    assert v.dtype == "float32"
    np.testing.assert_array_equal(v.numpy()[5], [15, 16, 17])
    np.testing.assert_array_equal(v.read_value().numpy(), v.numpy())


def test_shard_rule_matches_sok():
    # 17 rows on 2 ranks -> 9 and 8; row id lives at id // N on id % N.
    assert [shard_rows(17, "distributed", -1, r, 2) for r in (0, 1)] == [9, 8]
    assert [shard_rows(17, "distributed", -1, r, 3) for r in range(3)] == [
        6, 6, 5]
    np.testing.assert_array_equal(
        global_to_local(7, "distributed", 1, 3), [1, 4])
    assert shard_rows(17, "localized", 1, 1, 2) == 17
    assert shard_rows(17, "localized", 1, 0, 2) == 0


def test_modes_and_errors():
    assert parse_mode("localized:0", 1) == ("localized", 0)
    with pytest.raises(ValueError, match="localized:3"):
        parse_mode("localized:3", 2, "t")
    with pytest.raises(ValueError, match="'bogus'"):
        sok.Variable(np.zeros((3, 2)), mode="bogus")
    with pytest.raises(ValueError, match="2-D"):
        sok.Variable(np.zeros((3,)))
    with pytest.raises(ValueError, match="shape"):
        sok.Variable("uniform")
    v = sok.Variable("zeros", shape=(4, 3), mode="localized:0")
    assert v.shape == (4, 3) and v.mode == "localized:0"
    # SOK's DynamicVariable arguments: what to do instead.
    with pytest.raises(TypeError, match=r"\['dimension'\] are arguments of "
                       r"SOK's DynamicVariable.*shape=\(vocabulary_size"):
        sok.Variable(dimension=8, initializer="uniform", name="dyn")


def test_filter_variables():
    v = sok.Variable(np.zeros((3, 2)))
    d = keras.Variable(np.zeros((2,)))
    assert sok.filter_variables([d, v]) == ([v], [d])
    assert sok.split_embedding_variable_from_others([v, d]) == ([v], [d])
    # One variable, as `sok.dump` takes it (before: its rows were iterated,
    # "slice index 3 of dimension 0 out of bounds").
    assert sok.filter_variables(v) == ([v], [])
    assert sok.filter_variables(d) == ([], [d])


def test_world_of_one():
    sok.init()
    assert sok.rank() == 0 and sok.num_ranks() == 1
    sok.Init(global_batch_size=1024)  # the seed's spelling
    assert sok.rank() == 0 and sok.num_ranks() == 1


def _reads_alias_the_table(var):
    """Whether two dense reads of `var` share its buffer (TensorFlow's
    copy-on-read mode makes each read copy the whole table)."""
    a, b = var.value.read_value(), var.value.read_value()
    return (np.asarray(a).__array_interface__["data"][0]
            == np.asarray(b).__array_interface__["data"][0])


def test_tables_written_in_place_are_read_without_copies(tmp_path):
    """Block-wise initialization, `assign_global`, restored slots, a
    `sok.load` and a `load_model` write tables in place (sparse writes),
    which would leave TensorFlow's copy-on-read mode on: every lookup would
    copy the whole table first (10x slower on the CPU, 4x on the H200)."""
    made = sok.Variable(keras.initializers.RandomUniform(seed=1),
                        shape=(5000, 8), name="blocks")
    if "GPU" in made.value.device.upper():
        # Host arrays of device reads are copies whatever the mode; the
        # GPU's copy-on-read is measured by bench/copy_on_read.py.
        pytest.skip("compares host buffers: tables on the CPU only")
    assert _reads_alias_the_table(made)
    table = sok.Variable(np.zeros((300, 4), "float32"), name="assigned")
    table.assign_global(np.arange(1200, dtype="float32").reshape(300, 4))
    assert _reads_alias_the_table(table)
    np.testing.assert_array_equal(
        table.numpy(), np.arange(1200, dtype="float32").reshape(300, 4))

    inp = keras.Input((2,), dtype="int64")
    out = keras.layers.Dense(1)(sok.DistributedEmbedding(300, 4)(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=sok.OptimizerWrapper(keras.optimizers.Adam()),
                  loss="mse")
    model.fit(np.array([[1, 2], [3, 4]]), np.ones((2, 1)), verbose=0)
    sok.dump(str(tmp_path / "ckpt"), model)
    sok.load(str(tmp_path / "ckpt"), model)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for m in (model, loaded):
        tables = [v for v in m.weights if sok.variable.is_sok_variable(v)]
        for t in tables + [s for t in tables for s in t.slots.values()]:
            assert _reads_alias_the_table(t), t.path


@pytest.mark.parametrize("how", ["eager", "traced", "training_step"])
def test_a_pooled_lookup_after_a_sparse_access_reads_without_copies(how):
    """QA: one sparse access of a table (a user's `tf.gather` of
    `layer.embeddings`, a `scatter_update`; the gathers of 16-bit and
    unpooled ragged lookups) turned TensorFlow's copy-on-read mode on for
    good, and every later pooled lookup copied the whole table (a 2M x 64
    step 3.4 -> 65 ms on the CPU). The pooled lookup's read turns the mode
    off first."""
    values = np.arange(40, dtype="float32").reshape(10, 4)
    table = sok.Variable(values, name="t")
    if "GPU" in table.value.device.upper():
        pytest.skip("compares host buffers: tables on the CPU only")
    tf.gather(table.value, tf.constant([1, 2]))  # a sparse access
    assert not _reads_alias_the_table(table)  # (each read copies now)
    ids = tf.constant([[1, 2], [3, -1]], tf.int64)

    def lookup():
        if how != "training_step":
            return sok.lookup_sparse(table, ids, combiners="sum")
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(table, ids, combiners="sum")
        tape.gradient(out, table)
        return out

    out = (lookup if how == "eager" else tf.function(lookup))()
    np.testing.assert_array_equal(out.numpy(),
                                  [values[1] + values[2], values[3]])
    assert _reads_alias_the_table(table)


def test_a_table_looked_up_pooled_and_unpooled_in_one_step_is_not_copied():
    """QA: a float32 table looked up pooled (a dense read) and unpooled with
    ragged ids (a gather of the variable) in one traced step: the gather,
    while the read lived, copied the whole table and turned copy-on-read
    on, every step (2M x 64: ~40 ms more per step). Both read the table
    the same way now; the values and gradient are TensorFlow's."""
    from sok_keras.lookup import lookup_one

    values = np.arange(40, dtype="float32").reshape(10, 4)
    table = sok.Variable(values, name="t")
    if "GPU" in table.value.device.upper():
        pytest.skip("compares host buffers: tables on the CPU only")
    ref = tf.Variable(values)
    ids = tf.constant([[1, 2], [3, -1]], tf.int64)
    ragged = tf.ragged.constant([[4, 4, 1], [7]], tf.int64)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            pooled = lookup_one(table, ids, combiner="sum")
            unpooled = lookup_one(table, ragged, combiner=None)
            loss = (tf.reduce_sum(pooled * 2.0)
                    + tf.reduce_sum(unpooled.flat_values * 3.0))
        return loss, tape.gradient(loss, table)

    loss, grad = step()
    with tf.GradientTape() as tape:
        want = (tf.reduce_sum(tf.gather(ref, [1, 2, 3])) * 2.0
                + tf.reduce_sum(tf.gather(ref, [4, 4, 1, 7])) * 3.0)
    np.testing.assert_allclose(float(loss), float(want))
    np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(),
                               tf.convert_to_tensor(tape.gradient(
                                   want, ref)).numpy())
    assert _reads_alias_the_table(table)


def test_assign_global_takes_nested_lists():
    """`assign_global` takes what `keras.Variable.assign` takes, nested
    lists too, and a wrong one is named by its own shape (QA: a list was
    refused as "shape ()")."""
    table = sok.Variable(np.zeros((3, 2), "float32"), name="listed")
    table.assign_global([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(table.read_global(),
                                  [[1, 2], [3, 4], [5, 6]])
    with pytest.raises(ValueError, match=r"'listed'.*shape \(2, 2\), but "
                       r"the whole table has shape \(3, 2\)"):
        table.assign_global([[1.0, 2.0], [3.0, 4.0]])


def test_a_table_passed_to_a_tf_function_stays_a_table():
    """SOK's examples pass their tables as `tf.function` arguments
    (`step(params, ids)`): the lookup and the sparse update reach the
    table, traced once. Before: the table arrived as a tensor
    ("lookups need a sok_keras.Variable")."""
    v = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype="float32")
    w = sok.Variable(np.ones((7, 5)), dtype="float32")
    opt = sok.OptimizerWrapper(keras.optimizers.SGD(1.0))

    @tf.function
    def step(params, ids):
        with tf.GradientTape() as tape:
            outs = sok.lookup_sparse(params, ids, combiners="sum")
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        return outs

    ids = [tf.SparseTensor([[0, 0], [0, 1]], tf.constant([1, 1], tf.int64),
                           [1, 3]),
           tf.SparseTensor([[0, 0]], tf.constant([2], tf.int64), [1, 1])]
    first = step([v, w], ids)
    np.testing.assert_array_equal(first[0].numpy(), [[6, 8, 10]])
    np.testing.assert_array_equal(v.numpy()[1], [1, 2, 3])  # 4,5,6 - 2 * 1
    np.testing.assert_array_equal(w.numpy()[2], np.zeros(5))
    second = step([v, w], ids)
    np.testing.assert_array_equal(second[0].numpy(), [[2, 4, 6]])
    assert step.experimental_get_tracing_count() == 1
    # Another table of the same shape is its own argument (its own trace).
    v2 = sok.Variable(np.zeros((17, 3)), dtype="float32")
    np.testing.assert_array_equal(step([v2, w], ids)[0].numpy(),
                                  [[0, 0, 0]])
    np.testing.assert_array_equal(v.numpy()[1], [-1, 0, 1])


@pytest.mark.parametrize("shape", [(-2, 2), (2.5, 2), (True, 2), ("3", 2),
                                   (2, -2), (None, 2), (0, 2), (2, 0),
                                   (2 ** 63 - 1, 2)])
def test_a_bad_table_shape_is_refused_naming_the_table(shape):
    """Before: truncated (2.5), taken as 1 row (True) or as 3 ("3"), a
    local shard of 0 rows (-2, 2**63-1), or a raw TensorFlow / int()
    error."""
    with pytest.raises(ValueError, match=r"Variable 'bad': the table's shape "
                       r"must be two positive integers"):
        sok.Variable("uniform", shape=shape, name="bad")
    if all(type(s) is int and 0 <= s < 10 for s in shape):
        with pytest.raises(ValueError, match="two positive integers"):
            sok.Variable(np.zeros(shape, "float32"), name="bad")


def test_a_table_too_big_to_allocate_names_its_size():
    """Refused before allocating (on a machine that overcommits memory the
    kernel killed the process while the rows were filled: GPU run 13)."""
    with pytest.raises(MemoryError, match=r"Variable 'embeddings': cannot "
                       r"allocate the table 1,099,511,627,776 x 2 float32: "
                       r"this rank's shard \(1,099,511,627,776 rows\) "
                       r"needs 8,192.0 GiB"):
        sok.layers.DistributedEmbedding(2 ** 40, 2).build()


def test_errors_of_an_unnamed_table_do_not_call_it_none():
    """A table made with no name is "(no name)" in the constructor's
    errors (before: `sok_keras.Variable 'None'`), a named one its name."""
    with pytest.raises(ValueError, match=r"Variable \(no name\) must be 2-D"):
        sok.Variable(np.zeros((4,), np.float32))
    with pytest.raises(ValueError, match=r"Variable 'users' must be 2-D"):
        sok.Variable(np.zeros((4,), np.float32), name="users")


def test_initializing_a_shard_makes_no_array_of_its_row_ids():
    """The rows a rank owns are a `range`, not an int64 array: 8 bytes a
    row that a billion-row shard (8 GB of ids) could not afford, and that
    the memory check counted against the table (a 2**32 x 1 float16 table,
    8 GiB, was refused on a 24 GiB machine as needing 40 GiB)."""
    import tracemalloc

    init = keras.initializers.RandomUniform(seed=1)
    sok.Variable(init, shape=(1000, 1), dtype="float16")  # warm up
    tracemalloc.start()
    try:
        table = sok.Variable(init, shape=(4_000_000, 1), dtype="float16")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # NumPy's allocations are traced; the ids would be 30.5 MiB.
    assert peak < 4 << 20, peak
    ref = sok.Variable(init, shape=(4_000_000, 1), dtype="float16")
    np.testing.assert_array_equal(table.numpy(), ref.numpy())
    # An array's rows are still sliced per owner.
    a = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    np.testing.assert_array_equal(sok.Variable(a).numpy(), a)


def test_block_writes_give_int64_bounds(monkeypatch):
    """A block of an initializer's rows is written with int64 bounds.
    Python lists made `begin` int32 (the op's index type) for a block that
    starts below local row 2**31, and its `end` past 2**31 wrapped: the
    write was empty and those rows stayed zero, with no error (a 2**31 +
    1000 row shard: the 1,048,576 rows before row 2**31)."""
    calls = []
    write = tf.raw_ops.ResourceStridedSliceAssign

    def recording(**kw):
        calls.append({k: kw[k] for k in ("begin", "end", "strides")})
        return write(**kw)

    monkeypatch.setattr(tf.raw_ops, "ResourceStridedSliceAssign", recording)
    init = keras.initializers.RandomNormal(seed=5)
    table = sok.Variable(init, shape=(300_000, 8), name="t")
    assert calls, "no block was written in place"
    for call in calls:
        for bound in call.values():
            assert isinstance(bound, tf.Tensor) and bound.dtype == tf.int64
    np.testing.assert_array_equal(
        table.numpy(), np.asarray(init(shape=(300_000, 8))))


@pytest.mark.parametrize("make", [
    lambda a: a.astype("float16"),
    lambda a: tf.constant(a, tf.bfloat16),
    lambda a: keras.ops.cast(a, "bfloat16"),
    lambda a: np.asarray(keras.ops.convert_to_numpy(
        tf.constant(a, tf.bfloat16))),  # ml_dtypes' bfloat16 array
    lambda a: a,
])
def test_the_table_takes_its_initial_values_dtype(make):
    """A float initial value gives the table its dtype, as keras.Variable
    (QA: a bfloat16 value, ml_dtypes' NumPy kind "V", made a float32
    table); ints give float32."""
    a = np.random.default_rng(0).normal(size=(6, 2))
    value = make(a)
    want = keras.Variable(value).dtype
    v = sok.Variable(value)
    assert v.dtype == want
    np.testing.assert_array_equal(
        v.read_global().astype("float64"),
        np.asarray(keras.ops.convert_to_numpy(value)).astype("float64"))
    assert sok.Variable(np.arange(12).reshape(6, 2)).dtype == "float32"


@pytest.mark.parametrize("shape", [(7,), (7, 3), (7, 2, 2)])
@pytest.mark.parametrize("as_variable", [False, True])
def test_slice_rows_reads_rows_with_int64_indices(shape, as_variable):
    """`slice_rows` (the row reads of `sok.dump` and of a save) equals
    Python slicing. TensorFlow's own slicing crashed the process from row
    2**31 on (QA; bench/wide_table.py reads such a table)."""
    from sok_keras.variable import slice_rows

    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    value = tf.Variable(values) if as_variable else tf.constant(values)
    for a, b in [(0, 7), (2, 5), (6, 7), (3, 3)]:
        got = slice_rows(value, a, b)
        assert got.shape == values[a:b].shape
        np.testing.assert_array_equal(got.numpy(), values[a:b])
