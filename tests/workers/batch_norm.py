"""BatchNormalization in a model with a sok table, on N ranks: each rank's
moving statistics come from its own slice of every global batch, and
`fit` / `evaluate` must leave them the same on every rank.

Two BN layers: one on the raw dense features (its statistics do not depend
on training, so on N ranks their mean over the ranks must equal one
process's on the whole batches: a moving average is linear, and each
rank's slice mean averages to the batch mean), one after the embedding.
Rank r's slice of each global batch is shifted by 3 r, so the ranks'
statistics differ.
"""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

N = sok.num_ranks()
V, B, STEPS = 60, 16, 6
rng = np.random.default_rng(0)
ids = rng.integers(0, V, size=(B * STEPS, 3)).astype("int64")
x = rng.normal(size=(B * STEPS, 2)).astype("float32")
# Within each global batch, the second half (rank 1's slice on 2 ranks)
# is shifted.
x[:, 0] += 3.0 * np.tile(np.repeat([0.0, 1.0], B // 2), STEPS)
y = (rng.random((B * STEPS, 1)) < 0.5).astype("float32")

ii = keras.Input((3,), dtype="int64", name="ids")
xi = keras.Input((2,), name="x")
e = sok.layers.DistributedEmbedding(
    V, 4, combiner="mean",
    embeddings_initializer=keras.initializers.RandomNormal(seed=1))(ii)
raw = keras.layers.BatchNormalization(name="bn_raw")(xi)
z = keras.layers.BatchNormalization(name="bn")(
    keras.layers.Concatenate()([e, raw]))
out = keras.layers.Dense(
    1, activation="sigmoid",
    kernel_initializer=keras.initializers.GlorotUniform(seed=2))(z)
model = keras.Model({"ids": ii, "x": xi}, out)
model.compile(optimizer=keras.optimizers.SGD(0.1),
              loss="binary_crossentropy")


def data():
    return sok.shard_batches(tf.data.Dataset.from_tensor_slices(
        ({"ids": ids, "x": x}, y)).batch(B, drop_remainder=True))


def stats():
    return {f"{layer}.{v.name}": v.numpy().tolist()
            for layer in ("bn_raw", "bn")
            for v in (model.get_layer(layer).moving_mean,
                      model.get_layer(layer).moving_variance)}


model.fit(data(), epochs=2, validation_data=data(), verbose=0)
after_fit = stats()
loss = model.evaluate(data(), verbose=0)
write_result({"after_fit": after_fit, "after_evaluate": stats(),
              "evaluate_loss": float(loss)})
