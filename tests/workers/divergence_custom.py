"""A custom training loop (no fit): rank 1 raises, or exits normally, at
iteration 4 while rank 0 goes on calling collectives.

argv: "raise" | "exit".
"""

import sys

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

MODE = sys.argv[1]
comm = sok.world.communicator()
result = {"error": None, "iteration": None}
for i in range(1, 50):
    if RANK == 1 and i == 4:
        if MODE == "raise":
            raise RuntimeError("rank 1 stops its custom loop")
        sys.exit(0)
    try:
        comm.all_reduce(tf.constant([1.0]), "custom/loop")
    except tf.errors.OpError as e:
        result.update(error=e.message, iteration=i)
        break
write_result(result)
print(f"rank {RANK}: {result}", flush=True)
