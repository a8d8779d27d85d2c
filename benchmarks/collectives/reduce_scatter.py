"""reduce_scatter: rank ``r`` gets block ``r`` of the reduction of every rank's buffer.

Every rank's buffer holds ``nranks`` blocks of ``count`` elements (nccl-tests'
count), so a byte size is rounded down to a multiple of ``nranks`` elements and the
printed size is the whole buffer. The bus factor is ``(n-1)/n``. mpitrain has no
in-place reduce_scatter; MPI's reduces in place with ``Reduce_scatter_block``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt

from .. import gloo
from ..hooks import (
    Array,
    Call,
    Case,
    Collective,
    average_in_place,
    crafted,
    mpi_buffer,
    mpi_op,
    no_reset,
    poison,
    reduced,
    restore,
)


def _count(nbytes: int, itemsize: int, nranks: int) -> int:
    return nbytes // itemsize // nranks


def _size(count: int, itemsize: int, nranks: int) -> int:
    return count * nranks * itemsize


def _bus_factor(nranks: int) -> float:
    return (nranks - 1) / nranks


def _make_input(case: Case) -> Array:
    return crafted(case.rank, 0, case.count * case.nranks, case.dtype, case.op)


def _expected(case: Case) -> Array:
    return reduced(case.nranks, case.rank * case.count, case.count, case.dtype, case.op)


def _mpitrain(comm: mt.Communicator, algorithm: str, case: Case, data: Array,
              inplace: bool, allocates: bool) -> Call | None:
    if inplace:
        return None
    if allocates:
        return Call(lambda: comm.reduce_scatter(data, op=case.op, algorithm=algorithm), no_reset)
    out = np.empty_like(data, shape=(case.count,))  # preallocated, like MPI's
    return Call(lambda: comm.reduce_scatter(data, op=case.op, algorithm=algorithm, out=out),
                functools.partial(poison, out))


def _mpi(comm: MPI.Intracomm, case: Case, data: Array, inplace: bool) -> Call:
    op = mpi_op(case.dtype, case.op)
    average = case.op == "avg"
    buf = data.copy() if inplace else np.empty(case.count, case.dtype)
    out = buf[:case.count]
    send = MPI.IN_PLACE if inplace else mpi_buffer(data, blocks=case.nranks)
    recv = mpi_buffer(buf, blocks=case.nranks if inplace else 1)

    def run() -> Array:
        comm.Reduce_scatter_block(send, recv, op)
        if average:
            average_in_place(out, case.nranks)
        return out

    return Call(run, restore(buf, data) if inplace else functools.partial(poison, out))


def _dist(dist: Any, case: Case, data: Array, inplace: bool) -> Call | None:
    out = np.empty(case.count, case.dtype)
    source, target = dist.tensor(data), dist.tensor(out)
    if inplace or source is None or target is None:
        return None
    op, average = gloo.reduce_op(case.op, case.dtype), case.op == "avg"
    if op is None:
        return None
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run() -> Array:
        scatter(target, source, op=op)
        if average:
            average_in_place(out, case.nranks)
        return out

    return Call(run, functools.partial(poison, out))


COLLECTIVE = Collective(name="reduce_scatter", reduces=True, rooted=False, count=_count,
                        size=_size, bus_factor=_bus_factor, make_input=_make_input,
                        expected=_expected, mpitrain=_mpitrain, mpi=_mpi, dist=_dist,
                        direct_traffic=lambda n: n + 1)
