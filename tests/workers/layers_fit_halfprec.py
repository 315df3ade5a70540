"""Every sok layer with 16-bit tables in one model, trained with model.fit
on N ranks. argv: steps global_batch dtype
"""

import sys

import sok_keras as sok

sok.init()

import keras  # noqa: E402
from _worker import RANK, write_result  # noqa: E402

from tests.layers_model import build_and_fit  # noqa: E402

steps, global_batch, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
keras.utils.set_random_seed(RANK)
write_result(build_and_fit(steps, global_batch, dtype=dtype))
