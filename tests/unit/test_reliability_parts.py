"""Stall reports, stall settings and the excepthook's opt-out, without launching MPI."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import pytest

from mpitrain import config, excepthook
from mpitrain.comm import inspector
from mpitrain.comm.inspector import PeerState, describe


def test_stall_report_names_late_other_and_silent_ranks() -> None:
    peers = [PeerState(1, 7, False, "broadcast"), PeerState(2, 8, True, "allreduce"),
             PeerState(3, 8, True, "barrier"), PeerState(4, None)]
    report = describe(2, "allreduce", 8, 61.0, peers)
    assert report.startswith("rank 2: allreduce (collective #8 on this communicator) has "
                             "waited 61.0 s: rank 1 has not called it (rank 1 is at #7 "
                             "broadcast)")
    assert "rank 3 called barrier as #8 instead" in report
    assert "rank 4 has not answered" in report
    two = describe(0, "barrier", 3, 1.0, [PeerState(1, 2, True, "x"), PeerState(2, 1)])
    assert "ranks 1, 2 have not called it (rank 1 is at #2 x (waiting); rank 2 is at #1 " \
           "(none))" in two
    assert "every rank has called it" in describe(0, "allreduce", 3, 1.0,
                                                  [PeerState(1, 3, True, "allreduce")])
    assert "unknown (why)" in describe(0, "allreduce", 3, 1.0, None, "why")
    # the timeout's report (StallError, abort) says "timeout", as log scanners (and
    # torch's tests of a backend's timed-out barrier) look for
    assert describe(0, "barrier", 3, 1.0, None, "why", timed_out=True).startswith(
        "rank 0: barrier (collective #3 on this communicator) hit the stall timeout after "
        "1.0 s for other ranks")


def test_stall_report_says_where_a_late_rank_waits_elsewhere() -> None:
    peers = [PeerState(1, 4, False, "barrier", "the async engine's exchange and recv")]
    report = describe(0, "allreduce", 5, 2.0, peers)
    assert "rank 1 has not called it (rank 1 is at #4 barrier; it waits in the async " \
           "engine's exchange and recv)" in report


def test_a_reply_carries_long_and_non_ascii_names_cut_to_its_fields() -> None:
    name, elsewhere = "é" * 200, "w" * 300 + "é"
    packed = inspector._REPLY.pack(7, 3, 1, name.encode()[:inspector._NAME_BYTES],
                                   elsewhere.encode()[:inspector._ELSEWHERE_BYTES])
    qid, seq, waiting, got_name, got_elsewhere = inspector._REPLY.unpack(packed)
    assert (qid, seq, waiting) == (7, 3, 1)
    assert inspector._text(got_name) == "é" * (inspector._NAME_BYTES // 2)
    assert inspector._text(got_elsewhere) == "w" * inspector._ELSEWHERE_BYTES


def test_the_warning_says_what_the_stall_timeout_will_do(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stall warning says when the configured timeout ends the wait (a group's
    ``init_process_group(timeout=...)`` sets one), and how to set one where none is."""
    caplog.set_level("WARNING", logger="mpitrain")
    for timeout_s, action, said in ((0.0, "raise", "Set MPITRAIN_STALL_TIMEOUT_S"),
                                    (5.0, "raise", "At 5 s (the stall timeout) it raises"),
                                    (2.5, "abort", "At 2.5 s (the stall timeout) the job")):
        caplog.clear()
        inspector.warn("rank 0: barrier has waited 1 s", timeout_s, action)
        message = caplog.records[-1].getMessage()
        assert message.startswith("mpitrain rank 0: barrier has waited 1 s. ") and said in message
        assert ("MPITRAIN_STALL_TIMEOUT_S" in message) == (timeout_s == 0.0), message


def test_stall_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPITRAIN_STALL_TIMEOUT_S", "off")
    assert config.STALL_TIMEOUT_S.get() == 0.0
    monkeypatch.setenv("MPITRAIN_STALL_TIMEOUT_S", "2.5")
    assert config.STALL_TIMEOUT_S.get() == 2.5
    monkeypatch.setenv("MPITRAIN_STALL_WARNING_S", "-1")
    with pytest.raises(ValueError, match="MPITRAIN_STALL_WARNING_S='-1' is not valid"):
        config.STALL_WARNING_S.get()
    monkeypatch.setenv("MPITRAIN_STALL_ACTION", "Abort")
    assert config.STALL_ACTION.get() == "abort"
    monkeypatch.setenv("MPITRAIN_STALL_ACTION", "retry")
    with pytest.raises(ValueError, match="expected one of raise, abort"):
        config.STALL_ACTION.get()


def test_excepthook_opt_out_and_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(excepthook, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    before = (sys.excepthook, threading.excepthook)
    monkeypatch.setenv("MPITRAIN_ABORT_ON_EXCEPTION", "0")
    excepthook.install()
    assert (sys.excepthook, threading.excepthook) == before
    monkeypatch.setenv("MPITRAIN_ABORT_ON_EXCEPTION", "1")
    excepthook.install()
    assert sys.excepthook is not before[0] and threading.excepthook is not before[1]


def test_the_excepthook_writes_past_a_captured_stderr(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """torch.distributed's hook swaps ``sys.stderr`` for a StringIO while it calls the
    hook it wraps, and mpitrain's never returns (it ends the job): the report goes to
    the process's own stderr then, and to ``sys.stderr`` where that is a file."""
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stderr", captured)
    assert excepthook._terminal() is sys.__stderr__
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        assert excepthook._terminal() is log
