"""Collectives by NCCL, on device buffers (``cupy.cuda.nccl``; :mod:`mpitrain.comm.nccl`).

The ranks' NCCL communicator is made at the first call of the first plan
(:class:`~mpitrain.comm.nccl.NcclLink`, one per mpitrain communicator and device). A
call queues NCCL's kernel on the current stream (the collective's ``stream=``), which
the dispatcher synchronizes before it returns, as for every device call. The
dispatcher validates the call first and scales the result after (``Average`` is a sum
and a scaling); the reductions NCCL has not (int16, complex, bool, ...) run the
fallback instead (what ``auto`` would choose without the device links, through the
transfer policy), on every rank alike.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from ..comm.nccl import NcclLink, pointer, reduces, stream_handle
from ..comm.validation import Signature
from .base import Plan, PlanRequest

_BYTES = np.dtype(np.uint8)


class _NcclPlan(Plan):
    """What every NCCL plan starts from: the link, the stream and the fallback."""

    device_only = True
    link = "nccl"

    def __init__(self, req: PlanRequest) -> None:
        if req.links is None:
            raise ValueError("the nccl algorithm needs device buffers")
        self.device = req.backend.device()
        self.nccl: NcclLink = req.links.nccl(self.device)
        self.rank, self.size = req.transport.rank, req.transport.size
        self.chunks, self.dtype = req.chunks, req.dtype
        self.fallback: Plan | None = None
        if req.op is not None and not reduces(req.dtype, req.reduction):
            assert req.fallback is not None
            self.fallback = req.fallback()

    def stream(self) -> Any:
        """The stream NCCL queues on: the current one."""
        return stream_handle(self.device.current_stream())

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """The fallback's run where NCCL cannot reduce, else :meth:`launch`."""
        if self.fallback is not None:
            self.fallback.run(src, out, None, 1.0)  # the dispatcher scales after
            return
        self.launch(src, out)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """NCCL calls of the block launched as one group (``ncclGroupStart/End``)."""
        nccl = self.nccl.nccl
        nccl.groupStart()
        try:
            yield
        finally:
            nccl.groupEnd()

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """``(rank, lo, hi)`` of every rank's non-empty chunk."""
        return ((root, lo, hi) for root, (lo, hi) in enumerate(self.chunks) if hi > lo)

    def launch(self, src: Any, out: Any) -> None:
        """Queue the NCCL call (each collective's own)."""
        raise NotImplementedError(type(self).__name__)


class NcclAllreduce(_NcclPlan):
    """``ncclAllReduce``."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.count = req.count
        self.op = req.reduction

    def launch(self, src: Any, out: Any) -> None:
        """``out`` = the reduction of every rank's ``src`` (``src`` may be ``out``)."""
        link = self.nccl
        link.communicator().allReduce(pointer(src), pointer(out), self.count,
                                      link.dtype(self.dtype), link.op(self.op), self.stream())


class NcclReduceScatter(_NcclPlan):
    """``ncclReduceScatter`` where the chunks are even; else one ``ncclReduce`` per
    chunk (NCCL's reduce-scatter takes one count for every rank)."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.op = req.reduction
        self.even = len(set(req.counts)) == 1

    def launch(self, src: Any, out: Any) -> None:
        """``out`` = this rank's chunk of the reduction of every rank's ``src``."""
        link = self.nccl
        comm, dt, op, stream = link.communicator(), link.dtype(self.dtype), link.op(self.op), \
            self.stream()
        if self.even:
            comm.reduceScatter(pointer(src), pointer(out), self.chunks[0][1], dt, op, stream)
            return
        with self.group():
            for root, lo, hi in self.blocks():
                recv = pointer(out) if root == self.rank else pointer(src[lo:hi])
                comm.reduce(pointer(src[lo:hi]), recv, hi - lo, dt, op, root, stream)


class NcclAllgather(_NcclPlan):
    """``ncclAllGather`` of bytes where the blocks are even; else one ``ncclBroadcast``
    per block."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.even = len(set(req.counts)) == 1

    def launch(self, block: Any, out: Any) -> None:
        """``out`` = every rank's block."""
        link = self.nccl
        comm, stream, uint8 = link.communicator(), self.stream(), link.dtype(_BYTES)
        item = self.dtype.itemsize
        if self.even:
            comm.allGather(pointer(block), pointer(out), block.size * item, uint8, stream)
            return
        with self.group():
            for root, lo, hi in self.blocks():
                send = pointer(block) if root == self.rank else pointer(out[lo:hi])
                comm.broadcast(send, pointer(out[lo:hi]), (hi - lo) * item, uint8, root, stream)


class NcclBroadcast(_NcclPlan):
    """``ncclBroadcast`` of bytes."""

    def __init__(self, req: PlanRequest) -> None:
        super().__init__(req)
        self.root, self.count = req.root, req.count

    def launch(self, src: Any, out: Any) -> None:
        """The root's ``src`` into every rank's ``out`` (the same buffer)."""
        link = self.nccl
        link.communicator().broadcast(pointer(src), pointer(out),
                                      self.count * self.dtype.itemsize, link.dtype(_BYTES),
                                      self.root, self.stream())

