"""The ``fusion`` case: many small async allreduces, one big one, and blocking calls.

``python -m benchmarks fusion [-b 10K -e 10K -f 2] [-t 100] [-n 20 -w 5 -d float32 -o sum]
[--prescale F]``

For each tensor size ``s`` from ``-b`` to ``-e`` and ``t`` tensors (``--tensors``),
three calls on the same crafted values are timed, out of place and (unless
``--no-inplace``) in place, all six interleaved in one run
(:func:`benchmarks.common.time_calls`: barrier before each run, order shuffled per repetition):

* ``fused``: ``t`` ``allreduce_async`` (``allreduce_async_``) calls of ``s`` bytes
  each, submitted back to back and then waited together, so that the engine packs
  them into fusion buffers;
* ``one buffer``: one blocking ``allreduce`` (``allreduce_``) of all ``t * s`` bytes
  in one array (out of place into a preallocated ``out=``);
* ``blocking``: ``t`` blocking calls of ``s`` bytes, one after another.

The table prints the three times (max over ranks of each rank's median) side by side
with ``fused/one`` (the cost of fusion over a buffer the caller packed himself),
``blocking/fused`` (what fusion saves over one call per tensor) and the mean number of
collectives the engine ran per fused call. Every call is verified exactly afterwards.
With ``--prescale F`` every call passes ``prescale_factor=F`` (a power of two, so that
the results stay exact: the reduction of the crafted values times ``F``, ``F**n`` for
``prod``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain import config

from .common import (
    DTYPE_ALIASES,
    DTYPES,
    OneRankParser,
    command_line,
    count_wrong,
    machine_info,
    parse_size,
    program_name,
    size_series,
    time_calls,
)
from .hooks import REDUCING_OPS, Array, Call, crafted, no_reset, poison, reduced, restore

CALLS = ("fused", "one buffer", "blocking")


@dataclass(frozen=True)
class FusionOptions:
    """The parsed command line of the fusion case."""

    sizes: list[int]
    tensors: int
    iters: int
    warmup: int
    dtype: np.dtype[Any]
    op: str
    json: str | None
    modes: list[bool]
    prescale: float = 1.0


@dataclass(frozen=True)
class FusionResult:
    """One row: the three times at one tensor size, and what fusion did."""

    size: int
    count: int
    tensors: int
    dtype: str
    op: str
    mode: str
    fused_us: float
    one_buffer_us: float
    blocking_us: float
    collectives_per_fused_call: float
    wrong: int

    @property
    def fused_over_one(self) -> float:
        """How many times one pre-packed buffer's time the fused calls take."""
        return self.fused_us / self.one_buffer_us

    @property
    def blocking_over_fused(self) -> float:
        """How many times faster the fused calls are than one blocking call per tensor."""
        return self.blocking_us / self.fused_us


def parse_args(argv: Sequence[str], quiet: bool = False) -> FusionOptions:
    """Parse and check the command line of ``python -m benchmarks fusion``."""
    p = OneRankParser(quiet, prog=f"{program_name()} fusion",
                      description="Time many small async allreduces (fused by the engine) "
                                  "against one allreduce of the same bytes and against "
                                  "blocking calls.")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("10K"),
                   help="smallest tensor size in bytes (default 10K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("10K"),
                   help="largest tensor size in bytes (default 10K)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the tensor size by this each step (default 2)")
    p.add_argument("-t", "--tensors", type=int, default=100,
                   help="tensors per fused call (default 100)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed runs (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed runs before timing (default 5)")
    p.add_argument("-d", "--datatype", default="float32", metavar="TYPE",
                   choices=sorted(DTYPES) + sorted(DTYPE_ALIASES))
    p.add_argument("-o", "--op", default="sum", choices=REDUCING_OPS)
    p.add_argument("--inplace", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the in-place variant (default: yes)")
    p.add_argument("--json", metavar="FILE", help="write the results to this JSON file")
    p.add_argument("--prescale", type=float, default=1.0, metavar="F",
                   help="prescale_factor of every call: a power of two, for float "
                        "datatypes (default 1)")
    a = p.parse_args(argv)
    try:
        sizes = size_series(a.minbytes, a.maxbytes, a.stepfactor)
    except ValueError as exc:
        p.error(str(exc))
    if a.tensors < 1 or a.iters < 1 or a.warmup_iters < 0:
        p.error(f"need -t >= 1, -n >= 1 and -w >= 0, got -t {a.tensors} -n {a.iters} "
                f"-w {a.warmup_iters}")
    dtype = DTYPES[DTYPE_ALIASES.get(a.datatype, a.datatype)]
    if a.prescale != 1.0 and (not a.prescale > 0 or math.frexp(a.prescale)[0] != 0.5
                              or dtype.kind in "iub"):
        p.error(f"--prescale {a.prescale} with -d {a.datatype}: give a power of two (0.5, "
                "0.25, 2) and a float datatype, so that the results stay exact")
    return FusionOptions(sizes, a.tensors, a.iters, a.warmup_iters, dtype, a.op, a.json,
                         [False, True] if a.inplace else [False], a.prescale)


def prepare(comm: mt.Communicator, data: Array, tensors: int, op: str,
            inplace: bool, prescale: float = 1.0) -> dict[str, Call]:
    """The three calls over ``data`` cut into ``tensors`` equal tensors, each with
    ``prescale_factor=prescale``.

    Out of place, the single buffer and the blocking calls write into preallocated
    ``out=`` arrays (poisoned before each run), as the harness's allreduce does.
    """
    count = data.size // tensors
    pieces = [data[i * count:(i + 1) * count].copy() for i in range(tensors)]
    if inplace:
        whole, singles = data.copy(), [p.copy() for p in pieces]

        def reset(arrays: list[Array]) -> Callable[[], None]:
            def run() -> None:
                for i, a in enumerate(arrays):
                    np.copyto(a, data[i * count:(i + 1) * count])
            return run

        def fused() -> list[Array]:
            handles = [comm.allreduce_async_(p, op=op, prescale_factor=prescale)
                       for p in pieces]
            for h in handles:
                h.wait()
            return pieces

        def blocking() -> list[Array]:
            for p in singles:
                comm.allreduce_(p, op=op, prescale_factor=prescale)
            return singles

        return {"fused": Call(fused, reset(pieces)),
                "one buffer": Call(lambda: comm.allreduce_(whole, op=op,
                                                           prescale_factor=prescale),
                                   restore(whole, data)),
                "blocking": Call(blocking, reset(singles))}
    whole_out = np.empty_like(data)
    outs = [np.empty_like(p) for p in pieces]

    def fused_out() -> list[Array]:
        handles = [comm.allreduce_async(p, op=op, prescale_factor=prescale) for p in pieces]
        return [h.wait() for h in handles]

    def blocking_out() -> list[Array]:
        for p, out in zip(pieces, outs):
            comm.allreduce(p, op=op, out=out, prescale_factor=prescale)
        return outs

    def poison_outs() -> None:
        for out in outs:
            poison(out)

    return {"fused": Call(fused_out, no_reset),
            "one buffer": Call(lambda: comm.allreduce(data, op=op, out=whole_out,
                                                      prescale_factor=prescale),
                               functools.partial(poison, whole_out)),
            "blocking": Call(blocking_out, poison_outs)}


def measure(opts: FusionOptions, nbytes: int, comm: mt.Communicator,
            world: MPI.Intracomm) -> list[FusionResult]:
    """Time and verify the three calls of each mode at one tensor size, all interleaved
    in one run (collective over ``world``): one result per mode."""
    rank, nranks = world.Get_rank(), world.Get_size()
    count = nbytes // opts.dtype.itemsize
    total = count * opts.tensors
    data = crafted(rank, 0, total, opts.dtype, opts.op)
    calls = {(name, inplace): call for inplace in opts.modes
             for name, call in prepare(comm, data, opts.tensors, opts.op, inplace,
                                       opts.prescale).items()}
    before = comm.async_stats().collectives
    times = time_calls(calls, opts.iters, opts.warmup, world.Barrier)
    expected = reduced(nranks, 0, total, opts.dtype, opts.op)
    if opts.prescale != 1.0:  # a power of two: exact
        factor = opts.prescale ** nranks if opts.op == "prod" else opts.prescale
        np.multiply(expected, factor, out=expected, casting="unsafe")
    wrong = np.array([count_wrong(call, expected) for call in calls.values()], np.int64)
    fused_runs = (opts.warmup + opts.iters + 1) * len(opts.modes)
    stats = np.array([statistics.median(t) for t in times.values()]
                     + [(comm.async_stats().collectives - before) / fused_runs])
    world.Allreduce(MPI.IN_PLACE, stats, MPI.MAX)
    world.Allreduce(MPI.IN_PLACE, wrong, MPI.SUM)
    median = dict(zip(calls, stats[:-1]))
    bad = dict(zip(calls, wrong))
    return [FusionResult(count * opts.dtype.itemsize, count, opts.tensors, str(opts.dtype),
                         opts.op, "in-place" if inplace else "out-of-place",
                         *(median[(name, inplace)] * 1e6 for name in CALLS),
                         float(stats[-1]), int(sum(bad[(name, inplace)] for name in CALLS)))
            for inplace in opts.modes]


HEADER = ("#{:>10} {:>8} {:>7} {:>9} {:>6} {:>12} | {:>11} {:>11} {:>11} | {:>9} {:>14} | "
          "{:>11} {:>6}")


def table_header(tensors: int) -> list[str]:
    """The column titles and units."""
    return [HEADER.format("size", "count", "tensors", "type", "redop", "mode", "fused",
                          "one buffer", f"{tensors} blocking", "fused/one", "blocking/fused",
                          "collectives", "#wrong"),
            HEADER.format("(B/tensor)", "", "", "", "", "", "(us)", "(us)", "(us)", "", "",
                          "/fused call", "")]


def table_row(r: FusionResult) -> str:
    """The line of one tensor size."""
    return HEADER.format(r.size, r.count, r.tensors, r.dtype, r.op, r.mode, f"{r.fused_us:.1f}",
                         f"{r.one_buffer_us:.1f}", f"{r.blocking_us:.1f}",
                         f"{r.fused_over_one:.2f}", f"{r.blocking_over_fused:.2f}",
                         f"{r.collectives_per_fused_call:.2f}", r.wrong).replace("#", " ", 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fusion case; 0 if every verified element was right, else 1."""
    args = list(sys.argv[2:] if argv is None else argv)
    world = MPI.COMM_WORLD.Dup()
    rank, nranks = world.Get_rank(), world.Get_size()
    opts = parse_args(args, quiet=rank != 0)
    comm = mt.Communicator(MPI.COMM_WORLD)
    command = command_line(["fusion", *args], nranks)
    machine = machine_info(world)
    settings = ", ".join(f"{s.name}={s.get()!r}" for s in (config.FUSION_THRESHOLD,
                                                          config.CYCLE_TIME_MS))
    if opts.prescale != 1.0:
        settings += f"; every call with prescale_factor={opts.prescale}"

    def emit(lines: Sequence[str]) -> None:
        if rank == 0:
            print("\n".join(lines), flush=True)

    emit([f"# mpitrain benchmark: fusion ({opts.tensors} tensors per call)",
          f"# command   : {command}",
          f"# MPI       : {machine['mpi_library']}",
          f"# ranks     : {nranks} on {', '.join(machine['hosts'])}, {machine['cpus']} cpus",
          f"# engine    : {settings}",
          f"# timing    : {opts.warmup} warm-up + {opts.iters} timed runs, the three calls "
          "interleaved, barrier before each; time = max over ranks of each rank's median",
          "#", *table_header(opts.tensors)])
    results = []
    for nbytes in opts.sizes:
        if nbytes // opts.dtype.itemsize == 0:
            continue
        rows = measure(opts, nbytes, comm, world)
        results += rows
        emit([table_row(r) for r in rows])
    wrong = sum(r.wrong for r in results)
    emit([f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"])
    if rank == 0 and opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"case": "fusion", "command": command, "machine": machine,
                       "settings": {**asdict(opts), "dtype": str(opts.dtype)},
                       "results": [asdict(r) for r in results]}, f, indent=1)
    comm.free()
    world.Free()
    return 1 if wrong else 0


__all__ = ["FusionOptions", "FusionResult", "main", "measure", "parse_args"]
