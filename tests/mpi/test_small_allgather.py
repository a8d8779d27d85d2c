"""The small allgather fast path (mpitrain.dispatch.fastpath): same results, same checks
as the general path.

Blocking allgathers with default arguments of small numpy blocks take a plan cached
per (dtype, shape, requested algorithm); these tests make sure they do, that the
gathered array matches numpy's concatenation for every dtype (empty blocks
included), that ``out=`` and strided inputs work, that ranks sending other row counts
than the plan's are finished by the general path from the same exchange (whichever
path each rank is on, and whatever algorithm the gathered size then needs), that the
plan follows configuration changes, and that ranks that disagree still raise
MismatchError on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    DTYPES,
    assert_all_ranks,
    assert_equal_all_ranks,
    expect_last_rank_mismatch,
    fast_plan,
)

import mpitrain as mt
from mpitrain.dispatch.dispatcher import SLOT_BYTES
from mpitrain.dispatch.fastpath import SmallAllgather


def fast(comm: mt.Communicator, x: np.ndarray[Any, Any],
         algorithm: str | None = None) -> SmallAllgather:
    """The fast-path plan of ``x``; fails the test if there is none."""
    return fast_plan(comm, comm.dispatcher.small_allgather(x, algorithm), x)


def block_of(rank: int, rows: int, dtype: Any, trailing: tuple[int, ...] = (3,)) -> Any:
    """Rank ``rank``'s block: values that differ by rank, row and column."""
    count = rows * int(np.prod(trailing))
    values = (np.arange(count) * 7 + rank * 5) % 23 - 11
    if np.dtype(dtype).kind == "u":
        values = np.abs(values)
    return values.astype(dtype).reshape((rows, *trailing))


def gathered(n: int, rows: Callable[[int], int] | int, dtype: Any,
             trailing: tuple[int, ...] = (3,)) -> Any:
    """What an allgather of every rank's :func:`block_of` returns (``rows``: every
    rank's, or rank ``q``'s as ``rows(q)``)."""
    return np.concatenate([block_of(q, rows if isinstance(rows, int) else rows(q), dtype,
                                    trailing) for q in range(n)])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_matches_numpy(comm: mt.Communicator, dtype: str) -> None:
    n, r = comm.size, comm.rank
    for rows in (0, 1, 2, 5):
        x = block_of(r, rows, dtype)
        before = x.copy()
        plan = fast(comm, x)
        assert plan.out_shape == (n * rows, 3)
        want = gathered(n, rows, dtype)
        for _ in range(3):  # both parities, and the first call after them
            assert_equal_all_ranks(comm, comm.allgather(x), want, f"rows={rows}")
        assert_equal_all_ranks(comm, x, before, "allgather must not modify its input")
        out = np.full_like(want, 7)
        assert comm.allgather(x, out=out) is out
        assert_equal_all_ranks(comm, out, want, f"out=, rows={rows}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(5,), (1,), (7, 2, 3), (4, 0), (0, 3)])
def test_shapes_and_strided_blocks(comm: mt.Communicator, shape: tuple[int, ...]) -> None:
    n, r = comm.size, comm.rank
    x = block_of(r, shape[0], np.float64, shape[1:])
    want = gathered(n, shape[0], np.float64, shape[1:])
    fast(comm, x)
    assert_equal_all_ranks(comm, comm.allgather(x), want, f"shape {shape}")
    base = np.zeros((2 * shape[0], *shape[1:]), np.float64)  # every other row
    view = base[::2]
    view[...] = x
    fast(comm, view)
    assert_equal_all_ranks(comm, comm.allgather(view), want, f"strided {shape}")
    late = np.zeros((shape[0], *shape[1:], 2), np.float64)[..., 0]  # strided last axis
    late[...] = x
    assert_equal_all_ranks(comm, comm.allgather(late), want, f"strided last axis {shape}")


@pytest.mark.mpi(min_size=2)
def test_other_row_counts_finish_on_the_general_path(comm: mt.Communicator) -> None:
    """Each rank plans for its own rows; when the others send different ones, the call
    still gathers everything, through the general path, from the same exchange."""
    n, r = comm.size, comm.rank
    last = n - 1
    cases: dict[str, Callable[[int], int]] = {
        "rank + 1 rows": lambda q: q + 1,
        "one rank sends none": lambda q: 0 if q == last else 2,
        "one rank over a slot": lambda q: SLOT_BYTES // 32 + 1 if q == last else 1,
        "gathered size over the table's shm limit": lambda q: 12000 * (q + 1),
    }
    for what, rows in cases.items():
        x = block_of(r, rows(r), np.int64, (4,))
        want = gathered(n, rows, np.int64, (4,))
        for _ in range(2):
            assert_equal_all_ranks(comm, comm.allgather(x), want, what)
        out = np.zeros_like(want)
        assert comm.allgather(x, out=out) is out
        assert_equal_all_ranks(comm, out, want, f"{what}, out=")


@pytest.mark.mpi(min_size=2)
def test_out_sized_for_the_plan_but_rows_differ_raises_everywhere(
        comm: mt.Communicator) -> None:
    """``out=`` of ``size * rows`` rows fits the plan of a rank that sends ``rows``, but
    the ranks send more in all: every rank raises, as on the general path."""
    n, r = comm.size, comm.rank
    x = np.ones((2 if r == n - 1 else 1, 2), np.float32)
    out = np.empty((n, 2), np.float32)  # the same on every rank: right for rows=1
    problem = "no ArgumentError"
    try:
        comm.allgather(x, out=out)
    except mt.ArgumentError as exc:
        problem = "" if "allgather out= has" in str(exc) else str(exc)
    assert_all_ranks(comm, not problem, problem)
    assert_equal_all_ranks(comm, comm.allgather(np.full(1, r)), np.arange(n), "usable after")


@pytest.mark.mpi(min_size=1)
def test_plans_follow_shape_algorithm_and_configuration(
        comm: mt.Communicator, configure: Callable[..., Any]) -> None:
    d, n, r = comm.dispatcher, comm.size, comm.rank
    a = block_of(r, 4, np.float32)
    want = gathered(n, 4, np.float32)
    plan = fast(comm, a)
    assert d.small_allgather(a) is plan  # cached
    assert d.small_allgather(block_of(r, 5, np.float32)) is not plan
    assert d.small_allgather(a.astype(np.float64)) is not plan
    assert d.small_allgather(np.ones((), np.float32)) is None  # 0-d: general path
    assert_equal_all_ranks(comm, comm.allgather(np.float32(r)), np.arange(n, dtype=np.float32),
                           "0-d")
    auto = fast(comm, a, algorithm="auto")
    assert auto is not plan and auto.sig == plan.sig
    assert_equal_all_ranks(comm, comm.allgather(a, algorithm="auto"), want, "auto")
    if n == 1:
        return
    assert plan.sig is not None and plan.sig.algorithm == "auto"
    assert d.small_allgather(a, "ring") is None  # asked for: general path
    assert_equal_all_ranks(comm, comm.allgather(a, algorithm="ring"), want, "ring")
    saved = configure(check=False)  # allgather validates anyway (the rows travel)
    unchecked = fast(comm, a)
    assert unchecked is not plan and unchecked.sig == plan.sig
    configure(segment_bytes=16)  # the gathered array needs the stripes
    assert d.small_allgather(a) is None
    assert_equal_all_ranks(comm, comm.allgather(a), want, "segmented")
    configure(segment_bytes=a.nbytes * n)
    fast(comm, a)
    configure(saved)
    again = fast(comm, a)
    assert again is not plan and again.sig == plan.sig  # planned again, same checks
    big = np.ones((SLOT_BYTES // 4 + 1, 1), np.float32)  # over a slot
    assert d.small_allgather(big) is None
    assert_equal_all_ranks(comm, comm.allgather(big), np.ones((n * big.shape[0], 1),
                                                              np.float32), "over a slot")


@pytest.mark.mpi(min_size=2)
def test_a_table_that_may_pick_single_copy_keeps_the_general_path(
        comm: mt.Communicator, configure: Callable[..., Any], tmp_path_factory: Any) -> None:
    """single_copy reads every rank's block address from the exchange, which the fast
    path does not publish: where a tuning file may choose it, no allgather plan is made."""
    n, r = comm.size, comm.rank
    path = Path(tmp_path_factory.mktemp(f"rank{r}")) / "rules.json"
    path.write_text(json.dumps({"rules": [
        {"collective": "allgather", "algorithm": "single_copy", "min_bytes": 1 << 16}]}))
    configure(tuning_file=str(path))
    small = block_of(r, 2, np.float32)
    single_copy = comm.dispatcher.shm is not None and comm.dispatcher.shm.single_copy
    plan = comm.dispatcher.small_allgather(small)
    assert (plan is None) == single_copy

    def rows(q: int) -> int:
        return 2 if q < n - 1 else 9000  # gathered: over the file's 64 KiB

    x = block_of(r, rows(r), np.float32)
    assert_equal_all_ranks(comm, comm.allgather(x), gathered(n, rows, np.float32), "uneven")


@pytest.mark.mpi(min_size=1)
def test_counted_and_out_of_the_wrong_shape(comm: mt.Communicator) -> None:
    """The stall inspector reads the transport's count; an ``out=`` the fast path cannot
    write goes to the general path, which says what is wrong with it."""
    t, n = comm.dispatcher.transport, comm.size
    x = np.ones((2, 2), np.float32)
    fast(comm, x)
    seq = t.seq
    comm.allgather(x)
    assert t.seq == seq + (n > 1)
    assert n == 1 or t.current == "allgather"
    with pytest.raises(mt.ArgumentError, match="out="):
        comm.allgather(x, out=np.empty((2 * n, 3), np.float32))
    strided = np.zeros((2 * n, 4), np.float32)[:, :2]  # the right shape, not contiguous
    with pytest.raises(mt.ArgumentError, match="C-contiguous"):
        comm.allgather(x, out=strided)
    assert_equal_all_ranks(comm, comm.allgather(x), np.ones((2 * n, 2), np.float32), "after")


MISMATCHES: dict[str, tuple[Callable[[mt.Communicator, bool], Any], str]] = {
    "dtype": (lambda c, odd: c.allgather(np.ones((2, 3), np.float64 if odd else np.float32)),
              r"rank {last} sent float64\[\*, 3\], rank 0 sent float32\[\*, 3\]"),
    "trailing": (lambda c, odd: c.allgather(np.ones((2, 3 + odd), np.int8)),
                 r"rank {last} sent int8\[\*, 4\], rank 0 sent int8\[\*, 3\]"),
    "out= rows": (lambda c, odd: c.allgather(np.ones((2, 3)),
                                             out=np.empty((2 * c.size + odd, 3))),
                  r"rank {last} sent float64\[\*, {rows1}, 3\], "
                  r"rank 0 sent float64\[\*, {rows}, 3\]"),
    "out= on one rank": (lambda c, odd: c.allgather(np.ones((2, 3)), out=np.empty(
        (2 * c.size, 3)) if odd else None),
        r"rank {last} sent float64\[\*, {rows}, 3\], rank 0 sent float64\[\*, 3\]"),
    "algorithm": (lambda c, odd: c.allgather(np.ones(4), algorithm="ring" if odd else "auto"),
                  r"rank {last} sent algorithm ring, rank 0 sent algorithm auto"),
    "name (general path)": (lambda c, odd: c.allgather(np.ones(4), name="w" if odd else None),
                            r"rank {last} sent name 'w', rank 0 sent name none"),
    "allreduce": (lambda c, odd: c.allreduce(np.ones(4)) if odd else c.allgather(np.ones(4)),
                  r"rank {last} called allreduce, rank 0 called allgather"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_raises_on_every_rank(comm: mt.Communicator, case: str) -> None:
    call, pattern = MISMATCHES[case]
    n = comm.size
    expect_last_rank_mismatch(comm, call, pattern.format(last=n - 1, rows=2 * n, rows1=2 * n + 1))
