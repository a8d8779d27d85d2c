"""An uncaught exception on one rank, or one rank exiting while the others wait for it,
ends the whole job within seconds, under plain python."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from jobrun import JOBS, mpirun, run

TIMEOUT_S = 90.0  # a job that hangs is killed here; the steps alone would take 30 s
ENDS_WITHIN_S = 15.0


@pytest.mark.parametrize("where", ["main", "thread", "torch"])
def test_uncaught_exception_aborts_the_job(tmp_path: Path, where: str) -> None:
    """The rank's traceback reaches the job's output, and the job ends. ``torch``:
    under torch.distributed, whose own hook captures ``sys.stderr`` while it calls
    mpitrain's (which then never returns: it ends the job)."""
    if where == "torch":
        pytest.importorskip("torch")
    args = [str(JOBS / "crash.py"), str(tmp_path), "1"] + ([where] if where != "main"
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


@pytest.mark.parametrize(("code", "shm", "calls"), [
    (0, "1", "blocking"), (3, "1", "blocking"), (0, "0", "blocking"), (3, "0", "blocking"),
    (3, "1", "async"), (3, "0", "async")])
def test_a_rank_that_exits_early_aborts_the_job(tmp_path: Path, code: int, shm: str,
                                                calls: str) -> None:
    """``sys.exit`` on one rank while the others wait in a collective (through shared
    memory or MPI), or in ``handle.wait()`` of an async call (the async engine's
    exchange, for a name the leaving rank never submitted): the exit guard names it and
    ends the job."""
    args = [str(JOBS / "crash.py"), str(tmp_path), "1", "exit", str(code)]
    args += ["async"] if calls == "async" else []
    result = run(mpirun(3, args, MPITRAIN_SHM=shm), TIMEOUT_S)
    ended = time.time()
    assert result.rc not in (0, -1), result.out
    exited = float((tmp_path / "raised").read_text())
    assert ended - exited < ENDS_WITHIN_S, f"the job took {ended - exited:.1f} s to end"
    assert "mpitrain: rank 1 is exiting after collective #" in result.out
    waits = "the async engine's exchange" if calls == "async" else "allreduce"
    assert f"waits in {waits}" in result.out
    assert "finished all steps" not in result.out


@pytest.mark.parametrize("code", [0, 1])
def test_a_rank_that_calls_os_exit_ends_the_job(tmp_path: Path, code: int) -> None:
    """``os._exit()`` runs no hook: the MPI runtime itself sees a rank end without
    ``MPI_Finalize`` and ends the job, naming the rank."""
    result = run(mpirun(3, [str(JOBS / "crash.py"), str(tmp_path), "1", "os_exit",
                            str(code)]), TIMEOUT_S)
    ended = time.time()
    assert result.rc not in (0, -1), result.out
    exited = float((tmp_path / "raised").read_text())
    assert ended - exited < ENDS_WITHIN_S, f"the job took {ended - exited:.1f} s to end"
    assert "process rank 1 " in result.out or "@1,1]" in result.out, result.out
    assert "finished all steps" not in result.out


@pytest.mark.parametrize("calls", ["blocking", "async", "async-again"])
def test_ranks_that_finish_at_different_times_exit_normally(calls: str) -> None:
    """The exit guard waits for ranks that are still computing: no false abort, also
    when the ranks that leave the exit barrier first stop their async engines while
    the others still survey them (twice: that moment is a race)."""
    args = [str(JOBS / "uneven_exit.py")] + (["async"] if calls != "blocking" else [])
    result = run(mpirun(3, args), TIMEOUT_S)
    assert result.rc == 0, result.out
    assert result.out.count("finished all steps") == 3


def test_a_benchmark_rank_that_raises_ends_the_job(tmp_path: Path) -> None:
    """Only rank 0 writes --json; a path it cannot write makes it raise after the table:
    the benchmark's crash hook ends the job instead of leaving rank 1 in its last
    collective."""
    target = tmp_path / "missing-dir" / "out.json"
    result = run(mpirun(2, ["-m", "benchmarks", "allreduce", "-b", "8", "-e", "8", "-n", "2",
                            "-w", "1", "--impl", "mpitrain", "--json", str(target)]),
                 TIMEOUT_S)
    assert result.rc not in (0, -1), result.out
    assert result.seconds < 45, f"the job took {result.seconds:.1f} s"
    assert "[rank 0] FileNotFoundError" in result.out
    assert "died of an uncaught exception" in result.out
