"""The bad-input catalogue at 2, 3 and 4 ranks: the documented error on every rank,
within seconds, and a working collective afterwards.

One job per rank count runs every case of ``jobs/bad_inputs.py``, the three jobs at once
(most of each job's time is stall timeouts it waits out); each test checks one case on
every rank of one job.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from jobrun import JOBS, Result, mpirun, run

sys.path.insert(0, str(JOBS))
import bad_inputs  # the case list (imports no MPI)

RANKS = (2, 3, 4)
TIMEOUT_S = 240.0
CASE_S = 10.0  # "within seconds": every case, stalls included, ends well within this


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Result, Path]]:
    """Run the catalogue once per rank count, the jobs side by side."""
    outs = {n: tmp_path_factory.mktemp(f"bad{n}") for n in RANKS}
    with ThreadPoolExecutor(len(RANKS)) as pool:
        ran = {n: pool.submit(run, mpirun(n, [str(JOBS / "bad_inputs.py"), str(out)]),
                              TIMEOUT_S) for n, out in outs.items()}
        return {n: (ran[n].result(), outs[n]) for n in RANKS}


def results(jobs: dict[int, tuple[Result, Path]], n: int) -> list[dict[str, Any]]:
    result, out = jobs[n]
    assert result.rc == 0, f"the catalogue job at {n} ranks failed:\n{result.out[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("case", [c.name for c in bad_inputs.CASES])
def test_case(jobs: dict[int, tuple[Result, Path]], n: int, case: str) -> None:
    per_rank = [r[case] for r in results(jobs, n)]
    if "skipped" in per_rank[0]:
        pytest.skip(per_rank[0]["skipped"])
    for rank, got in enumerate(per_rank):
        assert got["ok"], f"rank {rank}: {got['why']}"
        assert got["seconds"] < CASE_S, f"rank {rank} took {got['seconds']:.1f} s"
        assert got["next_ok"], f"rank {rank}: the collective after the case failed"


def test_catalogue_is_large_enough() -> None:
    assert len(bad_inputs.CASES) >= 30
