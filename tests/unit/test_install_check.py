"""``python -m mpitrain``: the install check's report says what this process runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpitrain
from mpitrain import check, launcher
from mpitrain.algorithms import ALGORITHMS
from mpitrain.backends import hostcopy
from mpitrain.engine import compiled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    """The report of ``python -m mpitrain``, as ``{name: value}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPITRAIN_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "mpitrain"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = {}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(":")
        lines[name.strip()] = value.strip()
    return lines


def test_the_report_names_version_build_and_mpi(printed: dict[str, str]) -> None:
    assert printed["mpitrain"].startswith(f"{mpitrain.__version__} (")
    assert printed["engine core compiled"] == ("yes" if compiled() else "no")
    assert printed["host copies compiled"] == ("yes" if hostcopy.compiled() else "no")
    assert ("why not" in printed) == (not (compiled() and hostcopy.compiled()))
    from mpi4py import MPI

    assert printed["MPI library"] == MPI.Get_library_version().strip().splitlines()[0].strip()
    assert printed["mpiexec"] == launcher.find_mpiexec()
    assert printed["CUDA-aware MPI"].split()[0] in ("yes", "no")
    for name in ("CuPy", "NCCL", "torch", "mpi4py"):
        assert printed[name], f"the report says nothing about {name}"


def test_the_nccl_line_says_whether_mpitrain_can_use_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy's NCCL is the one mpitrain runs on (a stand-in ``cupy.cuda.nccl`` here);
    without it the line says what device collectives run over instead."""
    import types

    fake = types.ModuleType("cupy.cuda.nccl")
    fake.get_version = lambda: 22304  # type: ignore[attr-defined]
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = fake  # type: ignore[attr-defined]
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", fake)):
        monkeypatch.setitem(sys.modules, name, module)
    line = check._nccl(None, "14.2.0")
    assert line.startswith("CuPy's 22304 (") and "runs device collectives on" in line
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", None)  # CuPy without NCCL
    del cuda.nccl  # type: ignore[attr-defined]
    line = check._nccl(None, "14.2.0")
    assert line.startswith("not found (") and "CUDA IPC and MPI" in line


def test_the_report_lists_every_algorithm(printed: dict[str, str]) -> None:
    for collective, names in ALGORITHMS.items():
        listed = [n.split(" (")[0] for n in printed[collective].split(", ")]
        assert listed == list(names)


def test_under_mpiexec_reads_the_launchers_variables() -> None:
    assert check.under_mpiexec({"OMPI_COMM_WORLD_SIZE": "2"})
    assert check.under_mpiexec({"PMI_SIZE": "2"})
    assert not check.under_mpiexec({"PATH": "/bin"})


def test_mpitrain_run_accepts_check_build_without_a_command() -> None:
    job, args = launcher.parse(["--check-build"])
    assert args.check_build and job.np == 0
    with pytest.raises(SystemExit):
        launcher.parse(["python", "x.py"])  # -np is still required to run a job
