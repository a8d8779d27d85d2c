"""Run a command with a time limit; on Ctrl-C (or the limit) stop it and everything it
started, at once.

    python tools/timelimit.py SECONDS COMMAND [ARG...]

The Makefile's long targets (the MPI suite, ``integration``, ``faults``, ``soak``,
``bench``) run under it instead of coreutils' ``timeout``, which moves its command out of
the terminal's foreground process group: a Ctrl-C then stopped ``make`` but left
``mpirun`` and every rank running.

This wrapper stays in the terminal's process group (Ctrl-C reaches it and its command as
before) and makes itself the *child subreaper* of everything below it (Linux), so that
processes which leave the command's process group or session (an ``mpirun`` started with
a session of its own, its ranks, the orphans of a killed parent) still count as its
descendants. When SIGINT, SIGTERM or SIGHUP arrives, or the command outlives ``SECONDS``
(then SIGTERM), every descendant gets that signal; those still running
:data:`GRACE_S` later are killed with SIGKILL. A command that ends by itself has its
leftover descendants stopped the same way. The exit code is the command's; 128 + N when
signal N stopped it; 124 when the time limit did (as ``timeout``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0
"""How long the descendants have to end after the signal before SIGKILL."""
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_CHILD_SUBREAPER = 36
TIMED_OUT = 124


def become_subreaper() -> None:
    """Make orphaned descendants this process's children (Linux ``prctl``); elsewhere a
    no-op (descendants that leave the tree are then not stopped)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from ``/proc``), zombies excluded."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            parent_of[int(entry.name)] = int(stat[1])
    found: list[int] = []
    frontier = {pid}
    while frontier:
        below = {p for p, parent in parent_of.items() if parent in frontier}
        found += sorted(below)
        frontier = below
    return found


def reap() -> dict[int, int]:
    """Collect every child that has ended; ``{pid: exit code}`` (128 + N for signal N)."""
    ended = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended[pid] = os.waitstatus_to_exitcode(status)


def stop_all(signum: int) -> None:
    """Send ``signum`` to every descendant; SIGKILL those left after :data:`GRACE_S`."""
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    deadline = time.monotonic() + GRACE_S
    while descendants(os.getpid()) and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while descendants(os.getpid()):
        reap()
        time.sleep(0.01)
    reap()


def run(seconds: float, command: list[str]) -> int:
    """Run ``command`` under the limit; its exit code (see the module's doc)."""
    become_subreaper()
    watched = {*STOPPING, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        child = subprocess.Popen(command, preexec_fn=lambda: signal.pthread_sigmask(
            signal.SIG_UNBLOCK, watched))
    except OSError as exc:
        print(f"timelimit: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        got = signal.sigtimedwait(watched, max(left, 0.0)) if left > 0 else None
        if got is None:
            print(f"timelimit: {' '.join(command)} ran past {seconds:g} s; stopping it and "
                  "everything it started", file=sys.stderr, flush=True)
            stop_all(signal.SIGTERM)
            return TIMED_OUT
        if got.si_signo == signal.SIGCHLD:
            ended = reap()
            if child.pid in ended:
                child.returncode = ended[child.pid]
                stop_all(signal.SIGTERM)  # whatever it left running
                rc = ended[child.pid]
                return 128 - rc if rc < 0 else rc
            continue
        stop_all(got.si_signo)
        return 128 + got.si_signo


def main(argv: list[str]) -> int:
    """Entry point: ``timelimit.py SECONDS COMMAND [ARG...]``."""
    if len(argv) < 2:
        print(__doc__.split("\n\n", 2)[1], file=sys.stderr)
        return 2
    try:
        seconds = float(argv[0])
    except ValueError:
        print(f"timelimit: SECONDS must be a number, got {argv[0]!r}", file=sys.stderr)
        return 2
    return run(seconds, argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
