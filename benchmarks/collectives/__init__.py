"""The collectives the harness can benchmark, by name: one module of hooks each."""

from __future__ import annotations

from ..hooks import Collective
from . import allgather, allreduce, broadcast, reduce_scatter

COLLECTIVES: dict[str, Collective] = {
    c.name: c for c in (allreduce.COLLECTIVE, reduce_scatter.COLLECTIVE,
                        allgather.COLLECTIVE, broadcast.COLLECTIVE)
}

__all__ = ["COLLECTIVES"]
