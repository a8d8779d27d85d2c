"""The small-allreduce fast path: a blocking allreduce planned once per (dtype, shape, op,
requested algorithm).

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
  rank order straight into the result, which has the caller's shape.

Validation is not weakened: the fingerprint covers the collective, op, dtype, shape,
scaling, name and algorithm exactly as :func:`~mpitrain.comm.validation.signature`
does, so a rank on the fast path and a rank on the general path meet in the same
exchange, and ranks that disagree raise :class:`~mpitrain.MismatchError` on every rank.
The stall inspector, which watches the transport's collective count and waiting flag,
sees the same :meth:`~mpitrain.comm.transport.Transport.begin` and barrier waits.

A plan records :func:`mpitrain.config.plan_texts` when it is made; a call whose texts
differ (``MPITRAIN_ALGORITHM``, ``MPITRAIN_CHECK``, ``MPITRAIN_TUNING_FILE`` or
``MPITRAIN_SEGMENT_BYTES`` changed) plans again. Everything else (device arrays, array
subclasses, ``out=`` arrays the general path would refuse, other algorithms, larger
arrays) takes the general path.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..backends import NUMPY
from ..comm.shm import SharedMemory
from ..comm.transport import Transport
from ..comm.validation import Signature, Validator
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


class SmallAllreduce:
    """A planned blocking allreduce of one ``(dtype, shape, op)`` (see the module docs).

    Args:
        transport: the dispatcher's transport (its collective count and waits).
        shm: the node's shared memory, or ``None`` at one rank.
        validator: the dispatcher's validator (its exchange runs the barrier).
        dtype: the element type.
        shape: the caller's shape: the result gets it.
        op: the reduction; ``Average`` scales the sum by ``1/size``.
        sig: the call's signature, or ``None`` when calls are not validated.
        texts: :func:`mpitrain.config.plan_texts` when the plan was made.
    """

    def __init__(self, transport: Transport, shm: SharedMemory | None, validator: Validator,
                 dtype: np.dtype[Any], shape: tuple[int, ...], op: ReduceOp,
                 sig: Signature | None, texts: tuple[Any, ...]) -> None:
        self.transport, self.validator, self.texts = transport, validator, texts
        self.dtype, self.shape, self.sig = dtype, shape, sig
        self.fingerprint = sig.fingerprint if sig is not None else 0
        self.ufunc = UFUNCS[op]
        n = self.size = transport.size
        self.scale = 1.0 / n if op is ReduceOp.AVERAGE else 1.0
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        # a 0-d ufunc result is a scalar, not an array: give those an output array
        self.allocates = len(shape) > 0
        self.slots: list[list[Array]] = []
        self.mine: list[Array] = []
        if shm is not None:
            # slots[p][q]: rank q's slot at parity p, as this call's dtype and shape
            self.slots = [[shm.slot(p, q)[:self.nbytes].view(dtype).reshape(shape)
                           for q in range(n)] for p in range(2)]
            self.mine = [self.slots[p][transport.rank] for p in range(2)]
        self.shm = shm

    def allreduce(self, x: Array, out: Array | None) -> Array:
        """The reduction of ``x`` over all ranks, in ``out`` (may be ``x``) or a new array."""
        shm, n = self.shm, self.size
        if shm is None:  # one rank: the sum of one array is the array
            if out is None:
                return x.copy()
            if out is not x:
                out[...] = x
            return out
        t = self.transport
        if t.broken is None and not t.inflight:  # Transport.begin, inlined
            t.seq += 1
            t.current = "allreduce"
        else:
            t.begin("allreduce")  # raises on a broken transport, forgets old requests
        p = self.validator.parity = (shm.seq + 1) & 1
        slots = self.slots[p]
        self.mine[p][...] = x
        if not shm.agree(self.fingerprint) and self.sig is not None:  # Validator.meet
            self.validator.raise_mismatch(self.sig)
        ufunc = self.ufunc
        if out is None:
            if self.allocates:
                out = ufunc(slots[0], slots[1])
            else:
                out = np.empty(self.shape, self.dtype)
                ufunc(slots[0], slots[1], out=out)
        else:
            ufunc(slots[0], slots[1], out=out)
        if n > 2:
            for other in slots[2:]:
                ufunc(out, other, out=out)
        if self.scale != 1.0:
            NUMPY.scale(out, self.scale)
        return out


def fits_out(x: Array, out: Array) -> bool:
    """True if ``out`` is an ``out=`` the fast path may write: a writeable C-contiguous
    numpy array of ``x``'s dtype and shape (anything else goes to the general path,
    which accepts it or says why not)."""
    if type(out) is not np.ndarray or out.shape != x.shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    return bool(flags.c_contiguous and flags.writeable)
