"""Recursive doubling in segments, for the inter-node phase of the hierarchical allreduce.

The same exchanges as :class:`~.recursive_doubling.RecursiveDoublingAllreduce` (its
fold-in, partners and scratch), but every exchange is cut into ``segs``, all posted at
once, and segment ``k`` is reduced as soon as it has arrived and its own send has
left, so reductions overlap the transfer of later segments. Across nodes the segments
are small enough to go eagerly (see :mod:`.hierarchical`), where one whole-buffer
message would wait for a rendezvous go-ahead queued behind the peer's own data.

With two ranks (one exchange, no fold-in) :meth:`~SegmentedDoublingAllreduce.start`
only posts the exchange and :meth:`~SegmentedDoublingAllreduce.finish` completes it,
so the caller can overlap other work with the transfer.
"""

from __future__ import annotations

from typing import Any

from ..comm.transport import Request
from .base import PlanRequest, Signature
from .butterfly import allreduce_fold_in, allreduce_fold_out
from .chunks import segment_count, split_bounds
from .recursive_doubling import TAG, RecursiveDoublingAllreduce

Posted = tuple[list[Request], list[Request]]
"""Receives and sends of one exchange, one per segment."""


class SegmentedDoublingAllreduce(RecursiveDoublingAllreduce):
    """Recursive doubling with segmented exchanges and a split start/finish."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.count = req.count
        segments = segment_count(self.count, req.dtype.itemsize, req.segment_bytes)
        self.segs = split_bounds(self.count, segments)
        self.pending: tuple[Any, Any, Posted] | None = None

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out`` (in place)."""
        self.start(src, out)
        self.finish()

    def start(self, src: Any, out: Any) -> None:
        """Begin :meth:`run`: with two ranks only post the exchange, else run it all."""
        t, be, fold = self.transport, self.backend, self.fold
        if t.size == 1 or self.count == 0:
            if src is not out:
                be.copy_into(out, src)
            return
        if fold.extra == 0 and len(self.partners) == 1:
            self.pending = (src, out, self._post(src, self.partners[0]))
            return
        if src is not out:
            be.copy_into(out, src)
        if not allreduce_fold_in(fold, t, be, out, self.scratch, self.op, TAG):
            return
        for partner in self.partners:
            self._complete(out, out, self._post(out, partner))
        allreduce_fold_out(fold, t, be, out, TAG)

    def finish(self) -> None:
        """Complete what :meth:`start` began."""
        if self.pending is not None:
            acc, out, posted = self.pending
            self.pending = None
            self._complete(acc, out, posted)

    def _post(self, acc: Any, peer: int) -> Posted:
        """Post the receives of ``peer``'s buffer and the sends of ``acc`` to it."""
        t, as_bytes = self.transport, self.backend.as_bytes
        recvs = [t.irecv(as_bytes(self.scratch[lo:hi]), peer, TAG) for lo, hi in self.segs]
        sends = [t.isend(as_bytes(acc[lo:hi]), peer, TAG) for lo, hi in self.segs]
        return recvs, sends

    def _complete(self, acc: Any, out: Any, posted: Posted) -> None:
        """``out = acc <op> peer's buffer``, segment by segment as they arrive."""
        t, be = self.transport, self.backend
        for (lo, hi), recv, sent in zip(self.segs, *posted):
            t.wait(recv)
            t.wait(sent)  # out may be acc: its segment must have left first
            be.reduce_into(out[lo:hi], acc[lo:hi], self.scratch[lo:hi], self.op)
