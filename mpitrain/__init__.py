"""mpitrain: fast, checked collectives for distributed training over MPI.

Typical use under ``mpirun -np N python train.py``::

    import mpitrain as mt
    comm = mt.init()
    grads = comm.allreduce(grads, op=mt.Average)

The module-level functions (``mt.rank()``, ``mt.allreduce(...)``, ...) act on the
communicator returned by :func:`init` (:mod:`mpitrain.session`), as Horovod users expect.
"""

from __future__ import annotations

from . import elastic
from .communicator import Communicator
from .engine import EngineStats, Handle
from .errors import (
    ArgumentError,
    CommunicationError,
    DtypeError,
    MismatchError,
    MpitrainError,
    NotInitializedError,
    StallError,
)
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .session import (
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    default_communicator,
    grouped_allreduce,
    grouped_allreduce_async,
    init,
    is_initialized,
    local_rank,
    local_size,
    poll,
    rank,
    reduce_scatter,
    reduce_scatter_async,
    shutdown,
    size,
    synchronize,
)
from .timeline import start_timeline, stop_timeline

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "Average", "CommunicationError", "Communicator", "DtypeError", "Max",
    "Min", "MismatchError", "MpitrainError", "NotInitializedError", "Product", "ReduceOp",
    "StallError", "Sum", "allgather", "allgather_object", "allreduce", "allreduce_",
    "barrier", "broadcast", "broadcast_", "broadcast_object", "cross_rank", "cross_size",
    "default_communicator", "elastic", "init", "is_initialized", "local_rank", "local_size", "rank",
    "reduce_scatter", "shutdown", "size",
]
__all__ += [
    "EngineStats", "Handle", "allgather_async", "allreduce_async", "allreduce_async_",
    "broadcast_async_", "grouped_allreduce", "grouped_allreduce_async", "poll",
    "reduce_scatter_async", "start_timeline", "stop_timeline", "synchronize",
]
