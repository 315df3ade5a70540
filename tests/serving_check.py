"""Run as a script in a Python where sok_keras cannot be imported: loads a
SavedModel written by `sok.export_for_serving` with `tf.saved_model.load`
and writes its predictions on the probe inputs.

argv: SAVED_MODEL_DIR INPUTS_NPZ (keys probe_<input>) OUT_NPY
"""

import sys

sys.modules["sok_keras"] = None  # `import sok_keras` raises ImportError

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Plain float32 matmuls on a GPU (TensorFlow uses TF32 there by default), as
# in tests/test_serving.py, so that the two predictions compare at 1e-6.
tf.config.experimental.enable_tensor_float_32_execution(False)

saved_model, inputs, out = sys.argv[1:4]
try:
    import sok_keras  # noqa: F401
    raise SystemExit("sok_keras was importable")
except ImportError:
    pass
data = np.load(inputs)
probe = {k[len("probe_"):]: data[k] for k in data.files
         if k.startswith("probe_")}
served = tf.saved_model.load(saved_model)
# A lone unnamed input (key "") is given as a tensor, as a single-input
# Sequential's `serve` takes it.
predictions = np.asarray(served.serve(probe[""] if list(probe) == [""]
                                      else probe))
with open("/proc/self/maps") as f:
    loaded = [line.split()[-1] for line in f if "_sok_" in line]
if loaded:
    raise SystemExit(f"a sok_keras library was loaded: {sorted(set(loaded))}")
np.save(out, predictions)
