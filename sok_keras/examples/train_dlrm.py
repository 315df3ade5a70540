"""Demo: train a DLRM-style model with sharded embeddings through `model.fit`.

Run it as one process (`python -m sok_keras.examples.train_dlrm`) or as N
(`sokrun -np 2 python -m sok_keras.examples.train_dlrm`): every rank reads
its slice of each global batch, the embedding table is sharded over the
ranks, and the dense layers are data parallel.
"""

import argparse
import time

import sok_keras as sok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-examples", type=int, default=262144)
    parser.add_argument("--test-examples", type=int, default=32768)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="adagrad",
                        choices=["sgd", "adagrad", "adam"])
    args = parser.parse_args(argv)

    sok.init()  # first: sets up the ranks' communication
    import keras
    import tensorflow as tf

    from sok_keras.examples.dlrm import build_dlrm
    from sok_keras.examples.synthetic import DEFAULT_VOCAB_SIZES
    from sok_keras.examples.synthetic import make_dataset

    rank, n = sok.rank(), sok.num_ranks()
    keras.utils.set_random_seed(1234)  # same dense init on every rank
    x, y = make_dataset(args.train_examples, seed=0)
    tx, ty = make_dataset(args.test_examples, seed=1)

    def batches(features, labels):
        ds = tf.data.Dataset.from_tensor_slices((features, labels))
        ds = ds.batch(args.global_batch, drop_remainder=True)
        return sok.shard_batches(ds).prefetch(2)

    def test_batches(features, labels):
        # Every rank evaluates the whole test set (the lookups are
        # collective, so all ranks run the same steps): the loss and AUC
        # are then exact, not averages of per-rank values.
        ds = tf.data.Dataset.from_tensor_slices((features, labels))
        return ds.batch(args.global_batch // n, drop_remainder=True)

    model = build_dlrm(DEFAULT_VOCAB_SIZES, embedding_dim=args.dim,
                       bottom=(64, args.dim), top=(64, 32))
    inner = {
        "sgd": keras.optimizers.SGD,
        "adagrad": keras.optimizers.Adagrad,
        "adam": keras.optimizers.Adam,
    }[args.optimizer](learning_rate=args.lr)
    model.compile(
        optimizer=sok.optimizers.OptimizerWrapper(inner),
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc")],
    )
    if rank == 0:
        table = model.get_layer("embedding").embeddings
        print(f"ranks: {n}; table {table.global_shape[0]:,} x "
              f"{table.global_shape[1]}, this rank holds {table.shape[0]:,} "
              "rows")
        model.summary()

    class Throughput(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    timer = Throughput()
    model.fit(
        batches(x, y), epochs=args.epochs, verbose=1 if rank == 0 else 0,
        callbacks=[sok.callbacks.GlobalMetrics(), timer], shuffle=False,
    )
    steps = args.train_examples // args.global_batch
    examples_per_s = steps * args.global_batch / timer.seconds
    result = model.evaluate(test_batches(tx, ty), verbose=0,
                            return_dict=True)
    if rank == 0:
        print(
            f"final: test loss {result['loss']:.4f}, test AUC "
            f"{result['auc']:.4f}, training {examples_per_s:,.0f} examples/s "
            f"(last epoch, {n} rank(s), global batch {args.global_batch})"
        )


if __name__ == "__main__":
    main()
