"""A plain ``python script.py`` (one rank, no mpiexec) that dies of an exception prints
mpitrain's message and the traceback and exits with status 1, without Open MPI's
"Sorry! You were supposed to get help about: mpi-abort" (what ``Abort`` prints outside
its launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MAIN = "import mpitrain as mt\nmt.init()\nraise ValueError('boom')\n"
THREAD = ("import threading, time\nimport mpitrain as mt\nmt.init()\n"
          "def f():\n    raise ValueError('boom')\n"
          "threading.Thread(target=f).start()\ntime.sleep(30)\nprint('not ended')\n")


@pytest.mark.parametrize("script", [MAIN, THREAD], ids=["main-thread", "other-thread"])
def test_a_lone_rank_that_raises_exits_cleanly(script: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MPITRAIN_", "OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=str(ROOT), MPITRAIN_FALLBACK_NOTICE="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=60, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert "Sorry" not in done.stderr and "mpi-abort" not in done.stderr, done.stderr
    assert "[rank 0] mpitrain: rank 0 of 1" in done.stderr
    assert "exiting (no other rank to stop)" in done.stderr
    assert "[rank 0] ValueError: boom" in done.stderr
    assert "not ended" not in done.stdout
