"""Elastic training: survive the loss of ranks (ULFM), or restart from a checkpoint.

::

    import mpitrain as mt

    comm = mt.init()
    state = mt.elastic.State(params=w, optimizer=opt, epoch=0, batch=0)

    @mt.elastic.run
    def train(state):
        while state.batch < steps:
            comm = mt.default_communicator()   # re-read: it changes after a failure
            ...                                 # shard the batch by comm.size/comm.rank
            state.batch += 1
            state.commit()

    train(state)

Run it with ``mpitrain-run --elastic -np 4 train.py``. When a rank dies (by a signal:
under ``--elastic`` an uncaught exception kills its rank with SIGKILL), the survivors'
next MPI call fails; :func:`run` catches that, rebuilds the default communicator over
the survivors (:mod:`.recovery`), agrees on the newest commit any survivor holds (the
survivors may be a step apart: a rank that finished a step's collective before the
failure has committed one more step), gives every survivor that commit, calls the
reset callbacks and calls ``train(state)`` again, which resumes from ``state``.

Without ULFM a rank failure ends the job; ``mpitrain-run --max-restarts K`` starts it
again and :func:`run` resumes from the newest durable checkpoint of
``State(checkpoint=DIR)``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NoReturn, TypeVar

from .. import config, excepthook, session
from ..errors import ResetRequired
from .recovery import abandon, rank_failure, rebuild
from .state import State

__all__ = ["ResetRequired", "State", "abandon", "leave", "rank_failure", "rebuild",
           "recover", "recoverable", "run"]

log = logging.getLogger("mpitrain")
T = TypeVar("T")


def recover(state: State, synced: bool = True) -> None:
    """After a rank failure: rebuild the default communicator and agree on ``state``.

    Collective over the survivors. ``synced``: whether this rank has finished
    :func:`run`'s first sync from rank 0; a survivor that has not takes the state of one
    that has (or, when none has, of the new rank 0). Raises if another failure
    interrupts the agreement (call it again: :func:`run` does).
    """
    old = session.default_communicator()
    comm = rebuild(old)
    session.replace_default(comm)
    held = comm.allgather_object((state.commits, synced))
    newest = max(held)
    if min(held) == newest and synced:
        state.restore()
    else:
        state.sync(root=held.index(newest))
    log.warning("mpitrain elastic: rank %d of %d (was %d of %d) resumes from commit %d",
                comm.rank, comm.size, old.rank, old.size, newest[0])
    state.on_reset()


def recoverable(exc: BaseException) -> bool:
    """Whether :func:`run` recovers from ``exc``: the loss of a rank (ULFM's errors, also
    as the cause of another exception) or :class:`~mpitrain.errors.ResetRequired`."""
    return isinstance(exc, ResetRequired) or rank_failure(exc) is not None


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``func(state, ...)`` so that it survives the loss of ranks.

    The wrapper initialises mpitrain, resumes ``state`` from its durable checkpoint
    if there is one (rank 0 reads it), makes every rank start from rank 0's state,
    and calls ``func``. When a rank fails (ULFM), it recovers (:func:`recover`) and
    calls ``func`` again; any other exception propagates.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        comm = session.init()
        if not (comm.rank == 0 and state.load_checkpoint()):
            state.adopt(state.capture(), state.commits)
        synced = False
        while True:
            try:
                if not synced:  # in the loop: a rank lost during this sync is recovered from
                    state.sync(root=0)
                    synced = True
                return func(state, *args, **kwargs)
            except SystemExit as exc:  # sys.exit() inside training: this rank leaves
                leave(exc)
            except Exception as exc:
                if not recoverable(exc):
                    raise
                log.warning("mpitrain elastic: rank %d lost a peer (%s); recovering",
                            session.rank(), exc)
            while True:
                try:
                    recover(state, synced)
                    synced = True
                    break
                except Exception as exc:
                    if rank_failure(exc) is None:
                        raise

    return wrapper


def leave(exc: SystemExit) -> NoReturn:
    """``sys.exit()`` inside an elastic run on this rank only: a rank failure.

    Under ULFM (``MPITRAIN_ELASTIC=1``) the rank kills itself with SIGKILL, as for an
    uncaught exception, so that the survivors recover without it instead of waiting
    for it; otherwise the exit proceeds (and the exit guard ends a job whose other ranks
    wait for this one, see :mod:`mpitrain.comm.exitguard`).
    """
    if config.ELASTIC.get():
        log.warning("mpitrain elastic: rank %d called sys.exit(%r) inside the elastic run; "
                    "killing it so that the other ranks recover without it",
                    session.rank(), exc.code)
        excepthook.end_job()
    raise exc
