"""Array backends: numpy for host memory (cupy for device memory slots in here).

:func:`backend_for` picks the backend that owns an array; the comm layer never
imports numpy or cupy for the data path itself.
"""

from __future__ import annotations

from ..errors import DtypeError
from .base import Array, ArrayBackend
from .numpy_backend import NumpyBackend

NUMPY = NumpyBackend()
_BACKENDS: list[ArrayBackend] = []


def register(backend: ArrayBackend) -> None:
    """Add a backend consulted before numpy (device backends register themselves)."""
    if backend not in _BACKENDS:
        _BACKENDS.append(backend)


def backend_for(obj: object) -> ArrayBackend:
    """The backend that owns ``obj``; raises :class:`~mpitrain.DtypeError` if none does."""
    for backend in _BACKENDS:
        if backend.owns(obj):
            return backend
    if NUMPY.owns(obj) or isinstance(obj, (list, tuple, int, float, complex)):
        return NUMPY
    raise DtypeError(f"cannot use an object of type {type(obj).__name__} as a buffer; pass a "
                     "numpy array (or a cupy array / torch tensor with the matching adapter)")


__all__ = ["NUMPY", "Array", "ArrayBackend", "backend_for", "register"]
