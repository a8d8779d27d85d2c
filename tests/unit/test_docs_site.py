"""The documentation site against the code: the settings table, the variable names the
pages mention, and the pages the navigation lists (what ``make docs`` cannot see without
the docs tools installed)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from mpitrain import config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MISSPELT = {"MPITRAIN_ALGORTHM"}  # docs/configuration.md shows the warning a typo gives


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools/mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mkdocs_hooks"] = module
    spec.loader.exec_module(module)
    return module


def _pages() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
             for p in DOCS.rglob("*.md")}
    texts["README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    return texts


def test_the_settings_table_has_every_setting_with_its_default() -> None:
    table = _hooks().settings_table()
    rows = [line for line in table.splitlines() if line.startswith("| `MPITRAIN_")]
    assert [re.match(r"\| `(\w+)`", row)[1] for row in rows] == \
        [s.name for s in config.ALL_SETTINGS]  # type: ignore[index]
    assert "| `MPITRAIN_FUSION_THRESHOLD` | `64M` |" in table
    assert "| `MPITRAIN_INTER_SEGMENT_BYTES` | `60K` |" in table
    assert "| `MPITRAIN_CHECK` | `1` |" in table
    assert "| `MPITRAIN_CUDA_AWARE` | `unset` |" in table
    assert "| `MPITRAIN_STALL_WARNING_S` | `60` |" in table


def test_the_configuration_page_shows_the_table_and_the_other_variables() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert _hooks().MARKER in page
    for name in config.OTHER_NAMES:
        assert f"`{name}" in page, f"docs/configuration.md does not explain {name}"
    for setting in config.ALL_SETTINGS:
        assert f"`{setting.name}`" in page.split("## Where each is explained", 1)[1], \
            f"docs/configuration.md does not say where {setting.name} is explained"


def test_the_configuration_page_shows_every_horovod_alias() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert _hooks().ALIASES_MARKER in page
    table = _hooks().aliases_table()
    for alias in config.ALIASES:
        assert f"| `{alias.name}` | `{alias.setting.name}` |" in table
    for name in config.WITHOUT_COUNTERPART:
        assert f"| `{name}` | none (warned) |" in table


def test_every_variable_the_pages_name_exists() -> None:
    known = {s.name for s in config.ALL_SETTINGS} | config.OTHER_NAMES | MISSPELT
    for page, text in _pages().items():
        for name in set(re.findall(r"MPITRAIN_[A-Z0-9_]*[A-Z0-9]", text)):
            assert name in known, f"{page} names {name}, which mpitrain/config.py lacks"


def test_the_navigation_lists_every_page_and_only_pages_that_exist() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    nav = nav.split("\n\n", 1)[0]
    listed = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, re.M))
    generated = {_hooks().RESULTS_PAGE}
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert listed - generated <= on_disk, f"nav lists missing pages: {listed - on_disk}"
    assert on_disk <= listed, f"pages not in mkdocs.yml's nav: {on_disk - listed}"


def test_benchmark_plots_are_found_in_benchmarks_md() -> None:
    plots = _hooks().benchmark_plots("text ![allreduce](benchmarks/results/a.png) and "
                                     "![b](x/b.png)")
    assert plots == ["benchmarks/results/a.png", "x/b.png"]
    for path in _hooks().benchmark_plots((ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")):
        assert (ROOT / path).exists(), f"BENCHMARKS.md shows {path}, which does not exist"
