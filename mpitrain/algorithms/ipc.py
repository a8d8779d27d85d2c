"""Device-to-device collectives inside one node over mapped memory (CUDA IPC).

The single-copy algorithms of host memory, on the device: each rank reads its peers'
own device buffers, mapped into its process (:mod:`mpitrain.comm.ipc`), so a byte
crosses device memory once and never the host. Each call:

1. every rank writes the records of the buffers the others will read (their
   allocation's handle, address and offset) into its slot of the node's shared
   memory and meets the others at one barrier (the validation exchange, where the
   algorithm validates; an allgather's exchange has run before, so it adds one);
2. if some rank's buffer cannot be mapped (memory of a stream-ordered pool), every
   rank runs the fallback algorithm of the transfer policy instead;
3. reduce_scatter: rank ``r`` reduces chunk ``r`` of every rank's ``src`` into
   ``out`` with the reduction kernels, reading the peers' chunks where they are
   (its own ``src`` first, then ``r+1, r+2, ...``); allreduce: the same into
   ``out[chunk r]``, scaled by ``postscale`` there, a barrier, then every rank copies
   chunk ``q`` of rank ``q``'s ``out`` for every ``q != r``; allgather: every block
   copied from its owner's input into each output.

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

FALLBACK = "ring"
"""What runs a call whose buffers some rank cannot share."""
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
        self._make_fallback = req.fallback
        self._fallback: Plan | None = None

    def fallback(self, src: Any, out: Any, postscale: float) -> None:
        """Run the call with the fallback algorithm (validation done)."""
        if self._fallback is None:
            assert self._make_fallback is not None
            self._fallback = self._make_fallback(FALLBACK)
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
        if not self.shm.agree(0 if failure is None else 1):
            raise MpitrainError(
                f"rank {self.rank}: the ipc {self.collective} failed in {what} on "
                f"{'this rank: ' + repr(failure) if failure else 'another rank'}; set "
                "MPITRAIN_DEVICE_LINKS=none to send device buffers through MPI") from failure

    def peer(self, parity: int, q: int, index: int, bounds: Bounds) -> Any:
        """Elements ``bounds`` of rank ``q``'s buffer ``index``, mapped here."""
        lo, hi = bounds
        return self.ipc.array(parity, q, index, lo, hi - lo, self.dt)


class _Reducing(_IpcPlan):
    """Reduce chunk ``rank`` of every rank's ``src`` into an output."""

    fuses_check = True
    fuses_postscale = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction

    def reduce_mine(self, parity: int, src: Any, dst: Any, postscale: float) -> None:
        """``dst`` = chunk ``rank`` reduced over every rank's ``src``, times ``postscale``."""
        bounds = self.chunks[self.rank]
        lo, hi = bounds
        if hi == lo:
            return
        if not self.peers:
            self.backend.scale_into(dst, src[lo:hi], postscale)
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
        parity = self.ipc.publish((src,))
        self.backend.synchronize()
        self.validator.exchange(sig)
        if not self.ipc.ready(parity, 1):
            self.fallback(src, out, postscale)
            return
        with self.phase("its reduction"):  # after it nobody reads this rank's src
            self.reduce_mine(parity, src, out, postscale)


class IpcAllreduce(_Reducing):
    """Allreduce: each rank reduces its chunk from the peers' buffers, then copies the
    others' reduced chunks from their outputs."""

    collective = "allreduce"

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks) * postscale``; ``src`` may be ``out``."""
        parity = self.ipc.publish((src, out))
        self.backend.synchronize()
        self.validator.exchange(sig)
        if not self.ipc.ready(parity, 2):
            self.fallback(src, out, postscale)
            return
        lo, hi = self.chunks[self.rank]
        with self.phase("its reduction"):  # after it every chunk is reduced, src read
            self.reduce_mine(parity, src, out[lo:hi], postscale)
        with self.phase("its copies"):  # after it nobody reads this rank's out
            for q in self.peers:
                qlo, qhi = self.chunks[q]
                if qhi > qlo:
                    self.backend.copy_into(out[qlo:qhi],
                                           self.peer(parity, q, OUT, (qlo, qhi)))


class IpcAllgather(_IpcPlan):
    """Allgather: every block copied once, from its owner's input into each output."""

    collective = "allgather"

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = every rank's block (the row-count exchange has run: one more
        barrier publishes the blocks' records)."""
        parity = self.ipc.publish((block,))
        with self.phase("publishing its block"):
            pass
        if not self.ipc.ready(parity, 1):
            self.fallback(block, out, 1.0)
            return
        lo, hi = self.chunks[self.rank]
        if hi > lo:
            self.backend.copy_into(out[lo:hi], block)
        with self.phase("its copies"):  # after it nobody reads this rank's block
            for q in self.peers:
                qlo, qhi = self.chunks[q]
                if qhi > qlo:
                    self.backend.copy_into(out[qlo:qhi], self.ipc.array(parity, q, SRC, 0,
                                                                        qhi - qlo, self.dt))
