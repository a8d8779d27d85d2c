"""mpitrain-run: the mpiexec command lines it builds (``--dry-run``, in this process), its
flags, and what every rank runs first (mpitrain.run_rank)."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import mpitrain
from mpitrain import config, launcher

ROOT = Path(__file__).resolve().parents[2]
ROOT_FLAGS = ["--allow-run-as-root"] if os.geteuid() == 0 else []
YIELD = ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "--mca",
         "threads_pthreads_yield_strategy", "nanosleep"]
QUIET = ["--mca", "osc", "^ucx"]
WRAPPER = [sys.executable, "-I", str(launcher.RANK_WRAPPER)]
PORT = 29500


def fake_mpiexec(tmp_path: Path, version: str) -> str:
    """An executable that only answers ``--version`` like an MPI's mpiexec."""
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MPITRAIN_*, MASTER_* or OMPI_MCA_osc variables; PYTHONPATH set, as under the test
    suite's jobs; the free port the launcher picks is always :data:`PORT`."""
    for key in list(os.environ):
        if key.startswith("MPITRAIN_") or key in ("MASTER_ADDR", "MASTER_PORT",
                                                  "OMPI_MCA_osc"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PYTHONPATH", "/src")
    monkeypatch.setattr(launcher, "free_port", lambda: PORT)
    return monkeypatch


def dry_run(args: list[str], mpiexec: str | None, env: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The command ``mpitrain-run --dry-run args`` prints."""
    if mpiexec is not None:
        env.setenv("MPITRAIN_MPIEXEC", mpiexec)
    assert launcher.main(["--dry-run", *args]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def split(cmd: list[str]) -> tuple[list[str], list[str]]:
    """(mpiexec and its flags, what every rank runs after the wrapper)."""
    at = cmd.index(str(launcher.RANK_WRAPPER))
    assert cmd[at - 2:at + 1] == WRAPPER
    return cmd[:at - 2], cmd[at + 1:]


def exported(flags: list[str]) -> list[str]:
    """The ``-x`` arguments of an Open MPI command line."""
    return [flags[i + 1] for i, f in enumerate(flags) if f == "-x"]


@pytest.fixture
def openmpi(tmp_path: Path) -> str:
    return fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11")


def test_defaults_and_script_under_this_python(openmpi: str, clean_env: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cmd = dry_run(["-np", "2", "-H", "a:1,b:1", "train.py", "--lr", "0.1"], openmpi,
                  clean_env, capsys)
    assert cmd == [openmpi, "-np", "2", *ROOT_FLAGS, "--bind-to", "none", "-H", "a:1,b:1",
                   *QUIET, "-x", "PYTHONPATH", "-x", "MASTER_ADDR=a", "-x",
                   f"MASTER_PORT={PORT}", *WRAPPER, sys.executable, "train.py", "--lr", "0.1"]


def test_oversubscribes_and_yields_when_ranks_outnumber_slots(
        openmpi: str, tmp_path: Path, clean_env: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def flags(*args: str) -> list[str]:
        return split(dry_run([*args, "python", "x.py"], openmpi, clean_env, capsys))[0]

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
    clean_env.setenv("MPITRAIN_ELASTIC", "0")  # --elastic wins
    flags, _ = split(dry_run(["-np", "4", "-H", "a:4", "-x", "OMP_NUM_THREADS=1", "-x", "HOME",
                              "-x", "OMP_NUM_THREADS=2", "--elastic", "--max-restarts", "2",
                              "--mca", "btl", "self,tcp", "--mpi-args=--tag-output -v",
                              "python", "train.py"], openmpi, clean_env, capsys))
    assert flags[flags.index("--with-ft") + 1] == "ulfm"
    assert exported(flags) == ["HOME", "OMP_NUM_THREADS=2", "MPITRAIN_RESTART",
                               "MPITRAIN_ELASTIC_REPORT",
                               "MPITRAIN_STALL_WARNING_S", "PYTHONPATH", "MPITRAIN_ELASTIC=1",
                               "MASTER_ADDR=a", f"MASTER_PORT={PORT}"]
    assert flags[-5:] == ["--mca", "btl", "self,tcp", "--tag-output", "-v"]


def test_mpich_flags(tmp_path: Path, clean_env: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    mpich = fake_mpiexec(tmp_path, "HYDRA build details: Version: 4.2.0")
    cmd = dry_run(["-np", "3", "-H", "a:2,b:2", "-x", "A=1", "python", "t.py"], mpich,
                  clean_env, capsys)
    assert cmd == [mpich, "-n", "3", "-bind-to", "none", "-hosts", "a:2,b:2", "-genv", "A",
                   "1", "-genv", "MASTER_ADDR", "a", "-genv", "MASTER_PORT", str(PORT),
                   "-genvlist", "PYTHONPATH", *WRAPPER, sys.executable, "t.py"]
    with pytest.raises(SystemExit, match="--elastic needs Open MPI"):
        launcher.main(["--dry-run", "-np", "2", "--elastic", "python", "t.py"])
    with pytest.raises(SystemExit, match="--mca sets Open MPI parameters"):
        launcher.main(["--dry-run", "-np", "2", "--mca", "btl", "tcp", "python", "t.py"])


def test_python_scripts_and_modules_run_under_this_interpreter(
        openmpi: str, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def ranks_run(*args: str) -> list[str]:
        return split(dry_run(["-np", "2", *args], openmpi, clean_env, capsys))[1]

    me = sys.executable
    assert ranks_run("python", "x.py", "-v") == [me, "x.py", "-v"]
    assert ranks_run("python3", "-c", "pass") == [me, "-c", "pass"]
    assert ranks_run("python{}.{}".format(*sys.version_info[:2]), "x.py") == [me, "x.py"]
    assert ranks_run("x.py", "--lr", "1") == [me, "x.py", "--lr", "1"]
    assert ranks_run("-m", "benchmarks", "allreduce", "-b", "8", "-np", "3") == \
        [me, "-m", "benchmarks", "allreduce", "-b", "8", "-np", "3"]
    assert ranks_run("python", "-m", "benchmarks") == [me, "-m", "benchmarks"]
    assert ranks_run("/usr/bin/python3", "x.py") == ["/usr/bin/python3", "x.py"]
    assert ranks_run("hostname") == ["hostname"]
    flags, _ = split(dry_run(["-np", "2", "-x", "A", "-m", "mod"], openmpi, clean_env, capsys))
    assert flags[:3] == [openmpi, "-np", "2"] and "A" in exported(flags)


def test_console_scripts_of_this_environment_run_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed ``mpitrain-bench`` is found next to the interpreter even when its
    environment's bin folder is not on the ranks' PATH."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "folder").mkdir(parents=True)
    python = bin_dir / "python3"
    for name in ("python3", "mpitrain-bench"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "notes").write_text("not a program\n")
    monkeypatch.setattr(sys, "executable", str(python))
    wrapper = [str(python), "-I", str(launcher.RANK_WRAPPER)]
    assert launcher.rank_command(["mpitrain-bench", "allreduce", "-n", "2"]) == \
        [*wrapper, str(bin_dir / "mpitrain-bench"), "allreduce", "-n", "2"]
    for other in (["notes"], ["folder"], ["hostname"], ["./mpitrain-bench"], []):
        assert launcher.rank_command(other) == [*wrapper, *other]
    assert launcher.rank_command(["python3", "x.py"]) == [*wrapper, str(python), "x.py"]

def test_quiet_osc_unless_the_user_sets_it(openmpi: str, clean_env: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def flags(*args: str) -> list[str]:
        return split(dry_run(["-np", "2", *args, "python", "x.py"], openmpi, clean_env,
                             capsys))[0]

    assert flags()[-len(QUIET) - 6:-6] == QUIET  # before the -x arguments
    assert QUIET[1:] == ["osc", "^ucx"] and "^ucx" in flags("--mca", "btl", "tcp,self")
    assert flags("--mca", "osc", "pt2pt")[-3:] == ["--mca", "osc", "pt2pt"]
    assert "^ucx" not in flags("--mca", "osc", "pt2pt")
    assert "^ucx" not in flags("-mca", "osc", "rdma")
    assert "^ucx" not in flags("--mpi-args=--mca osc rdma")
    assert "^ucx" not in flags("-x", "OMPI_MCA_osc=sm")
    clean_env.setenv("OMPI_MCA_osc", "ucx")
    assert "^ucx" not in flags()


def test_horovodrun_flags_become_mpitrain_variables(
        openmpi: str, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("MPITRAIN_FUSION_THRESHOLD", "1M")  # the flag wins
    flags, _ = split(dry_run(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms",
                              "2.5", "--timeline-filename", "out/t.json", "--log-level",
                              "debug", "-x", "MPITRAIN_TIMELINE=other.json", "python",
                              "x.py"], openmpi, clean_env, capsys))
    variables = dict(e.split("=", 1) for e in exported(flags) if "=" in e)
    assert variables["MPITRAIN_FUSION_THRESHOLD"] == str(32 << 20)
    assert variables["MPITRAIN_CYCLE_TIME_MS"] == "2.5"
    assert variables["MPITRAIN_TIMELINE"] == "out/t.json"
    assert variables["MPITRAIN_LOG_LEVEL"] == "debug"
    # every horovodrun level is a value mt.init() accepts
    from mpitrain.launcher import LOG_LEVELS
    for level in LOG_LEVELS.values():
        assert config.check_environment({"MPITRAIN_LOG_LEVEL": level}) == []
    names = [e.split("=", 1)[0] for e in exported(flags)]
    assert len(names) == len(set(names))
    # what the ranks read back
    assert config.FUSION_THRESHOLD.parse(variables["MPITRAIN_FUSION_THRESHOLD"]) == 32 << 20
    assert config.CYCLE_TIME_MS.parse(variables["MPITRAIN_CYCLE_TIME_MS"]) == 2.5
    for name in ("FUSION_THRESHOLD", "CYCLE_TIME_MS", "TIMELINE"):
        assert f"MPITRAIN_{name}" == getattr(config, name).name
    flags, _ = split(dry_run(["-np", "2", "--fusion-threshold-mb", "0", "python", "x.py"],
                             openmpi, clean_env, capsys))
    assert "MPITRAIN_FUSION_THRESHOLD=0" in exported(flags)


def test_torchrun_rendezvous_variables(openmpi: str, tmp_path: Path,
                                       clean_env: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    def torch_exports(*args: str) -> list[str]:
        flags, _ = split(dry_run(["-np", "2", *args, "python", "x.py"], openmpi, clean_env,
                                 capsys))
        return [e for e in exported(flags) if e.startswith("MASTER_")]

    assert torch_exports() == ["MASTER_ADDR=127.0.0.1", f"MASTER_PORT={PORT}"]
    assert torch_exports("-H", "node7:2,node8:2") == ["MASTER_ADDR=node7",
                                                      f"MASTER_PORT={PORT}"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\n\nnode3 slots=2\nnode4 slots=2\n")
    assert torch_exports("--hostfile", str(hostfile))[0] == "MASTER_ADDR=node3"
    assert torch_exports("-x", "MASTER_PORT=1234") == ["MASTER_PORT=1234",
                                                       "MASTER_ADDR=127.0.0.1"]
    clean_env.setenv("MASTER_ADDR", "head")
    assert torch_exports() == ["MASTER_ADDR", f"MASTER_PORT={PORT}"]


def test_free_port_is_a_port() -> None:
    assert 0 < launcher.free_port() < 65536


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        launcher.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"mpitrain {mpitrain.__version__}\n"


def test_launcher_does_not_import_mpi(openmpi: str) -> None:
    code = ("import sys\n"
            "from mpitrain import launcher\n"
            "assert launcher.main(['--dry-run', '-np', '2', '-m', 'benchmarks', 'x']) == 0\n"
            "print('mpi4py imported:', 'mpi4py' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPITRAIN_MPIEXEC=openmpi)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "mpi4py imported: False"


def test_verbose_prints_the_command_before_running_it(
        openmpi: str, clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    clean_env.setenv("MPITRAIN_MPIEXEC", openmpi)  # runs and exits 0
    assert launcher.main(["--verbose", "-np", "1", "python", "x.py"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"mpitrain-run: {openmpi} -np 1 ")
    assert err.rstrip().endswith(f"{sys.executable} x.py")


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
                           "not allowed with"),
                          (["-np", "2", "-m"], "-m needs a module name"),
                          (["-np", "2", "--fusion-threshold-mb", "-1", "x.py"],
                           "--fusion-threshold-mb must be >= 0"),
                          (["-np", "2", "--fusion-threshold-mb", "1.5", "x.py"],
                           "invalid int value"),
                          (["-np", "2", "--cycle-time-ms", "0", "x.py"],
                           "--cycle-time-ms must be > 0"),
                          (["-np", "2", "--log-level", "chatty", "x.py"], "invalid choice"),
                          (["-np", "2", "--mca", "osc"], "expected 2 arguments")):
        with pytest.raises(SystemExit) as exc:
            launcher.parse(args)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err



def test_tune_reports_times_margins_and_open_ended_rules() -> None:
    from mpitrain import tune

    table = {4: {"shm": 2e-6, "mpi": 3e-6, "ring": 9e-6},
             4096: {"shm": 5e-6, "mpi": 4e-6, "ring": 9e-6}}
    lines = tune.report("allreduce", table, tune.rules_from("allreduce", table, 2))
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert rows["4"] == ["4", "shm", "2.00", "mpi", "3.00", "+50%"]
    assert rows["4096"] == ["4096", "mpi", "4.00", "shm", "5.00", "+25%"]
    assert lines[4] == "allreduce rule: 0 B .. 128 B: shm"
    assert lines[5] == "allreduce rule: 128 B .. and up: mpi"
    assert not any(str(1 << 62) in line for line in lines)
