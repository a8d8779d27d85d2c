"""Device arrays: CuPy, and every CUDA array CuPy can wrap without a copy.

A ``cupy.ndarray`` is used as it is; any other object with ``__dlpack__`` (torch
CUDA tensors, JAX, ...) goes through ``cupy.from_dlpack`` and one with only
``__cuda_array_interface__`` (Numba, ...) through ``cupy.asarray``, both zero-copy,
so in-place collectives write into the caller's memory. Results are CuPy arrays on
the input's device.

Reductions, scaling, compression casts and fusion-buffer packing run as the CUDA
kernels of ``kernels/`` (:mod:`.kernels`) for float16, bfloat16, float32, float64,
int32 and int64, and as CuPy element-wise operations for the other dtypes.

Stream rule: all work goes to the current stream. :meth:`CupyBackend.scope` makes
the collective's ``stream`` current on the array's device and synchronizes it on
entry and on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any, Iterator

import cupy
import numpy as np

from ..ops import ReduceOp
from . import kernels
from .base import Array, is_device_array
from .device import Export
from .numpy_backend import scale_integer

_UFUNCS = {
    ReduceOp.SUM: cupy.add,
    ReduceOp.AVERAGE: cupy.add,
    ReduceOp.MIN: cupy.minimum,
    ReduceOp.MAX: cupy.maximum,
    ReduceOp.PRODUCT: cupy.multiply,
}
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2


def as_stream(stream: Any) -> Any:
    """A CuPy stream for ``stream``: None (the current stream), a CuPy stream, an object
    with ``cuda_stream`` (torch) or ``ptr``, or a raw ``cudaStream_t`` integer.

    Another library's stream is wrapped with ``cupy.cuda.Stream.from_external`` (the
    CUDA stream protocol, CuPy 14 and later; the wrapper never destroys the stream),
    or with ``cupy.cuda.ExternalStream`` where CuPy has no ``from_external`` (CuPy 14
    deprecates it)."""
    if stream is None:
        return cupy.cuda.get_current_stream()
    if isinstance(stream, cupy.cuda.Stream):
        return stream
    handle = getattr(stream, "cuda_stream", getattr(stream, "ptr", stream))
    if not isinstance(handle, int):
        raise TypeError(f"stream= must be a CUDA stream (cupy, torch or an int handle), got "
                        f"{type(stream).__name__}")
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(handle)
    return from_external(StreamHandle(handle))


class StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol, for
    ``cupy.cuda.Stream.from_external``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(0, handle)``: the protocol's version 0."""
        return (0, self.ptr)


_BUFFER_ID = 7
"""``CU_POINTER_ATTRIBUTE_BUFFER_ID``: an allocation's identity, unique in the process."""


@functools.cache
def _driver() -> Any:
    """The CUDA driver's ``cuMemGetAddressRange_v2`` (the allocation that holds an
    address) and ``cuPointerGetAttribute``, or None where the driver cannot be loaded."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    address_range = driver.cuMemGetAddressRange_v2
    address_range.restype = ctypes.c_int
    address_range.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                              ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    attribute = driver.cuPointerGetAttribute
    attribute.restype = ctypes.c_int
    attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    return address_range, attribute


class CupyDevice:
    """One GPU, as the staging transport and the ``ipc`` algorithms see it
    (:class:`~.device.IpcDevice`)."""

    def __init__(self, device_id: int) -> None:
        self.id = device_id
        self.identity = cupy.cuda.Device(device_id).pci_bus_id
        self._handles: dict[tuple[int, int], bytes] = {}  # (base, buffer id) -> handle

    def can_map(self, identity: str) -> bool:
        """True for this GPU, and for a visible peer GPU this one can access."""
        if identity == self.identity:
            return True
        try:
            peer = cupy.cuda.runtime.deviceGetByPCIBusId(identity)
        except cupy.cuda.runtime.CUDARuntimeError:
            return False  # not visible in this process
        return bool(cupy.cuda.runtime.deviceCanAccessPeer(self.id, peer))

    def export(self, arr: Any) -> Export | None:
        """The IPC handle of the allocation holding ``arr`` (found by the driver: CuPy's
        and torch's pools hand out pieces of larger allocations) and ``arr``'s offset
        in it; None where the memory has no such handle (``cudaMallocAsync`` pools).
        Handles are kept per allocation (its address and buffer id): asking the runtime
        each call costs more than the call."""
        driver = _driver()
        if driver is None:
            return None
        address_range, attribute = driver
        ptr = int(arr.data.ptr)
        base, size, buffer_id = ctypes.c_uint64(0), ctypes.c_size_t(0), ctypes.c_uint64(0)
        if address_range(ctypes.byref(base), ctypes.byref(size), ptr) != 0 or \
                attribute(ctypes.byref(buffer_id), _BUFFER_ID, ptr) != 0:
            return None
        key = (base.value, buffer_id.value)
        handle = self._handles.get(key)
        if handle is None:
            try:
                handle = cupy.cuda.runtime.ipcGetMemHandle(base.value)
            except cupy.cuda.runtime.CUDARuntimeError:
                return None
            if len(self._handles) >= 1024:
                self._handles.clear()
            self._handles[key] = handle
        return Export(handle, base.value, buffer_id.value, ptr - base.value)

    def open(self, handle: bytes) -> int:
        """Map a peer's allocation (peer access enabled as needed); its address here."""
        with cupy.cuda.Device(self.id):
            return int(cupy.cuda.runtime.ipcOpenMemHandle(handle))

    def view(self, mapping: int, offset: int, count: int, dtype: Any) -> Any:
        """A flat CuPy array of ``count`` elements at byte ``offset`` of a mapping."""
        dtype = np.dtype(dtype)
        memory = cupy.cuda.UnownedMemory(mapping + offset, count * dtype.itemsize, None,
                                         self.id)
        return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(memory, 0))

    def close(self, mapping: int) -> None:
        """Unmap a peer's allocation."""
        with cupy.cuda.Device(self.id):
            cupy.cuda.runtime.ipcCloseMemHandle(mapping)

    def current_stream(self) -> Any:
        """CuPy's current stream."""
        return cupy.cuda.get_current_stream()

    def new_stream(self) -> Any:
        """A non-blocking stream on this device."""
        with cupy.cuda.Device(self.id):
            return cupy.cuda.Stream(non_blocking=True)

    def new_event(self) -> Any:
        """An event without timing."""
        with cupy.cuda.Device(self.id):
            return cupy.cuda.Event(disable_timing=True)

    def pinned(self, nbytes: int) -> np.ndarray[Any, Any]:
        """Page-locked host memory (from CuPy's pinned pool) as a uint8 array."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        memory = cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)

    def copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Any) -> None:
        """Queue a device-to-host copy of ``src``'s bytes into ``dst``."""
        _check_sizes(dst, src)
        cupy.cuda.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, src.nbytes,
                                      _MEMCPY_DEVICE_TO_HOST, stream.ptr)

    def copy_to_device(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        """Queue a host-to-device copy of ``src``'s bytes into ``dst``."""
        _check_sizes(dst, src)
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                      _MEMCPY_HOST_TO_DEVICE, stream.ptr)


def _check_sizes(dst: Any, src: Any) -> None:
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes} bytes")


@functools.cache
def _device(device_id: int) -> CupyDevice:
    return CupyDevice(device_id)


class CupyBackend:
    """The device-memory backend."""

    name = "cupy"
    is_device = True

    def owns(self, obj: object) -> bool:
        """True for CuPy arrays and CUDA arrays CuPy wraps without a copy."""
        return isinstance(obj, cupy.ndarray) or (not isinstance(obj, np.ndarray)
                                                  and is_device_array(obj))

    def asarray(self, obj: object) -> Any:
        """``obj`` as a CuPy array sharing its memory."""
        if isinstance(obj, cupy.ndarray):
            return obj
        if hasattr(obj, "__dlpack__"):
            return cupy.from_dlpack(obj)
        return cupy.asarray(obj)

    def writes_through(self, arr: Array, obj: object) -> bool:
        """Always: :meth:`asarray` never copies."""
        return True

    def empty(self, count: int, dtype: Any) -> Any:
        """A new flat array on the current device."""
        return cupy.empty(count, dtype=dtype)

    def empty_like(self, arr: Array) -> Any:
        """A new array shaped like ``arr``."""
        return cupy.empty_like(arr)

    def is_contiguous(self, arr: Array) -> bool:
        """True if ``arr`` is C-contiguous."""
        return bool(arr.flags.c_contiguous)

    def is_writeable(self, arr: Array) -> bool:
        """CuPy arrays are always writeable."""
        return True

    def ascontiguous(self, arr: Array) -> Any:
        """``arr`` or a C-contiguous copy."""
        return cupy.ascontiguousarray(arr)

    def flat(self, arr: Array) -> Any:
        """A flat view of a contiguous array."""
        return arr.reshape(-1)

    def as_bytes(self, flat: Array) -> Any:
        """A uint8 view of a flat contiguous array."""
        return flat.view(cupy.uint8)

    def copy_into(self, dst: Array, src: Array) -> None:
        """``dst[...] = src`` on the current stream (arrays of one dtype, shape and C
        layout by one ``cudaMemcpyAsync``: a third of ``cupy.copyto``'s host time)."""
        if dst.dtype == src.dtype and dst.shape == src.shape and \
                dst.flags.c_contiguous and src.flags.c_contiguous:
            if dst.nbytes and dst.data.ptr != src.data.ptr:
                dst.data.copy_from_device_async(src.data, dst.nbytes)
            return
        cupy.copyto(dst, src)

    def scatter(self, dsts: list[Array], rows: Array) -> None:
        """``dsts[i][...] = rows[i]``, one copy per array on the current stream."""
        for dst, row in zip(dsts, rows):
            cupy.copyto(dst, row)

    def reduce_into(self, dst: Array, a: Array, b: Array, op: ReduceOp,
                    factor: float = 1.0) -> None:
        """``dst = (a <op> b) * factor``: one kernel for the kernel dtypes."""
        if kernels.has_kernel(dst.dtype):
            kernels.reduce(dst, a, b, op, factor)
        else:
            _UFUNCS[op](a, b, out=dst)
            self.scale(dst, factor)

    def scale(self, arr: Array, factor: float) -> None:
        """Multiply in place; integers round toward minus infinity."""
        self.scale_into(arr, arr, factor)

    def scale_into(self, dst: Array, src: Array, factor: float) -> None:
        """``dst = src * factor``: one kernel (copy and scale fused) for the kernel dtypes."""
        if factor == 1.0 or dst.size == 0:
            if dst is not src:
                cupy.copyto(dst, src)
            return
        if kernels.has_kernel(dst.dtype):
            kernels.scale(dst, src, factor)
            return
        if dst is not src:
            cupy.copyto(dst, src)
        if dst.dtype.kind in "iu":
            scale_integer(dst, factor, cupy)
        else:
            cupy.multiply(dst, factor, out=dst, casting="unsafe")

    def cast_into(self, dst: Array, src: Array) -> None:
        """Compression casts by kernel; other pairs by CuPy."""
        pair = (kernels.dtype_name(src.dtype), kernels.dtype_name(dst.dtype))
        if pair in kernels.CASTS:
            kernels.cast(dst, src)
        else:
            cupy.copyto(dst, src, casting="unsafe")

    def pack_into(self, dst: Array, parts: list[Array]) -> None:
        """Gather ``parts`` into ``dst`` with one kernel launch."""
        kernels.pack(dst, parts)

    def unpack_from(self, src: Array, parts: list[Array]) -> None:
        """Scatter ``src`` into ``parts`` with one kernel launch."""
        kernels.pack(src, parts, unpack=True)

    def concatenate(self, arrays: list[Array]) -> Any:
        """A new 1-D array of every array's elements in C order, one after another."""
        return cupy.concatenate([a.ravel() for a in arrays], axis=0)

    def synchronize(self, stream: Any = None) -> None:
        """Block until the work queued on ``stream`` (default: current) is done."""
        as_stream(stream).synchronize()

    @contextlib.contextmanager
    def scope(self, obj: object, stream: Any = None) -> Iterator[None]:
        """``obj``'s device and ``stream`` made current; ``stream`` synchronized on entry
        (MPI then reads finished data) and on successful exit (results complete)."""
        arr = self.asarray(obj)
        with arr.device:
            chosen = as_stream(stream)
            with chosen:
                chosen.synchronize()
                yield
                chosen.synchronize()

    def stream(self, obj: object, stream: Any = None) -> Any:
        """The CuPy stream ``stream`` names (None: this thread's current one on ``obj``'s
        device; another library's stream wrapped, :func:`as_stream`)."""
        with self.asarray(obj).device:
            return as_stream(stream)

    def new_stream(self, obj: object) -> Any:
        """A new non-blocking stream of ``obj``'s device."""
        return _device(self.device_id(obj)).new_stream()

    def record(self, obj: object, stream: Any = None) -> Any:
        """An event recorded now on ``stream`` (None: the current one) of ``obj``'s device."""
        with self.asarray(obj).device:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(as_stream(stream))
        return event

    def device_id(self, obj: object = None) -> int:
        """``obj``'s CUDA device (None: the current one)."""
        if obj is None:
            return int(cupy.cuda.Device().id)
        return int(self.asarray(obj).device.id)

    def device(self) -> CupyDevice:
        """The current CUDA device for staging."""
        return _device(self.device_id())


CUPY = CupyBackend()
