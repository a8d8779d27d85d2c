"""Run torch's own process-group tests against the ``"mpitrain"`` backend.

    mpirun -np N python tools/torch_conformance.py [PATTERN ...]

torch ships the tests of its ``torch.distributed`` backends with the wheel
(``torch.testing._internal.distributed.distributed_test``, the tests that its CI runs
over gloo, NCCL and MPI, reading the backend's name from ``$BACKEND``). torch's harness
starts the ranks itself; this one runs under ``mpirun`` instead: every rank imports the
module with ``BACKEND=mpitrain``, makes the default group with
``init_process_group("mpitrain")`` and runs the tests of ``DistributedTest._DistTestBase``
(those matching a ``fnmatch`` PATTERN, default all) one after another, in step. torch's
lists of backends that support DDP, subgroups, device tensors and plugins are told that
``mpitrain`` does, so those tests run too; a test for another backend's own API or
behaviour (gloo's ``monitored_barrier``, NCCL's CUDA calls) skips itself as torch has it.

A test's outcome is the worst over the ranks: ``passed``, ``skipped`` (with torch's
reason) or ``failed`` (with each failed rank's traceback); after a failure every rank
makes the default group anew, so that what the failed test left in flight cannot reach
the next one. A test that outlives ``--limit`` seconds ends the run with every rank's
stack (``faulthandler``). The last line counts the outcomes; the exit status is 1 if a
test failed. The module needs ``expecttest`` (``pip install expecttest``).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import fnmatch
import os
import shutil
import sys
import tempfile
import time
import traceback
import unittest
from typing import Any

from mpi4py import MPI

OUTCOMES = ("passed", "skipped", "failed")
FEATURES = ("ddp", "subgroup", "gpu", "plugin")
"""torch's lists of the backends that support a feature (``DistTestCases``), which
name ``mpitrain`` here."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patterns", nargs="*", default=["*"],
                        help="fnmatch patterns of the test names to run (default: all)")
    parser.add_argument("--skip", action="append", default=[],
                        help="fnmatch pattern of test names to leave out (repeatable)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="the default group's timeout, seconds (a collective that a "
                             "rank never calls raises after it)")
    parser.add_argument("--limit", type=float, default=150.0,
                        help="seconds a test may run before the run ends with every "
                             "rank's stack")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    scratch = world.bcast(tempfile.mkdtemp(prefix="torch-conformance-") if rank == 0
                          else None)
    if rank == 0:
        for name in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(scratch, name))
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    os.environ.update(BACKEND="mpitrain", WORLD_SIZE=str(world.Get_size()), TEMP_DIR=scratch,
                      INIT_METHOD="file://" + os.path.join(scratch, "init_dir", "unused"))
    try:
        return run(args, world, scratch)
    finally:
        world.Barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace, world: Any, scratch: str) -> int:
    import torch.distributed as dist
    from torch.testing._internal import common_distributed
    from torch.testing._internal.common_utils import TestCase

    import mpitrain.torch  # noqa: F401  (registers the backend)

    for feature in FEATURES:  # (read when the test module is imported)
        common_distributed.DistTestCases.backend_feature[feature].add("mpitrain")
    from torch.testing._internal.distributed import distributed_test

    class Tests(distributed_test.DistributedTest._DistTestBase, TestCase):  # type: ignore
        """What torch's own harness (``TestDistBackend``) gives the tests besides."""

        world_size = property(lambda self: os.environ["WORLD_SIZE"])  # (a string there too)
        init_method = property(lambda self: os.environ["INIT_METHOD"])

    def make_group() -> None:
        dist.init_process_group("mpitrain",
                                timeout=datetime.timedelta(seconds=args.timeout))

    rank = world.Get_rank()
    names = [n for n in sorted(dir(Tests)) if n.startswith("test_")
             and any(fnmatch.fnmatch(n, p) for p in args.patterns)
             and not any(fnmatch.fnmatch(n, p) for p in args.skip)]
    barriers = os.path.join(scratch, "barrier")
    counts = dict.fromkeys(OUTCOMES, 0)
    make_group()
    for name in names:
        if rank == 0:  # torch's file barrier of the test starts from nothing
            for entry in os.listdir(barriers):
                os.unlink(os.path.join(barriers, entry))
        distributed_test.Barrier.barrier_id = 0
        world.Barrier()
        began = time.monotonic()
        faulthandler.dump_traceback_later(args.limit, exit=True)
        outcome, detail = run_one(Tests(name), name, rank)
        faulthandler.cancel_dump_traceback_later()
        outcomes = world.allgather(OUTCOMES.index(outcome))
        worst = OUTCOMES[max(outcomes)]
        counts[worst] += 1
        if outcome == "failed":
            print(f"failed {name} on rank {rank}:\n{detail}", flush=True)
        world.Barrier()
        if rank == 0:
            why = f" ({detail})" if worst == "skipped" and detail else ""
            print(f"{worst} {name} {time.monotonic() - began:.1f} s{why}", flush=True)
        if worst == "failed":
            dist.destroy_process_group()
            make_group()
    dist.destroy_process_group()
    if rank == 0:
        print(" ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return 1 if counts["failed"] else 0


def run_one(test: Any, name: str, rank: int) -> tuple[str, str]:
    """Run one test on this rank: its outcome and the reason of a skip or the
    traceback of a failure."""
    test.rank = rank
    method = getattr(test, name)
    if getattr(method, "__unittest_skip__", False):
        return "skipped", getattr(method, "__unittest_skip_why__", "")
    try:
        test.setUp()
        try:
            method()
        finally:
            test.tearDown()
    except unittest.SkipTest as exc:
        return "skipped", str(exc)
    except SystemExit as exc:  # torch's decorators skip with an exit code
        return "skipped", skip_reason(exc.code)
    except BaseException:
        return "failed", traceback.format_exc()
    return "passed", ""


def skip_reason(code: Any) -> str:
    from torch.testing._internal.common_distributed import TEST_SKIPS
    for skip in TEST_SKIPS.values():
        if skip.exit_code == code:
            return str(skip.message)
    return f"exit code {code}"


if __name__ == "__main__":
    sys.exit(main())
