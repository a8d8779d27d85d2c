"""op=Adasum: blocking and async results against a numpy reference of the pairwise
formula in the algorithm's tree order, exact properties, and the refusals (rank
counts that are not powers of two, integer dtypes, reduce_scatter, other algorithms).

Run at 1, 2, 4 and 8 ranks for results, at 3, 5, 6 and 7 for the refusal."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
from helpers import adasum_reference, assert_all_ranks, assert_equal_all_ranks

import mpitrain as mt
from mpitrain.dtypes import FLOAT_DTYPES

FLOATS = [str(d) for d in FLOAT_DTYPES]
pytestmark = [pytest.mark.many_ranks, pytest.mark.power_of_two]

TOLERANCE = {"float64": 1e-12, "float32": 4e-6, "float16": 8e-3, "bfloat16": 6e-2}
"""Largest error allowed, relative to the result's largest magnitude (a few units in
the last place: the reference rounds each level as the ranks do, but sums its dot
products in another order)."""


def power_of_two(size: int) -> bool:
    return size & (size - 1) == 0


@pytest.fixture
def acomm(env: pytest.MonkeyPatch) -> Iterator[mt.Communicator]:
    """A communicator whose waits raise after 120 s instead of hanging."""
    from mpi4py import MPI

    env.setenv("MPITRAIN_STALL_TIMEOUT_S", "120")
    env.setenv("MPITRAIN_STALL_ACTION", "raise")
    own = mt.Communicator(MPI.COMM_WORLD)
    yield own
    own.free()


def inputs(size: int, count: int, dtype: str) -> list[np.ndarray[Any, Any]]:
    """Every rank's input: random, different per rank and count, scaled per rank so
    that the coefficients differ from 1/2 and 1."""
    return [(np.random.default_rng(1000 * r + count).standard_normal(count) * (r + 1))
            .astype(dtype) for r in range(size)]


def check_result(comm: mt.Communicator, got: Any, want: Any, what: str) -> None:
    """``got`` is close to ``want`` (the dtype's tolerance) and the same bits on every rank."""
    got = np.asarray(got)
    scale = max(1.0, float(np.max(np.abs(want.astype(np.float64)), initial=0.0)))
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
    ok = got.dtype == want.dtype and got.shape == want.shape \
        and err <= TOLERANCE[str(want.dtype)] * scale
    assert_all_ranks(comm, ok, f"{what}: {got.dtype}{got.shape} off by {err} (scale {scale})")
    first = comm.broadcast_object(got.tobytes())
    assert_all_ranks(comm, first == got.tobytes(), f"{what}: ranks disagree")


def counts(size: int) -> list[int]:
    """0, 1, fewer than ranks, not divisible by the rank count, and several float64
    blocks per slice."""
    return sorted({0, 1, max(size - 1, 0), 1001, 200_003})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", FLOATS)
def test_blocking_matches_reference(acomm: mt.Communicator, dtype: str) -> None:
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    for count in counts(acomm.size):
        xs = inputs(acomm.size, count, dtype)
        want = adasum_reference(xs)
        x = xs[acomm.rank].copy()
        check_result(acomm, acomm.allreduce(x, op=mt.Adasum), want, f"allreduce n={count}")
        assert_equal_all_ranks(acomm, x, xs[acomm.rank], "allreduce must not modify its input")
        assert acomm.allreduce_(x, op="adasum") is x
        check_result(acomm, x, want, f"allreduce_ n={count}")


@pytest.mark.mpi(min_size=1)
def test_shapes_and_scaling(acomm: mt.Communicator) -> None:
    """A 2-D array reduces as its flat vector; postscale applies to the result."""
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    xs = [x.reshape(7, 11) for x in inputs(acomm.size, 77, "float64")]
    want = adasum_reference([x.reshape(-1) for x in xs]).reshape(7, 11)
    got = acomm.allreduce(xs[acomm.rank], op=mt.Adasum, postscale_factor=0.5)
    check_result(acomm, got, want * 0.5, "2-D, postscale 0.5")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("magnitude", ["tiny", "spread"])
def test_parallel_vectors_of_extreme_magnitudes_give_their_mean(
        acomm: mt.Communicator, dtype: str, magnitude: str) -> None:
    """Vectors along one direction combine into their mean, however small their squared
    norms (``tiny``: elements about 1e-30, squared norms far below 1e-8) or however far
    apart (``spread``: from there to near the square root of the dtype's largest), as
    the products and norms are float64; only a squared norm below ``sqrt(DBL_MIN)``
    (about 1.5e-154) counts as a zero vector (Horovod's floor)."""
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    direction = np.random.default_rng(7).standard_normal(257)
    n = acomm.size
    low, high = 1e-30, float(np.sqrt(np.finfo(dtype).max)) / 1e3
    if magnitude == "tiny":
        factors = [low * (r + 1) for r in range(n)]
    else:
        factors = [low ** ((n - r) / n) * high ** (r / n) for r in range(n)]
    xs = [(direction * f).astype(dtype) for f in factors]  # (rounding keeps them parallel enough)
    want = (sum(x.astype(np.float64) for x in xs) / n).astype(dtype)
    got = acomm.allreduce(xs[acomm.rank], op=mt.Adasum)
    err = float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))
    assert_all_ranks(acomm, err < 1e-5, f"{magnitude} {dtype}: off the mean by {err:.3g} "
                                        "(relative; 1 would be their sum)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", FLOATS)
def test_identical_vectors_give_that_vector(acomm: mt.Communicator, dtype: str) -> None:
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    x = inputs(1, 1001, dtype)[0]
    assert_equal_all_ranks(acomm, acomm.allreduce(x, op=mt.Adasum), x, "identical vectors")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", FLOATS)
def test_orthogonal_vectors_give_their_sum(acomm: mt.Communicator, dtype: str) -> None:
    """Each rank's vector is non-zero only on its own indices: the sum is exact."""
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    n, count = acomm.size, 1001
    xs = []
    for r, x in enumerate(inputs(n, count, dtype)):
        x[np.arange(count) % n != r] = 0
        xs.append(x)
    total = np.sum([x.astype(np.float64) for x in xs], axis=0).astype(dtype)
    assert_equal_all_ranks(acomm, acomm.allreduce(xs[acomm.rank], op=mt.Adasum), total,
                           "orthogonal vectors")


@pytest.mark.mpi(min_size=2)
def test_zero_vectors_add_nothing(acomm: mt.Communicator) -> None:
    """Only rank 0 has a non-zero vector: every rank gets it, unscaled."""
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    x = inputs(1, 513, "float32")[0]
    mine = x if acomm.rank == 0 else np.zeros_like(x)
    assert_equal_all_ranks(acomm, acomm.allreduce(mine, op=mt.Adasum), x, "one non-zero")
    zeros = np.zeros(9, np.float32)
    assert_equal_all_ranks(acomm, acomm.allreduce(zeros, op=mt.Adasum), zeros, "all zero")


@pytest.mark.mpi(min_size=1)
def test_async_matches_reference_and_is_never_fused(acomm: mt.Communicator) -> None:
    """Adasum arrays submitted together (with Sums in the same cycles) each get their
    own coefficients: a fused buffer would weigh them together."""
    if not power_of_two(acomm.size):
        pytest.skip("Adasum runs on power-of-two rank counts")
    n, r = acomm.size, acomm.rank
    checks = []
    for dtype in FLOATS:
        for count in (0, 1, 7, 1001):
            xs = inputs(n, count, dtype)
            want = adasum_reference(xs)
            checks.append((f"async {dtype} n={count}",
                           acomm.allreduce_async(xs[r], op=mt.Adasum), want))
            y = xs[r].copy()
            checks.append((f"async_ {dtype} n={count}",
                           acomm.allreduce_async_(y, op=mt.Adasum), want))
            checks.append((f"sum beside {dtype} n={count}",
                           acomm.allreduce_async(np.ones(count, dtype)), None))
    group = [inputs(n, c, "float32") for c in (5, 64, 3)]
    grouped = acomm.grouped_allreduce_async([g[r] for g in group], op=mt.Adasum)
    for what, handle, want in checks:
        got = handle.wait()
        if want is None:
            assert_equal_all_ranks(acomm, got, np.full(got.size, n, got.dtype), what)
        else:
            check_result(acomm, got, want, what)
    for i, (got, g) in enumerate(zip(grouped.wait(), group)):
        check_result(acomm, got, adasum_reference(g), f"grouped entry {i}")


@pytest.mark.mpi(min_size=3)
def test_refused_unless_power_of_two(acomm: mt.Communicator) -> None:
    if power_of_two(acomm.size):
        pytest.skip("Adasum is refused only on other rank counts")
    x = np.ones(5, np.float32)
    with pytest.raises(mt.UnsupportedError, match=rf"power-of-two.*has {acomm.size}"):
        acomm.allreduce(x, op=mt.Adasum)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        acomm.allreduce_async(x, op=mt.Adasum)
    # nothing was sent: the communicator goes on
    assert_equal_all_ranks(acomm, acomm.allreduce(x), np.full(5, acomm.size, np.float32),
                           "sum after the refusal")


@pytest.mark.mpi(min_size=1)
def test_misuse_raises(acomm: mt.Communicator) -> None:
    with pytest.raises(mt.DtypeError, match=r"Adasum combines float vectors.*int32"):
        acomm.allreduce(np.ones(4, np.int32), op=mt.Adasum)
    with pytest.raises(mt.DtypeError, match="Adasum"):
        acomm.allreduce_async(np.ones(4, np.complex64), op=mt.Adasum)
    with pytest.raises(mt.UnsupportedError, match="allreduce only"):
        acomm.reduce_scatter(np.ones(4, np.float32), op=mt.Adasum)
    if power_of_two(acomm.size):
        with pytest.raises(mt.ArgumentError, match="own algorithm, not 'ring'"):
            acomm.allreduce(np.ones(4, np.float32), op=mt.Adasum, algorithm="ring")
