"""The few device operations that staging needs: streams, events, pinned memory, copies.

:class:`~mpitrain.comm.staging.StagingTransport` is written against this small
interface only. The CuPy backend provides the real one
(:class:`~.cupy_backend.CupyDevice`); the tests provide a numpy-backed fake whose
streams run their work late and in random interleavings, so the same staging code
is exercised on machines without a GPU.

Stream rule: work queued on a stream runs in order; work on different streams is
ordered only by events (``stream.wait_event(event)`` makes later work on ``stream``
wait until the work before ``event.record(...)`` is done).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol


class Stream(Protocol):
    """A queue of device work."""

    def wait_event(self, event: Any) -> None:
        """Work queued on this stream after this call waits for ``event``."""

    def synchronize(self) -> None:
        """Block the host until every piece of work queued so far is done."""


class Event(Protocol):
    """A marker in a stream's queue."""

    def record(self, stream: Any = None) -> None:
        """Mark the current end of ``stream``'s queue (``None``: the current stream)."""

    @property
    def done(self) -> bool:
        """True once the work before the last :meth:`record` is done (never blocks)."""

    def synchronize(self) -> None:
        """Block the host until :attr:`done`."""


class Device(Protocol):
    """One accelerator as seen by the staging transport."""

    id: int
    """The device number (plans are cached per device)."""

    def current_stream(self) -> Stream:
        """The stream that the current call's device work goes to."""

    def new_stream(self) -> Stream:
        """A new stream that does not synchronize with the others implicitly."""

    def new_event(self) -> Event:
        """A new event (timing disabled)."""

    def pinned(self, nbytes: int) -> Any:
        """A page-locked host buffer of ``nbytes`` as a numpy uint8 array."""

    def copy_to_host(self, dst: Any, src: Any, stream: Stream) -> None:
        """Queue on ``stream`` a copy of device bytes ``src`` into pinned host bytes ``dst``."""

    def copy_to_device(self, dst: Any, src: Any, stream: Stream) -> None:
        """Queue on ``stream`` a copy of pinned host bytes ``src`` into device bytes ``dst``."""


class Export(NamedTuple):
    """What another process needs to map a buffer: the handle of the allocation that
    holds it (a handle always covers a whole allocation, and allocators hand out pieces
    of larger ones), the allocation's address in the owner and its identity (two
    allocations at one address, freed and allocated again, have different ones), and
    the buffer's byte offset in it."""

    handle: bytes
    base: int
    identity: int
    offset: int


class IpcDevice(Device, Protocol):
    """A device whose memory other processes on the node can map (CUDA IPC).

    A process cannot map its own handles, and mapping costs far more than a call (CUDA:
    ~90 us), so mappings are cached by the caller (:mod:`mpitrain.comm.ipc`).
    """

    identity: str
    """The physical device, named the same in every process (its PCI bus id)."""

    def can_map(self, identity: str) -> bool:
        """True if this process can map memory of the device ``identity`` (the same
        device, or a peer with P2P access)."""

    def export(self, arr: Any) -> Export | None:
        """The :class:`Export` of a device array's memory, or ``None`` where its memory
        cannot be shared this way (stream-ordered pools: ``cudaMallocAsync``). Cheap
        after the first call for an allocation."""

    def open(self, handle: bytes) -> Any:
        """Map another process's allocation; returns the mapping (its base address)."""

    def view(self, mapping: Any, offset: int, count: int, dtype: Any) -> Any:
        """A flat device array of ``count`` elements at byte ``offset`` of a mapping."""

    def close(self, mapping: Any) -> None:
        """Unmap a mapping that :meth:`open` returned."""
