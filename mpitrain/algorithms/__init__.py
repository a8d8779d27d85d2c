"""Collective algorithms: one algorithm per module, each planned in its constructor from a
:class:`~.base.PlanRequest` and executed by ``run()``, plus the table
(:mod:`.selection`) that picks among them.

To add an algorithm, write its module and list its class in :data:`REGISTRY`.
"""

from __future__ import annotations

from typing import Any

from .base import PlanRequest
from .hierarchical import HierarchicalAllgather, HierarchicalAllreduce, HierarchicalReduceScatter
from .native import NativeAllgather, NativeAllreduce, NativeBroadcast, NativeReduceScatter
from .ring import RingAllgather, RingAllreduce, RingReduceScatter
from .selection import select

# collective -> algorithm name -> class; the first name is the fallback of "auto".
REGISTRY: dict[str, dict[str, Any]] = {
    "allreduce": {"ring": RingAllreduce, "mpi": NativeAllreduce,
                  "hierarchical": HierarchicalAllreduce},
    "reduce_scatter": {"ring": RingReduceScatter, "mpi": NativeReduceScatter,
                       "hierarchical": HierarchicalReduceScatter},
    "allgather": {"ring": RingAllgather, "mpi": NativeAllgather,
                  "hierarchical": HierarchicalAllgather},
    "broadcast": {"mpi": NativeBroadcast},
}

ALGORITHMS: dict[str, tuple[str, ...]] = {c: tuple(algos) for c, algos in REGISTRY.items()}


def build(collective: str, algorithm: str, request: PlanRequest) -> Any:
    """Plan ``algorithm`` for ``collective``."""
    return REGISTRY[collective][algorithm](request)


__all__ = ["ALGORITHMS", "REGISTRY", "PlanRequest", "build", "select"]
