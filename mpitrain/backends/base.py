"""The array-backend interface: everything the comm layer needs from an array library.

A backend wraps one array library (numpy for host memory, cupy for device memory).
The comm layer and the algorithms only ever call these methods, so an algorithm
written once runs on both. Arrays handed to a backend are already flat and
contiguous unless a method says otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..ops import ReduceOp

Array = Any  # numpy.ndarray or cupy.ndarray; the backend knows which


@runtime_checkable
class ArrayBackend(Protocol):
    """What an array library must provide to carry mpitrain collectives."""

    name: str
    """Short name shown in benchmark headers and errors (``numpy``, ``cupy``)."""

    def owns(self, obj: object) -> bool:
        """True if ``obj`` is an array of this backend (or convertible without a copy)."""

    def asarray(self, obj: object) -> Array:
        """Return ``obj`` as this backend's array, without copying."""

    def empty(self, count: int, dtype: Any) -> Array:
        """A new flat uninitialised array of ``count`` elements."""

    def empty_like(self, arr: Array) -> Array:
        """A new uninitialised array with ``arr``'s shape and dtype."""

    def is_contiguous(self, arr: Array) -> bool:
        """True if ``arr`` is C-contiguous."""

    def is_writeable(self, arr: Array) -> bool:
        """True if ``arr`` may be written in place."""

    def ascontiguous(self, arr: Array) -> Array:
        """``arr`` itself when C-contiguous, else a C-contiguous copy."""

    def flat(self, arr: Array) -> Array:
        """A flat view of a contiguous ``arr`` (no copy)."""

    def as_bytes(self, flat: Array) -> Array:
        """A uint8 view of a flat contiguous array: what goes to MPI."""

    def copy_into(self, dst: Array, src: Array) -> None:
        """``dst[...] = src`` for same-shaped arrays."""

    def reduce_into(self, dst: Array, a: Array, b: Array, op: ReduceOp) -> None:
        """``dst = a <op> b`` elementwise; ``dst`` may alias ``a`` or ``b``."""

    def scale(self, arr: Array, factor: float) -> None:
        """Multiply ``arr`` by ``factor`` in place (integers: floor of the product)."""

    def concatenate(self, arrays: list[Array]) -> Array:
        """Concatenate along axis 0."""

    def synchronize(self, stream: Any = None) -> None:
        """Block until queued work on ``stream`` is done so MPI may touch the memory."""
