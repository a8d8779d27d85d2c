"""``python -m mpitrain.run``: the same as the ``mpitrain-run`` command."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
