"""mpitrain: fast, checked collectives for distributed training over MPI.

Typical use under ``mpirun -np N python train.py``::

    import mpitrain as mt
    comm = mt.init()
    grads = comm.allreduce(grads, op=mt.Average)

The module-level functions (``mt.rank()``, ``mt.allreduce(...)``, ...) act on the
communicator returned by :func:`init`, as Horovod users expect.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from . import elastic, excepthook
from .comm import Communicator
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
from .timeline import start_timeline, stop_timeline

__version__ = "0.1.0"

_default: Communicator | None = None


def init(comm: MPI.Intracomm | None = None) -> Communicator:
    """Create the default communicator (a duplicate of ``comm``, default COMM_WORLD).

    Idempotent: later calls return the same communicator. Also installs the hook that
    ends the whole job when a rank dies of an uncaught exception (see
    :mod:`mpitrain.excepthook`; ``MPITRAIN_ABORT_ON_EXCEPTION=0`` opts out).
    """
    global _default
    excepthook.install()
    if _default is None:
        _default = Communicator(comm if comm is not None else MPI.COMM_WORLD)
    return _default


def _replace_default(comm: Communicator) -> None:
    """Make ``comm`` the default communicator without freeing the old one, whose ranks
    may be gone (used by :mod:`mpitrain.elastic` after a rank failure)."""
    global _default
    _default = comm


def is_initialized() -> bool:
    """True once :func:`init` has been called (and not undone by :func:`shutdown`)."""
    return _default is not None


def shutdown() -> None:
    """Release the default communicator; :func:`init` may be called again."""
    global _default
    if _default is not None:
        _default.free()
        _default = None


def default_communicator() -> Communicator:
    """The communicator of :func:`init`; raises if :func:`init` was not called."""
    if _default is None:
        raise NotInitializedError("mpitrain is not initialised: call mpitrain.init() first")
    return _default


def rank() -> int:
    """Rank of this process in the default communicator."""
    return default_communicator().rank


def size() -> int:
    """Number of ranks in the default communicator."""
    return default_communicator().size


def local_rank() -> int:
    """Rank of this process among the ranks of its node."""
    return default_communicator().local_rank


def local_size() -> int:
    """Number of ranks on this node."""
    return default_communicator().local_size


def cross_rank() -> int:
    """Index of this process's node (nodes are numbered by their lowest rank)."""
    return default_communicator().cross_rank


def cross_size() -> int:
    """Number of nodes."""
    return default_communicator().cross_size


def allreduce(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Any:
    """:meth:`Communicator.allreduce` on the default communicator."""
    return default_communicator().allreduce(x, op, **kwargs)


def allreduce_(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Any:
    """:meth:`Communicator.allreduce_` on the default communicator."""
    return default_communicator().allreduce_(x, op, **kwargs)


def reduce_scatter(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Any:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return default_communicator().reduce_scatter(x, op, **kwargs)


def allgather(x: Any, **kwargs: Any) -> Any:
    """:meth:`Communicator.allgather` on the default communicator."""
    return default_communicator().allgather(x, **kwargs)


def broadcast(x: Any, root: int = 0, **kwargs: Any) -> Any:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return default_communicator().broadcast(x, root, **kwargs)


def broadcast_(x: Any, root: int = 0, **kwargs: Any) -> Any:
    """:meth:`Communicator.broadcast_` on the default communicator."""
    return default_communicator().broadcast_(x, root, **kwargs)


def barrier() -> None:
    """:meth:`Communicator.barrier` on the default communicator."""
    default_communicator().barrier()


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """:meth:`Communicator.broadcast_object` on the default communicator."""
    return default_communicator().broadcast_object(obj, root)


def allgather_object(obj: Any) -> list[Any]:
    """:meth:`Communicator.allgather_object` on the default communicator."""
    return default_communicator().allgather_object(obj)


def allreduce_async(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Handle:
    """:meth:`Communicator.allreduce_async` on the default communicator."""
    return default_communicator().allreduce_async(x, op, **kwargs)


def allreduce_async_(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Handle:
    """:meth:`Communicator.allreduce_async_` on the default communicator."""
    return default_communicator().allreduce_async_(x, op, **kwargs)


def grouped_allreduce(xs: list[Any], op: ReduceOp | str = Sum, **kwargs: Any) -> list[Any]:
    """:meth:`Communicator.grouped_allreduce` on the default communicator."""
    return default_communicator().grouped_allreduce(xs, op, **kwargs)


def grouped_allreduce_async(xs: list[Any], op: ReduceOp | str = Sum, **kwargs: Any) -> Handle:
    """:meth:`Communicator.grouped_allreduce_async` on the default communicator."""
    return default_communicator().grouped_allreduce_async(xs, op, **kwargs)


def allgather_async(x: Any, **kwargs: Any) -> Handle:
    """:meth:`Communicator.allgather_async` on the default communicator."""
    return default_communicator().allgather_async(x, **kwargs)


def broadcast_async_(x: Any, root: int = 0, **kwargs: Any) -> Handle:
    """:meth:`Communicator.broadcast_async_` on the default communicator."""
    return default_communicator().broadcast_async_(x, root, **kwargs)


def reduce_scatter_async(x: Any, op: ReduceOp | str = Sum, **kwargs: Any) -> Handle:
    """:meth:`Communicator.reduce_scatter_async` on the default communicator."""
    return default_communicator().reduce_scatter_async(x, op, **kwargs)


def synchronize(handle: Handle) -> Any:
    """Wait for an async operation and return its result (``handle.wait()``)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once an async operation is done; never blocks (``handle.test()``)."""
    return handle.test()


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
