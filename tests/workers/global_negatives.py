"""A two-tower retrieval model whose custom `train_step` scores each user
against the items of the whole global batch (in-batch negatives gathered
from every rank with `sok_keras.compat.horovod.allgather`, differentiable
as Horovod's). On N ranks it must train the model one process trains on
the concatenated batch: rank r's users are rows [r*B/N, (r+1)*B/N) of
each global batch, whose positives sit at those positions of the gathered
items."""

import numpy as np

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import write_result  # noqa: E402

import sok_keras.compat.horovod as hvd  # noqa: E402

R, N = sok.rank(), sok.num_ranks()
VU, VI, D, B, STEPS = 60, 90, 4, 8, 4
rng = np.random.default_rng(5)
users = rng.integers(0, VU, (B * STEPS,))
items = rng.integers(0, VI, (B * STEPS,))


def tower(vocab, name, seed):
    ids = keras.Input((), dtype="int64")
    e = sok.layers.DistributedEmbedding(
        vocab, D, name=f"{name}_emb",
        embeddings_initializer=keras.initializers.RandomNormal(
            0, 0.3, seed=seed))(ids)
    # No bias: an item bias adds the same u . b to all of a user's logits,
    # so its gradient is zero but for rounding, which Adam would amplify.
    out = keras.layers.Dense(
        D, name=f"{name}_dense", use_bias=False,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed))(e)
    return keras.Model(ids, out, name=name)


class TwoTower(keras.Model):
    def __init__(self):
        super().__init__()
        self.user, self.item = tower(VU, "user", 1), tower(VI, "item", 2)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.user(x["user"]), self.item(x["item"])

    def train_step(self, data):
        with tf.GradientTape() as tape:
            u, i = self(data)
            every = hvd.allgather(i, name="items")  # [B, D]
            logits = tf.matmul(u, every, transpose_b=True)
            labels = tf.range(tf.shape(u)[0]) + R * tf.shape(u)[0]
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels, logits))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


model = TwoTower()
model.compile(optimizer=keras.optimizers.Adam(0.05))
ds = tf.data.Dataset.from_tensor_slices(
    {"user": users, "item": items}).batch(B, drop_remainder=True)
history = model.fit(sok.shard_batches(ds), epochs=2, verbose=0)
write_result({
    "loss": history.history["loss"],
    "tables": [model.user.get_layer("user_emb").embeddings.read_global()
               .tolist(),
               model.item.get_layer("item_emb").embeddings.read_global()
               .tolist()],
    "dense": [w.tolist() for w in model.user.get_layer("user_dense")
              .get_weights() + model.item.get_layer("item_dense")
              .get_weights()],
})
