"""The small reduce-scatter fast path (mpitrain.dispatch.fastpath): same results, same
checks as the general path.

Blocking reduce-scatters with default arguments on small numpy arrays take a plan
cached per (dtype, shape, op, requested algorithm); these tests make sure they do, that
each rank's block matches numpy for every dtype and op (rows that do not divide
evenly, fewer rows than ranks, empty rows included), that ``out=`` and strided inputs
work, that the plan follows configuration changes, and that ranks that disagree still
raise MismatchError on every rank, whichever path each of them takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_equal_all_ranks,
    crafted,
    expect_last_rank_mismatch,
    fast_plan,
    ops_for,
    reference,
)

import mpitrain as mt
from mpitrain.dispatch.dispatcher import SLOT_BYTES
from mpitrain.dispatch.fastpath import SmallReduceScatter

CASES = [(d, o) for d in DTYPES for o in ops_for(d)]


def fast(comm: mt.Communicator, x: np.ndarray[Any, Any], op: Any = mt.Sum,
         algorithm: str | None = None) -> SmallReduceScatter:
    """The fast-path plan of ``x`` with ``op``; fails the test if there is none."""
    return fast_plan(comm, comm.dispatcher.small_reduce_scatter(x, op, algorithm), x)


def block(comm: mt.Communicator, full: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """This rank's rows of ``full``, as numpy's array_split cuts them."""
    return np.array_split(full, comm.size)[comm.rank]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype,op", CASES, ids=[f"{d}-{o.value}" for d, o in CASES])
def test_every_dtype_and_op_matches_numpy(comm: mt.Communicator, dtype: str,
                                          op: mt.ReduceOp) -> None:
    n, r = comm.size, comm.rank
    for rows in sorted({1, max(n - 1, 1), n, 2 * n + 1, 37}):
        full = reference(n, rows * 3, dtype, op).reshape(rows, 3)
        x = crafted(r, rows * 3, dtype, op).reshape(rows, 3)
        before = x.copy()
        fast(comm, x, op)
        got = comm.reduce_scatter(x, op=op)
        assert_equal_all_ranks(comm, got, block(comm, full), f"rows={rows}")
        assert_equal_all_ranks(comm, x, before, "reduce_scatter must not modify its input")
        assert_equal_all_ranks(comm, comm.reduce_scatter(x, op=op.value), block(comm, full),
                               f"op by name, rows={rows}")
        out = np.full_like(block(comm, full), 7)
        assert comm.reduce_scatter(x, op=op, out=out) is out
        assert_equal_all_ranks(comm, out, block(comm, full), f"out=, rows={rows}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(5,), (7, 2, 3), (4, 0), (0, 3)])
def test_shapes_strides_and_average(comm: mt.Communicator, shape: tuple[int, ...]) -> None:
    n, r = comm.size, comm.rank
    count = int(np.prod(shape))
    x = np.arange(count, dtype=np.float64).reshape(shape) + r
    full = np.arange(count, dtype=np.float64).reshape(shape) * n + n * (n - 1) / 2
    fast(comm, x)
    y = comm.reduce_scatter(x)
    assert_equal_all_ranks(comm, y, block(comm, full), f"shape {shape}")
    assert_equal_all_ranks(comm, comm.reduce_scatter(x, op=mt.Average), block(comm, full) / n,
                           f"average {shape}")
    ints = np.full(shape, r + 1, np.int32)  # integer Average: rounded toward minus infinity
    want = np.full(shape, (n * (n + 1) // 2) // n, np.int32)
    assert_equal_all_ranks(comm, comm.reduce_scatter(ints, op=mt.Average), block(comm, want),
                           f"int average {shape}")
    if shape[0] and count:  # a strided view of every other row
        base = np.zeros((2 * shape[0], *shape[1:]), np.float32)
        view = base[::2]
        view[...] = r + 1
        assert_equal_all_ranks(comm, comm.reduce_scatter(view),
                               block(comm, np.full(shape, n * (n + 1) / 2, np.float32)),
                               f"strided {shape}")


@pytest.mark.mpi(min_size=1)
def test_plans_follow_shape_op_algorithm_and_configuration(
        comm: mt.Communicator, configure: Callable[..., Any]) -> None:
    d, n = comm.dispatcher, comm.size
    a = np.ones((2 * n, 4), np.float32)
    want = block(comm, a * n)
    plan = fast(comm, a)
    assert plan.out_shape == want.shape
    assert d.small_reduce_scatter(a, mt.Sum) is plan  # cached
    assert d.small_reduce_scatter(np.ones((2 * n + 1, 4), np.float32), mt.Sum) is not plan
    assert d.small_reduce_scatter(a, mt.Max) is not plan
    assert d.small_reduce_scatter(np.ones((), np.float32), mt.Sum) is None  # 0-d: general path
    assert d.small_reduce_scatter(a, mt.Adasum) is None
    auto = fast(comm, a, algorithm="auto")
    assert auto is not plan and auto.sig == plan.sig
    assert_equal_all_ranks(comm, comm.reduce_scatter(a, algorithm="auto"), want, "auto")
    if n > 1:
        assert plan.sig is not None
        assert d.small_reduce_scatter(a, mt.Sum, "ring") is None  # asked for: general path
        assert_equal_all_ranks(comm, comm.reduce_scatter(a, algorithm="ring"), want, "ring")
        saved = configure(check=False)
        unchecked = fast(comm, a)
        assert unchecked is not plan and unchecked.sig is None
        assert_equal_all_ranks(comm, comm.reduce_scatter(a), want, "unchecked")
        configure(segment_bytes=16)  # the array does not fit a 16-byte slot
        assert d.small_reduce_scatter(a, mt.Sum) is None
        assert_equal_all_ranks(comm, comm.reduce_scatter(a), want, "segmented")
        configure(saved)
        again = fast(comm, a)
        assert again is not plan and again.sig == plan.sig  # planned again, same checks
        big = np.ones((SLOT_BYTES // 4 + n, 1), np.float32)  # over a slot
        assert d.small_reduce_scatter(big, mt.Sum) is None
        assert_equal_all_ranks(comm, comm.reduce_scatter(big), block(comm, big * n),
                               "over a slot")


@pytest.mark.mpi(min_size=1)
def test_counted_and_out_of_the_wrong_shape(comm: mt.Communicator) -> None:
    """The stall inspector reads the transport's count; an ``out=`` the fast path cannot
    write goes to the general path, which says what is wrong with it."""
    t = comm.dispatcher.transport
    x = np.ones((comm.size, 2), np.float32)
    fast(comm, x)
    seq = t.seq
    comm.reduce_scatter(x)
    assert t.seq == seq + (comm.size > 1)
    assert comm.size == 1 or t.current == "reduce_scatter"
    with pytest.raises(mt.ArgumentError, match="out="):
        comm.reduce_scatter(x, out=np.empty((3, 3), np.float32))
    strided = np.zeros((2, 2), np.float32)[:1]  # the right shape, written through the
    assert comm.reduce_scatter(x, out=strided) is strided  # general path
    assert_equal_all_ranks(comm, strided, np.full((1, 2), comm.size, np.float32), "out= view")


MISMATCHES: dict[str, tuple[Callable[[mt.Communicator, bool], Any], str]] = {
    "dtype": (lambda c, odd: c.reduce_scatter(np.ones((c.size, 2),
                                                      np.float64 if odd else np.float32)),
              r"rank {last} sent float64\[{n}, 2\], rank 0 sent float32\[{n}, 2\]"),
    "rows": (lambda c, odd: c.reduce_scatter(np.ones((c.size + odd, 2), np.float32)),
             r"rank {last} sent float32\[{n1}, 2\], rank 0 sent float32\[{n}, 2\]"),
    "op": (lambda c, odd: c.reduce_scatter(np.ones((c.size, 2)), op=mt.Min if odd else mt.Sum),
           r"rank {last} sent op min, rank 0 sent op sum"),
    "name (general path)": (lambda c, odd: c.reduce_scatter(np.ones((c.size, 2)),
                                                            name="w" if odd else None),
                            r"rank {last} sent name 'w', rank 0 sent name none"),
    "scaling (general path)": (lambda c, odd: c.reduce_scatter(
        np.ones((c.size, 2)), postscale_factor=2.0 if odd else 1.0), r"postscale"),
    "allreduce": (lambda c, odd: c.allreduce(np.ones(4)) if odd else
                  c.reduce_scatter(np.ones((c.size, 2))),
                  r"rank {last} called allreduce, rank 0 called reduce_scatter"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(comm: mt.Communicator, case: str) -> None:
    call, pattern = MISMATCHES[case]
    n = comm.size
    expect_last_rank_mismatch(comm, call, pattern.format(last=n - 1, n=n, n1=n + 1))
