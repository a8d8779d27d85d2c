"""tools/timelimit.py, which the Makefile's long targets run under: Ctrl-C (SIGINT to
the wrapper, or to its whole process group as a terminal sends it) and the time limit
stop the command and everything it started, even processes in sessions of their own and
processes that ignore SIGINT, within a few seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "timelimit.py"
sys.path.insert(0, str(TOOL.parent))
import timelimit  # noqa: E402

# a long target's shape: a background child (which a non-interactive sh starts with
# SIGINT ignored), a child in a session of its own (as mpitrain-run starts mpiexec, and
# the integration tests their jobs), and a foreground child
LONG = "sleep 300 & setsid sleep 301 & sleep 302"


def _start(command: str, limit: float = 300) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(TOOL), str(limit), "sh", "-c", command],
                            start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while len(timelimit.descendants(proc.pid)) < 4:  # sh and the three sleeps
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    return proc


def _sleeps() -> set[int]:
    """Processes of this test's sleeps (by their distinctive arguments)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if argv[:1] == [b"sleep"] and argv[1:2] in ([b"300"], [b"301"], [b"302"]) \
                    and state != "Z":
                found.add(int(entry.name))
    return found


def _stopped_within(proc: subprocess.Popen[bytes], before: set[int], seconds: float) -> int:
    try:
        rc = proc.wait(seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _sleeps() & before
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the wrapper exited: {sorted(left)}"
    return rc


@pytest.mark.parametrize("to_group", [False, True], ids=["wrapper", "process-group"])
def test_ctrl_c_stops_everything_at_once(to_group: bool) -> None:
    proc = _start(LONG)
    before = set(timelimit.descendants(proc.pid))
    started = time.monotonic()
    if to_group:  # what a terminal's Ctrl-C does
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    rc = _stopped_within(proc, before, timelimit.GRACE_S + 10)
    assert rc == 128 + signal.SIGINT
    assert time.monotonic() - started < timelimit.GRACE_S + 5


def test_the_time_limit_stops_everything() -> None:
    proc = _start(LONG, limit=2)
    before = set(timelimit.descendants(proc.pid))
    rc = _stopped_within(proc, before, 2 + timelimit.GRACE_S + 10)
    assert rc == timelimit.TIMED_OUT
    assert b"ran past 2 s" in proc.stderr.read()  # type: ignore[union-attr]


def test_the_commands_exit_code_passes_through() -> None:
    done = subprocess.run([sys.executable, str(TOOL), "60", "sh", "-c", "exit 3"], timeout=60)
    assert done.returncode == 3


def test_every_long_target_of_the_makefile_runs_under_it() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert not re.search(r"(^\t|:= ).*\btimeout\s+\d", makefile, re.M), \
        "a Makefile target runs under coreutils' timeout, which a Ctrl-C does not stop"
    assert "LIMIT    := $(PY) tools/timelimit.py" in makefile
    for target in ("integration", "faults", "soak"):
        recipe = makefile.split(f"\n{target}: ", 1)[1].split("\n\n", 1)[0]
        assert "$(LIMIT) " in recipe, f"make {target} does not run under tools/timelimit.py"
    assert "RUN      := $(LIMIT) 900 $(MPIRUN)" in makefile
