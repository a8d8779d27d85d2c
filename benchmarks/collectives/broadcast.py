"""broadcast: every rank gets the root's buffer.

``count`` is the buffer's element count; the bus factor is 1. Every rank crafts its
own input, so a rank that kept its own buffer is caught. The out-of-place MPI call
copies the root's input into the output, then broadcasts the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt

from ..hooks import (
    Array,
    Call,
    Case,
    Collective,
    crafted,
    mpi_buffer,
    no_reset,
    poison,
    restore,
)


def _count(nbytes: int, itemsize: int, nranks: int) -> int:
    return nbytes // itemsize


def _size(count: int, itemsize: int, nranks: int) -> int:
    return count * itemsize


def _bus_factor(nranks: int) -> float:
    return 1.0


def _make_input(case: Case) -> Array:
    return crafted(case.rank, 0, case.count, case.dtype, case.op)


def _expected(case: Case) -> Array:
    return crafted(case.root, 0, case.count, case.dtype, case.op)


def _mpitrain(comm: mt.Communicator, algorithm: str, case: Case, data: Array,
              inplace: bool, allocates: bool) -> Call | None:
    if allocates:  # broadcast takes no out=: its out-of-place column is the plain call
        return None
    if inplace:
        buf = data.copy()
        return Call(lambda: comm.broadcast_(buf, root=case.root, algorithm=algorithm),
                    restore(buf, data))
    return Call(lambda: comm.broadcast(data, root=case.root, algorithm=algorithm), no_reset)


def _baseline(bcast: Callable[[int], object], out: Array, case: Case, data: Array,
              inplace: bool) -> Call:
    """A baseline's call: ``bcast(root)`` broadcasts ``out`` in place; out of place,
    the root first copies its input into ``out`` (as mpitrain's out-of-place call does)."""
    copy_root_input = not inplace and case.rank == case.root

    def run() -> Array:
        if copy_root_input:
            np.copyto(out, data)
        bcast(case.root)
        return out

    return Call(run, restore(out, data) if inplace else functools.partial(poison, out))


def _mpi(comm: MPI.Intracomm, case: Case, data: Array, inplace: bool) -> Call:
    out = data.copy() if inplace else np.empty_like(data)
    buf = mpi_buffer(out)
    return _baseline(lambda root: comm.Bcast(buf, root), out, case, data, inplace)


def _dist(dist: Any, case: Case, data: Array, inplace: bool) -> Call | None:
    out = data.copy() if inplace else np.empty_like(data)
    tensor = dist.tensor(out)
    if tensor is None:
        return None
    return _baseline(lambda root: dist.broadcast(tensor, root), out, case, data, inplace)


COLLECTIVE = Collective(name="broadcast", reduces=False, rooted=True, count=_count,
                        size=_size, bus_factor=_bus_factor, make_input=_make_input,
                        expected=_expected, mpitrain=_mpitrain, mpi=_mpi, dist=_dist,
                        direct_traffic=lambda n: 2 * (n - 1))
