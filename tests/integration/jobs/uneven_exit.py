"""Ranks that leave at different times after the same collectives: a normal end.

Usage: uneven_exit.py

Every rank makes the same 20 allreduces; then rank 0 computes for 3 s (longer than
the exit guard's survey period) before it exits, while the others exit at once.
"""

from __future__ import annotations

import time

import numpy as np

import mpitrain as mt


def main() -> None:
    comm = mt.init()
    for _ in range(20):
        comm.allreduce(np.ones(100))
    if comm.rank == 0:
        time.sleep(3.0)
    print(f"rank {comm.rank} finished all steps", flush=True)


if __name__ == "__main__":
    main()
