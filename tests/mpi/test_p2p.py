"""The point-to-point barrier, broadcast and allgathers of an elastic transport
(mpitrain.comm.p2p): the results of MPI's own collectives, for every root, uneven and
empty blocks, and through the object collectives and the async engine that use them."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.comm.inspector import StallLimits
from mpitrain.comm.transport import Transport
from mpitrain.config import Settings

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[False, True], ids=["blocking", "interruptible"])
def transport(request: pytest.FixtureRequest) -> Iterator[Transport]:
    stall = StallLimits(0.0, 60.0 if request.param else 0.0, "raise")
    t = Transport(MPI.COMM_WORLD, stall, elastic=True)
    assert t.interruptible is request.param
    yield t
    t.free()


def test_allgather_equals_mpis(transport: Transport) -> None:
    rank, size = transport.rank, transport.size
    for dtype in (np.uint8, np.int64, np.float32, np.complex128):
        mine = (np.arange(5) * (rank + 2) + 7 * rank).astype(dtype)
        got = np.full((size, 5), 99, dtype)
        transport.allgather(mine, got)
        want = np.empty_like(got)
        MPI.COMM_WORLD.Allgather(mine, want)
        np.testing.assert_array_equal(got, want)


def test_allgatherv_with_uneven_and_empty_blocks(transport: Transport) -> None:
    rank, size = transport.rank, transport.size
    counts = [(3 * r) % 4 for r in range(size)]  # 0, 3, 2, 1, 0: some ranks send nothing
    displs = [sum(counts[:r]) for r in range(size)]
    mine = np.arange(counts[rank], dtype=np.uint8) + 10 * rank
    got = np.full(sum(counts), 255, np.uint8)
    transport.allgatherv(mine, got, counts, displs)
    want = np.concatenate([np.arange(c, dtype=np.uint8) + 10 * r for r, c in enumerate(counts)])
    np.testing.assert_array_equal(got, want)


def test_bcast_from_every_root(transport: Transport) -> None:
    for root in range(transport.size):
        buf = np.arange(6, dtype=np.float64) * (transport.rank + 1)
        transport.bcast(buf, root)
        np.testing.assert_array_equal(buf, np.arange(6) * (root + 1.0))


def test_barrier_returns_on_no_rank_before_the_last_has_entered(
        transport: Transport) -> None:
    """The last rank enters 0.3 s late; no rank may leave before it has entered (the
    times are on one clock: each rank's departure against the late rank's arrival)."""
    late = transport.size - 1
    MPI.COMM_WORLD.Barrier()
    if transport.rank == late:
        time.sleep(0.3)
    entered = time.time()
    transport.barrier()
    left = time.time()
    arrivals = MPI.COMM_WORLD.allgather(entered)
    assert left >= arrivals[late], (left, arrivals)


def test_object_collectives_and_the_engine_of_an_elastic_communicator() -> None:
    """Objects, barriers and async allreduces (whose negotiation is the point-to-point
    allgather) on a communicator whose settings say ``elastic``."""
    c = mt.Communicator(MPI.COMM_WORLD, settings=Settings.from_environment().changed(
        elastic=True))
    try:
        assert c.dispatcher.transport.elastic and c.dispatcher.shm is None
        rank, size = c.rank, c.size
        assert c.allgather_object({"r": rank, "pad": "x" * rank}) == \
            [{"r": r, "pad": "x" * r} for r in range(size)]
        for root in range(size):
            assert c.broadcast_object(("from", rank), root) == ("from", root)
        c.barrier()
        handles = [c.allreduce_async(np.full(7, rank + k, np.float64), name=f"p2p.{k}")
                   for k in range(3)]
        for k, h in enumerate(handles):
            np.testing.assert_array_equal(h.wait(), np.full(7, sum(range(size)) + k * size))
        assert c.engine().dispatcher.transport.elastic
    finally:
        c.free()
