"""``python -m benchmarks <collective> [options]``: see :mod:`benchmarks.harness`."""

import sys

from .harness import main

sys.exit(main())
