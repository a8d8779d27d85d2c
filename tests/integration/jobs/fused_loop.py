"""A training-like loop of fused async allreduces: every step the same few small
tensors, submitted and waited in an order of each rank's own, every result checked.

Usage: fused_loop.py STEPS [SCALE]

SCALE (default 1) multiplies the tensors' lengths: at 2000 the float32 and float64
buckets pass 256 KiB, where the default choice without shared memory is the ring.

Run it with ``MPITRAIN_SHM=0 MPITRAIN_SEGMENT_BYTES=64`` (the path ``--elastic`` takes,
with pipeline segments smaller than most buckets) and ``MPITRAIN_STALL_TIMEOUT_S`` set,
so that a hang ends as :class:`mpitrain.StallError`. Rank 0 prints ``steps done`` at
the end.
"""

from __future__ import annotations

import sys

import numpy as np

import mpitrain as mt

SIZES = (20, 30, 38, 5, 1)
DTYPES = ("float32", "float32", "float64", "int32", "float16")


def main(steps: int, scale: int) -> None:
    comm = mt.init()
    rank, size = comm.rank, comm.size
    for step in range(steps):
        order = np.random.default_rng([step, rank]).permutation(len(SIZES))
        handles = {}
        for i in order:
            x = np.full(SIZES[i] * scale, rank + 1 + step % 5, DTYPES[i])
            call = comm.allreduce_async_ if (i + step) % 2 else comm.allreduce_async
            handles[int(i)] = call(x, op=mt.Sum, name=f"grad.{i}")
        want = sum(r + 1 + step % 5 for r in range(size))
        for i in order[::-1]:
            got = handles[int(i)].wait()
            if not (got == want).all():
                raise AssertionError(f"rank {rank} step {step}: tensor {i} is not all {want}")
    if rank == 0:
        print(f"{steps} steps done", flush=True)
    mt.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
