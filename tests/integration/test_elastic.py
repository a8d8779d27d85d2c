"""Elastic training under ULFM: kill -9 one of 4 ranks mid-training; 3 survivors finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jobrun import JOBS, finish, launcher, start

sys.path.insert(0, str(JOBS))
import train as job  # the job's data, gradient and constants

TIMEOUT_S = 150.0
NOISE = "NBC_Progress"
"""What Open MPI's non-blocking collectives print on every survivor when a rank fails in
one (mpitrain posts none under --elastic: mpitrain.comm.p2p)."""
HVD_TIMEOUT_S = 400.0  # 4 ranks importing torch on a small, shared machine


def reference(params: np.ndarray, first: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Gradients of steps ``first..STEPS-1`` and the final parameters, in one process."""
    x, y = job.data()
    w = params.copy()
    grads = []
    for step in range(first, job.STEPS):
        rows = slice(step * job.BATCH, (step + 1) * job.BATCH)
        g = job.gradient(x[rows], y[rows], w) / job.BATCH
        grads.append(g)
        w -= job.LR * g
    return grads, w


def kill_victim(proc: subprocess.Popen[str], pid_file: Path, deadline: float) -> None:
    """Wait for the victim rank to write its pid to ``pid_file``, then ``kill -9`` it."""
    while not (pid_file.exists() and pid_file.read_text()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the victim never reached its step"
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_survivors_of_kill_9_finish_with_correct_gradients(tmp_path: Path) -> None:
    victim, victim_step = 2, 9
    started = time.monotonic()
    proc = start(launcher(["-np", "4", "--elastic", str(JOBS / "train.py"), str(tmp_path),
                           "--victim", str(victim), str(victim_step)]))
    kill_victim(proc, tmp_path / "victim.pid", started + TIMEOUT_S)
    result = finish(proc, TIMEOUT_S, started)
    assert result.rc == 0, result.out
    assert NOISE not in result.out, result.out
    logs = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1, 3)}
    assert not (tmp_path / f"rank{victim}.json").exists()
    _, final = reference(np.zeros(job.DIM), 0)
    for rank, log in logs.items():
        assert log["size"] == 3, f"rank {rank} ended with {log['size']} ranks"
        assert len(log["resumed"]) == 1, log["resumed"]
        resumed = log["resumed"][0]
        assert resumed["size"] == 3 and resumed["step"] == victim_step
        # a reference run from the restored state, and the survivors' own steps after it
        grads, want = reference(np.array(resumed["params"]), resumed["step"])
        after = [s for s in log["steps"] if s["size"] == 3]
        assert [s["step"] for s in after] == list(range(victim_step, job.STEPS))
        for s, g in zip(after, grads):
            np.testing.assert_allclose(s["grad"], g, rtol=1e-12, atol=1e-12)
        before = [s for s in log["steps"] if s["size"] == 4]
        assert [s["step"] for s in before] == list(range(victim_step))
        np.testing.assert_allclose(log["final"], want, rtol=1e-12)
        np.testing.assert_allclose(log["final"], final, rtol=1e-12)
    assert "resumes from commit" in result.out


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_lost_during_the_first_sync(tmp_path: Path, victim: int) -> None:
    """A rank that dies while the others are in the elastic run's first sync from rank 0
    (rank 0 itself, the root of that sync, or another): the survivors recover, take the
    state of a survivor and finish with the right result."""
    result = finish(start(launcher(["-np", "3", "--elastic", str(JOBS / "train.py"),
                                    str(tmp_path), "--die-before-sync", str(victim)])),
                    TIMEOUT_S)
    assert result.rc == 0, result.out
    assert NOISE not in result.out, result.out
    assert not (tmp_path / f"rank{victim}.json").exists()
    _, final = reference(np.zeros(job.DIM), 0)
    for rank in {0, 1, 2} - {victim}:
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert log["size"] == 2, log
        assert all(r["size"] == 2 for r in log["resumed"]), log["resumed"]
        np.testing.assert_allclose(log["final"], final, rtol=1e-12)


def test_a_job_whose_every_rank_failed_exits_non_zero(tmp_path: Path) -> None:
    """Under ULFM ``mpiexec`` exits 0 even when every rank died by a signal (here each one
    raising, which kills it under --elastic); the launcher reports the failure."""
    script = tmp_path / "fail.py"
    script.write_text("import mpitrain as mt\nmt.init()\nraise RuntimeError('on purpose')\n")
    result = finish(start(launcher(["-np", "2", "--elastic", str(script)])), TIMEOUT_S)
    assert result.rc == 1, result.out
    assert "every rank failed" in result.out


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_inside_the_run_is_a_rank_failure(tmp_path: Path, code: int) -> None:
    """Under --elastic a rank that calls sys.exit() mid-training (any status) is lost
    like a killed one: the others recover and finish with the right result."""
    result = finish(start(launcher(["-np", "4", "--elastic", str(JOBS / "train.py"),
                                    str(tmp_path), "--exit-at", "2", "10", str(code)])),
                    TIMEOUT_S)
    assert result.rc == 0, result.out
    assert f"rank 2 called sys.exit({code}) inside the elastic run" in result.out
    _, final = reference(np.zeros(job.DIM), 0)
    for rank in (0, 1, 3):
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["step"] for r in log["resumed"]] == [10] and log["size"] == 3
        np.testing.assert_allclose(log["final"], final, rtol=1e-12)


def test_uncaught_exception_kills_only_that_rank(tmp_path: Path) -> None:
    """Under --elastic the excepthook kills the raising rank by SIGKILL; the others go on
    (here reducing through the async engine, whose thread fails what is in flight)."""
    result = finish(start(launcher(["-np", "4", "--elastic", str(JOBS / "train.py"),
                                    str(tmp_path), "--raise-at", "3", "16", "--async"])),
                    TIMEOUT_S)
    assert result.rc == 0, result.out
    assert "[rank 3] RuntimeError: rank 3 fails at step 16 on purpose" in result.out
    assert "killing this rank so the others go on without it" in result.out
    assert NOISE not in result.out, result.out
    _, final = reference(np.zeros(job.DIM), 0)
    for rank in (0, 1, 2):
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["step"] for r in log["resumed"]] == [16] and log["size"] == 3
        np.testing.assert_allclose(log["final"], final, rtol=1e-12)


@pytest.mark.parametrize("how", ["os_exit", "return"])
def test_a_rank_that_leaves_without_an_exception_is_a_rank_failure(tmp_path: Path,
                                                                   how: str) -> None:
    """``os._exit(1)`` (no Python hook runs: its supervisor, run_rank, turns the exit into
    a death by signal) and a return from the script while the others still train (the
    exit guard sees them wait for it): the others recover and finish."""
    flag = ["--os-exit-at", "2", "10", "1"] if how == "os_exit" else ["--return-at", "2", "10"]
    result = finish(start(launcher(["-np", "4", "--elastic", str(JOBS / "train.py"),
                                    str(tmp_path), *flag])), TIMEOUT_S)
    assert result.rc == 0, result.out
    if how == "os_exit":
        assert "rank 2 (pid" in result.out and "exited with code 1" in result.out
    else:
        assert "mpitrain: rank 2 is exiting after collective #" in result.out
    _, final = reference(np.zeros(job.DIM), 0)
    for rank in (0, 1, 3):
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [r["step"] for r in log["resumed"]] == [10] and log["size"] == 3
        np.testing.assert_allclose(log["final"], final, rtol=1e-12)
    assert not (tmp_path / "rank2.json").exists()


def test_horovod_elastic_script_survives_kill_9(tmp_path: Path) -> None:
    """hvd.elastic.run + TorchState + ElasticSampler under ``--elastic -np 4``: one rank is
    killed mid-epoch; the 3 survivors end with equal parameters, and every sample of
    each epoch went into exactly one committed step (padding aside: the samples left at
    the reset, split over 3 ranks, are padded to a multiple of 3)."""
    sys.path.insert(0, str(JOBS))
    import hvd_elastic as hjob

    victim, victim_step = 2, 3
    started = time.monotonic()
    proc = start(launcher(["-np", "4", "--elastic", str(JOBS / "hvd_elastic.py"),
                           str(tmp_path), "--victim", str(victim), str(victim_step)]))
    kill_victim(proc, tmp_path / "victim.pid", started + HVD_TIMEOUT_S)
    result = finish(proc, HVD_TIMEOUT_S, started)
    assert result.rc == 0, result.out
    assert NOISE not in result.out, result.out
    assert not (tmp_path / f"rank{victim}.json").exists()
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1, 3)]
    for log in logs:
        assert log["size"] == 3 and log["resets"] == [3], log
        np.testing.assert_array_equal(log["params"], logs[0]["params"])
        assert log["counts"] == logs[0]["counts"]
    counts = np.array(logs[0]["counts"])
    assert counts.shape == (hjob.EPOCHS, hjob.SAMPLES)
    assert counts.min() == 1, "a sample of an epoch never went into a committed step"
    extra = counts.sum(axis=1) - hjob.SAMPLES
    assert extra[1] == 0, "the second epoch, all at 3 ranks after the reset, has no padding"
    assert 0 <= extra[0] <= 2 and (counts[0] == 2).sum() == extra[0], counts[0]
    assert counts.max() <= 2
