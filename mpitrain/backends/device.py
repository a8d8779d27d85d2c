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

from typing import Any, Protocol


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
