"""The pipelined ring: reduce-scatter phase, all-gather phase, and the three
collectives built from them.

The buffer is cut into ``n`` chunks (:mod:`.chunks`). In the *reduce-scatter phase*
rank ``r`` sends chunk ``owned - 1 - s`` to its right neighbour at step ``s`` and
receives chunk ``owned - 2 - s`` from its left one, reducing it with its own copy;
after ``n - 1`` steps it holds chunk ``owned`` fully reduced. In the *all-gather
phase* it sends chunk ``owned - s`` and receives chunk ``owned - 1 - s`` straight
into the output. Allreduce uses both phases with ``owned = r + 1``; reduce-scatter
only the first and all-gather only the second, both with ``owned = r``.

Every chunk is cut into ``segments``; segment ``k`` of step ``s + 1`` is sent as soon
as segment ``k`` of step ``s`` has been reduced (or received), so reductions overlap
transfers. Receives of the reduce-scatter phase land in ``scratch`` (one chunk);
reduce-scatter needs two more chunk-sized accumulators for its intermediate
results, allreduce reduces straight into the output. ``run()`` allocates nothing.

The last reduction of each segment also applies the collective's ``postscale`` (one
pass instead of two; a single kernel on device buffers). The ring only talks to its
transport (``isend``, ``irecv``, ``forward``, ``waitall``), so the same code moves
host buffers, device buffers through a CUDA-aware MPI, or device buffers staged
through pinned host memory (:mod:`mpitrain.comm.staging`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import ArrayBackend
from ..comm.transport import PeerTransport, Request
from ..ops import ReduceOp
from .base import Plan, PlanRequest, Signature
from .chunks import Bounds, default_segment_bytes, segment_bounds, segment_count

RS_TAG = 11
AG_TAG = 12


class RingSchedule:
    """Chunk/segment layout of a ring and the two pipelined phases over it.

    Args:
        transport: where messages go (left and right neighbours).
        backend: the array library of the buffers.
        chunks: element range of each of the ``n`` chunks.
        dtype: element type.
        segment_bytes: pipeline segment size (0: whole chunks).
    """

    def __init__(self, transport: PeerTransport, backend: ArrayBackend, chunks: list[Bounds],
                 dtype: Any, segment_bytes: int) -> None:
        self.transport = transport
        self.backend = backend
        self.n = transport.size
        self.chunks = chunks
        max_chunk = max(stop - start for start, stop in chunks)
        itemsize = np.dtype(dtype).itemsize
        if not segment_bytes:
            segment_bytes = default_segment_bytes(chunks[-1][1] * itemsize, self.n)
        self.segments = segment_count(max_chunk, np.dtype(dtype).itemsize, segment_bytes)
        # segs[c][k] = absolute element range of segment k of chunk c.
        self.segs = [segment_bounds(c, self.segments) for c in chunks]
        # Scratch offset of segment k: room for the longest segment k of any chunk.
        per_seg = max_chunk // self.segments + 1
        self.scratch_offsets = [k * per_seg for k in range(self.segments)]
        self.scratch_len = per_seg * self.segments
        self.dtype = dtype

    def scratch_view(self, buf: Any, c: int, k: int) -> Any:
        """The part of a chunk-sized buffer that holds segment ``k`` of chunk ``c``."""
        lo, hi = self.segs[c][k]
        off = self.scratch_offsets[k]
        return buf[off:off + hi - lo]

    def reduce_scatter(self, src: Any, dst_of_step: Any, owned: int, scratch: Any,
                       op: ReduceOp, final_sends: list[Request | None] | None,
                       postscale: float = 1.0) -> None:
        """Run the reduce-scatter phase.

        Args:
            src: the flat input (read only).
            dst_of_step: ``f(step, chunk, k)`` -> view where the reduced segment goes.
            owned: the chunk this rank holds fully reduced at the end.
            scratch: chunk-sized receive buffer.
            op: the elementwise reduction.
            final_sends: if a list, each finished segment of the owned chunk is sent on
                at once as the first step of the all-gather phase and its request appended.
            postscale: factor applied to the fully reduced segments of the owned chunk.
        """
        n, t, be = self.n, self.transport, self.backend
        K = self.segments
        left, right = t.left, t.right
        as_bytes = be.as_bytes
        sends: list[list[Request | None]] = []
        recvs: list[Request | None] = [None] * K

        def post_recv(step: int, k: int) -> None:
            c = (owned - 2 - step) % n
            view = self.scratch_view(scratch, c, k)
            recvs[k] = t.irecv(as_bytes(view), left, RS_TAG) if view.size else None

        def send(buf: Any, tag: int) -> Request | None:
            return t.isend(as_bytes(buf), right, tag) if buf.size else None

        first = (owned - 1) % n
        for k in range(K):
            post_recv(0, k)
        sends.append([send(src[lo:hi], RS_TAG) for lo, hi in self.segs[first]])
        for step in range(n - 1):
            c = (owned - 2 - step) % n
            last = step == n - 2
            next_sends: list[Request | None] = []
            for k in range(K):
                req = recvs[k]
                if req is not None:
                    t.wait(req)
                if step >= 2:  # the send still reading this accumulator (reduce-scatter)
                    prev = sends[step - 1][k]
                    if prev is not None:
                        t.wait(prev)
                lo, hi = self.segs[c][k]
                dst = dst_of_step(step, c, k)
                be.reduce_into(dst, src[lo:hi], self.scratch_view(scratch, c, k), op,
                               postscale if last else 1.0)
                if not last:
                    post_recv(step + 1, k)
                    next_sends.append(send(dst, RS_TAG))
                elif final_sends is not None:
                    final_sends.append(send(dst, AG_TAG))
            sends.append(next_sends)
        for step_sends in sends:
            t.waitall(step_sends)

    def all_gather(self, out: Any, owned: int, first_sends: list[Request | None] | None) -> None:
        """Run the all-gather phase: every chunk ends up in ``out``.

        Args:
            out: the flat output; chunk ``owned`` must be final (or being sent).
            owned: the chunk this rank contributes.
            first_sends: requests of step 0's sends if the caller already issued them;
                ``None`` to send chunk ``owned`` of ``out`` here.
        """
        n, t = self.n, self.transport
        left, right = t.left, t.right
        as_bytes = self.backend.as_bytes
        recvs: list[list[Request | None]] = []
        for step in range(n - 1):
            c = (owned - 1 - step) % n
            row = []
            for lo, hi in self.segs[c]:
                row.append(t.irecv(as_bytes(out[lo:hi]), left, AG_TAG) if hi > lo else None)
            recvs.append(row)
        sends: list[Request | None] = []
        if first_sends is None:
            for lo, hi in self.segs[owned]:
                sends.append(t.isend(as_bytes(out[lo:hi]), right, AG_TAG) if hi > lo else None)
        else:
            sends.extend(first_sends)
        for step in range(n - 1):
            c = (owned - 1 - step) % n
            forward = step < n - 2
            for k, (lo, hi) in enumerate(self.segs[c]):
                req = recvs[step][k]
                if req is not None:
                    t.wait(req)
                    if forward:
                        sends.append(t.forward(req, as_bytes(out[lo:hi]), right, AG_TAG))
        t.waitall(sends)


class RingAllreduce(Plan):
    """Ring allreduce of a flat buffer: reduce-scatter then all-gather, pipelined."""

    point_to_point = True
    fuses_postscale = True

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank, self.op = req.transport.size, req.transport.rank, req.reduction
        self.count = req.count
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        self.scratch = req.backend.empty(self.schedule.scratch_len, req.dtype)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks) * postscale``; ``src`` may be ``out`` (in place)."""
        if self.n == 1 or self.count == 0:
            self.schedule.backend.scale_into(out, src, postscale)
            return
        owned = (self.rank + 1) % self.n
        segs = self.schedule.segs

        def dst(step: int, c: int, k: int) -> Any:
            lo, hi = segs[c][k]
            return out[lo:hi]

        first_sends: list[Request | None] = []
        self.schedule.reduce_scatter(src, dst, owned, self.scratch, self.op, first_sends,
                                     postscale)
        self.schedule.all_gather(out, owned, first_sends)


class RingReduceScatter(Plan):
    """Ring reduce-scatter: rank ``r`` gets the reduced chunk ``r`` of the buffer."""

    point_to_point = True
    fuses_postscale = True

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank, self.op = req.transport.size, req.transport.rank, req.reduction
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        length, be, dt = self.schedule.scratch_len, req.backend, req.dtype
        self.scratch = be.empty(length, dt)
        self.acc = (be.empty(length, dt), be.empty(length, dt)) if self.n > 2 else ()

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduced chunk rank of src * postscale``; ``out`` holds exactly that chunk."""
        lo, hi = self.schedule.chunks[self.rank]
        if self.n == 1:
            self.schedule.backend.scale_into(out, src[lo:hi], postscale)
            return
        sched, last = self.schedule, self.n - 2

        def dst(step: int, c: int, k: int) -> Any:
            if step == last:
                slo, shi = sched.segs[c][k]
                return out[slo - lo:shi - lo]
            return sched.scratch_view(self.acc[step % 2], c, k)

        sched.reduce_scatter(src, dst, self.rank, self.scratch, self.op, None, postscale)


class RingAllgather(Plan):
    """Ring all-gather of blocks of possibly different lengths."""

    point_to_point = True

    def __init__(self, req: PlanRequest) -> None:
        self.n, self.rank = req.transport.size, req.transport.rank
        self.schedule = RingSchedule(req.transport, req.backend, list(req.chunks), req.dtype,
                                     req.segment_bytes)
        self.backend = req.backend

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        lo, hi = self.schedule.chunks[self.rank]
        if hi > lo:
            self.backend.copy_into(out[lo:hi], block)
        if self.n > 1:
            self.schedule.all_gather(out, self.rank, None)
