"""Every collective x algorithm x dtype x op across emulated hosts, against references.

``auto`` only picks among these; test_auto_goes_hierarchical_across_nodes checks its
choice.

Sizes: empty, one element, fewer elements than ranks, and not divisible by any rank
or node count; larger sizes for a few dtypes, and tiny pipeline segments to reach the
segmented paths with small buffers.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import (
    DTYPES,
    Checks,
    assert_all_ranks,
    assert_equal_all_ranks,
    check_allgather,
    check_allreduce,
    check_reduce_scatter,
    crafted,
    ops_for,
    reference,
)

import mpitrain as mt
from mpitrain.algorithms import ALGORITHMS as REGISTERED
from mpitrain.algorithms import REGISTRY
from mpitrain.backends import NUMPY

CASES = [(d, o) for d in DTYPES for o in ops_for(d)]
# Across hosts only the algorithms that do not need one node's shared memory run.
ALGORITHMS = {c: tuple(a for a in algos if not REGISTRY[c][a].needs_shared_memory
                       and not REGISTRY[c][a].device_only)
              for c, algos in REGISTERED.items()}
IDS = [f"{d}-{o.value}" for d, o in CASES]


def counts(comm: mt.Communicator) -> list[int]:
    return sorted({0, 1, max(comm.size - 1, 0), 1001})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allreduce"])
@pytest.mark.parametrize("dtype,op", CASES, ids=IDS)
def test_allreduce(comm: mt.Communicator, algorithm: str, dtype: str, op: mt.ReduceOp) -> None:
    check_allreduce(comm, algorithm, dtype, op, counts(comm))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
@pytest.mark.parametrize("dtype,op", CASES, ids=IDS)
def test_reduce_scatter(comm: mt.Communicator, algorithm: str, dtype: str,
                        op: mt.ReduceOp) -> None:
    check_reduce_scatter(comm, algorithm, dtype, op, counts(comm))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS["allgather"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm: mt.Communicator, algorithm: str, dtype: str) -> None:
    check_allgather(comm, algorithm, dtype, counts(comm))


LARGE = [(c, a) for c in ("allreduce", "reduce_scatter", "allgather") for a in ALGORITHMS[c]]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("collective,algorithm", LARGE, ids=[f"{c}-{a}" for c, a in LARGE])
def test_large(comm: mt.Communicator, collective: str, algorithm: str) -> None:
    for dtype, op in (("float32", mt.Sum), ("bfloat16", mt.Max), ("int64", mt.Product)):
        if collective == "allreduce":
            check_allreduce(comm, algorithm, dtype, op, [300_007])
        elif collective == "reduce_scatter":
            check_reduce_scatter(comm, algorithm, dtype, op, [100_003])
        else:
            check_allgather(comm, algorithm, dtype, [50_001])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm: mt.Communicator, dtype: str) -> None:
    checks = Checks(comm)
    for root in range(comm.size):
        x = crafted(comm.rank, 1001, dtype, mt.Sum)
        checks.equal(comm.broadcast(x, root=root), crafted(root, 1001, dtype, mt.Sum),
                     f"broadcast root={root}")
    checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cross", ["0", "1"])
def test_hierarchical_crossing_ranks(comm: mt.Communicator, configure: Callable[..., Any],
                                     cross: str) -> None:
    """Each node's sum through its first rank, and every local rank's shard in parallel."""
    configure(cross_ranks=cross)
    for dtype, op in (("float32", mt.Sum), ("int64", mt.Product)):
        check_allreduce(comm, "hierarchical", dtype, op, [comm.size - 1, 1001, 300_007])


@pytest.mark.mpi(min_size=1)
def test_hierarchical_segmented(comm: mt.Communicator, configure: Callable[..., Any]) -> None:
    """Tiny pipeline segments: many segments in every phase, intra- and inter-node."""
    configure(segment_bytes="40")
    check_allreduce(comm, "hierarchical", "float32", mt.Sum, [comm.size - 1, 1001])
    check_reduce_scatter(comm, "hierarchical", "int16", mt.Sum, [37, 333])
    check_allgather(comm, "hierarchical", "uint8", [37, 401])


@pytest.mark.mpi(min_size=1)
def test_auto_goes_hierarchical_across_nodes(comm: mt.Communicator) -> None:
    """auto picks hierarchical for a large allreduce when the job spans nodes, on every
    rank alike, and gets the same bits as the flat ring."""
    count = 1 << 20
    name = comm.dispatcher.algorithm("allreduce", "auto", count * 4, NUMPY, np.dtype(np.float32))
    spans = comm.topology.node_count > 1
    assert_all_ranks(comm, (name == "hierarchical") == spans, f"auto chose {name}")
    assert_all_ranks(comm, len(set(comm.allgather_object(name))) == 1, "ranks disagree")
    x = crafted(comm.rank, count, "float32", mt.Sum)
    got = comm.allreduce(x, op=mt.Average)
    flat = comm.allreduce(x, op=mt.Average, algorithm="ring")
    want = reference(comm.size, count, "float32", mt.Average)
    assert_equal_all_ranks(comm, got, want, "auto average")
    assert_all_ranks(comm, bool(np.array_equal(got, flat)), "auto differs from ring")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", sorted(REGISTERED))
def test_shared_memory_algorithms_refuse_several_hosts(comm: mt.Communicator,
                                                       collective: str) -> None:
    """Every rank raises the same error (the node count is the same everywhere)."""
    assert comm.topology.node_count > 1
    x = np.ones(comm.size * 2, np.float32)
    call = {"allreduce": lambda a: comm.allreduce(x, algorithm=a),
            "reduce_scatter": lambda a: comm.reduce_scatter(x, algorithm=a),
            "allgather": lambda a: comm.allgather(x, algorithm=a),
            "broadcast": lambda a: comm.broadcast(x, algorithm=a)}[collective]
    for algorithm in sorted(a for a in REGISTERED[collective]
                            if REGISTRY[collective][a].needs_shared_memory
                            and not REGISTRY[collective][a].device_only):
        with pytest.raises(ValueError, match=f"the {algorithm} {collective} needs every rank "
                                             "on one node"):
            call(algorithm)
    assert_equal_all_ranks(comm, comm.allreduce(x), x * comm.size, "still usable")
