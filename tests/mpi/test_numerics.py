"""Rounding, special values and wrap-around in every reducing algorithm.

The inputs of :func:`helpers.crafted` reduce exactly in any order, so they cannot see
how an algorithm rounds. Here:

* *random floats* (float16, bfloat16, float32, float64, complex64), summed, averaged
  and multiplied by every algorithm of allreduce and reduce_scatter, are compared with
  the reduction in float64 within a bound derived from the dtype and the rank count
  (:func:`bound`), and every rank of an allreduce must hold the same bits: an
  element is reduced once and copied, or reduced in the same order everywhere;
* NaN and +-Inf propagate through sum, average, min, max and product as numpy's
  ufuncs propagate them (Inf - Inf and 0 * Inf are NaN; min and max keep NaN);
* integer sums and products wrap around as numpy's do, and Average floor-divides the
  wrapped sum.

Counts: fewer than ranks, divisible by every rank count 1..8, not divisible, and one
past the 512 KiB slot of shared memory in float32 (its striped path).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from helpers import Checks, crafted, dtype_params, host_algorithms, layouts, with_nodes

import mpitrain as mt

# Every algorithm by name ("auto" picks one of them: shm on one node).
REDUCING = [(c, a) for c in ("allreduce", "reduce_scatter") for a in host_algorithms(c)]
ROUNDING = ["float16", "bfloat16", "float32", "float64", "complex64"]
SPECIAL = ["float16", "bfloat16", "float32", "float64"]
INTEGERS = ["int8", "uint8", "int16", "uint16", "int32", "uint64"]
SIGNIFICAND_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53,
                    "complex64": 24, "complex128": 53}
MANY_RANKS = {"float16", "float64"}
"""The dtypes whose random-float tests also run at 6, 7 and 8 ranks (16 and 64 bits;
float32's large count, past the shared-memory slot, runs at 1..5)."""
ALL_OPS = [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product]
UFUNCS = {mt.Sum: np.add, mt.Average: np.add, mt.Min: np.minimum, mt.Max: np.maximum,
          mt.Product: np.multiply}


def counts(size: int, dtype: str = "") -> list[int]:
    """Fewer than ranks (or 1), divisible by 1..8, not divisible; in float32 also one
    past the 512 KiB slot of shared memory (its striped path)."""
    return sorted({max(size - 1, 1), 840, 1001} | ({140_001} if dtype == "float32" else set()))


def ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{c}-{a}" for c, a in cases]


def reduce(comm: mt.Communicator, collective: str, algorithm: str, x: np.ndarray[Any, Any],
           op: mt.ReduceOp) -> np.ndarray[Any, Any]:
    """``collective`` of the flat ``x`` (a reduce_scatter's rows are its elements)."""
    if collective == "allreduce":
        return comm.allreduce(x, op=op, algorithm=algorithm)
    return comm.reduce_scatter(x, op=op, algorithm=algorithm)


def mine(comm: mt.Communicator, collective: str, full: np.ndarray[Any, Any]) -> Any:
    """This rank's part of an allreduce-sized result."""
    return full if collective == "allreduce" else np.array_split(full, comm.size)[comm.rank]


def digest(arr: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


# -- random floats --------------------------------------------------------------------
def random_input(rank: int, count: int, dtype: str, op: mt.ReduceOp) -> np.ndarray[Any, Any]:
    """Standard normal values (a product's: magnitudes in [0.5, 2), either sign, so
    that no product of 8 ranks leaves float16's normal range), per rank and count."""
    rng = np.random.default_rng([rank, count, SIGNIFICAND_BITS[dtype], ROUNDING.index(dtype)])
    if op is mt.Product:
        values = rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)
    else:
        values = rng.standard_normal(count)
        if dtype.startswith("complex"):
            values = values + 1j * rng.standard_normal(count)
    return values.astype(dtype)


def gamma(unit: float, size: int) -> float:
    """The bound of ``size - 1`` roundings of unit roundoff ``unit``, relative to the
    magnitudes combined: ``(n - 1) u / (1 - (n - 1) u)``."""
    return (size - 1) * unit / (1 - (size - 1) * unit)


def wide(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``x`` in long double (complex long double), exactly."""
    if x.dtype.kind not in "fc":  # bfloat16: its float32 values first
        x = x.astype(np.float32)
    return x.astype(np.clongdouble if x.dtype.kind == "c" else np.longdouble)


REFERENCE_UNIT = 2.0 ** -(np.finfo(np.longdouble).nmant + 1)
"""Unit roundoff of the reference's long double (2**-64 on x86-64, 2**-53 where it is
a double: the bound then also covers the reference's own rounding)."""


def bound(dtype: str, size: int, op: mt.ReduceOp,
          inputs: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """How far, elementwise, a correct reduction of ``inputs`` may be from the exact one.

    Any reduction over ``n`` ranks combines each element ``n - 1`` times, each combine
    rounding once (unit roundoff ``u``): a sum is off by at most ``gamma`` times the sum
    of the magnitudes, a product by ``gamma`` times its magnitude, whatever the order
    (:func:`gamma`). Average rounds twice more (its factor ``1/n`` and the product with
    it). 10 % covers the double rounding of 16-bit floats combined in float32; the
    reference's own rounding (:func:`exact`) is added.
    """
    u = 2.0 ** -SIGNIFICAND_BITS[dtype]
    g = gamma(u, size) + gamma(REFERENCE_UNIT, size)
    if op is mt.Product:
        return (1.1 * g * np.abs(np.prod([wide(x) for x in inputs], axis=0))).astype(np.float64)
    magnitude = np.sum([np.abs(wide(x)) for x in inputs], axis=0)
    if op is mt.Average:
        return (1.1 * (g + 3 * u) * magnitude / size).astype(np.float64)
    return (1.1 * g * magnitude).astype(np.float64)


def exact(size: int, op: mt.ReduceOp, inputs: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """The reduction of ``inputs`` in long double."""
    if op is mt.Product:
        return np.prod([wide(x) for x in inputs], axis=0)
    total = np.sum([wide(x) for x in inputs], axis=0)
    return total / size if op is mt.Average else total


def judge(checks: Checks, c: mt.Communicator, collective: str, what: str, got: Any,
          inputs: list[np.ndarray[Any, Any]], op: mt.ReduceOp) -> None:
    """Record a failure unless ``got`` (this rank's result) is within :func:`bound` of
    the exact reduction of ``inputs`` and, for an allreduce, has the bits of rank 0's
    (collective: every rank judges the same calls)."""
    if collective == "allreduce" and c.broadcast_object(digest(got)) != digest(got):
        checks.failures.append(f"{what}: not the bits of rank 0's result")
    want = mine(c, collective, exact(c.size, op, inputs))
    if got.dtype != inputs[0].dtype or got.shape != want.shape:
        checks.failures.append(f"{what}: got {got.dtype}{got.shape}")
        return
    error = np.abs(wide(got) - want).astype(np.float64)
    limit = mine(c, collective, bound(str(inputs[0].dtype), c.size, op, inputs))
    bad = np.flatnonzero(~(error <= limit))
    if bad.size:
        first = bad[0]
        checks.failures.append(f"{what}: {bad.size} elements beyond the bound, first at "
                               f"{first}: off by {error[first]:.3g} > {limit[first]:.3g}")


def ops_of(dtype: str) -> list[mt.ReduceOp]:
    """The ops that round: Sum, Average, and Product but for complex numbers."""
    return [mt.Sum, mt.Average] + ([] if dtype.startswith("complex") else [mt.Product])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("collective,algorithm", REDUCING, ids=ids(REDUCING))
@pytest.mark.parametrize("dtype", dtype_params(many_ranks=MANY_RANKS, dtypes=ROUNDING))
def test_random_floats_within_the_rounding_bound(comm: mt.Communicator, collective: str,
                                                 algorithm: str, dtype: str) -> None:
    checks = Checks(comm)
    for op in ops_of(dtype):
        for count in counts(comm.size, dtype):
            inputs = [random_input(r, count, dtype, op) for r in range(comm.size)]
            got = reduce(comm, collective, algorithm, inputs[comm.rank].copy(), op)
            judge(checks, comm, collective, f"{collective} {algorithm} {dtype} {op} n={count}",
                  got, inputs, op)
    checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", dtype_params(many_ranks=MANY_RANKS, dtypes=ROUNDING))
def test_random_floats_through_the_engine_and_the_general_path(comm: mt.Communicator,
                                                               dtype: str) -> None:
    """Async allreduces fused into the engine's buckets, and named blocking calls (the
    general path of the default algorithm, not the small-call fast path)."""
    checks = Checks(comm)
    for op in ops_of(dtype):
        sizes = counts(comm.size)
        inputs = {n: [random_input(r, n, dtype, op) for r in range(comm.size)] for n in sizes}
        handles = {n: comm.allreduce_async(inputs[n][comm.rank], op=op) for n in sizes}
        for n in sizes:
            judge(checks, comm, "allreduce", f"async {dtype} {op} n={n}", handles[n].wait(),
                  inputs[n], op)
            got = comm.allreduce(inputs[n][comm.rank], op=op, name=f"numerics.{n}")
            judge(checks, comm, "allreduce", f"named {dtype} {op} n={n}", got, inputs[n], op)
    checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", dtype_params(many_ranks=MANY_RANKS,
                                                dtypes=["float16", "float32"]))
@pytest.mark.parametrize("layout", list(layouts(8)))
def test_random_floats_across_emulated_nodes(comm: mt.Communicator, layout: str,
                                             dtype: str) -> None:
    """The hierarchical allreduce across nodes: within the bound, the same bits on
    every rank of every node."""
    node_ids = layouts(comm.size).get(layout)
    if node_ids is None:
        pytest.skip(f"layout {layout} equals another one at {comm.size} ranks")
    c = with_nodes(comm.mpi_comm, node_ids)
    try:
        checks = Checks(c)
        for op in (mt.Sum, mt.Average):
            for count in counts(c.size, dtype):
                inputs = [random_input(r, count, dtype, op) for r in range(c.size)]
                got = c.allreduce(inputs[c.rank], op=op, algorithm="hierarchical")
                judge(checks, c, "allreduce", f"{op} n={count}", got, inputs, op)
        checks.verdict()
    finally:
        c.free()


# -- NaN and Inf ----------------------------------------------------------------------
def with_specials(rank: int, size: int, count: int, dtype: str,
                  op: mt.ReduceOp) -> np.ndarray[Any, Any]:
    """:func:`helpers.crafted` values with, by index mod 8: a NaN on one rank (0), +Inf
    on rank 0 (1), +Inf on rank 0 and -Inf on the last rank (2), -Inf everywhere (3),
    a NaN on the last rank and +Inf on rank 0 (4), 0 on rank 0 and +Inf on the last
    rank (5); 6 and 7 stay finite."""
    x = crafted(rank, count, dtype, op)
    i = np.arange(count)
    kind = i % 8
    x[(kind == 0) & (i // 8 % size == rank)] = np.nan
    x[kind == 3] = -np.inf
    if rank == 0:
        x[(kind == 1) | (kind == 2) | (kind == 4)] = np.inf
        x[kind == 5] = 0
    if rank == size - 1 and size > 1:
        x[kind == 2] = -np.inf
        x[kind == 4] = np.nan
        x[kind == 5] = np.inf
    return x


def numpy_reduction(inputs: list[np.ndarray[Any, Any]], op: mt.ReduceOp,
                    size: int) -> np.ndarray[Any, Any]:
    """What numpy's ufunc gives, rank by rank in the inputs' dtype (Average: Sum times
    ``1/size``, floor division for integers, as mpitrain defines it)."""
    acc = inputs[0].copy()
    for x in inputs[1:]:
        UFUNCS[op](acc, x, out=acc)
    if op is mt.Average:
        if acc.dtype.kind in "iu":
            np.floor_divide(acc, size, out=acc)
        else:
            np.multiply(acc, 1.0 / size, out=acc, casting="unsafe")
    return acc


def check_against_numpy(comm: mt.Communicator, collective: str, algorithm: str,
                        make: Any) -> None:
    """Every op of ``make(rank, count, op)``'s inputs equals :func:`numpy_reduction`."""
    checks = Checks(comm)
    for op in ALL_OPS:
        for count in (max(comm.size - 1, 1), 840, 1001):
            inputs = [make(r, count, op) for r in range(comm.size)]
            with np.errstate(invalid="ignore"):  # Inf - Inf, 0 * Inf: numpy warns
                got = reduce(comm, collective, algorithm, inputs[comm.rank].copy(), op)
                want = mine(comm, collective, numpy_reduction(inputs, op, comm.size))
            checks.equal(got, want, f"{collective} {algorithm} {op} n={count}")
    checks.verdict()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("collective,algorithm", REDUCING, ids=ids(REDUCING))
@pytest.mark.parametrize("dtype", SPECIAL)
def test_nan_and_inf_propagate(comm: mt.Communicator, collective: str, algorithm: str,
                               dtype: str) -> None:
    check_against_numpy(comm, collective, algorithm,
                        lambda r, n, op: with_specials(r, comm.size, n, dtype, op))
    # and they are there to propagate: the inputs hold NaN and both infinities
    sample = np.concatenate([with_specials(r, 2, 16, dtype, mt.Sum) for r in range(2)])
    assert np.isnan(sample).any() and np.isposinf(sample).any() and np.isneginf(sample).any()


# -- integer wrap-around --------------------------------------------------------------
def wrapping(rank: int, count: int, dtype: str, op: mt.ReduceOp) -> np.ndarray[Any, Any]:
    """Values near the dtype's maximum (two in three per rank) and minimum, so that sums
    wrap (products: a quarter of the maximum, so that they do too)."""
    dt = np.dtype(dtype)
    info = np.iinfo(dt)
    i = np.arange(count)
    step = ((i * 7 + rank * 3) % 9).astype(dt)
    if op is mt.Product:
        return np.full(count, info.max // 4 + 1, dt) + step
    high = np.full(count, info.max, dt) - step
    low = np.full(count, info.min, dt) + step
    return np.where((i + rank) % 3 == 0, low, high)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("collective,algorithm", REDUCING, ids=ids(REDUCING))
@pytest.mark.parametrize("dtype", INTEGERS)
def test_integers_wrap_around(comm: mt.Communicator, collective: str, algorithm: str,
                              dtype: str) -> None:
    check_against_numpy(comm, collective, algorithm,
                        lambda r, n, op: wrapping(r, n, dtype, op))
    # and they are there to wrap: two ranks' sums and products leave the dtype's range
    info = np.iinfo(dtype)
    for op in (mt.Sum, mt.Product):
        a, b = (wrapping(r, 9, dtype, op).tolist() for r in (0, 1))
        wide = [p + q if op is mt.Sum else p * q for p, q in zip(a, b)]
        assert any(not info.min <= v <= info.max for v in wide), f"{op} never wraps"
