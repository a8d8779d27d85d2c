"""Allgather (row counts may differ by rank), broadcast, barrier, object collectives."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import assert_all_ranks, assert_equal_all_ranks, crafted, dtype_params, host_algorithms

import mpitrain as mt

ALLGATHER = ["auto", *host_algorithms("allgather")]
BROADCAST = ["auto", *host_algorithms("broadcast")]


def rows_of(rank: int, base: int) -> int:
    return max(base - rank, 0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALLGATHER)
@pytest.mark.parametrize("dtype", dtype_params(many_ranks={"float32", "int8", "bfloat16"}))
def test_allgather_uneven_rows(comm: mt.Communicator, algorithm: str, dtype: str) -> None:
    bases = (0, 1, comm.size - 1, 1001) + ((100_003,) if dtype == "int16" else ())
    for base in bases:
        def block(r: int, base: int = base) -> np.ndarray:
            return crafted(r, rows_of(r, base) * 2, dtype, mt.Sum).reshape(-1, 2)

        y = comm.allgather(block(comm.rank), algorithm=algorithm)
        expected = np.concatenate([block(r) for r in range(comm.size)])
        assert_equal_all_ranks(comm, y, expected, f"allgather {algorithm} base={base}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_allgather_segments(comm: mt.Communicator, configure: Callable[..., Any],
                            algorithm: str) -> None:
    configure(segment_bytes="8")
    for per_rank in (5, 37):
        y = comm.allgather(np.arange(comm.rank * per_rank, dtype=np.int16), algorithm=algorithm)
        expected = np.concatenate([np.arange(r * per_rank, dtype=np.int16)
                                   for r in range(comm.size)])
        assert_equal_all_ranks(comm, y, expected, f"segmented {algorithm} allgather")


@pytest.mark.mpi(min_size=2)
def test_allgather_mismatch_raises_everywhere(comm: mt.Communicator) -> None:
    dtype = np.float64 if comm.rank == comm.size - 1 else np.float32
    with pytest.raises(mt.MismatchError, match=f"rank {comm.size - 1} sent float64"):
        comm.allgather(np.zeros((2, 3), dtype))
    with pytest.raises(mt.MismatchError):
        comm.allgather(np.zeros((2, 3 + (comm.rank == 0)), np.float32))
    y = comm.allgather(np.ones(1, np.int8))  # still usable
    assert y.sum() == comm.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", BROADCAST)
@pytest.mark.parametrize("dtype", dtype_params(many_ranks={"float64"}))
def test_broadcast_from_every_root(comm: mt.Communicator, algorithm: str, dtype: str) -> None:
    for root in range(comm.size):
        for count in (0, 1, 1001):
            x = crafted(comm.rank, count, dtype, mt.Sum).reshape(-1)
            y = comm.broadcast(x, root=root, algorithm=algorithm)
            assert_equal_all_ranks(comm, y, crafted(root, count, dtype, mt.Sum),
                                   f"broadcast {algorithm} root={root}")
            comm.broadcast_(x, root=root, algorithm=algorithm)
            assert_equal_all_ranks(comm, x, crafted(root, count, dtype, mt.Sum),
                                   f"broadcast_ {algorithm} root={root}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", BROADCAST)
def test_broadcast_large(comm: mt.Communicator, configure: Callable[..., Any],
                         algorithm: str) -> None:
    for segment in ("", "1000"):  # default stripes, then many small ones
        configure(segment_bytes=segment)
        x = crafted(comm.rank, 300_007, "float32", mt.Sum)
        comm.broadcast_(x, root=comm.size - 1, algorithm=algorithm)
        assert_equal_all_ranks(comm, x, crafted(comm.size - 1, 300_007, "float32", mt.Sum),
                               f"broadcast_ {algorithm} segment={segment!r}")


@pytest.mark.mpi(min_size=1)
def test_objects_and_barrier(comm: mt.Communicator) -> None:
    comm.barrier()
    mt.barrier()
    got = comm.broadcast_object({"rank": comm.rank, "data": [1, 2]}, root=comm.size - 1)
    assert got == {"rank": comm.size - 1, "data": [1, 2]}
    assert comm.allgather_object(("r", comm.rank)) == [("r", r) for r in range(comm.size)]
    assert mt.allgather_object(comm.rank) == list(range(comm.size))
    assert mt.broadcast_object("x" * comm.rank) == ""


@pytest.mark.mpi(min_size=1)
def test_topology(comm: mt.Communicator) -> None:
    """One host: every rank is local; the cross communicator is one rank."""
    assert 0 <= comm.local_rank < comm.local_size
    assert 0 <= comm.cross_rank < comm.cross_size
    table = comm.allgather_object((comm.local_rank, comm.cross_rank))
    assert len(set(table)) == comm.size, "local/cross ranks must identify a rank uniquely"
    assert comm.local_size * comm.topology.node_count >= comm.size


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALLGATHER)
def test_allgather_into_out(comm: mt.Communicator, algorithm: str) -> None:
    for base in (0, 1, 1001):
        def block(r: int, base: int = base) -> np.ndarray:
            return crafted(r, rows_of(r, base) * 2, "int32", mt.Sum).reshape(-1, 2)

        expected = np.concatenate([block(r) for r in range(comm.size)])
        out = np.full(expected.shape, -7, np.int32)  # poisoned
        y = comm.allgather(block(comm.rank), algorithm=algorithm, out=out)
        assert_all_ranks(comm, y is out, f"allgather {algorithm} returns out=")
        assert_equal_all_ranks(comm, out, expected, f"allgather {algorithm} out= base={base}")


@pytest.mark.mpi(min_size=1)
def test_allgather_out_misuse_raises_everywhere(comm: mt.Communicator) -> None:
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"out= must be a float32\["):
        comm.allgather(x, out=np.zeros((2 * comm.size, 3), np.float64))
    # every rank passes the same wrong row count: all of them raise, after agreeing
    with pytest.raises(ValueError, match=f"out= has {2 * comm.size + 1} rows, but the ranks "
                                         f"send {2 * comm.size} rows"):
        comm.allgather(x, out=np.zeros((2 * comm.size + 1, 3), np.float32))
    if comm.size > 1:  # ranks disagree on out=: a mismatch, on every rank
        rows = 2 * comm.size + (comm.rank == 0)
        with pytest.raises(mt.MismatchError):
            comm.allgather(x, out=np.zeros((rows, 3), np.float32))
        with pytest.raises(mt.MismatchError):
            comm.allgather(x, out=np.zeros((2 * comm.size, 3), np.float32)
                           if comm.rank == 0 else None)
    assert comm.allgather(x).shape == (2 * comm.size, 3)  # still usable


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALLGATHER)
@pytest.mark.parametrize("rows", [1, 7, 50_001])
def test_allgather_equal_blocks(comm: mt.Communicator, algorithm: str, rows: int) -> None:
    """Every rank sends as many rows (native: MPI_Allgather rather than Allgatherv)."""
    def block(r: int) -> np.ndarray:
        return crafted(r, rows * 3, "float32", mt.Sum).reshape(rows, 3)

    expected = np.concatenate([block(r) for r in range(comm.size)])
    assert_equal_all_ranks(comm, comm.allgather(block(comm.rank), algorithm=algorithm),
                           expected, f"allgather {algorithm} of equal blocks, rows={rows}")
