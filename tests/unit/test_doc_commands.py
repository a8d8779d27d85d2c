"""Every command the documentation, the examples and the ``--help`` texts show for starting
ranks runs as pasted, as root too, without Open MPI's OSC UCX error: an ``mpitrain-run``
command is one its parser accepts; an ``mpirun``/``mpiexec`` command that starts a
program carries ``--allow-run-as-root`` and ``--mca osc ^ucx``."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from mpitrain import launcher, tune

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {"python", "python3", "sh", "mpitrain-tune", "mpitrain-bench"}


def _markdown_candidates(text: str) -> list[str]:
    """The lines of fenced blocks and the inline code spans of a page."""
    found, prose, fenced = [], [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            found.append(line.split(" #", 1)[0])
        else:
            prose.append(line)
    found += re.findall(r"`([^`]+)`", " ".join(prose))
    return found


def _python_candidates(path: Path) -> list[str]:
    """The literal blocks (indented lines) and ````code```` spans of a module's
    docstrings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc:
                found += [line for line in doc.splitlines() if line.startswith("    ")]
                found += re.findall(r"``([^`]+)``", " ".join(doc.split()))
    return found


def _help_texts() -> dict[str, str]:
    from benchmarks import harness

    texts = {"mpitrain-tune --help": tune.build_parser().format_help(),
             "python -m benchmarks --help": harness.build_parser().format_help()}
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        launcher.parse(["--help"])
    texts["mpitrain-run --help"] = out.getvalue()
    return texts


def _sources() -> dict[str, list[str]]:
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md",
             ROOT / "benchmarks" / "BENCHMARKS.template.md", ROOT / "BENCHMARKS.md"]
    sources = {str(p.relative_to(ROOT)): _markdown_candidates(p.read_text(encoding="utf-8"))
               for p in pages}
    for folder in ("examples", "benchmarks", "mpitrain"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            sources[str(path.relative_to(ROOT))] = _python_candidates(path)
    for name, text in _help_texts().items():
        sources[name] = [" ".join(text.split())]
    return sources


def _commands(candidate: str) -> list[list[str]]:
    """The words of each command of ``candidate`` (split at ``;``, ``&&``, ``||``)."""
    lexer = shlex.shlex(candidate.replace("``", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: a fragment, not a command
        return []
    commands: list[list[str]] = [[]]
    for word in words:
        if word in (";", "&&", "||", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(word.rstrip(":"))
    return [c for c in commands if c]


def launches() -> list[tuple[str, str, list[str]]]:
    """``(where, command, words)`` for every command shown that starts a program on ranks
    (a placeholder rank count ``N`` read as 2)."""
    found = []
    for where, candidates in _sources().items():
        for candidate in candidates:
            for words in _commands(candidate):
                tools = [i for i, w in enumerate(words)
                         if w.rsplit("/", 1)[-1] in ("mpirun", "mpiexec", "mpitrain-run")]
                if not tools:
                    continue
                rest = words[tools[0]:]
                if any(w in PROGRAMS or w.endswith((".py", "/python")) for w in rest[1:]):
                    rest = ["2" if w in ("N", "ranks") else w for w in rest]
                    found.append((where, shlex.join(words), words[:tools[0]] + rest))
    return found


LAUNCHES = launches()


def test_the_sources_show_commands() -> None:
    assert len(LAUNCHES) > 40
    assert any(words[0] == "mpitrain-run" for _, _, words in LAUNCHES)


@pytest.mark.parametrize("where, command, words", LAUNCHES,
                         ids=[f"{w}: {c}" for w, c, _ in LAUNCHES])
def test_a_shown_command_runs_as_pasted(where: str, command: str, words: list[str]) -> None:
    tool = next(i for i, w in enumerate(words)
                if w.rsplit("/", 1)[-1] in ("mpirun", "mpiexec", "mpitrain-run"))
    env, rest = words[:tool], words[tool + 1:]
    if words[tool] == "mpitrain-run":
        job, _ = launcher.parse(rest)  # exits (argparse) if mpitrain-run refuses it
        assert job.command, f"{where}: {command!r} starts no program"
        return
    as_root = "--allow-run-as-root" in rest or "OMPI_ALLOW_RUN_AS_ROOT=1" in env
    quiet = any(rest[i:i + 3] == ["--mca", "osc", "^ucx"] for i in range(len(rest)))
    assert as_root and quiet, (
        f"{where}: {command!r} fails as root or prints the OSC UCX error; show "
        "`mpitrain-run -np N ...`, or add --allow-run-as-root and --mca osc ^ucx")


def test_from_horovod_says_where_adasum_runs() -> None:
    row = next(line for line in (ROOT / "docs" / "from-horovod.md").read_text(
        encoding="utf-8").splitlines() if line.startswith("| `Average`, `Sum`"))
    assert "NotImplementedError" not in row and "adasum.md" in row, row
