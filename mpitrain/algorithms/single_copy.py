"""Single-copy collectives inside one node: ranks read each other's buffers directly.

The ``shm`` algorithms copy every byte into the shared window and out again. Here a
rank reads its peers' own buffers with Linux's cross-memory attach
(``process_vm_readv``, :func:`~mpitrain.backends.hostcopy.read_peer`), so each byte is
copied once, straight from where its owner holds it to where the reader needs it. It
runs only where :func:`~mpitrain.comm.shm.probe_single_copy` found, on every rank, that
every rank can read every other (the dispatcher offers it nowhere else).

Every rank's pid is known from the probe. Each call: every rank writes its *record*
(the addresses of ``src`` and ``out``) into its slot of the shared window and meets the
others at one barrier (the validation exchange, where the algorithm validates; an
allgather's block address rides the row-count exchange before ``run``); then

* allgather: rank ``r`` reads block ``q`` from rank ``q``'s ``block`` into
  ``out[chunk q]`` for every ``q != r``;
* reduce_scatter: rank ``r`` reads its chunk of every peer's ``src``, one ``stripe``
  at a time into ``scratch`` (so it stays in the cache), and reduces it into ``out``
  (its own ``src`` first, then the peers ``r+1, r+2, ...``);
* allreduce: the same reduction of chunk ``r`` into ``out[chunk r]``, scaled by
  ``postscale`` there, a barrier, then every rank reads chunk ``q`` of rank ``q``'s
  ``out`` for every ``q != r``.

A last barrier keeps every rank in the call until nobody reads its buffers any more.
In place (``src`` is ``out``) the ranges a rank writes are never those the others
read from it in the same phase.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import hostcopy
from ..comm.shm import SharedMemory
from ..comm.validation import Signature, Validator
from .base import Plan, PlanRequest
from .chunks import Bounds

STRIPE_BYTES = 256 << 10
"""Bytes of a peer's chunk read and reduced at a time (a test's segment size caps it)."""
SRC, OUT = 0, 1
RECORD_WORDS = 2


def _parts(req: PlanRequest) -> tuple[SharedMemory, Validator]:
    if req.shm is None or req.validator is None or not req.shm.single_copy:
        raise ValueError("the single_copy algorithm needs every rank on one node, with "
                         "shared memory, and able to read the others' memory "
                         "(MPITRAIN_SINGLE_COPY=1, process_vm_readv allowed)")
    return req.shm, req.validator


class _SingleCopyPlan(Plan):
    """What every single-copy plan starts from: the records and the barriers."""

    needs_shared_memory = True
    host_only = True
    needs_single_copy = True

    def __init__(self, req: PlanRequest) -> None:
        self.shm, self.validator = _parts(req)
        self.n, self.rank, self.backend = self.shm.size, self.shm.rank, req.backend
        self.dt, self.item = req.dtype, req.dtype.itemsize
        self.chunks: tuple[Bounds, ...] = req.chunks
        self.pids = self.shm.pids
        # records[p][q]: rank q's record at parity p (the head of its slot)
        self.records = [self.shm.slots[p, :, :RECORD_WORDS * 8].view(np.int64)
                        for p in range(2)]
        self.peers = [(self.rank + k) % self.n for k in range(1, self.n)]

    def publish(self, src: Any, out: Any) -> Any:
        """Write this rank's record for the next barrier; returns that parity's records."""
        records = self.records[self.shm.next_parity]
        mine = records[self.rank]
        mine[SRC], mine[OUT] = hostcopy.address(src), hostcopy.address(out)
        return records

    def read(self, records: Any, q: int, field: int, lo: int, dst: Any) -> None:
        """``dst`` = rank ``q``'s buffer ``field`` (its record's) from element ``lo`` on."""
        if dst.size:
            hostcopy.read_peer(self.pids[q], dst, int(records[q, field]) + lo * self.item)


class _Reducing(_SingleCopyPlan):
    """Reduce chunk ``rank`` of every rank's ``src`` into ``out``, stripe by stripe."""

    fuses_check = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction
        width_bytes = min(req.segment_bytes or STRIPE_BYTES, STRIPE_BYTES)
        self.width = max(1, width_bytes // self.item)
        self.scratch = self.backend.empty(self.width, self.dt)

    def reduce_mine(self, records: Any, src: Any, dst: Any, postscale: float) -> None:
        """``dst`` = chunk ``rank`` reduced over every rank's ``src``, times ``postscale``."""
        be, lo, hi = self.backend, *self.chunks[self.rank]
        last = self.peers[-1]
        for a in range(lo, hi, self.width):
            b = min(a + self.width, hi)
            acc, theirs = dst[a - lo:b - lo], self.scratch[:b - a]
            first = src[a:b]
            for q in self.peers:
                self.read(records, q, SRC, a, theirs)
                be.reduce_into(acc, first, theirs, self.op, postscale if q == last else 1.0)
                first = acc


class SingleCopyReduceScatter(_Reducing):
    """Reduce-scatter reading every peer's chunk straight into the reduction."""

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's reduced chunk of ``src``."""
        records = self.publish(src, out)
        self.validator.exchange(sig)
        self.reduce_mine(records, src, out, 1.0)
        self.shm.barrier()  # nobody returns while a peer still reads its src


class SingleCopyAllreduce(_Reducing):
    """Allreduce: each rank reduces its chunk from the peers' buffers, then reads the
    others' reduced chunks from their outputs."""

    fuses_postscale = True

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks) * postscale``; ``src`` may be ``out``."""
        records = self.publish(src, out)
        self.validator.exchange(sig)
        lo, hi = self.chunks[self.rank]
        self.reduce_mine(records, src, out[lo:hi], postscale)
        self.shm.barrier()  # every chunk reduced (and every src read)
        for q in self.peers:
            qlo, qhi = self.chunks[q]
            self.read(records, q, OUT, qlo, out[qlo:qhi])
        self.shm.barrier()  # nobody returns while a peer still reads its out


class SingleCopyAllgather(_SingleCopyPlan):
    """Allgather: every block copied once, from its owner's input into each output."""

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = every rank's block; call right after the row-count exchange, which
        carried every block's address."""
        addresses = self.validator.addresses()
        lo, hi = self.chunks[self.rank]
        if hi > lo:
            self.backend.copy_into(out[lo:hi], block)
        for q in self.peers:
            qlo, qhi = self.chunks[q]
            if qhi > qlo:
                hostcopy.read_peer(self.pids[q], out[qlo:qhi], int(addresses[q]))
        self.shm.barrier()  # nobody returns while a peer still reads its block
