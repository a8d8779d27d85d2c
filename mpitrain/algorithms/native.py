"""The native MPI collectives of the MPI library, behind the same plan interface.

They serve as the ``"mpi"`` algorithm (a baseline in benchmarks, and a candidate of
the selection table where they are faster). Float16 and bfloat16, which MPI cannot
reduce portably, are reduced by a user-defined MPI operation that calls our numpy
reduction, over a contiguous datatype of one element so MPI never splits one. So are
Min and Max of floats, so that NaN propagates as it does in every other algorithm, and
sums of 8- and 16-bit integers, so that they wrap around as they do in every other
algorithm.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from mpi4py import MPI

from ..backends import ArrayBackend, hostcopy
from ..dtypes import mpi_reduces_natively
from ..ops import ReduceOp
from .base import Plan, PlanRequest, Signature

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVERAGE: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}
_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVERAGE: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
}


PREDEFINED: dict[np.dtype[Any], MPI.Datatype] = {
    np.dtype(np.int8): MPI.INT8_T, np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int16): MPI.INT16_T, np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.int32): MPI.INT32_T, np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.int64): MPI.INT64_T, np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX, np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
"""MPI's predefined datatype of each dtype it reduces natively (its built-in operations
accept only predefined datatypes)."""


@functools.cache
def _element_type(dt: np.dtype[Any]) -> MPI.Datatype:
    """An MPI datatype of one ``dt`` element (predefined where MPI has one)."""
    if mpi_reduces_natively(dt):
        return PREDEFINED[dt]
    return MPI.BYTE.Create_contiguous(dt.itemsize).Commit()


def _predefined_differs(dt: np.dtype[Any], op: ReduceOp) -> bool:
    """Whether MPI's predefined operation gives other results than numpy's ufunc:
    Open MPI's ``MPI_MIN``/``MPI_MAX`` drop NaN where numpy's propagate it, and its
    ``op/avx`` component adds 8- and 16-bit integers with saturation where numpy wraps
    around (open-mpi/ompi#8045, closed as won't fix)."""
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return dt.kind == "f"
    return op is ReduceOp.SUM and dt.kind in "iu" and dt.itemsize <= 2


@functools.cache
def _mpi_op(dt: np.dtype[Any], op: ReduceOp) -> MPI.Op:
    """The MPI operation reducing ``dt`` with ``op``.

    User-defined (our numpy reduction) for float16/bf16, and where MPI's predefined
    operation would give another result than every other algorithm
    (:func:`_predefined_differs`). float16 and bfloat16 reduce in the
    :mod:`~mpitrain.backends.hostcopy` extension where it is built.
    """
    if mpi_reduces_natively(dt) and not _predefined_differs(dt, op):
        return _MPI_OPS[op]
    ufunc = _UFUNCS[op]

    def reduce(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        a = np.frombuffer(inbuf, dtype=dt)
        b = np.frombuffer(inoutbuf, dtype=dt)
        if not hostcopy.reduce16(b, a, b, op):
            ufunc(a, b, out=b)

    return MPI.Op.Create(reduce, commute=True)


def _spec(backend: ArrayBackend, flat: Any, count: int, dt: np.dtype[Any]) -> list[Any]:
    return [backend.as_bytes(flat), count, _element_type(dt)]


class NativeAllreduce(Plan):
    """``MPI_Allreduce`` (in place on the output)."""

    def __init__(self, req: PlanRequest) -> None:
        self.transport, self.backend, self.count = req.transport, req.backend, req.count
        self.comm = req.transport.comm
        self.dt = req.dtype
        self.mpi_op = _mpi_op(self.dt, req.reduction)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out = reduce(src over ranks)``; ``src`` may be ``out``."""
        if src is not out:
            self.backend.copy_into(out, src)
            self.backend.synchronize()  # a device copy must be done before MPI reads out
        self.transport.collective(self.comm.Allreduce, self.comm.Iallreduce, MPI.IN_PLACE,
                                  _spec(self.backend, out, self.count, self.dt), self.mpi_op)


class NativeReduceScatter(Plan):
    """``MPI_Reduce_scatter`` with the blocks of :func:`~.chunks.split_bounds`."""

    def __init__(self, req: PlanRequest) -> None:
        self.transport, self.backend, self.counts = req.transport, req.backend, req.counts
        self.comm, self.rank = req.transport.comm, req.transport.rank
        self.dt = req.dtype
        self.mpi_op = _mpi_op(self.dt, req.reduction)

    def run(self, src: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = this rank's reduced block of ``src``."""
        total = sum(self.counts)
        self.transport.collective(self.comm.Reduce_scatter, self.comm.Ireduce_scatter,
                                  _spec(self.backend, src, total, self.dt),
                                  _spec(self.backend, out, self.counts[self.rank], self.dt),
                                  self.counts, self.mpi_op)


class NativeAllgather(Plan):
    """``MPI_Allgather`` of equal blocks (MPI libraries optimise it beyond
    ``MPI_Allgatherv``, see BENCHMARKS.md), ``MPI_Allgatherv`` of blocks of different
    lengths."""

    def __init__(self, req: PlanRequest) -> None:
        self.transport, self.backend, self.counts = req.transport, req.backend, req.counts
        self.comm, self.dt = req.transport.comm, req.dtype
        self.displs = [lo for lo, _ in req.chunks]
        self.equal = len(set(self.counts)) == 1

    def run(self, block: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """``out`` = concatenation of every rank's ``block``."""
        etype = _element_type(self.dt)
        if self.equal:
            self.transport.collective(
                self.comm.Allgather, self.comm.Iallgather,
                [self.backend.as_bytes(block), block.size, etype],
                [self.backend.as_bytes(out), block.size, etype])
            return
        self.transport.collective(
            self.comm.Allgatherv, self.comm.Iallgatherv,
            [self.backend.as_bytes(block), block.size, etype],
            [self.backend.as_bytes(out), (self.counts, self.displs), etype])


class NativeBroadcast(Plan):
    """``MPI_Bcast``."""

    def __init__(self, req: PlanRequest) -> None:
        self.transport, self.backend, self.count = req.transport, req.backend, req.count
        self.comm, self.root, self.dt = req.transport.comm, req.root, req.dtype

    def run(self, buf: Any, out: Any, sig: Signature | None = None,
            postscale: float = 1.0) -> None:
        """Overwrite ``buf`` on every rank with the root's ``buf``."""
        self.transport.collective(self.comm.Bcast, self.comm.Ibcast,
                                  _spec(self.backend, buf, self.count, self.dt), self.root)
