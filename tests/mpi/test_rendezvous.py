"""Every point-to-point algorithm with sends that wait for their receiver.

A small message goes eagerly: its send completes at once, whether or not the peer has
posted the receive, so an algorithm that waits for its own send before it posts the
receive that its peer's send needs passes every test with small messages and hangs in
production above MPI's eager limit (Open MPI: 4 KiB through shared memory, 64 KiB over
TCP). Here the host transport's test knob (:data:`mpitrain.comm.transport.SYNCHRONOUS_SENDS`,
set by :func:`helpers.synchronous_sends`) posts every send as ``MPI_Issend`` or
``MPI_Ssend``, which completes only once its receive is matched, so such a wait hangs
at any size. Every algorithm that moves bytes through the transport runs with it: the
ring, recursive doubling and halving, Rabenseifner, Bruck, every phase of the
hierarchical collectives on emulated nodes (the segmented doubling between nodes, with
and without pieces) and Adasum, with whole chunks and with tiny pipeline segments.
Every communicator here has a stall timeout, so a hang is a StallError, a failure.
(Messages above the eager limit with ordinary sends: the ``*_large`` tests of
test_allreduce.py, test_reduce_scatter.py and test_allgather_broadcast.py.)
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from helpers import (
    adasum_reference,
    assert_all_ranks,
    check_allgather,
    check_allreduce,
    check_reduce_scatter,
    configured,
    layouts,
    synchronous_sends,
    with_nodes,
)

import mpitrain as mt
from mpitrain.algorithms import hierarchical

STALL_TIMEOUT_S = "60"
POINT_TO_POINT = {
    "allreduce": ["ring", "recursive_doubling", "rabenseifner", "hierarchical"],
    "reduce_scatter": ["ring", "recursive_halving", "hierarchical"],
    "allgather": ["ring", "recursive_doubling", "bruck", "hierarchical"],
}
CASES = [(c, a) for c, algorithms in POINT_TO_POINT.items() for a in algorithms]


@pytest.fixture
def rendezvous(env: pytest.MonkeyPatch, comm: mt.Communicator) -> Iterator[pytest.MonkeyPatch]:
    """Synchronous sends and a stall timeout for the communicators the test makes."""
    env.setenv("MPITRAIN_STALL_TIMEOUT_S", STALL_TIMEOUT_S)
    with synchronous_sends():
        yield env


def check(c: mt.Communicator, collective: str, algorithm: str) -> None:
    """Two dtype/op cases of ``collective`` at 0, 1, fewer than ranks, divisible by
    every rank count 1..8, and not divisible."""
    sizes = [0, 1, max(c.size - 1, 0), 840, 1001]
    assert_all_ranks(c, c.dispatcher.transport.synchronous, "the knob did not take")
    if collective == "allreduce":
        check_allreduce(c, algorithm, "float64", mt.Sum, sizes)
        check_allreduce(c, algorithm, "int8", mt.Product, sizes)
    elif collective == "reduce_scatter":
        check_reduce_scatter(c, algorithm, "float32", mt.Sum, sizes)
        check_reduce_scatter(c, algorithm, "int16", mt.Max, sizes)
    else:
        check_allgather(c, algorithm, "float64", sizes)
        check_allgather(c, algorithm, "uint8", sizes)


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=2)
def test_the_knob_makes_a_send_wait_for_its_receive(rendezvous: pytest.MonkeyPatch,
                                                    comm: mt.Communicator) -> None:
    """A one-byte send to the next rank is not complete before that rank posts its
    receive (which it does only after a barrier that follows the test)."""
    c = mt.Communicator(comm.mpi_comm)
    try:
        t = c.dispatcher.transport
        sent, got = np.ones(1, np.uint8), np.zeros(1, np.uint8)
        request = t.isend(sent, t.right, 5)
        early = bool(request.Test())
        c.barrier()
        t.waitall([t.irecv(got, t.left, 5), request])
        assert_all_ranks(c, not early and got[0] == 1, f"done before its receive: {early}")
    finally:
        c.free()


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("segment_bytes", [0, 24], ids=["whole", "seg24"])
@pytest.mark.parametrize("collective,algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_flat(rendezvous: pytest.MonkeyPatch, comm: mt.Communicator, collective: str,
              algorithm: str, segment_bytes: int) -> None:
    """Every rank on one (emulated) node: the flat algorithms, hierarchical as its
    intra-node phases."""
    rendezvous.setenv("MPITRAIN_SEGMENT_BYTES", str(segment_bytes))
    c = mt.Communicator(comm.mpi_comm, shared_memory=False)
    try:
        check(c, collective, algorithm)
    finally:
        c.free()


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", list(layouts(8)))
def test_hierarchical_layouts(rendezvous: pytest.MonkeyPatch, comm: mt.Communicator,
                              layout: str) -> None:
    """The hierarchical collectives across emulated nodes; the allreduce also with
    every local rank crossing, tiny segments, and pipelined in pieces (two nodes)."""
    ids = layouts(comm.size).get(layout)
    if ids is None:
        pytest.skip(f"layout {layout} equals another one at {comm.size} ranks")
    c = with_nodes(comm.mpi_comm, ids)
    try:
        for collective in POINT_TO_POINT:
            check(c, collective, "hierarchical")
        rendezvous.setattr(hierarchical, "PIECE_BYTES", 64)
        rendezvous.setattr(hierarchical, "MAX_PIECES", 5)
        with configured(c, segment_bytes=24, cross_ranks=0):
            check(c, "allreduce", "hierarchical")
    finally:
        c.free()


@pytest.mark.many_ranks
@pytest.mark.power_of_two
@pytest.mark.mpi(min_size=1)
def test_adasum(rendezvous: pytest.MonkeyPatch, comm: mt.Communicator) -> None:
    """Adasum's exchanges (power-of-two rank counts) against the pairwise formula."""
    if comm.size & (comm.size - 1):
        pytest.skip("Adasum runs on power-of-two rank counts")
    c = mt.Communicator(comm.mpi_comm)
    try:
        for count in (1, 1001, 20_003):
            xs = [np.random.default_rng(r + count).standard_normal(count) for r in range(c.size)]
            got = c.allreduce(xs[c.rank], op=mt.Adasum)
            want = adasum_reference(xs)
            err = float(np.max(np.abs(got - want)))
            assert_all_ranks(c, err <= 1e-12 * max(1.0, float(np.max(np.abs(want)))),
                             f"adasum n={count}: off by {err}")
    finally:
        c.free()
