"""One definition of the training runs the parity tests compare."""

import keras
import numpy as np
import tensorflow as tf

from sok_keras.examples.dlrm import build_dlrm
from sok_keras.examples.synthetic import make_dataset

# Parity at 1e-5 between different batch splits needs full-precision
# matmuls: TensorFloat-32 (TensorFlow's default on a GPU) rounds the
# Dense layers differently for every batch shape.
tf.config.experimental.enable_tensor_float_32_execution(False)

VOCAB = (50, 20, 300, 7, 120, 33, 64, 5, 200, 90, 11, 40, 60, 25, 80, 9, 150,
         30, 45, 6, 70, 12, 18, 100, 40, 22)

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    # epsilon 1e-3, not Keras' 1e-7: Adam divides by sqrt(v) + epsilon, so
    # a gradient entry near zero turns rounding differences (the sum of a
    # batch split over ranks is added in another order) into updates of
    # size lr; with epsilon 1e-7 runs on 1 and 2 ranks drift apart by ~1e-4
    # after 12 steps, with 1e-3 they agree to 1e-6.
    "adam": lambda: keras.optimizers.Adam(0.01, epsilon=1e-3),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    # Clipping across ranks: a table's norm sums every rank's shard.
    "momentum_clipnorm": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, epsilon=1e-3, global_clipnorm=0.1),
    # Keras' gradient accumulation: each rank sums its table rows' (and
    # Keras its dense) gradients over 3 steps, then updates.
    "adam_accumulate": lambda: keras.optimizers.Adam(
        0.01, epsilon=1e-3, gradient_accumulation_steps=3),
}


def make_model_and_data(embedding, opt_name, steps, global_batch):
    """The DLRM-style model with a fixed initial table, its optimizer and
    `steps` global batches of data."""
    keras.utils.set_random_seed(0)
    model = build_dlrm(VOCAB, embedding_dim=8, bottom=(16, 8), top=(16,),
                       embedding=embedding)
    table = np.random.default_rng(42).normal(
        0, 0.05, size=(sum(VOCAB), 8)).astype(np.float32)
    emb = model.get_layer("embedding")
    if embedding == "sok":
        emb.embeddings.assign_global(table)
    else:
        emb.embeddings.assign(table)
    data = make_dataset(steps * global_batch, VOCAB, seed=3)
    return model, OPTIMIZERS[opt_name](), data
