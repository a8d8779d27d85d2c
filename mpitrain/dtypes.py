"""The one table of dtypes mpitrain moves and reduces.

Every collective moves raw bytes; only reductions care about the element type. A
dtype is supported when numpy (or ``ml_dtypes`` for bfloat16) can reduce it. The
native MPI algorithm reduces with MPI's predefined operations where MPI has a
datatype for it, and with a user-defined operation (our numpy reduction) for float16
and bfloat16, which MPI cannot reduce portably.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import DtypeError
from .ops import ReduceOp

try:  # bfloat16 is optional
    import ml_dtypes

    BFLOAT16: np.dtype[Any] | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    BFLOAT16 = None

INTEGER_DTYPES = tuple(np.dtype(c) for c in ("int8", "uint8", "int16", "uint16", "int32",
                                              "uint32", "int64", "uint64"))
FLOAT_DTYPES = tuple(np.dtype(c) for c in ("float16", "float32", "float64")) + (
    (BFLOAT16,) if BFLOAT16 is not None else ())
COMPLEX_DTYPES = (np.dtype("complex64"), np.dtype("complex128"))
SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = INTEGER_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES
_CODES: dict[np.dtype[Any], int] = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
_NAMES: dict[np.dtype[Any], str] = {dt: str(dt) for dt in SUPPORTED_DTYPES}

# Dtypes whose reduction MPI's predefined operations cannot do portably.
_REDUCED_BY_US = {np.dtype("float16")} | ({BFLOAT16} if BFLOAT16 is not None else set())


def check_dtype(dtype: Any, *, rank: int | None = None) -> np.dtype[Any]:
    """Return ``np.dtype(dtype)`` if mpitrain can move and reduce it, else raise."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    if dt not in _CODES:
        where = f"rank {rank}: " if rank is not None else ""
        hint = " (cast with .astype(np.uint8))" if dt == np.dtype(bool) else ""
        raise DtypeError(f"{where}dtype {dt} is not supported{hint}; supported: "
                         + ", ".join(str(d) for d in SUPPORTED_DTYPES))
    return dt


def check_op_for_dtype(op: ReduceOp, dt: np.dtype[Any]) -> None:
    """Raise if ``op`` has no meaning for ``dt`` (Min/Max on complex numbers, Adasum on
    anything but floats)."""
    if op is ReduceOp.ADASUM and dt not in FLOAT_DTYPES:
        raise DtypeError(f"op=Adasum combines float vectors, but got dtype {dt}; pass one of "
                         + ", ".join(str(d) for d in FLOAT_DTYPES)
                         + " (e.g. x.astype(np.float32))")
    if dt.kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise DtypeError(f"{op!r} is undefined for complex dtype {dt}; reduce the real "
                         "and imaginary parts (x.real, x.imag) separately")


def is_float(dt: np.dtype[Any]) -> bool:
    """True for floating (and bfloat16) dtypes."""
    return dt in FLOAT_DTYPES


def is_integer(dt: np.dtype[Any]) -> bool:
    """True for the integer dtypes."""
    return dt in INTEGER_DTYPES


def mpi_reduces_natively(dt: np.dtype[Any]) -> bool:
    """True if MPI's predefined reduction operations handle ``dt`` portably."""
    return dt not in _REDUCED_BY_US


def dtype_name(dt: np.dtype[Any]) -> str:
    """Short name used in tables and error messages (``float32``, ``bfloat16``).

    A table lookup: ``dtype.name`` costs microseconds, too much for every call.
    """
    name = _NAMES.get(dt)
    return name if name is not None else str(dt)


def dtype_code(dt: np.dtype[Any]) -> int:
    """A small stable integer for ``dt``, used in cross-rank fingerprints."""
    return _CODES[dt]
