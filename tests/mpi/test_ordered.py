"""Ordered communicators (``Communicator(ordered=True)``, the torch.distributed
backend's): unnamed async calls numbered across kinds, the submissions of one call
counted as one, and meeting points (``rendezvous``, ``barrier``) in the order of the
async calls; ranks that disagree fail at once, on every rank, and the communicator goes
on working without leftovers.

Every communicator here has a stall timeout beyond the tests' own time limits, so a
disagreement that is not caught hangs until pytest's timeout (a failure), and a stall
warning of half a second, so that a leftover submission waiting for a rank that will
never submit it is logged (checked: none is).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from helpers import assert_all_ranks

import mpitrain as mt

LEFTOVER = "submitted by some ranks only"
"""The stall warning's words for a submission that some ranks never made."""


@pytest.fixture
def ordered(env: pytest.MonkeyPatch, comm: mt.Communicator,
            caplog: pytest.LogCaptureFixture) -> Iterator[mt.Communicator]:
    """An ordered communicator over every rank; the test fails if it logged a stall."""
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", "600")
    env.setenv("MPITRAIN_STALL_WARNING_S", "0.5")
    caplog.set_level(logging.WARNING, logger="mpitrain")
    c = mt.Communicator(comm.mpi_comm, ordered=True)
    try:
        yield c
        time.sleep(1.2)  # past the warning and the stall check's period: then a cycle
        assert_sums(c, "after the test")
        assert_all_ranks(c, LEFTOVER not in caplog.text,
                         f"no submission left waiting: {caplog.text}")
    finally:
        c.free()


def assert_sums(c: mt.Communicator, when: str) -> None:
    """An unnamed allreduce works (the ranks' next calls are in step)."""
    got = c.allreduce_async(np.full(3, c.rank + 1.0)).wait()
    assert_all_ranks(c, bool(np.all(got == c.size * (c.size + 1) / 2)), f"sum {when}: {got}")


def fails_everywhere(c: mt.Communicator, run: Callable[[], Any], *words: str) -> None:
    """``run`` raises MismatchError on every rank, with ``words`` in its message."""
    try:
        run()
        problem = "no error"
    except mt.MismatchError as exc:
        text = str(exc)
        missing = [w for w in words if w not in text]
        problem = f"{missing} not in {text}" if missing else ""
    assert_all_ranks(c, not problem, problem)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_calls_of_different_kinds_fail_at_once(ordered: mt.Communicator) -> None:
    """The last rank's n-th unnamed call is an allreduce, the others' an allgather (then
    a broadcast): MismatchError on every rank naming both, where per-kind names
    (``allreduce.noname.0`` against ``allgather.noname.0``) would wait for each other."""
    c, last = ordered, ordered.rank == ordered.size - 1
    x = np.ones(4, np.float32)
    fails_everywhere(c, lambda: (c.allreduce_async(x) if last else c.allgather_async(x)).wait(),
                     "call 0 of this group", "called allreduce sum float32[4]",
                     "called allgather float32[*]")
    fails_everywhere(c, lambda: (c.broadcast_async(x) if last else c.allreduce_async(x)).wait(),
                     "call 1 of this group", "called broadcast root=0")
    assert_sums(c, "after them")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_call_that_submits_more_on_one_rank(ordered: mt.Communicator) -> None:
    """One call (``Communicator.call``) of two submissions on the last rank, one on the
    others: the next call's names are the same on every rank all the same. Where the
    first submissions disagree, the last rank's second is given up with them; where
    they agree, it is given up once the others have gone on to their next call."""
    c, last = ordered, ordered.rank == ordered.size - 1
    x = np.ones(4, np.float32)

    def uneven(first: Callable[[], mt.Handle]) -> None:
        with c.call():
            handles = [first()] + ([c.allreduce_async(x)] if last else [])
        for h in handles:
            h.wait()

    fails_everywhere(c, lambda: uneven(lambda: c.allgather_async(x) if last
                                       else c.allreduce_async(x)),
                     "call 0 of this group")
    assert_sums(c, "after a call that disagreed")
    # the first submissions agree: the others' call is done, and they go on to the next
    try:
        uneven(lambda: c.allreduce_async(x))
        problem = "no error" if last else ""
    except mt.MismatchError as exc:
        problem = "" if last and "made call 2 of this group without it" in str(exc) \
            else f"{exc}"
    c.allreduce_async(x).wait()  # call 3, which gives the last rank's leftover up
    assert_all_ranks(c, not problem, problem)
    assert_sums(c, "after a call with fewer submissions on some ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_meeting_points_take_their_place_among_the_async_calls(
        ordered: mt.Communicator) -> None:
    """``barrier`` and ``rendezvous`` (which adapters run before MPI's own collectives)
    meet in the engine's order: against an allreduce, or a rendezvous of another name,
    MismatchError on every rank at once, naming both; agreed, they wait for every rank
    and for the async calls submitted before them."""
    c, last = ordered, ordered.rank == ordered.size - 1
    x = np.ones(4, np.float32)
    fails_everywhere(c, lambda: c.barrier() if last else c.allreduce_async(x).wait(),
                     "called barrier", "called allreduce")
    fails_everywhere(c, lambda: c.rendezvous("gather" if last else "scatter"),
                     "called gather", "called scatter")
    handle = c.allreduce_async(np.full(3, 1.0))
    c.barrier()
    assert_all_ranks(c, handle.done, "an allreduce submitted before the barrier is done")
    assert_all_ranks(c, bool(np.all(handle.wait() == c.size)), "its sum")
    c.rendezvous("gather")
    assert_sums(c, "after them")
