"""Async operations: same results as blocking calls, fusion, ordering, errors, overlap."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
from helpers import assert_all_ranks, assert_equal_all_ranks, crafted, reference
from mpi4py import MPI

import mpitrain as mt

DTYPES = ["float32", "int64", "float16", "bfloat16", "complex64"]
OPS = [mt.Sum, mt.Average, mt.Max, mt.Product]


def cases() -> list[tuple[str, mt.ReduceOp]]:
    return [(d, o) for d in DTYPES for o in OPS if not (d.startswith("complex") and o is mt.Max)]


@pytest.mark.mpi(min_size=1)
def test_every_kind_matches_the_reference(comm: mt.Communicator) -> None:
    """All submitted first and waited together, so fusable ones share buckets."""
    checks: list[tuple[str, Any, Any]] = []  # (what, handle, expected)
    for dtype, op in cases():
        for count in (0, 1, 1001):
            x = crafted(comm.rank, count, dtype, op)
            want = reference(comm.size, count, dtype, op)
            checks.append((f"allreduce_async {dtype} {op} n={count}",
                           comm.allreduce_async(x, op=op), want))
            y = x.copy()
            checks.append((f"allreduce_async_ {dtype} {op} n={count}",
                           comm.allreduce_async_(y, op=op), want))
            checks.append((f"reduce_scatter_async {dtype} {op} n={count}",
                           comm.reduce_scatter_async(x.reshape(count, 1), op=op),
                           np.array_split(want.reshape(count, 1), comm.size)[comm.rank]))
        block = crafted(comm.rank, 3 * (comm.rank + 1), dtype, mt.Sum).reshape(-1, 3)
        every = np.concatenate([crafted(r, 3 * (r + 1), dtype, mt.Sum).reshape(-1, 3)
                                for r in range(comm.size)])
        checks.append((f"allgather_async {dtype}", comm.allgather_async(block), every))
        root = comm.size - 1
        z = crafted(comm.rank, 7, dtype, mt.Sum)
        checks.append((f"broadcast_async {dtype}", comm.broadcast_async(z, root=root),
                       crafted(root, 7, dtype, mt.Sum)))
        checks.append((f"broadcast_async_ {dtype}", comm.broadcast_async_(z.copy(), root=root),
                       crafted(root, 7, dtype, mt.Sum)))
    for what, handle, want in checks:
        assert_equal_all_ranks(comm, handle.wait(), want, what)
        assert handle.done and handle.test()
        assert handle.submitted_at <= handle.started_at <= handle.finished_at  # type: ignore[operator]


@pytest.mark.mpi(min_size=1)
def test_scaling_and_explicit_algorithms(comm: mt.Communicator) -> None:
    """Average with a prescale and a postscale, through the ring and MPI's own."""
    x = crafted(comm.rank, 5000, "float64", mt.Sum)
    total = reference(comm.size, 5000, "float64", mt.Sum)
    for algorithm in ("ring", "mpi"):
        hs = [comm.allreduce_async(x[: 100 * (i + 1)], op=mt.Average, prescale_factor=0.5,
                                   postscale_factor=3.0, algorithm=algorithm) for i in range(5)]
        for i, h in enumerate(hs):
            want = total[: 100 * (i + 1)] * 0.5 * 3.0 / comm.size
            assert_all_ranks(comm, bool(np.allclose(h.wait(), want, rtol=1e-12, atol=0)),
                             f"scaled {algorithm} #{i}")


@pytest.mark.mpi(min_size=1)
def test_in_place_semantics(comm: mt.Communicator) -> None:
    base = crafted(comm.rank, 24, "float32", mt.Sum).reshape(4, 6)
    want = reference(comm.size, 24, "float32", mt.Sum).reshape(4, 6)
    view = base.T  # non-contiguous: written back through the fusion buffer
    small = np.ones(3, np.int32)
    before = base.copy()
    out = comm.allreduce_async(base)
    h1, h2 = comm.allreduce_async_(view), comm.allreduce_async_(small, op=mt.Max)
    assert_equal_all_ranks(comm, out.wait(), want, "out of place")
    assert h1.wait() is view and h2.wait() is small
    assert_equal_all_ranks(comm, base, want, "in place on a transposed view")
    assert_equal_all_ranks(comm, small, np.ones(3, np.int32), "in place max")
    assert_equal_all_ranks(comm, out.wait(), want, "wait() is idempotent")
    assert not np.shares_memory(out.wait(), before)
    xs = [crafted(comm.rank, n, "float64", mt.Sum) for n in (1, 10, 100)]
    assert all(a is b for a, b in zip(comm.grouped_allreduce_(xs), xs))
    for n, x in zip((1, 10, 100), xs):
        assert_equal_all_ranks(comm, x, reference(comm.size, n, "float64", mt.Sum), "group_")


@pytest.mark.mpi(min_size=1)
def test_named_tensors_in_a_different_order_per_rank(comm: mt.Communicator) -> None:
    """Three steps over the same names (the later ones announced by number); each step
    odd ranks submit in reverse and even ranks in a shuffle seeded by rank and step.
    The long names take the negotiation past its inline slot."""
    specs = [(f"model/layer{i}/" + "weight-gradient" * 6, 1 + 37 * i,
              ["float32", "float64", "int32"][i % 3]) for i in range(40)]
    for step in range(3):
        order = list(range(len(specs)))
        if comm.rank % 2:
            order.reverse()
        else:
            np.random.default_rng(comm.rank + 10 * step).shuffle(order)
        handles = {}
        for i in order:
            name, n, dtype = specs[i]
            x = crafted(comm.rank + i + step, n, dtype, mt.Sum)
            handles[name] = comm.allreduce_async(x, name=name)
        for i, (name, n, dtype) in enumerate(specs):
            want = sum(crafted(r + i + step, n, dtype, mt.Sum) for r in range(comm.size))
            assert_equal_all_ranks(comm, handles[name].wait(), np.asarray(want, dtype),
                                   f"step {step} {name}")


@pytest.mark.mpi(min_size=1)
def test_announcements_past_the_shared_memory_slot(comm: mt.Communicator) -> None:
    """Hundreds of long names announced in one cycle (over 64 KiB of announcements, more
    than a shared-memory slot holds) take the second exchange; ranks submit them in
    different orders."""
    names = [f"announce/{i:04d}/" + "x" * 300 for i in range(300)]
    order = list(range(len(names)))
    if comm.rank % 2:
        order.reverse()
    handles = {i: comm.allreduce_async(np.full(3, i + comm.rank, np.int64), name=names[i])
               for i in order}
    want_base = sum(range(comm.size))
    for i in range(len(names)):
        assert_equal_all_ranks(comm, handles[i].wait(),
                               np.full(3, i * comm.size + want_base, np.int64), names[i][:14])


@pytest.mark.mpi(min_size=2)
def test_negotiation_without_shared_memory(comm: mt.Communicator) -> None:
    """Without shared memory the cycles go through MPI_Iallgather (and MPI_Allgatherv
    for long announcements): names in different orders, fusion, and a mismatch."""
    c = mt.Communicator(comm.mpi_comm, shared_memory=False)
    try:
        assert not c.shared_memory
        names = [f"plain/{i:03d}/" + "y" * 120 for i in range(60)]  # past the 4 KiB slot
        order = list(range(len(names)))[::-1 if c.rank % 2 else 1]
        handles = {i: c.allreduce_async(np.full(5, i, np.float64), name=names[i])
                   for i in order}
        for i in range(len(names)):
            assert_equal_all_ranks(c, handles[i].wait(), np.full(5, i * c.size, np.float64),
                                   names[i][:10])
        assert c.engine().dispatcher.shm is None
        bad = c.allreduce_async(np.ones(3, np.float32 if c.rank else np.float64), name="bad")
        with pytest.raises(mt.MismatchError, match="different arguments"):
            bad.wait()
    finally:
        c.free()


@pytest.mark.mpi(min_size=1)
def test_one_bucket_of_mixed_shapes_and_layouts(comm: mt.Communicator) -> None:
    """One fused bucket holding 2-d, 1-d, 0-d, strided and in-place arrays: each result
    lands in its own shape (out of place) or in the caller's array (in place)."""
    base = crafted(comm.rank, 60, "float64", mt.Sum)
    inputs = [base[:12].reshape(3, 4), base[12:17], base[17:18].reshape(()),
              base[18:40:2], base[40:52].reshape(4, 3).T]
    inplace = [base[52:56].copy(), base[56:60].reshape(2, 2).copy().T]
    full = reference(comm.size, 60, "float64", mt.Sum)
    wants = [full[:12].reshape(3, 4), full[12:17], full[17:18].reshape(()), full[18:40:2],
             full[40:52].reshape(4, 3).T]
    before = comm.async_stats()
    outs = [comm.allreduce_async(x) for x in inputs]
    ins = [comm.allreduce_async_(x) for x in inplace]
    for i, (h, want) in enumerate(zip(outs, wants)):
        got = h.wait()
        assert got.shape == want.shape, f"#{i}: {got.shape} != {want.shape}"
        assert_equal_all_ranks(comm, got, want, f"out of place #{i}")
    assert ins[0].wait() is inplace[0] and ins[1].wait() is inplace[1]
    assert_equal_all_ranks(comm, inplace[0], full[52:56], "in place 1-d")
    assert_equal_all_ranks(comm, inplace[1], full[56:60].reshape(2, 2).T, "in place strided")
    assert_all_ranks(comm, comm.async_stats().fused - before.fused >= 2, "they were fused")


def in_place_arrays(values: np.ndarray[Any, Any], bounds: list[tuple[int, int]]
                    ) -> tuple[list[Any], list[Any]]:
    """Arrays for in-place calls holding ``values[a:b]`` for each of ``bounds``: copies,
    and every other one a strided view into a holder whose gaps (3) must stay untouched.
    Returns the holders and the arrays."""
    holders = [np.full(2 * (b - a), 3, values.dtype) for a, b in bounds]
    arrays = []
    for i, ((a, b), holder) in enumerate(zip(bounds, holders)):
        holder[::2] = values[a:b]
        arrays.append(holder[::2] if i % 2 else values[a:b].copy())
    return holders, arrays


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("segment", ["", "48"])
@pytest.mark.parametrize("dtype,op", [("float32", mt.Sum), ("int64", mt.Average),
                                      ("float64", mt.Average), ("int16", mt.Max),
                                      ("float16", mt.Product)])
def test_fused_buckets_without_packing(comm: mt.Communicator, configure: Callable[..., Any],
                                       segment: str, dtype: str, op: mt.ReduceOp) -> None:
    """Buckets that the shared-memory allreduce takes as they are (no fusion buffer):
    uneven sizes whose chunk and stripe boundaries fall inside arrays, empty, strided and
    2-d arrays, in the slot (small total) and in stripes (large total or, with 48-byte
    segments, many rounds), in place and out of place, with Average's scaling."""
    if segment:
        configure(segment_bytes=segment)
    for total in (97, 40_009):
        sizes = [0, 1, 5, total // 3, 0, 7, total - total // 3 - 13]
        bounds = list(zip(np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes)))
        values = crafted(comm.rank, total, dtype, op)
        full = reference(comm.size, total, dtype, op)
        holders, arrays = in_place_arrays(values, bounds)
        before = comm.async_stats()
        handles = [comm.allreduce_async_(x, op=op) for x in arrays]
        for i, (h, x, (a, b)) in enumerate(zip(handles, arrays, bounds)):
            assert h.wait() is x
            assert_equal_all_ranks(comm, x, full[a:b], f"in place #{i} of {total}")
            assert_all_ranks(comm, bool((holders[i][1::2] == 3).all()), f"gaps of #{i}")
        assert_all_ranks(comm, comm.async_stats().fused - before.fused >= 2, "some fused")
        # out of place: 2-d arrays where the size divides
        inputs = [values[a:b].reshape(-1, 2) if (b - a) % 2 == 0 and b > a else values[a:b]
                  for a, b in bounds]
        handles = [comm.allreduce_async(x, op=op) for x in inputs]
        for i, (h, x, (a, b)) in enumerate(zip(handles, inputs, bounds)):
            assert_equal_all_ranks(comm, h.wait(), full[a:b].reshape(x.shape),
                                   f"out of place #{i} of {total}")
    # in place, a 2-d array with no flat view that writes through: the bucket is packed
    values, full = crafted(comm.rank, 24, dtype, op), reference(comm.size, 24, dtype, op)
    arrays = [values[:12].reshape(3, 4).copy(), values[12:].reshape(3, 4).copy().T]
    for h in [comm.allreduce_async_(x, op=op) for x in arrays]:
        h.wait()
    assert_equal_all_ranks(comm, arrays[0], full[:12].reshape(3, 4), "2-d in place")
    assert_equal_all_ranks(comm, arrays[1], full[12:].reshape(3, 4).T, "transposed in place")


def prescaled_reference(size: int, count: int, dtype: str, op: mt.ReduceOp,
                        factor: float) -> np.ndarray[Any, Any]:
    """What an allreduce of :func:`crafted` with ``prescale_factor=factor`` returns: each
    rank's input scaled as the host backend scales (integers rounded down), then
    reduced (Average's ``1/size`` applied to the sum as :func:`reference` does)."""
    from mpitrain.backends import NUMPY

    inputs = []
    for r in range(size):
        x = crafted(r, count, dtype, op)
        NUMPY.scale(x, factor)
        inputs.append(x)
    acc = inputs[0]
    for x in inputs[1:]:
        acc = np.maximum(acc, x) if op is mt.Max else acc + x
    if op is mt.Average:
        NUMPY.scale(acc, 1.0 / size)
    return acc


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("segment", ["", "48"])
@pytest.mark.parametrize("dtype,op", [("float32", mt.Sum), ("int64", mt.Sum),
                                      ("float16", mt.Average), ("float64", mt.Max)])
def test_prescaled_buckets_are_scaled_where_they_are(
        comm: mt.Communicator, configure: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch, segment: str, dtype: str, op: mt.ReduceOp) -> None:
    """A fusion bucket of in-place allreduces with a prescale factor goes to an algorithm
    that takes the arrays as they are (shared memory) without a fusion buffer: each
    array is scaled where it is, then reduced there; strided arrays keep their gaps, and
    the results equal each rank's input scaled, then reduced. Out of place, the bucket
    is read once into the result buffer. Nothing is packed (``concatenate``) where the
    engine's algorithm takes pieces."""
    from mpitrain.backends import NUMPY

    if segment:
        configure(segment_bytes=segment)
    factor = 0.5
    packed: list[int] = []
    concatenate = NUMPY.concatenate
    monkeypatch.setattr(NUMPY, "concatenate",
                        lambda arrays: packed.append(len(arrays)) or concatenate(arrays))
    total = 30_011
    sizes = [0, 3, total // 3, 0, total - total // 3 - 3]
    bounds = list(zip(np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes)))
    values = crafted(comm.rank, total, dtype, op)
    want = prescaled_reference(comm.size, total, dtype, op, factor)
    holders, arrays = in_place_arrays(values, bounds)
    engine = comm.engine()
    pieces = engine.dispatcher.takes_pieces(None, values.nbytes, NUMPY, values.dtype)
    comm.grouped_allreduce_async_(arrays, op=op, prescale_factor=factor).wait()
    for i, (x, (a, b)) in enumerate(zip(arrays, bounds)):
        assert_equal_all_ranks(comm, x, want[a:b], f"in place #{i}")
        assert_all_ranks(comm, bool((holders[i][1::2] == 3).all()), f"gaps of #{i}")
    outs = comm.grouped_allreduce_async([values[a:b] for a, b in bounds], op=op,
                                        prescale_factor=factor).wait()
    for i, (got, (a, b)) in enumerate(zip(outs, bounds)):
        assert_equal_all_ranks(comm, got, want[a:b], f"out of place #{i}")
    assert_all_ranks(comm, not pieces or not packed,
                     f"packed {packed} although the algorithm takes pieces")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("segment", ["", "48"])
@pytest.mark.parametrize("prescale", [1.0, 0.5])
def test_in_place_arrays_that_share_memory(comm: mt.Communicator,
                                           configure: Callable[..., Any], segment: str,
                                           prescale: float) -> None:
    """The same array twice and two overlapping views, in place in one bucket (a
    group: separate submissions may run in separate cycles, one after the other):
    every element ends as the reduction of its original values, as with a fusion
    buffer, also when the bucket takes many stripe rounds (48-byte segments) and a
    later round would read what an earlier one wrote, and with a prescale factor
    (applied once to every element, not once per array that holds it)."""
    if segment:
        configure(segment_bytes=segment)
    values = crafted(comm.rank, 100, "float64", mt.Sum)
    full = reference(comm.size, 100, "float64", mt.Sum) * prescale
    x, y = values[:50].copy(), values[50:].copy()
    comm.grouped_allreduce_([x, y[:30], x, y[20:]], prescale_factor=prescale)
    assert_equal_all_ranks(comm, x, full[:50], "the same array twice")
    assert_equal_all_ranks(comm, y, full[50:], "overlapping views")


@pytest.mark.mpi(min_size=1)
def test_waits_from_several_threads(comm: mt.Communicator) -> None:
    """Callers blocked in wait() run the engine's cycles themselves; several threads
    waiting at once (and the progress thread) take turns without mixing results."""
    import threading

    xs = [crafted(comm.rank + i, 50 + i, "float32", mt.Sum) for i in range(60)]
    handles = [comm.allreduce_async(x) for x in xs]
    results: dict[int, Any] = {}

    def waiter(part: int) -> None:
        for i in range(part, len(handles), 3):
            results[i] = handles[len(handles) - 1 - i].wait()

    threads = [threading.Thread(target=waiter, args=(p,)) for p in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_all_ranks(comm, not any(t.is_alive() for t in threads), "a waiting thread hung")
    for i in range(len(handles)):
        j = len(handles) - 1 - i
        want = sum(crafted(r + j, 50 + j, "float32", mt.Sum) for r in range(comm.size))
        assert_equal_all_ranks(comm, results[i], want, f"thread result #{j}")


@pytest.mark.mpi(min_size=2)
def test_engine_barriers_know_whether_a_caller_waits(comm: mt.Communicator) -> None:
    """The engine tells its shared-memory barriers whether this process's threads have
    work of their own (then a long barrier wait sleeps, leaving them the core): yes
    while nobody waits on the engine, no while a caller is blocked in ``wait()``."""
    engine = comm.engine()
    shm = engine.dispatcher.shm
    if shm is None:
        pytest.skip("no shared memory")
    busy = shm.others_busy
    assert_all_ranks(comm, busy is not None and busy(), "nobody waits, yet not busy")
    assert busy is not None
    x = np.full(1000, comm.rank + 1.0, np.float32)
    seen: list[bool] = []
    if comm.rank == 0:  # waits on another thread while the others have not submitted
        handle = comm.allreduce_async(x)
        results: list[Any] = []
        waiter = threading.Thread(target=lambda: results.append(handle.wait()))
        waiter.start()
        deadline = time.monotonic() + 30
        while busy() and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(busy())
        MPI.COMM_WORLD.Barrier()
        waiter.join(60)
        result = results[0] if results else None
    else:
        MPI.COMM_WORLD.Barrier()
        result = comm.allreduce_async(x).wait()
    want = np.full(1000, comm.size * (comm.size + 1) / 2, np.float32)
    assert_equal_all_ranks(comm, result, want, "the allreduce")
    assert_all_ranks(comm, seen == ([False] if comm.rank == 0 else []),
                     f"busy while a caller waited: {seen}")
    assert_all_ranks(comm, busy(), "still not busy after the wait")


@pytest.mark.mpi(min_size=1)
def test_engine_progresses_after_callers_ran_cycles(comm: mt.Communicator) -> None:
    """After waits that ran cycles on the caller's thread, an operation nobody waits for
    still finishes: the progress thread must not miss its wake-up."""
    for step in range(20):
        comm.allreduce_async(np.full(2, step, np.int32)).wait()
        h = comm.allreduce_async(np.full(2, step, np.int32))
        deadline = time.perf_counter() + 20
        while not h.test() and time.perf_counter() < deadline:
            time.sleep(0.001)
        assert_all_ranks(comm, h.test(), f"step {step}: the un-waited operation never ran")
        assert_equal_all_ranks(comm, h.wait(), np.full(2, step * comm.size, np.int32),
                               f"step {step}")


@pytest.mark.mpi(min_size=1)
def test_a_loop_polling_test_lets_the_engine_run(comm: mt.Communicator) -> None:
    """``while not h.test(): pass`` finishes: test() lets go of the GIL, which the
    progress thread needs. With a switch interval of 60 s, a poll that kept the GIL
    would leave the progress thread nothing for a minute, past the 20 s deadline."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        for step in range(5):
            h = comm.allreduce_async(np.full(3, step, np.int64))
            deadline = time.perf_counter() + 20
            while not h.test() and time.perf_counter() < deadline:
                pass
            if not h.done:
                break
    finally:
        sys.setswitchinterval(interval)
    assert_all_ranks(comm, h.done, f"the operation of step {step} was still pending after "
                     "20 s of polling test()")
    assert_equal_all_ranks(comm, h.wait(), np.full(3, 4 * comm.size, np.int64), "the last")


@pytest.mark.mpi(min_size=2)
def test_pending_work_after_a_waiting_caller_goes_on(comm: mt.Communicator) -> None:
    """Rank 0 submits A and B and waits for A, which runs its cycles on its own thread;
    the other ranks submit B only after A is done, so B is still pending when rank 0's
    wait returns. Nobody waits for B after that (only test()): the progress thread must
    take it over, or every rank hangs."""
    for step in range(10):
        a, b = f"pending/{step}/a", f"pending/{step}/b"
        if comm.rank == 0:
            ha = comm.allreduce_async(np.full(2, 1, np.int64), name=a)
            hb = comm.allreduce_async(np.full(2, 2, np.int64), name=b)
            ha.wait()
        else:
            comm.allreduce_async(np.full(2, 1, np.int64), name=a).wait()
            hb = comm.allreduce_async(np.full(2, 2, np.int64), name=b)
        deadline = time.perf_counter() + 20
        while not hb.test() and time.perf_counter() < deadline:
            time.sleep(0.0005)
        assert_all_ranks(comm, hb.test(), f"step {step}: B never ran after A's wait")
        assert_equal_all_ranks(comm, hb.wait(), np.full(2, 2 * comm.size, np.int64), "B")


ROWS: dict[str, Callable[[int, int], int]] = {
    "same rows": lambda q, n: 2,
    "rank + 1 rows": lambda q, n: q + 1,
    "none on the last rank": lambda q, n: 0 if q == n - 1 else 2,
    "the last rank's over a slot": lambda q, n: 40000 if q == n - 1 else 1,
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rows", ROWS)
def test_an_operation_alone_takes_the_fast_path(comm: mt.Communicator,
                                                monkeypatch: pytest.MonkeyPatch,
                                                rows: str) -> None:
    """A small host operation that the engine runs alone goes to the blocking calls'
    fast-path plan (on one node: one barrier, nothing validated twice), not through the
    general path, and gives the same results; an allgather whose ranks send other rows
    than a rank's plan is finished from the same exchange, and a rank on the general
    path (its block does not fit a slot, or ``out=`` is not the plan's) meets the
    others' plans."""
    n, r = comm.size, comm.rank
    d = comm.engine().dispatcher
    general: list[str] = []
    execute = d.execute

    def counted(call: Any, *args: Any, **kwargs: Any) -> Any:
        general.append(call.collective)
        return execute(call, *args, **kwargs)
    monkeypatch.setattr(d, "execute", counted)
    x = crafted(r, 48, "float32", mt.Sum)
    want = reference(n, 48, "float32", mt.Sum)
    assert_equal_all_ranks(comm, comm.allreduce_async(x).wait(), want, "allreduce_async")
    y = crafted(r, 48, "float32", mt.Average)
    assert comm.allreduce_async_(y, op=mt.Average).wait() is y
    assert_equal_all_ranks(comm, y, reference(n, 48, "float32", mt.Average),
                           "allreduce_async_ Average")
    assert_equal_all_ranks(comm, comm.reduce_scatter_async(x.reshape(12, 4)).wait(),
                           np.array_split(want.reshape(12, 4), n)[r], "reduce_scatter_async")
    count = ROWS[rows]
    block = crafted(r, 3 * count(r, n), "int64", mt.Sum).reshape(-1, 3)
    every = np.concatenate([crafted(q, 3 * count(q, n), "int64", mt.Sum).reshape(-1, 3)
                            for q in range(n)])
    assert_equal_all_ranks(comm, comm.allgather_async(block).wait(), every, "allgather_async")
    out = np.zeros_like(every)
    assert comm.allgather_async(block, out=out).wait() is out
    assert_equal_all_ranks(comm, out, every, "allgather_async out=")
    if d.shm is not None or n == 1:  # shared memory on one node, or one rank: plans
        assert set(general) <= {"allgather"}, general
        if rows == "same rows":
            assert general == [], general


@pytest.mark.mpi(min_size=2)
def test_what_the_engine_runs_carries_no_signature(comm: mt.Communicator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Negotiation has compared every rank's submission: the engine's dispatcher
    validates nothing again, on any path (checking on), while blocking calls do."""
    d = comm.engine().dispatcher
    assert comm.dispatcher.checking and not d.checking
    sigs: list[Any] = []
    run_plan, exchange = d.run_plan, d.validator.exchange

    def planned(*args: Any) -> Any:
        sigs.append(args[7])  # run_plan(collective, name, be, dt, op, shape, root, sig, ...)
        return run_plan(*args)

    def exchanged(sig: Any, **kwargs: Any) -> Any:
        sigs.append(sig)
        return exchange(sig, **kwargs)
    monkeypatch.setattr(d, "run_plan", planned)
    monkeypatch.setattr(d.validator, "exchange", exchanged)
    n, r = comm.size, comm.rank
    x = crafted(r, 100_000, "float32", mt.Sum)
    want = reference(n, 100_000, "float32", mt.Sum)
    for algorithm in ("ring", "mpi", "auto"):
        assert_equal_all_ranks(comm, comm.allreduce_async(x, algorithm=algorithm).wait(),
                               want, f"allreduce_async {algorithm}")
        assert_equal_all_ranks(comm, comm.reduce_scatter_async(x, algorithm=algorithm).wait(),
                               np.array_split(want, n)[r], f"reduce_scatter_async {algorithm}")
        block = np.full((r + 1, 1000), r, np.int64)
        every = np.concatenate([np.full((q + 1, 1000), q, np.int64) for q in range(n)])
        assert_equal_all_ranks(comm, comm.allgather_async(block, algorithm=algorithm).wait(),
                               every, f"allgather_async {algorithm}")
        assert_equal_all_ranks(comm, comm.broadcast_async(x, root=n - 1).wait(),
                               crafted(n - 1, 100_000, "float32", mt.Sum), "broadcast_async")
    assert sigs and all(sig is None for sig in sigs), sigs


@pytest.mark.mpi(min_size=1)
def test_small_operations_are_fused(comm: mt.Communicator) -> None:
    before = comm.async_stats()
    xs = [crafted(comm.rank + i, 2560, "float32", mt.Sum) for i in range(100)]  # 10 KiB each
    handles = [comm.allreduce_async(x) for x in xs]
    results = [h.wait() for h in handles]
    after = comm.async_stats()
    collectives = after.collectives - before.collectives
    assert_all_ranks(comm, collectives <= 25, f"100 small allreduces took {collectives} "
                     "collectives; fusion should need a handful")
    assert_all_ranks(comm, after.fused - before.fused >= 75, "most arrays went through fusion")
    assert after.operations - before.operations == 100
    for i, y in enumerate(results):
        want = sum(crafted(r + i, 2560, "float32", mt.Sum) for r in range(comm.size))
        assert_equal_all_ranks(comm, y, want, f"fused #{i}")


@pytest.mark.mpi(min_size=1)
def test_a_batch_reaches_one_cycle(comm: mt.Communicator) -> None:
    """Submissions inside comm.batch() are negotiated in one cycle and fused, although
    the ranks pause inside the block (releasing the GIL: without the batch, the
    engine's thread starts a cycle with what it has): the counters move by one cycle."""
    comm.allreduce_async(np.zeros(1)).wait()  # the engine runs, idle
    before = comm.async_stats()
    xs = [crafted(comm.rank + i, 300 + i, "float32", mt.Sum) for i in range(12)]
    with comm.batch():
        handles = []
        for i, x in enumerate(xs):
            handles.append(comm.allreduce_async(x, name=f"batch/{i}"))
            if i == 3:
                time.sleep(0.02 * (comm.rank + 1))
    results = [h.wait() for h in handles]
    after = comm.async_stats()
    assert_all_ranks(comm, after.cycles - before.cycles == 1,
                     f"a batch of 12 took {after.cycles - before.cycles} cycles")
    assert_all_ranks(comm, after.collectives - before.collectives == 1,
                     f"{after.collectives - before.collectives} collectives for one bucket")
    for i, y in enumerate(results):
        want = sum(crafted(r + i, 300 + i, "float32", mt.Sum) for r in range(comm.size))
        assert_equal_all_ranks(comm, y, want, f"batched #{i}")


@pytest.mark.mpi(min_size=1)
def test_waiting_inside_a_batch_runs_the_cycle(comm: mt.Communicator) -> None:
    """A wait inside the block does not hang: the waiting caller takes what the batch
    holds. Nested blocks release the submissions when the outer one ends."""
    with comm.batch():
        first = comm.allreduce_async(np.full(3, comm.rank + 1.0), name="inside/0")
        assert_equal_all_ranks(comm, first.wait(), np.full(3, comm.size * (comm.size + 1) / 2),
                               "waited inside")
        with comm.batch():
            second = comm.allreduce_async(np.full(2, 1, np.int32), name="inside/1")
        later = comm.allreduce_async(np.full(2, 2, np.int32), name="inside/2")
    deadline = time.monotonic() + 60
    while not (second.test() and later.test()):  # the engine's thread runs them
        assert time.monotonic() < deadline, "the batch's submissions never ran"
        time.sleep(0.001)
    assert_equal_all_ranks(comm, second.wait(), np.full(2, comm.size, np.int32), "nested")
    assert_equal_all_ranks(comm, later.wait(), np.full(2, 2 * comm.size, np.int32), "after")


@pytest.mark.mpi(min_size=1)
def test_submissions_waited_for_at_once(comm: mt.Communicator) -> None:
    """``waited()``: submissions that do not wake the engine's thread run in the cycle
    their caller's wait drives, beside ranks that submit the same operation without it,
    and an async operation in flight on the thread; a block that raises wakes the
    thread, which runs what it submitted although nobody waits."""
    busy = comm.allreduce_async(np.full(4, 1.0), name="waited/busy")
    if comm.rank % 2:
        with comm.waited():
            h = comm.allreduce_async(np.full(5, comm.rank + 1.0))
    else:
        h = comm.allreduce_async(np.full(5, comm.rank + 1.0))
    assert_equal_all_ranks(comm, h.wait(), np.full(5, comm.size * (comm.size + 1) / 2),
                           "waited and not, mixed")
    assert_equal_all_ranks(comm, busy.wait(), np.full(4, float(comm.size)), "in flight")
    try:
        with comm.waited():
            left = comm.allreduce_async(np.full(2, 3, np.int32), name="waited/left")
            raise KeyError("before the wait")
    except KeyError:
        pass
    deadline = time.monotonic() + 60
    while not left.done:  # nobody waits: the engine's thread runs it
        assert time.monotonic() < deadline, "a raising block's submission never ran"
        time.sleep(0.001)
    assert_equal_all_ranks(comm, left.wait(), np.full(2, 3 * comm.size, np.int32), "left")


@pytest.mark.mpi(min_size=1)
def test_unnamed_runs_cut_differently_per_rank(comm: mt.Communicator) -> None:
    """Unnamed submissions are announced as runs (one item per burst of one spec). Here
    rank 0 submits everything in one burst while the other ranks pause inside it, so
    their cycles carry the same names in other runs; kinds and named calls interleave,
    and the last rank gives one unnamed allreduce inside a run another dtype: that one
    fails on every rank, the rest are right."""
    last = comm.size - 1
    bad = 13
    handles: list[tuple[str, int, Any]] = []
    for i in range(40):
        if comm.rank and i % 9 == 4:
            time.sleep(0.003)  # let this rank's engine announce what it has so far
        dtype = np.float64 if comm.rank == last and i == bad and comm.size > 1 else np.float32
        x = np.full(6, comm.rank + i, dtype)
        if i % 10 == 7:
            handles.append(("gather", i, comm.allgather_async(x.reshape(2, 3))))
        elif i % 10 == 3:
            handles.append(("named", i, comm.allreduce_async(x, name=f"runs/{i}")))
        else:
            handles.append(("reduce", i, comm.allreduce_async(x)))
    total = sum(range(comm.size))
    for kind, i, h in handles:
        if i == bad and comm.size > 1:
            with pytest.raises(mt.MismatchError, match="float64"):
                h.wait()
        elif kind == "gather":
            want = np.concatenate([np.full((2, 3), r + i, np.float32) for r in range(comm.size)])
            assert_equal_all_ranks(comm, h.wait(), want, f"allgather #{i}")
        else:
            assert_equal_all_ranks(comm, h.wait(), np.full(6, total + comm.size * i,
                                                            np.float32), f"{kind} #{i}")


@pytest.mark.mpi(min_size=1)
def test_threshold_zero_turns_fusion_off(comm: mt.Communicator,
                                         configure: Callable[..., Any]) -> None:
    configure(fusion_threshold="0")
    before = comm.async_stats()
    handles = [comm.allreduce_async(np.full(4, i, np.int16)) for i in range(10)]
    for i, h in enumerate(handles):
        assert_equal_all_ranks(comm, h.wait(), np.full(4, i * comm.size, np.int16), "unfused")
    after = comm.async_stats()
    assert (after.collectives - before.collectives, after.fused - before.fused) == (10, 0)


@pytest.mark.mpi(min_size=1)
def test_grouped_allreduce(comm: mt.Communicator) -> None:
    f32 = [crafted(comm.rank, n, "float32", mt.Sum) for n in (0, 5, 3000)]
    i64 = [crafted(comm.rank, n, "int64", mt.Sum) for n in (1, 2)]
    before = comm.async_stats()
    got = comm.grouped_allreduce(f32 + i64, op=mt.Average)
    assert comm.async_stats().collectives - before.collectives == 2  # one per dtype
    for x, y in zip(f32 + i64, got):
        want = reference(comm.size, x.size, x.dtype, mt.Average)
        assert_equal_all_ranks(comm, y, want, f"grouped {x.dtype}[{x.size}]")
    handle = mt.grouped_allreduce_async([np.ones(2)], name="group")
    assert_equal_all_ranks(comm, mt.synchronize(handle)[0], np.full(2, comm.size, float), "g")
    assert comm.grouped_allreduce([]) == []


@pytest.mark.mpi(min_size=2)
def test_test_is_false_while_a_large_op_is_in_flight(comm: mt.Communicator) -> None:
    x = np.ones(16 << 20, np.float32)  # 64 MiB
    handle = comm.allreduce_async_(x, name="large")
    seen_in_flight = polls = 0
    while True:
        started = handle.started_at
        done = handle.test()
        if done:
            break
        polls += 1
        seen_in_flight += started is not None
        time.sleep(0.001)
    assert_all_ranks(comm, seen_in_flight > 0, f"test() was never False after the collective "
                     f"started ({polls} polls)")
    assert_all_ranks(comm, bool(x[0] == comm.size and x[-1] == comm.size), "large result")


@pytest.mark.mpi(min_size=1)
def test_communication_overlaps_computation(comm: mt.Communicator) -> None:
    """Like backward: submit a gradient, keep computing; its collective starts meanwhile."""
    a = np.random.default_rng(comm.rank).random((200, 200))
    handles = []
    for layer in range(4):
        a = np.tanh(a @ a.T / 200)
        handles.append(comm.allreduce_async(a.copy(), name=f"layer{layer}"))
    deadline = time.perf_counter() + 60
    while handles[0].started_at is None and time.perf_counter() < deadline:
        a = np.tanh(a @ a.T / 200)  # more backward work; no wait() called
    computed_until = time.perf_counter()
    started = handles[0].started_at
    assert_all_ranks(comm, started is not None and started < computed_until,
                     "the first gradient's collective did not start while computing")
    assert all(isinstance(h.wait(), np.ndarray) for h in handles)


@pytest.mark.mpi(min_size=2)
def test_mismatch_raises_on_every_rank(comm: mt.Communicator) -> None:
    last = comm.rank == comm.size - 1
    h = comm.allreduce_async(np.zeros(5 + last, np.float32), name="count")
    with pytest.raises(mt.MismatchError, match=r"rank 0 submitted allreduce sum float32\[5\]"):
        h.wait()
    with pytest.raises(mt.MismatchError):  # idempotent: raises again
        h.wait()
    h = comm.allreduce_async(np.zeros(5, np.float64 if last else np.float32), name="dtype")
    with pytest.raises(mt.MismatchError, match="float64"):
        h.wait()
    x = np.zeros((2, 3))
    h = comm.allgather_async(x, name="kind") if last else comm.allreduce_async(x, name="kind")
    with pytest.raises(RuntimeError, match="different arguments"):
        h.wait()
    good = comm.allreduce_async(np.ones(3), name="count")  # names are free again
    assert_equal_all_ranks(comm, good.wait(), np.full(3, comm.size, float), "after mismatch")


@pytest.mark.mpi(min_size=1)
def test_local_misuse_raises_at_submission(comm: mt.Communicator) -> None:
    x = np.ones(4, np.float32)
    h = comm.allreduce_async(x, name="dup")
    with pytest.raises(ValueError, match="'dup' is already in flight"):
        comm.allreduce_async(x, name="dup")
    h.wait()
    comm.allreduce_async(x, name="dup").wait()  # finished names may be reused
    h = comm.allreduce_async(x, name="done")
    while not h.done:  # finished, its handle not waited on: the name is free (as Horovod's)
        time.sleep(0.001)
    again = comm.allreduce_async(x, name="done")
    assert_equal_all_ranks(comm, again.wait(), np.full(4, comm.size, np.float32), "reused")
    assert_equal_all_ranks(comm, h.wait(), np.full(4, comm.size, np.float32), "first")
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce_async_(ro)
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.allreduce_async(x, op="median")
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        comm.allreduce_async(x, algorithm="tree")
    with pytest.raises(TypeError, match="not supported"):
        comm.allgather_async(np.ones(2, bool))
    with pytest.raises(ValueError, match="root=99"):
        comm.broadcast_async_(x, root=99)
    with pytest.raises(ValueError, match="needs an array to write into"):
        comm.allreduce_async_([1.0, 2.0])
    with pytest.raises(ValueError, match="a list of arrays"):
        comm.grouped_allreduce(x)
    with pytest.raises(ValueError, match="must be numbers"):
        comm.allreduce_async(x, prescale_factor="half")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be numbers"):  # unhashable arguments too
        comm.allreduce_async(x, prescale_factor=[2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reduction op"):
        comm.reduce_scatter_async(x, op=["sum"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm must be a name"):
        comm.allgather_async(x, algorithm=["ring"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="root="):
        comm.broadcast_async(x, root=[0])  # type: ignore[arg-type]
    # The checks of a call's arguments are made once and kept; what belongs to the
    # array itself is checked on every call, and a refused call keeps nothing.
    w = np.ones(4, np.float32)
    comm.allreduce_async_(w).wait()  # same dtype and shape as ro: the spec is kept
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce_async_(ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.broadcast_async_(ro)
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown reduction op"):
            comm.allreduce_async(x, op="median")
    # 1 and 1.0 are the same factor: ranks that spell it differently agree
    one = 1 if comm.rank == 0 else 1.0
    assert_equal_all_ranks(comm, comm.allreduce_async(x, prescale_factor=one).wait(),
                           x * comm.size, "prescale 1 / 1.0")
    assert_equal_all_ranks(comm, mt.allreduce_async(x).wait(), x * comm.size, "still usable")


@pytest.mark.mpi(min_size=2)
def test_collective_errors_reach_every_rank(comm: mt.Communicator,
                                            env: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise mt.ArgumentError("planning failed on purpose")

    env.setattr(comm.engine().dispatcher, "plan", broken)  # fails in the engine's thread
    h = comm.allreduce_async(np.ones(10), name="bad", algorithm="ring")
    with pytest.raises(ValueError, match="planning failed on purpose"):
        h.wait()
    # a bucket of requests of one spec, one of several specs, one of a group's arrays
    # (each batch waited before the next, so that each is its own bucket): all fail
    batches = [lambda: [comm.allreduce_async(np.ones(4), name=f"same.{i}", algorithm="ring")
                        for i in range(3)],
               lambda: [comm.allreduce_async(np.ones(i + 1), name=f"mixed.{i}",
                                             algorithm="ring") for i in range(3)],
               lambda: [comm.grouped_allreduce_async([np.ones(2), np.ones(3)],
                                                     algorithm="ring")]]
    for submit in batches:
        for handle in submit():
            with pytest.raises(ValueError, match="planning failed on purpose"):
                handle.wait()
    env.undo()
    assert mt.poll(h)
    assert_equal_all_ranks(comm, comm.allreduce_async(np.ones(2), name="bad").wait(),
                           np.full(2, comm.size, float), "engine survives")


@pytest.mark.mpi(min_size=1)
def test_free_stops_the_engine(comm: mt.Communicator) -> None:
    from mpi4py import MPI

    own = mt.Communicator(MPI.COMM_WORLD)
    done = own.allreduce_async(np.ones(3), name="kept")
    orphan = own.allreduce_async(np.ones(3), name="only-on-rank-0") if comm.rank == 0 else None
    engine = own._engine
    assert engine is not None
    assert_equal_all_ranks(comm, done.wait(), np.full(3, comm.size, float), "before free")
    late = own.allreduce_async(np.ones(2), name="submitted-then-freed")
    own.free()
    assert not engine._worker.is_alive()
    assert_equal_all_ranks(comm, late.wait(), np.full(2, comm.size, float), "finished by free")
    if orphan is not None and comm.size > 1:
        with pytest.raises(mt.CommunicationError, match=r"rank\(s\) \[1"):
            orphan.wait()
    with pytest.raises(mt.CommunicationError, match="shut down"):
        engine.allreduce(np.ones(1), mt.Sum, None, 1.0, 1.0, None, False)


@pytest.mark.mpi(min_size=1)
def test_idle_engine_sleeps(comm: mt.Communicator) -> None:
    """With nothing in flight the progress thread sleeps on its doorbell, with no
    timeout, and runs no cycle: it is found there every time it is looked at, not in a
    loop."""
    engine = comm.engine()
    real = engine._bell

    class Watched:
        """The engine's doorbell, telling whether a sleep (and with what timeout) is on."""

        sleeping: float | None = None

        def sleep(self, timeout: float, settle_s: float) -> bool:
            self.sleeping = timeout
            try:
                return bool(real.sleep(timeout, settle_s))
            finally:
                self.sleeping = None

        def ring(self, settle: bool) -> None:
            real.ring(settle)

        def taken(self) -> None:
            real.taken()

    bell = engine._bell = Watched()
    real.ring(False)  # a sleep on the real bell ends: the next one is watched
    try:
        comm.allreduce_async(np.ones(4)).wait()  # the engine has just worked

        def asleep() -> bool:
            return bell.sleeping is not None and bell.sleeping < 0

        deadline = time.monotonic() + 60
        while not asleep() and time.monotonic() < deadline:  # it goes to sleep after the work
            time.sleep(0.001)
        cycles = comm.async_stats().cycles
        looks = []
        for _ in range(50):
            looks.append(asleep())
            time.sleep(0.002)
        ran = comm.async_stats().cycles - cycles
    finally:
        engine._bell = real
        engine._bell.ring(False)  # a sleep on the watched bell goes on on the real one
    assert_all_ranks(comm, all(looks) and ran == 0,
                     f"asleep at {sum(looks)} of 50 looks; {ran} cycles ran meanwhile")


@pytest.mark.mpi(min_size=1)
def test_done_callbacks(comm: mt.Communicator, caplog: pytest.LogCaptureFixture) -> None:
    """A handle's callbacks run once, after the result is ready (on the engine's side of
    the cycle), at once for a handle already done; one that raises is logged and the
    engine goes on."""

    seen: list[tuple[str, Any, bool]] = []
    lock = threading.Lock()

    def record(tag: str) -> Any:
        def fn(handle: mt.Handle) -> None:
            with lock:
                seen.append((tag, handle.wait().copy(), handle.done))
        return fn

    def broken(handle: mt.Handle) -> None:
        raise RuntimeError("a callback that fails on purpose")

    x = np.arange(5, dtype=np.float64)
    with caplog.at_level("ERROR", logger="mpitrain"):
        h = comm.allreduce_async(x, name="cb")
        h.add_done_callback(record("first"))
        h.add_done_callback(broken)
        h.add_done_callback(record("second"))
        result = h.wait()
        for _ in range(200):  # the engine calls them after its cycle: wait for both
            with lock:
                if len(seen) == 2:
                    break
            time.sleep(0.01)
        h.add_done_callback(record("late"))  # done: called here, at once
    with lock:
        tags = [t for t, _, _ in seen]
        ok = sorted(tags[:2]) == ["first", "second"] and tags[2:] == ["late"] and all(
            done and np.array_equal(v, result) for _, v, done in seen)
    assert_all_ranks(comm, ok, f"callbacks seen: {tags}")
    assert_all_ranks(comm, "fails on purpose" in caplog.text, "the failing callback logged")
    assert_equal_all_ranks(comm, comm.allreduce_async(x).wait(), x * comm.size, "usable after")
