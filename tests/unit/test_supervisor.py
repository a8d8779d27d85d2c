"""The supervisor that every rank of ``mpitrain-run --elastic`` runs (run_rank.py): an
early exit of the command becomes a death by signal of the rank process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitrain import config, run_rank
from mpitrain.comm import exitguard

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = [sys.executable, "-I", str(ROOT / "mpitrain" / "run_rank.py")]
ELASTIC = {**os.environ, "MPITRAIN_ELASTIC": "1", "OMPI_COMM_WORLD_RANK": "2"}
MARK = "import os; os.write(int(os.environ['MPITRAIN_SUPERVISOR_FD']), {!r}); "


def test_the_protocol_is_the_same_on_both_sides() -> None:
    assert config.SUPERVISOR_FD.name == run_rank.SUPERVISOR_FD
    assert (exitguard.INITIALISED, exitguard.CLEAN_EXIT) == (run_rank.INITIALISED,
                                                             run_rank.CLEAN_EXIT)


@pytest.mark.parametrize(("code", "want"), [
    ("import sys; sys.exit(5)", 5),                         # never initialised: its status
    (MARK.format(b"I") + "os._exit(0)", -signal.SIGKILL),   # initialised, left early
    (MARK.format(b"I") + "os._exit(4)", -signal.SIGKILL),
    (MARK.format(b"IC") + "import sys; sys.exit(3)", 3),    # every rank reached its exit
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGKILL),
])
def test_supervisor_exit_status(code: str, want: int) -> None:
    done = subprocess.run([*WRAPPER, sys.executable, "-c", code], env=ELASTIC,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == want, done.stderr
    if want == -signal.SIGKILL:
        assert "mpitrain-run: rank 2 (pid" in done.stderr
        assert "so that the other ranks recover without it" in done.stderr


def test_without_elastic_the_command_replaces_the_wrapper() -> None:
    env = {**ELASTIC, "MPITRAIN_ELASTIC": "0"}
    proc = subprocess.Popen([*WRAPPER, sys.executable, "-c", "import os; print(os.getpid())"],
                            env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert out.split() == [str(proc.pid)]


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_signals_reach_the_command_and_it_dies_with_its_supervisor(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(60)")
    for how in (signal.SIGTERM, signal.SIGKILL):
        pid_file.unlink(missing_ok=True)
        proc = subprocess.Popen([*WRAPPER, sys.executable, "-c", code], env=ELASTIC,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        try:
            while not (pid_file.exists() and pid_file.read_text()):
                assert proc.poll() is None, "the supervisor ended before its command started"
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.05)
            child = int(pid_file.read_text())
            assert child != proc.pid
            proc.send_signal(how)  # SIGTERM is passed on; SIGKILL kills the child with it
            assert proc.wait(timeout=30) == -signal.SIGKILL
            assert _wait_gone(child, 30), f"the command outlived its supervisor ({how!r})"
        finally:
            proc.kill()
            proc.communicate(timeout=30)
