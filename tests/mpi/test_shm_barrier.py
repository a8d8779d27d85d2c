"""The shared-memory barrier (mpitrain.comm.shm): ``agree`` and ``barrier`` on the
compiled counters, on the interpreter's code, and with both on different ranks, under
skewed arrivals: what a rank stored before a barrier is what the others read after it,
a different fingerprint is seen by every rank, the parities never overwrite data
that a slower rank still reads, and a long wait on shared cores, or of the async
engine while the process's own threads compute, sleeps."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm import shm as shm_module
from mpitrain.comm.shm import BUSY_MAX_PAUSE_S, SPIN_POLLS, SharedMemory

ROUNDS = 300


@pytest.fixture(params=["compiled", "interpreted", "mixed"])
def shm(request: pytest.FixtureRequest) -> Iterator[SharedMemory]:
    """A fresh communicator's shared memory whose barrier runs in the extension, in the
    interpreter, or in the extension on even ranks only."""
    comm = mt.Communicator(MPI.COMM_WORLD)
    memory = comm.dispatcher.shm
    try:
        if memory is None:
            pytest.skip("no shared memory at one rank")
        if request.param != "interpreted" and memory.counters is None:
            pytest.skip("the _hostcopy extension is not built")
        if request.param == "interpreted" or (request.param == "mixed" and comm.rank % 2):
            memory.counters = None
        yield memory
    finally:
        comm.free()


def _skew(rank: int, size: int, t: int) -> None:
    """Make one rank (a different one each round) late by up to 200 us."""
    if t % size == rank and t % 3:
        time.sleep((t % 7) * 30e-6)


def _stamp(shm: SharedMemory, parity: int) -> np.ndarray:
    """This rank's first two words of its slot at ``parity``."""
    return shm.slot(parity, shm.rank)[:16].view(np.int64)


def _read(shm: SharedMemory, parity: int) -> list[list[int]]:
    return [shm.slot(parity, q)[:16].view(np.int64).tolist() for q in range(shm.size)]


@pytest.mark.mpi(min_size=2)
def test_agree_carries_what_every_rank_wrote(shm: SharedMemory) -> None:
    """Each round every rank writes (round, rank) into its slot, then agrees; after
    the barrier it must read every rank's words of this round, and agreement."""
    problems: list[str] = []
    for _ in range(ROUNDS):
        t, p = shm.seq + 1, shm.next_parity
        _stamp(shm, p)[:] = (t, shm.rank)
        _skew(shm.rank, shm.size, t)
        agreed = shm.agree(12345)
        seen = _read(shm, p)
        if not agreed or seen != [[t, q] for q in range(shm.size)]:
            problems.append(f"barrier {t}: agreed {agreed}, read {seen}")
    assert_all_ranks_raw(shm, not problems, "; ".join(problems[:3]))


@pytest.mark.mpi(min_size=2)
def test_every_rank_sees_a_different_fingerprint(shm: SharedMemory) -> None:
    """The last rank publishes another fingerprint every third round: every rank gets
    False exactly there, and True elsewhere."""
    last = shm.rank == shm.size - 1
    wrong: list[int] = []
    for i in range(ROUNDS):
        t = shm.seq + 1
        _skew(shm.rank, shm.size, t)
        differs = i % 3 == 0
        agreed = shm.agree(-7 if differs and last else 2**62 + i)
        if agreed == differs:
            wrong.append(i)
    assert_all_ranks_raw(shm, not wrong, f"wrong verdict in rounds {wrong[:10]}")


@pytest.mark.mpi(min_size=2)
def test_barrier_carries_what_every_rank_wrote(shm: SharedMemory) -> None:
    """As the agree test, with the plain barrier of the large algorithms' stripes."""
    problems: list[str] = []
    for _ in range(ROUNDS):
        t, p = shm.seq + 1, shm.next_parity
        _stamp(shm, p)[:] = (t, shm.rank)
        _skew(shm.rank, shm.size, t)
        if shm.barrier() != t:
            problems.append(f"barrier {t} returned another number")
        seen = _read(shm, p)
        if seen != [[t, q] for q in range(shm.size)]:
            problems.append(f"barrier {t}: read {seen}")
    assert_all_ranks_raw(shm, not problems, "; ".join(problems[:3]))


def assert_all_ranks_raw(shm: SharedMemory, ok: bool, message: str) -> None:
    """:func:`helpers.assert_all_ranks` over MPI itself (not over the barrier under test)."""
    failed = MPI.COMM_WORLD.allgather(None if ok else f"rank {shm.rank}: {message}")
    bad = [f for f in failed if f is not None]
    assert not bad, "; ".join(bad)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_share_cores_sleep_through_a_long_wait(shm: SharedMemory) -> None:
    """Where the ranks share cores, a rank that waits long for a late one sleeps between
    tests instead of yielding (a yielding rank stays runnable and takes the cores the
    late rank needs): over a 0.6 s wait it uses a small part of a core."""
    shm.oversubscribed, shm.polls = True, 0
    late = shm.size - 1
    MPI.COMM_WORLD.Barrier()
    if shm.rank == late:
        time.sleep(0.6)
        shm.barrier()
        assert_all_ranks_raw(shm, True, "")
        return
    wall, cpu = time.monotonic(), time.process_time()
    shm.barrier()
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert_all_ranks_raw(shm, cpu < 0.25 * wall,
                         f"waited {wall:.2f} s for rank {late}, using {cpu:.2f} s of CPU")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("others_busy", [True, False], ids=["threads-busy", "caller-blocked"])
def test_an_engine_barrier_sleeps_only_while_its_process_has_work(
        shm: SharedMemory, others_busy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On cores of their own, a barrier of the async engine (``others_busy`` set) that
    waits long for a late rank sleeps between tests, for at most ``BUSY_MAX_PAUSE_S``
    at a time, while the process's other threads have work; while a caller is blocked
    on the engine (``others_busy()`` False) it yields only, to pass the barrier as soon
    as the late rank arrives."""
    shm.oversubscribed, shm.polls = False, SPIN_POLLS
    sleeps: list[float] = []
    real = shm_module.time

    class Clock:
        """The module's ``time``, counting sleeps."""
        monotonic = staticmethod(real.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            sleeps.append(seconds)
            real.sleep(seconds)

    monkeypatch.setattr(shm_module, "time", Clock)
    shm.others_busy = lambda: others_busy
    late = shm.size - 1
    MPI.COMM_WORLD.Barrier()
    if shm.rank == late:
        time.sleep(0.2)
    shm.barrier()
    if shm.rank == late:
        ok = True
    elif others_busy:
        ok = bool(sleeps) and max(sleeps) <= BUSY_MAX_PAUSE_S
    else:
        ok = not sleeps
    assert_all_ranks_raw(shm, ok, f"waited 0.2 s for rank {late} (others busy: "
                                  f"{others_busy}) with {len(sleeps)} sleeps, the longest "
                                  f"{max(sleeps, default=0.0) * 1e6:.0f} us")
