"""The compiled engine core (and the host copy extension built with it): what setup.py
compiles, and the stale-build guard."""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

import pytest

import mpitrain.engine as eng
from mpitrain.backends import hostcopy

ROOT = Path(__file__).resolve().parents[2]


def _setup_compiled() -> list[str]:
    """The ``COMPILED`` list of setup.py, read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPILED":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPILED list")


def _makefile_line(variable: str) -> str:
    """What the Makefile assigns to ``variable``."""
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.startswith(variable + " :="):
            return line.partition(":=")[2].strip()
    raise AssertionError(f"the Makefile has no {variable}")


def test_setup_compiles_the_modules_the_package_checks() -> None:
    core = sorted(m.__name__.replace(".", "/") + ".py" for m in eng._CORE)
    assert sorted(_setup_compiled()) == core
    # ENGINE_CORE := $(addprefix mpitrain/engine/,request.py ...): the make rebuild's inputs
    names = _makefile_line("ENGINE_CORE").partition(",")[2].rpartition(")")[0].split()
    assert sorted("mpitrain/engine/" + n for n in names) == core


def test_setup_builds_the_host_copy_source_the_package_checks() -> None:
    source = str(hostcopy.SOURCE.relative_to(ROOT))
    assert f'HOSTCOPY = Path("{source}")' in (ROOT / "setup.py").read_text(encoding="utf-8")
    assert _makefile_line("HOSTCOPY") == source


@pytest.mark.skipif(os.environ.get("EXPECT_COMPILED_ENGINE") != "1",
                    reason="run outside make: either build may be loaded")
def test_make_runs_the_compiled_core() -> None:
    assert eng.compiled(), "make test must run the engine core that make compiled"
    assert hostcopy.compiled(), "make test must run the host copy extension make built"


def test_core_is_all_compiled_or_all_source() -> None:
    kinds = {str(m.__file__).endswith(".py") for m in eng._CORE}
    assert len(kinds) == 1
    assert eng.compiled() == (kinds == {False})


@pytest.mark.skipif(not eng.compiled(), reason="the engine core runs from its sources")
def test_manifest_matches_the_sources() -> None:
    from mpitrain.engine._compiled import SOURCES

    for module in eng._CORE:
        # (a compiled module's __file__ may not name its directory: the package's does)
        source = Path(eng.__file__).parent / (module.__name__.rpartition(".")[2] + ".py")
        assert SOURCES[source.name] == hashlib.sha256(source.read_bytes()).hexdigest()


@pytest.mark.skipif(not eng.compiled(), reason="the engine core runs from its sources")
def test_stale_build_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import mpitrain.engine._compiled as manifest

    eng._check_compiled()  # the real build passes
    monkeypatch.setitem(manifest.SOURCES, "fusion.py", "0" * 64)  # as if fusion.py changed
    with pytest.raises(ImportError, match=r"compiled fusion\.py was built from another "
                                          r"version.*rebuild it \(make"):
        eng._check_compiled()
