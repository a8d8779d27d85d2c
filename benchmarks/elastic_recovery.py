"""How long the survivors of ``mpitrain-run --elastic`` take to go on after a rank exits.

Runs the elastic training job of the integration tests (``tests/integration/jobs/
train.py``) ``--trials`` times; in each, rank 2 leaves at step 10: ``--how os_exit``
calls ``os._exit(1)`` (no Python hook runs: its supervisor turns the exit into a death
by signal), ``--how return`` returns from the script (the exit guard sees the others
wait for it and kills its rank). The job
writes the time of the exit, and each survivor the time at which it completed its
first step after the recovery; a trial's figure is the time from the exit to the
last survivor's step (and to the first one's). With several ``--how``, the trials
alternate between them (A B A B ...). Prints every trial and the medians.

    python benchmarks/elastic_recovery.py --trials 7 -np 4 --how os_exit return
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "integration" / "jobs" / "train.py"
VICTIM, STEP = 2, 10
TIMEOUT_S = 300


HOW = {"os_exit": ["--os-exit-at", str(VICTIM), str(STEP), "1"],
       "return": ["--return-at", str(VICTIM), str(STEP)]}


def trial(np_: int, how: str, out: Path) -> tuple[float, float]:
    """One job: seconds from the exit to the first and to the last survivor's step."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "mpitrain.run", "-np", str(np_), "--elastic", str(JOB),
           str(out), *HOW[how]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"the job failed (exit code {done.returncode}):\n{done.stdout}"
                         f"{done.stderr}")
    exited = float((out / "exited").read_text())
    stepped = [float((out / f"recovered{r}").read_text().split()[0])
               for r in range(np_) if r != VICTIM]
    return min(stepped) - exited, max(stepped) - exited


def main() -> None:
    """Run the trials and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("-np", dest="np", type=int, default=4, help="ranks (at least 3)")
    p.add_argument("--how", choices=sorted(HOW), nargs="+", default=["os_exit"],
                   help="how rank 2 leaves (several: interleaved)")
    args = p.parse_args()
    if args.np < VICTIM + 1 or args.trials < 1:
        p.error(f"-np must be >= {VICTIM + 1} and --trials >= 1")
    firsts: dict[str, list[float]] = {how: [] for how in args.how}
    lasts: dict[str, list[float]] = {how: [] for how in args.how}
    print("| trial | how | exit -> first survivor's step (ms) | exit -> last survivor's "
          "step (ms) |")
    print("|---|---|---|---|")
    for i in range(args.trials):
        for how in args.how:
            with tempfile.TemporaryDirectory() as out:
                first, last = trial(args.np, how, Path(out))
            firsts[how].append(first)
            lasts[how].append(last)
            print(f"| {i + 1} | {how} | {first * 1e3:.0f} | {last * 1e3:.0f} |", flush=True)
    for how in args.how:
        print(f"| median | {how} | {statistics.median(firsts[how]) * 1e3:.0f} | "
              f"{statistics.median(lasts[how]) * 1e3:.0f} |")

if __name__ == "__main__":
    main()
