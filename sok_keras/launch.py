"""`python -m sok_keras.launch`: the same launcher as the `sokrun` command.

The launcher itself lives in the top-level module `sokrun` (standard
library only), so that `sokrun` and `python -m sokrun` start N ranks
without importing TensorFlow into the launching process; see
`sokrun.main`. This module is inside the package, so `python -m
sok_keras.launch` imports sok_keras, and with it TensorFlow and the op
library, before it starts them (a few seconds more; prefer `sokrun`).
"""

import sys

from sokrun import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
