"""The single-copy algorithm (ranks read each other's buffers with process_vm_readv):
every dtype and size against numpy, stripes, in place, and the collective probe that
turns it off on every rank when any rank cannot or will not use it."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import pytest
from helpers import DTYPES, assert_all_ranks, check_allgather, check_allreduce, ops_for
from helpers import check_reduce_scatter as check_rs
from mpi4py import MPI

import mpitrain as mt
from mpitrain.errors import ArgumentError

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


@pytest.fixture
def single(comm: mt.Communicator) -> Iterator[mt.Communicator]:
    """``comm`` where the single-copy algorithm can run (skipped where it cannot)."""
    shm = comm.dispatcher.shm
    able = shm is not None and shm.single_copy
    assert_all_ranks(comm, all(comm.mpi_comm.allgather(able)) or
                     not any(comm.mpi_comm.allgather(able)), "ranks disagree on single copy")
    if not able:
        pytest.skip("single copy is not available here: "
                    + (shm.single_copy_reason if shm is not None else "no shared memory"))
    yield comm


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_every_dtype_and_op(single: mt.Communicator, dtype: str, op: mt.ReduceOp) -> None:
    n = single.size
    check_allreduce(single, "single_copy", dtype, op, [0, 1, n - 1, 840, 1001, 70_001])
    check_rs(single, "single_copy", dtype, op, [0, 1, n - 1, 840, 1001])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_every_dtype(single: mt.Communicator, dtype: str) -> None:
    check_allgather(single, "single_copy", dtype, [0, 1, single.size + 2, 840, 1001, 40_000])


@pytest.mark.mpi(min_size=2)
def test_stripes_and_in_place(single: mt.Communicator, configure: Callable[..., Any]) -> None:
    """Many stripes (a 64-byte segment), Average with scaling, in place."""
    configure(segment_bytes="64")
    for dtype in ("float64", "float16", "int32"):
        check_allreduce(single, "single_copy", dtype, mt.Sum, [single.size + 1, 840, 999])
        check_rs(single, "single_copy", dtype, mt.Max, [840, 1001])
    rank, size = single.rank, single.size
    x = np.arange(5000, dtype=np.float64) + rank
    y = single.allreduce_(x, op=mt.Average, algorithm="single_copy", prescale_factor=2.0)
    want = (np.arange(5000) * size + size * (size - 1) / 2) * 2.0 / size
    assert_all_ranks(single, y is x and np.allclose(x, want), "in-place Average")


def _fresh(env: pytest.MonkeyPatch, off_on: set[int]) -> mt.Communicator:
    """A new communicator over every rank, MPITRAIN_SINGLE_COPY=0 on the ranks
    ``off_on`` (their environment only)."""
    if MPI.COMM_WORLD.Get_rank() in off_on:
        env.setenv("MPITRAIN_SINGLE_COPY", "0")
    else:
        env.delenv("MPITRAIN_SINGLE_COPY", raising=False)
    return mt.Communicator(MPI.COMM_WORLD)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("off_on", ["all", "last"])
def test_off_on_any_rank_is_off_on_every_rank(comm: mt.Communicator,
                                               env: pytest.MonkeyPatch, off_on: str) -> None:
    """The fallback: single_copy is offered nowhere, auto still gives right answers,
    and asking for it by name fails alike on every rank."""
    size = comm.size
    own = _fresh(env, set(range(size)) if off_on == "all" else {size - 1})
    try:
        shm = own.dispatcher.shm
        seen = own.mpi_comm.allgather(shm is not None and shm.single_copy)
        assert_all_ranks(own, not any(seen), f"single copy on: {seen}")
        for collective in COLLECTIVES:
            assert_all_ranks(own, "single_copy" not in own.algorithms(collective),
                             f"{collective} still offers single_copy")
        raised = False
        try:
            own.allreduce(np.ones(10), algorithm="single_copy")
        except ArgumentError:
            raised = True
        assert_all_ranks(own, raised, "asking for single_copy did not raise")
        check_allreduce(own, "auto", "float32", mt.Sum, [1 << 20])
        check_allgather(own, "auto", "float64", [100_000])
    finally:
        own.free()
