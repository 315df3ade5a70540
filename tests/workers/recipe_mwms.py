"""SOK's MultiWorkerMirroredStrategy recipe (custom training loop with
`strategy.run` / `strategy.reduce`), then Keras `model.fit` under the
strategy, with sok layers, on N workers (N = 1 is the reference).

The program builds its own strategy from TF_CONFIG first, as the seed does
(here from sokrun's rank and addresses, standing in for the user's own
launcher), then calls `sok.Init` inside `strategy.scope()`.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

task_id = int(os.environ.get("SOK_RANK", "0"))
addrs = os.environ.get("SOK_WORKER_ADDRS", "127.0.0.1:1").split(",")
worker_num = len(addrs)
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": addrs},
    "task": {"type": "worker", "index": task_id},
})
strategy = tf.distribute.MultiWorkerMirroredStrategy()

import sok_keras as sok  # noqa: E402
from _seed_recipe import DemoModel, same_start, weights_of  # noqa: E402
from _worker import write_result  # noqa: E402

MODE = sys.argv[1] if len(sys.argv) > 1 else "all"
GLOBAL_BATCH = 8
SLOT_NUM, NNZ, EMB_SIZE, DENSE = 4, 3, 8, 2
VOCAB_PER_GPU = 64
STEPS = 4
N, RANK = worker_num, task_id


def local(a):
    b = a.shape[1] // N
    return a[:, RANK * b:(RANK + 1) * b]


result = {}
rng = np.random.default_rng(1)
ids = rng.integers(0, VOCAB_PER_GPU, size=(STEPS, GLOBAL_BATCH, SLOT_NUM, NNZ))
labels = rng.integers(0, 2, size=(STEPS, GLOBAL_BATCH, 1)).astype("float32")

# --- the seed's custom loop ---------------------------------------------------
global_batch_size = GLOBAL_BATCH
use_tf_opt = True
with strategy.scope():
    sok.Init(global_batch_size=global_batch_size)
    model = DemoModel(max_vocabulary_size_per_gpu=VOCAB_PER_GPU,
                      slot_num=SLOT_NUM, nnz_per_slot=NNZ,
                      embedding_vector_size=EMB_SIZE,
                      num_of_dense_layers=DENSE)
    model(ids[0, :1])
    same_start(model, 2)
    emb_var, _ = sok.split_embedding_variable_from_others(
        model.trainable_variables)
    if not use_tf_opt:
        emb_opt = sok.optimizers.Adam(learning_rate=0.1)
    else:
        with sok.OptimizerScope(emb_var):  # sok_keras: around the creation
            emb_opt = tf.keras.optimizers.Adam(learning_rate=0.1)
    dense_opt = tf.keras.optimizers.Adam(learning_rate=0.1)

w = sok.world.world()
result["world"] = [w.rank, w.num_ranks, w.source,
                   w.strategy is strategy or N == 1]

loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True,
                                             reduction="none")


def _replica_loss(labels, logits):
    loss = loss_fn(labels, logits)
    return tf.nn.compute_average_loss(loss,
                                      global_batch_size=global_batch_size)


@tf.function
def _train_step(inputs, labels):
    with tf.GradientTape() as tape:
        logits = model(inputs, training=True)
        loss = _replica_loss(labels, logits)
    emb_var, other_var = sok.split_embedding_variable_from_others(
        model.trainable_variables)
    grads, emb_grads = tape.gradient(loss, [other_var, emb_var])
    emb_opt.apply_gradients(zip(emb_grads, emb_var))
    dense_opt.apply_gradients(zip(grads, other_var))
    return loss


losses = []
for i, (inputs, lab) in enumerate(zip(local(ids), local(labels))):
    replica_loss = strategy.run(_train_step, args=(tf.constant(inputs),
                                                   tf.constant(lab)))
    total_loss = strategy.reduce(tf.distribute.ReduceOp.SUM, replica_loss,
                                 axis=None)
    losses.append(float(total_loss))
result["loop"] = {"losses": losses, "weights": weights_of(model)}

# --- model.fit under the strategy ----------------------------------------------
if MODE in ("all", "fit"):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    x = ids.reshape((-1, SLOT_NUM, NNZ))
    y = labels.reshape((-1, 1))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        GLOBAL_BATCH).with_options(options)

    # keras-team/keras#20585 upstream: a plain Keras model under the same
    # strategy (sok_keras leaves it alone) still fails before any step.
    with strategy.scope():
        plain = tf.keras.Sequential([tf.keras.Input((SLOT_NUM, NNZ)),
                                     tf.keras.layers.Flatten(),
                                     tf.keras.layers.Dense(1)])
        plain.compile(optimizer="sgd", loss="mse")
    try:
        plain.fit(ds.map(lambda a, b: (tf.cast(a, "float32"), b)), epochs=1,
                  verbose=0)
        result["upstream_bug"] = None
    except ValueError as e:
        result["upstream_bug"] = str(e)[:200]

    with strategy.scope():
        inp = tf.keras.Input((SLOT_NUM, NNZ), dtype="int64")
        e = sok.All2AllDenseEmbedding(VOCAB_PER_GPU, EMB_SIZE, SLOT_NUM, NNZ,
                                      vocabulary_size=VOCAB_PER_GPU)(inp)
        h = tf.keras.layers.Flatten()(e)
        h = tf.keras.layers.Dense(16, activation="relu")(h)
        fit_model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(h))
        same_start(fit_model, 5)
        fit_model.compile(
            optimizer=sok.OptimizerWrapper(tf.keras.optimizers.SGD(0.1)),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    def local_dataset(context):
        # Worker r's samples [r * B, (r + 1) * B) of each global batch.
        b = context.get_per_replica_batch_size(GLOBAL_BATCH)
        return tf.data.Dataset.from_tensor_slices(
            (local(ids).reshape((-1, SLOT_NUM, NNZ)),
             local(labels).reshape((-1, 1)))).batch(b)

    dist = strategy.distribute_datasets_from_function(local_dataset)
    history = fit_model.fit(dist, epochs=2, steps_per_epoch=STEPS,
                            verbose=0)
    result["fit"] = {"losses": [float(v) for v in history.history["loss"]],
                     "weights": weights_of(fit_model)}

    # 100 steps of a model with 3 sok layers under the strategy (no hang).
    LONG, B3 = 100, 8
    r3 = np.random.default_rng(4)
    data3 = [r3.integers(0, 40, (LONG, B3, 3)),
             r3.integers(0, 30, (LONG, B3, 2)),
             r3.integers(0, 40, (LONG, B3, 2, 2))]
    y3 = r3.normal(size=(LONG, B3, 1)).astype("float32")
    with strategy.scope():
        i3 = [tf.keras.Input((3,), dtype="int64"),
              tf.keras.Input((2,), dtype="int64"),
              tf.keras.Input((2, 2), dtype="int64")]
        ea = sok.DistributedEmbedding(40, 4, combiner="mean")(i3[0])
        eb = sok.LocalizedEmbedding(30, 4, rank=N - 1)(i3[1])
        ec = sok.All2AllDenseEmbedding(20, 4, slot_num=2, nnz_per_slot=2,
                                       vocabulary_size=40)(i3[2])
        h = tf.keras.layers.Concatenate()([ea, eb,
                                           tf.keras.layers.Flatten()(ec)])
        h = tf.keras.layers.Dense(8, activation="relu")(h)
        model3 = tf.keras.Model(i3, tf.keras.layers.Dense(1)(h))
        same_start(model3, 3)
        model3.compile(
            optimizer=sok.OptimizerWrapper(tf.keras.optimizers.SGD(0.05)),
            loss="mse")

    def local_dataset3(context):
        b = context.get_per_replica_batch_size(B3)
        xs = tuple(local(d).reshape((-1,) + d.shape[2:]) for d in data3)
        return tf.data.Dataset.from_tensor_slices(
            (xs, local(y3).reshape((-1, 1)))).batch(b)

    history3 = model3.fit(
        strategy.distribute_datasets_from_function(local_dataset3),
        epochs=1, steps_per_epoch=LONG, verbose=0)
    result["long"] = {"losses": [float(v) for v in history3.history["loss"]],
                      "steps": int(model3.optimizer.iterations.numpy()),
                      "weights": weights_of(model3)}
    # model.save and save_weights inside the scope, on every rank (before:
    # rank 0's Keras built a throwaway optimizer there, whose variables'
    # broadcast waited for the other rank for ever).
    import time  # noqa: E402

    from _worker import OUT  # noqa: E402

    start = time.monotonic()
    with strategy.scope():
        model3.save(os.path.join(OUT, "mwms.keras"))
        model3.save_weights(os.path.join(OUT, "mwms.weights.h5"))
    result["saved_in_scope_s"] = time.monotonic() - start
    loaded = tf.keras.models.load_model(os.path.join(OUT, "mwms.keras"))
    result["loaded_weights"] = weights_of(loaded)
write_result(result)
