"""The session: :func:`init`, :func:`shutdown` and the default communicator.

The module-level collectives (``mt.rank()``, ``mt.allreduce(...)``, ...) act on the
communicator :func:`init` creates, as Horovod users expect. Code that needs the
default communicator (the trainer, elastic recovery, checkpoints) reads it here with
:func:`default_communicator`; elastic recovery swaps it with :func:`replace_default`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from mpi4py import MPI

from . import config, excepthook
from . import engine as _engine
from ._builds import why_not_compiled
from .backends import hostcopy
from .comm import exitguard
from .communicator import Communicator
from .config import Settings
from .engine import Handle
from .errors import NotInitializedError
from .ops import ReduceOp, Sum

_default: Communicator | None = None
_log_handler: logging.Handler | None = None
log = logging.getLogger("mpitrain")
_said: set[str] = set()
"""The messages about the environment this process has logged."""


def init(comm: MPI.Intracomm | None = None) -> Communicator:
    """Create the default communicator (a duplicate of ``comm``, default COMM_WORLD).

    Idempotent: later calls return the same communicator. Also installs the hooks that
    end the whole job when a rank dies of an uncaught exception
    (:mod:`mpitrain.excepthook`) or exits while other ranks wait for it in a collective
    (:mod:`mpitrain.comm.exitguard`, when ``comm`` spans every rank);
    ``MPITRAIN_ABORT_ON_EXCEPTION=0`` opts out of both.
    """
    global _default
    excepthook.install()
    if _default is None:
        world_rank = MPI.COMM_WORLD.Get_rank()
        unknown = config.check_environment()  # raises on an invalid value, naming it
        aliases = config.resolve_aliases()  # HOROVOD_* set before init() count too
        configure_logging(world_rank)
        # aliases once per process (each rank reads its own environment), unknown names
        # once, by rank 0
        for level, message in aliases + [(logging.WARNING, w) for w in unknown
                                         if world_rank == 0]:
            if message not in _said:
                _said.add(message)
                log.log(level, "mpitrain: %s", message)
        if world_rank == 0:
            notice = fallback_notice()
            if notice and notice not in _said:
                _said.add(notice)
                log.warning("%s", notice)
        _default = Communicator(comm if comm is not None else MPI.COMM_WORLD)
        if _default.size == MPI.COMM_WORLD.Get_size():  # every rank is here: collective
            exitguard.install()
    return _default


def fallback_notice() -> str:
    """The one line :func:`init` logs (rank 0, once) when this process runs the pure-Python
    fallback: what is slower, why, how to build the compiled parts and how to silence the
    line; ``""`` when they are compiled or ``MPITRAIN_FALLBACK_NOTICE=0``."""
    if not config.FALLBACK_NOTICE.get():
        return ""
    why = why_not_compiled(_engine.compiled(), hostcopy.compiled(),
                           Path(__file__).resolve().parent)
    if not why:
        return ""
    return (f"mpitrain: running the pure-Python fallback (the async engine and host copies "
            f"are slower): {why}; {config.FALLBACK_NOTICE.name}=0 silences this line")


def configure_logging(rank: int) -> None:
    """With ``MPITRAIN_LOG_LEVEL`` set, send the ``mpitrain`` logger's records of that
    level and above to stderr, each line prefixed with ``rank`` (otherwise leave the
    logging configuration to the program)."""
    global _log_handler
    level = config.LOG_LEVEL.get()
    if not level:
        return
    logger = logging.getLogger("mpitrain")
    logger.setLevel(level.upper())
    if _log_handler is None:
        _log_handler = logging.StreamHandler()
        logger.addHandler(_log_handler)
        logger.propagate = False
    _log_handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s %(levelname)s: "
                                                "%(message)s"))


def configure(settings: Settings | None = None, **changes: Any) -> Settings:
    """:meth:`Communicator.configure` of the default communicator (collective):
    ``mt.configure(segment_bytes="64K")``; returns the settings before."""
    return default_communicator().configure(settings, **changes)


def replace_default(comm: Communicator | None) -> None:
    """Make ``comm`` the default communicator without freeing the old one, whose ranks
    may be gone (:mod:`mpitrain.elastic` does this after a rank failure); ``None``: no
    default until the next :func:`init`."""
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
        # a Horovod script (import mpitrain.torch as hvd) knows the call as hvd.init()
        how = ("hvd.init() (mpitrain.torch's init) first" if "mpitrain.torch" in sys.modules
               else "mpitrain.init() first")
        raise NotInitializedError(f"rank {MPI.COMM_WORLD.Get_rank()}: mpitrain is not "
                                  f"initialised: call {how}")
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


def join() -> int:
    """:meth:`Communicator.join` on the default communicator: wait for every rank to join,
    serving their async operations meanwhile; returns the rank that joined last."""
    return default_communicator().join()


def poll(handle: Handle) -> bool:
    """True once an async operation is done; never blocks (``handle.test()``)."""
    return handle.test()
