"""The benchmark harness: one loop for every collective, modelled on nccl-tests.

For each byte size from ``-b`` to ``-e`` (times ``-f`` each step) the harness asks the
collective's hooks (:mod:`benchmarks.collectives`) for the element count, crafts this
rank's input and prepares one :class:`~benchmarks.hooks.Call` per implementation and
variant (out-of-place, in-place). Then, per size:

* *warm-up*: every call runs ``-w`` times;
* *timing*: ``-n`` repetitions, each running every call once, interleaved (A B A B,
  in an order drawn anew for each repetition, the same on every rank); a barrier
  precedes every run (device buffers: after the device has finished the reset of the
  run's buffers) and only the run is timed, with ``time.perf_counter``. Each rank
  takes the median (and the min, mean and max) of its own times; the time reported is the
  **maximum over ranks of each rank's median** (min, avg and max likewise: printed as a
  second table after the first, as OSU's benchmarks print them), so a size is as slow
  as its slowest rank;
* *verify*: every call runs once more from its crafted input and its result is
  compared exactly with the known one; ``#wrong`` is the number of wrong elements
  summed over ranks.

Before the warm-up every call runs once cold, measuring ``peak+``: the peak resident
memory it added (MiB, max over ranks; :mod:`.memory`), plan scratch included.

``algbw`` is size / time and ``busbw`` is algbw times the collective's bus factor, as
in nccl-tests. The header gives the machine's memory-copy bandwidth ``B`` and the bus
bandwidth bound of an algorithm that reads the other ranks' buffers directly
(``B / direct_traffic * bus factor``), so the distance to the hardware is visible.
Baselines: ``mpi`` (the MPI library's own collective) and ``gloo``
(torch.distributed, :mod:`.gloo`); ``torch-mpitrain`` is mpitrain reached through
torch.distributed (the same calls as the gloo column, on a group of mpitrain's backend),
as DDP and FSDP users reach it; ``torch-mpi`` (:mod:`.torch_mpi`) is the same
torch.distributed calls on a backend written in Python that calls MPI's own collective:
the least a Python backend costs, compared with ``torch-mpitrain``. mpitrain's
out-of-place calls are handed a
preallocated ``out=``, as MPI's are; ``--outputs given,alloc`` (the default) adds the
``[alloc]`` columns: the plain call (``comm.allreduce(x)``), which allocates its result
and pays the first touch of its pages, as a user's call does. ``--check on,off`` adds
mpitrain columns without cross-rank validation. The summary prints the per-call cost
of the Python layer at the smallest size (mpitrain minus native), of validation (on
minus off) and of allocating the result at the smallest and the largest size (alloc
minus given). Rank 0 prints the table; the process exits with 1 if any element was
wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.algorithms import ALGORITHMS
from mpitrain.dtypes import check_op_for_dtype
from mpitrain.errors import DtypeError
from mpitrain.ops import parse_op

from . import gloo, memory
from .arrays import ARRAYS, HostPlacement, Placement, PlacementError, placement_for
from .collectives import COLLECTIVES
from .common import (
    DTYPE_ALIASES,
    DTYPES,
    MIN_ITERS,
    Key,
    OneRankParser,
    command_line,
    count_wrong,
    format_size,
    machine_info,
    parse_size,
    program_name,
    size_series,
    time_calls,
)
from .hooks import NO_OP, NO_ROOT, REDUCING_OPS, Call, Case, Collective, mpi_datatype

IMPLS = ("mpitrain", "mpi", "gloo", "torch-mpitrain", "torch-mpi")
BASELINES = ("mpi", "gloo", "torch-mpi")
OURS = ("mpitrain", "torch-mpitrain")
"""The implementations each baseline is compared with (a ``baseline/ours`` ratio column;
``torch-mpi`` with ``torch-mpitrain`` only: both go through torch.distributed)."""
COMPARED = {"torch-mpi": ("torch-mpitrain",)}
"""Baselines compared with some of :data:`OURS` only."""
OVER_TORCH = {"gloo": "gloo", "torch-mpitrain": "mpitrain", "torch-mpi": "pympi"}
"""The implementations run through torch.distributed, with their group's backend."""
CHECKS = {"on": True, "off": False}
OUTPUTS = {"given": False, "alloc": True}
"""``--outputs``: mpitrain's out-of-place result in a preallocated ``out=``, or allocated
by the call (the ``[alloc]`` columns)."""


# -- options --------------------------------------------------------------------------
@dataclass(frozen=True)
class Impl:
    """One implementation column: mpitrain with one algorithm (validating or not, its
    out-of-place result preallocated or allocated by the call), or a baseline (MPI's
    own call, gloo)."""

    label: str
    kind: str
    algorithm: str
    check: bool = True
    allocates: bool = False


@dataclass(frozen=True)
class Options:
    """The parsed command line."""

    collective: Collective
    sizes: list[int]
    iters: int
    warmup: int
    dtype: np.dtype[Any]
    op: str
    root: int
    impls: list[Impl]
    algorithms: list[str]
    inplace: bool
    json: str | None
    plot: str | None
    budget: float = 0.0
    array: str = "numpy"

    @property
    def variants(self) -> list[bool]:
        """The in-place flags measured: out-of-place, then in-place unless disabled."""
        return [False, True] if self.inplace else [False]


def _comma_list(text: str) -> list[str]:
    return list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def make_impls(names: Sequence[str], algorithms: Sequence[str],
               checks: Sequence[bool] = (True,),
               allocations: Sequence[bool] = (False,)) -> list[Impl]:
    """Expand ``--impl`` by ``--algorithm``, ``--check`` and ``--outputs``: one
    ``mpitrain`` column per algorithm, validation setting and output.

    A single ``auto`` algorithm keeps the plain label ``mpitrain``; otherwise each
    column is labelled ``mpitrain:<algorithm>``; columns without validation end in
    ``[nocheck]``, those of the plain call that allocates its result in ``[alloc]``.
    """
    impls = []
    for name in names:
        if name != "mpitrain":  # a baseline, or mpitrain through torch.distributed
            impls.append(Impl(name, name, name))
            continue
        for check in checks:
            for allocates in allocations:
                for algorithm in algorithms:
                    label = "mpitrain" if list(algorithms) == ["auto"] \
                        else f"mpitrain:{algorithm}"
                    label += ("" if check else "[nocheck]") + ("[alloc]" if allocates else "")
                    impls.append(Impl(label, "mpitrain", algorithm, check, allocates))
    return impls


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks``."""
    prog = program_name()
    p = OneRankParser(
        quiet, prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time and verify mpitrain collectives against MPI's own, nccl-tests "
                    "style, on every rank of an MPI job.",
        epilog=f"Example:\n  mpitrain-run -np 2 {prog} allreduce -b 8 -e 64M --impl mpitrain,mpi"
               f"\n\nThe other benchmarks of {prog}:\n"
               f"  {prog} fusion -h    fused async allreduces against one buffer and "
               "blocking calls\n"
               f"  {prog} train -h     training steps against torch DDP (needs torch)\n"
               f"  {prog} latency -h   small-message latency against native MPI")
    p.add_argument("collective", choices=sorted(COLLECTIVES),
                   help="the collective; 'python -m benchmarks fusion -h' for the fusion case")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                   help="smallest size in bytes (K/M/G suffixes; default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                   help="largest size in bytes (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this each step (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed runs per size and implementation (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed runs before timing (default 5)")
    p.add_argument("-d", "--datatype", default="float32", metavar="TYPE",
                   choices=sorted(DTYPES) + sorted(DTYPE_ALIASES),
                   help=f"one of {', '.join(sorted(DTYPES))} or the nccl-tests names "
                        f"{', '.join(sorted(DTYPE_ALIASES))} (default float32)")
    p.add_argument("-o", "--op", default="sum", choices=REDUCING_OPS,
                   help="reduction of allreduce and reduce_scatter (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast (default 0)")
    p.add_argument("--impl", type=_comma_list, default=["mpitrain", "mpi"],
                   help="comma list of implementations: mpitrain, mpi, gloo, "
                        "torch-mpitrain (mpitrain's torch.distributed backend), torch-mpi "
                        "(a Python torch.distributed backend calling MPI's own collective); "
                        "gloo and the torch- ones need torch; default mpitrain,mpi")
    p.add_argument("--check", type=_comma_list, default=["on"],
                   help="comma list of mpitrain's cross-rank validation settings, one set of "
                        "columns each: on, off (default on)")
    p.add_argument("--outputs", type=_comma_list, default=["given", "alloc"],
                   help="comma list of how mpitrain's out-of-place calls get their result, "
                        "one set of columns each: given (a preallocated out=, as MPI's calls "
                        "get), alloc (the plain call, which allocates its result: columns "
                        "[alloc]); default given,alloc")
    p.add_argument("--algorithm", type=_comma_list, default=["auto"],
                   help="comma list of mpitrain algorithms, one column each (default auto)")
    p.add_argument("--budget", type=float, default=0.0, metavar="SECONDS",
                   help="time a size with fewer runs (at least 3) where -n runs of every "
                        "call would take longer than this (default 0: always -n)")
    p.add_argument("--inplace", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the in-place variant (default: yes)")
    p.add_argument("--array", choices=ARRAYS, default="numpy",
                   help="buffers in host memory (numpy, default) or on the GPU (cupy: "
                        "also times a device-to-device copy of each size)")
    p.add_argument("--json", metavar="FILE", help="write every result to this JSON file")
    p.add_argument("--plot", metavar="FILE.png", help="plot bus bandwidth against size")
    return p


def installed(module: str) -> bool:
    """True if ``module`` can be imported (checked before measuring, on every rank alike)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or blocked in sys.modules
        return False


def parse_args(argv: Sequence[str], nranks: int, quiet: bool = False) -> Options:
    """Parse and check a command line for a run on ``nranks`` ranks."""
    parser = build_parser(quiet)
    a = parser.parse_args(argv)
    collective = COLLECTIVES[a.collective]
    try:
        sizes = size_series(a.minbytes, a.maxbytes, a.stepfactor)
    except ValueError as exc:
        parser.error(str(exc))
    if a.iters < 1 or a.warmup_iters < 0:
        parser.error(f"need -n >= 1 and -w >= 0, got -n {a.iters} -w {a.warmup_iters}")
    unknown = [name for name in a.impl if name not in IMPLS]
    if unknown or not a.impl:
        parser.error(f"--impl takes a comma list of {', '.join(IMPLS)}, got {a.impl}")
    over_torch = [name for name in a.impl if name in OVER_TORCH]
    if over_torch and not gloo.available():
        parser.error(f"--impl {','.join(over_torch)} needs torch: pip install torch==2.13.0")
    if over_torch and a.array != "numpy":
        parser.error(f"--impl {','.join(over_torch)} runs on host buffers only (--array numpy)")
    if not a.check or any(c not in CHECKS for c in a.check):
        parser.error(f"--check takes a comma list of on, off; got {','.join(a.check)}")
    if not a.outputs or any(o not in OUTPUTS for o in a.outputs):
        parser.error(f"--outputs takes a comma list of given, alloc; got {','.join(a.outputs)}")
    offered = ("auto",) + ALGORITHMS[collective.name]
    bad = [name for name in a.algorithm if name not in offered]
    if bad or not a.algorithm:
        parser.error(f"mpitrain's {collective.name} offers the algorithms "
                     f"{', '.join(offered)}; got --algorithm {','.join(a.algorithm)}")
    dtype = DTYPES[DTYPE_ALIASES.get(a.datatype, a.datatype)]
    op = a.op if collective.reduces else NO_OP
    if collective.reduces:
        try:
            check_op_for_dtype(parse_op(op), dtype)
        except DtypeError as exc:
            parser.error(str(exc))
    if collective.rooted and not 0 <= a.root < nranks:
        parser.error(f"-r {a.root} is not a rank; use 0..{nranks - 1}")
    if a.plot and not installed("matplotlib"):
        parser.error("--plot needs matplotlib: pip install matplotlib")
    return Options(collective=collective, sizes=sizes, iters=a.iters, warmup=a.warmup_iters,
                   dtype=dtype, op=op, root=a.root if collective.rooted else NO_ROOT,
                   impls=make_impls(a.impl, a.algorithm, [CHECKS[c] for c in a.check],
                                    [OUTPUTS[o] for o in a.outputs]),
                   algorithms=a.algorithm,
                   inplace=a.inplace, json=a.json, plot=a.plot, budget=a.budget,
                   array=a.array)


@dataclass(frozen=True)
class Result:
    """One cell group of the table: a size measured by one implementation and variant."""

    size: int
    count: int
    dtype: str
    op: str
    root: int
    impl: str
    inplace: bool
    time_us: float
    time_min_us: float
    time_max_us: float
    algbw: float
    busbw: float
    wrong: int
    extra_mib: float = memory.UNKNOWN
    runs: int = 0
    time_avg_us: float = 0.0

    @property
    def key(self) -> Key:
        """The column group of this result."""
        return (self.impl, self.inplace)


def measure(opts: Options, case: Case, comm: mt.Communicator, world: MPI.Intracomm,
            unchecked: mt.Communicator | None = None, dists: Mapping[str, Any] | None = None,
            placement: Placement | None = None) -> list[Result]:
    """Measure memory, warm up, time and verify every implementation and variant at one size.

    Collective over ``world``; every rank returns the same results. ``unchecked`` runs
    the ``[nocheck]`` columns, ``dists`` (per implementation of :data:`OVER_TORCH`,
    torch.distributed or an :class:`.gloo.OnGroup`) the ones through torch.distributed.
    With device buffers (``placement``), ``mpi`` is MPI's own collective reached
    through mpitrain's ``mpi`` algorithm, which passes device pointers or stages whole
    buffers as this MPI library requires (:mod:`.arrays`).
    """
    coll = opts.collective
    placement = placement or HostPlacement()
    data = placement.put(coll.make_input(case))
    calls: dict[Key, Call] = {}
    for inplace in opts.variants:
        for impl in opts.impls:
            if impl.kind == "mpitrain" or (placement.is_device and impl.kind == "mpi"):
                ours = comm if impl.check else unchecked
                assert ours is not None, "a [nocheck] column needs a communicator without checks"
                call = coll.mpitrain(ours, impl.algorithm, case, data, inplace, impl.allocates)
            elif impl.kind in OVER_TORCH:
                assert dists is not None, f"the {impl.kind} column needs its process group"
                call = coll.dist(dists[impl.kind], case, data, inplace)
            else:
                call = coll.mpi(world, case, data, inplace)
            if call is not None:
                calls[(impl.label, inplace)] = call
    extra = np.zeros(len(calls))
    for i, call in enumerate(calls.values()):
        call.reset()
        placement.settle()
        world.Barrier()
        extra[i] = memory.peak_extra(call.run)
    times = time_calls(calls, opts.iters, opts.warmup, world.Barrier, opts.budget,
                       lambda t: world.allreduce(t, op=MPI.MAX), placement.settle)
    expected = coll.expected(case)
    wrong = np.array([count_wrong(call, expected, placement.get) for call in calls.values()],
                     dtype=np.int64)
    stats = np.array([[statistics.median(t), min(t), max(t), statistics.fmean(t)]
                      for t in times.values()])
    world.Allreduce(MPI.IN_PLACE, stats, MPI.MAX)
    world.Allreduce(MPI.IN_PLACE, extra, MPI.MAX)
    world.Allreduce(MPI.IN_PLACE, wrong, MPI.SUM)
    size = coll.size(case.count, case.dtype.itemsize, case.nranks)
    factor = coll.bus_factor(case.nranks)
    results = []
    for (label, inplace), (median, fastest, slowest, mean), bad, mib in zip(calls, stats, wrong,
                                                                             extra):
        algbw = size / median / 1e9
        results.append(Result(size, case.count, str(case.dtype), case.op, case.root, label,
                              inplace, median * 1e6, fastest * 1e6, slowest * 1e6, algbw,
                              algbw * factor, int(bad), float(mib),
                              len(times[(label, inplace)]), mean * 1e6))
    return results


# -- the table ------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    """A table column: title, unit line and width."""

    title: str
    unit: str
    width: int


_FIXED = (Column("size", "(B)", 12), Column("count", "(elements)", 12), Column("type", "", 9),
          Column("redop", "", 6), Column("root", "", 5))
_PER_IMPL = (Column("time", "(us)", 10), Column("algbw", "(GB/s)", 8),
             Column("busbw", "(GB/s)", 8), Column("#wrong", "", 6), Column("peak+", "(MiB)", 8))
_NA = "N/A"


def ratio_pairs(impls: Sequence[Impl]) -> list[tuple[str, str]]:
    """``(baseline label, mpitrain label)`` for each ``baseline/mpitrain`` ratio column."""
    return [(b.label, i.label) for b in impls if b.kind in BASELINES for i in impls
            if i.kind in COMPARED.get(b.kind, OURS)]


class Table:
    """nccl-tests' table: fixed columns, then per variant a column group per
    implementation and the ``mpi/mpitrain`` time ratios (>1: mpitrain is faster)."""

    def __init__(self, impls: Sequence[Impl], variants: Sequence[bool],
                 trailing: Sequence[Column] = ()) -> None:
        self.trailing = list(trailing)
        self.labels = [i.label for i in impls]
        self.variants = list(variants)
        self.ratios = ratio_pairs(impls)
        self.ratio_columns = [Column(f"{a}/{b}", "", max(len(f"{a}/{b}"), 6))
                              for a, b in self.ratios]

    def header(self) -> list[str]:
        """The four header lines: variant, implementation, titles, units."""
        spans_variant, spans_impl = [], []
        fixed_width = sum(c.width + 1 for c in _FIXED)
        impl_width = sum(c.width + 1 for c in _PER_IMPL)
        ratio_width = sum(c.width + 1 for c in self.ratio_columns)
        for inplace in self.variants:
            spans_variant.append(("in-place" if inplace else "out-of-place")
                                 .center(impl_width * len(self.labels) + ratio_width))
            spans_impl.append("".join(label.center(impl_width) for label in self.labels)
                              + " " * ratio_width)
        columns = self.columns()
        return ["#" + " " * fixed_width + "".join(spans_variant).rstrip(),
                "#" + " " * fixed_width + "".join(spans_impl).rstrip(),
                "#" + "".join(f"{c.title:>{c.width}} " for c in columns).rstrip(),
                "#" + "".join(f"{c.unit:>{c.width}} " for c in columns).rstrip()]

    def columns(self) -> list[Column]:
        """Every column, left to right."""
        group = list(_PER_IMPL) * len(self.labels) + self.ratio_columns
        return list(_FIXED) + group * len(self.variants) + self.trailing

    def row(self, results: Sequence[Result], trailing: Sequence[str] = ()) -> str:
        """The line of one size; a missing implementation or variant prints N/A.

        ``trailing`` fills the trailing columns (the device copy bandwidth)."""
        first = results[0]
        by_key = {r.key: r for r in results}
        cells = [str(first.size), str(first.count), first.dtype, first.op, str(first.root)]
        for inplace in self.variants:
            for label in self.labels:
                r = by_key.get((label, inplace))
                cells += ([f"{r.time_us:.2f}", f"{r.algbw:.3f}", f"{r.busbw:.3f}", str(r.wrong),
                           f"{r.extra_mib:.1f}" if r.extra_mib >= 0 else _NA]
                          if r else [_NA] * len(_PER_IMPL))
            for mpi_label, ours in self.ratios:
                native, mine = by_key.get((mpi_label, inplace)), by_key.get((ours, inplace))
                cells.append(f"{native.time_us / mine.time_us:.2f}" if native and mine else _NA)
        cells += list(trailing)
        return " " + "".join(f"{cell:>{c.width}} " for cell, c in zip(cells, self.columns())) \
            .rstrip()

    def spread(self, results: Sequence[Result]) -> list[str]:
        """The table of the timed runs' spread, as OSU's benchmarks print it: per size,
        per implementation and variant, ``min/avg/median/max`` (us; each the maximum over
        ranks of a rank's own)."""
        keys = [(label, inplace) for inplace in self.variants for label in self.labels]
        by_size: dict[int, dict[Key, Result]] = {}
        for r in results:
            by_size.setdefault(r.size, {})[r.key] = r
        rows = []
        for size, found in by_size.items():
            cells = [str(size)]
            for key in keys:
                r = found.get(key)
                cells.append(f"{r.time_min_us:.1f}/{r.time_avg_us:.1f}/{r.time_us:.1f}/"
                             f"{r.time_max_us:.1f}" if r else _NA)
            rows.append(cells)
        titles = ["size (B)"] + [f"{label}{' in-place' if inplace else ''}"
                                 for label, inplace in keys]
        widths = [max(len(c) for c in column) for column in zip(titles, *rows)]
        return ["# Spread of the timed runs (us): min/avg/median/max, each the max over "
                "ranks of a rank's own",
                "#" + " ".join(f"{t:>{w}}" for t, w in zip(titles, widths)),
                *("#" + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
                  for cells in rows)]

    def summary(self, results: Sequence[Result]) -> list[str]:
        """nccl-tests' closing lines: wrong elements and average bus bandwidth."""
        wrong = sum(r.wrong for r in results)
        averages = "  ".join(f"{label} {avg:.3f}" for label, avg in average_busbw(results,
                                                                                  self.labels))
        return [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
                f"# Avg bus bandwidth    : {averages}  (GB/s, mean over sizes and variants)",
                *overhead_lines(results)]


SMALL_BYTES = 4096
"""Largest smallest size at which the time difference to native MPI is reported as the
per-call cost of mpitrain's Python layer (above, moving the data dominates the time)."""


def overhead_lines(results: Sequence[Result]) -> list[str]:
    """The per-call cost of mpitrain's Python layer and of its validation, at the
    smallest size (``mpitrain - mpi`` and ``mpitrain - mpitrain[nocheck]``), and of
    allocating the result at the smallest and the largest size
    (``mpitrain[alloc] - mpitrain``)."""
    if not results:
        return []
    smallest = min(r.size for r in results)
    times = {r.impl: r.time_us for r in results if r.size == smallest and not r.inplace}
    lines = []
    if "mpitrain" in times and "mpi" in times and smallest <= SMALL_BYTES:
        lines.append(f"# Per-call cost at {smallest} B : mpitrain {times['mpitrain']:.2f} us = "
                     f"native {times['mpi']:.2f} us {times['mpitrain'] - times['mpi']:+.2f} us "
                     f"({times['mpitrain'] / times['mpi']:.2f}x native)")
    elif "mpitrain" in times and "mpi" in times:  # moving the data dominates: no per-call cost
        lines.append(f"# Smallest size, {smallest} B : mpitrain {times['mpitrain']:.2f} us, "
                     f"native {times['mpi']:.2f} us ({times['mpitrain'] / times['mpi']:.2f}x "
                     f"native); the per-call cost shows at sizes up to {SMALL_BYTES} B (-b 8)")
    if "mpitrain" in times and "mpitrain[nocheck]" in times:
        lines.append(f"# Validation at {smallest} B   : "
                     f"{times['mpitrain'] - times['mpitrain[nocheck]']:+.2f} us per call "
                     f"(on {times['mpitrain']:.2f} us, off {times['mpitrain[nocheck]']:.2f} us)")
    allocation = []
    for size in sorted({smallest, max(r.size for r in results)}):
        at = {r.impl: r.time_us for r in results if r.size == size and not r.inplace}
        if "mpitrain" in at and "mpitrain[alloc]" in at:
            allocation.append(f"{at['mpitrain[alloc]'] - at['mpitrain']:+.2f} us at {size} B "
                              f"({at['mpitrain[alloc]']:.2f} us, given out= "
                              f"{at['mpitrain']:.2f} us)")
    if allocation:
        lines.append(f"# Allocating the result : {'; '.join(allocation)} per call")
    return lines


def direct_bound(collective: Collective, nranks: int, copy_gbps: float) -> float:
    """Bus bandwidth (GB/s) of an algorithm that reads the other ranks' buffers directly
    and runs at the machine's copy bandwidth: ``B / traffic * bus factor``."""
    if nranks < 2:
        return 0.0
    return copy_gbps / collective.direct_traffic(nranks) * collective.bus_factor(nranks)


def average_busbw(results: Sequence[Result], labels: Sequence[str]) -> list[tuple[str, float]]:
    """Mean bus bandwidth of each implementation over every size and variant it ran."""
    out = []
    for label in labels:
        values = [r.busbw for r in results if r.impl == label]
        out.append((label, sum(values) / len(values) if values else 0.0))
    return out


# -- reproducibility: header, JSON, plot ----------------------------------------------
def header_block(opts: Options, command: str, machine: dict[str, Any],
                 arrays: str = "numpy (host memory)") -> list[str]:
    """The lines that say what ran where, above the table."""
    algorithms = ",".join(opts.algorithms) if any(i.kind == "mpitrain" for i in opts.impls) \
        else "-"
    versions = (f"python {machine['python']}, numpy {machine['numpy']}, "
                f"mpi4py {machine['mpi4py']}, mpitrain {machine['mpitrain']}")
    runs = f"{opts.iters}" + (f" (fewer, >= {MIN_ITERS}, where they exceed "
                              f"{opts.budget:g} s)" if opts.budget else "")
    timing = (f"{opts.warmup} warm-up + {runs} timed runs per size, implementations "
              "interleaved, barrier before each run; time = max over ranks of each rank's "
              "median")
    native = "mpi4py's calls on a Dup of COMM_WORLD"
    if opts.array != "numpy":
        native = ("MPI's own collective on the device buffers (mpitrain's mpi algorithm: "
                  "device pointers if CUDA-aware, else whole-buffer pinned host copies); "
                  "d2d = device-to-device copy of the same bytes, the single-GPU bound")
    elif opts.collective.reduces and not mpi_datatype(opts.dtype).is_predefined:
        native += f", reducing {opts.dtype} with a user-defined MPI op (numpy)"
    if any(i.kind == "gloo" for i in opts.impls):
        native += "; gloo = torch.distributed's gloo backend"
    if any(i.kind == "torch-mpitrain" for i in opts.impls):
        native += ("; torch-mpitrain = the same torch.distributed calls on a group of "
                   "mpitrain's backend")
    if any(i.kind == "torch-mpi" for i in opts.impls):
        native += ("; torch-mpi = the same torch.distributed calls on a Python backend that "
                   "calls MPI's own collective (benchmarks/torch_mpi.py)")
    lines = [
        f"# mpitrain benchmark: {opts.collective.name}",
        f"# command   : {command}",
        f"# MPI       : {machine['mpi_library']}",
        f"# ranks     : {machine['ranks']} on {', '.join(machine['hosts'])}",
        f"# versions  : {versions}",
        f"# arrays    : {arrays}",
        f"# algorithm : mpitrain {algorithms}; mpi = {native}",
        f"# date      : {machine['date']}",
        f"# timing    : {timing}",
    ]
    if "copy_gbps_all" in machine:
        bound = direct_bound(opts.collective, machine["ranks"], machine["copy_gbps_all"])
        lines.append(f"# memory    : copy bandwidth (read + written) "
                     f"{machine['copy_gbps_one']:.1f} GB/s one rank, "
                     f"{machine['copy_gbps_all']:.1f} GB/s all ranks at once; "
                     f"direct-read busbw bound {bound:.2f} GB/s; peak+ = extra resident MiB "
                     "of a cold call")
    if "host_path" in machine:
        lines.append(f"# host path : {machine['host_path']}")
    return [*lines, "#"]


def host_path(comm: mt.Communicator) -> str:
    """How mpitrain's host data moves inside the node: shared memory, and whether the
    ranks read each other's buffers directly (the single_copy algorithm)."""
    shm = comm.dispatcher.shm
    if shm is None:
        return "no shared memory (several nodes, MPITRAIN_SHM=0 or one rank)"
    if shm.single_copy:
        return "shared memory; single copy (process_vm_readv) on"
    return f"shared memory; single copy off: {shm.single_copy_reason}"


def write_json(path: str, opts: Options, command: str, machine: dict[str, Any],
               results: Sequence[Result], extra: dict[str, Any] | None = None) -> None:
    """Save the run: command, machine, settings, every result and the summary."""
    labels = [i.label for i in opts.impls]
    doc = {
        "collective": opts.collective.name,
        "command": command,
        "machine": machine,
        "settings": {"sizes": opts.sizes, "iters": opts.iters, "warmup": opts.warmup,
                     "dtype": str(opts.dtype), "op": opts.op, "root": opts.root,
                     "impls": labels, "algorithms": opts.algorithms,
                     "outputs": sorted({"alloc" if i.allocates else "given"
                                        for i in opts.impls if i.kind == "mpitrain"}),
                     "inplace": opts.inplace, "budget_s": opts.budget},
        "timing": "time_us = max over ranks of each rank's median of the timed runs; "
                  "time_min_us/time_avg_us/time_max_us = max over ranks of each rank's "
                  "min/mean/max",
        "results": [asdict(r) for r in results],
        "summary": {"wrong": sum(r.wrong for r in results),
                    "avg_busbw": dict(average_busbw(results, labels))},
        **(extra or {}),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def write_plot(path: str, opts: Options, machine: dict[str, Any],
               results: Sequence[Result]) -> None:
    """Plot bus bandwidth against size (log x): a colour per implementation, a solid line
    out-of-place and a dashed one in place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8, 5))
    for inplace in opts.variants:
        for index, impl in enumerate(opts.impls):
            points = [(r.size, r.busbw) for r in results if r.key == (impl.label, inplace)]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, color=f"C{index}", marker="o", linestyle="--" if inplace else "-",
                        label=f"{impl.label} ({'in-place' if inplace else 'out-of-place'})")
    if "copy_gbps_all" in machine and machine["ranks"] > 1:
        bound = direct_bound(opts.collective, machine["ranks"], machine["copy_gbps_all"])
        ax.axhline(bound, color="grey", linestyle=":",
                   label=f"direct-read bound ({machine['copy_gbps_all']:.0f} GB/s copy)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(int(x))))
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"{opts.collective.name}, {opts.dtype}"
                 + (f" {opts.op}" if opts.collective.reduces else "")
                 + f", {machine['ranks']} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# -- main -----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark described by ``argv`` (default ``sys.argv[1:]``).

    Returns:
        0 if every verified element was right, else 1.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    nranks, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    opts = parse_args(args, nranks, quiet=rank != 0)
    comm = mt.Communicator(MPI.COMM_WORLD, check=True)
    unchecked = mt.Communicator(MPI.COMM_WORLD, check=False) \
        if any(i.kind == "mpitrain" and not i.check for i in opts.impls) else None
    world = MPI.COMM_WORLD.Dup()
    kinds = {i.kind for i in opts.impls}
    groups = gloo.groups(world, "gloo" in kinds, "torch-mpitrain" in kinds,
                         "torch-mpi" in kinds)
    dists = {kind: gloo.OnGroup(groups[backend]) for kind, backend in OVER_TORCH.items()
             if backend in groups}

    def emit(lines: Sequence[str]) -> None:
        if rank == 0:
            print("\n".join(lines), flush=True)

    try:
        placement = placement_for(opts.array, comm.local_rank, world)
    except PlacementError as exc:
        if rank == 0:
            print(f"python -m benchmarks: error: {exc}", file=sys.stderr, flush=True)
        world.Free()
        comm.free()
        return 2
    command = command_line(args, nranks)
    machine = machine_info(world)
    machine["copy_gbps_one"], machine["copy_gbps_all"] = memory.copy_bandwidth(world)
    machine["host_path"] = host_path(comm)
    copies = placement.is_device
    table = Table(opts.impls, opts.variants, [Column("d2d", "(GB/s)", 8)] if copies else ())
    emit(header_block(opts, command, machine, placement.describe(comm)) + table.header())
    results: list[Result] = []
    copy_bandwidth: list[dict[str, float]] = []
    itemsize = opts.dtype.itemsize
    for nbytes in opts.sizes:
        count = opts.collective.count(nbytes, itemsize, nranks)
        if count == 0:
            continue
        case = Case(count, opts.dtype, opts.op, opts.root, rank, nranks)
        row = measure(opts, case, comm, world, unchecked, dists, placement)
        trailing = []
        if copies:
            size = row[0].size
            seconds = world.allreduce(placement.copy_seconds(size, opts.iters, opts.warmup),
                                      MPI.MAX)
            copy_bandwidth.append({"size": size, "time_us": seconds * 1e6,
                                   "gbps": size / seconds / 1e9})
            trailing = [f"{copy_bandwidth[-1]['gbps']:.1f}"]
        emit([table.row(row, trailing)])
        results += row
    emit(["#", *table.spread(results), "#", *table.summary(results)])
    if rank == 0:
        if opts.json:
            extra = {"device_copy": copy_bandwidth} if copies else None
            write_json(opts.json, opts, command, machine, results, extra)
        if opts.plot:
            write_plot(opts.plot, opts, machine, results)
    if groups:
        gloo.finish()
    world.Free()
    comm.free()
    if unchecked is not None:
        unchecked.free()
    return 1 if any(r.wrong for r in results) else 0
