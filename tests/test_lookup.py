"""`lookup_sparse` / `all2all_dense_embedding` against TensorFlow's lookups."""

import numpy as np
import pytest
import tensorflow as tf

import sok_keras as sok


def _random_sparse(rng, batch, max_hot, vocab, shuffle=True, empty=True):
    indices, values = [], []
    for b in range(batch):
        k = rng.integers(0 if empty else 1, max_hot + 1)
        for j in range(k):
            indices.append([b, j])
            values.append(rng.integers(0, vocab))
    indices = np.array(indices, np.int64).reshape(-1, 2)
    values = np.array(values, np.int64)
    order = rng.permutation(len(values)) if shuffle else np.arange(
        len(values))
    return indices[order], values[order]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_embedding_lookup_sparse(combiner, weighted):
    rng = np.random.default_rng(1)
    vocab, dim, batch = 50, 7, 33
    table = rng.normal(size=(vocab, dim)).astype(np.float32)
    # Small vocabulary and many ids: lots of duplicates; some empty rows;
    # indices deliberately out of order.
    indices, values = _random_sparse(rng, batch, 6, vocab)
    weights = rng.uniform(0.1, 2.0, len(values)).astype(np.float32)
    sp = tf.SparseTensor(indices, values, [batch, 6])
    sp_w = tf.SparseTensor(indices, weights, [batch, 6]) if weighted else None

    v = sok.Variable(table)
    ref_var = tf.Variable(table)
    with tf.GradientTape(persistent=True) as tape:
        out = sok.lookup_sparse(v, sp, sp_w, combiners=combiner)
        ordered = tf.sparse.reorder(sp)
        ordered_w = tf.sparse.reorder(sp_w) if weighted else None
        ref = tf.nn.embedding_lookup_sparse(
            ref_var, ordered, ordered_w, combiner=combiner)
        upstream = tf.constant(rng.normal(size=(batch, dim)), tf.float32)
        loss = tf.reduce_sum(out * upstream)
        ref_loss = tf.reduce_sum(ref * upstream)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-6,
                               atol=1e-6)
    g = tape.gradient(loss, v)
    g_ref = tape.gradient(ref_loss, ref_var)
    assert isinstance(g, tf.IndexedSlices)
    # Reduced per distinct id: no duplicate rows in the gradient.
    assert len(np.unique(g.indices.numpy())) == len(g.indices.numpy())
    np.testing.assert_allclose(
        tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(g_ref).numpy(),
        rtol=1e-6, atol=1e-6)


def test_ragged_dense_and_sparse_inputs_agree():
    rng = np.random.default_rng(2)
    table = rng.normal(size=(20, 4)).astype(np.float32)
    v = sok.Variable(table)
    dense = np.array([[1, 2, -1], [-1, -1, -1], [5, 5, 19]], np.int64)
    ragged = tf.ragged.constant([[1, 2], [], [5, 5, 19]], tf.int64)
    sparse = tf.SparseTensor([[2, 2], [0, 0], [0, 1], [2, 0], [2, 1]],
                             tf.constant([19, 1, 2, 5, 5], tf.int64), [3, 3])
    expected = np.stack([table[1] + table[2], np.zeros(4),
                         2 * table[5] + table[19]])
    for ids in (dense, ragged, sparse, tf.constant(dense, tf.int32)):
        out = sok.lookup_sparse(v, ids, combiners="sum")
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)
    # A [batch] vector is one id per sample.
    out = sok.lookup_sparse(v, tf.constant([3, 4]), combiners="mean")
    np.testing.assert_allclose(out.numpy(), table[[3, 4]], rtol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_unpooled_ragged_ids_keep_their_padding_positions(weighted):
    """combiner=None over ragged ids with -1 inside a row: a zero row at
    that position, as dense and sparse ids give, so the output's rows have
    the ids' lengths (before: the -1 was dropped, rows [3, 1] came out
    [2, 0] and no longer lined up with parallel per-id features)."""
    rng = np.random.default_rng(5)
    table = rng.normal(size=(6, 3)).astype(np.float32)
    layer = sok.layers.DistributedEmbedding(6, 3, combiner=None,
                                            weights=table)
    layer.build()
    ids = tf.ragged.constant([[1, -1, 2], [-1], [], [5, 5]], tf.int64)
    w = tf.ragged.constant([[0.5, 9.0, 2.0], [9.0], [], [1.0, -1.5]])
    weights = w if weighted else None
    with tf.GradientTape() as tape:
        out = layer(ids, weights) if weighted else layer(ids)
        loss = tf.reduce_sum(out.flat_values ** 2)
    assert out.row_lengths().numpy().tolist() == [3, 1, 0, 2]
    flat_ids = ids.flat_values.numpy()
    flat_w = w.flat_values.numpy() if weighted else np.ones(len(flat_ids))
    want = np.where((flat_ids >= 0)[:, None],
                    table[np.maximum(flat_ids, 0)] * flat_w[:, None], 0.0)
    np.testing.assert_allclose(out.flat_values.numpy(), want, rtol=1e-6)
    dense = (layer(ids.to_tensor(-1), w.to_tensor(0.0)) if weighted
             else layer(ids.to_tensor(-1)))
    np.testing.assert_allclose(out.to_tensor().numpy(), dense.numpy(),
                               rtol=1e-6)
    g = tape.gradient(loss, layer.embeddings)
    g = tf.math.unsorted_segment_sum(g.values, g.indices, 6).numpy()
    g_ref = np.zeros_like(table)
    for i, wi, row in zip(flat_ids, flat_w, want):
        if i >= 0:
            g_ref[i] += 2 * wi * row
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_lookup_in_tf_function_and_several_tables():
    rng = np.random.default_rng(3)
    t1 = rng.normal(size=(30, 3)).astype(np.float32)
    t2 = rng.normal(size=(9, 5)).astype(np.float32)
    v1, v2 = sok.Variable(t1), sok.Variable(t2)

    @tf.function
    def step(a, b):
        return sok.lookup_sparse([v1, v2], [a, b], combiners=["mean", "sum"])

    for batch in (4, 9):  # new shapes retrace / reuse the function
        a = rng.integers(0, 30, size=(batch, 3))
        b = rng.integers(0, 9, size=(batch, 2))
        o1, o2 = step(tf.constant(a), tf.constant(b))
        np.testing.assert_allclose(o1.numpy(), t1[a].mean(1), rtol=1e-6)
        np.testing.assert_allclose(o2.numpy(), t2[b].sum(1), rtol=1e-6)


def test_all2all_dense_embedding_shape_and_values():
    rng = np.random.default_rng(4)
    table = rng.normal(size=(11, 6)).astype(np.float32)
    v = sok.Variable(table)
    ids = rng.integers(0, 11, size=(4, 3, 2))
    out = sok.all2all_dense_embedding(v, ids)
    assert out.shape == (4, 3, 2, 6)
    np.testing.assert_allclose(out.numpy(), table[ids], rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(sok.all2all_dense_embedding(v, ids))
    g = tf.convert_to_tensor(tape.gradient(loss, v)).numpy()
    counts = np.bincount(ids.ravel(), minlength=11)
    np.testing.assert_allclose(g, np.repeat(counts[:, None], 6, 1))


def test_out_of_range_ids_raise_and_name_the_table():
    v = sok.Variable(np.zeros((17, 3), np.float32), name="my_table")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"my_table.*\b17\b"):
        sok.lookup_sparse(v, tf.constant([[1, 17]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"-2"):
        sok.lookup_sparse(v, tf.constant([[1, -2]]))
    with pytest.raises(TypeError, match="integer"):
        sok.lookup_sparse(v, tf.constant([[1.0, 2.0]]))


def test_argument_errors():
    v = sok.Variable(np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match="combiner"):
        sok.lookup_sparse(v, tf.constant([[1]]), combiners="max")
    with pytest.raises(ValueError, match="one ids tensor per table"):
        sok.lookup_sparse([v, v], [tf.constant([[1]])])
    with pytest.raises(TypeError, match="sok_keras.Variable"):
        sok.lookup_sparse(tf.Variable(np.zeros((5, 2))), tf.constant([[1]]))
    sp = tf.SparseTensor([[0, 0], [0, 1]], tf.constant([1, 2], tf.int64),
                         [1, 2])
    with pytest.raises(TypeError, match="SparseTensor ids.*RaggedTensor"):
        sok.lookup_sparse(v, sp, tf.ragged.constant([[1.0, 2.0]]))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_one_rank_pooled_gradient_stays_sparse_in_tf_function(combiner,
                                                              weighted):
    """The one-rank pooled path (SokPooledLookup, straight from the table)
    gives the table an IndexedSlices gradient over distinct rows, also in a
    graph (a densified gradient would cost a pass over the whole table),
    and the values of tf.nn.embedding_lookup_sparse."""
    rng = np.random.default_rng(21)
    table = rng.normal(size=(50, 4)).astype(np.float32)
    v, ref = sok.Variable(table), tf.Variable(table)
    ids = tf.constant([[1, 2, -1], [3, 3, 5], [-1, -1, -1]], tf.int64)
    w = tf.constant(rng.uniform(0.5, 2.0, (3, 3)).astype(np.float32))
    sp = tf.sparse.from_dense(ids + 1)
    sp = tf.SparseTensor(sp.indices, sp.values - 1, sp.dense_shape)
    sp_w = tf.SparseTensor(sp.indices, tf.gather_nd(w, sp.indices),
                           sp.dense_shape)

    @tf.function
    def step():
        with tf.GradientTape(persistent=True) as tape:
            out = sok.lookup_sparse(v, ids, w if weighted else None,
                                    combiners=combiner)
            want = tf.nn.embedding_lookup_sparse(
                ref, sp, sp_w if weighted else None, combiner=combiner)
            loss = tf.reduce_sum(out * out)
            loss_ref = tf.reduce_sum(want * want)
        return (out, want, tape.gradient(loss, v),
                tf.convert_to_tensor(tape.gradient(loss_ref, ref)))

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Converting sparse IndexedSlices"
        out, want, g, g_ref = step()
    assert isinstance(g, tf.IndexedSlices)
    assert sorted(g.indices.numpy().tolist()) == [1, 2, 3, 5]
    # (TF's output stops at the last non-empty row; ours has every row.)
    np.testing.assert_allclose(out.numpy()[:2], want.numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(out.numpy()[2], np.zeros(4))
    dense = tf.math.unsorted_segment_sum(g.values, g.indices, 50)
    np.testing.assert_allclose(dense.numpy(), g_ref.numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("layout", ["ragged", "dense", "sparse",
                                    "ragged_weights", "unpooled"])
def test_eager_tape_around_a_traced_lookup(layout):
    """A tape in eager code around a `tf.function` that looks a table up
    (one rank), as a custom loop that jits only its forward does: the
    gradient is traced into a backward function of its own (before: "Node
    with id 5 is different from the passed in node" for ragged and dense
    ids), and equals tf.nn.embedding_lookup_sparse's."""
    rng = np.random.default_rng(4)
    table = rng.normal(size=(20, 3)).astype(np.float32)
    v, ref = sok.Variable(table), tf.Variable(table)
    ragged = tf.ragged.constant([[1, 2, 2], [3], [], [19, 0]], tf.int64)
    w = tf.ragged.constant([[0.5, 2.0, 1.0], [3.0], [], [1.5, 0.25]])
    ids = {"dense": ragged.to_tensor(-1), "sparse": ragged.to_sparse(),
           "unpooled": tf.constant([[1, 2], [2, -1]], tf.int64)}.get(
               layout, ragged)
    weights = w if layout == "ragged_weights" else None
    combiner = None if layout == "unpooled" else "mean"

    if combiner is None:  # the unpooled path of dense -1-padded ids
        layer = sok.layers.DistributedEmbedding(20, 3, combiner=None,
                                                weights=table)
        layer.build()
        v = layer.embeddings

    def lookup(i):
        if combiner is None:
            return layer(i)
        return sok.lookup_sparse(v, i, weights, combiners=combiner)

    f = tf.function(lookup)
    for _ in range(2):  # the first call traces under the tape, then not
        with tf.GradientTape() as tape:
            out = f(ids)
            loss = tf.reduce_sum(out * out)
        g = tape.gradient(loss, v)
        assert isinstance(g, tf.IndexedSlices)
        with tf.GradientTape() as tape:
            if combiner is None:
                valid = tf.not_equal(ids, -1)
                want = tf.gather(ref, tf.where(valid, ids, 0)) * tf.cast(
                    valid, tf.float32)[..., None]
            else:
                want = tf.nn.embedding_lookup_sparse(
                    ref, ragged.to_sparse(),
                    None if weights is None else w.to_sparse(),
                    combiner=combiner)
            loss_ref = tf.reduce_sum(want * want)
        g_ref = tf.convert_to_tensor(tape.gradient(loss_ref, ref))
        np.testing.assert_allclose(loss.numpy(), loss_ref.numpy(), rtol=1e-5)
        dense = tf.math.unsorted_segment_sum(g.values, g.indices, 20)
        np.testing.assert_allclose(dense.numpy(), g_ref.numpy(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", None])
def test_ragged_weights_must_share_the_ids_row_splits(combiner):
    """Weights with other row splits would be applied, in flat order, to
    the wrong samples: refused."""
    v = sok.Variable(np.ones((10, 2), np.float32))
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)
    good = tf.ragged.constant([[1.0, 2.0], [3.0]])
    bad = tf.ragged.constant([[1.0], [2.0, 3.0]])
    layer = sok.layers.DistributedEmbedding(10, 2, combiner=combiner)
    layer(ids, good)  # builds, and matching splits are fine
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="row splits of the ids"):
        layer(ids, bad)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="row splits of the ids"):
        sok.lookup_sparse(v, ids, bad, combiners="sum")


@pytest.mark.parametrize("weighted", [False, True])
def test_one_rank_unpooled_dense_ids(weighted):
    """Unpooled dense ids on one rank (SokPooledLookup over one-id bags):
    each position's row times its weight, zeros at -1 padding, bad ids
    named; the gradient is an IndexedSlices over distinct rows equal to
    tf.gather's, also in a graph."""
    rng = np.random.default_rng(5)
    table = rng.normal(size=(30, 6)).astype(np.float32)
    v, ref = sok.Variable(table, name="unpooled_t"), tf.Variable(table)
    ids = tf.constant([[4, 4, -1, 7], [0, 29, 4, -1], [-1, -1, -1, -1]],
                      tf.int64)
    w = tf.constant(rng.uniform(0.5, 2.0, (3, 4)).astype(np.float32))
    keep = tf.cast(ids >= 0, tf.float32)[..., None]
    scale = (w[..., None] if weighted else 1.0) * keep
    up = tf.constant(rng.normal(size=(3, 4, 6)).astype(np.float32))

    @tf.function
    def step():
        with tf.GradientTape(persistent=True) as tape:
            out = sok.lookup.lookup_one(v, ids, w if weighted else None,
                                        combiner=None)
            want = tf.gather(ref, tf.maximum(ids, 0)) * scale
            loss = tf.reduce_sum(out * up)
            loss_ref = tf.reduce_sum(want * up)
        return (out, want, tape.gradient(loss, v),
                tf.convert_to_tensor(tape.gradient(loss_ref, ref)))

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Converting sparse IndexedSlices"
        out, want, g, g_ref = step()
    assert out.shape == (3, 4, 6)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-6)
    assert isinstance(g, tf.IndexedSlices)
    assert sorted(g.indices.numpy().tolist()) == [0, 4, 7, 29]
    dense = tf.math.unsorted_segment_sum(g.values, g.indices, 30)
    np.testing.assert_allclose(dense.numpy(), g_ref.numpy(), rtol=1e-5,
                               atol=1e-6)
    flat = sok.lookup.lookup_one(v, tf.constant([3, -1, 2]), combiner=None)
    np.testing.assert_array_equal(flat.numpy(),
                                  [table[3], np.zeros(6), table[2]])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"unpooled_t.*\b30\b"):
        sok.lookup.lookup_one(v, tf.constant([[1, 30]]), combiner=None)
    with pytest.raises(ValueError, match=r"one entry per id.*weights "
                       r"shape=\(3, 3\), ids shape=\(3, 4\)"):
        sok.lookup.lookup_one(v, ids, tf.ones([3, 3]), combiner=None)


def _weights_grads(lookup, ref_lookup, wv, upstream):
    """d(sum(lookup(w) * upstream))/dw and the same for `ref_lookup`."""
    grads = []
    for fn in (lookup, ref_lookup):
        with tf.GradientTape() as tape:
            tape.watch(wv)
            loss = tf.reduce_sum(fn(wv) * upstream)
        grads.append(tf.convert_to_tensor(tape.gradient(loss, wv)))
    return grads


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("layout", ["dense", "ragged", "sparse"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_get_embedding_lookup_sparses_gradient(combiner, layout,
                                                       dtype):
    """Per-id weights are differentiable (a weight model trains), with
    tf.nn.embedding_lookup_sparse's gradient: through the numerator and the
    mean/sqrtn denominators; padding and an empty sample get none. Dense and
    ragged ids take SokPooledLookup on one rank, sparse ids and 16-bit
    tables SokSegmentCombine."""
    rng = np.random.default_rng(7)
    table = rng.normal(size=(20, 4)).astype(np.float32)
    v = sok.Variable(table, name="wgrad_t", dtype=dtype)
    ref = tf.Variable(tf.cast(tf.cast(table, dtype), tf.float32))
    rows = [[1, 2, 2], [], [5], [7, 3, 1, 19], [4, 4]]
    ids_r = tf.ragged.constant(rows, tf.int64)
    wv = tf.constant(rng.uniform(0.2, 2.0, size=10).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(5, 4)).astype(np.float32))

    def as_layout(w_r):
        if layout == "ragged":
            return ids_r, w_r
        if layout == "sparse":
            return ids_r.to_sparse(), w_r.to_sparse()
        return ids_r.to_tensor(-1), w_r.to_tensor(0.0)

    def sok_lookup(w):
        ids, weights = as_layout(
            tf.RaggedTensor.from_row_splits(w, ids_r.row_splits))
        return tf.cast(sok.lookup_sparse(v, ids, weights, combiner),
                       tf.float32)

    def ref_lookup(w):
        weights = tf.RaggedTensor.from_row_splits(w, ids_r.row_splits)
        return tf.nn.embedding_lookup_sparse(
            ref, ids_r.to_sparse(), weights.to_sparse(), combiner=combiner)

    tol = 1e-5 if dtype == "float32" else 2e-2
    for fn in (lambda w: _weights_grads(sok_lookup, ref_lookup, w, upstream),
               tf.function(lambda w: _weights_grads(sok_lookup, ref_lookup,
                                                    w, upstream))):
        g, g_ref = fn(wv)
        assert g is not None
        np.testing.assert_allclose(g.numpy(), g_ref.numpy(), rtol=tol,
                                   atol=tol)


def test_unpooled_weights_and_a_weight_model_train():
    """combiner=None: each position's row times its weight; the weight's
    gradient is <row, upstream> (zero at padding). In model.fit a Dense
    that makes the weights is trained (it was not: the lookup's gradient
    for the weights was None)."""
    rng = np.random.default_rng(8)
    table = rng.normal(size=(30, 3)).astype(np.float32)
    v, ref = sok.Variable(table, name="unpooled_w"), tf.Variable(table)
    ids = tf.constant([[4, 4, -1], [0, 29, 4]], tf.int64)
    wv = tf.constant(rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32))
    up = tf.constant(rng.normal(size=(2, 3, 3)).astype(np.float32))
    keep = tf.cast(ids >= 0, tf.float32)[..., None]
    g, g_ref = _weights_grads(
        lambda w: sok.lookup.lookup_one(v, ids, w, combiner=None),
        lambda w: tf.gather(ref, tf.maximum(ids, 0)) * w[..., None] * keep,
        wv, up)
    np.testing.assert_allclose(g.numpy(), g_ref.numpy(), rtol=1e-5,
                               atol=1e-6)
    assert g.numpy()[0, 2] == 0.0

    import keras

    for combiner in ("sum", None):
        keras.utils.set_random_seed(3)
        ids_in = keras.Input((3,), dtype="int64")
        feats = keras.Input((3,))
        w = keras.layers.Dense(3, activation="sigmoid", name="weight_net")(
            feats)
        emb = sok.layers.DistributedEmbedding(30, 4, combiner=combiner)(
            ids_in, w)
        out = keras.layers.Dense(1)(keras.layers.Flatten()(emb))
        model = keras.Model([ids_in, feats], out)
        model.compile(optimizer=sok.OptimizerWrapper(
            keras.optimizers.SGD(0.5)), loss="mse")
        net = model.get_layer("weight_net")
        before = net.kernel.numpy().copy()
        x = [rng.integers(0, 30, (16, 3)), rng.normal(size=(16, 3))]
        model.fit(x, rng.normal(size=(16, 1)), epochs=2, verbose=0)
        assert np.abs(net.kernel.numpy() - before).max() > 1e-4, combiner


def test_default_combiner_is_mean_as_in_sok():
    """SOK's `lookup_sparse` (and `tf.nn.embedding_lookup_sparse`) pool
    with "mean" when no combiner is given; a ported script keeps its
    numbers (before: "sum")."""
    v = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype="float32")
    ids = tf.SparseTensor([[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]],
                          [1, 1, 3, 4, 5], [2, 3])
    np.testing.assert_array_equal(sok.lookup_sparse(v, ids).numpy(),
                                  [[3, 4, 5], [12, 13, 14]])
    ref = tf.nn.embedding_lookup_sparse(tf.constant(v.numpy()), ids, None)
    np.testing.assert_array_equal(sok.lookup_sparse([v], [ids])[0].numpy(),
                                  ref.numpy())


def test_a_lookup_inside_an_xla_function_names_the_table():
    """Before: XLA's "No registered 'SokPooledGradPlan' OpKernel for
    XLA_CPU_JIT", naming no table."""
    v = sok.Variable(np.ones((5, 2)), dtype="float32", name="t")

    @tf.function(jit_compile=True)
    def f(ids):
        return sok.lookup_sparse(v, ids)

    with pytest.raises(ValueError, match=r"table 't'.*XLA-compiled.*"
                       r"jit_compile"):
        f(tf.constant([[1, 2]], tf.int64))


def test_one_rank_refuses_weights_of_another_shape_eagerly():
    """Weights with as many entries as ids but another shape (transposed,
    flat, or 3-D ids' weights of another layout): refused eagerly as in a
    tf.function and on N ranks (before: taken in flat order, silently)."""
    table = np.arange(20, dtype="float32").reshape(10, 2)
    emb = sok.layers.DistributedEmbedding(10, 2, combiner="sum",
                                          weights=table, name="emb")
    ids = tf.constant([[1, 2, 3], [4, 5, 6]], tf.int64)
    for w in (tf.ones([3, 2]), tf.ones([6])):
        with pytest.raises(ValueError, match=r"table 'emb': the weights must "
                           r"have one entry per id.*ids shape=\(2, 3\)"):
            emb(ids, w)
        with pytest.raises(ValueError, match="one entry per id"):
            sok.lookup_sparse(emb.embeddings, ids, w, combiners="sum")
    deep = sok.layers.DistributedEmbedding(10, 2, combiner=None,
                                           weights=table, name="deep")
    ids3 = tf.constant([[[1, 2, 3], [4, 5, 6]]], tf.int64)
    for call in (deep, tf.function(deep)):
        with pytest.raises(ValueError, match=r"table 'deep': the weights "
                           r".*shape=\(1, 3, 2\), ids shape=\(1, 2, 3\)"):
            call(ids3, tf.ones([1, 3, 2]))
    np.testing.assert_array_equal(  # the right shape still works
        deep(ids3, tf.ones([1, 2, 3]))[0, 1, 2], table[6])


def test_lookup_sparse_argument_checks_with_several_tables():
    """A bad `pooling` is refused with two tables as with one (before:
    ignored), and no tables at all is a clear error (before: IndexError)."""
    v, w = sok.Variable(np.ones((4, 2))), sok.Variable(np.ones((4, 2)))
    ids = tf.constant([[1, 2]], tf.int64)
    for params, sp_ids in (([v], [ids]), ([v, w], [ids, ids])):
        with pytest.raises(ValueError, match=r"`pooling` must be one of.*"
                           r"Received: pooling='x'"):
            sok.lookup_sparse(params, sp_ids, pooling="x")
    with pytest.raises(ValueError, match="at least one table"):
        sok.lookup_sparse([], [])


def test_all2all_dense_embedding_names_the_table_for_ragged_or_sparse_ids():
    """Before: "TypeError: object of type 'RaggedTensor' has no len()" and
    "Attempt to convert ... SparseTensor", naming no table."""
    v = sok.Variable(np.ones((6, 2)), name="fixed")
    ragged = tf.ragged.constant([[1, 2], [3]], tf.int64)
    for ids in (ragged, ragged.to_sparse()):
        with pytest.raises(TypeError, match=r"table 'fixed': the ids must be "
                           r"a dense tensor.*use lookup_sparse"):
            sok.all2all_dense_embedding(v, ids)


@pytest.mark.parametrize("form", ["ragged", "sparse"])
def test_minus_one_is_padding_in_ragged_and_sparse_ids_too(form):
    """One padding value in every id form (docs/failures.md): -1 inside
    ragged or sparse ids is dropped as it is in dense ids, so `[[1, -1],
    [3]]` with "mean" gives row 1 alone for sample 0; another negative id
    is an error naming it."""
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    v = sok.Variable(table)
    ragged = tf.ragged.constant([[1, -1], [3]], dtype=tf.int64)
    ids = ragged if form == "ragged" else ragged.to_sparse()
    out = sok.lookup_sparse(v, ids, combiners="mean")
    np.testing.assert_array_equal(out.numpy(), table[[1, 3]])
    bad = tf.ragged.constant([[1, -5], [3]], dtype=tf.int64)
    bad = bad if form == "ragged" else bad.to_sparse()
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="-5"):
        sok.lookup_sparse(v, bad, combiners="mean")


def test_a_traced_lookups_graph_is_freed_with_its_function():
    """The lookups traced into a graph are listed on the graph itself
    (`lookups_before_update`): a WeakKeyDictionary from graphs to their
    tensors kept every graph that held a lookup alive for good (the
    tensors refer to their graph), a leak per model built in a loop."""
    import gc

    from tensorflow.python.framework.func_graph import FuncGraph

    def graphs():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, FuncGraph))

    table = sok.Variable(np.ones((100, 4), np.float32))
    ids = tf.constant([[1, 2], [3, -1]], tf.int64)
    before = graphs()
    for _ in range(3):
        f = tf.function(lambda: sok.lookup_sparse(table, ids, combiners="sum"))
        f()
        del f
    assert graphs() == before


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("form", ["dense", "ragged", "sparse"])
@pytest.mark.parametrize("combiner", ["sum", None])
def test_an_invalid_id_is_named_at_its_position_in_the_input(dtype, form,
                                                             combiner):
    """Every table dtype and path names an invalid id's position in the flat
    input, padding included (a SparseTensor's: in its values) (QA: the paths
    that dedup first, 16-bit tables and float32 unpooled ragged or sparse
    ids, named its position among the ids left without the padding)."""
    name = f"pos_{form}_{dtype}_{combiner}"
    table = sok.Variable(np.ones((5, 2), np.float32), dtype=dtype, name=name)
    if form == "dense":
        ids = tf.constant([[-1, -1, 2], [-1, 99, -1]], tf.int64)
        where = "at position 4"
    elif form == "ragged":
        ids = tf.ragged.constant([[2, -1], [-1, 99]], tf.int64)
        where = "at position 3"
    else:
        ids = tf.SparseTensor([[0, 0], [0, 1], [1, 0], [1, 1]],
                              tf.constant([-1, 2, -1, 99], tf.int64), [2, 2])
        where = "at position 3"
    for call in (sok.lookup_sparse, tf.function(sok.lookup_sparse)):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=f"'{name}': id 99 {where} "):
            call(table, ids, combiners=combiner)


def test_an_invalid_id_of_a_collection_is_named_at_its_position():
    coll = sok.layers.EmbeddingCollection(
        tables={"t": {"vocabulary_size": 5, "embedding_dim": 2}},
        features={"a": {"table": "t"}, "b": {"table": "t"}}, name="coll")
    good = tf.constant([[0, -1]], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="id 99 at position 2 "):
        coll({"a": good, "b": tf.constant([[1, -1], [99, -1]], tf.int64)})


_PENALTY_IDS = [[0, 2, -1], [3, 3, 5]]
_PENALTY_W = [[0.5, 1.5, 0.0], [1.0, 2.0, 0.7]]
_PENALTY_G = [[1.0, -2.0], [0.5, 3.0]]


def _penalty_grads(lookup, table, of):
    """d(penalty)/d(weights, table) with penalty = |dL/d`of`|^2 of a
    weighted mean lookup's loss L."""
    w = tf.Variable(_PENALTY_W)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            out = tf.cast(lookup(table, w * 1.0), tf.float32)
            loss = tf.reduce_sum(out * tf.constant(_PENALTY_G))
        g = inner.gradient(loss, w if of == "weights" else table)
        penalty = tf.reduce_sum(tf.square(tf.cast(
            tf.convert_to_tensor(g), tf.float32)))
    return outer.gradient(penalty, [w, table])


def _sok_mean(table, w):
    return sok.lookup_sparse(table, tf.constant(_PENALTY_IDS, tf.int64), w,
                             combiners="mean")


def _sok_fused_mean(table, w):
    ids = tf.constant(_PENALTY_IDS, tf.int64)
    a, b = sok.lookup_sparse([table, table], [ids, ids], [w, None],
                             combiners=["mean", "sum"])
    return a + 0.0 * b


def _tf_mean(table, w):
    ids = tf.constant(_PENALTY_IDS, tf.int64)
    where = tf.where(ids >= 0)
    shape = tf.shape(ids, tf.int64)
    return tf.nn.embedding_lookup_sparse(
        table, tf.SparseTensor(where, tf.gather_nd(ids, where), shape),
        tf.SparseTensor(where, tf.gather_nd(w, where), shape),
        combiner="mean")


@pytest.mark.parametrize("dtype,lookup", [
    ("float32", _sok_mean), ("float32", _sok_fused_mean),
    ("float16", _sok_mean)])
def test_a_second_order_gradient_through_a_table_gradient_is_refused(
        dtype, lookup):
    """The gradient of d loss / d table (a gradient penalty on it) is
    refused, naming what is not supported (QA: the fused and 16-bit paths
    silently dropped its term, the float32 path raised a bare LookupError
    naming an op)."""
    table = sok.Variable(np.arange(12).reshape(6, 2) / 10, dtype=dtype)
    with pytest.raises(NotImplementedError,
                       match="second-order gradient through a table's "
                             "gradient is not supported"):
        _penalty_grads(lookup, table, "table")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("lookup", [_sok_mean, _sok_fused_mean])
def test_the_gradient_of_the_weights_gradient_is_tensorflows(dtype, lookup):
    """A penalty on d loss / d weights differentiates as TensorFlow's
    lookup does, with respect to the weights and the table."""
    values = np.arange(12).reshape(6, 2) / 10
    table = sok.Variable(values, dtype=dtype)
    got = _penalty_grads(lookup, table, "weights")
    want = _penalty_grads(_tf_mean, tf.Variable(values, dtype=tf.float32),
                          "weights")
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=tol,
                               atol=tol)
    np.testing.assert_allclose(
        tf.cast(tf.convert_to_tensor(got[1]), tf.float32).numpy(),
        tf.convert_to_tensor(want[1]).numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,combiner,ragged", [
    ("float16", "sum", False), ("bfloat16", None, False),
    ("float16", "mean", True), ("float32", None, True)])
@pytest.mark.parametrize("traced", [False, True])
def test_tables_of_2_31_rows_or_more_make_their_own_gather_gradient(
        monkeypatch, dtype, combiner, ragged, traced):
    """QA: traced, TensorFlow's gradient of the gather from a table of
    2**31 local rows or more wrote the table's shape as int32, and the
    step failed while it was built ("Invalid value in tensor used for
    shape: -2147483584"). Such tables take `gather_table_rows`' own
    gradient (int64 shape); here a small table takes it with the threshold
    lowered, and matches TensorFlow's. bench/wide_table.py runs a table of
    2**31 + 64 rows end to end (fit, dump/load, save/load)."""
    from sok_keras import lookup

    values = np.arange(30).reshape(10, 3) / 8
    ids = (tf.ragged.constant([[1, 2, 2], [9], []], tf.int64) if ragged
           else tf.constant([[1, 2], [9, -1], [2, 2]], tf.int64))

    def step(layer):
        with tf.GradientTape() as tape:
            out = layer(ids)
            out = tf.reshape(tf.cast(
                out.flat_values if isinstance(out, tf.RaggedTensor) else out,
                tf.float32), [-1])
            loss = tf.reduce_sum(
                out * tf.range(1, 1 + tf.size(out), dtype=tf.float32))
        grad = tape.gradient(loss, layer.embeddings)
        return out, grad

    results = []
    for wide_rows in (2 ** 31, 1):
        monkeypatch.setattr(lookup, "_WIDE_ROWS", wide_rows)
        layer = sok.layers.DistributedEmbedding(10, 3, combiner=combiner,
                                                dtype=dtype)
        layer.build((None, 2))
        layer.embeddings.assign(values)
        out, grad = (tf.function(step) if traced else step)(layer)
        assert isinstance(grad, tf.IndexedSlices)
        results.append((out, grad))
    (out, grad), (wide_out, wide_grad) = results
    assert wide_grad.dense_shape.dtype == tf.int64
    np.testing.assert_array_equal(wide_out.numpy(), out.numpy())
    np.testing.assert_array_equal(
        tf.cast(tf.convert_to_tensor(wide_grad), tf.float32).numpy(),
        tf.cast(tf.convert_to_tensor(grad), tf.float32).numpy())
