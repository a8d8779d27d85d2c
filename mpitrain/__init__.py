"""mpitrain: fast, checked collectives for distributed training over MPI.

Typical use under ``mpitrain-run -np N python train.py``::

    import mpitrain as mt
    comm = mt.init()
    grads = comm.allreduce(grads, op=mt.Average)

The module-level functions (``mt.rank()``, ``mt.allreduce(...)``, ...) act on the
communicator returned by :func:`init` (:mod:`mpitrain.session`), as Horovod users expect.

Importing the package loads no MPI: each name below is imported from its module when it
is first used (PEP 562), so that ``mpitrain-run`` and ``python -m mpitrain.run_rank``,
which must not initialise MPI, can be part of the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import elastic
    from .communicator import Communicator
    from .config import Settings
    from .engine import EngineStats, Handle
    from .errors import (
        ArgumentError,
        CommunicationError,
        DtypeError,
        MismatchError,
        MpitrainError,
        NotInitializedError,
        StallError,
        UnsupportedError,
    )
    from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
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
        configure,
        cross_rank,
        cross_size,
        default_communicator,
        grouped_allreduce,
        grouped_allreduce_async,
        init,
        is_initialized,
        join,
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

_EXPORTS: dict[str, tuple[str, ...]] = {
    "communicator": ("Communicator",),
    "config": ("Settings",),
    "engine": ("EngineStats", "Handle"),
    "errors": ("ArgumentError", "CommunicationError", "DtypeError", "MismatchError",
               "MpitrainError", "NotInitializedError", "StallError", "UnsupportedError"),
    "ops": ("Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum"),
    "session": ("allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
                "allreduce_async", "allreduce_async_", "barrier", "broadcast", "broadcast_",
                "broadcast_async_", "broadcast_object", "configure", "cross_rank", "cross_size",
                "default_communicator", "grouped_allreduce", "grouped_allreduce_async", "init",
                "is_initialized", "join", "local_rank", "local_size", "poll", "rank",
                "reduce_scatter",
                "reduce_scatter_async", "shutdown", "size", "synchronize"),
    "timeline": ("start_timeline", "stop_timeline"),
}
"""Where each name of ``__all__`` but ``elastic`` comes from: its module under ``mpitrain``
(the imports under ``TYPE_CHECKING`` say the same, for type checkers and linters)."""

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "Adasum", "ArgumentError", "Average", "CommunicationError", "Communicator", "DtypeError",
    "Max", "Min", "MismatchError", "MpitrainError", "NotInitializedError", "Product",
    "ReduceOp", "StallError", "Sum", "UnsupportedError", "allgather", "allgather_object",
    "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_", "broadcast_object",
    "cross_rank", "cross_size", "default_communicator", "elastic", "init", "is_initialized",
    "local_rank", "local_size", "rank", "reduce_scatter", "shutdown", "size",
]
__all__ += [
    "EngineStats", "Handle", "allgather_async", "allreduce_async", "allreduce_async_",
    "broadcast_async_", "grouped_allreduce", "grouped_allreduce_async", "join", "poll",
    "reduce_scatter_async", "start_timeline", "stop_timeline", "synchronize",
]
__all__ += ["Settings", "configure"]

if not TYPE_CHECKING:  # type checkers see the imports above instead

    def __getattr__(name: str) -> Any:
        """Import a name of ``__all__``, or a submodule (``mt.elastic``), on first use."""
        module = _MODULE_OF.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        elif name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        """The package's attributes, the names not imported yet included."""
        return sorted({*globals(), *__all__})
