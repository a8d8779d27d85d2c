"""Tensor fusion: small allreduces packed into one buffer and reduced by one collective.

:func:`plan_buckets` cuts the requests a cycle agreed on into *buckets*, the same way
on every rank (it only reads what the ranks agreed on): allreduce entries with the
same :func:`fusion_key` (backend, dtype, op, prescale, postscale, algorithm) share a
bucket until the next one would take it past ``threshold`` bytes; an entry of
``threshold`` bytes or more, and every entry of the other collectives, is a bucket of
its own; the entries of a grouped allreduce share one bucket per key whatever their
size. Buckets run in the order they were opened.

:class:`BucketRunner` runs a bucket: pack -> prescale -> collective -> postscale ->
unpack, where the middle three are one call of the engine's
:class:`~mpitrain.Communicator`, so fused buffers get the same algorithm selection,
plan cache and scaling as blocking calls. The fusion buffer is a new array per
bucket (one ``concatenate``, which also flattens and makes contiguous); out-of-place
results are views of it. A bucket of one entry skips the fusion buffer and calls the
communicator on the entry's own array.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request import Entry, Request

if TYPE_CHECKING:
    from ..comm.communicator import Communicator

Phase = tuple[str, float, float]  # (name, start, end) in perf_counter seconds


@dataclass
class Bucket:
    """Entries that run as one collective.

    Attributes:
        items: ``(request, entry)`` pairs, in packing order.
        nbytes: their total size.
    """

    items: list[tuple[Request, Entry]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, request: Request, entry: Entry) -> None:
        """Append one entry."""
        self.items.append((request, entry))
        self.nbytes += entry.nbytes

    @property
    def requests(self) -> list[Request]:
        """The distinct requests of the bucket, in order."""
        return list({id(r): r for r, _ in self.items}.values())


def fusion_key(backend: str, dtype: Any, op: str | None, prescale: float, postscale: float,
               algorithm: str | None) -> str:
    """Arrays with equal keys may be reduced together in one buffer (a string, so that
    the engine builds it once per signature and looks it up without hashing)."""
    return f"{backend} {dtype} {op} {prescale!r} {postscale!r} {algorithm}"


def plan_buckets(requests: list[Request], threshold: int) -> list[Bucket]:
    """Cut agreed ``requests`` into buckets of at most ``threshold`` bytes (see module doc)."""
    buckets: list[Bucket] = []
    filling: dict[str, Bucket] = {}
    for request in requests:
        if request.kind != "allreduce":
            buckets.extend(Bucket([(request, entry)], entry.nbytes) for entry in request.entries)
        elif request.grouped:
            groups: dict[str, Bucket] = {}
            for entry in request.entries:
                key = fusion_key(entry.backend.name, entry.dtype, request.op.value,
                                 request.prescale, request.postscale, request.algorithm)
                groups.setdefault(key, Bucket()).add(request, entry)
            buckets.extend(groups.values())
        else:
            entry = request.entries[0]
            nbytes = entry.nbytes
            if nbytes >= threshold:
                buckets.append(Bucket([(request, entry)], nbytes))
                continue
            bucket = filling.get(request.fusion)
            if bucket is None or bucket.nbytes + nbytes > threshold:
                bucket = filling[request.fusion] = Bucket()
                buckets.append(bucket)
            bucket.items.append((request, entry))
            bucket.nbytes += nbytes
    return buckets


class BucketRunner:
    """Runs buckets on the engine's private communicator.

    Args:
        comm: the engine's private communicator.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def run(self, bucket: Bucket) -> list[Phase]:
        """Run ``bucket``, store each entry's output, and return the timed phases."""
        if len(bucket.items) > 1:
            return self._fused(bucket)
        request, entry = bucket.items[0]
        start = _begin(bucket)
        c, a = self.comm, entry.array
        if request.kind == "allreduce":
            args = (request.op, request.algorithm, request.prescale, request.postscale)
            if request.inplace:
                c.allreduce_(a, *args)
            else:
                entry.output = c.allreduce(a, *args)
        elif request.kind == "reduce_scatter":
            entry.output = c.reduce_scatter(a, request.op, request.algorithm, request.prescale,
                                            request.postscale)
        elif request.kind == "allgather":
            entry.output = c.allgather(a, request.algorithm)
        elif request.inplace:
            c.broadcast_(a, request.root, request.algorithm)
        else:
            entry.output = c.broadcast(a, request.root, request.algorithm)
        return [(self._collective_name(request), start, time.perf_counter())]

    def _fused(self, bucket: Bucket) -> list[Phase]:
        """Pack into a new buffer, reduce it in place, hand out the results.

        Out-of-place results are views of the buffer (no second copy), so the buffer
        lives as long as any of them; in-place results are copied back into the
        caller's arrays.
        """
        items = bucket.items
        request, first = items[0]
        be = first.backend
        packing = time.perf_counter()
        buf = be.concatenate([entry.array for _, entry in items])
        start = _begin(bucket)
        self.comm.allreduce_(buf, request.op, request.algorithm, request.prescale,
                             request.postscale)
        unpacking = time.perf_counter()
        count = first.count
        if all(e.count == count and e.array.ndim == 1 for _, e in items):
            # equal 1-D pieces (the common case of many small tensors): the rows of one
            # reshape are their views
            copy_into = be.copy_into
            for (req, entry), row in zip(items, buf.reshape(len(items), count)):
                if req.inplace:
                    copy_into(entry.array, row)
                else:
                    entry.output = row
        else:
            offset = 0
            for req, entry in items:
                end = offset + entry.count
                piece = buf[offset:end]
                if entry.array.ndim != 1:
                    piece = piece.reshape(entry.array.shape)
                if req.inplace:
                    be.copy_into(entry.array, piece)
                else:
                    entry.output = piece
                offset = end
        return [("PACK", packing, start), (self._collective_name(request), start, unpacking),
                ("UNPACK", unpacking, time.perf_counter())]

    def _collective_name(self, request: Request) -> str:
        return f"{request.kind.upper()}({self.comm.last_algorithm})"


def _begin(bucket: Bucket) -> float:
    """Mark the bucket's requests as started (first start wins) and return the time."""
    now = time.perf_counter()
    for request, _ in bucket.items:
        if request.started_at is None:
            request.started_at = now
    return now
