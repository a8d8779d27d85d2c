"""A numpy-backed fake GPU that runs the real staging code without a GPU.

:class:`FakeDevice` implements :class:`mpitrain.backends.device.Device`; its streams
queue their work (copies, "kernels") instead of doing it, and run it late: each piece
of work takes a random number of device clock ticks before it may run, a few random
steps (sometimes many) happen whenever the host asks an event whether it is done,
and streams are drained only when the host synchronizes. So work on different
streams completes in random orders, and code that reads device memory, or hands it
to MPI, without the event or synchronization the stream rule requires sees stale
bytes. Fresh device arrays and pinned buffers are filled with a poison byte, so
stale bytes show up as wrong results. As on a GPU, the current stream is per thread
(the async engine's thread has its own), and the device may be driven from several
threads at once (one lock orders its steps).

:class:`FakeBackend` is a device array backend over :class:`FakeDeviceArray` (a numpy
subclass) whose every operation is queued on the current fake stream; registered
with :func:`mpitrain.backends.register`, it sends the communicator down exactly the
device path (transfer policy, staging transport, ring) that CuPy arrays take. It also
owns :class:`ForeignDeviceArray`, the fake's counterpart of a torch CUDA tensor:
another library's object in the same device memory, which ``asarray`` wraps in a new
view (as ``cupy.from_dlpack`` does), so ``asarray(x) is x`` never holds for it.

Its memory is host shared memory, so that other processes can map it as CUDA IPC
maps a GPU's (:class:`FakeHeap`): arrays are carved out of *allocations* (files in
``/dev/shm`` mapped here, like the blocks a CUDA pool splits); a handle names the
allocation, so an array is shared as its allocation's handle and an offset; a process
cannot open its own handles; a freed allocation's (fake) address is handed to the next
one, with a new handle, while the processes that mapped the old one still see its old
bytes, as on a GPU. Arrays made by numpy operations, and foreign arrays, are not in
the heap and cannot be exported (the fake's ``cudaMallocAsync`` memory).

While :func:`fake_backend` is active, the device transports post their sends as
``MPI_Issend`` (:data:`mpitrain.comm.staging.SYNCHRONOUS_SENDS`): a send completes only
once its receive is matched, as every message above MPI's eager limit does on a real
machine, so a transport that waits on its peer's receive shows it with tiny messages.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import random
import threading
import weakref
from collections import deque
from typing import Any, Callable, Iterator

import numpy as np

from mpitrain.backends import NUMPY
from mpitrain.backends.device import Export
from mpitrain.ops import ReduceOp

POISON = 0xA5


class FakeDeviceArray(np.ndarray):  # type: ignore[type-arg]
    """An array in the fake device's memory."""


class ForeignDeviceArray:
    """Another library's array in fake device memory (the fake's torch CUDA tensor):
    not an array of the backend, which sees its memory through a new view.

    Args:
        memory: the fake device memory it stands for (shared, not copied).
    """

    def __init__(self, memory: FakeDeviceArray) -> None:
        self.memory = memory
        self.shape, self.dtype = memory.shape, memory.dtype

    def view(self) -> FakeDeviceArray:
        """A new backend array over the same memory (``cupy.from_dlpack``'s role)."""
        return self.memory.view(FakeDeviceArray)


class _Marker:
    """The point in a stream that an event's last ``record`` marked."""

    __slots__ = ("reached",)

    def __init__(self) -> None:
        self.reached = False


class FakeStream:
    """A queue of work that runs in order, when the device gets to it."""

    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device, self.name = device, name
        self.queue: deque[tuple[str, Any, int]] = deque()  # (kind, item, runnable at tick)
        self.enqueued = 0  # pieces of work queued here so far (which stream ran what)

    def enqueue(self, work: Callable[[], None], ticks: int | None = None) -> None:
        """Queue a piece of work that takes ``ticks`` (default: a random while)."""
        with self.device.lock:
            delay = self.device.latency() if ticks is None else ticks
            self.queue.append(("run", work, self.device.clock + delay))
            self.enqueued += 1

    def mark(self, marker: _Marker) -> None:
        """Queue the marker of an event."""
        with self.device.lock:
            self.queue.append(("mark", marker, 0))

    def wait_event(self, event: FakeEvent) -> None:
        """Later work waits for what ``event`` marked at this moment."""
        with self.device.lock:
            if event.marker is not None:
                self.queue.append(("wait", event.marker, 0))

    def ready(self) -> bool:
        """True if the next piece of work can run now."""
        if not self.queue:
            return False
        kind, item, tick = self.queue[0]
        return (kind != "wait" or item.reached) and tick <= self.device.clock

    def step(self) -> None:
        """Run the next piece of work."""
        kind, item, _ = self.queue.popleft()
        if kind == "run":
            item()
        elif kind == "mark":
            item.reached = True

    def synchronize(self) -> None:
        """Run work (of any stream, as needed) until this queue is empty."""
        self.device.run_until(lambda: not self.queue)

    def __enter__(self) -> FakeStream:
        self.device.entered().append(self.device.current)
        self.device.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.device.current = self.device.entered().pop()


class FakeEvent:
    """A marker in a fake stream."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.marker: _Marker | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        """Mark the current end of ``stream`` (default: the current stream)."""
        stream = stream or self.device.current
        self.marker = _Marker()
        stream.mark(self.marker)

    @property
    def done(self) -> bool:
        """Let the device run a little, then report."""
        self.device.wander()
        return self.marker is None or self.marker.reached

    def synchronize(self) -> None:
        """Run work until the marker is reached."""
        self.device.run_until(lambda: self.marker is None or self.marker.reached)


class _Allocation(mmap.mmap):
    """A mapping of one fake allocation's file (a subclass: it can be weakly referenced,
    so the allocation is freed when its last array is gone)."""


ALLOCATION_BYTES = 1 << 20
"""Smallest fake allocation: smaller arrays share one, as in a CUDA memory pool."""
_ALIGN = 256
_FILES = itertools.count()


def _sweep() -> None:
    """Remove the allocation files of fake devices whose processes are gone (killed
    before they could remove their own)."""
    for name in os.listdir("/dev/shm"):
        if name.startswith("mpitrain-fake-"):
            pid = name.split("-")[2]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")


class FakeHeap:
    """Fake device memory in host shared memory, handed out as CUDA pools do."""

    swept = False

    def __init__(self) -> None:
        if not FakeHeap.swept:
            FakeHeap.swept = True
            _sweep()
        # start -> (size, handle, base, identity)
        self.live: dict[int, tuple[int, bytes, int, int]] = {}
        self.free_bases: list[int] = []
        self.next_base = 1 << 40
        self.current: tuple[np.ndarray[Any, Any], int] | None = None  # (memory, bytes used)

    def _allocate(self, nbytes: int) -> np.ndarray[Any, Any]:
        path = f"/dev/shm/mpitrain-fake-{os.getpid()}-{next(_FILES)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mapping = _Allocation(fd, nbytes)
        finally:
            os.close(fd)
        memory: np.ndarray[Any, Any] = np.frombuffer(mapping, np.uint8)
        start = memory.ctypes.data
        if self.free_bases:
            base = self.free_bases.pop()
        else:
            base, self.next_base = self.next_base, self.next_base + (1 << 32)
        identity = next(_FILES)
        handle = f"{os.getpid()}:{path}".encode()
        self.live[start] = (nbytes, handle, base, identity)
        weakref.finalize(mapping, self._free, start, path, base)
        return memory

    def _free(self, start: int, path: str, base: int) -> None:
        self.live.pop(start, None)
        self.free_bases.append(base)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def empty(self, nbytes: int) -> np.ndarray[Any, Any]:
        """``nbytes`` of poisoned fake device memory."""
        nbytes = max(nbytes, 1)
        if nbytes > ALLOCATION_BYTES // 4:
            memory = self._allocate(nbytes)
            used = 0
        else:
            if self.current is None or self.current[1] + nbytes > self.current[0].size:
                self.current = (self._allocate(ALLOCATION_BYTES), 0)
            memory, used = self.current
            self.current = (memory, used + -(-nbytes // _ALIGN) * _ALIGN)
        piece = memory[used:used + nbytes]
        piece.fill(POISON)
        return piece

    def export(self, arr: Any) -> Export | None:
        """The allocation's handle and base, and ``arr``'s offset in it (None: not in
        the heap)."""
        address = arr.__array_interface__["data"][0]
        for start, (size, handle, base, identity) in self.live.items():
            if start <= address < start + size:
                return Export(handle, base, identity, address - start)
        return None


class FakeDevice:
    """The fake GPU: streams, events, pinned buffers and copies.

    Args:
        seed: seeds the random choice of which stream runs next and how far.
        eagerness: the most steps the device usually takes each time an event is queried.
    """

    _count = 0

    def __init__(self, seed: int = 0, eagerness: int = 2, max_latency: int = 12) -> None:
        FakeDevice._count += 1
        self.id = FakeDevice._count  # a new device each time: plans are cached per device
        self.rng = random.Random(seed)
        self.eagerness = eagerness
        self.max_latency = max_latency
        self.clock = 0
        self.lock = threading.RLock()  # one step at a time, whichever thread drives it
        self._local = threading.local()  # the current stream is per thread
        self.default = FakeStream(self, "default")
        self.streams: list[FakeStream] = [self.default]
        self.heap = FakeHeap()
        self.identity = "fake-gpu:0"  # every process's fake device is "the same GPU"
        self.opened = 0
        self.closed = 0

    @property
    def current(self) -> FakeStream:
        """This thread's current stream (the default stream until one is entered)."""
        stream: FakeStream = getattr(self._local, "stream", self.default)
        return stream

    @current.setter
    def current(self, stream: FakeStream) -> None:
        self._local.stream = stream

    def entered(self) -> list[FakeStream]:
        """This thread's streams made current by ``with stream:`` before the current one."""
        stack: list[FakeStream] = self._local.__dict__.setdefault("entered", [])
        return stack

    def current_stream(self) -> FakeStream:
        """The current stream."""
        return self.current

    def new_stream(self, name: str | None = None) -> FakeStream:
        """A new stream (named ``name``, default ``stream<n>``)."""
        with self.lock:
            stream = FakeStream(self, name or f"stream{len(self.streams)}")
            self.streams.append(stream)
        return stream

    def new_event(self) -> FakeEvent:
        """A new event."""
        return FakeEvent(self)

    def pinned(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A poisoned host buffer."""
        return np.full(nbytes, POISON, dtype=np.uint8)

    def copy_to_host(self, dst: Any, src: Any, stream: FakeStream) -> None:
        """Queue a copy of device bytes into host bytes."""
        assert dst.nbytes == src.nbytes and not isinstance(dst, FakeDeviceArray)
        assert isinstance(src, FakeDeviceArray), "copy_to_host needs a device source"
        stream.enqueue(lambda: np.copyto(dst, src.view(np.ndarray)))

    def copy_to_device(self, dst: Any, src: Any, stream: FakeStream) -> None:
        """Queue a copy of host bytes into device bytes."""
        assert dst.nbytes == src.nbytes and not isinstance(src, FakeDeviceArray)
        assert isinstance(dst, FakeDeviceArray), "copy_to_device needs a device destination"
        stream.enqueue(lambda: np.copyto(dst, src))

    def can_map(self, identity: str) -> bool:
        """Every fake device maps every other."""
        return True

    def export(self, arr: Any) -> Export | None:
        """See :meth:`FakeHeap.export`."""
        return self.heap.export(arr)

    def open(self, handle: bytes) -> np.ndarray[Any, Any]:
        """Map another process's allocation (its bytes as a uint8 array)."""
        pid, path = handle.rstrip(b"\0").decode().split(":", 1)
        if int(pid) == os.getpid():
            raise RuntimeError("fake cudaIpcOpenMemHandle: a process cannot open its own "
                               "handle (cudaErrorDeviceUninitialized)")
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = _Allocation(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.opened += 1
        return np.frombuffer(mapping, np.uint8)

    def view(self, mapping: Any, offset: int, count: int, dtype: Any) -> FakeDeviceArray:
        """``count`` elements at byte ``offset`` of a mapping."""
        nbytes = count * np.dtype(dtype).itemsize
        return mapping[offset:offset + nbytes].view(dtype).view(FakeDeviceArray)

    def close(self, mapping: Any) -> None:
        """Unmap (the mapping goes with its last view)."""
        self.closed += 1

    def latency(self) -> int:
        """Clock ticks a new piece of work takes before it may run."""
        return self.rng.randint(0, self.max_latency)

    def step(self) -> bool:
        """Advance the clock and run the next piece of work of a random ready stream.

        When nothing is ready only because of latency, the clock jumps ahead. False if
        nothing can ever run (every stream is empty or waits for an event)."""
        with self.lock:
            return self._step()

    def _step(self) -> bool:
        self.clock += 1
        ready = [s for s in self.streams if s.ready()]
        if not ready:
            waiting = [s.queue[0][2] for s in self.streams
                       if s.queue and (s.queue[0][0] != "wait" or s.queue[0][1].reached)]
            if not waiting:
                return False
            self.clock = max(self.clock, min(waiting))
            ready = [s for s in self.streams if s.ready()]
        self.rng.choice(ready).step()
        return True

    def wander(self) -> None:
        """Take up to ``eagerness`` random steps (the GPU runs while the host works), and
        now and then a burst of many (the GPU got far ahead of the host)."""
        steps = self.rng.randint(0, self.eagerness) if self.rng.random() > 0.2 else 64
        for _ in range(steps):
            if not self.step():
                return

    def run_until(self, condition: Callable[[], bool]) -> None:
        """Take random steps until ``condition`` holds."""
        while not condition():
            with self.lock:
                if condition():
                    return
                if not self._step():
                    pending = {s.name: len(s.queue) for s in self.streams if s.queue}
                    raise RuntimeError(f"fake device deadlock: nothing can run; queued "
                                       f"{pending}")

    def idle(self) -> bool:
        """True when no stream has work queued."""
        return not any(s.queue for s in self.streams)


class FakeBackend:
    """The array backend of :class:`FakeDeviceArray`: numpy operations queued on streams."""

    name = "fake"
    is_device = True

    def __init__(self, device: FakeDevice) -> None:
        self.fake = device

    def _queue(self, work: Callable[[], None]) -> None:
        self.fake.current.enqueue(work)

    def owns(self, obj: object) -> bool:
        """True for fake device arrays and foreign arrays in fake device memory."""
        return isinstance(obj, (FakeDeviceArray, ForeignDeviceArray))

    def asarray(self, obj: object) -> Any:
        """A fake device array itself; a foreign one as a new view of its memory."""
        return obj.view() if isinstance(obj, ForeignDeviceArray) else obj

    def writes_through(self, arr: Any, obj: object) -> bool:
        """Always: no conversion copies."""
        return True

    def empty(self, count: int, dtype: Any) -> Any:
        """A new poisoned array in the fake device's heap."""
        dtype = np.dtype(dtype)
        memory = self.fake.heap.empty(count * dtype.itemsize)
        return memory[:count * dtype.itemsize].view(dtype).view(FakeDeviceArray)

    def empty_like(self, arr: Any) -> Any:
        """A new poisoned array shaped like ``arr``."""
        return self.empty(arr.size, arr.dtype).reshape(arr.shape)

    def is_contiguous(self, arr: Any) -> bool:
        """True if C-contiguous."""
        return bool(arr.flags.c_contiguous)

    def is_writeable(self, arr: Any) -> bool:
        """True if writeable."""
        return bool(arr.flags.writeable)

    def ascontiguous(self, arr: Any) -> Any:
        """``arr`` or a contiguous copy made on the stream."""
        if arr.flags.c_contiguous:
            return arr
        out = self.empty_like(arr)
        self.copy_into(out, arr)
        return out

    def flat(self, arr: Any) -> Any:
        """A flat view."""
        return arr.reshape(-1)

    def as_bytes(self, flat: Any) -> Any:
        """A uint8 view."""
        return flat.view(np.uint8)

    def copy_into(self, dst: Any, src: Any) -> None:
        """Queue ``dst[...] = src``."""
        self._queue(lambda: np.copyto(dst, src))

    def scatter(self, dsts: list[Any], rows: Any) -> None:
        """Queue the copies of ``rows`` into ``dsts``."""
        self._queue(lambda: NUMPY.scatter(dsts, rows))

    def reduce_into(self, dst: Any, a: Any, b: Any, op: ReduceOp, factor: float = 1.0) -> None:
        """Queue the reduction "kernel"."""
        self._queue(lambda: NUMPY.reduce_into(dst, a, b, op, factor))

    def scale(self, arr: Any, factor: float) -> None:
        """Queue the scaling."""
        self._queue(lambda: NUMPY.scale(arr, factor))

    def scale_into(self, dst: Any, src: Any, factor: float) -> None:
        """Queue ``dst = src * factor``."""
        self._queue(lambda: NUMPY.scale_into(dst, src, factor))

    def cast_into(self, dst: Any, src: Any) -> None:
        """Queue the cast."""
        self._queue(lambda: NUMPY.cast_into(dst, src))

    def pack_into(self, dst: Any, parts: list[Any]) -> None:
        """Queue the packing."""
        self._queue(lambda: NUMPY.pack_into(dst, parts))

    def unpack_from(self, src: Any, parts: list[Any]) -> None:
        """Queue the unpacking."""
        self._queue(lambda: NUMPY.unpack_from(src, parts))

    def concatenate(self, arrays: list[Any]) -> Any:
        """A new array filled on the stream."""
        out = self.empty(sum(a.size for a in arrays), arrays[0].dtype)
        self.pack_into(out, [a.reshape(-1) for a in arrays])
        return out

    def synchronize(self, stream: Any = None) -> None:
        """Drain ``stream`` (default: the current one)."""
        (stream or self.fake.current).synchronize()

    @contextlib.contextmanager
    def scope(self, obj: object, stream: Any = None) -> Iterator[None]:
        """``stream`` made current, synchronized on entry and on exit."""
        chosen = stream or self.fake.current
        with chosen:
            chosen.synchronize()
            yield
            chosen.synchronize()

    def stream(self, obj: object, stream: Any = None) -> FakeStream:
        """``stream``, or this thread's current stream."""
        return stream or self.fake.current  # type: ignore[no-any-return]

    def new_stream(self, obj: object) -> FakeStream:
        """A new stream of the fake device, named ``engine`` (only the async engine asks
        the backend for one: a test finds it by that name)."""
        return self.fake.new_stream("engine")

    def record(self, obj: object, stream: Any = None) -> FakeEvent:
        """An event recorded now on ``stream`` (default: this thread's current one)."""
        event = self.fake.new_event()
        event.record(stream or self.fake.current)
        return event

    def device_id(self, obj: object = None) -> int:
        """The fake device's number."""
        return self.fake.id

    def device(self) -> FakeDevice:
        """The fake device."""
        return self.fake


_ACTIVE: list[FakeBackend] = []


def to_device(host: np.ndarray[Any, Any]) -> FakeDeviceArray:
    """A fake device array holding a copy of ``host`` (ready at once), in the heap of the
    active :func:`fake_backend` (outside one: in private memory)."""
    if not _ACTIVE:
        return np.array(host, copy=True).view(FakeDeviceArray)
    host = np.asarray(host)
    out = _ACTIVE[-1].empty(host.size, host.dtype).reshape(host.shape)
    np.copyto(out.view(np.ndarray), host)
    return out  # type: ignore[no-any-return]


@contextlib.contextmanager
def fake_backend(seed: int, eagerness: int = 2) -> Iterator[FakeBackend]:
    """Register a fresh fake backend for the block (the previous one is replaced), with
    synchronous sends in the device transports (see the module documentation)."""
    from mpitrain import backends
    from mpitrain.comm import staging

    backend = FakeBackend(FakeDevice(seed, eagerness))
    saved = list(backends._BACKENDS)
    synchronous = staging.SYNCHRONOUS_SENDS
    backends._BACKENDS[:] = [b for b in saved if not isinstance(b, FakeBackend)] + [backend]
    staging.SYNCHRONOUS_SENDS = True
    _ACTIVE.append(backend)
    try:
        yield backend
    finally:
        _ACTIVE.remove(backend)
        backends._BACKENDS[:] = saved
        staging.SYNCHRONOUS_SENDS = synchronous


class FakeTensors:
    """``mpitrain.torch``'s view of the fake GPU (a :class:`mpitrain.torch.tensors.DeviceTensors`):
    while :func:`fake_torch_device` is active every CPU tensor counts as a tensor on the
    fake GPU, so the adapter hands it to the comm layer as a :class:`ForeignDeviceArray`
    (as it hands a CUDA tensor itself, which the CuPy backend wraps), and results come
    back from fake device arrays (as through ``torch.from_dlpack``). The "host copies"
    it makes (what ``tensor.cpu()`` is for a CUDA tensor) are the CPU tensors it does not
    claim: their memory is remembered until they are gone."""

    def __init__(self) -> None:
        self.host: set[int] = set()  # storage addresses of the host copies alive

    def owns(self, tensor: Any) -> bool:
        """Every CPU tensor but the host copies."""
        return bool(tensor.device.type == "cpu") and \
            tensor.untyped_storage().data_ptr() not in self.host

    def host_copy(self, tensor: Any) -> Any:
        """A copy that the adapter takes for a host tensor."""
        copy = tensor.clone()
        address = copy.untyped_storage().data_ptr()
        self.host.add(address)
        weakref.finalize(copy, self.host.discard, address)
        return copy

    def to_device(self, result: Any, like: Any) -> Any:
        """A copy "on the device" (one the fake claims)."""
        return result.clone()

    def to_buffer(self, tensor: Any) -> ForeignDeviceArray:
        """The tensor's memory as a foreign array on the fake device."""
        from mpitrain.torch.tensors import host_view

        return ForeignDeviceArray(host_view(tensor).view(FakeDeviceArray))

    def from_buffer(self, array: Any) -> Any:
        """A tensor sharing a fake device result's memory."""
        from mpitrain.torch.tensors import from_host

        if isinstance(array, FakeDeviceArray):
            return from_host(array.view(np.ndarray))
        return None

    def stream(self, tensor: Any) -> Any:
        """The current stream (torch's work on CPU tensors is done when it returns)."""
        return None


@contextlib.contextmanager
def fake_torch_device(seed: int, eagerness: int = 2) -> Iterator[FakeBackend]:
    """:func:`fake_backend`, with ``mpitrain.torch`` taking every CPU tensor as a tensor
    on that fake GPU (:class:`FakeTensors`)."""
    from mpitrain.torch import tensors

    with fake_backend(seed, eagerness) as backend:
        tensors.DEVICES.insert(0, FakeTensors())
        try:
            yield backend
        finally:
            del tensors.DEVICES[0]
