"""Rank 1 gets SIGTERM right after init; it must stop promptly (and the job
with it), not ignore the signal."""

import os
import signal
import time

import sok_keras as sok

sok.init()

import tensorflow as tf  # noqa: E402
from _worker import RANK  # noqa: E402

tf.constant(1.0).numpy()  # TensorFlow's runtime is up
if RANK == 1:
    os.kill(os.getpid(), signal.SIGTERM)
for _ in range(600):
    time.sleep(0.1)
