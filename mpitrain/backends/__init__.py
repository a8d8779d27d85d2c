"""Array backends: numpy for host memory, cupy for device memory.

:func:`backend_for` picks the backend that owns an array (:func:`backend_and_array`
also returns the array); the comm layer never
imports numpy or cupy for the data path itself. The CuPy backend is registered
lazily: CuPy is imported only when a device array (a ``cupy.ndarray``, or any
object exposing ``__cuda_array_interface__`` or a CUDA ``__dlpack_device__``, such
as a torch CUDA tensor) is first passed in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DtypeError
from .base import Array, ArrayBackend, is_device_array
from .numpy_backend import NumpyBackend

NUMPY = NumpyBackend()
_BACKENDS: list[ArrayBackend] = []

def register(backend: ArrayBackend) -> None:
    """Add a backend consulted before numpy (device backends register themselves)."""
    if backend not in _BACKENDS:
        _BACKENDS.append(backend)


def _device_backend(obj: object) -> ArrayBackend:
    """Import, register and return the CuPy backend."""
    try:
        from .cupy_backend import CUPY
    except ImportError as exc:
        raise DtypeError(f"got a CUDA device array ({type(obj).__module__}."
                         f"{type(obj).__name__}) but CuPy cannot be imported ({exc}); install "
                         "the CuPy wheel for your CUDA, e.g. pip install cupy-cuda12x") from None
    register(CUPY)
    return CUPY


def backend_named(name: str) -> ArrayBackend:
    """The backend called ``name`` (``ArrayBackend.name``): numpy, or CuPy (imported and
    registered if need be); raises :class:`~mpitrain.DtypeError` for any other name."""
    for backend in (NUMPY, *_BACKENDS):
        if backend.name == name:
            return backend
    device = _device_backend(name)
    if device.name != name:
        raise DtypeError(f"no array backend is called {name!r}; the backends are "
                         f"{NUMPY.name!r} and {device.name!r}")
    return device


def backend_for(obj: object) -> ArrayBackend:
    """The backend that owns ``obj``; raises :class:`~mpitrain.DtypeError` if none does."""
    for backend in _BACKENDS:
        if backend.owns(obj):
            return backend
    if isinstance(obj, np.ndarray):
        return NUMPY
    if is_device_array(obj):
        return _device_backend(obj)
    if NUMPY.owns(obj) or isinstance(obj, (list, tuple, int, float, complex)):
        return NUMPY
    raise DtypeError(f"cannot use an object of type {type(obj).__name__} as a buffer; pass a "
                     "numpy array, a cupy array or a CUDA array (torch tensor, ...)")


def backend_and_array(x: Any) -> tuple[ArrayBackend, Array]:
    """The backend of ``x`` and ``x`` as its array (numpy arrays take the fast path)."""
    if type(x) is np.ndarray:
        return NUMPY, x
    be = backend_for(x)
    return be, be.asarray(x)


__all__ = ["NUMPY", "Array", "ArrayBackend", "backend_and_array", "backend_for", "backend_named",
           "is_device_array", "register"]
