"""SOK's two Horovod recipes, with only the Horovod import changed, plus a
100-step model of three sok layers, on N ranks (N = 1 is the reference).

Every rank builds the same global batch and the same initial weights from
fixed seeds and trains on its slice of the batch (rank r: samples
[r * B, (r + 1) * B)). Results: per-step losses (the global loss),
final tables (read_global) and dense weights.
"""

import numpy as np
import tensorflow as tf

import sok_keras.compat.horovod as hvd
import sok_keras as sok

# --- the seed's experimental recipe (SOK 2 `sok.experiment`) ---------------
hvd.init()
gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    # The seed has gpus[hvd.local_rank()] (a GPU per rank); `%` lets the
    # ranks share the test machine's one GPU.
    tf.config.experimental.set_visible_devices(
        gpus[hvd.local_rank() % len(gpus)], "GPU")

sok.init()

from _seed_recipe import DemoModel, same_start, weights_of  # noqa: E402
from _worker import write_result  # noqa: E402

RANK, N = hvd.rank(), hvd.size()
result = {"rank": RANK, "size": N, "local_rank": hvd.local_rank(),
          "local_size": hvd.local_size()}

v1 = sok.Variable(np.arange(17 * 3).reshape(17, 3), dtype=tf.float32)
v2 = sok.Variable(np.arange(7 * 5).reshape(7, 5), dtype=tf.float32)
indices1 = tf.SparseTensor(
    indices=[[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]], values=[1, 1, 3, 4, 5],
    dense_shape=[2, 3])
indices2 = tf.SparseTensor(
    indices=[[0, 0], [1, 0], [1, 1]], values=[1, 2, 3], dense_shape=[2, 2])
with tf.GradientTape() as tape:
    embeddings = sok.lookup_sparse(
        [v1, v2], [indices1, indices2], hotness=[3, 2],
        combiners=["sum", "sum"])
    loss = 0.0
    for i, embedding in enumerate(embeddings):
        loss += tf.reduce_sum(embedding)
grads = tape.gradient(loss, [v1, v2])
optimizer = tf.keras.optimizers.SGD(learning_rate=1.0)
optimizer.apply_gradients(zip(grads, [v1, v2]))
result["experimental"] = {
    "shapes": [list(v1.shape), list(v2.shape)],
    "emb": [e.numpy().tolist() for e in embeddings],
    "grad_rows": [int(g.values.shape[0]) for g in grads],
    "after": [v1.read_global().tolist(), v2.read_global().tolist()],
}

# --- hvd collectives themselves -----------------------------------------
x = tf.constant([float(RANK + 1), 10.0 * (RANK + 1)])
result["collectives"] = {
    "average": hvd.allreduce(x).numpy().tolist(),
    "sum": hvd.allreduce(x, op=hvd.Sum).numpy().tolist(),
    "max": hvd.allreduce(x, op=hvd.Max).numpy().tolist(),
    "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                            postscale_factor=0.5).numpy().tolist(),
    # ragged first dimension: rank r sends r + 1 rows
    "allgather": hvd.allgather(
        tf.fill([RANK + 1, 2], float(RANK))).numpy().tolist(),
    "broadcast": hvd.broadcast(tf.constant([RANK + 7]), root_rank=N - 1)
    .numpy().tolist(),
    # A plain tf.Variable (a global step): before, "Attempt to convert a
    # value (<bound method ...value ...>)".
    "tf_variable": (lambda v: (hvd.broadcast_variables([v], root_rank=0),
                               v.numpy().tolist())[1])(
        tf.Variable([float(RANK + 3)])),
    "sparse": tf.convert_to_tensor(hvd.allreduce(tf.IndexedSlices(
        tf.constant([[1.0, 2.0]]) * (RANK + 1), tf.constant([RANK % 3]),
        tf.constant([3, 2], tf.int64)))).numpy().tolist(),
}


@tf.function
def _in_function(a):
    # Three unnamed calls in one tf.function: numbered in tracing order.
    return [hvd.allreduce(a), hvd.allreduce(2.0 * a, op=hvd.Sum),
            hvd.allgather(a[:RANK + 1])]


result["collectives"]["in_function"] = [
    t.numpy().tolist() for t in _in_function(x)]


def _gradients(a):
    # Rank s weighs each collective's output by (s + 1): Horovod's rule
    # gives this rank the gradient of every rank's loss.
    w = float(RANK + 1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(a)
        rows = tf.tile(a[tf.newaxis], [RANK + 1, 1])  # r + 1 copies
        gathered = hvd.allgather(rows)
        losses = {
            "average": tf.reduce_sum(w * hvd.allreduce(a)),
            "sum": tf.reduce_sum(w * hvd.allreduce(a, op=hvd.Sum)),
            "allgather": tf.reduce_sum(w * gathered * tf.reshape(
                tf.range(tf.size(gathered), dtype=a.dtype),
                tf.shape(gathered))),
            "broadcast": tf.reduce_sum(
                w * hvd.broadcast(a, root_rank=N - 1)),
        }
    return {k: tape.gradient(v, a) for k, v in losses.items()}


result["gradients"] = {
    "eager": {k: v.numpy().tolist() for k, v in _gradients(x).items()},
    "function": {k: v.numpy().tolist()
                 for k, v in tf.function(_gradients)(x).items()},
}

# --- the seed's TF2 Horovod recipe: DemoModel (All2AllDenseEmbedding) -------
GLOBAL_BATCH = 8
SLOT_NUM, NNZ, EMB_SIZE, DENSE = 4, 3, 8, 2
VOCAB_PER_GPU = 64
STEPS = 4


def global_data(seed, steps, batch, shape, vocab):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(steps, batch) + shape)
    labels = rng.integers(0, 2, size=(steps, batch, 1)).astype("float32")
    return ids, labels


def local(a):
    b = a.shape[1] // N
    return a[:, RANK * b:(RANK + 1) * b]


global_batch_size = GLOBAL_BATCH
use_tf_opt = True
sok.Init(global_batch_size=global_batch_size)
model = DemoModel(max_vocabulary_size_per_gpu=VOCAB_PER_GPU,
                  slot_num=SLOT_NUM, nnz_per_slot=NNZ,
                  embedding_vector_size=EMB_SIZE,
                  num_of_dense_layers=DENSE)
ids, labels = global_data(1, STEPS, GLOBAL_BATCH, (SLOT_NUM, NNZ),
                          VOCAB_PER_GPU)
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

loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True,
                                             reduction="none")


def _replica_loss(labels, logits):
    loss = loss_fn(labels, logits)
    # sok_keras averages over ranks (like hvd.DistributedOptimizer): the
    # per-rank loss is the mean over the rank's own samples.
    return tf.nn.compute_average_loss(
        loss, global_batch_size=global_batch_size // hvd.size())


@tf.function
def _train_step(inputs, labels, first_batch):
    with tf.GradientTape() as tape:
        logits = model(inputs, training=True)
        loss = _replica_loss(labels, logits)
    emb_var, other_var = sok.split_embedding_variable_from_others(
        model.trainable_variables)
    emb_grads, other_grads = tape.gradient(loss, [emb_var, other_var])
    emb_opt.apply_gradients(zip(emb_grads, emb_var))
    other_grads = [hvd.allreduce(grads) for grads in other_grads]
    dense_opt.apply_gradients(zip(other_grads, other_var))
    if first_batch:
        hvd.broadcast_variables(other_var, root_rank=0)
        hvd.broadcast_variables(dense_opt.variables, root_rank=0)
    return loss


losses = []
for i, (inputs, lab) in enumerate(zip(local(ids), local(labels))):
    replica_loss = _train_step(tf.constant(inputs), tf.constant(lab), 0 == i)
    total_loss = hvd.allreduce(replica_loss)
    losses.append(float(total_loss))
result["demo"] = {"losses": losses, "weights": weights_of(model)}

# --- three sok layers, 100 steps, DistributedGradientTape -----------------
STEPS3, B3 = 100, 8


def three_layer_model(prefix):
    inp_a = tf.keras.Input((3,), dtype="int64")
    inp_b = tf.keras.Input((2,), dtype="int64")
    inp_c = tf.keras.Input((2, 2), dtype="int64")
    ea = sok.DistributedEmbedding(40, 4, combiner="mean",
                                  name=prefix + "a")(inp_a)
    eb = sok.LocalizedEmbedding(30, 4, combiner="sum",
                                name=prefix + "b")(inp_b)
    ec = sok.All2AllDenseEmbedding(20, 4, slot_num=2, nnz_per_slot=2,
                                   vocabulary_size=40,
                                   name=prefix + "c")(inp_c)
    h = tf.keras.layers.Concatenate()([ea, eb,
                                       tf.keras.layers.Flatten()(ec)])
    h = tf.keras.layers.Dense(8, activation="relu")(h)
    out = tf.keras.layers.Dense(1)(h)
    model = tf.keras.Model([inp_a, inp_b, inp_c], out)
    same_start(model, 3)
    return model


model3 = three_layer_model("e")
rng = np.random.default_rng(4)
data3 = [rng.integers(0, 40, (STEPS3, B3, 3)),
         rng.integers(0, 30, (STEPS3, B3, 2)),
         rng.integers(0, 40, (STEPS3, B3, 2, 2))]
y3 = rng.normal(size=(STEPS3, B3, 1)).astype("float32")
tables, dense = sok.split_embedding_variable_from_others(
    model3.trainable_variables)
table_opt = sok.optimizers.SGD(learning_rate=0.05)
dense_opt3 = tf.keras.optimizers.SGD(learning_rate=0.05)


@tf.function
def step3(a, b, c, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model3([a, b, c]) - y))
    tape = hvd.DistributedGradientTape(tape)
    tg, dg = tape.gradient(loss, [tables, dense])
    table_opt.apply_gradients(zip(tg, tables))
    dense_opt3.apply_gradients(zip(dg, dense))
    return hvd.allreduce(loss, name="loss3")


losses3 = []
for s in range(STEPS3):
    losses3.append(float(step3(*[tf.constant(local(d)[s]) for d in data3],
                               tf.constant(local(y3)[s]))))
result["three_layers"] = {"losses": losses3, "weights": weights_of(model3)}

# --- the same model, 100 steps of plain `model.fit` on sokrun's ranks ----------
fit3 = three_layer_model("f")
fit3.compile(optimizer=sok.OptimizerWrapper(tf.keras.optimizers.SGD(0.05)),
             loss="mse")
history3 = fit3.fit(
    [local(d).reshape((-1,) + d.shape[2:]) for d in data3],
    local(y3).reshape((-1, 1)), batch_size=B3 // hvd.size(), epochs=1,
    shuffle=False, verbose=0)
result["fit_three_layers"] = {"loss": history3.history["loss"],
                              "steps": int(fit3.optimizer.iterations.numpy()),
                              "weights": weights_of(fit3)}
write_result(result)
