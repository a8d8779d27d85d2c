"""``python -m mpitrain``: the install check (:mod:`mpitrain.check`)."""

import sys

from .check import main

if __name__ == "__main__":
    sys.exit(main())
