"""Which algorithm runs a collective: one ordered table, first matching rule wins.

A rule matches on the collective, the message size in bytes (``min_bytes <= nbytes <
max_bytes``), the rank count, the number of nodes the ranks span, the dtype and the
buffer kind; a rule naming an algorithm the communicator cannot run (``shm`` across
nodes or on device buffers) is skipped. The built-in rules follow the crossovers that
BENCHMARKS.md measures on one node and on an emulated cluster; ``mpitrain-tune``
measures a cluster's own crossovers and writes a JSON file of rules that
``MPITRAIN_TUNING_FILE`` puts in front of the built-in ones (:meth:`Table.load`, once per
communicator). Every rank evaluates the same table (the communicator checks that the
ranks loaded the same rules) on the same arguments, so every rank picks the same
algorithm.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

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
    buffer: str = "any"  # "numpy", "cupy", "device" (any device backend) or "any"
    dtypes: str = "any"  # "any" or a comma list of dtype names ("float16,bfloat16")
    min_nodes: int = 1

    def matches(self, collective: str, nbytes: int, ranks: int, buffer: str,
                dtype: str = "float32", nodes: int = 1) -> bool:
        """True if this rule applies to the call."""
        return (self.collective == collective and self.min_bytes <= nbytes < self.max_bytes
                and self.min_ranks <= ranks <= self.max_ranks
                and (self.buffer in ("any", buffer)
                     or (self.buffer == "device" and buffer != "numpy"))
                and nodes >= self.min_nodes
                and (self.dtypes == "any" or dtype in self.dtypes.split(",")))


KiB, MiB = 1 << 10, 1 << 20

DEFAULT_RULES: tuple[Rule, ...] = (
    # Device buffers: NCCL where every rank has its own GPU, else CUDA IPC inside a node
    # (offered only where the communicator's device layout allows them:
    # mpitrain.comm.links), else the rules below through CUDA-aware MPI or staging.
    Rule("allreduce", "nccl", buffer="device"),
    Rule("reduce_scatter", "nccl", buffer="device"),
    Rule("allgather", "nccl", buffer="device"),
    Rule("broadcast", "nccl", buffer="device"),
    Rule("allreduce", "ipc", buffer="device"),
    Rule("reduce_scatter", "ipc", buffer="device"),
    Rule("allgather", "ipc", buffer="device"),
    # Across nodes (BENCHMARKS.md, "Multi-node"): small messages go to native MPI's
    # single exchange, larger ones to the node-aware phases.
    Rule("allreduce", "hierarchical", min_bytes=256 * KiB, min_nodes=2),
    Rule("reduce_scatter", "hierarchical", min_bytes=256 * KiB, min_nodes=2),
    Rule("allgather", "hierarchical", min_bytes=1 * MiB, min_nodes=2),
    # Otherwise, and on one node.
    Rule("allreduce", "shm"),
    Rule("allreduce", "mpi", max_bytes=256 * KiB),
    Rule("allreduce", "ring"),
    Rule("reduce_scatter", "shm"),
    Rule("reduce_scatter", "mpi", max_bytes=64 * KiB),
    Rule("reduce_scatter", "ring"),
    # shm: up to 512 KiB per rank the blocks ride the slots (one barrier, a copy in and
    # out), above in stripes; it beat native Allgather behind the general path (its
    # row-count exchange) up to 4 MiB at 2 and 4 ranks, which wins from 64 MiB
    # (BENCHMARKS.md, 2026-11-24).
    Rule("allgather", "shm", max_bytes=16 * MiB),
    Rule("allgather", "mpi"),
    Rule("broadcast", "shm"),
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


class Table:
    """The ordered rules one communicator selects by: a tuning file's, then the built-in
    ones (:meth:`load`). Choices are memoized per argument tuple, so a call costs one
    dictionary lookup once its size has been seen.

    Args:
        rules: the rules in the order they are tried.
    """

    def __init__(self, rules: tuple[Rule, ...] = DEFAULT_RULES) -> None:
        self.rules = rules
        self._named = frozenset((rule.collective, rule.algorithm) for rule in rules)
        self._choices: dict[tuple[Any, ...], str] = {}

    @classmethod
    def load(cls, path: str) -> Table:
        """The rules of the tuning file at ``path`` (none: ``""``) before the built-in ones."""
        return cls((load_rules(path) if path else ()) + DEFAULT_RULES)

    def may_select(self, collective: str, algorithm: str) -> bool:
        """True if some rule names ``algorithm`` for ``collective``: whether
        :meth:`select` may ever return it."""
        return (collective, algorithm) in self._named

    def select(self, collective: str, nbytes: int, ranks: int, buffer: str,
               available: tuple[str, ...], dtype: str = "float32", nodes: int = 1) -> str:
        """The algorithm for a call, among the ``available`` ones for this call
        (``nodes``: the number of nodes the ranks span, ``Topology.node_count``)."""
        key = (collective, nbytes, ranks, buffer, available, dtype, nodes)
        choice = self._choices.get(key)
        if choice is None:
            choice = next((rule.algorithm for rule in self.rules
                           if rule.algorithm in available
                           and rule.matches(collective, nbytes, ranks, buffer, dtype, nodes)),
                          available[0])
            if len(self._choices) >= 4096:
                self._choices.clear()
            self._choices[key] = choice
        return choice


BUILT_IN = Table()
"""The built-in rules alone (no tuning file)."""
