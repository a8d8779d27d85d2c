"""Adasum allreduce (Maleki et al., MLSys 2021) by vector halving, distance doubling.

Adasum combines two vectors ``a`` and ``b`` as
``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: their sum where they are
orthogonal, their mean where they are equal. Over ``p`` ranks (a power of two) it
combines a binary tree of adjacent ranks, as Horovod's CPU Adasum does: at *level*
``L = 1, 2, .., p/2`` each group of ``2 L`` ranks combines the vector of its *left*
half (ranks with ``rank & L == 0``) with that of its right half.

The data moves as in a reduce-scatter by recursive halving with the partners in the
opposite order: at level ``L`` a rank keeps one half of its current *slice* (the
first half on the left), sends the other half to ``rank ^ L`` and receives the
partner's copy of the kept half, so slices halve while groups double. The dot
product and the squared norms of the two whole vectors are sums over the slices of
the group's ``2 L`` ranks: each rank adds up its slice's share in float64, and the
group sums these three numbers by recursive doubling (``log2 2L`` exchanges of 24
bytes). Each rank then combines its slice with the coefficients. After the last
level the steps run backwards to send the slices back (an allgather), so every rank
ends with the same bits. A squared norm below :data:`NORM_FLOOR` (zero, in practice)
gives its vector the coefficient 1, as in Horovod (a zero vector then adds nothing).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import Plan, PlanRequest, Signature
from .chunks import Bounds

TAG = 25
NORM_FLOOR = math.sqrt(sys.float_info.min)
"""Squared norms below this (about 1.5e-154) give coefficient 1: Horovod's floor,
``sqrt(DBL_MIN)``, below which the float64 division could overflow. Vectors of tiny
elements still combine (two equal ones into their mean, not their sum)."""
BLOCK = 1 << 15
"""Elements widened to float64 at a time (bounds the float64 scratch)."""


@dataclass(frozen=True)
class Level:
    """One level of the tree, seen from one rank.

    Attributes:
        partner: ``rank ^ L``, which holds the other vector's copy of ``keep``.
        keep: the element range this rank combines at this level (its new slice).
        give: the element range the partner combines.
        left: this rank's vector is the group's left one.
        group_masks: the masks of the recursive doubling over the group (``1 .. L``).
    """

    partner: int
    keep: Bounds
    give: Bounds
    left: bool
    group_masks: tuple[int, ...]


def plan_levels(rank: int, size: int, count: int) -> list[Level]:
    """The levels of a rank among ``size`` (a power of two) over ``count`` elements.

    At each level the left rank keeps the first ``n // 2`` elements of its ``n``-element
    slice and the right rank the rest (Horovod's split).
    """
    levels = []
    lo, hi = 0, count
    level = 1
    while level < size:
        mid = lo + (hi - lo) // 2
        left = not rank & level
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        masks = tuple(1 << k for k in range(level.bit_length()))
        levels.append(Level(rank ^ level, keep, give, left, masks))
        lo, hi = keep
        level <<= 1
    return levels


def coefficient(dot: float, norm_sq: float) -> float:
    """The factor of a vector of squared norm ``norm_sq`` whose dot product with the
    other vector is ``dot``."""
    return 1.0 - dot / (2.0 * norm_sq) if norm_sq >= NORM_FLOOR else 1.0


class AdasumAllreduce(Plan):
    """Adasum of every rank's flat float vector (host buffers, power-of-two ranks)."""

    def __init__(self, req: PlanRequest) -> None:
        t = req.transport
        self.transport, self.backend = t, req.backend
        self.levels = plan_levels(t.rank, t.size, req.count)
        longest = max((lv.keep[1] - lv.keep[0] for lv in self.levels), default=0)
        self.recv = req.backend.empty(longest, req.dtype)
        self.wide = req.dtype != np.float64  # slices are widened to float64 blockwise
        width = min(longest, BLOCK) if self.wide else 0
        self.wide_a, self.wide_b = np.empty(width), np.empty(width)
        self.sums, self.other = np.empty(3), np.empty(3)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = adasum(src over ranks)``; ``src`` may be ``out``."""
        be, t = self.backend, self.transport
        if src is not out:
            be.copy_into(out, src)
        if out.size == 0:
            return
        for lv in self.levels:
            (klo, khi), (glo, ghi) = lv.keep, lv.give
            theirs, mine = self.recv[:khi - klo], out[klo:khi]
            t.sendrecv(be.as_bytes(out[glo:ghi]), lv.partner, be.as_bytes(theirs), lv.partner,
                       TAG)
            dot, mine_sq, theirs_sq = self._dot_and_norms(mine, theirs)
            # [dot, |left|^2, |right|^2] summed over the group, the same bits on each rank
            self.sums[:] = (dot, mine_sq, theirs_sq) if lv.left else (dot, theirs_sq, mine_sq)
            self._group_sum(lv.group_masks)
            dot, left_sq, right_sq = (float(v) for v in self.sums)
            c_left, c_right = coefficient(dot, left_sq), coefficient(dot, right_sq)
            c_mine, c_theirs = (c_left, c_right) if lv.left else (c_right, c_left)
            self._combine(mine, c_mine, theirs, c_theirs)
        for lv in reversed(self.levels):
            (klo, khi), (glo, ghi) = lv.keep, lv.give
            t.sendrecv(be.as_bytes(out[klo:khi]), lv.partner, be.as_bytes(out[glo:ghi]),
                       lv.partner, TAG)

    def _group_sum(self, masks: tuple[int, ...]) -> None:
        """Sum :attr:`sums` over the group by recursive doubling (``a + b == b + a``, so
        every rank of the group ends with the same bits)."""
        t, sums, other = self.transport, self.sums, self.other
        for mask in masks:
            peer = t.rank ^ mask
            t.sendrecv(sums.view(np.uint8), peer, other.view(np.uint8), peer, TAG)
            np.add(sums, other, out=sums)

    def _dot_and_norms(self, a: Any, b: Any) -> tuple[float, float, float]:
        """``a.b``, ``|a|^2`` and ``|b|^2`` accumulated in float64."""
        if not self.wide:
            return float(a @ b), float(a @ a), float(b @ b)
        dot = a_sq = b_sq = 0.0
        for lo in range(0, a.size, BLOCK):
            x, y = self._widened(a, b, lo)
            dot += float(x @ y)
            a_sq += float(x @ x)
            b_sq += float(y @ y)
        return dot, a_sq, b_sq

    def _combine(self, a: Any, ca: float, b: Any, cb: float) -> None:
        """``a = ca * a + cb * b`` (computed in float64, rounded once); ``b`` is scratch."""
        if not self.wide:
            a *= ca
            b *= cb
            a += b
            return
        for lo in range(0, a.size, BLOCK):
            x, y = self._widened(a, b, lo)
            x *= ca
            y *= cb
            x += y
            np.copyto(a[lo:lo + x.size], x, casting="unsafe")

    def _widened(self, a: Any, b: Any, lo: int) -> tuple[Any, Any]:
        """Block ``lo`` of ``a`` and ``b`` copied into the float64 scratch."""
        n = min(BLOCK, a.size - lo)
        x, y = self.wide_a[:n], self.wide_b[:n]
        np.copyto(x, a[lo:lo + n], casting="unsafe")
        np.copyto(y, b[lo:lo + n], casting="unsafe")
        return x, y
