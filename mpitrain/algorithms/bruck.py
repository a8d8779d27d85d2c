"""Bruck's allgather: ``ceil(log2 n)`` steps for any rank count.

Rank ``r`` keeps the blocks in *relative* order ``r, r+1, .., r-1`` (mod ``n``) in a
scratch buffer, starting with its own. At step ``k`` (distance ``d = 2**k``) it sends
its first ``min(d, n - d)`` blocks to rank ``r - d`` and appends the first
``min(d, n - d)`` blocks of rank ``r + d``, which are blocks ``r + d ..``; after the
last step it holds all ``n`` and rotates them into the output. Blocks may differ in
length: the offsets of the relative order are planned once. Unlike recursive
doubling it needs no fold-in for a rank count that is not a power of two.
"""

from __future__ import annotations

from typing import Any

from .base import Plan, PlanRequest, Signature

TAG = 24


class BruckAllgather(Plan):
    """Allgather by Bruck's algorithm (blocks of any length)."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend = t, req.backend
        n, r = t.size, t.rank
        self.chunks = req.chunks
        order = [(r + i) % n for i in range(n)]
        # offsets[i]: start of the i-th block of the relative order in the scratch.
        offsets = [0]
        for q in order:
            lo, hi = req.chunks[q]
            offsets.append(offsets[-1] + hi - lo)
        self.order, self.offsets = order, offsets
        self.steps = []
        d = 1
        while d < n:
            m = min(d, n - d)
            # send my first m blocks to r - d; receive r + d's first m, my blocks d .. d+m
            self.steps.append(((r - d) % n, offsets[m], (r + d) % n, (offsets[d], offsets[d + m])))
            d *= 2
        self.scratch = req.backend.empty(offsets[-1], req.dtype)

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        be, t, tmp = self.backend, self.transport, self.scratch
        offsets = self.offsets
        be.copy_into(tmp[:offsets[1]], block)
        for dest, send_len, source, (rlo, rhi) in self.steps:
            t.sendrecv(be.as_bytes(tmp[:send_len]), dest, be.as_bytes(tmp[rlo:rhi]), source,
                       TAG)
        for i, q in enumerate(self.order):
            lo, hi = self.chunks[q]
            if hi > lo:
                be.copy_into(out[lo:hi], tmp[offsets[i]:offsets[i + 1]])
