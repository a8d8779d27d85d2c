"""Shared test helpers: crafted inputs with exact results, and all-rank assertions."""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt
from mpitrain.dtypes import BFLOAT16, SUPPORTED_DTYPES
from mpitrain.ops import ReduceOp

DTYPES = [str(d) for d in SUPPORTED_DTYPES]


def ops_for(dtype: Any) -> list[ReduceOp]:
    """The elementwise ops defined for ``dtype`` (no Min/Max for complex; no Adasum,
    which tests/mpi/test_adasum.py covers)."""
    ops = [o for o in ReduceOp if o is not ReduceOp.ADASUM]
    if np.dtype(dtype).kind == "c":
        ops = [o for o in ops if o not in (ReduceOp.MIN, ReduceOp.MAX)]
    return ops


MANY_RANKS_CASES = {("float32", ReduceOp.SUM), ("int8", ReduceOp.PRODUCT),
                    ("bfloat16", ReduceOp.MAX), ("float64", ReduceOp.AVERAGE),
                    ("uint16", ReduceOp.MIN)}
"""The (dtype, op) cases of the allreduce and reduce_scatter matrices that also run at
6, 7 and 8 ranks: floats of each width, integers, every op once."""


def dtype_op_cases(many_ranks: set[tuple[str, ReduceOp]]) -> list[Any]:
    """Every (dtype, op) case as a pytest parameter; those in ``many_ranks`` are marked
    ``many_ranks`` (``make test-mpi`` also runs them at 6, 7 and 8 ranks)."""
    return [pytest.param(d, o, id=f"{d}-{o.value}",
                         marks=[pytest.mark.many_ranks] if (d, o) in many_ranks else [])
            for d in DTYPES for o in ops_for(d)]


def dtype_params(many_ranks: set[str], dtypes: list[str] = DTYPES) -> list[Any]:
    """Each of ``dtypes`` as a pytest parameter; those in ``many_ranks`` are marked
    ``many_ranks``."""
    return [pytest.param(d, id=d, marks=[pytest.mark.many_ranks] if d in many_ranks else [])
            for d in dtypes]


def crafted(rank: int, count: int, dtype: Any, op: ReduceOp) -> np.ndarray[Any, Any]:
    """An input that differs by rank and index and reduces exactly in any order.

    Sums of small integers and products of {-1, 1, 2} are exact in every dtype,
    float16 and bfloat16 included, so results compare with ``==``.
    """
    dt = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    unsigned = dt.kind == "u"
    if op is ReduceOp.PRODUCT:
        table = np.array([1, 2, 1] if unsigned else [1, 2, -1])
        values = table[(i * 5 + rank * 3) % 3]
    elif op in (ReduceOp.MIN, ReduceOp.MAX):
        values = (i * 37 + rank * 11) % 101 - (0 if unsigned else 50)
    else:
        values = (i * 7 + rank * 3) % 9 - (0 if unsigned else 4)
    if dt.kind == "c":
        return (values + 1j * ((values * 3) % 5)).astype(dt)
    return values.astype(dt)


def reference(size: int, count: int, dtype: Any, op: ReduceOp) -> np.ndarray[Any, Any]:
    """What an allreduce of :func:`crafted` over ``size`` ranks must return."""
    acc = crafted(0, count, dtype, op)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
             ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
    for r in range(1, size):
        acc = ufunc(acc, crafted(r, count, dtype, op))
    if op is ReduceOp.AVERAGE:
        if acc.dtype.kind in "iu":
            acc = np.floor_divide(acc, size)
        else:
            np.multiply(acc, 1.0 / size, out=acc, casting="unsafe")
    return acc


@contextlib.contextmanager
def configured(comm: mt.Communicator, **changes: Any) -> Iterator[mt.Communicator]:
    """``comm`` under changed settings for the block (``Communicator.configure``:
    collective, every rank passes the same), its settings put back afterwards."""
    saved = comm.configure(**changes)
    try:
        yield comm
    finally:
        comm.configure(saved)


@contextlib.contextmanager
def synchronous_sends() -> Iterator[None]:
    """For the block, the host transports made afterwards post every send as
    ``MPI_Issend`` (:data:`mpitrain.comm.transport.SYNCHRONOUS_SENDS`): it completes only
    once its receive is matched, as a send above MPI's eager limit does."""
    from mpitrain.comm import transport

    saved = transport.SYNCHRONOUS_SENDS
    transport.SYNCHRONOUS_SENDS = True
    try:
        yield
    finally:
        transport.SYNCHRONOUS_SENDS = saved


def layouts(n: int) -> dict[str, list[int]]:
    """Node id of each of ``n`` ranks, per emulated layout; layouts equal at this size
    are dropped."""
    candidates = {
        "one-node": [0] * n,
        "rank-per-node": list(range(n)),
        "pairs": [r // 2 for r in range(n)],          # 2+2+1 at 5 ranks
        "interleaved": [r % 2 for r in range(n)],     # nodes are not rank ranges
        "one-then-rest": [min(r, 1) for r in range(n)],
    }
    unique: dict[str, list[int]] = {}
    for name, ids in candidates.items():
        if ids not in unique.values():
            unique[name] = ids
    return unique


def with_nodes(comm: MPI.Intracomm, ids: list[int]) -> mt.Communicator:
    """A communicator over ``comm`` whose nodes are the ranks with equal ``ids`` (its
    settings, stall limits included, read from the environment now)."""
    from mpitrain.comm.inspector import StallLimits
    from mpitrain.comm.topology import Topology

    c = mt.Communicator(comm, shared_memory=False)  # emulated nodes share no memory
    s = c.settings
    c.dispatcher.topology.free()
    c.dispatcher.topology = Topology.from_node_ids(
        c.mpi_comm, ids[c.rank], StallLimits(s.stall_warning_s, s.stall_timeout_s,
                                             s.stall_action))
    return c


def assert_all_ranks(comm: mt.Communicator, ok: bool, message: str) -> None:
    """Fail on every rank if the check failed on any (so no rank hangs in the next test).

    One small allreduce counts the failed ranks; only if there are any are the messages
    gathered (an object allgather is several collectives). A rank whose own check failed
    fails even if that count says none did.
    """
    failures = int(comm.allreduce(np.array([0 if ok else 1], np.int32))[0])
    if failures:
        failed = comm.allgather_object(None if ok else f"rank {comm.rank}: {message}")
        raise AssertionError("; ".join(f for f in failed if f is not None))
    assert ok, f"rank {comm.rank}: {message} (yet the ranks' count of failures was 0)"


_T = TypeVar("_T")


def fast_plan(comm: mt.Communicator, plan: _T | None, x: np.ndarray[Any, Any]) -> _T:
    """``plan``, a small-call fast-path plan for ``x``; fails the test on every rank if
    any rank has none."""
    assert_all_ranks(comm, plan is not None, f"no fast path for {x.dtype}{list(x.shape)}")
    assert plan is not None
    return plan


def assert_equal_all_ranks(comm: mt.Communicator, actual: Any, expected: Any, what: str) -> None:
    """Exact comparison of arrays, shape and dtype included, judged on every rank."""
    why = mismatch(actual, expected)
    assert_all_ranks(comm, not why, f"{what}: {why}")


def expect_last_rank_mismatch(comm: mt.Communicator,
                              call: Callable[[mt.Communicator, bool], Any],
                              pattern: str) -> None:
    """``call(comm, odd)``, ``odd`` True on the last rank only, must raise MismatchError
    matching ``pattern`` on every rank, twice (the second time through cached plans)."""
    odd = comm.rank == comm.size - 1
    for _ in range(2):
        expect_mismatch(comm, lambda: call(comm, odd), pattern)


def expect_mismatch(comm: mt.Communicator, call: Callable[[], Any], pattern: str) -> None:
    """``call`` must raise MismatchError matching ``pattern`` on every rank; the
    communicator must then still work."""
    try:
        call()
        problem = "no MismatchError"
    except mt.MismatchError as exc:
        problem = "" if re.search(pattern, str(exc)) else f"{exc!s} does not match {pattern!r}"
    assert_all_ranks(comm, not problem, problem)
    y = comm.allreduce(np.arange(5, dtype=np.int32))  # still usable
    assert_equal_all_ranks(comm, y, np.arange(5, dtype=np.int32) * comm.size, "after mismatch")


def mismatch(actual: Any, expected: Any) -> str:
    """Why ``actual`` is not exactly ``expected`` (shape, dtype and bits; a NaN equals
    a NaN), or ``""``."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"got {actual.dtype}{actual.shape}, want {expected.dtype}{expected.shape}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    same = a == e
    if expected.dtype.kind in "fc" or expected.dtype == BFLOAT16:
        same |= np.isnan(a) & np.isnan(e)
    if same.all():
        return ""
    wrong = np.flatnonzero(~same)
    first = wrong[0]
    return f"{wrong.size} wrong elements, first at {first}: got {a[first]}, want {e[first]}"


class Checks:
    """Local checks gathered into one all-rank verdict (one agreement round, not many)."""

    def __init__(self, comm: mt.Communicator) -> None:
        self.comm = comm
        self.failures: list[str] = []

    def equal(self, actual: Any, expected: Any, what: str) -> None:
        """Record a failure if ``actual`` is not exactly ``expected``."""
        why = mismatch(actual, expected)
        if why:
            self.failures.append(f"{what}: {why}")

    def verdict(self) -> None:
        """Fail on every rank if any check failed on any rank."""
        assert_all_ranks(self.comm, not self.failures, "; ".join(self.failures[:3]))


def check_allreduce(comm: mt.Communicator, algorithm: str, dtype: Any, op: ReduceOp,
                    counts: list[int]) -> None:
    """Allreduce and allreduce_ of crafted inputs of each count equal the reference."""
    checks = Checks(comm)
    for count in counts:
        expected = reference(comm.size, count, dtype, op)
        x = crafted(comm.rank, count, dtype, op)
        checks.equal(comm.allreduce(x, op=op, algorithm=algorithm), expected,
                     f"allreduce {algorithm} {dtype} {op} n={count}")
        checks.equal(x, crafted(comm.rank, count, dtype, op), "allreduce modified its input")
        y = comm.allreduce_(x, op=op, algorithm=algorithm)
        if y is not x:
            checks.failures.append(f"allreduce_ {algorithm} n={count} returned another array")
        checks.equal(x, expected, f"allreduce_ {algorithm} {dtype} {op} n={count}")
    checks.verdict()


def check_reduce_scatter(comm: mt.Communicator, algorithm: str, dtype: Any, op: ReduceOp,
                         rows: list[int], width: int = 3) -> None:
    """Each rank's reduce_scatter block equals its np.array_split block of the reference."""
    checks = Checks(comm)
    for n in rows:
        x = crafted(comm.rank, n * width, dtype, op).reshape(n, width)
        y = comm.reduce_scatter(x, op=op, algorithm=algorithm)
        full = reference(comm.size, n * width, dtype, op).reshape(n, width)
        checks.equal(y, np.array_split(full, comm.size)[comm.rank],
                     f"reduce_scatter {algorithm} {dtype} {op} rows={n}")
    checks.verdict()


def check_allgather(comm: mt.Communicator, algorithm: str, dtype: Any,
                    bases: list[int]) -> None:
    """Allgather of blocks of ``base - rank`` rows (fewer on higher ranks, some empty)."""
    checks = Checks(comm)
    for base in bases:
        def block(r: int, base: int = base) -> np.ndarray[Any, Any]:
            return crafted(r, max(base - r, 0) * 2, dtype, ReduceOp.SUM).reshape(-1, 2)

        y = comm.allgather(block(comm.rank), algorithm=algorithm)
        checks.equal(y, np.concatenate([block(r) for r in range(comm.size)]),
                     f"allgather {algorithm} {dtype} base={base}")
    checks.verdict()


def adasum_pair(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The Adasum of two float64 vectors, straight from the formula (Horovod's floor:
    a squared norm below sqrt(DBL_MIN), about 1.5e-154, gives coefficient 1)."""
    floor = math.sqrt(sys.float_info.min)
    dot, a_sq, b_sq = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * a_sq) if a_sq >= floor else 1.0
    cb = 1.0 - dot / (2.0 * b_sq) if b_sq >= floor else 1.0
    return ca * a + cb * b


def adasum_reference(vectors: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """Adasum over ranks in the tree of adjacent ranks (``(0 1) (2 3)``, then
    ``(0 1 2 3)``, ...), computed in float64; each level's result is rounded to the
    inputs' dtype, as the ranks store it."""
    dt = vectors[0].dtype
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]).astype(dt).astype(np.float64)
                 for i in range(0, len(level), 2)]
    return level[0].astype(dt)


def host_algorithms(collective: str) -> list[str]:
    """The algorithms of ``collective`` that run on host buffers (not the device-only
    ``ipc`` and ``nccl``, which tests/mpi/test_ipc.py and test_nccl.py run)."""
    from mpitrain.algorithms import REGISTRY

    return [name for name, plan in REGISTRY[collective].items() if not plan.device_only]


def register_ddp_hook(ddp: Any, hook: str) -> None:
    """Give a DDP model one of the communication hooks the DDP tests sweep: ``"none"``,
    DDP's ``"fp16"`` compression hook, or ``"powersgd"`` (rank 8, compressing from the
    third step on: exact on the tests' weights of at most 8 x 6). Over the default group."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=8,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        raise ValueError(f"unknown DDP hook {hook!r}")
