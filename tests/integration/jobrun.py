"""Starting whole MPI jobs from a test: ``mpirun`` (or ``mpitrain-run``) with a hard timeout."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
_BESIDE = Path(sys.executable).parent / "mpirun"
MPIRUN = str(_BESIDE) if _BESIDE.exists() else shutil.which("mpirun") or "mpirun"
# osc ^ucx: without UCX devices that component may print an error line when a window is
# made (the Makefile's MPIFLAGS say the same); the tests read the jobs' output.
FLAGS = ["--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
         "--mca", "threads_pthreads_yield_strategy", "nanosleep", "--mca", "osc", "^ucx"]


@dataclass
class Result:
    """How a job ended: exit code (-1: killed at the timeout), output, seconds."""

    rc: int
    out: str
    seconds: float


def environment(**env: str) -> dict[str, str]:
    """This process's environment for a job: the worktree's mpitrain, root allowed, no
    ``MPITRAIN_*`` of this process, and no ``COLUMNS`` or ``LINES``, which pytest-xdist
    sets in its workers (a job's output would then be taken for a terminal's;
    ``mpitrain-run`` sets ``COLUMNS`` itself on a terminal)."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("MPITRAIN_") and k not in ("COLUMNS", "LINES")}
    full.update(PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **env)
    return full


def mpirun(np_: int, args: list[str], **env: str) -> list[str]:
    """The ``mpirun`` command running ``python args...`` on ``np_`` ranks."""
    exports = [a for k in ("PYTHONPATH", *env) for a in ("-x", k)]
    return [MPIRUN, *FLAGS, *exports, "-np", str(np_), sys.executable, *args]


def launcher(args: list[str]) -> list[str]:
    """The ``mpitrain-run`` command with ``args``."""
    return [sys.executable, "-m", "mpitrain.run", *args]


def _as_from_a_terminal() -> None:
    """SIGINT, SIGTERM and SIGHUP at their defaults, as in a job started from a terminal:
    a test runner started in the background of a shell has SIGINT ignored, which the job
    would inherit (and keep ignored, as ``mpitrain-run`` keeps a ``nohup``)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def start(cmd: list[str], **env: str) -> subprocess.Popen[str]:
    """Start ``cmd`` in a session of its own (so a timeout can kill every rank), with the
    signals' dispositions of a terminal's job."""
    return subprocess.Popen(cmd, env=environment(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from ``/proc``."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parent_of.items() if parent in frontier]
        found += below
        frontier = below
    return found


def finish(proc: subprocess.Popen[str], timeout: float, started: float | None = None) -> Result:
    """Wait for ``proc``; kill it and every process below it if it outlives ``timeout``.

    Not only its session: ``mpitrain-run`` starts ``mpiexec`` in a session of its own, and
    Open MPI's ranks are in process groups of their own.
    """
    started = time.monotonic() if started is None else started
    try:
        out, _ = proc.communicate(timeout=max(0.0, timeout - (time.monotonic() - started)))
        return Result(proc.returncode, out, time.monotonic() - started)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something else still holds the output pipe
            proc.kill()
            out = "[output lost]"
        return Result(-1, out + f"\n[killed after {timeout:.0f} s]",
                      time.monotonic() - started)


NOT_STARTED = "The PMIx server's listener thread failed to start"
"""What Open MPI's launcher prints when it fails before starting any rank (seen now and
then when many jobs start in quick succession): the job never ran, so it is run again."""


def run(cmd: list[str], timeout: float, **env: str) -> Result:
    """Run ``cmd`` to completion (or to ``timeout``); once more if MPI's launcher failed
    before starting any rank (:data:`NOT_STARTED`)."""
    started = time.monotonic()
    result = finish(start(cmd, **env), timeout, started)
    if NOT_STARTED in result.out:
        result = finish(start(cmd, **env), timeout, time.monotonic())
    return result
