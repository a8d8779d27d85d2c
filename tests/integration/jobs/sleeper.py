"""A job that only sleeps: every rank initialises MPI, records its pid, and sleeps until
it is killed.

Usage: sleeper.py OUT_DIR

Each rank writes its pid to ``OUT_DIR/attempt<A>.rank<R>.pid`` (A: ``MPITRAIN_RESTART``,
R: the rank), then sleeps in a loop.
"""

from __future__ import annotations

import os
import sys
import time

import mpitrain as mt


def main() -> None:
    out = sys.argv[1]
    comm = mt.init()
    name = os.path.join(out, f"attempt{os.environ.get('MPITRAIN_RESTART', '0')}"
                             f".rank{comm.rank}.pid")
    with open(name + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(name + ".tmp", name)  # the test never reads half a file
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
