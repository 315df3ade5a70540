"""Property tests (hypothesis): lookups, their backward and every sparse
optimizer rule against independent references, over random shapes, dtypes,
duplicate ids, weights and rank counts.

- Lookup (every combiner, pooled and unpooled, with and without weights,
  float32/float64/float16/bfloat16 tables): `sok.lookup_sparse` /
  `lookup_one` on one rank against a NumPy pooling of the table, and the
  table's gradient (a `tf.IndexedSlices`) against the NumPy gradient.
- Rank counts: the N-rank sharding simulated in one process with the core
  ops the exchange runs (`SokDedupBucketize` with `num_ranks=N`, each
  owner's shard from `sok_keras.variable.global_to_local`,
  `SokSegmentCombine`) equals the NumPy pooling of the whole table, for
  N = 1..5 and both sharding modes.
- Every rule of `sok_keras.optimizers.sparse_rules` through
  `OptimizerWrapper` on a `sok.Variable` against Keras' own optimizer on a
  plain float64 variable fed the dense gradient: with the same rows touched
  in every step (a lazy update equals the dense one there) the touched rows
  must match, and the other rows must not move.

Profiles are derandomized with few examples so that the file runs in well
under a minute on 2 cores and CI is reproducible.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import sok_keras as sok
from sok_keras import lookup_ops
from sok_keras.variable import global_to_local
from sok_keras.variable import parse_mode

PROFILE = dict(derandomize=True, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow])

# Tolerances: the table dtype's rounding (16-bit tables round each output
# element once) on values of size ~10.
TOL = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 1.5e-1}
COMBINERS = ("sum", "mean", "sqrtn")


@pytest.fixture(autouse=True)
def _clear_session():
    # Overrides conftest's (~0.6 s a call): hypothesis runs many examples
    # per test, and each builds only its own variables.
    yield


def _round(x, dtype):
    """What a table of `dtype` stores of float64 `x`."""
    return tf.cast(tf.constant(x, tf.float64), dtype).numpy().astype(
        np.float64)


def np_pool(table, ids, weights, combiner):
    """NumPy reference of a pooled lookup of dense -1 padded `ids`."""
    b, _ = ids.shape
    out = np.zeros((b, table.shape[1]))
    for i in range(b):
        keep = ids[i] >= 0
        w = weights[i][keep] if weights is not None else np.ones(keep.sum())
        s = (w[:, None] * table[ids[i][keep]]).sum(0)
        if combiner == "mean":
            d = w.sum()
        elif combiner == "sqrtn":
            d = np.sqrt((w * w).sum())
        else:
            d = 1.0
        out[i] = s / d if d != 0 else 0.0
    return out


def np_pool_grad(table_shape, ids, weights, combiner, dy):
    """NumPy gradient of `sum(pool * dy)` with respect to the table."""
    g = np.zeros(table_shape)
    for i in range(ids.shape[0]):
        keep = ids[i] >= 0
        w = weights[i][keep] if weights is not None else np.ones(keep.sum())
        if combiner == "mean":
            d = w.sum()
        elif combiner == "sqrtn":
            d = np.sqrt((w * w).sum())
        else:
            d = 1.0
        if d == 0:
            continue
        for wi, r in zip(w, ids[i][keep]):
            g[r] += wi / d * dy[i]
    return g


@st.composite
def lookups(draw, dtypes=("float32", "float64", "float16", "bfloat16")):
    rows = draw(st.integers(1, 40))
    dim = draw(st.integers(1, 6))
    batch = draw(st.integers(0, 6))
    width = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    # Few distinct ids, so that duplicates (within and across samples) are
    # common; -1 is padding.
    pool = rng.integers(0, rows, size=max(1, rows // 3 + 1))
    ids = rng.choice(np.concatenate([pool, [-1]]), size=(batch, width))
    table = _round(rng.uniform(-2, 2, (rows, dim)), dtype)
    weights = None
    if draw(st.booleans()):
        weights = _round(rng.uniform(0.25, 2.0, (batch, width)), dtype)
    return table, ids.astype(np.int64), weights, dtype, rng


@settings(max_examples=40, **PROFILE)
@given(case=lookups(), combiner=st.sampled_from(COMBINERS),
       in_function=st.booleans())
def test_pooled_lookup_and_gradient_match_numpy(case, combiner, in_function):
    table, ids, weights, dtype, rng = case
    v = sok.Variable(table, dtype=dtype)
    dy = rng.uniform(-1, 1, (ids.shape[0], table.shape[1]))

    def step():
        with tf.GradientTape() as tape:
            out = sok.lookup_sparse(
                v, tf.constant(ids),
                None if weights is None else tf.constant(weights, dtype),
                combiners=combiner)
            loss = tf.reduce_sum(tf.cast(out, tf.float64) * dy)
        return out, tape.gradient(loss, v)

    out, g = tf.function(step)() if in_function else step()
    tol = TOL[dtype]
    want = np_pool(table, ids, weights, combiner)
    np.testing.assert_allclose(out.numpy().astype(np.float64), want,
                               rtol=tol, atol=tol)
    assert out.shape == (ids.shape[0], table.shape[1])
    want_g = np_pool_grad(table.shape, ids, weights, combiner, dy)
    if g is None:  # no id looked up
        assert not want_g.any()
        return
    assert isinstance(g, tf.IndexedSlices)
    got_g = tf.math.unsorted_segment_sum(
        tf.cast(g.values, tf.float64), g.indices, table.shape[0]).numpy()
    np.testing.assert_allclose(got_g, want_g, rtol=tol, atol=tol)
    # Only the rows looked up have a gradient, each once.
    idx = g.indices.numpy()
    assert len(set(idx.tolist())) == len(idx)
    assert set(idx.tolist()) == set(ids[ids >= 0].tolist())


@settings(max_examples=25, **PROFILE)
@given(case=lookups(dtypes=("float32", "float64")),
       structure=st.sampled_from(["dense", "ragged", "sparse"]))
def test_unpooled_lookup_and_gradient_match_numpy(case, structure):
    """Unpooled rows (zeros at padding), dense, ragged or sparse ids."""
    table, ids, weights, dtype, rng = case
    v = sok.Variable(table, dtype=dtype)
    w = None if weights is None else tf.constant(weights, dtype)
    if structure == "dense":
        x = tf.constant(ids)
    elif structure == "ragged":
        x = tf.RaggedTensor.from_tensor(tf.constant(ids), padding=-1)
        if w is not None:
            w = tf.RaggedTensor.from_tensor(w, lengths=x.row_lengths())
    else:
        x = tf.sparse.from_dense(tf.constant(ids) + 1)
        x = tf.SparseTensor(x.indices, x.values - 1, x.dense_shape)
        if w is not None:
            w = tf.SparseTensor(x.indices, tf.gather_nd(w, x.indices),
                                x.dense_shape)
    per_id = np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0.0)
    if weights is not None:
        per_id = per_id * weights[..., None]
    dy = rng.uniform(-1, 1, per_id.shape)
    with tf.GradientTape() as tape:
        out = sok.lookup.lookup_one(v, x, w, combiner=None)
        dense = out.to_tensor(shape=per_id.shape) if isinstance(
            out, tf.RaggedTensor) else out
        loss = tf.reduce_sum(tf.cast(dense, tf.float64) * dy)
    g = tape.gradient(loss, v)
    np.testing.assert_allclose(dense.numpy(), per_id, rtol=1e-5, atol=1e-5)
    want_g = np.zeros(table.shape)
    for pos in zip(*np.nonzero(ids >= 0)):
        wi = 1.0 if weights is None else weights[pos]
        want_g[ids[pos]] += wi * dy[pos]
    got_g = np.zeros(table.shape) if g is None else (
        tf.math.unsorted_segment_sum(tf.cast(g.values, tf.float64),
                                     g.indices, table.shape[0]).numpy())
    np.testing.assert_allclose(got_g, want_g, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, **PROFILE)
@given(case=lookups(dtypes=("float32", "float64")),
       num_ranks=st.integers(1, 5), combiner=st.sampled_from(COMBINERS),
       localized=st.booleans(), data=st.data())
def test_sharded_exchange_simulated_in_one_process(case, num_ranks, combiner,
                                                   localized, data):
    """What N ranks compute, simulated: every rank's ids deduplicated and
    bucketed by owner (`SokDedupBucketize`), each owner gathering the rows
    from its own shard (`global_to_local`), pooled at home
    (`SokSegmentCombine`), equals pooling the whole table."""
    table, ids, weights, dtype, _ = case
    rows = table.shape[0]
    target = data.draw(st.integers(0, num_ranks - 1)) if localized else -1
    mode = f"localized:{target}" if localized else "distributed"
    kind, target = parse_mode(mode, num_ranks)
    shards = [table[global_to_local(rows, kind, r, num_ranks)]
              if kind == "distributed" or r == target
              else table[:0] for r in range(num_ranks)]
    flat = ids.reshape(-1)
    keep = flat >= 0
    values = flat[keep]
    segs = np.repeat(np.arange(ids.shape[0]), ids.shape[1])[keep]
    d = lookup_ops.dedup_bucketize(values, num_ranks=num_ranks,
                                   vocab_size=rows, owner=target)
    unique = d.unique_ids.numpy()
    local = d.local_rows.numpy()
    counts = d.counts.numpy()
    assert d.error.numpy()[0] == -1
    np.testing.assert_array_equal(unique[d.inverse.numpy()], values)
    assert len(set(unique.tolist())) == len(unique)
    owners = np.repeat(np.arange(num_ranks), counts)
    assert counts.sum() == len(unique)
    if kind == "distributed":
        np.testing.assert_array_equal(owners, unique % num_ranks)
    else:
        assert (owners == target).all()
    # Each owner serves its distinct ids from its own shard.
    got_rows = np.stack([shards[o][r] for o, r in zip(owners, local)]) if (
        len(unique)) else np.zeros((0, table.shape[1]))
    np.testing.assert_array_equal(got_rows, table[unique])
    w = tf.zeros([0], dtype) if weights is None else tf.constant(
        weights.reshape(-1)[keep], dtype)
    out = lookup_ops.segment_combine(
        tf.constant(got_rows, dtype), d.inverse, segs, w, ids.shape[0],
        combiner).numpy()
    np.testing.assert_allclose(out, np_pool(table, ids, weights, combiner),
                               rtol=1e-5, atol=1e-5)


@settings(max_examples=20, **PROFILE)
@given(vocab=st.integers(1, 2 ** 40), num_ranks=st.integers(1, 8),
       bad=st.sampled_from([-2, -(2 ** 63), 2 ** 31, 2 ** 32 + 1,
                            2 ** 63 - 1]), data=st.data())
def test_dedup_reports_the_first_invalid_id(vocab, num_ranks, bad, data):
    """Any id outside [0, vocab) is reported (never wrapped), with its
    position; valid ids around it do not matter."""
    n = data.draw(st.integers(1, 6))
    pos = data.draw(st.integers(0, n - 1))
    ids = np.array(data.draw(st.lists(st.integers(0, min(vocab, 2 ** 62) - 1),
                                      min_size=n, max_size=n)), np.int64)
    if bad < vocab and bad >= 0:
        bad = vocab  # the smallest invalid id
    ids[pos] = bad
    d = lookup_ops.dedup_bucketize(ids, num_ranks=num_ranks, vocab_size=vocab,
                                   raise_on_error=False)
    assert d.error.numpy().tolist() == [pos, bad]
    assert d.counts.numpy().sum() == 0


# -- optimizer rules ----------------------------------------------------------


def _optimizers():
    return {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.8,
                                                 nesterov=True),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "amsgrad": lambda: keras.optimizers.Adam(0.02, amsgrad=True),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
        "ftrl": lambda: keras.optimizers.Ftrl(
            0.1, l1_regularization_strength=0.01,
            l2_regularization_strength=0.02, beta=0.1),
        "ftrl_shrinkage": lambda: keras.optimizers.Ftrl(
            0.05, l2_shrinkage_regularization_strength=0.1),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
        "rmsprop_momentum_centered": lambda: keras.optimizers.RMSprop(
            0.01, momentum=0.5, centered=True),
        "adamax": lambda: keras.optimizers.Adamax(0.01),
        "adadelta": lambda: keras.optimizers.Adadelta(0.5),
        # (A small rate: a sign that float64 and a 16-bit table see
        # differently moves a row by 2 x the rate.)
        "lion": lambda: keras.optimizers.Lion(0.001),
        "nadam": lambda: keras.optimizers.Nadam(0.01),
        "muon": lambda: keras.optimizers.Muon(0.01, adam_lr_ratio=0.5,
                                              adam_weight_decay=0.05),
    }


# (float64: Keras computes Adam's bias corrections of a float64 variable
# in float32 -- ~1e-5 relative of the step -- where sok_keras' kernels
# follow the float64 formula; the 16-bit tables round each stored row.)
RULE_TOL = {"float64": 2e-5, "float32": 2e-5, "float16": 4e-3,
            "bfloat16": 3e-2}


def test_every_sparse_rule_has_a_property_case():
    from sok_keras.optimizers import sparse_rules

    names = {sparse_rules.rule_for(make()).name
             for make in _optimizers().values()}
    assert names == set(sparse_rules.SUPPORTED)


@pytest.mark.parametrize("opt_name", sorted(_optimizers()))
@settings(max_examples=6, **PROFILE)
@given(rows=st.integers(2, 30), dim=st.integers(1, 4),
       steps=st.integers(1, 4), dtype=st.sampled_from(
           ["float32", "float64", "float16", "bfloat16"]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_sparse_rule_matches_keras(opt_name, rows, dim, steps, dtype, seed):
    rng = np.random.default_rng(seed)
    table = _round(rng.uniform(-1, 1, (rows, dim)), dtype)
    touched = np.unique(rng.integers(0, rows, size=max(1, rows // 2)))
    make = _optimizers()[opt_name]
    v = sok.Variable(table, dtype=dtype, name="t")
    ours = sok.OptimizerWrapper(make())
    if opt_name == "muon":  # Muon reads `path`: an embedding takes AdamW
        ref_var = keras.Variable(table, dtype="float64", name="embeddings")
    else:
        ref_var = tf.Variable(table, dtype=tf.float64)
    ref = make()
    for _ in range(steps):
        # The touched rows, each 1-3 times (duplicates summed), shuffled.
        idx = rng.permutation(np.repeat(touched, rng.integers(
            1, 4, size=len(touched))))
        g = rng.normal(size=(len(idx), dim))
        ours.apply_gradients([(tf.IndexedSlices(
            tf.constant(g, dtype), tf.constant(idx, tf.int64),
            tf.constant([rows, dim], tf.int64)), v)])
        dense = np.zeros((rows, dim))
        np.add.at(dense, idx, g)
        ref.apply_gradients([(tf.constant(dense), ref_var)])
    got = v.numpy().astype(np.float64)
    want = ref_var.numpy()
    tol = RULE_TOL[dtype] * steps
    np.testing.assert_allclose(got[touched], want[touched], rtol=tol,
                               atol=tol)
    others = np.setdiff1d(np.arange(rows), touched)
    np.testing.assert_array_equal(got[others], table[others])
