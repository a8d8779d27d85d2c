"""Fused async allreduces without shared memory in 64-byte pipeline segments: a loop
of training steps at 3, 4 and 5 ranks ends, with every result right, through the ring
(whose pipeline the segments cut) and through the default choice; and buckets of
hundreds of kilobytes, which the ring used to cut into thousands of segments per
chunk, all in flight at once (jobs hung inside the ring).

``tools/ring_messages.py``, the ring's message pattern in plain mpi4py (with which
docs/reliability.md tells a stall inside MPI from one of mpitrain's), runs here with
each of its exchanges and checks its sums.

Each job has a stall timeout (a hang inside it becomes StallError) and a hard timeout.
The jobs send thousands of 64-byte messages per collective: `make integration` runs
them alone (with another job beside them, one collective of the 3-rank job once took
over its 60 s limit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mpirun import run

JOB = str(Path(__file__).resolve().parent / "jobs" / "fused_loop.py")
pytestmark = pytest.mark.alone


@pytest.mark.parametrize("ranks,algorithm", [(3, "ring"), (4, "ring"), (5, "ring"),
                                             (3, "auto"), (5, "auto")])
def test_fused_loop_in_tiny_segments_without_shared_memory(ranks: int, algorithm: str) -> None:
    code, out = run(ranks, [sys.executable, JOB, "500"], 300, MPITRAIN_SHM="0",
                    MPITRAIN_ALGORITHM=algorithm,
                    MPITRAIN_SEGMENT_BYTES="64", MPITRAIN_STALL_WARNING_S="10",
                    MPITRAIN_STALL_TIMEOUT_S="60")
    assert code == 0, out[-4000:]
    assert "500 steps done" in out, out[-4000:]


@pytest.mark.parametrize("ranks", [3, 5])
def test_large_fused_buckets_in_tiny_segments(ranks: int) -> None:
    code, out = run(ranks, [sys.executable, JOB, "20", "2000"], 300, MPITRAIN_SHM="0",
                    MPITRAIN_SEGMENT_BYTES="64", MPITRAIN_STALL_WARNING_S="10",
                    MPITRAIN_STALL_TIMEOUT_S="60")
    assert code == 0, out[-4000:]
    assert "20 steps done" in out, out[-4000:]


TOOL = str(Path(__file__).resolve().parents[2] / "tools" / "ring_messages.py")


@pytest.mark.parametrize("exchange", ["none", "nbc", "block", "p2p"])
def test_the_plain_mpi4py_ring_pattern_runs_and_checks_its_sums(exchange: str) -> None:
    """tools/ring_messages.py (docs/reliability.md), at 3 ranks: every collective's sum
    checked, each exchange before it."""
    code, out = run(3, [sys.executable, TOOL, "--iters", "5", "--segments", "8", "--elems",
                        "3", "--exchange", exchange, "--stall-s", "60"], 120)
    assert code == 0, out[-4000:]
    assert f"5 collectives of 8 segments of 24 B per chunk, exchange {exchange}:" in out, \
        out[-4000:]
