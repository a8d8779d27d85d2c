"""pyproject.toml against the tree: the packages a wheel holds, the console scripts, the
one version and the mypy that compiles the engine core (tests/integration/test_wheel.py
builds and installs the wheel)."""

from __future__ import annotations

import importlib
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import mpitrain

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    """pyproject.toml, parsed."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_wheel_lists_every_package_of_the_tree(pyproject: dict[str, Any]) -> None:
    tool = pyproject["tool"]["setuptools"]
    run = subprocess.run(["git", "ls-files", "mpitrain", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if run.returncode != 0 or not run.stdout:
        pytest.skip("not a git checkout")
    packages = {str(Path(f).parent).replace("/", ".") for f in run.stdout.split()
                if f.endswith("/__init__.py")}
    assert set(tool["packages"]) == packages | {"mpitrain.kernels"}
    assert tool["package-dir"] == {"mpitrain.kernels": "kernels"}
    assert (ROOT / "kernels" / "common.cuh").is_file()  # what mpitrain.backends.kernels loads


@pytest.mark.parametrize("script, target", [
    ("mpitrain-run", "mpitrain.launcher:main"),
    ("mpitrain-tune", "mpitrain.tune:main"),
    ("mpitrain-bench", "benchmarks.__main__:run"),
])
def test_console_scripts_name_functions_that_exist(
        pyproject: dict[str, Any], script: str, target: str) -> None:
    assert pyproject["project"]["scripts"][script] == target
    module, _, function = target.partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_version_comes_from_the_package_only(pyproject: dict[str, Any]) -> None:
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    source = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert source == "mpitrain.__version__"
    assert isinstance(mpitrain.__version__, str) and mpitrain.__version__
    assert "version" not in (ROOT / "setup.py").read_text(encoding="utf-8")


def test_build_compiles_with_the_mypy_that_checks_the_code(pyproject: dict[str, Any]) -> None:
    build = [r for r in pyproject["build-system"]["requires"] if r.startswith("mypy")]
    dev = [r for r in pyproject["project"]["optional-dependencies"]["dev"]
           if r.startswith("mypy")]
    assert len(build) == 1 and len(dev) == 1
    pin = build[0].partition(";")[0].strip()
    assert pin == dev[0] and pin.startswith("mypy==")
    try:
        installed = metadata.version("mypy")
    except metadata.PackageNotFoundError:
        pytest.skip("mypy is not installed here")
    assert pin == f"mypy=={installed}", (
        f"the build compiles the engine with {pin} but this environment has mypy "
        f"{installed}: change both pins in pyproject.toml to the mypy in use")
