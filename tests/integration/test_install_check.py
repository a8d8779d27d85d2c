"""The install check on real jobs: ``python -m mpitrain --smoke`` starts its own 2-rank
job, ``mpitrain-run -np 3 --check-build`` a 3-rank one, and each says that every element
of its collectives was right."""

from __future__ import annotations

import sys

from jobrun import launcher, run


def test_python_m_mpitrain_smoke_runs_a_checked_job() -> None:
    done = run([sys.executable, "-m", "mpitrain", "--smoke"], 180)
    assert done.rc == 0, done.out
    assert "engine core compiled:" in done.out and "MPI library:" in done.out
    assert "smoke test: allreduce, allgather and broadcast at 2 ranks: every element " \
           "right" in done.out, done.out


def test_mpitrain_run_check_build_with_ranks() -> None:
    done = run(launcher(["-np", "3", "--check-build"]), 180)
    assert done.rc == 0, done.out
    assert "at 3 ranks: every element right" in done.out, done.out
