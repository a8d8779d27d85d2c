"""Allreduce: algorithm x dtype x op x element count, at whatever rank count runs it."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from helpers import (
    DTYPES,
    MANY_RANKS_CASES,
    assert_all_ranks,
    assert_equal_all_ranks,
    check_allreduce,
    crafted,
    dtype_op_cases,
    host_algorithms,
    reference,
)
from mpi4py import MPI

import mpitrain as mt

ALGORITHMS = ["auto", *host_algorithms("allreduce")]
SEGMENTED = ["ring", "shm"]  # algorithms with a pipeline that MPITRAIN_SEGMENT_BYTES cuts


def counts(size: int) -> list[int]:
    """0, 1, fewer than ranks, divisible by every rank count 1..8 (equal chunks, and
    equal blocks of every butterfly), and divisible by none of 2..8 (uneven chunks)."""
    return sorted({0, 1, max(size - 1, 0), 840, 1001})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype,op", dtype_op_cases(many_ranks=MANY_RANKS_CASES))
def test_allreduce_matches_reference(comm: mt.Communicator, algorithm: str, dtype: str,
                                     op: mt.ReduceOp) -> None:
    """Out of place (the input untouched) and in place, at every count of :func:`counts`."""
    check_allreduce(comm, algorithm, dtype, op, counts(comm.size))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_large(comm: mt.Communicator, algorithm: str) -> None:
    """Buffers of ~200k elements: several segments or stripes per chunk, in uneven
    chunks and in equal ones (201_600 = 240 * 840: equal at every rank count 1..8)."""
    for count, dtype, op in ((200_003, "float32", mt.Sum), (201_600, "int16", mt.Max)):
        x = crafted(comm.rank, count, dtype, op)
        expected = reference(comm.size, count, dtype, op)
        assert_equal_all_ranks(comm, comm.allreduce(x, op=op, algorithm=algorithm), expected,
                               f"allreduce {algorithm} {dtype} n={count}")
        assert_equal_all_ranks(comm, comm.allreduce_(x, op=op, algorithm=algorithm), expected,
                               f"allreduce_ {algorithm} {dtype} n={count}")


@pytest.mark.mpi(min_size=1)
def test_allreduce_million(comm: mt.Communicator) -> None:
    x = crafted(comm.rank, 1_000_003, "float32", mt.Sum)
    assert_equal_all_ranks(comm, comm.allreduce_(x), reference(comm.size, 1_000_003, "float32",
                                                               mt.Sum), "allreduce_ 1e6")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", SEGMENTED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_segments(comm: mt.Communicator, configure: Callable[..., Any],
                           algorithm: str, dtype: str) -> None:
    """Tiny segments reach the multi-segment pipeline (or stripes) with uneven chunks;
    Average's scaling rides the last reduction of each stripe."""
    configure(segment_bytes="24")
    for count in (comm.size - 1, 37, 840, 1001):
        for op in (mt.Sum, mt.Product, mt.Average):
            x = crafted(comm.rank, count, dtype, op)
            y = comm.allreduce(x, op=op, algorithm=algorithm)
            assert_equal_all_ranks(comm, y, reference(comm.size, count, dtype, op),
                                   f"segmented {algorithm} n={count} {op}")
            comm.allreduce_(x, op=op, algorithm=algorithm)
            assert_equal_all_ranks(comm, x, reference(comm.size, count, dtype, op),
                                   f"segmented in-place {algorithm} n={count} {op}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_scaling_factors(comm: mt.Communicator, algorithm: str) -> None:
    x = crafted(comm.rank, 1001, "float64", mt.Sum)
    y = comm.allreduce(x, op=mt.Average, algorithm=algorithm, prescale_factor=0.5,
                       postscale_factor=3.0)
    expected = reference(comm.size, 1001, "float64", mt.Sum) * 0.5 * 3.0 / comm.size
    assert np.allclose(y, expected, rtol=1e-12)
    ints = crafted(comm.rank, 1001, "int64", mt.Sum)
    got = comm.allreduce(ints, op="sum", algorithm=algorithm, postscale_factor=0.25)
    want = np.floor(reference(comm.size, 1001, "int64", mt.Sum) * 0.25).astype(np.int64)
    assert_equal_all_ranks(comm, got, want, "integer postscale rounds toward -inf")


@pytest.mark.mpi(min_size=1)
def test_shapes_out_and_noncontiguous(comm: mt.Communicator) -> None:
    base = crafted(comm.rank, 4 * 6, "float32", mt.Sum).reshape(4, 6)
    expected = reference(comm.size, 24, "float32", mt.Sum).reshape(4, 6)
    out = np.empty((4, 6), np.float32)
    assert comm.allreduce(base, out=out) is out
    assert_equal_all_ranks(comm, out, expected, "out=")
    strided = np.asfortranarray(base)
    assert_equal_all_ranks(comm, comm.allreduce(strided), expected, "fortran-ordered input")
    view = base.T  # non-contiguous, reduced through a copy that is written back
    assert comm.allreduce_(view) is view
    assert_equal_all_ranks(comm, base, expected, "allreduce_ on a transposed view")
    scalar = np.float64(comm.rank + 1)
    total = comm.allreduce(np.asarray(scalar))
    assert total.shape == () and total == comm.size * (comm.size + 1) / 2


@pytest.mark.mpi(min_size=1)
def test_module_level_shortcuts(comm: mt.Communicator) -> None:
    assert mt.init() is comm and mt.is_initialized()
    assert (mt.rank(), mt.size()) == (comm.rank, comm.size)
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)  # MPI's own view of the nodes
    try:
        local_ranks = MPI.COMM_WORLD.allgather(node.Get_rank())
        want = (node.Get_rank(), node.Get_size(), local_ranks.count(node.Get_rank()))
    finally:
        node.Free()
    got = (mt.local_rank(), mt.local_size(), mt.cross_size())
    assert_all_ranks(comm, got == want, f"local rank, local size, cross size {got}, want {want}")
    x = np.full(3, comm.rank, np.int32)
    assert_equal_all_ranks(comm, mt.allreduce(x, mt.Max), np.full(3, comm.size - 1, np.int32),
                           "mt.allreduce")
    mt.allreduce_(x, "min")
    assert_equal_all_ranks(comm, x, np.zeros(3, np.int32), "mt.allreduce_")
