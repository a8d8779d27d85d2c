"""Transports that carry device buffers: through pinned host slots, or straight to MPI.

Both offer what the ring algorithms use from :class:`~.transport.Transport`
(``isend``, ``irecv``, ``forward``, ``waitall`` and requests with ``Wait()``), so an
algorithm written once runs on host buffers, on device buffers with a CUDA-aware
MPI (:class:`DeviceDirectTransport`) and on device buffers with a host-only MPI
(:class:`StagingTransport`).

**Staging.** A send is queued until a pinned *send slot* is free, then copies its
device bytes into the slot on the ``d2h`` stream (after the current stream's work
that produced them: an event recorded when ``isend`` was called), and is posted to
MPI once that copy is done. Sends are posted to MPI in the order ``isend`` and
``forward`` were called, receives likewise, so MPI matches every message exactly as
it would for host buffers. A receive is queued until a *receive slot* is free,
posted to MPI into the slot, and when the message is in, copied to the device on
the ``h2d`` stream (after the current stream's earlier work on the destination:
an event recorded when ``irecv`` was called). ``Wait()`` on a receive returns once
that copy is queued and makes the current stream wait for it, so the reduction
kernel that consumes the segment is ordered after the copy without blocking the
host. Slots are handed out first come, first served, and every step advances
whatever can advance (:meth:`StagingTransport.progress`), so the copies of one
segment overlap the MPI transfer of the next and the reduction of a third.

``forward`` sends on what a receive brought in (the ring's all-gather phase). It never
holds the receive's slot: a send above MPI's eager limit completes only once the peer
has posted its receive, and a forward that held a receive slot until then would let
every rank's receive slots be held by forwards that wait for a neighbour whose own
slots are held the same way (the deadlock of 3 or more ranks with more segments per
chunk than slots). Instead the bytes are copied, host to host, into a free send slot
at once; with none free, the forward is an ordinary send of the device buffer (queued
for a send slot, copied from the device when it gets one). So a receive slot is held
only until its receive is waited for, and a send slot only by its own send.

Every wait runs through the host transport's :meth:`~.transport.Transport.block`, so a
rank stuck here is seen by the stall inspector (and, with a stall timeout, raises
:class:`~mpitrain.StallError`) like one stuck in an MPI wait.

Every request must be waited for; a receive keeps its slot until it has been.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence, Union

import numpy as np
from mpi4py import MPI

from ..backends.device import Device, Event
from ..errors import ArgumentError, MpitrainError
from .transport import PeerTransport

SYNCHRONOUS_SENDS = False
"""Test knob: post the device transports' sends as ``MPI_Issend``, which completes only
once the receiver has matched it, as every send above the eager limit does. Small test
messages would otherwise always complete at once and hide waits on the receiver (read
when a transport is made)."""


class _Slot:
    """A pinned host buffer of one pool, with the number of operations still using it."""

    __slots__ = ("buf", "pool", "users")

    def __init__(self, buf: Any, pool: _Pool) -> None:
        self.buf = buf
        self.pool = pool
        self.users = 0

    def release(self) -> None:
        """Drop one user; the last one gives the slot back to its pool."""
        self.users -= 1
        if self.users == 0:
            self.pool.free.append(self)


class _Pool:
    """``count`` pinned buffers of ``nbytes`` each, allocated once."""

    def __init__(self, device: Device, count: int, nbytes: int) -> None:
        self.free: deque[_Slot] = deque(_Slot(device.pinned(nbytes), self) for _ in range(count))

    def take(self) -> _Slot | None:
        """A free slot (now with one user), or ``None``."""
        if not self.free:
            return None
        slot = self.free.popleft()
        slot.users = 1
        return slot


class _Events:
    """A free list of events, so that steady-state runs create none."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.free: list[Event] = []

    def take(self) -> Event:
        """A free event (a new one if none is left)."""
        return self.free.pop() if self.free else self.device.new_event()

    def give(self, event: Event) -> None:
        """Return an event whose last record is known to be done."""
        self.free.append(event)


# Request states, in order.
QUEUED, COPYING_IN, IN_MPI, COPYING_OUT, DONE = range(5)


class StagedSend:
    """A send of device bytes through a pinned slot: queued, copying D2H, in MPI, done."""

    __slots__ = ("copied", "dest", "mpi", "nbytes", "ready", "slot", "src", "state", "tag",
                 "transport")

    def __init__(self, transport: StagingTransport, src: Any, dest: int, tag: int) -> None:
        self.transport, self.src, self.dest, self.tag = transport, src, dest, tag
        self.nbytes = src.nbytes
        self.state = QUEUED
        self.slot: _Slot | None = None
        self.mpi: MPI.Request | None = None
        self.copied: Event | None = None
        self.ready: Event | None = None

    def start(self, slot: _Slot) -> None:
        """Copy the bytes into ``slot`` once the work that produced them is done."""
        t = self.transport
        assert self.ready is not None
        self.slot = slot
        t.d2h.wait_event(self.ready)
        t.device.copy_to_host(slot.buf[:self.nbytes], self.src, t.d2h)
        self.copied = t.events.take()
        self.copied.record(t.d2h)
        self.state = COPYING_IN

    def start_from(self, slot: _Slot, data: Any) -> None:
        """Copy ``data`` (host bytes, e.g. a receive slot's) into ``slot`` now: nothing
        is left to copy from the device."""
        np.copyto(slot.buf[:self.nbytes], data)
        self.slot = slot
        self.state = COPYING_IN

    def postable(self) -> bool:
        """True once the slot holds the bytes."""
        if self.state != COPYING_IN:
            return False
        if self.copied is None:
            return True
        if not self.copied.done:
            return False
        assert self.ready is not None
        self.transport.events.give(self.copied)
        self.transport.events.give(self.ready)
        self.copied = self.ready = None
        return True

    def post(self) -> None:
        """Hand the slot's bytes to MPI."""
        assert self.slot is not None
        self.mpi = self.transport.post_send([self.slot.buf[:self.nbytes], MPI.BYTE],
                                            self.dest, self.tag)
        self.state = IN_MPI

    def advance(self) -> bool:
        """True once MPI is done with the send (its slot is then given back)."""
        if self.state == IN_MPI:
            assert self.mpi is not None and self.slot is not None
            if not self.mpi.Test():
                return False
            self.slot.release()
            self.slot = None
            self.state = DONE
        return self.state == DONE

    def Wait(self) -> None:  # the name of MPI.Request.Wait
        """Block until the send is complete (its device bytes may then be overwritten)."""
        self.transport.wait_for(self, DONE)


class StagedRecv:
    """A receive into device bytes through a pinned slot: queued, in MPI, copying H2D, done."""

    __slots__ = ("copied", "dst", "free", "mpi", "nbytes", "slot", "source", "state", "tag",
                 "transport", "waited")

    def __init__(self, transport: StagingTransport, dst: Any, source: int, tag: int) -> None:
        self.transport, self.dst, self.source, self.tag = transport, dst, source, tag
        self.nbytes = dst.nbytes
        self.state = QUEUED
        self.slot: _Slot | None = None
        self.mpi: MPI.Request | None = None
        self.copied: Event | None = None
        self.free: Event | None = None
        self.waited = False

    def start(self, slot: _Slot) -> None:
        """Post the MPI receive into ``slot``."""
        self.slot = slot
        self.mpi = self.transport.comm.Irecv([slot.buf[:self.nbytes], MPI.BYTE], self.source,
                                             self.tag)
        self.state = IN_MPI

    def advance(self) -> bool:
        """Move on if the current stage is over; True when the slot has been given back."""
        t = self.transport
        if self.state == IN_MPI:
            assert self.mpi is not None and self.slot is not None and self.free is not None
            if not self.mpi.Test():
                return False
            t.h2d.wait_event(self.free)
            t.device.copy_to_device(self.dst, self.slot.buf[:self.nbytes], t.h2d)
            self.copied = t.events.take()
            self.copied.record(t.h2d)
            self.state = COPYING_OUT
        if self.state == COPYING_OUT:
            assert self.copied is not None and self.free is not None and self.slot is not None
            if not (self.waited and self.copied.done):
                return False
            t.events.give(self.copied)
            t.events.give(self.free)
            self.copied = self.free = None
            self.slot.release()
            self.slot = None
            self.state = DONE
        return self.state == DONE

    def Wait(self) -> None:  # the name of MPI.Request.Wait
        """Block until the bytes are in; later work on the current stream sees them."""
        if self.waited:
            return
        self.transport.wait_for(self, COPYING_OUT)
        assert self.copied is not None
        self.transport.device.current_stream().wait_event(self.copied)
        self.waited = True


StagedRequest = Union[StagedSend, StagedRecv]


class _BlockingCalls:
    """The blocking calls of :class:`~.transport.PeerTransport`, built from the
    non-blocking ones of the device transports below."""

    def isend(self, buf: Any, dest: int, tag: int) -> Any:
        raise NotImplementedError

    def irecv(self, buf: Any, source: int, tag: int) -> Any:
        raise NotImplementedError

    def wait(self, request: Any) -> None:
        raise NotImplementedError

    def waitall(self, requests: Sequence[Any]) -> None:
        raise NotImplementedError

    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""
        self.wait(self.isend(buf, dest, tag))

    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        """Blocking receive into ``buf`` from ``source``."""
        self.wait(self.irecv(buf, source, tag))

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""
        self.waitall([self.irecv(recvbuf, source, tag), self.isend(sendbuf, dest, tag)])


class StagingTransport(_BlockingCalls):
    """Point-to-point transfers of device buffers through pinned host slots.

    Args:
        transport: the host transport whose private communicator carries the bytes.
        device: the device that owns the buffers.
        slot_bytes: size of one pinned slot (the longest message an algorithm sends).
        slots: pinned slots for sends, and as many for receives.
    """

    def __init__(self, transport: PeerTransport, device: Device, slot_bytes: int,
                 slots: int) -> None:
        if slots < 1:
            raise ArgumentError(f"staging needs at least one pinned slot per direction, got "
                                f"{slots}; set MPITRAIN_STAGING_SLOTS to 1 or more")
        self.host = transport
        self.comm = transport.comm
        self.post_send = self.comm.Issend if SYNCHRONOUS_SENDS else self.comm.Isend
        self.rank, self.size = transport.rank, transport.size
        self.left, self.right = transport.left, transport.right
        self.device = device
        self.slot_bytes = slot_bytes
        self.d2h = device.new_stream()
        self.h2d = device.new_stream()
        self.events = _Events(device)
        self.send_slots = _Pool(device, slots, slot_bytes)
        self.recv_slots = _Pool(device, slots, slot_bytes)
        self.unposted_sends: deque[StagedSend] = deque()  # in call order
        self.queued_recvs: deque[StagedRecv] = deque()  # waiting for a slot, in call order
        self.active: list[StagedRequest] = []  # in MPI, or receives copying to the device
        self.collective = transport.collective

    def isend(self, buf: Any, dest: int, tag: int) -> StagedSend:
        """Send device bytes ``buf`` (as produced by the current stream's work so far)."""
        self._check(buf)
        op = StagedSend(self, buf, dest, tag)
        op.ready = self.events.take()
        op.ready.record(self.device.current_stream())
        self.unposted_sends.append(op)
        self._admit()
        return op

    def irecv(self, buf: Any, source: int, tag: int) -> StagedRecv:
        """Receive into device bytes ``buf`` (after the current stream's work on it so far)."""
        self._check(buf)
        op = StagedRecv(self, buf, source, tag)
        op.free = self.events.take()
        op.free.record(self.device.current_stream())
        self.queued_recvs.append(op)
        self._admit()
        return op

    def forward(self, request: Any, buf: Any, dest: int, tag: int) -> StagedRequest:
        """Send on what ``request`` (a waited receive) brought into ``buf``.

        Copied host to host from the receive's pinned slot into a free send slot, if
        the slot still holds the bytes (``buf`` must be the receive's destination,
        unchanged since) and a send slot is free now; otherwise sent from ``buf`` like
        any send. Either way the receive's slot is not held by the send (see the
        module documentation).
        """
        if (isinstance(request, StagedRecv) and request.slot is not None
                and request.nbytes == buf.nbytes and not self.unposted_sends):
            slot = self.send_slots.take()
            if slot is not None:
                op = StagedSend(self, buf, dest, tag)
                op.start_from(slot, request.slot.buf[:request.nbytes])
                self.unposted_sends.append(op)
                self._admit()
                return op
        return self.isend(buf, dest, tag)

    def wait(self, request: StagedRequest) -> None:
        """Wait for one request."""
        request.Wait()

    def block(self, done: Callable[[], bool]) -> None:
        """Wait as the host transport waits (see :meth:`.Transport.block`)."""
        self.host.block(done)

    def waitall(self, requests: Sequence[StagedRequest | None]) -> None:
        """Wait for every request that is not ``None``."""
        for request in requests:
            if request is not None:
                request.Wait()

    def wait_for(self, op: StagedRequest, state: int) -> None:
        """Advance everything until ``op`` reaches ``state`` (a collective wait of the
        host transport: the stall inspector sees it)."""
        if op.state < state:
            self.host.block(lambda: self._advanced(op, state))

    def _advanced(self, op: StagedRequest, state: int) -> bool:
        """Advance what can advance; True once ``op`` has reached ``state``."""
        self.progress()
        return op.state >= state

    def progress(self) -> bool:
        """Advance every request that can advance; True if any did."""
        moved = False
        still = []
        for op in self.active:
            before = op.state
            if not op.advance():
                still.append(op)
            moved = moved or op.state != before
        self.active = still
        return self._admit() or moved

    def _admit(self) -> bool:
        """Give free slots to queued requests, oldest first, and post to MPI the sends
        whose bytes are in their slots, in call order; True if anything started."""
        started = False
        for op in self.unposted_sends:
            if op.state == QUEUED:
                slot = self.send_slots.take()
                if slot is None:
                    break
                op.start(slot)
                started = True
        while self.unposted_sends and self.unposted_sends[0].postable():
            op = self.unposted_sends.popleft()
            op.post()
            self.active.append(op)
            started = True
        while self.queued_recvs:
            slot = self.recv_slots.take()
            if slot is None:
                break
            recv = self.queued_recvs.popleft()
            recv.start(slot)
            self.active.append(recv)
            started = True
        return started

    def _check(self, buf: Any) -> None:
        if buf.nbytes > self.slot_bytes:
            raise MpitrainError(f"rank {self.rank}: a message of {buf.nbytes} bytes does not fit "
                             f"the {self.slot_bytes}-byte staging slots of this plan")


class DeviceDirectTransport(_BlockingCalls):
    """Device buffers handed to a CUDA-aware MPI, after the current stream's work on them.

    ``isend`` and ``irecv`` first wait (on the host) for the work queued so far on the
    current stream: MPI reads and writes device memory outside any stream.
    """

    def __init__(self, transport: PeerTransport, device: Device) -> None:
        self.comm = transport.comm
        self.rank, self.size = transport.rank, transport.size
        self.left, self.right = transport.left, transport.right
        self.device = device
        self.event = device.new_event()
        self._transport = transport
        self.collective = transport.collective
        self.post_send = self.comm.Issend if SYNCHRONOUS_SENDS else self.comm.Isend

    def wait(self, request: Any) -> None:
        """Wait for one request."""
        self._transport.wait(request)

    def block(self, done: Callable[[], bool]) -> None:
        """Wait as the host transport waits (see :meth:`.Transport.block`)."""
        self._transport.block(done)

    def _settle(self) -> None:
        self.event.record(self.device.current_stream())
        self.event.synchronize()

    def isend(self, buf: Any, dest: int, tag: int) -> MPI.Request:
        """Send device bytes ``buf`` once the current stream has produced them."""
        self._settle()
        return self.post_send(buf, dest, tag)

    def irecv(self, buf: Any, source: int, tag: int) -> MPI.Request:
        """Receive into device bytes ``buf`` once the current stream is done with them."""
        self._settle()
        return self.comm.Irecv(buf, source, tag)

    def forward(self, request: Any, buf: Any, dest: int, tag: int) -> MPI.Request:
        """Send on what a completed receive wrote into ``buf``."""
        return self.post_send(buf, dest, tag)

    def waitall(self, requests: Sequence[MPI.Request | None]) -> None:
        """Wait for every request that is not ``None``."""
        self._transport.waitall(requests)
