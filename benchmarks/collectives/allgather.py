"""allgather: every rank gets the concatenation of every rank's block.

Each rank sends ``count`` elements (nccl-tests' count), so a byte size is rounded
down to a multiple of ``nranks`` elements and the printed size is the gathered
buffer. Rank ``r``'s block carries the crafted values of global indices
``r*count ..``, so the expected result is one crafted sequence. The bus factor is
``(n-1)/n``. mpitrain has no in-place allgather; MPI's gathers in place with
``MPI_IN_PLACE``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt

from ..hooks import Array, Call, Case, Collective, crafted, mpi_buffer, no_reset, poison


def _count(nbytes: int, itemsize: int, nranks: int) -> int:
    return nbytes // itemsize // nranks


def _size(count: int, itemsize: int, nranks: int) -> int:
    return count * nranks * itemsize


def _bus_factor(nranks: int) -> float:
    return (nranks - 1) / nranks


def _make_input(case: Case) -> Array:
    return crafted(case.rank, case.rank * case.count, case.count, case.dtype, case.op)


def _expected(case: Case) -> Array:
    blocks = [crafted(r, r * case.count, case.count, case.dtype, case.op)
              for r in range(case.nranks)]
    return np.concatenate(blocks)


def _mpitrain(comm: mt.Communicator, algorithm: str, case: Case, data: Array,
              inplace: bool, allocates: bool) -> Call | None:
    if inplace:
        return None
    if allocates:
        return Call(lambda: comm.allgather(data, algorithm=algorithm), no_reset)
    out = np.empty_like(data, shape=(case.count * case.nranks,))  # preallocated, like MPI's
    return Call(lambda: comm.allgather(data, algorithm=algorithm, out=out),
                functools.partial(poison, out))


def _mpi(comm: MPI.Intracomm, case: Case, data: Array, inplace: bool) -> Call:
    out = np.empty(case.count * case.nranks, case.dtype)
    send = MPI.IN_PLACE if inplace else mpi_buffer(data)
    recv = mpi_buffer(out, blocks=case.nranks)
    mine = out[case.rank * case.count:(case.rank + 1) * case.count]

    def run() -> Array:
        comm.Allgather(send, recv)
        return out

    def reset_in_place() -> None:
        poison(out)
        np.copyto(mine, data)

    return Call(run, reset_in_place if inplace else functools.partial(poison, out))


def _dist(dist: Any, case: Case, data: Array, inplace: bool) -> Call | None:
    out = np.empty(case.count * case.nranks, case.dtype)
    source, target = dist.tensor(data), dist.tensor(out)
    if inplace or source is None or target is None:
        return None
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def run() -> Array:
        gather(target, source)
        return out

    return Call(run, functools.partial(poison, out))


COLLECTIVE = Collective(name="allgather", reduces=False, rooted=False, count=_count,
                        size=_size, bus_factor=_bus_factor, make_input=_make_input,
                        expected=_expected, mpitrain=_mpitrain, mpi=_mpi, dist=_dist,
                        direct_traffic=lambda n: 2 * (n - 1))
