"""mpitrain-run: the mpiexec command lines it builds (``--dry-run``, in this process)."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import sys
from pathlib import Path

import pytest

from mpitrain import launcher

ROOT_FLAGS = ["--allow-run-as-root"] if os.geteuid() == 0 else []
YIELD = ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--mca",
         "threads_pthreads_yield_strategy", "nanosleep"]


def fake_mpiexec(tmp_path: Path, version: str) -> str:
    """An executable that only answers ``--version`` like an MPI's mpiexec."""
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MPITRAIN_* variables; PYTHONPATH set, as under the test suite's jobs."""
    for key in list(os.environ):
        if key.startswith("MPITRAIN_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PYTHONPATH", "/src")
    return monkeypatch


def dry_run(args: list[str], mpiexec: str | None, env: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The command ``mpitrain-run --dry-run args`` prints."""
    if mpiexec is not None:
        env.setenv("MPITRAIN_MPIEXEC", mpiexec)
    assert launcher.main(["--dry-run", *args]) == 0
    return shlex.split(capsys.readouterr().out.strip())


@pytest.fixture
def openmpi(tmp_path: Path) -> str:
    return fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11")


def test_defaults_and_script_under_this_python(openmpi: str, clean_env: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cmd = dry_run(["-np", "2", "-H", "a:1,b:1", "train.py", "--lr", "0.1"], openmpi,
                  clean_env, capsys)
    assert cmd == [openmpi, "-np", "2", *ROOT_FLAGS, "--bind-to", "none", "-H", "a:1,b:1",
                   "-x", "PYTHONPATH", sys.executable, "train.py", "--lr", "0.1"]


def test_oversubscribes_and_yields_when_ranks_outnumber_slots(
        openmpi: str, tmp_path: Path, clean_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def flags(*args: str) -> list[str]:
        return dry_run([*args, "python", "x.py"], openmpi, clean_env, capsys)

    cmd = flags("-np", "5", "-H", "a:2,b:2")
    assert cmd[cmd.index("a:2,b:2") + 1:][:len(YIELD)] == YIELD
    assert "--oversubscribe" not in flags("-np", "4", "-H", "a:2,b:2")
    assert "--oversubscribe" in flags("-np", "3", "-H", "a,b")  # no count: one slot each
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2 slots=4  # big\n\n")
    assert "--oversubscribe" not in flags("-np", "8", "--hostfile", str(hostfile))
    assert "--oversubscribe" in flags("-np", "9", "--hostfile", str(hostfile))
    hostfile.write_text("node1\n")  # slots left to the MPI: never forced
    assert "--oversubscribe" not in flags("-np", "64", "--hostfile", str(hostfile))
    assert "--oversubscribe" in flags("-np", "64", "--hostfile", str(hostfile),
                                      "--oversubscribe")
    local = flags("-np", str(4 * (os.cpu_count() or 1)))
    assert "--oversubscribe" in local and "-H" not in local
    assert "--oversubscribe" not in flags("-np", "1")


def test_exports_elastic_and_extra_arguments(openmpi: str, clean_env: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("MPITRAIN_STALL_WARNING_S", "30")
    cmd = dry_run(["-np", "4", "-H", "a:4", "-x", "OMP_NUM_THREADS=1", "-x", "HOME",
                   "--elastic", "--max-restarts", "2", "--mpi-args=--tag-output -v",
                   "python", "train.py"], openmpi, clean_env, capsys)
    flags = cmd[:cmd.index("python")]
    assert flags[flags.index("--with-ft") + 1] == "ulfm"
    exported = [flags[i + 1] for i, f in enumerate(flags) if f == "-x"]
    assert exported == ["OMP_NUM_THREADS=1", "HOME", "MPITRAIN_RESTART",
                        "MPITRAIN_STALL_WARNING_S", "PYTHONPATH", "MPITRAIN_ELASTIC=1"]
    assert flags[-2:] == ["--tag-output", "-v"]


def test_mpich_flags(tmp_path: Path, clean_env: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    mpich = fake_mpiexec(tmp_path, "HYDRA build details: Version: 4.2.0")
    cmd = dry_run(["-np", "3", "-H", "a:2,b:2", "-x", "A=1", "python", "t.py"], mpich,
                  clean_env, capsys)
    assert cmd == [mpich, "-n", "3", "-bind-to", "none", "-hosts", "a:2,b:2", "-genv", "A",
                   "1", "-genvlist", "PYTHONPATH", "python", "t.py"]
    with pytest.raises(SystemExit, match="--elastic needs Open MPI"):
        launcher.main(["--dry-run", "-np", "2", "--elastic", "python", "t.py"])


def test_exit_code_of_a_job_killed_by_a_signal() -> None:
    with launcher.Supervisor() as supervisor:
        assert supervisor.run(["sh", "-c", "kill -TERM $$"], dict(os.environ)) == 128 + 15
        assert supervisor.run(["sh", "-c", "exit 3"], dict(os.environ)) == 3
        assert supervisor.signum is None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_finds_mpiexec_and_rejects_bad_arguments(clean_env: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.find_mpiexec() == str(Path(sys.executable).parent / "mpiexec")
    clean_env.setenv("MPITRAIN_MPIEXEC", "/opt/mpi/bin/mpiexec")
    assert launcher.find_mpiexec() == "/opt/mpi/bin/mpiexec"
    for args, message in ((["-np", "2"], "no command to run"),
                          (["python", "x.py"], "-np"),
                          (["-np", "0", "python"], "-np must be >= 1"),
                          (["-np", "2", "-H", "a", "--hostfile", "h", "python"],
                           "not allowed with")):
        with pytest.raises(SystemExit) as exc:
            launcher.parse(args)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert '"mpitrain-run = mpitrain.launcher:main"' in setup
