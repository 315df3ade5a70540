"""What the workers of SOK's recipes share: the seed's TF2 DemoModel and
the same starting point and read-out of a model on every rank and every N.

Import it after any device configuration (it imports sok_keras)."""

import numpy as np
import tensorflow as tf

import sok_keras as sok


class DemoModel(tf.keras.models.Model):
    """The seed's TF2 DemoModel, unchanged but for `dense_units` (the
    seed's 1024 by default)."""

    def __init__(self, max_vocabulary_size_per_gpu, slot_num, nnz_per_slot,
                 embedding_vector_size, num_of_dense_layers,
                 dense_units=1024, **kwargs):
        super(DemoModel, self).__init__(**kwargs)
        self.max_vocabulary_size_per_gpu = max_vocabulary_size_per_gpu
        self.slot_num = slot_num
        self.nnz_per_slot = nnz_per_slot
        self.embedding_vector_size = embedding_vector_size
        self.num_of_dense_layers = num_of_dense_layers
        self.embedding_layer = sok.All2AllDenseEmbedding(
            max_vocabulary_size_per_gpu=self.max_vocabulary_size_per_gpu,
            embedding_vec_size=self.embedding_vector_size,
            slot_num=self.slot_num,
            nnz_per_slot=self.nnz_per_slot)
        self.dense_layers = list()
        for _ in range(self.num_of_dense_layers):
            self.layer = tf.keras.layers.Dense(units=dense_units,
                                               activation="relu")
            self.dense_layers.append(self.layer)
        self.out_layer = tf.keras.layers.Dense(units=1, activation=None)

    def call(self, inputs, training=True):
        emb_vector = self.embedding_layer(inputs, training=training)
        emb_vector = tf.reshape(emb_vector, shape=[
            -1, self.slot_num * self.nnz_per_slot *
            self.embedding_vector_size])
        hidden = emb_vector
        for layer in self.dense_layers:
            hidden = layer(hidden)
        logit = self.out_layer(hidden)
        return logit


def same_start(model, seed):
    """Same initial tables (the first rows of one draw, whatever the number
    of rows) and dense weights on every rank and every N."""
    rng = np.random.default_rng(seed)
    for v in model.weights:
        if sok.variable.is_sok_variable(v):
            rows, dim = v.global_shape
            big = rng.uniform(-0.05, 0.05, size=(4096, dim))
            v.assign_global(big[:rows].astype("float32"))
        else:
            v.assign(rng.normal(0, 0.05, size=v.shape).astype("float32"))


def weights_of(model):
    """Every weight, sok tables whole, as lists."""
    return [v.read_global().tolist() if sok.variable.is_sok_variable(v)
            else np.asarray(v.numpy()).tolist() for v in model.weights]
