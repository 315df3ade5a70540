"""tf.train.Checkpoint of a sharded table on several ranks.

argv: FOLDER. Each rank saves its shard to FOLDER/r<rank>/ and restores
it, with its optimizer's slots (also into a new table and optimizer,
before the optimizer has made them); then restores the other rank's
checkpoint, which must be refused (naming both shards) and change nothing.
"""

import os
import sys
import time

import sok_keras as sok

sok.init()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _worker import NUM_RANKS, RANK, write_result  # noqa: E402

folder = sys.argv[1]
def make():
    table = sok.Variable(np.arange(36, dtype=np.float32).reshape(18, 2),
                         name="A")
    dense = keras.Variable(np.ones((2, 1), np.float32), name="W")
    return table, dense, sok.optimizers.Adam(0.1)


table, dense, opt = make()
opt.build([table, dense])
# Each rank's slot rows differ from the other's (and from their start).
table.slots["m"].assign(table.value * 0 + (RANK + 1) * 10.0)
table.slots["v"].assign(table.value * 0 + (RANK + 1) * 20.0)
ckpt = tf.train.Checkpoint(A=table, W=dense, opt=opt)
own = ckpt.save(os.path.join(folder, f"r{RANK}", "ck"))
shard = table.numpy().copy()
m, v = table.slots["m"].numpy().copy(), table.slots["v"].numpy().copy()
table.assign(tf.zeros_like(table.value))
table.slots["m"].assign(tf.zeros_like(table.value))
ckpt.restore(own)
result = {"own_restored": bool(
    np.array_equal(table.numpy(), shard)
    and np.array_equal(table.slots["m"].numpy(), m))}
# Into a new table and optimizer, before the optimizer has made the slots.
new_table, new_dense, new_opt = make()
tf.train.Checkpoint(A=new_table, W=new_dense, opt=new_opt).restore(own)
new_opt.build([new_table, new_dense])
result["own_restored"] &= bool(
    np.array_equal(new_table.numpy(), shard)
    and np.array_equal(new_table.slots["m"].numpy(), m)
    and np.array_equal(new_table.slots["v"].numpy(), v))

other = (RANK + 1) % NUM_RANKS
index = os.path.join(folder, f"r{other}", "checkpoint")
deadline = time.monotonic() + 60
while not os.path.exists(index) and time.monotonic() < deadline:
    time.sleep(0.1)
table.assign(tf.zeros_like(table.value))
try:
    ckpt.restore(tf.train.latest_checkpoint(os.path.dirname(index)))
    result["other_error"] = None
except ValueError as e:
    result["other_error"] = str(e)
result["other_unchanged"] = bool(not np.asarray(table.numpy()).any())
write_result(result)
