"""Recovering the default communicator after a rank failure, with ULFM.

Under ``mpiexec --with-ft ulfm`` a rank that dies *by a signal* is reported to the
ranks that communicate with it: their MPI call fails with ``ERR_PROC_FAILED`` (or
``ERR_PROC_FAILED_PENDING``). Ranks that wait on living peers are not told, so the
first rank that sees a failure *revokes* the communicator, and every other rank's
pending and later calls on it fail with ``ERR_REVOKED``. Then every survivor:

1. :func:`abandon`\\ s the old :class:`~mpitrain.Communicator`: revokes its private
   communicators (transport, node split and the node split's transports) and stops
   their stall inspectors;
2. :func:`rebuild`\\ s: ``Shrink`` of the revoked transport communicator gives a
   communicator of the survivors, and a new ``Communicator`` on it plans rings and
   the node topology for the new size. ``Agree`` (a fault-tolerant AND) confirms
   that every survivor built it; if another rank died meanwhile, they shrink again.

After a recovery, ``MPI_Finalize`` at exit can hang: its runtime fence sometimes still
waits for the dead rank (seen with the Open MPI 5.0.11 wheel in about one job in ten).
So the exit guard (:func:`mpitrain.comm.exitguard.after_recovery`) holds its barrier
over the survivors at interpreter exit, before mpi4py finalizes MPI (no one leaves
while another still needs it), and the process then ends with ``os._exit(0)``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import cast

from mpi4py import MPI

from ..comm import exitguard
from ..communicator import Communicator
from ..dispatch import Dispatcher

log = logging.getLogger("mpitrain")
FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                             MPI.ERR_REVOKED})


def rank_failure(exc: BaseException | None) -> MPI.Exception | None:
    """The MPI error reporting a failed rank or a revoked communicator behind ``exc``.

    Follows ``__cause__``/``__context__``, since layers above MPI may wrap the error.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def abandon(comm: Communicator) -> None:
    """Revoke every private communicator of ``comm`` (and of its async engine, whose
    thread then fails what is in flight) and stop their stall inspectors."""
    dispatchers = [comm.dispatcher]
    if comm.engine_started:
        dispatchers.append(comm.engine().dispatcher)
    for dispatcher in dispatchers:
        _revoke(dispatcher)


def _revoke(dispatcher: Dispatcher) -> None:
    topology = dispatcher.topology
    transports = (dispatcher.transport, topology.local, topology.cross)
    for mpi_comm in (topology.local_comm, topology.cross_comm,
                     *(t.comm for t in transports), *(t.inspector.comm for t in transports)):
        if mpi_comm is not None and mpi_comm != MPI.COMM_NULL:
            with contextlib.suppress(MPI.Exception):
                mpi_comm.Revoke()
    for t in transports:
        t.inspector.close(free=False)


def rebuild(old: Communicator) -> Communicator:
    """A new communicator of the survivors of ``old`` (collective over the survivors)."""
    abandon(old)
    log.debug("mpitrain rank %d: elastic: revoked the %d-rank communicator; shrinking it to "
              "its survivors", old.rank, old.size)
    parent = old.mpi_comm
    attempt = 0
    while True:
        attempt += 1
        shrunk = cast(MPI.Intracomm, parent.Shrink())
        log.debug("mpitrain rank %d: elastic: shrink %d gave %d survivor(s); building their "
                  "communicator", old.rank, attempt, shrunk.Get_size())
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        comm: Communicator | None = None
        survivors: MPI.Intracomm | None = None
        try:
            comm = Communicator(shrunk)
            survivors = shrunk.Dup()
        except MPI.Exception as exc:
            if rank_failure(exc) is None:
                raise
        try:
            everywhere = bool(shrunk.Agree(int(survivors is not None)))
        except MPI.Exception as exc:  # a rank died during the rebuild: same error on all
            if rank_failure(exc) is None:
                raise
            everywhere = False
        if everywhere and comm is not None and survivors is not None:
            log.debug("mpitrain rank %d: elastic: every survivor built the new communicator; "
                      "this rank is now %d of %d", old.rank, comm.rank, comm.size)
            shrunk.Free()
            exitguard.after_recovery(survivors)
            return comm
        log.debug("mpitrain rank %d: elastic: another rank failed during the rebuild; "
                  "shrinking again", old.rank)
        if comm is not None:
            abandon(comm)
        with contextlib.suppress(MPI.Exception):
            shrunk.Revoke()
            if survivors is not None:
                survivors.Revoke()
        parent = shrunk
