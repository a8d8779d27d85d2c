"""An uncaught exception on one rank ends the whole job within seconds, under plain python."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jobrun import JOBS, mpirun, run

TIMEOUT_S = 90.0  # a job that hangs is killed here; the steps alone would take 30 s
ENDS_WITHIN_S = 15.0


@pytest.mark.parametrize("where", ["main", "thread"])
def test_uncaught_exception_aborts_the_job(tmp_path: Path, where: str) -> None:
    args = [str(JOBS / "crash.py"), str(tmp_path), "1"] + (["thread"] if where == "thread"
                                                           else [])
    result = run(mpirun(3, args), TIMEOUT_S)
    ended = time.time()
    assert result.rc not in (0, -1), result.out
    raised = float((tmp_path / "raised").read_text())
    assert ended - raised < ENDS_WITHIN_S, f"the job took {ended - raised:.1f} s to end"
    assert "[rank 1] ValueError: boom at step 5" in result.out
    assert "[rank 1] mpitrain: rank 1 of 3" in result.out
    assert "finished all steps" not in result.out
    if where == "thread":
        assert "in thread 'loader'" in result.out
