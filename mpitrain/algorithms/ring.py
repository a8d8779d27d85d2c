"""The pipelined ring: reduce-scatter phase, all-gather phase, and the three
collectives built from them.

The buffer is cut into ``n`` chunks (:mod:`.chunks`) and every chunk into ``K``
segments. In the *reduce-scatter phase* rank ``r`` sends chunk ``owned - 1 - s`` to
its right neighbour at step ``s`` and receives chunk ``owned - 2 - s`` from its left
one, reducing it with its own copy; after ``n - 1`` steps it holds chunk ``owned``
fully reduced. In the *all-gather phase* it sends chunk ``owned - s`` and receives
chunk ``owned - 1 - s`` straight into the output. Allreduce uses both phases with
``owned = r + 1``; reduce-scatter only the first and all-gather only the second, both
with ``owned = r``.

The unit of work is a *task*: one segment of one step (task ``i`` is segment
``i % K`` of step ``i // K``). Segment ``k`` of step ``s + 1`` is sent as soon as
segment ``k`` of step ``s`` is reduced, so reductions overlap transfers. Receives of
the reduce-scatter phase land in ``window = K + 1`` segment-sized *slots*, posted
``window`` tasks ahead: what a rank sends at task ``i`` its right neighbour consumes at
its task ``i + K``, so a window of ``K + 1`` lets every send be matched without any
rank waiting for a neighbour to get ahead of it (a smaller one deadlocks once messages
leave MPI's eager protocol). Allreduce reduces straight into its output (in place
too), so its scratch is one chunk plus one segment; reduce-scatter keeps its partial
sums in ``window`` more slots. Byte offsets are planned once; ``run()`` allocates
nothing and only slices.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import ArrayBackend
from ..comm.transport import Request, Transport
from ..ops import ReduceOp
from .base import PlanRequest
from .chunks import Bounds, default_segment_bytes, segment_bounds, segment_count

RS_TAG = 11
AG_TAG = 12
MAX_IN_FLIGHT = 64
"""Outstanding sends before the older half is waited for."""


class Pending:
    """Outstanding send requests, waited for oldest first once there are too many."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def add(self, request: Request) -> None:
        """Track ``request``; wait for the older half when ``MAX_IN_FLIGHT`` are pending."""
        self.requests.append(request)
        if len(self.requests) >= MAX_IN_FLIGHT:
            half = MAX_IN_FLIGHT // 2
            Request.Waitall(self.requests[:half])
            del self.requests[:half]

    def wait(self) -> None:
        """Wait for every tracked request."""
        if self.requests:
            Request.Waitall(self.requests)
            self.requests.clear()


class RingSchedule:
    """Chunk/segment layout of a ring and the two pipelined phases over it.

    Args:
        transport: where messages go (left and right neighbours).
        backend: the array library of the buffers.
        chunks: element range of each of the ``n`` chunks.
        dtype: element type.
        segment_bytes: pipeline segment size (0: :func:`~.chunks.default_segment_bytes`).
    """

    def __init__(self, transport: Transport, backend: ArrayBackend, chunks: list[Bounds],
                 dtype: Any, segment_bytes: int) -> None:
        self.transport, self.backend = transport, backend
        self.n = transport.size
        self.chunks = chunks
        self.item = np.dtype(dtype).itemsize
        max_chunk = max(stop - start for start, stop in chunks)
        if not segment_bytes:
            segment_bytes = default_segment_bytes(chunks[-1][1] * self.item, self.n)
        self.K = segment_count(max_chunk, self.item, segment_bytes)
        # segs[c][k] = absolute element range of segment k of chunk c.
        self.segs = [segment_bounds(c, self.K) for c in chunks]
        self.seg_len = max((hi - lo for segs in self.segs for lo, hi in segs), default=0)
        self.tasks = (self.n - 1) * self.K
        self.window = max(1, min(self.K + 1, self.tasks))

    def slots(self, dtype: Any) -> list[Any]:
        """``window`` new segment-sized buffers."""
        return [self.backend.empty(self.seg_len, dtype) for _ in range(self.window)]

    def task(self, owned: int, offset: int, i: int) -> Bounds:
        """Element range of task ``i`` of a phase whose step ``s`` handles chunk
        ``owned - offset - s``."""
        s, k = divmod(i, self.K)
        return self.segs[(owned - offset - s) % self.n][k]

    def reduce_scatter(self, src: Any, owned: int, slots: list[Any], op: ReduceOp,
                       dst_of: Any, partials: list[Any] | None, final: Pending | None) -> None:
        """Run the reduce-scatter phase.

        Args:
            src: the flat input (read only, unless it is the output of an allreduce).
            owned: the chunk this rank holds fully reduced at the end.
            slots: ``window`` receive buffers.
            op: the elementwise reduction.
            dst_of: ``f(lo, hi)`` -> where the last step's reduction of ``lo:hi`` goes
                (and, when ``partials`` is ``None``, every step's).
            partials: ``window`` buffers for the partial sums sent on, or ``None`` to
                keep them in ``dst_of``'s place.
            final: if given, each finished segment of the owned chunk is sent on at
                once as the first step of the all-gather phase, tracked here.
        """
        t, be, K, W, tasks = self.transport, self.backend, self.K, self.window, self.tasks
        it, right, left = self.item, t.right, t.left
        src_bytes = be.as_bytes(src)
        slot_bytes = [be.as_bytes(s) for s in slots]
        sends = Pending()
        for lo, hi in self.segs[(owned - 1) % self.n]:
            sends.add(t.isend(src_bytes[lo * it:hi * it], right, RS_TAG))
        recvs: list[Request] = []
        for i in range(W):
            lo, hi = self.task(owned, 2, i)
            recvs.append(t.irecv(slot_bytes[i][:(hi - lo) * it], left, RS_TAG))
        partial_sends: list[Request | None] = [None] * W
        last_first = tasks - K
        for i in range(tasks):
            j = i % W
            lo, hi = self.task(owned, 2, i)
            m = hi - lo
            recvs[j].Wait()
            last = i >= last_first
            if last or partials is None:
                dst = dst_of(lo, hi)
            else:
                pending = partial_sends[j]
                if pending is not None:
                    pending.Wait()
                dst = partials[j][:m]
            be.reduce_into(dst, src[lo:hi], slots[j][:m], op)
            if i + W < tasks:
                nlo, nhi = self.task(owned, 2, i + W)
                recvs[j] = t.irecv(slot_bytes[j][:(nhi - nlo) * it], left, RS_TAG)
            if not last:
                request = t.isend(be.as_bytes(dst), right, RS_TAG)
                sends.add(request)
                if partials is not None:
                    partial_sends[j] = request
            elif final is not None:
                final.add(t.isend(be.as_bytes(dst), right, AG_TAG))
        sends.wait()

    def all_gather(self, out: Any, owned: int, sends: Pending | None) -> None:
        """Run the all-gather phase: every chunk ends up in ``out``.

        Args:
            out: the flat output; chunk ``owned`` must be final (or being sent).
            owned: the chunk this rank contributes.
            sends: the step-0 sends if the caller already issued them; ``None`` to
                send chunk ``owned`` of ``out`` here.
        """
        t, be, K, tasks, it = self.transport, self.backend, self.K, self.tasks, self.item
        right, left = t.right, t.left
        out_bytes = be.as_bytes(out)
        if sends is None:
            sends = Pending()
            for lo, hi in self.segs[owned]:
                sends.add(t.isend(out_bytes[lo * it:hi * it], right, AG_TAG))
        ahead = max(1, min(tasks, self.K + 1))
        recvs: list[Request] = []
        for i in range(ahead):
            lo, hi = self.task(owned, 1, i)
            recvs.append(t.irecv(out_bytes[lo * it:hi * it], left, AG_TAG))
        forward_until = tasks - K
        for i in range(tasks):
            j = i % ahead
            recvs[j].Wait()
            if i + ahead < tasks:
                lo, hi = self.task(owned, 1, i + ahead)
                recvs[j] = t.irecv(out_bytes[lo * it:hi * it], left, AG_TAG)
            if i < forward_until:
                lo, hi = self.task(owned, 1, i)
                sends.add(t.isend(out_bytes[lo * it:hi * it], right, AG_TAG))
        sends.wait()


class RingAllreduce:
    """Ring allreduce of a flat buffer: reduce-scatter then all-gather, pipelined.

    Partial sums go straight into the output, so the scratch is ``window`` segments.
    """

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank, self.op = req.transport.size, req.transport.rank, req.reduction
        self.count = req.count
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        self.slots = self.schedule.slots(req.dtype)

    def run(self, src: Any, out: Any) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out`` (in place)."""
        if self.n == 1 or self.count == 0:
            if src is not out:
                out[...] = src
            return
        owned = (self.rank + 1) % self.n

        def dst_of(lo: int, hi: int) -> Any:
            return out[lo:hi]

        final = Pending()
        self.schedule.reduce_scatter(src, owned, self.slots, self.op, dst_of, None, final)
        self.schedule.all_gather(out, owned, final)


class RingReduceScatter:
    """Ring reduce-scatter: rank ``r`` gets the reduced chunk ``r`` of the buffer."""

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank, self.op = req.transport.size, req.transport.rank, req.reduction
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        self.slots = self.schedule.slots(req.dtype)
        self.partials = self.schedule.slots(req.dtype) if self.n > 2 else None

    def run(self, src: Any, out: Any) -> None:
        """``out = reduced chunk rank of src``; ``out`` holds exactly that chunk."""
        mine = self.schedule.chunks[self.rank][0]
        if self.n == 1:
            out[...] = src[mine:mine + out.size]
            return

        def dst_of(lo: int, hi: int) -> Any:
            return out[lo - mine:hi - mine]

        self.schedule.reduce_scatter(src, self.rank, self.slots, self.op, dst_of,
                                     self.partials, None)


class RingAllgather:
    """Ring all-gather of blocks of possibly different lengths."""

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank = req.transport.size, req.transport.rank
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        self.backend = req.backend

    def run(self, block: Any, out: Any) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        lo, hi = self.schedule.chunks[self.rank]
        if hi > lo:
            self.backend.copy_into(out[lo:hi], block)
        if self.n > 1:
            self.schedule.all_gather(out, self.rank, None)
