"""The step runner of the GPU scripts (``benchmarks/gpu_steps.sh``): a step's output in its
log, its failure, hang or skip counted in ``status``, the step limit and the script's
deadline kept. The scripts run on GPU machines only; this runs their shared part here,
with a stand-in ``nvidia-smi`` on the PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_steps(tmp_path: Path, body: str, **env: str) -> tuple[str, Path]:
    """Source gpu_steps.sh from the checkout's root, run ``body``, print ``status``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'index, name'\necho '0, Stand-in GPU'\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    script = f". benchmarks/gpu_steps.sh\n{body}\necho \"status=$status\"\n"
    environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": "python3",
               "MPIRUN": "mpirun", "OUT": str(out), **env}
    result = subprocess.run(["sh", "-c", script], cwd=ROOT, env=environ, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout, out


def test_a_passing_step_keeps_its_output_and_the_device_line(tmp_path: Path) -> None:
    text, out = run_steps(tmp_path, "step hello echo 'hello from the step'")
    assert "Stand-in GPU" in (out / "device.txt").read_text()
    assert (out / "hello.log").read_text() == "hello from the step\n"
    assert "-- hello: passed" in text and text.rstrip().endswith("status=0")


def test_a_failing_step_is_reported_and_the_next_one_runs(tmp_path: Path) -> None:
    text, _ = run_steps(tmp_path, "step bad sh -c 'exit 3'\nstep good true")
    assert "-- bad: FAILED (rc=3)" in text
    assert "-- good: passed" in text
    assert text.rstrip().endswith("status=1")


def test_a_step_past_its_limit_is_killed_and_counted_as_hung(tmp_path: Path) -> None:
    text, _ = run_steps(tmp_path, "step slow sleep 30", STEP_S="1")
    assert "-- slow: HUNG, killed after 1 s" in text
    assert text.rstrip().endswith("status=1")


@pytest.mark.parametrize("deadline, ran", [("0", True), ("21", False)])
def test_the_deadline_skips_a_step_that_would_start_too_late(tmp_path: Path, deadline: str,
                                                             ran: bool) -> None:
    """With 2 s of a 21 s deadline spent, less than the 20 s a step needs is left: the
    next step is skipped and counted; with no deadline (0) it runs."""
    text, out = run_steps(tmp_path, "step first sleep 2\nstep second echo ran",
                          DEADLINE=deadline)
    assert ("-- second: passed" in text) is ran
    assert ("== second: SKIPPED" in text) is not ran
    assert (out / "second.log").exists() is ran
    assert text.rstrip().endswith("status=0" if ran else "status=1")


def test_a_step_is_limited_to_what_is_left_of_the_deadline(tmp_path: Path) -> None:
    """A step that starts with 25 s of the deadline left gets 25 s, not its 900."""
    text, _ = run_steps(tmp_path, "step only true", DEADLINE="25")
    assert "== only (limit 25 s)" in text or "== only (limit 24 s)" in text


def test_steps_picks_steps_by_name_patterns_and_leaves_the_rest(tmp_path: Path) -> None:
    """``STEPS`` runs the steps whose names match one of its patterns (matched against
    names, not against the checkout's files, where ``bench*`` names ``benchmarks``);
    the others are reported as not selected, which is no failure."""
    body = "step bench-a echo A\nstep train-cuda-np2 false\nstep torch-np2 echo T"
    text, out = run_steps(tmp_path, body, STEPS="bench* torch-np2")
    assert "-- bench-a: passed" in text and "-- torch-np2: passed" in text
    assert "== train-cuda-np2: not selected" in text
    assert not (out / "train-cuda-np2.log").exists()
    assert text.rstrip().endswith("status=0")
