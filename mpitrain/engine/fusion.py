"""Tensor fusion: small allreduces packed into one buffer and reduced by one collective.

:func:`plan_buckets` cuts the requests a cycle agreed on into *buckets*, the same way
on every rank (it only reads what the ranks agreed on): allreduce entries with the
same :func:`fusion_key` (backend, dtype, op, prescale, postscale, algorithm) share a
bucket until the next one would take it past ``threshold`` bytes; an entry of
``threshold`` bytes or more, and every entry of the other collectives, is a bucket of
its own; the entries of a grouped allreduce share one bucket per key whatever their
size. Adasum arrays are never fused (their key is ``""``): each is a bucket of its
own. Buckets run in the order they were opened.

:class:`BucketRunner` runs a bucket: pack -> prescale -> collective -> postscale ->
unpack, where the middle three are one call of the engine's
:class:`~mpitrain.dispatch.Dispatcher` (:meth:`~mpitrain.dispatch.Dispatcher.allreduce_flat`;
a bucket of one array runs its checked call through
:meth:`~mpitrain.dispatch.Dispatcher.execute`), so fused buffers get the same algorithm
selection, plan cache and scaling as blocking calls. The fusion buffer is a new array per
bucket (one ``concatenate``, which also flattens and makes contiguous); out-of-place
results are views of it. Where the dispatcher's algorithm takes
:class:`~mpitrain.algorithms.pieces.Pieces` (the shared-memory allreduce, on one
node), nothing is packed: the algorithm reads the arrays themselves and writes the
results into them (in place) or into a new buffer (out of place), which saves one
or two copies of the bucket. A bucket of one entry skips the fusion buffer and calls
the dispatcher on the entry's own array.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..algorithms.pieces import Pieces
from ..dispatch import Dispatcher
from ..ops import ReduceOp
from .request import Request, Spec

Phase = tuple[str, float, float]  # (name, start, end) in perf_counter seconds


@dataclass
class Bucket:
    """Entries that run as one collective.

    Attributes:
        items: ``(request, entry)`` pairs, in packing order (a request of one array is
            its own entry).
        nbytes: their total size.
        spec: the :class:`~.request.Spec` of every item, if every item is a request of
            one array of that spec (their arrays then have equal shapes), else ``None``.
    """

    items: list[tuple[Request, Any]] = field(default_factory=list)
    nbytes: int = 0
    spec: Spec | None = None

    def add(self, request: Request, entry: Any) -> None:
        """Append one entry (``request`` itself for a request of one array)."""
        spec = request.spec if entry is request else None
        if not self.items:
            self.spec = spec
        elif self.spec is not spec:
            self.spec = None
        self.items.append((request, entry))
        self.nbytes += entry.nbytes

    @property
    def requests(self) -> list[Request]:
        """The distinct requests of the bucket, in order."""
        return list({id(r): r for r, _ in self.items}.values())


def fusion_key(backend: str, dtype: Any, op: str | None, prescale: float, postscale: float,
               algorithm: str | None) -> str:
    """Arrays with equal keys may be reduced together in one buffer (a string, so that
    the engine builds it once per spec and looks it up without hashing); ``""``: never
    fused (Adasum weighs each array by its own dot products and norms)."""
    if op == ReduceOp.ADASUM.value:
        return ""
    return f"{backend} {dtype} {op} {prescale!r} {postscale!r} {algorithm}"


def plan_buckets(requests: list[Request], threshold: int) -> list[Bucket]:
    """Cut agreed ``requests`` into buckets of at most ``threshold`` bytes (see module doc)."""
    if requests:
        # The common cycle: small allreduces of one spec (equal shapes) that fit one
        # bucket together, which is what the loop below would make of them.
        spec, nbytes = requests[0].spec, requests[0].nbytes
        if spec.fusion and nbytes * len(requests) <= threshold and nbytes < threshold \
                and all(r.spec is spec for r in requests):
            return [Bucket([(r, r) for r in requests], nbytes * len(requests), spec)]
    buckets: list[Bucket] = []
    filling: dict[str, Bucket] = {}
    for request in requests:
        spec = request.spec
        if spec.fusion and request.nbytes < threshold:  # a small allreduce of one array
            bucket = filling.get(spec.fusion)
            if bucket is None or bucket.nbytes + request.nbytes > threshold:
                bucket = filling[spec.fusion] = Bucket()
                buckets.append(bucket)
            bucket.add(request, request)
        elif spec.grouped:
            groups: dict[str, Bucket] = {}
            for i, entry in enumerate(request.entries or ()):
                key = fusion_key(entry.backend.name, entry.dtype, spec.op.value,
                                 spec.prescale, spec.postscale, spec.algorithm) or str(i)
                groups.setdefault(key, Bucket()).add(request, entry)
            buckets.extend(groups.values())
        else:
            buckets.append(Bucket([(request, request)], request.nbytes, spec))
    return buckets


class BucketRunner:
    """Runs buckets through the engine's dispatcher.

    Args:
        dispatcher: the engine's own dispatcher (on its private communicator).
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def run(self, bucket: Bucket, traced: bool = False) -> list[Phase]:
        """Run ``bucket``, store each entry's output, and return the timed phases (named
        after the algorithm that ran only if ``traced``: a timeline is recording).

        Device inputs are read only once the work that produced them is done (each
        request's ``ready`` event); the work runs on the request's ``stream`` (a fused
        bucket's: see :meth:`_fused`); the outputs are complete when this returns."""
        for request in bucket.requests:
            if request.ready is not None:
                request.ready.synchronize()
        if len(bucket.items) > 1:
            return self._fused(bucket)
        request, entry = bucket.items[0]
        spec = request.spec
        start = _begin(bucket)
        d, a = self.dispatcher, entry.array
        call = spec.call
        assert call is not None
        if spec.grouped:  # an array of a group: the group's arguments, its own array
            call = dataclasses.replace(call, backend=entry.backend, dtype=entry.dtype,
                                       shape=tuple(a.shape))
        # negotiation compared every rank's submission: the dispatcher does not validate
        out = request.output if spec.kind == "allgather" else None  # allgather's out=
        result = d.run_small(call, a, out)
        if result is None:
            result = d.execute(call, a, out=out, stream=request.stream)
        if not spec.inplace:
            entry.output = result
        if not traced:
            return [(self._collective_name(spec, ""), start, time.perf_counter())]
        # the dispatcher's choice is memoized: asking again names the algorithm that ran
        nbytes = result.nbytes if spec.kind == "allgather" else a.nbytes  # chosen by these
        algorithm = d.algorithm(spec.kind, spec.algorithm, nbytes, entry.backend, a.dtype)
        return [(self._collective_name(spec, algorithm), start, time.perf_counter())]

    def _fused(self, bucket: Bucket) -> list[Phase]:
        """Reduce the bucket's arrays as one flat buffer and hand out the results.

        Where the dispatcher's algorithm takes :class:`Pieces` (shared memory), the
        arrays go to it as they are: in place, the results land in them (a prescale
        factor scales them there first); out of place, in one new buffer. Otherwise
        they are packed into a new buffer that is reduced in place. Out-of-place
        results are views of the buffer (no second copy), so it lives as long as any
        of them; in-place results in a packed buffer are copied back into the caller's
        arrays.
        """
        items = bucket.items
        spec = items[0][0].spec
        be = items[0][1].backend
        packing = time.perf_counter()
        arrays = [entry.array for _, entry in items]
        dt = arrays[0].dtype
        same = bucket.spec
        # equal 1-D arrays of one spec (the common case of many small tensors): their length
        row = same.shape[0] if same is not None and same.shape is not None \
            and len(same.shape) == 1 else None
        inplace = same.inplace if same is not None else _all_or_none(
            [request.spec.inplace for request, _ in items])
        pieces = None
        if inplace is not None and self.dispatcher.takes_pieces(spec.algorithm, bucket.nbytes,
                                                                be, dt):
            pieces = _as_pieces(be, arrays, row is not None, inplace)
        # on the stream of its first request, or, in place and out of place mixed, of its
        # first whose results are views of the buffer (from that stream's pool:
        # Engine._ready); the others' events were waited for
        stream = items[0][0].stream if inplace is not None else next(
            r.stream for r, _ in items if not r.spec.inplace)
        with be.scope(arrays[0], stream):  # checked at submission, compared by negotiation
            if pieces is None:
                src = buf = be.concatenate(arrays)
            else:
                src, buf = pieces, (pieces if inplace else be.empty(pieces.size, dt))
            start = _begin(bucket)
            algorithm = self.dispatcher.allreduce_flat(be, src, buf, dt, spec.op,
                                                       spec.algorithm, spec.prescale,
                                                       spec.postscale)
            unpacking = time.perf_counter()
            if not isinstance(buf, Pieces):  # (in place on pieces: already in the arrays)
                _hand_out(be, items, arrays, buf, row)
        return [("PACK", packing, start),
                (self._collective_name(spec, algorithm), start, unpacking),
                ("UNPACK", unpacking, time.perf_counter())]

    @staticmethod
    def _collective_name(spec: Spec, algorithm: str) -> str:
        return f"{spec.kind.upper()}({algorithm})"


def _all_or_none(flags: list[bool]) -> bool | None:
    """``True`` or ``False`` if every flag is, else ``None``."""
    first = flags[0]
    return first if all(flag is first for flag in flags) else None


def _as_pieces(be: Any, arrays: list[Any], one_d: bool, inplace: bool) -> Pieces | None:
    """The arrays (all 1-D if ``one_d``) as :class:`Pieces` of 1-D views, or ``None`` if
    one to be written in place has none (a non-contiguous array of several dimensions)."""
    if one_d:
        return Pieces(be, arrays)
    flat = []
    for a in arrays:
        if a.ndim != 1:
            if inplace and not be.is_contiguous(a):
                return None
            a = be.flat(a)
        flat.append(a)
    return Pieces(be, flat)


def _hand_out(be: Any, items: list[tuple[Request, Any]], arrays: list[Any], buf: Any,
              row: int | None) -> None:
    """Hand out the results in ``buf``: views of it out of place, copies back into the
    caller's arrays in place. ``row``: the common length of equal 1-D arrays of one
    spec, whose results are then the rows of one reshape."""
    if row is not None:
        rows = buf.reshape(len(items), row)
        if items[0][0].spec.inplace:
            be.scatter(arrays, rows)
        else:
            for (_, entry), result in zip(items, rows):
                entry.output = result
        return
    offset = 0
    for req, entry in items:
        end = offset + entry.array.size
        piece = buf[offset:end]
        if entry.array.ndim != 1:
            piece = piece.reshape(entry.array.shape)
        if req.spec.inplace:
            be.copy_into(entry.array, piece)
        else:
            entry.output = piece
        offset = end


def _begin(bucket: Bucket) -> float:
    """Mark the bucket's requests as started (first start wins) and return the time."""
    now = time.perf_counter()
    for request, _ in bucket.items:
        if request.started_at is None:
            request.started_at = now
    return now
