"""mpitrain-run on real jobs: --max-restarts, giving up, ``python -m mpitrain.run``,
signals, ``-m module`` and torchrun's variables.

Every wait is bounded: a job that hangs fails its test (and is killed) instead of
hanging the suite.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from jobrun import JOBS, ROOT, Result, finish, launcher, run, start

from mpitrain import launcher as launcher_module


def final_params(out: Path, ranks: int) -> list[np.ndarray]:
    return [np.array(json.loads((out / f"rank{r}.json").read_text())["final"])
            for r in range(ranks)]


def test_max_restarts_resumes_from_checkpoint(tmp_path: Path) -> None:
    """Rank 1 raises at step 13 of the first attempt; the restart resumes from step 13."""
    plain, failing = tmp_path / "plain", tmp_path / "failing"
    for d in (plain, failing):
        d.mkdir()
    reference = run(launcher(["-np", "3", str(JOBS / "train.py"), str(plain)]), 120)
    assert reference.rc == 0, reference.out
    result = run(launcher(["-np", "3", "--max-restarts", "2", str(JOBS / "train.py"),
                           str(failing), "--raise-at", "1", "13", "--checkpoint",
                           str(failing / "ckpt")]), 180)
    assert result.rc == 0, result.out
    assert "rank 1 fails at step 13 on purpose" in result.out
    assert "restart 1 of 2" in result.out and "restart 2" not in result.out
    started = [json.loads((failing / f"rank{r}.json").read_text())["started"] for r in range(3)]
    assert started == [13, 13, 13]
    for got, want in zip(final_params(failing, 3), final_params(plain, 3)):
        np.testing.assert_array_equal(got, want)


def test_gives_up_after_max_restarts() -> None:
    result = run(launcher(["-np", "2", "--max-restarts", "1", "python", "-c",
                           "import sys; sys.exit(3)"]), 120)
    assert result.rc != 0
    assert "restart 1 of 1" in result.out and "after 1 restarts; giving up" in result.out


def test_module_entry_point_prints_the_command() -> None:
    result = run(launcher(["--dry-run", "-np", "2", "train.py"]), 60)
    assert result.rc == 0, result.out
    cmd = shlex.split(result.out.strip().splitlines()[-1])
    assert cmd[0] == str(Path(sys.executable).parent / "mpiexec")
    assert cmd[-2:] == [sys.executable, "train.py"]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition`` every 50 ms for up to ``seconds``; whether it came true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def kill_all(pids: list[int]) -> None:
    """SIGKILL whichever of ``pids`` still run (a failed test leaves nothing behind)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def stop_with(signum: int, out: Path, extra: list[str]) -> tuple[Result, list[int], list[int]]:
    """Start ``mpitrain-run -np 2 sleeper.py``, send it ``signum`` once every rank is up,
    and give it 30 s to exit and its processes 5 s more to end.

    Returns how the launcher ended (rc -1: it did not), the pids of the ranks and of
    mpiexec, and those of them still running then, which are killed before it returns.
    """
    proc = start(launcher(["-np", "2", *extra, str(JOBS / "sleeper.py"), str(out)]))
    pids: list[int] = []
    try:
        up = wait_for(lambda: len(list(out.glob("attempt0.rank*.pid"))) == 2
                      or proc.poll() is not None, 90)
        assert up and proc.poll() is None, "the job did not start"
        mpiexec = children(proc.pid)
        assert len(mpiexec) == 1, mpiexec
        pids = [int(f.read_text()) for f in sorted(out.glob("attempt0.rank*.pid"))] + mpiexec
        assert all(alive(pid) for pid in pids)
        signalled = time.monotonic()
        os.kill(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        seconds = time.monotonic() - signalled
        wait_for(lambda: not any(alive(pid) for pid in pids), 5)
        left = [pid for pid in pids if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pids)  # the output pipe closes only when every process holding it has ended
    out_text = finish(proc, 30).out
    return Result(proc.returncode if proc.returncode is not None else -1, out_text,
                  seconds), pids, left


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_the_launcher_ends_every_process(signum: int, tmp_path: Path) -> None:
    result, pids, left = stop_with(signum, tmp_path, [])
    assert not left, f"still running after {signal.Signals(signum).name}: {left}"
    assert result.rc == 128 + signum, result.out
    assert f"{signal.Signals(signum).name} received: the job was stopped" in result.out
    assert result.seconds < 10, result.seconds
    assert len(set(pids)) == 3


def test_no_restart_after_a_signal(tmp_path: Path) -> None:
    result, _, left = stop_with(signal.SIGTERM, tmp_path, ["--max-restarts", "3"])
    assert not left and result.rc == 128 + signal.SIGTERM, result.out
    assert "and is not restarted" in result.out and "restart 1" not in result.out
    time.sleep(1)
    assert sorted(f.name for f in tmp_path.glob("*.pid")) == ["attempt0.rank0.pid",
                                                              "attempt0.rank1.pid"]


def test_a_job_that_outlives_its_timeout_is_killed_with_every_rank(tmp_path: Path) -> None:
    """The harness's own timeout (jobrun.finish) ends mpiexec's session and the ranks too."""
    proc = start(launcher(["-np", "2", str(JOBS / "sleeper.py"), str(tmp_path)]))
    assert wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2 or proc.poll() is not None,
                    90)
    ranks = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    below = children(proc.pid)
    result = finish(proc, 1)
    try:
        assert result.rc == -1 and "[killed after 1 s]" in result.out
        assert wait_for(lambda: not any(alive(pid) for pid in ranks + below), 5)
    finally:
        kill_all(ranks + below)


STUBBORN_MPIEXEC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "mpiexec (Open MPI) 5.0.11"; exit 0; fi
trap '' TERM INT HUP
sleep 300 &
echo $$ $! > "$PIDS.tmp" && mv "$PIDS.tmp" "$PIDS"
wait
"""
"""An mpiexec that ignores the signals passed on to it, with a child that does too."""


@pytest.mark.parametrize("second", [None, signal.SIGINT], ids=["timer", "second-signal"])
def test_an_mpiexec_that_ignores_the_signal_is_killed(second: int | None,
                                                      tmp_path: Path) -> None:
    fake, pids_file = tmp_path / "mpiexec", tmp_path / "pids"
    fake.write_text(STUBBORN_MPIEXEC)
    fake.chmod(0o755)
    proc = start(launcher(["-np", "2", "true"]), MPITRAIN_MPIEXEC=str(fake),
                 PIDS=str(pids_file))
    pids: list[int] = []
    try:
        assert wait_for(pids_file.exists, 60), "the fake mpiexec did not start"
        pids = [int(p) for p in pids_file.read_text().split()]
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        if second is not None:
            time.sleep(0.5)
            os.kill(proc.pid, second)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        seconds = time.monotonic() - signalled
        assert wait_for(lambda: not any(alive(pid) for pid in pids), 5), pids
        assert proc.returncode == 128 + signal.SIGTERM
        if second is None:  # killed by the timer
            assert launcher_module.KILL_AFTER_S - 1 < seconds < launcher_module.KILL_AFTER_S + 5
        else:
            assert seconds < 5
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pids)
        finish(proc, 30)


def rank_lines(out: str, word: str) -> list[list[str]]:
    """The words after ``word`` of each output line that starts with it, sorted."""
    return sorted(line.split(" ", 1)[1:] for line in out.splitlines()
                  if line.startswith(word + " "))


def test_ranks_see_torchrun_variables_at_import(tmp_path: Path) -> None:
    has_torch = importlib.util.find_spec("torch") is not None
    script = run(launcher(["-np", "2", str(JOBS / "torch_env.py"),
                           *(["--torch"] if has_torch else [])]), 180)
    module = run(launcher(["-np", "2", "-x", f"PYTHONPATH={ROOT}{os.pathsep}{JOBS}",
                           "-m", "torch_env"]), 120)
    for result in (script, module):
        assert result.rc == 0, result.out
        seen = [json.loads(words[0]) for words in rank_lines(result.out, "env")]
        assert len(seen) == 2, result.out
        assert sorted(s["RANK"] for s in seen) == ["0", "1"]
        for s in seen:
            assert s["RANK"] == s["LOCAL_RANK"]
            assert s["WORLD_SIZE"] == s["LOCAL_WORLD_SIZE"] == "2"
            assert s["MASTER_ADDR"] == "127.0.0.1" and 0 < int(s["MASTER_PORT"]) < 65536
            assert (s["MASTER_ADDR"], s["MASTER_PORT"]) == \
                (seen[0]["MASTER_ADDR"], seen[0]["MASTER_PORT"])
    if has_torch:
        assert rank_lines(script.out, "torch") == [["0 2 1"], ["1 2 1"]], script.out


def test_module_runs_on_every_rank_quietly() -> None:
    result = run(launcher(["-np", "2", "-m", "benchmarks", "allreduce", "-b", "8", "-e", "64",
                           "-f", "8", "-n", "2", "-w", "1", "--impl", "mpitrain,mpi"]), 180)
    assert result.rc == 0, result.out
    assert "# Out of bounds values : 0 OK" in result.out
    assert "OSC UCX" not in result.out  # osc ^ucx: no error line per rank for each window


def test_python_and_scripts_run_under_the_launchers_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "which.py"
    script.write_text("import sys; print('python', sys.executable)\n")
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {"PATH": f"{bare}{os.pathsep}/usr/bin{os.pathsep}/bin"}  # no venv on PATH
    for command in (["python", str(script)], [str(script)]):
        result = run(launcher(["-np", "2", *command]), 120, **env)
        assert result.rc == 0, result.out
        assert rank_lines(result.out, "python") == [[sys.executable]] * 2, result.out


def test_version_without_mpi() -> None:
    done = subprocess.run(launcher(["--version"]), capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert done.returncode == 0 and done.stdout.startswith("mpitrain "), done.stderr
