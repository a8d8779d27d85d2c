"""Small-message latency: mpitrain's blocking allreduce and barrier against native MPI.

``mpitrain-run -np 2 python -m benchmarks.latency`` times, per size, ``comm.allreduce(x)``,
``comm.allreduce_(y)``, ``comm.allreduce_async(x).wait()`` (the async engine's round
trip: submission, negotiation, the run, the handle) and mpi4py's
``MPI.COMM_WORLD.Allreduce`` into a preallocated output, then ``comm.barrier()`` and
``MPI.COMM_WORLD.Barrier()``, interleaved (A B A B ...: one block of ``--iters`` calls
of each in turn, ``--blocks`` times), so that a disturbance of a shared machine hits
every variant alike. It prints the median time per call over the blocks and its ratio
to the native call (rank 0's clock). The ranks run on without meeting between blocks,
so a block may start while another rank is still in the last one; ``--in-step`` makes
them meet at an MPI barrier (not timed) before every block, as the ranks of a training
loop reach its collectives together. ``--hvd`` adds ``hvd.allreduce(t, op=hvd.Sum)`` of
:mod:`mpitrain.torch` on a CPU tensor of the same values (the Horovod adapter's blocking
call: the engine's round trip and the adapter's work around it; needs torch), and
``--dist`` ``torch.distributed.all_reduce(t)`` through the ``"mpitrain"`` process-group
backend (in place, one freshly filled tensor per call; the default group is made here
unless the process has one), and with it ``torch.distributed.barrier()`` and, per size,
``torch.distributed.all_to_all_single`` (the size is what each rank sends) against
mpi4py's ``Barrier`` and ``Alltoall``: calls that run MPI's own collective after the
group's meeting point in its order of calls and an exchange of the ranks' arguments.

Every allreduce is checked: the inputs are the crafted values of the collective
benchmark (:mod:`.hooks`), whose sum is known exactly, and before each block (not
timed) each variant is reset: the in-place call gets one freshly crafted buffer per
call of the block (reducing the same buffer again would sum sums), the others a
poisoned output. After the block every result of it is compared with the exact sum;
``#wrong`` is the number of wrong elements over every block and rank, and the process
exits with 1 if any was wrong.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt

from .common import program_name
from .hooks import crafted, poison, reduced

DTYPE = np.dtype(np.float32)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    p = argparse.ArgumentParser(prog=f"{program_name()} latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4,4096,16384",
                   help="message sizes in bytes of float32 (comma-separated)")
    p.add_argument("--blocks", type=int, default=200, help="blocks per variant")
    p.add_argument("--iters", type=int, default=20, help="calls per block")
    p.add_argument("--in-step", action="store_true",
                   help="the ranks meet at a barrier (not timed) before every block")
    p.add_argument("--hvd", action="store_true",
                   help="also time mpitrain.torch's hvd.allreduce (needs torch)")
    p.add_argument("--dist", action="store_true",
                   help="also time torch.distributed's all_reduce, all_to_all_single and "
                        "barrier over the mpitrain backend")
    return p.parse_args(argv)


@dataclass
class Case:
    """One timed variant: ``call`` is timed ``iters`` times in a row after ``reset``;
    ``wrong`` then counts the wrong elements of what those calls produced."""

    call: Callable[[int], Any]
    reset: Callable[[], None]
    wrong: Callable[[], int]


def allreduce_cases(comm: mt.Communicator, world: MPI.Intracomm, nbytes: int,
                    iters: int, hvd: bool = False, dist: bool = False) -> dict[str, Case]:
    """The four allreduce variants of one size (with ``hvd`` mpitrain.torch's, with
    ``dist`` torch.distributed's over the mpitrain backend), each checked against the
    exact sum."""
    count = max(nbytes // DTYPE.itemsize, 1)
    x = crafted(world.rank, 0, count, DTYPE, "sum")
    want = reduced(world.size, 0, count, DTYPE, "sum")
    size = f"{x.nbytes} B"

    def wrong(arrays: Sequence[np.ndarray[Any, Any]]) -> int:
        return sum(int(np.count_nonzero(a != want)) for a in arrays) + \
            int(np.count_nonzero(x != crafted(world.rank, 0, count, DTYPE, "sum")))

    results: list[Any] = [None] * iters  # what each call of the block returned

    def plain(i: int) -> None:
        results[i] = comm.allreduce(x)

    def forget() -> None:
        results[:] = [None] * iters

    engine_results: list[Any] = [None] * iters

    def waited(i: int) -> None:
        engine_results[i] = comm.allreduce_async(x).wait()

    def forget_waited() -> None:
        engine_results[:] = [None] * iters

    buffers = [np.empty_like(x) for _ in range(iters)]  # one per call: no sum of sums

    def in_place(i: int) -> None:
        comm.allreduce_(buffers[i])

    def reset_buffers() -> None:
        for b in buffers:
            np.copyto(b, x)

    z = np.empty_like(x)
    cases = {
        f"mpitrain allreduce {size}": Case(plain, forget, lambda: wrong(results)),
        f"mpitrain allreduce_ {size}": Case(in_place, reset_buffers, lambda: wrong(buffers)),
        f"mpitrain allreduce_async {size}": Case(waited, forget_waited,
                                                 lambda: wrong(engine_results)),
    }
    if hvd:
        cases[f"mpitrain.torch allreduce {size}"] = _hvd_case(x, want, iters)
    if dist:
        cases[f"torch.distributed all_reduce {size}"] = _dist_case(x, want, iters)
    cases[f"MPI Allreduce {size}"] = Case(lambda i: world.Allreduce(x, z), lambda: poison(z),
                                          lambda: wrong([z]))
    return cases


def _hvd_case(x: np.ndarray[Any, Any], want: np.ndarray[Any, Any], iters: int) -> Case:
    """``hvd.allreduce(t, op=hvd.Sum)`` of a CPU tensor holding ``x``; its results are
    compared with ``want`` (and ``t`` with ``x``: the call must leave it alone)."""
    import torch

    import mpitrain.torch as hvd

    hvd.init()
    t = torch.from_numpy(x.copy())
    results: list[Any] = [None] * iters

    def call(i: int) -> None:
        results[i] = hvd.allreduce(t, op=hvd.Sum)

    def forget() -> None:
        results[:] = [None] * iters

    def wrong() -> int:
        return sum(int(np.count_nonzero(r.numpy() != want)) for r in results) + \
            int(np.count_nonzero(t.numpy() != x))

    return Case(call, forget, wrong)


def _dist_case(x: np.ndarray[Any, Any], want: np.ndarray[Any, Any], iters: int) -> Case:
    """``torch.distributed.all_reduce(t)`` (in place, SUM) over the ``"mpitrain"``
    backend, one tensor per call filled with ``x`` before the block; compared with
    ``want``."""
    import torch
    import torch.distributed as torch_dist

    import mpitrain.torch  # noqa: F401  (registers the backend)

    if not torch_dist.is_initialized():
        torch_dist.init_process_group("mpitrain")
    tensors = [torch.from_numpy(x.copy()) for _ in range(iters)]

    def call(i: int) -> None:
        torch_dist.all_reduce(tensors[i])

    def refill() -> None:
        for t in tensors:
            t.copy_(torch.from_numpy(x))

    def wrong() -> int:
        return sum(int(np.count_nonzero(t.numpy() != want)) for t in tensors)

    return Case(call, refill, wrong)


def alltoall_cases(world: MPI.Intracomm, nbytes: int) -> dict[str, Case]:
    """``torch.distributed.all_to_all_single(out, x)`` over the ``"mpitrain"`` backend
    and mpi4py's ``Alltoall`` of the same ``nbytes`` per rank: rank ``r`` sends the value
    ``r * size + q`` to rank ``q``; each output is poisoned before a block and checked
    after it (the last call's)."""
    import torch
    import torch.distributed as torch_dist

    n, r = world.size, world.rank
    per = max(nbytes // DTYPE.itemsize // n, 1)
    x = np.repeat(np.arange(r * n, r * n + n, dtype=DTYPE), per)
    want = np.repeat(np.arange(r, n * n, n, dtype=DTYPE), per)
    out, native = np.empty_like(x), np.empty_like(x)
    t, t_out = torch.from_numpy(x), torch.from_numpy(out)
    size = f"{x.nbytes} B"
    return {
        f"torch.distributed all_to_all_single {size}": Case(
            lambda i: torch_dist.all_to_all_single(t_out, t), lambda: poison(out),
            lambda: int(np.count_nonzero(out != want))),
        f"MPI Alltoall {size}": Case(lambda i: world.Alltoall(x, native),
                                     lambda: poison(native),
                                     lambda: int(np.count_nonzero(native != want))),
    }


def barrier_cases(comm: mt.Communicator, world: MPI.Intracomm,
                  dist: bool = False) -> dict[str, Case]:
    """The barriers (nothing to check): mpitrain's, torch.distributed's over the
    mpitrain backend with ``dist``, MPI's."""
    cases = {"mpitrain barrier": Case(lambda i: comm.barrier(), no_op, lambda: 0)}
    if dist:
        import torch.distributed as torch_dist

        cases["torch.distributed barrier"] = Case(lambda i: torch_dist.barrier(), no_op,
                                                  lambda: 0)
    cases["MPI Barrier"] = Case(lambda i: world.Barrier(), no_op, lambda: 0)
    return cases


def no_op() -> None:
    """The reset of a call that produces nothing."""


def interleaved(cases: dict[str, Case], blocks: int, iters: int,
                meet: Callable[[], None] = lambda: None) -> tuple[dict[str, float],
                                                                 dict[str, int]]:
    """Median microseconds per call of each case, blocks of ``iters`` calls in turn, and
    the wrong elements each case produced over every block (this rank's); ``meet`` runs
    before every timed block (untimed)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    wrong = dict.fromkeys(cases, 0)
    for case in cases.values():  # warm-up: plans, caches, connections
        for _ in range(-(-100 // iters)):
            case.reset()
            for i in range(iters):
                case.call(i)
    clock = time.perf_counter_ns
    for _ in range(blocks):
        for name, case in cases.items():
            case.reset()
            meet()
            start = clock()
            for i in range(iters):
                case.call(i)
            times[name].append((clock() - start) / iters / 1e3)
            wrong[name] += case.wrong()
    return {k: statistics.median(v) for k, v in times.items()}, wrong


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; rank 0 prints one line per variant (``name us ratio #wrong``).

    Returns:
        0 if every result was right, else 1 (on every rank).
    """
    args = parse_args(argv)
    comm = mt.init()
    world = MPI.COMM_WORLD
    groups = [allreduce_cases(comm, world, int(s), args.iters, args.hvd, args.dist)
              for s in args.sizes.split(",")]
    if args.dist:
        groups += [alltoall_cases(world, int(s)) for s in args.sizes.split(",")]
    groups.append(barrier_cases(comm, world, args.dist))
    if world.rank == 0:
        print(f"# {world.size} ranks, median of {args.blocks} blocks of {args.iters} calls"
              f"{', the ranks meeting before each' if args.in_step else ''}; every allreduce "
              "and all-to-all result checked")
    total_wrong = 0
    for cases in groups:
        medians, wrong = interleaved(cases, args.blocks, args.iters,
                                     world.Barrier if args.in_step else (lambda: None))
        native = medians[list(cases)[-1]]
        bad = {name: world.allreduce(n, op=MPI.SUM) for name, n in wrong.items()}
        total_wrong += sum(bad.values())
        if world.rank == 0:
            for name, us in medians.items():
                print(f"{name:36s} {us:8.2f} us {us / native:6.2f}x  #wrong {bad[name]}")
    if world.rank == 0:
        print(f"# Out of bounds values : {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
    return 1 if total_wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
