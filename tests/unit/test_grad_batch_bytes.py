"""When DistributedOptimizer starts gradient allreduces: MPITRAIN_GRAD_BATCH_BYTES and
the rule that decides it when unset (one node, host gradients, no spare core)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import mpitrain as mt
from mpitrain import config
from mpitrain.parallel import reducer
from mpitrain.parallel.reducer import SHARED_CORE_BATCH_BYTES, cores_per_rank, grad_batch_bytes


def node(local_size: int, cross_size: int = 1) -> Any:
    return SimpleNamespace(local_size=local_size, cross_size=cross_size)


def machine(monkeypatch: pytest.MonkeyPatch, cpus: int, mask: int) -> None:
    monkeypatch.setattr(reducer.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(reducer.os, "sched_getaffinity", lambda pid: set(range(mask)))


@pytest.mark.parametrize("cpus, mask, local_size, want", [
    (2, 1, 2, 1.0),     # plain mpirun -np 2: each rank bound to one core
    (2, 2, 4, 0.5),     # --bind-to none, 4 ranks on 2 cores
    (64, 64, 8, 8.0),   # unbound: the machine shared
    (64, 32, 8, 32.0),  # bound to a package: its mask
])
def test_cores_per_rank(monkeypatch: pytest.MonkeyPatch, cpus: int, mask: int,
                        local_size: int, want: float) -> None:
    machine(monkeypatch, cpus, mask)
    assert cores_per_rank(local_size) == want


@pytest.mark.parametrize("cpus, mask, local_size, cross_size, host, threads, want", [
    (2, 1, 2, 1, True, 1, SHARED_CORE_BATCH_BYTES),  # one core per rank, one thread
    (2, 2, 4, 1, True, 1, SHARED_CORE_BATCH_BYTES),  # oversubscribed
    (64, 64, 8, 1, True, 1, 0),                      # spare cores: overlap
    (64, 64, 8, 1, True, 8, SHARED_CORE_BATCH_BYTES),  # torch threads use them all
    (2, 1, 2, 1, False, 1, 0),                       # device gradients
    (2, 1, 2, 2, True, 1, 0),                        # a network between nodes
])
def test_the_auto_rule(monkeypatch: pytest.MonkeyPatch, cpus: int, mask: int,
                       local_size: int, cross_size: int, host: bool, threads: int,
                       want: int) -> None:
    monkeypatch.delenv("MPITRAIN_GRAD_BATCH_BYTES", raising=False)
    machine(monkeypatch, cpus, mask)
    assert grad_batch_bytes(node(local_size, cross_size), host, threads) == want
    monkeypatch.setenv("MPITRAIN_GRAD_BATCH_BYTES", "auto")
    assert grad_batch_bytes(node(local_size, cross_size), host, threads) == want


@pytest.mark.parametrize("text, want", [("0", 0), ("8M", 8 << 20), ("1536", 1536)])
def test_a_size_overrides_the_rule(monkeypatch: pytest.MonkeyPatch, text: str,
                                   want: int) -> None:
    machine(monkeypatch, 2, 1)
    monkeypatch.setenv("MPITRAIN_GRAD_BATCH_BYTES", text)
    assert grad_batch_bytes(node(2), True, 1) == want
    assert grad_batch_bytes(node(2, 3), False, 1) == want


def test_a_bad_value_names_the_variable() -> None:
    with pytest.raises(mt.ArgumentError, match="MPITRAIN_GRAD_BATCH_BYTES='soon' is not valid"):
        config.check_environment({"MPITRAIN_GRAD_BATCH_BYTES": "soon"})
