"""The compiled float16/bfloat16 reductions (:func:`hostcopy.reduce16`, ``scale16``)
against numpy and ml_dtypes, and the numpy backend's use of them."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from mpitrain.backends import NUMPY, hostcopy
from mpitrain.dtypes import BFLOAT16
from mpitrain.ops import ReduceOp

built = pytest.mark.skipif(not hostcopy.compiled(), reason="the _hostcopy extension is not "
                                                           "built (setup.py)")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf and NaN on purpose
HALVES = ["float16"] + (["bfloat16"] if BFLOAT16 is not None else [])
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
SIZES = [0, 1, 7, 2047, 2049, 100_003]  # around the extension's block of 2048 elements
SPECIAL = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 6e-8, -6e-8, 6.1e-5, 65504.0,
           -65504.0, 3.0e38]  # subnormals, float16's extremes, bfloat16's range


@pytest.fixture(params=["simd", "portable"])
def conversion(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the SIMD paths (F16C conversions, the fused one-pass loops of
    float16 and bfloat16), then with the portable code."""
    if not hostcopy.compiled():
        pytest.skip("the _hostcopy extension is not built")
    extension: Any = hostcopy._EXTENSION
    was = extension.use_simd(request.param == "simd")
    # asking again says whether the first call left a SIMD path in use
    if request.param == "simd" and not extension.use_simd(True):
        extension.use_simd(was)
        pytest.skip("this processor has neither F16C nor AVX2")
    yield str(request.param)
    extension.use_simd(was)


def _operands(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays of ``n`` values: random magnitudes over float16's range and beyond,
    with special values mixed in at fixed places."""
    rng = np.random.default_rng(seed)
    pair = []
    for _ in range(2):
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 6, n)
        x[::13] = np.resize(SPECIAL, x[::13].size)
        rng.shuffle(x[::13])
        with np.errstate(over="ignore"):
            pair.append(x.astype(np.float32).astype(dtype))
    return pair[0], pair[1]


def _numpy_reduce(a: np.ndarray, b: np.ndarray, op: ReduceOp) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(UFUNCS[op](a, b))


def _same(got: np.ndarray, want: np.ndarray, both_nan: np.ndarray | None = None) -> None:
    """Bit for bit, except that where ``both_nan`` a NaN of any payload will do (which
    operand's NaN survives NaN + NaN is the compiler's choice, in numpy as here)."""
    gb, wb = got.view(np.uint16), want.view(np.uint16)
    differ = gb != wb
    if both_nan is not None:
        differ &= ~(both_nan & np.isnan(got.astype(np.float32)))
    assert not differ.any(), (f"{int(differ.sum())} of {got.size} differ, first at "
                              f"{np.flatnonzero(differ)[:5]}: got {gb[differ][:5]}, "
                              f"want {wb[differ][:5]}")


def _nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(x.astype(np.float32))


@built
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_matches_numpy(conversion: str, dtype: str, op: ReduceOp, n: int) -> None:
    """Without a factor every op is bit for bit numpy's (ml_dtypes' for bfloat16)."""
    a, b = _operands(n, dtype, seed=n)
    dst = np.full(n, 7, dtype)
    assert hostcopy.reduce16(dst, a, b, op) is True
    want = _numpy_reduce(a, b, op)
    if dtype == "bfloat16" and op in (ReduceOp.MIN, ReduceOp.MAX):
        # ml_dtypes keeps the second of two equal zeros, numpy (and we) the first
        zeros = (a == 0) & (b == 0)
        want[zeros] = a[zeros]
    _same(dst, want, _nan(a) & _nan(b))


@built
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
def test_every_float16_against_special_values(conversion: str, op: ReduceOp) -> None:
    """All 65536 float16 values (subnormals, inf, every NaN) with each special value."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for value in SPECIAL:
        with np.errstate(over="ignore"):
            other = np.full(every.size, value, np.float16)
        dst = np.empty_like(every)
        assert hostcopy.reduce16(dst, every, other, op)
        _same(dst, _numpy_reduce(every, other, op), _nan(every) & _nan(other))


@built
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("factor", [0.5, 1 / 3, 0.2, 3.0])
def test_factor_as_numpy_applies_it(conversion: str, dtype: str, op: ReduceOp,
                                    factor: float) -> None:
    """``(a <op> b) * factor`` as numpy computes it: the reduction rounded, the factor
    rounded to the 16-bit type, the product rounded (bit for bit)."""
    a, b = _operands(5001, dtype, seed=3)
    want = _numpy_reduce(a, b, op)
    if dtype == "bfloat16" and op in (ReduceOp.MIN, ReduceOp.MAX):
        zeros = (a == 0) & (b == 0)
        want[zeros] = a[zeros]
    with np.errstate(all="ignore"):
        np.multiply(want, factor, out=want, casting="unsafe")
    dst = np.empty_like(a)
    assert hostcopy.reduce16(dst, a, b, op, factor)
    _same(dst, want, _nan(a) & _nan(b))
    scaled = np.empty_like(a)
    assert hostcopy.scale16(scaled, a, factor)
    with np.errstate(all="ignore"):
        _same(scaled, np.multiply(a, factor).astype(dtype))


@built
@pytest.mark.parametrize("dtype", HALVES)
def test_in_place_aliasing(conversion: str, dtype: str) -> None:
    """``dst`` may be either operand, or the source of a scale."""
    a, b = _operands(10_001, dtype, seed=5)
    want = _numpy_reduce(a, b, ReduceOp.SUM)
    both_nan = _nan(a) & _nan(b)
    first, second = a.copy(), b.copy()
    assert hostcopy.reduce16(first, first, b, ReduceOp.SUM)
    assert hostcopy.reduce16(second, a, second, ReduceOp.SUM)
    _same(first, want, both_nan)
    _same(second, want, both_nan)
    assert hostcopy.scale16(first, first, 0.25)
    with np.errstate(all="ignore"):
        _same(first, np.multiply(want, 0.25).astype(dtype))


@built
def test_declines_what_it_cannot_do() -> None:
    """Other dtypes, mixed dtypes, strided or read-only arrays, unequal lengths: False,
    and the destination is untouched."""
    a = np.arange(10, dtype=np.float16)
    dst = np.full(10, 9, np.float16)
    readonly = dst.copy()
    readonly.flags.writeable = False
    assert hostcopy.reduce16(np.zeros(10, np.float32), a.astype(np.float32),
                             a.astype(np.float32), ReduceOp.SUM) is False
    assert hostcopy.reduce16(dst, a, a.astype(np.float32), ReduceOp.SUM) is False
    assert hostcopy.reduce16(dst[::2], a[::2], a[::2], ReduceOp.SUM) is False
    assert hostcopy.reduce16(dst, a, a[:5], ReduceOp.SUM) is False
    assert hostcopy.reduce16(readonly, a, a, ReduceOp.SUM) is False
    assert hostcopy.scale16(dst[:5], a, 2.0) is False
    assert (dst == 9).all() and (readonly == 9).all()


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("path", ["extension", "numpy"])
def test_numpy_backend_reduces_alike_with_and_without(path: str, dtype: str,
                                                      monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The backend's reduce_into/scale/scale_into give numpy's sums either way (the
    fallback when the extension is not built)."""
    if path == "extension" and not hostcopy.compiled():
        pytest.skip("the _hostcopy extension is not built")
    if path == "numpy":
        monkeypatch.setattr(hostcopy, "_EXTENSION", None)
    a, b = _operands(3001, dtype, seed=11)
    dst = np.empty_like(a)
    NUMPY.reduce_into(dst, a, b, ReduceOp.SUM)
    _same(dst, _numpy_reduce(a, b, ReduceOp.SUM), _nan(a) & _nan(b))
    exact = np.arange(3001).astype(dtype)  # halving is exact either way
    NUMPY.scale(exact, 0.5)
    _same(exact, (np.arange(3001) / 2).astype(dtype))
    out = np.empty_like(exact)
    NUMPY.scale_into(out, exact, 2.0)
    _same(out, np.arange(3001).astype(dtype))


@built
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("n", SIZES)
def test_convert_matches_numpy(conversion: str, dtype: str, n: int) -> None:
    """float32 -> 16 bits rounds as numpy's (ml_dtypes') cast, and back is exact: NaN
    payloads aside, bit for bit, every 16-bit value and float32 values around them."""
    rng = np.random.default_rng(n)
    wide = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 40, n)).astype(np.float32)
    wide[::11] = np.resize(np.array(SPECIAL, np.float32), wide[::11].size)
    halves = np.empty(n, dtype)
    assert hostcopy.convert16(halves, wide)
    with np.errstate(over="ignore"):
        _same(halves, wide.astype(dtype), np.isnan(wide))
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    back = np.empty(every.size, np.float32)
    assert hostcopy.convert16(back, every)
    want = every.astype(np.float32)
    assert ((back.view(np.uint32) == want.view(np.uint32)) | (np.isnan(back) & np.isnan(want))
            ).all()


@built
def test_convert_declines_other_dtypes() -> None:
    """Neither side float32, float64 sources, unequal lengths: False, nothing written."""
    dst = np.full(4, 9, np.float16)
    assert hostcopy.convert16(dst, np.ones(4, np.float64)) is False
    assert hostcopy.convert16(dst, np.ones(4, np.float16)) is False
    assert hostcopy.convert16(dst, np.ones(5, np.float32)) is False
    assert hostcopy.convert16(np.ones(4, np.int32), dst) is False
    assert (dst == 9).all()
