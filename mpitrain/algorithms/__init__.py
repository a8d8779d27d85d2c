"""Collective algorithms: one algorithm per module, each planned in its constructor from a
:class:`~.base.PlanRequest` and executed by ``run()``, plus the table
(:mod:`.selection`) that picks among them.

To add an algorithm, write its module and list its class in :data:`REGISTRY`.
"""

from __future__ import annotations

from typing import Any

from .base import PlanRequest
from .bruck import BruckAllgather
from .hierarchical import HierarchicalAllgather, HierarchicalAllreduce, HierarchicalReduceScatter
from .native import NativeAllgather, NativeAllreduce, NativeBroadcast, NativeReduceScatter
from .rabenseifner import RabenseifnerAllreduce
from .recursive_doubling import RecursiveDoublingAllgather, RecursiveDoublingAllreduce
from .recursive_halving import RecursiveHalvingReduceScatter
from .ring import RingAllgather, RingAllreduce, RingReduceScatter
from .selection import select
from .shared_memory import ShmAllgather, ShmAllreduce, ShmBroadcast, ShmReduceScatter

# collective -> algorithm name -> class; the first name is the fallback of "auto".
REGISTRY: dict[str, dict[str, Any]] = {
    "allreduce": {"ring": RingAllreduce, "mpi": NativeAllreduce, "shm": ShmAllreduce,
                  "recursive_doubling": RecursiveDoublingAllreduce,
                  "rabenseifner": RabenseifnerAllreduce,
                  "hierarchical": HierarchicalAllreduce},
    "reduce_scatter": {"ring": RingReduceScatter, "mpi": NativeReduceScatter,
                       "shm": ShmReduceScatter, "recursive_halving": RecursiveHalvingReduceScatter,
                       "hierarchical": HierarchicalReduceScatter},
    "allgather": {"ring": RingAllgather, "mpi": NativeAllgather, "shm": ShmAllgather,
                  "recursive_doubling": RecursiveDoublingAllgather, "bruck": BruckAllgather,
                  "hierarchical": HierarchicalAllgather},
    "broadcast": {"mpi": NativeBroadcast, "shm": ShmBroadcast},
}

ALGORITHMS: dict[str, tuple[str, ...]] = {c: tuple(algos) for c, algos in REGISTRY.items()}
KNOWN: frozenset[str] = frozenset(name for algos in REGISTRY.values() for name in algos)
"""Every algorithm name of any collective."""
NEEDS_SHARED_MEMORY: frozenset[str] = frozenset({"shm"})
"""Algorithms that run only when every rank is on one node, on host buffers."""


def build(collective: str, algorithm: str, request: PlanRequest) -> Any:
    """Plan ``algorithm`` for ``collective``."""
    return REGISTRY[collective][algorithm](request)


__all__ = ["ALGORITHMS", "KNOWN", "NEEDS_SHARED_MEMORY", "REGISTRY", "PlanRequest", "build",
           "select"]
