"""Host arrays: numpy (with ml_dtypes' bfloat16 when installed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import ReduceOp
from .base import Array

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


def scale_integer(arr: Any, factor: float, xp: Any) -> None:
    """Scale an integer array in place, rounding toward minus infinity.

    A factor of exactly ``1/k`` (Average's ``1/size``) divides by ``k`` with integer
    floor division, so ``Average`` of integers is exact floor division, not subject
    to float rounding.
    """
    inverse = 1.0 / factor if factor != 0 else 0.0
    k = round(inverse)
    if k != 0 and abs(inverse - k) <= 1e-12 * abs(inverse):
        xp.floor_divide(arr, k, out=arr)
    else:
        arr[...] = xp.floor(arr.astype(xp.float64) * factor).astype(arr.dtype)


class NumpyBackend:
    """The host-memory backend."""

    name = "numpy"

    def owns(self, obj: object) -> bool:
        """True for numpy arrays and anything numpy wraps without a copy."""
        return isinstance(obj, np.ndarray) or hasattr(obj, "__array_interface__")

    def asarray(self, obj: object) -> np.ndarray[Any, Any]:
        """``obj`` as a numpy array, without a copy where possible."""
        return np.asarray(obj)

    def empty(self, count: int, dtype: Any) -> np.ndarray[Any, Any]:
        """A new flat uninitialised array."""
        return np.empty(count, dtype=dtype)

    def empty_like(self, arr: Array) -> np.ndarray[Any, Any]:
        """A new uninitialised array shaped like ``arr``."""
        return np.empty_like(arr)

    def is_contiguous(self, arr: Array) -> bool:
        """True if ``arr`` is C-contiguous."""
        return bool(arr.flags.c_contiguous)

    def is_writeable(self, arr: Array) -> bool:
        """True if ``arr`` is writeable."""
        return bool(arr.flags.writeable)

    def ascontiguous(self, arr: Array) -> np.ndarray[Any, Any]:
        """``arr`` or a C-contiguous copy of it."""
        return np.ascontiguousarray(arr)

    def flat(self, arr: Array) -> np.ndarray[Any, Any]:
        """A flat view of a contiguous array (the array itself when already flat)."""
        return arr if arr.ndim == 1 else arr.reshape(-1)

    def as_bytes(self, flat: Array) -> np.ndarray[Any, Any]:
        """A uint8 view of a flat contiguous array."""
        return flat.view(np.uint8)

    def copy_into(self, dst: Array, src: Array) -> None:
        """``dst[...] = src``."""
        np.copyto(dst, src)

    def reduce_into(self, dst: Array, a: Array, b: Array, op: ReduceOp) -> None:
        """``dst = a <op> b`` elementwise."""
        _UFUNCS[op](a, b, out=dst)

    def scale(self, arr: Array, factor: float) -> None:
        """Multiply in place; integer dtypes round toward minus infinity."""
        if factor == 1.0 or arr.size == 0:
            return
        if arr.dtype.kind in "iu":
            scale_integer(arr, factor, np)
        else:
            np.multiply(arr, factor, out=arr, casting="unsafe")

    def concatenate(self, arrays: list[Array]) -> np.ndarray[Any, Any]:
        """Concatenate along axis 0."""
        return np.concatenate(arrays, axis=0)

    def synchronize(self, stream: Any = None) -> None:
        """Host memory is always ready."""
