"""The array-backend interface: everything the comm layer needs from an array library.

A backend wraps one array library (numpy for host memory, cupy for device memory).
The comm layer and the algorithms only ever call these methods, so an algorithm
written once runs on both. Arrays handed to a backend are already flat and
contiguous unless a method says otherwise.

Stream rule for device backends: every method queues its work on the current
stream and returns without waiting; :meth:`ArrayBackend.scope` makes the caller's
stream current for a whole collective and synchronizes it on entry (so MPI never
sees unfinished data) and on exit (so the result is complete on return).
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable

import numpy as np

from ..ops import ReduceOp

Array = Any  # numpy.ndarray or cupy.ndarray; the backend knows which


@runtime_checkable
class ArrayBackend(Protocol):
    """What an array library must provide to carry mpitrain collectives."""

    name: str
    """Short name shown in benchmark headers and errors (``numpy``, ``cupy``)."""

    is_device: bool
    """True for device memory (the comm layer then picks a transfer policy)."""

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

    def scatter(self, dsts: list[Array], rows: Array) -> None:
        """``dsts[i][...] = rows[i]`` for every ``i``: the rows of a 2-D array into
        arrays of the row's length and dtype (the unpacking of a fusion buffer)."""

    def writes_through(self, arr: Array, obj: object) -> bool:
        """True if writing into ``arr = asarray(obj)`` writes into ``obj``."""

    def reduce_into(self, dst: Array, a: Array, b: Array, op: ReduceOp,
                    factor: float = 1.0) -> None:
        """``dst = (a <op> b) * factor`` elementwise; ``dst`` may alias ``a`` or ``b``."""

    def scale(self, arr: Array, factor: float) -> None:
        """Multiply ``arr`` by ``factor`` in place (integers: floor of the product)."""

    def scale_into(self, dst: Array, src: Array, factor: float) -> None:
        """``dst = src * factor`` (as :meth:`scale`); ``dst`` may be ``src``."""

    def cast_into(self, dst: Array, src: Array) -> None:
        """``dst = src`` converted to ``dst``'s dtype (fp16/bf16 compression and back)."""

    def pack_into(self, dst: Array, parts: list[Array]) -> None:
        """Copy flat ``parts`` one after the other into ``dst`` (the fusion buffer)."""

    def unpack_from(self, src: Array, parts: list[Array]) -> None:
        """Copy consecutive pieces of ``src`` into flat ``parts`` (undoes :meth:`pack_into`)."""

    def concatenate(self, arrays: list[Array]) -> Array:
        """A new 1-D array of every array's elements in C order, one after another (any
        shapes and strides)."""

    def synchronize(self, stream: Any = None) -> None:
        """Block until queued work on ``stream`` is done so MPI may touch the memory."""

    def scope(self, obj: object, stream: Any = None) -> ContextManager[None]:
        """Run a collective on ``obj``'s device with ``stream`` (None: the current one)."""

    def stream(self, obj: object, stream: Any = None) -> Any:
        """The stream of ``obj``'s device that ``stream`` names (None: this thread's
        current one), as an object :meth:`scope` and :meth:`record` take on any thread
        later (the async engine records a submission's event on the stream that produced
        its array, and runs there the operations that hand out memory they allocate).
        ``None`` for host memory."""

    def new_stream(self, obj: object) -> Any:
        """A new stream of ``obj``'s device that synchronizes with no other stream (the
        legacy default stream included): the async engine's own, where it runs the
        operations that write only into memory their caller gave. ``None`` for host
        memory."""

    def record(self, obj: object, stream: Any = None) -> Any:
        """An event recorded now on ``stream`` (None: the current one) of ``obj``'s
        device: its ``synchronize()`` returns once the work queued there so far (what
        produces ``obj``) is done. ``None`` for host memory."""

    def device_id(self, obj: object = None) -> int:
        """The number of ``obj``'s device (None: of the current device; plans are kept
        per device); -1 for host memory."""

    def device(self) -> Any:
        """The current device as a :class:`~.device.Device` (device backends only)."""


# DLPack device types of memory a CUDA kernel can address: kDLCUDA, kDLCUDAManaged.
_DLPACK_CUDA = (2, 13)


def is_device_array(obj: object) -> bool:
    """True for CUDA device arrays, recognised without importing any GPU library."""
    if type(obj).__module__.split(".")[0] == "cupy":
        return True
    try:
        if hasattr(obj, "__cuda_array_interface__"):
            return True
    except Exception:  # torch raises RuntimeError for tensors that require grad
        pass
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is None or isinstance(obj, np.ndarray):
        return False
    try:
        return int(dlpack_device()[0]) in _DLPACK_CUDA
    except Exception:  # a producer that cannot say where its memory is: not ours
        return False
