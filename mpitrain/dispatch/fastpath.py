"""The small-call fast paths: a blocking allreduce (:class:`SmallAllreduce`),
reduce-scatter (:class:`SmallReduceScatter`) or allgather (:class:`SmallAllgather`)
planned once per (dtype, shape, op, requested algorithm).

A blocking allreduce of a small numpy array spends far longer in Python than in moving
its bytes: argument checks, the algorithm choice, the signature, the plan lookup and
the backend scope cost microseconds, against well under one for the data. So the
dispatcher keeps, per ``(dtype, shape, op, algorithm)`` of a call without ``name`` or
scaling (``algorithm`` as requested: none, ``"auto"`` or a name), a
:class:`SmallAllreduce` that did all of that once:

* at one rank, the call is a copy (or nothing, in place);
* on one node with shared memory, when the algorithm resolves to ``shm`` and the array
  fits a slot, it is the ``shm`` algorithm's small case with nothing around it: the
  input is copied into this rank's slot, the validation exchange (one barrier, with the
  same fingerprint as the general path's signature) runs, and the slots are reduced in
  rank order straight into the result, which has the caller's shape (float16 and
  bfloat16 by :func:`~mpitrain.backends.hostcopy.reduce16`, numpy's bits at float32's
  speed, where numpy's own loop takes ten times as long).

:class:`SmallReduceScatter` is the same for a reduce-scatter (at one rank, a copy; on
one node, this rank's rows of every slot reduced into the result).

:class:`SmallAllgather` is the same for an allgather whose block fits a slot and whose
gathered size the table sends to ``shm``: the block and this rank's row count go into
its slot and header, one validated barrier, then one copy of every slot into the
result. Rows may differ between ranks; when they are not the plan's (every rank the
caller's), every rank sees it in the headers, and the general path finishes the call
from the same exchange.

Validation is not weakened: the fingerprint covers the collective, op, dtype, shape,
scaling, name and algorithm exactly as :func:`~mpitrain.comm.validation.signature`
does, so a rank on the fast path and a rank on the general path meet in the same
exchange, and ranks that disagree raise :class:`~mpitrain.MismatchError` on every rank.
The stall inspector, which watches the transport's collective count and waiting flag,
sees the same :meth:`~mpitrain.comm.transport.Transport.begin` and barrier waits.

Plans are made under the communicator's settings (:class:`~mpitrain.config.Settings`)
and dropped when :meth:`~mpitrain.Communicator.configure` changes them. Everything else
(device arrays, array subclasses, ``out=`` arrays the general path would refuse, other
algorithms, larger arrays) takes the general path.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..backends import NUMPY, hostcopy
from ..comm.shm import PAYLOAD, ROWS, SharedMemory
from ..comm.transport import Transport
from ..comm.validation import Signature, Validator, signature
from ..ops import ReduceOp

Array = Any

UFUNCS: dict[ReduceOp, Callable[..., Any]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}
"""The numpy ufunc of each elementwise op (``Average`` reduces as ``Sum``)."""


def compiled_reduction(op: ReduceOp) -> Callable[..., Array]:
    """``op``'s ufunc for 16-bit floats, as :func:`~mpitrain.backends.hostcopy.reduce16`
    computes it (numpy's bits, without numpy's one-element-at-a-time float16 loop):
    ``f(a, b, out=None)`` returns ``out``, or a new array of ``a``'s shape."""
    def reduce(a: Array, b: Array, out: Array | None = None) -> Array:
        if out is None:
            out = np.empty(a.shape, a.dtype)
        NUMPY.reduce_into(out, a, b, op)
        return out
    return reduce


class SmallCall:
    """What a small-call plan holds: the call's identity and checks, and this rank's
    view of every slot. ``collective`` names the call for the transport's count;
    arrays with fewer than ``min_ndim`` dimensions take the general path."""

    collective = ""
    min_ndim = 0

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp | None,
                 sig: Signature | None) -> None:
        self.transport, self.validator = transport, validator
        self.dtype, self.shape, self.sig = dtype, shape, sig
        self.fingerprint = sig.fingerprint if sig is not None else 0
        n = self.size = transport.size
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.shm = shm
        # views[p][q]: rank q's slot at parity p, flat, as this call's dtype
        self.views: list[list[Array]] = [] if shm is None else \
            [[shm.slot(p, q)[:self.nbytes].view(dtype) for q in range(n)] for p in range(2)]
        # mine[p]: this rank's slot at parity p, in the caller's shape
        self.mine = [v[transport.rank].reshape(shape) for v in self.views]

    def _begin(self, shm: SharedMemory) -> int:
        """Count the call (as the transport's ``begin`` does); returns the parity of the
        slots this call writes and reads."""
        t = self.transport
        if t.broken is None and not t.inflight:  # Transport.begin, inlined
            t.seq += 1
            t.current = self.collective
        else:
            t.begin(self.collective)  # raises on a broken transport, forgets old requests
        p = self.validator.parity = (shm.seq + 1) & 1
        return p

    def _meet(self, shm: SharedMemory, x: Array) -> int:
        """Count the call, copy ``x`` into this rank's slot of ``shm`` (the plan's) and
        pass the validated barrier (raising MismatchError on every rank if the ranks
        disagree); returns the parity of the slots to read."""
        p = self._begin(shm)
        self.mine[p][...] = x
        if not shm.agree(self.fingerprint) and self.sig is not None:  # Validator.meet
            self.validator.raise_mismatch(self.sig)
        return p


class SmallReduction(SmallCall):
    """A small call that reduces: the elementwise ``ufunc`` of its op (compiled for
    16-bit floats: :func:`compiled_reduction`), and the
    ``scale`` of its result (``1/size`` for ``Average``)."""

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp | None,
                 sig: Signature | None) -> None:
        super().__init__(transport, shm, validator, dtype, shape, op, sig)
        if op is None:
            raise ValueError(f"a {self.collective} plan needs an op")
        self.ufunc = compiled_reduction(op) if hostcopy.reduces16(dtype) else UFUNCS[op]
        self.scale = 1.0 / self.size if op is ReduceOp.AVERAGE else 1.0


class SmallAllreduce(SmallReduction):
    """A planned blocking allreduce of one ``(dtype, shape, op)`` (see the module docs).

    Args:
        transport: the dispatcher's transport (its collective count and waits).
        shm: the node's shared memory, or ``None`` at one rank.
        validator: the dispatcher's validator (its exchange runs the barrier).
        dtype: the element type.
        shape: the caller's shape: the result gets it.
        op: the reduction; ``Average`` scales the sum by ``1/size``.
        sig: the call's signature, or ``None`` when calls are not validated.
    """

    collective = "allreduce"

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp | None,
                 sig: Signature | None) -> None:
        super().__init__(transport, shm, validator, dtype, shape, op, sig)
        # a 0-d ufunc result is a scalar, not an array: give those an output array
        self.allocates = len(shape) > 0
        # slots[p][q]: rank q's slot at parity p, in the caller's shape
        self.slots = [[v.reshape(shape) for v in views] for views in self.views]

    def allreduce(self, x: Array, out: Array | None) -> Array:
        """The reduction of ``x`` over all ranks, in ``out`` (may be ``x``) or a new array."""
        shm = self.shm
        if shm is None:  # one rank: the sum of one array is the array
            if out is None:
                return x.copy()
            if out is not x:
                out[...] = x
            return out
        # _meet (and _begin), inlined on the hottest call: calling it measured 1-2 % more time here
        # (0.02-0.03 us of 1.55 us at 2 ranks, python -m benchmarks.latency, 4 runs each)
        t = self.transport
        if t.broken is None and not t.inflight:  # Transport.begin, inlined
            t.seq += 1
            t.current = "allreduce"
        else:
            t.begin("allreduce")  # raises on a broken transport, forgets old requests
        p = self.validator.parity = (shm.seq + 1) & 1
        self.mine[p][...] = x
        if not shm.agree(self.fingerprint) and self.sig is not None:  # Validator.meet
            self.validator.raise_mismatch(self.sig)
        slots, ufunc = self.slots[p], self.ufunc
        if out is None:
            if self.allocates:
                out = ufunc(slots[0], slots[1])
            else:
                out = np.empty(self.shape, self.dtype)
                ufunc(slots[0], slots[1], out=out)
        else:
            ufunc(slots[0], slots[1], out=out)
        if self.size > 2:  # (slicing the list costs more than the test)
            for other in slots[2:]:
                ufunc(out, other, out=out)
        if self.scale != 1.0:
            NUMPY.scale(out, self.scale)
        return out


class SmallReduceScatter(SmallReduction):
    """A planned blocking reduce-scatter of one ``(dtype, shape, op)``: the small
    reduce-scatter of the ``shm`` algorithm with nothing around it. The input is copied
    into this rank's slot, the validation exchange runs, and this rank's block of rows
    is reduced from every slot, in rank order, straight into the result.

    Args: as :class:`SmallAllreduce`'s; ``shape`` has at least one dimension.

    Rank ``r`` gets rows ``[r * q + min(r, e), ...)`` of axis 0, ``q + (r < e)`` of them
    (``q, e = divmod(shape[0], size)``), as on the general path.
    """

    collective = "reduce_scatter"
    min_ndim = 1  # it splits axis 0

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp | None,
                 sig: Signature | None) -> None:
        super().__init__(transport, shm, validator, dtype, shape, op, sig)
        r, row = transport.rank, int(np.prod(shape[1:], dtype=np.int64))
        rows, extra = divmod(shape[0], self.size)
        mine = rows + (r < extra)
        self.out_shape = (mine, *shape[1:])
        lo = (r * rows + min(r, extra)) * row
        hi = lo + mine * row
        # blocks[p][q]: this rank's rows in rank q's slot at parity p
        self.blocks = [[v[lo:hi].reshape(self.out_shape) for v in views]
                       for views in self.views]

    def reduce_scatter(self, x: Array, out: Array | None) -> Array:
        """This rank's block of the reduction of ``x`` over all ranks, in ``out`` or a
        new array of :attr:`out_shape`."""
        shm = self.shm
        if shm is None:  # one rank: its block is the whole array
            if out is None:
                return x.copy()
            out[...] = x
            return out
        blocks, ufunc = self.blocks[self._meet(shm, x)], self.ufunc
        out = ufunc(blocks[0], blocks[1], out=out)
        if self.size > 2:
            for other in blocks[2:]:
                ufunc(out, other, out=out)
        if self.scale != 1.0:
            NUMPY.scale(out, self.scale)
        return out


class SmallAllgather(SmallCall):
    """A planned blocking allgather of one ``(dtype, shape)`` block per rank, every rank
    sending ``shape[0]`` rows: the small allgather of the ``shm`` algorithm with nothing
    around it (see the module docs).

    Args: as :class:`SmallAllreduce`'s, without an op (``None``); ``shape`` has at
    least one dimension, and ``sig`` is the signature of a call without ``out=``
    (allgather is always validated: the exchange carries the row counts).

    The result has :attr:`out_shape`, ``(size * shape[0], *shape[1:])``. A call whose
    ranks send other row counts returns ``None`` after the exchange: the general path
    then finishes it from the headers (:meth:`~mpitrain.comm.validation.Validator.rows`).
    """

    collective = "allgather"
    min_ndim = 1  # it concatenates along axis 0

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp | None,
                 sig: Signature | None) -> None:
        super().__init__(transport, shm, validator, dtype, shape, op, sig)
        n, r, rows = self.size, transport.rank, shape[0]
        self.rows = rows
        self.out_shape = (n * rows, *shape[1:])
        # with out=, its row count is part of what the ranks agree on (as on the general
        # path, so the two meet)
        self.out_sig = None if sig is None else signature(
            sig.collective, sig.op, sig.dtype, self.out_shape, True, -1, 1.0, 1.0, sig.name,
            sig.algorithm)
        self.out_fingerprint = self.out_sig.fingerprint if self.out_sig is not None else 0
        # this rank's row and payload words in a header; every rank's rows, then every
        # rank's payloads, are words [ROWS * n, (PAYLOAD + 1) * n)
        self.rows_at, self.payload_at = ROWS * n + r, PAYLOAD * n + r
        self.headers_lo, self.headers_hi = ROWS * n, (PAYLOAD + 1) * n
        self.expected = [rows] * n + [self.nbytes] * n
        # gathered[p]: every rank's slot at parity p as a (size, *shape) array
        self.gathered = [] if shm is None else \
            [shm.slots[p][:, :self.nbytes].view(dtype).reshape((n, *shape)) for p in range(2)]

    def allgather(self, x: Array, out: Array | None) -> Array | None:
        """Every rank's ``x`` concatenated along axis 0, in ``out`` or a new array of
        :attr:`out_shape`; ``None`` if the ranks' row counts are not the plan's (the
        exchange has happened: the caller finishes the call from its headers)."""
        shm = self.shm
        if shm is None:  # one rank: the gathered array is the block
            if out is None:
                return x.copy()
            out[...] = x
            return out
        p = self._begin(shm)
        words = shm.header_words[p]  # Validator.exchange's header, with the slot filled
        words[self.rows_at] = self.rows
        words[self.payload_at] = self.nbytes
        self.mine[p][...] = x
        if out is None:
            if not shm.agree(self.fingerprint) and self.sig is not None:
                self.validator.raise_mismatch(self.sig)
        elif not shm.agree(self.out_fingerprint) and self.out_sig is not None:
            self.validator.raise_mismatch(self.out_sig)
        if words[self.headers_lo:self.headers_hi].tolist() != self.expected:
            return None
        gathered = self.gathered[p]
        if out is None:
            out = np.empty(self.out_shape, self.dtype)
        out.reshape(gathered.shape)[...] = gathered
        return out


def fits_out(out: Array, shape: tuple[int, ...], dtype: np.dtype[Any]) -> bool:
    """True if ``out`` is an ``out=`` the fast path may write: a writeable C-contiguous
    numpy array of the result's ``shape`` and ``dtype`` (anything else goes to the
    general path, which accepts it or says why not)."""
    if type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype:
        return False
    flags = out.flags
    return bool(flags.c_contiguous and flags.writeable)
