"""Recursive doubling: ``log2 p`` exchanges with partners at distance 1, 2, 4, ...

*Allreduce*: at each step a rank swaps its whole accumulated buffer with its partner
(``v ^ mask``) and reduces the partner's into its own, so after ``log2 p`` steps every
rank holds the full reduction. It sends ``log2 p`` times the buffer but needs only
``log2 p`` message latencies: the algorithm of choice for small messages. Ranks
beyond the largest power of two fold in first (:mod:`.butterfly`): the even rank of
each pair sends its input to the odd one before the butterfly and gets the result
after it. Both ranks of a pair reduce ``a op b`` and ``b op a``, which are the same
bits for the commutative ops mpitrain supports, so every rank ends with the same
result.

*Allgather*: at each step a rank swaps the run of blocks it holds with its
partner's, straight into the output; the runs double each step.
"""

from __future__ import annotations

from typing import Any

from .base import Plan, PlanRequest, Signature
from .butterfly import Fold, allreduce_fold_in, allreduce_fold_out, halving_steps

TAG = 21


class RecursiveDoublingAllreduce(Plan):
    """Allreduce by recursive doubling with the non-power-of-two fold-in."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend, self.op = t, req.backend, req.reduction
        self.fold = Fold(t.rank, t.size)
        self.partners = [self.fold.real(self.fold.vrank ^ m) for m in self.fold.masks()] \
            if not self.fold.folded else []
        self.scratch = req.backend.empty(req.count, req.dtype)
        self.scratch_bytes = req.backend.as_bytes(self.scratch)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out``."""
        be, t, fold, op = self.backend, self.transport, self.fold, self.op
        if src is not out:
            be.copy_into(out, src)
        scratch, scratch_bytes = self.scratch, self.scratch_bytes
        if not allreduce_fold_in(fold, t, be, out, scratch, op, TAG):
            return
        mine = be.as_bytes(out)
        for partner in self.partners:
            t.sendrecv(mine, partner, scratch_bytes, partner, TAG)
            be.reduce_into(out, out, scratch, op)
        allreduce_fold_out(fold, t, be, out, TAG)


class RecursiveDoublingAllgather(Plan):
    """Allgather by recursive doubling (blocks of any length) with the fold-in."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend = t, req.backend
        self.fold = Fold(t.rank, t.size)
        self.chunks = req.chunks
        self.mine = req.chunks[t.rank]
        # Doubling is halving backwards: send what halving keeps, receive what it gives.
        self.steps = [] if self.fold.folded else list(reversed(halving_steps(self.fold,
                                                                             req.chunks)))

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        be, t, fold = self.backend, self.transport, self.fold
        lo, hi = self.mine
        be.copy_into(out[lo:hi], block)
        whole = be.as_bytes(out)
        if fold.folded:
            t.send(be.as_bytes(out[lo:hi]), fold.partner, TAG)
            t.recv(whole, fold.partner, TAG)
            return
        if fold.keeps:
            plo, phi = self.chunks[fold.partner]
            t.recv(be.as_bytes(out[plo:phi]), fold.partner, TAG)
        for partner, (slo, shi), (rlo, rhi) in self.steps:
            t.sendrecv(be.as_bytes(out[slo:shi]), partner, be.as_bytes(out[rlo:rhi]), partner,
                       TAG)
        if fold.keeps:
            t.send(whole, fold.partner, TAG)
