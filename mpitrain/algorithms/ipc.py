"""Device-to-device collectives inside one node over mapped memory (CUDA IPC).

The single-copy algorithms of host memory, on the device: each rank reads its peers'
own device buffers, mapped into its process (:mod:`mpitrain.comm.ipc`), so a byte
crosses device memory once and never the host. Each call:

1. every rank writes the records of the buffers the others will read (their
   allocation's handle, address and offset) into its slot of the node's shared
   memory and meets the others at one barrier (the validation exchange, where the
   algorithm validates; an allgather's exchange has run before, so it adds one);
2. if some rank's buffer cannot be mapped (memory of a stream-ordered pool), every
   rank runs the fallback instead (what ``auto`` would choose without the device
   links, through the transfer policy);
3. where the ranks have devices of their own (peers with P2P access), each works on
   its part: reduce_scatter: rank ``r`` reduces chunk ``r`` of every rank's ``src``
   into ``out`` with the reduction kernels, reading the peers' chunks where they are
   (its own ``src`` first, then ``r+1, r+2, ...``); allreduce: the same into
   ``out[chunk r]``, scaled by ``postscale`` there, a barrier, then every rank copies
   chunk ``q`` of rank ``q``'s ``out`` for every ``q != r``; allgather: every rank
   copies every block from its owner's input into its output;
4. where every rank is on one device, rank 0 does the whole call's device work:
   it reduces every chunk into its owner's output (allreduce: the whole buffer into its
   own, then copies it into the others'), or copies every block into every output.
   The device is not faster for being driven from several processes (their contexts
   take turns on it), and one process's work needs no switch between contexts and one
   barrier fewer.

Device work is ordered with the host barriers: before each barrier a rank
synchronizes its stream, so what the barrier publishes is done and what a rank reads
after it is complete (the first one too: the dispatcher may have queued work on the
input since the collective's scope synchronized it, a prescaling). A last barrier
keeps every rank in the call until nobody reads its buffers.

A rank whose part fails (a handle it cannot map, a device error) still comes to the
next barrier, which also compares a word of every rank: every rank then raises
:class:`~mpitrain.MpitrainError` together, and nobody waits for it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..comm.ipc import IpcPeers
from ..comm.shm import SharedMemory
from ..comm.validation import Signature, Validator
from ..errors import MpitrainError
from .base import Plan, PlanRequest
from .chunks import Bounds

SRC, OUT = 0, 1


class _IpcPlan(Plan):
    """What every IPC plan starts from: the records, the barriers and the fallback."""

    collective = ""

    needs_shared_memory = True
    device_only = True
    link = "ipc"

    def __init__(self, req: PlanRequest) -> None:
        if req.shm is None or req.validator is None or req.links is None:
            raise ValueError("the ipc algorithm needs every rank on one node, with shared "
                             "memory, and device buffers")
        self.shm: SharedMemory = req.shm
        self.validator: Validator = req.validator
        self.backend = req.backend
        self.device = req.backend.device()
        self.ipc: IpcPeers = req.links.ipc(self.device)
        self.rank, self.n = self.shm.rank, self.shm.size
        self.dt = req.dtype
        self.chunks: tuple[Bounds, ...] = req.chunks
        self.peers = [(self.rank + k) % self.n for k in range(1, self.n)]
        layout = req.links.layout(req.backend)
        self.one_device = layout is not None and len(set(layout.devices)) == 1
        self.leads = self.one_device and self.rank == 0
        self._make_fallback = req.fallback
        self._fallback: Plan | None = None

    def fallback(self, src: Any, out: Any, postscale: float) -> None:
        """Run the call with the fallback algorithm (validation done)."""
        if self._fallback is None:
            assert self._make_fallback is not None
            self._fallback = self._make_fallback()
        self._fallback.run(src, out, None, postscale)
        if not self._fallback.fuses_postscale:
            self.backend.scale(out, postscale)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Run a phase's device work, wait for it, then for every rank at a barrier
        that also says whether every rank's phase succeeded (else every rank raises)."""
        failure: BaseException | None = None
        try:
            yield
            self.backend.synchronize()
        except Exception as exc:  # the others wait at the barrier: come, then raise
            failure = exc
        # a failed rank publishes its own nonzero word: the ranks never all agree then
        agreed = self.shm.agree(0 if failure is None else self.rank + 1)
        if failure is not None or not agreed:
            raise MpitrainError(
                f"rank {self.rank}: the ipc {self.collective} failed in {what} on "
                f"{'this rank: ' + repr(failure) if failure else 'another rank'}; set "
                "MPITRAIN_DEVICE_LINKS=none to send device buffers through MPI") from failure

    def peer(self, parity: int, q: int, index: int, bounds: Bounds) -> Any:
        """Elements ``bounds`` of rank ``q``'s buffer ``index``, mapped here."""
        lo, hi = bounds
        return self.ipc.array(parity, q, index, lo, hi - lo, self.dt)

    def publish(self, buffers: tuple[Any, ...], sig: Signature | None) -> int | None:
        """Publish the records of ``buffers`` and meet the others at the validation
        exchange (after this rank's device work on them); their parity, or None if some
        rank's cannot be mapped (then run the fallback)."""
        parity = self.ipc.publish(buffers)
        self.backend.synchronize()
        self.validator.exchange(sig)
        return parity if self.ipc.ready(parity, len(buffers)) else None


class _Reducing(_IpcPlan):
    """Reductions of chunks of every rank's ``src``."""

    fuses_check = True
    fuses_postscale = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction
        self.count = req.count

    def reduce_chunk(self, parity: int, src: Any, dst: Any, bounds: Bounds,
                     postscale: float) -> None:
        """``dst`` = elements ``bounds`` reduced over every rank's ``src`` (this rank's
        first, then its peers' in turn), times ``postscale``."""
        lo, hi = bounds
        if hi == lo:
            return
        first, last = src[lo:hi], self.peers[-1]
        for q in self.peers:
            theirs = self.peer(parity, q, SRC, bounds)
            self.backend.reduce_into(dst, first, theirs, self.op,
                                     postscale if q == last else 1.0)
            first = dst


class IpcReduceScatter(_Reducing):
    """Reduce-scatter reading every peer's chunk where it is."""

    collective = "reduce_scatter"

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's chunk of the reduction, times ``postscale``."""
        parity = self.publish((src, out), sig)
        if parity is None:
            self.fallback(src, out, postscale)
            return
        with self.phase("the reduction"):  # after it nobody reads this rank's buffers
            if self.leads:
                for q, (lo, hi) in enumerate(self.chunks):
                    if hi > lo:
                        dst = out if q == self.rank else self.peer(parity, q, OUT, (0, hi - lo))
                        self.reduce_chunk(parity, src, dst, (lo, hi), postscale)
            elif not self.one_device:
                self.reduce_chunk(parity, src, out, self.chunks[self.rank], postscale)


class IpcAllreduce(_Reducing):
    """Allreduce: each rank reduces its chunk from the peers' buffers, then copies the
    others' reduced chunks from their outputs (on one device: rank 0 reduces the whole
    buffer, then copies it into the others' outputs)."""

    collective = "allreduce"

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks) * postscale``; ``src`` may be ``out``."""
        parity = self.publish((src, out), sig)
        if parity is None:
            self.fallback(src, out, postscale)
            return
        if self.one_device:
            with self.phase("the reduction"):  # after it nobody reads this rank's buffers
                if self.leads and self.count:
                    whole = (0, self.count)
                    self.reduce_chunk(parity, src, out, whole, postscale)
                    for q in self.peers:
                        self.backend.copy_into(self.peer(parity, q, OUT, whole), out)
            return
        lo, hi = self.chunks[self.rank]
        with self.phase("its reduction"):  # after it every chunk is reduced, src read
            self.reduce_chunk(parity, src, out[lo:hi], (lo, hi), postscale)
        with self.phase("its copies"):  # after it nobody reads this rank's out
            for q in self.peers:
                qlo, qhi = self.chunks[q]
                if qhi > qlo:
                    self.backend.copy_into(out[qlo:qhi],
                                           self.peer(parity, q, OUT, (qlo, qhi)))


class IpcAllgather(_IpcPlan):
    """Allgather: every block copied once from its owner's input into each output."""

    collective = "allgather"

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = every rank's block (the row-count exchange has run: one more
        barrier publishes the blocks' records)."""
        parity = self.ipc.publish((block, out))
        with self.phase("publishing its buffers"):
            pass
        if not self.ipc.ready(parity, 2):
            self.fallback(block, out, 1.0)
            return
        with self.phase("the copies"):  # after it nobody reads this rank's buffers
            if self.leads:
                for q, (lo, hi) in enumerate(self.chunks):
                    if hi == lo:
                        continue
                    theirs = block if q == self.rank else self.peer(parity, q, SRC,
                                                                    (0, hi - lo))
                    self.backend.copy_into(out[lo:hi], theirs)
                    for r in self.peers:
                        self.backend.copy_into(self.peer(parity, r, OUT, (lo, hi)), theirs)
            elif not self.one_device:
                for q, (lo, hi) in enumerate(self.chunks):
                    if hi > lo:
                        theirs = block if q == self.rank else self.peer(parity, q, SRC,
                                                                        (0, hi - lo))
                        self.backend.copy_into(out[lo:hi], theirs)
