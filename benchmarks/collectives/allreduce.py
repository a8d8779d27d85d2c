"""allreduce: every rank gets the reduction of every rank's whole buffer.

``count`` is the buffer's element count. The bus factor is ``2(n-1)/n``: a ring
moves each byte ``n - 1`` times in its reduce-scatter half and again in its
all-gather half.
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
    return nbytes // itemsize


def _size(count: int, itemsize: int, nranks: int) -> int:
    return count * itemsize


def _bus_factor(nranks: int) -> float:
    return 2 * (nranks - 1) / nranks


def _make_input(case: Case) -> Array:
    return crafted(case.rank, 0, case.count, case.dtype, case.op)


def _expected(case: Case) -> Array:
    return reduced(case.nranks, 0, case.count, case.dtype, case.op)


def _mpitrain(comm: mt.Communicator, algorithm: str, case: Case, data: Array,
              inplace: bool, allocates: bool) -> Call | None:
    if inplace:
        if allocates:
            return None
        buf = data.copy()
        return Call(lambda: comm.allreduce_(buf, op=case.op, algorithm=algorithm),
                    restore(buf, data))
    if allocates:
        return Call(lambda: comm.allreduce(data, op=case.op, algorithm=algorithm), no_reset)
    out = np.empty_like(data)
    return Call(lambda: comm.allreduce(data, op=case.op, algorithm=algorithm, out=out),
                functools.partial(poison, out))


def _mpi(comm: MPI.Intracomm, case: Case, data: Array, inplace: bool) -> Call:
    op = mpi_op(case.dtype, case.op)
    average = case.op == "avg"
    out = data.copy() if inplace else np.empty_like(data)
    send = MPI.IN_PLACE if inplace else mpi_buffer(data)
    recv = mpi_buffer(out)

    def run() -> Array:
        comm.Allreduce(send, recv, op)
        if average:
            average_in_place(out, case.nranks)
        return out

    return Call(run, restore(out, data) if inplace else functools.partial(poison, out))


def _dist(dist: Any, case: Case, data: Array, inplace: bool) -> Call | None:
    out = data.copy()
    tensor = dist.tensor(out)
    if tensor is None:
        return None
    op, average = gloo.reduce_op(case.op, case.dtype), case.op == "avg"
    if op is None:
        return None

    def run() -> Array:
        if not inplace:  # torch.distributed reduces in place: out-of-place copies first
            np.copyto(out, data)
        dist.all_reduce(tensor, op=op)
        if average:
            average_in_place(out, case.nranks)
        return out

    return Call(run, restore(out, data) if inplace else functools.partial(poison, out))


COLLECTIVE = Collective(name="allreduce", reduces=True, rooted=False, count=_count,
                        size=_size, bus_factor=_bus_factor, make_input=_make_input,
                        expected=_expected, mpitrain=_mpitrain, mpi=_mpi, dist=_dist,
                        direct_traffic=lambda n: 3 * n - 1)
