"""What a collective module gives the harness, and the helpers it builds that from.

A collective is a :class:`Collective`: a small table of hooks, as in nccl-tests. The
harness turns a byte size into a :class:`Case` with ``count``, crafts this rank's
input with ``make_input``, times the :class:`Call` objects that ``mpitrain`` and
``mpi`` prepare, and compares each call's result with ``expected``.

*Crafted values* make every result exactly known. Element ``i`` of rank ``r`` gets a
pseudo-random *level* in ``0..8`` from a hash (splitmix64) of ``(r, i)``, so a
misplaced block or a block from the wrong rank is wrong in about 8 of 9 elements.
Sums, minima and maxima use ``level - 4`` (``level`` for unsigned types); products use
``2`` for level 0, ``-1`` for level 1 (signed and floating types) and ``1`` otherwise.
Every partial sum of a floating type is then an integer of magnitude at most
``4 * nranks``, exact in bfloat16 up to 64 ranks, and every partial product a signed
power of two, so any order of reduction gives the same bits. ``avg`` is the sum
followed by mpitrain's (Horovod's) postscale: integer types are floor-divided by the
rank count, floating types multiplied in place by ``1 / nranks``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import numpy.typing as npt
from mpi4py import MPI

import mpitrain as mt

Array = npt.NDArray[Any]

REDUCING_OPS = ("sum", "prod", "min", "max", "avg")
NO_OP = "none"
NO_ROOT = -1

_LEVELS = 9
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_POISON_BYTE = 0xA5
_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
           "max": np.maximum}
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}


@dataclass(frozen=True)
class Case:
    """One benchmark point as this rank sees it.

    ``count`` is the count parameter of the call, as nccl-tests prints it: the whole
    buffer for allreduce and broadcast, one rank's block for reduce_scatter and
    allgather. ``op`` is ``"none"`` and ``root`` is ``-1`` where they do not apply.
    """

    count: int
    dtype: np.dtype[Any]
    op: str
    root: int
    rank: int
    nranks: int


@dataclass(frozen=True)
class Call:
    """A prepared collective call.

    ``run`` is the call that is timed; it returns this rank's result. ``reset``
    restores the input of an in-place call and poisons a preallocated output, so
    that every run starts from the crafted input and a run that writes nothing
    cannot pass verification; it is never timed.
    """

    run: Callable[[], Array]
    reset: Callable[[], None]


PrepareMpitrain = Callable[[mt.Communicator, str, Case, Array, bool, bool], Optional[Call]]
PrepareMpi = Callable[[MPI.Intracomm, Case, Array, bool], Optional[Call]]
PrepareDist = Callable[[Any, Case, Array, bool], Optional[Call]]


@dataclass(frozen=True)
class Collective:
    """The hooks of one collective.

    Attributes:
        name: the collective's name in mpitrain (``allreduce``, ...).
        reduces: whether it takes a reduction op (else its redop column is ``none``).
        rooted: whether it takes a root (else its root column is ``-1``).
        count: ``(nbytes, itemsize, nranks) -> count`` of :class:`Case`; 0 skips the size.
        size: ``(count, itemsize, nranks) -> bytes`` printed and used for bandwidth.
        bus_factor: ``nranks -> busbw / algbw``, as in nccl-tests.
        make_input: this rank's crafted input (a flat array; read only).
        expected: this rank's exact result (a flat array).
        mpitrain: ``(comm, algorithm, case, data, inplace, allocates) -> Call``;
            ``allocates``: the plain out-of-place call, which allocates its result
            (``comm.allreduce(x)``), else one handed a preallocated ``out=``, as MPI's
            calls are; ``None`` when mpitrain has no such variant (the table prints
            ``N/A``).
        mpi: ``(comm, case, data, inplace) -> Call`` with mpi4py's own collectives.
        dist: ``(torch.distributed, case, data, inplace) -> Call`` with
            torch.distributed's call on its default group (gloo) or on a
            :class:`benchmarks.gloo.OnGroup` (mpitrain's backend); ``None`` where the
            backend has no such call.
        direct_traffic: ``nranks -> bytes of memory traffic per byte of size`` of an
            algorithm that reads the other ranks' buffers directly (the hardware bound
            printed next to the bus bandwidth).
    """

    name: str
    reduces: bool
    rooted: bool
    count: Callable[[int, int, int], int]
    size: Callable[[int, int, int], int]
    bus_factor: Callable[[int], float]
    make_input: Callable[[Case], Array]
    expected: Callable[[Case], Array]
    mpitrain: PrepareMpitrain
    mpi: PrepareMpi
    dist: PrepareDist
    direct_traffic: Callable[[int], float]


# -- crafted values -------------------------------------------------------------------
def crafted(rank: int, start: int, count: int, dtype: np.dtype[Any], op: str) -> Array:
    """The crafted input of ``rank`` at global element indices ``start .. start+count``."""
    # splitmix64 of (rank, index): neighbouring elements and ranks get unrelated levels
    z = np.arange(start, start + count, dtype=np.uint64) + np.uint64(
        (rank + 1) * _GOLDEN & _MASK64)
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    z ^= z >> np.uint64(31)
    level = (z % np.uint64(_LEVELS)).astype(np.int64)
    signed = dtype.kind != "u"
    if op == "prod":
        values = np.where(level == 0, 2, np.where((level == 1) & signed, -1, 1))
    else:
        values = level - 4 if signed else level
    return values.astype(dtype)


def reduced(nranks: int, start: int, count: int, dtype: np.dtype[Any], op: str) -> Array:
    """The exact reduction over ``nranks`` ranks of the crafted values at those indices."""
    acc = crafted(0, start, count, dtype, op)
    for rank in range(1, nranks):
        _UFUNCS[op](acc, crafted(rank, start, count, dtype, op), out=acc)
    if op == "avg":
        average_in_place(acc, nranks)
    return acc


def average_in_place(total: Array, nranks: int) -> None:
    """Turn a sum into mpitrain's average: floor division for integers, else ``* 1/n``."""
    if total.dtype.kind in "iu":
        np.floor_divide(total, nranks, out=total)
    else:
        np.multiply(total, 1.0 / nranks, out=total, casting="unsafe")


def poison(arr: Array) -> None:
    """Fill ``arr`` with a byte pattern that no crafted result contains."""
    arr.view(np.uint8).fill(_POISON_BYTE)


def restore(buf: Array, data: Array) -> Callable[[], None]:
    """A reset that copies ``data`` back into the in-place buffer ``buf``."""
    return functools.partial(np.copyto, buf, data)


def no_reset() -> None:
    """The reset of a call that neither overwrites its input nor reuses an output."""


# -- native MPI -----------------------------------------------------------------------
@functools.cache
def mpi_datatype(dtype: np.dtype[Any]) -> MPI.Datatype:
    """MPI's predefined datatype for ``dtype``, else a committed block of its bytes.

    bfloat16 has no MPI datatype; its elements travel as opaque 2-byte blocks.
    """
    try:
        return MPI.Datatype.fromcode(dtype.char)
    except ValueError:
        return MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()


@functools.cache
def mpi_op(dtype: np.dtype[Any], op: str) -> MPI.Op:
    """The MPI operation for ``op`` on ``dtype`` (``avg`` reduces as ``sum``).

    Predefined where MPI has a datatype for ``dtype``; for bfloat16 a user-defined
    operation that reduces with numpy.
    """
    if mpi_datatype(dtype).is_predefined:
        return _MPI_OPS[op]
    ufunc = _UFUNCS[op]

    def reduce(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        acc = np.frombuffer(inoutbuf, dtype=dtype)
        ufunc(acc, np.frombuffer(inbuf, dtype=dtype), out=acc)

    return MPI.Op.Create(reduce, commute=True)


def mpi_buffer(arr: Array, blocks: int = 1) -> list[Any]:
    """The mpi4py buffer specification ``[bytes, count, datatype]`` of a flat array.

    mpi4py reads the count of a buffer that holds one block per rank (the receive
    buffer of ``Allgather``, the send buffer of ``Reduce_scatter_block``) as the
    count of *one* block, so such buffers pass ``blocks=nranks``.
    """
    return [arr.view(np.uint8), arr.size // blocks, mpi_datatype(arr.dtype)]
