"""Every sok layer in one model, trained with model.fit on N ranks.

Dense layers start from a rank-dependent seed: the optimizer wrapper's
broadcast from rank 0 must make them identical. argv: steps global_batch
"""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.layers_model import build_and_fit  # noqa: E402

steps, global_batch = int(sys.argv[1]), int(sys.argv[2])
keras.utils.set_random_seed(RANK)
result = build_and_fit(steps, global_batch)

# Masks on N ranks: an unpooled lookup's -1 padding is masked, so that
# GlobalAveragePooling1D averages only the real ids (whose rows come
# through the exchange from every rank).
import numpy as np  # noqa: E402

values = np.arange(40 * 3, dtype="float32").reshape(40, 3)
emb = sok.layers.DistributedEmbedding(40, 3, combiner=None, name="masked")
inp = keras.Input((4,), dtype="int64")
masked = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(emb(inp)))
emb.embeddings.assign_global(values, "masked")
ids = np.array([[1 + RANK, 7, -1, -1], [39 - RANK, -1, -1, -1],
                [2, 3, 5, 11 + RANK]])
want = np.stack([values[[i for i in row if i >= 0]].mean(0) for row in ids])
got = masked.predict(ids, verbose=0)
result["mask_max_err"] = float(np.abs(got - want).max())
write_result(result)
