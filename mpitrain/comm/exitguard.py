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
waits in the barrier, as ``MPI_Finalize`` would. It is off with
``MPITRAIN_ABORT_ON_EXCEPTION=0``.

Under ``MPITRAIN_ELASTIC=1`` (``mpitrain-run --elastic``) a rank that leaves early is
a rank failure that the others recover from (:mod:`mpitrain.elastic`): instead of
aborting the job, the guard kills its own rank with SIGKILL. It also reports to the
rank's supervisor (:mod:`mpitrain.run_rank`): ``I`` when it is installed, ``C`` when
the exit barrier has completed; a rank that ends without ``C`` (``os._exit()``, which
runs no hook) is killed by its supervisor. After a recovery (:func:`after_recovery`)
the barrier runs over the survivors, and the process then ends with ``os._exit(0)``
instead of calling ``MPI_Finalize``, whose fence can wait forever for the dead rank.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
from typing import Callable

from mpi4py import MPI

from .. import config, excepthook
from . import p2p
from .inspector import PeerState, Watched, live_inspectors

POLL_S = 0.05
"""How often the exit barrier is tested."""
SURVEY_EVERY_S = 0.5
"""How often the other ranks are surveyed while the barrier is not complete."""
BARRIER_GRACE_S = 1.0
"""How long the barrier may take to complete once peers are seen waiting, before the
guard concludes that they wait for this rank."""

INITIALISED, CLEAN_EXIT = b"I", b"C"
"""What the guard tells a rank's supervisor (the same bytes as :mod:`mpitrain.run_rank`)."""

_comm: MPI.Intracomm | None = None  # the exit barrier's communicator
_survey = False  # look for ranks stranded by this one's exit
_after_failure = False  # a recovery happened: skip MPI_Finalize


def install() -> None:
    """Register the exit hook (collective over ``COMM_WORLD`` the first time; idempotent)."""
    global _comm, _survey
    if _comm is not None or not config.ABORT_ON_EXCEPTION.get():
        return
    if MPI.COMM_WORLD.Get_size() == 1:
        return
    _comm = MPI.COMM_WORLD.Dup()
    _comm.Set_errhandler(MPI.ERRORS_RETURN)
    _survey = True
    atexit.register(_at_exit)  # after mpi4py's own hook: runs before MPI is finalized
    if config.ELASTIC.get():
        tell_supervisor(INITIALISED)


def tell_supervisor(mark: bytes) -> None:
    """Write ``mark`` to the rank's supervisor, if ``mpitrain-run --elastic`` gave one."""
    fd = config.SUPERVISOR_FD.get()
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(fd, mark)


def after_recovery(survivors: MPI.Intracomm) -> None:
    """Hold the exit barrier over ``survivors`` (a communicator of this rank's own, from
    a recovery), and end the process with ``os._exit(0)`` after it."""
    global _comm, _after_failure
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    if _comm is None:
        atexit.register(_at_exit)
    _comm, _after_failure = survivors, True


def stranded(transport: Watched, peers: list[PeerState]) -> list[PeerState]:
    """The peers that wait in a collective of ``transport``'s communicator that this
    rank has not begun: they wait for this rank, which is leaving."""
    return [p for p in peers if p.waiting and p.seq is not None and p.seq > transport.seq]


def _at_exit() -> None:
    if _comm is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    try:
        _exit_barrier(_comm)
    except MPI.Exception as exc:
        if not config.ELASTIC.get():
            raise
        _leave(f"another rank failed while this one was exiting ({exc})")
    tell_supervisor(CLEAN_EXIT)
    if _after_failure:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def _exit_barrier(comm: MPI.Intracomm) -> None:
    done = _barrier(comm)
    next_survey = time.monotonic() + SURVEY_EVERY_S
    while not done():
        time.sleep(POLL_S)
        if not _survey or time.monotonic() < next_survey:
            continue
        for inspector in live_inspectors():
            peers = inspector.survey()
            waiting = stranded(inspector.transport, peers or [])
            if waiting and not _completes(done):
                _abort(inspector.transport, waiting)
        next_survey = time.monotonic() + SURVEY_EVERY_S


def _barrier(comm: MPI.Intracomm) -> Callable[[], bool]:
    """Enter a non-blocking barrier on ``comm``; returns its test. Under ULFM it is
    point-to-point messages, whose failure prints nothing (:mod:`.p2p`)."""
    if config.ELASTIC.get():
        requests = p2p.barrier(comm)
        return lambda: p2p.testall(requests)
    return comm.Ibarrier().Test


def _completes(barrier: Callable[[], bool]) -> bool:
    """Whether the exit barrier completes within ``BARRIER_GRACE_S``.

    A peer seen waiting may have left the barrier already: its completion there means
    every rank has entered it, and what the peer waits in is then what comes after the
    exit hook (stopping the async engines, collective on every rank). This rank's side
    of the barrier completes as soon as it is tested; a peer stranded by this rank's
    exit never enters the barrier, so it does not complete.
    """
    deadline = time.monotonic() + BARRIER_GRACE_S
    while time.monotonic() < deadline:
        if barrier():
            return True
        time.sleep(POLL_S)
    return barrier()


def _abort(transport: Watched, waiting: list[PeerState]) -> None:
    who = "; ".join(f"rank {p.rank} waits in {p.collective or 'a collective'} "
                    f"(#{p.seq} on its communicator)" for p in waiting)
    why = (f"rank {MPI.COMM_WORLD.Get_rank()} is exiting after collective "
           f"#{transport.seq} of that communicator, but {who}; they would wait for it "
           "forever")
    if config.ELASTIC.get():
        _leave(why)
    sys.stderr.write(
        f"mpitrain: {why}, so the job is aborted. Every rank must make the same collective "
        "calls before it exits (MPITRAIN_ABORT_ON_EXCEPTION=0 turns this check off)\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)


def _leave(why: str) -> None:
    """Under ULFM: end this rank by SIGKILL, a rank failure the others recover from."""
    sys.stderr.write(f"mpitrain: {why}; killing this rank so that the others go on "
                     "without it (elastic mode)\n")
    excepthook.end_job()
