"""Reduce-scatter: this rank's np.array_split block of the reduction, every case."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import (
    MANY_RANKS_CASES,
    assert_all_ranks,
    assert_equal_all_ranks,
    check_reduce_scatter,
    crafted,
    dtype_op_cases,
    host_algorithms,
    reference,
)

import mpitrain as mt

ALGORITHMS = ["auto", *host_algorithms("reduce_scatter")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,op", dtype_op_cases(many_ranks=MANY_RANKS_CASES))
def test_reduce_scatter_matches_reference(comm: mt.Communicator, algorithm: str, dtype: str,
                                          op: mt.ReduceOp) -> None:
    """0, 1 and fewer rows than ranks; 840 rows: equal blocks at every rank count 1..8;
    1001: uneven at every one."""
    check_reduce_scatter(comm, algorithm, dtype, op, sorted({0, 1, max(comm.size - 1, 0),
                                                             840, 1001}))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_large(comm: mt.Communicator, algorithm: str) -> None:
    """~200k elements, in uneven and in equal blocks (67_200 = 80 * 840 rows)."""
    width = 3
    for rows in (66_667, 67_200):
        x = crafted(comm.rank, rows * width, "float32", mt.Sum).reshape(rows, width)
        full = reference(comm.size, rows * width, "float32", mt.Sum).reshape(rows, width)
        assert_equal_all_ranks(comm, comm.reduce_scatter(x, algorithm=algorithm),
                               np.array_split(full, comm.size)[comm.rank],
                               f"reduce_scatter {algorithm} rows={rows}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["ring", "shm"])
def test_reduce_scatter_segments_and_1d(comm: mt.Communicator, configure: Callable[..., Any],
                                        algorithm: str) -> None:
    configure(segment_bytes="16")
    for count in (comm.size - 1, 50, 840, 1001):
        for op in (mt.Sum, mt.Min):
            x = crafted(comm.rank, count, "float64", op)
            y = comm.reduce_scatter(x, op=op, algorithm=algorithm)
            expected = np.array_split(reference(comm.size, count, "float64", op),
                                      comm.size)[comm.rank]
            assert_equal_all_ranks(comm, y, expected,
                                   f"segmented {algorithm} reduce_scatter n={count} {op}")


@pytest.mark.mpi(min_size=1)
def test_reduce_scatter_average_and_scaling(comm: mt.Communicator) -> None:
    x = crafted(comm.rank, 40, "float64", mt.Sum).reshape(20, 2)
    y = comm.reduce_scatter(x, op=mt.Average, prescale_factor=2.0)
    full = reference(comm.size, 40, "float64", mt.Sum).reshape(20, 2) * 2.0 / comm.size
    assert np.allclose(y, np.array_split(full, comm.size)[comm.rank], rtol=1e-12)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reduce_scatter_into_out(comm: mt.Communicator, algorithm: str) -> None:
    for rows in (0, comm.size + 1, 1001):
        x = crafted(comm.rank, rows * 2, "float64", mt.Sum).reshape(rows, 2)
        mine = np.array_split(reference(comm.size, rows * 2, "float64", mt.Sum)
                              .reshape(rows, 2), comm.size)[comm.rank]
        out = np.full(mine.shape, np.nan)  # poisoned: an unwritten element fails
        y = comm.reduce_scatter(x, algorithm=algorithm, out=out)
        assert_all_ranks(comm, y is out, f"reduce_scatter {algorithm} returns out=")
        assert_equal_all_ranks(comm, out, mine, f"reduce_scatter {algorithm} out= rows={rows}")
    with pytest.raises(ValueError, match=r"out= must be a float64\["):
        comm.reduce_scatter(np.zeros((comm.size, 2)), out=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.reduce_scatter(np.zeros((comm.size, 2)), out=np.zeros((1, 4))[:, ::2])
