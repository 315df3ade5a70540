"""SOK's MirroredStrategy recipe in one process: the seed's custom loop
(`strategy.run` / `strategy.reduce`, the TF2 DemoModel with
`All2AllDenseEmbedding`), Keras `model.fit` under the strategy, and 100
steps of a model with 3 sok layers, each on 2 and 4 logical devices, and
the same programs without a strategy (the reference, one rank).

argv[1]: the number of replicas, 1 for the reference (no strategy); one
process per count (TensorFlow's collective group keys start over in each
new MirroredStrategy, so two strategies of different sizes in one process
collide). argv[2]: the device kind, "CPU" (logical CPUs) or "GPU" (logical
GPUs on the first GPU).
"""

import os
import sys

import numpy as np
import tensorflow as tf

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2
KIND = sys.argv[2] if len(sys.argv) > 2 else "CPU"
if KIND == "GPU":  # (TF32 matmuls would round the two runs apart)
    tf.config.experimental.enable_tensor_float_32_execution(False)
else:
    # Logical CPUs, and the reference on the CPU too: in a GPU TensorFlow
    # it would otherwise run on the GPU (TF32 matmuls, XLA-compiled dense
    # updates) and round apart from the replicas.
    tf.config.set_visible_devices([], "GPU")
if N > 1 and KIND == "GPU":
    gpu = tf.config.list_physical_devices("GPU")[0]
    tf.config.set_logical_device_configuration(
        gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=4096)] * N)
elif N > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * N)

import sok_keras as sok  # noqa: E402
from _worker import OUT  # noqa: E402
from _seed_recipe import DemoModel, same_start, weights_of  # noqa: E402
from _worker import write_result  # noqa: E402

GLOBAL_BATCH = 16
SLOT_NUM, NNZ, EMB_SIZE, DENSE = 4, 3, 8, 2
VOCAB_PER_GPU = 64
STEPS = 4
LONG_STEPS = 100
rng = np.random.default_rng(1)
ids = rng.integers(0, VOCAB_PER_GPU, size=(STEPS, GLOBAL_BATCH, SLOT_NUM, NNZ))
labels = rng.integers(0, 2, size=(STEPS, GLOBAL_BATCH, 1)).astype("float32")


def devices(n):
    return [f"/{KIND}:{i}" for i in range(n)]


def seed_loop(strategy):
    """The seed's MirroredStrategy recipe (custom loop); `strategy` None is
    the same program with the default strategy."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
    ).scope()
    global_batch_size = GLOBAL_BATCH
    with scope:
        model = DemoModel(max_vocabulary_size_per_gpu=VOCAB_PER_GPU,
                          slot_num=SLOT_NUM, nnz_per_slot=NNZ,
                          embedding_vector_size=EMB_SIZE,
                          num_of_dense_layers=DENSE, dense_units=64)
        model(ids[0, :1])
        same_start(model, 2)
        emb_var, _ = sok.split_embedding_variable_from_others(
            model.trainable_variables)
        with sok.OptimizerScope(emb_var):  # sok_keras: around the creation
            emb_opt = tf.keras.optimizers.Adam(learning_rate=0.1)
        dense_opt = tf.keras.optimizers.Adam(learning_rate=0.1)
        if strategy is not None:
            # Keras 3 under MirroredStrategy: build the optimizers in the
            # scope (built lazily inside `strategy.run`, their variables'
            # initializers cannot be lifted out of the step's graph).
            emb_opt.build(emb_var)
            dense_opt.build([v for v in model.trainable_variables
                             if not sok.variable.is_sok_variable(v)])

    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True,
                                                 reduction="none")

    def _replica_loss(labels, logits):
        loss = loss_fn(labels, logits)
        return tf.nn.compute_average_loss(
            loss, global_batch_size=global_batch_size)

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

    dataset = tf.data.Dataset.from_tensor_slices(
        (ids.reshape((-1, SLOT_NUM, NNZ)), labels.reshape((-1, 1)))
    ).batch(GLOBAL_BATCH)
    losses = []
    if strategy is None:
        for inputs, lab in dataset:
            losses.append(float(_train_step(inputs, lab)))
    else:
        for inputs, lab in strategy.experimental_distribute_dataset(dataset):
            replica_loss = strategy.run(_train_step, args=(inputs, lab))
            total_loss = strategy.reduce(tf.distribute.ReduceOp.SUM,
                                         replica_loss, axis=None)
            losses.append(float(total_loss))
    return {"losses": losses, "weights": weights_of(model),
            "shards": [None if not sok.variable.is_sok_variable(v) else (
                v.num_ranks, [list(s.shape) for s in v.replica_shards or []],
                [s.device for s in v.replica_shards or []])
                for v in model.weights]}


def save_and_load(strategy, model, inputs, path):
    """`model.save` under the strategy, then `load_model` in its scope:
    the whole tables, their slots and the predictions come back."""
    model.save(path)
    got = {}
    for where, scope in (("mirrored", strategy.scope()),):
        with scope:
            loaded = tf.keras.models.load_model(path)
        got[where] = {
            "weights": weights_of(loaded),
            "preds": loaded.predict(inputs, batch_size=GLOBAL_BATCH,
                                    verbose=0).tolist(),
            "slots": [[s.read_global().tolist() for _, s in sorted(
                v.slots.items())] for v in loaded.weights
                if sok.variable.is_sok_variable(v)],
        }
    return got


def tf_checkpoint_round_trip(model, path):
    """`tf.train.Checkpoint` of the model and its optimizer under the
    strategy: every replica's shard of each table and of its slots comes
    back (before: only replica 0's)."""
    tables = [v for v in model.weights if sok.variable.is_sok_variable(v)]
    every = [s for t in tables for s in [t, *t.slots.values()]]

    def state():
        return [v.read_global().tolist() for v in every]

    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    saved_path, saved = ckpt.save(path), state()
    for v in every:
        for shard in v.replica_shards:
            shard.assign(tf.zeros_like(shard))
    cleared = state() != saved
    ckpt.restore(saved_path)
    return {"cleared": cleared, "restored": state() == saved,
            "slots": len(every) - len(tables)}


def three_tables(strategy, steps, eager=False, save_to=None):
    """`model.fit` of a functional model with 3 sok layers (distributed,
    localized on the last rank, All2AllDenseEmbedding), OptimizerWrapper
    with Adam, under `strategy` (None: no strategy)."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
    ).scope()
    n = strategy.num_replicas_in_sync if strategy else 1
    r = np.random.default_rng(3)
    x1 = r.integers(0, 50, size=(steps * GLOBAL_BATCH, 3))
    x2 = r.integers(0, 30, size=(steps * GLOBAL_BATCH, 2))
    x3 = r.integers(0, 40, size=(steps * GLOBAL_BATCH, 2, 2))
    y = r.integers(0, 2, size=(steps * GLOBAL_BATCH, 1)).astype("float32")
    with scope:
        i1 = tf.keras.Input((3,), dtype="int64")
        i2 = tf.keras.Input((2,), dtype="int64")
        i3 = tf.keras.Input((2, 2), dtype="int64")
        e1 = sok.DistributedEmbedding(50, 4, combiner="mean")(i1)
        e2 = sok.LocalizedEmbedding(30, 4, rank=n - 1)(i2)
        e3 = tf.keras.layers.Flatten()(sok.All2AllDenseEmbedding(
            20, 4, slot_num=2, nnz_per_slot=2, vocabulary_size=40)(i3))
        h = tf.keras.layers.Concatenate()([e1, e2, e3])
        h = tf.keras.layers.Dense(8, activation="relu")(h)
        model = tf.keras.Model([i1, i2, i3], tf.keras.layers.Dense(1)(h))
        same_start(model, 4)
        model.compile(
            optimizer=sok.OptimizerWrapper(tf.keras.optimizers.Adam(0.01)),
            loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
            run_eagerly=eager)
    history = model.fit((x1, x2, x3), y, batch_size=GLOBAL_BATCH, epochs=1,
                        shuffle=False, verbose=0)
    head = (x1[:GLOBAL_BATCH], x2[:GLOBAL_BATCH], x3[:GLOBAL_BATCH])
    preds = model.predict(head, batch_size=GLOBAL_BATCH, verbose=0)
    out = {"loss": [float(v) for v in history.history["loss"]],
           "weights": weights_of(model), "preds": preds.tolist(),
           "slots": [[s.read_global().tolist() for _, s in sorted(
               v.slots.items())] for v in model.weights
               if sok.variable.is_sok_variable(v)]}
    if save_to is not None:
        out["saved"] = save_and_load(strategy, model, head, save_to)
        out["tf_checkpoint"] = tf_checkpoint_round_trip(
            model, save_to + ".tf/ck")
        try:
            sok.dump(save_to + ".ckpt", model)
            out["dump_refused"] = None
        except NotImplementedError as e:
            out["dump_refused"] = str(e)
    return out


COLLECTION_TABLES = {
    "user": {"vocabulary_size": 30, "embedding_dim": 4},
    "item": {"vocabulary_size": 50, "embedding_dim": 6,
             "mode": "localized:0"},
}
COLLECTION_FEATURES = {
    "user_id": {"table": "user"},
    "clicked": {"table": "item", "combiner": "mean"},
    "history": {"table": "item", "combiner": None},
}


def collection_step(strategy):
    """`EmbeddingCollection` (a distributed and a localized table, pooled
    and unpooled features) inside `strategy.run`: outputs, then one step of
    `sok.optimizers.SGD` (None: the same without a strategy)."""
    scope = strategy.scope() if strategy else tf.distribute.get_strategy(
    ).scope()
    n = strategy.num_replicas_in_sync if strategy else 1
    r = np.random.default_rng(6)
    batch = 8
    x = {"user_id": r.integers(0, 30, size=(batch,)),
         "clicked": r.integers(-1, 50, size=(batch, 3)),
         "history": r.integers(-1, 50, size=(batch, 3))}
    with scope:
        layer = sok.layers.EmbeddingCollection(COLLECTION_TABLES,
                                               COLLECTION_FEATURES)
        layer({k: v[:1] for k, v in x.items()})
        for name, table in sorted(layer.embeddings.items()):
            rows, dim = table.global_shape
            table.assign_global(r.normal(size=(rows, dim)).astype("float32"))
        opt = sok.optimizers.SGD(0.5)
        opt.build(list(layer.embeddings.values()))
    tables = [layer.embeddings[k] for k in sorted(layer.embeddings)]
    initial = [t.read_global().tolist() for t in tables]

    def step(inputs):
        with tf.GradientTape() as tape:
            out = layer(inputs)
            loss = (tf.reduce_sum(out["user_id"]) * 0.5
                    + tf.reduce_sum(out["clicked"] ** 2)
                    + tf.reduce_sum(out["history"] * 3.0))
        grads = tape.gradient(loss, tables)
        opt.apply_gradients(zip(grads, tables))
        return out

    if strategy is None:
        out = tf.function(step)({k: tf.constant(v) for k, v in x.items()})
        outs = {k: np.asarray(v).tolist() for k, v in out.items()}
    else:
        per = batch // n

        def part(ctx):
            i = ctx.replica_id_in_sync_group
            return {k: tf.constant(v[i * per:(i + 1) * per])
                    for k, v in x.items()}

        dist = strategy.experimental_distribute_values_from_function(part)
        out = strategy.run(tf.function(step), args=(dist,))
        outs = {k: np.concatenate([np.asarray(t) for t in
                                   strategy.experimental_local_results(v)]
                                  ).tolist() for k, v in out.items()}
    return {"outputs": outs, "initial": initial,
            "tables": [t.read_global().tolist() for t in tables]}


def cross_replica_lookup(strategy):
    """A lookup outside `strategy.run` reads every replica's shard."""
    with strategy.scope():
        table = sok.Variable(np.arange(17 * 3).reshape(17, 3),
                             dtype="float32", name="cross")
        got = sok.lookup_sparse(
            table, tf.ragged.constant([[1, 2, 16], [3, 3, 0]], tf.int64),
            combiners="sum")
    return np.asarray(got).tolist()


def refused(strategy):
    """A table made outside the strategy's scope, looked up inside
    `strategy.run`, is refused with a clear error."""
    table = sok.Variable(np.arange(12.0).reshape(6, 2), dtype="float32",
                         name="outside_table")
    try:
        strategy.run(lambda: sok.lookup_sparse(
            table, tf.sparse.from_dense(tf.constant([[1, 2]], tf.int64))))
        return None
    except NotImplementedError as e:
        return str(e)


sok.init()
if N == 1:
    result = {"loop": seed_loop(None), "fit": three_tables(None, 4),
              "long": three_tables(None, LONG_STEPS),
              "collection": collection_step(None)}
else:
    strategy = tf.distribute.MirroredStrategy(devices(N))
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "loop": seed_loop(strategy),
        "long": three_tables(strategy, LONG_STEPS),
        "collection": collection_step(strategy),
        "cross": cross_replica_lookup(strategy),
        "refused": refused(strategy),
    }
    if N == 2:  # the 4-step fits (graph, eager) and save/load: 2 replicas
        result["fit"] = three_tables(strategy, 4, save_to=os.path.join(
            OUT, "mirrored.keras"))
        result["eager"] = three_tables(strategy, 4, eager=True)
write_result(result)
