"""Print the requirements of one extra of pyproject.toml, one a line:

    python tools/extra_requirements.py docs

``make docs`` installs the ``docs`` extra's tools with them, without reinstalling (and
recompiling) mpitrain itself, which ``pip install -e '.[docs]'`` would do.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11: pip's own copy of the same parser
    from pip._vendor import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extra: str) -> list[str]:
    """The requirement strings of ``extra`` (KeyError naming the extras if unknown)."""
    extras = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"][
        "optional-dependencies"]
    if extra not in extras:
        raise KeyError(f"no extra {extra!r} in {PYPROJECT}; the extras are {', '.join(extras)}")
    return list(extras[extra])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(requirements(sys.argv[1])))
