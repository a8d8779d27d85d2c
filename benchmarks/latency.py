"""Small-message latency: mpitrain's blocking allreduce and barrier against native MPI.

``mpirun -np 2 python -m benchmarks.latency`` times, per size, ``comm.allreduce(x)``,
``comm.allreduce_(x)`` and mpi4py's ``MPI.COMM_WORLD.Allreduce`` into a preallocated
output, then ``comm.barrier()`` and ``MPI.COMM_WORLD.Barrier()``, interleaved (A B A B
...: one block of ``--iters`` calls of each in turn, ``--blocks`` times), so that a
disturbance of a shared machine hits every variant alike. It prints the median time
per call over the blocks and its ratio to the native call (rank 0's clock).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__)
    p.add_argument("--sizes", default="4,4096,16384",
                   help="message sizes in bytes of float32 (comma-separated)")
    p.add_argument("--blocks", type=int, default=200, help="blocks per variant")
    p.add_argument("--iters", type=int, default=20, help="calls per block")
    return p.parse_args(argv)


def interleaved(cases: dict[str, Callable[[], Any]], blocks: int,
                iters: int) -> dict[str, float]:
    """Median microseconds per call of each case, blocks of ``iters`` calls in turn."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():  # warm-up: plans, caches, connections
        for _ in range(100):
            f()
    clock = time.perf_counter_ns
    for _ in range(blocks):
        for name, f in cases.items():
            start = clock()
            for _ in range(iters):
                f()
            times[name].append((clock() - start) / iters / 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; rank 0 prints one line per variant (``name us ratio``)."""
    args = parse_args(argv)
    comm = mt.init()
    world = MPI.COMM_WORLD
    groups: list[dict[str, Callable[[], Any]]] = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = np.ones(max(nbytes // 4, 1), np.float32)
        y, z = np.zeros_like(x), np.empty_like(x)
        groups.append({
            f"mpitrain allreduce {x.nbytes} B": lambda x=x: comm.allreduce(x),
            f"mpitrain allreduce_ {x.nbytes} B": lambda y=y: comm.allreduce_(y),
            f"MPI Allreduce {x.nbytes} B": lambda x=x, z=z: world.Allreduce(x, z),
        })
    groups.append({"mpitrain barrier": comm.barrier, "MPI Barrier": world.Barrier})
    if world.rank == 0:
        print(f"# {world.size} ranks, median of {args.blocks} blocks of {args.iters} calls")
    for cases in groups:
        medians = interleaved(cases, args.blocks, args.iters)
        native = medians[list(cases)[-1]]
        if world.rank == 0:
            for name, us in medians.items():
                print(f"{name:32s} {us:8.2f} us {us / native:6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
