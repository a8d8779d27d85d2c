"""Where the time of a device allreduce goes, on one node's GPU:

    mpitrain-run -np 2 python -m benchmarks.device_steps [-s 1M,64M,256M] [-n 20]
        [--algorithm ipc] [--steps] [--profile]

First the primitives a call on device buffers is made of, each the median over ``-n``
iterations (a barrier between iterations, rank 0's clock): MPI's barrier, mpitrain's
barrier, a synchronize of an idle stream, a 1 MiB float32 add with its synchronize in
one process while the others wait, the same add taking turns between the processes
(each turn a switch between CUDA contexts when the ranks share a GPU), all processes
adding at once, and on rank 0 a 256 MiB copy within its own memory, into rank 1's
(mapped with CUDA IPC) and out of rank 1's.

Then per size the float32 sum allreduce with ``--algorithm``, in place and out of
place: the median time *after own work* (each rank refills its buffer on the device,
waits for it and meets the others at a barrier before each call: as in training, the
GPU last ran some rank's own work), the median *back to back* (only a barrier between
calls), the device time of rank 0's call (CUDA events on its stream; the events are
work of every rank's context, so this includes switches between them), with
``--steps`` each rank's time per call in the steps of an ``ipc`` call (inclusive:
a phase includes its synchronize), and with ``--profile`` each rank's functions by
cumulative time over ``-n`` profiled calls (cProfile; it adds its own cost to every
Python call). Every result is checked: rank ``r`` contributes ``r + 1``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI

import mpitrain as mt

from .common import parse_size

KERNEL_BYTES = 1 << 20
COPY_BYTES = 256 << 20
STEPS = ("mpitrain.dispatch.dispatcher:Dispatcher.allreduce_flat",
         "mpitrain.algorithms.ipc:IpcAllreduce.run",
         "mpitrain.comm.ipc:IpcPeers.publish",
         "mpitrain.comm.validation:Validator.exchange",
         "mpitrain.algorithms.ipc:_Reducing.reduce_chunk",
         "mpitrain.backends.cupy_backend:CupyBackend.copy_into",
         "mpitrain.backends.cupy_backend:CupyBackend.synchronize",
         "mpitrain.comm.shm:SharedMemory.agree")
"""The functions ``--steps`` times (module:class.method)."""


class StepClock:
    """Wraps the :data:`STEPS` methods to add up their time while on."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {step: 0.0 for step in STEPS}
        self.calls: dict[str, int] = {step: 0 for step in STEPS}
        for step in STEPS:
            module, qualified = step.split(":")
            owner_name, method = qualified.split(".")
            owner = getattr(importlib.import_module(module), owner_name)
            setattr(owner, method, self._timed(step, getattr(owner, method)))

    def _timed(self, step: str, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return func(*args, **kwargs)
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds[step] += time.perf_counter() - start
                self.calls[step] += 1
        return timed

    def report(self, calls: int) -> str:
        """Microseconds per call of each step (and how often it ran per call), then reset."""
        parts = [f"{step.split(':')[1]} {self.seconds[step] / calls * 1e6:.1f}"
                 f" (x{self.calls[step] / calls:g})" for step in STEPS if self.calls[step]]
        for step in STEPS:
            self.seconds[step], self.calls[step] = 0.0, 0
        return "; ".join(parts)


def median_us(run: Callable[[], None], iters: int, barrier: Callable[[], None]) -> float:
    """Median microseconds of ``run`` over ``iters`` runs, a barrier before each."""
    times = []
    for _ in range(iters + 2):
        barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e6


def primitives(cupy: Any, world: MPI.Intracomm, comm: mt.Communicator,
               iters: int) -> list[tuple[str, float]]:
    """The primitives' medians (rank 0's, microseconds); collective over ``world``."""
    rank, n = world.Get_rank(), world.Get_size()
    stream = cupy.cuda.get_current_stream()
    count = KERNEL_BYTES // 4
    a, b, c = (cupy.full(count, i, cupy.float32) for i in (1, 2, 0))
    nothing = world.Barrier

    def add() -> None:
        cupy.add(a, b, out=c)
        stream.synchronize()

    def add_on(owner: int) -> Callable[[], None]:
        return add if rank == owner else (lambda: None)

    turns: list[float] = []

    def taking_turns() -> None:  # one add per process, one after another
        for q in range(n):
            if q == rank:
                start = time.perf_counter()
                add()
                turns.append(time.perf_counter() - start)
            world.Barrier()

    rows = [("MPI barrier", median_us(world.Barrier, iters, nothing)),
            ("mpitrain barrier", median_us(comm.barrier, iters, nothing)),
            ("idle stream synchronize", median_us(stream.synchronize, iters, nothing)),
            ("1 MiB add + synchronize, one process", median_us(add_on(0), iters, nothing)),
            ("1 MiB add + synchronize, all at once", median_us(add, iters, nothing))]
    median_us(taking_turns, iters, nothing)
    rows.append((f"1 MiB add + synchronize, {n} processes taking turns (each turn)",
                 statistics.median(turns[2:]) * 1e6))
    rows += copies(cupy, world, iters)
    return rows


def copies(cupy: Any, world: MPI.Intracomm, iters: int) -> list[tuple[str, float]]:
    """Rank 0's device time of 256 MiB copies: own to own, into and out of rank 1's
    allocation mapped with CUDA IPC (needs 2 ranks on one node)."""
    if world.Get_size() < 2:
        return []
    rank = world.Get_rank()
    runtime = cupy.cuda.runtime
    mine = cupy.ones(COPY_BYTES, cupy.uint8)
    other = cupy.zeros(COPY_BYTES, cupy.uint8)
    handle = world.bcast(runtime.ipcGetMemHandle(mine.data.ptr) if rank == 1 else None, root=1)
    rows: list[tuple[str, float]] = []
    if rank == 0:
        ptr = runtime.ipcOpenMemHandle(handle)
        memory = cupy.cuda.UnownedMemory(ptr, COPY_BYTES, None, cupy.cuda.Device().id)
        theirs = cupy.ndarray(COPY_BYTES, cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
        for what, dst, src in (("own -> own", other, mine), ("own -> rank 1's", theirs, mine),
                               ("rank 1's -> own", other, theirs)):
            rows.append((f"256 MiB copy {what} (device time)", device_us(
                cupy, lambda dst=dst, src=src: cupy.copyto(dst, src), iters)))
        del theirs, memory
        runtime.ipcCloseMemHandle(ptr)
    world.Barrier()
    return rows


def device_us(cupy: Any, run: Callable[[], None], iters: int) -> float:
    """Median device microseconds of ``run``'s work on the current stream."""
    times = []
    for _ in range(iters + 2):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    return statistics.median(times[2:])


def calls(cupy: Any, world: MPI.Intracomm, comm: mt.Communicator, nbytes: int,
          algorithm: str, iters: int, profile: bool, clock: StepClock | None) -> list[str]:
    """Rank 0's report lines for the allreduce of ``nbytes``; collective over ``world``."""
    rank, n = world.Get_rank(), world.Get_size()
    count = nbytes // 4
    data = cupy.full(count, rank + 1, cupy.float32)
    out = cupy.empty_like(data)
    buf = data.copy()
    device = cupy.cuda.Device()
    want = n * (n + 1) / 2
    variants: dict[str, Callable[[], Any]] = {
        "out of place": lambda: comm.allreduce(data, op="sum", algorithm=algorithm, out=out),
        "in place": lambda: comm.allreduce_(buf, op="sum", algorithm=algorithm)}
    lines = []
    for name, run in variants.items():
        def settled() -> None:
            buf.fill(rank + 1)
            device.synchronize()
            world.Barrier()

        result = run()
        settled()
        wrong = world.allreduce(int((run() != want).sum()), op=MPI.SUM)
        after_work = world.allreduce(median_us(run, iters, settled), op=MPI.MAX)
        settled()
        back_to_back = world.allreduce(median_us(run, iters, world.Barrier), op=MPI.MAX)
        gpu = device_us(cupy, run, iters)
        lines.append(f"{nbytes >> 20:>5} MiB {name:<13} after own work {after_work:>8.1f} us, "
                     f"back to back {back_to_back:>8.1f} us (slowest rank's medians); rank 0's "
                     f"device time {gpu:>8.1f} us; wrong {wrong}")
        if clock is not None:
            for mode, between in (("after own work", settled), ("back to back", world.Barrier)):
                settled()
                clock.on = True
                median_us(run, iters, between)
                clock.on = False
                reports = world.gather(clock.report(iters + 2), root=0) or []
                lines += [f"   steps, {mode}, rank {q}: {text}" for q, text in enumerate(reports)]
        if profile:
            profiler = cProfile.Profile()
            for _ in range(iters):
                settled()
                profiler.enable()
                result = run()
                profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
            for q, report in enumerate(world.gather(text.getvalue(), root=0) or []):
                lines.append(f"-- rank {q}, {nbytes >> 20} MiB {name}, {iters} calls, "
                             "by cumulative time:")
                lines += [line for line in report.splitlines()
                          if line.strip() and "Ordered by" not in line]
        del result
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the primitives and the calls' times (rank 0)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_steps",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("-s", "--sizes", default="1M,64M,256M",
                        help="allreduce sizes in bytes, comma-separated (default %(default)s)")
    parser.add_argument("-n", "--iters", type=int, default=20)
    parser.add_argument("--algorithm", default="ipc")
    parser.add_argument("--profile", action="store_true", help="add cProfile's breakdown")
    parser.add_argument("--steps", action="store_true", help="time the steps of each call")
    opts = parser.parse_args(sys.argv[1:] if argv is None else argv)
    import cupy

    world = MPI.COMM_WORLD.Dup()
    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(node.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    clock = StepClock() if opts.steps else None
    comm = mt.Communicator(MPI.COMM_WORLD)
    lines = [f"# {world.Get_size()} ranks; {comm.device_links(cupy.empty(1, cupy.float32))}"]
    lines += [f"{name:<64} {us:>10.1f} us"
              for name, us in primitives(cupy, world, comm, opts.iters)]
    for size in opts.sizes.split(","):
        lines += calls(cupy, world, comm, parse_size(size), opts.algorithm, opts.iters,
                       opts.profile, clock)
    if rank == 0:
        print("\n".join(lines), flush=True)
    comm.free()
    node.Free()
    world.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
