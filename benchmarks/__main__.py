"""``python -m benchmarks <collective> [options]`` (:mod:`benchmarks.harness`) or
``python -m benchmarks fusion [options]`` (:mod:`benchmarks.fusion`); installed, the same
command is ``mpitrain-bench``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mpitrain import excepthook

from . import fusion, harness


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark ``argv`` (default ``sys.argv[1:]``) names: ``fusion ...`` the
    fusion case, anything else one collective through the harness.

    Returns:
        The benchmark's exit status: 0 if every verified element was right, else 1.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["fusion"]:  # not one collective but three calls compared: its own table
        return fusion.main(args[1:])
    return harness.main(args)


def run() -> int:
    """Entry point of ``mpitrain-bench`` and ``python -m benchmarks``: :func:`main`, with
    mpitrain's exception hook installed, so that a rank that raises (a bad ``--json``
    path, a missing module) ends the whole job, as under ``mt.init()``, instead of
    leaving the other ranks in their next collective."""
    excepthook.install()
    return main()


if __name__ == "__main__":
    sys.exit(run())
