"""Collective algorithms: one algorithm per module, each planned in its constructor from a
:class:`~.base.PlanRequest` and executed by ``run()`` (the :class:`~.base.Plan` contract).

To add an algorithm, write its module (a :class:`~.base.Plan` subclass that declares
its capabilities) and list its class in :data:`REGISTRY`; the selection table
(:mod:`mpitrain.dispatch.selection`) decides when ``auto`` picks it.

An allreduce with ``op=Adasum`` is no elementwise reduction that these algorithms
could run: it always runs :class:`~.adasum.AdasumAllreduce`, which is in no table.
"""

from __future__ import annotations

from ..ops import ReduceOp
from .adasum import AdasumAllreduce
from .base import Plan, PlanRequest
from .bruck import BruckAllgather
from .hierarchical import HierarchicalAllgather, HierarchicalAllreduce, HierarchicalReduceScatter
from .ipc import IpcAllgather, IpcAllreduce, IpcReduceScatter
from .native import NativeAllgather, NativeAllreduce, NativeBroadcast, NativeReduceScatter
from .nccl import NcclAllgather, NcclAllreduce, NcclBroadcast, NcclReduceScatter
from .rabenseifner import RabenseifnerAllreduce
from .recursive_doubling import RecursiveDoublingAllgather, RecursiveDoublingAllreduce
from .recursive_halving import RecursiveHalvingReduceScatter
from .ring import RingAllgather, RingAllreduce, RingReduceScatter
from .shared_memory import ShmAllgather, ShmAllreduce, ShmBroadcast, ShmReduceScatter
from .single_copy import SingleCopyAllgather, SingleCopyAllreduce, SingleCopyReduceScatter

# collective -> algorithm name -> class; the first name is the fallback of "auto".
REGISTRY: dict[str, dict[str, type[Plan]]] = {
    "allreduce": {"ring": RingAllreduce, "mpi": NativeAllreduce, "shm": ShmAllreduce,
                  "recursive_doubling": RecursiveDoublingAllreduce,
                  "rabenseifner": RabenseifnerAllreduce,
                  "hierarchical": HierarchicalAllreduce, "single_copy": SingleCopyAllreduce,
                  "ipc": IpcAllreduce, "nccl": NcclAllreduce},
    "reduce_scatter": {"ring": RingReduceScatter, "mpi": NativeReduceScatter,
                       "shm": ShmReduceScatter, "recursive_halving": RecursiveHalvingReduceScatter,
                       "hierarchical": HierarchicalReduceScatter,
                       "single_copy": SingleCopyReduceScatter, "ipc": IpcReduceScatter,
                       "nccl": NcclReduceScatter},
    "allgather": {"ring": RingAllgather, "mpi": NativeAllgather, "shm": ShmAllgather,
                  "recursive_doubling": RecursiveDoublingAllgather, "bruck": BruckAllgather,
                  "hierarchical": HierarchicalAllgather, "single_copy": SingleCopyAllgather,
                  "ipc": IpcAllgather, "nccl": NcclAllgather},
    "broadcast": {"mpi": NativeBroadcast, "shm": ShmBroadcast, "nccl": NcclBroadcast},
}

ALGORITHMS: dict[str, tuple[str, ...]] = {c: tuple(algos) for c, algos in REGISTRY.items()}
KNOWN: frozenset[str] = frozenset(name for algos in REGISTRY.values() for name in algos)
"""Every algorithm name of any collective."""
ADASUM = "adasum"
"""The name an allreduce with ``op=Adasum`` reports as its algorithm."""


def build(collective: str, algorithm: str, request: PlanRequest) -> Plan:
    """Plan ``algorithm`` for ``collective`` (an allreduce with ``op=Adasum``: always
    :class:`~.adasum.AdasumAllreduce`)."""
    if request.op is ReduceOp.ADASUM:
        return AdasumAllreduce(request)
    return REGISTRY[collective][algorithm](request)


__all__ = ["ALGORITHMS", "KNOWN", "REGISTRY", "Plan", "PlanRequest", "build"]
