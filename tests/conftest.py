"""Pytest configuration shared by the unit and MPI suites."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Ranks share few cores: one compute thread each (torch's OpenMP threads would spin).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def comm() -> Iterator[object]:
    """The default mpitrain communicator over every rank of the job (a test may shut it
    down: the next one gets a new one), with mpitrain's own join() rule (an earlier
    ``mpitrain.torch`` test may have set Horovod's on it)."""
    import mpitrain as mt
    from mpitrain.engine import JOIN_SERVES_ALL

    comm = mt.init()
    comm.join_serves = JOIN_SERVES_ALL  # mpitrain.torch narrows it to Horovod's rule
    yield comm


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Set MPITRAIN_* variables for one test (every rank must set the same)."""
    return monkeypatch

