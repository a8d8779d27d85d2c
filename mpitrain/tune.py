"""``mpitrain-tune``: measure this cluster's crossovers and write a tuning file.

Run it under the launcher with the rank count (and placement) of the jobs to tune::

    mpitrain-run -np 8 mpitrain-tune -o tuning.json
    MPITRAIN_TUNING_FILE=tuning.json mpitrain-run -np 8 python train.py

For every collective and message size it times every algorithm this communicator can
run (the MPI library's own collective included), interleaved, and takes the median of
each rank's times, then the maximum over ranks (``MPI_Allreduce``), so every rank holds
the same table and picks the same winner. Neighbouring sizes with the same winner
merge into one :class:`~mpitrain.dispatch.selection.Rule` whose byte range ends
halfway (geometrically) between the last size it won and the first it lost. The rules
name this rank count (``min_ranks = max_ranks``); ``--append`` keeps an existing
file's rules for other rank counts, so one file can tune several job sizes. Rank 0
writes the file, with the measured times in its ``meta``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from .communicator import Communicator
from .config import parse_size
from .dispatch.selection import Rule, dump_rules, load_rules

TUNED = ("allreduce", "reduce_scatter", "allgather", "broadcast")


def _call(comm: Communicator, collective: str, algorithm: str, data: Any) -> Any:
    if collective == "allreduce":
        return comm.allreduce_(data, algorithm=algorithm)
    if collective == "reduce_scatter":
        return comm.reduce_scatter(data, algorithm=algorithm)
    if collective == "allgather":
        return comm.allgather(data, algorithm=algorithm)
    return comm.broadcast_(data, algorithm=algorithm)


def _elements(collective: str, nbytes: int, itemsize: int, size: int) -> int:
    """Elements of this rank's input for a call of ``nbytes`` (allgather: the result)."""
    count = max(1, nbytes // itemsize)
    return max(1, count // size) if collective == "allgather" else count


def measure(comm: Communicator, collective: str, sizes: Sequence[int], dtype: np.dtype[Any],
            iters: int, warmup: int) -> dict[int, dict[str, float]]:
    """Seconds per call of every algorithm at every size (identical on every rank).

    Collective over ``comm``.
    """
    names = comm.algorithms(collective)
    table: dict[int, dict[str, float]] = {}
    for nbytes in sizes:
        data = np.ones(_elements(collective, nbytes, dtype.itemsize, comm.size), dtype)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(warmup):
            for name in names:
                _call(comm, collective, name, data)
        for rep in range(iters):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                comm.mpi_comm.Barrier()
                start = time.perf_counter()
                _call(comm, collective, name, data)
                times[name].append(time.perf_counter() - start)
        medians = np.array([statistics.median(times[name]) for name in names])
        comm.mpi_comm.Allreduce(MPI.IN_PLACE, medians, MPI.MAX)
        table[nbytes] = dict(zip(names, medians.tolist()))
    return table


def rules_from(collective: str, table: dict[int, dict[str, float]], ranks: int,
               buffer: str = "numpy") -> list[Rule]:
    """One rule per run of sizes with the same fastest algorithm.

    The first rule starts at 0 bytes and the last has no upper end; a boundary lies
    at the geometric mean of the neighbouring measured sizes.
    """
    sizes = sorted(table)
    winners = [min(table[s], key=table[s].__getitem__) for s in sizes]
    rules: list[Rule] = []
    start = 0
    for i, (nbytes, winner) in enumerate(zip(sizes, winners)):
        if i + 1 < len(sizes) and winners[i + 1] == winner:
            continue
        end = math.isqrt(nbytes * sizes[i + 1]) if i + 1 < len(sizes) else Rule.max_bytes
        rules.append(Rule(collective, winner, min_bytes=start, max_bytes=end, min_ranks=ranks,
                          max_ranks=ranks, buffer=buffer))
        start = end
    return rules


def report(collective: str, table: dict[int, dict[str, float]], rules: Sequence[Rule]) -> list[str]:
    """What ``mpitrain-tune`` prints for one collective: per measured size the fastest
    algorithm and the runner-up with their times and the margin between them (how
    clear the choice was), then the rules written (the last one "and up")."""
    lines = [f"{collective}: per size, the fastest algorithm and the runner-up (times: max "
             "over ranks of each rank's median)",
             f"{'size (B)':>12}  {'fastest':<20}{'time (us)':>10}  {'runner-up':<20}"
             f"{'time (us)':>10}  margin"]
    for nbytes in sorted(table):
        ranked = sorted(table[nbytes].items(), key=lambda item: item[1])
        best, best_s = ranked[0]
        second, second_s = ranked[1] if len(ranked) > 1 else ("-", math.nan)
        margin = f"{(second_s / best_s - 1) * 100:+.0f}%" if len(ranked) > 1 and best_s else "-"
        lines.append(f"{nbytes:>12}  {best:<20}{best_s * 1e6:>10.2f}  {second:<20}"
                     f"{second_s * 1e6:>10.2f}  {margin}")
    for rule in rules:
        upper = "and up" if rule.max_bytes == Rule.max_bytes else f"{rule.max_bytes} B"
        lines.append(f"{collective} rule: {rule.min_bytes} B .. {upper}: {rule.algorithm}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``mpitrain-tune``."""
    p = argparse.ArgumentParser(
        prog="mpitrain-tune",
        description="Measure the fastest algorithm per collective and size on this "
                    "cluster and write a tuning file for MPITRAIN_TUNING_FILE. Run it with "
                    "the rank count of the jobs to tune.",
        epilog="Example: mpitrain-run -np 8 mpitrain-tune -o tuning.json; then "
               "MPITRAIN_TUNING_FILE=tuning.json mpitrain-run -np 8 python train.py")
    p.add_argument("-o", "--output", default="mpitrain-tuning.json",
                   help="tuning file to write (default mpitrain-tuning.json)")
    p.add_argument("--append", action="store_true",
                   help="keep the file's rules for other rank counts")
    p.add_argument("--collectives", default=",".join(TUNED),
                   help=f"comma list of collectives (default {','.join(TUNED)})")
    p.add_argument("-b", "--minbytes", type=parse_size, default=4, help="default 4")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="default 64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="default 4")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed calls per algorithm")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls per algorithm")
    p.add_argument("-d", "--dtype", default="float32", help="element type (default float32)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mpitrain-tune``; returns the exit status."""
    rank = MPI.COMM_WORLD.Get_rank()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in collectives if c not in TUNED]
    if bad or args.minbytes < 1 or args.maxbytes < args.minbytes or args.stepfactor < 2:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"mpitrain-tune: collectives are {', '.join(TUNED)}; need 1 <= -b <= -e and "
                  "-f >= 2", file=sys.stderr)
        return 2
    sizes = []
    nbytes = args.minbytes
    while nbytes <= args.maxbytes:
        sizes.append(nbytes)
        nbytes *= args.stepfactor
    comm = Communicator(MPI.COMM_WORLD)
    dtype = np.dtype(args.dtype)
    rules: list[Rule] = []
    measured: dict[str, dict[int, dict[str, float]]] = {}
    try:
        for collective in collectives:
            table = measure(comm, collective, sizes, dtype, args.iters, args.warmup)
            measured[collective] = table
            rules += rules_from(collective, table, comm.size)
            if rank == 0:
                print("\n".join(report(collective, table,
                                        rules_from(collective, table, comm.size))), flush=True)
    finally:
        comm.free()
    if rank == 0:
        if args.append and os.path.exists(args.output):
            rules = [r for r in load_rules(args.output)
                     if not (r.min_ranks <= comm.size <= r.max_ranks)] + rules
        meta = {"ranks": comm.size, "dtype": str(dtype),
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "mpi": MPI.Get_library_version().strip("\0 \n").splitlines()[0],
                "seconds_per_call": {c: {str(s): t for s, t in table.items()}
                                     for c, table in measured.items()}}
        dump_rules(rules, args.output, meta)
        print(f"mpitrain-tune: wrote {len(rules)} rules to {args.output}; use it with "
              f"MPITRAIN_TUNING_FILE={json.dumps(os.path.abspath(args.output))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
