"""Async engine across whole jobs: exit without shutdown, timeline of a killed job.

Each test starts its own ``mpirun`` with a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from mpirun import finish, run, start


def job(tmp_path: Path, script: str) -> list[str]:
    """The command that runs ``script`` (written to ``tmp_path``) with this Python."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    return [sys.executable, str(path)]


def launch(tmp_path: Path, np_: int, script: str, **env: str) -> subprocess.Popen[str]:
    return start(np_, job(tmp_path, script), **env)


def test_exit_without_shutdown_does_not_hang(tmp_path: Path) -> None:
    """Ops in flight at exit (one only rank 0 submitted) are settled by the atexit stop."""
    code, out = run(3, job(tmp_path, """
        import numpy as np
        import mpitrain as mt
        comm = mt.init()
        hs = [comm.allreduce_async(np.ones(1000), name=f"t{i}") for i in range(10)]
        assert hs[0].wait()[0] == comm.size
        if comm.rank == 0:
            orphan = comm.allreduce_async(np.ones(3), name="only-rank-0")
        print("rank", comm.rank, "leaving", flush=True)
    """), 120)
    assert code == 0, out
    assert out.count("leaving") == 3


def test_timeline_of_a_killed_job_parses(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    proc = launch(tmp_path, 2, """
        import os
        import numpy as np
        import mpitrain as mt
        comm = mt.init()
        step = 0
        while True:
            hs = [comm.allreduce_async(np.ones(500), name=f"grad/{j}") for j in range(6)]
            hs.append(comm.grouped_allreduce_async([np.ones(9), np.ones(3)], name="group"))
            hs.append(comm.allgather_async(np.ones(2), name="gather"))
            for h in hs:
                h.wait()
            step += 1
            if step == 20 and comm.rank == 0:
                print("PID", os.getpid(), flush=True)
    """, MPITRAIN_TIMELINE=str(timeline))
    pid = None
    deadline = time.time() + 120
    assert proc.stdout is not None
    while pid is None and time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("PID"):
            pid = int(line.split()[1])
    if pid is None:
        _, out = finish(proc, 1)
        raise AssertionError(f"the job never got going:\n{out}")
    time.sleep(0.3)  # keep it writing for a while, then kill rank 0 mid-flight
    os.kill(pid, signal.SIGKILL)
    finish(proc, 60)
    with open(timeline, encoding="utf-8") as f:
        events: list[dict[str, Any]] = json.load(f)
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) >= 20 * 8 * 2, f"only {len(spans)} spans"
    assert {"QUEUE", "PACK", "UNPACK"} <= {e["name"] for e in spans}
