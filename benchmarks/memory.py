"""What the memory of the machine allows, and what a call costs in memory.

:func:`copy_bandwidth` measures ``numpy.copyto`` bandwidth (bytes read plus bytes
written) of one rank alone and of every rank at once: the hardware limit that a
collective's bus bandwidth is compared with. :func:`peak_extra` measures the peak
resident memory a call adds on top of what the process held before it, through
Linux's resettable high-water mark (``/proc/self/clear_refs``), so it sees every
allocation: numpy's, MPI's internal buffers, pages of shared windows first touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

COPY_BYTES = 64 << 20
UNKNOWN = -1.0


def copy_bandwidth(world: MPI.Intracomm, nbytes: int = COPY_BYTES,
                   reps: int = 5) -> tuple[float, float]:
    """Memory-copy bandwidth in GB/s (read + written): ``(rank 0 alone, all ranks at once)``.

    Collective over ``world``. Each figure is the best of ``reps`` copies.
    """
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def best_copy() -> float:
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
        return best

    alone = 0.0
    if world.Get_rank() == 0:
        alone = 2 * nbytes / best_copy() / 1e9
    world.Barrier()
    together = best_copy()
    slowest = world.allreduce(together, op=MPI.MAX)
    return world.bcast(alone, root=0), 2 * nbytes * world.Get_size() / slowest / 1e9


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_extra(run: Callable[[], Any]) -> float:
    """Run ``run`` once; the peak resident MiB it added, or ``UNKNOWN`` off Linux."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset the high-water mark to the current resident size
        before = _status_kib("VmRSS:")
    except OSError:
        run()
        return UNKNOWN
    run()
    return max(0, _status_kib("VmHWM:") - before) / 1024
