"""mpitrain-run on real jobs: --max-restarts, giving up, ``python -m mpitrain.run``."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
from jobrun import JOBS, launcher, run


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
