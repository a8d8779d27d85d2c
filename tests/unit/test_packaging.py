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
    # benchmarks/ goes into the wheel as mpitrain.benchmarks: no top-level name but mpitrain
    installed = {"mpitrain." + p if p.startswith("benchmarks") else p for p in packages}
    assert set(tool["packages"]) == installed | {"mpitrain.kernels"}
    assert all(p == "mpitrain" or p.startswith("mpitrain.") for p in tool["packages"])
    assert tool["package-dir"] == {"mpitrain.kernels": "kernels",
                                   "mpitrain.benchmarks": "benchmarks"}
    assert (ROOT / "kernels" / "common.cuh").is_file()  # what mpitrain.backends.kernels loads


@pytest.mark.parametrize("script, target", [
    ("mpitrain-run", "mpitrain.launcher:main"),
    ("mpitrain-tune", "mpitrain.tune:main"),
    ("mpitrain-bench", "mpitrain.benchmarks.__main__:run"),
])
def test_console_scripts_name_functions_that_exist(
        pyproject: dict[str, Any], script: str, target: str) -> None:
    assert pyproject["project"]["scripts"][script] == target
    module, _, function = target.partition(":")
    # a package the wheel maps from another folder is imported from that folder here
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        if module.startswith(package + "."):
            module = folder.replace("/", ".") + module[len(package):]
    assert callable(getattr(importlib.import_module(module), function))


def test_make_docs_installs_the_docs_tools_only() -> None:
    """``make docs`` reads the sources: it must not reinstall (and recompile) mpitrain."""
    import sys

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    rule = makefile.split("\n$(VENV)/.docs:", 1)[1].split("\n\n", 1)[0]
    prerequisites, _, recipe = rule.partition("\n")
    assert "setup.py" not in prerequisites
    assert "pip install" in recipe and ".[" not in recipe and " -e " not in recipe, recipe
    assert "tools/extra_requirements.py docs" in recipe
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import extra_requirements
    finally:
        sys.path.pop(0)
    assert extra_requirements.requirements("docs") == \
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]["docs"]


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
