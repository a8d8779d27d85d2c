"""mpitrain.comm.p2p reports the error of the request that failed (a lost rank's
MPI_ERR_PROC_FAILED), not MPI_ERR_IN_STATUS, which elastic recovery would not know."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.comm import p2p
from mpitrain.comm.inspector import StallLimits
from mpitrain.comm.p2p import _rethrow
from mpitrain.comm.transport import Transport
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


@pytest.mark.parametrize("elastic", [False, True])
@pytest.mark.parametrize("timeout_s", [0.0, 30.0], ids=["blocking", "interruptible"])
def test_an_elastic_transports_waits_report_through_p2p(
        monkeypatch: pytest.MonkeyPatch, elastic: bool, timeout_s: float) -> None:
    """Every multi-request wait of an elastic transport (blocking or interruptible) goes
    through p2p's testall/waitall, which translate MPI_ERR_IN_STATUS; others use MPI's."""
    seen: list[str] = []

    def recorded(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(requests: Any) -> Any:
            seen.append(name)
            return real(requests)
        return call

    monkeypatch.setattr(p2p, "testall", recorded("testall", p2p.testall))
    monkeypatch.setattr(p2p, "waitall", recorded("waitall", p2p.waitall))
    t = Transport(MPI.COMM_SELF, StallLimits(0.0, timeout_s, "raise"), elastic=elastic)
    try:
        got, sent = np.zeros(3), np.arange(3.0)
        t.waitall([t.irecv(got, 0, 5), t.isend(sent, 0, 5)])
        np.testing.assert_array_equal(got, sent)
        want = ("testall" if timeout_s else "waitall") if elastic else None
        assert (seen[-1] if seen else None) == want, seen
    finally:
        t.free()
