"""A rank that leaves while the others wait for it ends the job instead of hanging it.

``sys.exit(code)`` on one rank, or a script that returns on one rank only, runs no
exception hook; without this guard the other ranks would wait forever inside their
next collective. :func:`install` (called by :func:`mpitrain.init`) registers an
interpreter-exit hook that runs before MPI is finalized:

1. it enters a non-blocking barrier on a private duplicate of ``COMM_WORLD``; when
   every rank has reached its own exit, the barrier completes and the process exits
   as usual;
2. while it waits, it asks the other ranks where they are, through the stall
   inspector's survey of every live communicator (:mod:`.inspector`): a rank that
   waits in a collective this rank never began (its collective count is ahead of
   this rank's) waits for a rank that is gone, so the guard prints which rank left
   and who waits for it in which collective, and calls ``MPI.COMM_WORLD.Abort(1)``,
   which ends every rank within seconds.

Ranks that are still computing are not waiting for anyone: the guard waits for
them (they reach their exit, or a collective that the survey then sees). Without a
survey (the stall inspector off, or MPI below ``THREAD_MULTIPLE``) the guard only
waits in the barrier, as ``MPI_Finalize`` would. It is off under
``MPITRAIN_ELASTIC=1`` (a rank failure is recovered there, see
:mod:`mpitrain.elastic`) and with ``MPITRAIN_ABORT_ON_EXCEPTION=0``.
"""

from __future__ import annotations

import atexit
import sys
import time

from mpi4py import MPI

from .. import config
from .inspector import PeerState, Watched, live_inspectors

POLL_S = 0.05
"""How often the exit barrier is tested."""
SURVEY_EVERY_S = 0.5
"""How often the other ranks are surveyed while the barrier is not complete."""

_comm: MPI.Intracomm | None = None


def install() -> None:
    """Register the exit hook (collective over ``COMM_WORLD`` the first time; idempotent)."""
    global _comm
    if _comm is not None or not config.ABORT_ON_EXCEPTION.get() or config.ELASTIC.get():
        return
    if MPI.COMM_WORLD.Get_size() == 1:
        return
    _comm = MPI.COMM_WORLD.Dup()
    atexit.register(_at_exit)  # after mpi4py's own hook: runs before MPI is finalized


def stranded(transport: Watched, peers: list[PeerState]) -> list[PeerState]:
    """The peers that wait in a collective of ``transport``'s communicator that this
    rank has not begun: they wait for this rank, which is leaving."""
    return [p for p in peers if p.waiting and p.seq is not None and p.seq > transport.seq]


def _at_exit() -> None:
    if _comm is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    barrier = _comm.Ibarrier()
    next_survey = time.monotonic() + SURVEY_EVERY_S
    while not barrier.Test():
        time.sleep(POLL_S)
        if time.monotonic() < next_survey:
            continue
        for inspector in live_inspectors():
            peers = inspector.survey()
            waiting = stranded(inspector.transport, peers or [])
            # a peer past the barrier (which completed while this rank slept) waits in
            # what it does after it, e.g. stopping an async engine: not for this rank
            if waiting and not barrier.Test():
                _abort(inspector.transport, waiting)
        next_survey = time.monotonic() + SURVEY_EVERY_S


def _abort(transport: Watched, waiting: list[PeerState]) -> None:
    who = "; ".join(f"rank {p.rank} waits in {p.collective or 'a collective'} "
                    f"(#{p.seq} on its communicator)" for p in waiting)
    sys.stderr.write(
        f"mpitrain: rank {MPI.COMM_WORLD.Get_rank()} is exiting after collective "
        f"#{transport.seq} of that communicator, but {who}; they would wait for it "
        "forever, so the job is aborted. Every rank must make the same collective calls "
        "before it exits (MPITRAIN_ABORT_ON_EXCEPTION=0 turns this check off)\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
