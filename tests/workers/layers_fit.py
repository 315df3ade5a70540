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
write_result(build_and_fit(steps, global_batch))
