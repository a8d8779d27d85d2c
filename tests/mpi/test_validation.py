"""Cross-rank validation: disagreeing calls raise MismatchError on every rank, never hang.

Every case runs on the default communicator (shared-memory exchange on one node) and
on one without shared memory (the MPI_Allgather exchange), and is followed by a call
that must succeed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from helpers import assert_equal_all_ranks, crafted, expect_mismatch, reference
from mpi4py import MPI

import mpitrain as mt


@pytest.fixture(scope="module", params=["shm", "mpi"])
def vcomm(request: pytest.FixtureRequest) -> Iterator[mt.Communicator]:
    """The default communicator, then one that validates through MPI_Allgather."""
    if request.param == "shm":
        yield mt.init()
        return
    other = mt.Communicator(MPI.COMM_WORLD, shared_memory=False)
    yield other
    other.free()


def odd(comm: mt.Communicator) -> bool:
    """True on the last rank: the one that disagrees."""
    return comm.rank == comm.size - 1


CASES: dict[str, tuple[Callable[[mt.Communicator], Any], str]] = {
    "dtype": (lambda c: c.allreduce(np.ones(1024, np.float64 if odd(c) else np.float32)),
              r"rank {last} sent float64\[1024\], rank 0 sent float32\[1024\]"),
    "count": (lambda c: c.allreduce(np.ones(1024 + odd(c), np.float32)),
              r"rank {last} sent float32\[1025\], rank 0 sent float32\[1024\]"),
    "small vs large": (lambda c: c.allreduce(np.ones(1 << 20 if odd(c) else 4, np.float32)),
                       r"rank {last} sent float32\[1048576\], rank 0 sent float32\[4\]"),
    "shape": (lambda c: c.allreduce(np.ones((3, 4) if odd(c) else (2, 6), np.float32)),
              r"rank {last} sent float32\[3, 4\], rank 0 sent float32\[2, 6\]"),
    "op": (lambda c: c.allreduce(np.ones(8), op=mt.Max if odd(c) else mt.Sum),
           r"rank {last} sent op max, rank 0 sent op sum"),
    "prescale": (lambda c: c.allreduce(np.ones(8), prescale_factor=2.0 if odd(c) else 1.0),
                 r"rank {last} sent scaling prescale 2 postscale 1, rank 0 sent scaling "
                 r"prescale 1"),
    "name": (lambda c: c.allreduce(np.ones(8), name="w" if odd(c) else "b"),
             r"rank {last} sent name 'w', rank 0 sent name 'b'"),
    "algorithm": (lambda c: c.allreduce(np.ones(8), algorithm="mpi" if odd(c) else "ring"),
                  r"rank {last} sent algorithm mpi, rank 0 sent algorithm ring"),
    "collective": (lambda c: c.barrier() if odd(c) else c.allreduce(np.ones(8)),
                   r"rank {last} called barrier, rank 0 called allreduce"),
    "root": (lambda c: c.broadcast(np.ones(8), root=c.size - 1 if odd(c) else 0),
             r"rank {last} sent root {last}, rank 0 sent root 0"),
    "object root": (lambda c: c.broadcast_object(1, root=c.size - 1 if odd(c) else 0),
                    r"rank {last} sent root {last}, rank 0 sent root 0"),
    "reduce_scatter shape": (
        lambda c: c.reduce_scatter(np.ones((6, 2 + odd(c)), np.int64)),
        r"rank {last} sent int64\[6, 3\], rank 0 sent int64\[6, 2\]"),
    "allgather dtype": (lambda c: c.allgather(np.ones((2, 3), np.float64 if odd(c)
                                                       else np.float32)),
                        r"rank {last} sent float64\[\*, 3\], rank 0 sent float32\[\*, 3\]"),
    "allgather trailing": (lambda c: c.allgather(np.ones((2, 3 + odd(c)), np.int8)),
                           r"rank {last} sent int8\[\*, 4\], rank 0 sent int8\[\*, 3\]"),
    "zero-size on one rank": (lambda c: c.allreduce(np.ones(0 if odd(c) else 3)),
                              r"rank {last} sent float64\[0\], rank 0 sent float64\[3\]"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatch_raises_on_every_rank(vcomm: mt.Communicator, case: str) -> None:
    call, pattern = CASES[case]
    expect_mismatch(vcomm, lambda: call(vcomm), pattern.format(last=vcomm.size - 1))


@pytest.mark.mpi(min_size=3)
def test_mismatch_names_every_odd_rank(vcomm: mt.Communicator) -> None:
    expect_mismatch(vcomm, lambda: vcomm.allreduce(np.ones(4, np.int8 if vcomm.rank else
                                                           np.int16)),
                    r"ranks 1, 2(, \d)* sent int8\[4\], rank 0 sent int16\[4\]")


@pytest.mark.mpi(min_size=1)
def test_collectives_without_shared_memory(vcomm: mt.Communicator) -> None:
    """Every collective through the exchange of this communicator (rows included)."""
    n, r = vcomm.size, vcomm.rank
    x = crafted(r, 1001, "float32", mt.Sum)
    assert_equal_all_ranks(vcomm, vcomm.allreduce(x), reference(n, 1001, "float32", mt.Sum),
                           "allreduce")
    assert_equal_all_ranks(vcomm, vcomm.reduce_scatter(x),
                           np.array_split(reference(n, 1001, "float32", mt.Sum), n)[r],
                           "reduce_scatter")
    got = vcomm.allgather(np.full((r + 1, 2), r, np.int64))
    want = np.concatenate([np.full((q + 1, 2), q, np.int64) for q in range(n)])
    assert_equal_all_ranks(vcomm, got, want, "allgather")
    assert_equal_all_ranks(vcomm, vcomm.broadcast(x, root=n - 1),
                           crafted(n - 1, 1001, "float32", mt.Sum), "broadcast")
    vcomm.barrier()
    assert vcomm.allgather_object(r) == list(range(n))
    assert vcomm.broadcast_object(r, root=n - 1) == n - 1


@pytest.mark.mpi(min_size=2)
def test_check_switch(comm: mt.Communicator, env: pytest.MonkeyPatch,
                      configure: Callable[..., Any]) -> None:
    """MPITRAIN_CHECK=0 (or check=False) skips the exchange of calls that need none."""
    def refuse(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("validated although checking is off")

    x = np.ones(100_000, np.float32)
    saved = configure(check=False)
    env.setattr(comm.dispatcher.validator, "exchange", refuse)
    for algorithm in ("ring", "mpi", "rabenseifner"):
        assert_equal_all_ranks(comm, comm.allreduce(x, algorithm=algorithm),
                               x * comm.size, f"unchecked {algorithm}")
    env.undo()
    configure(saved)
    env.setattr(comm.dispatcher.validator, "exchange", refuse)
    with pytest.raises(AssertionError, match="validated although"):
        comm.allreduce(x, algorithm="ring")
    env.undo()
    unchecked = mt.Communicator(MPI.COMM_WORLD, check=False)
    try:
        env.setattr(unchecked.dispatcher.validator, "exchange", refuse)
        assert_equal_all_ranks(unchecked, unchecked.allreduce(x, algorithm="ring"),
                               x * comm.size, "check=False")
    finally:
        env.undo()
        unchecked.free()
