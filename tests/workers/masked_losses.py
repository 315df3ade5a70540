"""Losses whose divisor depends on the data, trained with fit on N ranks
where the ranks' slices hold different counts: a per-position loss on an
unpooled lookup's masked output (Keras divides by the unmasked positions),
with two outputs (two such losses a step, steps_per_execution=2); and
`reduction="mean_with_sample_weight"` (divides by the weights' sum),
through fit and train_on_batch; `reduction="sum"` (a global sum); a custom train_step calling
`compute_loss`; a `compute_loss` computing its loss in a `tf.cond` on the
rank's data (which must run: no collective in a branch). Rank r's rows are
x[r::N]: the even rows are mostly padding and weigh 5, the odd ones are
full and weigh 1."""

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

R, N = sok.rank(), sok.num_ranks()
V, D, T, B = 30, 4, 6, 8  # global batch B
rng = np.random.default_rng(0)
x = rng.integers(0, V, (32, T))
for i in range(32):
    x[i, (1 if i % 2 == 0 else T):] = -1
y = rng.integers(0, 3, (32, T))
sw = np.where(np.arange(32) % 2 == 0, 5.0, 1.0).astype(np.float32)


def model_of(outputs):
    ids = keras.Input((T,), dtype="int64")
    e = sok.layers.DistributedEmbedding(V, D, combiner=None, name="emb")(ids)
    model = keras.Model(ids, outputs(e))
    model.get_layer("emb").embeddings.assign_global(
        np.random.default_rng(3).uniform(-.5, .5, (V, D)).astype(np.float32))
    for layer in model.layers[2:]:
        layer.set_weights([np.random.default_rng(4).uniform(
            -.5, .5, w.shape).astype(np.float32) for w in layer.get_weights()])
    return model


def trained(model):
    return {"table": model.get_layer("emb").embeddings.read_global().tolist(),
            "dense": [w.tolist() for w in model.get_weights()[1:]]}


result = {}
# Masked per-position losses, two outputs (Dense passes the mask on).
masked = model_of(lambda e: [
    keras.layers.Dense(3, activation="softmax", name="a")(e),
    keras.layers.Dense(3, activation="softmax", name="b")(e)])
masked.compile(optimizer=keras.optimizers.SGD(0.5),
               loss=["sparse_categorical_crossentropy"] * 2,
               steps_per_execution=2)
history = masked.fit(x[R::N], [y[R::N], y[R::N][:, ::-1]],
                     batch_size=B // N, epochs=2, shuffle=False, verbose=0)
result["masked_loss"] = history.history["loss"]
result["masked"] = trained(masked)
result["masked_evaluate"] = masked.evaluate(
    x[R::N], [y[R::N], y[R::N][:, ::-1]], batch_size=B // N, verbose=0)
# mean_with_sample_weight, fit then train_on_batch.
weighted = model_of(lambda e: keras.layers.Dense(
    3, activation="softmax", name="o")(keras.layers.GlobalAveragePooling1D()(e)))
weighted.compile(optimizer=keras.optimizers.SGD(0.5),
                 loss=keras.losses.SparseCategoricalCrossentropy(
                     reduction="mean_with_sample_weight"))
history = weighted.fit(x[R::N], y[R::N, 0], sample_weight=sw[R::N],
                       batch_size=B // N, epochs=2, shuffle=False, verbose=0)
result["weighted_loss"] = history.history["loss"]
result["weighted_on_batch"] = weighted.train_on_batch(
    x[R:B:N], y[R:B:N, 0], sample_weight=sw[R:B:N])
result["weighted"] = trained(weighted)
class Anchored(keras.layers.Dense):
    """A Dense whose kernel is pulled to 0 by a sum-reduced loss on the
    weights (`add_loss`): the same on every rank, not scaled by N."""

    def call(self, x):
        self.add_loss(0.1 * keras.losses.MeanSquaredError(reduction="sum")(
            tf.zeros_like(self.kernel), self.kernel))
        return super().call(x)


# reduction="sum": the global batch's sum, not the ranks' mean of sums.
summed = model_of(lambda e: Anchored(
    3, activation="softmax", name="o")(keras.layers.GlobalAveragePooling1D()(e)))
summed.compile(optimizer=keras.optimizers.SGD(0.05),
               loss=keras.losses.SparseCategoricalCrossentropy(
                   reduction="sum"))
history = summed.fit(x[R::N], y[R::N, 0], batch_size=B // N, epochs=2,
                     shuffle=False, verbose=0)
result["summed_loss"] = history.history["loss"]
result["summed_evaluate"] = summed.evaluate(x[R::N], y[R::N, 0],
                                            batch_size=B // N, verbose=0)
result["summed"] = trained(summed)


class CustomStep(keras.Model):
    """Keras' guide's custom train_step: the loss from `compute_loss`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class CondLoss(keras.Model):
    """A `compute_loss` whose loss runs in a `tf.cond` on the rank's own
    data: no collective there (one rank may skip it), so it runs."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        return tf.cond(
            tf.reduce_any(tf.equal(tf.cast(y, tf.int64), 2)),
            lambda: super(CondLoss, self).compute_loss(
                x, y, y_pred, sample_weight, training=training),
            lambda: tf.constant(0.0))


for name, cls in (("custom", CustomStep), ("cond", CondLoss)):
    ids = keras.Input((T,), dtype="int64")
    e = sok.layers.DistributedEmbedding(V, D, combiner=None, name="emb")(ids)
    out = keras.layers.Dense(3, activation="softmax", name="o")(e)
    model = cls(ids, out)
    model.get_layer("emb").embeddings.assign_global(
        np.random.default_rng(3).uniform(-.5, .5, (V, D)).astype(np.float32))
    model.get_layer("o").set_weights([np.random.default_rng(4).uniform(
        -.5, .5, w.shape).astype(np.float32)
        for w in model.get_layer("o").get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss="sparse_categorical_crossentropy")
    model.fit(x[R::N], y[R::N], batch_size=B // N, epochs=2, shuffle=False,
              verbose=0)
    result[name] = trained(model)
write_result(result)
