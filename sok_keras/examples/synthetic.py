"""Synthetic Criteo-like click data: 13 dense and 26 categorical features.

Categorical ids follow a Zipf law (a few ids are very hot, most are rare),
and the label depends on the dense features and on a hidden score of every
id, so a model that learns its embeddings reaches an AUC well above 0.5.
"""

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
# Cardinalities shaped like Criteo's: a few huge features, many small ones.
DEFAULT_VOCAB_SIZES = (
    1000, 500, 20000, 10000, 300, 30, 1200, 600, 5, 9000, 5000, 15000, 3000,
    30, 2000, 12000, 10, 4000, 2000, 5, 14000, 20, 20, 8000, 100, 7000,
)


def zipf_ids(rng, vocab_size, size, exponent=1.2):
    """Draws `size` ids in `[0, vocab_size)` from a truncated Zipf law."""
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -exponent)
    cdf /= cdf[-1]
    ids = np.searchsorted(cdf, rng.random(size), side="right")
    return np.minimum(ids, vocab_size - 1).astype(np.int64)


def _hidden_score(feature, ids):
    """A fixed pseudo-random effect in [-0.5, 0.5) for every (feature, id)."""
    h = (ids * 2654435761 + (feature + 1) * 40503) % 1000003
    return h / 1000003.0 - 0.5


def make_dataset(num_examples, vocab_sizes=DEFAULT_VOCAB_SIZES, seed=0):
    """Returns `({"dense": [n, 13] float32, "sparse": [n, 26] int64}, y)`.

    `sparse[:, f]` is the id of feature `f` in `[0, vocab_sizes[f])`.
    """
    rng = np.random.default_rng(seed)
    dense = rng.lognormal(0.0, 1.0, size=(num_examples, NUM_DENSE))
    dense = np.log1p(dense).astype(np.float32)
    sparse = np.stack(
        [zipf_ids(rng, v, num_examples) for v in vocab_sizes], axis=1)
    w = np.linspace(-1.0, 1.0, NUM_DENSE)
    logit = (dense - dense.mean(0)) @ w
    for f in range(len(vocab_sizes)):
        logit += 1.5 * _hidden_score(f, sparse[:, f])
    p = 1.0 / (1.0 + np.exp(-logit))
    y = (rng.random(num_examples) < p).astype(np.float32)[:, None]
    return {"dense": dense, "sparse": sparse}, y
