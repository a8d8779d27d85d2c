"""The device path of every collective, run on the fake GPU of ``tests/fake_device.py``.

The fake device's arrays go through exactly the code CuPy arrays take: the
communicator's stream scope, the transfer policy chosen at plan time, the staging
transport (``MPITRAIN_CUDA_AWARE=0``) or the direct one (``=1``), and the ring or
the native algorithms. Its streams run work late and in random orders, so a missing
synchronization shows up as wrong elements. Tiny segments and one or two pinned
slots reach the multi-segment pipeline and the slot queues with small buffers.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import numpy as np
import pytest
from fake_device import FakeDeviceArray, ForeignDeviceArray, fake_backend, to_device
from helpers import assert_all_ranks, assert_equal_all_ranks, crafted, ops_for, reference

import mpitrain as mt

POLICIES = {"staged": "0", "cuda-aware": "1"}
ALGORITHMS = ["ring", "mpi"]
DTYPES = ["float32", "bfloat16"]  # integers: the scaling and reduce-scatter tests


def counts(size: int) -> list[int]:
    """0, 1, fewer than ranks, and a length no rank count divides."""
    return sorted({0, 1, max(size - 1, 0), 101})


@pytest.fixture(params=list(POLICIES))
def policy(request: pytest.FixtureRequest, configure: Callable[..., Any]) -> str:
    """Run the test under both device policies, with tiny segments and few slots."""
    configure(cuda_aware=POLICIES[request.param], segment_bytes="16", staging_slots=2)
    return str(request.param)


def host(arr: Any) -> np.ndarray[Any, Any]:
    """A fake device array's contents (the collective has synchronized its stream)."""
    assert isinstance(arr, FakeDeviceArray), f"expected a device array, got {type(arr)}"
    return np.asarray(arr).view(np.ndarray)


def seed(comm: mt.Communicator, *salt: object) -> int:
    """A seed that differs by rank and by test case (stable across runs)."""
    return comm.rank * 7919 + sum(ord(c) for c in "".join(map(str, salt)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(comm: mt.Communicator, policy: str, algorithm: str, dtype: str) -> None:
    assert comm.cuda_policy == policy
    ops = ops_for(dtype) if dtype == "float32" else [mt.Sum, mt.Min, mt.Average]
    with fake_backend(seed(comm, policy, algorithm, dtype)):
        for count in counts(comm.size):
            for op in ops:
                expected = reference(comm.size, count, dtype, op)
                x = to_device(crafted(comm.rank, count, dtype, op))
                y = comm.allreduce(x, op=op, algorithm=algorithm)
                assert_equal_all_ranks(comm, host(y), expected, f"allreduce n={count} {op}")
                z = to_device(crafted(comm.rank, count, dtype, op))
                assert comm.allreduce_(z, op=op, algorithm=algorithm) is z
                assert_equal_all_ranks(comm, host(z), expected, f"allreduce_ n={count} {op}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_scaling_streams_and_out(comm: mt.Communicator, policy: str, algorithm: str) -> None:
    with fake_backend(seed(comm, policy, algorithm)) as be:
        stream = be.fake.new_stream()
        x = to_device(crafted(comm.rank, 101, "float64", mt.Sum))
        out = be.empty(101, np.float64)
        got = comm.allreduce(x, op=mt.Average, algorithm=algorithm, prescale_factor=0.5,
                             postscale_factor=3.0, out=out, stream=stream)
        want = reference(comm.size, 101, "float64", mt.Sum) * 0.5 * 3.0 / comm.size
        assert_all_ranks(comm, got is out and bool(np.allclose(host(out), want, rtol=1e-12)),
                         "scaled allreduce on a side stream")
        ints = to_device(crafted(comm.rank, 101, "int32", mt.Sum))
        got = comm.allreduce(ints, algorithm=algorithm, postscale_factor=0.25)
        want_ints = np.floor(reference(comm.size, 101, "int32", mt.Sum) * 0.25).astype(np.int32)
        assert_equal_all_ranks(comm, host(got), want_ints, "integer postscale")
        square = to_device(crafted(comm.rank, 36, "float32", mt.Sum)).reshape(6, 6)
        view = square.T  # non-contiguous: reduced through a copy written back
        assert comm.allreduce_(view, algorithm=algorithm) is view
        assert_equal_all_ranks(comm, host(square),
                               reference(comm.size, 36, "float32", mt.Sum).reshape(6, 6),
                               "allreduce_ of a transposed device view")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float16", "int32"])
def test_reduce_scatter(comm: mt.Communicator, policy: str, algorithm: str, dtype: str) -> None:
    with fake_backend(seed(comm, policy, algorithm, dtype, "rs")):
        for rows in (2 * comm.size + 1, 33):
            for op in (mt.Sum, mt.Max, mt.Average):
                full = reference(comm.size, rows * 3, dtype, op).reshape(rows, 3)
                mine = np.array_split(full, comm.size)[comm.rank]
                x = to_device(crafted(comm.rank, rows * 3, dtype, op)).reshape(rows, 3)
                got = comm.reduce_scatter(x, op=op, algorithm=algorithm)
                assert_equal_all_ranks(comm, host(got), mine, f"reduce_scatter rows={rows} {op}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allgather_and_broadcast(comm: mt.Communicator, policy: str, algorithm: str) -> None:
    with fake_backend(seed(comm, policy, algorithm, "ag")):
        for rows in (0, 1, 7):
            mine = rows + comm.rank % 2  # blocks of different lengths
            x = to_device(crafted(comm.rank, mine * 2, "float32", mt.Sum)).reshape(mine, 2)
            want = np.concatenate([crafted(r, (rows + r % 2) * 2, "float32", mt.Sum)
                                   for r in range(comm.size)]).reshape(-1, 2)
            got = comm.allgather(x, algorithm=algorithm)
            assert_equal_all_ranks(comm, host(got), want, f"allgather rows={rows}")
        root = comm.size - 1
        for count in (1, 57):
            b = to_device(crafted(comm.rank, count, "int64", mt.Sum))
            want = crafted(root, count, "int64", mt.Sum)
            assert_equal_all_ranks(comm, host(comm.broadcast(b, root=root)), want,
                                   "broadcast")
            assert comm.broadcast_(b, root=root) is b
            assert_equal_all_ranks(comm, host(b), want, "broadcast_")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_async_allreduce(comm: mt.Communicator, policy: str, inplace: bool) -> None:
    """Device arrays through the engine's fusion buffer: equal pieces (the rows of one
    reshape) and pieces of different shapes (offsets), out of place and in place."""
    with fake_backend(seed(comm, policy, "fused", inplace)) as fake:
        for counts_ in ([16] * 40, [16, 3, 40, 7] * 10):
            before = comm.async_stats()
            xs = [to_device(crafted(comm.rank + i, n, "float32", mt.Sum))
                  for i, n in enumerate(counts_)]
            start = comm.allreduce_async_ if inplace else comm.allreduce_async
            results = [h.wait() for h in [start(x) for x in xs]]
            fake.synchronize()  # a consumer on the caller's stream sees the unpacking done
            fused = comm.async_stats().fused - before.fused
            assert_all_ranks(comm, fused >= 20, f"only {fused} of 40 arrays were fused")
            for i, (n, x, y) in enumerate(zip(counts_, xs, results)):
                assert (y is x) == inplace
                want = sum(crafted(r + i, n, "float32", mt.Sum) for r in range(comm.size))
                assert_equal_all_ranks(comm, host(y), want, f"fused #{i} of {counts_[:4]}")


@pytest.mark.mpi(min_size=1)
def test_async_operations_run_on_the_streams_the_rule_gives(
        comm: mt.Communicator, policy: str) -> None:
    """Where an async operation runs (Engine._ready), whichever stream is current on
    the thread that runs the engine's cycle: one that writes only into the caller's
    memory (in place, allgather into ``out=``) on the engine's own stream, one that
    hands out memory it allocates on its producer's stream (``stream=``). None of
    their work lands on the default stream (where a training step's kernels would wait
    for it), and the inputs, produced late on the side stream, are read only once
    they are written."""
    with fake_backend(seed(comm, policy, "streams")) as fake:
        side = fake.fake.new_stream()

        def produced(count: int, salt: int = 0) -> Any:
            x = fake.empty(count, np.float32)
            with side:  # written late, on the side stream
                fake.copy_into(x, to_device(crafted(comm.rank + salt, count, "float32",
                                                    mt.Sum)))
            return x

        small = [produced(8, salt=i) for i in range(12)]  # fused into one bucket
        mixed = [produced(8, salt=20 + i) for i in range(6)]  # in place first, alternating
        big, rows, root = produced(101), produced(3 * comm.size), produced(7)
        gather, gathered_into = produced(5), produced(5)
        out = fake.empty(5 * comm.size, np.float32).reshape(comm.size, 5)

        def queued() -> dict[str, int]:
            """Work queued so far on the default, the side and the engine's own stream."""
            own = sum(s.enqueued for s in fake.fake.streams if s.name == "engine")
            return {"default": fake.fake.default.enqueued, "side": side.enqueued, "own": own}

        def fused() -> list[Any]:
            with comm.batch():  # one cycle: one bucket
                return [comm.allreduce_async(x, stream=side) for x in small]

        def fused_mixed() -> list[Any]:
            with comm.batch():
                return [(comm.allreduce_async if i % 2 else comm.allreduce_async_)(
                    x, stream=side) for i, x in enumerate(mixed)]

        cases: list[tuple[str, Callable[[], list[Any]], str]] = [
            ("fused allreduces", fused, "side"),
            ("allreduce_ Max", lambda: [comm.allreduce_async_(big, op=mt.Max, stream=side)],
             "own"),
            ("fused, in place and out of place", fused_mixed, "side"),
            ("allgather", lambda: [comm.allgather_async(gather, stream=side)], "side"),
            ("allgather into out=", lambda: [comm.allgather_async(
                gathered_into.reshape(1, 5), stream=side, out=out)], "own"),
            ("reduce_scatter", lambda: [comm.reduce_scatter_async(rows, stream=side)], "side"),
            ("broadcast_", lambda: [comm.broadcast_async_(root, root=comm.size - 1,
                                                          stream=side)], "own"),
        ]
        results: list[Any] = []
        moved = {"side": 0, "own": 0}
        for what, submit, where in cases:
            before = queued()
            results += [h.wait() for h in submit()]
            delta = {name: n - before[name] for name, n in queued().items()}
            wrong = [name for name in delta if name != where and delta[name]]
            assert_all_ranks(comm, not wrong, f"{what}: work on the {wrong} stream(s), "
                             f"not only on the {where} stream: {delta}")
            moved[where] += delta[where]
        owns = [s for s in fake.fake.streams if s.name == "engine"]
        assert_all_ranks(comm, moved["side"] > 0 and moved["own"] > 0 and len(owns) == 1,
                         f"no work on the side or the engine's own stream ({moved}), or "
                         f"not one stream of the engine's own: {len(owns)}")
        other = mt.Communicator(comm.mpi_comm)  # another engine: a stream of its own
        try:
            again = produced(9)
            other.allreduce_async_(again, stream=side).wait()
            comm.allreduce_async_(again, stream=side).wait()
            owns = [s for s in fake.fake.streams if s.name == "engine"]
            assert_all_ranks(comm, len(owns) == 2, f"{len(owns)} engine streams for two "
                             "communicators' engines, not one each")
            twice = comm.size * reference(comm.size, 9, "float32", mt.Sum)
            assert_equal_all_ranks(comm, host(again), twice,
                                   "in-place allreduces on two engines, one after the other")
        finally:
            other.free()
        for i, y in enumerate(results[:12]):
            want = sum(crafted(r + i, 8, "float32", mt.Sum) for r in range(comm.size))
            assert_equal_all_ranks(comm, host(y), want, f"fused allreduce #{i}")
        maxed = np.max([crafted(r, 101, "float32", mt.Sum) for r in range(comm.size)], axis=0)
        assert_equal_all_ranks(comm, host(results[12]), maxed, "allreduce_ Max")
        for i, y in enumerate(results[13:19]):
            want = sum(crafted(r + 20 + i, 8, "float32", mt.Sum) for r in range(comm.size))
            assert_all_ranks(comm, (y is mixed[i]) == (i % 2 == 0), f"mixed #{i}: in place?")
            assert_equal_all_ranks(comm, host(y), want, f"mixed fused allreduce #{i}")
        gathered = np.stack([crafted(r, 5, "float32", mt.Sum) for r in range(comm.size)])
        assert_equal_all_ranks(comm, host(results[19]).reshape(-1), gathered.reshape(-1),
                               "allgather")
        assert_all_ranks(comm, results[20] is out, "allgather into out= returned another array")
        assert_equal_all_ranks(comm, host(out), gathered, "allgather into out=")
        mine = reference(comm.size, 3 * comm.size, "float32", mt.Sum)[3 * comm.rank:][:3]
        assert_equal_all_ranks(comm, host(results[21]).reshape(-1), mine, "reduce_scatter")
        assert_equal_all_ranks(comm, host(results[22]),
                               crafted(comm.size - 1, 7, "float32", mt.Sum), "broadcast_")


@pytest.mark.mpi(min_size=2)
def test_one_slot_and_many_segments(comm: mt.Communicator,
                                    configure: Callable[..., Any]) -> None:
    """One pinned slot per direction: every segment queues behind the previous one."""
    configure(cuda_aware=False, staging_slots=1, segment_bytes="64")
    with fake_backend(seed(comm, "one slot")):
        count = 2053
        x = to_device(crafted(comm.rank, count, "float32", mt.Sum))
        got = comm.allreduce(x, algorithm="ring")
        assert_equal_all_ranks(comm, host(got), reference(comm.size, count, "float32", mt.Sum),
                               "allreduce through one slot")
        got = comm.reduce_scatter(x, algorithm="ring")
        want = np.array_split(reference(comm.size, count, "float32", mt.Sum), comm.size)
        assert_equal_all_ranks(comm, host(got), want[comm.rank], "reduce_scatter, one slot")


@pytest.mark.mpi(min_size=1)
def test_numpy_arrays_keep_the_host_path(comm: mt.Communicator) -> None:
    x = np.ones(5, np.float32)
    y = comm.allreduce(x, stream="ignored for numpy")
    assert type(y) is np.ndarray and y[0] == comm.size


# -- another library's device arrays (a torch CUDA tensor's role) -----------------------
@pytest.mark.mpi(min_size=1)
def test_foreign_arrays_in_place_async(comm: mt.Communicator, policy: str) -> None:
    """In-place async collectives on foreign device arrays, which the backend sees
    through a new view (as CuPy sees a torch CUDA tensor): the results must land in the
    caller's memory, as the blocking calls' do (the engine once refused them)."""
    with fake_backend(seed(comm, policy, "foreign")):
        for count in counts(comm.size):
            x = ForeignDeviceArray(to_device(crafted(comm.rank, count, "float32", mt.Sum)))
            assert comm.allreduce_async_(x).wait() is x
            assert_equal_all_ranks(comm, host(x.memory),
                                   reference(comm.size, count, "float32", mt.Sum),
                                   f"allreduce_async_ n={count}")
            group = [ForeignDeviceArray(to_device(crafted(comm.rank + i, count + i, "float64",
                                                          mt.Sum))) for i in range(3)]
            assert comm.grouped_allreduce_async_(group).wait() == group
            for i, g in enumerate(group):
                want = sum(crafted(r + i, count + i, "float64", mt.Sum) for r in range(comm.size))
                assert_equal_all_ranks(comm, host(g.memory), want, f"grouped #{i} n={count}")
            root = comm.size - 1
            b = ForeignDeviceArray(to_device(crafted(comm.rank, count, "int32", mt.Sum)))
            assert comm.broadcast_async_(b, root=root).wait() is b
            assert_equal_all_ranks(comm, host(b.memory), crafted(root, count, "int32", mt.Sum),
                                   f"broadcast_async_ n={count}")
            assert comm.allreduce_(x) is x  # and the blocking call, for comparison
            out = comm.allreduce_async(x, op=mt.Max).wait()
            assert_equal_all_ranks(comm, host(out), host(x.memory), f"out of place n={count}")


# -- sends that wait for their receive, beyond the slots --------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_staged_ring_with_more_segments_than_slots(comm: mt.Communicator, env: pytest.MonkeyPatch,
                                                    slots: int) -> None:
    """The staged ring with rendezvous sends (a send completes only once its receive is
    matched: fake_backend posts them as MPI_Issend) and many more segments per chunk than
    pinned slots: at 3+ ranks, forwards that held a receive slot until their send
    completed deadlocked every rank. A stall timeout turns a hang into a failure."""
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", "30")
    c = mt.Communicator(comm.mpi_comm, settings=mt.Settings.from_environment(
        cuda_aware=False, staging_slots=slots, segment_bytes=64))
    try:
        with fake_backend(seed(c, "rendezvous", slots)):
            for dtype in ("int8", "int16", "float32", "float64"):
                count = 40 * c.size * 64 // np.dtype(dtype).itemsize + 3
                x = to_device(crafted(c.rank, count, dtype, mt.Sum))
                assert_equal_all_ranks(c, host(c.allreduce(x, algorithm="ring")),
                                       reference(c.size, count, dtype, mt.Sum),
                                       f"allreduce {dtype}")
                rows = 8 * c.size + 1
                y = to_device(crafted(c.rank, rows * 33, dtype, mt.Sum)).reshape(rows, 33)
                want = np.array_split(reference(c.size, rows * 33, dtype, mt.Sum)
                                      .reshape(rows, 33), c.size)[c.rank]
                assert_equal_all_ranks(c, host(c.reduce_scatter(y, algorithm="ring")), want,
                                       f"reduce_scatter {dtype}")
                blocks = [crafted(r, 700 + r, dtype, mt.Sum) for r in range(c.size)]
                got = c.allgather(to_device(blocks[c.rank]), algorithm="ring")
                assert_equal_all_ranks(c, host(got), np.concatenate(blocks), f"allgather {dtype}")
    finally:
        c.free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_late_to_a_staged_ring_is_a_stall(comm: mt.Communicator,
                                                 env: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Ranks waiting in the staged transport for a rank that has not called the
    collective are seen by the stall inspector as on the host path: a warning naming
    the late rank and the collective, then StallError at the timeout."""
    env.setenv("MPITRAIN_STALL_WARNING_S", "0.5")
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", "1.5")
    c = mt.Communicator(comm.mpi_comm, check=False,  # no validation: straight into the ring
                        settings=mt.Settings.from_environment(cuda_aware=False,
                                                              staging_slots=2,
                                                              segment_bytes=64))
    late = c.size - 1
    error = ""
    try:
        with fake_backend(seed(c, "late")), caplog.at_level("WARNING", logger="mpitrain"):
            x = to_device(crafted(c.rank, 5000, "float32", mt.Sum))
            if c.rank == late:
                time.sleep(2.5)  # the others stall, and are gone when this rank comes
            try:
                c.allreduce(x, algorithm="ring")
                error = "no StallError"
            except mt.StallError as exc:
                text = str(exc)
                if c.rank != late and not re.search(rf"allreduce .*rank {late} has not "
                                                    "called it", text):
                    error = f"StallError does not name rank {late}: {text}"
            warned = " ".join(r.getMessage() for r in caplog.records)
            if c.rank != late and not re.search(rf"allreduce .*rank {late} has not called it",
                                                warned):
                error = error or f"no warning named rank {late}: {warned!r}"
    finally:
        c.free()  # a stalled communicator frees only what it can
    assert_all_ranks(comm, not error, error)
