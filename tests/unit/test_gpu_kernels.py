"""The CUDA kernels on a GPU, against numpy (skipped without CuPy and a CUDA device).

Every output is poisoned first (NaN, or a byte pattern outside the inputs' range) so
an element a kernel forgot to write fails. Floating results are compared with a
float64 reference within a relative error of a few units in the last place of their
dtype; integer results, and everything the numpy backend computes the same way
(unscaled reductions, casts, packing), must match exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gpu import cupy, requires_gpu

from mpitrain.backends import NUMPY, kernels
from mpitrain.dtypes import BFLOAT16
from mpitrain.ops import ReduceOp

pytestmark = requires_gpu

SIZES = [0, 1, 1000, 3_000_017]  # the last one needs the grid-stride loop
# Relative error allowed against float64: about three units of roundoff of the dtype.
RTOL = {"float16": 1.5e-3, "bfloat16": 1.2e-2, "float32": 2.5e-7, "float64": 4e-16}
OPS = list(kernels.OP_CODES)
POISON = 0xA5


def dtype_of(name: str) -> np.dtype[Any]:
    """numpy dtype of a kernel dtype name."""
    if name == "bfloat16":
        assert BFLOAT16 is not None, "bfloat16 needs ml_dtypes"
        return BFLOAT16
    return np.dtype(name)


def inputs(name: str, n: int, seed: int) -> np.ndarray[Any, Any]:
    """Values whose sums and products stay far from overflow."""
    rng = np.random.default_rng(seed)
    dt = dtype_of(name)
    if dt.kind in "iu":
        bound = 10_000 if dt.itemsize == 4 else 1_000_000_000
        return rng.integers(-bound, bound, size=n).astype(dt)
    return rng.uniform(-4.0, 4.0, size=n).astype(dt)


def poisoned(n: int, dt: np.dtype[Any]) -> Any:
    """A device array whose every byte is the poison pattern (NaN for floats)."""
    out = cupy.empty(n, dtype=dt)
    if dt.kind == "f" or dt == BFLOAT16:
        out.fill(np.nan)
    else:
        out.view(cupy.uint8).fill(POISON)
    return out


def assert_close(got: np.ndarray[Any, Any], want64: np.ndarray[Any, Any], name: str,
                 what: str) -> None:
    """Within RTOL of the float64 reference, relative to its magnitude."""
    got64 = got.astype(np.float64)
    tiny = float(np.finfo(np.float16).tiny) if name == "float16" else 1e-30
    bad = ~(np.abs(got64 - want64) <= RTOL[name] * np.abs(want64) + tiny)
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, first at "
                           f"{int(np.flatnonzero(bad)[0])}: got {got64[bad][0]}, "
                           f"want {want64[bad][0]}")


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("op", OPS, ids=[o.value for o in OPS])
@pytest.mark.parametrize("name", list(kernels.CTYPES))
def test_reduce_kernel(name: str, op: ReduceOp, scaled: bool) -> None:
    dt = dtype_of(name)
    factors = [1 / 3, 0.3] if scaled else [1.0]  # 1/3: integer floor division path
    for n in SIZES:
        a_host, b_host = inputs(name, n, 1), inputs(name, n, 2)
        a, b = cupy.asarray(a_host), cupy.asarray(b_host)
        for factor in factors:
            out = poisoned(n, dt)
            kernels.reduce(out, a, b, op, factor)
            got = cupy.asnumpy(out)
            want = np.empty(n, dt)
            NUMPY.reduce_into(want, a_host, b_host, op, factor)
            what = f"reduce {name} {op.value} x{factor} n={n}"
            if dt.kind in "iu" or not scaled:
                assert np.array_equal(got, want), what
            if dt.kind == "f" or dt == BFLOAT16:
                ufunc = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum,
                         ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}[op]
                ref = ufunc(a_host.astype(np.float64), b_host.astype(np.float64)) * factor
                assert_close(got, ref, name, what)
        in_place = a.copy()
        kernels.reduce(in_place, in_place, b, op)  # dst aliasing an input
        want = np.empty(n, dt)
        NUMPY.reduce_into(want, a_host, b_host, op)
        assert np.array_equal(cupy.asnumpy(in_place), want), f"in-place reduce {name} n={n}"


@pytest.mark.parametrize("name", list(kernels.CTYPES))
def test_scale_kernel(name: str) -> None:
    dt = dtype_of(name)
    for n in SIZES:
        host = inputs(name, n, 3)
        src = cupy.asarray(host)
        for factor in (1 / 3, 0.3, 2.0, 1 / 5):
            out = poisoned(n, dt)
            kernels.scale(out, src, factor)
            want = host.copy()
            NUMPY.scale(want, factor)
            got = cupy.asnumpy(out)
            what = f"scale {name} x{factor} n={n}"
            if dt.kind in "iu":
                assert np.array_equal(got, want), what
            else:
                assert_close(got, host.astype(np.float64) * factor, name, what)
            in_place = src.copy()
            kernels.scale(in_place, in_place, factor)
            assert np.array_equal(cupy.asnumpy(in_place), got), f"in-place {what}"


@pytest.mark.parametrize("pair", kernels.CASTS, ids=[f"{a}-{b}" for a, b in kernels.CASTS])
def test_cast_kernel(pair: tuple[str, str]) -> None:
    src_dt, dst_dt = dtype_of(pair[0]), dtype_of(pair[1])
    for n in SIZES:
        rng = np.random.default_rng(4)
        values = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, size=n)
        if n:
            values[:4] = [65504.0, 70000.0, -1e-9, 1.0 + 2.0 ** -9][:min(4, n)]
        host = values.astype(src_dt)
        out = poisoned(n, dst_dt)
        kernels.cast(out, cupy.asarray(host))
        want = np.empty(n, dst_dt)
        NUMPY.cast_into(want, host)
        got = cupy.asnumpy(out)
        assert np.array_equal(got, want), f"cast {pair} n={n}"


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32", "int64"])
def test_pack_and_unpack(dtype: str) -> None:
    dt = np.dtype(dtype)
    rng = np.random.default_rng(5)
    sizes = [0, 1, 7, 1000, 0, 300_001, 3]
    parts_host = [rng.integers(0, 100, size=s).astype(dt) for s in sizes]
    parts = [cupy.asarray(p) for p in parts_host]
    buf = poisoned(sum(sizes), dt)
    kernels.pack(buf, parts)
    assert np.array_equal(cupy.asnumpy(buf), np.concatenate(parts_host)), f"pack {dtype}"
    back = [poisoned(s, dt) for s in sizes]
    kernels.pack(buf, back, unpack=True)
    for i, (got, want) in enumerate(zip(back, parts_host)):
        assert np.array_equal(cupy.asnumpy(got), want), f"unpack {dtype} part {i}"


def test_pack_more_parts_than_one_grid_row() -> None:
    count = 70_000  # more than the 65535 blocks of gridDim.y
    parts_host = [np.full(1 + i % 3, i, np.int32) for i in range(count)]
    parts = [cupy.asarray(p) for p in parts_host]
    buf = poisoned(sum(p.size for p in parts_host), np.dtype(np.int32))
    kernels.pack(buf, parts)
    assert np.array_equal(cupy.asnumpy(buf), np.concatenate(parts_host))


def test_every_instantiation_loads_once_per_device() -> None:
    device = cupy.cuda.Device().id
    for name, source in kernels.SOURCES.items():
        module = kernels.module(name, device)
        assert kernels.module(name, device) is module
        for expression in source.names:
            assert module.get_function(expression) is not None, expression


def test_backend_covers_dtypes_without_kernels() -> None:
    from mpitrain.backends.cupy_backend import CUPY

    for dtype in ("int8", "uint16", "complex64"):
        a_host, b_host = (np.arange(50) % 7).astype(dtype), (np.arange(50) % 5).astype(dtype)
        out = CUPY.empty(50, dtype)
        CUPY.reduce_into(out, cupy.asarray(a_host), cupy.asarray(b_host), ReduceOp.SUM, 0.5)
        want = np.empty(50, dtype)
        NUMPY.reduce_into(want, a_host, b_host, ReduceOp.SUM, 0.5)
        assert np.array_equal(cupy.asnumpy(out), want), dtype


def test_foreign_streams_are_used_without_deprecation_and_outlive_their_wrapper() -> None:
    """A raw ``cudaStream_t`` (how a torch stream reaches the backend) becomes a CuPy
    stream without CuPy 14's ExternalStream warning, runs the scope's work, and stays
    usable once its wrapper is gone (the wrapper never destroys it)."""
    import gc
    import warnings

    from mpitrain.backends.cupy_backend import CUPY, as_stream

    owner = cupy.cuda.Stream(non_blocking=True)
    x = cupy.arange(1000, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        wrapped = as_stream(owner.ptr)
        assert wrapped.ptr == owner.ptr
        with CUPY.scope(x, owner.ptr):
            assert cupy.cuda.get_current_stream().ptr == owner.ptr
            x *= 2
        event = CUPY.record(x, owner.ptr)
    del wrapped
    gc.collect()
    event.synchronize()
    with owner:  # still a valid stream
        x += 1
    owner.synchronize()
    assert np.array_equal(cupy.asnumpy(x), np.arange(1000, dtype=np.float32) * 2 + 1)
