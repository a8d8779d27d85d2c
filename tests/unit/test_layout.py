"""The repository's structure: the layout table of docs/design.md against the tree, and
the import checks of ``make lint`` (tools/lint_imports.py) on the real packages and on
small packages built to break them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_PAGE = "docs/design.md"


def _layout_rows() -> list[tuple[str, str]]:
    """The (path cell, what cell) rows of the "Layout" table of docs/design.md."""
    text = (ROOT / LAYOUT_PAGE).read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2:
            rows.append((cells[0], cells[1]))
    return rows


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_layout_table_names_only_what_exists() -> None:
    rows = _layout_rows()
    assert len(rows) > 10
    for paths, what in rows:
        dirs = []
        for path in _ticked(paths):
            assert (ROOT / path).exists(), \
                f"{LAYOUT_PAGE}'s layout names {path}, which does not exist"
            if path.endswith("/"):
                dirs.append(ROOT / path)
        # a file named in the description lives in one of the row's folders
        for name in _ticked(what):
            if re.fullmatch(r"[\w/]+\.(py|c|cu|cuh)", name) and dirs:
                assert any((d / name).exists() for d in dirs), \
                    f"{LAYOUT_PAGE}'s layout row {paths} names {name}, which is not in {paths}"


def _tracked(folder: str) -> list[str]:
    """The files git tracks under ``folder`` (built and generated files are not)."""
    run = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    if run.returncode != 0 or not run.stdout:
        pytest.skip("not a git checkout")
    return run.stdout.split()


def test_every_module_of_mpitrain_is_in_the_layout_table() -> None:
    listed = set()
    for paths, what in _layout_rows():
        for path in _ticked(paths):
            listed.add(path)
            if path.endswith("/"):
                listed.update(path + name for name in _ticked(what))
    for path in _tracked("mpitrain"):
        parts = path.split("/")
        if parts[-1] in ("__init__.py", "py.typed"):
            continue
        if len(parts) > 2:
            folder = "/".join(parts[:2]) + "/"
            assert folder in listed, f"{folder} is missing from the layout table of {LAYOUT_PAGE}"
        assert path in listed, f"{path} is missing from the layout table of {LAYOUT_PAGE}"


def _lint_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "tools/lint_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lint_imports"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_packages_pass_the_import_checks() -> None:
    lint = _lint_module()
    assert lint.check(lint.load([str(ROOT / "mpitrain"), str(ROOT / "benchmarks")])) == []


def _package(tmp_path: Path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


@pytest.mark.parametrize("files, expected", [
    ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from . import a\n"},
     "import cycle: pkg.a <-> pkg.b"),
    ({"__init__.py": "from .a import f\n", "a.py": "def f(): ...\n",
      "b.py": "def g():\n    import pkg\n    return pkg.f\n",
      "c.py": "from . import b\n"},
     None),
    ({"__init__.py": "from .a import f\nfrom .b import g\n", "a.py": "def f(): ...\n",
      "b.py": "def g():\n    from . import f\n"},
     "import cycle: pkg <-> pkg.b"),
    ({"__init__.py": "", "a.py": "def _helper(): ...\n", "b.py": "from .a import _helper\n"},
     "pkg.b imports the private name _helper of pkg.a"),
    ({"__init__.py": "", "a.py": "class A:\n    def _run(self): ...\n",
      "b.py": "from .a import A\n\ndef f(x: A):\n    return x._run()\n"},
     "pkg.b reads x._run, a private name it does not define"),
    ({"__init__.py": "", "_impl.py": "X = 1\n", "sub/__init__.py": "",
      "sub/c.py": "from .._impl import X\n", "a.py": "from ._impl import X\n"},
     None),
    ({"__init__.py": "", "a.py": "class A:\n    def _run(self, other: 'A'):\n"
      "        return other._run\n"}, None),
])
def test_import_checks_catch_cycles_and_private_names(tmp_path: Path, files: dict[str, str],
                                                      expected: str | None) -> None:
    lint = _lint_module()
    problems = lint.check(lint.load([_package(tmp_path, files)]))
    if expected is None:
        assert problems == []
    else:
        assert any(expected in p for p in problems), problems


def test_the_command_exits_nonzero_on_a_problem(tmp_path: Path) -> None:
    root = _package(tmp_path, {"__init__.py": "", "a.py": "from . import b\n",
                               "b.py": "from . import a\n"})
    run = subprocess.run([sys.executable, str(ROOT / "tools/lint_imports.py"), root],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "import cycle" in run.stdout
