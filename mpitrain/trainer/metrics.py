"""Metric averaging across ranks.

:func:`average_metrics` averages a dict of numbers over ranks in one collective;
:class:`Metrics` accumulates sample-weighted sums over an epoch and averages them at
the end, so ranks with different sample counts are weighted correctly.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..communicator import Communicator
from ..errors import ArgumentError, MismatchError
from ..parallel.broadcast import resolve


def average_metrics(metrics: Mapping[str, float], weight: float = 1.0,
                    comm: Communicator | None = None) -> dict[str, float]:
    """Weighted average of each metric over all ranks (collective).

    Args:
        metrics: name -> value on this rank; every rank must pass the same names.
        weight: this rank's weight (e.g. its sample count); equal weights by default.
        comm: the communicator (default: that of :func:`mpitrain.init`).

    Returns:
        name -> ``sum(weight_r * value_r) / sum(weight_r)``, the same on every rank.
    """
    comm = resolve(comm)
    names = sorted(metrics)
    table = comm.allgather_object((names, float(weight), [float(metrics[k]) for k in names]))
    for r, (their_names, _, _) in enumerate(table):
        if their_names != names:
            raise MismatchError(f"rank {comm.rank}: average_metrics needs the same metric names "
                                f"on every rank, but rank {r} passed {their_names} and rank "
                                f"{comm.rank} passed {names}")
    weights = np.array([w for _, w, _ in table])
    total = weights.sum()
    if total <= 0:
        raise ArgumentError(f"rank {comm.rank}: average_metrics weights sum to {total}; "
                            "pass positive weights")
    values = np.array([v for _, _, v in table]).reshape(len(table), len(names))
    averaged = weights @ values / total
    return {k: float(v) for k, v in zip(names, averaged)}


class Metrics:
    """Sample-weighted running sums of named metrics, averaged over ranks on demand.

    ``update(n, loss=l, acc=a)`` adds ``n * l`` and ``n * a`` (``l``, ``a`` are means
    over ``n`` samples); :meth:`average` returns the means over every sample of every
    rank since the last :meth:`reset`.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0.0

    def update(self, n: float = 1.0, **values: Any) -> None:
        """Add ``values`` (means over ``n`` samples) to the running sums."""
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value) * n
        self.count += n

    def local(self) -> dict[str, float]:
        """This rank's means (no communication)."""
        return {k: v / self.count for k, v in self.sums.items()} if self.count else {}

    def average(self, comm: Communicator | None = None) -> dict[str, float]:
        """Means over the samples of every rank (collective)."""
        return average_metrics(self.local(), weight=self.count, comm=comm)

    def reset(self) -> None:
        """Start a new accumulation."""
        self.sums.clear()
        self.count = 0.0
