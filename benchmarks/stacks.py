"""``python -m benchmarks.stacks FILE... [--top N] [--match TEXT]``: where the samples of
py-spy's collapsed stacks went, thread by thread.

Reads the files that ``py-spy record -f raw --threads`` writes (one line per distinct
stack: ``frame;frame;...;frame COUNT``, the first frame naming the thread, each other
``function (file:line)``; docs/gpu.md gives the command that records every rank of a
training run) and prints, for each thread with the most samples first, its share of
all samples and the functions most often on its stack (inclusive samples: a function
counts once per sample however deep it recurs) and at the top of it (self samples).
``--match`` keeps the functions whose file path contains one of its comma-separated
texts (``mpitrain,distributed``, say); the shares stay those of all samples (recorded
with ``--idle``, those include the threads' waits, at the top of their stacks). Several
files (the ranks of one run) are added up: thread names, not thread ids, tell threads
apart.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

_THREAD = re.compile(r"^(?:thread|process) \((?P<tid>\d+)\)(?::\s*(?P<name>.*))?$")


@dataclass
class Thread:
    """The samples of one thread (of every file read): how many, and per function how
    many had it anywhere on the stack (``inclusive``) and at its top (``self``)."""

    samples: int = 0
    inclusive: Counter[str] = field(default_factory=Counter)
    self: Counter[str] = field(default_factory=Counter)


def thread_name(frame: str, names: dict[str, str] | None = None) -> str:
    """The name of the thread a stack's first frame names (py-spy's ``thread (tid):
    name``), without the thread id; a frame with the id alone takes the name that
    ``names`` (id to name, of the same file) has for it. A first frame that names no
    thread is its own name."""
    m = _THREAD.match(frame.strip())
    if m is None:
        return frame.strip()
    name = m.group("name")
    if name:
        return name.strip()
    return (names or {}).get(m.group("tid"), f"thread {m.group('tid')}")


def function(frame: str) -> tuple[str, str]:
    """``(function (file), file)`` of a frame ``function (file:line)``: the line is
    dropped, so that every line of a function counts as the function."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return (f"{name} ({path.rsplit('/', 1)[-1]})" if path else name), path


def read(lines: Iterable[str], threads: dict[str, Thread] | None = None,
         match: Sequence[str] = ()) -> dict[str, Thread]:
    """Add the collapsed stacks of ``lines`` to ``threads`` (new if None) and return it;
    ``match``: keep only functions whose file contains one of these texts."""
    threads = {} if threads is None else threads
    stacks = []
    names: dict[str, str] = {}  # thread id -> name, where some stack names it
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        stacks.append((frames, int(count)))
        m = _THREAD.match(frames[0].strip())
        if m is not None and m.group("name"):
            names[m.group("tid")] = m.group("name").strip()
    for frames, n in stacks:
        thread = threads.setdefault(thread_name(frames[0], names), Thread())
        thread.samples += n
        seen = set()
        kept = []
        for frame in frames[1:]:
            name, path = function(frame)
            if match and not any(text in path for text in match):
                continue
            kept.append(name)
            if name not in seen:
                seen.add(name)
                thread.inclusive[name] += n
        if kept and kept[-1] == function(frames[-1])[0]:
            thread.self[kept[-1]] += n
    return threads


def report(threads: dict[str, Thread], top: int = 12) -> list[str]:
    """The lines :func:`main` prints."""
    total = sum(t.samples for t in threads.values()) or 1
    lines = [f"{total} samples in {len(threads)} thread(s)"]
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1].samples):
        lines.append(f"\n{name}: {t.samples} samples, {100 * t.samples / total:.1f} %")
        for what, counts in (("on the stack", t.inclusive), ("at the top", t.self)):
            for function_name, n in counts.most_common(top):
                lines.append(f"  {what:12s} {100 * n / total:5.1f} %  {n:7d}  {function_name}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report of the files ``argv`` names (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stacks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="py-spy's raw output (-f raw --threads)")
    parser.add_argument("--top", type=int, default=12,
                        help="functions shown per thread and kind (default 12)")
    parser.add_argument("--match", default="",
                        help="comma-separated texts; keep functions whose file has one")
    opts = parser.parse_args(argv)
    match = [m for m in opts.match.split(",") if m]
    threads: dict[str, Thread] = defaultdict(Thread)
    for path in opts.files:
        with open(path, encoding="utf-8", errors="replace") as f:
            read(f, threads, match)
    print("\n".join(report(dict(threads), opts.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
