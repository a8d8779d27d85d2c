"""Host arrays: numpy (with ml_dtypes' bfloat16 when installed)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import numpy as np

from ..ops import ReduceOp
from . import hostcopy
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
    is_device = False

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

    def scatter(self, dsts: list[Array], rows: Array) -> None:
        """``dsts[i][...] = rows[i]``: one call of :mod:`.hostcopy` where it applies,
        else item assignment (cheaper per call than ``np.copyto``; the dtypes are
        equal, so no cast happens)."""
        if hostcopy.scatter(rows, dsts):
            return
        for dst, row in zip(dsts, rows):
            dst[...] = row

    def writes_through(self, arr: Array, obj: object) -> bool:
        """True if ``arr`` is ``obj`` or a view numpy made of an array subclass."""
        return arr is obj or isinstance(obj, type(arr))

    def reduce_into(self, dst: Array, a: Array, b: Array, op: ReduceOp,
                    factor: float = 1.0) -> None:
        """``dst = (a <op> b) * factor`` elementwise (16-bit floats in
        :mod:`.hostcopy` where it applies: numpy's are ten times slower)."""
        if hostcopy.reduce16(dst, a, b, op, factor):
            return
        _UFUNCS[op](a, b, out=dst)
        self.scale(dst, factor)

    def scale(self, arr: Array, factor: float) -> None:
        """Multiply in place; integer dtypes round toward minus infinity."""
        if factor == 1.0 or arr.size == 0 or hostcopy.scale16(arr, arr, factor):
            return
        if arr.dtype.kind in "iu":
            scale_integer(arr, factor, np)
        else:
            np.multiply(arr, factor, out=arr, casting="unsafe")

    def scale_into(self, dst: Array, src: Array, factor: float) -> None:
        """``dst = src * factor``: one pass for floats and complex numbers of one dtype
        (the multiplication writes ``dst``), else a copy scaled in place."""
        if factor != 1.0 and hostcopy.scale16(dst, src, factor):
            return
        if dst is not src and factor != 1.0 and dst.size and dst.dtype == src.dtype \
                and dst.dtype.kind in "fc":
            np.multiply(src, factor, out=dst, casting="unsafe")
            return
        if dst is not src:
            np.copyto(dst, src)
        self.scale(dst, factor)

    def cast_into(self, dst: Array, src: Array) -> None:
        """``dst = src`` converted to ``dst``'s dtype (round to nearest even; float32 <->
        float16/bfloat16 in :mod:`.hostcopy` where it applies)."""
        if not hostcopy.convert16(dst, src):
            np.copyto(dst, src, casting="unsafe")

    def pack_into(self, dst: Array, parts: list[Array]) -> None:
        """Copy flat ``parts`` one after the other into ``dst``: one call of
        :mod:`.hostcopy` where it applies, else one ``concatenate``."""
        if len(parts) > 1:
            if not hostcopy.gather(dst, parts):
                np.concatenate(parts, axis=None, out=dst)
        elif parts:
            dst[...] = parts[0]

    def unpack_from(self, src: Array, parts: list[Array]) -> None:
        """Copy consecutive pieces of ``src`` into ``parts``: one call of
        :mod:`.hostcopy` where it applies, else one assignment per part."""
        if len(parts) > 1 and hostcopy.scatter(src, parts):
            return
        start = 0
        for part in parts:
            part[...] = src[start:start + part.size]
            start += part.size

    def concatenate(self, arrays: list[Array]) -> np.ndarray[Any, Any]:
        """A new 1-D array of every array's elements in C order, one after another."""
        return np.concatenate(arrays, axis=None)

    def synchronize(self, stream: Any = None) -> None:
        """Host memory is always ready."""

    def scope(self, obj: object, stream: Any = None) -> ContextManager[None]:
        """Nothing to set up for host memory; ``stream`` is ignored."""
        return contextlib.nullcontext()

    def stream(self, obj: object, stream: Any = None) -> Any:
        """Host memory has no streams (``None``)."""
        return None

    def new_stream(self, obj: object) -> Any:
        """Host memory has no streams (``None``)."""
        return None

    def record(self, obj: object, stream: Any = None) -> Any:
        """Host memory is always ready: no event (``None``)."""
        return None

    def device_id(self, obj: object = None) -> int:
        """-1: host memory."""
        return -1

    def device(self) -> Any:
        """Host memory has no device."""
        raise TypeError("numpy arrays live in host memory; there is no device to stage from")
