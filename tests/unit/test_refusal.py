"""The adapters' refusal block and handle table (mpitrain.parallel), on fakes of the
engine: no MPI."""

from __future__ import annotations

from typing import Any

import pytest

from mpitrain.errors import ArgumentError
from mpitrain.parallel.pending import HandleTable, Pending
from mpitrain.parallel.refusal import refusing


class _Engine:
    def __init__(self) -> None:
        self.refused: list[tuple[str, str | None, BaseException]] = []

    def refuse(self, kind: str, name: str | None, exc: BaseException) -> None:
        self.refused.append((kind, name, exc))


class _Comm:
    def __init__(self) -> None:
        self.the_engine = _Engine()

    def engine(self) -> _Engine:
        return self.the_engine


def test_an_error_in_the_block_refuses_every_named_submission_and_goes_on() -> None:
    comm = _Comm()
    error = ValueError("bad shape")
    with pytest.raises(ValueError) as raised, \
            refusing(comm, "allgather", "g.0", None, "g.2"):  # type: ignore[arg-type]
        raise error
    assert raised.value is error
    assert comm.the_engine.refused == [("allgather", "g.0", error), ("allgather", None, error),
                                       ("allgather", "g.2", error)]


def test_a_block_that_returns_refuses_nothing() -> None:
    comm = _Comm()
    with refusing(comm, "allreduce", "x"):  # type: ignore[arg-type]
        pass
    assert comm.the_engine.refused == []


def test_an_interrupt_is_not_announced_as_a_refusal() -> None:
    """Only errors of the arguments' checks are refusals; Ctrl-C in the block is not."""
    comm = _Comm()
    with pytest.raises(KeyboardInterrupt), \
            refusing(comm, "allreduce", "x"):  # type: ignore[arg-type]
        raise KeyboardInterrupt
    assert comm.the_engine.refused == []


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value

    def test(self) -> bool:
        return True


class _Running:
    """A handle still in flight whose test() yields the GIL (counted)."""

    done = False

    def __init__(self) -> None:
        self.tests = 0

    def test(self) -> bool:
        self.tests += 1
        return False


def test_finished_asks_without_testing() -> None:
    """``Pending.finished`` reads each handle's ``done`` (``test()`` would let go of the
    GIL: torch.distributed's Work.get_future asks it once, on the training thread)."""
    running = _Running()
    pending = Pending([running], lambda: None)  # type: ignore[list-item]
    assert not pending.finished and running.tests == 0
    assert not pending.done() and running.tests == 1
    running.done = True
    assert pending.finished


def test_handles_count_up_and_synchronize_once_then_weakly() -> None:
    table = HandleTable(lambda: 3, kept=2)
    out = _Done(None)  # an output object (a tensor in the adapters)
    first = table.register(Pending([_Done(out)], lambda: out))  # type: ignore[list-item]
    second = table.register(Pending([], lambda: "two"))
    assert (first, second) == (1, 2)
    assert table.poll(first)
    assert table.synchronize(first) is out
    assert table.synchronize(first) is out  # again, while the output lives elsewhere
    out = None
    assert table.synchronize(first) is None  # gone: Horovod's None
    with pytest.raises(ArgumentError, match=r"rank 3: 7 is not a handle.*1\.\.2"):
        table.synchronize(7)
