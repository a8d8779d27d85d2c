"""Ctrl-C on a long target: the MPI suite's shape (``tools/timelimit.py`` running
``mpirun`` with ranks that would run for minutes) stops at once and fully."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobrun import FLAGS, MPIRUN, ROOT, descendants, environment

TOOL = ROOT / "tools" / "timelimit.py"
GRACE_S = 5.0  # tools/timelimit.py's GRACE_S


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_ctrl_c_stops_mpirun_and_every_rank() -> None:
    ranks = [MPIRUN, *FLAGS, "-np", "2", sys.executable, "-c",
             "import time, mpitrain as mt; mt.init(); print('up', flush=True); "
             "time.sleep(600)"]
    proc = subprocess.Popen([sys.executable, str(TOOL), "900", *ranks],
                            env=environment(MPITRAIN_FALLBACK_NOTICE="0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines == [b"up", b"up"], lines
        below = descendants(proc.pid)
        assert len(below) >= 3, below  # mpirun and two ranks at least
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        rc = proc.wait(GRACE_S + 20)
        took = time.monotonic() - started
        alive = [p for p in below if _running(p)]
        assert not alive, f"left running after Ctrl-C: {alive}"
        assert rc == 128 + signal.SIGINT and took < GRACE_S + 5, (rc, took)
    finally:
        if proc.poll() is None:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
