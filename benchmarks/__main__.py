"""``python -m benchmarks <collective> [options]`` (:mod:`benchmarks.harness`),
``python -m benchmarks fusion [options]`` (:mod:`benchmarks.fusion`) or
``python -m benchmarks train [options]`` (:mod:`benchmarks.train`, needs torch) or
``python -m benchmarks latency [options]`` (:mod:`benchmarks.latency`); installed,
the same command is ``mpitrain-bench``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mpi4py import MPI

from mpitrain import excepthook

from . import common, fusion, gloo, harness


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark ``argv`` (default ``sys.argv[1:]``) names: ``fusion ...`` the
    fusion case, ``train ...`` the training case, anything else one collective through
    the harness.

    Returns:
        The benchmark's exit status: 0 if every verified element (every trained
        model) was right, else 1; 2 for ``train`` without torch.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["latency"]:  # small blocking allreduces against native MPI
        from . import latency

        return latency.main(args[1:])
    if args[:1] == ["fusion"]:  # not one collective but three calls compared: its own table
        return fusion.main(args[1:])
    if args[:1] == ["train"]:  # whole training steps, torch only: imported on demand
        if not gloo.available():
            if MPI.COMM_WORLD.Get_rank() == 0:
                print("python -m benchmarks train: error: needs torch: pip install "
                      "torch==2.13.0", file=sys.stderr, flush=True)
            return 2
        common.ask_for_huge_pages(args)  # before torch's first allocation
        from . import train

        return train.main(args[1:])
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
