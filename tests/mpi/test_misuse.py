"""Local misuse fails on entry, on every rank, with TypeError/ValueError."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import mpitrain as mt


@pytest.mark.mpi(min_size=1)
def test_bad_arguments(comm: mt.Communicator) -> None:
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="dtype object is not supported"):
        comm.allreduce(np.array([1, "a"], dtype=object))
    with pytest.raises(TypeError, match="cast with"):
        comm.allreduce(np.ones(3, bool))
    with pytest.raises(ValueError, match="unknown reduction op 'median'"):
        comm.allreduce(x, op="median")
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        comm.allreduce(x, algorithm="tree")
    with pytest.raises(ValueError, match=r"out= must be a float32\[4\] array"):
        comm.allreduce(x, out=np.empty(5, np.float32))
    with pytest.raises(ValueError, match=r"out= must be a float32\[4\]"):
        comm.allreduce(x, out=np.empty(4, np.float64))
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce_(ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.broadcast_(ro)
    with pytest.raises(TypeError, match="undefined for complex"):
        comm.allreduce(np.ones(2, np.complex64), op=mt.Max)
    with pytest.raises(ValueError, match="0-d array"):
        comm.reduce_scatter(np.float32(1.0))
    with pytest.raises(ValueError, match="root=99"):
        comm.broadcast(x, root=99)
    with pytest.raises(TypeError, match="cannot use an object of type"):
        comm.allreduce(object())
    with pytest.raises(ValueError, match="needs an array to write into"):
        comm.allreduce_([1.0, 2.0])
    # errors are in the one hierarchy
    with pytest.raises(mt.MpitrainError):
        comm.allreduce(x, op="nope")
    assert comm.allreduce(x)[0] == comm.size  # still usable


@pytest.mark.mpi(min_size=1)
def test_env_algorithm(comm: mt.Communicator, configure: Callable[..., Any]) -> None:
    configure(algorithm="ring")
    assert comm.allreduce(np.ones(3))[0] == comm.size
    configure(algorithm="bogus")
    with pytest.raises(ValueError, match="bogus"):
        comm.allreduce(np.ones(3))
