"""mpitrain.comm.p2p reports the error of the request that failed (a lost rank's
MPI_ERR_PROC_FAILED), not MPI_ERR_IN_STATUS, which elastic recovery would not know."""

from __future__ import annotations

from mpi4py import MPI

from mpitrain.comm.p2p import _rethrow
from mpitrain.elastic import rank_failure


def _status(code: int) -> MPI.Status:
    status = MPI.Status()
    status.Set_error(code)
    return status


def test_err_in_status_becomes_the_failed_requests_error() -> None:
    exc = MPI.Exception(MPI.ERR_IN_STATUS)
    assert rank_failure(exc) is None
    statuses = [_status(MPI.SUCCESS), _status(MPI.ERR_PENDING), _status(MPI.ERR_PROC_FAILED),
                _status(MPI.ERR_REVOKED)]
    raised = _rethrow(exc, statuses)
    assert raised.Get_error_class() == MPI.ERR_PROC_FAILED
    assert rank_failure(raised) is raised


def test_other_errors_pass_unchanged() -> None:
    exc = MPI.Exception(MPI.ERR_TRUNCATE)
    assert _rethrow(exc, [_status(MPI.ERR_PROC_FAILED)]) is exc
    inside = MPI.Exception(MPI.ERR_IN_STATUS)
    assert _rethrow(inside, [_status(MPI.SUCCESS)]) is inside
