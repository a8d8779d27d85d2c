"""The narrow transport the algorithms talk to.

A :class:`Transport` owns a private duplicate of the user's communicator, so that
mpitrain's messages can never match a message of the user's (or of another
mpitrain communicator). Algorithms only post non-blocking sends and receives of
raw bytes to ranks of this communicator and wait for them, and run native MPI
collectives through :meth:`Transport.collective`.

Every wait goes through :meth:`Transport.wait`/:meth:`Transport.waitall` (or the
blocking :meth:`Transport.collective`, :meth:`Transport.send`, :meth:`Transport.recv`),
which raise the ``waiting`` flag that the stall inspector (:mod:`.inspector`) watches;
barriers of shared memory report to :meth:`Transport.watch`'s hook instead. By default
they block inside MPI (nothing is added to the fast path but the flag). With a stall
timeout and ``MPITRAIN_STALL_ACTION=raise`` the transport is *interruptible*: waits
poll ``Test`` (spinning first, then sleeping a little), native collectives use their
non-blocking variants, and past the timeout the waiting rank raises
:class:`~mpitrain.StallError`. The interrupted collective's messages stay in flight,
so the transport is then *broken*: every later collective raises at once.

Under ULFM (``elastic``) the barrier, broadcast and allgathers that mpitrain runs on
its own account are point-to-point messages (:mod:`.p2p`), whose failures Open MPI
does not print, and every wait reports a failed request's own error.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import StallError
from . import p2p
from .inspector import Inspector, StallLimits, abort, warn
from .shm import SPIN_S, SharedMemory, next_pause

Request = MPI.Request


SYNCHRONOUS_SENDS = False
"""Test knob: post this transport's sends as ``MPI_Issend`` (``MPI_Ssend`` when
blocking), which completes only once the receiver has matched it, as every send above
MPI's eager limit does. Small test messages would otherwise always complete at once
and hide a send that waits for its receiver (read when a transport is made)."""


class PeerTransport(Protocol):
    """What an algorithm may use: its ring neighbours and non-blocking byte messages.

    :class:`Transport` is the host one; :mod:`.staging` has the device ones.
    """

    comm: MPI.Intracomm
    rank: int
    size: int
    left: int
    right: int

    def isend(self, buf: Any, dest: int, tag: int) -> Any:
        """Start sending ``buf``; returns a request with ``Wait()``."""

    def irecv(self, buf: Any, source: int, tag: int) -> Any:
        """Start receiving into ``buf``; returns a request with ``Wait()``."""

    def forward(self, request: Any, buf: Any, dest: int, tag: int) -> Any:
        """Send on what the waited receive ``request`` wrote into ``buf``."""

    def wait(self, request: Any) -> None:
        """Wait for one request."""

    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""

    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        """Blocking receive into ``buf`` from ``source``."""

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""

    def waitall(self, requests: Sequence[Any]) -> None:
        """Wait for every request that is not ``None``."""

    def collective(self, blocking: Callable[..., Any], nonblocking: Callable[..., Any],
                   *args: Any) -> None:
        """Run a native MPI collective on the private communicator."""

    def block(self, done: Callable[[], bool]) -> None:
        """Wait, as a collective wait, until ``done()`` (which advances the caller's own
        requests) holds."""


class Transport:
    """Point-to-point byte transport on a private communicator.

    Args:
        comm: the communicator to duplicate; the transport never uses it directly.
        stall: the stall limits of its inspector (default: ``MPITRAIN_STALL_*``).
        elastic: the job runs under ULFM (``MPITRAIN_ELASTIC``): :meth:`barrier`,
            :meth:`bcast`, :meth:`allgather` and :meth:`allgatherv` are point-to-point
            messages (:mod:`.p2p`).
    """

    def __init__(self, comm: MPI.Intracomm, stall: StallLimits | None = None,
                 elastic: bool = False) -> None:
        self.comm: MPI.Intracomm = comm.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.right: int = (self.rank + 1) % self.size
        self.left: int = (self.rank - 1) % self.size
        # What the stall inspector serves to the other ranks.
        self.seq = 0
        self.current = ""
        self.detail: Callable[[], str] | None = None  # more about the current collective
        self.waiting = False
        self.broken: str | None = None
        self.inspector = Inspector(self, stall)
        self.interruptible = self.inspector.raises
        self.elastic = elastic
        # testall(requests[, statuses]): True once all are done; under ULFM a failed
        # request raises its own error, not MPI_ERR_IN_STATUS (see .p2p).
        self.testall: Callable[..., bool] = \
            p2p.testall if elastic else MPI.Request.Testall
        self._waitall: Callable[[list[Request]], Any] = \
            p2p.waitall if elastic else MPI.Request.Waitall
        # Requests of the current collective, kept alive (with their buffers) after a stall.
        self.inflight: list[Request] = []
        self.synchronous = SYNCHRONOUS_SENDS
        post_send = self.comm.Issend if self.synchronous else self.comm.Isend
        # Bound methods: the hot loops call these without attribute lookups on MPI.
        self.isend: Callable[..., Request] = post_send
        self.irecv: Callable[..., Request] = self.comm.Irecv
        if self.interruptible:
            self.isend = self._tracked(post_send)
            self.irecv = self._tracked(self.comm.Irecv)

    def begin(self, collective: str) -> None:
        """Count a new collective named ``collective``; raise if the transport is broken."""
        if self.broken is not None:
            raise StallError(f"rank {self.rank}: {collective} called on a communicator that an "
                             f"earlier stall left unusable ({self.broken}); create a new "
                             "mpitrain.Communicator on every rank")
        self.seq += 1
        self.current = collective
        if self.inflight:
            self.inflight.clear()

    def forward(self, request: Request, buf: Any, dest: int, tag: int) -> Request:
        """Send on what the completed receive ``request`` wrote into ``buf``."""
        return self.isend(buf, dest, tag)

    def wait(self, request: Request) -> None:
        """Wait for one request."""
        self.waiting = True
        try:
            if self.interruptible:
                self.poll(request.Test)
            else:
                request.Wait()
        finally:
            self.waiting = False

    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Blocking send of ``buf`` to ``dest``."""
        if self.synchronous:
            self.collective(self.comm.Ssend, self.comm.Issend, buf, dest, tag)
        else:
            self.collective(self.comm.Send, self.comm.Isend, buf, dest, tag)

    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        """Blocking receive into ``buf`` from ``source``."""
        self.collective(self.comm.Recv, self.comm.Irecv, buf, source, tag)

    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""
        if self.synchronous:
            self.waitall([self.irecv(recvbuf, source, tag), self.isend(sendbuf, dest, tag)])
            return
        self.collective(self.comm.Sendrecv, self.comm.Isendrecv, sendbuf, dest, tag, recvbuf,
                        source, tag)

    def waitall(self, requests: Sequence[Request | None]) -> None:
        """Wait for every request that is not ``None``."""
        live = [r for r in requests if r is not None]
        if not live:
            return
        self.waiting = True
        try:
            if self.interruptible:
                self.poll(lambda: self.testall(live))
            else:
                self._waitall(live)
        finally:
            self.waiting = False

    def barrier(self) -> None:
        """Wait until every rank has entered the barrier."""
        if self.elastic:
            self._exchange(p2p.barrier(self.comm))
        else:
            self.collective(self.comm.Barrier, self.comm.Ibarrier)

    def bcast(self, buf: np.ndarray, root: int) -> None:
        """``buf`` of ``root`` into ``buf`` of every rank (host arrays)."""
        if self.elastic:
            self._exchange(p2p.bcast(self.comm, buf, root))
        else:
            self.collective(self.comm.Bcast, self.comm.Ibcast, buf, root)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Every rank's ``send`` into row ``r`` of ``recv`` (host arrays)."""
        if self.elastic:
            self._exchange(p2p.allgather(self.comm, send, recv))
        else:
            self.collective(self.comm.Allgather, self.comm.Iallgather, send, recv)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                   displs: Sequence[int]) -> None:
        """Every rank's ``send`` (``counts[r]`` elements) into ``recv[displs[r]:]``."""
        if self.elastic:
            self._exchange(p2p.allgatherv(self.comm, send, recv, counts, displs))
        else:
            self.collective(self.comm.Allgatherv, self.comm.Iallgatherv, send,
                            [recv, (list(counts), list(displs))])

    def _exchange(self, requests: list[Request]) -> None:
        if self.interruptible:
            self.inflight.extend(requests)
        self.waitall(requests)

    def collective(self, blocking: Callable[..., Any], nonblocking: Callable[..., Request],
                   *args: Any) -> None:
        """Run a blocking MPI call: ``collective(comm.Bcast, comm.Ibcast, buf, 0)``.

        The blocking variant is faster for small messages (Open MPI's non-blocking
        collectives are a separate, slower implementation); an interruptible transport
        uses the non-blocking one so that a stall can raise.
        """
        if self.interruptible:
            self.wait(self._track(nonblocking(*args)))
            return
        self.waiting = True
        try:
            blocking(*args)
        finally:
            self.waiting = False

    def block(self, done: Callable[[], bool]) -> None:
        """Call ``done()`` until it returns True, yielding the core between calls: a wait
        on requests that ``done`` advances itself (the device transports' staged
        messages). Like :meth:`wait`, it raises :attr:`waiting`, so the stall inspector
        reports it, and an interruptible transport raises StallError past the timeout.
        """
        if done():
            return
        self.waiting = True
        try:
            timeout = self.inspector.timeout_s if self.interruptible else 0.0
            start = time.monotonic()
            while not done():
                os.sched_yield()
                if timeout:
                    waited = time.monotonic() - start
                    if waited >= timeout:
                        raise self.stalled(waited)
        finally:
            self.waiting = False

    def watch(self, shm: SharedMemory) -> None:
        """Report stalls in the barriers of ``shm``, which spin on memory, not in MPI;
        a barrier that waits raises :attr:`waiting` like an MPI wait."""
        shm.waiter = self
        limits = [s for s in (self.inspector.warning_s, self.inspector.timeout_s) if s > 0]
        if limits:
            shm.stall_seconds = min(limits) / 4
            shm.stall_hook = self._shm_stalled
            self._shm_seq, self._shm_since, self._shm_warned = -1, 0.0, False

    def _shm_stalled(self, waited: float, missing: list[int]) -> None:
        """``shm``'s hook: ``waited`` s more in a barrier that ``missing`` have not reached."""
        now = time.monotonic()
        if self._shm_seq != self.seq:
            self._shm_seq, self._shm_since, self._shm_warned = self.seq, now - waited, False
        total = now - self._shm_since
        ins = self.inspector
        if ins.timeout_s and total >= ins.timeout_s:
            if ins.action == "abort":
                abort(ins.report(self.what(), self.seq, total, timed_out=True))
            raise self.stalled(total)
        # the daemon warns of this wait itself (the barrier raises ``waiting``): one
        # warning per stall, from here only where no daemon watches
        if ins.warning_s and total >= ins.warning_s and not self._shm_warned \
                and not ins.watching:
            self._shm_warned = True
            warn(ins.report(self.what(), self.seq, total))

    def free(self) -> None:
        """Release the private communicator (collective)."""
        self.inspector.close()
        if self.comm != MPI.COMM_NULL and self.broken is None:
            self.comm.Free()

    # -- interruptible mode -------------------------------------------------------------
    def _track(self, request: Request) -> Request:
        self.inflight.append(request)
        return request

    def _tracked(self, post: Callable[..., Request]) -> Callable[..., Request]:
        def tracked(*args: Any) -> Request:
            request = post(*args)
            self.inflight.append(request)
            return request
        return tracked

    def what(self) -> str:
        """The current collective, as stall reports name it."""
        detail = self.detail
        return self.current + detail() if detail is not None else self.current

    def poll(self, test: Callable[[], bool]) -> None:
        """Test until done; past the stall timeout, break the transport and raise
        :class:`~mpitrain.StallError` (for an interruptible transport)."""
        start = time.monotonic()
        pause = 0.0
        while not test():
            waited = time.monotonic() - start
            if waited >= self.inspector.timeout_s:
                raise self.stalled(waited)
            if waited > SPIN_S:
                time.sleep(pause)
                pause = next_pause(pause)

    def stalled(self, waited: float) -> StallError:
        """Break the transport after a wait of ``waited`` s: the StallError to raise."""
        self.broken = self.inspector.report(self.what(), self.seq, waited, timed_out=True)
        return StallError(f"{self.broken}. This communicator is now unusable: messages of the "
                       "interrupted collective may still be in flight, and every later call on "
                       "it raises StallError. Create a new mpitrain.Communicator (or call "
                       "mpitrain.shutdown() and mpitrain.init()) on every rank to go on; raise "
                       "MPITRAIN_STALL_TIMEOUT_S if the other ranks are only slow.")
