"""One argument shape for every collective of :class:`mpitrain.Communicator`: the array,
then the op (reductions) or the root (broadcasts) by position, everything else by
keyword, alike in the blocking, in-place and async families."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from mpi4py import MPI

import mpitrain as mt

COLLECTIVES = [
    "allreduce", "allreduce_", "reduce_scatter", "allgather", "broadcast", "broadcast_",
    "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "reduce_scatter_async",
    "allgather_async", "broadcast_async", "broadcast_async_",
]
POSITIONAL = {"x", "xs", "op", "root"}


@pytest.mark.parametrize("method", COLLECTIVES)
def test_only_the_array_and_its_op_or_root_are_positional(method: str) -> None:
    params = list(inspect.signature(getattr(mt.Communicator, method)).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert positional and positional[0] in ("x", "xs") and set(positional) <= POSITIONAL
    assert len(positional) <= 2 and not set(keyword) & POSITIONAL
    assert {"name", "algorithm"} <= set(keyword)


def test_the_same_keywords_in_every_family() -> None:
    """allreduce, allreduce_ and allreduce_async take the same keywords (the async
    call has no ``out``, the in-place ones no ``out`` either)."""
    def keywords(method: str) -> set[str]:
        return {p.name for p in inspect.signature(getattr(mt.Communicator, method))
                .parameters.values() if p.kind is p.KEYWORD_ONLY}

    assert keywords("allreduce") - {"out"} == keywords("allreduce_") == \
        keywords("allreduce_async") == keywords("allreduce_async_")
    assert keywords("broadcast") == keywords("broadcast_") == keywords("broadcast_async")
    assert keywords("allgather") == keywords("allgather_async")


def test_a_third_positional_argument_raises() -> None:
    comm = mt.Communicator(MPI.COMM_SELF)
    try:
        x = np.arange(4.0)
        for call in (lambda: comm.allreduce(x, mt.Sum, "ring"),
                     lambda: comm.allreduce_async(x, mt.Sum, "name"),
                     lambda: comm.broadcast(x, 0, "ring"),
                     lambda: comm.allgather(x, "ring")):
            with pytest.raises(TypeError):
                call()
        assert np.array_equal(comm.allreduce(x, mt.Sum, algorithm="ring"), x)
        assert np.array_equal(comm.allreduce_async(x, mt.Sum, name="n").wait(), x)
    finally:
        comm.free()
