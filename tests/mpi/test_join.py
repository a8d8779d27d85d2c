"""join() with uneven data: a rank in join() serves the other ranks' async operations
(the op's identity for reductions, no rows for allgathers) until every rank has joined,
and join() returns the last rank that joined, on every rank."""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import numpy as np
import pytest
from helpers import assert_all_ranks, mismatch
from mpi4py import MPI

import mpitrain as mt

DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
OPS = [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product]


def value(rank: int, step: int, dtype: Any, n: int = 7) -> np.ndarray[Any, Any]:
    """Small integers that differ by rank, step and index (exact in every dtype, and
    their products over 5 ranks too)."""
    return ((np.arange(n) + rank + step) % 4 + 1).astype(dtype)


def expected(ranks: list[int], size: int, step: int, dtype: Any, op: mt.ReduceOp,
             n: int = 7) -> np.ndarray[Any, Any]:
    """The reduction over the ranks that submitted ``step``; Average divides by the full
    ``size`` (joined ranks count as zeros), integers rounded toward minus infinity."""
    parts = np.stack([value(r, step, np.float64, n) for r in ranks])
    if op is mt.Min:
        acc = parts.min(0)
    elif op is mt.Max:
        acc = parts.max(0)
    elif op is mt.Product:
        acc = parts.prod(0)
    else:
        acc = parts.sum(0)
        if op is mt.Average:
            acc = np.floor(acc / size) if np.dtype(dtype).kind in "iu" else acc / size
    return acc.astype(dtype)


def close(actual: Any, want: Any) -> str:
    """Why ``actual`` differs from ``want`` (exact for integers, a relative 1 % for the
    floats: Average divides by the size in the array's own precision)."""
    if np.dtype(want.dtype).kind in "iu":
        return mismatch(actual, want)
    if actual.shape != want.shape or actual.dtype != want.dtype:
        return f"got {actual.dtype}{actual.shape}, want {want.dtype}{want.shape}"
    a, w = actual.astype(np.float64), want.astype(np.float64)
    return "" if np.allclose(a, w, rtol=1e-2) else f"got {a}, want {w}"


def steps(comm: mt.Communicator) -> list[int]:
    """Rank r does r + 1 steps."""
    return [r + 1 for r in range(comm.size)]


def run_uneven(comm: mt.Communicator, counts: list[int], dtype: Any, op: mt.ReduceOp,
               waited: bool) -> list[str]:
    """Rank r submits ``counts[r]`` allreduces (all then wait, or waiting each), joins,
    and checks every result; returns what was wrong."""
    me = comm.rank
    wrong = []
    handles = []
    for step in range(counts[me]):
        h = comm.allreduce_async(value(me, step, dtype), op=op, name=f"join.{dtype}.{step}")
        if waited:
            h.wait()
        handles.append(h)
    last = comm.join()
    for step, h in enumerate(handles):
        ranks = [r for r in range(comm.size) if counts[r] > step]
        why = close(h.wait(), expected(ranks, comm.size, step, dtype, op))
        if why:
            wrong.append(f"{dtype} {op} step {step}: {why}")
    # the rank with the most steps waits for its last step, which needs all others
    # joined, before it joins: it joins last
    top = max(counts)
    if waited and counts.count(top) == 1 and last != counts.index(top):
        wrong.append(f"join() returned {last}, want {counts.index(top)}")
    return wrong


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fusion", ["fused", "unfused"])
def test_uneven_allreduces(comm: mt.Communicator, configure: Callable[..., Any],
                           fusion: str) -> None:
    """Rank r does r + 1 allreduces, of every dtype and op, then joins."""
    if fusion == "unfused":
        configure(fusion_threshold=0)
    wrong = []
    for dtype in DTYPES:
        for op in OPS:
            wrong += run_uneven(comm, steps(comm), dtype, op, waited=op is mt.Min)
    assert_all_ranks(comm, not wrong, "; ".join(wrong))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_counts(comm: mt.Communicator, seed: int) -> None:
    """Random numbers of steps per rank (the same draw on every rank), one waited at a
    time or all at once; the rank with the most steps joins last."""
    rng = random.Random(seed)
    counts = [rng.randrange(0, 6) for _ in range(comm.size)]
    counts[rng.randrange(comm.size)] = 7  # one rank has the most
    wrong = run_uneven(comm, counts, "float32", mt.Average, waited=bool(seed % 2))
    wrong += run_uneven(comm, counts, "int64", mt.Sum, waited=not seed % 2)
    assert_all_ranks(comm, not wrong, "; ".join(wrong))


@pytest.mark.mpi(min_size=1)
def test_allgather_grouped_and_reduce_scatter(comm: mt.Communicator) -> None:
    """A joined rank contributes no rows to an allgather, zeros to a grouped allreduce
    and to a reduce-scatter (whose block it discards)."""
    me, n = comm.rank, comm.size
    gathered, grouped, scattered = [], [], []
    for step in range(me + 1):
        rows = np.full((me + 1, 3), 10 * me + step, np.float32)
        gathered.append(comm.allgather_async(rows, name=f"gather.{step}"))
        grouped.append(comm.grouped_allreduce_async(
            [value(me, step, np.float64), value(me, step, np.int32, 3)], name=f"group.{step}"))
        scattered.append(comm.reduce_scatter_async(
            np.full((2 * n, 2), me + 1, np.float64), name=f"scatter.{step}"))
    comm.join()
    wrong = []
    for step in range(me + 1):
        ranks = list(range(step, n))
        want = np.concatenate([np.full((r + 1, 3), 10 * r + step, np.float32) for r in ranks])
        wrong.append(mismatch(gathered[step].wait(), want))
        a, b = grouped[step].wait()
        wrong.append(mismatch(a, expected(ranks, n, step, np.float64, mt.Sum)))
        wrong.append(mismatch(b, expected(ranks, n, step, np.int32, mt.Sum, 3)))
        total = float(sum(r + 1 for r in ranks))
        wrong.append(mismatch(scattered[step].wait(), np.full((2, 2), total, np.float64)))
    wrong = [w for w in wrong if w]
    assert_all_ranks(comm, not wrong, "; ".join(wrong))


@pytest.mark.mpi(min_size=2)
def test_broadcast_to_and_from_joined_ranks(comm: mt.Communicator) -> None:
    """A broadcast from a rank that has not joined reaches joined ranks; one from a
    joined root fails with an error naming join on the ranks that submitted it."""
    me, last = comm.rank, comm.size - 1
    root_data = np.arange(5, dtype=np.int64) + 100
    if me == 0:
        ok_last = comm.join()
        outcome = "joined"
    else:
        x = root_data.copy() if me == last else np.zeros(5, np.int64)
        got = comm.broadcast_async(x, root=last, name="bcast.ok").wait()
        bad = comm.broadcast_async(np.zeros(2, np.float32), root=0, name="bcast.bad")
        try:
            bad.wait()
            outcome = "no error"
        except mt.CommunicationError as exc:
            outcome = "error" if "join()" in str(exc) and "root 0" in str(exc) else str(exc)
        outcome = outcome if not mismatch(got, root_data) else mismatch(got, root_data)
        ok_last = comm.join()
    assert_all_ranks(comm, outcome in ("joined", "error"), outcome)
    # ranks 1.. join after rank 0 (their broadcast needs it joined), in any order
    assert_all_ranks(comm, ok_last in range(1, comm.size), f"last {ok_last}")


@pytest.mark.mpi(min_size=1)
def test_join_twice_and_with_nothing_pending(comm: mt.Communicator) -> None:
    """join() with nothing in flight, twice in a row, returns a rank, the same on every
    rank; the engine works as before afterwards."""
    results = [comm.join(), comm.join()]
    agreed = comm.allgather_object(results)
    assert_all_ranks(comm, all(a == results for a in agreed), f"{agreed}")
    assert_all_ranks(comm, all(r in range(comm.size) for r in results), f"{results}")
    out = comm.allreduce_async(np.ones(4, np.float32), name="after.join").wait()
    assert_all_ranks(comm, not mismatch(out, np.full(4, comm.size, np.float32)), "after join")


@pytest.mark.mpi(min_size=2)
def test_blocking_call_while_others_joined(comm: mt.Communicator) -> None:
    """A blocking collective on a rank that has seen another rank join raises an error
    naming join (a rank in join() serves async operations only), instead of hanging."""
    if comm.rank == 0:
        comm.join()
        outcome = "error"
    else:
        comm.allreduce_async(np.ones(3), name="before.blocking").wait()  # sees rank 0 joined
        try:
            comm.allreduce(np.ones(3))
            outcome = "no error"
        except mt.CommunicationError as exc:
            outcome = "error" if "join()" in str(exc) and "[0]" in str(exc) else str(exc)
        comm.join()
    assert_all_ranks(comm, outcome == "error", outcome)


@pytest.mark.mpi(min_size=2)
def test_joined_rank_is_no_stall(env: pytest.MonkeyPatch) -> None:
    """With a stall timeout, a joined rank waiting longer than it for a rank that is
    still computing is not a stall."""
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", "1")
    own = mt.Communicator(MPI.COMM_WORLD)
    try:
        own.engine()  # started (collectively) before the last rank computes
        h = None
        if own.rank == own.size - 1:
            time.sleep(2.0)  # "computing" a second past the timeout
            h = own.allreduce_async(np.ones(2, np.float32), name="slow")
        last = own.join()
        ok = last == own.size - 1 and (h is None or not mismatch(h.wait(),
                                                                  np.ones(2, np.float32)))
        assert_all_ranks(own, ok, f"last {last}")
    finally:
        own.free()


@pytest.mark.mpi(min_size=2)
def test_rank_that_stops_without_joining() -> None:
    """A rank that stops its engine without joining fails the other ranks' join()."""
    own = mt.Communicator(MPI.COMM_WORLD)
    own.engine()
    outcome = "stopped"
    if own.rank == 0:
        own.free()
    else:
        try:
            own.join()
            outcome = "no error"
        except mt.CommunicationError as exc:
            outcome = "error" if "without calling join()" in str(exc) else str(exc)
        own.free()
    assert_all_ranks(mt.init(), outcome in ("stopped", "error"), outcome)


@pytest.mark.mpi(min_size=2)
def test_submitting_during_join_is_refused(comm: mt.Communicator) -> None:
    """Another thread of a rank in join() cannot submit: an error naming join. The other
    ranks join only once that thread has tried (it tells them, on a communicator of the
    test's own), so rank 0 is in join() all the while."""
    import threading

    errors: list[str] = []
    engine = comm.engine()
    side = MPI.COMM_WORLD.Dup()

    def submit() -> None:
        while engine._join is None and not done.is_set():
            time.sleep(0.001)
        try:
            comm.allreduce_async(np.ones(2), name="late")
        except mt.ArgumentError as exc:
            errors.append(str(exc))
        for r in range(1, side.Get_size()):
            side.send("tried", dest=r, tag=7)

    done = threading.Event()
    t = threading.Thread(target=submit)
    told = ""
    if comm.rank == 0:
        t.start()
    else:  # ready once rank 0 is in join(): its thread tries, then says so
        comm.allreduce_async(np.ones(1), name="rank 0 joined").wait()
        request = side.irecv(source=0, tag=7)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            finished, told = request.test()
            if finished:
                break
            time.sleep(0.001)
        else:
            request.Cancel()
    comm.join()
    done.set()
    if comm.rank == 0:
        t.join(30)
    side.Free()
    ok = (len(errors) == 1 and "join()" in errors[0]) if comm.rank == 0 else told == "tried"
    assert_all_ranks(comm, ok, f"{errors}" if comm.rank == 0 else f"told {told!r}")


@pytest.mark.mpi(min_size=2)
def test_join_serves_limits_what_joined_ranks_take_part_in(comm: mt.Communicator) -> None:
    """With ``join_serves`` narrowed to allreduces, an allgather submitted while rank 0 is
    in join() fails on the submitting ranks with an error naming join and rank 0, while
    an allreduce runs; the default (every kind) comes back afterwards."""
    default = comm.join_serves
    with pytest.raises(ValueError, match="unknown kinds \\['gather'\\]"):
        comm.join_serves = {"allreduce", "gather"}
    assert comm.join_serves == default  # unchanged
    comm.join_serves = {"allreduce"}
    try:
        if comm.rank == 0:
            comm.join()
            outcome = "joined"
        else:
            rows = comm.allgather_async(np.ones((1, 2)), name="serves.gather")
            summed = comm.allreduce_async(np.ones(3), name="serves.sum").wait()
            try:
                rows.wait()
                outcome = "no error"
            except mt.CommunicationError as exc:
                outcome = "error" if "join()" in str(exc) and "[0]" in str(exc) else str(exc)
            if mismatch(summed, np.full(3, comm.size - 1.0)):
                outcome = mismatch(summed, np.full(3, comm.size - 1.0))
            comm.join()
    finally:
        comm.join_serves = default
    assert_all_ranks(comm, outcome in ("joined", "error"), outcome)
    assert default == {"allreduce", "reduce_scatter", "allgather", "broadcast"}


@pytest.mark.mpi(min_size=2)
def test_unnamed_operations_stay_matched_after_joins(comm: mt.Communicator) -> None:
    """Rank 0, then each rank in turn, joins first while the others submit unnamed
    operations: an allgather (refused: join_serves is allreduce only, as under
    mpitrain.torch) and an allreduce (the joined rank stands in). The joined rank's
    counters move past those names with the submitters', so every later unnamed
    operation still matches across ranks (a stale counter left the submitters of a
    later round, or of the last allgather, with different names, waiting for each
    other until the test's timeout)."""
    default = comm.join_serves
    comm.join_serves = {"allreduce"}
    outcomes = []
    try:
        for first in [0, *range(comm.size)]:
            if comm.rank == first:
                last = comm.join()
            else:
                try:
                    comm.allgather_async(np.ones((1, 2))).wait()
                    outcomes.append(f"round {first}: the allgather ran")
                except mt.CommunicationError:
                    pass
                summed = comm.allreduce_async(np.ones(3), op=mt.Sum).wait()
                wrong = mismatch(summed, np.full(3, comm.size - 1.0))
                if wrong:
                    outcomes.append(f"round {first}: the allreduce {wrong}")
                last = comm.join()
            if last == first:
                outcomes.append(f"round {first}: join() returned the first rank to join")
        rows = comm.allgather_async(np.full((1, 2), float(comm.rank))).wait()
        if mismatch(rows, np.repeat(np.arange(comm.size, dtype=np.float64), 2).reshape(-1, 2)):
            outcomes.append("the allgather after the joins")
    finally:
        comm.join_serves = default
    assert_all_ranks(comm, not outcomes, "; ".join(outcomes))
