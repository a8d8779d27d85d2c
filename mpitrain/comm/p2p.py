"""Collectives posted as point-to-point messages, for jobs under ULFM.

When a rank fails, a non-blocking collective of Open MPI's ``libnbc`` that waits for it
aborts its schedule and writes ``NBC_Progress: an error 75 was found during schedule
... - aborting the schedule`` to stderr on every survivor, unconditionally; a
point-to-point request only completes with the error. Under ``mpitrain-run --elastic``
(``MPITRAIN_ELASTIC=1``) the collectives that mpitrain runs on its own account (the async
engine's negotiation, the exit barrier, and a transport's barrier, broadcast and
allgathers: validation, object collectives) are therefore the messages below: one round in
which each rank sends its part to every other rank that needs it. Their payloads are
small (slots, tables, lengths, pickled objects), so ``size - 1`` messages per rank cost
little against what a collective algorithm would save.

Each function posts the receives first, then the sends, and returns the requests; the
caller completes them with :func:`testall`/:func:`waitall`, which report a failed
request's own error (``MPI_ERR_PROC_FAILED``, ``MPI_ERR_REVOKED``) where MPI reports
``MPI_ERR_IN_STATUS``, so that :func:`mpitrain.elastic.rank_failure` recognises it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from mpi4py import MPI

TAG = 60
"""The tag of these messages (the algorithms' tags are below 40)."""


def _rethrow(exc: MPI.Exception, statuses: Sequence[MPI.Status]) -> MPI.Exception:
    """The error of the first failed request behind an ``MPI_ERR_IN_STATUS``."""
    if exc.Get_error_class() == MPI.ERR_IN_STATUS:
        for status in statuses:
            code = status.Get_error()
            if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                return MPI.Exception(code)
    return exc


def testall(requests: Sequence[MPI.Request],
            statuses: list[MPI.Status] | None = None) -> bool:
    """``MPI_Testall`` (filling ``statuses`` where given), raising a failed request's
    own error."""
    if statuses is None:
        statuses = [MPI.Status() for _ in requests]
    try:
        return bool(MPI.Request.Testall(list(requests), statuses))
    except MPI.Exception as exc:
        raise _rethrow(exc, statuses) from None


def waitall(requests: Sequence[MPI.Request]) -> None:
    """``MPI_Waitall``, raising a failed request's own error."""
    statuses = [MPI.Status() for _ in requests]
    try:
        MPI.Request.Waitall(list(requests), statuses)
    except MPI.Exception as exc:
        raise _rethrow(exc, statuses) from None


def _others(comm: MPI.Intracomm) -> list[int]:
    rank = comm.Get_rank()
    return [r for r in range(comm.Get_size()) if r != rank]


def barrier(comm: MPI.Intracomm) -> list[MPI.Request]:
    """A barrier: an empty message to and from every other rank."""
    empty = np.empty(0, np.uint8)
    others = _others(comm)
    return ([comm.Irecv(empty, r, TAG) for r in others]
            + [comm.Isend(empty, r, TAG) for r in others])


def bcast(comm: MPI.Intracomm, buf: np.ndarray, root: int) -> list[MPI.Request]:
    """``buf`` of ``root`` into ``buf`` of every rank."""
    if comm.Get_rank() != root:
        return [comm.Irecv(buf, root, TAG)]
    return [comm.Isend(buf, r, TAG) for r in _others(comm)]


def allgather(comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray) -> list[MPI.Request]:
    """Every rank's ``send`` into row ``r`` of ``recv`` (``size`` rows of ``send``'s
    length and dtype, C-contiguous)."""
    rows = recv.reshape(comm.Get_size(), -1)
    rows[comm.Get_rank()] = send.reshape(-1)
    others = _others(comm)
    return ([comm.Irecv(rows[r], r, TAG) for r in others]
            + [comm.Isend(send, r, TAG) for r in others])


def allgatherv(comm: MPI.Intracomm, send: np.ndarray, recv: np.ndarray,
               counts: Sequence[int], displs: Sequence[int]) -> list[MPI.Request]:
    """Every rank's ``send`` (``counts[r]`` elements) into ``recv[displs[r]:]``
    (``recv`` one-dimensional, of ``send``'s dtype)."""
    rank = comm.Get_rank()
    lo = displs[rank]
    recv[lo:lo + counts[rank]] = send.reshape(-1)
    others = _others(comm)
    return ([comm.Irecv(recv[displs[r]:displs[r] + counts[r]], r, TAG) for r in others]
            + [comm.Isend(send, r, TAG) for r in others])
