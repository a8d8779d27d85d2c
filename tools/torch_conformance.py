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

torch gates some tests to the backends it ships, by name (``all_to_all`` on CPU to
``mpi``; barrier timeouts, sparse ``all_reduce`` and batched CPU point-to-point to
``gloo``). ``--as mpi`` or ``--as gloo`` runs the module under that name: its gates and
the branches of its tests read the name, while every group it makes, the default one
included, is still an ``"mpitrain"`` group (``init_process_group`` and ``new_group``
given the name get ``"mpitrain"``). The tests of that backend's own API, which no other
backend has (:data:`NOT_OURS`), are left out then. ``--as mpi`` needs 3 ranks or more.

A test's outcome is the worst over the ranks: ``passed``, ``skipped`` (with torch's
reason) or ``failed`` (with each failed rank's traceback); after a failure, and after
a test that made the default group anew, every rank makes the default group anew, so
that what the test left in flight (or broke on purpose) cannot reach the next one. A test
that outlives ``--limit`` seconds ends the run with every rank's stack
(``faulthandler``). The last line counts the outcomes; the exit status is 1 if a
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
NOT_OURS = {
    "gloo": ("test_get_backend", "test_monitored_barrier*"),
    "mpi": ("test_get_backend",),
}
"""Under ``--as NAME``, the tests of NAME's own API (``get_backend`` returns
``"mpitrain"``; ``monitored_barrier`` is gloo's alone in torch), left out."""
FEATURES = ("ddp", "subgroup", "gpu", "plugin")
"""torch's lists of the backends that support a feature (``DistTestCases``), which
name ``mpitrain`` here."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patterns", nargs="*", default=["*"],
                        help="fnmatch patterns of the test names to run (default: all)")
    parser.add_argument("--as", dest="as_backend", choices=sorted(NOT_OURS), default=None,
                        help="run torch's tests as if the backend were named this (its "
                             "gates and branches); the groups stay mpitrain's")
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
    if args.as_backend == "mpi" and world.Get_size() < 3:
        parser.error("--as mpi needs 3 ranks or more: the subgroup tests that torch runs "
                     "for mpi at any world size use ranks 1 and 2")
    rank = world.Get_rank()
    scratch = world.bcast(tempfile.mkdtemp(prefix="torch-conformance-") if rank == 0
                          else None)
    if rank == 0:
        for name in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(scratch, name))
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    os.environ.update(BACKEND=args.as_backend or "mpitrain", WORLD_SIZE=str(world.Get_size()),
                      TEMP_DIR=scratch,
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

    if args.as_backend:
        args.skip += NOT_OURS[args.as_backend]
        for name in ("init_process_group", "new_group"):
            setattr(dist, name, _as_ours(getattr(dist, name), args.as_backend))

    def make_group() -> Any:
        dist.init_process_group("mpitrain",
                                timeout=datetime.timedelta(seconds=args.timeout))
        return dist.group.WORLD

    rank = world.Get_rank()
    names = [n for n in sorted(dir(Tests)) if n.startswith("test_")
             and any(fnmatch.fnmatch(n, p) for p in args.patterns)
             and not any(fnmatch.fnmatch(n, p) for p in args.skip)]
    barriers = os.path.join(scratch, "barrier")
    counts = dict.fromkeys(OUTCOMES, 0)
    made = make_group()
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
        # a test that failed, or one that made the default group anew (with a timeout
        # it then runs into on purpose), leaves the next one a group of its own
        if worst == "failed" or dist.group.WORLD is not made:
            if dist.is_initialized():
                dist.destroy_process_group()
            made = make_group()
    dist.destroy_process_group()
    if rank == 0:
        print(" ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return 1 if counts["failed"] else 0


def _as_ours(make: Any, alias: str) -> Any:
    """``make`` (``init_process_group``, ``new_group``) with a ``backend`` named ``alias``
    made an ``"mpitrain"`` group."""
    def made(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == alias:
            kwargs["backend"] = "mpitrain"
        return make(*args, **kwargs)
    return made


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
