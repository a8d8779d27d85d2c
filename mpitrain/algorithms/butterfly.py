"""Planning shared by the butterfly algorithms (recursive doubling and halving).

A butterfly pairs rank ``v`` with ``v ^ mask`` for masks that are powers of two, so it
needs a power-of-two number of ranks. With ``n = p + extra`` ranks (``p`` the largest
power of two ``<= n``) the first ``2 * extra`` ranks *fold in*: in each pair
``(2i, 2i + 1)`` the even rank hands its data to the odd one and sits the butterfly
out, and the ``p`` remaining ranks take *virtual ranks* ``0 .. p - 1`` in rank order.
Virtual rank ``v`` stands for real ranks ``2v, 2v + 1`` when ``v < extra`` and for
``v + extra`` otherwise, so the chunks a virtual rank stands for are contiguous and
in order: a run of virtual ranks covers one contiguous element range.
"""

from __future__ import annotations

from typing import Any

from ..backends import ArrayBackend
from ..comm.transport import PeerTransport
from ..ops import ReduceOp
from .chunks import Bounds, split_bounds


class Fold:
    """The fold-in of one rank: its role, partner and virtual rank.

    Attributes:
        p: ranks in the butterfly (a power of two).
        extra: pairs that fold in (``n - p``).
        folded: this rank hands its data to ``partner`` and waits for the result.
        keeps: this rank receives ``partner``'s data before the butterfly.
        partner: the other rank of this rank's pair (``-1`` if none).
        vrank: this rank's virtual rank (``-1`` when folded).
    """

    def __init__(self, rank: int, n: int) -> None:
        self.p = 1 << (n.bit_length() - 1)
        self.extra = n - self.p
        self.folded = rank < 2 * self.extra and rank % 2 == 0
        self.keeps = rank < 2 * self.extra and rank % 2 == 1
        self.partner = rank + 1 if self.folded else rank - 1 if self.keeps else -1
        self.vrank = -1 if self.folded else rank // 2 if self.keeps else rank - self.extra

    def real(self, v: int) -> int:
        """The real rank that plays virtual rank ``v``."""
        return 2 * v + 1 if v < self.extra else v + self.extra

    def first_real(self, v: int) -> int:
        """The lowest real rank virtual rank ``v`` stands for."""
        return 2 * v if v < self.extra else v + self.extra

    def span(self, chunks: tuple[Bounds, ...] | list[Bounds], v_lo: int, v_hi: int) -> Bounds:
        """Element range of the chunks of virtual ranks ``v_lo .. v_hi - 1``."""
        return chunks[self.first_real(v_lo)][0], chunks[self.real(v_hi - 1)][1]

    def masks(self) -> list[int]:
        """The butterfly's masks, smallest first: ``1, 2, 4, .., p / 2``."""
        return [1 << k for k in range(self.p.bit_length() - 1)]


def halving_steps(fold: Fold, blocks: tuple[Bounds, ...] | list[Bounds]
                  ) -> list[tuple[int, Bounds, Bounds]]:
    """The steps of recursive halving for this rank's virtual rank.

    ``blocks`` are per *real* rank (see :meth:`Fold.span`). At the step with mask
    ``m`` (largest first) a rank keeps the half of its current run of virtual ranks
    that holds its own virtual rank and gives the other half to ``v ^ m``.

    Returns:
        ``(partner real rank, kept element range, given element range)`` per step.
    """
    v = fold.vrank
    lo, hi = 0, fold.p
    steps = []
    for mask in reversed(fold.masks()):
        mid = lo + (hi - lo) // 2
        if v & mask:
            keep, give, lo = (mid, hi), (lo, mid), mid
        else:
            keep, give, hi = (lo, mid), (mid, hi), mid
        steps.append((fold.real(v ^ mask), fold.span(blocks, *keep), fold.span(blocks, *give)))
    return steps


def virtual_blocks(fold: Fold, count: int) -> list[Bounds]:
    """Per real rank, blocks such that virtual rank ``v`` spans block ``v`` of ``p``.

    For algorithms free to cut the buffer their own way (allreduce): the buffer is
    cut into ``p`` blocks, one per virtual rank; a folded rank's block is empty.
    """
    per_virtual = split_bounds(count, fold.p)
    blocks: list[Bounds] = []
    for v, (lo, hi) in enumerate(per_virtual):
        if v < fold.extra:
            blocks.append((lo, lo))
        blocks.append((lo, hi))
    return blocks


def allreduce_fold_in(fold: Fold, transport: PeerTransport, backend: ArrayBackend, buf: Any,
                      scratch: Any, op: ReduceOp, tag: int) -> bool:
    """The fold-in of an allreduce working in ``buf`` (``scratch``: at least as long).

    A folded rank sends ``buf`` and receives the result into it at once (its partner
    sends it after :func:`allreduce_fold_out`). Returns whether this rank takes part
    in the butterfly.
    """
    if fold.folded:
        whole = backend.as_bytes(buf)
        transport.send(whole, fold.partner, tag)
        transport.recv(whole, fold.partner, tag)
        return False
    if fold.keeps:
        other = scratch[:buf.size]
        transport.recv(backend.as_bytes(other), fold.partner, tag)
        backend.reduce_into(buf, buf, other, op)
    return True


def allreduce_fold_out(fold: Fold, transport: PeerTransport, backend: ArrayBackend, buf: Any,
                       tag: int) -> None:
    """Send the result to the folded partner, if this rank has one."""
    if fold.keeps:
        transport.send(backend.as_bytes(buf), fold.partner, tag)
