"""The benchmark header's command reproduces the run: pasted into a shell (as root here,
no UCX devices), it runs, and the run it starts prints the same command."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from jobrun import MPIRUN, launcher, run

BENCH = ["python", "-m", "benchmarks", "allreduce", "-b", "8", "-e", "64", "-n", "2", "-w",
         "1", "--impl", "mpitrain,mpi"]


def _header_command(out: str) -> str:
    found = re.search(r"^# command\s*: (.*)$", out, re.M)
    assert found, out
    return found[1].strip()


@pytest.mark.parametrize("how", ["mpitrain-run", "pinned-mpirun"])
def test_the_printed_command_runs_and_prints_itself(how: str) -> None:
    if how == "mpitrain-run":
        first = run(launcher(["-np", "2", *BENCH]), 180, MPITRAIN_FALLBACK_NOTICE="0")
    else:  # plain mpirun: ranks pinned to cores, busy-polling (the headline's setup)
        first = run([MPIRUN, "--allow-run-as-root", "--mca", "osc", "^ucx", "-np", "2",
                     sys.executable, *BENCH[1:]], 180, MPITRAIN_FALLBACK_NOTICE="0")
    assert first.rc == 0, first.out
    command = _header_command(first.out)
    assert command.startswith("MPITRAIN_FALLBACK_NOTICE=0 ")
    # the pasted command, with this environment's python, mpirun and mpitrain-run first
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # as root without Open MPI's root variables: the command itself must allow it
    again = run(["env", "-u", "OMPI_ALLOW_RUN_AS_ROOT", "-u", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                 "sh", "-c", command], 180, PATH=path)
    assert again.rc == 0, f"{command!r} failed:\n{again.out}"
    assert _header_command(again.out) == command
    assert "OSC UCX" not in again.out
