"""How the suite shares a sweep's cases out among jobs of 3, 4 and 5 ranks
(``tests/conftest.py``), and ``MPITRAIN_TEST_EVERY_CASE=1``, which the GPU scripts set so
that each of their jobs runs every case. Collection only, in a pytest of its own that
takes the rank count from the environment as under ``mpirun``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SWEEP = "tests/mpi/test_small_allreduce.py"  # a sweep over dtypes, ops and sizes


def collected(size: int, every_case: str | None) -> tuple[int, int]:
    """(collected, deselected) of :data:`SWEEP` in a job of ``size`` ranks."""
    env = {k: v for k, v in os.environ.items() if k != "MPITRAIN_TEST_EVERY_CASE"}
    env["OMPI_COMM_WORLD_SIZE"] = str(size)
    if every_case is not None:
        env["MPITRAIN_TEST_EVERY_CASE"] = every_case
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                             "--co", SWEEP], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found = re.search(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?",
                      result.stdout)
    assert found, result.stdout
    total = int(found.group(2) or found.group(1))
    return total, int(found.group(3) or 0)


@pytest.mark.parametrize("size", [3, 4, 5])
def test_jobs_of_three_to_five_ranks_share_the_cases_out(size: int) -> None:
    total, deselected = collected(size, None)
    assert 0 < deselected < total


@pytest.mark.parametrize("size", [1, 2])
def test_jobs_of_one_and_two_ranks_run_every_case(size: int) -> None:
    assert collected(size, None)[1] == 0


def test_every_case_runs_at_every_rank_count_when_asked() -> None:
    assert collected(3, "1")[1] == 0
    assert collected(3, "0")[1] > 0  # only "1" asks
