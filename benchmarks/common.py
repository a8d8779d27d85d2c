"""What the benchmarks share: the collective harness (:mod:`.harness`), the fusion case
(:mod:`.fusion`) and the training case (:mod:`.train`) build on it, and it imports none.

* the dtypes ``-d`` takes (:data:`DTYPES`, :data:`DTYPE_ALIASES`);
* byte sizes: :func:`parse_size`, :func:`format_size`, :func:`size_series`;
* :class:`OneRankParser`, an argument parser that prints on rank 0 only;
* interleaved timing (:func:`time_calls`, :data:`MIN_ITERS`) and exact verification
  (:func:`count_wrong`);
* what makes a run reproducible: :func:`command_line`, :func:`machine_info` (with
  :func:`idle_wait`: whether the ranks busy-poll or yield).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import mpi4py
import numpy as np
from mpi4py import MPI

import mpitrain as mt
from mpitrain.dtypes import SUPPORTED_DTYPES

from .hooks import Array, Call

DTYPES: dict[str, np.dtype[Any]] = {str(dt): dt for dt in SUPPORTED_DTYPES}
DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+)([KMG]?)B?", re.IGNORECASE)

Key = tuple[str, bool]
"""What a timed call is known by: (implementation or call label, in place)."""


# -- sizes ----------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """Parse a byte count with an optional K, M or G suffix (powers of 1024): ``64M``."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a byte count; write e.g. 8, 1K, 64M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of a byte count: ``64M``, ``1536``, ``3K``."""
    for suffix in ("G", "M", "K"):
        if nbytes >= _UNITS[suffix] and nbytes % _UNITS[suffix] == 0:
            return f"{nbytes // _UNITS[suffix]}{suffix}"
    return str(nbytes)


def size_series(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """``minbytes, minbytes*factor, ...`` up to and including ``maxbytes``."""
    if minbytes < 1 or maxbytes < minbytes or factor < 2:
        raise ValueError(f"need 1 <= minbytes <= maxbytes and stepfactor >= 2, got "
                         f"-b {minbytes} -e {maxbytes} -f {factor}")
    sizes = []
    nbytes = minbytes
    while nbytes <= maxbytes:
        sizes.append(nbytes)
        nbytes *= factor
    return sizes


# -- the command line -----------------------------------------------------------------
class OneRankParser(argparse.ArgumentParser):
    """An argument parser that prints (usage, errors, help) on one rank only.

    With ``quiet`` (every rank but 0) it prints nothing but still exits as argparse
    does: ``-h`` with status 0, a bad argument with status 2. Only argparse's public
    methods are overridden: :meth:`print_usage`, :meth:`print_help` and :meth:`exit`,
    through which ``-h`` and :meth:`~argparse.ArgumentParser.error` print.
    """

    def __init__(self, quiet: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.quiet = quiet

    def print_usage(self, file: Any = None) -> None:
        """Print the usage line, unless quiet."""
        if not self.quiet:
            super().print_usage(file)

    def print_help(self, file: Any = None) -> None:
        """Print the help text, unless quiet."""
        if not self.quiet:
            super().print_help(file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """Exit with ``status``, printing ``message`` to stderr unless quiet."""
        super().exit(status, None if self.quiet else message)


# -- timing and verification ----------------------------------------------------------
MIN_ITERS = 3


def run_order(keys: Sequence[Key], rep: int) -> list[Key]:
    """The order in which repetition ``rep`` runs ``keys``: a permutation drawn from
    ``rep`` alone, so every rank runs the calls in the same order, and over the
    repetitions each call follows each other one about equally often. (Rotating a fixed
    order would put the same call right after the same neighbour in almost every
    repetition, so a neighbour that leaves the machine busy, such as gloo's threads,
    would slow one column only.)"""
    order = list(keys)
    random.Random(rep).shuffle(order)
    return order


def time_calls(calls: dict[Key, Call], iters: int, warmup: int,
               barrier: Callable[[], None], budget: float = 0.0,
               slowest: Callable[[float], float] = float,
               settle: Callable[[], None] = lambda: None) -> dict[Key, list[float]]:
    """Run every call ``warmup`` times, then time ``iters`` interleaved repetitions.

    Each repetition runs every call once, in :func:`run_order`'s order. A reset, a
    ``settle`` (device buffers: wait for the reset's queued copies, which a call that
    synchronizes its stream on entry would otherwise time) and a barrier precede each
    run; only the run is timed. With a ``budget`` (seconds), the
    repetitions are cut to what the last warm-up round says fits in it (at least
    ``MIN_ITERS``); ``slowest`` turns this rank's estimate into every rank's (the
    maximum over ranks), so that every rank runs as many.

    Returns:
        This rank's seconds per run of each call.
    """
    keys = list(calls)
    round_seconds = 0.0
    for _ in range(warmup):
        start = time.perf_counter()
        for key in keys:
            calls[key].reset()
            settle()
            barrier()
            calls[key].run()
        round_seconds = time.perf_counter() - start
    if budget > 0 and warmup:
        per_round = slowest(round_seconds)
        iters = min(iters, max(MIN_ITERS, int(budget / per_round) if per_round else iters))
    times: dict[Key, list[float]] = {key: [] for key in keys}
    for rep in range(iters):
        for key in run_order(keys, rep):
            call = calls[key]
            call.reset()
            settle()
            barrier()
            start = time.perf_counter()
            call.run()
            times[key].append(time.perf_counter() - start)
    return times


def count_wrong(call: Call, expected: Array,
                to_host: Callable[[Any], Array] = np.asarray) -> int:
    """Run ``call`` once from its crafted input; count its elements unequal to ``expected``.

    A result of the wrong shape or dtype counts as wholly wrong. ``to_host`` brings a
    device result back for the comparison.
    """
    call.reset()
    result = to_host(call.run())
    if result.size != expected.size or result.dtype != expected.dtype:
        return int(max(result.size, expected.size))
    return int(np.count_nonzero(result.reshape(-1) != expected))


# -- reproducibility ------------------------------------------------------------------
YIELD_MCA = ("mpi_yield_when_idle", "threads_pthreads_yield_strategy")
"""Open MPI's settings that make waiting ranks yield, shown in :func:`command_line`."""
LAUNCHER_SETS = ("MPITRAIN_RESTART",)
"""Variables that ``mpitrain-run`` sets on every rank itself (not part of a command)."""
YIELD_VALUES = {"mpi_yield_when_idle": "1", "threads_pthreads_yield_strategy": "nanosleep"}
"""The values of :data:`YIELD_MCA` that ``mpitrain-run`` sets when ranks outnumber cores."""


def program_name() -> str:
    """How this benchmark was started: ``mpitrain-bench`` (the installed command), else
    ``python -m`` this package (``benchmarks`` in a clone, ``mpitrain.benchmarks`` where
    a wheel installed it); what its ``--help`` and its command line call it."""
    package = __package__ or "benchmarks"
    return "mpitrain-bench" if Path(sys.argv[0]).name == "mpitrain-bench" \
        else f"python -m {package}"


def bound_to_cores() -> bool:
    """Whether MPI pinned this rank: its CPU set is smaller than its parent's (the MPI
    daemon that started it, which runs unpinned), as plain ``mpirun -np N`` does where
    the ranks fit the cores."""
    try:
        return os.sched_getaffinity(0) < os.sched_getaffinity(os.getppid())
    except (AttributeError, OSError):  # not Linux, or the parent is gone
        return False


def command_line(argv: Sequence[str], nranks: int) -> str:
    """The command that reproduces this run as pasted (as root too), with the MPITRAIN_*
    and MALLOC_* variables it saw (glibc's malloc thresholds change native MPI's
    large-message times).

    ``mpitrain-run -np N python -m benchmarks ...`` where that starts the ranks the same
    way (unpinned, yielding exactly when they outnumber the cores: what mpitrain-run
    does); otherwise ``mpirun`` with what shaped the run: ``--oversubscribe`` where the
    ranks outnumber the cores, ``--bind-to none`` where they were not pinned, Open MPI's
    yield settings where given (:data:`YIELD_MCA`), and, as root, ``--allow-run-as-root``;
    ``--mca osc ^ucx`` only silences the OSC UCX error message of hosts without UCX
    devices.
    """
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith(("MPITRAIN_", "MALLOC_")) and k not in LAUNCHER_SETS]
    yielding = [name for name in YIELD_MCA if f"OMPI_MCA_{name}" in os.environ]
    crowded = nranks > (os.cpu_count() or 1)
    bound = bound_to_cores()
    program = f"-np {nranks} {program_name()} {shlex.join(argv)}".rstrip()
    if not bound and bool(yielding) == crowded and \
            all(os.environ[f"OMPI_MCA_{name}"] == value for name, value in YIELD_VALUES.items()
                if name in yielding):
        return " ".join([*env, "mpitrain-run", program])
    flags = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    if crowded:
        flags.append("--oversubscribe")
    if not bound:
        flags += ["--bind-to", "none"]
    flags += [f"--mca {name} {shlex.quote(os.environ[f'OMPI_MCA_{name}'])}"
              for name in yielding]
    return " ".join([*env, "mpirun", *flags, "--mca osc ^ucx", program])


def idle_wait() -> str:
    """How ranks wait for messages: ``yield`` where Open MPI was told to
    (``--mca mpi_yield_when_idle 1``, which it passes to every rank as
    ``OMPI_MCA_mpi_yield_when_idle``), else ``busy-poll``, MPI's default."""
    yielding = os.environ.get("OMPI_MCA_mpi_yield_when_idle") == "1"  # noqa: SIM112 (its name)
    return "yield" if yielding else "busy-poll"


HUGE_PAGES_VARIABLE = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages under its CPU tensors of 2 MiB and more,
read once, at torch's first allocation."""
SMALL_PAGES_FLAG = "--small-pages"
"""The training benchmark's option to leave torch's allocations on 4 KiB pages."""
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def ask_for_huge_pages(args: Sequence[str]) -> None:
    """Before torch is imported: have it put its large tensors on transparent huge
    pages, unless ``args`` has :data:`SMALL_PAGES_FLAG` or the variable is set. On 4 KiB
    pages, which of several models built one after another trains faster depends on
    where each one's tensors landed (docs/benchmarks.md, "Training steps against torch
    DDP and FSDP": the figures)."""
    if SMALL_PAGES_FLAG not in args:
        os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")


def huge_pages() -> str:
    """How torch's large tensors are paged in this process, for a benchmark's header:
    on ``huge pages`` (asked for, and the kernel allows it) or on ``4 KiB pages``."""
    try:
        with open(THP_MODE_FILE, encoding="utf-8") as f:
            mode = f.read()
    except OSError:
        mode = ""
    if os.environ.get(HUGE_PAGES_VARIABLE, "0") != "1":
        return "4 KiB pages"
    if "[never]" in mode or not mode:
        return "4 KiB pages (transparent huge pages are off in the kernel)"
    return "huge pages"


def machine_info(world: MPI.Intracomm) -> dict[str, Any]:
    """Where the run happened (collective: gathers every rank's host name)."""
    hosts = sorted(set(world.allgather(socket.gethostname())))
    return {
        "mpi_library": MPI.Get_library_version().strip("\0 \n").splitlines()[0].rstrip(", "),
        "mpi_version": "{}.{}".format(*MPI.Get_version()),
        "ranks": world.Get_size(),
        "hosts": hosts,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpitrain": mt.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "idle_wait": idle_wait(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
