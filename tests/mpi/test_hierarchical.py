"""Hierarchical collectives on one host, with the ranks grouped into emulated nodes.

``Topology.from_node_ids`` lets any grouping of ranks act as the node split, so the
multi-node code paths (uneven nodes, nodes that are not contiguous rank ranges, one
rank per node) run in the normal suite. The full dtype x op matrix runs on one
uneven layout; every layout runs a few dtypes and sizes, also at 6, 7 and 8 ranks
(nodes of 3 and 4 ranks, 3 and 4 nodes). tests/cluster runs the same checks across
emulated hosts.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_all_ranks,
    assert_equal_all_ranks,
    check_allgather,
    check_allreduce,
    check_reduce_scatter,
    configured,
    crafted,
    layouts,
    ops_for,
    reference,
    with_nodes,
)
from mpi4py import MPI

import mpitrain as mt
from mpitrain.algorithms import PlanRequest, hierarchical
from mpitrain.algorithms.segmented_doubling import SegmentedDoublingAllreduce
from mpitrain.backends import NUMPY

CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


LAYOUTS = list(layouts(5))


@pytest.fixture(scope="module", params=LAYOUTS)
def emulated(request: pytest.FixtureRequest) -> Iterator[tuple[mt.Communicator, list[int]]]:
    """A communicator over every rank whose topology is the layout's grouping, and the
    layout (node id of each rank)."""
    ids = layouts(MPI.COMM_WORLD.Get_size()).get(request.param)
    if ids is None:
        pytest.skip(f"layout {request.param} equals another one at this size")
    c = with_nodes(MPI.COMM_WORLD, ids)
    yield c, ids
    c.free()


Emulated = tuple[mt.Communicator, list[int]]


def expected_nodes(ids: list[int]) -> list[tuple[int, ...]]:
    """The ranks of each node, nodes ordered by their lowest rank."""
    groups = [tuple(r for r in range(len(ids)) if ids[r] == i) for i in set(ids)]
    return sorted(groups)


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=1)
def test_topology_of_layout(emulated: Emulated) -> None:
    c, ids = emulated
    topo, want = c.topology, expected_nodes(ids)
    node = want[c.cross_rank]
    ok = (list(topo.nodes) == want and node.index(c.rank) == c.local_rank
          and c.local_size == len(node) and c.cross_size == len(want) == topo.node_count
          and topo.homogeneous == (len({len(m) for m in want}) == 1)
          and topo.min_local_size == min(len(m) for m in want))
    assert_all_ranks(c, ok, f"local {c.local_rank}/{c.local_size} cross {c.cross_rank}/"
                            f"{c.cross_size} nodes {topo.nodes}, want {want}")
    # The cross communicator joins this local rank of every node that has it, in node order.
    members = topo.cross_comm.allgather(c.cross_rank)
    expected = [j for j, ranks in enumerate(want) if len(ranks) > c.local_rank]
    assert_all_ranks(c, members == expected, f"cross members {members} != {expected}")


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=1)
def test_every_layout(emulated: Emulated) -> None:
    c, _ = emulated
    n = c.size
    for dtype, op in (("float64", mt.Sum), ("int8", mt.Product), ("bfloat16", mt.Max)):
        check_allreduce(c, "hierarchical", dtype, op, [0, 1, n - 1, 840, 1001, 100_003])
        check_reduce_scatter(c, "hierarchical", dtype, op, [0, 1, n - 1, 840, 33_337])
        check_allgather(c, "hierarchical", dtype, [0, 1, n - 1, 840, 20_001])


@pytest.mark.mpi(min_size=1)
def test_every_layout_segmented(emulated: Emulated) -> None:
    """Tiny pipeline segments reach the multi-segment paths of every phase."""
    with configured(emulated[0], segment_bytes="24") as c:
        check_allreduce(c, "hierarchical", "float32", mt.Sum, [c.size - 1, 37, 840, 1001])
        check_reduce_scatter(c, "hierarchical", "int16", mt.Sum, [37, 333, 840])
        check_allgather(c, "hierarchical", "uint8", [37, 401])


@pytest.mark.mpi(min_size=1)
def test_allreduce_in_pieces(emulated: Emulated, env: pytest.MonkeyPatch) -> None:
    """Small pieces reach the pipeline (one piece between nodes, the next inside)."""
    c, _ = emulated
    env.setattr(hierarchical, "PIECE_BYTES", 64)
    env.setattr(hierarchical, "MAX_PIECES", 5)
    check_allreduce(c, "hierarchical", "int16", mt.Sum, [c.size + 1, 97, 4099, 77_777])
    check_allreduce(c, "hierarchical", "float64", mt.Product, [4099])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cross", ["0", "1", "2", "9"])
def test_crossing_ranks(emulated: Emulated, env: pytest.MonkeyPatch, cross: str) -> None:
    """MPITRAIN_CROSS_RANKS: every node's sum through its first rank (1), through every
    rank in parallel (0, or more than the smallest node has), or through two; pipelined
    in pieces and not."""
    with configured(emulated[0], cross_ranks=cross) as c:
        check_allreduce(c, "hierarchical", "float64", mt.Sum, [1, c.size + 1, 1001, 100_003])
        env.setattr(hierarchical, "PIECE_BYTES", 64)
        env.setattr(hierarchical, "MAX_PIECES", 5)
        check_allreduce(c, "hierarchical", "int16", mt.Sum, [97, 4099])
        check_allreduce(c, "hierarchical", "bfloat16", mt.Max, [4099])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_dtype_op_matrix_uneven(comm: mt.Communicator, dtype: str, op: mt.ReduceOp) -> None:
    c = with_nodes(comm.mpi_comm, [min(r, 1) for r in range(comm.size)])  # 1 + rest
    try:
        n = c.size
        check_allreduce(c, "hierarchical", dtype, op, [1, n - 1, 840, 1001])
        check_reduce_scatter(c, "hierarchical", dtype, op, [n - 1, 101, 840])
        if op is mt.Sum:
            check_allgather(c, "hierarchical", dtype, [n - 1, 101])
    finally:
        c.free()


@pytest.mark.mpi(min_size=1)
def test_one_node_is_flat(comm: mt.Communicator) -> None:
    """On one host, hierarchical matches the reference under the default topology too."""
    n = comm.size
    check_allreduce(comm, "hierarchical", "float32", mt.Average, [0, n - 1, 1001])
    check_reduce_scatter(comm, "hierarchical", "int32", mt.Min, [0, n - 1, 1001])
    check_allgather(comm, "hierarchical", "complex64", [0, n - 1, 1001])
    assert comm.topology.node_count == 1


@pytest.mark.mpi(min_size=1)
def test_scaling_and_average(emulated: Emulated) -> None:
    c, _ = emulated
    x = crafted(c.rank, 1001, "float64", mt.Sum)
    y = c.allreduce(x, op=mt.Average, algorithm="hierarchical", prescale_factor=2.0)
    want = reference(c.size, 1001, "float64", mt.Sum) * 2.0 / c.size
    assert_all_ranks(c, bool(np.allclose(y, want, rtol=1e-12)), "scaled average")
    ints = crafted(c.rank, 1001, "int32", mt.Sum)
    got = c.allreduce(ints, op=mt.Average, algorithm="hierarchical")
    assert_equal_all_ranks(c, got, reference(c.size, 1001, "int32", mt.Average), "int avg")


@pytest.mark.mpi(min_size=1)
def test_auto_across_nodes(emulated: Emulated) -> None:
    """auto is hierarchical for a large allreduce exactly when the job spans nodes, and
    every rank runs the same algorithm."""
    c, _ = emulated
    x = crafted(c.rank, 1 << 20, "float32", mt.Sum)
    name = c.dispatcher.algorithm("allreduce", "auto", x.nbytes, NUMPY, x.dtype)
    assert_all_ranks(c, (name == "hierarchical") == (c.topology.node_count > 1), name)
    assert_all_ranks(c, len(set(c.allgather_object(name))) == 1, "ranks disagree")
    assert_equal_all_ranks(c, c.allreduce(x), reference(c.size, 1 << 20, "float32", mt.Sum),
                           "auto allreduce")


@pytest.mark.many_ranks
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_recursive_doubling(comm: mt.Communicator, dtype: str) -> None:
    """The inter-node allreduce on its own, at every rank count (folds when not 2**k)."""
    for segment in (0, 40):
        for count in (0, 1, comm.size - 1, 1001):
            req = PlanRequest(comm.dispatcher.transport, comm.topology, NUMPY, np.dtype(dtype),
                              mt.Sum, ((0, count),), 0, segment)
            plan = SegmentedDoublingAllreduce(req)
            x = crafted(comm.rank, count, dtype, mt.Sum)
            out = np.empty_like(x)
            plan.run(x, out)
            want = reference(comm.size, count, dtype, mt.Sum)
            assert_equal_all_ranks(comm, out, want, f"doubling n={count} seg={segment}")
            plan.run(x, x)
            assert_equal_all_ranks(comm, x, want, f"doubling in place n={count}")
