"""Which algorithm runs a collective: one ordered table, first matching rule wins.

A rule matches on the collective, the message size in bytes (``min_bytes <= nbytes <
max_bytes``), the rank count, the number of nodes the ranks span and the buffer kind.
The built-in single-node rules were measured on a 2-core host with Open MPI 5, the
multi-node ones on an emulated cluster (see BENCHMARKS.md); ``mpitrain-tune`` measures a
cluster's own crossovers and writes a JSON file of rules that
``MPITRAIN_TUNING_FILE`` puts in front of the built-in ones. Every rank evaluates the
same table on the same arguments, so every rank picks the same algorithm.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from typing import Any

from .. import config
from ..errors import ArgumentError

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast")


@dataclass(frozen=True)
class Rule:
    """Use ``algorithm`` for ``collective`` when every given condition holds."""

    collective: str
    algorithm: str
    min_bytes: int = 0
    max_bytes: int = 1 << 62
    min_ranks: int = 1
    max_ranks: int = 1 << 30
    buffer: str = "any"  # "numpy", "cupy" or "any"
    min_nodes: int = 1

    def matches(self, collective: str, nbytes: int, ranks: int, buffer: str,
                nodes: int = 1) -> bool:
        """True if this rule applies to the call."""
        return (self.collective == collective and self.min_bytes <= nbytes < self.max_bytes
                and self.min_ranks <= ranks <= self.max_ranks
                and self.buffer in ("any", buffer) and nodes >= self.min_nodes)


KiB, MiB = 1 << 10, 1 << 20

DEFAULT_RULES: tuple[Rule, ...] = (
    # Across nodes (measured on the emulated cluster, see BENCHMARKS.md "Multi-node").
    Rule("allreduce", "hierarchical", min_bytes=64 * KiB, min_nodes=2),
    Rule("reduce_scatter", "hierarchical", min_bytes=256 * KiB, min_nodes=2),
    Rule("allgather", "hierarchical", min_bytes=1 * MiB, min_nodes=2),
    # Otherwise, and on one node.
    Rule("allreduce", "mpi", max_bytes=256 * KiB),
    Rule("allreduce", "ring"),
    Rule("reduce_scatter", "mpi", max_bytes=64 * KiB),
    Rule("reduce_scatter", "ring"),
    Rule("allgather", "mpi"),
    Rule("broadcast", "mpi"),
)


def load_rules(path: str) -> tuple[Rule, ...]:
    """Read the rules of a tuning file (a JSON object with a ``rules`` list)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return tuple(Rule(**entry) for entry in data["rules"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ArgumentError(f"MPITRAIN_TUNING_FILE={path!r} cannot be used: {exc}; "
                            "regenerate it with mpitrain-tune or unset the variable") from None


def dump_rules(rules: list[Rule], path: str, meta: dict[str, Any] | None = None) -> None:
    """Write ``rules`` as a tuning file."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta or {}, "rules": [asdict(r) for r in rules]}, f, indent=1)


@functools.lru_cache(maxsize=8)
def _rules_for(path: str) -> tuple[Rule, ...]:
    return (load_rules(path) if path else ()) + DEFAULT_RULES


def select(collective: str, nbytes: int, ranks: int, buffer: str,
           available: tuple[str, ...], nodes: int = 1) -> str:
    """The algorithm for a call, among the ``available`` ones for this call.

    ``nodes`` is the number of nodes the ranks span (``Topology.node_count``).
    """
    for rule in _rules_for(config.TUNING_FILE.get()):
        if rule.algorithm in available and rule.matches(collective, nbytes, ranks, buffer,
                                                        nodes):
            return rule.algorithm
    return available[0]
