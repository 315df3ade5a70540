"""`python -m sok_keras.launch`: the same launcher as the `sokrun` command.

The launcher itself lives in the top-level module `sokrun` (standard
library only), so that starting N ranks does not import TensorFlow into the
launching process; see `sokrun.main`.
"""

import sys

from sokrun import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
