"""The README's install line is one line, and it installs everything its first run
imports; every extra is explained."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = {"sklearn": "scikit-learn"}
"""Import names whose distribution is named otherwise."""


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _sh_lines(section: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [line.split(" #", 1)[0].strip() for b in blocks for line in b.splitlines()
            if line.strip()]


def _imports(script: Path, seen: set[Path]) -> set[str]:
    """The top-level modules ``script`` imports, through the local modules it imports."""
    seen.add(script)
    found: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and not node.level else [])
        for name in names:
            top = name.split(".")[0]
            local = script.parent / f"{top}.py"
            if local.exists():
                if local not in seen:
                    found |= _imports(local, seen)
            else:
                found.add(top)
    return found


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!;\[ ]", spec, maxsplit=1)[0].lower() for spec in specs}


def test_one_install_line_makes_the_first_run_work() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    installs = [line for line in _sh_lines(_section(readme, "Install"))
                if line.startswith("pip install")]
    assert len(installs) == 1, f"the README installs in {len(installs)} lines: {installs}"
    extras = re.findall(r"\.\[([\w,-]+)\]", installs[0])[0].split(",")
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    installed = _requirement_names(project["dependencies"]) | {"mpitrain"}
    for extra in extras:
        installed |= _requirement_names(project["optional-dependencies"][extra])
    first_run = _sh_lines(_section(readme, "First run"))[0]
    script = next(w for w in shlex.split(first_run) if w.endswith(".py"))
    needed = {DISTRIBUTION.get(m, m).lower() for m in _imports(ROOT / script, set())
              if m not in sys.stdlib_module_names and m != "__future__"}
    assert needed <= installed, f"{first_run!r} imports {sorted(needed - installed)}, " \
                                f"which {installs[0]!r} does not install"


def test_every_extra_is_explained() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = _section((ROOT / "docs" / "install.md").read_text(encoding="utf-8"), "Extras")
    for extra in extras:
        assert f"| `{extra}` |" in table, f"docs/install.md's extras table lacks {extra}"
        assert f"`{extra}`" in _section(readme, "Install"), f"README does not name {extra}"
