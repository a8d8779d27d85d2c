"""Reduction operations.

``Average`` is not a reduction of its own: it is ``Sum`` followed by a postscale of
``1/size`` (Horovod's definition), so every algorithm only implements Sum, Min, Max
and Product. ``Adasum`` is not elementwise: it combines whole vectors (allreduce of
float arrays only) and runs its own algorithm (:mod:`mpitrain.algorithms.adasum`).
"""

from __future__ import annotations

import enum

from .errors import ArgumentError


class ReduceOp(enum.Enum):
    """A reduction operation accepted by every reducing collective."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    # Members are singletons compared by identity: hash them the same way, in C
    # (Enum's own __hash__ is Python code, and every async submission hashes its op).
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"mpitrain.{self.name.capitalize()}"

    @property
    def reduction(self) -> ReduceOp:
        """The reduction actually performed (Average reduces as Sum)."""
        return ReduceOp.SUM if self is ReduceOp.AVERAGE else self


Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_ALIASES = {"avg": ReduceOp.AVERAGE, "mean": ReduceOp.AVERAGE, "prod": ReduceOp.PRODUCT}


def parse_op(op: ReduceOp | str) -> ReduceOp:
    """Return the :class:`ReduceOp` for an op object or its name (case-insensitive)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        key = op.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
        try:
            return ReduceOp(key)
        except ValueError:
            pass
    names = ", ".join(o.value for o in ReduceOp)
    raise ArgumentError(f"unknown reduction op {op!r}; use one of mpitrain.Sum/Average/Min/"
                        f"Max/Product/Adasum or the strings {names}")
