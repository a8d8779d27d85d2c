"""Shared-memory collectives inside one node: ranks read each other's data directly.

Every rank of the communicator maps the same window (:mod:`mpitrain.comm.shm`), so no
byte goes through MPI: a rank copies what others need into its part of the window,
all ranks meet at one barrier, and each reads the others' parts straight into its
result.

*Small* calls (the input fits one rank's ``slot``) put their input in the slot of the
validation exchange, so validation, synchronisation and data movement are one
barrier. For allreduce every rank then reduces every slot, in rank order, so every
rank computes the same bits.

*Large* calls go through the ``arena`` in *stripes*: round ``j`` handles elements
``j*width .. (j+1)*width`` of every chunk (the ``np.array_split`` chunks of
:class:`~.base.PlanRequest`). In allreduce, rank ``r`` copies the stripe of every
chunk ``c != r`` to ``stage[c]`` of its arena, everyone meets at a barrier, owner
``r`` reduces its own stripe of ``src`` with ``stage[r]`` of every other rank into
``res`` (scaled there once, for everyone) and its output, and, after the next round's
barrier, every rank copies the other owners' ``res`` into its output. So each round
costs one barrier, and the stripes stay in the cache between the copy that writes them
and the reads; from main memory each rank only reads its input and writes its output
once. ``stage`` and ``res`` alternate between two parities, following the rule in
:mod:`.shm`.
"""

from __future__ import annotations

from typing import Any

from ..comm.shm import SharedMemory
from ..comm.validation import NO_PAYLOAD, Signature, Validator
from .base import Plan, PlanRequest
from .chunks import Bounds
from .pieces import Pieces, read_range, write_range

CACHE_LINE = 64
STRIPE_BYTES = 512 << 10
"""Default stripe width per chunk (bytes): a round's working set stays in the L3 cache."""


def _parts(req: PlanRequest) -> tuple[SharedMemory, Validator]:
    if req.shm is None or req.validator is None:
        raise ValueError("the shm algorithm needs every rank on one node with shared memory")
    return req.shm, req.validator


def fits_slot(req: PlanRequest, shm: SharedMemory) -> bool:
    """True if the call's buffer rides in a slot (a configured segment size caps it)."""
    nbytes = req.count * req.dtype.itemsize
    return nbytes <= min(shm.slot_bytes, req.segment_bytes or shm.slot_bytes)


def stripe_elems(req: PlanRequest, regions: int, arena_bytes: int) -> int:
    """Elements per stripe when a rank's arena holds ``regions`` stripes."""
    item = req.dtype.itemsize
    width = req.segment_bytes or STRIPE_BYTES
    fit = (arena_bytes // regions) // CACHE_LINE * CACHE_LINE
    return max(1, min(width, fit) // item)


class Stripes:
    """Round ``j`` of chunk ``c`` is ``bounds(c, j)``: ``width`` elements (or fewer)."""

    def __init__(self, chunks: tuple[Bounds, ...], width: int) -> None:
        self.chunks, self.width = chunks, width
        longest = max((hi - lo for lo, hi in chunks), default=0)
        self.rounds = max(1, -(-longest // width))

    def bounds(self, c: int, j: int) -> Bounds:
        """Absolute element range of round ``j`` of chunk ``c`` (maybe empty)."""
        lo, hi = self.chunks[c]
        start = min(lo + j * self.width, hi)
        return start, min(start + self.width, hi)


def _views(shm: SharedMemory, dt: Any, owner: int, offset: int, count: int) -> Any:
    """``count`` elements of ``dt`` at byte ``offset`` of ``owner``'s arena."""
    return shm.arena[owner, offset:offset + count * dt.itemsize].view(dt)


def reduce_in_order(backend: Any, dst: Any, operands: list[Any], op: Any,
                    factor: float = 1.0) -> None:
    """``dst = (operands[0] op operands[1] op ...) * factor`` (``dst`` may alias
    ``operands[0]``); the factor rides the last reduction (one pass fewer where the
    backend fuses them: 16-bit floats on the host)."""
    last = len(operands) - 1
    backend.reduce_into(dst, operands[0], operands[1], op, factor if last == 1 else 1.0)
    for i in range(2, last + 1):
        backend.reduce_into(dst, dst, operands[i], op, factor if i == last else 1.0)


class _ShmPlan(Plan):
    """What every shared-memory plan starts from."""

    needs_shared_memory = True
    host_only = True

    def __init__(self, req: PlanRequest) -> None:
        self.shm, self.validator = _parts(req)
        self.n, self.rank, self.backend = self.shm.size, self.shm.rank, req.backend
        self.dt = req.dtype
        self.nbytes = req.count * req.dtype.itemsize
        self.small = fits_slot(req, self.shm)

    def slot_views(self, owner: int, count: int) -> list[Any]:
        """Per parity, the first ``count`` elements of ``owner``'s slot."""
        return [self.shm.slot(p, owner)[:count * self.dt.itemsize].view(self.dt)
                for p in range(2)]

    def stage_views(self, width: int) -> list[list[list[Any]]]:
        """``[parity][rank][chunk]``: stripe-wide views at the start of every arena."""
        n, wb = self.n, width * self.dt.itemsize
        return [[[_views(self.shm, self.dt, q, (p * n + c) * wb, width) for c in range(n)]
                 for q in range(n)] for p in range(2)]


class ShmAllreduce(_ShmPlan):
    """Allreduce through shared memory: one slot exchange when small, stripes when large.

    ``src`` and ``out`` may be :class:`~.pieces.Pieces` (a fusion bucket's arrays,
    unpacked): every step reads or writes element ranges anyway, so no packing copy
    is needed. The owner of a stripe scales it once (``postscale``) before the others
    read it, instead of every rank scaling its whole output afterwards.
    """

    fuses_check = True
    fuses_postscale = True
    takes_pieces = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction
        self.count = req.count
        self.scratch: Any = None
        n = self.n
        if self.small:
            # slots[p][q]: rank q's input, as this call's dtype, at parity p.
            per_rank = [self.slot_views(q, req.count) for q in range(n)]
            self.slots = [[per_rank[q][p] for q in range(n)] for p in range(2)]
            return
        width = stripe_elems(req, 2 * n + 2, self.shm.arena_bytes)
        self.stripes = Stripes(req.chunks, width)
        # stage[p][q][c]: rank q's copy of chunk c's stripe; res[p][c]: chunk c reduced.
        self.stage = self.stage_views(width)
        wb = width * self.dt.itemsize
        self.res = [[_views(self.shm, self.dt, c, (2 * n + p) * wb, width) for c in range(n)]
                    for p in range(2)]

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks) * postscale``; ``src`` may be ``out``."""
        be, count = self.backend, self.count
        if self.small:
            slots = self.slots[self.shm.next_parity]
            read_range(be, src, 0, count, slots[self.rank])
            self.validator.exchange(sig, payload=self.nbytes)
            dst = self._scratch() if isinstance(out, Pieces) else out
            reduce_in_order(be, dst, slots, self.op, postscale)
            if dst is not out:
                out.write(0, count, dst)
            return
        if sig is not None:
            self.validator.check(sig)
        shm, rounds = self.shm, self.stripes.rounds
        if rounds > 1 and out is src and isinstance(src, Pieces) and src.overlapping():
            # pieces that share memory, in place: a later round could read an element
            # an earlier round wrote through another piece, so read everything first
            # (into a buffer of this call only: plans are cached, and this is rare)
            packed = be.empty(count, self.dt)
            src.read(0, count, packed)
            src = packed
        for j in range(rounds + 1):
            p = shm.next_parity
            if j < rounds:
                self._stage(src, j, p)
            shm.barrier()
            if j:
                self._gather(out, j - 1, p ^ 1)
            if j < rounds:
                self._reduce(src, out, j, p, postscale)

    def _scratch(self) -> Any:
        """A buffer of the call's size (slot-sized), for results bound for
        :class:`Pieces`."""
        if self.scratch is None:
            self.scratch = self.backend.empty(self.count, self.dt)
        return self.scratch

    def _stage(self, src: Any, j: int, p: int) -> None:
        be, stage, r = self.backend, self.stage[p][self.rank], self.rank
        for c in range(self.n):
            lo, hi = self.stripes.bounds(c, j)
            if c != r and hi > lo:
                read_range(be, src, lo, hi, stage[c][:hi - lo])

    def _reduce(self, src: Any, out: Any, j: int, p: int, postscale: float) -> None:
        r, be, stage = self.rank, self.backend, self.stage[p]
        lo, hi = self.stripes.bounds(r, j)
        m = hi - lo
        if not m:
            return
        res = self.res[p][r][:m]
        if isinstance(src, Pieces):
            # this rank's own stage region (never read by the others) holds its stripe
            mine = stage[r][r][:m]
            src.read(lo, hi, mine)
        else:
            mine = src[lo:hi]
        operands = [mine if q == r else stage[q][r][:m] for q in range(self.n)]
        # scaled before the others copy it (after the next barrier)
        reduce_in_order(be, res, operands, self.op, postscale)
        write_range(be, out, lo, hi, res)

    def _gather(self, out: Any, j: int, p: int) -> None:
        be, res = self.backend, self.res[p]
        for c in range(self.n):
            lo, hi = self.stripes.bounds(c, j)
            if c != self.rank and hi > lo:
                write_range(be, out, lo, hi, res[c][:hi - lo])


class ShmReduceScatter(_ShmPlan):
    """Reduce-scatter through shared memory: each owner reduces its chunk from every rank."""

    fuses_check = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction
        n, r = self.n, self.rank
        self.lo, self.hi = req.chunks[r]
        if self.small:
            whole = [self.slot_views(q, req.count) for q in range(n)]
            self.mine = whole[r]
            self.slots = [[whole[q][p][self.lo:self.hi] for q in range(n)] for p in range(2)]
            return
        width = stripe_elems(req, 2 * n, self.shm.arena_bytes)
        self.stripes = Stripes(req.chunks, width)
        self.stage = self.stage_views(width)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's reduced chunk of ``src``."""
        be, op = self.backend, self.op
        if self.small:
            p = self.shm.next_parity
            be.copy_into(self.mine[p], src)
            self.validator.exchange(sig, payload=self.nbytes)
            reduce_in_order(be, out, self.slots[p], op)
            return
        if sig is not None:
            self.validator.check(sig)
        shm, r, stripes = self.shm, self.rank, self.stripes
        for j in range(stripes.rounds):
            p = shm.next_parity
            stage = self.stage[p]
            for c in range(self.n):
                lo, hi = stripes.bounds(c, j)
                if c != r and hi > lo:
                    be.copy_into(stage[r][c][:hi - lo], src[lo:hi])
            shm.barrier()
            lo, hi = stripes.bounds(r, j)
            m = hi - lo
            if not m:
                continue
            operands = [src[lo:hi] if q == r else stage[q][r][:m] for q in range(self.n)]
            reduce_in_order(be, out[lo - self.lo:hi - self.lo], operands, op)


class ShmAllgather(_ShmPlan):
    """Allgather through shared memory.

    The communicator exchanges row counts before choosing an algorithm, and a rank
    whose block fits its slot already put it there
    (:meth:`~mpitrain.comm.shm.SharedMemory.offer`); if every
    rank did, ``run`` only copies the slots. Otherwise blocks go through the arena
    in stripes, one barrier per round.
    """

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        shm, dt = self.shm, req.dtype
        self.chunks = req.chunks
        # A configured segment size below the call's size forces the stripes (tests).
        self.slots_allowed = not req.segment_bytes or req.count * dt.itemsize <= req.segment_bytes
        width = stripe_elems(req, 2, shm.arena_bytes)
        self.stripes = Stripes(req.chunks, width)
        wb = width * dt.itemsize
        self.stage = [[_views(shm, dt, q, p * wb, width) for q in range(self.n)]
                      for p in range(2)]

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = every rank's block; call right after the row-count exchange."""
        be, shm, r = self.backend, self.shm, self.rank
        mine, mine_hi = self.chunks[r]
        if mine_hi > mine:
            be.copy_into(out[mine:mine_hi], block)
        if self.slots_allowed and bool((self.validator.payloads() != NO_PAYLOAD).all()):
            slots = shm.slots[self.validator.parity]
            for q, (lo, hi) in enumerate(self.chunks):
                if q != r and hi > lo:
                    be.copy_into(out[lo:hi], slots[q][:(hi - lo) * self.dt.itemsize]
                                 .view(self.dt))
            return
        stripes = self.stripes
        for j in range(stripes.rounds):
            p = shm.next_parity
            lo, hi = stripes.bounds(r, j)
            if hi > lo:
                be.copy_into(self.stage[p][r][:hi - lo], block[lo - mine:hi - mine])
            shm.barrier()
            for q in range(self.n):
                lo, hi = stripes.bounds(q, j)
                if q != r and hi > lo:
                    be.copy_into(out[lo:hi], self.stage[p][q][:hi - lo])


class ShmBroadcast(_ShmPlan):
    """Broadcast through shared memory: the root writes, everyone else reads."""

    fuses_check = True

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        shm, dt = self.shm, req.dtype
        self.root = req.root
        if self.small:
            self.slots = self.slot_views(self.root, req.count)
            return
        self.stripes = Stripes(((0, req.count),), stripe_elems(req, 2, shm.arena_bytes))
        wb = self.stripes.width * dt.itemsize
        self.stage = [_views(shm, dt, self.root, p * wb, self.stripes.width) for p in range(2)]

    def run(self, buf: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """Overwrite ``buf`` with the root's ``buf``."""
        be, shm, is_root = self.backend, self.shm, self.rank == self.root
        if self.small:
            p = shm.next_parity
            if is_root:
                be.copy_into(self.slots[p], buf)
            self.validator.exchange(sig, payload=self.nbytes if is_root else NO_PAYLOAD)
            if not is_root:
                be.copy_into(buf, self.slots[p])
            return
        if sig is not None:
            self.validator.check(sig)
        for j in range(self.stripes.rounds):
            p = shm.next_parity
            lo, hi = self.stripes.bounds(0, j)
            if is_root:
                be.copy_into(self.stage[p][:hi - lo], buf[lo:hi])
            shm.barrier()
            if not is_root:
                be.copy_into(buf[lo:hi], self.stage[p][:hi - lo])
