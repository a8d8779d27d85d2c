"""Ranks that leave at different times after the same collectives: a normal end.

Usage: uneven_exit.py [async]

Every rank makes the same 20 allreduces; then rank 0 computes for 3 s (longer than
the exit guard's survey period) before it exits, while the others exit at once.

With ``async`` the allreduces go through the async engine, which is still running at
exit: the ranks that leave the exit barrier first stop their engines (a collective)
while the others may still be surveying the ranks from the barrier, which must not
take the stopping ranks for ranks stranded by their exit. The survey then runs at
every test of the barrier instead of every half second, to make that moment likely.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import mpitrain as mt
from mpitrain.comm import exitguard


def main() -> None:
    asynchronous = sys.argv[1:] == ["async"]
    comm = mt.init()
    for _ in range(20):
        if asynchronous:
            comm.allreduce_async(np.ones(100)).wait()
        else:
            comm.allreduce(np.ones(100))
    if asynchronous:
        exitguard.SURVEY_EVERY_S = exitguard.POLL_S
    if comm.rank == 0:
        time.sleep(3.0)
    print(f"rank {comm.rank} finished all steps", flush=True)


if __name__ == "__main__":
    main()
