"""Collective algorithms: one algorithm per module, each planned in its constructor and
executed by ``run()``, plus the table (:mod:`.selection`) that picks among them."""

from __future__ import annotations

from .chunks import split_bounds
from .native import NativeAllgather, NativeAllreduce, NativeBroadcast, NativeReduceScatter
from .ring import RingAllgather, RingAllreduce, RingReduceScatter
from .selection import select

# Algorithms each collective offers; the first is the fallback of "auto".
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "mpi"),
    "reduce_scatter": ("ring", "mpi"),
    "allgather": ("ring", "mpi"),
    "broadcast": ("mpi",),
}

__all__ = [
    "ALGORITHMS", "NativeAllgather", "NativeAllreduce", "NativeBroadcast",
    "NativeReduceScatter", "RingAllgather", "RingAllreduce", "RingReduceScatter", "select",
    "split_bounds",
]
