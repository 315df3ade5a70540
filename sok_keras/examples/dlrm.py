"""A small DLRM-style model: bottom MLP, embeddings, dot interaction, top MLP.

All 26 categorical features share one table (feature `f`'s ids are shifted
by the sizes of the features before it), so a step makes one exchange for
all of them. `embedding="sok"` uses `sok_keras.layers.DistributedEmbedding`;
`embedding="keras"` uses `keras.layers.Embedding`, the single-device
reference with the same structure.
"""

import keras
import numpy as np

from sok_keras.layers import DistributedEmbedding


@keras.saving.register_keras_serializable(package="sok_keras")
class FeatureOffsets(keras.layers.Layer):
    """Adds feature `f`'s offset into the shared table to column `f`.

    Args:
        vocab_sizes: list of ints, the size of every feature's vocabulary.

    Call arguments:
        inputs: int tensor `[batch, num_features]`.
    """

    def __init__(self, vocab_sizes, **kwargs):
        super().__init__(**kwargs)
        self.vocab_sizes = [int(v) for v in vocab_sizes]
        self._offsets = np.concatenate(
            [[0], np.cumsum(self.vocab_sizes)[:-1]]).astype(np.int64)

    def call(self, inputs):
        offsets = keras.ops.convert_to_tensor(self._offsets, "int64")
        return keras.ops.cast(inputs, "int64") + offsets

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "vocab_sizes": self.vocab_sizes}


@keras.saving.register_keras_serializable(package="sok_keras")
class DotInteraction(keras.layers.Layer):
    """Pairwise dot products of `[batch, k, d]` vectors (upper triangle)."""

    def call(self, inputs):
        k = inputs.shape[1]
        dots = keras.ops.matmul(inputs, keras.ops.transpose(inputs, (0, 2, 1)))
        rows, cols = np.triu_indices(k, 1)
        flat = keras.ops.reshape(dots, (-1, k * k))
        return keras.ops.take(flat, rows * k + cols, axis=1)

    def compute_mask(self, inputs, mask=None):
        return None  # every feature has one id: nothing to mask

    def compute_output_shape(self, input_shape):
        k = input_shape[1]
        return (input_shape[0], k * (k - 1) // 2)


def build_dlrm(vocab_sizes, embedding_dim=16, bottom=(64, 16),
               top=(64, 32), embedding="sok", seed=0):
    """Builds the functional DLRM-style model.

    Args:
        vocab_sizes: list of ints, one per categorical feature.
        embedding_dim: int, the width of every embedding.
        bottom: units of the bottom MLP; its last layer must equal
            `embedding_dim`.
        top: units of the top MLP's hidden layers (a 1-unit sigmoid follows).
        embedding: `"sok"` or `"keras"`.
        seed: seed of the dense layers' initializers.

    Returns:
        A `keras.Model` taking `{"dense": [b, 13], "sparse": [b, 26]}` and
        returning click probabilities `[b, 1]`.
    """
    if bottom[-1] != embedding_dim:
        raise ValueError(
            f"The bottom MLP must end with embedding_dim={embedding_dim} "
            f"units. Received: bottom={bottom}.")
    dense_in = keras.Input(shape=(13,), name="dense")
    sparse_in = keras.Input(shape=(len(vocab_sizes),), dtype="int64",
                            name="sparse")
    init = iter(range(seed * 100, seed * 100 + 100))

    def dense(units, name, activation="relu"):
        return keras.layers.Dense(
            units, activation=activation, name=name,
            kernel_initializer=keras.initializers.GlorotUniform(next(init)))

    x = dense_in
    for i, units in enumerate(bottom):
        x = dense(units, f"bottom_{i}")(x)
    ids = FeatureOffsets(vocab_sizes, name="offsets")(sparse_in)
    total = int(sum(vocab_sizes))
    if embedding == "sok":
        table = DistributedEmbedding(
            total, embedding_dim, combiner=None, name="embedding")
    elif embedding == "keras":
        table = keras.layers.Embedding(total, embedding_dim, name="embedding")
    else:
        raise ValueError(
            f"`embedding` must be 'sok' or 'keras'. Received: {embedding!r}.")
    emb = table(ids)  # [b, 26, d]
    stacked = keras.layers.Concatenate(axis=1)(
        [keras.layers.Reshape((1, embedding_dim))(x), emb])
    inter = DotInteraction(name="interaction")(stacked)
    z = keras.layers.Concatenate()([x, inter])
    for i, units in enumerate(top):
        z = dense(units, f"top_{i}")(z)
    out = dense(1, "click", activation="sigmoid")(z)
    return keras.Model({"dense": dense_in, "sparse": sparse_in}, out)
