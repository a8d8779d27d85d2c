"""mkdocs hooks of mpitrain's documentation site (mkdocs.yml, ``hooks:``).

* ``<!-- settings-table -->`` in a page becomes the table of every ``MPITRAIN_*``
  setting, built from ``mpitrain.config.ALL_SETTINGS``, so the page cannot fall behind
  the code; ``<!-- horovod-aliases-table -->`` the table of the ``HOROVOD_*`` variables
  read as aliases (``mpitrain.config.ALIASES``) and of those that have no effect.
* ``benchmark-results.md`` is BENCHMARKS.md (which stays at the top of the repository),
  with the plots it shows.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- settings-table -->"
ALIASES_MARKER = "<!-- horovod-aliases-table -->"
RESULTS_PAGE = "benchmark-results.md"


def _config() -> Any:
    """``mpitrain.config`` of this checkout (it loads no MPI)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("mpitrain.config")


def _default_text(config: Any, setting: Any) -> str:
    """A setting's default as a user would write it in the variable."""
    value = setting.default
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if setting.parse is config.parse_size and value:
        for suffix, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value % size == 0:
                return f"{value // size}{suffix}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def settings_table() -> str:
    """The Markdown table of every setting: variable, default, meaning."""
    config = _config()
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for setting in config.ALL_SETTINGS:
        doc = " ".join(setting.doc.split()).replace("|", "\\|")
        rows.append(f"| `{setting.name}` | `{_default_text(config, setting)}` | {doc} |")
    return "\n".join(rows)


def aliases_table() -> str:
    """The Markdown table of Horovod's variables: the setting each sets, or why none."""
    config = _config()
    rows = ["| Horovod variable | mpitrain setting | notes |", "|---|---|---|"]
    for alias in config.ALIASES:
        note = alias.note.replace("|", "\\|")
        rows.append(f"| `{alias.name}` | `{alias.setting.name}` | {note} |")
    for name, hint in config.WITHOUT_COUNTERPART.items():
        rows.append(f"| `{name}` | none (warned) | {hint} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the settings and alias tables where a page asks for them."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, settings_table())
    if ALIASES_MARKER in markdown:
        markdown = markdown.replace(ALIASES_MARKER, aliases_table())
    return markdown


def benchmark_plots(text: str) -> list[str]:
    """The repository paths of the images that BENCHMARKS.md shows."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)


def on_files(files: Any, config: Any) -> Any:
    """Add BENCHMARKS.md as the results page, and the plots it shows."""
    from mkdocs.structure.files import File

    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    files.append(File.generated(config, RESULTS_PAGE, content=text))
    for path in benchmark_plots(text):
        files.append(File.generated(config, path, abs_src_path=str(ROOT / path)))
    return files
