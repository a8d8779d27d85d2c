"""What every rank of ``mpitrain-run`` runs first (mpitrain/run_rank.py): torchrun's
variables from the MPI's, then the command, in the same process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpitrain import run_rank

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = [sys.executable, "-I", str(ROOT / "mpitrain" / "run_rank.py")]

OPEN_MPI_RANK = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                 "PMIX_RANK": "3"}
TORCH_RANK = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_torchrun_variables_from_each_mpi() -> None:
    assert run_rank.torch_variables(OPEN_MPI_RANK) == TORCH_RANK
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert run_rank.torch_variables(hydra) == TORCH_RANK
    assert run_rank.torch_variables({"PMIX_RANK": "5"}) == {"RANK": "5"}
    assert run_rank.torch_variables({**hydra, **OPEN_MPI_RANK, "PMI_RANK": "9"}) == TORCH_RANK
    assert run_rank.torch_variables({"OMPI_COMM_WORLD_RANK": ""}) == {}


def test_rank_wrapper_sets_the_variables_and_runs_the_command_in_its_process() -> None:
    show = ("import os; print(os.getpid(), *(os.environ.get(k) for k in "
            "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'KEPT')))")
    env = {**os.environ, **OPEN_MPI_RANK, "RANK": "stale", "KEPT": "yes"}
    for wrapper in (WRAPPER, [sys.executable, "-m", "mpitrain.run_rank"]):
        proc = subprocess.Popen([*wrapper, sys.executable, "-c", show], stdout=subprocess.PIPE,
                                text=True, env={**env, "PYTHONPATH": str(ROOT)})
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert out.split() == [str(proc.pid), "3", "4", "1", "2", "yes"]
    done = subprocess.run([*WRAPPER, "no-such-command-here"], capture_output=True, text=True,
                          timeout=60, env=env, check=False)
    assert done.returncode == 127
    assert "mpitrain-run: rank 3 cannot run 'no-such-command-here'" in done.stderr
    done = subprocess.run(WRAPPER, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "usage" in done.stderr


def test_clean_exits_are_reported_to_the_launcher() -> None:
    """What ``mpitrain-run --elastic`` counts: each report is acknowledged before the rank
    exits; a host name that does not resolve falls back to this host's loopback; no
    address, no report."""
    from mpitrain.launcher import CleanExits

    exits = CleanExits()
    try:
        port = exits.address.rpartition(":")[2]
        run_rank.report_clean_exit({run_rank.REPORT: exits.address})
        run_rank.report_clean_exit({run_rank.REPORT: f"no-such-host.invalid:{port}"})
        run_rank.report_clean_exit({})
        assert exits.take() == 2
        assert exits.take() == 0
    finally:
        exits.close()


def test_the_launcher_and_the_rank_wrapper_name_the_same_report_variable() -> None:
    from mpitrain import launcher

    assert launcher.REPORT == run_rank.REPORT == "MPITRAIN_ELASTIC_REPORT"
