"""Reduce-scatter by recursive halving.

Chunk ``r`` (the ``np.array_split`` chunk of rank ``r``) must end on rank ``r``. Ranks
beyond the largest power of two ``p`` fold in (:mod:`.butterfly`): the even rank of
each pair sends its whole input to the odd one, which reduces it into its
accumulator; virtual rank ``v`` then stands for the contiguous chunks of its real
ranks. At mask ``p/2, .., 1`` a rank keeps the half of its run of virtual ranks that
holds its own, sends the other half to ``v ^ mask`` and reduces the partner's copy of
the kept half into its accumulator: ``log2 p`` latencies and about one buffer sent.
The odd rank of a pair finally sends its partner's chunk back. The first step reads
the input itself, so the accumulator (one buffer) only ever holds reduced data.
"""

from __future__ import annotations

from typing import Any

from .base import Plan, PlanRequest, Signature
from .butterfly import Fold, halving_steps

TAG = 23


class RecursiveHalvingReduceScatter(Plan):
    """Reduce-scatter by recursive halving with the non-power-of-two fold-in."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend, self.op = t, req.backend, req.reduction
        self.fold = Fold(t.rank, t.size)
        self.chunks = req.chunks
        self.steps = [] if self.fold.folded else halving_steps(self.fold, req.chunks)
        be, dt = req.backend, req.dtype
        self.acc = be.empty(0 if self.fold.folded else req.count, dt)
        half = max((k[1] - k[0] for _, k, _ in self.steps), default=0)
        self.scratch = be.empty(req.count if self.fold.keeps else half, dt)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's reduced chunk of ``src``."""
        be, t, fold, op = self.backend, self.transport, self.fold, self.op
        lo, hi = self.chunks[t.rank]
        if fold.folded:
            t.send(be.as_bytes(src), fold.partner, TAG)
            t.recv(be.as_bytes(out), fold.partner, TAG)
            return
        acc, scratch, cur = self.acc, self.scratch, src
        if fold.keeps:
            t.recv(be.as_bytes(scratch), fold.partner, TAG)
            be.reduce_into(acc, src, scratch, op)
            cur = acc
        for partner, (klo, khi), (glo, ghi) in self.steps:
            recv = scratch[:khi - klo]
            t.sendrecv(be.as_bytes(cur[glo:ghi]), partner, be.as_bytes(recv), partner, TAG)
            be.reduce_into(acc[klo:khi], cur[klo:khi], recv, op)
            cur = acc
        if fold.keeps:
            plo, phi = self.chunks[fold.partner]
            t.send(be.as_bytes(cur[plo:phi]), fold.partner, TAG)
        be.copy_into(out, cur[lo:hi])
