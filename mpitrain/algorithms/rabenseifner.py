"""Rabenseifner's allreduce: recursive halving, then recursive doubling.

The buffer is cut into ``p`` blocks, one per virtual rank (:mod:`.butterfly`). In the
*halving* phase, at mask ``p/2, p/4, .., 1``, a rank keeps the half of its current
run of blocks that holds its own block, sends the other half to ``v ^ mask`` and
reduces the partner's copy of the kept half into its own: after ``log2 p`` steps it
holds its block fully reduced, having sent about one buffer in all. The *doubling*
phase runs the steps backwards, swapping reduced runs straight into the output.
So it moves ``2 (p-1)/p`` buffers in ``2 log2 p`` latencies: fewer latencies than the
ring, fewer bytes than recursive doubling -- the middle sizes. Ranks beyond ``p`` fold
in as in recursive doubling. Each block is reduced by one rank only, so every rank
ends with the same bits. Scratch: half the buffer.
"""

from __future__ import annotations

from typing import Any

from .base import Plan, PlanRequest, Signature
from .butterfly import (
    Fold,
    allreduce_fold_in,
    allreduce_fold_out,
    halving_steps,
    virtual_blocks,
)

TAG = 22


class RabenseifnerAllreduce(Plan):
    """Allreduce by recursive halving (reduce-scatter) and doubling (allgather)."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend, self.op = t, req.backend, req.reduction
        self.fold = Fold(t.rank, t.size)
        self.steps = [] if self.fold.folded else halving_steps(
            self.fold, virtual_blocks(self.fold, req.count))
        half = max((keep[1] - keep[0] for _, keep, _ in self.steps), default=0)
        scratch_len = req.count if self.fold.keeps else half
        self.scratch = req.backend.empty(scratch_len, req.dtype)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out``."""
        be, t, fold, op = self.backend, self.transport, self.fold, self.op
        if src is not out:
            be.copy_into(out, src)
        scratch = self.scratch
        if not allreduce_fold_in(fold, t, be, out, scratch, op, TAG):
            return
        for partner, (klo, khi), (glo, ghi) in self.steps:
            recv = scratch[:khi - klo]
            t.sendrecv(be.as_bytes(out[glo:ghi]), partner, be.as_bytes(recv), partner, TAG)
            be.reduce_into(out[klo:khi], out[klo:khi], recv, op)
        for partner, (klo, khi), (glo, ghi) in reversed(self.steps):
            t.sendrecv(be.as_bytes(out[klo:khi]), partner, be.as_bytes(out[glo:ghi]), partner,
                       TAG)
        allreduce_fold_out(fold, t, be, out, TAG)
