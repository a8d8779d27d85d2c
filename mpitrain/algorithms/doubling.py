"""Recursive doubling allreduce: log2(n) rounds, each a whole-buffer exchange.

In round ``d = 1, 2, 4, ...`` the rank with *virtual rank* ``v`` exchanges its whole
accumulated buffer with virtual rank ``v ^ d`` and reduces what it receives into it;
after ``log2 p`` rounds every rank holds the reduction. The two partners of a round
reduce the same two operands, so every rank ends with the same bits. With two ranks
this is a single exchange.

When ``n`` is not a power of two, with ``p`` the largest power of two below ``n``, the
first ``2 (n - p)`` ranks *fold* first: each even one of them sends its buffer to the
odd one above it (its ``fold_peer``), sits out the rounds and receives the result at
the end; the others take the virtual ranks ``0 .. p - 1``.

Every exchange is cut into ``segs``, all posted at once; segment ``k`` is reduced as
soon as it has arrived and its own send has left, so reductions overlap the transfer
of later segments. With two ranks, :meth:`~RecursiveDoublingAllreduce.start` only
posts the exchange and :meth:`~RecursiveDoublingAllreduce.finish` completes it, so a
caller can overlap other work with the transfer. Received segments land in
``scratch``. Each rank sends ``log2 p`` whole buffers: the choice for two ranks and for
small buffers, where the number of rounds matters more than the bytes; the ring sends
less on more ranks.
"""

from __future__ import annotations

from typing import Any

from ..comm.transport import Request
from .base import PlanRequest
from .chunks import segment_count, split_bounds

TAG = 21
Posted = tuple[list[Request], list[Request | None]]
"""Receives and sends of one exchange, one per segment."""


class RecursiveDoublingAllreduce:
    """Allreduce of a flat buffer by recursive doubling (see the module text)."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend, self.op, self.count = t, req.backend, req.reduction, \
            req.count
        n, rank = t.size, t.rank
        p = 1 << (n.bit_length() - 1)
        extra = n - p
        self.fold_peer: int | None = None
        self.sits_out = False
        if rank < 2 * extra:
            self.fold_peer = rank ^ 1
            self.sits_out = rank % 2 == 0
            virtual = rank // 2
        else:
            virtual = rank - extra

        def real(v: int) -> int:
            return 2 * v + 1 if v < extra else v + extra

        self.partners = [] if self.sits_out else \
            [real(virtual ^ d) for d in (1 << i for i in range(p.bit_length() - 1))]
        segments = segment_count(self.count, req.dtype.itemsize, req.segment_bytes)
        self.segs = split_bounds(self.count, segments)
        self.scratch = req.backend.empty(self.count if n > 1 else 0, req.dtype)
        self.pending: tuple[Any, Any, Posted] | None = None

    def run(self, src: Any, out: Any) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out`` (in place)."""
        self.start(src, out)
        self.finish()

    def start(self, src: Any, out: Any) -> None:
        """Begin :meth:`run`; :meth:`finish` completes it.

        With two ranks this only posts the exchange, so the caller can work (on other
        buffers) while it is on the wire; otherwise it runs to completion.
        """
        if self.transport.size == 1 or self.count == 0:
            if src is not out:
                self.backend.copy_into(out, src)
            return
        fold = self.fold_peer
        if fold is not None and self.sits_out:
            self._send(src, fold)
            self._receive(out, fold)
            return
        if fold is None and len(self.partners) == 1:
            self.pending = (src, out, self._post(src, self.partners[0], send=True))
            return
        acc = src
        if fold is not None:
            self._complete(acc, out, self._post(acc, fold, send=False))
            acc = out
        for partner in self.partners:
            self._complete(acc, out, self._post(acc, partner, send=True))
            acc = out
        if fold is not None:
            self._send(out, fold)

    def finish(self) -> None:
        """Complete what :meth:`start` began."""
        if self.pending is not None:
            acc, out, posted = self.pending
            self.pending = None
            self._complete(acc, out, posted)

    def _post(self, acc: Any, peer: int, send: bool) -> Posted:
        """Post the receives of ``peer``'s buffer and (if ``send``) the sends of ``acc``."""
        t, as_bytes = self.transport, self.backend.as_bytes
        recvs = [t.irecv(as_bytes(self.scratch[lo:hi]), peer, TAG) for lo, hi in self.segs]
        sends = [t.isend(as_bytes(acc[lo:hi]), peer, TAG) if send else None
                 for lo, hi in self.segs]
        return recvs, sends

    def _complete(self, acc: Any, out: Any, posted: Posted) -> None:
        """``out = acc <op> peer's buffer``, segment by segment as they arrive."""
        t, be = self.transport, self.backend
        for (lo, hi), recv, sent in zip(self.segs, *posted):
            t.wait(recv)
            if sent is not None:  # out may be acc: its segment must have left first
                t.wait(sent)
            be.reduce_into(out[lo:hi], acc[lo:hi], self.scratch[lo:hi], self.op)

    def _send(self, buf: Any, peer: int) -> None:
        as_bytes = self.backend.as_bytes
        self.transport.waitall([self.transport.isend(as_bytes(buf[lo:hi]), peer, TAG)
                                for lo, hi in self.segs])

    def _receive(self, buf: Any, peer: int) -> None:
        as_bytes = self.backend.as_bytes
        self.transport.waitall([self.transport.irecv(as_bytes(buf[lo:hi]), peer, TAG)
                                for lo, hi in self.segs])
